//! Rolling out: a canary enforced while everyone else is in shadow mode, and the shadow
//! report an operator decides by (`GET /admin/v1/shadow`), summed over every gateway.

use std::time::Duration;

use futures_util::future::join_all;
use reqwest::Method;
use serde_json::{json, Value};

use crate::helpers::*;

fn token() -> String {
    admin_token("ops", "admin:read admin:write")
}

/// Redis with a generous decision budget (these tests are about decisions, not about
/// failing open), shadow mode by default, shadow counts flushed every 50 ms and catalog
/// changes mirrored within 100 ms.
fn shadow_toml(redis: &RedisServer) -> String {
    format!(
        "{}[redis]\nurl = \"{}\"\ntimeout_ms = 2000\n[catalog]\nrefresh_ms = 100\n[limits]\ndefault_mode = \"shadow\"\n[periods]\nshadow_flush_ms = 50\n",
        admin_toml(),
        redis.url()
    )
}

async fn report(gw: &TestGateway) -> Value {
    let r = gw
        .admin(Method::GET, "/shadow", &token())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

/// Waits until the report has counted `compared` comparisons, and returns it.
async fn report_of(gw: &TestGateway, compared: u64) -> Value {
    eventually(
        Duration::from_secs(5),
        &format!("{compared} comparisons flushed"),
        || async { report(gw).await["compared"] == compared },
    )
    .await;
    report(gw).await
}

/// `n` requests of `client` to `path`, 50 at a time; their statuses.
async fn send(gw: &TestGateway, path: &str, client: &str, n: usize) -> Vec<u16> {
    let k = key(client);
    let mut statuses = Vec::new();
    for chunk in (0..n).collect::<Vec<_>>().chunks(50) {
        let answers = join_all(chunk.iter().map(|_| gw.get(path, Some(&k)))).await;
        statuses.extend(answers.iter().map(|r| r.status().as_u16()));
    }
    statuses
}

#[tokio::test]
async fn in_a_shadow_rollout_only_the_canary_client_set_to_enforce_is_limited() {
    // Arrange: shadow mode by default; two clients on a plan of 3; the canary is set to
    // enforce through the admin API, as the README's rollout step 1 says.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}{}{}",
        shadow_toml(&redis),
        catalog_toml(("three", 3.0, 0.001), &["canary", "others"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    let r = gw
        .admin(Method::PUT, "/clients/canary", &token())
        .json(&json!({"plan": "three", "mode": "enforce"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    gw.wait_for_catalog(etag_version(&r)).await;

    // Act: six requests each, one at a time.
    let mut canary = Vec::new();
    let mut others = Vec::new();
    for _ in 0..6 {
        canary.push(gw.get("/orders", Some(&key("canary"))).await);
        others.push(gw.get("/orders", Some(&key("others"))).await);
    }

    // Assert: the canary is limited at the edge: its plan, then 429s that never reach the
    // service.
    let statuses =
        |rs: &[reqwest::Response]| -> Vec<u16> { rs.iter().map(|r| r.status().as_u16()).collect() };
    assert_eq!(
        statuses(&canary),
        vec![200, 200, 200, 429, 429, 429],
        "the canary"
    );
    assert!(canary[3].headers().contains_key("retry-after"));
    // The other client is decided (it has a token count) but forwarded past its plan.
    assert_eq!(statuses(&others), vec![200; 6], "a client in shadow mode");
    assert_eq!(others[5].headers()["ratelimit"], "\"three\";r=0;t=3000");
    assert_eq!(up.hits(), 3 + 6);
    for (outcome, n) in [("denied", 3.0), ("shadow_denied", 3.0), ("allowed", 6.0)] {
        let series = format!("tollgate_decisions_total{{outcome=\"{outcome}\"}}");
        assert_eq!(gw.metric(&series).await, Some(n), "{series}");
    }
}

#[tokio::test]
async fn a_service_refusing_what_the_gateway_admitted_is_a_disagreement_and_the_report_lists_the_most_disagreeing_first(
) {
    // Arrange: three shadow clients on a plan of 10, each calling a service whose own
    // limiter is stricter than the gateway (2 and 5) or the same (10). Their ids sort the
    // other way round from their disagreements.
    let redis = RedisServer::start().unwrap();
    let two = Upstream::start(Behaviour::Limit(2)).await;
    let five = Upstream::start(Behaviour::Limit(5)).await;
    let ten = Upstream::start(Behaviour::Limit(10)).await;
    let toml = format!(
        "{}{}{}{}{}",
        shadow_toml(&redis),
        catalog_toml(("ten", 10.0, 0.001), &["a-agrees", "m-some", "z-most"]),
        route_toml("two", "/two", &[two.url()]),
        route_toml("five", "/five", &[five.url()]),
        route_toml("ten", "/ten", &[ten.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;

    // Act: ten requests each, within the gateway's limit.
    let most = send(&gw, "/two", "z-most", 10).await;
    let some = send(&gw, "/five", "m-some", 10).await;
    let agrees = send(&gw, "/ten", "a-agrees", 10).await;

    // Assert: the services refused what they refused (the gateway forwards everything)...
    assert_eq!(most.iter().filter(|s| **s == 429).count(), 8);
    assert_eq!(some.iter().filter(|s| **s == 429).count(), 5);
    assert_eq!(agrees, vec![200; 10]);
    // ...each such refusal of a request the gateway admitted is a disagreement...
    let report = report_of(&gw, 30).await;
    assert_eq!(report["disagreements"], 13, "{report}");
    assert_eq!(report["ready_to_enforce"], false, "{report}");
    // ...and the clients come most disagreeing first.
    let clients: Vec<(String, u64, u64)> = report["clients"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["id"].as_str().unwrap().to_string(),
                c["compared"].as_u64().unwrap(),
                c["disagreements"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        clients,
        [
            ("z-most".to_string(), 10, 8),
            ("m-some".to_string(), 10, 5),
            ("a-agrees".to_string(), 10, 0),
        ],
        "{report}"
    );
    assert_eq!(report["clients"][0]["rate"], 0.8);
    // This gateway's own counters: the gateway admitted all 30, the services refused 13.
    let compared = |gateway: &str, service: &str| {
        format!("tollgate_shadow_comparisons_total{{gateway=\"{gateway}\",service=\"{service}\"}}")
    };
    assert_eq!(gw.metric(&compared("allow", "deny")).await, Some(13.0));
    assert_eq!(gw.metric(&compared("allow", "allow")).await, Some(17.0));
}

#[tokio::test]
async fn ready_to_enforce_needs_something_compared_and_fewer_than_one_disagreement_in_a_thousand() {
    // Arrange: shadow clients with room to spare at the gateway; the service refuses a
    // client's 1000th request (its limiter admits 999).
    let redis = RedisServer::start().unwrap();
    let service = Upstream::start(Behaviour::Limit(999)).await;
    let toml = format!(
        "{}{}{}",
        shadow_toml(&redis),
        catalog_toml(("big", 10_000.0, 1.0), &["busy", "quiet", "late"]),
        route_toml("orders", "/orders", &[service.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;

    // Nothing compared: nothing to judge by.
    let nothing = report(&gw).await;
    assert_eq!(nothing["compared"], 0, "{nothing}");
    assert_eq!(nothing["ready_to_enforce"], false, "{nothing}");

    // No disagreement in 5 comparisons: ready.
    send(&gw, "/orders", "quiet", 5).await;
    let agreed = report_of(&gw, 5).await;
    assert_eq!(agreed["disagreements"], 0, "{agreed}");
    assert_eq!(agreed["ready_to_enforce"], true, "{agreed}");

    // One disagreement in exactly 1000 comparisons: a rate of 0.001 is not below it.
    let r = gw
        .admin(Method::DELETE, "/shadow", &token())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    let statuses = send(&gw, "/orders", "busy", 1000).await;
    assert_eq!(statuses.iter().filter(|s| **s == 429).count(), 1);
    let at = report_of(&gw, 1000).await;
    assert_eq!(at["disagreements"], 1, "{at}");
    assert_eq!(at["rate"], 0.001, "{at}");
    assert_eq!(at["ready_to_enforce"], false, "{at}");

    // One more agreeing comparison: 1 in 1001 is below it.
    send(&gw, "/orders", "late", 1).await;
    let below = report_of(&gw, 1001).await;
    assert_eq!(below["disagreements"], 1, "{below}");
    assert_eq!(below["ready_to_enforce"], true, "{below}");
}
