//! The awc clients replicas are reached with: one over plain TCP, one over TLS (for
//! `https://` replicas), both under [`super::wire`]. Each worker's forwards have a pair
//! (their pools keep connections alive), and so has the health checker.

use std::sync::Arc;

use super::{tls, wire};
use crate::configuration::UpstreamSettings;
use crate::domain::Upstream;

pub struct Clients {
    plain: awc::Client,
    tls: awc::Client,
    /// The TLS client's configuration, for connections opened without awc (WebSocket
    /// upgrades to `https://` replicas).
    tls_config: Arc<rustls::ClientConfig>,
}

impl Clients {
    /// A replica that does not accept a connection (and, over TLS, finish the handshake)
    /// within `connect_timeout` has failed; a pooled connection unused for `idle_timeout`
    /// is closed before a service closes it itself.
    pub fn new(s: &UpstreamSettings) -> Result<Clients, rustls::Error> {
        let tls_config = tls::client_config(&s.trust)?;
        Ok(Clients {
            plain: wire::client(s.connect_timeout, s.idle_timeout),
            tls: tls::client(s.connect_timeout, s.idle_timeout, Arc::clone(&tls_config)),
            tls_config,
        })
    }

    /// How a connection to an `https://` replica is made and verified.
    pub fn tls_config(&self) -> &Arc<rustls::ClientConfig> {
        &self.tls_config
    }

    /// The client whose connections `upstream` takes.
    #[inline]
    pub fn of(&self, upstream: &Upstream) -> &awc::Client {
        if upstream.tls() {
            &self.tls
        } else {
            &self.plain
        }
    }
}
