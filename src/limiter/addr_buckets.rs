//! Token buckets for client addresses, in a table of fixed size allocated once: however
//! many addresses a botnet sends from, the table never grows and never allocates. It is
//! set-associative (a few ways per set); an address new to a full set takes the place of
//! the way that will be full again soonest, so what is forgotten is what holds the least
//! (a full bucket and a forgotten one are the same) and the addresses being held back are
//! forgotten last.
//!
//! The sets are found with a hash keyed at start (SipHash), so a client cannot choose
//! addresses that meet in one set.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hash};
use std::time::Instant;

use parking_lot::Mutex;

use crate::domain::{bucket, Bucket, BucketState};

/// Ways per set.
const WAYS: usize = 4;

#[derive(Clone, Copy)]
struct Slot {
    /// The key's hash (never 0); 0 is an empty way.
    tag: u64,
    state: BucketState,
    /// When the bucket will be full again, on the table's clock: from then on the way is
    /// as good as empty.
    full_at_us: u64,
}

impl Default for Slot {
    fn default() -> Slot {
        Slot {
            tag: 0,
            state: BucketState {
                tokens: 0.0,
                ts_us: 0,
            },
            full_at_us: 0,
        }
    }
}

/// Buckets for keys that are not the gateway's own (addresses), in `sets × 4` ways.
pub struct AddrBuckets {
    sets: Box<[Mutex<[Slot; WAYS]>]>,
    hasher: RandomState,
    epoch: Instant,
}

impl AddrBuckets {
    /// A table of `sets` sets (at least 1), allocated now.
    pub fn new(sets: usize) -> AddrBuckets {
        AddrBuckets {
            sets: (0..sets.max(1))
                .map(|_| Mutex::new([Slot::default(); WAYS]))
                .collect(),
            hasher: RandomState::new(),
            epoch: Instant::now(),
        }
    }

    /// The table's size in bytes: fixed at [`AddrBuckets::new`].
    pub fn bytes(&self) -> usize {
        std::mem::size_of_val(&*self.sets)
    }

    /// `at` in microseconds on the table's clock.
    pub fn us_at(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.epoch).as_micros() as u64
    }

    /// Refills `key`'s bucket of `plan` to `now_us` and takes `cost` from it; returns the
    /// wait until it holds the cost (`bucket::TAKEN`: it did), as `bucket::take` does. A key
    /// not in the table starts full.
    pub fn take_at(&self, key: &impl Hash, plan: Bucket, cost: f64, now_us: u64) -> Option<u64> {
        let tag = self.hasher.hash_one(key) | 1;
        let set = &self.sets[(tag >> 32) as usize % self.sets.len()];
        let mut ways = set.lock();
        let way = match ways.iter().position(|s| s.tag == tag) {
            Some(i) => i,
            None => {
                let i = victim(&ways);
                ways[i] = Slot {
                    tag,
                    ..Slot::default()
                };
                i
            }
        };
        let slot = &mut ways[way];
        let known = (slot.full_at_us > now_us).then_some(slot.state);
        let (state, wait_us) = bucket::take(known, now_us, plan, cost);
        slot.state = state;
        let missing_us = (plan.capacity() - state.tokens).max(0.0) / plan.rate() * 1e6;
        slot.full_at_us = now_us.saturating_add(missing_us.ceil() as u64);
        wait_us
    }
}

impl AddrBuckets {
    /// How long until `key`'s bucket of `plan` holds `cost` at `now_us`, without taking
    /// anything (`bucket::TAKEN`: it does now). A key not in the table is full.
    pub fn wait_at(&self, key: &impl Hash, plan: Bucket, cost: f64, now_us: u64) -> Option<u64> {
        let tag = self.hasher.hash_one(key) | 1;
        let set = &self.sets[(tag >> 32) as usize % self.sets.len()];
        let ways = set.lock();
        let known = ways
            .iter()
            .find(|s| s.tag == tag && s.full_at_us > now_us)
            .map(|s| s.state);
        let mut tokens = bucket::refill(known, now_us, plan, None);
        bucket::take_from(&mut tokens, plan, cost)
    }
}

/// The way a new key takes: the one full again soonest (an empty way has been "full" since
/// the start).
fn victim(ways: &[Slot; WAYS]) -> usize {
    (0..WAYS).min_by_key(|&i| ways[i].full_at_us).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> Bucket {
        Bucket::new(2.0, 1.0).unwrap()
    }

    #[test]
    fn a_key_takes_its_burst_then_waits_for_its_rate() {
        let t = AddrBuckets::new(16);
        assert_eq!(t.take_at(&"a", plan(), 1.0, 0), bucket::TAKEN);
        assert_eq!(t.take_at(&"a", plan(), 1.0, 0), bucket::TAKEN);
        assert_eq!(t.take_at(&"a", plan(), 1.0, 0), Some(1_000_000));
        assert_eq!(t.take_at(&"a", plan(), 1.0, 500_000), Some(500_000));
        assert_eq!(t.take_at(&"a", plan(), 1.0, 1_000_000), bucket::TAKEN);
        // Another key is untouched.
        assert_eq!(t.take_at(&"b", plan(), 1.0, 0), bucket::TAKEN);
    }

    #[test]
    fn a_wait_is_read_without_taking() {
        let t = AddrBuckets::new(16);
        assert_eq!(t.wait_at(&"a", plan(), 1.0, 0), bucket::TAKEN);
        t.take_at(&"a", plan(), 2.0, 0);
        assert_eq!(t.wait_at(&"a", plan(), 1.0, 250_000), Some(750_000));
        assert_eq!(t.wait_at(&"a", plan(), 1.0, 250_000), Some(750_000));
        assert_eq!(t.wait_at(&"a", plan(), 1.0, 1_000_000), bucket::TAKEN);
    }

    #[test]
    fn its_size_is_fixed_whatever_it_is_sent() {
        let t = AddrBuckets::new(1024);
        let before = t.bytes();
        // 136 bytes a set, as the README says.
        assert_eq!(std::mem::size_of::<Mutex<[Slot; WAYS]>>(), 136);
        assert_eq!(before, 1024 * 136);
        for i in 0..1_000_000u32 {
            t.take_at(&i, plan(), 1.0, u64::from(i));
        }
        assert_eq!(t.bytes(), before);
    }

    #[test]
    fn a_key_held_back_outlives_a_flood_of_others() {
        // One set: every key meets the held-back one.
        let t = AddrBuckets::new(1);
        for _ in 0..3 {
            t.take_at(&"held", plan(), 1.0, 0);
        }
        for i in 0..10_000u32 {
            // Each of these takes one of two tokens: never the emptiest way.
            t.take_at(&i, plan(), 1.0, 1);
        }
        assert!(t.take_at(&"held", plan(), 1.0, 2).is_some_and(|w| w > 0));
    }

    #[test]
    fn the_way_full_again_soonest_is_forgotten_and_starts_full() {
        // `a` took both tokens (full again in 2 s), the others one (in 1 s): the fourth
        // other pushes out one of them, not `a`.
        let t = AddrBuckets::new(1);
        t.take_at(&"a", plan(), 2.0, 0);
        for i in 0..4u32 {
            t.take_at(&i, plan(), 1.0, 0);
        }
        assert_eq!(t.take_at(&"a", plan(), 2.0, 0), Some(2_000_000));
        // Now `b` took one token, the others both: `b` is pushed out and starts full.
        let t = AddrBuckets::new(1);
        t.take_at(&"b", plan(), 1.0, 0);
        for i in 0..4u32 {
            t.take_at(&i, plan(), 2.0, 0);
        }
        assert_eq!(t.take_at(&"b", plan(), 2.0, 0), bucket::TAKEN);
    }
}
