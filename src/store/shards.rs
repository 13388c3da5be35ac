//! What regional reconciliation exchanges with the store: a region's report for a sharded
//! client ([`Reconcile`]) and the shares the store answers with ([`ShardState`]).

use crate::domain::{Bucket, ClientId, Region};

/// One region's part of a sharded client's plan.
#[derive(Debug, Clone, PartialEq, serde::Serialize, utoipa::ToSchema)]
pub struct RegionShare {
    pub region: String,
    /// Fraction of the plan's capacity and rate this region's shard holds.
    pub share: f64,
    /// How full the region's shard was when last reported (0..1).
    pub fill: Option<f64>,
}

/// A sharded client's shares, as the global store last reconciled them.
#[derive(Debug, Clone, PartialEq, serde::Serialize, utoipa::ToSchema)]
pub struct ShardState {
    /// Unix ms of the last reconciliation.
    pub updated_at_ms: u64,
    /// Unix ms when sharding began.
    pub since_ms: u64,
    /// How full the global bucket was when sharding began (0..1): new shards start so.
    pub seed: f64,
    pub regions: Vec<RegionShare>,
}

/// One call of the reconciler for one client from one region.
pub struct Reconcile<'a> {
    pub client: &'a ClientId,
    pub region: &'a Region,
    /// This region's demand: requests per second over its last interval.
    pub demand: f64,
    /// How full this region's shard is (0..1), if known.
    pub fill: Option<f64>,
    pub regions: &'a [Region],
    /// The client's global bucket key (its fill seeds the shards when sharding begins).
    pub global_key: &'a str,
    /// Where the shared bucket's state lives in that key (its field prefix).
    pub field: &'a str,
    pub plan: Bucket,
    pub period_ms: u64,
    /// The part of the plan idle regions keep, summed over all regions.
    pub floor: f64,
}
