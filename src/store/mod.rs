//! The one store abstraction. Buckets and the catalog live either in this process (the
//! embedded store, for one instance) or in Redis (one server or a Redis Cluster, through
//! the same hash-tagged keys). Both sides run the same operations with the same arithmetic.
//!
//! [`Store`] (`dispatch.rs`) is what the rest of the gateway holds; the backends sit
//! beside it, each split by concern (buckets, catalog, audit, shadow counts, shards).
//! The vocabulary both share lives in its own files: errors (`error.rs`), catalog records
//! (`records.rs`), reconciliation (`shards.rs`), key names (`keys.rs`), in-process
//! buckets (`local.rs`) and a once-per-period gate (`every.rs`).

mod budget;
mod dispatch;
mod embedded;
mod error;
mod every;
mod keys;
mod local;
pub mod records;
mod redis;
mod shards;

pub use self::budget::Budget;
pub use self::dispatch::Store;
pub use self::error::StoreError;
pub use self::every::Every;
pub use self::keys::{key_in_slot, key_slot, state_field, Keys, StateGroups, CLUSTER_STATE_GROUPS};
pub use self::local::{LocalBuckets, LocalLimits, LocalOp, Probe};
pub use self::records::ClientsPage;
pub use self::redis::Persistence;
pub use self::shards::{Reconcile, RegionShare, ShardState};
