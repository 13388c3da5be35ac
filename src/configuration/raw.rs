//! What the configuration sources say, as `config` deserializes them: the documented keys,
//! as strings and numbers. Nothing outside this module sees these types; [`super::parse`]
//! turns them into [`super::Settings`] once, naming every bad key.

use std::path::PathBuf;

use secrecy::SecretString;
use serde::Deserialize;

/// The defaults, compiled in so the binary starts without the repository beside it.
pub const DEFAULT_TOML: &str = include_str!("../../config/default.toml");

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSettings {
    pub(super) server: RawServer,
    pub(super) redis: RawRedis,
    pub(super) catalog: RawCatalog,
    pub(super) limits: RawLimits,
    pub(super) admin: RawAdmin,
    pub(super) periods: RawPeriods,
    pub(super) overload: RawOverload,
    pub(super) upstream: RawUpstream,
    pub(super) telemetry: RawTelemetry,
    pub(super) edge: RawEdge,
    pub(super) tls: RawTls,
    pub(super) warnings: RawWarnings,
    pub(super) usage: RawUsage,
    #[serde(default)]
    pub(super) routes: Vec<RawRoute>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawWarnings {
    pub(super) retries: u64,
    pub(super) backoff_ms: u64,
    pub(super) timeout_ms: u64,
    pub(super) queue: u64,
    #[serde(default)]
    pub(super) webhooks: Vec<RawWebhook>,
}

/// `[[warnings.webhooks]]`: an endpoint quota warnings are sent to.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawWebhook {
    pub(super) url: String,
    pub(super) secret: SecretString,
    #[serde(default)]
    pub(super) ca_file: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTls {
    pub(super) cert_file: PathBuf,
    pub(super) key_file: PathBuf,
    #[serde(default)]
    pub(super) sni: Vec<RawCertificate>,
    pub(super) admin_cert_file: PathBuf,
    pub(super) admin_key_file: PathBuf,
    pub(super) min_version: String,
    pub(super) watch_ms: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCertificate {
    pub(super) cert_file: PathBuf,
    pub(super) key_file: PathBuf,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawEdge {
    pub(super) ipv4_prefix: u8,
    pub(super) ipv6_prefix: u8,
    pub(super) failed_keys_burst: u32,
    pub(super) failed_keys_per_minute: f64,
    pub(super) failed_keys_sets: usize,
    pub(super) limits_path: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServer {
    pub(super) listen: String,
    pub(super) admin_listen: String,
    pub(super) region: String,
    pub(super) workers: usize,
    pub(super) api_key_header: String,
    pub(super) api_key_sources: Vec<String>,
    pub(super) api_key_query: String,
    pub(super) trusted_proxies: Vec<String>,
    pub(super) max_body_bytes: u64,
    pub(super) shutdown_timeout_s: u64,
    pub(super) http2: bool,
    pub(super) max_connections_per_address: u32,
    pub(super) new_connections_per_address: u32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRedis {
    pub(super) url: SecretString,
    pub(super) cluster_nodes: Vec<SecretString>,
    pub(super) regional_url: SecretString,
    pub(super) timeout_ms: u64,
    pub(super) control_timeout_ms: u64,
    pub(super) pool_size: u32,
    pub(super) key_prefix: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCatalog {
    pub(super) file: PathBuf,
    pub(super) refresh_ms: u64,
    pub(super) cache_file: PathBuf,
    pub(super) mode: String,
    pub(super) cached_clients: u64,
    pub(super) unknown_keys: u64,
    pub(super) unknown_for_ms: u64,
    pub(super) lookup_timeout_ms: u64,
    pub(super) key_filter_mib: u64,
    #[serde(default)]
    pub(super) plans: Vec<RawPlan>,
    #[serde(default)]
    pub(super) clients: Vec<RawClient>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPlan {
    pub(super) name: String,
    #[serde(default)]
    pub(super) capacity: Option<f64>,
    #[serde(default)]
    pub(super) rate: Option<f64>,
    /// Several limits instead of one `capacity` and `rate`.
    #[serde(default)]
    pub(super) limits: Vec<crate::domain::LimitSpec>,
    #[serde(default)]
    pub(super) description: Option<String>,
    /// A client's open upgraded connections at most (absent: no cap).
    #[serde(default)]
    pub(super) max_connections: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawClient {
    pub(super) id: String,
    pub(super) plan: String,
    #[serde(default)]
    pub(super) mode: Option<String>,
    #[serde(default)]
    pub(super) keys: Vec<SecretString>,
    #[serde(default)]
    pub(super) key_hashes: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLimits {
    pub(super) default_mode: String,
    pub(super) safety_multiplier: f64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawUsage {
    pub(super) enabled: bool,
    pub(super) flush_ms: u64,
    pub(super) fold_ms: u64,
    pub(super) adopt_after_ms: u64,
    pub(super) retention_days: u64,
    pub(super) max_entries: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPeriods {
    pub(super) hot_window_ms: u64,
    pub(super) share_ms: u64,
    pub(super) unshard_window_ms: u64,
    pub(super) shadow_flush_ms: u64,
    pub(super) key_use_flush_ms: u64,
    pub(super) debit_ms: u64,
    pub(super) breaker_backoff_ms: u64,
    pub(super) breaker_backoff_max_ms: u64,
    pub(super) breaker_stable_ms: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawOverload {
    pub(super) max_delay_ms: u64,
    pub(super) max_pending: u64,
    pub(super) max_wait_ms: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawUpstream {
    pub(super) connect_timeout_ms: u64,
    pub(super) idle_timeout_ms: u64,
    pub(super) eject_after: u64,
    pub(super) ejection_ms: u64,
    pub(super) max_ejection_ms: u64,
    pub(super) max_tries: u64,
    pub(super) retry_budget_percent: u64,
    pub(super) retry_min_concurrency: u64,
    pub(super) replay_body_bytes: u64,
    pub(super) body_timeout_ms: u64,
    pub(super) ca_file: String,
    pub(super) websocket_idle_timeout_ms: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTelemetry {
    pub(super) otlp_endpoint: String,
    pub(super) otlp_protocol: String,
    pub(super) otlp_compression: String,
    pub(super) otlp_headers: SecretString,
    pub(super) otlp_ca_file: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAdmin {
    pub(super) jwt_hs256_secret: SecretString,
    pub(super) jwt_public_key_pem: String,
    pub(super) jwt_issuer: String,
    pub(super) jwt_audience: String,
    pub(super) jwks_refetch_ms: u64,
    pub(super) jwks_refresh_ms: u64,
    pub(super) catalog_max_bytes: u64,
    #[serde(default)]
    pub(super) issuers: Vec<RawIssuer>,
}

/// `[[admin.issuers]]`: an identity provider whose tokens the admin API takes.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawIssuer {
    pub(super) issuer: String,
    #[serde(default)]
    pub(super) jwks_url: String,
    #[serde(default)]
    pub(super) audience: String,
    #[serde(default = "default_issuer_algorithms")]
    pub(super) algorithms: Vec<String>,
    #[serde(default)]
    pub(super) roles_claim: String,
    #[serde(default)]
    pub(super) roles: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    pub(super) ca_file: String,
}

fn default_issuer_algorithms() -> Vec<String> {
    vec!["RS256".to_string()]
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRoute {
    pub(super) service: String,
    pub(super) prefix: String,
    pub(super) upstreams: Vec<String>,
    #[serde(default = "default_cost")]
    pub(super) cost: f64,
    #[serde(default = "default_route_timeout")]
    pub(super) timeout_ms: u64,
    #[serde(default)]
    pub(super) cost_header: Option<String>,
    #[serde(default = "default_balance")]
    pub(super) balance: String,
    #[serde(default)]
    pub(super) health_check: Option<RawHealthCheck>,
    #[serde(default)]
    pub(super) public_plan: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawHealthCheck {
    pub(super) path: String,
    #[serde(default = "default_check_interval")]
    pub(super) interval_ms: u64,
    #[serde(default = "default_check_timeout")]
    pub(super) timeout_ms: u64,
    #[serde(default = "default_check_threshold")]
    pub(super) unhealthy_after: u64,
    #[serde(default = "default_check_threshold")]
    pub(super) healthy_after: u64,
}

fn default_balance() -> String {
    "least_request".into()
}

fn default_check_interval() -> u64 {
    5_000
}

fn default_check_timeout() -> u64 {
    1_000
}

fn default_check_threshold() -> u64 {
    2
}

fn default_cost() -> f64 {
    1.0
}

fn default_route_timeout() -> u64 {
    30_000
}

impl RawSettings {
    /// The compiled-in defaults, then each file in order, then `TOLLGATE__*` variables.
    /// Each file is one that opens (the caller checked: `readable` in `parse`). The error
    /// is a malformed file, an unknown key or a value of the wrong type.
    pub(super) fn load(
        files: &[PathBuf],
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<RawSettings, String> {
        let mut builder = config::Config::builder().add_source(config::File::from_str(
            DEFAULT_TOML,
            config::FileFormat::Toml,
        ));
        for file in files {
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
                .with_list_parse_key("server.api_key_sources")
                .try_parsing(true)
                .source(Some(env)),
        );
        builder
            .build()
            .and_then(|c| c.try_deserialize())
            .map_err(|e| e.to_string())
    }
}
