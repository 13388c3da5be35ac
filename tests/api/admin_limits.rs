//! The admin API for plans of several limits: limits in plan bodies (and the old
//! `capacity`/`rate` body), client overrides with an expiry, and a client's usage, each
//! checked through the real gateway and, where it matters, through its proxy.

use std::time::Duration;

use reqwest::Method;
use serde_json::{json, Value};

use crate::helpers::*;

fn rw() -> String {
    admin_token("alice", "admin:read admin:write")
}

/// An admin gateway with a fast catalog mirror and `extra` settings (routes, a store).
async fn gateway(extra: &str) -> TestGateway {
    TestGateway::spawn(settings(&format!(
        "{}[catalog]\nrefresh_ms = 50\n{extra}",
        admin_toml()
    )))
    .await
}

/// `method path` as `rw`, with a JSON body when given.
async fn call(
    gw: &TestGateway,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> reqwest::Response {
    gw.send_admin(method, path, &rw(), body).await
}

async fn read(gw: &TestGateway, path: &str) -> Value {
    let r = call(gw, Method::GET, path, None).await;
    assert_eq!(r.status(), 200, "GET {path}");
    r.json().await.unwrap()
}

/// The `field`s of a `422` problem, sorted.
async fn refused_fields(r: reqwest::Response) -> Vec<String> {
    assert_eq!(r.status(), 422);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    problem_fields(r).await
}

/// A plan, a client `acme` on it with a new key, and the gateway's mirror caught up with
/// both: the key.
async fn client_on(gw: &TestGateway, plan: &str, limits: Value) -> String {
    let r = call(
        gw,
        Method::PUT,
        &format!("/plans/{plan}"),
        Some(json!({ "limits": limits })),
    )
    .await;
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    call(
        gw,
        Method::PUT,
        "/clients/acme",
        Some(json!({"plan": plan})),
    )
    .await;
    let (_, key) = new_key(gw, "acme").await;
    let version = etag_version(&call(gw, Method::GET, "/clients/acme", None).await);
    gw.wait_for_catalog(version).await;
    key
}

/// How many of `n` requests to `path` are admitted (the rest must be 429s).
async fn admitted(gw: &TestGateway, path: &str, key: &str, n: usize) -> usize {
    let mut ok = 0;
    for _ in 0..n {
        let r = gw.get(path, Some(key)).await;
        match r.status().as_u16() {
            200 => ok += 1,
            429 => {}
            s => panic!("{path} answered {s}"),
        }
    }
    ok
}

/// Unix seconds on this machine's clock (the gateway's, in process).
fn unix_s() -> i64 {
    jiff::Timestamp::now().as_second()
}

fn rfc3339(unix_s: i64) -> String {
    jiff::Timestamp::from_second(unix_s).unwrap().to_string()
}

/// Unix milliseconds of an RFC 3339 time.
fn ms_of(t: &Value) -> i64 {
    t.as_str()
        .unwrap_or_else(|| panic!("no time: {t}"))
        .parse::<jiff::Timestamp>()
        .unwrap()
        .as_millisecond()
}

/// The worked example of the README: gold = burst 200 @ 100/s, 1,000,000 a calendar month
/// (UTC), and /search at 10/s.
fn gold() -> Value {
    json!([
        {"name": "burst", "capacity": 200, "rate": 100},
        {"name": "monthly", "quota": 1000000, "period": "month"},
        {"name": "search", "service": "search", "capacity": 10, "rate": 10}
    ])
}

#[tokio::test]
async fn a_plan_of_several_limits_reads_back_whole_and_can_be_put_back_as_read() {
    let gw = gateway("").await;

    let created = call(
        &gw,
        Method::PUT,
        "/plans/gold",
        Some(json!({"limits": gold(), "description": "the worked example"})),
    )
    .await;
    assert_eq!(created.status(), 201);
    let etag = created.headers()["etag"].clone();

    // Every field is shown, the quota's defaults filled in, and the first bucket for
    // every service as the plan's capacity and rate, for clients of the old body.
    let expected = json!({
        "name": "gold",
        "description": "the worked example",
        "capacity": 200.0,
        "rate": 100.0,
        "limits": [
            {"name": "burst", "capacity": 200.0, "rate": 100.0},
            {"name": "monthly", "quota": 1000000.0, "period": "month", "reset": "calendar", "time_zone": "UTC"},
            {"name": "search", "service": "search", "capacity": 10.0, "rate": 10.0}
        ]
    });
    assert_eq!(created.json::<Value>().await.unwrap(), expected);
    let got = call(&gw, Method::GET, "/plans/gold", None).await;
    assert_eq!(got.headers()["etag"], etag);
    let got: Value = got.json().await.unwrap();
    assert_eq!(got, expected);
    assert_eq!(read(&gw, "/plans").await["items"], json!([expected]));

    // What GET answered is a valid body: sent back, it changes nothing.
    let again = call(&gw, Method::PUT, "/plans/gold", Some(got)).await;
    assert_eq!(again.status(), 200);
    assert_eq!(read(&gw, "/plans/gold").await, expected);

    // A plan without a bucket for every service has no capacity and rate to show, and
    // round-trips too; an anchored quota keeps its day, a zone its IANA spelling.
    let quota_only = json!({"limits": [
        {"name": "daily", "quota": 500, "period": "day", "reset": "rolling"},
        {"name": "billing", "quota": 20000, "period": "month", "reset": "anchor", "anchor_day": 15, "time_zone": "europe/berlin"}
    ]});
    assert_eq!(
        call(&gw, Method::PUT, "/plans/metered", Some(quota_only))
            .await
            .status(),
        201
    );
    let metered = read(&gw, "/plans/metered").await;
    assert_eq!(
        metered,
        json!({"name": "metered", "limits": [
            {"name": "daily", "quota": 500.0, "period": "day", "reset": "rolling", "time_zone": "UTC"},
            {"name": "billing", "quota": 20000.0, "period": "month", "reset": "anchor", "anchor_day": 15, "time_zone": "Europe/Berlin"}
        ]})
    );
    assert_eq!(
        call(&gw, Method::PUT, "/plans/metered", Some(metered.clone()))
            .await
            .status(),
        200
    );
    assert_eq!(read(&gw, "/plans/metered").await, metered);
}

#[tokio::test]
async fn the_old_capacity_and_rate_body_is_one_bucket_named_default() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&route_toml("orders", "/orders", &[up.url()])).await;
    let r = call(
        &gw,
        Method::PUT,
        "/plans/gold",
        Some(json!({"capacity": 3, "rate": 0.001})),
    )
    .await;
    assert_eq!(r.status(), 201);
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({"name": "gold", "capacity": 3.0, "rate": 0.001,
            "limits": [{"name": "default", "capacity": 3.0, "rate": 0.001}]})
    );
    // And it is that bucket the proxy decides with, under the plan's name.
    call(
        &gw,
        Method::PUT,
        "/clients/acme",
        Some(json!({"plan": "gold"})),
    )
    .await;
    let (_, key) = new_key(&gw, "acme").await;
    gw.wait_for_catalog(etag_version(
        &call(&gw, Method::GET, "/clients/acme", None).await,
    ))
    .await;
    let first = gw.get("/orders", Some(&key)).await;
    assert_eq!(first.headers()["ratelimit-policy"], "\"gold\";q=3;w=3000");
    assert_eq!(admitted(&gw, "/orders", &key, 3).await, 2);

    // Beside limits, capacity and rate may only repeat what GET shows; anything else is
    // the two bodies at once.
    let both =
        json!({"limits": [{"name": "burst", "capacity": 5, "rate": 1}], "capacity": 6, "rate": 1});
    assert_eq!(
        refused_fields(call(&gw, Method::PUT, "/plans/gold", Some(both)).await).await,
        ["capacity"]
    );
    // Neither body: both old fields are asked for.
    assert_eq!(
        refused_fields(call(&gw, Method::PUT, "/plans/gold", Some(json!({}))).await).await,
        ["capacity", "rate"]
    );
}

#[tokio::test]
async fn every_bad_field_of_every_limit_is_named_with_its_place_and_nothing_is_stored() {
    let gw = gateway("").await;

    // Arrange: one body, a different mistake in each limit.
    let body = json!({"limits": [
        {"name": "burst", "capacity": 0, "rate": 1e300},
        {"name": "monthly", "quota": 0, "period": "month", "time_zone": "Mars/Olympus_Mons"},
        {"name": "weekly", "quota": 10, "period": "week"},
        {"name": "odd", "capacity": 5, "rate": 1, "colour": "red"},
        "search",
        {"name": "both", "capacity": 5, "rate": 1, "quota": 10, "period": "day"},
        {"name": "half", "quota": 10},
        {"name": "anchorless", "quota": 10, "period": "month", "anchor_day": 3},
        {"name": "bad name!", "service": "no spaces", "capacity": 1, "rate": 1, "reset": "rolling"},
        {"name": "nulls", "service": null, "capacity": 1, "rate": 1}
    ], "rate": "fast"});

    // Act
    let r = call(&gw, Method::PUT, "/plans/gold", Some(body)).await;

    // Assert: every problem at once, each with its place.
    assert_eq!(
        refused_fields(r).await,
        [
            "limits",
            "limits[0].capacity",
            "limits[0].rate",
            "limits[1].quota",
            "limits[1].time_zone",
            "limits[2].period",
            "limits[3].colour",
            "limits[4]",
            "limits[5].quota",
            "limits[6].period",
            "limits[7].anchor_day",
            "limits[8].name",
            "limits[8].reset",
            "limits[8].service",
            "limits[9].service",
            "rate",
        ]
    );
    assert_eq!(
        call(&gw, Method::GET, "/plans/gold", None).await.status(),
        404,
        "a refused plan was stored"
    );

    // Problems of the whole set are named `limits`.
    let bucket = |name: &str| json!({"name": name, "capacity": 5, "rate": 1});
    let nine: Vec<Value> = (0..9).map(|i| bucket(&format!("l{i}"))).collect();
    let sets = [
        ("two limits of one name", json!([bucket("a"), bucket("a")])),
        ("more than eight", json!(nine)),
        ("none", json!([])),
        (
            "a first limit for one service",
            json!([{"name": "search", "service": "search", "capacity": 5, "rate": 1}, bucket("b")]),
        ),
    ];
    for (what, limits) in sets {
        let r = call(
            &gw,
            Method::PUT,
            "/plans/gold",
            Some(json!({ "limits": limits })),
        )
        .await;
        assert_eq!(refused_fields(r).await, ["limits"], "{what}");
    }
    // A quota with an anchor needs a monthly period; a zone must be a known one.
    let r = call(
        &gw,
        Method::PUT,
        "/plans/gold",
        Some(json!({"limits": [{"name": "m", "quota": 5, "period": "day", "reset": "anchor", "anchor_day": 3}]})),
    )
    .await;
    assert_eq!(refused_fields(r).await, ["limits[0].anchor_day"]);
}

#[tokio::test]
async fn an_override_raises_a_bucket_until_it_expires_and_then_the_plan_holds_again() {
    // Arrange: a plan of 2 tokens that barely refill, a client on it.
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&route_toml("orders", "/orders", &[up.url()])).await;
    let key = client_on(
        &gw,
        "small",
        json!([{"name": "burst", "capacity": 2, "rate": 0.001}]),
    )
    .await;

    // Act: raise the bucket to 5 for the next few seconds.
    let until = unix_s() + 3;
    let r = call(
        &gw,
        Method::PUT,
        "/clients/acme/overrides/burst",
        Some(json!({"capacity": 5, "until": rfc3339(until)})),
    )
    .await;
    assert_eq!(r.status(), 201);
    gw.wait_for_catalog(etag_version(&r)).await;

    // Assert: 5 admitted while it holds, and usage says why.
    assert_eq!(admitted(&gw, "/orders", &key, 6).await, 5);
    let usage = read(&gw, "/clients/acme/usage").await;
    let burst = &usage["limits"][0];
    assert_eq!(burst["capacity"], 5.0, "{usage}");
    assert_eq!(burst["overridden"], true);
    assert_eq!(burst["overridden_until"], json!(rfc3339(until)));

    // Once `until` has passed the plan's 2 hold again, from what was spent: the bucket is
    // not refilled by the change, so the next request waits.
    eventually(Duration::from_secs(5), "the override expires", || async {
        read(&gw, "/clients/acme/usage").await["limits"][0]["overridden"] == false
    })
    .await;
    assert_eq!(admitted(&gw, "/orders", &key, 1).await, 0);
    assert_eq!(
        call(&gw, Method::DELETE, "/clients/acme/bucket", None)
            .await
            .status(),
        204
    );
    assert_eq!(admitted(&gw, "/orders", &key, 3).await, 2);
    let usage = read(&gw, "/clients/acme/usage").await;
    assert_eq!(usage["limits"][0]["capacity"], 2.0);
    assert!(
        usage["limits"][0].get("overridden_until").is_none(),
        "{usage}"
    );
}

#[tokio::test]
async fn a_client_moved_to_another_plan_keeps_what_it_spent_from_a_limit_of_the_same_name() {
    // Arrange: gold holds 10, and 8 of them are spent.
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&route_toml("orders", "/orders", &[up.url()])).await;
    let bucket = json!({"name": "burst", "capacity": 10, "rate": 0.001});
    let key = client_on(&gw, "gold", json!([bucket])).await;
    assert_eq!(admitted(&gw, "/orders", &key, 8).await, 8);

    // Act: silver has a limit of the same name and size (and one more).
    let r = call(
        &gw,
        Method::PUT,
        "/plans/silver",
        Some(json!({"limits": [bucket, {"name": "daily", "quota": 1000, "period": "day"}]})),
    )
    .await;
    assert_eq!(r.status(), 201);
    let moved = call(
        &gw,
        Method::PUT,
        "/clients/acme",
        Some(json!({"plan": "silver"})),
    )
    .await;
    assert_eq!(moved.status(), 200);
    gw.wait_for_catalog(etag_version(&moved)).await;

    // Assert: 2 left, not a fresh 10; the new limit starts whole.
    let usage = read(&gw, "/clients/acme/usage").await;
    assert_eq!(usage["plan"], "silver");
    let left = usage["limits"][0]["remaining"].as_f64().unwrap();
    assert!((left - 2.0).abs() < 0.01, "{usage}");
    assert_eq!(usage["limits"][1]["remaining"], 1000.0);
    assert_eq!(admitted(&gw, "/orders", &key, 4).await, 2);
}

#[tokio::test]
async fn usage_shows_every_limit_with_what_is_left_and_when_it_resets() {
    // Arrange: gold's shape with slow buckets, two services.
    let orders = Upstream::start(Behaviour::Echo).await;
    let search = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&format!(
        "{}{}",
        route_toml("orders", "/orders", &[orders.url()]),
        route_toml("search", "/search", &[search.url()])
    ))
    .await;
    let key = client_on(
        &gw,
        "gold",
        json!([
            {"name": "burst", "capacity": 20, "rate": 0.01},
            {"name": "monthly", "quota": 1000, "period": "month"},
            {"name": "search", "service": "search", "capacity": 5, "rate": 0.01}
        ]),
    )
    .await;

    // Act: 2 requests to orders, 3 to search.
    assert_eq!(admitted(&gw, "/orders", &key, 2).await, 2);
    assert_eq!(admitted(&gw, "/search", &key, 3).await, 3);
    let usage = read(&gw, "/clients/acme/usage").await;

    // Assert: each limit by its policy name, with what is left and when it is whole.
    assert_eq!(
        (&usage["client"], &usage["plan"]),
        (&json!("acme"), &json!("gold"))
    );
    assert_eq!(usage["sharded"], false);
    let at = ms_of(&usage["at"]);
    let limits = usage["limits"].as_array().unwrap();
    let names: Vec<_> = limits
        .iter()
        .map(|l| (l["name"].clone(), l["policy"].clone()))
        .collect();
    assert_eq!(
        names,
        [
            (json!("burst"), json!("gold")),
            (json!("monthly"), json!("gold.monthly")),
            (json!("search"), json!("gold.search"))
        ]
    );
    let close = |v: &Value, want: f64| (v.as_f64().unwrap() - want).abs() < 0.05;

    let burst = &limits[0];
    assert_eq!(burst["kind"], "bucket");
    assert!(close(&burst["remaining"], 15.0), "{burst}");
    // 5 tokens at 0.01/s: whole again in about 500 s.
    let whole_in = ms_of(&burst["resets_at"]) - at;
    assert!((495_000..=500_000).contains(&whole_in), "{burst}");

    let monthly = &limits[1];
    assert_eq!(monthly["kind"], "quota");
    assert_eq!(monthly["used"], 5.0);
    assert_eq!(monthly["remaining"], 995.0);
    assert_eq!(monthly["time_zone"], "UTC");
    // A calendar month in UTC: it starts over at midnight on the 1st of next month.
    let now = jiff::Timestamp::from_millisecond(at)
        .unwrap()
        .to_zoned(jiff::tz::TimeZone::UTC);
    let next_month = now.first_of_month().unwrap().start_of_day().unwrap();
    let next_month = next_month.checked_add(jiff::Span::new().months(1)).unwrap();
    assert_eq!(
        ms_of(&monthly["resets_at"]),
        next_month.timestamp().as_millisecond(),
        "{monthly}"
    );

    let search_limit = &limits[2];
    assert_eq!(search_limit["service"], "search");
    assert!(close(&search_limit["remaining"], 2.0), "{search_limit}");
    assert_eq!(search_limit["overridden"], false);

    // A client sharded by region is told what its levels mean.
    let sharded = call(
        &gw,
        Method::PUT,
        "/clients/acme",
        Some(json!({"plan": "gold", "shards": {"regions": ["eu", "us"]}})),
    )
    .await;
    assert_eq!(sharded.status(), 200);
    let usage = read(&gw, "/clients/acme/usage").await;
    assert_eq!(usage["sharded"], true);
    assert!(usage["note"].as_str().unwrap().contains("shard"), "{usage}");
}

#[tokio::test]
async fn overrides_are_checked_against_the_plan_guarded_by_if_match_kept_and_audited() {
    let gw = gateway("").await;
    client_on(
        &gw,
        "gold",
        json!([
            {"name": "burst", "capacity": 20, "rate": 1},
            {"name": "monthly", "quota": 1000, "period": "month"}
        ]),
    )
    .await;

    // Refused, each naming its field; nothing written.
    let refusals = [
        ("no such limit", "ghost", json!({"capacity": 5}), "limit"),
        (
            "a quota for a bucket",
            "burst",
            json!({"quota": 5}),
            "quota",
        ),
        (
            "a capacity for a quota",
            "monthly",
            json!({"capacity": 5}),
            "capacity",
        ),
        (
            "a capacity out of bounds",
            "burst",
            json!({"capacity": 0}),
            "capacity",
        ),
        ("no value", "burst", json!({}), "limit"),
        (
            "an until past",
            "burst",
            json!({"capacity": 5, "until": "2020-01-01T00:00:00Z"}),
            "until",
        ),
        (
            "an until in unix seconds",
            "burst",
            json!({"capacity": 5, "until": 4102444800u64}),
            "until",
        ),
        (
            "another limit in the body",
            "burst",
            json!({"capacity": 5, "limit": "monthly"}),
            "limit",
        ),
        (
            "an unknown field",
            "burst",
            json!({"capacity": 5, "colour": "red"}),
            "colour",
        ),
    ];
    for (what, limit, body, field) in refusals {
        let r = call(
            &gw,
            Method::PUT,
            &format!("/clients/acme/overrides/{limit}"),
            Some(body),
        )
        .await;
        assert_eq!(refused_fields(r).await, [field], "{what}");
    }
    assert_eq!(
        read(&gw, "/clients/acme/overrides").await,
        json!({"items": []})
    );

    // Created, then replaced; each answer carries the client's new ETag.
    let until = "2099-01-01T00:00:00Z";
    let created = call(
        &gw,
        Method::PUT,
        "/clients/acme/overrides/burst",
        Some(json!({"capacity": 50, "until": "2099-01-01T01:00:00.250+01:00"})),
    )
    .await;
    assert_eq!(created.status(), 201);
    assert_eq!(
        created.headers()["location"],
        "/admin/v1/clients/acme/overrides/burst"
    );
    let etag = created.headers()["etag"].to_str().unwrap().to_string();
    assert_eq!(
        created.json::<Value>().await.unwrap(),
        json!({"limit": "burst", "capacity": 50.0, "until": "2099-01-01T00:00:01Z"})
    );
    let replaced = gw
        .admin(Method::PUT, "/clients/acme/overrides/burst", &rw())
        .header("if-match", &etag)
        .json(&json!({"capacity": 40, "rate": 2, "until": until}))
        .send()
        .await
        .unwrap();
    assert_eq!(replaced.status(), 200);
    // A write at a version the client has left is refused.
    let stale = gw
        .admin(Method::PUT, "/clients/acme/overrides/monthly", &rw())
        .header("if-match", &etag)
        .json(&json!({"quota": 5000}))
        .send()
        .await
        .unwrap();
    assert_eq!(stale.status(), 412);
    let listed = call(&gw, Method::GET, "/clients/acme/overrides", None).await;
    let current_etag = listed.headers()["etag"].to_str().unwrap().to_string();
    let expected = json!([{"limit": "burst", "capacity": 40.0, "rate": 2.0, "until": until}]);
    assert_eq!(listed.json::<Value>().await.unwrap()["items"], expected);
    // What GET lists can be sent back.
    let resent = gw
        .admin(Method::PUT, "/clients/acme/overrides/burst", &rw())
        .header("if-match", &current_etag)
        .json(&expected[0])
        .send()
        .await
        .unwrap();
    assert_eq!(resent.status(), 200);

    // The client shows them read-only, and replacing the client keeps them.
    let client = read(&gw, "/clients/acme").await;
    assert_eq!(client["overrides"], expected);
    assert_eq!(
        call(&gw, Method::PUT, "/clients/acme", Some(client.clone()))
            .await
            .status(),
        200
    );
    assert_eq!(read(&gw, "/clients/acme").await["overrides"], expected);

    // Deleted once; a second time there is nothing to delete.
    let deleted = call(&gw, Method::DELETE, "/clients/acme/overrides/burst", None).await;
    assert_eq!(deleted.status(), 204);
    assert_eq!(
        call(&gw, Method::DELETE, "/clients/acme/overrides/burst", None)
            .await
            .status(),
        404
    );
    assert_eq!(
        call(&gw, Method::GET, "/clients/nobody/overrides", None)
            .await
            .status(),
        404
    );

    // Audited with who did it and the overrides before and after.
    let audit = read(&gw, "/audit?limit=10").await;
    let items = audit["items"].as_array().unwrap();
    let actions: Vec<&str> = items[..5]
        .iter()
        .map(|e| e["action"].as_str().unwrap())
        .collect();
    assert_eq!(
        actions,
        [
            "override.delete",
            "client.put",
            "override.put",
            "override.put",
            "override.put"
        ]
    );
    assert_eq!(items[0]["actor"], "alice");
    assert_eq!(items[0]["kind"], "client");
    assert_eq!(items[0]["before"]["overrides"][0]["capacity"], 40.0);
    assert!(items[0]["after"].get("overrides").is_none(), "{}", items[0]);
    assert!(
        items[4]["before"].get("overrides").is_none(),
        "{}",
        items[4]
    );
    assert_eq!(items[4]["after"]["overrides"][0]["capacity"], 50.0);
}

#[tokio::test]
async fn on_redis_any_gateway_reads_the_usage_and_writes_the_overrides_of_another() {
    // Arrange: two gateways on one Redis; a client spends on the first.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "[redis]\nurl = \"{}\"\ntimeout_ms = 2000\n{}",
        redis.url(),
        route_toml("orders", "/orders", &[up.url()])
    );
    let a = gateway(&toml).await;
    let b = gateway(&toml).await;
    let key = client_on(
        &a,
        "gold",
        json!([
            {"name": "burst", "capacity": 3, "rate": 0.001},
            {"name": "daily", "quota": 100, "period": "day", "time_zone": "Asia/Kolkata"}
        ]),
    )
    .await;
    assert_eq!(admitted(&a, "/orders", &key, 4).await, 3);

    // Act + Assert: the other gateway sees what was spent.
    let usage = read(&b, "/clients/acme/usage").await;
    assert!(
        usage["limits"][0]["remaining"].as_f64().unwrap().abs() < 0.01,
        "{usage}"
    );
    assert_eq!(usage["limits"][1]["used"], 3.0);
    // Kolkata is UTC+5:30: its day ends at 18:30 UTC.
    assert!(
        usage["limits"][1]["resets_at"]
            .as_str()
            .unwrap()
            .ends_with("T18:30:00Z"),
        "{usage}"
    );

    // An override written on the other gateway is in force on the first: a raise to 6 is
    // not a refill (what was spent stays spent), and a full bucket then holds 6.
    let r = call(
        &b,
        Method::PUT,
        "/clients/acme/overrides/burst",
        Some(json!({"capacity": 6})),
    )
    .await;
    assert_eq!(r.status(), 201);
    a.wait_for_catalog(etag_version(&r)).await;
    assert_eq!(admitted(&a, "/orders", &key, 1).await, 0);
    let used_before = read(&a, "/clients/acme/usage").await["limits"][1]["used"]
        .as_f64()
        .unwrap();
    assert!(used_before > 0.0);
    // A refill fills the buckets and keeps the quota's count: it is not a free day.
    assert_eq!(
        call(&b, Method::DELETE, "/clients/acme/bucket", None)
            .await
            .status(),
        204
    );
    assert_eq!(admitted(&a, "/orders", &key, 7).await, 6);
    let usage = read(&a, "/clients/acme/usage").await;
    assert_eq!(usage["limits"][1]["used"], used_before + 6.0, "{usage}");
    assert_eq!(usage["limits"][0]["overridden"], true);
    assert_eq!(usage["limits"][0]["capacity"], 6.0);
    // The catalog script wrote the override's audit entry with it.
    let audit = read(&a, "/audit?limit=2").await;
    assert_eq!(audit["items"][1]["action"], "override.put");
    assert_eq!(audit["items"][1]["actor"], "alice");
}
