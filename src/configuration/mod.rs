//! Settings: `config/default.toml` (compiled in) → `--config` files → `TOLLGATE__*` env,
//! deserialized into the keys as written (a private raw layer), then parsed once into
//! [`Settings`]: addresses, regions, header names, networks, modes, durations, ids, key
//! hashes and upstreams, so nothing downstream parses a setting again. Parsing names every
//! bad key ([`SettingsError::Invalid`]), not only the first.

mod parse;
mod periods;
mod raw;
mod settings;

pub use parse::{redact_url, Problem, SettingsError, MIN_HS256_SECRET};
pub use periods::{BackOff, Periods};
pub use raw::DEFAULT_TOML;
pub use settings::{
    AdminSettings, Balance, CacheBounds, CatalogSettings, CertificateFiles, Certificates,
    ClientSettings, EdgeSettings, HealthCheckSettings, Holding, IssuerSettings, KeySource,
    LimitSettings, OtlpCompression, OtlpEndpoint, OtlpHeader, OtlpProtocol, OverloadSettings,
    PlanSettings, RedisSettings, RouteSettings, ServerSettings, Settings, TelemetrySettings,
    TlsSettings, TlsVersion, TrustRoots, UpstreamSettings, UsageSettings, WarningSettings,
    WebhookSettings,
};
