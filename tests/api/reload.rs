//! Active health checks take a replica out and bring it back; `SIGHUP` swaps the routes
//! without a restart, and a bad file changes nothing (the book, "Upstreams").

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::helpers::*;

/// A `[routes.health_check]` for the route just written, checked every 50 ms.
fn checks(unhealthy_after: u32, healthy_after: u32) -> String {
    format!(
        "balance = \"round_robin\"\n[routes.health_check]\npath = \"/healthz\"\ninterval_ms = 50\ntimeout_ms = 500\nunhealthy_after = {unhealthy_after}\nhealthy_after = {healthy_after}\n"
    )
}

fn catalog() -> String {
    catalog_toml(("gold", 100_000.0, 100_000.0), &["acme"])
}

/// The replica's `tollgate_upstream_replica_healthy` on `/metrics` at `address`.
async fn healthy(address: &str, service: &str, replica: &Upstream) -> Option<f64> {
    let text = reqwest::get(format!("{address}/metrics"))
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    sample_in(
        &text,
        &format!(
            "tollgate_upstream_replica_healthy{{service=\"{service}\",replica=\"{}\"}}",
            replica.url()
        ),
    )
}

/// Health checks `replica` has answered (whatever it answered).
fn checked(replica: &Upstream) -> usize {
    replica.hits_on("/healthz")
}

#[tokio::test]
async fn a_replica_failing_its_checks_gets_no_traffic_until_it_passes_again() {
    let flag = health_flag(true);
    let (a, b) = (
        Upstream::start(Behaviour::Checked(flag)).await,
        Upstream::start(Behaviour::Checked(health_flag(true))).await,
    );
    let toml = format!(
        "{}{}{}",
        catalog(),
        route_toml("orders", "/orders", &[a.url(), b.url()]),
        checks(2, 3)
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    eventually(Duration::from_secs(5), "both replicas checked", || async {
        checked(&a) >= 2 && checked(&b) >= 2
    })
    .await;

    // Failing: out after two failed checks in a row, not before.
    flag.store(false, Ordering::SeqCst);
    let before = checked(&a);
    eventually(Duration::from_secs(5), "a taken out", || async {
        healthy(&gw.address, "orders", &a).await == Some(0.0)
    })
    .await;
    assert!(
        checked(&a) - before >= 2,
        "out after {} checks",
        checked(&a) - before
    );
    let (on_a, on_b) = (a.hits_on("/orders"), b.hits_on("/orders"));
    for _ in 0..20 {
        assert_eq!(gw.get("/orders", Some(&key("acme"))).await.status(), 200);
    }
    assert_eq!(
        a.hits_on("/orders"),
        on_a,
        "a replica failing its checks got traffic"
    );
    assert_eq!(b.hits_on("/orders"), on_b + 20);

    // Passing again: back after three passed checks in a row.
    flag.store(true, Ordering::SeqCst);
    let before = checked(&a);
    eventually(Duration::from_secs(5), "a back", || async {
        healthy(&gw.address, "orders", &a).await == Some(1.0)
    })
    .await;
    assert!(
        checked(&a) - before >= 3,
        "back after {} checks",
        checked(&a) - before
    );
    let on_a = a.hits_on("/orders");
    for _ in 0..20 {
        assert_eq!(gw.get("/orders", Some(&key("acme"))).await.status(), 200);
    }
    assert_eq!(
        a.hits_on("/orders"),
        on_a + 10,
        "round robin over both again"
    );

    // The checks are not client traffic: no decision, no upstream request counted, and
    // they say who they are.
    assert_eq!(
        gw.sample("tollgate_decisions_total{outcome=\"allowed\"}")
            .await,
        40.0
    );
    assert_eq!(
        gw.sample("tollgate_upstream_requests_total{service=\"orders\",status_class=\"2xx\"}")
            .await,
        40.0
    );
    let check = a.seen().into_iter().find(|s| s.path == "/healthz").unwrap();
    assert_eq!(check.headers["user-agent"], "tollgate-health-check");
    assert_eq!(check.headers["host"], a.url().trim_start_matches("http://"));
    assert!(!check.headers.contains_key("x-client-id"));
}

#[tokio::test]
async fn with_every_replica_failing_its_checks_the_route_is_still_served() {
    let (a, b) = (
        Upstream::start(Behaviour::Checked(health_flag(false))).await,
        Upstream::start(Behaviour::Checked(health_flag(false))).await,
    );
    let toml = format!(
        "{}{}{}",
        catalog(),
        route_toml("orders", "/orders", &[a.url(), b.url()]),
        checks(1, 1)
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    eventually(Duration::from_secs(5), "both taken out", || async {
        healthy(&gw.address, "orders", &a).await == Some(0.0)
            && healthy(&gw.address, "orders", &b).await == Some(0.0)
    })
    .await;
    for _ in 0..20 {
        assert_eq!(gw.get("/orders", Some(&key("acme"))).await.status(), 200);
    }
    // Spread over both (Envoy's panic mode), not piled on one.
    assert_eq!((a.hits_on("/orders"), b.hits_on("/orders")), (10, 10));
}

#[tokio::test]
async fn routes_of_one_service_check_their_shared_replicas_once() {
    let a = Upstream::start(Behaviour::Checked(health_flag(true))).await;
    let toml = format!(
        "{}{}{}{}{}",
        catalog(),
        route_toml("orders", "/orders", &[a.url()]),
        checks(2, 2),
        route_toml("orders", "/carts", &[a.url()]),
        checks(2, 2)
    );
    let _gw = TestGateway::spawn(settings(&toml)).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    // Every 50 ms for a second: about 20, not about 40.
    let n = checked(&a);
    assert!((10..=26).contains(&n), "{n} checks in a second");
}

/// The configuration file of a gateway process, its `extra` replaced by `new`, and the
/// gateway told to read it again.
pub(crate) fn reload(gw: &GatewayProcess, old: &str, new: &str) {
    let file = gw.dir().join("gateway.toml");
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.ends_with(old), "{text}");
    std::fs::write(&file, format!("{}{new}", &text[..text.len() - old.len()])).unwrap();
    tollgate_testkit::signal(&gw.child, libc::SIGHUP).unwrap();
}

async fn metric_of(gw: &GatewayProcess, series: &str) -> Option<f64> {
    let text = reqwest::get(format!("{}/metrics", gw.address))
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    sample_in(&text, series)
}

async fn get(http: &reqwest::Client, gw: &GatewayProcess, path: &str) -> reqwest::Response {
    http.get(format!("{}{path}", gw.address))
        .header("x-api-key", key("acme"))
        .send()
        .await
        .expect("the gateway answers")
}

fn port_of(r: &reqwest::Response) -> u16 {
    r.headers()["x-upstream-port"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

fn log_of(gw: &GatewayProcess) -> String {
    std::fs::read_to_string(gw.dir().join("gateway.log")).unwrap_or_default()
}

#[tokio::test]
async fn sighup_moves_traffic_to_new_replicas_and_no_request_fails() {
    let (a, b) = (
        Upstream::start(Behaviour::Echo).await,
        Upstream::start(Behaviour::Echo).await,
    );
    let slow = Upstream::start(Behaviour::Slow(Duration::from_millis(1500))).await;
    let old = format!(
        "{}{}{}",
        catalog(),
        route_toml("orders", "/orders", &[a.url()]),
        route_toml("slow", "/slow", &[slow.url()]),
    );
    let gw = gateway_process(&old, &[("NO_COLOR", "1")]);
    let http = reqwest::Client::new();
    assert_eq!(port_of(&get(&http, &gw, "/orders").await), a.port);

    // Requests in a loop across the reload, and a slow one started before it.
    let stop = Arc::new(AtomicBool::new(false));
    let (sent, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let looping = {
        let (stop, sent, failed) = (stop.clone(), sent.clone(), failed.clone());
        let (http, address) = (http.clone(), gw.address.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let r = http
                    .get(format!("{address}/orders"))
                    .header("x-api-key", key("acme"))
                    .send()
                    .await;
                sent.fetch_add(1, Ordering::SeqCst);
                if !r.is_ok_and(|r| r.status() == 200) {
                    failed.fetch_add(1, Ordering::SeqCst);
                }
            }
        })
    };
    let in_flight = {
        let (http, address) = (http.clone(), gw.address.clone());
        tokio::spawn(async move {
            http.get(format!("{address}/slow"))
                .header("x-api-key", key("acme"))
                .send()
                .await
        })
    };
    eventually(
        Duration::from_secs(5),
        "the slow request reached its replica",
        || async { slow.hits() == 1 },
    )
    .await;

    // `/orders` now goes to b only, `/slow` to b too; a setting that needs a restart
    // changes as well.
    let new = format!(
        "{}{}{}[upstream]\nmax_tries = 2\n",
        catalog(),
        route_toml("orders", "/orders", &[b.url()]),
        route_toml("slow", "/slow", &[b.url()]),
    );
    reload(&gw, &old, &new);
    eventually(Duration::from_secs(5), "b takes the traffic", || async {
        b.hits_on("/orders") > 0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, Ordering::SeqCst);
    looping.await.unwrap();
    assert_eq!(
        failed.load(Ordering::SeqCst),
        0,
        "requests failed across the reload"
    );
    assert!(sent.load(Ordering::SeqCst) > 10);

    // The request in flight finished on the replica it started on.
    let r = in_flight
        .await
        .unwrap()
        .expect("the slow request is answered");
    assert_eq!(r.status(), 200);
    assert_eq!(port_of(&r), slow.port);

    let on_a = a.hits_on("/orders");
    for _ in 0..10 {
        assert_eq!(port_of(&get(&http, &gw, "/orders").await), b.port);
    }
    assert_eq!(a.hits_on("/orders"), on_a);
    assert_eq!(port_of(&get(&http, &gw, "/slow").await), b.port);
    assert_eq!(
        metric_of(&gw, "tollgate_config_reloads_total{result=\"ok\"}").await,
        Some(1.0)
    );
    let at = metric_of(&gw, "tollgate_config_reload_last_success_timestamp_seconds")
        .await
        .unwrap();
    assert!((unix_now() as f64 - at).abs() < 30.0, "{at}");
    // The change to [upstream] was not applied, and the log says so.
    let log = log_of(&gw);
    assert!(
        log.lines()
            .any(|l| l.contains("WARN") && l.contains("restart") && l.contains("upstream")),
        "{log}"
    );
}

#[tokio::test]
async fn sighup_with_a_bad_file_is_refused_and_the_old_routes_keep_serving() {
    let (a, b) = (
        Upstream::start(Behaviour::Echo).await,
        Upstream::start(Behaviour::Echo).await,
    );
    let old = format!(
        "{}{}",
        catalog(),
        route_toml("orders", "/orders", &[a.url()])
    );
    let gw = gateway_process(&old, &[("NO_COLOR", "1")]);
    let http = reqwest::Client::new();

    // Not TOML at all.
    let broken = format!("{old}[[routes]\n");
    reload(&gw, &old, &broken);
    eventually(Duration::from_secs(5), "the reload refused", || async {
        metric_of(&gw, "tollgate_config_reloads_total{result=\"rejected\"}").await == Some(1.0)
    })
    .await;
    // Valid TOML, two bad keys: both named.
    let bad = format!(
        "{}{}balance = \"random\"\n[routes.health_check]\npath = \"/healthz\"\ninterval_ms = 1\n",
        catalog(),
        route_toml("orders", "/orders", &[b.url()]),
    );
    reload(&gw, &broken, &bad);
    eventually(Duration::from_secs(5), "the reload refused", || async {
        metric_of(&gw, "tollgate_config_reloads_total{result=\"rejected\"}").await == Some(2.0)
    })
    .await;
    for _ in 0..10 {
        let r = get(&http, &gw, "/orders").await;
        assert_eq!(r.status(), 200);
        assert_eq!(port_of(&r), a.port);
    }
    assert_eq!(b.hits(), 0);
    let log = log_of(&gw);
    for key in ["routes[0].balance", "routes[0].health_check.interval_ms"] {
        assert!(
            log.lines()
                .any(|l| l.contains("refused") && l.contains(key)),
            "{key} not named: {log}"
        );
    }
    assert_eq!(
        metric_of(&gw, "tollgate_config_reloads_total{result=\"ok\"}").await,
        Some(0.0)
    );
    // Fixed: taken.
    let good = format!(
        "{}{}",
        catalog(),
        route_toml("orders", "/orders", &[b.url()])
    );
    reload(&gw, &bad, &good);
    eventually(Duration::from_secs(5), "the fixed file applied", || async {
        metric_of(&gw, "tollgate_config_reloads_total{result=\"ok\"}").await == Some(1.0)
    })
    .await;
    assert_eq!(port_of(&get(&http, &gw, "/orders").await), b.port);
}

#[tokio::test]
async fn health_checks_added_and_removed_by_a_reload_take_effect() {
    let (a, b) = (
        Upstream::start(Behaviour::Checked(health_flag(false))).await,
        Upstream::start(Behaviour::Echo).await,
    );
    let route = route_toml("orders", "/orders", &[a.url(), b.url()]);
    let old = format!("{}{route}balance = \"round_robin\"\n", catalog());
    let gw = gateway_process(&old, &[("NO_COLOR", "1")]);
    let http = reqwest::Client::new();

    // Checks added: a fails them and is taken out.
    let new = format!("{}{route}{}", catalog(), checks(2, 2));
    reload(&gw, &old, &new);
    eventually(Duration::from_secs(5), "a taken out", || async {
        healthy(&gw.address, "orders", &a).await == Some(0.0)
    })
    .await;
    let on_a = a.hits_on("/orders");
    for _ in 0..10 {
        assert_eq!(port_of(&get(&http, &gw, "/orders").await), b.port);
    }
    assert_eq!(a.hits_on("/orders"), on_a);
    let log = log_of(&gw);
    assert!(
        log.lines()
            .any(|l| l.contains("WARN") && l.contains("health check") && l.contains(&a.url())),
        "{log}"
    );

    // Checks removed: nothing keeps a out any more.
    reload(&gw, &new, &old);
    eventually(Duration::from_secs(5), "a back", || async {
        healthy(&gw.address, "orders", &a).await == Some(1.0)
    })
    .await;
    let checks_then = checked(&a);
    let ports: Vec<u16> = {
        let mut ports = Vec::new();
        for _ in 0..10 {
            ports.push(port_of(&get(&http, &gw, "/orders").await));
        }
        ports
    };
    assert_eq!(
        ports.iter().filter(|&&p| p == a.port).count(),
        5,
        "{ports:?}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        checked(&a),
        checks_then,
        "still checked after the checks were removed"
    );
}

#[tokio::test]
async fn sighup_makes_a_route_public_and_private_again() {
    let up = Upstream::start(Behaviour::Echo).await;
    let anonymous = "[[catalog.plans]]\nname = \"anonymous\"\ncapacity = 100\nrate = 100\n";
    let private = route_toml("login", "/login", &[up.url()]);
    let public = format!("{private}public_plan = \"anonymous\"\n");
    let gw = gateway_process(&format!("{}{anonymous}{private}", catalog()), &[]);
    let http = reqwest::Client::new();
    let without_key = || async {
        http.get(format!("{}/login", gw.address))
            .send()
            .await
            .map(|r| r.status().as_u16())
            .unwrap_or(0)
    };
    assert_eq!(without_key().await, 401);

    reload(&gw, &private, &public);
    eventually(Duration::from_secs(5), "the route is public", || async {
        without_key().await == 200
    })
    .await;
    reload(&gw, &public, &private);
    eventually(
        Duration::from_secs(5),
        "the route is private again",
        || async { without_key().await == 401 },
    )
    .await;
    assert_eq!(get(&http, &gw, "/login").await.status(), 200);
}
