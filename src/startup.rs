//! The one entry point: [`Application::build`] binds, seeds and mirrors the catalog,
//! spawns background tasks (the health checker among them), and
//! [`Application::run_until_stopped`] serves until SIGTERM. [`Application::reload_on_sighup`]
//! swaps the routes when the configuration is read again ([`crate::reload`]).
//! `main` and the integration tests use the same path.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use actix_web::dev::{Server, ServerHandle};
use actix_web::middleware::from_fn;
use actix_web::{web, App, HttpServer};
use anyhow::Context;
use arc_swap::ArcSwap;
use tracing_actix_web::TracingLogger;

use crate::admin::{self, JwtVerifier};
use crate::catalog::{self, Catalog};
use crate::configuration::Settings;
use crate::limiter::Limiter;
use crate::metrics::Metrics;
use crate::proxy::{self, RouteTable};
use crate::reload::{self, Reloader};
use crate::state::AppState;
use crate::store::{Keys, Store, StoreKind};
use crate::trace::{self, Tracer};
use crate::{ops, telemetry};

/// How long a connection lingers after an answer that left the request body unread.
const LINGER: Duration = Duration::from_secs(1);

pub struct Application {
    port: u16,
    admin_port: Option<u16>,
    servers: Vec<Server>,
    state: web::Data<AppState>,
    /// What it started with: a reload applies its routes, and compares the rest with this.
    settings: Settings,
}

impl Application {
    pub async fn build(settings: Settings) -> anyhow::Result<Application> {
        let metrics = Arc::new(Metrics::default());
        metrics.reloads.loaded(reload::unix_ms());
        let keys = Keys::new(&settings.redis.key_prefix);
        let store = open_store(&settings, &keys)?;
        let region = &settings.server.region;
        let cache_file = settings
            .catalog
            .cache_file
            .clone()
            .filter(|_| !settings.uses_embedded_store());
        let catalog = Arc::new(
            Catalog::new(settings.limits.default_mode, keys.clone(), region.clone())
                .with_cache_file(cache_file),
        );
        prepare_store(&store, &catalog, &settings).await?;
        catalog.spawn_refresh(store.clone(), settings.catalog.refresh);
        if let Some(chore) = Arc::clone(&store.lifecycle).housekeeping() {
            tokio::spawn(chore);
        }

        let regional = open_regional_store(&settings, &keys, &store)?;
        if settings.redis.regional_url.is_some() && !settings.uses_embedded_store() {
            if let Err(e) = regional.lifecycle.load_scripts().await {
                tracing::warn!(error = %e, "regional store unavailable at start; its shards fail open until it answers");
            }
        }
        let limiter = Arc::new(Limiter::new(
            store.clone(),
            regional,
            region.clone(),
            Arc::clone(&catalog),
            settings.redis.timeout,
            Arc::clone(&metrics),
            settings.limits.safety_multiplier,
            settings.periods,
            settings.overload,
        ));
        limiter.spawn_background();
        let traces = match &settings.telemetry.otlp_endpoint {
            Some(endpoint) => Some(Tracer::start(trace::exporter(
                endpoint,
                &settings.telemetry,
            )?)),
            None => None,
        };
        let state = web::Data::new(AppState {
            catalog,
            limiter,
            store: store.clone(),
            routes: ArcSwap::from_pointee(RouteTable::new(&settings.routes)),
            metrics,
            api_key_header: settings.server.api_key_header.clone(),
            trusted_proxies: settings.server.trusted_proxies.clone(),
            max_body_bytes: settings.server.max_body_bytes.get(),
            upstream: settings.upstream,
            safety_multiplier: settings.limits.safety_multiplier,
            traces,
        });
        let traced = state.traces.is_some();
        // One checker for the process, reading whichever table is served now; it ends
        // when the state does.
        let served = Arc::downgrade(&state.clone().into_inner());
        proxy::spawn_health_checker(
            move || served.upgrade().map(|s| s.routes.load_full()),
            &settings.upstream,
        );
        let jwt = web::Data::new(JwtVerifier::from_settings(&settings.admin)?);

        let listener = TcpListener::bind(settings.server.listen)
            .with_context(|| format!("server.listen: cannot bind {}", settings.server.listen))?;
        let port = listener.local_addr()?.port();
        let separate_admin = settings.server.admin_listen.is_some();

        let mut servers = Vec::new();
        let (data, jwt_data) = (state.clone(), jwt.clone());
        let upstream = settings.upstream;
        let main = HttpServer::new(move || {
            // This closure runs once on each worker's thread: keep that worker's
            // request-path connections open from now on, re-opened as soon as one dies,
            // rather than on its first request, and measure its event loop's delay.
            let limiter = Arc::clone(&data.limiter);
            actix_web::rt::spawn(async move {
                futures_util::future::join(limiter.keep_connected(), limiter.watch_worker()).await
            });
            let app = App::new()
                .wrap(TracingLogger::<telemetry::RequestSpan>::new())
                .wrap(from_fn(proxy::request_id))
                .app_data(data.clone())
                .app_data(jwt_data.clone())
                .configure(ops::configure)
                .configure(|cfg| {
                    if !separate_admin {
                        ops::configure_metrics(cfg);
                        admin::configure(cfg);
                    }
                });
            // Every path no other service claims: the limiter, then the forward.
            let proxy = proxy::Guard(upstream);
            if traced {
                // The request span around both, only when spans are exported.
                app.service(
                    web::scope("")
                        .wrap(from_fn(trace::request))
                        .default_service(proxy),
                )
            } else {
                app.default_service(proxy)
            }
        });
        let shutdown_timeout_s = settings.server.shutdown_timeout.as_secs();
        // A request the gateway answers without reading its body (a 401, a 429, ...) keeps
        // that body's `Payload` until the answer is written (proxy::edge), so actix-http
        // closes the connection after lingering, reading and discarding, for at most this
        // long: nginx's lingering close, bounded, so that the client reads its answer
        // rather than a reset, and a client that never stops sending is cut off. Set here,
        // not left to actix-web's default (also 1 s today), because the bound is ours.
        let main = main
            .shutdown_timeout(shutdown_timeout_s)
            .backlog(4096)
            .client_disconnect_timeout(LINGER);
        let main = match settings.server.workers {
            Some(n) => main.workers(n.get()),
            None => main,
        };
        servers.push(main.listen(listener)?.run());

        let mut admin_port = None;
        if let Some(admin_listen) = settings.server.admin_listen {
            let listener = TcpListener::bind(admin_listen)
                .with_context(|| format!("server.admin_listen: cannot bind {admin_listen}"))?;
            admin_port = Some(listener.local_addr()?.port());
            let data = state.clone();
            let admin = HttpServer::new(move || {
                App::new()
                    .wrap(TracingLogger::<telemetry::RequestSpan>::new())
                    .wrap(from_fn(proxy::request_id))
                    .app_data(data.clone())
                    .app_data(jwt.clone())
                    .configure(ops::configure)
                    .configure(ops::configure_metrics)
                    .configure(admin::configure)
            })
            .workers(1)
            .shutdown_timeout(shutdown_timeout_s);
            servers.push(admin.listen(listener)?.run());
        }

        if !separate_admin {
            tracing::warn!("server.admin_listen is empty: the admin API, its docs and /metrics share the public listener; set it to a private address to serve them apart");
        }
        tracing::info!(
            listen = %SocketAddr::new(settings.server.listen.ip(), port),
            admin_port = ?admin_port,
            store = %store.lifecycle.describe(),
            region = %settings.server.region,
            "tollgate started"
        );
        if store.lifecycle.kind() == StoreKind::Embedded {
            tracing::info!(
                file = %settings.catalog.file.display(),
                "embedded store: buckets live in this process, so limits hold for this single instance only"
            );
        }
        warn_unless_persistent(store.clone(), Arc::clone(&state.catalog));
        Ok(Application {
            port,
            admin_port,
            servers,
            state,
            settings,
        })
    }

    /// From now on, every `SIGHUP` reads the configuration again from the compiled-in
    /// defaults, `files` (the `--config` files it started with) and the environment, and
    /// applies its routes, or refuses it and keeps serving the routes it has (README,
    /// "Upstreams"). Call it on a Tokio runtime.
    pub fn reload_on_sighup(&self, files: Vec<PathBuf>) -> std::io::Result<()> {
        reload::on_sighup(Reloader::new(
            files,
            self.settings.clone(),
            self.state.clone(),
        ))
    }

    /// The port the proxy listens on (useful with port 0).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The admin listener's port, when `server.admin_listen` is set.
    pub fn admin_port(&self) -> Option<u16> {
        self.admin_port
    }

    /// Handles to stop the servers gracefully.
    pub fn handles(&self) -> Vec<ServerHandle> {
        self.servers.iter().map(|s| s.handle()).collect()
    }

    pub fn state(&self) -> web::Data<AppState> {
        self.state.clone()
    }

    /// Serves until SIGTERM/SIGINT (or a handle's stop), then lets in-flight requests finish.
    pub async fn run_until_stopped(self) -> std::io::Result<()> {
        futures_util::future::try_join_all(self.servers).await?;
        Ok(())
    }
}

fn open_store(settings: &Settings, keys: &Keys) -> anyhow::Result<Store> {
    let redis = &settings.redis;
    if !redis.cluster_nodes.is_empty() {
        return Store::cluster(&redis.cluster_nodes, redis.control_timeout, keys.clone())
            .context("redis.cluster_nodes");
    }
    if let Some(url) = &redis.url {
        return Store::redis(url, redis.pool_size, redis.control_timeout, keys.clone())
            .context("redis.url");
    }
    Store::embedded(&settings.catalog.file).context("catalog.file")
}

/// The store holding this region's shards of hot clients: `redis.regional_url`, or the
/// global store when it is not set.
fn open_regional_store(settings: &Settings, keys: &Keys, global: &Store) -> anyhow::Result<Store> {
    let url = match &settings.redis.regional_url {
        Some(url) if !settings.uses_embedded_store() => url,
        _ => return Ok(global.clone()),
    };
    Store::redis(
        url,
        settings.redis.pool_size,
        settings.redis.control_timeout,
        keys.clone(),
    )
    .context("redis.regional_url")
}

/// Loads scripts, seeds the declared catalog and mirrors it. A Redis that is down at start
/// does not stop the gateway (it fails open); this is retried in the background instead.
async fn prepare_store(
    store: &Store,
    catalog: &Arc<Catalog>,
    settings: &Settings,
) -> anyhow::Result<()> {
    async fn attempt(store: &Store, catalog: &Catalog, settings: &Settings) -> anyhow::Result<()> {
        store.lifecycle.load_scripts().await?;
        catalog::seed(store, settings).await?;
        catalog.refresh(store).await?;
        Ok(())
    }
    match attempt(store, catalog, settings).await {
        Ok(()) => Ok(()),
        Err(e) if store.lifecycle.kind() == StoreKind::Embedded => Err(e),
        Err(e) if e.downcast_ref::<crate::store::StoreError>().is_none() => Err(e),
        Err(e) => {
            tracing::warn!(error = %e, "store unavailable at start; failing open and retrying");
            match catalog.serve_fallback(settings) {
                catalog::Source::Cache { saved_at_ms } => tracing::warn!(
                    file = %settings.catalog.cache_file.as_deref().unwrap_or(Path::new("")).display(),
                    age_s = catalog::cache::now_ms().saturating_sub(saved_at_ms) / 1000,
                    clients = catalog.len(),
                    "serving the last-known catalog from the cache file until the store answers"
                ),
                _ => tracing::warn!(
                    clients = catalog.len(),
                    "no catalog cache file: serving only the configuration's clients until the store answers"
                ),
            }
            let (store, catalog, settings) = (store.clone(), Arc::clone(catalog), settings.clone());
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    if attempt(&store, &catalog, &settings).await.is_ok() {
                        tracing::info!("store reachable; catalog seeded and mirrored");
                        return;
                    }
                }
            });
            Ok(())
        }
    }
}

/// Says once what the store keeps across its own restart, when it first answers (Redis may
/// be down at start), and warns when a plan has a quota and the store may forget its count:
/// a Redis restarted empty hands every client a fresh period (README, Durability).
fn warn_unless_persistent(store: Store, catalog: Arc<Catalog>) {
    tokio::spawn(async move {
        loop {
            match store.lifecycle.persistence().await {
                Ok(p) => {
                    // The warning first: once "store persistence" is in the log, so is it.
                    if catalog.has_quotas() && !p.keeps_quotas() {
                        tracing::warn!(
                            persistence = %p.describe(),
                            "a plan has a quota, and the store does not say it keeps every write: a restart of it can forget every quota's count and hand every client a fresh period (Redis: appendonly yes; see README, Durability)"
                        );
                    }
                    tracing::info!(persistence = %p.describe(), "store persistence");
                    return;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "store persistence not known yet; asking again");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    });
}
