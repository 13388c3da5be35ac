//! The one entry point: [`Application::build`] runs the start-up's steps in order (open
//! the store, mirror the catalog, open the regional store, start the limiter, share the
//! state, start the health checker and the servers), and
//! [`Application::run_until_stopped`] serves until SIGTERM, then stops and joins every
//! background task. [`Application::reload_on_sighup`] swaps the routes when the
//! configuration is read again ([`crate::reload`]). `main` and the integration tests use
//! the same path.
//!
//! Every long-lived background task starts under the application's [`Supervisor`]
//! ([`crate::tasks`]): here (the store's housekeeping, the start-up retry, the
//! persistence check), or in the part it belongs to, through the [`Tasks`] handed to it.

use std::net::{SocketAddr, TcpListener};
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use actix_web::dev::{Server, ServerHandle};
use actix_web::middleware::from_fn;
use actix_web::{web, App};
use anyhow::Context;
use arc_swap::ArcSwap;
use tracing_actix_web::TracingLogger;

use crate::admin::{self, JwtVerifier};
use crate::catalog::{self, Catalog, StoreStart};
use crate::configuration::Settings;
use crate::limiter::{Limiter, LimiterParts};
use crate::listen::{self, Admission, Admissions, Bounds, Serving};
use crate::metrics::Metrics;
use crate::proxy::{self, RouteTable};
use crate::reload::{self, Reloader};
use crate::state::AppState;
use crate::store::{Keys, Store, StoreKind};
use crate::tasks::{Policy, Supervisor, Tasks};
use crate::trace::{self, Tracer};
use crate::{ops, telemetry, tls};

/// How long a connection lingers after an answer that left the request body unread.
const LINGER: Duration = Duration::from_secs(1);

/// How long the background tasks get to stop once the servers have: each ends at its next
/// wait, so this is a bound for a stuck one, not a wait.
const TASKS_STOP_WITHIN: Duration = Duration::from_secs(5);

pub struct Application {
    /// Owns the background tasks. First, so that an application dropped without being run
    /// cancels them before the rest goes.
    supervisor: Supervisor,
    port: u16,
    admin_port: Option<u16>,
    servers: Vec<Server>,
    state: web::Data<AppState>,
    /// What it started with: a reload applies its routes, and compares the rest with this.
    settings: Settings,
}

/// The servers started, and the ports they listen on.
struct Listening {
    servers: Vec<Server>,
    port: u16,
    admin_port: Option<u16>,
}

impl Application {
    pub async fn build(settings: Settings) -> anyhow::Result<Application> {
        let supervisor = Supervisor::new();
        let tasks = supervisor.tasks();
        let metrics = Arc::new(Metrics::default());
        metrics.reloads.loaded(reload::unix_ms());
        let keys = Keys::new(&settings.redis.key_prefix);
        let store = open_store(&settings, &keys)?;
        let mirrored = mirror_catalog(&settings, &keys, &store, &tasks).await?;
        let catalog = Arc::clone(&mirrored.0);
        start_housekeeping(&store, &tasks);
        let regional = open_regional_store(&settings, &keys, &store).await?;
        // Quota warnings: claimed in the store under this gateway's own id.
        let holder = uuid::Uuid::new_v4().simple().to_string();
        let webhooks = crate::webhooks::start(&settings.warnings, &store, &holder, &tasks)?;
        let limiter = Limiter::start(LimiterParts {
            store: store.clone(),
            regional,
            region: settings.server.region.clone(),
            catalog: Arc::clone(&catalog),
            metrics: Arc::clone(&metrics),
            timeout: settings.redis.timeout,
            safety_multiplier: settings.limits.safety_multiplier,
            periods: settings.periods,
            overload: settings.overload,
            warnings: webhooks.warnings.clone(),
            usage: settings.usage,
            control_timeout: settings.redis.control_timeout,
            tasks: tasks.clone(),
        });
        let tls = tls::Listeners::load(&settings.tls)?;
        if let Some(every) = settings.tls.watch {
            tls::spawn_watch(&tls, every, &tasks);
        }
        let state = shared_state(
            &settings,
            mirrored,
            limiter,
            store,
            (metrics, webhooks.stats),
            tls,
            &tasks,
        )?;
        start_health_checks(&state, &settings, &tasks);
        proxy::close_on_sigterm(&state.websockets, &tasks)?;
        start_view_eviction(&state, &tasks);
        let jwt = web::Data::new(JwtVerifier::from_settings(&settings.admin)?);
        jwt.spawn_refresh(&tasks, settings.admin.jwks_refresh);
        let listening = start_servers(&settings, &state, &jwt)?;
        say_started(&settings, &state.store, &listening);
        warn_unless_persistent(&tasks, state.store.clone(), Arc::clone(&state.catalog));
        Ok(Application {
            supervisor,
            port: listening.port,
            admin_port: listening.admin_port,
            servers: listening.servers,
            state,
            settings,
        })
    }

    /// From now on, every `SIGHUP` reads the configuration again from the compiled-in
    /// defaults, `files` (the `--config` files it started with) and the environment, and
    /// applies its routes, or refuses it and keeps serving the routes it has (the book,
    /// "Upstreams"); and loads the listeners' certificates again (the book, "TLS"). Call it
    /// on a Tokio runtime.
    pub fn reload_on_sighup(&self, files: Vec<PathBuf>) -> std::io::Result<()> {
        let reloader = Reloader::new(files, self.settings.clone(), self.state.clone());
        reload::on_sighup(reloader, &self.supervisor.tasks())
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

    /// The background tasks: what runs, and how often each was restarted.
    pub fn tasks(&self) -> Tasks {
        self.supervisor.tasks()
    }

    /// Serves until SIGTERM/SIGINT (or a handle's stop), lets in-flight requests finish,
    /// then stops every background task and waits for it (at most 5 s).
    /// An essential task that fails stops the gateway the same way, and is the error.
    pub async fn run_until_stopped(self) -> std::io::Result<()> {
        let Application {
            supervisor,
            servers,
            ..
        } = self;
        let handles: Vec<ServerHandle> = servers.iter().map(Server::handle).collect();
        let mut serving = std::pin::pin!(futures_util::future::try_join_all(servers));
        let (served, failed) = tokio::select! {
            served = &mut serving => (served, None),
            failed = supervisor.stop_requested() => {
                tracing::error!(error = %failed, "stopping: the gateway cannot go on without this task");
                futures_util::future::join_all(handles.iter().map(|h| h.stop(true))).await;
                (serving.await, Some(failed))
            }
        };
        supervisor.shutdown(TASKS_STOP_WITHIN).await;
        served?;
        match failed {
            Some(failed) => Err(std::io::Error::other(failed)),
            None => Ok(()),
        }
    }
}

/// The in-memory catalog, seeded and mirrored from `store` (or, with the store down, from
/// the cache file or the configuration while a task keeps trying), and its refresh task.
async fn mirror_catalog(
    settings: &Settings,
    keys: &Keys,
    store: &Store,
    tasks: &Tasks,
) -> anyhow::Result<(Arc<Catalog>, Arc<StoreStart>)> {
    let cache_file = settings
        .catalog
        .cache_file
        .clone()
        .filter(|_| !settings.uses_embedded_store());
    let catalog = Arc::new(
        Catalog::new(
            settings.limits.default_mode,
            keys.clone(),
            settings.server.region.clone(),
        )
        .with_cache_file(cache_file)
        .with_holding(settings.catalog.holding),
    );
    let start = prepare_store(store, &catalog, settings, tasks).await?;
    catalog.spawn_refresh(tasks, store.clone(), settings.catalog.refresh);
    catalog
        .first_key_filter(store, crate::catalog::KEY_FILTER_AT_START)
        .await;
    catalog.spawn_key_filter(tasks, store.clone());
    catalog.spawn_key_use_flush(tasks, store.clone(), settings.periods.key_use_flush);
    Ok((catalog, start))
}

/// Starts task `store-housekeeping`, when the store has chores (the embedded store evicts
/// idle buckets).
fn start_housekeeping(store: &Store, tasks: &Tasks) {
    if Arc::clone(&store.lifecycle).housekeeping().is_none() {
        return;
    }
    let lifecycle = Arc::clone(&store.lifecycle);
    tasks.spawn("store-housekeeping", Policy::Restart, move |stop| {
        let chores = Arc::clone(&lifecycle).housekeeping();
        async move {
            if let Some(chores) = chores {
                stop.run_until_cancelled(chores).await;
            }
        }
    });
}

/// Starts task `view-eviction`: every 5 s, forgets the clients whose own-limits view
/// allowance is whole again (so it holds only clients that read it lately).
fn start_view_eviction(state: &web::Data<AppState>, tasks: &Tasks) {
    let state = state.clone();
    tasks.spawn("view-eviction", Policy::Restart, move |stop| {
        let state = state.clone();
        async move {
            stop.run_until_cancelled(async {
                let mut tick = tokio::time::interval(Duration::from_secs(5));
                loop {
                    tick.tick().await;
                    state.views.evict_idle();
                }
            })
            .await;
        }
    });
}

/// What every handler shares.
fn shared_state(
    settings: &Settings,
    (catalog, store_start): (Arc<Catalog>, Arc<StoreStart>),
    limiter: Arc<Limiter>,
    store: Store,
    (metrics, webhooks): (Arc<Metrics>, Arc<crate::webhooks::WebhookStats>),
    tls: tls::Listeners,
    tasks: &Tasks,
) -> anyhow::Result<web::Data<AppState>> {
    let traces = match &settings.telemetry.otlp_endpoint {
        Some(endpoint) => Some(Tracer::start(
            trace::exporter(endpoint, &settings.telemetry)?,
            tasks,
        )),
        None => None,
    };
    Ok(web::Data::new(AppState {
        catalog,
        limiter,
        store,
        store_start,
        routes: ArcSwap::from_pointee(RouteTable::new(&settings.routes)),
        metrics: Arc::clone(&metrics),
        key_sources: crate::proxy::KeySources::new(
            &settings.server.api_key_sources,
            &settings.server.api_key_header,
            &settings.server.api_key_query,
        ),
        trusted_proxies: settings.server.trusted_proxies.clone(),
        edge: settings.edge.clone(),
        views: Default::default(),
        failed_keys: crate::limiter::FailedKeys::new(
            settings.edge.failed_keys_sets,
            settings.edge.failed_keys_burst,
            settings.edge.failed_keys_per_minute,
        ),
        max_body_bytes: settings.server.max_body_bytes.get(),
        catalog_max_bytes: settings.admin.catalog_max_bytes,
        webhooks,
        upstream: settings.upstream.clone(),
        safety_multiplier: settings.limits.safety_multiplier,
        usage: settings.usage,
        traces,
        tasks: tasks.clone(),
        tls,
        connections: admissions(settings),
        websockets: proxy::Relays::new(
            settings.upstream.websocket_idle_timeout,
            settings.server.shutdown_timeout,
            metrics,
        ),
    }))
}

/// One checker for the process, reading whichever table is served now; it ends when the
/// gateway stops (or the state is gone).
fn start_health_checks(state: &web::Data<AppState>, settings: &Settings, tasks: &Tasks) {
    let served = Arc::downgrade(&state.clone().into_inner());
    proxy::spawn_health_checker(
        tasks,
        move || served.upgrade().map(|s| s.routes.load_full()),
        &settings.upstream,
    );
}

/// Each listener's admission of connections: `server.*_per_address`, with the trusted
/// proxies exempt and addresses grouped as the per-IP limits group them.
fn admissions(settings: &Settings) -> Admissions {
    let bounds = Bounds {
        open: settings.server.max_connections_per_address,
        per_second: settings.server.new_connections_per_address,
        exempt: settings.server.trusted_proxies.clone(),
        ipv4_prefix: settings.edge.ipv4_prefix,
        ipv6_prefix: settings.edge.ipv6_prefix,
    };
    Admissions {
        public: Admission::new("public", bounds.clone()),
        admin: settings
            .server
            .admin_listen
            .map(|_| Admission::new("admin", bounds)),
    }
}

/// Binds the listeners and starts the public server (the proxy, and the admin API when it
/// has no listener of its own) and, when `server.admin_listen` is set, the admin server.
fn start_servers(
    settings: &Settings,
    state: &web::Data<AppState>,
    jwt: &web::Data<JwtVerifier>,
) -> anyhow::Result<Listening> {
    let listener = TcpListener::bind(settings.server.listen)
        .with_context(|| format!("server.listen: cannot bind {}", settings.server.listen))?;
    let port = listener.local_addr()?.port();
    let mut servers = vec![public_server(settings, state, jwt, listener)?];
    let mut admin_port = None;
    if let Some(admin_listen) = settings.server.admin_listen {
        let listener = TcpListener::bind(admin_listen)
            .with_context(|| format!("server.admin_listen: cannot bind {admin_listen}"))?;
        admin_port = Some(listener.local_addr()?.port());
        servers.push(admin_server(settings, state, jwt, listener)?);
    }
    Ok(Listening {
        servers,
        port,
        admin_port,
    })
}

/// The proxy's server: every path no other service claims goes through the limiter, then
/// the forward; the health and metrics endpoints, and the admin API unless it has a
/// listener of its own.
fn public_server(
    settings: &Settings,
    state: &web::Data<AppState>,
    jwt: &web::Data<JwtVerifier>,
    listener: TcpListener,
) -> std::io::Result<Server> {
    let (data, jwt_data) = (state.clone(), jwt.clone());
    let separate_admin = settings.server.admin_listen.is_some();
    let traced = state.traces.is_some();
    let upstream = settings.upstream.clone();
    let limits_path = settings.edge.limits_path.clone();
    let main = move || {
        // This closure runs once on each worker's thread.
        data.limiter.start_worker();
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
        // Every path no other service claims: a client's own view, or the limiter, then
        // the forward.
        let proxy = proxy::Guard {
            upstream: upstream.clone(),
            limits_path: limits_path.clone(),
        };
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
    };
    // A request the gateway answers without reading its body (a 401, a 429, ...) keeps
    // that body's `Payload` until the answer is written (proxy::edge), so actix-http
    // closes the connection after lingering, reading and discarding, for at most this
    // long: nginx's lingering close, bounded, so that the client reads its answer rather
    // than a reset, and a client that never stops sending is cut off. Set here, not left
    // to actix-web's default (also 1 s today), because the bound is ours.
    let tls = match &state.tls.public {
        Some(served) => Some(tls_config(served, settings)?),
        None => None,
    };
    listen::serve(
        main,
        Serving {
            listener,
            tls,
            h2c: settings.server.http2,
            workers: settings.server.workers.map(NonZeroUsize::get),
            shutdown_timeout: settings.server.shutdown_timeout,
            backlog: 4096,
            linger: LINGER,
            admission: Arc::clone(&state.connections.public),
        },
    )
}

/// The admin server, on `server.admin_listen`: the admin API, its docs, health and metrics.
fn admin_server(
    settings: &Settings,
    state: &web::Data<AppState>,
    jwt: &web::Data<JwtVerifier>,
    listener: TcpListener,
) -> std::io::Result<Server> {
    let (data, jwt) = (state.clone(), jwt.clone());
    let admin = move || {
        App::new()
            .wrap(TracingLogger::<telemetry::RequestSpan>::new())
            .wrap(from_fn(proxy::request_id))
            .app_data(data.clone())
            .app_data(jwt.clone())
            .configure(ops::configure)
            .configure(ops::configure_metrics)
            .configure(admin::configure)
    };
    let tls = match &state.tls.admin {
        Some(served) => Some(tls_config(served, settings)?),
        None => None,
    };
    listen::serve(
        admin,
        Serving {
            listener,
            tls,
            h2c: settings.server.http2,
            workers: Some(1),
            shutdown_timeout: settings.server.shutdown_timeout,
            backlog: 1024,
            linger: LINGER,
            admission: state
                .connections
                .admin
                .clone()
                .expect("an admission for server.admin_listen"),
        },
    )
}

/// A TLS listener's configuration: `served`'s certificates, `tls.min_version`, and `h2` by
/// ALPN unless `server.http2` is off.
fn tls_config(
    served: &Arc<tls::Served>,
    settings: &Settings,
) -> std::io::Result<rustls::ServerConfig> {
    served
        .server_config(settings.tls.min_version, settings.server.http2)
        .map_err(std::io::Error::other)
}

/// Logs where it listens and what it stands on.
fn say_started(settings: &Settings, store: &Store, listening: &Listening) {
    if settings.server.admin_listen.is_none() {
        tracing::warn!("server.admin_listen is empty: the admin API, its docs and /metrics share the public listener; set it to a private address to serve them apart");
    }
    tracing::info!(
        listen = %SocketAddr::new(settings.server.listen.ip(), listening.port),
        admin_port = ?listening.admin_port,
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
}

/// The store the settings name: Redis Cluster, one Redis, or the embedded store.
pub fn open_store(settings: &Settings, keys: &Keys) -> anyhow::Result<Store> {
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

/// The store holding this region's shards of hot clients: `redis.regional_url`, its
/// scripts loaded (or, when it is down, its shards failing open until it answers), or the
/// global store when it is not set.
async fn open_regional_store(
    settings: &Settings,
    keys: &Keys,
    global: &Store,
) -> anyhow::Result<Store> {
    let url = match &settings.redis.regional_url {
        Some(url) if !settings.uses_embedded_store() => url,
        _ => return Ok(global.clone()),
    };
    let regional = Store::redis(
        url,
        settings.redis.pool_size,
        settings.redis.control_timeout,
        keys.clone(),
    )
    .context("redis.regional_url")?;
    if let Err(e) = regional.lifecycle.load_scripts().await {
        tracing::warn!(error = %e, "regional store unavailable at start; its shards fail open until it answers");
    }
    Ok(regional)
}

/// Loads scripts, seeds the declared catalog and mirrors it. A Redis that is down at start
/// does not stop the gateway (it fails open); task `store-start-retry` tries again every
/// second instead, until it has (an admin request tries at once: [`StoreStart`]).
async fn prepare_store(
    store: &Store,
    catalog: &Arc<Catalog>,
    settings: &Settings,
    tasks: &Tasks,
) -> anyhow::Result<Arc<StoreStart>> {
    let start = {
        let (store, catalog, settings) = (store.clone(), Arc::clone(catalog), settings.clone());
        Arc::new(StoreStart::new(Box::new(move || {
            let (store, catalog, settings) =
                (store.clone(), Arc::clone(&catalog), settings.clone());
            Box::pin(async move {
                store.lifecycle.load_scripts().await?;
                catalog::seed(&store, &settings).await?;
                catalog.refresh(&store).await?;
                Ok(())
            })
        })))
    };
    match start.ensure().await {
        Ok(()) => Ok(start),
        Err(e) if store.lifecycle.kind() == StoreKind::Embedded => Err(e),
        Err(e) if e.downcast_ref::<crate::store::StoreError>().is_none() => Err(e),
        Err(e) => {
            tracing::warn!(error = %e, "store unavailable at start; failing open and retrying");
            serve_fallback(catalog, settings);
            let retried = Arc::clone(&start);
            tasks.spawn("store-start-retry", Policy::UntilDone, move |stop| {
                let start = Arc::clone(&retried);
                async move {
                    let retrying = async {
                        loop {
                            tokio::time::sleep(Duration::from_secs(1)).await;
                            if start.done() {
                                return;
                            }
                            if start.ensure().await.is_ok() {
                                tracing::info!("store reachable; catalog seeded and mirrored");
                                return;
                            }
                        }
                    };
                    stop.run_until_cancelled(retrying).await;
                }
            });
            Ok(start)
        }
    }
}

/// Serves the last-known catalog from the cache file, or else the configuration's, and
/// says which.
fn serve_fallback(catalog: &Catalog, settings: &Settings) {
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
}

/// Starts task `store-persistence-check`, which says once what the store keeps across its
/// own restart, when it first answers (Redis may be down at start), and warns when a plan
/// has a quota and the store may forget its count: a Redis restarted empty hands every
/// client a fresh period (the book, "When things fail", "Durability").
fn warn_unless_persistent(tasks: &Tasks, store: Store, catalog: Arc<Catalog>) {
    tasks.spawn("store-persistence-check", Policy::UntilDone, move |stop| {
        let (store, catalog) = (store.clone(), Arc::clone(&catalog));
        async move {
            stop.run_until_cancelled(say_persistence(&store, &catalog))
                .await;
        }
    });
}

async fn say_persistence(store: &Store, catalog: &Catalog) {
    loop {
        match store.lifecycle.persistence().await {
            Ok(p) => {
                // The warning first: once "store persistence" is in the log, so is it.
                if catalog.has_quotas() && !p.keeps_quotas() {
                    tracing::warn!(
                        persistence = %p.describe(),
                        "a plan has a quota, and the store does not say it keeps every write: a restart of it can forget every quota's count and hand every client a fresh period (Redis: appendonly yes; see the book, When things fail, Durability)"
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
}
