//! What the Redis store is, whether it answers (readiness, the breaker's probe), and
//! what it loads at start.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::future::BoxFuture;
use redis::cluster_async::ClusterConnection;
use redis::Value;

use super::backend::{parse_slots, retrying, Backend, RedisStore};
use crate::store::{Lifecycle, Persistence, PoolState, SlotRange, StoreError, StoreKind};

#[async_trait]
impl Lifecycle for RedisStore {
    fn describe(&self) -> String {
        format!("redis {}", self.url)
    }

    fn kind(&self) -> StoreKind {
        match *self.backend {
            Backend::Single { .. } => StoreKind::Redis,
            Backend::Cluster(_) => StoreKind::Cluster,
        }
    }

    /// Connections open and idle, for the pool saturation metrics (one server only).
    fn pool(&self) -> Option<PoolState> {
        match &*self.backend {
            Backend::Single { pool, .. } => {
                let s = pool.state();
                Some(PoolState {
                    open: s.connections,
                    idle: s.idle_connections,
                })
            }
            Backend::Cluster(_) => None,
        }
    }

    async fn cluster_slots(&self) -> Result<Vec<SlotRange>, StoreError> {
        let ranges: Vec<Value> = retrying!(self, |c| async {
            Ok(redis::cmd("CLUSTER").arg("SLOTS").query_async(c).await?)
        }
        .await)?;
        parse_slots(ranges)
    }

    async fn load_scripts(&self) -> Result<(), StoreError> {
        retrying!(self, |c| async {
            self.bucket.load_async(c).await?;
            self.catalog_write.load_async(c).await?;
            self.usage_add.load_async(c).await?;
            Ok(())
        }
        .await)
    }

    /// Whether Redis answers a round trip within `budget` on a *fresh* connection (the
    /// breaker's probe; `key`: a key on the node the breaker guards, in a cluster). When
    /// it does, the connections opened before are retired: the breaker opened because
    /// they failed, and a fresh one works, so they may be dead (a partition, a failover
    /// behind the name) even though Redis is not.
    async fn probe(&self, key: Option<&str>, budget: Duration) -> Result<(), StoreError> {
        match &*self.backend {
            Backend::Single { dialer, .. } => {
                dialer.answers_fresh(budget).await?;
                dialer.retire_all();
                Ok(())
            }
            Backend::Cluster(cluster) => {
                let check = async |mut c: ClusterConnection| {
                    let mut cmd = redis::cmd("EXISTS");
                    cmd.arg(key.unwrap_or("tollgate:probe"));
                    tokio::time::timeout(budget, cmd.query_async::<i64>(&mut c))
                        .await
                        .map_err(|_| StoreError::Pool("probe timed out".into()))??;
                    Ok(())
                };
                // The workers' own connections to the key's master: retired when a fresh
                // one answers, as one server's are.
                if let Some(node) = key.and_then(|k| cluster.node_of(k)) {
                    node.dialer.answers_fresh(budget).await?;
                    node.dialer.retire_all();
                }
                if check(cluster.conn()).await.is_ok() {
                    return Ok(());
                }
                cluster.renew(check).await
            }
        }
    }

    /// A round trip on a pooled connection (readiness). Dead connections are dropped at
    /// checkout, and one found dead on the way is retried on a fresh one, so the answer is
    /// about Redis, not about a stale socket.
    async fn ping(&self) -> Result<(), StoreError> {
        retrying!(self, |c| async {
            redis::cmd("PING").query_async::<String>(c).await?;
            Ok(())
        }
        .await)
    }

    async fn persistence(&self) -> Result<Persistence, StoreError> {
        self.ask_persistence().await
    }

    fn housekeeping(self: Arc<Self>) -> Option<BoxFuture<'static, ()>> {
        None
    }
}
