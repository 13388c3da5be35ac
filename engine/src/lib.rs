//! tollgate's Redis bucket engine: how a take reaches Redis and comes back. See this
//! crate's README for how a take travels, why each layer exists and what it saves.
//!
//! Today it holds the connection layer: [`pipe`], the request path's pipelined connection
//! to one server (commands written on the caller's thread, replies read in order by one
//! task beside them), and [`pool`], the connections to one server (one pipelined link per
//! worker thread and its keeper, a bb8 pool for everything else) and how a dead one is
//! noticed and left behind. It imports nothing of the gateway.

mod budget;
mod error;
mod every;
pub mod keys;
pub mod limits;
pub mod pipe;
pub mod pool;
mod port;
pub mod redis;

pub use self::budget::Budget;
pub use self::error::{StoreError, StoreErrorKind};
pub use self::every::Every;
pub use self::keys::{key_in_slot, key_slot, state_field, StateGroups, CLUSTER_STATE_GROUPS};
pub use self::port::{BucketCalls, Buckets};
