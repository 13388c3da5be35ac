//! Fixtures shared by tollgate's integration tests and its load tool.
//!
//! [`FaultProxy`] sits between the gateway and a real `redis-server` and injects the
//! network faults an operator meets: a delay on every reply, connections that go silent
//! (a partition, or a failover that moves a name while the old peer keeps the socket),
//! resets, and refused connections. No iptables or tc: it is a plain TCP proxy on
//! loopback, run on its own thread so a stalled test runtime cannot stall it.

mod fault_proxy;

pub use fault_proxy::FaultProxy;
