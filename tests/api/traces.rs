//! Traces: W3C Trace Context carried through the gateway into the service, and the spans
//! exported over OTLP/HTTP to a real (small) collector: JSON by default, protobuf, gzip,
//! headers and https as configured.

use crate::helpers::*;

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT: &str = "00f067aa0ba902b7";

fn traceparent() -> String {
    format!("00-{TRACE}-{PARENT}-01")
}

/// `(trace-id, parent-id, flags)` of a `traceparent` the service received, checked to be a
/// well-formed version 00 value.
fn parts(tp: &str) -> (String, String, String) {
    let fields: Vec<&str> = tp.split('-').collect();
    assert_eq!(fields.len(), 4, "{tp:?}");
    assert_eq!(fields[0], "00", "{tp:?}");
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    assert!(hex(fields[1], 32) && fields[1] != "0".repeat(32), "{tp:?}");
    assert!(hex(fields[2], 16) && fields[2] != "0".repeat(16), "{tp:?}");
    (fields[1].into(), fields[2].into(), fields[3].into())
}

async fn gateway(up: &Upstream, capacity: f64, extra: &str) -> TestGateway {
    let toml = format!(
        "{}{}{extra}",
        catalog_toml(("gold", capacity, 1.0), &["acme"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    TestGateway::spawn(settings(&toml)).await
}

fn exporting_to(url: &str) -> String {
    format!("[telemetry]\notlp_endpoint = \"{url}\"\n")
}

fn span<'a>(spans: &'a [ExportedSpan], name: &str) -> &'a ExportedSpan {
    spans
        .iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("no {name:?} span in {spans:#?}"))
}

#[tokio::test]
async fn a_callers_trace_continues_through_the_gateway_into_the_service() {
    let collector = Collector::start().await;
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&up, 100.0, &exporting_to(&collector.url())).await;

    let r = traced(
        &gw,
        "/orders/7",
        Some(&traceparent()),
        Some("vendor=abc,other=1"),
    )
    .await;
    assert_eq!(r.status(), 200);

    let seen = &up.seen()[0].headers;
    let (trace, parent, flags) = parts(&seen["traceparent"]);
    assert_eq!(trace, TRACE, "the service continues the caller's trace");
    assert_eq!(flags, "01", "the sampled flag is kept");
    assert_eq!(seen["tracestate"], "vendor=abc,other=1");

    let spans = collector.trace(TRACE, 3).await;
    assert_eq!(spans.len(), 3, "{spans:#?}");
    let request = span(&spans, "GET /orders");
    let decision = span(&spans, "decision");
    let upstream = span(&spans, "upstream");
    assert_eq!(
        request.parent_id, PARENT,
        "the request span is the caller's child"
    );
    assert_eq!(request.kind, 2, "server");
    assert_eq!(decision.parent_id, request.span_id);
    assert_eq!(upstream.parent_id, request.span_id);
    assert_eq!(upstream.kind, 3, "client");
    assert_eq!(
        parent, upstream.span_id,
        "the service's parent is the gateway's upstream span"
    );
    assert_eq!(request.attributes["http.request.method"], "GET");
    assert_eq!(request.attributes["http.route"], "/orders");
    assert_eq!(request.attributes["http.response.status_code"], "200");
    assert_eq!(request.attributes["tollgate.status_class"], "2xx");
    assert_eq!(request.attributes["tollgate.service"], "orders");
    assert_eq!(request.attributes["tollgate.client_id"], "acme");
    assert_eq!(decision.attributes["tollgate.outcome"], "allowed");
    assert!(!decision
        .attributes
        .contains_key("tollgate.fail_open_reason"));
    assert!(
        !decision.attributes.contains_key("tollgate.batch_size"),
        "the embedded store makes no call"
    );
    assert_eq!(upstream.attributes["http.response.status_code"], "200");
    assert!(
        collector.bodies().iter().all(|b| !b.contains(&key("acme"))),
        "API keys are never exported"
    );
}

#[tokio::test]
async fn a_request_without_a_traceparent_starts_a_trace_the_service_sees() {
    let collector = Collector::start().await;
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&up, 100.0, &exporting_to(&collector.url())).await;

    assert_eq!(gw.get("/orders/1", Some(&key("acme"))).await.status(), 200);
    assert_eq!(gw.get("/orders/2", Some(&key("acme"))).await.status(), 200);

    let seen = up.seen();
    let (first, parent, flags) = parts(&seen[0].headers["traceparent"]);
    let (second, _, _) = parts(&seen[1].headers["traceparent"]);
    assert_ne!(first, second, "each request starts its own trace");
    assert_eq!(flags, "01");
    assert!(!seen[0].headers.contains_key("tracestate"));
    let spans = collector.trace(&first, 3).await;
    let request = span(&spans, "GET /orders");
    assert_eq!(
        request.parent_id, "",
        "the gateway's request span is the root"
    );
    assert_eq!(span(&spans, "upstream").span_id, parent);
}

#[tokio::test]
async fn a_malformed_traceparent_is_never_forwarded_and_a_new_trace_starts() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&up, 100.0, "").await;
    let malformed = [
        format!("00-{}-{PARENT}-01", TRACE.to_uppercase()),
        format!("00-{}-{PARENT}-01", "0".repeat(32)),
        format!("00-{TRACE}-{}-01", "0".repeat(16)),
        format!("00-{TRACE}-{PARENT}-01-extra"),
        format!("ff-{TRACE}-{PARENT}-01"),
        format!("00-{TRACE}-{PARENT}"),
        format!("00-{TRACE}x{PARENT}-01"),
    ];

    for bad in &malformed {
        let r = traced(&gw, "/orders/1", Some(bad), Some("vendor=abc")).await;
        assert_eq!(r.status(), 200);
        let seen = up.seen().pop().unwrap().headers;
        let (trace, parent, _) = parts(&seen["traceparent"]);
        assert_ne!(&seen["traceparent"], bad);
        assert_ne!(
            trace, TRACE,
            "{bad:?}: a new trace, not the malformed one's"
        );
        assert_ne!(trace, TRACE.to_uppercase());
        assert_ne!(parent, PARENT);
        assert!(
            !seen.contains_key("tracestate"),
            "{bad:?}: a tracestate without a valid traceparent is not passed on"
        );
    }
}

#[tokio::test]
async fn with_export_off_nothing_is_exported_and_the_trace_still_reaches_the_service() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&up, 100.0, "").await;

    let r = traced(&gw, "/orders/7", Some(&traceparent()), Some("vendor=abc")).await;
    assert_eq!(r.status(), 200);

    let seen = &up.seen()[0].headers;
    let (trace, parent, flags) = parts(&seen["traceparent"]);
    assert_eq!((trace.as_str(), flags.as_str()), (TRACE, "01"));
    assert_ne!(
        parent, PARENT,
        "the gateway is a hop: the parent is its own span"
    );
    assert_eq!(seen["tracestate"], "vendor=abc");
    assert_eq!(
        gw.metric("tollgate_trace_spans_exported_total").await,
        None,
        "no exporter runs when telemetry.otlp_endpoint is empty"
    );
}

#[tokio::test]
async fn a_tracestate_passes_unchanged_and_an_oversized_one_is_dropped() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&up, 100.0, "").await;
    let send = |state: String| {
        gw.http
            .get(format!("{}/orders/1", gw.address))
            .header("x-api-key", key("acme"))
            .header("traceparent", traceparent())
            .header("tracestate", state)
            .send()
    };

    let fits = format!("congo=t61rcWkgMzE,rojo={}", "a".repeat(512 - 23));
    assert_eq!(fits.len(), 512);
    assert_eq!(send(fits.clone()).await.unwrap().status(), 200);
    assert_eq!(up.seen().pop().unwrap().headers["tracestate"], fits);

    let oversized = format!("{fits}b");
    assert_eq!(send(oversized).await.unwrap().status(), 200);
    let seen = up.seen().pop().unwrap().headers;
    assert!(
        !seen.contains_key("tracestate"),
        "513 characters are dropped"
    );
    assert_eq!(
        parts(&seen["traceparent"]).0,
        TRACE,
        "the trace still continues"
    );
}

#[tokio::test]
async fn a_refused_request_exports_its_spans_and_reaches_no_service() {
    let collector = Collector::start().await;
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&up, 1.0, &exporting_to(&collector.url())).await;
    assert_eq!(gw.get("/orders/1", Some(&key("acme"))).await.status(), 200);

    let r = traced(&gw, "/orders/2", Some(&traceparent()), None).await;
    assert_eq!(r.status(), 429);
    assert_eq!(
        up.hits(),
        1,
        "the refused request never reaches the service"
    );

    let spans = collector.trace(TRACE, 2).await;
    let request = span(&spans, "GET /orders");
    let decision = span(&spans, "decision");
    assert_eq!(request.parent_id, PARENT);
    assert_eq!(request.attributes["http.response.status_code"], "429");
    assert_eq!(request.attributes["tollgate.status_class"], "4xx");
    assert_eq!(decision.parent_id, request.span_id);
    assert_eq!(decision.attributes["tollgate.outcome"], "denied");
    assert!(
        spans.iter().all(|s| s.name != "upstream"),
        "no upstream span: {spans:#?}"
    );
}

#[tokio::test]
async fn a_decision_that_failed_open_says_why() {
    let collector = Collector::start().await;
    let up = Upstream::start(Behaviour::Echo).await;
    let dead_redis = format!(
        "[redis]\nurl = \"redis://127.0.0.1:{}\"\n{}",
        free_port().unwrap(),
        exporting_to(&collector.url())
    );
    let gw = gateway(&up, 100.0, &dead_redis).await;

    let r = traced(&gw, "/orders/1", Some(&traceparent()), None).await;
    assert_eq!(r.status(), 200, "the gateway fails open");

    let spans = collector.trace(TRACE, 3).await;
    let decision = span(&spans, "decision");
    assert_eq!(decision.attributes["tollgate.outcome"], "fail_open");
    let reason = decision.attributes["tollgate.fail_open_reason"].as_str();
    assert!(
        ["timeout", "error", "breaker_open"].contains(&reason),
        "{reason:?}"
    );
}

#[tokio::test]
async fn an_unsampled_trace_is_passed_on_unsampled_and_not_exported() {
    let collector = Collector::start().await;
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&up, 100.0, &exporting_to(&collector.url())).await;

    let r = traced(
        &gw,
        "/orders/1",
        Some(&format!("00-{TRACE}-{PARENT}-00")),
        None,
    )
    .await;
    assert_eq!(r.status(), 200);
    let (trace, _, flags) = parts(&up.seen()[0].headers["traceparent"]);
    assert_eq!((trace.as_str(), flags.as_str()), (TRACE, "00"));

    // A sampled request after it: once its spans are in, the unsampled one's would be too.
    assert_eq!(gw.get("/orders/2", Some(&key("acme"))).await.status(), 200);
    let (second, _, _) = parts(&up.seen()[1].headers["traceparent"]);
    collector.trace(&second, 3).await;
    assert!(collector.spans().iter().all(|s| s.trace_id != TRACE));
}

#[tokio::test]
async fn a_collector_that_is_down_fails_no_request_and_its_drops_are_counted() {
    let up = Upstream::start(Behaviour::Echo).await;
    let down = format!("http://127.0.0.1:{}", free_port().unwrap());
    let gw = gateway(&up, 100.0, &exporting_to(&down)).await;

    for i in 0..20 {
        let r = gw.get(&format!("/orders/{i}"), Some(&key("acme"))).await;
        assert_eq!(r.status(), 200);
    }
    assert_eq!(up.hits(), 20);
    eventually(
        std::time::Duration::from_secs(5),
        "the spans the collector did not take are counted as dropped",
        || async {
            gw.metric("tollgate_trace_spans_dropped_total{reason=\"export_failed\"}")
                .await
                .is_some_and(|n| n >= 60.0)
        },
    )
    .await;
    assert_eq!(gw.sample("tollgate_trace_spans_exported_total").await, 0.0);
}

#[tokio::test]
async fn an_unreachable_service_marks_the_request_and_upstream_spans_failed() {
    let collector = Collector::start().await;
    let toml = format!(
        "{}{}{}",
        catalog_toml(("gold", 100.0, 1.0), &["acme"]),
        route_toml(
            "orders",
            "/orders",
            &[format!("http://127.0.0.1:{}", free_port().unwrap())]
        ),
        exporting_to(&collector.url()),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;

    let r = traced(&gw, "/orders/1", Some(&traceparent()), None).await;
    assert_eq!(r.status(), 502);

    let spans = collector.trace(TRACE, 3).await;
    let request = span(&spans, "GET /orders");
    let upstream = span(&spans, "upstream");
    assert_eq!(request.attributes["http.response.status_code"], "502");
    assert_eq!(request.status, 2, "a 5xx is an error");
    assert_eq!(upstream.attributes["error.type"], "unreachable");
    assert_eq!(upstream.status, 2);
    assert_eq!(span(&spans, "decision").status, 0);
}

#[tokio::test]
async fn on_redis_the_decision_span_says_how_many_requests_its_store_call_decided() {
    let redis = RedisServer::start().unwrap();
    let collector = Collector::start().await;
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(
        &up,
        100.0,
        &format!("{}{}", redis_toml(&redis), exporting_to(&collector.url())),
    )
    .await;

    let r = traced(&gw, "/orders/3", Some(&traceparent()), None).await;
    assert_eq!(r.status(), 200);

    let spans = collector.trace(TRACE, 3).await;
    let decision = span(&spans, "decision");
    assert_eq!(decision.attributes["tollgate.outcome"], "allowed");
    assert_eq!(
        decision.attributes["tollgate.batch_size"], "1",
        "a request alone in its call"
    );
}

#[tokio::test]
async fn configured_headers_arrive_at_the_collector_with_every_export() {
    let collector = Collector::start().await;
    let up = Upstream::start(Behaviour::Echo).await;
    let telemetry = format!(
        "{}otlp_headers = \"x-api-key=s3cret%2Cpart, x-team=orders\"\n",
        exporting_to(&collector.url())
    );
    let gw = gateway(&up, 100.0, &telemetry).await;

    let r = traced(&gw, "/orders/1", Some(&traceparent()), None).await;
    assert_eq!(r.status(), 200);

    collector.trace(TRACE, 3).await;
    let posts = collector.posts();
    assert!(!posts.is_empty());
    for post in posts {
        assert_eq!(post.headers["x-api-key"], "s3cret,part", "percent-decoded");
        assert_eq!(post.headers["x-team"], "orders");
        assert_eq!(post.headers["content-type"], "application/json");
        assert!(!post.headers.contains_key("content-encoding"));
    }
}

#[tokio::test]
async fn with_protobuf_and_gzip_the_same_spans_arrive() {
    let collector = Collector::start().await;
    let up = Upstream::start(Behaviour::Echo).await;
    let telemetry = format!(
        "{}otlp_protocol = \"http/protobuf\"\notlp_compression = \"gzip\"\n",
        exporting_to(&collector.url())
    );
    let gw = gateway(&up, 100.0, &telemetry).await;

    let r = traced(&gw, "/orders/1", Some(&traceparent()), None).await;
    assert_eq!(r.status(), 200);

    let spans = collector.trace(TRACE, 3).await;
    let request = span(&spans, "GET /orders");
    assert_eq!(request.parent_id, PARENT);
    assert_eq!(span(&spans, "decision").parent_id, request.span_id);
    assert_eq!(
        span(&spans, "upstream").attributes["http.response.status_code"],
        "200"
    );
    for post in collector.posts() {
        assert_eq!(post.headers["content-type"], "application/x-protobuf");
        assert_eq!(post.headers["content-encoding"], "gzip");
    }
}

#[tokio::test]
async fn spans_reach_an_https_collector_whose_certificate_the_ca_file_names() {
    let cert = SelfSigned::generate();
    let collector = Collector::start_tls(&cert).await;
    assert!(collector.url().starts_with("https://"));
    let dir = tollgate_testkit::temp_dir("otlp-ca").unwrap();
    let ca = dir.path().join("collector.pem");
    std::fs::write(&ca, &cert.cert_pem).unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let telemetry = format!(
        "{}otlp_ca_file = \"{}\"\n",
        exporting_to(&collector.url()),
        ca.display()
    );
    let gw = gateway(&up, 100.0, &telemetry).await;

    let r = traced(&gw, "/orders/1", Some(&traceparent()), None).await;
    assert_eq!(r.status(), 200);

    let spans = collector.trace(TRACE, 3).await;
    assert_eq!(span(&spans, "GET /orders").parent_id, PARENT);
}

#[tokio::test]
async fn an_https_collector_with_an_untrusted_certificate_gets_no_spans() {
    let collector = Collector::start_tls(&SelfSigned::generate()).await;
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&up, 100.0, &exporting_to(&collector.url())).await;

    let r = traced(&gw, "/orders/1", Some(&traceparent()), None).await;
    assert_eq!(r.status(), 200, "the request does not notice");

    eventually(
        std::time::Duration::from_secs(5),
        "the spans the collector could not be trusted with are counted as dropped",
        || async {
            gw.metric("tollgate_trace_spans_dropped_total{reason=\"export_failed\"}")
                .await
                .is_some_and(|n| n >= 3.0)
        },
    )
    .await;
    assert!(collector.posts().is_empty());
    assert_eq!(gw.sample("tollgate_trace_spans_exported_total").await, 0.0);
}

/// A GET of `path` as acme, with these trace headers.
async fn traced(
    gw: &TestGateway,
    path: &str,
    traceparent: Option<&str>,
    tracestate: Option<&str>,
) -> reqwest::Response {
    let mut req = gw
        .http
        .get(format!("{}{path}", gw.address))
        .header("x-api-key", key("acme"));
    if let Some(t) = traceparent {
        req = req.header("traceparent", t);
    }
    if let Some(t) = tracestate {
        req = req.header("tracestate", t);
    }
    req.send().await.unwrap()
}
