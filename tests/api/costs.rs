//! Costs known after the response: a route's service reports a request's real cost in
//! its `cost_header`, and the gateway debits (or refunds) the difference to what it took
//! up front, batched and off the request path, on the embedded store and on Redis.

use std::cell::Cell;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures_util::future::join_all;
use reqwest::Method;

use crate::helpers::*;
use crate::limiting::quiet;

const COST_HEADER: &str = "x-tollgate-cost";

/// Where the client's limits live: a real `redis-server`, or the gateway's own memory.
enum Backend {
    Embedded,
    Redis(RedisServer),
}

impl Backend {
    fn redis() -> Backend {
        Backend::Redis(RedisServer::start().unwrap())
    }

    fn toml(&self) -> String {
        match self {
            Backend::Embedded => String::new(),
            Backend::Redis(redis) => redis_toml(redis),
        }
    }
}

/// A test per store for a scenario `async fn name(backend: Backend)`: `name::on_redis`
/// and `name::embedded`.
macro_rules! on_both_stores {
    ($name:ident) => {
        mod $name {
            #[tokio::test]
            async fn on_redis() {
                super::$name(super::Backend::redis()).await
            }

            #[tokio::test]
            async fn embedded() {
                super::$name(super::Backend::Embedded).await
            }
        }
    };
}

/// A route `/<service>` whose service reports its costs in [`COST_HEADER`]; `cost` is
/// taken up front.
fn costed_route(service: &str, up: &Upstream, cost: f64) -> String {
    format!(
        "{}cost = {cost:?}\ncost_header = \"{COST_HEADER}\"\n",
        route_toml(service, &format!("/{service}"), &[up.url()])
    )
}

/// A gateway on `store` (its `[redis]` section, or nothing: embedded), with the admin
/// API, `catalog` (client `acme`), `routes` and `extra` (further sections).
async fn gateway(store: &str, catalog: &str, routes: &str, extra: &str) -> TestGateway {
    TestGateway::spawn(settings(&format!(
        "{store}{}{catalog}{routes}{extra}",
        admin_toml()
    )))
    .await
}

/// acme's headline bucket in the store, as the admin API reads it (`HMGET`, no script).
async fn tokens(gw: &TestGateway, token: &str) -> f64 {
    let view: serde_json::Value = gw
        .admin(Method::GET, "/clients/acme/bucket", token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    view["tokens"].as_f64().expect("tokens in the bucket view")
}

/// Waits until the store shows acme's tokens passing `check`: the debits queued so far
/// have reached it. Returns the tokens then.
async fn until_tokens(gw: &TestGateway, what: &str, check: impl Fn(f64) -> bool) -> f64 {
    let token = admin_token("ops", "admin:read");
    let last = Cell::new(f64::NAN);
    eventually(Duration::from_secs(5), what, || async {
        last.set(tokens(gw, &token).await);
        check(last.get())
    })
    .await;
    last.get()
}

/// What a `429` says: (`Retry-After` in s, `retry_after_ms`, the refusing limit's name).
async fn refusal(r: reqwest::Response) -> (u64, u64, String) {
    assert_eq!(r.status(), 429);
    let retry_after = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let body: serde_json::Value = r.json().await.unwrap();
    (
        retry_after,
        body["retry_after_ms"].as_u64().unwrap(),
        body["limit"].as_str().unwrap_or_default().to_string(),
    )
}

on_both_stores!(a_cost_reported_over_the_routes_is_debited_and_waited_off);
async fn a_cost_reported_over_the_routes_is_debited_and_waited_off(backend: Backend) {
    // Arrange: 10 tokens refilled at 0.5/s; the route takes 1, the service reports 5.
    let up = Upstream::start(Behaviour::Header(COST_HEADER, "5")).await;
    let gw = gateway(
        &backend.toml(),
        &catalog_toml(("gold", 10.0, 0.5), &["acme"]),
        &costed_route("llm", &up, 1.0),
        "",
    )
    .await;
    let k = key("acme");

    // Act: two requests, each 1 up front and 5 in the end.
    let first = gw.get("/llm", Some(&k)).await;
    let second = gw.get("/llm", Some(&k)).await;

    // Assert: both admitted; the report stays between the service and the gateway; the
    // first response already shows its real cost (9 after the take, 5 after the debit).
    for r in [&first, &second] {
        assert_eq!(r.status(), 200);
        assert!(!r.headers().contains_key(COST_HEADER), "{:?}", r.headers());
    }
    assert_eq!(first.headers()["ratelimit"], "\"gold\";r=5;t=10");
    // The store comes to 10 - 2 × 5 = 0 (8 without the debits), plus what refilled since.
    until_tokens(&gw, "both debits reach the store", |t| t < 1.0).await;

    // Refused, with an honest Retry-After: refused half a second before it, admitted at it.
    let (retry_after, wait_ms, limit) = refusal(gw.get("/llm", Some(&k)).await).await;
    assert_eq!(limit, "gold");
    assert!((1..=2).contains(&retry_after), "{retry_after}");
    assert_eq!(
        retry_after,
        wait_ms.div_ceil(1000),
        "{retry_after} s vs {wait_ms} ms"
    );
    assert!(wait_ms > 500, "{wait_ms} ms");
    tokio::time::sleep(Duration::from_millis(wait_ms - 500)).await;
    assert_eq!(gw.get("/llm", Some(&k)).await.status(), 429);
    tokio::time::sleep(Duration::from_millis(550)).await;
    assert_eq!(gw.get("/llm", Some(&k)).await.status(), 200);
    assert_eq!(up.hits(), 3, "refused requests never reach the service");
    assert_eq!(
        gw.sample("tollgate_cost_reports_total{service=\"llm\",outcome=\"debit\"}")
            .await,
        3.0
    );
}

on_both_stores!(a_cost_reported_under_the_routes_is_refunded);
async fn a_cost_reported_under_the_routes_is_refunded(backend: Backend) {
    // Arrange: 10 tokens, next to no refill; the route takes 5, the service reports 0.
    let up = Upstream::start(Behaviour::Header(COST_HEADER, "0")).await;
    let gw = gateway(
        &backend.toml(),
        &catalog_toml(("gold", 10.0, 0.001), &["acme"]),
        &costed_route("llm", &up, 5.0),
        "",
    )
    .await;
    let k = key("acme");

    // Act
    let first = gw.get("/llm", Some(&k)).await;

    // Assert: the 5 taken up front come back (5 left without the refund).
    assert_eq!(first.status(), 200);
    assert_eq!(first.headers()["ratelimit"], "\"gold\";r=10;t=0");
    until_tokens(&gw, "the refund reaches the store", |t| t > 9.99).await;
    // So two more fit at once (only one would without it).
    assert_eq!(gw.get("/llm", Some(&k)).await.status(), 200);
    assert_eq!(gw.get("/llm", Some(&k)).await.status(), 200);
    assert_eq!(
        gw.sample("tollgate_cost_reports_total{service=\"llm\",outcome=\"refund\"}")
            .await,
        3.0
    );
}

on_both_stores!(a_balance_below_zero_is_waited_off);
async fn a_balance_below_zero_is_waited_off(backend: Backend) {
    // Arrange: 10 tokens refilled at 10/s; the route takes 1, the service reports 25.
    let up = Upstream::start(Behaviour::Header(COST_HEADER, "25")).await;
    let gw = gateway(
        &backend.toml(),
        &catalog_toml(("gold", 10.0, 10.0), &["acme"]),
        &costed_route("llm", &up, 1.0),
        "",
    )
    .await;
    let k = key("acme");

    // Act: one request that really cost two and a half buckets.
    let first = gw.get("/llm", Some(&k)).await;

    // Assert: the bucket goes to 10 - 25 = -15, shown as nothing left, full in 2.5 s...
    assert_eq!(first.status(), 200);
    assert_eq!(first.headers()["ratelimit"], "\"gold\";r=0;t=3");
    until_tokens(&gw, "the debit takes the store below zero", |t| t < 0.0).await;
    // ...so the next needs 16 tokens: refused for ~1.6 s, Retry-After 2.
    let (retry_after, wait_ms, _) = refusal(gw.get("/llm", Some(&k)).await).await;
    assert_eq!(retry_after, 2);
    assert!((1000..=1600).contains(&wait_ms), "{wait_ms} ms");
    tokio::time::sleep(Duration::from_millis(wait_ms - 500)).await;
    assert_eq!(gw.get("/llm", Some(&k)).await.status(), 429);
    tokio::time::sleep(Duration::from_millis(550)).await;
    assert_eq!(gw.get("/llm", Some(&k)).await.status(), 200);
}

on_both_stores!(a_quota_is_debited_by_the_real_cost_too);
async fn a_quota_is_debited_by_the_real_cost_too(backend: Backend) {
    clear_of_midnight().await;
    // Arrange: a plan of a roomy bucket (next to no refill, so the admin API can see when
    // a debit landed) and 10 requests a day; the route takes 1, the service reports 5.
    let up = Upstream::start(Behaviour::Header(COST_HEADER, "5")).await;
    let catalog = format!(
        r#"[[catalog.plans]]
name = "gold"
limits = [{{ name = "burst", capacity = 100, rate = 0.001 }}, {{ name = "daily", quota = 10, period = "day" }}]
[[catalog.clients]]
id = "acme"
plan = "gold"
keys = ["{}"]
"#,
        key("acme")
    );
    let gw = gateway(
        &backend.toml(),
        &catalog,
        &costed_route("llm", &up, 1.0),
        "",
    )
    .await;
    let k = key("acme");

    // Act: two requests (2 of the day's 10 up front; 10 in the end).
    assert_eq!(gw.get("/llm", Some(&k)).await.status(), 200);
    assert_eq!(gw.get("/llm", Some(&k)).await.status(), 200);
    // The bucket and the quota are debited in the same script call.
    until_tokens(&gw, "the debits reach the store", |t| t < 90.01).await;

    // Assert: the quota is used up; its window ends at the next midnight (UTC).
    let (retry_after, _, limit) = refusal(gw.get("/llm", Some(&k)).await).await;
    assert_eq!(limit, "gold.daily");
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let midnight = 86_400 - now % 86_400;
    assert!(
        retry_after.abs_diff(midnight) <= 2,
        "Retry-After {retry_after} s, midnight in {midnight} s"
    );
}

on_both_stores!(a_malformed_report_is_ignored_and_counted);
async fn a_malformed_report_is_ignored_and_counted(backend: Backend) {
    // Arrange: one service reports nonsense, another (the witness) a real cost of 2.
    let bad = Upstream::start(Behaviour::Header(COST_HEADER, "lots")).await;
    let witness = Upstream::start(Behaviour::Header(COST_HEADER, "2")).await;
    let gw = gateway(
        &backend.toml(),
        &catalog_toml(("gold", 10.0, 0.001), &["acme"]),
        &format!(
            "{}{}",
            costed_route("llm", &bad, 1.0),
            costed_route("witness", &witness, 1.0)
        ),
        "",
    )
    .await;
    let k = key("acme");

    // Act
    let answers = [
        gw.get("/llm", Some(&k)).await,
        gw.get("/llm", Some(&k)).await,
    ];
    // Debits queued on this worker go out together or in order, so once the witness's
    // reaches the store, any the malformed reports had caused would have too.
    assert_eq!(gw.get("/witness", Some(&k)).await.status(), 200);
    let left = until_tokens(&gw, "the witness's debit reaches the store", |t| t < 6.5).await;

    // Assert: 3 taken and the witness's 1 debited, nothing else; the header still stripped.
    assert!((left - 6.0).abs() < 0.01, "{left}");
    for r in &answers {
        assert_eq!(r.status(), 200);
        assert!(!r.headers().contains_key(COST_HEADER));
    }
    assert_eq!(answers[1].headers()["ratelimit"], "\"gold\";r=8;t=2000");
    assert_eq!(
        gw.sample("tollgate_cost_reports_total{service=\"llm\",outcome=\"invalid\"}")
            .await,
        2.0
    );
    assert_eq!(
        gw.sample("tollgate_cost_reports_total{service=\"llm\",outcome=\"debit\"}")
            .await,
        0.0
    );
}

on_both_stores!(without_a_report_nothing_is_settled);
async fn without_a_report_nothing_is_settled(backend: Backend) {
    // Arrange: a route with a cost header whose service sends none; a route without one
    // whose service happens to send that header; a witness reporting a real cost of 2.
    let silent = Upstream::start(Behaviour::Echo).await;
    let plain = Upstream::start(Behaviour::Header(COST_HEADER, "5")).await;
    let witness = Upstream::start(Behaviour::Header(COST_HEADER, "2")).await;
    let gw = gateway(
        &backend.toml(),
        &catalog_toml(("gold", 10.0, 0.001), &["acme"]),
        &format!(
            "{}{}{}",
            costed_route("silent", &silent, 1.0),
            route_toml("plain", "/plain", &[plain.url()]),
            costed_route("witness", &witness, 1.0)
        ),
        "",
    )
    .await;
    let k = key("acme");

    // Act
    let silent_answer = gw.get("/silent", Some(&k)).await;
    let plain_answer = gw.get("/plain", Some(&k)).await;
    assert_eq!(gw.get("/witness", Some(&k)).await.status(), 200);
    let left = until_tokens(&gw, "the witness's debit reaches the store", |t| t < 6.5).await;

    // Assert: each took its route's cost and no more; a header that is not the route's
    // cost header is the service's to send, and reaches the client.
    assert!((left - 6.0).abs() < 0.01, "{left}");
    assert_eq!(silent_answer.status(), 200);
    assert_eq!(plain_answer.status(), 200);
    assert_eq!(plain_answer.headers()[COST_HEADER], "5");
    let metrics = gw.get("/metrics", None).await.text().await.unwrap();
    for service in ["silent", "plain"] {
        assert!(
            !metrics.contains(&format!(
                "tollgate_cost_reports_total{{service=\"{service}\""
            )),
            "{metrics}"
        );
    }
}

#[tokio::test]
async fn reports_within_one_period_cost_redis_one_call_per_worker() {
    // Arrange: two workers; debits summed for a second; 1000 tokens, next to no refill.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Header(COST_HEADER, "3")).await;
    let gw = gateway(
        &redis_toml(&redis),
        &catalog_toml(("gold", 1000.0, 0.001), &["acme"]),
        &costed_route("llm", &up, 1.0),
        "[server]\nworkers = 2\n[catalog]\nrefresh_ms = 600000\n[periods]\ndebit_ms = 1000\n",
    )
    .await;
    quiet(&redis).await;
    redis.reset_command_stats().unwrap();
    let takes_before = gw.sample("tollgate_store_bucket_calls_total").await;

    // Act: 40 requests at once (on many connections, so on both workers), each reporting
    // 3 for the 1 taken.
    let k = key("acme");
    let started = Instant::now();
    let answers = join_all((0..40).map(|_| gw.get("/llm", Some(&k)))).await;
    let took = started.elapsed();
    assert!(answers.iter().all(|r| r.status() == 200));
    until_tokens(&gw, "every debit reaches the store", |t| {
        t < 1000.0 - 120.0 + 0.01
    })
    .await;

    // Assert: every EVALSHA past the takes' (which the gateway counts) is a debit: one
    // per worker at most, the 80 tokens of 40 reports in them.
    let takes = gw.sample("tollgate_store_bucket_calls_total").await - takes_before;
    let evalsha = redis.calls("evalsha").unwrap() as f64;
    let debits = evalsha - takes;
    assert!(
        (1.0..=2.0).contains(&debits),
        "{debits} debit calls ({evalsha} EVALSHA, {takes} for takes; the requests took {took:?} of a 1 s period)"
    );
}
