//! Stopping: a gateway stops promptly, and its background work with it (the book, "Operating
//! tollgate": SIGTERM). Every long-lived task runs under the gateway's supervisor, which
//! cancels and joins them once the servers have stopped.

use std::time::{Duration, Instant};

use tollgate::startup::Application;

use crate::helpers::*;

#[tokio::test]
async fn a_stopped_gateway_has_stopped_every_background_task_and_checks_no_replica() {
    // Arrange: a gateway on Redis whose replica is health-checked every 20 ms, with its
    // background tasks running.
    let redis = RedisServer::start().unwrap();
    let replica = Upstream::start(Behaviour::Checked(health_flag(true))).await;
    let toml = format!(
        "{}{}{}[routes.health_check]\npath = \"/healthz\"\ninterval_ms = 20\n",
        redis_toml(&redis),
        catalog_toml(("gold", 100.0, 100.0), &["acme"]),
        route_toml("orders", "/orders", &[replica.url()]),
    );
    let app = Application::build(settings(&toml)).await.unwrap();
    let (tasks, handles) = (app.tasks(), app.handles());
    let running = tokio::spawn(app.run_until_stopped());
    let expected = [
        "catalog-refresh",
        "health-checks",
        "store-breaker-probe",
        "regional-breaker-probe",
        "hot-clients-rotation",
        "shares-reconciler",
        "shadow-flush",
        "safety-eviction",
        "worker-store-connections",
        "worker-delay-watch",
    ];
    eventually(Duration::from_secs(5), "every task runs", || async {
        let names = tasks.running();
        expected.iter().all(|t| names.iter().any(|n| n == t))
    })
    .await;
    eventually(Duration::from_secs(5), "the replica is checked", || async {
        replica.hits_on("/healthz") >= 2
    })
    .await;

    // Act: stop it, as SIGTERM does.
    let began = Instant::now();
    for h in &handles {
        h.stop(true).await;
    }
    running.await.unwrap().expect("it stops cleanly");

    // Assert: promptly, with nothing left running, and no check after.
    assert!(
        began.elapsed() < Duration::from_secs(3),
        "took {:?}",
        began.elapsed()
    );
    assert_eq!(tasks.running(), Vec::<String>::new());
    let checks = replica.hits_on("/healthz");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        replica.hits_on("/healthz"),
        checks,
        "checked after it stopped"
    );
    assert!(
        tasks.restarts().values().all(|n| *n == 0),
        "{:?}",
        tasks.restarts()
    );
}

#[tokio::test]
async fn every_background_task_is_counted_in_the_metrics_with_its_restarts() {
    // Arrange: a gateway on Redis, its background tasks running.
    let redis = RedisServer::start().unwrap();
    let toml = format!(
        "{}{}",
        redis_toml(&redis),
        catalog_toml(("gold", 100.0, 100.0), &["acme"]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;

    // Act: scrape it.
    let series = "tollgate_task_restarts_total{task=\"catalog-refresh\"}";
    eventually(
        Duration::from_secs(5),
        "the catalog refresh is counted",
        || async { gw.metric(series).await.is_some() },
    )
    .await;

    // Assert: each task has its series, none restarted.
    for task in ["catalog-refresh", "hot-clients-rotation", "safety-eviction"] {
        let series = format!("tollgate_task_restarts_total{{task=\"{task}\"}}");
        assert_eq!(gw.sample(&series).await, 0.0, "{series}");
    }
    gw.stop().await;
}

#[tokio::test]
async fn the_span_exporter_runs_under_the_supervisor_and_stops_with_the_gateway() {
    // Arrange: a gateway exporting its spans to a collector.
    let collector = Collector::start().await;
    let toml = format!(
        "{}[telemetry]\notlp_endpoint = \"{}\"\n",
        catalog_toml(("gold", 100.0, 100.0), &["acme"]),
        collector.url(),
    );
    let app = Application::build(settings(&toml)).await.unwrap();
    let (tasks, handles) = (app.tasks(), app.handles());
    let running = tokio::spawn(app.run_until_stopped());
    eventually(Duration::from_secs(5), "the exporter runs", || async {
        tasks.running().iter().any(|t| t == "span-export")
    })
    .await;

    // Act: stop it.
    for h in &handles {
        h.stop(true).await;
    }
    running.await.unwrap().expect("it stops cleanly");

    // Assert: the export thread was joined with the rest.
    assert_eq!(tasks.running(), Vec::<String>::new());
}

#[tokio::test]
async fn a_worker_on_the_embedded_store_has_no_connection_to_keep_and_restarts_nothing() {
    // Arrange: a gateway on the embedded store, whose workers' connection keepers have
    // nothing to keep and end at once.
    let gw = TestGateway::spawn(settings(&catalog_toml(("gold", 100.0, 100.0), &["acme"]))).await;

    // Act: time for a few restarts (the first comes after 100 ms), were a keeper's end
    // taken for a failure.
    tokio::time::sleep(Duration::from_millis(700)).await;

    // Assert: done, not failed: never restarted.
    let series = "tollgate_task_restarts_total{task=\"worker-store-connections\"}";
    assert_eq!(gw.sample(series).await, 0.0, "{series}");
    gw.stop().await;
}
