//! What every handler shares: built once by `Application::build`, cloned into workers.

use std::sync::Arc;

use arc_swap::ArcSwap;
use ipnet::IpNet;

use crate::catalog::Catalog;
use crate::configuration::{UpstreamSettings, UsageSettings};
use crate::limiter::Limiter;
use crate::metrics::Metrics;
use crate::proxy::RouteTable;
use crate::store::Store;
use crate::tasks::Tasks;
use crate::trace::Tracer;

pub struct AppState {
    pub catalog: Arc<Catalog>,
    pub limiter: Arc<Limiter>,
    pub store: Store,
    /// Whether the store got the scripts and the declared catalog yet (it may have been
    /// down at start); admin requests wait for it.
    pub store_start: Arc<crate::catalog::StoreStart>,
    /// Swapped whole by a reload (`SIGHUP`); a request keeps the `Arc<Route>` it found.
    pub routes: ArcSwap<RouteTable>,
    pub metrics: Arc<Metrics>,
    /// Where requests' API keys are read from.
    pub key_sources: crate::proxy::KeySources,
    pub trusted_proxies: Vec<IpNet>,
    /// How requests without a key are grouped by address.
    pub edge: crate::configuration::EdgeSettings,
    /// Unknown keys counted per address group (`None`: not counted).
    pub failed_keys: Option<crate::limiter::FailedKeys>,
    /// How often each client read its own limits lately (see `edge.limits_path`): a
    /// bucket per client that did, so bounded by the catalog.
    pub views: crate::store::LocalBuckets<crate::domain::ClientId>,
    pub max_body_bytes: u64,
    /// `admin.catalog_max_bytes`: the largest catalog `PUT /admin/v1/catalog` reads.
    pub catalog_max_bytes: usize,
    /// What became of the quota warnings (`/metrics`).
    pub webhooks: Arc<crate::webhooks::WebhookStats>,
    /// `[upstream]`: how routes reach their replicas.
    pub upstream: UpstreamSettings,
    /// `[usage]`: how far back the usage history's reads may go.
    pub usage: UsageSettings,
    /// `limits.safety_multiplier`, until the admin API stores safety settings.
    pub safety_multiplier: f64,
    /// The span exporter, when `telemetry.otlp_endpoint` is set.
    pub traces: Option<Tracer>,
    /// The background tasks, for `/metrics` (their restarts).
    pub tasks: Tasks,
    /// The listeners' certificates, for `/metrics` (their expiry and reloads).
    pub tls: crate::tls::Listeners,
    /// The listeners' admission of connections, for `/metrics`.
    pub connections: crate::listen::Admissions,
    /// The open WebSocket relays: counted per client, closed at a stop.
    pub websockets: crate::proxy::Relays,
}
