//! One request against the limits that apply to it: each limit's level at an instant
//! ([`Level`], from its stored [`LimitState`]), a take of a cost from all of them or from
//! none ([`take_many`]), and the answer ([`Ruling`]). Both stores decide with it; Redis
//! replays the levels its script answers through it.

use std::sync::Arc;

use super::bucket::{self, BucketState};
use super::plan::{Bucket, MAX_CAPACITY};
use super::quota::{window_end, QuotaClock};

/// One limit as one request sees it: its state's place and the values it is decided with
/// (a regional shard's portion of a bucket, a seed for a bucket that does not exist yet).
#[derive(Debug, Clone, PartialEq)]
pub struct Applied {
    /// Its index among the plan's limits (the first speaks for the plan in headers).
    pub index: usize,
    /// Its name among the plan's limits, as the gateway's headers say it.
    pub name: Arc<str>,
    pub field: Arc<str>,
    pub kind: AppliedKind,
}

#[derive(Debug, Clone, PartialEq)]
pub enum AppliedKind {
    Bucket {
        bucket: Bucket,
        /// Tokens a bucket that does not exist yet starts with (default: full).
        initial: Option<f64>,
    },
    Quota {
        amount: f64,
        clock: Arc<QuotaClock>,
    },
}

impl Applied {
    /// The most it can hold: a request costing more is never admitted.
    pub fn ceiling(&self) -> f64 {
        match &self.kind {
            AppliedKind::Bucket { bucket, .. } => bucket.capacity(),
            AppliedKind::Quota { amount, .. } => *amount,
        }
    }
}

/// A limit's stored state.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LimitState {
    Bucket(BucketState),
    /// `used` of the quota in the window that ends at `end_us`.
    Quota {
        used: f64,
        end_us: u64,
    },
}

/// A limit's level at one instant, before any take: a bucket's tokens after refilling, a
/// quota's count in the window the instant falls in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Level {
    Tokens(f64),
    Used { used: f64, end_us: u64 },
}

/// The lowest a balance can go with costs debited after the response: minus the largest
/// capacity, so an empty bucket's refill time stays within 2e12 s (exact in ms).
pub const MIN_TOKENS: f64 = -MAX_CAPACITY;

impl Level {
    /// The level of a limit at `now_us`, from its stored state (`None`: never used, or
    /// forgotten since it was full / its window ended).
    pub fn at(kind: &AppliedKind, state: Option<LimitState>, now_us: u64) -> Level {
        match kind {
            AppliedKind::Bucket { bucket, initial } => {
                let state = match state {
                    Some(LimitState::Bucket(s)) => Some(s),
                    _ => None,
                };
                Level::Tokens(bucket::refill(state, now_us, *bucket, *initial))
            }
            AppliedKind::Quota { clock, .. } => {
                let bounds = clock.bounds(now_us);
                match state {
                    Some(LimitState::Quota { used, end_us }) if now_us < end_us => {
                        Level::Used { used, end_us }
                    }
                    _ => Level::Used {
                        used: 0.0,
                        end_us: window_end(bounds, None, now_us),
                    },
                }
            }
        }
    }

    fn fits(&self, kind: &AppliedKind, cost: f64) -> bool {
        match (self, kind) {
            (Level::Tokens(t), _) => *t >= cost,
            (Level::Used { used, .. }, AppliedKind::Quota { amount, .. }) => used + cost <= *amount,
            (Level::Used { .. }, _) => false,
        }
    }

    /// Until `cost` fits: `None` when it never can.
    fn wait_us(&self, kind: &AppliedKind, cost: f64, now_us: u64) -> Option<u64> {
        if self.fits(kind, cost) {
            return Some(0);
        }
        match (self, kind) {
            (Level::Tokens(t), AppliedKind::Bucket { bucket, .. }) => (cost <= bucket.capacity())
                .then(|| ((cost - t) / bucket.rate() * 1_000_000.0).ceil() as u64),
            (Level::Used { end_us, .. }, AppliedKind::Quota { amount, .. }) => {
                (cost <= *amount).then(|| end_us.saturating_sub(now_us))
            }
            _ => None,
        }
    }

    fn spend(&mut self, cost: f64) {
        match self {
            Level::Tokens(t) => *t -= cost,
            Level::Used { used, .. } => *used += cost,
        }
    }

    /// Debits `delta` (a refund when negative) whatever the balance: a bucket may go below
    /// zero (down to [`MIN_TOKENS`]) and waits it off; a quota's count never below zero.
    pub fn adjust(&mut self, kind: &AppliedKind, delta: f64) {
        match (self, kind) {
            (Level::Tokens(t), AppliedKind::Bucket { bucket, .. }) => {
                *t = (*t - delta).clamp(MIN_TOKENS, bucket.capacity())
            }
            (Level::Used { used, .. }, AppliedKind::Quota { amount, .. }) => {
                *used = (*used + delta).clamp(0.0, 2.0 * amount)
            }
            _ => {}
        }
    }

    /// What is left: tokens, or the quota less its count.
    pub fn remaining(&self, kind: &AppliedKind) -> f64 {
        match (self, kind) {
            (Level::Tokens(t), _) => *t,
            (Level::Used { used, .. }, AppliedKind::Quota { amount, .. }) => amount - used,
            (Level::Used { .. }, _) => 0.0,
        }
    }

    /// Microseconds until it is whole again: a bucket full, a quota's window over.
    pub fn reset_us(&self, kind: &AppliedKind, now_us: u64) -> u64 {
        match (self, kind) {
            (Level::Tokens(t), AppliedKind::Bucket { bucket, .. }) => {
                ((bucket.capacity() - t).max(0.0) / bucket.rate() * 1_000_000.0).ceil() as u64
            }
            (Level::Used { end_us, .. }, _) => end_us.saturating_sub(now_us),
            _ => 0,
        }
    }

    /// The state to store for this level at `now_us`.
    pub fn state(&self, now_us: u64) -> LimitState {
        match *self {
            Level::Tokens(tokens) => LimitState::Bucket(BucketState {
                tokens,
                ts_us: now_us,
            }),
            Level::Used { used, end_us } => LimitState::Quota { used, end_us },
        }
    }

    /// How long its state must be kept: until a bucket would be full (it then starts full
    /// anyway), until a quota's window ends; one second of slack, as in the script.
    pub fn keep_ms(&self, kind: &AppliedKind, now_us: u64) -> u64 {
        match (self, kind) {
            (Level::Tokens(t), AppliedKind::Bucket { bucket, .. }) => {
                bucket::idle_expiry_ms(*bucket, *t)
            }
            (Level::Used { end_us, .. }, _) => end_us.saturating_sub(now_us).div_ceil(1000) + 1000,
            _ => 1000,
        }
    }
}

/// The answer for one request against all the limits that apply to it.
#[derive(Debug, Clone, PartialEq)]
pub struct Ruling {
    pub allowed: bool,
    /// Each limit's level after this request, in the order of the applied limits.
    pub levels: Vec<Level>,
    /// Until every limit that refused would admit: zero when allowed, `None` when some
    /// limit can never hold the cost.
    pub wait_us: Option<u64>,
    /// The first limit that refused (index among the applied limits).
    pub refused_by: Option<usize>,
    /// The store's clock when it decided, in unix microseconds.
    pub now_us: u64,
    /// Requests decided by the same store call as this one (itself included); 0 when no
    /// call was made (the embedded store, a refusal decided in the gateway).
    pub batch: u32,
}

impl Ruling {
    /// What a peek answers: `levels` as they stand at `now_us`, nothing refused.
    pub fn levels(levels: Vec<Level>, now_us: u64) -> Ruling {
        Ruling {
            allowed: true,
            levels,
            wait_us: Some(0),
            refused_by: None,
            now_us,
            batch: 0,
        }
    }

    /// What an adjustment answers: `levels` (before it) each debited `delta` (a refund
    /// when negative), whatever the balance.
    pub fn adjusted(
        mut levels: Vec<Level>,
        applied: &[Applied],
        delta: f64,
        now_us: u64,
    ) -> Ruling {
        for (l, a) in levels.iter_mut().zip(applied) {
            l.adjust(&a.kind, delta);
        }
        Ruling::levels(levels, now_us)
    }

    /// The applied limit closest to refusing: the one that refused, else the one with the
    /// least left (on a tie, the one that takes longest to be whole again).
    pub fn tightest(&self, applied: &[Applied]) -> Option<usize> {
        if let Some(i) = self.refused_by {
            return Some(i);
        }
        (0..applied.len().min(self.levels.len())).min_by(|&a, &b| {
            let ra = self.levels[a].remaining(&applied[a].kind);
            let rb = self.levels[b].remaining(&applied[b].kind);
            ra.total_cmp(&rb).then_with(|| {
                let ta = self.levels[a].reset_us(&applied[a].kind, self.now_us);
                let tb = self.levels[b].reset_us(&applied[b].kind, self.now_us);
                tb.cmp(&ta)
            })
        })
    }
}

/// `n` takes of `cost` at one instant, in order, from `levels`: each admitted only if every
/// limit holds the cost, and then spent from all of them. What `n` separate calls at that
/// instant decide; the script does the same, so replaying its levels here gives each
/// request its exact answer. Once one is refused the rest are too (same cost, no refill).
pub fn take_many(
    applied: &[Applied],
    mut levels: Vec<Level>,
    cost: f64,
    n: usize,
    now_us: u64,
) -> Vec<Ruling> {
    let mut rulings = Vec::with_capacity(n);
    for i in 0..n {
        let refused_by = take_one(applied, &mut levels, cost);
        let wait_us = match refused_by {
            None => Some(0),
            Some(_) => applied
                .iter()
                .zip(&levels)
                .map(|(a, l)| l.wait_us(&a.kind, cost, now_us))
                .try_fold(0u64, |m, w| w.map(|w| m.max(w))),
        };
        rulings.push(Ruling {
            allowed: refused_by.is_none(),
            // The last take keeps the levels themselves (most calls decide one).
            levels: if i + 1 == n {
                std::mem::take(&mut levels)
            } else {
                levels.clone()
            },
            wait_us,
            refused_by,
            now_us,
            batch: 0,
        });
    }
    rulings
}

/// Spends from `levels` what [`take_many`] would admit of `k` takes of `cost`, without
/// their rulings: the levels the take after them sees.
pub fn spend_takes(applied: &[Applied], levels: &mut [Level], cost: f64, k: usize) {
    for _ in 0..k {
        if take_one(applied, levels, cost).is_some() {
            // Refused, and so is every later one (same cost, no refill): nothing spent.
            return;
        }
    }
}

/// One take of `cost`: spent from every limit if each holds it, else from none; the
/// first limit that refused it, if one did.
fn take_one(applied: &[Applied], levels: &mut [Level], cost: f64) -> Option<usize> {
    let refused_by = applied
        .iter()
        .zip(levels.iter())
        .position(|(a, l)| !l.fits(&a.kind, cost));
    if refused_by.is_none() {
        for l in levels.iter_mut() {
            l.spend(cost);
        }
    }
    refused_by
}

/// The levels of `applied` at `now_us` from their stored states (in the same order).
pub fn levels_at(applied: &[Applied], states: &[Option<LimitState>], now_us: u64) -> Vec<Level> {
    applied
        .iter()
        .zip(states.iter().copied().chain(std::iter::repeat(None)))
        .map(|(a, s)| Level::at(&a.kind, s, now_us))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::quota::{Period, Reset};
    use super::*;

    fn bucket(name: &str, capacity: f64, rate: f64) -> Applied {
        Applied {
            index: 0,
            name: Arc::from(name),
            field: Arc::from(format!("{name}:")),
            kind: AppliedKind::Bucket {
                bucket: Bucket::new(capacity, rate).unwrap(),
                initial: None,
            },
        }
    }

    fn daily(name: &str, amount: f64) -> Applied {
        let clock = QuotaClock::new(Period::Day, Reset::Calendar, "UTC").unwrap();
        Applied {
            index: 0,
            name: Arc::from(name),
            field: Arc::from(format!("{name}:")),
            kind: AppliedKind::Quota {
                amount,
                clock: Arc::new(clock),
            },
        }
    }

    fn applied(limits: &[Applied]) -> Vec<Applied> {
        limits
            .iter()
            .enumerate()
            .map(|(index, l)| Applied { index, ..l.clone() })
            .collect()
    }

    const NOON: u64 = 1_796_126_400_000_000; // 2026-12-01T12:00:00Z

    #[test]
    fn a_request_refused_by_one_limit_spends_from_none() {
        let a = applied(&[bucket("burst", 5.0, 1.0), daily("day", 3.0)]);
        let levels = levels_at(&a, &[], NOON);
        let r = take_many(&a, levels, 1.0, 5, NOON);
        assert_eq!(
            r.iter().map(|r| r.allowed).collect::<Vec<_>>(),
            [true, true, true, false, false]
        );
        // Each ruling holds the levels after its own take; the bucket kept the two tokens
        // the refused requests did not take.
        assert_eq!(r[0].levels[0], Level::Tokens(4.0));
        assert_eq!(r[2].levels[0], Level::Tokens(2.0));
        assert_eq!(r[4].levels[0], Level::Tokens(2.0));
        assert_eq!(r[4].refused_by, Some(1));
        // A quota refuses until its window ends: midnight.
        assert_eq!(r[4].wait_us, Some(12 * 3600 * 1_000_000));
    }

    /// A take that joined others of its client in one script call replays theirs first:
    /// whatever their number, it gets what it would have got among them.
    #[test]
    fn takes_spent_without_rulings_leave_what_their_rulings_would_have() {
        let a = applied(&[bucket("burst", 5.0, 1.0), daily("day", 3.0)]);
        for cost in [1.0, 2.0] {
            let all = take_many(&a, levels_at(&a, &[], NOON), cost, 6, NOON);
            for skip in 0..6 {
                let mut levels = levels_at(&a, &[], NOON);
                spend_takes(&a, &mut levels, cost, skip);
                let rest = take_many(&a, levels, cost, 6 - skip, NOON);
                assert_eq!(rest, all[skip..], "cost {cost}, {skip} before");
            }
        }
    }

    #[test]
    fn the_wait_is_until_every_refusing_limit_admits() {
        let a = applied(&[bucket("burst", 2.0, 1.0), bucket("slow", 2.0, 0.5)]);
        let levels = vec![Level::Tokens(0.0), Level::Tokens(0.0)];
        let r = take_many(&a, levels, 1.0, 1, NOON);
        assert_eq!(r[0].wait_us, Some(2_000_000));
        assert_eq!(r[0].refused_by, Some(0));
    }

    #[test]
    fn a_cost_one_limit_can_never_hold_is_never_admitted() {
        let a = applied(&[bucket("burst", 100.0, 1.0), daily("day", 3.0)]);
        let r = take_many(&a, levels_at(&a, &[], NOON), 4.0, 1, NOON);
        assert_eq!(r[0].wait_us, None);
    }

    #[test]
    fn a_quota_starts_over_when_its_window_ends() {
        let a = applied(&[daily("day", 3.0)]);
        let end = NOON + 12 * 3600 * 1_000_000;
        let full = Some(LimitState::Quota {
            used: 3.0,
            end_us: end,
        });
        assert!(!take_many(&a, levels_at(&a, &[full], end - 1), 1.0, 1, end - 1)[0].allowed);
        let r = take_many(&a, levels_at(&a, &[full], end), 1.0, 1, end);
        assert!(r[0].allowed);
        assert_eq!(
            r[0].levels[0],
            Level::Used {
                used: 1.0,
                end_us: end + 24 * 3600 * 1_000_000
            }
        );
    }

    #[test]
    fn a_debit_after_the_response_can_take_a_bucket_below_zero() {
        let a = applied(&[bucket("burst", 10.0, 1.0), daily("day", 100.0)]);
        let mut levels = levels_at(&a, &[], NOON);
        for (l, a) in levels.iter_mut().zip(&a) {
            l.adjust(&a.kind, 14.0);
        }
        assert_eq!(levels[0], Level::Tokens(-4.0));
        assert_eq!(levels[0].reset_us(&a[0].kind, NOON), 14_000_000);
        let r = take_many(&a, levels.clone(), 1.0, 1, NOON);
        assert_eq!(r[0].wait_us, Some(5_000_000));
        // A refund never takes a quota's count below zero.
        levels[1].adjust(&a[1].kind, -1000.0);
        assert_eq!(levels[1].remaining(&a[1].kind), 100.0);
    }
}
