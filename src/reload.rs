//! Reloading the configuration without a restart: on `SIGHUP` the gateway reads the same
//! sources again (the compiled-in defaults, the same `--config` files, the environment it
//! started with), and when they parse it swaps its route table at once
//! ([`crate::proxy::RouteTable::rebuilt`]: what it learned of the replicas it keeps carries over).
//! Requests in flight keep the route they were admitted on and finish. A configuration
//! that does not parse is refused, every bad key named in the log, and the routes already
//! served stay.
//!
//! Only `routes` (upstreams, balance, health checks, prefixes, costs, timeouts, cost
//! headers) is applied. Every other section is read once at start: a reload that changes
//! one says so in a `WARN` naming the sections, and applies the routes alone. The same
//! `SIGHUP` loads the listeners' certificates again from the files named at start
//! ([`crate::tls`]).

use std::fmt::Debug;
use std::path::PathBuf;
use std::sync::Arc;

use actix_web::web;
use parking_lot::Mutex;
use secrecy::{ExposeSecret, SecretString};

use crate::configuration::{Settings, SettingsError};
use crate::state::AppState;
use crate::tasks::{Policy, Tasks};

/// What a reload reads, and what it applies to.
pub struct Reloader {
    files: Vec<PathBuf>,
    /// The settings the process started with: the sections a reload does not apply are
    /// compared with them.
    running: Settings,
    state: web::Data<AppState>,
}

/// What a reload did.
#[derive(Debug, PartialEq, Eq)]
pub enum Reloaded {
    /// The routes were swapped; these sections changed too, and were not applied.
    Applied { unapplied: Vec<&'static str> },
    /// The configuration did not load: nothing changed.
    Refused,
}

impl Reloader {
    pub fn new(files: Vec<PathBuf>, running: Settings, state: web::Data<AppState>) -> Reloader {
        Reloader {
            files,
            running,
            state,
        }
    }

    /// Reads the configuration again and applies its routes, or refuses it; logs and
    /// counts either.
    pub fn reload(&self) -> Reloaded {
        self.apply(Settings::load(&self.files))
    }

    /// Applies `loaded` (the configuration as read again), or refuses it.
    fn apply(&self, loaded: Result<Settings, SettingsError>) -> Reloaded {
        let reloads = &self.state.metrics.reloads;
        let new = match loaded {
            Ok(new) => new,
            Err(SettingsError::Invalid(problems)) => {
                for p in &problems {
                    tracing::error!("configuration reload refused, the running routes stay: {p}");
                }
                reloads.rejected();
                return Reloaded::Refused;
            }
            Err(e) => {
                tracing::error!("configuration reload refused, the running routes stay: {e}");
                reloads.rejected();
                return Reloaded::Refused;
            }
        };
        let table = self.state.routes.load().rebuilt(&new.routes);
        let routes = table.routes().len();
        self.state.routes.store(Arc::new(table));
        reloads.succeeded(unix_ms());
        let unapplied = unapplied(&self.running, &new);
        tracing::info!(routes, "configuration reloaded: routes applied");
        if !unapplied.is_empty() {
            tracing::warn!(
                sections = %unapplied.join(", "),
                "the reloaded configuration changes settings that need a restart: only the routes were applied"
            );
        }
        Reloaded::Applied { unapplied }
    }
}

/// Now, in Unix milliseconds.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Reloads on every `SIGHUP` from now on, as task `sighup-reload` of `tasks` (the signal's
/// default, ending the process, no longer applies). Call it on a Tokio runtime: it fails
/// when the signal cannot be listened for.
pub fn on_sighup(reloader: Reloader, tasks: &Tasks) -> std::io::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    // The first listener is made here, so that a failure is the caller's; a restarted
    // task makes its own.
    let first = Mutex::new(Some(signal(SignalKind::hangup())?));
    let reloader = Arc::new(reloader);
    tasks.spawn("sighup-reload", Policy::Restart, move |stop| {
        let reloader = Arc::clone(&reloader);
        let hangups = first
            .lock()
            .take()
            .map_or_else(|| signal(SignalKind::hangup()), Ok);
        async move {
            let mut hangups = match hangups {
                Ok(hangups) => hangups,
                Err(e) => {
                    tracing::error!(error = %e, "cannot listen for SIGHUP");
                    return;
                }
            };
            while let Some(Some(())) = stop.run_until_cancelled(hangups.recv()).await {
                tracing::info!(files = ?reloader.files, "SIGHUP: reloading the configuration");
                reloader.reload();
                reloader.state.tls.reload("SIGHUP");
            }
        }
    });
    Ok(())
}

/// The sections other than `routes` in which `new` differs from `running`.
pub fn unapplied(running: &Settings, new: &Settings) -> Vec<&'static str> {
    fn differ(a: &impl Debug, b: &impl Debug) -> bool {
        // Debug output hides secrets; they are compared below.
        format!("{a:?}") != format!("{b:?}")
    }
    fn exposed(s: &Option<SecretString>) -> Option<&str> {
        s.as_ref().map(|s| s.expose_secret())
    }
    let (a, b) = (running, new);
    let redis_secrets = |s: &Settings| {
        (
            exposed(&s.redis.url).map(str::to_owned),
            exposed(&s.redis.regional_url).map(str::to_owned),
            s.redis
                .cluster_nodes
                .iter()
                .map(|n| n.expose_secret().to_owned())
                .collect::<Vec<_>>(),
        )
    };
    let sections = [
        ("server", differ(&a.server, &b.server)),
        (
            "redis",
            differ(&a.redis, &b.redis) || redis_secrets(a) != redis_secrets(b),
        ),
        ("catalog", differ(&a.catalog, &b.catalog)),
        ("limits", differ(&a.limits, &b.limits)),
        (
            "admin",
            differ(&a.admin, &b.admin)
                || exposed(&a.admin.jwt_hs256_secret) != exposed(&b.admin.jwt_hs256_secret),
        ),
        ("periods", differ(&a.periods, &b.periods)),
        ("overload", differ(&a.overload, &b.overload)),
        ("upstream", differ(&a.upstream, &b.upstream)),
        ("telemetry", differ(&a.telemetry, &b.telemetry)),
        ("edge", differ(&a.edge, &b.edge)),
        // The certificate files named at start are loaded again on SIGHUP; other files or
        // settings need a restart.
        ("tls", differ(&a.tls, &b.tls)),
    ];
    sections
        .into_iter()
        .filter(|(_, changed)| *changed)
        .map(|(name, _)| name)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(toml: &str) -> Settings {
        let dir = std::env::temp_dir().join(format!(
            "tollgate-reload-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("t.toml");
        std::fs::write(&file, toml).unwrap();
        let s = Settings::load_with_env(&[file], std::iter::empty()).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        s
    }

    const ROUTE: &str =
        "[[routes]]\nservice = \"orders\"\nprefix = \"/orders\"\nupstreams = [\"http://127.0.0.1:1\"]\n";

    #[test]
    fn only_sections_other_than_routes_need_a_restart() {
        let running = load(ROUTE);
        let routes_only = load(&ROUTE.replace(":1", ":2"));
        assert!(unapplied(&running, &routes_only).is_empty());
        let more = load(&format!(
            "[upstream]\nmax_tries = 2\n[server]\nmax_body_bytes = 10\n{ROUTE}"
        ));
        assert_eq!(unapplied(&running, &more), ["server", "upstream"]);
    }

    #[test]
    fn a_changed_secret_is_a_change_though_debug_output_hides_it() {
        let running = load("[admin]\njwt_hs256_secret = \"0123456789abcdef0123456789abcdef\"\n");
        let new = load("[admin]\njwt_hs256_secret = \"0123456789abcdef0123456789abcdeX\"\n");
        assert_eq!(format!("{:?}", running.admin), format!("{:?}", new.admin));
        assert_eq!(unapplied(&running, &new), ["admin"]);
        let running = load("[redis]\nurl = \"redis://:a@127.0.0.1:6379\"\n");
        let new = load("[redis]\nurl = \"redis://:b@127.0.0.1:6379\"\n");
        assert_eq!(unapplied(&running, &new), ["redis"]);
    }
}
