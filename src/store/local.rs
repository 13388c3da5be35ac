//! Token buckets in process memory: a sharded map, so concurrent requests for different
//! keys rarely meet on a lock, and no lock is ever held across an await. The embedded
//! store's buckets and the coarse safety limit both live here.

use std::borrow::Borrow;
use std::collections::HashMap;

use foldhash::fast::RandomState;
use std::hash::{BuildHasher, Hash};
use std::time::Instant;

use parking_lot::Mutex;

use crate::domain::Plan;
use crate::domain::{bucket, BucketState, Verdict};

const SHARDS: usize = 64;

struct Slot {
    state: BucketState,
    /// Once the clock passes this, the bucket would be full and can be forgotten.
    expires_us: u64,
}

/// Buckets keyed by `K`, on a monotonic clock.
pub struct LocalBuckets<K> {
    /// foldhash: keys are the gateway's own (client and service names), and a SipHash per
    /// request on the hot path bought nothing.
    shards: Box<[Mutex<HashMap<K, Slot, RandomState>>]>,
    hasher: RandomState,
    epoch: Instant,
}

impl<K: Hash + Eq> Default for LocalBuckets<K> {
    fn default() -> Self {
        LocalBuckets {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(HashMap::default()))
                .collect(),
            hasher: Default::default(),
            epoch: Instant::now(),
        }
    }
}

impl<K: Hash + Eq> LocalBuckets<K> {
    /// Microseconds on this map's monotonic clock.
    pub fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    fn shard<Q: Hash + ?Sized>(&self, key: &Q) -> &Mutex<HashMap<K, Slot, RandomState>> {
        &self.shards[self.hasher.hash_one(key) as usize % SHARDS]
    }

    /// Refills and takes `cost` tokens at `now_us`; the key is copied only for a new bucket.
    pub fn take_at<Q>(&self, key: &Q, plan: Plan, cost: f64, now_us: u64) -> Verdict
    where
        K: Borrow<Q> + for<'a> From<&'a Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.take_seeded(key, plan, cost, now_us, None)
    }

    /// [`LocalBuckets::take_at`]; a new bucket starts with `initial` tokens, if given.
    pub fn take_seeded<Q>(
        &self,
        key: &Q,
        plan: Plan,
        cost: f64,
        now_us: u64,
        initial: Option<f64>,
    ) -> Verdict
    where
        K: Borrow<Q> + for<'a> From<&'a Q>,
        Q: Hash + Eq + ?Sized,
    {
        let mut shard = self.shard(key).lock();
        let prev = shard.get(key).map(|s| s.state);
        let (state, verdict) = bucket::take_seeded(prev, now_us, plan, cost, initial);
        let slot = Slot {
            state,
            expires_us: now_us + bucket::idle_expiry_ms(plan, state.tokens) * 1000,
        };
        match shard.get_mut(key) {
            Some(s) => *s = slot,
            None => {
                shard.insert(K::from(key), slot);
            }
        }
        verdict
    }

    pub fn peek<Q>(&self, key: &Q) -> Option<BucketState>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.shard(key).lock().get(key).map(|s| s.state)
    }

    pub fn remove<Q>(&self, key: &Q)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.shard(key).lock().remove(key);
    }

    /// Forgets buckets that would be full by now; returns how many remain.
    pub fn evict_idle(&self) -> usize {
        let now = self.now_us();
        self.shards
            .iter()
            .map(|s| {
                let mut s = s.lock();
                s.retain(|_, slot| slot.expires_us > now);
                s.len()
            })
            .sum()
    }
}
