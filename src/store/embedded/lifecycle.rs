//! What the embedded store is: always there, nothing to load or probe, and one chore:
//! forgetting idle buckets.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::future::BoxFuture;

use super::backend::EmbeddedStore;
use crate::store::{Lifecycle, Persistence, PoolState, SlotRange, StoreError, StoreKind};

/// How often idle buckets are forgotten.
const EVICT_EVERY: Duration = Duration::from_secs(5);

#[async_trait]
impl Lifecycle for EmbeddedStore {
    fn kind(&self) -> StoreKind {
        StoreKind::Embedded
    }

    fn describe(&self) -> String {
        "embedded, single instance".to_string()
    }

    async fn probe(&self, _key: Option<&str>, _budget: Duration) -> Result<(), StoreError> {
        Ok(())
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }

    async fn load_scripts(&self) -> Result<(), StoreError> {
        Ok(())
    }

    async fn cluster_slots(&self) -> Result<Vec<SlotRange>, StoreError> {
        Ok(vec![])
    }

    fn pool(&self) -> Option<PoolState> {
        None
    }

    async fn persistence(&self) -> Result<Persistence, StoreError> {
        Ok(Persistence::Embedded)
    }

    /// Forgets idle in-process buckets every few seconds, so memory tracks active clients.
    fn housekeeping(self: Arc<Self>) -> Option<BoxFuture<'static, ()>> {
        Some(Box::pin(async move {
            let mut tick = tokio::time::interval(EVICT_EVERY);
            loop {
                tick.tick().await;
                self.evict_idle();
            }
        }))
    }
}
