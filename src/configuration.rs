//! Settings: `config/default.toml` (compiled in) → `--config` files → `TOLLGATE__*` env,
//! deserialized once and then [`Settings::validate`]d, which names every bad key.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use ipnet::IpNet;
use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

use crate::domain::{ClientId, KeyHash, Mode, Plan, PlanName, Region};

/// The defaults, compiled in so the binary starts without the repository beside it.
pub const DEFAULT_TOML: &str = include_str!("../config/default.toml");

/// Everything the gateway is configured with.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    pub server: ServerSettings,
    pub redis: RedisSettings,
    pub catalog: CatalogSettings,
    pub limits: LimitSettings,
    pub admin: AdminSettings,
    /// Upstream services, matched by longest path prefix.
    #[serde(default)]
    pub routes: Vec<RouteSettings>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSettings {
    /// Proxy, admin API and docs listen here (`host:port`; port 0 picks a free one).
    pub listen: String,
    /// When set, `/admin`, `/metrics` and the docs move to this listener.
    pub admin_listen: String,
    /// This instance's region; regional shards of hot clients use it.
    pub region: String,
    /// Actix worker threads; 0 means one per core.
    pub workers: usize,
    /// Request header that carries the client's API key.
    pub api_key_header: String,
    /// Peers (CIDRs) whose `X-Forwarded-For` is believed and extended rather than replaced.
    pub trusted_proxies: Vec<String>,
    /// Request bodies larger than this are refused with `413`.
    pub max_body_bytes: u64,
    /// After SIGTERM/SIGINT, in-flight requests get this long to finish.
    pub shutdown_timeout_s: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisSettings {
    /// `redis://[:password@]host:port[/db]`; empty selects the embedded store.
    pub url: SecretString,
    /// Redis Cluster seed nodes; when non-empty they are used instead of `url`.
    pub cluster_nodes: Vec<SecretString>,
    /// Redis holding this region's shards of hot clients; empty means `url`.
    pub regional_url: SecretString,
    /// Budget for one decision (pool checkout + script); past it the request fails open.
    pub timeout_ms: u64,
    /// Deadline of every store call off the request path (admin API, catalog refresh,
    /// shadow flush, reconciler, readiness) and of each new connection. A command that
    /// passes it replaces every connection to that Redis.
    pub control_timeout_ms: u64,
    /// Connections per gateway instance.
    pub pool_size: u32,
    /// Prefix of every key tollgate writes.
    pub key_prefix: String,
}

impl RedisSettings {
    pub fn control_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.control_timeout_ms)
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CatalogSettings {
    /// Embedded mode only: where plans and clients persist.
    pub file: PathBuf,
    /// Upper bound on how stale a gateway's in-memory copy of the catalog may be.
    pub refresh_ms: u64,
    /// Redis mode: where the last catalog this gateway mirrored is kept (key hashes only,
    /// owner-only permissions), to serve from when it starts while Redis is down; empty:
    /// keep none.
    pub cache_file: PathBuf,
    /// Plans created at start when absent.
    #[serde(default)]
    pub plans: Vec<PlanSettings>,
    /// Clients created at start when absent.
    #[serde(default)]
    pub clients: Vec<ClientSettings>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanSettings {
    pub name: String,
    /// Bucket size in tokens (≥ 1).
    pub capacity: f64,
    /// Refill in tokens per second (> 0).
    pub rate: f64,
    #[serde(default)]
    pub description: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientSettings {
    pub id: String,
    pub plan: String,
    /// `enforce` or `shadow`; absent means `limits.default_mode`.
    #[serde(default)]
    pub mode: Option<String>,
    /// Plaintext API keys, for development; only their hashes are stored.
    #[serde(default)]
    pub keys: Vec<SecretString>,
    /// `sha256:<hex>` hashes of API keys.
    #[serde(default)]
    pub key_hashes: Vec<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitSettings {
    /// Mode of clients that set none.
    pub default_mode: String,
    /// Coarse per-(client, service) limit as a multiple of the plan.
    pub safety_multiplier: f64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminSettings {
    /// HS256 secret for admin JWTs.
    pub jwt_hs256_secret: SecretString,
    /// Path to an RS256/ES256 public key (PEM) for admin JWTs.
    pub jwt_public_key_pem: String,
    pub jwt_issuer: String,
    pub jwt_audience: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteSettings {
    /// Name of the upstream service (used in metrics and safety limits).
    pub service: String,
    /// Path prefix; the longest matching prefix wins and is kept when forwarding.
    pub prefix: String,
    /// Replicas, balanced round-robin.
    pub upstreams: Vec<String>,
    /// Tokens one request takes.
    #[serde(default = "default_cost")]
    pub cost: f64,
    /// Upstream response deadline; past it the gateway answers `504`.
    #[serde(default = "default_route_timeout")]
    pub timeout_ms: u64,
}

fn default_cost() -> f64 {
    1.0
}

fn default_route_timeout() -> u64 {
    30_000
}

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
    #[error("{0}")]
    Load(String),
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
        let mut builder = config::Config::builder().add_source(config::File::from_str(
            DEFAULT_TOML,
            config::FileFormat::Toml,
        ));
        for file in files {
            if !file.exists() {
                return Err(SettingsError::Load(format!(
                    "--config {}: no such file",
                    file.display()
                )));
            }
            builder = builder.add_source(config::File::from(file.as_path()).required(true));
        }
        let env: config::Map<String, String> = env
            .into_iter()
            .filter(|(k, _)| k.starts_with("TOLLGATE__"))
            .collect();
        builder = builder.add_source(
            config::Environment::with_prefix("TOLLGATE")
                .prefix_separator("__")
                .separator("__")
                .list_separator(",")
                .with_list_parse_key("redis.cluster_nodes")
                .with_list_parse_key("server.trusted_proxies")
                .try_parsing(true)
                .source(Some(env)),
        );
        let settings: Settings = builder
            .build()
            .and_then(|c| c.try_deserialize())
            .map_err(|e| SettingsError::Load(e.to_string()))?;
        settings.validate().map_err(SettingsError::Invalid)?;
        Ok(settings)
    }

    /// Every problem with these settings, each naming its key.
    pub fn validate(&self) -> Result<(), Vec<Problem>> {
        let mut problems = Vec::new();
        let mut bad = |key: &str, message: String| {
            problems.push(Problem {
                key: key.to_string(),
                message,
            })
        };

        if let Err(e) = parse_listen(&self.server.listen) {
            bad("server.listen", e);
        }
        if !self.server.admin_listen.is_empty() {
            if let Err(e) = parse_listen(&self.server.admin_listen) {
                bad("server.admin_listen", e);
            }
        }
        if let Err(e) = Region::parse(&self.server.region) {
            bad("server.region", e.to_string());
        }
        if self.server.workers > 1024 {
            bad("server.workers", "must be at most 1024".into());
        }
        if actix_web::http::header::HeaderName::from_bytes(self.server.api_key_header.as_bytes())
            .is_err()
        {
            bad(
                "server.api_key_header",
                format!(
                    "{:?} is not a valid header name",
                    self.server.api_key_header
                ),
            );
        }
        for (i, cidr) in self.server.trusted_proxies.iter().enumerate() {
            if parse_cidr(cidr).is_none() {
                bad(
                    &format!("server.trusted_proxies[{i}]"),
                    format!("{cidr:?} is not an IP address or CIDR"),
                );
            }
        }
        if self.server.max_body_bytes == 0 {
            bad("server.max_body_bytes", "must be at least 1".into());
        }

        for (key, url) in [
            ("redis.url", &self.redis.url),
            ("redis.regional_url", &self.redis.regional_url),
        ] {
            let url = url.expose_secret();
            if !url.is_empty() {
                if let Err(e) = check_redis_url(url) {
                    bad(key, e);
                }
            }
        }
        for (i, url) in self.redis.cluster_nodes.iter().enumerate() {
            if let Err(e) = check_redis_url(url.expose_secret()) {
                bad(&format!("redis.cluster_nodes[{i}]"), e);
            }
        }
        if self.redis.timeout_ms == 0 || self.redis.timeout_ms > 10_000 {
            bad("redis.timeout_ms", "must be between 1 and 10000".into());
        }
        if self.redis.control_timeout_ms < 10 || self.redis.control_timeout_ms > 60_000 {
            bad(
                "redis.control_timeout_ms",
                "must be between 10 and 60000".into(),
            );
        }
        if self.redis.pool_size == 0 || self.redis.pool_size > 1024 {
            bad("redis.pool_size", "must be between 1 and 1024".into());
        }
        if self.redis.key_prefix.contains(['{', '}']) {
            bad(
                "redis.key_prefix",
                "must not contain '{' or '}' (they delimit cluster hash tags)".into(),
            );
        }

        if self.catalog.refresh_ms < 10 || self.catalog.refresh_ms > 600_000 {
            bad("catalog.refresh_ms", "must be between 10 and 600000".into());
        }
        if self.uses_embedded_store() && self.catalog.file.as_os_str().is_empty() {
            bad(
                "catalog.file",
                "must be set when the embedded store is used".into(),
            );
        }
        let mut plan_names = std::collections::HashSet::new();
        for (i, p) in self.catalog.plans.iter().enumerate() {
            let key = format!("catalog.plans[{i}]");
            match PlanName::parse(&p.name) {
                Ok(name) => {
                    if !plan_names.insert(name) {
                        bad(
                            &format!("{key}.name"),
                            format!("plan {:?} declared twice", p.name),
                        );
                    }
                }
                Err(e) => bad(&format!("{key}.name"), e.to_string()),
            }
            if let Err(e) = Plan::new(p.capacity, p.rate) {
                bad(&format!("{key}.{}", e.field()), e.to_string());
            }
        }
        let mut client_ids = std::collections::HashSet::new();
        let mut key_hashes = std::collections::HashSet::new();
        for (i, c) in self.catalog.clients.iter().enumerate() {
            let key = format!("catalog.clients[{i}]");
            match ClientId::parse(&c.id) {
                Ok(id) => {
                    if !client_ids.insert(id) {
                        bad(
                            &format!("{key}.id"),
                            format!("client {:?} declared twice", c.id),
                        );
                    }
                }
                Err(e) => bad(&format!("{key}.id"), e.to_string()),
            }
            if let Err(e) = PlanName::parse(&c.plan) {
                bad(&format!("{key}.plan"), e.to_string());
            }
            if let Some(mode) = &c.mode {
                if let Err(e) = mode.parse::<Mode>() {
                    bad(&format!("{key}.mode"), e);
                }
            }
            for (j, k) in c.keys.iter().enumerate() {
                let k = k.expose_secret();
                if let Err(e) = crate::domain::ApiKey::parse(k) {
                    bad(&format!("{key}.keys[{j}]"), e.to_string());
                } else if !key_hashes.insert(KeyHash::of(k)) {
                    bad(&format!("{key}.keys[{j}]"), "key used twice".into());
                }
            }
            for (j, h) in c.key_hashes.iter().enumerate() {
                match h.parse::<KeyHash>() {
                    Ok(h) => {
                        if !key_hashes.insert(h) {
                            bad(&format!("{key}.key_hashes[{j}]"), "key used twice".into());
                        }
                    }
                    Err(e) => bad(&format!("{key}.key_hashes[{j}]"), e),
                }
            }
        }

        if let Err(e) = self.limits.default_mode.parse::<Mode>() {
            bad("limits.default_mode", e);
        }
        let m = self.limits.safety_multiplier;
        if !(m.is_finite() && (1.0..=1_000.0).contains(&m)) {
            bad(
                "limits.safety_multiplier",
                "must be a number between 1 and 1000".into(),
            );
        }

        let secret = self.admin.jwt_hs256_secret.expose_secret();
        if !secret.is_empty() && secret.len() < MIN_HS256_SECRET {
            bad(
                "admin.jwt_hs256_secret",
                format!(
                    "must be at least {MIN_HS256_SECRET} bytes (got {}): a short HMAC secret can be guessed offline from one token",
                    secret.len()
                ),
            );
        }
        if !self.admin.jwt_public_key_pem.is_empty()
            && !Path::new(&self.admin.jwt_public_key_pem).is_file()
        {
            bad(
                "admin.jwt_public_key_pem",
                format!("{:?} is not a readable file", self.admin.jwt_public_key_pem),
            );
        }

        let mut prefixes = std::collections::HashSet::new();
        for (i, r) in self.routes.iter().enumerate() {
            let key = format!("routes[{i}]");
            if r.service.is_empty()
                || r.service.len() > 64
                || !r
                    .service
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
            {
                bad(
                    &format!("{key}.service"),
                    "must be 1-64 characters of A-Z a-z 0-9 - _ .".into(),
                );
            }
            if !r.prefix.starts_with('/') {
                bad(&format!("{key}.prefix"), "must start with '/'".into());
            } else if !prefixes.insert(r.prefix.trim_end_matches('/').to_string()) {
                bad(
                    &format!("{key}.prefix"),
                    format!("{:?} used twice", r.prefix),
                );
            }
            if r.upstreams.is_empty() {
                bad(
                    &format!("{key}.upstreams"),
                    "needs at least one upstream".into(),
                );
            }
            for (j, u) in r.upstreams.iter().enumerate() {
                if let Err(e) = crate::domain::Upstream::parse(u) {
                    bad(&format!("{key}.upstreams[{j}]"), e);
                }
            }
            if !(r.cost.is_finite() && r.cost > 0.0 && r.cost <= 1e9) {
                bad(
                    &format!("{key}.cost"),
                    "must be a number greater than 0".into(),
                );
            }
            if r.timeout_ms == 0 {
                bad(&format!("{key}.timeout_ms"), "must be at least 1".into());
            }
        }

        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems)
        }
    }

    /// No Redis configured: limiter and catalog live in this process.
    pub fn uses_embedded_store(&self) -> bool {
        self.redis.url.expose_secret().is_empty() && self.redis.cluster_nodes.is_empty()
    }

    /// The configured default mode (validated).
    pub fn default_mode(&self) -> Mode {
        self.limits.default_mode.parse().unwrap_or(Mode::Enforce)
    }

    /// Trusted proxy networks (validated).
    pub fn trusted_proxies(&self) -> Vec<IpNet> {
        self.server
            .trusted_proxies
            .iter()
            .filter_map(|c| parse_cidr(c))
            .collect()
    }
}

/// RFC 7518 3.2: an HS256 key must be at least as long as the hash, 256 bits.
pub const MIN_HS256_SECRET: usize = 32;

fn parse_listen(s: &str) -> Result<SocketAddr, String> {
    s.parse::<SocketAddr>()
        .map_err(|_| format!("{s:?} is not host:port (e.g. 127.0.0.1:8080)"))
}

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
        assert_eq!(s.redis.timeout_ms, 5);
        assert_eq!(s.server.api_key_header, "x-api-key");
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
        assert_eq!(s.redis.url.expose_secret(), "redis://127.0.0.1:6379");
        assert_eq!(s.redis.timeout_ms, 7);
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
