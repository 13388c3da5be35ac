//! The Redis side of the store: one `EVALSHA` per decision, a scripted catalog write, and
//! a change feed that gateways poll instead of reloading the catalog.
//!
//! `backend.rs` holds [`RedisStore`] and how it reaches Redis (`pool.rs`: connections to
//! one server, `pipe.rs`: the request path's); each of the store's ports is implemented
//! in a file of its own: `buckets.rs` (takes, through `coalesce.rs`), `catalog.rs`,
//! `audit.rs`, `shadow.rs`, `shards.rs` and `lifecycle.rs` (with `persistence.rs`: what
//! Redis keeps across its restart).

#[cfg(test)]
mod arithmetic;
mod audit;
mod backend;
mod catalog;
mod lifecycle;
mod limits;
mod persistence;
#[cfg(test)]
mod script_paths;
mod shadow;
mod shards;

pub(super) use self::backend::RedisStore;
