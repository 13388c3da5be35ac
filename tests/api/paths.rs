//! Paths: a client reaches only what its route publishes, however it spells the path.
//!
//! Requests are written byte for byte on a TCP stream: HTTP client libraries normalise
//! dot segments and escapes themselves, which would hide exactly what is tested here.

use std::collections::HashMap;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::helpers::*;

/// A response as read off the wire.
struct Raw {
    status: u16,
    headers: HashMap<String, String>,
    body: String,
}

impl Raw {
    /// Whole tokens left, from the `RateLimit` header.
    fn remaining(&self) -> Option<u64> {
        let v = self.headers.get("ratelimit")?;
        v.split("r=").nth(1)?.split(';').next()?.parse().ok()
    }
}

/// Sends `<method> <target> HTTP/1.1` exactly as given, with the API key if any.
async fn raw(gw: &TestGateway, method: &str, target: &str, key: Option<&str>) -> Raw {
    match key {
        Some(k) => raw_with(gw, method, target, &[("x-api-key", k)]).await,
        None => raw_with(gw, method, target, &[]).await,
    }
}

/// Sends `<method> <target> HTTP/1.1` exactly as given, with these headers.
async fn raw_with(gw: &TestGateway, method: &str, target: &str, headers: &[(&str, &str)]) -> Raw {
    let addr = gw.address.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let headers: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    let head =
        format!("{method} {target} HTTP/1.1\r\nhost: {addr}\r\n{headers}connection: close\r\n\r\n");
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    // The gateway may close without reading a refused request to its end: a reset after
    // the answer still leaves the answer in `buf`.
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut buf)).await;
    let text = String::from_utf8_lossy(&buf);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line for {target:?}: {text:?}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Raw {
        status,
        headers,
        body: body.to_string(),
    }
}

/// Routes `/orders` → one service and `/billing` (cost 2) → another; no root route. The
/// plan refills so slowly that the tokens left count exactly what was charged.
async fn two_services(extra: &str) -> (TestGateway, Upstream, Upstream) {
    let orders = Upstream::start(Behaviour::Echo).await;
    let billing = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}{}{}cost = 2.0\n{extra}",
        catalog_toml(("gold", 1000.0, 0.001), &["acme"]),
        route_toml("orders", "/orders", &[orders.url()]),
        route_toml("billing", "/billing", &[billing.url()]),
    );
    (TestGateway::spawn(settings(&toml)).await, orders, billing)
}

/// What each trick must lead to: the status, and the path+query each service received
/// (`None`: it received nothing).
struct Trick {
    target: String,
    status: u16,
    orders: Option<&'static str>,
    billing: Option<&'static str>,
}

fn trick(target: &str, status: u16) -> Trick {
    Trick {
        target: target.to_string(),
        status,
        orders: None,
        billing: None,
    }
}

fn to_orders(target: &str, seen: &'static str) -> Trick {
    Trick {
        orders: Some(seen),
        ..trick(target, 200)
    }
}

fn to_billing(target: &str, seen: &'static str) -> Trick {
    Trick {
        billing: Some(seen),
        ..trick(target, 200)
    }
}

fn tricks() -> Vec<Trick> {
    vec![
        // Plain paths, as sent.
        to_orders("/orders", "/orders"),
        to_orders("/orders/7?x=1", "/orders/7?x=1"),
        // Dot segments, raw and encoded in every case: resolved before routing.
        trick("/orders/../secret.txt", 404),
        trick("/orders/%2e%2e/secret.txt", 404),
        trick("/orders/%2E%2E/secret.txt", 404),
        trick("/orders/.%2e/secret.txt", 404),
        trick("/orders/%2e./secret.txt", 404),
        trick("/orders/%2e%2E/secret.txt", 404),
        trick("/orders/.%2E/secret.txt", 404),
        trick("/orders/..", 404),
        trick("/healthz/..", 404),
        to_orders("/orders/./7", "/orders/7"),
        to_orders("/orders/%2e/7", "/orders/7"),
        to_orders("/orders/7/.", "/orders/7/"),
        to_orders("/orders/7/8/..", "/orders/7/"),
        // Climbing out of a route into another: routed, and charged, where it lands.
        to_billing("/orders/x/../../billing/y", "/billing/y"),
        to_orders("/billing/%2e%2e/orders/1", "/orders/1"),
        // Climbing above the root.
        trick("/..", 400),
        trick("/orders/../../etc/passwd", 400),
        trick("/orders/%2e%2e/%2e%2e/etc/passwd", 400),
        // Double encoding is decoded once: the text "%2e", never a dot.
        to_orders(
            "/orders/%252e%252e/secret.txt",
            "/orders/%252e%252e/secret.txt",
        ),
        // Unreserved escapes decoded, the others upper-cased.
        to_orders("/%6Frders/%37", "/orders/7"),
        to_orders("/orders/%c3%a9", "/orders/%C3%A9"),
        // Path parameters.
        trick("/orders/..;/secret.txt", 400),
        trick("/orders/7;jsessionid=x", 400),
        trick("/orders/7%3bx", 400),
        // Encoded slashes and backslashes, raw backslashes.
        trick("/orders/..%2fsecret.txt", 400),
        trick("/orders%2F..%2Fsecret.txt", 400),
        trick("/orders/..%5csecret.txt", 400),
        trick("/orders/..\\secret.txt", 400),
        // Control characters, encoded (raw ones never get past the HTTP parser).
        trick("/orders/7%00", 400),
        trick("/orders/%00/../../secret.txt", 400),
        trick("/orders/7%0d%0ax-injected:%20yes", 400),
        trick("/orders/%zz", 400),
        trick("/orders/%4", 400),
        // Repeated slashes are merged.
        to_orders("//orders//7", "/orders/7"),
        to_orders("///orders", "/orders"),
        trick("//secret.txt", 404),
        // Trailing dots.
        trick("/orders/...", 400),
        trick("/orders/.../secret.txt", 400),
        trick("/orders./x", 400),
        trick("/orders/secret.txt.", 400),
        trick("/orders/.%2e./x", 400),
        // The query is not a path: forwarded byte for byte, also when the path changes.
        to_orders(
            "/orders/7?next=../../x&p=%2f%2e%2e;y&q=%zz",
            "/orders/7?next=../../x&p=%2f%2e%2e;y&q=%zz",
        ),
        to_orders("/orders/./7?a=..%2F&b=%2e", "/orders/7?a=..%2F&b=%2e"),
        // Absolute-form: its path is normalised like any other.
        trick("http://upstream.example/orders/../secret.txt", 404),
        to_orders(
            "http://upstream.example/orders/./7?q=%2e",
            "/orders/7?q=%2e",
        ),
        // A path over 8 KiB.
        trick(&format!("/orders/{}", "a".repeat(9000)), 414),
    ]
}

#[tokio::test]
async fn a_client_reaches_only_the_normal_path_its_route_publishes() {
    let (gw, orders, billing) = two_services("").await;
    let acme = key("acme");
    let probe = raw(&gw, "GET", "/orders/probe", Some(&acme)).await;
    let mut left = probe.remaining().expect("RateLimit remaining");

    for t in tricks() {
        let (o, b) = (orders.seen().len(), billing.seen().len());

        let r = raw(&gw, "GET", &t.target, Some(&acme)).await;
        let probe = raw(&gw, "GET", "/orders/probe", Some(&acme)).await;

        let target = &t.target[..t.target.len().min(80)];
        assert_eq!(r.status, t.status, "{target}: {}", r.body);
        let orders_seen: Vec<String> = orders.seen()[o..].iter().map(|s| s.path.clone()).collect();
        let billing_seen: Vec<String> =
            billing.seen()[b..].iter().map(|s| s.path.clone()).collect();
        let mut want_orders: Vec<String> = t.orders.iter().map(|s| s.to_string()).collect();
        want_orders.push("/orders/probe".into());
        let want_billing: Vec<String> = t.billing.iter().map(|s| s.to_string()).collect();
        assert_eq!(orders_seen, want_orders, "{target}: the orders service");
        assert_eq!(billing_seen, want_billing, "{target}: the billing service");
        if r.status >= 400 {
            assert_eq!(
                r.headers.get("content-type").map(String::as_str),
                Some("application/problem+json"),
                "{target}"
            );
        }
        // Charged for the route it went to (billing costs 2), then 1 for the probe;
        // refused and unrouted requests spend nothing.
        let charged = match (t.orders, t.billing) {
            (Some(_), _) => 1,
            (_, Some(_)) => 2,
            _ => 0,
        };
        let now = probe.remaining().expect("RateLimit remaining");
        assert_eq!(now, left - charged - 1, "{target}: tokens spent");
        left = now;
    }
}

#[tokio::test]
async fn a_refused_path_names_the_problem_without_echoing_it() {
    let (gw, _orders, _billing) = two_services("").await;
    let cases = [
        ("/orders%2Fx", "encoded '/' (%2F)"),
        ("/orders/..;/x", "';'"),
        ("/orders/%1b[31m", "control characters"),
        ("/orders/../../x", "climbs above '/'"),
    ];
    for (target, says) in cases {
        let r = raw(&gw, "GET", target, Some(&key("acme"))).await;
        assert_eq!(r.status, 400, "{target}");
        let body: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(body["status"], 400);
        assert_eq!(body["type"], "https://tollgate.dev/problems/bad-path");
        let detail = body["detail"].as_str().unwrap();
        assert!(detail.contains(says), "{target}: {detail}");
        assert!(
            !detail.contains("orders") && !detail.contains('\u{1b}'),
            "{detail}"
        );
    }
}

#[tokio::test]
async fn a_bad_path_is_refused_before_the_key_is_looked_at() {
    let (gw, orders, _billing) = two_services("").await;
    assert_eq!(raw(&gw, "GET", "/orders/..;/x", None).await.status, 400);
    assert_eq!(raw(&gw, "GET", "/orders/7", None).await.status, 401);
    assert_eq!(
        raw(&gw, "GET", "/orders/7", Some("key-nobody-0000"))
            .await
            .status,
        401
    );
    assert_eq!(orders.hits(), 0);
}

#[tokio::test]
async fn an_asterisk_request_target_is_never_forwarded() {
    // `OPTIONS *` matches none of the gateway's own endpoints, so it reaches the guard,
    // whose `NormalPath` refuses a path that does not start with '/'.
    let (gw, orders, billing) = two_services("").await;
    let r = raw(&gw, "OPTIONS", "*", Some(&key("acme"))).await;
    assert_eq!(r.status, 400);
    assert!(r.body.contains("starting with '/'"), "{}", r.body);
    assert_eq!(orders.hits() + billing.hits(), 0);
}

#[tokio::test]
async fn a_request_line_past_what_http_parses_is_refused_before_the_gateway_sees_it() {
    // Past 64 KiB the URI does not parse, past 128 KiB the head does not fit actix's
    // buffer: both are answered by actix-http, never forwarded.
    let (gw, orders, _billing) = two_services("").await;
    for (len, status) in [(70_000, 400), (140_000, 431)] {
        let target = format!("/orders/{}", "a".repeat(len));
        let r = raw(&gw, "GET", &target, Some(&key("acme"))).await;
        assert_eq!(r.status, status, "{len}");
    }
    assert_eq!(orders.hits(), 0);
}

#[tokio::test]
async fn dot_segments_never_reach_the_admin_api_or_the_gateways_own_endpoints() {
    let (gw, orders, billing) = two_services(&admin_toml()).await;
    let token = admin_token("ops", "admin");
    let acme = key("acme");
    // Sanity: the admin API is on this listener and wants a token.
    assert_eq!(raw(&gw, "GET", "/admin/v1/plans", None).await.status, 401);

    for target in [
        "/healthz/../admin/v1/plans",
        "/orders/../admin/v1/plans",
        "/orders/%2e%2e/admin/v1/plans",
        "//admin/v1/plans",
        "/./admin/v1/plans",
    ] {
        // Not an admin path as actix routes it, so it is a data-plane request: the key
        // is required, and with one the normal path matches no route.
        assert_eq!(raw(&gw, "GET", target, None).await.status, 401, "{target}");
        assert_eq!(
            raw(&gw, "GET", target, Some(&acme)).await.status,
            404,
            "{target}"
        );
        // Nor does an admin token help: the data plane never hands a request to the admin API.
        let bearer = format!("Bearer {token}");
        let with_token = [("x-api-key", acme.as_str()), ("authorization", &bearer)];
        let r = raw_with(&gw, "GET", target, &with_token).await;
        assert_eq!(r.status, 404, "{target}");
    }
    // What actix routes to the admin scope stays there (it decodes unreserved escapes
    // too, but resolves no dot segments): still the admin API, still a token, no service.
    for target in [
        "/admin/v1/../../orders/7",
        "/admin/v1/%2e%2e/%2e%2e/orders/7",
        "/%61dmin/v1/plans/../../../orders/7",
    ] {
        assert_eq!(
            raw(&gw, "GET", target, Some(&acme)).await.status,
            401,
            "{target}"
        );
    }
    // The Swagger UI serves embedded files only.
    for target in [
        "/swagger-ui/../../etc/passwd",
        "/swagger-ui/%2e%2e/%2e%2e/etc/passwd",
    ] {
        let r = raw(&gw, "GET", target, Some(&acme)).await;
        assert!(!r.body.contains("root:"), "{target}");
    }
    assert_eq!(orders.hits() + billing.hits(), 0);
}

#[tokio::test]
async fn a_clients_own_view_is_found_by_its_normal_path_and_never_reaches_a_service() {
    // Arrange: a root route, so a path the gateway did not take for its own would be
    // forwarded.
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}{}",
        catalog_toml(("gold", 1000.0, 0.001), &["acme", "beta"]),
        route_toml("all", "/", &[up.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    let acme = key("acme");

    // Act and assert: every spelling whose normal form is the view's path is the view
    // (its JSON names the client), and the service sees none of them. Two clients: each
    // may read its view 5 times at once.
    let spellings = [
        "/_tollgate/limits",
        "/_tollgate/%6Cimits",
        "/_tollgate/%6cimits",
        "/_tollgate/./limits",
        "/_tollgate/x/../limits",
        "//_tollgate/limits",
        "/_tollgate//limits",
    ];
    for (i, target) in spellings.into_iter().enumerate() {
        let client = if i < 4 { "acme" } else { "beta" };
        let r = raw(&gw, "GET", target, Some(&key(client))).await;
        assert_eq!(r.status, 200, "{target}: {}", r.body);
        let named = format!("\"client\":\"{client}\"");
        assert!(r.body.contains(&named), "{target}: {}", r.body);
    }
    assert_eq!(up.hits(), 0);
    // A path beside it is the service's, as any other.
    assert_eq!(
        raw(&gw, "GET", "/_tollgate/limitsx", Some(&acme))
            .await
            .status,
        200
    );
    assert_eq!(up.hits(), 1);
}

#[tokio::test]
async fn ids_made_of_dots_are_refused_for_every_record_however_spelled() {
    // Arrange: the admin API, written to byte for byte (a client library would resolve
    // the dot segments before sending).
    let (gw, _orders, _billing) = two_services(&admin_toml()).await;
    let bearer = format!("Bearer {}", admin_token("ops", "admin:read admin:write"));
    let put = |target: String, body: &'static str| {
        let (gw, bearer) = (&gw, bearer.clone());
        async move {
            let addr = gw.address.trim_start_matches("http://");
            let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
            let head = format!(
                "PUT {target} HTTP/1.1\r\nhost: {addr}\r\nauthorization: {bearer}\r\n\
                 content-type: application/json\r\ncontent-length: {}\r\n\
                 connection: close\r\n\r\n{body}",
                body.len()
            );
            stream.write_all(head.as_bytes()).await.unwrap();
            let mut buf = Vec::new();
            let _ =
                tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut buf)).await;
            String::from_utf8_lossy(&buf).into_owned()
        }
    };

    // Act and assert: `.` and `..`, escaped or not (actix decodes `%2E`), as a client, a
    // plan or an override's limit: each a 422 naming the field, and nothing is written.
    for dots in ["%2E", "%2E%2E", "%2e%2e", ".%2E", "...", "%2E%2E%2E"] {
        let r = put(format!("/admin/v1/clients/{dots}"), r#"{"plan": "gold"}"#).await;
        assert!(r.starts_with("HTTP/1.1 422"), "{dots}: {r}");
        assert!(
            r.contains("\"client\"") && r.contains("not only dots"),
            "{dots}: {r}"
        );
        let r = put(
            format!("/admin/v1/plans/{dots}"),
            r#"{"capacity": 5, "rate": 1}"#,
        )
        .await;
        assert!(r.starts_with("HTTP/1.1 422"), "{dots}: {r}");
        assert!(r.contains("\"plan\""), "{dots}: {r}");
    }
    let token = admin_token("ops", "admin:read");
    let clients: serde_json::Value = gw
        .send_admin(reqwest::Method::GET, "/clients", &token, None)
        .await
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = clients["items"]
        .as_array()
        .map(|a| a.iter().filter_map(|c| c["id"].as_str()).collect())
        .unwrap_or_default();
    assert!(
        ids.iter().all(|id| id.bytes().any(|b| b != b'.')),
        "{clients}"
    );
    // An id with dots and something else stays valid.
    let r = put("/admin/v1/clients/.acme.".into(), r#"{"plan": "gold"}"#).await;
    assert!(r.starts_with("HTTP/1.1 201"), "{r}");
}
