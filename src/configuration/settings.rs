//! The gateway's settings as domain types: every value here was parsed once, from the
//! keys documented beside each field, and is valid; consumers read fields, never strings.

use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroU64, NonZeroUsize};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use actix_web::http::header::HeaderName;
use ipnet::IpNet;
use secrecy::SecretString;

use super::periods::Periods;
use crate::domain::{
    ClientId, KeyHash, Limits, MaxConnections, Mode, PlanName, Region, ServiceName, Upstream,
};

/// Everything the gateway is configured with.
#[derive(Debug, Clone)]
pub struct Settings {
    pub server: ServerSettings,
    pub redis: RedisSettings,
    pub catalog: CatalogSettings,
    pub limits: LimitSettings,
    pub admin: AdminSettings,
    /// `periods`: how often the limiter's background work runs.
    pub periods: Periods,
    /// `overload`: when a worker sheds requests rather than decide them late.
    pub overload: OverloadSettings,
    /// `upstream`: how routes reach their replicas.
    pub upstream: UpstreamSettings,
    pub telemetry: TelemetrySettings,
    /// `edge`: what the edge does for requests without a key.
    pub edge: EdgeSettings,
    /// `tls`: TLS on the listeners.
    pub tls: TlsSettings,
    /// `usage`: usage history (README, "Usage history").
    pub usage: UsageSettings,
    /// `routes`: upstream services, matched by longest path prefix.
    pub routes: Vec<RouteSettings>,
    /// `warnings`: where quota warnings are sent.
    pub warnings: WarningSettings,
}

/// `[warnings]`: quota warnings (a plan's quota `warn_at`), sent to every webhook.
#[derive(Debug, Clone)]
pub struct WarningSettings {
    /// `warnings.retries`: a delivery that fails is tried again this many times at most.
    pub retries: u32,
    /// `warnings.backoff_ms`: the wait before the first retry, doubled each time (at most
    /// a minute).
    pub backoff: Duration,
    /// `warnings.timeout_ms`: each try's deadline.
    pub timeout: Duration,
    /// `warnings.queue`: warnings waiting to be sent, at most (more are dropped, counted).
    pub queue: usize,
    /// `[[warnings.webhooks]]`: none: no warning is looked for.
    pub webhooks: Vec<WebhookSettings>,
}

/// `[[warnings.webhooks]]`: an endpoint every quota warning is sent to, signed with its
/// own secret.
#[derive(Clone)]
pub struct WebhookSettings {
    pub url: String,
    /// The HMAC-SHA256 key of its `Tollgate-Signature` header.
    pub secret: SecretString,
    /// A PEM file of CA certificates trusted beside the public roots.
    pub ca_file: Option<PathBuf>,
}

impl std::fmt::Debug for WebhookSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookSettings")
            .field("url", &self.url)
            .field("secret", &"[redacted]")
            .field("ca_file", &self.ca_file)
            .finish()
    }
}

#[derive(Debug, Clone)]
pub struct ServerSettings {
    /// `server.listen`: proxy, admin API and docs listen here (port 0 picks a free one).
    pub listen: SocketAddr,
    /// `server.admin_listen` (`""`: none): when set, `/admin`, `/metrics` and the docs
    /// move to this listener.
    pub admin_listen: Option<SocketAddr>,
    /// `server.region`: this instance's region; regional shards of hot clients use it.
    pub region: Region,
    /// `server.workers` (`0`: none): actix worker threads; `None` means one per core.
    pub workers: Option<NonZeroUsize>,
    /// `server.api_key_header`: request header that carries the client's API key.
    pub api_key_header: HeaderName,
    /// `server.api_key_sources`: where a request's API key is looked for, in this order
    /// (the order names them in a `401`; a key in two of them is refused).
    pub api_key_sources: Vec<KeySource>,
    /// `server.api_key_query`: the query parameter of the `query` source.
    pub api_key_query: String,
    /// `server.trusted_proxies`: peers whose `X-Forwarded-For` is believed and extended
    /// rather than replaced (a bare address is a one-address network).
    pub trusted_proxies: Vec<IpNet>,
    /// `server.max_body_bytes`: request bodies larger than this are refused with `413`.
    pub max_body_bytes: NonZeroU64,
    /// `server.shutdown_timeout_s`: after SIGTERM/SIGINT, in-flight requests get this long
    /// to finish (whole seconds).
    pub shutdown_timeout: Duration,
    /// `server.http2`: the listeners speak HTTP/2 too: over TLS when the client asks by
    /// ALPN, and in cleartext to a client that starts with HTTP/2's preface (h2c).
    pub http2: bool,
    /// `server.max_connections_per_address` (`0`: no bound): connections one client address
    /// group may have open at once on a listener; more are reset before their handshake.
    pub max_connections_per_address: Option<NonZeroU32>,
    /// `server.new_connections_per_address` (`0`: no bound): connections one client address
    /// group may open a second on a listener (a second's worth at once); more are reset
    /// before their handshake.
    pub new_connections_per_address: Option<NonZeroU32>,
}

#[derive(Debug, Clone)]
pub struct RedisSettings {
    /// `redis.url` (`""`: none): `redis://[:password@]host:port[/db]`; with no URL and no
    /// cluster nodes the embedded store is used.
    pub url: Option<SecretString>,
    /// `redis.cluster_nodes`: Redis Cluster seed nodes; when non-empty they are used
    /// instead of `url`.
    pub cluster_nodes: Vec<SecretString>,
    /// `redis.regional_url` (`""`: none): Redis holding this region's shards of hot
    /// clients; `None` means the global store.
    pub regional_url: Option<SecretString>,
    /// `redis.timeout_ms`: budget for one decision (pool checkout + script); past it the
    /// request fails open.
    pub timeout: Duration,
    /// `redis.control_timeout_ms`: deadline of every store call off the request path (admin
    /// API, catalog refresh, shadow flush, reconciler, readiness) and of each new
    /// connection. A command that passes it replaces every connection to that Redis.
    pub control_timeout: Duration,
    /// `redis.pool_size`: connections per gateway instance (1-1024).
    pub pool_size: u32,
    /// `redis.key_prefix`: prefix of every key tollgate writes (no `{` or `}`).
    pub key_prefix: String,
}

#[derive(Debug, Clone)]
pub struct CatalogSettings {
    /// `catalog.file`: embedded mode only: where plans and clients persist.
    pub file: PathBuf,
    /// `catalog.refresh_ms`: upper bound on how stale a gateway's in-memory copy of the
    /// catalog may be.
    pub refresh: Duration,
    /// `catalog.cache_file` (`""`: none): Redis mode: where the last catalog this gateway
    /// mirrored is kept (key hashes only, owner-only permissions), to serve from when it
    /// starts while Redis is down.
    pub cache_file: Option<PathBuf>,
    /// `catalog.mode` and its bounds: whether this gateway holds every client or a
    /// bounded cache of the ones in use.
    pub holding: Holding,
    /// `catalog.plans`: plans created at start when absent.
    pub plans: Vec<PlanSettings>,
    /// `catalog.clients`: clients created at start when absent.
    pub clients: Vec<ClientSettings>,
}

/// What a gateway holds of the catalog (`catalog.mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holding {
    /// `"mirror"`: every plan and client, followed from the change feed.
    Mirror,
    /// `"cache"` (Redis only): every plan, and the clients in use, looked up by key on a miss.
    Cache(CacheBounds),
}

/// The bounds of a gateway's catalog cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheBounds {
    /// `catalog.cached_clients`: clients held at most.
    pub clients: u64,
    /// `catalog.unknown_keys`: keys remembered as unknown at most.
    pub unknown_keys: u64,
    /// `catalog.unknown_for_ms`: how long a key is remembered as unknown.
    pub unknown_for: Duration,
    /// `catalog.lookup_timeout_ms`: how long a request with a key not cached waits for the
    /// store before it is answered `503`.
    pub lookup_timeout: Duration,
    /// `catalog.key_filter_mib`, in bits: the size of the store's key filter when this
    /// gateway starts one (0: none; see `catalog::key_filter`).
    pub key_filter_bits: u64,
}

/// A declared plan (`[[catalog.plans]]`).
#[derive(Debug, Clone)]
pub struct PlanSettings {
    /// `name`.
    pub name: PlanName,
    /// `limits`, or one bucket of `capacity` (tokens) and `rate` (tokens per second).
    pub limits: Limits,
    /// `description`.
    pub description: Option<String>,
    /// `max_connections`: a client's open upgraded (WebSocket) connections at most, on each
    /// gateway (`None`: no cap).
    pub max_connections: Option<MaxConnections>,
}

/// A declared client (`[[catalog.clients]]`).
#[derive(Debug, Clone)]
pub struct ClientSettings {
    /// `id`.
    pub id: ClientId,
    /// `plan`: a plan's name (it must exist when the client is seeded).
    pub plan: PlanName,
    /// `mode`: absent means `limits.default_mode`.
    pub mode: Option<Mode>,
    /// Every key of the client, as stored: the plaintext `keys` (for development) hashed,
    /// then the `key_hashes` (`sha256:<hex>`). No two declared keys are the same.
    pub keys: Vec<KeyHash>,
}

#[derive(Debug, Clone)]
pub struct LimitSettings {
    /// `limits.default_mode`: mode of clients that set none.
    pub default_mode: Mode,
    /// `limits.safety_multiplier`: coarse per-(client, service) limit as a multiple of the
    /// plan (1-1000).
    pub safety_multiplier: f64,
}

/// Where a request's API key may come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeySource {
    /// `header`: the `server.api_key_header` header.
    Header,
    /// `bearer`: `Authorization: Bearer <key>`.
    Bearer,
    /// `query`: the `server.api_key_query` query parameter.
    Query,
}

impl KeySource {
    pub fn parse(s: &str) -> Result<KeySource, String> {
        match s {
            "header" => Ok(KeySource::Header),
            "bearer" => Ok(KeySource::Bearer),
            "query" => Ok(KeySource::Query),
            _ => Err(format!("{s:?} is not one of header, bearer, query")),
        }
    }
}

/// TLS on the listeners (README, "TLS"): which certificates each serves, and how they are
/// kept current.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSettings {
    /// `tls.cert_file`, `tls.key_file` and `tls.sni` (`None`: `server.listen` is plain
    /// HTTP).
    pub public: Option<Certificates>,
    /// `tls.admin_cert_file` and `tls.admin_key_file` (`None`: `server.admin_listen` serves
    /// the public certificates, or plain HTTP when there are none).
    pub admin: Option<Certificates>,
    /// `tls.min_version`: the oldest protocol version accepted (1.2 or 1.3).
    pub min_version: TlsVersion,
    /// `tls.watch_ms` (`0`: none): how often the files are checked for a change; a change
    /// (and `SIGHUP`, always) loads them again.
    pub watch: Option<Duration>,
}

/// The certificates one listener serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Certificates {
    /// Served when the client names no host, or one no certificate has.
    pub default: CertificateFiles,
    /// `tls.sni`: more, each served to clients that name a host it is for (its subject
    /// alternative names, wildcards included).
    pub sni: Vec<CertificateFiles>,
}

/// A certificate chain and its private key, as PEM files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertificateFiles {
    /// The chain, leaf first.
    pub cert: PathBuf,
    /// The leaf's private key (PKCS #8, PKCS #1 or SEC 1).
    pub key: PathBuf,
}

/// A TLS protocol version a listener accepts at least.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsVersion {
    V1_2,
    V1_3,
}

/// Usage history: what each gateway counts per client, limit and hour, and how long the
/// store keeps it (README, "Usage history").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UsageSettings {
    /// `usage.enabled`: whether decisions are counted and flushed at all.
    pub enabled: bool,
    /// `usage.flush_ms`: what the gateway counted and has not folded is checkpointed in
    /// the store this often (one value: another gateway adds it should this one die).
    pub flush: Duration,
    /// `usage.fold_ms`: counts are added to the history this often, each client's once
    /// per fold, on the fold's boundary (multiples of it since the epoch, plus a
    /// gateway's own delay of up to a tenth of it, at most a minute), and once more at a
    /// graceful stop. At least `flush`.
    pub fold: Duration,
    /// `usage.adopt_after_ms`: a gateway silent this long (no checkpoint written) has its
    /// checkpoint added by another. At least three times `flush`.
    pub adopt_after: Duration,
    /// `usage.retention_days`: the store keeps each UTC day this many days after it ends;
    /// the admin API reads at most this far back.
    pub retention_days: u64,
    /// `usage.max_entries`: (client, limit, hour) counts a gateway holds at most, unsent
    /// ones included (the store down); past it new ones are dropped, counted in
    /// `tollgate_usage_dropped_total`.
    pub max_entries: usize,
}

/// How requests without a key are told apart (README, "Public routes").
#[derive(Debug, Clone, PartialEq)]
pub struct EdgeSettings {
    /// `edge.ipv4_prefix` (1-32): an IPv4 client is limited by this many leading bits of
    /// its address (32: each address alone).
    pub ipv4_prefix: u8,
    /// `edge.ipv6_prefix` (1-128): an IPv6 client by this many (64: one subscriber's
    /// network, as providers hand them out).
    pub ipv6_prefix: u8,
    /// `edge.failed_keys_burst` (1-1000000): unknown keys an address group may send before
    /// it is answered `429`...
    pub failed_keys_burst: u32,
    /// `edge.failed_keys_per_minute` (0.001-1000000): ...and how many more a minute after.
    pub failed_keys_per_minute: f64,
    /// `edge.failed_keys_sets` (0-16777216; 0: not counted): the size of each gateway's
    /// table of address groups (4 per set, 136 bytes a set).
    pub failed_keys_sets: usize,
    /// `edge.limits_path` (`""`: none): where a client reads its own limits with its key,
    /// spending nothing (`GET`/`HEAD`).
    pub limits_path: Option<String>,
}

/// When a worker is overloaded, and how long a decision may take in all (see
/// `limiter::overload`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OverloadSettings {
    /// `overload.max_delay_ms`: a worker whose event loop runs a ready task this late is
    /// overloaded, and sheds the requests of clients with a decision already pending on it.
    pub max_delay: Duration,
    /// `overload.max_pending`: undecided requests per worker past which every new one is
    /// shed.
    pub max_pending: usize,
    /// `overload.max_wait_ms`: a decision not made by then, whatever held it, is shed;
    /// more than twice `redis.timeout_ms`, so a slow store fails open first (`0`, the
    /// default: four times `redis.timeout_ms`, at least 100 ms).
    pub max_wait: Duration,
}

/// How routes reach their replicas: connections, ejection, retries, TLS (README,
/// "Upstreams").
#[derive(Debug, Clone, PartialEq)]
pub struct UpstreamSettings {
    /// `upstream.connect_timeout_ms`: a replica that has not accepted a connection (and,
    /// for `https://`, finished the TLS handshake) by then has failed; the request is
    /// tried on another (nothing was sent).
    pub connect_timeout: Duration,
    /// `upstream.idle_timeout_ms`: a pooled connection idle this long is closed, before the
    /// service closes it itself (the keep-alive race).
    pub idle_timeout: Duration,
    /// `upstream.eject_after` (`0`: never): failures in a row that set a replica aside.
    pub eject_after: u32,
    /// `upstream.ejection_ms`: how long a first ejection lasts; each further ejection of a
    /// replica ejected recently lasts once more (2x, 3x, ...).
    pub ejection: Duration,
    /// `upstream.max_ejection_ms`: the longest an ejection lasts.
    pub max_ejection: Duration,
    /// `upstream.max_tries`: tries per request, the first included.
    pub max_tries: u32,
    /// `upstream.retry_budget_percent`: retries in flight on a route at most this share of
    /// its requests in flight...
    pub retry_budget_percent: u32,
    /// `upstream.retry_min_concurrency`: ...or this many, whichever is more.
    pub retry_min_concurrency: u32,
    /// `upstream.replay_body_bytes`: request bodies up to this size are kept, so a request
    /// can be tried again after its body was sent.
    pub replay_body_bytes: u64,
    /// `upstream.body_timeout_ms`: a request body that sends nothing for this long is cut
    /// off, and its connection closed.
    pub body_timeout: Duration,
    /// `upstream.ca_file` (`""`: the system's roots): what the certificates of `https://`
    /// replicas are verified against.
    pub trust: TrustRoots,
    /// `upstream.websocket_idle_timeout_ms`: an upgraded (WebSocket) connection that carries
    /// no byte either way for this long is closed (README, "WebSocket").
    pub websocket_idle_timeout: Duration,
}

/// The certificates an `https://` replica's chain must lead to: those of
/// `upstream.ca_file`, or the system's bundle. Read once per load of the configuration.
#[derive(Clone)]
pub struct TrustRoots {
    /// The PEM file they were read from (`None`: no `ca_file`, and the host has no bundle).
    pub file: Option<PathBuf>,
    /// Whether `file` is `upstream.ca_file` (else the system's bundle).
    pub configured: bool,
    /// Shared by every TLS client built from them (one per worker, the health checker's).
    pub store: Arc<rustls::RootCertStore>,
}

impl TrustRoots {
    /// No certificate: an `https://` replica cannot be verified.
    pub fn is_empty(&self) -> bool {
        self.store.is_empty()
    }
}

/// Certificates are compared, not just the file's name: a reload that reads a changed
/// file is a change (one that needs a restart).
impl PartialEq for TrustRoots {
    fn eq(&self, other: &TrustRoots) -> bool {
        self.file == other.file
            && self.configured == other.configured
            && self.store.roots == other.store.roots
    }
}

/// The file and a count: a bundle's certificates would fill a settings dump.
impl std::fmt::Debug for TrustRoots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrustRoots")
            .field("file", &self.file)
            .field("configured", &self.configured)
            .field("certificates", &self.store.len())
            .finish()
    }
}

/// How a route picks a replica (`routes[].balance`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Balance {
    /// `"least_request"` (the default): the one with fewer requests in flight of two picked
    /// at random (power of two choices), so a slow replica gets less traffic.
    LeastRequest,
    /// `"round_robin"`: each in turn.
    RoundRobin,
}

/// A route's active health checks (`[routes.health_check]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthCheckSettings {
    /// `path`: what is fetched (`GET`) from every replica; a `2xx` passes.
    pub path: String,
    /// `interval_ms`: how often.
    pub interval: Duration,
    /// `timeout_ms`: no answer by then fails the check.
    pub timeout: Duration,
    /// `unhealthy_after`: failed checks in a row that take a replica out.
    pub unhealthy_after: u32,
    /// `healthy_after`: passed checks in a row that bring it back.
    pub healthy_after: u32,
}

/// Where spans go and how (README, "Tracing").
#[derive(Debug, Clone)]
pub struct TelemetrySettings {
    /// `telemetry.otlp_endpoint` (`""`: none): an OTLP/HTTP collector,
    /// `http[s]://host[:port]`; when set, spans are posted to its `/v1/traces`. W3C Trace
    /// Context is propagated to upstreams either way.
    pub otlp_endpoint: Option<OtlpEndpoint>,
    /// `telemetry.otlp_protocol`: `"http/json"` (the default) or `"http/protobuf"`.
    pub otlp_protocol: OtlpProtocol,
    /// `telemetry.otlp_compression`: `"none"` (the default) or `"gzip"`.
    pub otlp_compression: OtlpCompression,
    /// `telemetry.otlp_headers` (`""`: none): headers sent with every export, e.g. a hosted
    /// collector's API key, as `name=value,name=value` (values percent-encoded where they
    /// hold a comma or a percent sign: the format of `OTEL_EXPORTER_OTLP_HEADERS`). Secret:
    /// never printed.
    pub otlp_headers: Vec<OtlpHeader>,
    /// `telemetry.otlp_ca_file` (`""`: none): a PEM file of certificates trusted for an
    /// `https://` endpoint besides the public roots (Mozilla's, built in): a private CA's,
    /// or a collector's self-signed one.
    pub otlp_ca_file: Option<PathBuf>,
}

/// An OTLP/HTTP collector: scheme and authority, no path (`/v1/traces` is appended).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtlpEndpoint {
    base: String,
}

impl OtlpEndpoint {
    /// `http://host[:port]` or `https://host[:port]`, with no path, query or credentials.
    pub fn parse(s: &str) -> Result<OtlpEndpoint, String> {
        let uri: actix_web::http::Uri = s
            .parse()
            .map_err(|_| format!("{s:?} is not a URL like http://collector:4318"))?;
        let scheme = uri.scheme_str().unwrap_or_default();
        if !matches!(scheme, "http" | "https") {
            return Err(format!("{s:?}: only http:// and https:// are supported"));
        }
        let authority = uri
            .authority()
            .filter(|a| !a.as_str().contains('@') && !a.host().is_empty())
            .ok_or_else(|| format!("{s:?} needs a host and no credentials"))?;
        if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
            return Err(format!(
                "{s:?} must not have a path or query (/v1/traces is appended)"
            ));
        }
        Ok(OtlpEndpoint {
            base: format!("{scheme}://{authority}"),
        })
    }

    /// `scheme://authority`.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// Where spans are posted.
    pub fn traces_url(&self) -> String {
        format!("{}/v1/traces", self.base)
    }
}

/// How spans are encoded (`telemetry.otlp_protocol`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OtlpProtocol {
    /// `"http/json"`: OTLP/HTTP with JSON bodies.
    HttpJson,
    /// `"http/protobuf"`: OTLP/HTTP with protobuf bodies (smaller, cheaper to encode).
    HttpProtobuf,
}

/// How export bodies are compressed (`telemetry.otlp_compression`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OtlpCompression {
    None,
    Gzip,
}

/// A header sent with every export; its value is secret (`Debug` shows `[REDACTED]`).
#[derive(Debug, Clone)]
pub struct OtlpHeader {
    pub name: HeaderName,
    pub value: SecretString,
}

#[derive(Debug, Clone)]
pub struct AdminSettings {
    /// `admin.jwt_hs256_secret` (`""`: none): HS256 secret for admin JWTs, at least
    /// [`super::MIN_HS256_SECRET`] bytes.
    pub jwt_hs256_secret: Option<SecretString>,
    /// `admin.jwt_public_key_pem` (`""`: none): an RS256/ES256 public key (PEM) file for
    /// admin JWTs; it wins over the HS256 secret for verifying.
    pub jwt_public_key_pem: Option<PathBuf>,
    /// `admin.jwt_issuer`: required `iss`.
    pub jwt_issuer: String,
    /// `admin.jwt_audience`: required `aud`.
    pub jwt_audience: String,
    /// `admin.jwks_refetch_ms`: a token naming a key id an issuer's keys lack makes the
    /// gateway read that issuer's JWKS again, at most once in this long.
    pub jwks_refetch: Duration,
    /// `admin.jwks_refresh_ms`: each issuer's JWKS is read again this often.
    pub jwks_refresh: Duration,
    /// `admin.catalog_max_bytes`: the largest whole catalog `PUT /admin/v1/catalog` reads
    /// (every other admin body is 64 KiB at most).
    pub catalog_max_bytes: usize,
    /// `[[admin.issuers]]`: identity providers whose tokens the admin API takes.
    pub issuers: Vec<IssuerSettings>,
}

/// An identity provider (`[[admin.issuers]]`): its tokens are verified with the keys of
/// its JWKS, with the algorithms configured here (never the token's choice), and their
/// roles give the admin scopes.
#[derive(Debug, Clone)]
pub struct IssuerSettings {
    /// `issuer`: the `iss` its tokens carry (an `https://` URL for OpenID Connect).
    pub issuer: String,
    /// `jwks_url` (`""`: read from `<issuer>/.well-known/openid-configuration`'s
    /// `jwks_uri`).
    pub jwks_url: Option<String>,
    /// `audience` (`""`: `admin.jwt_audience`): the `aud` its tokens must carry.
    pub audience: String,
    /// `algorithms` (default `["RS256"]`): asymmetric only.
    pub algorithms: Vec<jsonwebtoken::Algorithm>,
    /// `roles_claim` (`""`: none): the claim holding the token's roles or groups, a dotted
    /// path into nested objects (`realm_access.roles`), an array of strings or a
    /// space-separated string.
    pub roles_claim: Option<String>,
    /// `roles`: role name → the admin scopes it gives (`"admin:read admin:write"`).
    pub roles: std::collections::BTreeMap<String, Vec<String>>,
    /// `ca_file` (`""`: none): PEM certificates trusted for its `https://` documents
    /// besides the built-in public roots (a private CA).
    pub ca_file: Option<PathBuf>,
}

/// A route (`[[routes]]`).
#[derive(Debug, Clone)]
pub struct RouteSettings {
    /// `service`: name of the upstream service (used in metrics and safety limits).
    pub service: ServiceName,
    /// `prefix`: path prefix starting with `/`; the longest matching prefix wins and is
    /// kept when forwarding.
    pub prefix: String,
    /// `upstreams`: replicas (at least one).
    pub upstreams: Vec<Upstream>,
    /// `balance`: how a replica is picked.
    pub balance: Balance,
    /// `health_check` (absent: none): active checks.
    pub health_check: Option<HealthCheckSettings>,
    /// `cost`: tokens one request takes (default 1).
    pub cost: f64,
    /// `timeout_ms`: upstream response deadline (default 30 s); past it the gateway answers
    /// `504`.
    pub timeout: Duration,
    /// `cost_header` (absent: none): a response header in which the service may report an
    /// admitted request's real cost (a number from 0 to 1e9); the difference to `cost` is
    /// debited or refunded after the response, and the header is not passed to the client.
    pub cost_header: Option<HeaderName>,
    /// `public_plan` (absent: none): the route is public. A request without a key is
    /// limited per client address (see [`EdgeSettings`]) by this catalog plan; a request
    /// with a key still by its client's plan.
    pub public_plan: Option<PlanName>,
}

impl Settings {
    /// No Redis configured: limiter and catalog live in this process.
    pub fn uses_embedded_store(&self) -> bool {
        self.redis.url.is_none() && self.redis.cluster_nodes.is_empty()
    }
}
