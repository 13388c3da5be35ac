//! WebSocket pass-through: an upgrade request is decided as any request is (its cost taken
//! once, at the handshake), then its connection is relayed both ways, byte for byte, until
//! either side ends it, it idles, or the gateway stops (the book, "WebSocket").
//!
//! [`Upgrade`] tells an upgrade from other requests and checks it before its decision (no
//! body; the client's `max_connections`); [`respond`] opens a connection of the gateway's
//! own to a replica ([`handshake`]), passes the client's handshake on (its
//! `Sec-WebSocket-Key` with it: the service's `Sec-WebSocket-Accept` answers the client)
//! and, on `101`, relays ([`relay`], which follows frame boundaries with [`frames`] only to
//! close cleanly). [`Relays`] is what every relay of the process shares: the count per
//! client, the idle timeout, and the signal that closes them all at a stop.

mod frames;
mod handshake;
mod relay;
mod relays;
mod upgrade;

pub use relays::{close_on_sigterm, Relays};
pub use upgrade::{respond, Upgrade};
