//! Regional reconciliation of sharded clients (`lua/reconcile.lua`), and reading a
//! client's shares and their history.

use async_trait::async_trait;

use super::backend::{retrying, RedisStore};
use crate::domain::ClientId;
use crate::store::{Reconcile, RegionShare, ShardState, ShardView, Shards, StoreError};

#[async_trait]
impl Shards for RedisStore {
    async fn reconcile(&self, r: &Reconcile<'_>) -> Result<ShardState, StoreError> {
        // Used only when sharding begins: the regional buckets start as full as this.
        let seed = self
            .bucket_tokens(r.global_key, r.field, r.plan)
            .await?
            .map_or(1.0, |t| t / r.plan.capacity());
        let mut inv = self.reconcile.prepare_invoke();
        inv.key(self.keys.shard_state(r.client))
            .key(self.keys.shard_history(r.client))
            .arg(r.period_ms)
            .arg(r.region.as_str())
            .arg(r.demand)
            .arg(r.fill.map(|f| f.to_string()).unwrap_or_default())
            .arg(r.floor)
            .arg(seed);
        for region in r.regions {
            inv.arg(region.as_str());
        }
        let mut c = self.conn().await?;
        let out: Vec<Option<String>> = inv.invoke_async(&mut c).await?;
        parse_shard_state(&out).ok_or_else(|| StoreError::Protocol("reconcile reply".into()))
    }

    async fn view(&self, client: &ClientId) -> Result<ShardView, StoreError> {
        let (fields, history): (std::collections::HashMap<String, String>, Vec<String>) =
            retrying!(self, |c| async {
                Ok(redis::pipe()
                    .hgetall(self.keys.shard_state(client))
                    .lrange(self.keys.shard_history(client), 0, 59)
                    .query_async(c)
                    .await?)
            }
            .await)?;
        let history = history
            .iter()
            .filter_map(|h| serde_json::from_str(h).ok())
            .collect();
        if fields.is_empty() {
            return Ok(ShardView {
                state: None,
                history,
            });
        }
        let num = |k: &str| fields.get(k).and_then(|v| v.parse::<f64>().ok());
        let mut regions: Vec<RegionShare> = fields
            .iter()
            .filter_map(|(k, v)| {
                let region = k.strip_prefix("s:")?;
                Some(RegionShare {
                    region: region.to_string(),
                    share: v.parse().ok()?,
                    fill: num(&format!("f:{region}")),
                })
            })
            .collect();
        regions.sort_by(|a, b| a.region.cmp(&b.region));
        Ok(ShardView {
            state: Some(ShardState {
                updated_at_ms: num("ts").unwrap_or(0.0) as u64,
                since_ms: num("since").unwrap_or(0.0) as u64,
                seed: num("seed").unwrap_or(1.0),
                regions,
            }),
            history,
        })
    }
}

/// Parses the reconcile script's reply.
fn parse_shard_state(out: &[Option<String>]) -> Option<ShardState> {
    let num = |i: usize| out.get(i)?.as_deref()?.parse::<f64>().ok();
    let regions = out
        .get(3..)?
        .chunks(3)
        .filter_map(|c| {
            Some(RegionShare {
                region: c.first()?.clone()?,
                share: c.get(1)?.as_deref()?.parse().ok()?,
                fill: c.get(2)?.as_deref().and_then(|f| f.parse().ok()),
            })
        })
        .collect();
    Some(ShardState {
        updated_at_ms: num(0)? as u64,
        since_ms: num(1)? as u64,
        seed: num(2).unwrap_or(1.0),
        regions,
    })
}
