//! The arithmetic both stores run: a token bucket ([`bucket`]) and a quota's window on the
//! calendar ([`quota`]), and the bounds a bucket is built within ([`plan`]).

pub mod bucket;
pub mod plan;
pub mod quota;

pub use self::bucket::BucketState;
pub use self::plan::{
    Bucket, Capacity, PlanError, Rate, MAX_CAPACITY, MAX_RATE, MAX_REFILL_SECS, MIN_CAPACITY,
    MIN_RATE,
};
pub use self::quota::{window_end, Bounds, Period, QuotaClock, QuotaError, Reset};
