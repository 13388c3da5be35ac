//! The store's ports: one small trait per concern, each implemented by the embedded store
//! and by Redis. The request path's, [`Buckets`], is the engine's public surface
//! (`tollgate_engine`), re-exported here. Callers name the port they need (the limiter holds [`Buckets`], the admin
//! API [`CatalogRecords`] and [`AuditLog`], ...) and never which backend answers.
//!
//! | port               | what it keeps                                      | request path |
//! |--------------------|----------------------------------------------------|--------------|
//! | [`Buckets`]        | every client's limits: take, adjust, peek, refill   | yes          |
//! | [`Shards`]         | a hot client's regional shares, reconciled         | no           |
//! | [`CatalogRecords`] | plans, clients and safety settings, versioned      | no           |
//! | [`AuditLog`]       | who changed what                                   | no           |
//! | [`ShadowCounts`]   | shadow mode's comparisons, from every gateway      | no           |
//! | [`UsageHistory`]   | per client, limit and hour: admitted, refused, cost | no           |
//! | [`Lifecycle`]      | start-up, health, readiness, what the store is      | no           |
//!
//! The request path's port is not `Send`: a take joins the calling worker's batch and
//! connection (thread-local), so its future stays on that worker. The others are, so
//! background tasks may run them anywhere.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::future::BoxFuture;

use super::records::{
    ApplyOutcome, Audit, AuditEntry, CatalogApply, CatalogChanges, CatalogDump, CatalogWrite,
    ClientRecord, ClientsPage, ImportChunk, ImportOutcome, ImportProgress, KeyFilterHead,
    KeyFilterStep, KeyLookup, PlanRecord, SafetyRecord, Versioned, Wants, WriteOutcome,
};
use super::shards::{Reconcile, ShardState};
use super::usage::{Checkpoint, Checkpointed, UsageBatch, UsageRow};
use super::{Persistence, StoreError};
use crate::domain::{ClientId, KeyHash};
pub use tollgate_engine::redis::SlotRange;
pub use tollgate_engine::{BucketCalls, Buckets};

/// A hot client's regional shares of its bucket, recomputed from every region's demand.
#[async_trait]
pub trait Shards: Send + Sync {
    /// Flushes a region's demand for a sharded client and returns the current shares,
    /// recomputed from every region's demand once per period.
    async fn reconcile(&self, r: &Reconcile<'_>) -> Result<ShardState, StoreError>;

    /// A sharded client's shares without changing anything, and its recent history.
    async fn view(&self, client: &ClientId) -> Result<ShardView, StoreError>;
}

/// A sharded client's shares as they stand, and how they moved.
#[derive(Debug, Default)]
pub struct ShardView {
    /// `None`: the client has not been reconciled yet.
    pub state: Option<ShardState>,
    /// The recent reconciliations, newest last.
    pub history: Vec<serde_json::Value>,
}

/// The catalog's records: plans, clients, safety settings, each with its revision, and
/// the change feed gateways follow.
#[async_trait]
pub trait CatalogRecords: Send + Sync {
    /// Every plan and client, with the catalog version they were read at (or after).
    async fn dump(&self) -> Result<CatalogDump, StoreError>;

    /// What changed after version `since` of the catalog `epoch`, with the client records
    /// `wants` names; when the feed cannot say (a catalog of another epoch, a gap), a
    /// reload.
    async fn changes(
        &self,
        since: u64,
        epoch: Option<&str>,
        wants: Wants<'_>,
    ) -> Result<CatalogChanges, StoreError>;

    /// Writes one chunk of a bulk import, atomically with the import's progress.
    async fn import(&self, chunk: &ImportChunk<'_>) -> Result<ImportOutcome, StoreError>;

    /// How far the import `import` got (nothing yet: the default).
    async fn import_progress(&self, import: &str) -> Result<ImportProgress, StoreError>;

    /// Replaces the store's catalog with `mirror` (its epoch, version and records), in one
    /// atomic step, only if the store is still at `seen`. `false`: it moved (another
    /// gateway restored it, or it was written), and nothing was written.
    async fn restore(&self, seen: CatalogAt<'_>, mirror: &CatalogDump) -> Result<bool, StoreError>;

    /// Many catalog writes as one (see [`CatalogApply`]): all of them, or none when the
    /// catalog moved from the version they were computed against.
    async fn apply(&self, apply: &CatalogApply<'_>) -> Result<ApplyOutcome, StoreError>;

    /// One atomic catalog write with its audit entry: all of it happens, or none of it.
    async fn write(&self, write: &CatalogWrite, audit: &Audit) -> Result<WriteOutcome, StoreError>;

    async fn plan(&self, name: &str) -> Result<Option<Versioned<PlanRecord>>, StoreError>;

    async fn plans(&self) -> Result<Vec<Versioned<PlanRecord>>, StoreError>;

    async fn client(&self, id: &str) -> Result<Option<Versioned<ClientRecord>>, StoreError>;

    /// The client whose key has this hash, with the catalog's epoch and version, read in
    /// one round trip: what a gateway that does not hold the whole catalog asks on a key it
    /// has not cached. Read on the caller's worker's own connection when it has one, which
    /// has `near_within` to answer; then (or else) off the request path.
    async fn client_by_key(
        &self,
        hash: &KeyHash,
        near_within: Duration,
    ) -> Result<KeyLookup, StoreError>;

    /// One step of building the store's filter of every key (a Bloom filter, see
    /// `lua/key_filter.lua`), reading up to `per_step` keys; a filter of `bits` bits is
    /// started if the store has none. Steps of several gateways share one build.
    async fn key_filter_step(&self, bits: u64, per_step: u64) -> Result<KeyFilterStep, StoreError>;

    /// The key filter, if the store has one that holds every key.
    async fn key_filter_head(&self) -> Result<Option<KeyFilterHead>, StoreError>;

    /// Up to `len` bytes of the key filter from byte `offset` (bit n is bit `7 - n % 8` of
    /// byte `n / 8`, as Redis numbers a bitmap's bits); fewer past its end.
    async fn key_filter_bytes(&self, offset: u64, len: u64) -> Result<Vec<u8>, StoreError>;

    /// Up to `limit` clients in id order, after the id `after` (cursor pagination).
    async fn clients_page(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<ClientsPage, StoreError>;

    async fn safety(&self) -> Result<Option<Versioned<SafetyRecord>>, StoreError>;
}

/// Where a catalog stood when it was read: its epoch (`None`: it has never been written)
/// and its version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CatalogAt<'a> {
    pub epoch: Option<&'a str>,
    pub version: u64,
}

/// Who changed what, newest first.
#[async_trait]
pub trait AuditLog: Send + Sync {
    /// The newest `limit` entries, newest first.
    async fn recent(&self, limit: usize) -> Result<Vec<AuditEntry>, StoreError>;

    /// Records a change made outside the catalog (a bucket refill).
    async fn record(&self, entry: AuditEntry) -> Result<(), StoreError>;
}

/// When each API key was last used, by any gateway: written in batches off the request
/// path (`catalog::Catalog::flush_key_use`), read by the admin API. Members are
/// `<client>/<key_id>`.
#[async_trait]
pub trait KeyUse: Send + Sync {
    /// Records that these keys were used at these times (unix s); a member keeps its
    /// latest time.
    async fn touch(&self, uses: &[(String, u64)]) -> Result<(), StoreError>;

    /// When each member was last used (unix s), in order; `None`: never seen.
    async fn last_used(&self, members: &[String]) -> Result<Vec<Option<u64>>, StoreError>;

    /// Forgets members (revoked keys, deleted clients).
    async fn forget(&self, members: &[String]) -> Result<(), StoreError>;
}

/// Names claimed once by the whole fleet: the first gateway to claim a name within its
/// time holds it (a quota warning is sent by the gateway that claims it, so by one).
#[async_trait]
pub trait Claims: Send + Sync {
    /// Claims `name` for `ttl`, as `holder` (this gateway's id); `true` when this caller
    /// holds it, also when its own claim's reply was lost and the claim is asked again.
    async fn claim(&self, name: &str, holder: &str, ttl: Duration) -> Result<bool, StoreError>;
}

/// Shadow mode's comparisons per client, added up from every gateway.
#[async_trait]
pub trait ShadowCounts: Send + Sync {
    /// Adds comparison counts.
    async fn add(&self, counts: &[ShadowCount]) -> Result<(), StoreError>;

    /// Every client's counts.
    async fn counts(&self) -> Result<Vec<ShadowCount>, StoreError>;

    /// Forgets every count.
    async fn reset(&self) -> Result<(), StoreError>;
}

/// Usage history: per client, per limit, per UTC hour, what every gateway counted
/// (`limiter::UsageTally`, flushed in batches off the request path), kept
/// `usage.retention_days`; read by the admin API.
#[async_trait]
pub trait UsageHistory: Send + Sync {
    /// Adds a batch's counts. Idempotent: a batch of a gateway already added (by its
    /// `gateway` and `seq`) adds nothing, so a batch whose reply was lost may be sent again.
    async fn add(&self, batch: &UsageBatch) -> Result<(), StoreError>;

    /// Keeps what `gateway` holds and has not yet added in place of what it kept before
    /// (unless [`Checkpoint::Same`]), and notes it alive; `noted`: it was noted before, so
    /// finding it not means it was adopted ([`Checkpointed::Adopted`], nothing written).
    /// A store that dies with its gateway (the embedded one) keeps nothing.
    async fn checkpoint(
        &self,
        gateway: &str,
        held: Checkpoint<'_>,
        noted: bool,
    ) -> Result<Checkpointed, StoreError>;

    /// Takes the checkpoint of one gateway silent for longer than `grace` (dead, or cut
    /// off), or of one whose adopter went silent before releasing it: its id and what it
    /// held, to add on its behalf ([`UsageHistory::add`], its batches in order with their
    /// own numbers: should it come back, it adds them too, and each is added once), then
    /// [`UsageHistory::release`]. `None` when there is none.
    async fn adopt(&self, grace: Duration) -> Result<Option<(String, Vec<u8>)>, StoreError>;

    /// Forgets the adopted checkpoint of `gateway`, once its batches are added.
    async fn release(&self, gateway: &str) -> Result<(), StoreError>;

    /// Forgets `gateway`, which stops holding nothing: no one waits for it.
    async fn retire(&self, gateway: &str) -> Result<(), StoreError>;

    /// What `client` counted in the hours from `from_s` (inclusive) to `to_s` (exclusive),
    /// unix seconds, every gateway summed: one row per limit and hour with counts, ordered
    /// by hour then limit.
    async fn read(
        &self,
        client: &ClientId,
        from_s: u64,
        to_s: u64,
    ) -> Result<Vec<UsageRow>, StoreError>;
}

/// How often the gateway and a client's service agreed, for one client.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShadowCount {
    pub client: String,
    /// Requests both judged.
    pub compared: u64,
    /// Of those, the ones they judged apart.
    pub disagreed: u64,
}

/// The store as a whole: what it is, whether it answers, and its start-up chores.
#[async_trait]
pub trait Lifecycle: Send + Sync {
    /// What kind of store this is.
    fn kind(&self) -> StoreKind;

    /// What the start-up log says about the store.
    fn describe(&self) -> String;

    /// Whether the store answers a round trip within `budget` (the breaker's probe): on the
    /// node owning `key` (Redis Cluster), else on a fresh connection, whose success retires
    /// the connections opened before it (they may be dead while Redis is not).
    async fn probe(&self, key: Option<&str>, budget: Duration) -> Result<(), StoreError>;

    /// Whether the store answers (readiness).
    async fn ping(&self) -> Result<(), StoreError>;

    /// Loads the scripts, so the first requests already hit `EVALSHA` (none to load in
    /// the embedded store).
    async fn load_scripts(&self) -> Result<(), StoreError>;

    /// Which node serves which slots (Redis Cluster; none otherwise).
    async fn cluster_slots(&self) -> Result<Vec<SlotRange>, StoreError>;

    /// Connections open and idle, for the pool saturation metrics (one Redis server only).
    fn pool(&self) -> Option<PoolState>;

    /// What the store keeps across its own restart, for the start-up log: the embedded
    /// store's buckets live in this process's memory, so a gateway restart forgets them
    /// ([`Persistence::Embedded`]); Redis is asked (every master of a cluster: the weakest
    /// answer is the cluster's). An error: Redis could not be reached, so nothing is known.
    async fn persistence(&self) -> Result<Persistence, StoreError>;

    /// The store's own long-lived chore, if it has one (the embedded store forgets idle
    /// buckets, so memory tracks active clients; Redis expires them itself).
    fn housekeeping(self: Arc<Self>) -> Option<BoxFuture<'static, ()>>;
}

/// What kind of store answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreKind {
    /// Buckets in this process: limits for this one instance only.
    Embedded,
    /// One Redis server.
    Redis,
    /// A Redis Cluster, whose nodes fail apart (a breaker per node).
    Cluster,
}

/// A connection pool's size now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolState {
    pub open: u32,
    pub idle: u32,
}
