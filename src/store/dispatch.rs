//! [`Store`]: the embedded store or Redis behind one type. Every call dispatches on the
//! variant; nothing outside `store` needs to know which one it holds.
//!
//! Dispatch is an enum, not a trait object: the request path calls [`Store::take`] once
//! per request, and an enum keeps that call free of boxing.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use secrecy::SecretString;

use super::embedded::EmbeddedStore;
use super::records::{
    Audit, AuditEntry, CatalogChanges, CatalogDump, CatalogWrite, ClientRecord, ClientsPage,
    PlanRecord, SafetyRecord, Versioned, WriteOutcome,
};
use super::redis::{Persistence, RedisStore};
use super::shards::{Reconcile, ShardState};
use super::{Keys, StoreError};
use crate::domain::{Applied, Bucket, ClientId, Ruling};

/// Embedded or Redis; cheap to clone.
#[derive(Clone)]
pub enum Store {
    Embedded(Arc<EmbeddedStore>),
    Redis(Arc<RedisStore>),
}

impl Store {
    /// The embedded store over the catalog file at `file` (created when missing), which it
    /// locks: a second process on the same file is refused.
    pub fn embedded(file: &Path) -> Result<Store, StoreError> {
        Ok(Store::Embedded(Arc::new(EmbeddedStore::open(file)?)))
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
        Ok(Store::Redis(Arc::new(RedisStore::connect(
            url,
            pool_size,
            control_timeout,
            keys,
        )?)))
    }

    /// Redis Cluster from its seed `nodes`; connects in the background, like
    /// [`Store::redis`].
    pub fn cluster(
        nodes: &[SecretString],
        control_timeout: Duration,
        keys: Keys,
    ) -> Result<Store, StoreError> {
        Ok(Store::Redis(Arc::new(RedisStore::connect_cluster(
            nodes,
            control_timeout,
            keys,
        )?)))
    }

    /// Takes `cost` from every limit in `applied` at `key`, or from none, atomically, on
    /// the store's clock. With a `budget`, a call the store does not answer within it
    /// answers [`StoreError::Deadline`] (the embedded store always answers at once).
    pub async fn take(
        &self,
        key: &str,
        applied: &[Applied],
        cost: f64,
        budget: Option<super::Budget>,
    ) -> Result<Ruling, StoreError> {
        match self {
            Store::Embedded(s) => Ok(s.take(key, applied, cost)),
            Store::Redis(s) => s.take(key, applied, cost, budget).await,
        }
    }

    /// Debits `delta` from every limit in `applied` at `key` (a refund when negative),
    /// whatever the balance: a bucket may go below zero and waits it off. Returns the
    /// levels after it.
    pub async fn adjust(
        &self,
        key: &str,
        applied: &[Applied],
        delta: f64,
    ) -> Result<Ruling, StoreError> {
        match self {
            Store::Embedded(s) => Ok(s.adjust(key, applied, delta)),
            Store::Redis(s) => s.adjust(key, applied, delta).await,
        }
    }

    /// Every limit's level now, on the store's clock. For inspection; changes nothing.
    pub async fn peek(&self, key: &str, applied: &[Applied]) -> Result<Ruling, StoreError> {
        match self {
            Store::Embedded(s) => Ok(s.peek(key, applied)),
            Store::Redis(s) => s.peek(key, applied).await,
        }
    }

    /// The tokens now of the bucket whose state is under `field` at `key`, refilled on the
    /// store's clock; `None` when it has no state (it is full). Takes nothing.
    pub async fn tokens_now(
        &self,
        key: &str,
        field: &str,
        bucket: Bucket,
    ) -> Result<Option<f64>, StoreError> {
        match self {
            Store::Embedded(s) => Ok(s.tokens_now(key, field, bucket)),
            Store::Redis(s) => s.tokens_now(key, field, bucket).await,
        }
    }

    /// Forgets the state of the buckets whose fields are `buckets` at `key`, so they start
    /// full; the client's other limits (its quotas' counts) stay.
    pub async fn refill(&self, key: &str, buckets: &[Arc<str>]) -> Result<(), StoreError> {
        match self {
            Store::Embedded(s) => {
                s.refill(key, buckets);
                Ok(())
            }
            Store::Redis(s) => s.refill(key, buckets).await,
        }
    }

    /// Bucket script calls sent and the takes they decided (Redis only).
    pub fn bucket_calls(&self) -> Option<(u64, u64)> {
        match self {
            Store::Embedded(_) => None,
            Store::Redis(s) => Some(s.bucket_calls()),
        }
    }

    /// A number that tells stores apart (the same for clones of one store).
    pub fn id(&self) -> usize {
        match self {
            Store::Embedded(s) => Arc::as_ptr(s) as usize,
            Store::Redis(s) => Arc::as_ptr(s) as usize,
        }
    }

    /// Whether both are the same store.
    pub fn same_as(&self, other: &Store) -> bool {
        match (self, other) {
            (Store::Embedded(a), Store::Embedded(b)) => Arc::ptr_eq(a, b),
            (Store::Redis(a), Store::Redis(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    /// Keeps the calling worker thread's request-path connection open (Redis, one
    /// server): opens it now and re-opens it whenever it dies. Runs until the thread ends.
    pub async fn keep_connected(&self) {
        if let Store::Redis(s) = self {
            s.keep_connected().await;
        }
    }

    /// Whether the store answers a round trip within `budget` (the breaker's probe): on the
    /// node owning `key` (Redis Cluster), else on a fresh connection, whose success retires
    /// the connections opened before it (they may be dead while Redis is not).
    pub async fn probe(&self, key: Option<&str>, budget: Duration) -> Result<(), StoreError> {
        match self {
            Store::Redis(s) => s.probe(key, budget).await,
            Store::Embedded(_) => Ok(()),
        }
    }

    /// Whether the store answers (readiness).
    pub async fn ping(&self) -> Result<(), StoreError> {
        match self {
            Store::Embedded(_) => Ok(()),
            Store::Redis(s) => s.ping().await,
        }
    }

    /// Every plan and client, with the catalog version they were read at (or after).
    pub async fn catalog_dump(&self) -> Result<CatalogDump, StoreError> {
        match self {
            Store::Embedded(s) => Ok(s.catalog_dump()),
            Store::Redis(s) => s.catalog_dump().await,
        }
    }

    /// What changed after version `since` of the catalog `epoch`; a catalog of another
    /// epoch is answered with all of it.
    pub async fn catalog_changes(
        &self,
        since: u64,
        epoch: Option<&str>,
    ) -> Result<CatalogChanges, StoreError> {
        match self {
            Store::Embedded(s) => Ok(s.catalog_changes(since, epoch)),
            Store::Redis(s) => s.catalog_changes(since, epoch).await,
        }
    }

    /// Replaces the store's catalog with `mirror` (its epoch, version and records), in one
    /// atomic step, only if the store is still at `seen` (epoch, version). `false`: it
    /// moved (another gateway restored it, or it was written), and nothing was written.
    pub async fn catalog_restore(
        &self,
        seen: (Option<&str>, u64),
        mirror: &CatalogDump,
    ) -> Result<bool, StoreError> {
        match self {
            Store::Embedded(s) => {
                let seen = (seen.0.map(str::to_string), seen.1);
                let mirror = mirror.clone();
                off_worker(s, move |s| {
                    s.catalog_restore((seen.0.as_deref(), seen.1), &mirror)
                })
                .await
            }
            Store::Redis(s) => s.catalog_restore(seen, mirror).await,
        }
    }

    /// One atomic catalog write with its audit entry: all of it happens, or none of it.
    pub async fn catalog_write(
        &self,
        write: &CatalogWrite,
        audit: &Audit,
    ) -> Result<WriteOutcome, StoreError> {
        match self {
            Store::Embedded(s) => {
                let (write, audit) = (write.clone(), audit.clone());
                off_worker(s, move |s| s.catalog_write(&write, &audit)).await
            }
            Store::Redis(s) => s.catalog_write(write, audit).await,
        }
    }

    pub async fn plan(&self, name: &str) -> Result<Option<Versioned<PlanRecord>>, StoreError> {
        match self {
            Store::Embedded(s) => Ok(s.plan(name)),
            Store::Redis(s) => s.plan(name).await,
        }
    }

    pub async fn plans(&self) -> Result<Vec<Versioned<PlanRecord>>, StoreError> {
        match self {
            Store::Embedded(s) => Ok(s.plans()),
            Store::Redis(s) => s.plans().await,
        }
    }

    pub async fn client(&self, id: &str) -> Result<Option<Versioned<ClientRecord>>, StoreError> {
        match self {
            Store::Embedded(s) => Ok(s.client(id)),
            Store::Redis(s) => s.client(id).await,
        }
    }

    /// Up to `limit` clients in id order, after the id `after` (cursor pagination).
    pub async fn clients_page(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<ClientsPage, StoreError> {
        match self {
            Store::Embedded(s) => Ok(s.clients_page(after, limit)),
            Store::Redis(s) => s.clients_page(after, limit).await,
        }
    }

    pub async fn safety(&self) -> Result<Option<Versioned<SafetyRecord>>, StoreError> {
        match self {
            Store::Embedded(s) => Ok(s.safety()),
            Store::Redis(s) => s.safety().await,
        }
    }

    /// The newest `limit` audit entries, newest first.
    pub async fn audit(&self, limit: usize) -> Result<Vec<AuditEntry>, StoreError> {
        match self {
            Store::Embedded(s) => Ok(s.audit(limit)),
            Store::Redis(s) => s.audit(limit).await,
        }
    }

    /// Records a change made outside the catalog (a bucket refill).
    pub async fn record_audit(&self, entry: AuditEntry) -> Result<(), StoreError> {
        match self {
            Store::Embedded(s) => off_worker(s, move |s| s.record_audit(entry)).await,
            Store::Redis(s) => s.record_audit(&entry).await,
        }
    }

    /// Adds shadow-mode comparison counts (client, compared, disagreed).
    pub async fn shadow_add(&self, counts: &[(String, u64, u64)]) -> Result<(), StoreError> {
        match self {
            Store::Embedded(s) => {
                s.shadow_add(counts);
                Ok(())
            }
            Store::Redis(s) => s.shadow_add(counts).await,
        }
    }

    /// Shadow-mode counts per client (client, compared, disagreed), from every gateway.
    pub async fn shadow_counts(&self) -> Result<Vec<(String, u64, u64)>, StoreError> {
        match self {
            Store::Embedded(s) => Ok(s.shadow_counts()),
            Store::Redis(s) => s.shadow_counts().await,
        }
    }

    pub async fn shadow_reset(&self) -> Result<(), StoreError> {
        match self {
            Store::Embedded(s) => {
                s.shadow_reset();
                Ok(())
            }
            Store::Redis(s) => s.shadow_reset().await,
        }
    }

    /// Flushes a region's demand for a sharded client and returns the current shares,
    /// recomputed from every region's demand once per period.
    pub async fn reconcile(&self, r: &Reconcile<'_>) -> Result<ShardState, StoreError> {
        match self {
            Store::Embedded(s) => Ok(s.reconcile(r)),
            Store::Redis(s) => s.reconcile(r).await,
        }
    }

    /// A sharded client's shares without changing anything, and its recent history.
    pub async fn shard_view(
        &self,
        client: &ClientId,
    ) -> Result<(Option<ShardState>, Vec<serde_json::Value>), StoreError> {
        match self {
            Store::Embedded(s) => Ok(s.shard_view(client)),
            Store::Redis(s) => s.shard_view(client).await,
        }
    }

    /// Whether this is the embedded store: buckets in this process, limits for this one
    /// instance only.
    pub fn is_embedded(&self) -> bool {
        matches!(self, Store::Embedded(_))
    }

    /// Whether this is a Redis Cluster, whose nodes fail apart (a breaker per node).
    pub fn is_cluster(&self) -> bool {
        match self {
            Store::Embedded(_) => false,
            Store::Redis(s) => s.is_cluster(),
        }
    }

    /// Which node serves which slots: (first slot, last slot, "host:port") per range
    /// (Redis Cluster; none otherwise).
    pub async fn cluster_slots(&self) -> Result<Vec<(u16, u16, String)>, StoreError> {
        match self {
            Store::Embedded(_) => Ok(vec![]),
            Store::Redis(s) => s.cluster_slots().await,
        }
    }

    /// Connections open and idle, for the pool saturation metrics (one Redis server only).
    pub fn pool_state(&self) -> Option<(u32, u32)> {
        match self {
            Store::Embedded(_) => None,
            Store::Redis(s) => s.pool_state(),
        }
    }

    /// `SCRIPT LOAD`s the scripts, so the first requests already hit `EVALSHA` (Redis; the
    /// embedded store has none).
    pub async fn load_scripts(&self) -> Result<(), StoreError> {
        match self {
            Store::Embedded(_) => Ok(()),
            Store::Redis(s) => s.load_scripts().await,
        }
    }

    /// Forgets idle in-process buckets every few seconds, so memory tracks active clients
    /// (embedded; Redis expires idle buckets itself).
    pub fn spawn_evictor(&self) {
        if let Store::Embedded(s) = self {
            let store = Arc::clone(s);
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_secs(5));
                loop {
                    tick.tick().await;
                    store.evict_idle();
                }
            });
        }
    }

    /// What the start-up log says about the store.
    pub fn describe(&self) -> String {
        match self {
            Store::Embedded(_) => "embedded, single instance".to_string(),
            Store::Redis(s) => s.describe(),
        }
    }

    /// What the store keeps across its own restart, for the start-up log: the embedded
    /// store's buckets live in this process's memory, so a gateway restart forgets them
    /// ([`Persistence::Embedded`]); Redis is asked (every master of a cluster: the weakest
    /// answer is the cluster's). An error: Redis could not be reached, so nothing is known.
    pub async fn persistence(&self) -> Result<Persistence, StoreError> {
        match self {
            Store::Embedded(_) => Ok(Persistence::Embedded),
            Store::Redis(s) => s.persistence().await,
        }
    }
}

/// Runs an embedded-store call that writes the catalog file on a blocking thread, so an
/// fsync never stalls an async worker.
async fn off_worker<T: Send + 'static>(
    store: &Arc<EmbeddedStore>,
    f: impl FnOnce(&EmbeddedStore) -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StoreError> {
    let store = Arc::clone(store);
    tokio::task::spawn_blocking(move || f(&store))
        .await
        .map_err(|e| StoreError::File(format!("catalog file writer: {e}")))?
}
