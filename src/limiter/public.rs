//! Requests without a key, on a public route: limited per client address by the route's
//! plan, in the same store, script and round trip as a client's (`Buckets::take` takes
//! any bucket key), always enforced.

use std::sync::Arc;

use crate::catalog::PlanSlot;
use crate::domain::{Decision, Limits, Outcome};

/// Who a request without a key is: its address group's bucket of the route's plan.
pub struct Anonymous {
    /// `<plan>@<address group>` (see [`crate::domain::address_tag`]).
    pub tag: String,
    /// `tollgate:b:{<tag>}`.
    pub bucket_key: String,
    pub plan: Arc<PlanSlot>,
}

/// A decision of `outcome` for `cost` with nothing applied or ruled yet, under `limits`
/// as planned (a request without a key; a client's adds its overrides).
pub(super) fn anonymous_opening(limits: &Limits, cost: f64, outcome: Outcome) -> Decision {
    Decision {
        outcome,
        applied: Vec::new(),
        ruling: None,
        safety_wait_us: None,
        fail_open_reason: None,
        as_planned: !limits.has_scoped(),
        cost,
        sharded: false,
    }
}
