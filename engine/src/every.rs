//! A gate that lets one caller through at most once per period, whatever the number of
//! threads asking: the store's occasional work on the request path (a sweep asked of
//! Redis, the cluster's slot map read again, a failed call said in the log) costs the
//! other callers one atomic load.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

pub struct Every {
    period_ms: u64,
    epoch: Instant,
    /// Milliseconds since `epoch` plus one period when the gate last opened; 0: never,
    /// so the first call opens it.
    opened_ms: AtomicU64,
}

impl Every {
    pub fn new(period: Duration) -> Every {
        Every {
            period_ms: period.as_millis() as u64,
            epoch: Instant::now(),
            opened_ms: AtomicU64::new(0),
        }
    }

    /// Whether this caller is the one let through: the first call, then the first one a
    /// period or more after the last that was.
    pub fn due(&self) -> bool {
        let now = self.epoch.elapsed().as_millis() as u64 + self.period_ms;
        let last = self.opened_ms.load(Relaxed);
        now >= last + self.period_ms
            && self
                .opened_ms
                .compare_exchange(last, now, Relaxed, Relaxed)
                .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_call_opens_it_then_once_per_period_one_caller_among_threads() {
        let gate = Every::new(Duration::from_millis(200));
        assert!(gate.due(), "the first call");
        assert!(!gate.due(), "within the period");
        std::thread::sleep(Duration::from_millis(220));
        let opened: usize = std::thread::scope(|s| {
            let racers: Vec<_> = (0..8).map(|_| s.spawn(|| gate.due())).collect();
            racers
                .into_iter()
                .map(|r| usize::from(r.join().unwrap()))
                .sum()
        });
        assert_eq!(opened, 1, "one of the racers after the period");
    }
}
