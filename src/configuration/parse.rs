//! From what the sources say ([`RawSettings`]) to [`Settings`], once: each key becomes its
//! domain type, and every key that cannot is named, so one start-up shows every problem.

use std::collections::HashSet;
use std::ffi::OsString;
use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroU64, NonZeroUsize};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use actix_web::http::header::HeaderName;
use ipnet::IpNet;
use secrecy::{ExposeSecret, SecretString};

use super::periods::{BackOff, Periods};
use super::raw::{
    RawAdmin, RawCatalog, RawClient, RawEdge, RawHealthCheck, RawIssuer, RawLimits, RawOverload,
    RawPeriods, RawPlan, RawRedis, RawRoute, RawServer, RawSettings, RawTelemetry, RawTls,
    RawUpstream, RawUsage, RawWarnings,
};
use super::settings::{
    AdminSettings, Balance, CacheBounds, CatalogSettings, CertificateFiles, Certificates,
    ClientSettings, EdgeSettings, HealthCheckSettings, Holding, IssuerSettings, KeySource,
    LimitSettings, OtlpCompression, OtlpEndpoint, OtlpHeader, OtlpProtocol, OverloadSettings,
    PlanSettings, RedisSettings, RouteSettings, ServerSettings, Settings, TelemetrySettings,
    TlsSettings, TlsVersion, TrustRoots, UpstreamSettings, UsageSettings, WarningSettings,
    WebhookSettings,
};
use crate::domain::{
    ApiKey, Bucket, Capacity, ClientId, KeyHash, Limit, LimitSpec, Limits, MaxConnections, Mode,
    PlanName, Rate, Region, ServiceName, Upstream,
};

/// RFC 7518 3.2: an HS256 key must be at least as long as the hash, 256 bits.
pub const MIN_HS256_SECRET: usize = 32;

/// One bad key and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub key: String,
    pub message: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.key, self.message)
    }
}

/// Why settings could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// A `--config` file could not be read (missing, not a file, not permitted): apart from
    /// [`SettingsError::Load`] because `check-config` exits 2 for it, as for any file it
    /// cannot read, and 1 for a file it read that is not a configuration.
    #[error("--config {}: {reason}", file.display())]
    Unreadable { file: PathBuf, reason: String },
    /// A source could not be deserialized (not TOML, unknown key, wrong type).
    #[error("{0}")]
    Load(String),
    /// Values that are not what their keys allow, each named.
    #[error("{}", .0.iter().map(|p| p.to_string()).collect::<Vec<_>>().join("; "))]
    Invalid(Vec<Problem>),
}

impl Settings {
    /// Loads the compiled-in defaults, then each file in order, then `TOLLGATE__*` variables.
    pub fn load(files: &[PathBuf]) -> Result<Settings, SettingsError> {
        Self::load_with_env(files, std::env::vars())
    }

    /// [`Settings::load`] with an explicit environment (tests use this).
    pub fn load_with_env(
        files: &[PathBuf],
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Settings, SettingsError> {
        for file in files {
            readable(file)?;
        }
        let raw = RawSettings::load(files, env).map_err(SettingsError::Load)?;
        parse(raw).map_err(SettingsError::Invalid)
    }
}

/// `Ok` when `file` opens and is a file. Checked before the sources are layered because,
/// given a name that is not a file, the `config` crate looks for `<name>.toml` instead.
fn readable(file: &Path) -> Result<(), SettingsError> {
    let unreadable = |reason: String| SettingsError::Unreadable {
        file: file.to_path_buf(),
        reason,
    };
    let opened = std::fs::File::open(file).and_then(|f| f.metadata());
    match opened {
        Ok(meta) if meta.is_file() => Ok(()),
        Ok(_) => Err(unreadable("not a file".into())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Err(unreadable("no such file".into()))
        }
        Err(e) => Err(unreadable(e.to_string())),
    }
}

/// The problems found so far; a section parses to `None` only after recording one.
#[derive(Default)]
struct Problems(Vec<Problem>);

impl Problems {
    fn add(&mut self, key: impl Into<String>, message: impl Into<String>) {
        self.0.push(Problem {
            key: key.into(),
            message: message.into(),
        });
    }

    /// The value, or `None` with its error recorded under `key`.
    fn take<T, E: std::fmt::Display>(
        &mut self,
        key: impl Into<String>,
        parsed: Result<T, E>,
    ) -> Option<T> {
        parsed.map_err(|e| self.add(key, e.to_string())).ok()
    }
}

/// Each item parsed by `parse` (which records its problems), or `None` when any was bad.
/// Every item is parsed, so every bad one is named.
fn each<I: IntoIterator, T>(
    items: I,
    mut parse: impl FnMut(usize, I::Item) -> Option<T>,
) -> Option<Vec<T>> {
    let parsed: Vec<Option<T>> = items
        .into_iter()
        .enumerate()
        .map(|(i, item)| parse(i, item))
        .collect();
    parsed.into_iter().collect()
}

/// `v` when it lies in `range`, else `message`.
fn within<T: PartialOrd>(
    v: T,
    range: std::ops::RangeInclusive<T>,
    message: &str,
) -> Result<T, String> {
    if range.contains(&v) {
        Ok(v)
    } else {
        Err(message.to_string())
    }
}

/// The settings the sources describe, or every problem with them, each naming its key.
fn parse(raw: RawSettings) -> Result<Settings, Vec<Problem>> {
    let mut p = Problems::default();
    // Decided by the raw keys: a malformed URL still means "not embedded".
    let embedded = raw.redis.url.expose_secret().is_empty() && raw.redis.cluster_nodes.is_empty();
    let server = server(raw.server, &mut p);
    let redis = redis(raw.redis, &mut p);
    let catalog = catalog(raw.catalog, embedded, &mut p);
    let limits = limits(raw.limits, &mut p);
    let admin = admin(raw.admin, &mut p);
    let periods = periods(raw.periods, &mut p);
    let overload = overload(raw.overload, redis.as_ref(), &mut p);
    let upstream = upstream(raw.upstream, &mut p);
    let telemetry = telemetry(raw.telemetry, &mut p);
    let edge = edge(raw.edge, &mut p);
    let tls = tls(raw.tls, server.as_ref(), &mut p);
    let usage = usage(raw.usage, &mut p);
    let routes = routes(raw.routes, upstream.as_ref(), &mut p);
    let warnings = warnings(raw.warnings, &mut p);
    match (
        server, redis, catalog, limits, admin, periods, overload, upstream, telemetry, edge, tls,
        usage, routes, warnings,
    ) {
        (
            Some(server),
            Some(redis),
            Some(catalog),
            Some(limits),
            Some(admin),
            Some(periods),
            Some(overload),
            Some(upstream),
            Some(telemetry),
            Some(edge),
            Some(tls),
            Some(usage),
            Some(routes),
            Some(warnings),
        ) if p.0.is_empty() => Ok(Settings {
            server,
            redis,
            catalog,
            limits,
            admin,
            periods,
            overload,
            upstream,
            telemetry,
            edge,
            tls,
            usage,
            routes,
            warnings,
        }),
        _ => {
            debug_assert!(!p.0.is_empty(), "a section failed without naming a key");
            Err(p.0)
        }
    }
}

/// `[tls]`: the files are named here and read at start ([`crate::tls`]), where one that
/// does not load is an error naming its key.
fn tls(raw: RawTls, server: Option<&ServerSettings>, p: &mut Problems) -> Option<TlsSettings> {
    fn pair(cert: PathBuf, key: PathBuf, at: &str, p: &mut Problems) -> Option<CertificateFiles> {
        match (cert.as_os_str().is_empty(), key.as_os_str().is_empty()) {
            (true, true) => None,
            (false, false) => Some(CertificateFiles { cert, key }),
            (false, true) => {
                p.add(format!("{at}key_file"), "needs a key for its certificate");
                None
            }
            (true, false) => {
                p.add(format!("{at}cert_file"), "needs a certificate for its key");
                None
            }
        }
    }
    let failed = p.0.len();
    let default = pair(raw.cert_file, raw.key_file, "tls.", p);
    let sni_listed = !raw.sni.is_empty();
    let sni: Vec<CertificateFiles> = raw
        .sni
        .into_iter()
        .enumerate()
        .filter_map(|(i, c)| {
            let at = format!("tls.sni[{i}].");
            let before = p.0.len();
            let files = pair(c.cert_file, c.key_file, &at, p);
            if files.is_none() && p.0.len() == before {
                p.add(format!("{at}cert_file"), "needs a certificate and its key");
            }
            files
        })
        .collect();
    if default.is_none() && sni_listed {
        p.add(
            "tls.cert_file",
            "tls.sni needs a default certificate (tls.cert_file and tls.key_file)",
        );
    }
    let admin = pair(raw.admin_cert_file, raw.admin_key_file, "tls.admin_", p);
    if admin.is_some() && server.is_some_and(|s| s.admin_listen.is_none()) {
        p.add(
            "tls.admin_cert_file",
            "is for server.admin_listen, which is not set",
        );
    }
    let min_version = p.take(
        "tls.min_version",
        match raw.min_version.as_str() {
            "1.2" => Ok(TlsVersion::V1_2),
            "1.3" => Ok(TlsVersion::V1_3),
            other => Err(format!("{other:?} is not \"1.2\" or \"1.3\"")),
        },
    );
    let watch = p.take(
        "tls.watch_ms",
        within(
            raw.watch_ms,
            0..=3_600_000,
            "must be at most 3600000 (an hour)",
        ),
    );
    if p.0.len() > failed {
        return None;
    }
    Some(TlsSettings {
        public: default.map(|default| Certificates { default, sni }),
        admin: admin.map(|default| Certificates {
            default,
            sni: Vec::new(),
        }),
        min_version: min_version?,
        watch: (watch? > 0).then(|| Duration::from_millis(raw.watch_ms)),
    })
}

/// `[edge]`.
fn edge(raw: RawEdge, p: &mut Problems) -> Option<EdgeSettings> {
    let ipv4_prefix = p.take(
        "edge.ipv4_prefix",
        within(raw.ipv4_prefix, 1..=32, "must be from 1 to 32"),
    );
    let ipv6_prefix = p.take(
        "edge.ipv6_prefix",
        within(raw.ipv6_prefix, 1..=128, "must be from 1 to 128"),
    );
    let failed_keys_burst = p.take(
        "edge.failed_keys_burst",
        within(
            raw.failed_keys_burst,
            1..=1_000_000,
            "must be from 1 to 1000000",
        ),
    );
    let failed_keys_per_minute = p.take(
        "edge.failed_keys_per_minute",
        within(
            raw.failed_keys_per_minute,
            0.001..=1e6,
            "must be from 0.001 to 1000000",
        ),
    );
    let failed_keys_sets = p.take(
        "edge.failed_keys_sets",
        within(
            raw.failed_keys_sets,
            0..=1 << 24,
            "must be from 0 to 16777216",
        ),
    );
    let limits_path = match raw.limits_path.as_str() {
        "" => Some(None),
        path => p.take("edge.limits_path", limits_path(path)).map(Some),
    };
    Some(EdgeSettings {
        limits_path: limits_path?,
        ipv4_prefix: ipv4_prefix?,
        ipv6_prefix: ipv6_prefix?,
        failed_keys_burst: failed_keys_burst?,
        failed_keys_per_minute: failed_keys_per_minute?,
        failed_keys_sets: failed_keys_sets?,
    })
}

/// `edge.limits_path`: a path in its normal form (letters, digits, `-._~/`, no empty, `.`
/// or `..` segment), outside the gateway's own paths.
fn limits_path(path: &str) -> Result<String, String> {
    let normal = path.starts_with('/')
        && path.len() <= 256
        && path
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._~/".contains(&b))
        && path[1..]
            .split('/')
            .all(|s| !s.is_empty() && s != "." && s != "..");
    if !normal {
        return Err(
            "must be a path such as /_tollgate/limits: '/' then segments of A-Z a-z 0-9 - . _ ~"
                .into(),
        );
    }
    let own = [
        "/admin",
        "/metrics",
        "/api-docs",
        "/swagger-ui",
        "/healthz",
        "/readyz",
    ];
    if own
        .iter()
        .any(|o| path == *o || path.starts_with(&format!("{o}/")))
    {
        return Err(format!("{path} is one of the gateway's own paths"));
    }
    Ok(path.to_string())
}

/// `[upstream]`.
fn upstream(raw: RawUpstream, p: &mut Problems) -> Option<UpstreamSettings> {
    let mut ms = |key: &str, v: u64, range: std::ops::RangeInclusive<u64>| {
        let message = format!("must be between {} and {}", range.start(), range.end());
        p.take(format!("upstream.{key}"), within(v, range, &message))
            .map(Duration::from_millis)
    };
    let connect_timeout = ms("connect_timeout_ms", raw.connect_timeout_ms, 1..=600_000);
    let idle_timeout = ms("idle_timeout_ms", raw.idle_timeout_ms, 1..=3_600_000);
    let ejection = ms("ejection_ms", raw.ejection_ms, 1..=86_400_000);
    let max_ejection = ms("max_ejection_ms", raw.max_ejection_ms, 1..=86_400_000);
    let body_timeout = ms("body_timeout_ms", raw.body_timeout_ms, 1..=3_600_000);
    let websocket_idle_timeout = ms(
        "websocket_idle_timeout_ms",
        raw.websocket_idle_timeout_ms,
        1..=86_400_000,
    );
    let mut count = |key: &str, v: u64, range: std::ops::RangeInclusive<u64>| {
        let message = format!("must be between {} and {}", range.start(), range.end());
        p.take(format!("upstream.{key}"), within(v, range, &message))
            .and_then(|v| u32::try_from(v).ok())
    };
    let eject_after = count("eject_after", raw.eject_after, 0..=1_000);
    let max_tries = count("max_tries", raw.max_tries, 1..=10);
    let retry_budget_percent = count("retry_budget_percent", raw.retry_budget_percent, 0..=100);
    let retry_min_concurrency = count(
        "retry_min_concurrency",
        raw.retry_min_concurrency,
        0..=100_000,
    );
    let replay_body_bytes = p.take(
        "upstream.replay_body_bytes",
        within(
            raw.replay_body_bytes,
            0..=16 << 20,
            "must be between 0 and 16777216",
        ),
    );
    let trust = p.take(
        "upstream.ca_file",
        trust_roots(
            &raw.ca_file,
            std::env::var_os("SSL_CERT_FILE").filter(|v| !v.is_empty()),
        ),
    );
    if let (Some(first), Some(max)) = (ejection, max_ejection) {
        if max < first {
            p.add("upstream.max_ejection_ms", "must be at least ejection_ms");
            return None;
        }
    }
    Some(UpstreamSettings {
        connect_timeout: connect_timeout?,
        idle_timeout: idle_timeout?,
        eject_after: eject_after?,
        ejection: ejection?,
        max_ejection: max_ejection?,
        max_tries: max_tries?,
        retry_budget_percent: retry_budget_percent?,
        retry_min_concurrency: retry_min_concurrency?,
        replay_body_bytes: replay_body_bytes?,
        body_timeout: body_timeout?,
        trust: trust?,
        websocket_idle_timeout: websocket_idle_timeout?,
    })
}

/// Where distributions keep the system's bundle of trusted roots, one PEM file each
/// (Debian, Ubuntu and Alpine; Fedora and RHEL; openSUSE; macOS and BSDs): the files
/// OpenSSL and `rustls-native-certs` read on Linux.
const SYSTEM_BUNDLES: [&str; 4] = [
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/ssl/cert.pem",
];

/// `upstream.ca_file`: every certificate in it, each a usable trust anchor, at least one;
/// or, when empty, the system's bundle: the file `SSL_CERT_FILE` names (`ssl_cert_file`,
/// as OpenSSL and `rustls-native-certs` read it; one that does not load is an error, not
/// silently no roots), else the first of [`SYSTEM_BUNDLES`] there is, its unusable
/// entries skipped as OpenSSL does, none when the host has none.
fn trust_roots(ca_file: &str, ssl_cert_file: Option<OsString>) -> Result<TrustRoots, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    let mut store = rustls::RootCertStore::empty();
    if ca_file.is_empty() {
        if let Some(named) = ssl_cert_file {
            let path = PathBuf::from(named);
            let certs = CertificateDer::pem_file_iter(&path).map_err(|e| {
                format!("empty, and SSL_CERT_FILE names {path:?}, which cannot be read: {e}")
            })?;
            let (added, _) = store.add_parsable_certificates(certs.filter_map(Result::ok));
            if added == 0 {
                return Err(format!(
                    "empty, and SSL_CERT_FILE names {path:?}, which has no usable certificate"
                ));
            }
            return Ok(TrustRoots {
                file: Some(path),
                configured: false,
                store: Arc::new(store),
            });
        }
        let Some(bundle) = SYSTEM_BUNDLES.iter().map(Path::new).find(|p| p.is_file()) else {
            return Ok(TrustRoots {
                file: None,
                configured: false,
                store: Arc::new(store),
            });
        };
        let certs = CertificateDer::pem_file_iter(bundle)
            .map(|certs| certs.filter_map(Result::ok).collect::<Vec<_>>())
            .unwrap_or_default();
        store.add_parsable_certificates(certs);
        return Ok(TrustRoots {
            file: Some(bundle.to_path_buf()),
            configured: false,
            store: Arc::new(store),
        });
    }
    let certs = CertificateDer::pem_file_iter(ca_file)
        .map_err(|e| format!("{ca_file:?} cannot be read: {e}"))?;
    for cert in certs {
        let cert = cert.map_err(|e| format!("{ca_file:?}: not PEM: {e}"))?;
        store
            .add(cert)
            .map_err(|e| format!("{ca_file:?}: a certificate that cannot be a root: {e}"))?;
    }
    if store.is_empty() {
        return Err(format!("{ca_file:?}: no certificate in it"));
    }
    Ok(TrustRoots {
        file: Some(PathBuf::from(ca_file)),
        configured: true,
        store: Arc::new(store),
    })
}

/// A route's `balance`.
fn balance(s: &str) -> Result<Balance, String> {
    match s {
        "least_request" => Ok(Balance::LeastRequest),
        "round_robin" => Ok(Balance::RoundRobin),
        _ => Err(format!(
            "{s:?} is not a balance; use \"least_request\" or \"round_robin\""
        )),
    }
}

/// A route's `[routes.health_check]`; `key` names the table.
fn health_check(raw: RawHealthCheck, key: &str, p: &mut Problems) -> Option<HealthCheckSettings> {
    let path = if raw.path.starts_with('/')
        && raw
            .path
            .parse::<actix_web::http::uri::PathAndQuery>()
            .is_ok()
    {
        Some(raw.path)
    } else {
        p.add(
            format!("{key}.path"),
            "must be a path starting with '/', e.g. \"/healthz\"",
        );
        None
    };
    let interval = p.take(
        format!("{key}.interval_ms"),
        within(
            raw.interval_ms,
            10..=3_600_000,
            "must be between 10 and 3600000",
        ),
    );
    let timeout = p.take(
        format!("{key}.timeout_ms"),
        within(raw.timeout_ms, 1..=600_000, "must be between 1 and 600000"),
    );
    let unhealthy_after = p.take(
        format!("{key}.unhealthy_after"),
        within(raw.unhealthy_after, 1..=100, "must be between 1 and 100"),
    );
    let healthy_after = p.take(
        format!("{key}.healthy_after"),
        within(raw.healthy_after, 1..=100, "must be between 1 and 100"),
    );
    Some(HealthCheckSettings {
        path: path?,
        interval: Duration::from_millis(interval?),
        timeout: Duration::from_millis(timeout?),
        unhealthy_after: u32::try_from(unhealthy_after?).ok()?,
        healthy_after: u32::try_from(healthy_after?).ok()?,
    })
}

fn telemetry(raw: RawTelemetry, p: &mut Problems) -> Option<TelemetrySettings> {
    let otlp_endpoint = if raw.otlp_endpoint.is_empty() {
        Some(None)
    } else {
        p.take(
            "telemetry.otlp_endpoint",
            OtlpEndpoint::parse(&raw.otlp_endpoint),
        )
        .map(Some)
    };
    let otlp_protocol = p.take(
        "telemetry.otlp_protocol",
        match raw.otlp_protocol.as_str() {
            "http/json" => Ok(OtlpProtocol::HttpJson),
            "http/protobuf" => Ok(OtlpProtocol::HttpProtobuf),
            other => Err(format!(
                "{other:?} is not a protocol; use \"http/json\" or \"http/protobuf\""
            )),
        },
    );
    let otlp_compression = p.take(
        "telemetry.otlp_compression",
        match raw.otlp_compression.as_str() {
            "none" => Ok(OtlpCompression::None),
            "gzip" => Ok(OtlpCompression::Gzip),
            other => Err(format!(
                "{other:?} is not a compression; use \"none\" or \"gzip\""
            )),
        },
    );
    let otlp_headers = p.take(
        "telemetry.otlp_headers",
        otlp_headers(raw.otlp_headers.expose_secret()),
    );
    let ca = raw.otlp_ca_file;
    let otlp_ca_file = if ca.is_empty() {
        Some(None)
    } else if Path::new(&ca).is_file() {
        Some(Some(PathBuf::from(ca)))
    } else {
        p.add(
            "telemetry.otlp_ca_file",
            format!("{ca:?} is not a readable file"),
        );
        None
    };
    Some(TelemetrySettings {
        otlp_endpoint: otlp_endpoint?,
        otlp_protocol: otlp_protocol?,
        otlp_compression: otlp_compression?,
        otlp_headers: otlp_headers?,
        otlp_ca_file: otlp_ca_file?,
    })
}

/// The shortest webhook secret: an HMAC-SHA256 key of 32 bytes.
pub const MIN_WEBHOOK_SECRET: usize = 32;

fn warnings(raw: RawWarnings, p: &mut Problems) -> Option<WarningSettings> {
    let retries = p.take(
        "warnings.retries",
        within(raw.retries, 0..=20, "must be 0-20"),
    );
    let backoff = p.take(
        "warnings.backoff_ms",
        within(raw.backoff_ms, 10..=600_000, "must be 10-600000"),
    );
    let timeout = p.take(
        "warnings.timeout_ms",
        within(raw.timeout_ms, 100..=60_000, "must be 100-60000"),
    );
    let queue = p.take(
        "warnings.queue",
        within(raw.queue, 1..=1_000_000, "must be 1-1000000"),
    );
    let mut webhooks = Vec::new();
    let mut ok = true;
    for (i, w) in raw.webhooks.into_iter().enumerate() {
        let key = |field: &str| format!("warnings.webhooks[{i}].{field}");
        let url = match w.url.parse::<http::Uri>() {
            Ok(u) if matches!(u.scheme_str(), Some("http" | "https")) && u.host().is_some() => {
                Some(w.url.clone())
            }
            _ => {
                p.add(key("url"), format!("{:?} is not an http(s) URL", w.url));
                None
            }
        };
        if w.secret.expose_secret().len() < MIN_WEBHOOK_SECRET {
            p.add(
                key("secret"),
                format!("must be {MIN_WEBHOOK_SECRET} bytes at least (an HMAC-SHA256 key)"),
            );
            ok = false;
        }
        let ca_file = if w.ca_file.is_empty() {
            None
        } else if Path::new(&w.ca_file).is_file() {
            Some(PathBuf::from(&w.ca_file))
        } else {
            p.add(
                key("ca_file"),
                format!("{:?} is not a readable file", w.ca_file),
            );
            ok = false;
            None
        };
        match url {
            Some(url) if ok => webhooks.push(WebhookSettings {
                url,
                secret: w.secret,
                ca_file,
            }),
            _ => ok = false,
        }
    }
    if !ok {
        return None;
    }
    Some(WarningSettings {
        retries: u32::try_from(retries?).ok()?,
        backoff: Duration::from_millis(backoff?),
        timeout: Duration::from_millis(timeout?),
        queue: usize::try_from(queue?).ok()?,
        webhooks,
    })
}

/// The headers the exporter sets itself: a configured one would contradict the body.
const EXPORTER_HEADERS: [&str; 4] = ["content-type", "content-encoding", "content-length", "host"];

/// `telemetry.otlp_headers`: `name=value` pairs separated by commas, values
/// percent-decoded (`OTEL_EXPORTER_OTLP_HEADERS`'s format). Errors name the header, never
/// a value: the values are secrets.
fn otlp_headers(s: &str) -> Result<Vec<OtlpHeader>, String> {
    let mut headers: Vec<OtlpHeader> = Vec::new();
    for (i, pair) in s.split(',').map(str::trim).enumerate() {
        if pair.is_empty() {
            continue;
        }
        let Some((name, value)) = pair.split_once('=') else {
            return Err(format!("entry {} is not name=value", i + 1));
        };
        let name = HeaderName::try_from(name.trim())
            .map_err(|_| format!("entry {} has no valid header name", i + 1))?;
        if EXPORTER_HEADERS.contains(&name.as_str()) {
            return Err(format!("{name} is set by the exporter"));
        }
        if headers.iter().any(|h| h.name == name) {
            return Err(format!("{name} is given twice"));
        }
        let value = percent_decode(value.trim())
            .filter(|v| {
                !v.is_empty() && v.bytes().all(|b| b == b'\t' || (0x20..=0x7e).contains(&b))
            })
            .ok_or_else(|| {
                format!("{name}: the value must be printable ASCII, percent-encoded where needed")
            })?;
        headers.push(OtlpHeader {
            name,
            value: SecretString::from(value),
        });
    }
    Ok(headers)
}

/// `%XX` escapes decoded; `None` for a malformed escape or a result that is not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

fn server(raw: RawServer, p: &mut Problems) -> Option<ServerSettings> {
    let listen = p.take("server.listen", parse_listen(&raw.listen));
    let admin_listen = if raw.admin_listen.is_empty() {
        Some(None)
    } else {
        p.take("server.admin_listen", parse_listen(&raw.admin_listen))
            .map(Some)
    };
    let region = p.take("server.region", Region::parse(&raw.region));
    let workers = p.take(
        "server.workers",
        within(raw.workers, 0..=1024, "must be at most 1024").map(NonZeroUsize::new),
    );
    let api_key_header = p.take(
        "server.api_key_header",
        HeaderName::from_bytes(raw.api_key_header.as_bytes())
            .map_err(|_| format!("{:?} is not a valid header name", raw.api_key_header)),
    );
    let mut seen = HashSet::new();
    let api_key_sources = each(&raw.api_key_sources, |i, s| {
        let key = format!("server.api_key_sources[{i}]");
        let source = p.take(key.clone(), KeySource::parse(s))?;
        if !seen.insert(source) {
            p.add(key, format!("{s:?} is listed twice"));
            return None;
        }
        Some(source)
    });
    if raw.api_key_sources.is_empty() {
        p.add("server.api_key_sources", "needs at least one source");
    }
    let api_key_query = p.take(
        "server.api_key_query",
        if !raw.api_key_query.is_empty()
            && raw
                .api_key_query
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        {
            Ok(raw.api_key_query.clone())
        } else {
            Err("must be 1 or more characters of A-Z a-z 0-9 - _ .")
        },
    );
    let trusted_proxies = each(&raw.trusted_proxies, |i, cidr| {
        p.take(
            format!("server.trusted_proxies[{i}]"),
            parse_cidr(cidr).ok_or_else(|| format!("{cidr:?} is not an IP address or CIDR")),
        )
    });
    let max_body_bytes = p.take(
        "server.max_body_bytes",
        NonZeroU64::new(raw.max_body_bytes).ok_or("must be at least 1"),
    );
    Some(ServerSettings {
        listen: listen?,
        admin_listen: admin_listen?,
        region: region?,
        workers: workers?,
        api_key_header: api_key_header?,
        api_key_sources: api_key_sources?,
        api_key_query: api_key_query?,
        trusted_proxies: trusted_proxies?,
        max_body_bytes: max_body_bytes?,
        shutdown_timeout: Duration::from_secs(raw.shutdown_timeout_s),
        http2: raw.http2,
        max_connections_per_address: NonZeroU32::new(raw.max_connections_per_address),
        new_connections_per_address: NonZeroU32::new(raw.new_connections_per_address),
    })
}

fn redis(raw: RawRedis, p: &mut Problems) -> Option<RedisSettings> {
    let url = optional_redis_url("redis.url", raw.url, p);
    let regional_url = optional_redis_url("redis.regional_url", raw.regional_url, p);
    let cluster_nodes = each(raw.cluster_nodes, |i, url| {
        let checked = check_redis_url(url.expose_secret());
        p.take(format!("redis.cluster_nodes[{i}]"), checked.map(|()| url))
    });
    let timeout = p.take(
        "redis.timeout_ms",
        within(raw.timeout_ms, 1..=10_000, "must be between 1 and 10000"),
    );
    let control_timeout = p.take(
        "redis.control_timeout_ms",
        within(
            raw.control_timeout_ms,
            10..=60_000,
            "must be between 10 and 60000",
        ),
    );
    let pool_size = p.take(
        "redis.pool_size",
        within(raw.pool_size, 1..=1024, "must be between 1 and 1024"),
    );
    let key_prefix = if raw.key_prefix.contains(['{', '}']) {
        p.add(
            "redis.key_prefix",
            "must not contain '{' or '}' (they delimit cluster hash tags)",
        );
        None
    } else {
        Some(raw.key_prefix)
    };
    Some(RedisSettings {
        url: url?,
        cluster_nodes: cluster_nodes?,
        regional_url: regional_url?,
        timeout: Duration::from_millis(timeout?),
        control_timeout: Duration::from_millis(control_timeout?),
        pool_size: pool_size?,
        key_prefix: key_prefix?,
    })
}

/// `""` is none; anything else must be a Redis URL.
fn optional_redis_url(
    key: &str,
    url: SecretString,
    p: &mut Problems,
) -> Option<Option<SecretString>> {
    if url.expose_secret().is_empty() {
        return Some(None);
    }
    let checked = check_redis_url(url.expose_secret());
    p.take(key, checked.map(|()| Some(url)))
}

fn catalog(raw: RawCatalog, embedded: bool, p: &mut Problems) -> Option<CatalogSettings> {
    let holding = holding(&raw, embedded, p);
    let refresh = p.take(
        "catalog.refresh_ms",
        within(
            raw.refresh_ms,
            10..=600_000,
            "must be between 10 and 600000",
        ),
    );
    let file = if embedded && raw.file.as_os_str().is_empty() {
        p.add(
            "catalog.file",
            "must be set when the embedded store is used",
        );
        None
    } else {
        Some(raw.file)
    };
    let mut plan_names = HashSet::new();
    let plans = each(raw.plans, |i, raw| plan(i, raw, &mut plan_names, p));
    let mut declared = Declared::default();
    let clients = each(raw.clients, |i, raw| client(i, raw, &mut declared, p));
    Some(CatalogSettings {
        file: file?,
        refresh: Duration::from_millis(refresh?),
        cache_file: (!raw.cache_file.as_os_str().is_empty()).then_some(raw.cache_file),
        holding: holding?,
        plans: plans?,
        clients: clients?,
    })
}

/// `catalog.mode` and the cache's bounds (checked whatever the mode, so a typo shows
/// before the mode is switched).
fn holding(raw: &RawCatalog, embedded: bool, p: &mut Problems) -> Option<Holding> {
    let clients = p.take(
        "catalog.cached_clients",
        within(
            raw.cached_clients,
            1..=100_000_000,
            "must be between 1 and 100000000",
        ),
    );
    let unknown_keys = p.take(
        "catalog.unknown_keys",
        within(
            raw.unknown_keys,
            1..=100_000_000,
            "must be between 1 and 100000000",
        ),
    );
    let unknown_for = p.take(
        "catalog.unknown_for_ms",
        within(
            raw.unknown_for_ms,
            1..=86_400_000,
            "must be between 1 and 86400000",
        ),
    );
    let lookup_timeout = p.take(
        "catalog.lookup_timeout_ms",
        within(
            raw.lookup_timeout_ms,
            1..=60_000,
            "must be between 1 and 60000",
        ),
    );
    let key_filter_mib = p.take(
        "catalog.key_filter_mib",
        within(raw.key_filter_mib, 0..=512, "must be between 0 and 512"),
    );
    let cache = match raw.mode.as_str() {
        "mirror" => false,
        "cache" if embedded => {
            p.add(
                "catalog.mode",
                "\"cache\" needs Redis: the embedded store's catalog is this process's own",
            );
            return None;
        }
        "cache" => true,
        _ => {
            p.add("catalog.mode", "must be \"mirror\" or \"cache\"");
            return None;
        }
    };
    let bounds = CacheBounds {
        clients: clients?,
        unknown_keys: unknown_keys?,
        unknown_for: Duration::from_millis(unknown_for?),
        lookup_timeout: Duration::from_millis(lookup_timeout?),
        key_filter_bits: key_filter_mib? * 8 * 1024 * 1024,
    };
    Some(if cache {
        Holding::Cache(bounds)
    } else {
        Holding::Mirror
    })
}

/// `catalog.plans[i]`, whose name none of the plans before it (`names`) has.
fn plan(
    i: usize,
    plan: RawPlan,
    names: &mut HashSet<PlanName>,
    p: &mut Problems,
) -> Option<PlanSettings> {
    let key = format!("catalog.plans[{i}]");
    let name = match PlanName::parse(&plan.name) {
        Ok(name) if !names.insert(name.clone()) => {
            p.add(
                format!("{key}.name"),
                format!("plan {:?} declared twice", plan.name),
            );
            None
        }
        parsed => p.take(format!("{key}.name"), parsed),
    };
    let limits = if plan.limits.is_empty() {
        // Both parsed, so a plan with both wrong names both.
        let capacity = p.take(
            format!("{key}.capacity"),
            Capacity::parse(plan.capacity.unwrap_or(f64::NAN)),
        );
        let rate = p.take(
            format!("{key}.rate"),
            Rate::parse(plan.rate.unwrap_or(f64::NAN)),
        );
        Some(Limits::single(Bucket::from_parts(capacity?, rate?)))
    } else {
        if plan.capacity.is_some() || plan.rate.is_some() {
            p.add(
                format!("{key}.limits"),
                "give either limits or capacity and rate, not both",
            );
        }
        plan_limits(&key, &plan.limits, p)
    };
    let max_connections = match plan.max_connections {
        Some(n) => Some(p.take(format!("{key}.max_connections"), MaxConnections::parse(n))?),
        None => None,
    };
    Some(PlanSettings {
        name: name?,
        limits: limits?,
        description: plan.description,
        max_connections,
    })
}

/// The `limits` of the plan at `key`, each checked, then together.
fn plan_limits(key: &str, specs: &[LimitSpec], p: &mut Problems) -> Option<Limits> {
    let items: Vec<Option<Limit>> = specs
        .iter()
        .enumerate()
        .map(|(j, spec)| {
            Limit::from_spec(spec)
                .map_err(|e| p.add(format!("{key}.limits[{j}].{}", e.field()), e.to_string()))
                .ok()
        })
        .collect();
    let items: Option<Vec<Limit>> = items.into_iter().collect();
    match items.map(Limits::new) {
        Some(Ok(l)) => Some(l),
        Some(Err(e)) => {
            p.add(format!("{key}.limits"), e.to_string());
            None
        }
        None => None,
    }
}

/// What the clients declared before the one being read hold: each id once, and across
/// clients each key once (one key belongs to one client).
#[derive(Default)]
struct Declared {
    ids: HashSet<ClientId>,
    keys: HashSet<KeyHash>,
}

/// `catalog.clients[i]`, whose id and keys none of the clients before it holds.
fn client(
    i: usize,
    client: RawClient,
    declared: &mut Declared,
    p: &mut Problems,
) -> Option<ClientSettings> {
    let key = format!("catalog.clients[{i}]");
    let id = match ClientId::parse(&client.id) {
        Ok(id) if !declared.ids.insert(id.clone()) => {
            p.add(
                format!("{key}.id"),
                format!("client {:?} declared twice", client.id),
            );
            None
        }
        parsed => p.take(format!("{key}.id"), parsed),
    };
    let plan = p.take(format!("{key}.plan"), PlanName::parse(&client.plan));
    let mode = p.take(
        format!("{key}.mode"),
        client.mode.as_deref().map(str::parse::<Mode>).transpose(),
    );
    let key_hashes = &mut declared.keys;
    let plaintext = each(&client.keys, |j, k| {
        let field = format!("{key}.keys[{j}]");
        let hash = p.take(&field, ApiKey::parse(k.expose_secret()).map(|k| k.hash()));
        unique_key(field, hash, key_hashes, p)
    });
    let hashed = each(&client.key_hashes, |j, h| {
        let field = format!("{key}.key_hashes[{j}]");
        let hash = p.take(&field, h.parse::<KeyHash>());
        unique_key(field, hash, key_hashes, p)
    });
    Some(ClientSettings {
        id: id?,
        plan: plan?,
        mode: mode?,
        keys: plaintext?.into_iter().chain(hashed?).collect(),
    })
}

/// A declared key's hash, unless another declared key (of any client) has it.
fn unique_key(
    field: String,
    hash: Option<KeyHash>,
    seen: &mut HashSet<KeyHash>,
    p: &mut Problems,
) -> Option<KeyHash> {
    let hash = hash?;
    if seen.insert(hash) {
        Some(hash)
    } else {
        p.add(field, "key used twice");
        None
    }
}

fn limits(raw: RawLimits, p: &mut Problems) -> Option<LimitSettings> {
    let default_mode = p.take("limits.default_mode", raw.default_mode.parse::<Mode>());
    // `contains` is false for NaN, so it is refused too.
    let safety_multiplier = p.take(
        "limits.safety_multiplier",
        within(
            raw.safety_multiplier,
            1.0..=1_000.0,
            "must be a number between 1 and 1000",
        ),
    );
    Some(LimitSettings {
        default_mode: default_mode?,
        safety_multiplier: safety_multiplier?,
    })
}

/// `[usage]`.
fn usage(raw: RawUsage, p: &mut Problems) -> Option<UsageSettings> {
    let flush = p.take(
        "usage.flush_ms",
        within(
            raw.flush_ms,
            100..=3_600_000,
            "must be between 100 and 3600000",
        ),
    );
    let retention_days = p.take(
        "usage.retention_days",
        within(raw.retention_days, 1..=3660, "must be between 1 and 3660"),
    );
    let max_entries = p.take(
        "usage.max_entries",
        within(
            raw.max_entries,
            1..=100_000_000,
            "must be between 1 and 100000000",
        ),
    );
    let fold = p.take(
        "usage.fold_ms",
        within(
            raw.fold_ms,
            100..=86_400_000,
            "must be between 100 and 86400000",
        ),
    );
    let adopt_after = p.take(
        "usage.adopt_after_ms",
        within(
            raw.adopt_after_ms,
            300..=86_400_000,
            "must be between 300 and 86400000",
        ),
    );
    let (flush, fold, adopt_after) = (flush?, fold?, adopt_after?);
    if fold < flush {
        p.add("usage.fold_ms", "must be at least usage.flush_ms");
        return None;
    }
    if adopt_after < 3 * flush {
        // A gateway misses a checkpoint or two when the store blinks: it is not dead.
        p.add(
            "usage.adopt_after_ms",
            "must be at least three times usage.flush_ms",
        );
        return None;
    }
    Some(UsageSettings {
        enabled: raw.enabled,
        flush: Duration::from_millis(flush),
        fold: Duration::from_millis(fold),
        adopt_after: Duration::from_millis(adopt_after),
        retention_days: retention_days?,
        max_entries: usize::try_from(max_entries?).ok()?,
    })
}

/// `[overload]`. `redis`: the store's budget, which the whole decision's must exceed twice
/// over (a call ahead of the take's own, then its own), so a slow store fails open before a
/// decision is shed for taking too long (`None` when the Redis settings are bad, which
/// say why themselves).
fn overload(
    raw: RawOverload,
    redis: Option<&RedisSettings>,
    p: &mut Problems,
) -> Option<OverloadSettings> {
    let max_delay = p.take(
        "overload.max_delay_ms",
        within(raw.max_delay_ms, 1..=60_000, "must be between 1 and 60000"),
    );
    let max_pending = p.take(
        "overload.max_pending",
        within(
            raw.max_pending,
            1..=1_000_000,
            "must be between 1 and 1000000",
        ),
    );
    let budget = redis.map(|r| r.timeout)?;
    let max_wait = match raw.max_wait_ms {
        // Automatic: room for four store budgets, and never under 100 ms.
        0 => Some((budget * 4).max(Duration::from_millis(100))),
        ms => p
            .take(
                "overload.max_wait_ms",
                within(ms, 1..=60_000, "must be 0 (automatic) or 1 to 60000"),
            )
            .map(Duration::from_millis)
            .filter(|wait| {
                *wait > budget * 2 || {
                    p.add(
                        "overload.max_wait_ms",
                        "must be more than twice redis.timeout_ms (or 0, automatic)",
                    );
                    false
                }
            }),
    };
    Some(OverloadSettings {
        max_delay: Duration::from_millis(max_delay?),
        max_pending: usize::try_from(max_pending?).ok()?,
        max_wait: max_wait?,
    })
}

fn periods(raw: RawPeriods, p: &mut Problems) -> Option<Periods> {
    let mut ms = |key: &str, v: u64, min: u64| {
        p.take(
            format!("periods.{key}"),
            within(
                v,
                min..=86_400_000,
                &format!("must be {min} to 86400000 ms"),
            ),
        )
        .map(Duration::from_millis)
    };
    // A share period under 100 ms leaves no room for the reconciler's 50 ms margin.
    let hot_window = ms("hot_window_ms", raw.hot_window_ms, 100);
    let share = ms("share_ms", raw.share_ms, 100);
    let unshard_window = ms("unshard_window_ms", raw.unshard_window_ms, 1);
    let shadow_flush = ms("shadow_flush_ms", raw.shadow_flush_ms, 1);
    let key_use_flush = ms("key_use_flush_ms", raw.key_use_flush_ms, 100);
    let debit = ms("debit_ms", raw.debit_ms, 1);
    let base = ms("breaker_backoff_ms", raw.breaker_backoff_ms, 1);
    let max = ms("breaker_backoff_max_ms", raw.breaker_backoff_max_ms, 1);
    let stable = ms("breaker_stable_ms", raw.breaker_stable_ms, 1);
    if let (Some(base), Some(max)) = (base, max) {
        if max < base {
            p.add(
                "periods.breaker_backoff_max_ms",
                "must be at least periods.breaker_backoff_ms",
            );
            return None;
        }
    }
    Some(Periods {
        hot_window: hot_window?,
        share: share?,
        unshard_window: unshard_window?,
        shadow_flush: shadow_flush?,
        key_use_flush: key_use_flush?,
        debit: debit?,
        backoff: BackOff {
            base: base?,
            max: max?,
            stable: stable?,
        },
    })
}

fn admin(raw: RawAdmin, p: &mut Problems) -> Option<AdminSettings> {
    let len = raw.jwt_hs256_secret.expose_secret().len();
    let jwt_hs256_secret = match len {
        0 => Some(None),
        MIN_HS256_SECRET.. => Some(Some(raw.jwt_hs256_secret)),
        _ => {
            p.add(
                "admin.jwt_hs256_secret",
                format!(
                    "must be at least {MIN_HS256_SECRET} bytes (got {len}): a short HMAC secret can be guessed offline from one token"
                ),
            );
            None
        }
    };
    let pem = raw.jwt_public_key_pem;
    let jwt_public_key_pem = if pem.is_empty() {
        Some(None)
    } else if Path::new(&pem).is_file() {
        Some(Some(PathBuf::from(pem)))
    } else {
        p.add(
            "admin.jwt_public_key_pem",
            format!("{pem:?} is not a readable file"),
        );
        None
    };
    let refetch = p.take(
        "admin.jwks_refetch_ms",
        within(
            raw.jwks_refetch_ms,
            100..=86_400_000,
            "must be 100-86400000",
        ),
    );
    let refresh = p.take(
        "admin.jwks_refresh_ms",
        within(
            raw.jwks_refresh_ms,
            1_000..=604_800_000,
            "must be 1000-604800000",
        ),
    );
    let catalog_max = p.take(
        "admin.catalog_max_bytes",
        within(
            raw.catalog_max_bytes,
            65_536..=1_073_741_824,
            "must be 65536-1073741824",
        ),
    );
    let audience = raw.jwt_audience.clone();
    let issuers = each(raw.issuers, |i, r| issuer(i, r, &audience, p));
    Some(AdminSettings {
        jwt_hs256_secret: jwt_hs256_secret?,
        jwt_public_key_pem: jwt_public_key_pem?,
        jwt_issuer: raw.jwt_issuer,
        jwt_audience: raw.jwt_audience,
        jwks_refetch: Duration::from_millis(refetch?),
        jwks_refresh: Duration::from_millis(refresh?),
        catalog_max_bytes: catalog_max? as usize,
        issuers: issuers?,
    })
}

/// The admin scopes a role may give.
const ADMIN_SCOPES: [&str; 3] = ["admin:read", "admin:write", "admin:keys"];

/// `admin.issuers[i]`.
fn issuer(i: usize, raw: RawIssuer, audience: &str, p: &mut Problems) -> Option<IssuerSettings> {
    let key = |field: &str| format!("admin.issuers[{i}].{field}");
    let url = |v: &str| v.starts_with("https://") || v.starts_with("http://");
    let mut ok = true;
    if raw.issuer.is_empty() {
        p.add(key("issuer"), "is required: the iss its tokens carry");
        ok = false;
    }
    let jwks_url = match raw.jwks_url.as_str() {
        "" if !url(&raw.issuer) => {
            p.add(
                key("jwks_url"),
                "is required when issuer is not a URL (its discovery document is read from <issuer>/.well-known/openid-configuration)",
            );
            ok = false;
            None
        }
        "" => None,
        u if url(u) => Some(u.to_string()),
        u => {
            p.add(key("jwks_url"), format!("{u:?} is not an http(s) URL"));
            ok = false;
            None
        }
    };
    let mut algorithms = Vec::new();
    for a in &raw.algorithms {
        use jsonwebtoken::Algorithm::*;
        match a.parse::<jsonwebtoken::Algorithm>() {
            Ok(HS256 | HS384 | HS512) | Err(_) => {
                p.add(
                    key("algorithms"),
                    format!("{a:?} is not one of RS256 RS384 RS512 PS256 PS384 PS512 ES256 ES384 EdDSA (an identity provider's keys are public)"),
                );
                ok = false;
            }
            Ok(alg) => algorithms.push(alg),
        }
    }
    if raw.algorithms.is_empty() {
        p.add(key("algorithms"), "must name one algorithm at least");
        ok = false;
    }
    let mut roles = std::collections::BTreeMap::new();
    for (role, scopes) in raw.roles {
        let scopes: Vec<String> = scopes.split_whitespace().map(str::to_string).collect();
        if let Some(bad) = scopes.iter().find(|s| !ADMIN_SCOPES.contains(&s.as_str())) {
            p.add(
                format!("{}.{role}", key("roles")),
                format!("{bad:?} is not an admin scope (admin:read, admin:write, admin:keys)"),
            );
            ok = false;
        }
        roles.insert(role, scopes);
    }
    let ca_file = match raw.ca_file.as_str() {
        "" => None,
        f if Path::new(f).is_file() => Some(PathBuf::from(f)),
        f => {
            p.add(key("ca_file"), format!("{f:?} is not a readable file"));
            ok = false;
            None
        }
    };
    ok.then(|| IssuerSettings {
        issuer: raw.issuer,
        jwks_url,
        audience: if raw.audience.is_empty() {
            audience.to_string()
        } else {
            raw.audience
        },
        algorithms,
        roles_claim: (!raw.roles_claim.is_empty()).then_some(raw.roles_claim),
        roles,
        ca_file,
    })
}

/// `[[routes]]`; `upstream` (when it parsed) tells whether an `https://` replica can be
/// verified at all.
fn routes(
    raw: Vec<RawRoute>,
    upstream: Option<&UpstreamSettings>,
    p: &mut Problems,
) -> Option<Vec<RouteSettings>> {
    let unverifiable = upstream.is_some_and(|u| u.trust.is_empty());
    let mut prefixes = HashSet::new();
    each(raw, |i, route| {
        let key = format!("routes[{i}]");
        let service = p.take(format!("{key}.service"), ServiceName::parse(&route.service));
        let prefix = if !route.prefix.starts_with('/') {
            p.add(format!("{key}.prefix"), "must start with '/'");
            None
        } else if !prefixes.insert(route.prefix.trim_end_matches('/').to_string()) {
            p.add(
                format!("{key}.prefix"),
                format!("{:?} used twice", route.prefix),
            );
            None
        } else {
            Some(route.prefix)
        };
        if route.upstreams.is_empty() {
            p.add(format!("{key}.upstreams"), "needs at least one upstream");
        }
        let upstreams = each(&route.upstreams, |j, u| {
            let parsed = Upstream::parse(u).and_then(|u| {
                if u.tls() && unverifiable {
                    Err(format!(
                        "{:?}: no trusted roots to verify it with (no system bundle at {}); \
                         set upstream.ca_file",
                        u.base(),
                        SYSTEM_BUNDLES[0]
                    ))
                } else {
                    Ok(u)
                }
            });
            p.take(format!("{key}.upstreams[{j}]"), parsed)
        })
        .filter(|u| !u.is_empty());
        let cost = if route.cost.is_finite() && route.cost > 0.0 && route.cost <= 1e9 {
            Some(route.cost)
        } else {
            p.add(format!("{key}.cost"), "must be a number greater than 0");
            None
        };
        let timeout = p.take(
            format!("{key}.timeout_ms"),
            within(route.timeout_ms, 1..=u64::MAX, "must be at least 1"),
        );
        let cost_header = match route.cost_header {
            None => Some(None),
            Some(name) => p
                .take(format!("{key}.cost_header"), cost_header(&name))
                .map(Some),
        };
        let balance = p.take(format!("{key}.balance"), balance(&route.balance));
        let public_plan = match route.public_plan {
            None => Some(None),
            Some(name) => p
                .take(format!("{key}.public_plan"), PlanName::parse(&name))
                .map(Some),
        };
        let health_check = match route.health_check {
            None => Some(None),
            Some(raw) => health_check(raw, &format!("{key}.health_check"), p).map(Some),
        };
        Some(RouteSettings {
            service: service?,
            prefix: prefix?,
            upstreams: upstreams?,
            balance: balance?,
            health_check: health_check?,
            cost: cost?,
            timeout: Duration::from_millis(timeout?),
            cost_header: cost_header?,
            public_plan: public_plan?,
        })
    })
}

/// Response headers a service cannot report its costs in: the gateway removes the cost
/// header from the response, so it must not be one the response is framed by, one that
/// never reaches the gateway (hop-by-hop), or one the gateway sets itself.
const NOT_A_COST_HEADER: [&str; 16] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "content-type",
    "content-encoding",
    "content-range",
    "ratelimit",
    "ratelimit-policy",
    "retry-after",
    "x-request-id",
];

/// A route's `cost_header`: a header name of the service's own.
fn cost_header(name: &str) -> Result<HeaderName, String> {
    let header = HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| format!("{name:?} is not a valid header name"))?;
    if NOT_A_COST_HEADER.contains(&header.as_str()) {
        return Err(format!(
            "{name:?} frames the response or is the gateway's own; use a header of the service's own, e.g. x-tollgate-cost"
        ));
    }
    Ok(header)
}

fn parse_listen(s: &str) -> Result<SocketAddr, String> {
    s.parse::<SocketAddr>()
        .map_err(|_| format!("{s:?} is not host:port (e.g. 127.0.0.1:8080)"))
}

/// A network, or a bare address as the network of that one address.
fn parse_cidr(s: &str) -> Option<IpNet> {
    s.parse::<IpNet>()
        .ok()
        .or_else(|| s.parse::<std::net::IpAddr>().ok().map(IpNet::from))
}

fn check_redis_url(url: &str) -> Result<(), String> {
    match redis::parse_redis_url(url) {
        Some(u) if u.scheme() == "redis" || u.scheme() == "rediss" => Ok(()),
        _ => Err(format!("{:?} is not a redis:// URL", redact_url(url))),
    }
}

/// A Redis URL with any password replaced by `***`, for logs and errors.
pub fn redact_url(url: &str) -> String {
    match redis::parse_redis_url(url) {
        Some(mut u) => {
            if u.password().is_some() {
                let _ = u.set_password(Some("***"));
            }
            u.to_string()
        }
        None => "<unparseable>".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(toml: &str, env: &[(&str, &str)]) -> Result<Settings, SettingsError> {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("t.toml");
        std::fs::write(&file, toml).unwrap();
        Settings::load_with_env(
            &[file],
            env.iter().map(|(k, v)| (k.to_string(), v.to_string())),
        )
    }

    fn problems(toml: &str) -> Vec<String> {
        match load(toml, &[]) {
            Err(SettingsError::Invalid(p)) => p.into_iter().map(|p| p.key).collect(),
            other => panic!("expected invalid settings, got {other:?}"),
        }
    }

    #[test]
    fn the_defaults_are_valid_and_embedded() {
        let s = load("", &[]).unwrap();
        assert!(s.uses_embedded_store());
        assert_eq!(s.redis.timeout, Duration::from_millis(5));
        assert_eq!(s.server.api_key_header, "x-api-key");
        assert_eq!(s.server.admin_listen, None);
        assert_eq!(s.server.workers, None);
        assert_eq!(s.limits.default_mode, Mode::Enforce);
        assert!(s.admin.jwt_hs256_secret.is_none());
        // The compiled-in periods are the design's (README, "Configuration reference").
        assert_eq!(s.periods, Periods::default());
        assert_eq!(
            s.overload,
            OverloadSettings {
                max_delay: Duration::from_millis(10),
                max_pending: 1024,
                max_wait: Duration::from_millis(100),
            }
        );
    }

    #[test]
    fn identity_providers_take_public_key_algorithms_and_known_scopes_only() {
        let s = load(
            "[[admin.issuers]]\nissuer = \"https://idp.example\"\nroles_claim = \"realm_access.roles\"\nroles = { ops = \"admin:read admin:write\" }\n",
            &[],
        )
        .unwrap();
        let idp = &s.admin.issuers[0];
        assert_eq!(idp.jwks_url, None, "from the discovery document");
        assert_eq!(idp.audience, "tollgate-admin");
        assert_eq!(idp.algorithms, [jsonwebtoken::Algorithm::RS256]);
        assert_eq!(idp.roles["ops"], ["admin:read", "admin:write"]);
        let keys = problems(
            "[[admin.issuers]]\nissuer = \"ops-idp\"\nalgorithms = [\"HS256\", \"none\"]\nroles = { ops = \"admin:root\" }\n\
             [[admin.issuers]]\nissuer = \"\"\njwks_url = \"ftp://x\"\n",
        );
        for k in [
            "admin.issuers[0].jwks_url",
            "admin.issuers[0].algorithms",
            "admin.issuers[0].roles.ops",
            "admin.issuers[1].issuer",
            "admin.issuers[1].jwks_url",
        ] {
            assert!(keys.contains(&k.to_string()), "{k} not in {keys:?}");
        }
    }

    #[test]
    fn the_catalog_is_a_mirror_unless_a_cache_is_asked_for_on_redis() {
        assert_eq!(load("", &[]).unwrap().catalog.holding, Holding::Mirror);
        let s = load(
            "[redis]\nurl = \"redis://127.0.0.1:6379\"\n[catalog]\nmode = \"cache\"\ncached_clients = 7\n",
            &[],
        )
        .unwrap();
        assert_eq!(
            s.catalog.holding,
            Holding::Cache(CacheBounds {
                clients: 7,
                unknown_keys: 100_000,
                unknown_for: Duration::from_secs(600),
                lookup_timeout: Duration::from_millis(50),
                key_filter_bits: 16 * 8 * 1024 * 1024,
            })
        );
        assert_eq!(problems("[catalog]\nmode = \"cache\"\n"), ["catalog.mode"]);
        assert_eq!(
            problems("[catalog]\nmode = \"lru\"\ncached_clients = 0\nlookup_timeout_ms = 0\nkey_filter_mib = 513\n"),
            [
                "catalog.cached_clients",
                "catalog.lookup_timeout_ms",
                "catalog.key_filter_mib",
                "catalog.mode"
            ]
        );
    }

    #[test]
    fn usage_history_settings_are_read_and_bad_ones_named() {
        let s = load(
            "[usage]\nenabled = false\nflush_ms = 2500\nretention_days = 7\nmax_entries = 10\n",
            &[],
        )
        .unwrap();
        assert!(!s.usage.enabled);
        assert_eq!(s.usage.flush, Duration::from_millis(2500));
        assert_eq!(s.usage.retention_days, 7);
        assert_eq!(s.usage.max_entries, 10);
        let d = load("", &[]).unwrap();
        assert!(d.usage.enabled);
        assert_eq!(d.usage.flush, Duration::from_secs(10));
        assert_eq!(d.usage.fold, Duration::from_secs(3600));
        assert_eq!(d.usage.adopt_after, Duration::from_secs(60));
        assert_eq!(d.usage.retention_days, 35);
        assert_eq!(
            problems("[usage]\nflush_ms = 1000\nfold_ms = 999\n"),
            ["usage.fold_ms"]
        );
        assert_eq!(
            problems("[usage]\nflush_ms = 1000\nadopt_after_ms = 2999\n"),
            ["usage.adopt_after_ms"]
        );
        assert_eq!(
            problems("[usage]\nflush_ms = 99\nretention_days = 0\nmax_entries = 0\n"),
            [
                "usage.flush_ms",
                "usage.retention_days",
                "usage.max_entries"
            ]
        );
    }

    #[test]
    fn overload_bounds_are_named_and_the_whole_wait_must_exceed_two_store_budgets() {
        let s = load(
            "[redis]\ntimeout_ms = 50\n[overload]\nmax_delay_ms = 3\nmax_pending = 7\nmax_wait_ms = 101\n",
            &[],
        )
        .unwrap();
        assert_eq!(s.overload.max_delay, Duration::from_millis(3));
        assert_eq!(s.overload.max_pending, 7);
        assert_eq!(s.overload.max_wait, Duration::from_millis(101));
        assert_eq!(
            problems("[overload]\nmax_delay_ms = 0\nmax_pending = 0\n"),
            ["overload.max_delay_ms", "overload.max_pending"]
        );
        assert_eq!(
            problems("[redis]\ntimeout_ms = 50\n[overload]\nmax_wait_ms = 100\n"),
            ["overload.max_wait_ms"]
        );
        // Automatic: four budgets, at least 100 ms.
        let wait = |toml: &str| load(toml, &[]).unwrap().overload.max_wait;
        assert_eq!(wait(""), Duration::from_millis(100));
        assert_eq!(wait("[redis]\ntimeout_ms = 2000\n"), Duration::from_secs(8));
    }

    #[test]
    fn upstream_settings_are_bounded_and_bad_ones_are_named() {
        let s = load(
            "[upstream]\neject_after = 0\nmax_tries = 1\nconnect_timeout_ms = 250\n",
            &[],
        )
        .unwrap();
        assert_eq!(s.upstream.eject_after, 0);
        assert_eq!(s.upstream.max_tries, 1);
        assert_eq!(s.upstream.connect_timeout, Duration::from_millis(250));
        assert_eq!(
            problems(
                "[upstream]\nmax_tries = 0\nretry_budget_percent = 101\nidle_timeout_ms = 0\n"
            ),
            [
                "upstream.idle_timeout_ms",
                "upstream.max_tries",
                "upstream.retry_budget_percent"
            ]
        );
        let idle = |toml: &str| load(toml, &[]).unwrap().upstream.websocket_idle_timeout;
        assert_eq!(idle(""), Duration::from_secs(60));
        assert_eq!(
            idle("[upstream]\nwebsocket_idle_timeout_ms = 300\n"),
            Duration::from_millis(300)
        );
        assert_eq!(
            problems("[upstream]\nwebsocket_idle_timeout_ms = 0\n"),
            ["upstream.websocket_idle_timeout_ms"]
        );
        assert_eq!(
            problems("[upstream]\nejection_ms = 5000\nmax_ejection_ms = 1000\n"),
            ["upstream.max_ejection_ms"]
        );
    }

    /// A CA's certificate in PEM.
    fn ca_pem() -> String {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let key = rcgen::KeyPair::generate().unwrap();
        params.self_signed(&key).unwrap().pem()
    }

    #[test]
    fn an_upstream_ca_file_replaces_the_system_roots_and_must_hold_certificates() {
        let dir = tempfile::tempdir().unwrap();
        let two = dir.path().join("two.pem");
        std::fs::write(&two, format!("{}{}", ca_pem(), ca_pem())).unwrap();
        let s = load(&format!("[upstream]\nca_file = {two:?}\n"), &[]).unwrap();
        assert!(s.upstream.trust.configured);
        assert_eq!(s.upstream.trust.file.as_deref(), Some(two.as_path()));
        assert_eq!(s.upstream.trust.store.len(), 2);

        let garbage = dir.path().join("garbage.pem");
        std::fs::write(&garbage, "not a certificate\n").unwrap();
        let key_only = dir.path().join("key.pem");
        std::fs::write(
            &key_only,
            rcgen::KeyPair::generate().unwrap().serialize_pem(),
        )
        .unwrap();
        for bad in [garbage, key_only, dir.path().join("absent.pem")] {
            assert_eq!(
                problems(&format!("[upstream]\nca_file = {bad:?}\n")),
                ["upstream.ca_file"],
                "{bad:?}"
            );
        }
    }

    #[test]
    fn without_a_ca_file_the_systems_bundle_is_trusted() {
        let s = load("", &[]).unwrap();
        assert!(!s.upstream.trust.configured);
        if Path::new(SYSTEM_BUNDLES[0]).is_file() {
            assert_eq!(
                s.upstream.trust.file.as_deref(),
                Some(Path::new(SYSTEM_BUNDLES[0]))
            );
            assert!(s.upstream.trust.store.len() > 10);
        }
    }

    #[test]
    fn ssl_cert_file_names_the_systems_bundle_and_one_that_does_not_load_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let bundle = dir.path().join("bundle.pem");
        let ca = rcgen::generate_simple_self_signed(vec!["ca.test".to_string()]).unwrap();
        std::fs::write(&bundle, ca.cert.pem()).unwrap();

        let trust = trust_roots("", Some(bundle.clone().into_os_string())).unwrap();
        assert_eq!(trust.file.as_deref(), Some(bundle.as_path()));
        assert_eq!(trust.store.len(), 1);
        assert!(!trust.configured);
        // `upstream.ca_file` wins over it.
        let configured = trust_roots(bundle.to_str().unwrap(), Some("/nowhere".into())).unwrap();
        assert!(configured.configured);

        let missing = trust_roots("", Some("/nowhere/bundle.pem".into())).unwrap_err();
        assert!(missing.contains("SSL_CERT_FILE") && missing.contains("/nowhere/bundle.pem"));
        std::fs::write(&bundle, "not a certificate").unwrap();
        let empty = trust_roots("", Some(bundle.into_os_string())).unwrap_err();
        assert!(empty.contains("no usable certificate"), "{empty}");
    }

    #[test]
    fn an_https_upstream_with_nothing_to_verify_it_against_is_named() {
        let mut upstream = load("", &[]).unwrap().upstream;
        upstream.trust = TrustRoots {
            file: None,
            configured: false,
            store: Arc::new(rustls::RootCertStore::empty()),
        };
        let route = |upstreams: &[&str]| RawRoute {
            service: "orders".into(),
            prefix: "/orders".into(),
            upstreams: upstreams.iter().map(|u| u.to_string()).collect(),
            cost: 1.0,
            timeout_ms: 1000,
            cost_header: None,
            balance: "least_request".into(),
            health_check: None,
            public_plan: None,
        };
        let mut p = Problems::default();
        let parsed = routes(
            vec![route(&["http://10.0.0.1", "https://10.0.0.2"])],
            Some(&upstream),
            &mut p,
        );
        assert!(parsed.is_none());
        let keys: Vec<&str> = p.0.iter().map(|p| p.key.as_str()).collect();
        assert_eq!(keys, ["routes[0].upstreams[1]"]);
        assert!(p.0[0].message.contains("upstream.ca_file"), "{:?}", p.0);

        let mut p = Problems::default();
        assert!(routes(vec![route(&["http://10.0.0.1"])], Some(&upstream), &mut p).is_some());
    }

    #[test]
    fn tls_is_off_by_default_and_a_half_pair_or_an_orphan_is_named() {
        let s = load("", &[]).unwrap();
        assert_eq!(s.tls.public, None);
        assert_eq!(s.tls.admin, None);
        assert_eq!(s.tls.watch, Some(Duration::from_secs(1)));
        let s = load(
            "[server]\nadmin_listen = \"127.0.0.1:0\"\n[tls]\ncert_file = \"c\"\nkey_file = \"k\"\nsni = [{ cert_file = \"c2\", key_file = \"k2\" }]\nadmin_cert_file = \"ac\"\nadmin_key_file = \"ak\"\nmin_version = \"1.3\"\nwatch_ms = 0\n",
            &[],
        )
        .unwrap();
        let public = s.tls.public.unwrap();
        assert_eq!(public.default.cert, PathBuf::from("c"));
        assert_eq!(public.sni[0].key, PathBuf::from("k2"));
        assert_eq!(s.tls.admin.unwrap().default.key, PathBuf::from("ak"));
        assert_eq!(s.tls.min_version, TlsVersion::V1_3);
        assert_eq!(s.tls.watch, None);
        assert_eq!(
            problems("[tls]\ncert_file = \"c\"\nmin_version = \"1.1\"\nwatch_ms = 3600001\n"),
            ["tls.key_file", "tls.min_version", "tls.watch_ms"]
        );
        assert_eq!(
            problems("[tls]\nsni = [{ cert_file = \"\", key_file = \"k\" }, { cert_file = \"\", key_file = \"\" }]\n"),
            ["tls.sni[0].cert_file", "tls.sni[1].cert_file", "tls.cert_file"]
        );
        assert_eq!(
            problems("[tls]\nadmin_cert_file = \"c\"\nadmin_key_file = \"k\"\n"),
            ["tls.admin_cert_file"]
        );
    }

    #[test]
    fn periods_are_durations_and_bad_ones_are_named() {
        let s = load(
            "[periods]\nhot_window_ms = 300\nbreaker_backoff_ms = 20\n",
            &[],
        )
        .unwrap();
        assert_eq!(s.periods.hot_window, Duration::from_millis(300));
        assert_eq!(s.periods.backoff.base, Duration::from_millis(20));
        assert_eq!(
            problems("[periods]\nshare_ms = 50\nshadow_flush_ms = 0\n"),
            ["periods.share_ms", "periods.shadow_flush_ms"]
        );
        assert_eq!(
            problems("[periods]\nbreaker_backoff_ms = 500\nbreaker_backoff_max_ms = 100\n"),
            ["periods.breaker_backoff_max_ms"]
        );
    }

    #[test]
    fn an_otlp_endpoint_is_an_http_base_url_and_off_by_default() {
        assert!(load("", &[]).unwrap().telemetry.otlp_endpoint.is_none());
        let s = load(
            "[telemetry]\notlp_endpoint = \"http://collector:4318\"\n",
            &[],
        )
        .unwrap();
        let endpoint = s.telemetry.otlp_endpoint.unwrap();
        assert_eq!(endpoint.base(), "http://collector:4318");
        for bad in [
            "collector:4318",
            "ftp://collector:4318",
            "http://collector:4318/v1/traces",
            "http://user:pw@collector",
        ] {
            let toml = format!("[telemetry]\notlp_endpoint = \"{bad}\"\n");
            assert_eq!(problems(&toml), ["telemetry.otlp_endpoint"], "{bad}");
        }
    }

    #[test]
    fn an_otlp_endpoint_may_be_https_and_its_spans_go_to_v1_traces() {
        let s = load(
            "[telemetry]\notlp_endpoint = \"https://api.collector.example/\"\n",
            &[],
        )
        .unwrap();
        let endpoint = s.telemetry.otlp_endpoint.unwrap();
        assert_eq!(endpoint.base(), "https://api.collector.example");
        assert_eq!(
            endpoint.traces_url(),
            "https://api.collector.example/v1/traces"
        );
        assert_eq!(s.telemetry.otlp_protocol, OtlpProtocol::HttpJson);
        assert_eq!(s.telemetry.otlp_compression, OtlpCompression::None);
        assert!(s.telemetry.otlp_headers.is_empty());
        assert!(s.telemetry.otlp_ca_file.is_none());
    }

    #[test]
    fn otlp_protocol_compression_and_ca_file_are_checked() {
        let s = load(
            "[telemetry]\notlp_protocol = \"http/protobuf\"\notlp_compression = \"gzip\"\n",
            &[],
        )
        .unwrap();
        assert_eq!(s.telemetry.otlp_protocol, OtlpProtocol::HttpProtobuf);
        assert_eq!(s.telemetry.otlp_compression, OtlpCompression::Gzip);
        assert_eq!(
            problems(
                "[telemetry]\notlp_protocol = \"grpc\"\notlp_compression = \"zstd\"\n\
                 otlp_ca_file = \"/no/such/ca.pem\"\n"
            ),
            [
                "telemetry.otlp_protocol",
                "telemetry.otlp_compression",
                "telemetry.otlp_ca_file"
            ]
        );
    }

    #[test]
    fn otlp_headers_are_name_value_pairs_whose_values_never_print() {
        let s = load(
            "",
            &[(
                "TOLLGATE__TELEMETRY__OTLP_HEADERS",
                "x-api-key=abc%3D%2C123 , X-Team=orders,",
            )],
        )
        .unwrap();
        let headers: Vec<(&str, &str)> = s
            .telemetry
            .otlp_headers
            .iter()
            .map(|h| (h.name.as_str(), h.value.expose_secret()))
            .collect();
        assert_eq!(headers, [("x-api-key", "abc=,123"), ("x-team", "orders")]);
        assert!(!format!("{s:?}").contains("abc=,123"));

        for bad in [
            "x-api-key",
            "bad name=1",
            "x-a=1,x-a=2",
            "content-type=text/plain",
            "x-a=%zz",
            "x-a=line%0Abreak",
            "x-a=",
        ] {
            let env = [("TOLLGATE__TELEMETRY__OTLP_HEADERS", bad)];
            match load("", &env) {
                Err(SettingsError::Invalid(p)) => {
                    assert_eq!(p.len(), 1, "{bad}");
                    assert_eq!(p[0].key, "telemetry.otlp_headers", "{bad}");
                    let secret = bad.split_once('=').map_or("", |(_, v)| v);
                    assert!(
                        secret.len() < 2 || !p[0].message.contains(secret),
                        "{bad}: {}",
                        p[0].message
                    );
                }
                other => panic!("{bad}: expected invalid settings, got {other:?}"),
            }
        }
    }

    #[test]
    fn environment_overrides_files() {
        let s = load(
            "[redis]\nurl = \"redis://a:1\"\n",
            &[
                ("TOLLGATE__REDIS__URL", "redis://127.0.0.1:6379"),
                ("TOLLGATE__REDIS__TIMEOUT_MS", "7"),
            ],
        )
        .unwrap();
        assert_eq!(
            s.redis.url.as_ref().map(|u| u.expose_secret()),
            Some("redis://127.0.0.1:6379")
        );
        assert_eq!(s.redis.timeout, Duration::from_millis(7));
    }

    #[test]
    fn every_bad_key_is_named() {
        let keys = problems(
            r#"
            [server]
            listen = "nowhere"
            region = "not a region!"
            [redis]
            timeout_ms = 0
            url = "http://x"
            [[catalog.plans]]
            name = "gold"
            capacity = 0
            rate = 1
            [[catalog.plans]]
            name = "silver"
            capacity = 10
            rate = -1
            [[catalog.clients]]
            id = "a b"
            plan = "gold"
            mode = "loud"
            [[routes]]
            service = "orders"
            prefix = "orders"
            upstreams = ["ftp://x"]
            "#,
        );
        for k in [
            "server.listen",
            "server.region",
            "redis.timeout_ms",
            "redis.url",
            "catalog.plans[0].capacity",
            "catalog.plans[1].rate",
            "catalog.clients[0].id",
            "catalog.clients[0].mode",
            "routes[0].prefix",
            "routes[0].upstreams[0]",
        ] {
            assert!(keys.contains(&k.to_string()), "{k} not in {keys:?}");
        }
    }

    #[test]
    fn a_plans_max_connections_is_one_to_a_million_or_absent() {
        let plan = |cap: &str| {
            format!("[[catalog.plans]]\nname = \"gold\"\ncapacity = 1\nrate = 1\n{cap}")
        };
        let s = load(&plan("max_connections = 3\n"), &[]).unwrap();
        assert_eq!(s.catalog.plans[0].max_connections.map(|m| m.get()), Some(3));
        let s = load(&plan(""), &[]).unwrap();
        assert_eq!(s.catalog.plans[0].max_connections, None);
        for bad in ["0", "1000001"] {
            assert_eq!(
                problems(&plan(&format!("max_connections = {bad}\n"))),
                ["catalog.plans[0].max_connections"],
                "{bad}"
            );
        }
    }

    #[test]
    fn a_plan_wrong_in_both_limits_names_both() {
        let keys = problems("[[catalog.plans]]\nname = \"gold\"\ncapacity = 0\nrate = 0\n");
        assert_eq!(keys, ["catalog.plans[0].capacity", "catalog.plans[0].rate"]);
    }

    #[test]
    fn a_key_declared_twice_is_named_wherever_it_is() {
        let hash = KeyHash::of("dev-key-shared");
        let keys = problems(&format!(
            r#"
            [[catalog.plans]]
            name = "gold"
            capacity = 10
            rate = 1
            [[catalog.clients]]
            id = "a"
            plan = "gold"
            keys = ["dev-key-shared"]
            [[catalog.clients]]
            id = "b"
            plan = "gold"
            key_hashes = ["{hash}"]
            [[catalog.clients]]
            id = "a"
            plan = "gold"
            "#
        ));
        assert_eq!(
            keys,
            ["catalog.clients[1].key_hashes[0]", "catalog.clients[2].id"]
        );
    }

    #[test]
    fn values_arrive_as_domain_types() {
        let hash = KeyHash::of("dev-key-hashed");
        let s = load(
            &format!(
                r#"
                [server]
                admin_listen = "127.0.0.1:9090"
                region = "eu"
                workers = 2
                api_key_header = "X-Client-Key"
                trusted_proxies = ["10.0.0.0/8", "192.168.1.7"]
                [redis]
                url = "redis://127.0.0.1:6379"
                control_timeout_ms = 250
                [catalog]
                refresh_ms = 500
                cache_file = ""
                [[catalog.plans]]
                name = "gold"
                capacity = 100
                rate = 50
                [[catalog.clients]]
                id = "acme"
                plan = "gold"
                mode = "shadow"
                keys = ["dev-key-acme"]
                key_hashes = ["{hash}"]
                [limits]
                default_mode = "shadow"
                [[routes]]
                service = "orders"
                prefix = "/orders"
                upstreams = ["http://127.0.0.1:9001"]
                timeout_ms = 1500
                "#
            ),
            &[],
        )
        .unwrap();

        assert_eq!(
            s.server.admin_listen,
            Some("127.0.0.1:9090".parse().unwrap())
        );
        assert_eq!(s.server.region, Region::parse("eu").unwrap());
        assert_eq!(s.server.workers, NonZeroUsize::new(2));
        assert_eq!(s.server.api_key_header, "x-client-key");
        assert_eq!(
            s.server.trusted_proxies,
            [
                "10.0.0.0/8".parse::<IpNet>().unwrap(),
                "192.168.1.7/32".parse().unwrap()
            ]
        );
        assert!(!s.uses_embedded_store());
        assert_eq!(s.redis.control_timeout, Duration::from_millis(250));
        assert_eq!(s.catalog.refresh, Duration::from_millis(500));
        assert_eq!(s.catalog.cache_file, None);
        let plan = &s.catalog.plans[0];
        let bucket = plan.limits.headline_bucket().unwrap();
        assert_eq!((bucket.capacity(), bucket.rate()), (100.0, 50.0));
        let client = &s.catalog.clients[0];
        assert_eq!(client.id, ClientId::parse("acme").unwrap());
        assert_eq!(client.mode, Some(Mode::Shadow));
        assert_eq!(client.keys, [KeyHash::of("dev-key-acme"), hash]);
        assert_eq!(s.limits.default_mode, Mode::Shadow);
        let route = &s.routes[0];
        assert_eq!(
            route.upstreams,
            [Upstream::parse("http://127.0.0.1:9001").unwrap()]
        );
        assert_eq!(route.timeout, Duration::from_millis(1500));
        assert_eq!(route.cost, 1.0);
        assert_eq!(route.cost_header, None);
    }

    #[test]
    fn a_cost_header_is_a_header_name_of_the_services_own() {
        let route = |header: &str| {
            format!(
                "[[routes]]\nservice = \"llm\"\nprefix = \"/llm\"\nupstreams = [\"http://127.0.0.1:9001\"]\ncost_header = {header:?}\n"
            )
        };
        let s = load(&route("X-Tollgate-Cost"), &[]).unwrap();
        assert_eq!(
            s.routes[0].cost_header,
            Some(HeaderName::from_static("x-tollgate-cost"))
        );
        for bad in [
            "",
            "x cost",
            "cost:",
            "Content-Length",
            "ratelimit",
            "connection",
        ] {
            assert_eq!(problems(&route(bad)), ["routes[0].cost_header"], "{bad:?}");
        }
    }

    #[test]
    fn a_file_that_cannot_be_read_is_told_apart_from_one_that_does_not_parse() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.toml");
        let no_env = std::iter::empty::<(String, String)>;

        let unreadable = [missing.clone(), dir.path().to_path_buf()].map(|file| {
            match Settings::load_with_env(std::slice::from_ref(&file), no_env()) {
                Err(SettingsError::Unreadable {
                    file: named,
                    reason,
                }) => {
                    assert_eq!(named, file);
                    reason
                }
                other => panic!("{file:?}: {other:?}"),
            }
        });
        assert_eq!(unreadable, ["no such file", "not a file"]);

        // A missing name is not completed to `<name>.toml`.
        std::fs::write(dir.path().join("missing.toml.toml"), "").unwrap();
        assert!(matches!(
            Settings::load_with_env(&[missing], no_env()),
            Err(SettingsError::Unreadable { .. })
        ));
        assert!(matches!(
            load("not toml\n", &[]),
            Err(SettingsError::Load(_))
        ));
    }

    #[test]
    fn an_unknown_key_is_refused() {
        match load("[server]\nlisen = \"x\"\n", &[]) {
            Err(SettingsError::Load(msg)) => assert!(msg.contains("lisen"), "{msg}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn secrets_do_not_show_in_debug_output() {
        let s = load(
            "[redis]\nurl = \"redis://:hunter2@127.0.0.1:6379\"\n[admin]\njwt_hs256_secret = \"s3cret-value-long-enough-0123456789\"\n",
            &[],
        )
        .unwrap();
        let dbg = format!("{s:?}");
        assert!(!dbg.contains("hunter2"));
        assert!(!dbg.contains("s3cret-value"));
    }

    #[test]
    fn a_short_hs256_secret_is_refused_by_name() {
        let keys = problems("[admin]\njwt_hs256_secret = \"0123456789abcdef0123456789abcde\"\n");
        assert_eq!(keys, ["admin.jwt_hs256_secret"]);
        assert!(load(
            "[admin]\njwt_hs256_secret = \"0123456789abcdef0123456789abcdef\"\n",
            &[]
        )
        .is_ok());
    }

    #[test]
    fn passwords_are_redacted_from_urls() {
        assert_eq!(
            redact_url("redis://:hunter2@127.0.0.1:6379"),
            "redis://:***@127.0.0.1:6379"
        );
    }
}
