//! Quota warnings, found where the count is kept: a quota's level after a decision (or a
//! debit) is the store's count, so the first level a gateway sees at or past one of the
//! quota's `warn_at` percentages is a crossing of the window it belongs to. Each gateway
//! hands a (client, limit, window, percentage) on at most once (`seen`), to a bounded
//! queue; who sends it is settled in the store (`Claims`: the first gateway to claim it),
//! so the whole fleet sends it once a window. Nothing here waits or calls the store: this
//! runs on the request path.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use dashmap::DashMap;
use tokio::sync::mpsc;

use crate::domain::{Applied, AppliedKind, ClientId, Level, Limits, PlanName};

/// A quota's level found at or past one of its warnings.
#[derive(Debug, Clone, PartialEq)]
pub struct Crossing {
    pub client: ClientId,
    pub plan: PlanName,
    pub limit: Arc<str>,
    /// The warning's percentage of the quota.
    pub percent: u8,
    /// What the window has used, as the store counted it.
    pub used: f64,
    /// The quota in force (the plan's, or the client's override).
    pub quota: f64,
    /// When the window ends (unix microseconds): the warning's window.
    pub window_end_us: u64,
    /// When it was found, on the store's clock (unix microseconds).
    pub at_us: u64,
}

impl Crossing {
    /// The name it is claimed by in the store: one per client, limit, window and
    /// percentage.
    pub fn claim_name(&self) -> String {
        format!(
            "warn:{}:{}:{}:{}",
            self.client,
            self.limit,
            self.window_end_us / 1_000_000,
            self.percent
        )
    }

    fn seen_key(&self) -> Seen {
        (
            self.client.clone(),
            Arc::clone(&self.limit),
            self.window_end_us,
            self.percent,
        )
    }
}

type Seen = (ClientId, Arc<str>, u64, u8);

/// The crossings this gateway found, on their way to the deliverer.
pub struct Warnings {
    tx: mpsc::Sender<Crossing>,
    /// Crossings handed on, until their window ends.
    seen: DashMap<Seen, ()>,
    max_seen: usize,
    /// Crossings not handed on: the queue was full, or `seen` was.
    dropped: AtomicU64,
}

impl Warnings {
    /// Crossings go to `tx`; at most `max_seen` are remembered at once (past it, a crossing
    /// is dropped and counted rather than sent twice by this gateway).
    pub fn new(tx: mpsc::Sender<Crossing>, max_seen: usize) -> Warnings {
        Warnings {
            tx,
            seen: DashMap::new(),
            max_seen,
            dropped: AtomicU64::new(0),
        }
    }

    /// Looks at a quota's levels after a decision or a debit: `applied` (the limits of
    /// `limits`, in order) and `levels` (each one's level, in the same order), at `now_us`.
    pub fn observe(
        &self,
        client: &ClientId,
        plan: &PlanName,
        limits: &Limits,
        applied: &[Applied],
        levels: &[Level],
        now_us: u64,
    ) {
        for (a, level) in applied.iter().zip(levels) {
            let (AppliedKind::Quota { amount, .. }, Level::Used { used, end_us }) =
                (&a.kind, level)
            else {
                continue;
            };
            let Some(limit) = limits.items().get(a.index) else {
                continue;
            };
            for &percent in limit.warn_at() {
                if *used < amount * f64::from(percent) / 100.0 {
                    // Ascending: the ones after are not reached either.
                    break;
                }
                self.found(Crossing {
                    client: client.clone(),
                    plan: plan.clone(),
                    limit: Arc::clone(&a.name),
                    percent,
                    used: *used,
                    quota: *amount,
                    window_end_us: *end_us,
                    at_us: now_us,
                });
            }
        }
    }

    fn found(&self, c: Crossing) {
        let key = c.seen_key();
        if self.seen.contains_key(&key) {
            return;
        }
        if self.seen.len() >= self.max_seen {
            self.forget_ended(c.at_us);
            if self.seen.len() >= self.max_seen {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
        if self.seen.insert(key, ()).is_some() {
            return;
        }
        if self.tx.try_send(c.clone()).is_err() {
            // Not handed on: a later level may find it again.
            self.seen.remove(&c.seen_key());
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Forgets crossings whose window ended before `now_us`.
    pub fn forget_ended(&self, now_us: u64) {
        self.seen.retain(|(_, _, end_us, _), _| *end_us > now_us);
    }

    /// Lets a crossing be found again (its claim could not be made: the store did not
    /// answer).
    pub fn retry_later(&self, c: &Crossing) {
        self.seen.remove(&c.seen_key());
    }

    /// Crossings dropped so far.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Crossings remembered now.
    pub fn remembered(&self) -> usize {
        self.seen.len()
    }
}
