//! Usage history (issue 37): every decision about a client is counted per limit and hour
//! on its gateway, checkpointed to the store every `usage.flush_ms` and folded into the
//! history every `usage.fold_ms` (off the request path; here most gateways fold at each
//! flush), and read by the admin API as JSON or CSV. Admitted cost over a quota's window is
//! the quota's `used`, exactly; a fold Redis does not acknowledge is sent again and counted
//! once; what a killed or cut-off gateway held is added by another, once.

use std::time::Duration;

use reqwest::Method;
use serde_json::Value;

use tollgate_testkit::FaultProxy;

use crate::helpers::*;

fn read() -> String {
    admin_token("billing", "admin:read")
}

/// A burst of 20 (refilling 1 a minute, so nothing refills during a test) and a daily
/// quota of 100, for `clients`.
fn plan_toml(clients: &[&str]) -> String {
    limits_catalog_toml(
        "metered",
        r#"[{ name = "burst", capacity = 20, rate = 0.0166 },
            { name = "daily", quota = 100, period = "day" }]"#,
        clients,
    )
}

/// Checkpoints and folds every `flush_ms`; a gateway silent for three of them is adopted.
fn usage_toml(flush_ms: u64) -> String {
    format!(
        "[usage]\nflush_ms = {flush_ms}\nfold_ms = {flush_ms}\nadopt_after_ms = {}\nretention_days = 2\n",
        3 * flush_ms
    )
}

async fn gateway(store: &str, up: &Upstream, flush_ms: u64) -> TestGateway {
    TestGateway::spawn(settings(&format!(
        "{store}{}{}{}{}",
        usage_toml(flush_ms),
        admin_toml(),
        plan_toml(&["acme", "other"]),
        route_toml("orders", "/orders", &[up.url()]),
    )))
    .await
}

/// Sends `n` requests as acme; returns how many were admitted (200) and refused (429).
async fn send(gw: &TestGateway, n: usize) -> (u64, u64) {
    let (mut admitted, mut refused) = (0, 0);
    for _ in 0..n {
        match gw
            .get("/orders", Some(&key("acme")))
            .await
            .status()
            .as_u16()
        {
            200 => admitted += 1,
            429 => refused += 1,
            s => panic!("unexpected status {s}"),
        }
    }
    (admitted, refused)
}

/// acme's history as JSON over the last two hours (and the next), `step` rows.
async fn history(gw: &TestGateway, step: &str) -> Value {
    history_or_status(gw, step)
        .await
        .unwrap_or_else(|s| panic!("history: {s}"))
}

/// [`history`], or the status of a refusal (the store unreachable: 503).
async fn history_or_status(gw: &TestGateway, step: &str) -> Result<Value, u16> {
    let to = unix_now() / 3600 * 3600 + 3600;
    let from = to - 3 * 3600;
    let r = gw
        .admin(
            Method::GET,
            &format!(
                "/clients/acme/usage/history?from={}&to={}&step={step}",
                rfc3339(from),
                rfc3339(to)
            ),
            &read(),
        )
        .send()
        .await
        .unwrap();
    match r.status().as_u16() {
        200 => Ok(r.json().await.unwrap()),
        s => Err(s),
    }
}

fn rfc3339(unix_s: u64) -> String {
    jiff::Timestamp::from_second(unix_s as i64)
        .unwrap()
        .to_string()
}

/// One limit's totals in a history (zeros when it has none).
fn totals(h: &Value, limit: &str) -> (u64, u64, f64, u64) {
    h["totals"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["limit"] == limit)
        .map(|t| {
            (
                t["admitted"].as_u64().unwrap(),
                t["refused"].as_u64().unwrap(),
                t["cost"].as_f64().unwrap(),
                t["unmetered"].as_u64().unwrap(),
            )
        })
        .unwrap_or_default()
}

/// The daily quota's `used` now, from `GET /clients/acme/usage`.
async fn quota_used(gw: &TestGateway) -> f64 {
    let u: Value = gw
        .admin(Method::GET, "/clients/acme/usage", &read())
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    u["limits"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == "daily")
        .and_then(|l| l["used"].as_f64())
        .unwrap_or(0.0)
}

/// Waits until the history's totals for both limits are `expected`.
async fn history_reaches(gw: &TestGateway, expected: (u64, u64, f64, u64)) {
    eventually(
        Duration::from_secs(10),
        &format!("the history's totals reach {expected:?}"),
        || async {
            history_or_status(gw, "hour")
                .await
                .is_ok_and(|h| totals(&h, "burst") == expected && totals(&h, "daily") == expected)
        },
    )
    .await;
}

#[tokio::test]
async fn the_history_counts_every_request_and_its_cost_is_the_quotas_used_exactly() {
    // Arrange.
    clear_of_midnight().await;
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&redis_toml(&redis), &up, 200).await;

    // Act: 30 requests against a burst of 20.
    let (admitted, refused) = send(&gw, 30).await;

    // Assert: every one counted on both limits, once flushed; the admitted cost is what
    // the quota counted.
    assert_eq!((admitted, refused), (20, 10));
    history_reaches(&gw, (admitted, refused, admitted as f64, 0)).await;
    assert_eq!(quota_used(&gw).await, admitted as f64);
    let by_day = history(&gw, "day").await;
    let rows = by_day["rows"].as_array().unwrap();
    assert!(
        rows.iter()
            .all(|r| r["start"].as_str().unwrap().ends_with("T00:00:00Z")),
        "{by_day}"
    );
    assert_eq!(totals(&by_day, "daily"), (20, 10, 20.0, 0));
    // Another client's history is its own.
    let r = gw
        .admin(Method::GET, "/clients/other/usage/history", &read())
        .send()
        .await
        .unwrap();
    let other: Value = r.json().await.unwrap();
    assert_eq!(other["rows"], serde_json::json!([]), "{other}");

    // Assert: one hash per client and UTC day, kept the retention (2 days) past the day's
    // end.
    let day = unix_now() / 86_400 * 86_400;
    let keys = redis.keys("tollgate:u:*").unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    let ttl: i64 = redis::cmd("TTL")
        .arg(&keys[0])
        .query(&mut redis.conn().unwrap())
        .unwrap();
    let expected = (day + 86_400 + 2 * 86_400 - unix_now()) as i64;
    assert!(
        (expected - 5..=expected).contains(&ttl),
        "{ttl} vs {expected}"
    );
    let _ = (day, keys);
}

#[tokio::test]
async fn two_gateways_on_one_redis_add_up_in_one_history() {
    // Arrange.
    clear_of_midnight().await;
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let a = gateway(&redis_toml(&redis), &up, 200).await;
    let b = gateway(&redis_toml(&redis), &up, 300).await;

    // Act: 12 requests through each; the burst of 20 is shared.
    let (a_in, a_out) = send(&a, 12).await;
    let (b_in, b_out) = send(&b, 12).await;

    // Assert: one history of all 24, read the same on either gateway.
    assert_eq!((a_in + b_in, a_out + b_out), (20, 4));
    history_reaches(&a, (20, 4, 20.0, 0)).await;
    history_reaches(&b, (20, 4, 20.0, 0)).await;
    assert_eq!(quota_used(&b).await, 20.0);
}

#[tokio::test]
async fn a_flush_redis_ran_but_did_not_answer_and_one_it_never_got_are_each_counted_once() {
    // Arrange: a gateway reaching Redis through a proxy that can delay replies and refuse
    // connections; flushes bounded by a control timeout of 300 ms.
    clear_of_midnight().await;
    let redis = RedisServer::start().unwrap();
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", redis.port).parse().unwrap());
    let up = Upstream::start(Behaviour::Echo).await;
    let store = format!(
        "[redis]\nurl = \"{}\"\ntimeout_ms = 2000\ncontrol_timeout_ms = 300\n",
        proxy.redis_url()
    );
    let gw = gateway(&store, &up, 200).await;

    // Act: 8 requests; then every reply from Redis arrives 1 s late, so the flush that
    // carries them runs in Redis but times out at the gateway.
    let (admitted, refused) = send(&gw, 8).await;
    assert_eq!((admitted, refused), (8, 0));
    proxy.delay(Duration::from_millis(1000));
    eventually(Duration::from_secs(10), "a flush fails", || async {
        gw.sample("tollgate_usage_flushes_total{result=\"failed\"}")
            .await
            >= 1.0
    })
    .await;
    proxy.heal();

    // Assert: sent again, and counted once.
    history_reaches(&gw, (8, 0, 8.0, 0)).await;
    wait_until_nothing_held(&gw).await;
    let h = history(&gw, "hour").await;
    assert_eq!(totals(&h, "daily"), (8, 0, 8.0, 0), "{h}");
    assert_eq!(quota_used(&gw).await, 8.0);

    // Act: 4 more, then Redis refuses every connection while a flush is due, and the
    // requests made meanwhile fail open.
    let (admitted, _) = send(&gw, 4).await;
    assert_eq!(admitted, 4);
    proxy.refuse();
    proxy.reset();
    let before = gw
        .sample("tollgate_usage_flushes_total{result=\"failed\"}")
        .await;
    let (open, _) = send(&gw, 3).await;
    assert_eq!(open, 3);
    eventually(Duration::from_secs(10), "a flush fails again", || async {
        gw.sample("tollgate_usage_flushes_total{result=\"failed\"}")
            .await
            > before
    })
    .await;
    proxy.heal();

    // Assert: nothing lost, nothing doubled; the 3 admitted without Redis are unmetered,
    // and the quota counted only what Redis admitted.
    history_reaches(&gw, (12, 0, 12.0, 3)).await;
    wait_until_nothing_held(&gw).await;
    let h = history(&gw, "hour").await;
    assert_eq!(totals(&h, "burst"), (12, 0, 12.0, 3), "{h}");
    assert_eq!(quota_used(&gw).await, 12.0);
}

async fn wait_until_nothing_held(gw: &TestGateway) {
    eventually(Duration::from_secs(10), "nothing held unsent", || async {
        gw.sample("tollgate_usage_entries").await == 0.0
    })
    .await;
}

#[tokio::test]
async fn a_gateway_stopping_flushes_what_it_counted() {
    // Arrange: a flush period far longer than the test.
    clear_of_midnight().await;
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&redis_toml(&redis), &up, 3_600_000).await;
    let (admitted, refused) = send(&gw, 22).await;

    // Act: a graceful stop.
    gw.stop().await;

    // Assert: another gateway reads all of it.
    let reader = gateway(&redis_toml(&redis), &up, 3_600_000).await;
    let h = history(&reader, "hour").await;
    assert_eq!(
        totals(&h, "daily"),
        (admitted, refused, admitted as f64, 0),
        "{h}"
    );
    assert_eq!((admitted, refused), (20, 2));
}

#[tokio::test]
async fn the_embedded_store_serves_history_as_json_and_csv_and_bad_input_is_named() {
    // Arrange: no Redis.
    clear_of_midnight().await;
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway("", &up, 200).await;
    let (admitted, refused) = send(&gw, 25).await;
    assert_eq!((admitted, refused), (20, 5));

    // Assert: JSON.
    history_reaches(&gw, (20, 5, 20.0, 0)).await;
    assert_eq!(quota_used(&gw).await, 20.0);

    // Assert: CSV, by format and by Accept, with a header and a row per limit and hour.
    for (query, accept) in [("?format=csv", "*/*"), ("", "text/csv")] {
        let r = gw
            .admin(
                Method::GET,
                &format!("/clients/acme/usage/history{query}"),
                &read(),
            )
            .header("accept", accept)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/csv"));
        let body = r.text().await.unwrap();
        let mut lines = body.lines();
        assert_eq!(
            lines.next(),
            Some("client,limit,start,admitted,refused,cost,unmetered,unmetered_cost")
        );
        let mut sums = std::collections::BTreeMap::<String, (u64, u64, f64)>::new();
        for line in lines {
            let f: Vec<&str> = line.split(',').collect();
            assert_eq!(f.len(), 8, "{line}");
            assert_eq!(f[0], "acme");
            assert!(f[2].parse::<jiff::Timestamp>().is_ok(), "{line}");
            let s = sums.entry(f[1].to_string()).or_default();
            s.0 += f[3].parse::<u64>().unwrap();
            s.1 += f[4].parse::<u64>().unwrap();
            s.2 += f[5].parse::<f64>().unwrap();
        }
        assert_eq!(sums["burst"], (20, 5, 20.0), "{body}");
        assert_eq!(sums["daily"], (20, 5, 20.0), "{body}");
    }

    // Assert: bad input is a problem naming its field.
    for (query, field) in [
        ("from=yesterday", "from"),
        ("to=2026-13-01T00:00:00Z", "to"),
        ("step=week", "step"),
        ("format=xml", "format"),
        ("from=2026-12-02T00:00:00Z&to=2026-12-01T00:00:00Z", "from"),
    ] {
        let r = gw
            .admin(
                Method::GET,
                &format!("/clients/acme/usage/history?{query}"),
                &read(),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 422, "{query}");
        assert_eq!(
            r.headers()["content-type"],
            "application/problem+json",
            "{query}"
        );
        assert_eq!(problem_fields(r).await, [field], "{query}");
    }
    // A range longer than the retention (2 days) plus one reads as far back as is kept.
    let r = gw
        .admin(
            Method::GET,
            "/clients/acme/usage/history?from=2026-11-01T00:00:00Z&to=2026-12-01T00:00:00Z",
            &read(),
        )
        .send()
        .await
        .unwrap();
    let h: Value = r.json().await.unwrap();
    assert_eq!(
        (h["from"].as_str(), h["to"].as_str()),
        (Some("2026-11-28T00:00:00Z"), Some("2026-12-01T00:00:00Z")),
        "{h}"
    );
    // A token without admin:read is refused.
    let r = gw
        .admin(
            Method::GET,
            "/clients/acme/usage/history",
            &admin_token("x", "admin:keys"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
}

#[tokio::test]
async fn on_a_redis_cluster_every_clients_history_is_kept_in_its_groups_slot() {
    // Arrange: 200 clients in the cluster's 256 state groups (so some groups hold several,
    // written in one call), spread over the three masters.
    clear_of_midnight().await;
    let cluster = RedisCluster::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let clients: Vec<String> = (0..200).map(|i| format!("c{i}")).collect();
    let refs: Vec<&str> = clients.iter().map(String::as_str).collect();
    let gw = TestGateway::spawn(settings(&format!(
        "[redis]\ncluster_nodes = {:?}\ntimeout_ms = 2000\n{}{}{}{}",
        cluster.urls(),
        usage_toml(200),
        admin_toml(),
        plan_toml(&refs),
        route_toml("orders", "/orders", &[up.url()]),
    )))
    .await;

    // Act: client i sends i % 2 + 1 requests.
    for (i, c) in clients.iter().enumerate() {
        for _ in 0..i % 2 + 1 {
            assert_eq!(gw.get("/orders", Some(&key(c))).await.status(), 200);
        }
    }

    // Assert: each client's history has exactly its requests, and its quota agrees.
    for (i, c) in clients.iter().enumerate() {
        let n = (i % 2 + 1) as u64;
        eventually(
            Duration::from_secs(10),
            &format!("{c}'s history holds its {n} requests"),
            || async {
                let r = gw
                    .admin(Method::GET, &format!("/clients/{c}/usage/history"), &read())
                    .send()
                    .await
                    .unwrap();
                let h: Value = r.json().await.unwrap();
                totals(&h, "daily") == (n, 0, n as f64, 0)
            },
        )
        .await;
    }
    // The records live on more than one master.
    let holding = cluster
        .nodes
        .iter()
        .filter(|n| !n.keys("tollgate:u:*").unwrap().is_empty())
        .count();
    assert!(holding >= 2, "usage records on {holding} master(s)");
}

#[tokio::test]
async fn counts_past_max_entries_are_dropped_and_counted() {
    // Arrange: room for one (client, limit, hour) count, the embedded store.
    clear_of_midnight().await;
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = TestGateway::spawn(settings(&format!(
        "[usage]\nflush_ms = 200\nfold_ms = 200\nmax_entries = 1\n{}{}{}",
        admin_toml(),
        plan_toml(&["acme"]),
        route_toml("orders", "/orders", &[up.url()]),
    )))
    .await;

    // Act: three requests, each counted on two limits.
    let (admitted, _) = send(&gw, 3).await;
    assert_eq!(admitted, 3);

    // Assert: the first limit's counts are kept, the second's dropped, each counted.
    eventually(
        Duration::from_secs(10),
        "the first limit flushed",
        || async { totals(&history(&gw, "hour").await, "burst") == (3, 0, 3.0, 0) },
    )
    .await;
    assert_eq!(totals(&history(&gw, "hour").await, "daily"), (0, 0, 0.0, 0));
    assert_eq!(gw.sample("tollgate_usage_dropped_total").await, 3.0);
}

#[tokio::test]
async fn a_cost_the_service_reports_is_in_the_history_as_the_quota_counted_it() {
    // Arrange: the route takes 1 up front and its service reports 5 for each request.
    clear_of_midnight().await;
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Header("x-tollgate-cost", "5")).await;
    let gw = TestGateway::spawn(settings(&format!(
        "{}{}{}{}{}cost = 1.0\ncost_header = \"x-tollgate-cost\"\n",
        redis_toml(&redis),
        usage_toml(200),
        admin_toml(),
        plan_toml(&["acme"]),
        route_toml("orders", "/orders", &[up.url()]),
    )))
    .await;

    // Act: 4 requests: 4 taken up front, 20 in the end.
    let (admitted, refused) = send(&gw, 4).await;
    assert_eq!((admitted, refused), (4, 0));

    // Assert: the history's cost is the real cost, and the quota's used.
    history_reaches(&gw, (4, 0, 20.0, 0)).await;
    eventually(Duration::from_secs(5), "the quota counts 20", || async {
        quota_used(&gw).await == 20.0
    })
    .await;
}

/// Checkpointed every 200 ms, folded hourly: what it counts stays in its checkpoint.
const HOLDING: &str =
    "[usage]\nflush_ms = 200\nfold_ms = 3600000\nadopt_after_ms = 1000\nretention_days = 2\n";

/// Waits until `metrics` (a gateway's `/metrics` page, read anew each time) shows two more
/// checkpoints written than now: one begun after this call, done.
async fn checkpointed<F, Fut>(metrics: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = String>,
{
    let series = "tollgate_usage_checkpoints_total{result=\"ok\"}";
    let before = sample_in(&metrics().await, series).unwrap();
    eventually(Duration::from_secs(10), "two more checkpoints", || async {
        sample_in(&metrics().await, series).unwrap() >= before + 2.0
    })
    .await;
}

#[tokio::test]
async fn a_gateway_killed_between_folds_has_what_it_counted_added_by_another() {
    // Arrange: gateway A, a process of its own, holds its counts for the hour.
    clear_of_midnight().await;
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let mut a = gateway_process(
        &format!(
            "{}{HOLDING}{}{}",
            redis_toml(&redis),
            plan_toml(&["acme", "other"]),
            route_toml("orders", "/orders", &[up.url()]),
        ),
        &[],
    );
    let http = reqwest::Client::new();
    let (mut admitted, mut refused) = (0, 0);
    for _ in 0..22 {
        let r = http
            .get(format!("{}/orders", a.address))
            .header("x-api-key", key("acme"))
            .send()
            .await
            .unwrap();
        match r.status().as_u16() {
            200 => admitted += 1,
            429 => refused += 1,
            s => panic!("unexpected status {s}"),
        }
    }
    let metrics = || async {
        let page = http.get(format!("{}/metrics", a.address)).send().await;
        page.unwrap().text().await.unwrap()
    };
    checkpointed(metrics).await;

    // Act: A is killed, an hour before its fold; B runs on.
    a.child.kill().unwrap();
    a.child.wait().unwrap();
    let b = gateway(&redis_toml(&redis), &up, 200).await;

    // Assert: B adds what A held, once; the history is the quota's count.
    assert_eq!((admitted, refused), (20, 2));
    history_reaches(&b, (20, 2, 20.0, 0)).await;
    assert_eq!(quota_used(&b).await, 20.0);
    eventually(Duration::from_secs(5), "one adoption counted", || async {
        b.sample("tollgate_usage_adopted_total{result=\"ok\"}")
            .await
            == 1.0
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let h = history(&b, "hour").await;
    assert_eq!(totals(&h, "daily"), (20, 2, 20.0, 0), "{h}");
}

#[tokio::test]
async fn a_gateway_cut_off_long_enough_to_be_adopted_comes_back_and_nothing_is_counted_twice() {
    // Arrange: A reaches Redis through a proxy and holds its counts for the hour; B
    // folds at each flush and adopts a gateway silent for 600 ms.
    clear_of_midnight().await;
    let redis = RedisServer::start().unwrap();
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", redis.port).parse().unwrap());
    let up = Upstream::start(Behaviour::Echo).await;
    let through_proxy = format!(
        "[redis]\nurl = \"{}\"\ntimeout_ms = 2000\ncontrol_timeout_ms = 300\n",
        proxy.redis_url()
    );
    let a = TestGateway::spawn(settings(&format!(
        "{through_proxy}{HOLDING}{}{}{}",
        admin_toml(),
        plan_toml(&["acme", "other"]),
        route_toml("orders", "/orders", &[up.url()]),
    )))
    .await;
    let b = gateway(&redis_toml(&redis), &up, 200).await;
    assert_eq!(send(&a, 10).await, (10, 0));
    checkpointed(|| async { a.get("/metrics", None).await.text().await.unwrap() }).await;

    // Act: A is cut off until B has added what it held; then it comes back, counts 5
    // more, and stops (folding everything, what B added too).
    proxy.refuse();
    proxy.reset();
    eventually(Duration::from_secs(10), "B adopts A", || async {
        b.sample("tollgate_usage_adopted_total{result=\"ok\"}")
            .await
            >= 1.0
    })
    .await;
    history_reaches(&b, (10, 0, 10.0, 0)).await;
    proxy.heal();
    checkpointed(|| async { a.get("/metrics", None).await.text().await.unwrap() }).await;
    assert_eq!(send(&a, 5).await, (5, 0));
    a.stop().await;

    // Assert: each request counted once.
    history_reaches(&b, (15, 0, 15.0, 0)).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let h = history(&b, "hour").await;
    assert_eq!(totals(&h, "burst"), (15, 0, 15.0, 0), "{h}");
    assert_eq!(quota_used(&b).await, 15.0);
}
