//! The Redis side of the store: one `EVALSHA` per decision, a scripted catalog write, and
//! a change feed that gateways poll instead of reloading the catalog.

mod backend;
mod coalesce;
mod pool;

pub(super) use self::backend::RedisStore;
