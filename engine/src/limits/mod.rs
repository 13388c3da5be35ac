//! The arithmetic both stores run: a token bucket ([`bucket`]) and a quota's window on the
//! calendar ([`quota`]), the bounds a bucket is built within ([`plan`]), and one request's
//! take from all the limits that apply to it ([`take`]).

pub mod bucket;
pub mod plan;
pub mod quota;
pub mod take;

pub use self::bucket::BucketState;
pub use self::plan::{
    Bucket, Capacity, PlanError, Rate, MAX_CAPACITY, MAX_RATE, MAX_REFILL_SECS, MIN_CAPACITY,
    MIN_RATE,
};
pub use self::quota::{window_end, Bounds, Period, QuotaClock, QuotaError, Reset};
pub use self::take::{
    levels_at, spend_takes, take_many, Applied, AppliedKind, Level, LimitState, Ruling, MIN_TOKENS,
};
