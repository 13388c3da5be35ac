//! Routes: path prefix → service → replicas, longest prefix first, round-robin.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix_web::http::header::HeaderName;

use crate::configuration::RouteSettings;
use crate::domain::Upstream;

/// A service and how to reach it.
#[derive(Debug)]
pub struct Route {
    pub service: Arc<str>,
    pub prefix: String,
    pub upstreams: Vec<Upstream>,
    pub cost: f64,
    pub timeout: Duration,
    /// The response header in which the service reports a request's real cost, if any.
    pub cost_header: Option<HeaderName>,
    next: AtomicUsize,
}

impl Route {
    /// The next replica, round-robin.
    pub fn pick(&self) -> &Upstream {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        &self.upstreams[i % self.upstreams.len()]
    }

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
        let mut routes: Vec<Arc<Route>> = settings
            .iter()
            .map(|r| {
                Arc::new(Route {
                    service: Arc::from(r.service.as_str()),
                    prefix: r.prefix.clone(),
                    upstreams: r.upstreams.clone(),
                    cost: r.cost,
                    timeout: r.timeout,
                    cost_header: r.cost_header.clone(),
                    next: AtomicUsize::new(0),
                })
            })
            .filter(|r| !r.upstreams.is_empty())
            .collect();
        routes.sort_by_key(|r| std::cmp::Reverse(r.prefix.len()));
        RouteTable { routes }
    }

    /// The route with the longest prefix that matches `path` on a segment boundary.
    pub fn find(&self, path: &str) -> Option<&Arc<Route>> {
        self.routes.iter().find(|r| r.matches(path))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::ServiceName;

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
                    cost: 1.0,
                    timeout: Duration::from_secs(1),
                    cost_header: None,
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
    fn no_match_without_a_root_route() {
        let t = table(&["/orders"]);
        assert!(t.find("/billing").is_none());
        assert!(t.find("/ordersx").is_none());
    }

    #[test]
    fn replicas_take_turns() {
        let t = table(&["/a"]);
        let r = t.find("/a").unwrap();
        let picks: Vec<_> = (0..4).map(|_| r.pick().base().to_string()).collect();
        assert_eq!(picks[0], picks[2]);
        assert_ne!(picks[0], picks[1]);
    }
}
