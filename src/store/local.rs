//! Token buckets in process memory: a sharded map, so concurrent requests for different
//! keys rarely meet on a lock, and no lock is ever held across an await. The embedded
//! store's limits and the coarse safety limit both live here.

use std::collections::HashMap;

use foldhash::fast::RandomState;
use std::hash::{BuildHasher, Hash};
use std::time::Instant;

use hashbrown::HashTable;
use parking_lot::Mutex;

use std::sync::Arc;

use crate::domain::limits::{levels_at, take_many};
use crate::domain::Bucket;
use crate::domain::{bucket, Applied, BucketState, LimitState, Ruling};

const SHARDS: usize = 64;

struct Slot {
    state: BucketState,
    /// Once the clock passes this, the bucket would be full and can be forgotten.
    expires_us: u64,
}

/// How a [`LocalBuckets`] finds a bucket without building its key: `Probe` hashes
/// exactly as the key `K` it stands for does, and builds `K` only for a new bucket.
pub trait Probe<K>: Hash {
    fn is(&self, key: &K) -> bool;
    fn key(&self) -> K;
}

impl<K: Hash + Eq + Clone> Probe<K> for K {
    fn is(&self, key: &K) -> bool {
        self == key
    }
    fn key(&self) -> K {
        self.clone()
    }
}

impl Probe<Box<str>> for str {
    fn is(&self, key: &Box<str>) -> bool {
        self == &**key
    }
    fn key(&self) -> Box<str> {
        self.into()
    }
}

type BucketShard<K> = Mutex<HashTable<(K, Slot)>>;

/// Buckets keyed by `K`, on a monotonic clock.
pub struct LocalBuckets<K> {
    /// One hash per lookup picks the shard (from its middle bits) and the slot in it.
    /// foldhash: keys are the gateway's own (client and service names), and a SipHash per
    /// request on the hot path bought nothing.
    shards: Box<[BucketShard<K>]>,
    hasher: RandomState,
    epoch: Instant,
}

impl<K: Hash> Default for LocalBuckets<K> {
    fn default() -> Self {
        LocalBuckets {
            shards: (0..SHARDS).map(|_| Mutex::new(HashTable::new())).collect(),
            hasher: Default::default(),
            epoch: Instant::now(),
        }
    }
}

impl<K: Hash> LocalBuckets<K> {
    /// Microseconds on this map's monotonic clock.
    pub fn now_us(&self) -> u64 {
        self.us_at(Instant::now())
    }

    /// `at` in microseconds on this map's clock (a moment the caller read already).
    pub fn us_at(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.epoch).as_micros() as u64
    }

    /// The key's hash and its shard. The table indexes by the low bits and tags by the
    /// top seven, so the shard comes from bits in between, independent of both.
    fn shard(&self, key: &(impl Hash + ?Sized)) -> (u64, &BucketShard<K>) {
        let hash = self.hasher.hash_one(key);
        (hash, &self.shards[(hash >> 32) as usize % SHARDS])
    }

    /// Refills and takes `cost` tokens at `now_us`, hashing the key once (the key is built
    /// only for a new bucket); returns the wait until they exist, as `bucket::take` does.
    pub fn take_at(
        &self,
        key: &(impl Probe<K> + ?Sized),
        plan: Bucket,
        cost: f64,
        now_us: u64,
    ) -> Option<u64> {
        let (hash, shard) = self.shard(key);
        let mut shard = shard.lock();
        let expiry =
            |state: BucketState| now_us + bucket::idle_expiry_ms(plan, state.tokens) * 1000;
        match shard.find_mut(hash, |(k, _)| key.is(k)) {
            Some((_, slot)) => {
                let (state, wait_us) =
                    bucket::take_seeded(Some(slot.state), now_us, plan, cost, None);
                *slot = Slot {
                    state,
                    expires_us: expiry(state),
                };
                wait_us
            }
            None => {
                let (state, wait_us) = bucket::take_seeded(None, now_us, plan, cost, None);
                let slot = Slot {
                    state,
                    expires_us: expiry(state),
                };
                let hasher = &self.hasher;
                shard.insert_unique(hash, (key.key(), slot), |(k, _)| hasher.hash_one(k));
                wait_us
            }
        }
    }

    /// Forgets buckets that would be full by now; returns how many remain.
    pub fn evict_idle(&self) -> usize {
        let now = self.now_us();
        self.shards
            .iter()
            .map(|s| {
                let mut s = s.lock();
                s.retain(|(_, slot)| slot.expires_us > now);
                s.len()
            })
            .sum()
    }
}

/// Every client's limit states in process memory (the embedded store), on the system
/// clock in unix microseconds, since quotas follow the calendar. The same arithmetic as
/// `engine/lua/bucket.lua`: see `domain::limits`.
pub struct LocalLimits {
    shards: Box<[LimitShard]>,
    hasher: RandomState,
}

type LimitShard = Mutex<HashMap<Box<str>, Entry, RandomState>>;

struct Entry {
    /// By field prefix, as in the client's Redis hash.
    states: Vec<(Arc<str>, LimitState)>,
    /// Once the clock passes this, every limit would be whole again and can be forgotten.
    expires_us: u64,
}

/// What to do with the levels read.
#[derive(Clone, Copy)]
pub enum LocalOp {
    Take { cost: f64 },
    Adjust { delta: f64 },
    Peek,
}

impl Default for LocalLimits {
    fn default() -> Self {
        LocalLimits {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(HashMap::default()))
                .collect(),
            hasher: Default::default(),
        }
    }
}

impl LocalLimits {
    /// The system clock in unix microseconds.
    pub fn now_us() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64)
    }

    fn shard(&self, key: &str) -> &LimitShard {
        &self.shards[self.hasher.hash_one(key) as usize % SHARDS]
    }

    /// Runs `op` on the limits `applied` of `key`, atomically, at `now_us`.
    pub fn run(&self, key: &str, applied: &[Applied], op: LocalOp, now_us: u64) -> Ruling {
        let mut shard = self.shard(key).lock();
        let states: Vec<Option<LimitState>> = applied
            .iter()
            .map(|a| {
                shard.get(key).and_then(|e| {
                    e.states
                        .iter()
                        .find(|(f, _)| **f == *a.field)
                        .map(|(_, s)| *s)
                })
            })
            .collect();
        let levels = levels_at(applied, &states, now_us);
        let ruling = match op {
            LocalOp::Take { cost } => take_many(applied, levels, cost, 1, now_us)
                .pop()
                .expect("one take"),
            LocalOp::Adjust { delta } => Ruling::adjusted(levels, applied, delta, now_us),
            LocalOp::Peek => return Ruling::levels(levels, now_us),
        };
        let keep_us = applied
            .iter()
            .zip(&ruling.levels)
            .map(|(a, l)| l.keep_ms(&a.kind, now_us) * 1000)
            .max()
            .unwrap_or(0);
        let entry = match shard.get_mut(key) {
            Some(e) => e,
            None => shard.entry(key.into()).or_insert(Entry {
                states: Vec::new(),
                expires_us: 0,
            }),
        };
        entry.expires_us = entry.expires_us.max(now_us + keep_us);
        for (a, l) in applied.iter().zip(&ruling.levels) {
            let state = l.state(now_us);
            match entry.states.iter_mut().find(|(f, _)| **f == *a.field) {
                Some((_, s)) => *s = state,
                None => entry.states.push((Arc::clone(&a.field), state)),
            }
        }
        ruling
    }

    /// The bucket state under `field` of `key`, if any.
    pub fn bucket_state(&self, key: &str, field: &str) -> Option<BucketState> {
        let shard = self.shard(key).lock();
        shard.get(key)?.states.iter().find_map(|(f, s)| match s {
            LimitState::Bucket(b) if **f == *field => Some(*b),
            _ => None,
        })
    }

    /// Forgets the bucket states under `fields` at `key` (quota counts stay).
    pub fn forget(&self, key: &str, fields: &[Arc<str>]) {
        if let Some(e) = self.shard(key).lock().get_mut(key) {
            e.states.retain(|(f, s)| {
                !(matches!(s, LimitState::Bucket(_)) && fields.iter().any(|g| **g == **f))
            });
        }
    }

    /// Forgets clients whose limits would all be whole by now; returns how many remain.
    pub fn evict_idle(&self) -> usize {
        let now = Self::now_us();
        self.shards
            .iter()
            .map(|s| {
                let mut s = s.lock();
                s.retain(|_, e| e.expires_us > now);
                s.len()
            })
            .sum()
    }
}
