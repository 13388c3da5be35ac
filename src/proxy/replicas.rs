//! A route's replicas: which may take traffic (passive health: outlier ejection; active
//! health checks), how busy each is, and which one a try goes to.
//!
//! The state is shared by every worker (atomics, no lock): a replica one worker saw fail is
//! set aside for all. Like Envoy's outlier detection, a replica that fails `eject_after`
//! times in a row is ejected for `ejection`, once more each time it is ejected again soon
//! after coming back (up to `max_ejection`), and returns on its own. A route never runs out
//! of replicas: when every replica is ejected or failing its checks, requests spread over
//! all of them (Envoy's panic mode), and the retries find the live ones.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::configuration::{Balance, UpstreamSettings};
use crate::domain::Upstream;

/// Milliseconds since the first call in this process: the clock ejections are kept in.
pub fn now_ms() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    // Never 0: 0 means "not ejected".
    EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64 + 1
}

/// What a try's outcome says about the replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TryResult {
    /// It answered (any status but 502, 503, 504).
    Answered,
    /// It failed: refused, reset, timed out, or answered 502, 503 or 504.
    Failed,
}

/// One replica and what the gateway knows of it.
#[derive(Debug)]
pub struct Replica {
    pub upstream: Upstream,
    /// Requests in flight to it, from every worker (until the response head).
    in_flight: AtomicU32,
    /// Failures in a row.
    failures: AtomicU32,
    /// Until when it is ejected ([`now_ms`]); 0: never ejected.
    ejected_until: AtomicU64,
    /// The multiplier of its last ejection's length.
    streak: AtomicU32,
    /// Times ejected (the metric's counter).
    ejections: AtomicU64,
    /// Tries whose TLS handshake failed (the metric's counter).
    tls_failures: AtomicU64,
    /// The active checks' result (true without checks).
    checks_pass: AtomicBool,
}

impl Replica {
    pub fn new(upstream: Upstream) -> Replica {
        Replica {
            upstream,
            in_flight: AtomicU32::new(0),
            failures: AtomicU32::new(0),
            ejected_until: AtomicU64::new(0),
            streak: AtomicU32::new(0),
            ejections: AtomicU64::new(0),
            tls_failures: AtomicU64::new(0),
            checks_pass: AtomicBool::new(true),
        }
    }

    /// Neither ejected nor failing its checks at `now`.
    pub fn available(&self, now: u64) -> bool {
        self.ejected_until.load(Relaxed) <= now && self.checks_pass.load(Relaxed)
    }

    /// Whether it is ejected at `now`.
    pub fn ejected(&self, now: u64) -> bool {
        self.ejected_until.load(Relaxed) > now
    }

    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Relaxed)
    }

    pub fn ejections(&self) -> u64 {
        self.ejections.load(Relaxed)
    }

    pub fn tls_failures(&self) -> u64 {
        self.tls_failures.load(Relaxed)
    }

    /// Counts a try whose TLS handshake with it failed.
    pub fn count_tls_failure(&self) {
        self.tls_failures.fetch_add(1, Relaxed);
    }

    pub fn checks_pass(&self) -> bool {
        self.checks_pass.load(Relaxed)
    }

    /// Sets the active checks' result; true when it changed.
    pub fn set_checks_pass(&self, pass: bool) -> bool {
        self.checks_pass.swap(pass, Relaxed) != pass
    }

    /// Counts a request in flight to it until the guard drops.
    pub fn start(&self) -> InFlight<'_> {
        self.in_flight.fetch_add(1, Relaxed);
        InFlight(&self.in_flight)
    }

    /// Records a try's outcome; `Some(length)` when this failure ejected it.
    pub fn record(&self, result: TryResult, s: &UpstreamSettings, now: u64) -> Option<Duration> {
        match result {
            TryResult::Answered => {
                // A load before the store: the healthy path writes nothing shared.
                if self.failures.load(Relaxed) != 0 {
                    self.failures.store(0, Relaxed);
                }
                // An ejected replica that answered (a try sent to it with every replica
                // out) is back now, not when its ejection ends: a replica restarted in a
                // rolling restart takes traffic again at its first answer.
                if self.ejected(now) {
                    self.ejected_until.store(now, Relaxed);
                }
                None
            }
            TryResult::Failed => {
                let failures = self.failures.fetch_add(1, Relaxed) + 1;
                if s.eject_after == 0 || failures < s.eject_after || self.ejected(now) {
                    return None;
                }
                self.failures.store(0, Relaxed);
                Some(self.eject(s, now))
            }
        }
    }

    /// Ejects it from `now`: for `ejection`, times one more than last time if it came back
    /// from its last ejection less than `max_ejection` ago, up to `max_ejection`.
    fn eject(&self, s: &UpstreamSettings, now: u64) -> Duration {
        let back_at = self.ejected_until.load(Relaxed);
        let recent =
            back_at != 0 && now.saturating_sub(back_at) < s.max_ejection.as_millis() as u64;
        let streak = if recent {
            self.streak.load(Relaxed).saturating_add(1)
        } else {
            1
        };
        self.streak.store(streak, Relaxed);
        let length = s.ejection.saturating_mul(streak).min(s.max_ejection);
        self.ejected_until
            .store(now + length.as_millis() as u64, Relaxed);
        self.ejections.fetch_add(1, Relaxed);
        length
    }
}

/// A request in flight to a replica (see [`Replica::start`]).
pub struct InFlight<'a>(&'a AtomicU32);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

/// A route's replicas and how one is picked.
#[derive(Debug)]
pub struct Replicas {
    all: Vec<Arc<Replica>>,
    balance: Balance,
    next: AtomicUsize,
}

impl Replicas {
    pub fn new(all: Vec<Arc<Replica>>, balance: Balance) -> Replicas {
        Replicas {
            all,
            balance,
            next: AtomicUsize::new(0),
        }
    }

    pub fn all(&self) -> &[Arc<Replica>] {
        &self.all
    }

    /// The replica for a try: one not `tried` yet that is available; when none is, one not
    /// tried (every replica out: spread over all); when all were tried, any available one.
    /// `None` only for a route without replicas, which parsed settings never have.
    pub fn pick(&self, tried: &[usize], now: u64) -> Option<usize> {
        let fresh = |i: usize| !tried.contains(&i);
        let available = |i: usize| self.all[i].available(now);
        self.choose(|i| fresh(i) && available(i))
            .or_else(|| self.choose(fresh))
            .or_else(|| self.choose(available))
            .or_else(|| self.choose(|_| true))
    }

    pub fn get(&self, i: usize) -> &Arc<Replica> {
        &self.all[i]
    }

    /// One of the replicas `ok` accepts, by the route's balance.
    fn choose(&self, ok: impl Fn(usize) -> bool) -> Option<usize> {
        let n = self.all.len();
        if n == 0 {
            return None;
        }
        match self.balance {
            Balance::RoundRobin => {
                let start = self.next.fetch_add(1, Relaxed);
                let found = (0..n).map(|k| (start + k) % n).find(|&i| ok(i));
                if found.is_none() {
                    // Not a turn: `pick` asks again, and two replicas would not alternate.
                    self.next.fetch_sub(1, Relaxed);
                }
                found
            }
            Balance::LeastRequest => {
                // Two distinct candidates at random (power of two choices); the one with
                // fewer requests in flight, the first on a tie.
                let r = rand::random::<u64>();
                let a = (r % n as u64) as usize;
                let b = if n > 1 {
                    (a + 1 + ((r >> 32) % (n as u64 - 1)) as usize) % n
                } else {
                    a
                };
                match (ok(a), ok(b)) {
                    (true, true) => Some(if self.all[b].in_flight() < self.all[a].in_flight() {
                        b
                    } else {
                        a
                    }),
                    (true, false) => Some(a),
                    (false, true) => Some(b),
                    // Neither: the least busy of those that are.
                    (false, false) => (0..n)
                        .filter(|&i| ok(i))
                        .min_by_key(|&i| (self.all[i].in_flight(), (i + n - a) % n)),
                }
            }
        }
    }
}

/// A route's retries in flight, bounded by its requests in flight (Envoy's retry budget):
/// at most `retry_budget_percent` of them, or `retry_min_concurrency`, whichever is more.
#[derive(Debug, Default)]
pub struct RetryBudget {
    requests: AtomicU32,
    retries: AtomicU32,
    /// Retries made and refused by the budget (the metrics' counters).
    retried: AtomicU64,
    refused: AtomicU64,
}

impl RetryBudget {
    /// Counts a request in flight until the guard drops.
    pub fn request(&self) -> InFlight<'_> {
        self.requests.fetch_add(1, Relaxed);
        InFlight(&self.requests)
    }

    /// Room for one more retry now, held until the guard drops; `None` (and counted as
    /// refused) when the budget is spent.
    pub fn retry(&self, s: &UpstreamSettings) -> Option<InFlight<'_>> {
        let requests = u64::from(self.requests.load(Relaxed));
        let allowed = (requests * u64::from(s.retry_budget_percent) / 100)
            .max(u64::from(s.retry_min_concurrency));
        let before = u64::from(self.retries.fetch_add(1, Relaxed));
        if before >= allowed {
            self.retries.fetch_sub(1, Relaxed);
            self.refused.fetch_add(1, Relaxed);
            return None;
        }
        self.retried.fetch_add(1, Relaxed);
        Some(InFlight(&self.retries))
    }

    /// Counts a retry the budget does not bound (see the forwarder).
    pub fn count_free(&self) {
        self.retried.fetch_add(1, Relaxed);
    }

    pub fn retried(&self) -> u64 {
        self.retried.load(Relaxed)
    }

    pub fn refused(&self) -> u64 {
        self.refused.load(Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> UpstreamSettings {
        UpstreamSettings {
            connect_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(4),
            eject_after: 3,
            ejection: Duration::from_millis(100),
            max_ejection: Duration::from_millis(250),
            max_tries: 3,
            retry_budget_percent: 20,
            retry_min_concurrency: 2,
            replay_body_bytes: 1024,
            body_timeout: Duration::from_secs(1),
            trust: crate::configuration::TrustRoots {
                file: None,
                configured: false,
                store: Arc::new(rustls::RootCertStore::empty()),
            },
            websocket_idle_timeout: Duration::from_secs(60),
        }
    }

    fn replicas(n: usize, balance: Balance) -> Replicas {
        Replicas::new(
            (0..n)
                .map(|i| {
                    Arc::new(Replica::new(
                        Upstream::parse(&format!("http://127.0.0.1:{}", 9000 + i)).unwrap(),
                    ))
                })
                .collect(),
            balance,
        )
    }

    #[test]
    fn failures_in_a_row_eject_and_an_answer_between_them_forgives() {
        let (r, s) = (
            Replica::new(Upstream::parse("http://a").unwrap()),
            settings(),
        );
        assert_eq!(r.record(TryResult::Failed, &s, 1000), None);
        assert_eq!(r.record(TryResult::Failed, &s, 1000), None);
        assert_eq!(r.record(TryResult::Answered, &s, 1000), None);
        assert_eq!(r.record(TryResult::Failed, &s, 1000), None);
        assert_eq!(r.record(TryResult::Failed, &s, 1000), None);
        assert!(r.available(1000));
        assert_eq!(
            r.record(TryResult::Failed, &s, 1000),
            Some(Duration::from_millis(100))
        );
        assert!(!r.available(1000) && !r.available(1099) && r.available(1100));
        assert_eq!(r.ejections(), 1);
    }

    #[test]
    fn an_ejected_replica_that_answers_is_back_at_once() {
        let (r, s) = (
            Replica::new(Upstream::parse("http://a").unwrap()),
            settings(),
        );
        while r.record(TryResult::Failed, &s, 1000).is_none() {}
        assert!(!r.available(1010));
        r.record(TryResult::Answered, &s, 1010);
        assert!(r.available(1010));
        // It came back at 1010: ejected again soon, twice as long.
        assert_eq!(
            (0..3).find_map(|_| r.record(TryResult::Failed, &s, 1020)),
            Some(Duration::from_millis(200))
        );
    }

    #[test]
    fn an_ejection_soon_after_the_last_lasts_longer_up_to_the_most() {
        let (r, s) = (
            Replica::new(Upstream::parse("http://a").unwrap()),
            settings(),
        );
        let eject = |now| {
            (0..3)
                .filter_map(|_| r.record(TryResult::Failed, &s, now))
                .next()
        };
        assert_eq!(eject(1000), Some(Duration::from_millis(100)));
        // Back at 1100; ejected again soon: twice as long, then capped.
        assert_eq!(eject(1150), Some(Duration::from_millis(200)));
        assert_eq!(eject(1400), Some(Duration::from_millis(250)));
        // Long after coming back (1650 + 250 and more): the first length again.
        assert_eq!(eject(5000), Some(Duration::from_millis(100)));
    }

    #[test]
    fn eject_after_zero_never_ejects() {
        let s = UpstreamSettings {
            eject_after: 0,
            ..settings()
        };
        let r = Replica::new(Upstream::parse("http://a").unwrap());
        assert!((0..100).all(|_| r.record(TryResult::Failed, &s, 1).is_none()));
        assert!(r.available(1));
    }

    #[test]
    fn picks_skip_ejected_and_tried_replicas_and_never_run_out() {
        for balance in [Balance::RoundRobin, Balance::LeastRequest] {
            let rs = replicas(3, balance);
            let s = settings();
            while rs.get(1).record(TryResult::Failed, &s, 10).is_none() {}
            for _ in 0..50 {
                let i = rs.pick(&[], 10).unwrap();
                assert_ne!(i, 1, "{balance:?}");
                assert_eq!(rs.pick(&[i], 10), Some(3 - i - 1), "{balance:?}");
            }
            // Every available one tried: the ejected one (it may be back).
            assert_eq!(rs.pick(&[0, 2], 10), Some(1));
            // All ejected: spread over all.
            for i in [0, 2] {
                while rs.get(i).record(TryResult::Failed, &s, 10).is_none() {}
            }
            let mut seen = [0; 3];
            for _ in 0..300 {
                seen[rs.pick(&[], 10).unwrap()] += 1;
            }
            assert!(seen.iter().all(|&n| n > 0), "{balance:?}: {seen:?}");
        }
    }

    #[test]
    fn a_replica_failing_its_checks_gets_nothing_while_others_can() {
        let rs = replicas(2, Balance::RoundRobin);
        assert!(rs.get(0).set_checks_pass(false));
        assert!((0..10).all(|_| rs.pick(&[], 1) == Some(1)));
        assert!(rs.get(0).set_checks_pass(true));
    }

    #[test]
    fn round_robin_takes_turns() {
        let rs = replicas(3, Balance::RoundRobin);
        let picks: Vec<_> = (0..6).map(|_| rs.pick(&[], 1).unwrap()).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn least_request_keeps_traffic_off_a_busy_replica() {
        let rs = replicas(3, Balance::LeastRequest);
        let _busy = rs.get(2).start();
        assert!((0..200).all(|_| rs.pick(&[], 1) != Some(2)));
        // Spread over the idle two.
        let zeros = (0..200).filter(|_| rs.pick(&[], 1) == Some(0)).count();
        assert!((40..160).contains(&zeros), "{zeros}");
    }

    #[test]
    fn the_retry_budget_is_a_share_of_requests_in_flight_with_a_floor() {
        let (b, s) = (RetryBudget::default(), settings());
        let requests: Vec<_> = (0..20).map(|_| b.request()).collect();
        // 20% of 20 = 4.
        let held: Vec<_> = (0..4)
            .map(|_| b.retry(&s).expect("within budget"))
            .collect();
        assert!(b.retry(&s).is_none());
        drop(held);
        assert!(b.retry(&s).is_some());
        drop(requests);
        // Nothing in flight: the floor (2).
        let held: Vec<_> = (0..2).map(|_| b.retry(&s).unwrap()).collect();
        assert!(b.retry(&s).is_none());
        assert_eq!((b.retried(), b.refused()), (7, 2));
        drop(held);
    }
}
