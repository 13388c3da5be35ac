//! One TOML builder for a gateway's configuration: its listener and workers, the store,
//! the admin API, a catalog (plans and clients, with the catalog file in a directory of
//! the caller's) and routes; and the snippets tests layer on top of it.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// A plan in the gateway's catalog.
#[derive(Debug, Clone)]
pub struct PlanDef {
    pub name: String,
    pub capacity: f64,
    pub rate: f64,
}

/// A client in the gateway's catalog, with one API key.
#[derive(Debug, Clone)]
pub struct ClientDef {
    pub id: String,
    pub plan: String,
    pub key: String,
}

/// A route: service, prefix, replicas.
#[derive(Debug, Clone)]
pub struct RouteDef {
    pub service: String,
    pub prefix: String,
    pub upstreams: Vec<String>,
}

impl PlanDef {
    pub fn toml(&self) -> String {
        format!(
            "[[catalog.plans]]\nname = {:?}\ncapacity = {:?}\nrate = {:?}\n",
            self.name, self.capacity, self.rate
        )
    }
}

impl ClientDef {
    pub fn toml(&self) -> String {
        format!(
            "[[catalog.clients]]\nid = {:?}\nplan = {:?}\nkeys = [{:?}]\n",
            self.id, self.plan, self.key
        )
    }
}

impl RouteDef {
    pub fn toml(&self) -> String {
        format!(
            "[[routes]]\nservice = {:?}\nprefix = {:?}\nupstreams = {:?}\n",
            self.service, self.prefix, self.upstreams
        )
    }
}

/// What a gateway is configured with; whatever is `None` or empty is left to the
/// compiled-in defaults (or to [`GatewayConfig::extra`]).
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// `server.workers`.
    pub workers: usize,
    pub shutdown_timeout_s: Option<u64>,
    /// More `[server]` settings, TOML lines written into that table as they are (e.g.
    /// `trusted_proxies = ["127.0.0.1"]`).
    pub server: String,
    /// `redis.url` (`""`: the embedded store).
    pub redis_url: Option<String>,
    /// `redis.timeout_ms`, the decision budget.
    pub timeout_ms: Option<u64>,
    /// `limits.default_mode`: `"enforce"` or `"shadow"`.
    pub default_mode: Option<String>,
    /// `admin.jwt_hs256_secret`.
    pub admin_secret: Option<String>,
    pub plans: Vec<PlanDef>,
    pub clients: Vec<ClientDef>,
    pub routes: Vec<RouteDef>,
    /// TOML appended as it is, after everything above. It must not open a table the
    /// builder writes itself: `[server]` and `[catalog]` always, `[redis]`, `[limits]` and
    /// `[admin]` when their fields are set.
    pub extra: String,
}

impl Default for GatewayConfig {
    fn default() -> GatewayConfig {
        GatewayConfig {
            workers: 1,
            shutdown_timeout_s: None,
            server: String::new(),
            redis_url: None,
            timeout_ms: None,
            default_mode: None,
            admin_secret: None,
            plans: Vec::new(),
            clients: Vec::new(),
            routes: Vec::new(),
            extra: String::new(),
        }
    }
}

impl GatewayConfig {
    /// The defaults with `toml` appended as [`GatewayConfig::extra`].
    pub fn with_extra(toml: &str) -> GatewayConfig {
        GatewayConfig {
            extra: toml.to_string(),
            ..GatewayConfig::default()
        }
    }

    /// The catalog file a gateway configured with `dir` keeps (embedded store); its
    /// cache is beside it, `catalog-cache.json`.
    pub fn catalog_file(dir: &Path) -> PathBuf {
        dir.join("catalog.json")
    }

    /// The configuration as TOML, listening on `listen` (e.g. `127.0.0.1:0`), with the
    /// catalog file and its cache in `dir`.
    pub fn toml(&self, listen: &str, dir: &Path) -> String {
        let mut t = format!(
            "[server]\nlisten = {listen:?}\nworkers = {}\n",
            self.workers
        );
        if let Some(s) = self.shutdown_timeout_s {
            let _ = writeln!(t, "shutdown_timeout_s = {s}");
        }
        t.push_str(&self.server);
        if self.redis_url.is_some() || self.timeout_ms.is_some() {
            t.push_str("[redis]\n");
            if let Some(url) = &self.redis_url {
                let _ = writeln!(t, "url = {url:?}");
            }
            if let Some(ms) = self.timeout_ms {
                let _ = writeln!(t, "timeout_ms = {ms}");
            }
        }
        let catalog = GatewayConfig::catalog_file(dir);
        let _ = writeln!(
            t,
            "[catalog]\nfile = {:?}\ncache_file = {:?}",
            catalog.to_string_lossy(),
            catalog
                .with_file_name("catalog-cache.json")
                .to_string_lossy()
        );
        if let Some(mode) = &self.default_mode {
            let _ = writeln!(t, "[limits]\ndefault_mode = {mode:?}");
        }
        if let Some(secret) = &self.admin_secret {
            t.push_str(&admin_section(secret));
        }
        for p in &self.plans {
            t.push_str(&p.toml());
        }
        for c in &self.clients {
            t.push_str(&c.toml());
        }
        for r in &self.routes {
            t.push_str(&r.toml());
        }
        t.push_str(&self.extra);
        t
    }
}

/// The API key [`catalog_toml`] gives `client`.
pub fn key(client: &str) -> String {
    format!("key-{client}-0000")
}

/// A plan `(name, capacity, rate)` and `clients` on it, each with the key [`key`] gives
/// it, as TOML.
pub fn catalog_toml(plan: (&str, f64, f64), clients: &[&str]) -> String {
    let (name, capacity, rate) = plan;
    let mut t = PlanDef {
        name: name.into(),
        capacity,
        rate,
    }
    .toml();
    for c in clients {
        t.push_str(
            &ClientDef {
                id: c.to_string(),
                plan: name.into(),
                key: key(c),
            }
            .toml(),
        );
    }
    t
}

/// A plan of several limits and `clients` on it (each with the key [`key`] gives it), as
/// TOML. `limits` is the plan's `limits` value, an array of inline tables, e.g.
/// `[{ name = "burst", capacity = 200, rate = 100 }, { name = "monthly", quota = 1000000,
/// period = "month" }]`.
pub fn limits_catalog_toml(plan: &str, limits: &str, clients: &[&str]) -> String {
    let mut t = format!("[[catalog.plans]]\nname = {plan:?}\nlimits = {limits}\n");
    for c in clients {
        t.push_str(
            &ClientDef {
                id: c.to_string(),
                plan: plan.into(),
                key: key(c),
            }
            .toml(),
        );
    }
    t
}

/// A route as TOML.
pub fn route_toml(service: &str, prefix: &str, upstreams: &[String]) -> String {
    RouteDef {
        service: service.into(),
        prefix: prefix.into(),
        upstreams: upstreams.to_vec(),
    }
    .toml()
}

/// The HS256 secret test gateways share for the admin API (see [`admin_toml`]).
pub const ADMIN_SECRET: &str = "test-secret-please-change-0123456789";

fn admin_section(secret: &str) -> String {
    format!("[admin]\njwt_hs256_secret = {secret:?}\n")
}

/// `[admin]` settings with [`ADMIN_SECRET`].
pub fn admin_toml() -> String {
    admin_section(ADMIN_SECRET)
}
