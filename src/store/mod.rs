//! The one store abstraction. Buckets and the catalog live either in this process (the
//! embedded store, for one instance) or in Redis (one server or a Redis Cluster, through
//! the same hash-tagged keys). Both sides run the same operations with the same arithmetic.
//!
//! The rest of the gateway speaks to a store through its ports (`ports.rs`), one small
//! trait per concern (buckets, shards, catalog records, audit, shadow counts, lifecycle),
//! which both backends implement, each in a file per concern. [`Store`] (`open.rs`) opens
//! one backend and hands out its ports. The request path's port, [`Buckets`], and what it
//! speaks in ([`Budget`], [`StoreError`], the state groups and hash slots of Redis keys,
//! a once-per-period gate [`Every`]) are the engine's (`tollgate_engine`), re-exported
//! here; on Redis the engine answers it. The store's own vocabulary lives in its files:
//! catalog records (`records.rs`), reconciliation (`shards.rs`), key names (`keys.rs`) and
//! in-process buckets (`local.rs`).

mod embedded;
mod keys;
mod local;
mod open;
mod persistence;
mod ports;
pub mod records;
mod redis;
mod shards;
mod usage;

pub use self::keys::Keys;
pub use self::local::{LocalBuckets, LocalLimits, LocalOp, Probe};
pub use self::open::Store;
pub use self::persistence::Persistence;
pub use self::ports::{
    AuditLog, BucketCalls, Buckets, CatalogAt, CatalogRecords, Claims, KeyUse, Lifecycle,
    PoolState, ShadowCount, ShadowCounts, ShardView, Shards, SlotRange, StoreKind, UsageHistory,
};
pub use self::records::ClientsPage;
pub use self::shards::{Reconcile, RegionShare, ShardState};
pub use self::usage::{
    day_name, decode_checkpoint, encode_checkpoint, Checkpoint, Checkpointed, UsageBatch,
    UsageCounts, UsageEntry, UsageRow, DAY_S, HOUR_S,
};
pub use tollgate_engine::{
    key_in_slot, key_slot, state_field, Budget, Every, StateGroups, StoreError,
    CLUSTER_STATE_GROUPS,
};
