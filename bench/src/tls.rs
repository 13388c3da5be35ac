//! TLS for the `protocols` scenario: a CA of the tool's own and the leaves it signs
//! (rcgen), their files written as a deploy tool writes them (a new file renamed over
//! the old, key first), and the client side (rustls, verifying against that CA, no
//! session resumption, so every new connection is a full handshake and shows the leaf
//! the listener serves now).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

/// The name every leaf is for, and every client asks for (SNI).
pub const HOST: &str = "localhost";

/// The tool's CA.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    der: Vec<u8>,
    pem: String,
}

/// A leaf the CA signed, in PEM (the chain, leaf first), its key, and its DER (to know it
/// on the wire).
pub struct Leaf {
    pub cert_pem: String,
    pub key_pem: String,
    pub der: Vec<u8>,
}

impl Ca {
    pub fn new() -> anyhow::Result<Ca> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "tollgate-bench CA");
        let key = KeyPair::generate()?;
        let cert = params.self_signed(&key)?;
        Ok(Ca {
            der: cert.der().to_vec(),
            pem: cert.pem(),
            issuer: Issuer::new(params, key),
        })
    }

    /// A new leaf for [`HOST`] and 127.0.0.1, with a key of its own (ECDSA P-256).
    pub fn leaf(&self) -> anyhow::Result<Leaf> {
        let mut params = CertificateParams::new(vec![HOST.to_string(), "127.0.0.1".into()])?;
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, HOST);
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Leaf {
            cert_pem: format!("{}{}", cert.pem(), self.pem),
            key_pem: key.serialize_pem(),
            der: cert.der().to_vec(),
        })
    }

    /// A client configuration that trusts this CA alone, offering `alpn`, with no
    /// session resumption.
    pub fn client(&self, alpn: &[&[u8]]) -> anyhow::Result<Arc<rustls::ClientConfig>> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.der.clone().into())?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        config.resumption = rustls::client::Resumption::disabled();
        Ok(Arc::new(config))
    }
}

/// A certificate's two files.
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl CertFiles {
    /// `dir/name.crt` and `dir/name.key`, holding `leaf`.
    pub fn write(dir: &Path, name: &str, leaf: &Leaf) -> anyhow::Result<CertFiles> {
        let files = CertFiles {
            cert: dir.join(format!("{name}.crt")),
            key: dir.join(format!("{name}.key")),
        };
        files.replace(leaf)?;
        Ok(files)
    }

    /// Puts `leaf` in place: the key, then the certificate, each renamed over the old.
    pub fn replace(&self, leaf: &Leaf) -> anyhow::Result<()> {
        replace(&self.key, &leaf.key_pem)?;
        replace(&self.cert, &leaf.cert_pem)
    }

    /// The `[tls]` table serving them.
    pub fn toml(&self) -> String {
        format!(
            "[tls]\ncert_file = {:?}\nkey_file = {:?}\n",
            self.cert.to_string_lossy(),
            self.key.to_string_lossy()
        )
    }
}

fn replace(path: &Path, text: &str) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming over {}", path.display()))
}

/// A TLS session with `addr`, naming [`HOST`].
pub async fn connect(
    addr: SocketAddr,
    config: &Arc<rustls::ClientConfig>,
) -> std::io::Result<TlsStream<TcpStream>> {
    handshake(TcpStream::connect(addr).await?, config).await
}

/// [`connect`] from `from`, a local address of this host (e.g. `127.0.0.2`: to the gateway,
/// another client than one on `127.0.0.1`).
pub async fn connect_from(
    from: std::net::IpAddr,
    addr: SocketAddr,
    config: &Arc<rustls::ClientConfig>,
) -> std::io::Result<TlsStream<TcpStream>> {
    let socket = match from {
        std::net::IpAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        std::net::IpAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.bind(SocketAddr::new(from, 0))?;
    handshake(socket.connect(addr).await?, config).await
}

async fn handshake(
    tcp: TcpStream,
    config: &Arc<rustls::ClientConfig>,
) -> std::io::Result<TlsStream<TcpStream>> {
    tcp.set_nodelay(true)?;
    tokio_rustls::TlsConnector::from(Arc::clone(config))
        .connect(ServerName::try_from(HOST).expect("a DNS name"), tcp)
        .await
}

/// The leaf `addr` serves to a new connection now (a full handshake).
pub async fn served_leaf(
    addr: SocketAddr,
    config: &Arc<rustls::ClientConfig>,
) -> std::io::Result<Vec<u8>> {
    let tls = connect(addr, config).await?;
    tls.get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.to_vec())
        .ok_or_else(|| std::io::Error::other("no certificate served"))
}
