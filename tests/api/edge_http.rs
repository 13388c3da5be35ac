//! The HTTP/1.1 edge against hostile clients: bodies that never end after a refusal,
//! `Expect`, a key or a `Host` sent twice, addresses a client claims for itself, `TRACE`
//! and `CONNECT`; and pipelined requests, each answered in order and framed by its own.
//!
//! Requests are written byte for byte on a TCP stream: client libraries would not send most
//! of them, and the connection's fate after the answer is part of what is tested.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::helpers::*;

/// A response head (and body, when it has a `content-length`) as read off the wire.
#[derive(Debug)]
struct Raw {
    status: u16,
    /// Lower-case names; a repeated header keeps its last value.
    headers: HashMap<String, String>,
    body: String,
}

/// A gateway routing `/orders` to `upstream`, one client `acme` on a plan of `capacity`
/// tokens refilled very slowly, and `extra` configuration.
async fn gateway(upstream: &str, capacity: f64, extra: &str) -> TestGateway {
    let toml = format!(
        "{}{}{extra}",
        catalog_toml(("gold", capacity, 0.001), &["acme"]),
        route_toml("orders", "/orders", &[upstream.to_string()]),
    );
    TestGateway::spawn(settings(&toml)).await
}

fn authority(gw: &TestGateway) -> &str {
    gw.address.trim_start_matches("http://")
}

async fn connect(gw: &TestGateway) -> TcpStream {
    TcpStream::connect(authority(gw)).await.unwrap()
}

/// The reading side of a connection, with what was read past the last response.
struct Wire<R> {
    rx: R,
    buf: Vec<u8>,
}

impl<R: AsyncRead + Unpin> Wire<R> {
    fn new(rx: R) -> Wire<R> {
        Wire {
            rx,
            buf: Vec::new(),
        }
    }

    /// Reads one more piece into the buffer by `deadline`; panics if the connection ends.
    async fn fill(&mut self, deadline: tokio::time::Instant) {
        let mut chunk = [0u8; 4096];
        let n = tokio::time::timeout_at(deadline, self.rx.read(&mut chunk))
            .await
            .unwrap_or_else(|_| panic!("no response within 5 s; read {:?}", self.buf))
            .unwrap_or_else(|e| panic!("connection failed ({e}); read {:?}", self.buf));
        assert!(n > 0, "connection closed early; read {:?}", self.buf);
        self.buf.extend_from_slice(&chunk[..n]);
    }

    /// Reads one response: its head, then its body when it declares a length (a `100
    /// Continue` is a response too). Panics if none arrives within 5 s.
    async fn response(&mut self) -> Raw {
        self.read_response(true).await
    }

    /// Reads one response to a `HEAD`: its head alone, whatever length it declares (RFC
    /// 9110 §9.3.2: no content). Bytes after the head are left for the next response.
    async fn head_response(&mut self) -> Raw {
        self.read_response(false).await
    }

    async fn read_response(&mut self, with_body: bool) -> Raw {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let head_end = loop {
            if let Some(i) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            self.fill(deadline).await;
        };
        let head = String::from_utf8_lossy(&self.buf[..head_end]).to_string();
        let mut lines = head.lines();
        let status = lines
            .next()
            .and_then(|l| l.split(' ').nth(1))
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no status line: {head:?}"));
        let headers: HashMap<String, String> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        let len: usize = match headers.get("content-length") {
            Some(v) if with_body => v.parse().unwrap_or(0),
            _ => 0,
        };
        while self.buf.len() < head_end + len {
            self.fill(deadline).await;
        }
        let body = String::from_utf8_lossy(&self.buf[head_end..head_end + len]).to_string();
        self.buf.drain(..head_end + len);
        Raw {
            status,
            headers,
            body,
        }
    }

    /// The next final (not 1xx) response.
    async fn final_response(&mut self) -> Raw {
        loop {
            let r = self.response().await;
            if r.status >= 200 {
                return r;
            }
        }
    }

    /// How long after now the gateway closes the connection (EOF or reset), ignoring
    /// whatever else it sends; `None` if it is still open after `patience`.
    async fn closed_after(&mut self, patience: Duration) -> Option<Duration> {
        let start = Instant::now();
        let mut sink = [0u8; 4096];
        let closed = tokio::time::timeout(patience, async {
            loop {
                match self.rx.read(&mut sink).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await;
        closed.ok().map(|()| start.elapsed())
    }
}

/// Writes `request` on a new connection and reads the final answer.
async fn exchange(gw: &TestGateway, request: &str) -> Raw {
    let mut stream = connect(gw).await;
    stream.write_all(request.as_bytes()).await.unwrap();
    Wire::new(stream).final_response().await
}

// A refused request's body is not drained for as long as the client cares to send it.

#[tokio::test]
async fn a_chunked_body_trickled_after_a_401_does_not_hold_the_connection() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&up.url(), 100.0, "").await;
    let (rx, mut tx) = connect(&gw).await.into_split();
    let mut wire = Wire::new(rx);
    let head = format!(
        "POST /orders HTTP/1.1\r\nhost: {}\r\nx-api-key: not-a-key\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n",
        authority(&gw)
    );
    tx.write_all(head.as_bytes()).await.unwrap();

    let r = wire.response().await;
    assert_eq!(r.status, 401);
    // The client keeps sending a chunk every 100 ms, for up to 10 s.
    let trickle = tokio::spawn(async move {
        for _ in 0..100 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if tx.write_all(b"5\r\nhello\r\n").await.is_err() {
                return;
            }
        }
    });

    let closed = wire.closed_after(Duration::from_secs(6)).await;
    trickle.abort();
    let closed = closed.expect("the gateway still drains the body after 6 s");
    // The linger is 1 s; the rest is slack for a loaded debug build.
    assert!(
        closed < Duration::from_millis(2500),
        "closed after {closed:?}"
    );
    // and said so in its answer.
    assert_eq!(
        r.headers.get("connection").map(String::as_str),
        Some("close")
    );
    assert_eq!(up.hits(), 0);
}

#[tokio::test]
async fn a_declared_body_never_sent_after_a_401_does_not_hold_the_connection() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&up.url(), 100.0, "").await;
    let (rx, mut tx) = connect(&gw).await.into_split();
    let mut wire = Wire::new(rx);
    let head = format!(
        "POST /orders HTTP/1.1\r\nhost: {}\r\nx-api-key: not-a-key\r\ncontent-length: 100000\r\n\r\n",
        authority(&gw)
    );
    tx.write_all(head.as_bytes()).await.unwrap();

    let r = wire.response().await;
    assert_eq!(r.status, 401);
    let closed = wire
        .closed_after(Duration::from_secs(6))
        .await
        .expect("the gateway still waits for the body after 6 s");
    assert!(
        closed < Duration::from_millis(2500),
        "closed after {closed:?}"
    );
}

#[tokio::test]
async fn a_client_that_sent_its_whole_body_gets_its_answer_and_keeps_its_connection() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&up.url(), 100.0, "").await;
    let (rx, mut tx) = connect(&gw).await.into_split();
    let mut wire = Wire::new(rx);
    let host = authority(&gw);

    let sized = format!(
        "POST /orders HTTP/1.1\r\nhost: {host}\r\nx-api-key: not-a-key\r\ncontent-length: 5\r\n\r\nhello"
    );
    tx.write_all(sized.as_bytes()).await.unwrap();
    let r = wire.response().await;
    assert_eq!(r.status, 401);
    assert!(r.body.contains("x-api-key"), "{}", r.body);
    assert_ne!(
        r.headers.get("connection").map(String::as_str),
        Some("close")
    );

    // The same connection, a whole chunked body, and then an admitted request.
    let chunked = format!(
        "POST /orders HTTP/1.1\r\nhost: {host}\r\nx-api-key: not-a-key\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    );
    tx.write_all(chunked.as_bytes()).await.unwrap();
    assert_eq!(wire.response().await.status, 401);
    let admitted = format!(
        "POST /orders HTTP/1.1\r\nhost: {host}\r\nx-api-key: {}\r\ncontent-length: 5\r\n\r\nhello",
        key("acme")
    );
    tx.write_all(admitted.as_bytes()).await.unwrap();
    let r = wire.response().await;
    assert_eq!((r.status, r.body.as_str()), (200, "hello"));
}

// `Expect` is answered by the gateway's own HTTP server, never passed on.

#[tokio::test]
async fn expect_never_reaches_the_service() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&up.url(), 100.0, "").await;
    let (rx, mut tx) = connect(&gw).await.into_split();
    let mut wire = Wire::new(rx);
    let head = format!(
        "POST /orders HTTP/1.1\r\nhost: {}\r\nx-api-key: {}\r\nexpect: 100-continue\r\ncontent-length: 5\r\n\r\n",
        authority(&gw),
        key("acme")
    );
    tx.write_all(head.as_bytes()).await.unwrap();
    // actix-http answers 100 as soon as the head is parsed, before the guard runs.
    assert_eq!(wire.response().await.status, 100);
    tx.write_all(b"hello").await.unwrap();
    let r = wire.response().await;
    assert_eq!((r.status, r.body.as_str()), (200, "hello"));

    // Without a body, awc given `Expect` would refuse to send at all (502).
    let get = format!(
        "GET /orders HTTP/1.1\r\nhost: {}\r\nx-api-key: {}\r\nexpect: 100-continue\r\n\r\n",
        authority(&gw),
        key("acme")
    );
    assert_eq!(exchange(&gw, &get).await.status, 200);

    let seen = up.seen();
    assert_eq!(seen.len(), 2);
    for s in seen {
        assert!(!s.headers.contains_key("expect"), "{:?}", s.headers);
    }
}

/// A service on a raw socket that never sends `100 Continue` (as many do not): it reads a
/// head and the body it declares, then answers `200 ok` and closes. It keeps each head.
async fn service_without_continue() -> (String, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let heads = Arc::new(Mutex::new(Vec::new()));
    let seen = heads.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                return;
            };
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                let head_end = loop {
                    if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        break i + 4;
                    }
                    match conn.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                };
                let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0);
                seen.lock().unwrap().push(head);
                while buf.len() < head_end + len {
                    match conn.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let _ = conn
                    .write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok",
                    )
                    .await;
            });
        }
    });
    (url, heads)
}

#[tokio::test]
async fn a_curl_like_expect_with_a_body_is_answered_promptly_by_a_service_that_never_says_continue()
{
    let (url, heads) = service_without_continue().await;
    let gw = gateway(&url, 100.0, "").await;
    let (rx, mut tx) = connect(&gw).await.into_split();
    let mut wire = Wire::new(rx);
    let start = Instant::now();
    let head = format!(
        "PUT /orders/7 HTTP/1.1\r\nhost: {}\r\nx-api-key: {}\r\nexpect: 100-continue\r\ncontent-length: 11\r\n\r\n",
        authority(&gw),
        key("acme")
    );
    tx.write_all(head.as_bytes()).await.unwrap();
    assert_eq!(wire.response().await.status, 100);
    tx.write_all(b"hello world").await.unwrap();

    let r = wire.response().await;
    assert_eq!((r.status, r.body.as_str()), (200, "ok"));
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    let heads = heads.lock().unwrap();
    assert!(!heads[0].contains("expect"), "{}", heads[0]);
}

// One key, one host.

#[tokio::test]
async fn the_configured_key_header_sent_twice_is_refused_before_a_token_is_spent() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(
        &up.url(),
        1.0,
        "[server]\napi_key_header = \"x-tollgate-key\"\n",
    )
    .await;
    let host = authority(&gw);
    let acme = key("acme");

    let twice = format!(
        "GET /orders HTTP/1.1\r\nhost: {host}\r\nx-tollgate-key: {acme}\r\nx-tollgate-key: {acme}\r\nconnection: close\r\n\r\n"
    );
    let r = exchange(&gw, &twice).await;
    assert_eq!(r.status, 400);
    assert_eq!(r.headers["content-type"], "application/problem+json");
    assert!(r.body.contains("x-tollgate-key"), "{}", r.body);
    assert!(!r.headers.contains_key("ratelimit"), "{:?}", r.headers);
    assert_eq!(up.hits(), 0);

    // The plan's one token is still there.
    let once = format!(
        "GET /orders HTTP/1.1\r\nhost: {host}\r\nx-tollgate-key: {acme}\r\nconnection: close\r\n\r\n"
    );
    assert_eq!(exchange(&gw, &once).await.status, 200);
    assert_eq!(up.hits(), 1);
}

#[tokio::test]
async fn a_malformed_repeated_or_missing_host_is_refused_and_a_valid_one_forwarded() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&up.url(), 100.0, "").await;
    let acme = key("acme");

    // actix-http's parser refuses these itself, with a bare 400, before the guard runs.
    for hosts in ["host: api.example\r\nhost: evil.example\r\n", ""] {
        let request = format!(
            "GET /orders HTTP/1.1\r\n{hosts}x-api-key: {acme}\r\nconnection: close\r\n\r\n"
        );
        assert_eq!(exchange(&gw, &request).await.status, 400, "{hosts:?}");
    }
    for host in [
        "evil.example/<script>",
        "a b",
        "u@evil.example",
        "api.example:80x",
        "a..b",
        "",
    ] {
        let request = format!(
            "GET /orders HTTP/1.1\r\nhost: {host}\r\nx-api-key: {acme}\r\nconnection: close\r\n\r\n"
        );
        let r = exchange(&gw, &request).await;
        assert_eq!(r.status, 400, "{host:?}: {}", r.body);
        assert_eq!(
            r.headers.get("content-type").map(String::as_str),
            Some("application/problem+json"),
            "{host:?}: {r:?}"
        );
        assert!(r.body.contains("Host"), "{}", r.body);
    }
    assert_eq!(up.hits(), 0);

    for (host, forwarded) in [
        ("api.example:8443", "host=\"api.example:8443\""),
        ("[::1]:8080", "host=\"[::1]:8080\""),
    ] {
        let request = format!(
            "GET /orders HTTP/1.1\r\nhost: {host}\r\nx-api-key: {acme}\r\nconnection: close\r\n\r\n"
        );
        assert_eq!(exchange(&gw, &request).await.status, 200, "{host}");
        let seen = up.seen().pop().unwrap();
        assert_eq!(seen.headers["x-forwarded-host"], host);
        assert!(
            seen.headers["forwarded"].contains(forwarded),
            "{:?}",
            seen.headers
        );
    }
    // HTTP/1.0 needs no Host.
    let old = format!("GET /orders HTTP/1.0\r\nx-api-key: {acme}\r\n\r\n");
    assert_eq!(exchange(&gw, &old).await.status, 200);
    assert!(!up
        .seen()
        .pop()
        .unwrap()
        .headers
        .contains_key("x-forwarded-host"));
}

// Addresses a client claims for itself.

const CLAIMS: [&str; 5] = [
    "x-real-ip",
    "true-client-ip",
    "x-client-ip",
    "cf-connecting-ip",
    "fastly-client-ip",
];

async fn claim_addresses(gw: &TestGateway) {
    let claims: String = CLAIMS.iter().map(|h| format!("{h}: 6.6.6.6\r\n")).collect();
    let request = format!(
        "GET /orders HTTP/1.1\r\nhost: {}\r\nx-api-key: {}\r\n{claims}x-custom: kept\r\nconnection: close\r\n\r\n",
        authority(gw),
        key("acme")
    );
    assert_eq!(exchange(gw, &request).await.status, 200);
}

#[tokio::test]
async fn client_ip_claims_of_an_untrusted_client_are_removed() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&up.url(), 100.0, "").await;
    claim_addresses(&gw).await;
    let h = &up.seen()[0].headers;
    for claim in CLAIMS {
        assert!(!h.contains_key(claim), "{claim} was forwarded: {h:?}");
    }
    assert_eq!(h["x-custom"], "kept");
    assert_eq!(h["x-forwarded-for"], "127.0.0.1");
}

#[tokio::test]
async fn client_ip_claims_of_a_trusted_proxy_pass() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(
        &up.url(),
        100.0,
        "[server]\ntrusted_proxies = [\"127.0.0.0/8\"]\n",
    )
    .await;
    claim_addresses(&gw).await;
    let h = &up.seen()[0].headers;
    for claim in CLAIMS {
        assert_eq!(h.get(claim).map(String::as_str), Some("6.6.6.6"), "{claim}");
    }
}

// Methods the gateway never forwards.

#[tokio::test]
async fn trace_and_connect_are_405_with_allow_before_the_key_is_checked() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&up.url(), 100.0, "").await;
    let host = authority(&gw).to_string();
    let acme = key("acme");

    for request in [
        format!("TRACE /orders HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n"),
        format!("TRACE /orders HTTP/1.1\r\nhost: {host}\r\nx-api-key: {acme}\r\nconnection: close\r\n\r\n"),
        format!("CONNECT {host} HTTP/1.1\r\nhost: {host}\r\nx-api-key: {acme}\r\n\r\n"),
    ] {
        let r = exchange(&gw, &request).await;
        assert_eq!(r.status, 405, "{request:?}: {}", r.body);
        assert!(r.headers["allow"].contains("GET"), "{:?}", r.headers);
        assert!(!r.headers["allow"].contains("TRACE"));
        assert_eq!(r.headers["content-type"], "application/problem+json");
    }
    assert_eq!(up.hits(), 0);
}

// Pipelined requests, written in one piece: answered in order, each framed by its own
// request, not by the one decoded after it (actix-http 3.20.0 did that; tollgate carries a
// patched copy: vendor/actix-http/PATCHES.md).

/// What the service behind [`pipeline_gateway`] answers: 11 bytes.
const BODY: &str = "eleven byte";

/// A gateway in front of a service answering [`BODY`] to every request.
async fn pipeline_gateway() -> (Upstream, TestGateway) {
    let up = Upstream::start(Behaviour::Body(BODY)).await;
    let gw = gateway(&up.url(), 100.0, "").await;
    (up, gw)
}

/// `method path` for the route, with acme's key and `extra` header lines.
fn request(gw: &TestGateway, method: &str, path: &str, extra: &str) -> String {
    format!(
        "{method} {path} HTTP/1.1\r\nhost: {}\r\nx-api-key: {}\r\n{extra}\r\n",
        authority(gw),
        key("acme")
    )
}

/// Reads the answer to `method path` and checks it is the service's to that request: its
/// length, and its body unless it answers a `HEAD`.
async fn answer<R: AsyncRead + Unpin>(wire: &mut Wire<R>, method: &str, path: &str) -> Raw {
    let head = method == "HEAD";
    let r = if head {
        wire.head_response().await
    } else {
        wire.response().await
    };
    let what = format!("{method} {path}");
    assert_eq!(r.status, 200, "{what}: {r:?}");
    assert_eq!(
        r.headers.get("x-request"),
        Some(&what),
        "not the answer to {what}: {r:?}"
    );
    assert_eq!(
        r.headers.get("content-length").map(String::as_str),
        Some("11"),
        "{what}: {r:?}"
    );
    assert_eq!(r.body, if head { "" } else { BODY }, "{what}");
    r
}

/// Writes one request per method in one write, reads their answers in order (each keeps
/// the connection), then asks once more on the same connection.
async fn pipelined(methods: &[&str]) {
    let (up, gw) = pipeline_gateway().await;
    let (rx, mut tx) = connect(&gw).await.into_split();
    let mut wire = Wire::new(rx);
    let requests: Vec<(&str, String)> = methods
        .iter()
        .enumerate()
        .map(|(i, m)| (*m, format!("/orders/{}", i + 1)))
        .collect();
    let batch: String = requests
        .iter()
        .map(|(m, p)| request(&gw, m, p, ""))
        .collect();
    tx.write_all(batch.as_bytes()).await.unwrap();

    for (m, p) in &requests {
        let r = answer(&mut wire, m, p).await;
        assert_ne!(
            r.headers.get("connection").map(String::as_str),
            Some("close"),
            "{m} {p}: {r:?}"
        );
    }
    // The connection still serves, and nothing came before this answer: no answer to a
    // `HEAD` carried a body.
    tx.write_all(request(&gw, "GET", "/orders/last", "").as_bytes())
        .await
        .unwrap();
    answer(&mut wire, "GET", "/orders/last").await;
    assert!(wire.buf.is_empty(), "more than the answers: {:?}", wire.buf);
    assert_eq!(up.hits(), methods.len() + 1);
}

#[tokio::test]
async fn a_pipelined_head_then_get_are_both_answered_each_framed_by_its_own_method() {
    pipelined(&["HEAD", "GET"]).await;
}

#[tokio::test]
async fn a_pipelined_get_then_head_are_both_answered_each_framed_by_its_own_method() {
    pipelined(&["GET", "HEAD"]).await;
}

#[tokio::test]
async fn pipelined_head_head_get_are_answered_in_order() {
    pipelined(&["HEAD", "HEAD", "GET"]).await;
}

#[tokio::test]
async fn a_pipelined_connection_close_closes_after_its_own_answer_not_the_one_before() {
    let (up, gw) = pipeline_gateway().await;
    let (rx, mut tx) = connect(&gw).await.into_split();
    let mut wire = Wire::new(rx);
    let batch = request(&gw, "GET", "/orders/1", "")
        + &request(&gw, "GET", "/orders/2", "connection: close\r\n");
    tx.write_all(batch.as_bytes()).await.unwrap();

    let first = answer(&mut wire, "GET", "/orders/1").await;
    assert_ne!(
        first.headers.get("connection").map(String::as_str),
        Some("close"),
        "the keep-alive request's answer: {first:?}"
    );
    let second = answer(&mut wire, "GET", "/orders/2").await;
    assert_eq!(
        second.headers.get("connection").map(String::as_str),
        Some("close"),
        "{second:?}"
    );
    assert!(wire.buf.is_empty(), "more than the answers: {:?}", wire.buf);
    wire.closed_after(Duration::from_secs(5))
        .await
        .expect("the connection is still open 5 s after the answer to `connection: close`");
    assert_eq!(up.hits(), 2);
}

// A client's own view answers without reading a body, as any refusal does: it holds none
// for long, and a whole one leaves the connection usable.

#[tokio::test]
async fn a_body_trickled_to_the_own_view_does_not_hold_the_connection() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&up.url(), 100.0, "").await;
    let (rx, mut tx) = connect(&gw).await.into_split();
    let mut wire = Wire::new(rx);
    let head = format!(
        "POST /_tollgate/limits HTTP/1.1\r\nhost: {}\r\nx-api-key: {}\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n",
        authority(&gw),
        key("acme")
    );
    tx.write_all(head.as_bytes()).await.unwrap();

    let r = wire.response().await;
    assert_eq!(r.status, 405);
    let trickle = tokio::spawn(async move {
        for _ in 0..100 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if tx.write_all(b"5\r\nhello\r\n").await.is_err() {
                return;
            }
        }
    });
    let closed = wire.closed_after(Duration::from_secs(6)).await;
    trickle.abort();
    let closed = closed.expect("the gateway still drains the body after 6 s");
    assert!(
        closed < Duration::from_millis(2500),
        "closed after {closed:?}"
    );
    assert_eq!(up.hits(), 0);
}

#[tokio::test]
async fn the_own_view_with_a_whole_body_keeps_the_connection_and_refuses_a_key_sent_twice() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&up.url(), 100.0, "").await;
    let (rx, mut tx) = connect(&gw).await.into_split();
    let mut wire = Wire::new(rx);
    let (host, acme) = (authority(&gw).to_string(), key("acme"));

    let with_body = format!(
        "GET /_tollgate/limits HTTP/1.1\r\nhost: {host}\r\nx-api-key: {acme}\r\ncontent-length: 5\r\n\r\nhello"
    );
    tx.write_all(with_body.as_bytes()).await.unwrap();
    let r = wire.response().await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_ne!(
        r.headers.get("connection").map(String::as_str),
        Some("close")
    );
    // The same connection: a key header sent twice is 400, as on every other path.
    let twice = format!(
        "GET /_tollgate/limits HTTP/1.1\r\nhost: {host}\r\nx-api-key: {acme}\r\nx-api-key: {acme}\r\n\r\n"
    );
    tx.write_all(twice.as_bytes()).await.unwrap();
    let r = wire.response().await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(up.hits(), 0);
}
