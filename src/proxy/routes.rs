//! Routes: path prefix → service → replicas, longest prefix first. A table is rebuilt
//! whole when the configuration is reloaded; what the gateway learned of a replica (its
//! ejections, requests in flight, check verdicts) and a route's retry counters carry over
//! to the new table when the service and the replica's address are the same.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use actix_web::http::header::HeaderName;

use super::replicas::{now_ms, Replica, Replicas, RetryBudget};
use crate::configuration::{HealthCheckSettings, RouteSettings};
use crate::domain::PlanName;
use crate::metrics::{Exposition, Kind};

/// A service and how to reach it.
#[derive(Debug)]
pub struct Route {
    pub service: Arc<str>,
    pub prefix: String,
    pub replicas: Replicas,
    pub cost: f64,
    pub timeout: Duration,
    /// The response header in which the service reports a request's real cost, if any.
    pub cost_header: Option<HeaderName>,
    /// Set on a public route: the plan a request without a key is limited by, per client
    /// address.
    pub public_plan: Option<PlanName>,
    pub health_check: Option<HealthCheckSettings>,
    /// Shared by every route of the service, and kept across reloads.
    pub retries: Arc<RetryBudget>,
}

impl Route {
    fn matches(&self, path: &str) -> bool {
        match path.strip_prefix(self.prefix.as_str()) {
            Some(rest) => self.prefix.ends_with('/') || rest.is_empty() || rest.starts_with('/'),
            None => false,
        }
    }
}

/// Routes ordered longest prefix first.
#[derive(Debug, Default)]
pub struct RouteTable {
    routes: Vec<Arc<Route>>,
}

impl RouteTable {
    /// From the settings' routes (a route without upstreams, which parsed settings never
    /// have, is left out rather than panic when picked).
    pub fn new(settings: &[RouteSettings]) -> RouteTable {
        RouteTable::default().rebuilt(settings)
    }

    /// A table for `settings` that keeps this one's state of the replicas and services it
    /// still has.
    pub fn rebuilt(&self, settings: &[RouteSettings]) -> RouteTable {
        let mut replicas: HashMap<(&str, &str), &Arc<Replica>> = HashMap::new();
        let mut budgets: HashMap<&str, &Arc<RetryBudget>> = HashMap::new();
        for route in &self.routes {
            budgets.insert(&route.service, &route.retries);
            for r in route.replicas.all() {
                replicas.insert((&route.service, r.upstream.base()), r);
            }
        }
        // Routes of one service share its replicas and its budget.
        let mut fresh_replicas: HashMap<(String, String), Arc<Replica>> = HashMap::new();
        let mut fresh_budgets: HashMap<String, Arc<RetryBudget>> = HashMap::new();
        let mut routes: Vec<Arc<Route>> = settings
            .iter()
            .filter(|r| !r.upstreams.is_empty())
            .map(|r| {
                let service = r.service.as_str();
                let all = r
                    .upstreams
                    .iter()
                    .map(|u| {
                        fresh_replicas
                            .entry((service.to_string(), u.base().to_string()))
                            .or_insert_with(|| {
                                replicas
                                    .get(&(service, u.base()))
                                    .map(|r| Arc::clone(r))
                                    .unwrap_or_else(|| Arc::new(Replica::new(u.clone())))
                            })
                            .clone()
                    })
                    .collect();
                let retries = fresh_budgets
                    .entry(service.to_string())
                    .or_insert_with(|| {
                        budgets
                            .get(service)
                            .map(|b| Arc::clone(b))
                            .unwrap_or_default()
                    })
                    .clone();
                Arc::new(Route {
                    service: Arc::from(service),
                    prefix: r.prefix.clone(),
                    replicas: Replicas::new(all, r.balance),
                    cost: r.cost,
                    timeout: r.timeout,
                    cost_header: r.cost_header.clone(),
                    public_plan: r.public_plan.clone(),
                    health_check: r.health_check.clone(),
                    retries,
                })
            })
            .collect();
        routes.sort_by_key(|r| std::cmp::Reverse(r.prefix.len()));
        RouteTable { routes }
    }

    /// The route with the longest prefix that matches `path` on a segment boundary.
    #[inline]
    pub fn find(&self, path: &str) -> Option<&Arc<Route>> {
        self.routes.iter().find(|r| r.matches(path))
    }

    pub fn routes(&self) -> &[Arc<Route>] {
        &self.routes
    }

    /// The replicas' and retry budgets' metrics, each service and replica once.
    pub fn write_metrics(&self, out: &mut Exposition) {
        let now = now_ms();
        let mut replicas: Vec<(&str, &Arc<Replica>)> = Vec::new();
        let mut budgets: Vec<(&str, &Arc<RetryBudget>)> = Vec::new();
        for route in &self.routes {
            if !budgets.iter().any(|(s, _)| *s == &*route.service) {
                budgets.push((&route.service, &route.retries));
            }
            for r in route.replicas.all() {
                if !replicas.iter().any(|(_, seen)| Arc::ptr_eq(seen, r)) {
                    replicas.push((&route.service, r));
                }
            }
        }
        let mut per_replica =
            |name: &'static str, kind: Kind, help: &str, value: &dyn Fn(&Replica) -> u64| {
                let mut f = out.family(name, kind, help);
                for (service, r) in &replicas {
                    f.sample(
                        &[("service", service), ("replica", r.upstream.base())],
                        value(r),
                    );
                }
            };
        per_replica(
            "tollgate_upstream_replica_available",
            Kind::Gauge,
            "Whether a replica takes traffic (1): neither ejected nor failing its health checks.",
            &|r| r.available(now) as u64,
        );
        per_replica(
            "tollgate_upstream_replica_ejected",
            Kind::Gauge,
            "Whether a replica is ejected now (1), after upstream.eject_after failures in a row.",
            &|r| r.ejected(now) as u64,
        );
        per_replica(
            "tollgate_upstream_replica_healthy",
            Kind::Gauge,
            "The replica's active health checks pass (1; 1 without checks).",
            &|r| r.checks_pass() as u64,
        );
        per_replica(
            "tollgate_upstream_in_flight",
            Kind::Gauge,
            "Requests in flight to a replica (until its response head).",
            &|r| u64::from(r.in_flight()),
        );
        per_replica(
            "tollgate_upstream_ejections_total",
            Kind::Counter,
            "Times a replica was ejected.",
            &|r| r.ejections(),
        );
        per_replica(
            "tollgate_upstream_tls_failures_total",
            Kind::Counter,
            "Tries whose TLS handshake with an https replica failed (its certificate not verified, or another handshake error; the reason is logged).",
            &|r| r.tls_failures(),
        );
        let mut f = out.family(
            "tollgate_upstream_retries_total",
            Kind::Counter,
            "Tries made again on another replica after one failed before the service could have acted on it.",
        );
        for (service, b) in &budgets {
            f.sample(&[("service", service)], b.retried());
        }
        let mut f = out.family(
            "tollgate_upstream_retries_refused_total",
            Kind::Counter,
            "Retries the service's retry budget refused (the request got the failed try's answer).",
        );
        for (service, b) in &budgets {
            f.sample(&[("service", service)], b.refused());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::configuration::Balance;
    use crate::domain::{ServiceName, Upstream};

    fn table(prefixes: &[&str]) -> RouteTable {
        RouteTable::new(
            &prefixes
                .iter()
                .map(|p| RouteSettings {
                    service: ServiceName::parse(&format!("svc{}", p.replace('/', "-"))).unwrap(),
                    prefix: p.to_string(),
                    upstreams: ["http://127.0.0.1:1", "http://127.0.0.1:2"]
                        .map(|u| Upstream::parse(u).unwrap())
                        .to_vec(),
                    balance: Balance::RoundRobin,
                    health_check: None,
                    cost: 1.0,
                    timeout: Duration::from_secs(1),
                    cost_header: None,
                    public_plan: None,
                })
                .collect::<Vec<_>>(),
        )
    }

    #[test]
    fn the_longest_prefix_wins_on_segment_boundaries() {
        let t = table(&["/", "/orders", "/orders/archive"]);
        assert_eq!(
            t.find("/orders/archive/1").unwrap().prefix,
            "/orders/archive"
        );
        assert_eq!(t.find("/orders/1").unwrap().prefix, "/orders");
        assert_eq!(t.find("/orders").unwrap().prefix, "/orders");
        assert_eq!(t.find("/ordersx").unwrap().prefix, "/");
    }

    #[test]
    fn replica_and_retry_metrics_are_written_as_before() {
        let t = table(&["/a"]);
        let _busy = t.find("/a").unwrap().replicas.get(0).start();
        let mut out = Exposition::new();
        t.write_metrics(&mut out);
        assert_eq!(out.finish(), include_str!("../../tests/golden/routes.txt"));
    }

    #[test]
    fn no_match_without_a_root_route() {
        let t = table(&["/orders"]);
        assert!(t.find("/billing").is_none());
        assert!(t.find("/ordersx").is_none());
    }

    #[test]
    fn a_rebuilt_table_keeps_what_it_knew_of_the_same_replicas() {
        let t = table(&["/a", "/b"]);
        let a = Arc::clone(t.find("/a").unwrap());
        let _busy = a.replicas.get(0).start();
        let mut settings = vec![RouteSettings {
            service: ServiceName::parse("svc-a").unwrap(),
            prefix: "/a".into(),
            upstreams: ["http://127.0.0.1:2", "http://127.0.0.1:3"]
                .map(|u| Upstream::parse(u).unwrap())
                .to_vec(),
            balance: Balance::RoundRobin,
            health_check: None,
            cost: 1.0,
            timeout: Duration::from_secs(1),
            cost_header: None,
            public_plan: None,
        }];
        let t2 = t.rebuilt(&settings);
        let a2 = t2.find("/a").unwrap();
        assert!(t2.find("/b").is_none());
        // :2 is the same replica of the same service; :3 is new.
        assert!(Arc::ptr_eq(a2.replicas.get(0), a.replicas.get(1)));
        assert_eq!(a2.replicas.get(1).in_flight(), 0);
        assert!(Arc::ptr_eq(&a2.retries, &a.retries));
        // Another service at the same address is another replica.
        settings[0].service = ServiceName::parse("other").unwrap();
        let t3 = t.rebuilt(&settings);
        assert!(!Arc::ptr_eq(
            t3.find("/a").unwrap().replicas.get(0),
            a.replicas.get(1)
        ));
        assert_eq!(a.replicas.get(0).in_flight(), 1);
    }
}
