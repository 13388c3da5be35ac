//! Active health checks (`[routes.health_check]`): one checker per process, on a thread of
//! its own with its own actix runtime (awc is `!Send`), so the workers never run a check;
//! it is the supervised task `health-checks` ([`crate::tasks`]), and each check a child of
//! that thread's runtime, ending with it.
//!
//! Every `interval` it fetches (`GET`) the route's `path` from each replica of each route
//! that has checks, with the check's `timeout`; a `2xx` passes, anything else (another
//! status, a refused or broken connection, no answer in time) fails. `unhealthy_after`
//! failures in a row take the replica out ([`Replica::set_checks_pass`]`(false)`), and
//! `healthy_after` passes in a row bring it back; each change is logged once (`WARN` out,
//! `INFO` back). A replica is checked once however many routes share it (the routes of a
//! service share their replicas): by the settings of the first route, longest prefix first,
//! that checks it.
//!
//! The checker reads the route table each time it wakes (at least every [`IDLE`]), so a
//! reloaded table is checked from then on: a replica the reload kept keeps its verdict and
//! its count, a new one starts passing and is checked at once, and a replica no route
//! checks any more is let back in. Checks go from the gateway to the replica directly:
//! they never pass the rate limiter, count as a client's request, or feed the passive
//! ejection (`upstream.eject_after`). They use the forwards' clients ([`Clients`]): an
//! `https://` replica is checked over TLS, its certificate verified as for a request.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use actix_web::http::header::{self, HeaderValue};
use actix_web::http::uri::PathAndQuery;
use actix_web::http::StatusCode;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::clients::Clients;
use super::replicas::Replica;
use super::routes::RouteTable;
use crate::configuration::{HealthCheckSettings, UpstreamSettings};
use crate::tasks::{Policy, Tasks};

/// The longest the checker sleeps before it looks at the route table again.
pub const IDLE: Duration = Duration::from_millis(500);

/// What a check's answer body may hold; it is read (up to this) so that the connection
/// can carry the next check, and otherwise ignored.
const BODY_LIMIT: usize = 64 * 1024;

/// How the checks say who they are, to the service and in its access log.
const USER_AGENT: &str = "tollgate-health-check";

/// Checks passed and failed in a row by one replica: the checker's state machine.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    passes: u32,
    failures: u32,
}

impl Tally {
    /// Counts a check (`passed`) of a replica whose checks pass now or not (`passing`);
    /// the replica's new verdict when this check changes it.
    pub fn record(&mut self, passed: bool, passing: bool, s: &HealthCheckSettings) -> Option<bool> {
        if passed {
            self.failures = 0;
            self.passes = self.passes.saturating_add(1);
            (!passing && self.passes >= s.healthy_after).then_some(true)
        } else {
            self.passes = 0;
            self.failures = self.failures.saturating_add(1);
            (passing && self.failures >= s.unhealthy_after).then_some(false)
        }
    }
}

/// Starts task `health-checks`, the process's checker of the table `routes` returns, on a
/// thread of its own, until the gateway stops (or `routes` returns `None`: the gateway is
/// gone).
pub fn spawn_health_checker(
    tasks: &Tasks,
    routes: impl Fn() -> Option<Arc<RouteTable>> + Send + Sync + 'static,
    upstream: &UpstreamSettings,
) {
    let upstream = upstream.clone();
    tasks.spawn_thread("health-checks", Policy::Restart, move |stop| {
        actix_web::rt::System::new().block_on(async {
            // The forwards' clients: `https://` replicas are checked over TLS, verified as
            // requests are.
            match Clients::new(&upstream) {
                Ok(clients) => {
                    stop.run_until_cancelled(run(&routes, Rc::new(clients)))
                        .await;
                }
                Err(e) => {
                    tracing::error!(error = %e, "the upstream TLS client could not be built: no health checks");
                }
            }
        })
    });
}

/// One replica the checker checks.
struct Target {
    replica: Arc<Replica>,
    service: Arc<str>,
    settings: HealthCheckSettings,
    tally: Tally,
    /// When its next check starts.
    due: Instant,
    /// A check of it is under way.
    checking: bool,
}

/// A check's outcome: the replica (to match it to its target) and its status, or why
/// there was none.
type Outcome = (Arc<Replica>, Result<StatusCode, String>);

/// Replicas are told apart by address: the table holds them in `Arc`s, shared by the
/// routes of a service and kept across reloads, and a [`Target`] holds one, so an address
/// is not reused while it is a key.
fn id(replica: &Arc<Replica>) -> usize {
    Arc::as_ptr(replica) as usize
}

async fn run(routes: impl Fn() -> Option<Arc<RouteTable>>, clients: Rc<Clients>) {
    let (tx, mut rx) = mpsc::unbounded_channel::<Outcome>();
    let mut targets: HashMap<usize, Target> = HashMap::new();
    let mut seen: Option<Arc<RouteTable>> = None;
    loop {
        let Some(table) = routes() else { return };
        if !seen.as_ref().is_some_and(|t| Arc::ptr_eq(t, &table)) {
            reconcile(&mut targets, &table, Instant::now());
            seen = Some(table);
        }
        let now = Instant::now();
        for t in targets.values_mut() {
            if t.checking || t.due > now {
                continue;
            }
            t.checking = true;
            t.due = now + t.settings.interval;
            let (clients, replica, settings, tx) = (
                Rc::clone(&clients),
                Arc::clone(&t.replica),
                t.settings.clone(),
                tx.clone(),
            );
            actix_web::rt::spawn(async move {
                let outcome = check(&clients, &replica, &settings).await;
                let _ = tx.send((replica, outcome));
            });
        }
        let wake = targets
            .values()
            .filter(|t| !t.checking)
            .map(|t| t.due)
            .fold(now + IDLE, Instant::min);
        tokio::select! {
            Some((replica, outcome)) = rx.recv() => {
                if let Some(t) = targets.get_mut(&id(&replica)) {
                    if Arc::ptr_eq(&t.replica, &replica) {
                        t.checking = false;
                        apply(t, outcome);
                    }
                }
            }
            _ = tokio::time::sleep_until(wake) => {}
        }
    }
}

/// The targets of `table`: the replicas of its routes with checks, each once.
fn reconcile(targets: &mut HashMap<usize, Target>, table: &RouteTable, now: Instant) {
    let mut wanted: HashMap<usize, (&Arc<Replica>, &Arc<str>, &HealthCheckSettings)> =
        HashMap::new();
    let mut present: HashSet<usize> = HashSet::new();
    for route in table.routes() {
        for r in route.replicas.all() {
            present.insert(id(r));
            if let Some(s) = &route.health_check {
                wanted.entry(id(r)).or_insert((r, &route.service, s));
            }
        }
    }
    targets.retain(|key, t| {
        if wanted.contains_key(key) {
            return true;
        }
        // No route checks it any more: its last verdict no longer holds it out.
        if present.contains(key) && t.replica.set_checks_pass(true) {
            tracing::info!(
                service = %t.service,
                replica = t.replica.upstream.base(),
                "replica no longer health-checked: it takes traffic again"
            );
        }
        false
    });
    for (key, (replica, service, settings)) in wanted {
        match targets.entry(key) {
            Entry::Occupied(mut e) => {
                let t = e.get_mut();
                // Checked sooner if its interval became shorter.
                t.due = t.due.min(now + settings.interval);
                t.service = Arc::clone(service);
                t.settings = settings.clone();
            }
            Entry::Vacant(e) => {
                e.insert(Target {
                    replica: Arc::clone(replica),
                    service: Arc::clone(service),
                    settings: settings.clone(),
                    tally: Tally::default(),
                    due: now,
                    checking: false,
                });
            }
        }
    }
}

/// Counts a check's outcome, and takes the replica out or brings it back when it should.
fn apply(t: &mut Target, outcome: Result<StatusCode, String>) {
    let passed = matches!(outcome, Ok(status) if status.is_success());
    let Some(verdict) = t.tally.record(passed, t.replica.checks_pass(), &t.settings) else {
        return;
    };
    if !t.replica.set_checks_pass(verdict) {
        return;
    }
    let (service, replica, path) = (&t.service, t.replica.upstream.base(), &t.settings.path);
    if verdict {
        tracing::info!(
            %service,
            replica,
            path,
            passed = t.settings.healthy_after,
            "replica passes its health checks again: it takes traffic again"
        );
    } else {
        let answer = match outcome {
            Ok(status) => status.to_string(),
            Err(e) => e,
        };
        tracing::warn!(
            %service,
            replica,
            path,
            failed = t.settings.unhealthy_after,
            last = %answer,
            "replica fails its health checks: it gets no traffic until they pass"
        );
    }
}

/// One check: `GET path` on the replica within the check's timeout; its status, or why
/// there was none.
async fn check(
    clients: &Clients,
    replica: &Replica,
    s: &HealthCheckSettings,
) -> Result<StatusCode, String> {
    let path: PathAndQuery = s.path.parse().map_err(|e| format!("bad path: {e}"))?;
    let uri = replica
        .upstream
        .uri(Some(&path))
        .map_err(|e| format!("bad URI: {e}"))?;
    let request = clients
        .of(&replica.upstream)
        .get(uri)
        .insert_header((header::HOST, replica.upstream.host().clone()))
        .insert_header((header::USER_AGENT, HeaderValue::from_static(USER_AGENT)))
        .timeout(s.timeout);
    let exchange = async {
        let mut res = request.send().await.map_err(|e| e.to_string())?;
        // Read so that the connection can be used again; what it says does not count.
        let _ = res.body().limit(BODY_LIMIT).await;
        Ok(res.status())
    };
    match tokio::time::timeout(s.timeout, exchange).await {
        Ok(outcome) => outcome,
        Err(_) => Err(format!("no answer within {} ms", s.timeout.as_millis())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::configuration::{Balance, RouteSettings};
    use crate::domain::{ServiceName, Upstream};

    fn settings(unhealthy_after: u32, healthy_after: u32) -> HealthCheckSettings {
        HealthCheckSettings {
            path: "/healthz".into(),
            interval: Duration::from_millis(100),
            timeout: Duration::from_millis(50),
            unhealthy_after,
            healthy_after,
        }
    }

    /// Feeds `checks` (true: passed) to a tally of a replica that starts passing; the
    /// verdict after each.
    fn run_checks(s: &HealthCheckSettings, checks: &[bool]) -> Vec<bool> {
        let (mut tally, mut passing) = (Tally::default(), true);
        checks
            .iter()
            .map(|&passed| {
                if let Some(v) = tally.record(passed, passing, s) {
                    assert_ne!(v, passing, "a verdict that changes nothing");
                    passing = v;
                }
                passing
            })
            .collect()
    }

    #[test]
    fn failures_in_a_row_take_a_replica_out_and_passes_in_a_row_bring_it_back() {
        let s = settings(2, 3);
        let (t, f) = (true, false);
        assert_eq!(
            run_checks(&s, &[f, t, f, f, f, t, t, f, t, t, t, t]),
            [t, t, t, f, f, f, f, f, f, f, t, t]
        );
    }

    #[test]
    fn one_check_is_enough_when_so_configured() {
        let s = settings(1, 1);
        let (t, f) = (true, false);
        assert_eq!(run_checks(&s, &[t, f, f, t, f, t]), [t, f, f, t, f, t]);
    }

    #[test]
    fn a_replica_out_since_before_counts_its_passes_from_zero() {
        // A replica a reload kept while out: a new tally, still out until it passes.
        let s = settings(2, 2);
        let mut tally = Tally::default();
        assert_eq!(tally.record(true, false, &s), None);
        assert_eq!(tally.record(true, false, &s), Some(true));
        // The counts do not overflow however long it stays.
        let mut tally = Tally {
            passes: u32::MAX,
            failures: 0,
        };
        assert_eq!(tally.record(true, true, &s), None);
    }

    fn route(service: &str, prefix: &str, ports: &[u16], checks: bool) -> RouteSettings {
        RouteSettings {
            service: ServiceName::parse(service).unwrap(),
            prefix: prefix.into(),
            upstreams: ports
                .iter()
                .map(|p| Upstream::parse(&format!("http://127.0.0.1:{p}")).unwrap())
                .collect(),
            balance: Balance::RoundRobin,
            health_check: checks.then(|| settings(2, 2)),
            cost: 1.0,
            timeout: Duration::from_secs(1),
            cost_header: None,
            public_plan: None,
        }
    }

    #[test]
    fn each_checked_replica_is_one_target_and_unchecked_ones_are_let_back_in() {
        let now = Instant::now();
        let table = RouteTable::new(&[
            route("orders", "/orders", &[1, 2], true),
            route("orders", "/carts", &[2, 3], false),
            route("billing", "/billing", &[1], true),
        ]);
        let mut targets = HashMap::new();
        reconcile(&mut targets, &table, now);
        // orders :1 and :2 (shared with /carts), billing :1 (another service's replica).
        assert_eq!(targets.len(), 3);
        let carts = table.find("/carts").unwrap();
        assert!(targets.contains_key(&id(carts.replicas.get(0))));
        assert!(!targets.contains_key(&id(carts.replicas.get(1))));

        // Out, then no longer checked by a reloaded table: back in.
        let orders = table.find("/orders").unwrap();
        let out = Arc::clone(orders.replicas.get(0));
        assert!(out.set_checks_pass(false));
        let reloaded = table.rebuilt(&[
            route("orders", "/orders", &[1, 2], false),
            route("billing", "/billing", &[1], true),
        ]);
        assert!(Arc::ptr_eq(
            reloaded.find("/orders").unwrap().replicas.get(0),
            &out
        ));
        reconcile(&mut targets, &reloaded, now);
        assert_eq!(targets.len(), 1);
        assert!(out.checks_pass());
    }

    #[test]
    fn a_target_kept_by_a_reload_keeps_its_count_and_a_shorter_interval_applies_at_once() {
        let start = Instant::now();
        let table = RouteTable::new(&[route("orders", "/orders", &[1], true)]);
        let mut targets = HashMap::new();
        reconcile(&mut targets, &table, start);
        let t = targets.values_mut().next().unwrap();
        t.due = start + Duration::from_secs(60);
        assert_eq!(t.tally.record(false, true, &t.settings), None);

        let mut faster = route("orders", "/orders", &[1], true);
        if let Some(s) = faster.health_check.as_mut() {
            s.interval = Duration::from_millis(10);
        }
        reconcile(&mut targets, &table.rebuilt(&[faster]), start);
        let t = targets.values_mut().next().unwrap();
        assert_eq!(t.due, start + Duration::from_millis(10));
        // The second failure in a row: out.
        assert_eq!(t.tally.record(false, true, &t.settings), Some(false));
    }
}
