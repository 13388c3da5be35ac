//! TLS to `https://` replicas, put *between* the TCP connection and [`Wire`]: awc's own TLS
//! (`Connector::rustls_0_23`) would wrap the connection after its connector service, so
//! the wrapper would sit under TLS and read ciphertext, and its fixes (interim responses,
//! bodiless and close-delimited heads, truncation) would be lost. Here the connector
//! service itself connects, shakes hands, and wraps the plaintext stream.
//!
//! awc sends an `https` URL to its TLS pool (and fails with `SslIsNotSupported` without
//! one), so the client built here is given `http` URLs with the port written out
//! ([`crate::domain::Upstream::uri`]); its pool is its own, so plain and TLS connections
//! to one authority never mix. The handshake runs inside the connector service, so
//! `upstream.connect_timeout_ms` bounds DNS, TCP connect and handshake together.
//!
//! Verification is rustls's (webpki): the chain must lead to a root of
//! `upstream.ca_file` or the system's bundle, be valid now, and name the replica's host
//! (a DNS name, sent as SNI, or an IP address, matched against the certificate's IP
//! addresses and not sent). TLS 1.2 and 1.3; ALPN offers `http/1.1` only, the one
//! protocol awc's HTTP/1.1 path and the wrapper speak.

use std::fmt;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use actix_service::Service;
use actix_tls::connect::{ConnectError, ConnectInfo, Connection, Resolver};
use actix_web::rt::net::{ActixStream, TcpStream};
use awc::error::SendRequestError;
use awc::http::Uri;
use futures_util::future::LocalBoxFuture;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf, Ready};
use tokio_rustls::TlsConnector;

use super::wire::{self, Wire};
use crate::configuration::TrustRoots;
use crate::domain::server_name;
use crate::error::UpstreamTls;

/// The rustls client every TLS connection to a replica is made with.
pub fn client_config(trust: &TrustRoots) -> Result<Arc<rustls::ClientConfig>, rustls::Error> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])?
        .with_root_certificates(Arc::clone(&trust.store))
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// An awc client (as [`wire::client`]) whose every connection is TLS under [`Wire`]: for
/// the `http` URLs of `https://` replicas only (see the module doc).
pub fn client(
    connect_timeout: Duration,
    idle_timeout: Duration,
    config: Arc<rustls::ClientConfig>,
) -> awc::Client {
    let connect = TlsConnect {
        tcp: actix_tls::connect::Connector::new(Resolver::default()).service(),
        tls: TlsConnector::from(config),
    };
    wire::client_over(connect, connect_timeout, idle_timeout)
}

/// What failed, when a try failed in the TLS handshake with its replica.
pub fn failure(e: &SendRequestError) -> Option<UpstreamTls> {
    let SendRequestError::Connect(awc::error::ConnectError::Io(io)) = e else {
        return None;
    };
    io_failure(io)
}

/// [`failure`], from the I/O error of a connection opened without awc (a WebSocket's).
pub fn io_failure(io: &io::Error) -> Option<UpstreamTls> {
    // tokio-rustls hands rustls's error on as the source of an `InvalidData` I/O error.
    let tls = io.get_ref()?.downcast_ref::<rustls::Error>()?;
    Some(match tls {
        rustls::Error::InvalidCertificate(_)
        | rustls::Error::NoCertificatesPresented
        | rustls::Error::UnsupportedNameType => UpstreamTls::Certificate,
        _ => UpstreamTls::Handshake,
    })
}

/// The connector service: TCP connect (awc's own service), then the handshake with the
/// replica's host as the name, then the wrapper on the plaintext stream.
#[derive(Clone)]
struct TlsConnect<S> {
    tcp: S,
    tls: TlsConnector,
}

impl<S> Service<ConnectInfo<Uri>> for TlsConnect<S>
where
    S: Service<ConnectInfo<Uri>, Response = Connection<Uri, TcpStream>, Error = ConnectError>,
    S::Future: 'static,
{
    type Response = Connection<Uri, Wire<TlsIo>>;
    type Error = ConnectError;
    type Future = LocalBoxFuture<'static, Result<Self::Response, ConnectError>>;

    actix_service::forward_ready!(tcp);

    fn call(&self, req: ConnectInfo<Uri>) -> Self::Future {
        // `Upstream::parse` refused hosts that are not names, so this holds; an I/O error
        // otherwise (awc panics on `ConnectError::InvalidInput`).
        let name = ServerName::try_from(server_name(req.hostname()).to_owned()).map_err(|_| {
            ConnectError::Io(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the upstream's host is not a DNS name or an IP address",
            ))
        });
        let tcp = self.tcp.call(req);
        let tls = self.tls.clone();
        Box::pin(async move {
            let name = name?;
            let (io, conn) = tcp.await?.replace_io(());
            let stream = tls.connect(name, io).await.map_err(ConnectError::Io)?;
            Ok(conn.replace_io(Wire::new(TlsIo(stream), true)).1)
        })
    }
}

/// A TLS connection to a replica, as awc's connector wants its streams (`ActixStream`,
/// which tokio-rustls's client stream is not).
pub struct TlsIo(tokio_rustls::client::TlsStream<TcpStream>);

impl AsyncRead for TlsIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

/// The socket's readiness, as actix-tls's server-side stream reports it.
impl ActixStream for TlsIo {
    fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<Ready>> {
        <TcpStream as ActixStream>::poll_read_ready(self.0.get_ref().0, cx)
    }

    fn poll_write_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<Ready>> {
        <TcpStream as ActixStream>::poll_write_ready(self.0.get_ref().0, cx)
    }
}

impl fmt::Debug for TlsIo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (tcp, session) = self.0.get_ref();
        f.debug_struct("TlsIo")
            .field("peer", &tcp.peer_addr().ok())
            .field("version", &session.protocol_version())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn connect_error(e: io::Error) -> SendRequestError {
        SendRequestError::Connect(awc::error::ConnectError::Io(e))
    }

    fn rustls_error(e: rustls::Error) -> SendRequestError {
        connect_error(io::Error::new(io::ErrorKind::InvalidData, e))
    }

    #[test]
    fn certificate_errors_are_told_from_other_handshake_failures_and_from_tcp_ones() {
        use rustls::CertificateError::{Expired, NotValidForName, UnknownIssuer};
        for e in [UnknownIssuer, NotValidForName, Expired] {
            assert_eq!(
                failure(&rustls_error(rustls::Error::InvalidCertificate(e))),
                Some(UpstreamTls::Certificate)
            );
        }
        assert_eq!(
            failure(&rustls_error(rustls::Error::AlertReceived(
                rustls::AlertDescription::HandshakeFailure
            ))),
            Some(UpstreamTls::Handshake)
        );
        assert_eq!(
            failure(&connect_error(io::ErrorKind::ConnectionRefused.into())),
            None
        );
        assert_eq!(
            failure(&SendRequestError::Connect(
                awc::error::ConnectError::Timeout
            )),
            None
        );
    }
}
