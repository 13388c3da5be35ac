//! Requests with a key the catalog does not know (unknown, revoked), counted per client
//! address in this gateway's memory: past a burst, an address is answered `429` instead
//! of `401`, and a valid key from it too, so guessing keys is slow and a flood of them
//! costs no store call. The table is of fixed size (see [`AddrBuckets`]); nothing here
//! allocates after start.

use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use super::addr_buckets::AddrBuckets;
use crate::domain::{bucket, Bucket};
use crate::store::Every;

/// Per address group: `burst` failed keys, then `per_minute` more.
pub struct FailedKeys {
    table: AddrBuckets,
    allowance: Bucket,
    /// Set while some address may be held back: until then, a valid key's request reads
    /// this one flag and nothing else.
    active: AtomicBool,
    /// When the last address held back has its next failed key again (table clock, µs).
    held_until_us: AtomicU64,
    /// When an address held back may be logged again.
    log: Every,
}

/// An address held back is logged at most this often.
const LOG_EVERY: Duration = Duration::from_secs(10);

impl FailedKeys {
    /// `None` when `sets` is 0 (turned off) or the allowance is not a bucket.
    pub fn new(sets: usize, burst: u32, per_minute: f64) -> Option<FailedKeys> {
        let allowance = Bucket::new(f64::from(burst), per_minute / 60.0).ok()?;
        (sets > 0).then(|| FailedKeys {
            table: AddrBuckets::new(sets),
            allowance,
            active: AtomicBool::new(false),
            held_until_us: AtomicU64::new(0),
            log: Every::new(LOG_EVERY),
        })
    }

    /// The table's size in bytes (fixed at start).
    pub fn bytes(&self) -> usize {
        self.table.bytes()
    }

    /// Counts a failed key from `group` (an address group, see
    /// [`crate::domain::address_group`]) at `now`: `None` while within its allowance (answer
    /// `401`), else the wait until it has one again (answer `429`; this one is not counted).
    /// The failed key that spends the allowance holds the address back from then on.
    pub fn note(&self, group: (IpAddr, u8), now: Instant) -> Option<u64> {
        let now_us = self.table.us_at(now);
        let refused = self.table.take_at(&group, self.allowance, 1.0, now_us);
        let wait = match refused {
            bucket::TAKEN => self.table.wait_at(&group, self.allowance, 1.0, now_us),
            wait => wait,
        };
        if let Some(wait) = wait.filter(|w| *w > 0) {
            self.held_until_us.fetch_max(now_us + wait, Relaxed);
            self.active.store(true, Relaxed);
        }
        let refused = refused.filter(|w| *w > 0);
        if refused.is_some() && self.log.due() {
            // The one way to hold back every client at once: a proxy not in
            // `server.trusted_proxies`, whose clients all come from its address.
            tracing::warn!(
                address = %group.0,
                prefix = group.1,
                "an address sent more unknown API keys than its allowance and is held back, with its valid keys (429); if it is a proxy or load balancer, add it to server.trusted_proxies (logged at most every {} s)",
                LOG_EVERY.as_secs()
            );
        }
        refused
    }

    /// Whether a request from `group` with a valid key is held back now: the wait until
    /// its address may send a failed key again. One relaxed load (no clock, no address)
    /// while no address is held back.
    #[inline]
    pub fn held(&self, group: impl FnOnce() -> (IpAddr, u8)) -> Option<u64> {
        self.held_at(group, Instant::now)
    }

    #[inline]
    fn held_at(
        &self,
        group: impl FnOnce() -> (IpAddr, u8),
        now: impl FnOnce() -> Instant,
    ) -> Option<u64> {
        if !self.active.load(Relaxed) {
            return None;
        }
        self.held_slow(group(), now())
    }

    #[cold]
    fn held_slow(&self, group: (IpAddr, u8), now: Instant) -> Option<u64> {
        let now_us = self.table.us_at(now);
        if now_us >= self.held_until_us.load(Relaxed) {
            self.active.store(false, Relaxed);
            // A note racing this store set `held_until_us` past now: keep looking.
            if now_us < self.held_until_us.load(Relaxed) {
                self.active.store(true, Relaxed);
            } else {
                return None;
            }
        }
        match self.table.wait_at(&group, self.allowance, 1.0, now_us) {
            bucket::TAKEN => None,
            wait => wait,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn group(last: u8) -> (IpAddr, u8) {
        (IpAddr::from([203, 0, 113, last]), 32)
    }

    #[test]
    fn an_address_gets_its_burst_of_401s_then_429s_and_others_are_untouched() {
        let f = FailedKeys::new(64, 3, 6.0).unwrap();
        let t0 = Instant::now();
        let notes: Vec<Option<u64>> = (0..5).map(|_| f.note(group(1), t0)).collect();
        assert_eq!(notes[..3], [None, None, None]);
        // One more every 10 s.
        assert_eq!(notes[3], Some(10_000_000));
        assert_eq!(notes[4], Some(10_000_000));
        assert_eq!(f.note(group(2), t0), None);
        assert_eq!(f.held_at(|| group(1), || t0), Some(10_000_000));
        assert_eq!(f.held_at(|| group(2), || t0), None);
        let later = t0 + Duration::from_secs(10);
        assert_eq!(f.held_at(|| group(1), || later), None);
        assert_eq!(f.note(group(1), later), None);
        assert_eq!(f.note(group(1), later), Some(10_000_000));
    }

    #[test]
    fn no_address_is_read_while_none_is_held_back() {
        let f = FailedKeys::new(64, 3, 6.0).unwrap();
        let t0 = Instant::now();
        assert_eq!(
            f.held_at(|| unreachable!("no address is held back"), || t0),
            None
        );
        for _ in 0..4 {
            f.note(group(1), t0);
        }
        assert!(f.held_at(|| group(1), || t0).is_some());
        // Once the last one held back may send again, the flag is down again.
        let later = t0 + Duration::from_secs(11);
        assert_eq!(f.held_at(|| group(1), || later), None);
        assert_eq!(
            f.held_at(|| unreachable!("the flag is down"), || later),
            None
        );
    }

    #[test]
    fn it_is_off_with_no_sets() {
        assert!(FailedKeys::new(0, 3, 6.0).is_none());
    }
}
