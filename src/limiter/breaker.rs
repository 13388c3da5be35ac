//! A circuit breaker in front of the store: after a few failures in a row the limiter
//! stops waiting on a dead or stalled store (it fails open in microseconds), a background
//! probe checks it, and the breaker closes as soon as it answers within the budget again.
//! A store that keeps failing right after recovering gets longer back-offs, so a flapping
//! one does not make every request wait.
//!
//! It judges the store, not the gateway ([`Breaker::observe`]): a failure is a store call
//! that did not answer within the store's budget, counted from when it was written and
//! checked against the socket before it is called late (see `store::Budget`), or an
//! error. Time a request waits for its worker, a batch or a call ahead of it is never
//! counted, so a saturated or stalled gateway cannot open it; a request whose call was
//! abandoned by its leader proves nothing either. Any reply is a success. A stalled or
//! dead store still opens it: every call that goes out to it fails.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::configuration::BackOff;
use crate::store::{Store, StoreError};
use crate::tasks::{Policy, Tasks};

/// Failures in a row that open the breaker...
pub const THRESHOLD: u32 = 3;
/// ...if they also span at least this many decision budgets. A single stall of the host
/// (a scheduler hiccup, a stolen CPU) times out every call in flight at once; that is not
/// a store that stopped answering, and opening on it would admit everything for a
/// back-off. A store that is really down keeps failing past two budgets.
const STREAK_BUDGETS: u32 = 2;

pub struct Breaker {
    open: AtomicBool,
    failures: AtomicU32,
    /// When the current streak of failures began (µs on `epoch`).
    streak_start_us: AtomicU64,
    /// How long a streak must last to open the breaker.
    streak_us: u64,
    backoff_ms: AtomicU64,
    backoff: BackOff,
    opened: AtomicU64,
    wake: Notify,
    epoch: Instant,
    closed_at_ms: AtomicU64,
}

impl Breaker {
    /// A breaker for calls bounded by `budget`, backing off by `backoff` while open.
    pub fn new(budget: Duration, backoff: BackOff) -> Breaker {
        Breaker {
            open: AtomicBool::new(false),
            failures: AtomicU32::new(0),
            streak_start_us: AtomicU64::new(0),
            streak_us: (budget * STREAK_BUDGETS).as_micros() as u64,
            backoff_ms: AtomicU64::new(backoff.base.as_millis() as u64),
            backoff,
            opened: AtomicU64::new(0),
            wake: Notify::new(),
            epoch: Instant::now(),
            closed_at_ms: AtomicU64::new(0),
        }
    }

    /// Whether requests should ask the store.
    pub fn is_open(&self) -> bool {
        self.open.load(Relaxed)
    }

    /// How many times the breaker has opened.
    pub fn times_opened(&self) -> u64 {
        self.opened.load(Relaxed)
    }

    /// Counts what a store call's answer says about the store (see the module docs).
    pub fn observe<T>(&self, answer: &Result<T, StoreError>) {
        match answer {
            Ok(_) => self.success(),
            Err(StoreError::Abandoned) => {}
            Err(_) => self.failure(),
        }
    }

    pub fn success(&self) {
        if self.failures.load(Relaxed) != 0 {
            self.failures.store(0, Relaxed);
            self.streak_start_us.store(0, Relaxed);
        }
    }

    /// Counts a failure; opens the breaker once failures in a row reach the threshold and
    /// have lasted two budgets.
    pub fn failure(&self) {
        let n = self.failures.fetch_add(1, Relaxed) + 1;
        let now_us = self.epoch.elapsed().as_micros() as u64 + 1;
        if n == 1 {
            self.streak_start_us.store(now_us, Relaxed);
        }
        let started = match self.streak_start_us.load(Relaxed) {
            0 => now_us,
            s => s,
        };
        let lasted = now_us.saturating_sub(started) >= self.streak_us;
        if n >= THRESHOLD && lasted && !self.open.swap(true, Relaxed) {
            let now = self.epoch.elapsed().as_millis() as u64;
            let closed_at = self.closed_at_ms.load(Relaxed);
            let backoff = if closed_at > 0
                && now.saturating_sub(closed_at) < self.backoff.stable.as_millis() as u64
            {
                (self.backoff_ms.load(Relaxed) * 2).min(self.backoff.max.as_millis() as u64)
            } else {
                self.backoff.base.as_millis() as u64
            };
            self.backoff_ms.store(backoff, Relaxed);
            self.opened.fetch_add(1, Relaxed);
            tracing::warn!(
                failures = n,
                backoff_ms = backoff,
                "store failing: circuit breaker open, failing open without waiting"
            );
            self.wake.notify_one();
        }
    }

    fn close(&self) {
        self.failures.store(0, Relaxed);
        self.streak_start_us.store(0, Relaxed);
        self.closed_at_ms
            .store(self.epoch.elapsed().as_millis().max(1) as u64, Relaxed);
        self.open.store(false, Relaxed);
        tracing::info!("store answers again: circuit breaker closed, limiting resumed");
    }

    /// Starts task `name`, which probes the store while the breaker is open and closes it
    /// when the store answers within `budget`, until the gateway stops. `probe_key`: a
    /// key on the node this breaker guards (Redis Cluster), else a plain `PING`.
    pub fn spawn_prober(
        self: &Arc<Self>,
        tasks: &Tasks,
        name: String,
        store: Store,
        probe_key: Option<String>,
        budget: Duration,
    ) {
        let breaker = Arc::clone(self);
        tasks.spawn(name, Policy::Restart, move |stop| {
            let (breaker, store, probe_key) =
                (Arc::clone(&breaker), store.clone(), probe_key.clone());
            async move {
                let probing = breaker.probe(&store, probe_key.as_deref(), budget);
                stop.run_until_cancelled(probing).await;
            }
        });
    }

    /// Waits for the breaker to open, probes until it closes, and again.
    async fn probe(&self, store: &Store, probe_key: Option<&str>, budget: Duration) {
        loop {
            if !self.is_open() {
                self.wake.notified().await;
                continue;
            }
            tokio::time::sleep(Duration::from_millis(self.backoff_ms.load(Relaxed))).await;
            // The probe takes the path requests take (a connection, a round trip to the
            // right node), within the same budget, so the breaker closes only when
            // requests would succeed.
            if store.lifecycle.probe(probe_key, budget).await.is_ok() {
                self.close();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_stall_that_times_out_every_call_at_once_does_not_open_it() {
        let b = Breaker::new(Duration::from_millis(50), BackOff::default());
        for _ in 0..20 {
            b.failure();
        }
        assert!(
            !b.is_open(),
            "20 failures within microseconds are one stall"
        );
        std::thread::sleep(Duration::from_millis(120));
        b.failure();
        assert!(
            b.is_open(),
            "failures that last past two budgets are a failing store"
        );
    }

    #[test]
    fn it_opens_after_the_threshold_of_failures_in_a_row() {
        let b = Breaker::new(Duration::ZERO, BackOff::default());
        b.failure();
        b.failure();
        b.success();
        b.failure();
        b.failure();
        assert!(!b.is_open());
        b.failure();
        assert!(b.is_open());
        assert_eq!(b.times_opened(), 1);
    }

    #[test]
    fn calls_abandoned_by_their_leader_never_open_it() {
        let b = Breaker::new(Duration::ZERO, BackOff::default());
        for _ in 0..100 {
            b.observe::<()>(&Err(StoreError::Abandoned));
        }
        assert!(!b.is_open());
        assert_eq!(b.failures.load(Relaxed), 0);
    }

    #[test]
    fn calls_that_went_out_and_did_not_answer_open_it() {
        let b = Breaker::new(Duration::ZERO, BackOff::default());
        for _ in 0..THRESHOLD {
            b.observe::<()>(&Err(StoreError::Deadline));
        }
        assert!(
            b.is_open(),
            "a store that does not answer its calls is down"
        );
        let e = Breaker::new(Duration::ZERO, BackOff::default());
        for _ in 0..THRESHOLD {
            e.observe::<()>(&Err(StoreError::Pool("no connection".into())));
        }
        assert!(e.is_open(), "a store that errors is down");
    }

    #[test]
    fn any_reply_ends_a_streak_of_failures() {
        let b = Breaker::new(Duration::ZERO, BackOff::default());
        for _ in 0..THRESHOLD * 10 {
            b.observe::<()>(&Err(StoreError::Deadline));
            b.observe::<()>(&Err(StoreError::Abandoned));
            b.observe(&Ok(()));
        }
        assert!(!b.is_open());
    }

    #[test]
    fn reopening_soon_after_closing_backs_off_longer() {
        let b = Breaker::new(Duration::ZERO, BackOff::default());
        for _ in 0..THRESHOLD {
            b.failure();
        }
        let first = b.backoff_ms.load(Relaxed);
        b.close();
        for _ in 0..THRESHOLD {
            b.failure();
        }
        assert_eq!(b.backoff_ms.load(Relaxed), first * 2);
    }
}
