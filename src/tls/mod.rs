//! TLS on the listeners (the book, "TLS"): each listener's certificates, chosen per handshake
//! by the name the client asks for (SNI), and loaded again without a restart.
//!
//! A listener's rustls configuration is built once, with a [`Served`] as its certificate
//! resolver; the resolver reads the certificates of the moment from an [`ArcSwap`], so a
//! reload swaps one pointer: handshakes after it get the new certificates, and connections
//! already open keep the session they have (a certificate matters only during a handshake).
//! A reload reads every file of the listener, and either all of them load (each chain
//! parses, each key matches its leaf) and are swapped in together, or none is: the old
//! certificates keep serving, and the failure is logged and counted
//! (`tollgate_tls_reload_failing`).
//!
//! Reloads are asked for by `SIGHUP` ([`crate::reload`]) and, every `tls.watch_ms`, by a
//! change of any file's modification time, size or inode ([`spawn_watch`]), which covers a
//! file written in place, one renamed over it, and Kubernetes' swapped symlinks.

mod certificate;
mod client;

pub use client::{client_config, https_client};

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::ServerConfig;

use crate::configuration::{CertificateFiles, Certificates, TlsSettings, TlsVersion};
use crate::metrics::{Exposition, Kind};
use crate::tasks::{Policy, Tasks};
use certificate::{Leaf, Stamp};

/// One listener's certificates: what it serves now, and how it reloads them.
#[derive(Debug)]
pub struct Served {
    /// `public` or `admin`: the `listener` label of the metrics.
    listener: &'static str,
    files: Certificates,
    current: ArcSwap<Loaded>,
    /// Every file's stamp when it was last read, in [`Self::paths`] order.
    stamps: Mutex<Vec<Option<Stamp>>>,
    reloads_ok: AtomicU64,
    reloads_rejected: AtomicU64,
    /// The files on disk did not load when last read: older certificates are served.
    failing: AtomicBool,
}

/// The certificates of one moment, and how a handshake finds its own.
#[derive(Debug)]
struct Loaded {
    /// The first (`tls.cert_file`): for clients that name no host, or one no other is for.
    default: Arc<CertifiedKey>,
    /// By exact host name, lower case.
    exact: HashMap<String, Arc<CertifiedKey>>,
    /// By the parent of a wildcard's name: `example.com` for `*.example.com`.
    wildcard: HashMap<String, Arc<CertifiedKey>>,
    /// Each certificate's leaf, in configuration order (for the metrics).
    leaves: Vec<Leaf>,
}

impl Served {
    /// Loads `files` for `listener` (`public` or `admin`); an error names the file and the
    /// configuration key that named it.
    pub fn load(listener: &'static str, files: &Certificates) -> anyhow::Result<Arc<Served>> {
        let stamps = stamps(files);
        let loaded = Loaded::read(listener, files)?;
        Ok(Arc::new(Served {
            listener,
            files: files.clone(),
            current: ArcSwap::from_pointee(loaded),
            stamps: Mutex::new(stamps),
            reloads_ok: AtomicU64::new(0),
            reloads_rejected: AtomicU64::new(0),
            failing: AtomicBool::new(false),
        }))
    }

    /// The rustls configuration of a listener serving these certificates, offering `h2`
    /// (preferred) and `http/1.1` by ALPN, or `http/1.1` alone.
    pub fn server_config(
        self: &Arc<Self>,
        min_version: TlsVersion,
        http2: bool,
    ) -> Result<ServerConfig, rustls::Error> {
        let versions: &[&rustls::SupportedProtocolVersion] = match min_version {
            TlsVersion::V1_2 => &[&rustls::version::TLS13, &rustls::version::TLS12],
            TlsVersion::V1_3 => &[&rustls::version::TLS13],
        };
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(versions)?
            .with_no_client_auth()
            .with_cert_resolver(Arc::clone(self) as Arc<dyn ResolvesServerCert>);
        config.alpn_protocols = match http2 {
            true => vec![b"h2".to_vec(), b"http/1.1".to_vec()],
            false => vec![b"http/1.1".to_vec()],
        };
        Ok(config)
    }

    /// Reads every file again and serves what it read, or keeps what it serves; says which
    /// in the log (with `why`, what asked) and the metrics. `true`: the new ones are served.
    pub fn reload(&self, why: &str) -> bool {
        *self.stamps.lock() = stamps(&self.files);
        match Loaded::read(self.listener, &self.files) {
            Ok(loaded) => {
                let names: Vec<String> = loaded.leaves.iter().map(Leaf::describe).collect();
                self.current.store(Arc::new(loaded));
                self.reloads_ok.fetch_add(1, Relaxed);
                self.failing.store(false, Relaxed);
                tracing::info!(listener = self.listener, why, certificates = ?names, "TLS certificates loaded again");
                true
            }
            Err(e) => {
                self.reloads_rejected.fetch_add(1, Relaxed);
                self.failing.store(true, Relaxed);
                tracing::error!(listener = self.listener, why, error = %e, "TLS certificates not loaded: the ones loaded before are still served");
                false
            }
        }
    }

    /// Whether a file changed since it was last read.
    fn changed(&self) -> bool {
        let stamps = self.stamps.lock();
        paths(&self.files)
            .zip(stamps.iter())
            .any(|(path, seen)| Stamp::of(path) != *seen)
    }
}

impl ResolvesServerCert for Served {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let loaded = self.current.load();
        Some(Arc::clone(
            hello
                .server_name()
                .and_then(|name| loaded.find(name))
                .unwrap_or(&loaded.default),
        ))
    }
}

impl Loaded {
    fn read(listener: &'static str, files: &Certificates) -> anyhow::Result<Loaded> {
        let at = |i: usize| match (listener, i) {
            ("admin", _) => "tls.admin_".to_owned(),
            (_, 0) => "tls.".to_owned(),
            (_, i) => format!("tls.sni[{}].", i - 1),
        };
        let mut exact = HashMap::new();
        let mut wildcard = HashMap::new();
        let mut leaves = Vec::new();
        let mut default = None;
        for (i, pair) in std::iter::once(&files.default)
            .chain(&files.sni)
            .enumerate()
        {
            let (key, leaf) = certificate::read(pair, &at(i))?;
            let key = Arc::new(key);
            // The first certificate to claim a name is served for it.
            for name in &leaf.names {
                match name.strip_prefix("*.") {
                    Some(parent) => wildcard.entry(parent.to_owned()),
                    None => exact.entry(name.clone()),
                }
                .or_insert_with(|| Arc::clone(&key));
            }
            if i > 0 && leaf.names.is_empty() {
                tracing::warn!(file = %pair.cert.display(), "this certificate names no host (no DNS subject alternative name), so no client is ever served it");
            }
            default.get_or_insert(key);
            leaves.push(leaf);
        }
        Ok(Loaded {
            default: default.expect("a listener's certificates include a default"),
            exact,
            wildcard,
            leaves,
        })
    }

    /// The certificate for `host` (as the client sent it: any case), if one names it.
    fn find(&self, host: &str) -> Option<&Arc<CertifiedKey>> {
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        self.exact.get(&host).or_else(|| {
            let (_, parent) = host.split_once('.')?;
            self.wildcard.get(parent)
        })
    }
}

/// Every file of a listener: each certificate's chain, then its key.
fn paths(files: &Certificates) -> impl Iterator<Item = &std::path::Path> {
    std::iter::once(&files.default)
        .chain(&files.sni)
        .flat_map(|CertificateFiles { cert, key }| [cert.as_path(), key.as_path()])
}

/// Each file's stamp now, in [`paths`] order.
fn stamps(files: &Certificates) -> Vec<Option<Stamp>> {
    paths(files).map(Stamp::of).collect()
}

/// The cryptography every listener uses: rustls's `ring` provider, as everywhere in the
/// gateway.
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The listeners' certificates, loaded from `settings`: the public listener's, then the
/// admin listener's (its own, or the public one's, when it has none of its own).
#[derive(Debug, Clone, Default)]
pub struct Listeners {
    pub public: Option<Arc<Served>>,
    pub admin: Option<Arc<Served>>,
}

impl Listeners {
    pub fn load(settings: &TlsSettings) -> anyhow::Result<Listeners> {
        let public = match &settings.public {
            Some(files) => Some(Served::load("public", files)?),
            None => None,
        };
        let admin = match &settings.admin {
            Some(files) => Some(Served::load("admin", files)?),
            None => public.clone(),
        };
        Ok(Listeners { public, admin })
    }

    /// Each set of certificates once (the admin listener may serve the public one's).
    pub fn each(&self) -> impl Iterator<Item = &Arc<Served>> {
        let admin = self
            .admin
            .as_ref()
            .filter(|a| !self.public.as_ref().is_some_and(|p| Arc::ptr_eq(p, a)));
        self.public.iter().chain(admin)
    }

    /// Loads every listener's certificates again (`SIGHUP`).
    pub fn reload(&self, why: &str) {
        for served in self.each() {
            served.reload(why);
        }
    }

    /// The TLS families of `/metrics`: each certificate's expiry, and the reloads.
    pub fn write_metrics(&self, out: &mut Exposition) {
        if self.public.is_none() && self.admin.is_none() {
            return;
        }
        let mut family = out.family(
            "tollgate_tls_certificate_expiry_timestamp_seconds",
            Kind::Gauge,
            "When each certificate a listener serves expires (its leaf's notAfter), Unix seconds.",
        );
        for served in self.each() {
            for leaf in &served.current.load().leaves {
                let file = leaf.file.to_string_lossy();
                family.sample(
                    &[("listener", served.listener), ("file", &file)],
                    leaf.not_after as f64,
                );
            }
        }
        let mut family = out.family(
            "tollgate_tls_reloads_total",
            Kind::Counter,
            "Loads of a listener's certificate files after start (a file changed, or SIGHUP): served (ok) or refused, the ones before kept (rejected).",
        );
        for served in self.each() {
            family
                .sample(
                    &[("listener", served.listener), ("result", "ok")],
                    served.reloads_ok.load(Relaxed),
                )
                .sample(
                    &[("listener", served.listener), ("result", "rejected")],
                    served.reloads_rejected.load(Relaxed),
                );
        }
        let mut family = out.family(
            "tollgate_tls_reload_failing",
            Kind::Gauge,
            "1 while a listener's certificate files on disk do not load (the last ones that did are served), else 0.",
        );
        for served in self.each() {
            family.sample(
                &[("listener", served.listener)],
                u8::from(served.failing.load(Relaxed)),
            );
        }
    }
}

/// Starts task `tls-watch`: every `every`, the files of each listener that changed are
/// loaded again.
pub fn spawn_watch(listeners: &Listeners, every: Duration, tasks: &Tasks) {
    let listeners = listeners.clone();
    if listeners.each().next().is_none() {
        return;
    }
    tasks.spawn("tls-watch", Policy::Restart, move |stop| {
        let listeners = listeners.clone();
        async move {
            stop.run_until_cancelled(async {
                let mut tick = tokio::time::interval(every);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tick.tick().await;
                    for served in listeners.each() {
                        if served.changed() {
                            served.reload("a file changed");
                        }
                    }
                }
            })
            .await;
        }
    });
}

/// The client configuration of `tollgate healthcheck` against a TLS listener: it asks the
/// gateway on this host whether it answers, so it takes whatever certificate is served
/// (whether that one is valid and current is the expiry gauge's and the reload metrics'
/// to say, and a container's probe has no name to check it against).
pub fn probe_client_config() -> Arc<rustls::ClientConfig> {
    let config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("ring supports the default versions")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyCertificate))
        .with_no_client_auth();
    Arc::new(config)
}

/// Accepts any certificate (see [`probe_client_config`]); signatures are still checked.
#[derive(Debug)]
struct AnyCertificate;

impl rustls::client::danger::ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        let algorithms = provider().signature_verification_algorithms;
        rustls::crypto::verify_tls12_signature(message, cert, dss, &algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        let algorithms = provider().signature_verification_algorithms;
        rustls::crypto::verify_tls13_signature(message, cert, dss, &algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        provider()
            .signature_verification_algorithms
            .supported_schemes()
    }
}
