//! tollgate's Redis bucket engine: how a take reaches Redis and comes back. See this
//! crate's README for how a take travels, why each layer exists and what it saves.
//!
//! Its public surface is the gateway's [`Buckets`] port, with the values it speaks in:
//! [`limits`], the arithmetic both stores run (a token bucket, a quota's window, one
//! request's take from all the limits that apply to it, and the [`Ruling`](limits::Ruling)
//! it comes to), [`Budget`], [`StoreError`], and where state lives ([`keys`]). Behind the
//! port, for Redis: [`redis::RedisBuckets`], which queues takes behind a call in flight
//! (coalesce), gathers a worker's takes into one script call (gather), and replays the
//! script's answer for each take; over [`redis::Backend`] (one server or a cluster), whose
//! request path is [`pipe`], the pipelined connection of a worker thread, and whose other
//! calls go through [`pool`]. It imports nothing of the gateway.

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
