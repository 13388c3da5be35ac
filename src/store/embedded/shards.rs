//! Regional reconciliation of sharded clients, the same as `lua/reconcile.lua`, in memory.

use std::collections::{HashMap, VecDeque};

use async_trait::async_trait;

use super::backend::{now_ms, EmbeddedShard, EmbeddedStore};
use crate::domain::{ClientId, Region};
use crate::store::{Reconcile, RegionShare, ShardState, ShardView, Shards, StoreError};

/// The same reconciliation as `lua/reconcile.lua`, for one instance.
#[async_trait]
impl Shards for EmbeddedStore {
    async fn reconcile(&self, r: &Reconcile<'_>) -> Result<ShardState, StoreError> {
        let now = now_ms();
        let mut shards = self.shards.lock();
        let seed = || {
            self.bucket_tokens(r.global_key, r.field, r.plan)
                .map_or(1.0, |t| t / r.plan.capacity())
        };
        let s = shards
            .entry(r.client.clone())
            .or_insert_with(|| EmbeddedShard {
                ts: now,
                since: now,
                seed: seed(),
                shares: r
                    .regions
                    .iter()
                    .map(|g| (g.to_string(), 1.0 / r.regions.len() as f64))
                    .collect(),
                demand: HashMap::new(),
                fill: HashMap::new(),
                history: VecDeque::new(),
            });
        s.demand.insert(r.region.to_string(), (r.demand, now));
        if let Some(f) = r.fill {
            s.fill.insert(r.region.to_string(), f);
        }
        if now.saturating_sub(s.ts) >= r.period_ms {
            let n = r.regions.len() as f64;
            // A region that stopped reporting counts as idle.
            let rate = |g: &Region| match s.demand.get(g.as_str()) {
                Some((d, at)) if now.saturating_sub(*at) <= 3 * r.period_ms => *d,
                _ => 0.0,
            };
            let total: f64 = r.regions.iter().map(rate).sum();
            let mut demands = serde_json::Map::new();
            for g in r.regions {
                let d = rate(g);
                let share = if total <= 0.0 {
                    1.0 / n
                } else {
                    r.floor / n + (1.0 - r.floor) * d / total
                };
                s.shares.insert(g.to_string(), share);
                demands.insert(g.to_string(), d.into());
            }
            s.ts = now;
            s.history.push_front(
                serde_json::json!({"at_ms": now, "shares": s.shares, "demand": demands}),
            );
            s.history.truncate(60);
        }
        Ok(s.state(r.regions))
    }

    async fn view(&self, client: &ClientId) -> Result<ShardView, StoreError> {
        let shards = self.shards.lock();
        match shards.get(client) {
            Some(s) => {
                let mut regions: Vec<Region> = s
                    .shares
                    .keys()
                    .filter_map(|r| Region::parse(r).ok())
                    .collect();
                regions.sort();
                Ok(ShardView {
                    state: Some(s.state(&regions)),
                    history: s.history.iter().cloned().collect(),
                })
            }
            None => Ok(ShardView::default()),
        }
    }
}

impl EmbeddedShard {
    fn state(&self, regions: &[Region]) -> ShardState {
        ShardState {
            updated_at_ms: self.ts,
            since_ms: self.since,
            seed: self.seed,
            regions: regions
                .iter()
                .map(|g| RegionShare {
                    region: g.to_string(),
                    share: self
                        .shares
                        .get(g.as_str())
                        .copied()
                        .unwrap_or(1.0 / regions.len() as f64),
                    fill: self.fill.get(g.as_str()).copied(),
                })
                .collect(),
        }
    }
}
