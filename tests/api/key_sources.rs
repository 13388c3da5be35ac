//! Keys from a header, `Authorization: Bearer` or a query parameter, in the configured
//! order: whichever carried the key is taken out of what is forwarded, a key in two
//! places is refused before anything is spent, and a key in the query never reaches the
//! service or the gateway's logs and traces.

use std::time::Duration;

use crate::helpers::*;

const ALL: &str = "[server]\napi_key_sources = [\"header\", \"bearer\", \"query\"]\n";

fn catalog() -> String {
    catalog_toml(("gold", 1000.0, 1000.0), &["acme"])
}

async fn gateway(up: &Upstream, extra: &str) -> TestGateway {
    TestGateway::spawn(settings(&format!(
        "{extra}{}{}",
        catalog(),
        route_toml("orders", "/orders", &[up.url()])
    )))
    .await
}

#[tokio::test]
async fn a_bearer_key_admits_and_is_not_forwarded() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&up, ALL).await;

    let r = gw
        .http
        .get(format!("{}/orders", gw.address))
        .bearer_auth(key("acme"))
        .send()
        .await
        .unwrap();

    assert_eq!(r.status(), 200);
    assert_eq!(RateLimit::of(&r).policy, "gold");
    let seen = &up.seen()[0];
    assert_eq!(seen.headers["x-client-id"], "acme");
    assert!(!seen.headers.contains_key("authorization"), "{seen:?}");
}

#[tokio::test]
async fn another_authorization_scheme_is_not_a_key_and_is_forwarded_untouched() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&up, ALL).await;

    let r = gw
        .http
        .get(format!("{}/orders", gw.address))
        .header("x-api-key", key("acme"))
        .header("authorization", "Basic dXNlcjpwYXNz")
        .send()
        .await
        .unwrap();

    assert_eq!(r.status(), 200);
    assert_eq!(up.seen()[0].headers["authorization"], "Basic dXNlcjpwYXNz");
}

#[tokio::test]
async fn without_the_bearer_source_authorization_is_the_services_own() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&up, "").await;

    let bearer_only = gw
        .http
        .get(format!("{}/orders", gw.address))
        .bearer_auth(key("acme"))
        .send()
        .await
        .unwrap();
    assert_eq!(bearer_only.status(), 401);
    let body: serde_json::Value = bearer_only.json().await.unwrap();
    assert_eq!(
        body["detail"],
        "a valid API key is required in the x-api-key header"
    );

    let r = gw
        .http
        .get(format!("{}/orders", gw.address))
        .header("x-api-key", key("acme"))
        .bearer_auth("the-services-own-token")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        up.seen()[0].headers["authorization"],
        "Bearer the-services-own-token"
    );
}

#[tokio::test]
async fn a_query_key_is_taken_out_of_the_forwarded_uri_and_nothing_else_changes() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&up, ALL).await;
    let k = key("acme");

    for (query, forwarded) in [
        (format!("a=%2F&api_key={k}&b=1+2"), "/orders/7?a=%2F&b=1+2"),
        (format!("api_key={k}"), "/orders/7"),
        (format!("api_key={k}&z="), "/orders/7?z="),
        // Percent-encoded, the name too.
        (format!("api%5Fkey={}", k.replace('-', "%2D")), "/orders/7"),
    ] {
        let r = gw.get(&format!("/orders/7?{query}"), None).await;
        assert_eq!(r.status(), 200, "{query}");
        assert_eq!(up.seen().last().unwrap().path, forwarded, "{query}");
    }
    // A path rewritten to its normal form, and its query key taken out.
    let r = gw
        .get(&format!("/orders//7/./?x=1&api_key={k}"), None)
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(up.seen().last().unwrap().path, "/orders/7/?x=1");
}

#[tokio::test]
async fn a_key_in_two_places_is_refused_before_anything_is_spent() {
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&up, &format!("{ALL}{}", redis_toml(&redis))).await;
    let k = key("acme");

    let header_and_query = gw.get(&format!("/orders?api_key={k}"), Some(&k)).await;
    let header_and_bearer = gw
        .http
        .get(format!("{}/orders", gw.address))
        .header("x-api-key", &k)
        .bearer_auth(&k)
        .send()
        .await
        .unwrap();
    let query_twice = gw
        .get(&format!("/orders?api_key={k}&api_key={k}"), None)
        .await;

    for (r, says) in [
        (header_and_query, "in a header and in the query"),
        (header_and_bearer, "in a header and as a Bearer token"),
        (query_twice, "more than once"),
    ] {
        assert_eq!(r.status(), 400);
        let body: serde_json::Value = r.json().await.unwrap();
        assert!(body["detail"].as_str().unwrap().contains(says), "{body}");
    }
    assert_eq!(up.hits(), 0);
    assert!(stored(&redis, "acme", "").is_none(), "nothing was spent");
}

#[tokio::test]
async fn a_query_key_never_reaches_the_service_the_log_or_a_trace() {
    // Arrange: a gateway process logging everything (every crate at trace, as JSON) and
    // exporting its traces; a plan of 3 so that a 429 comes too.
    let collector = Collector::start().await;
    let up = Upstream::start(Behaviour::Echo).await;
    let dead = free_port().unwrap();
    let toml = format!(
        "[telemetry]\notlp_endpoint = \"{}\"\n{}{}{}",
        collector.url(),
        catalog_toml(("small", 3.0, 0.001), &["acme"]),
        route_toml("orders", "/orders", &[up.url()]),
        route_toml("gone", "/gone", &[format!("http://127.0.0.1:{dead}")]),
    );
    let gw = gateway_process(
        &toml,
        &[
            ("RUST_LOG", "trace"),
            ("TOLLGATE_LOG_FORMAT", "json"),
            ("TOLLGATE__SERVER__API_KEY_SOURCES", "header,bearer,query"),
        ],
    );
    let http = reqwest::Client::new();
    let k = key("acme");
    let secret = "tg_never_logged_0123456789";

    // Act: the key in the query on a 200, a 502, a 429, an unknown key's 401, and a 400
    // (two places).
    let mut statuses = Vec::new();
    for (path, header) in [
        (format!("/orders/1?api_key={k}&q=1"), None),
        (format!("/gone?api_key={k}"), None),
        (format!("/orders/2?api_key={k}"), None),
        (format!("/orders/3?api_key={k}"), None),
        (format!("/orders?api_key={secret}"), None),
        (format!("/orders?api_key={secret}"), Some(secret)),
    ] {
        let mut req = http.get(format!("{}{path}", gw.address));
        if let Some(h) = header {
            req = req.header("x-api-key", h);
        }
        statuses.push(req.send().await.unwrap().status().as_u16());
    }
    assert_eq!(statuses, [200, 502, 200, 429, 401, 400]);

    // Assert: neither key, nor its encoded form, anywhere.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let log = std::fs::read_to_string(gw.dir().join("gateway.log")).unwrap();
    let err = std::fs::read_to_string(gw.dir().join("gateway.err")).unwrap();
    assert!(log.lines().count() > 50, "the trace log was written: {log}");
    let traces = collector.bodies().join("\n");
    assert!(!traces.is_empty(), "spans were exported");
    for needle in [k.as_str(), secret, "api_key="] {
        assert!(!log.contains(needle), "{needle} in the log");
        assert!(!err.contains(needle), "{needle} in stderr");
        assert!(!traces.contains(needle), "{needle} in a trace");
        for seen in up.seen() {
            assert!(!seen.path.contains(needle), "{needle} reached the service");
            assert!(
                seen.headers.values().all(|v| !v.contains(needle)),
                "{needle} in a header the service got"
            );
        }
    }
}
