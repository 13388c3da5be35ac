//! Forwarding: headers, bodies, and upstream failures.

use std::time::Duration;

use crate::helpers::*;

async fn gateway_to(upstreams: &[String], extra: &str) -> TestGateway {
    let toml = format!(
        "{}{}{extra}",
        catalog_toml(("gold", 1000.0, 100.0), &["acme"]),
        route_toml("orders", "/orders", upstreams),
    );
    TestGateway::spawn(settings(&toml)).await
}

#[tokio::test]
async fn an_admitted_request_reaches_the_service_with_its_identity_and_without_the_key() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway_to(&[up.url()], "").await;

    let r = gw
        .http
        .get(format!("{}/orders/7?x=1", gw.address))
        .header("x-api-key", key("acme"))
        .header("x-request-id", "req-abc-123")
        .header("x-forwarded-for", "6.6.6.6")
        .header("connection", "x-hop")
        .header("x-hop", "secret")
        .header("x-custom", "kept")
        .send()
        .await
        .unwrap();

    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-request-id"], "req-abc-123");
    let seen = &up.seen()[0];
    assert_eq!(seen.path, "/orders/7?x=1");
    let h = &seen.headers;
    assert!(
        !h.contains_key("x-api-key"),
        "the API key must not be forwarded"
    );
    assert_eq!(h["x-client-id"], "acme");
    assert_eq!(h["x-request-id"], "req-abc-123");
    // The peer is not a trusted proxy, so its X-Forwarded-For claim is replaced.
    assert_eq!(h["x-forwarded-for"], "127.0.0.1");
    assert_eq!(h["x-forwarded-proto"], "http");
    assert!(h["forwarded"].starts_with("for=127.0.0.1;proto=http"));
    // The service is asked by its own name; the client's host goes in X-Forwarded-Host.
    assert_eq!(h["host"], up.url().trim_start_matches("http://"));
    assert_eq!(
        h["x-forwarded-host"],
        gw.address.trim_start_matches("http://")
    );
    assert!(
        !h.contains_key("x-hop"),
        "connection-listed headers are hop-by-hop"
    );
    assert_eq!(h["x-custom"], "kept");
}

#[tokio::test]
async fn a_trusted_proxy_chain_is_extended() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway_to(
        &[up.url()],
        "[server]\ntrusted_proxies = [\"127.0.0.0/8\"]\n",
    )
    .await;
    gw.http
        .get(format!("{}/orders", gw.address))
        .header("x-api-key", key("acme"))
        .header("x-forwarded-for", "203.0.113.9")
        .send()
        .await
        .unwrap();
    let h = &up.seen()[0].headers;
    assert_eq!(h["x-forwarded-for"], "203.0.113.9, 127.0.0.1");
    assert!(h["forwarded"].starts_with("for=203.0.113.9"));
}

#[tokio::test]
async fn a_client_cannot_spoof_its_address_past_a_hop_the_proxy_wrote_with_a_port() {
    // A trusted proxy wrote its client as `203.0.113.9:5678` after what the client sent.
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway_to(
        &[up.url()],
        "[server]\ntrusted_proxies = [\"127.0.0.0/8\"]\n",
    )
    .await;
    for (xff, client) in [
        ("6.6.6.6, 203.0.113.9:5678", "203.0.113.9"),
        ("6.6.6.6, unknown", "127.0.0.1"),
        ("6.6.6.6, [2001:db8::9]:443", "\"[2001:db8::9]\""),
        ("::ffff:203.0.113.7", "203.0.113.7"),
    ] {
        gw.http
            .get(format!("{}/orders", gw.address))
            .header("x-api-key", key("acme"))
            .header("x-forwarded-for", xff)
            .send()
            .await
            .unwrap();
        let seen = up.seen();
        let forwarded = seen.last().unwrap().headers["forwarded"].clone();
        assert!(
            forwarded.starts_with(&format!("for={client};")),
            "{xff}: {forwarded}"
        );
    }
}

#[tokio::test]
async fn a_missing_request_id_is_generated() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway_to(&[up.url()], "").await;
    let r = gw.get("/orders", Some(&key("acme"))).await;
    let id = r.headers()["x-request-id"].to_str().unwrap().to_string();
    assert_eq!(id.len(), 36);
    assert_eq!(up.seen()[0].headers["x-request-id"], id);
}

#[tokio::test]
async fn a_one_mebibyte_body_is_forwarded_intact_both_ways() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway_to(&[up.url()], "").await;
    let body: Vec<u8> = (0..(1 << 20)).map(|i| (i % 251) as u8).collect();

    let r = gw
        .http
        .post(format!("{}/orders", gw.address))
        .header("x-api-key", key("acme"))
        .body(body.clone())
        .send()
        .await
        .unwrap();

    assert_eq!(r.status(), 200);
    assert_eq!(up.seen()[0].body_len, body.len());
    assert_eq!(r.bytes().await.unwrap().as_ref(), &body[..]);
}

#[tokio::test]
async fn a_streamed_body_is_forwarded_intact() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway_to(&[up.url()], "").await;
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
        (0..64).map(|i| Ok(vec![i as u8; 4096])).collect();
    let r = gw
        .http
        .post(format!("{}/orders", gw.address))
        .header("x-api-key", key("acme"))
        .body(reqwest::Body::wrap_stream(futures_util::stream::iter(
            chunks,
        )))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.bytes().await.unwrap().len(), 64 * 4096);
}

#[tokio::test]
async fn a_body_over_the_limit_gets_413_and_spends_nothing() {
    // Arrange: a plan of one token, so spending even one shows.
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "[server]\nmax_body_bytes = 1000\n{}{}",
        catalog_toml(("one", 1.0, 0.001), &["acme"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;

    // Act: three bodies one byte over the limit.
    for _ in 0..3 {
        let r = gw
            .http
            .post(format!("{}/orders", gw.address))
            .header("x-api-key", key("acme"))
            .body(vec![0u8; 1001])
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 413);
        assert_eq!(r.headers()["content-type"], "application/problem+json");
    }
    assert_eq!(up.hits(), 0);

    // Assert: the one token is still there, and it is the only one.
    let r = gw.get("/orders", Some(&key("acme"))).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["ratelimit"], "\"one\";r=0;t=1000");
    assert_eq!(gw.get("/orders", Some(&key("acme"))).await.status(), 429);
}

#[tokio::test]
async fn an_unreachable_upstream_gets_502() {
    let dead = format!("http://127.0.0.1:{}", free_port().unwrap());
    let gw = gateway_to(&[dead], "").await;
    let r = gw.get("/orders", Some(&key("acme"))).await;
    assert_eq!(r.status(), 502);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
}

#[tokio::test]
async fn a_slow_upstream_gets_504() {
    let up = Upstream::start(Behaviour::Slow(Duration::from_secs(3))).await;
    let toml = format!(
        "{}[[routes]]\nservice = \"orders\"\nprefix = \"/orders\"\nupstreams = [{:?}]\ntimeout_ms = 200\n",
        catalog_toml(("gold", 10.0, 1.0), &["acme"]),
        up.url()
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    let started = std::time::Instant::now();
    let r = gw.get("/orders", Some(&key("acme"))).await;
    assert_eq!(r.status(), 504);
    assert!(started.elapsed() < Duration::from_secs(2));
}

#[tokio::test]
async fn no_route_gets_404_before_a_token_is_spent() {
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}{}",
        catalog_toml(("gold", 1.0, 0.001), &["acme"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    for _ in 0..3 {
        assert_eq!(gw.get("/nowhere", Some(&key("acme"))).await.status(), 404);
    }
    // The single token is still there.
    assert_eq!(gw.get("/orders", Some(&key("acme"))).await.status(), 200);
}

#[tokio::test]
async fn replicas_share_the_load() {
    let a = Upstream::start(Behaviour::Echo).await;
    let b = Upstream::start(Behaviour::Echo).await;
    let gw = gateway_to(&[a.url(), b.url()], "").await;
    for _ in 0..40 {
        assert_eq!(gw.get("/orders", Some(&key("acme"))).await.status(), 200);
    }
    // Least-request picks the less busy of two at random: both serve, neither all.
    assert!(
        a.hits() > 0 && b.hits() > 0,
        "{} and {}",
        a.hits(),
        b.hits()
    );
    assert_eq!(a.hits() + b.hits(), 40);
}
