//! The lowest floor: values every other layer speaks in, with no I/O and no imports from
//! the rest of the crate. Types that refuse bad values (once constructed, they are valid),
//! a plan's limits ([`limits`]), decisions and their outcomes, the IETF `RateLimit` header
//! values, and where a route's service lives ([`Upstream`]). The token-bucket arithmetic
//! both stores run, a bucket's bounds ([`Bucket`]) and quota windows on the calendar
//! ([`quota`]) are the engine's (`tollgate_engine::limits`), re-exported here under their
//! names.

mod address;
mod api_key;
mod connections;
mod decision;
mod ids;
mod instant;
pub mod limits;
mod mode;
pub mod ratelimit;
mod upstream;

pub use address::{address_group, address_tag, client_addr, hop_addr};
pub use api_key::{ApiKey, KeyHash};
pub use connections::MaxConnections;
pub use decision::{Decision, FailOpenReason, Outcome};
pub use ids::{ClientId, IdError, LimitName, PlanName, Region, ServiceName, ID_PATTERN};
pub use instant::{rfc3339_wanted, unix_s_of_rfc3339};
pub use limits::{
    Applied, AppliedKind, Level, Limit, LimitError, LimitKind, LimitSpec, LimitState, Limits,
    Override, OverrideError, PolicyItem, Quota, Ruling,
};
pub use mode::Mode;
pub use ratelimit::{policy_header, RateLimitHeaders};
pub use tollgate_engine::limits::{bucket, quota};
pub use tollgate_engine::limits::{
    window_end, Bounds, Bucket, BucketState, Capacity, Period, PlanError, QuotaClock, QuotaError,
    Rate, Reset, MAX_CAPACITY, MAX_RATE, MAX_REFILL_SECS, MIN_CAPACITY, MIN_RATE,
};
pub use upstream::{server_name, Upstream};
