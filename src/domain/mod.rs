//! Domain types that refuse bad values: once constructed, they are valid.

mod api_key;
mod ids;
mod plan;
mod upstream;

pub use api_key::{ApiKey, KeyHash};
pub use ids::{ClientId, IdError, PlanName, Region, ServiceName, ID_PATTERN};
pub use plan::{
    Capacity, Mode, Plan, PlanError, Rate, MAX_CAPACITY, MAX_RATE, MAX_REFILL_SECS, MIN_CAPACITY,
    MIN_RATE,
};
pub use upstream::Upstream;
