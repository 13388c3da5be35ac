//! [`RedisStore`]: the engine's connection to Redis ([`Backend`], one server or a cluster),
//! shared by the engine's buckets and the store's own commands, with the retry rule for
//! calls off the request path (`retrying!`) and the reads every concern shares.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionLike;
use redis::Script;
use secrecy::{ExposeSecret, SecretString};

use crate::configuration::redact_url;
#[cfg(test)]
use crate::store::StateGroups;
use crate::store::{Keys, StoreError};
pub(super) use tollgate_engine::redis::{parse_slots, Backend, Conn};
use tollgate_engine::redis::{RedisBuckets, BUCKET_LUA};
pub(super) use tollgate_engine::retrying;

/// One stream entry (the change feed, the audit log): its id and fields.
pub(super) type FeedEntry = (String, Vec<(String, String)>);

/// Redis (one server or a cluster) as the store.
pub struct RedisStore {
    /// How commands reach Redis, shared with [`Self::buckets`].
    pub(super) backend: Arc<Backend>,
    /// Every client's limits: the engine's.
    pub(crate) buckets: Arc<RedisBuckets>,
    pub(super) keys: Keys,
    /// Where client state lives (`engine/lua/bucket.lua`), for the tests that read it.
    #[cfg(test)]
    pub(super) groups: StateGroups,
    pub(super) bucket: Script,
    pub(super) catalog_write: Script,
    pub(super) catalog_restore: Script,
    pub(super) catalog_restore_stage: Script,
    pub(super) catalog_apply: Script,
    pub(super) catalog_apply_stage: Script,
    pub(super) catalog_apply_swap: Script,
    pub(super) key_filter_add: Script,
    pub(super) catalog_import: Script,
    pub(super) client_by_key: Script,
    pub(super) key_filter_build: Script,
    pub(super) reconcile: Script,
    pub(super) usage_add: Script,
    pub(super) usage_checkpoint: Script,
    pub(super) usage_orphan: Script,
    pub(super) usage_adopt: Script,
    pub(super) url: String,
}

impl RedisStore {
    fn new(backend: Backend, keys: Keys, url: String, control_timeout: Duration) -> RedisStore {
        let backend = Arc::new(backend);
        let buckets = Arc::new(RedisBuckets::new(
            Arc::clone(&backend),
            keys.prefix(),
            control_timeout,
        ));
        RedisStore {
            #[cfg(test)]
            groups: buckets.groups().clone(),
            backend,
            buckets,
            keys,
            bucket: Script::new(BUCKET_LUA),
            catalog_write: with_key_filter(include_str!("../../../lua/catalog_write.lua")),
            catalog_restore: Script::new(include_str!("../../../lua/catalog_restore.lua")),
            catalog_restore_stage: Script::new(include_str!(
                "../../../lua/catalog_restore_stage.lua"
            )),
            catalog_apply: with_key_filter(include_str!("../../../lua/catalog_apply.lua")),
            catalog_apply_stage: Script::new(include_str!("../../../lua/catalog_apply_stage.lua")),
            catalog_apply_swap: Script::new(include_str!("../../../lua/catalog_apply_swap.lua")),
            key_filter_add: with_key_filter(include_str!("../../../lua/key_filter_add.lua")),
            catalog_import: with_key_filter(include_str!("../../../lua/catalog_import.lua")),
            client_by_key: Script::new(include_str!("../../../lua/client_by_key.lua")),
            key_filter_build: with_key_filter(include_str!("../../../lua/key_filter_build.lua")),
            reconcile: Script::new(include_str!("../../../lua/reconcile.lua")),
            usage_add: Script::new(include_str!("../../../lua/usage_add.lua")),
            usage_checkpoint: Script::new(include_str!("../../../lua/usage_checkpoint.lua")),
            usage_orphan: Script::new(include_str!("../../../lua/usage_orphan.lua")),
            usage_adopt: Script::new(include_str!("../../../lua/usage_adopt.lua")),
            url,
        }
    }

    /// Builds the pool without connecting: a gateway starts (and fails open) while Redis
    /// is down, and connects once it answers.
    /// `control_timeout` bounds every call off the request path (and each dial).
    pub fn connect(
        url: &SecretString,
        pool_size: u32,
        control_timeout: Duration,
        keys: Keys,
    ) -> Result<RedisStore, StoreError> {
        let backend = Backend::single(url.expose_secret(), pool_size, control_timeout)?;
        Ok(RedisStore::new(
            backend,
            keys,
            redact_url(url.expose_secret()),
            control_timeout,
        ))
    }

    /// A store on the test's `redis` (a pool of 2, the prefix `tollgate:`).
    #[cfg(test)]
    pub(super) fn for_test(redis: &tollgate_testkit::RedisServer) -> RedisStore {
        let url = SecretString::from(redis.url());
        RedisStore::connect(&url, 2, Duration::from_secs(5), Keys::new("tollgate:"))
            .expect("a store on the test's Redis")
    }

    /// Redis Cluster from seed nodes. Connects in the background, so the gateway starts
    /// (failing open) while the cluster is unreachable.
    pub fn connect_cluster(
        nodes: &[SecretString],
        control_timeout: Duration,
        keys: Keys,
    ) -> Result<RedisStore, StoreError> {
        let urls: Vec<&str> = nodes.iter().map(|n| n.expose_secret()).collect();
        let backend = Backend::cluster(&urls, control_timeout)?;
        let url = format!(
            "cluster {}",
            urls.iter()
                .map(|u| redact_url(u))
                .collect::<Vec<_>>()
                .join(",")
        );
        Ok(RedisStore::new(backend, keys, url, control_timeout))
    }

    /// A connection off the request path (see [`Backend::conn`]).
    pub(super) async fn conn(&self) -> Result<Conn<'_>, StoreError> {
        self.backend.conn().await
    }

    /// After a control-plane call timed out (see [`Backend::after_timeout`]).
    pub(super) async fn after_timeout(&self) {
        self.backend.after_timeout().await
    }

    /// The tokens now of the bucket whose state is under `field` at `key` (the engine's
    /// [`RedisBuckets::bucket_tokens`]).
    pub(super) async fn bucket_tokens(
        &self,
        key: &str,
        field: &str,
        plan: crate::domain::Bucket,
    ) -> Result<Option<f64>, StoreError> {
        self.buckets.bucket_tokens(key, field, plan).await
    }
}

/// A script that gives keys: `lua/key_filter.lua` (which sets a key's bits in the key
/// filter) before `body`.
fn with_key_filter(body: &str) -> Script {
    Script::new(&[include_str!("../../../lua/key_filter.lua"), body].concat())
}

/// Every field of a hash, with HSCAN (a catalog may hold millions of clients).
pub(super) async fn scan_hash(
    c: &mut impl ConnectionLike,
    key: &str,
) -> Result<Vec<(String, String)>, StoreError> {
    let mut out = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, page): (u64, Vec<(String, String)>) = redis::cmd("HSCAN")
            .arg(key)
            .arg(cursor)
            .arg("COUNT")
            .arg(1000)
            .query_async(c)
            .await?;
        out.extend(page);
        if next == 0 {
            return Ok(out);
        }
        cursor = next;
    }
}
