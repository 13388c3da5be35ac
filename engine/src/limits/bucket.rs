//! The token bucket arithmetic, once. `engine/lua/bucket.lua` performs the same operations in
//! the same order, so the embedded store and Redis decide identically.
//!
//! A take answers with the wait until its cost exists: `Some(0)` when it did and was
//! taken ([`TAKEN`]), a later time when it will, `None` when it never can (the cost is
//! more than the bucket holds). What is left is the bucket's state, returned beside it.

use super::plan::Bucket;

/// What a bucket stores between requests.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BucketState {
    /// Tokens left after the last take.
    pub tokens: f64,
    /// When they were counted, in microseconds on the store's clock.
    pub ts_us: u64,
}

/// The wait of a take that was admitted: its cost existed, and was taken.
pub const TAKEN: Option<u64> = Some(0);

/// Refills the bucket up to `now_us`, then takes `cost` tokens if it holds that many.
/// A bucket seen for the first time (`state == None`) starts full.
pub fn take(
    state: Option<BucketState>,
    now_us: u64,
    plan: Bucket,
    cost: f64,
) -> (BucketState, Option<u64>) {
    take_seeded(state, now_us, plan, cost, None)
}

/// [`take`], where a bucket seen for the first time starts with `initial` tokens (at most
/// the capacity) instead of full.
pub fn take_seeded(
    state: Option<BucketState>,
    now_us: u64,
    plan: Bucket,
    cost: f64,
    initial: Option<f64>,
) -> (BucketState, Option<u64>) {
    let mut tokens = refill(state, now_us, plan, initial);
    let wait_us = take_from(&mut tokens, plan, cost);
    (
        BucketState {
            tokens,
            ts_us: now_us,
        },
        wait_us,
    )
}

/// The bucket's tokens at `now_us`: what it held, plus the rate times the time since,
/// never past capacity. A bucket seen for the first time holds `initial` (default: full).
pub fn refill(state: Option<BucketState>, now_us: u64, plan: Bucket, initial: Option<f64>) -> f64 {
    let cap = plan.capacity();
    let (tokens, ts) = match state {
        Some(s) => (s.tokens, s.ts_us),
        None => (cap.min(initial.unwrap_or(cap)), now_us),
    };
    let elapsed = now_us.saturating_sub(ts) as f64;
    cap.min(tokens + elapsed * plan.rate() / 1_000_000.0)
}

/// Takes `cost` from already refilled `tokens` if they hold that much; returns the wait
/// until they would ([`TAKEN`] when they did).
pub fn take_from(tokens: &mut f64, plan: Bucket, cost: f64) -> Option<u64> {
    if *tokens >= cost {
        *tokens -= cost;
        TAKEN
    } else if cost > plan.capacity() {
        None
    } else {
        // At least a microsecond: a refused take never reads as taken, even when the
        // tokens it lacks are too few to count.
        Some((((cost - *tokens) / plan.rate() * 1_000_000.0).ceil() as u64).max(1))
    }
}

/// How long an untouched bucket needs to be full again: after that it can be forgotten,
/// since a missing bucket starts full. One second of slack, as in the script.
pub fn idle_expiry_ms(plan: Bucket, tokens: f64) -> u64 {
    ((plan.capacity() - tokens) / plan.rate() * 1000.0).ceil() as u64 + 1000
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(capacity: f64, rate: f64) -> Bucket {
        Bucket::new(capacity, rate).unwrap()
    }

    #[test]
    fn a_new_bucket_starts_full_and_admits_exactly_its_capacity() {
        let p = plan(5.0, 1.0);
        let mut state = None;
        let mut admitted = 0;
        for _ in 0..10 {
            let (s, wait) = take(state, 1_000, p, 1.0);
            state = Some(s);
            admitted += u32::from(wait == TAKEN);
        }
        assert_eq!(admitted, 5);
    }

    #[test]
    fn tokens_refill_at_the_rate_and_never_past_capacity() {
        let p = plan(10.0, 2.0);
        let (s, _) = take(None, 0, p, 10.0);
        assert_eq!(s.tokens, 0.0);
        let (s, _) = take(Some(s), 1_500_000, p, 0.0);
        assert_eq!(s.tokens, 3.0);
        let (s, _) = take(Some(s), 1_000_000_000, p, 0.0);
        assert_eq!(s.tokens, 10.0);
    }

    #[test]
    fn a_denied_take_says_exactly_how_long_to_wait() {
        let p = plan(2.0, 4.0);
        let (s, _) = take(None, 0, p, 2.0);
        let (s, wait) = take(Some(s), 0, p, 1.0);
        assert_eq!(wait, Some(250_000));
        // Waiting exactly that long is enough.
        let (_, wait) = take(Some(s), 250_000, p, 1.0);
        assert_eq!(wait, TAKEN);
    }

    #[test]
    fn a_cost_above_capacity_can_never_be_met() {
        let (_, wait) = take(None, 0, plan(2.0, 1.0), 3.0);
        assert_eq!(wait, None);
    }

    #[test]
    fn a_clock_that_goes_backwards_refills_nothing() {
        let p = plan(2.0, 1.0);
        let (s, _) = take(None, 10_000_000, p, 2.0);
        let (_, wait) = take(Some(s), 5_000_000, p, 1.0);
        assert_ne!(wait, TAKEN);
    }

    #[test]
    fn an_empty_bucket_expires_once_it_would_be_full() {
        assert_eq!(idle_expiry_ms(plan(10.0, 5.0), 0.0), 3_000);
        assert_eq!(idle_expiry_ms(plan(10.0, 5.0), 10.0), 1_000);
    }

    #[test]
    fn admitted_over_a_long_run_is_capacity_plus_rate_times_time() {
        // 1,000 requests/s against 100 + 50/s for 10 s: exactly 600 admitted.
        let p = plan(100.0, 50.0);
        let mut state = None;
        let mut admitted = 0;
        for i in 0..=10_000u64 {
            let (s, wait) = take(state, i * 1_000, p, 1.0);
            state = Some(s);
            admitted += u32::from(wait == TAKEN);
        }
        assert_eq!(admitted, 600);
    }
}
