//! [`Store`]: the ports of one store, opened together. Each field is the port of one
//! concern; callers take the ones they need and never learn which backend answers.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use secrecy::SecretString;

use super::embedded::EmbeddedStore;
use super::ports::{
    AuditLog, Buckets, CatalogRecords, Claims, KeyUse, Lifecycle, ShadowCounts, Shards,
    UsageHistory,
};
use super::redis::RedisStore;
use super::{Keys, StoreError};

/// One store's ports; cheap to clone.
#[derive(Clone)]
pub struct Store {
    pub buckets: Arc<dyn Buckets>,
    pub shards: Arc<dyn Shards>,
    pub catalog: Arc<dyn CatalogRecords>,
    pub audit: Arc<dyn AuditLog>,
    pub shadow: Arc<dyn ShadowCounts>,
    pub key_use: Arc<dyn KeyUse>,
    pub claims: Arc<dyn Claims>,
    pub usage: Arc<dyn UsageHistory>,
    pub lifecycle: Arc<dyn Lifecycle>,
}

impl Store {
    /// The embedded store over the catalog file at `file` (created when missing), which it
    /// locks: a second process on the same file is refused.
    pub fn embedded(file: &Path) -> Result<Store, StoreError> {
        let store = Arc::new(EmbeddedStore::open(file)?);
        Ok(Store::of(store.clone(), store))
    }

    /// One Redis server at `url`, with a pool of `pool_size` connections for the calls off
    /// the request path, each bounded by `control_timeout`. Connects lazily: a gateway
    /// starts (and fails open) while Redis is down.
    pub fn redis(
        url: &SecretString,
        pool_size: u32,
        control_timeout: Duration,
        keys: Keys,
    ) -> Result<Store, StoreError> {
        Ok(Store::on_redis(RedisStore::connect(
            url,
            pool_size,
            control_timeout,
            keys,
        )?))
    }

    /// Redis Cluster from its seed `nodes`; connects in the background, like
    /// [`Store::redis`].
    pub fn cluster(
        nodes: &[SecretString],
        control_timeout: Duration,
        keys: Keys,
    ) -> Result<Store, StoreError> {
        Ok(Store::on_redis(RedisStore::connect_cluster(
            nodes,
            control_timeout,
            keys,
        )?))
    }

    /// Redis' ports: the engine's buckets (the request path calls them directly, not
    /// through the store), the store's own for the rest.
    fn on_redis(redis: RedisStore) -> Store {
        let buckets = Arc::clone(&redis.buckets);
        Store::of(buckets, Arc::new(redis))
    }

    fn of<S>(buckets: Arc<dyn Buckets>, s: Arc<S>) -> Store
    where
        S: Shards
            + CatalogRecords
            + AuditLog
            + ShadowCounts
            + KeyUse
            + Claims
            + UsageHistory
            + Lifecycle
            + 'static,
    {
        Store {
            buckets,
            shards: s.clone(),
            catalog: s.clone(),
            audit: s.clone(),
            shadow: s.clone(),
            key_use: s.clone(),
            claims: s.clone(),
            usage: s.clone(),
            lifecycle: s,
        }
    }

    /// Whether both are the same store (clones of one).
    pub fn same_as(&self, other: &Store) -> bool {
        Arc::ptr_eq(&self.lifecycle, &other.lifecycle)
    }
}
