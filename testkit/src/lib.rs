//! Fixtures shared by tollgate's integration tests and its load tool, one copy of each.
//!
//! - [`RedisServer`] and [`RedisCluster`]: `redis-server` processes on free ports, which a
//!   test or a scenario can stall (SIGSTOP), resume, kill, restart and inspect.
//! - [`GatewayProcess`]: the gateway's real binary as a child process, started by a
//!   [`Launcher`] from a [`GatewayConfig`], the one TOML builder for a gateway's
//!   configuration (plans, clients, routes, store, admin API, catalog file); the snippets
//!   tests layer on it are [`catalog_toml`] (a plan of one bucket),
//!   [`limits_catalog_toml`] (a plan of several limits), [`route_toml`] and [`admin_toml`].
//! - [`free_port`], [`on_a_free_port`] (start a child again on another port when someone
//!   took its port first: [`PortTaken`]), [`temp_dir`] (and [`clean_stale_dirs`]),
//!   [`command`] (a child that dies with its parent), [`signal`], [`wait_for_port`] (only
//!   the child's own listener counts), [`stop`]: the process plumbing underneath, for the
//!   load tool's own children too.
//! - [`FaultProxy`] sits between the gateway and a real `redis-server` and injects the
//!   network faults an operator meets: a delay on every reply, connections that go silent
//!   (a partition, or a failover that moves a name while the old peer keeps the socket),
//!   resets, and refused connections. No iptables or tc: it is a plain TCP proxy on
//!   loopback, run on its own thread so a stalled test runtime cannot stall it.
//! - [`h2_frames`]: HTTP/2 frames and header blocks written by hand, for attacks.
//! - [`FakeClock`]: a wall clock of the test's choosing for the gateway and `redis-server`
//!   alike (a preloaded library reading one offset file), which the test moves while they
//!   run: calendar quotas cross a month's end in seconds.
//!
//! Every fixture that can fail returns `anyhow::Result` (tests unwrap it, the load tool
//! reports it), except [`FaultProxy`], which panics; children are killed on drop, and
//! with the thread that started them.
//!
//! This crate does not depend on `tollgate` (tollgate dev-depends on it): the in-process
//! gateway of the tests stays with the tests.

mod config;
mod fake_clock;
mod fault_proxy;
mod gateway;
pub mod h2_frames;
mod ports;
mod process;
mod redis;

pub use config::{
    admin_toml, catalog_toml, key, limits_catalog_toml, route_toml, ClientDef, GatewayConfig,
    PlanDef, RouteDef, ADMIN_SECRET,
};
pub use fake_clock::FakeClock;
pub use fault_proxy::FaultProxy;
pub use gateway::{GatewayProcess, Launcher};
pub use ports::{free_port, on_a_free_port, PortTaken};
pub use process::{clean_stale_dirs, command, signal, stop, temp_dir, wait_for_port};
pub use redis::{RedisCluster, RedisServer};
pub use tempfile::TempDir;
