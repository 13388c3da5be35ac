//! tollgate: an API gateway that enforces one token bucket per client, once, at the edge.
//!
//! How the pieces fit, in request order:
//! - [`proxy::Guard`] (the proxy's service) brings the path to its normal form
//!   ([`proxy::NormalPath`]), hashes the API key and finds the client in the catalog
//!   mirror (memory only), picks the route, and asks the limiter for a decision: one
//!   atomic call into the [`store`] (a Redis script, or the same arithmetic in process),
//!   bounded by `redis.timeout_ms`, failing open past it.
//! - Denied requests are answered `429` by the gateway; admitted ones are streamed to
//!   one replica with awc, in the same service.
//! - [`trace`] propagates W3C Trace Context to the upstream and, when configured,
//!   exports the request's spans over OTLP.
//! - [`startup::Application`] wires it together from [`configuration::Settings`];
//!   [`reload`] swaps the routes when `SIGHUP` asks for the configuration to be read again.
//!
//! The modules are floors (the book, "Architecture"; checked by `.ci/layers`): [`domain`] <-
//! [`metrics`] / [`tasks`] <- [`configuration`] <- [`store`] <- `catalog` <- `limiter` <- [`proxy`] /
//! [`admin`] / [`ops`] <- [`startup`] / [`reload`]. Only what the binary, the tests and the load tool use
//! is public.

pub mod admin;
mod catalog;
pub mod cli;
pub mod configuration;
pub mod domain;
mod error;
pub mod import;
mod limiter;
pub mod listen;
pub mod metrics;
pub mod ops;
pub mod proxy;
pub mod reload;
pub mod startup;
pub mod state;
pub mod store;
pub mod sync;
pub mod tasks;
pub mod telemetry;
pub mod tls;
pub mod trace;
pub mod webhooks;
