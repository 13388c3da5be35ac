//! HTTP/2 at the edge: over TLS by ALPN and in cleartext with prior knowledge (h2c), each
//! stream decided once, with the same answers, headers and bounds as HTTP/1.1; and the
//! known HTTP/2 attacks (rapid reset, CONTINUATION floods, too many streams, PING and
//! SETTINGS floods) written frame by frame on a raw socket, while another client is served.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::helpers::*;
use crate::tls::{connect_offering, Ca, Files};
use crate::upstreams::RawService;
use tollgate_testkit::h2_frames::{
    frame, hpack, CANCEL, CONTINUATION, END_HEADERS, END_STREAM, ENHANCE_YOUR_CALM, GOAWAY,
    HEADERS, PING, PREFACE, REFUSED_STREAM, RST_STREAM, SETTINGS,
};

/// A request's answer: status, headers, body.
struct Answer {
    status: u16,
    headers: http::HeaderMap,
    body: Bytes,
}

/// An HTTP/2 connection over `io` (the h2 crate's client).
async fn h2_client<T>(io: T) -> h2::client::SendRequest<Bytes>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (client, conn) = h2::client::handshake(io).await.expect("h2 handshake");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    client
}

/// `method uri` on `client` with `headers` and `body`, read whole.
async fn send(
    client: &h2::client::SendRequest<Bytes>,
    method: &str,
    uri: &str,
    headers: &[(&str, &str)],
    body: Option<Bytes>,
) -> Result<Answer, h2::Error> {
    let mut req = http::Request::builder().method(method).uri(uri);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let mut client = client.clone().ready().await?;
    let (response, mut stream) = client.send_request(req.body(()).unwrap(), body.is_none())?;
    if let Some(body) = body {
        stream.send_data(body, true)?;
    }
    let response = response.await?;
    let (parts, mut recv) = response.into_parts();
    let mut body = Vec::new();
    while let Some(chunk) = recv.data().await {
        let chunk = chunk?;
        recv.flow_control().release_capacity(chunk.len()).unwrap();
        body.extend_from_slice(&chunk);
    }
    Ok(Answer {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body: body.into(),
    })
}

fn addr_of(gw: &TestGateway) -> SocketAddr {
    gw.address.trim_start_matches("http://").parse().unwrap()
}

/// A gateway with plan `gold` (`capacity` tokens, refilled at `rate`/s) for `acme` and
/// `mallory`, a route `/orders` to `up`, and `extra` TOML.
async fn gateway(up: &Upstream, capacity: f64, rate: f64, extra: &str) -> TestGateway {
    let toml = format!(
        "{}{}{extra}",
        catalog_toml(("gold", capacity, rate), &["acme", "mallory"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    TestGateway::spawn(settings(&toml)).await
}

/// [`gateway`], with a route `/fast` to `fast` for the client who is not attacking.
async fn attacked(up: &Upstream, fast: &Upstream) -> TestGateway {
    gateway(
        up,
        10_000.0,
        10_000.0,
        &route_toml("fast", "/fast", &[fast.url()]),
    )
    .await
}

#[tokio::test]
async fn h2c_streams_on_one_connection_are_each_decided_once() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&up, 3.0, 0.001, "").await;
    let addr = addr_of(&gw);
    let client = h2_client(TcpStream::connect(addr).await.unwrap()).await;
    let uri = format!("http://{addr}/orders/1");
    let acme = key("acme");
    let keyed = [("x-api-key", acme.as_str())];

    let answers =
        futures_util::future::join_all((0..5).map(|_| send(&client, "GET", &uri, &keyed, None)))
            .await;

    let statuses: Vec<u16> = answers.iter().map(|a| a.as_ref().unwrap().status).collect();
    assert_eq!(
        statuses.iter().filter(|s| **s == 200).count(),
        3,
        "{statuses:?}"
    );
    assert_eq!(
        statuses.iter().filter(|s| **s == 429).count(),
        2,
        "{statuses:?}"
    );
    assert_eq!(up.hits(), 3, "a refused stream never reaches the service");
    // A GET whose head ended its stream is forwarded with no body, as over HTTP/1.1 (not
    // an empty chunked one).
    let seen = &up.seen()[0];
    assert!(
        !seen.headers.contains_key("transfer-encoding"),
        "{:?}",
        seen.headers
    );
    let refused = answers.iter().flatten().find(|a| a.status == 429).unwrap();
    assert_eq!(refused.headers["content-type"], "application/problem+json");
    assert!(refused.headers.contains_key("retry-after"));
    assert!(refused.headers.contains_key("ratelimit"));
    let admitted = answers.iter().flatten().find(|a| a.status == 200).unwrap();
    assert!(admitted.headers.contains_key("ratelimit"));
    assert!(!admitted.headers.contains_key("connection"));
    gw.stop().await;
}

#[tokio::test]
async fn h2_over_tls_forwards_with_the_authority_as_the_clients_host() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new();
    let files = Files::write(dir.path(), "gw", &ca.leaf(&["gw.test"]));
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&up, 100.0, 100.0, &format!("[tls]\n{}", files.toml())).await;
    let tls = connect_offering(addr_of(&gw), Some("gw.test"), &[b"h2", b"http/1.1"])
        .await
        .unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let client = h2_client(tls).await;

    let a = send(
        &client,
        "POST",
        "https://gw.test:8443/orders/7?x=1",
        &[("x-api-key", &key("acme")), ("x-custom", "kept")],
        Some(Bytes::from_static(b"hello")),
    )
    .await
    .unwrap();

    assert_eq!(a.status, 200);
    assert_eq!(&a.body[..], b"hello");
    let seen = &up.seen()[0];
    assert_eq!(seen.path, "/orders/7?x=1");
    let h = &seen.headers;
    assert_eq!(h["x-forwarded-proto"], "https");
    assert_eq!(h["x-forwarded-host"], "gw.test:8443");
    assert!(
        h["forwarded"].contains("host=\"gw.test:8443\"")
            || h["forwarded"].contains("host=gw.test:8443"),
        "{h:?}"
    );
    assert_eq!(h["host"], up.url().trim_start_matches("http://"));
    assert_eq!(h["x-client-id"], "acme");
    assert_eq!(h["x-custom"], "kept");
    assert!(!h.contains_key("x-api-key"));
    gw.stop().await;
}

#[tokio::test]
async fn the_edges_answers_hold_for_http2() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&up, 100.0, 100.0, "[server]\nmax_body_bytes = 1000\n").await;
    let addr = addr_of(&gw);
    let client = h2_client(TcpStream::connect(addr).await.unwrap()).await;
    let acme = key("acme");
    let keyed = [("x-api-key", acme.as_str())];
    let at = |path: &str| format!("http://{addr}{path}");

    let no_key = send(&client, "GET", &at("/orders/1"), &[], None)
        .await
        .unwrap();
    let trace = send(&client, "TRACE", &at("/orders/1"), &keyed, None)
        .await
        .unwrap();
    let unrouted = send(&client, "GET", &at("/nowhere"), &keyed, None)
        .await
        .unwrap();
    let dots = send(
        &client,
        "GET",
        &at("/orders/%2e%2e/%2e%2e/etc/passwd"),
        &keyed,
        None,
    )
    .await
    .unwrap();
    let declared = send(
        &client,
        "POST",
        &at("/orders/1"),
        &[("x-api-key", &acme), ("content-length", "5000")],
        Some(Bytes::from(vec![b'x'; 5000])),
    )
    .await
    .unwrap();
    let streamed = send(
        &client,
        "POST",
        &at("/orders/1"),
        &keyed,
        Some(Bytes::from(vec![b'x'; 5000])),
    )
    .await
    .unwrap();
    let contradicted = send(
        &client,
        "GET",
        &at("/orders/1"),
        &[("x-api-key", &acme), ("host", "elsewhere.test")],
        None,
    )
    .await
    .unwrap();
    let twice = send(
        &client,
        "GET",
        &at("/orders/1"),
        &[("x-api-key", &acme), ("x-api-key", &acme)],
        None,
    )
    .await
    .unwrap();
    let normal = send(&client, "GET", &at("/orders//2/./3"), &keyed, None)
        .await
        .unwrap();

    assert_eq!(no_key.status, 401);
    assert_eq!(no_key.headers["content-type"], "application/problem+json");
    assert_eq!(trace.status, 405);
    assert_eq!(unrouted.status, 404);
    assert_eq!(dots.status, 400);
    assert_eq!(declared.status, 413);
    assert_eq!(streamed.status, 413);
    assert_eq!(contradicted.status, 400);
    assert!(String::from_utf8_lossy(&contradicted.body).contains(":authority"));
    assert_eq!(twice.status, 400);
    assert_eq!(normal.status, 200);
    assert_eq!(up.hits(), 1, "only the normal path reached the service");
    assert_eq!(up.seen()[0].path, "/orders/2/3");
    // The connection outlives every refusal: a refused stream is its own.
    let after = send(&client, "GET", &at("/orders/4"), &keyed, None)
        .await
        .unwrap();
    assert_eq!(after.status, 200);
    gw.stop().await;
}

#[tokio::test]
async fn a_get_over_http2_has_no_body_so_it_is_tried_again_when_a_replica_drops_it() {
    // One replica reads the request's head and closes without an answer; the other
    // answers. A GET with no body is sent again; one whose body had been read from could
    // not be.
    let drops = RawService::start(None, Arc::new(|_| (Vec::new(), true)));
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}{}[upstream]\neject_after = 0\n",
        catalog_toml(("gold", 1000.0, 1000.0), &["acme"]),
        route_toml("orders", "/orders", &[drops.url(), up.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    let addr = addr_of(&gw);
    let client = h2_client(TcpStream::connect(addr).await.unwrap()).await;
    let acme = key("acme");

    // Least-request picks either replica on a tie: go on until the dropping one has been
    // tried a few times (ten requests alone miss it one run in a thousand).
    let mut statuses = Vec::new();
    while drops.requests() < 3 && statuses.len() < 200 {
        let a = send(
            &client,
            "GET",
            &format!("http://{addr}/orders/1"),
            &[("x-api-key", &acme)],
            None,
        )
        .await;
        statuses.push(a.unwrap().status);
    }

    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    assert!(
        drops.requests() >= 3,
        "the dropping replica was tried {} times",
        drops.requests()
    );
    gw.stop().await;
}

#[tokio::test]
async fn http2_off_leaves_a_cleartext_listener_http1_only() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&up, 100.0, 100.0, "[server]\nhttp2 = false\n").await;

    let handshake = h2::client::handshake(TcpStream::connect(addr_of(&gw)).await.unwrap()).await;
    let refused = match handshake {
        Err(_) => true,
        Ok((client, conn)) => {
            tokio::spawn(conn);
            send(
                &client,
                "GET",
                &format!("{}/orders/1", gw.address),
                &[("x-api-key", &key("acme"))],
                None,
            )
            .await
            .is_err()
        }
    };

    assert!(refused, "an HTTP/2 preface was served with http2 = false");
    let r = gw.get("/orders/1", Some(&key("acme"))).await;
    assert_eq!(r.status(), 200);
    gw.stop().await;
}

// --- Attacks, written frame by frame -----------------------------------------------------

/// `GET path` with `key`'s API key, as one header block.
fn request_block(addr: SocketAddr, path: &str, key: &str) -> Vec<u8> {
    hpack(&[
        (":method", "GET"),
        (":scheme", "http"),
        (":path", path),
        (":authority", &addr.to_string()),
        ("x-api-key", key),
    ])
}

/// A raw connection: the preface and an empty SETTINGS written.
async fn raw(addr: SocketAddr) -> TcpStream {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let mut hello = PREFACE.to_vec();
    hello.extend(frame(SETTINGS, 0, 0, &[]));
    tcp.write_all(&hello).await.unwrap();
    tcp
}

/// Reads frames until the server closes or `within` passes: each frame's type, and the
/// error code of each RST_STREAM and GOAWAY.
async fn frames_until_closed(tcp: &mut TcpStream, within: Duration) -> (Vec<(u8, u32)>, bool) {
    let mut seen = Vec::new();
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let n = match tokio::time::timeout_at(deadline, tcp.read(&mut chunk)).await {
            Err(_) => return (seen, false),
            Ok(Ok(0)) | Ok(Err(_)) => return (seen, true),
            Ok(Ok(n)) => n,
        };
        buf.extend_from_slice(&chunk[..n]);
        while buf.len() >= 9 {
            let len =
                (usize::from(buf[0]) << 16) | (usize::from(buf[1]) << 8) | usize::from(buf[2]);
            if buf.len() < 9 + len {
                break;
            }
            let kind = buf[3];
            let payload = &buf[9..9 + len];
            let code = match kind {
                RST_STREAM if len >= 4 => u32::from_be_bytes(payload[..4].try_into().unwrap()),
                GOAWAY if len >= 8 => u32::from_be_bytes(payload[4..8].try_into().unwrap()),
                _ => 0,
            };
            seen.push((kind, code));
            buf.drain(..9 + len);
        }
    }
}

/// While `attack` runs, a well-behaved client asks `/fast` every 20 ms; all its answers.
async fn served_during<F: std::future::Future>(
    gw: &TestGateway,
    attack: F,
) -> (F::Output, Vec<u16>) {
    let addr = addr_of(gw);
    let victim = async {
        let client = h2_client(TcpStream::connect(addr).await.unwrap()).await;
        let mut statuses = Vec::new();
        for _ in 0..25 {
            let a = send(
                &client,
                "GET",
                &format!("http://{addr}/fast/1"),
                &[("x-api-key", &key("acme"))],
                None,
            )
            .await;
            statuses.push(a.map_or(0, |a| a.status));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        statuses
    };
    tokio::join!(attack, victim)
}

#[tokio::test]
async fn rapid_reset_closes_the_connection_and_others_are_served() {
    let up = Upstream::start(Behaviour::Echo).await;
    let fast = Upstream::start(Behaviour::Echo).await;
    let gw = attacked(&up, &fast).await;
    let addr = addr_of(&gw);

    // CVE-2023-44487: streams opened and reset at once, as fast as the socket takes them.
    let attack = async {
        let mut tcp = raw(addr).await;
        let block = request_block(addr, "/orders/1", &key("mallory"));
        let mut burst = Vec::new();
        for i in 0..20_000u32 {
            let stream = 2 * i + 1;
            burst.extend(frame(HEADERS, END_STREAM | END_HEADERS, stream, &block));
            burst.extend(frame(RST_STREAM, 0, stream, &CANCEL.to_be_bytes()));
        }
        let _ = tcp.write_all(&burst).await;
        frames_until_closed(&mut tcp, Duration::from_secs(5)).await
    };
    let ((frames, closed), victim) = served_during(&gw, attack).await;

    assert!(victim.iter().all(|s| *s == 200), "{victim:?}");
    // h2 closes a connection that resets more streams than it can accept (20 pending):
    // GOAWAY with ENHANCE_YOUR_CALM.
    assert!(closed, "the attacker's connection is still open");
    assert!(frames.contains(&(GOAWAY, ENHANCE_YOUR_CALM)), "{frames:?}");
    assert!(
        up.hits() < 20_000 / 10,
        "{} of 20000 reached the service",
        up.hits()
    );
}

#[tokio::test]
async fn a_stream_reset_after_it_was_accepted_is_not_worked_on() {
    // A slow service: a request whose stream the client resets is dropped by the gateway
    // before the service answers, so it is never counted as answered.
    let up = Upstream::start(Behaviour::Slow(Duration::from_millis(1500))).await;
    let fast = Upstream::start(Behaviour::Echo).await;
    let gw = attacked(&up, &fast).await;
    let addr = addr_of(&gw);

    let mut tcp = raw(addr).await;
    let block = request_block(addr, "/orders/1", &key("mallory"));
    for i in 0..20u32 {
        let stream = 2 * i + 1;
        tcp.write_all(&frame(HEADERS, END_STREAM | END_HEADERS, stream, &block))
            .await
            .unwrap();
        // Long enough for the gateway to accept the stream and start forwarding it.
        tokio::time::sleep(Duration::from_millis(50)).await;
        tcp.write_all(&frame(RST_STREAM, 0, stream, &CANCEL.to_be_bytes()))
            .await
            .unwrap();
    }
    // Past the slow service's answer time: a request not dropped would have its answer.
    tokio::time::sleep(Duration::from_millis(2500)).await;

    assert!(up.hits() > 0, "no request was forwarded before its reset");
    let answered = gw
        .metric("tollgate_upstream_requests_total{service=\"orders\",status_class=\"2xx\"}")
        .await
        .unwrap_or(0.0);
    assert_eq!(
        answered, 0.0,
        "a reset request's forward went on to its answer"
    );
    // The connection is still the client's: another stream on it is served.
    let r = gw.get("/fast/1", Some(&key("acme"))).await;
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn more_streams_than_allowed_at_once_are_refused() {
    let up = Upstream::start(Behaviour::Slow(Duration::from_millis(3000))).await;
    let fast = Upstream::start(Behaviour::Echo).await;
    let gw = attacked(&up, &fast).await;
    let addr = addr_of(&gw);

    let attack = async {
        let mut tcp = raw(addr).await;
        let block = request_block(addr, "/orders/1", &key("mallory"));
        let mut burst = Vec::new();
        for i in 0..300u32 {
            burst.extend(frame(HEADERS, END_STREAM | END_HEADERS, 2 * i + 1, &block));
        }
        tcp.write_all(&burst).await.unwrap();
        frames_until_closed(&mut tcp, Duration::from_secs(2)).await
    };
    let ((frames, _), victim) = served_during(&gw, attack).await;

    assert!(victim.iter().all(|s| *s == 200), "{victim:?}");
    let refused = frames
        .iter()
        .filter(|f| **f == (RST_STREAM, REFUSED_STREAM))
        .count();
    // 128 at once (MAX_CONCURRENT_STREAMS); the rest refused, never forwarded.
    assert!(refused >= 300 - 128, "{refused} refused");
    assert!(up.hits() <= 128, "{} reached the service", up.hits());
}

#[tokio::test]
async fn a_continuation_flood_is_cut_off_and_others_are_served() {
    let up = Upstream::start(Behaviour::Echo).await;
    let fast = Upstream::start(Behaviour::Echo).await;
    let gw = attacked(&up, &fast).await;
    let addr = addr_of(&gw);

    let attack = async {
        let mut tcp = raw(addr).await;
        let mut head = request_block(addr, "/orders/1", &key("mallory"));
        head.extend(hpack(&[("x-pad", "p")]));
        tcp.write_all(&frame(HEADERS, END_STREAM, 1, &head))
            .await
            .unwrap();
        // A header block that does not end: 1 MiB of 16 KiB CONTINUATION frames, then
        // nothing. Bounded at 64 KiB of header list (5 frames), the server closes the
        // connection; at h2's default (16 MiB) it would still be waiting for the rest.
        let field = hpack(&[("x-filler", &"f".repeat(100))]);
        // Whole fields in each frame (HPACK decodes as frames arrive).
        let payload = field.repeat(16 * 1024 / field.len());
        let continuation = frame(CONTINUATION, 0, 1, &payload);
        for _ in 0..64 {
            if tcp.write_all(&continuation).await.is_err() {
                break;
            }
        }
        frames_until_closed(&mut tcp, Duration::from_secs(3)).await
    };
    let ((frames, closed), victim) = served_during(&gw, attack).await;

    assert!(victim.iter().all(|s| *s == 200), "{victim:?}");
    assert!(closed, "the connection is still open: {frames:?}");
    // More CONTINUATION frames than a 64 KiB header list needs (5): ENHANCE_YOUR_CALM.
    assert!(frames.contains(&(GOAWAY, ENHANCE_YOUR_CALM)), "{frames:?}");
    assert_eq!(
        up.hits(),
        0,
        "the flooded request never reached the service"
    );
}

#[tokio::test]
async fn ping_and_settings_floods_do_not_stop_others_being_served() {
    let up = Upstream::start(Behaviour::Echo).await;
    let fast = Upstream::start(Behaviour::Echo).await;
    let gw = attacked(&up, &fast).await;
    let addr = addr_of(&gw);

    let attack = async {
        let mut results = Vec::new();
        for kind in [PING, SETTINGS] {
            let mut tcp = raw(addr).await;
            let one = match kind {
                PING => frame(PING, 0, 0, &[7; 8]),
                _ => frame(SETTINGS, 0, 0, &[0, 3, 0, 0, 0, 100]),
            };
            let burst: Vec<u8> = one
                .iter()
                .copied()
                .cycle()
                .take(one.len() * 20_000)
                .collect();
            // The flooder never reads: the server must not queue answers without bound.
            let mut written = 0;
            for _ in 0..50 {
                match tokio::time::timeout(Duration::from_millis(100), tcp.write_all(&burst)).await
                {
                    Ok(Ok(())) => written += burst.len(),
                    _ => break,
                }
            }
            results.push((kind, written, 50 * burst.len()));
        }
        results
    };
    let (results, victim) = served_during(&gw, attack).await;

    assert!(victim.iter().all(|s| *s == 200), "{victim:?}");
    for (kind, written, offered) in results {
        // Writes stall once the server stops reading a client that reads nothing: less than
        // what this kind's flood offered was taken (each kind its own total; seen red with
        // the flood sent to a socket that reads everything).
        assert!(
            written < offered,
            "kind {kind}: all {written} bytes were taken"
        );
    }
    // Still serving after.
    let r = gw.get("/fast/1", Some(&key("acme"))).await;
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn a_connection_that_sends_nothing_is_closed_as_over_http1_only() {
    // Telling h2c from HTTP/1.1 waits for the first bytes: no longer than a first request's
    // head may take (actix's client_request_timeout, 5 s), as with HTTP/1.1 alone.
    let up = Upstream::start(Behaviour::Echo).await;
    let both = gateway(&up, 100.0, 100.0, "").await;
    let h1_only = gateway(&up, 100.0, 100.0, "[server]\nhttp2 = false\n").await;

    let silent = |addr: SocketAddr| async move {
        let mut tcp = TcpStream::connect(addr).await.unwrap();
        let started = std::time::Instant::now();
        // Read to the end: HTTP/1.1 alone answers `408` first, then closes.
        let mut got = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(15), tcp.read_to_end(&mut got))
            .await
            .is_ok();
        (closed, started.elapsed())
    };
    let ((closed, took), (closed_h1, took_h1)) =
        tokio::join!(silent(addr_of(&both)), silent(addr_of(&h1_only)));

    eprintln!("closed after {took:?} (HTTP/1.1 only: {took_h1:?})");
    assert!(closed_h1, "HTTP/1.1 alone kept a silent connection");
    assert!(closed, "a silent connection was kept open");
    both.stop().await;
    h1_only.stop().await;
}
