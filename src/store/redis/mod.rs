//! The Redis side of the store: a scripted catalog write, and a change feed that gateways
//! poll instead of reloading the catalog; every client's limits are the engine's
//! (`tollgate_engine::redis::RedisBuckets`, one `EVALSHA` per batch of decisions).
//!
//! `backend.rs` holds [`RedisStore`], which shares the engine's connections to Redis
//! (`tollgate_engine::redis::Backend`: one server or a cluster); each of the store's ports
//! is implemented in a file of its own (the `Buckets` port is the engine's `RedisBuckets`,
//! which `Store` hands out as it is): `catalog.rs`, `audit.rs`, `shadow.rs`, `shards.rs`
//! and `lifecycle.rs` (with `persistence.rs`: what Redis keeps across its restart).
//! `arithmetic.rs` and `script_paths.rs` test the engine's script against the embedded
//! store's arithmetic.

#[cfg(test)]
mod arithmetic;
mod audit;
mod backend;
mod catalog;
mod claims;
mod key_use;
mod lifecycle;
mod persistence;
#[cfg(test)]
mod script_paths;
mod shadow;
mod shards;
mod usage;

pub(super) use self::backend::RedisStore;
