//! Domain types that refuse bad values: once constructed, they are valid.

mod api_key;
mod ids;
mod plan;

pub use api_key::{ApiKey, KeyHash};
pub use ids::{ClientId, IdError, PlanName, Region};
pub use plan::{Mode, Plan, PlanError};
