//! Ports on 127.0.0.1.

use std::net::TcpListener;

/// A port nobody listens on right now.
pub fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}
