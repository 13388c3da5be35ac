//! Replicas that die or hang: set aside (ejected) and retried around, within the route's
//! retry budget, each request still one decision (the book, "Upstreams").

use std::io::{Read, Write};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::helpers::*;

fn dead() -> String {
    format!("http://127.0.0.1:{}", free_port().unwrap())
}

async fn gateway(upstreams: &[String], extra: &str) -> TestGateway {
    let toml = format!(
        "{}{}{extra}",
        catalog_toml(("gold", 100_000.0, 100_000.0), &["acme"]),
        route_toml("orders", "/orders", upstreams),
    );
    TestGateway::spawn(settings(&toml)).await
}

/// The sum of every series of metric family `name`.
async fn total(gw: &TestGateway, name: &str) -> f64 {
    let text = gw
        .http
        .get(format!("{}/metrics", gw.address))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn post(gw: &TestGateway, body: &'static str) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{}/orders", gw.address))
        .header("x-api-key", key("acme"))
        .body(body)
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn one_dead_replica_of_three_costs_no_request_and_is_set_aside() {
    let (a, b) = (
        Upstream::start(Behaviour::Echo).await,
        Upstream::start(Behaviour::Echo).await,
    );
    let gw = gateway(&[a.url(), dead(), b.url()], "").await;

    for _ in 0..90 {
        let r = gw.get("/orders", Some(&key("acme"))).await;
        assert_eq!(r.status(), 200);
    }
    // A refused connection sent nothing: a POST goes elsewhere too, body intact.
    for _ in 0..30 {
        let r = post(&gw, "an order").await;
        assert_eq!(r.status(), 200);
        assert_eq!(r.text().await.unwrap(), "an order");
    }
    assert_eq!(a.hits() + b.hits(), 120);
    // Ejected after three refusals in a row, so few requests were retried.
    assert!(total(&gw, "tollgate_upstream_ejections_total").await >= 1.0);
    let retries = gw
        .metric("tollgate_upstream_retries_total{service=\"orders\"}")
        .await
        .unwrap();
    assert!((3.0..20.0).contains(&retries), "{retries} retries");
    // One decision per request, however many tries.
    assert_eq!(
        gw.metric("tollgate_decisions_total{outcome=\"allowed\"}")
            .await
            .unwrap(),
        120.0
    );
}

#[tokio::test]
async fn a_hanging_replica_costs_its_first_few_requests_not_a_third() {
    let (a, b) = (
        Upstream::start(Behaviour::Echo).await,
        Upstream::start(Behaviour::Echo).await,
    );
    let hung = Upstream::start(Behaviour::Slow(Duration::from_secs(30))).await;
    let toml = format!(
        "{}[[routes]]\nservice = \"orders\"\nprefix = \"/orders\"\nupstreams = [{:?}, {:?}, {:?}]\ntimeout_ms = 300\n",
        catalog_toml(("gold", 100_000.0, 100_000.0), &["acme"]),
        a.url(),
        hung.url(),
        b.url()
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    let mut waited = 0;
    for _ in 0..30 {
        let started = Instant::now();
        let r = gw.get("/orders", Some(&key("acme"))).await;
        if r.status() == 504 {
            waited += 1;
            assert!(started.elapsed() >= Duration::from_millis(300));
        } else {
            assert_eq!(r.status(), 200);
        }
    }
    // Round-robin sent it 10 of 30; ejected after three timeouts in a row.
    assert!(
        waited <= 3,
        "{waited} requests waited for the hanging replica"
    );
    assert_eq!(hung.hits(), waited);
}

#[tokio::test]
async fn with_every_replica_ejected_requests_still_spread_over_all() {
    let (p, q) = (free_port().unwrap(), free_port().unwrap());
    let urls = [p, q].map(|p| format!("http://127.0.0.1:{p}"));
    let gw = gateway(&urls, "[upstream]\neject_after = 1\nejection_ms = 60000\n").await;
    // Both refuse: both ejected for a minute.
    for _ in 0..4 {
        assert_eq!(gw.get("/orders", Some(&key("acme"))).await.status(), 502);
    }
    assert_eq!(total(&gw, "tollgate_upstream_replica_ejected").await, 2.0);

    // One comes back while still ejected: it is found (Envoy's panic mode), not 502.
    let back = Upstream::start_at(q, Behaviour::Echo).await;
    for _ in 0..10 {
        assert_eq!(gw.get("/orders", Some(&key("acme"))).await.status(), 200);
    }
    assert_eq!(back.hits(), 10);
}

#[tokio::test]
async fn a_spent_retry_budget_answers_the_failed_try() {
    // One replica closes every connection without answering (the request may have
    // reached it: a retry is the budget's to allow), the other answers.
    let closes = RawService::start(None, Arc::new(|_| (Vec::new(), true)));
    let a = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(
        &[closes.url(), a.url()],
        "[upstream]\neject_after = 0\nretry_budget_percent = 0\nretry_min_concurrency = 0\n",
    )
    .await;
    let mut statuses = Vec::new();
    for _ in 0..20 {
        statuses.push(
            gw.get("/orders", Some(&key("acme")))
                .await
                .status()
                .as_u16(),
        );
    }
    // Each pick of the closing replica is answered 502, not retried.
    let failed = statuses.iter().filter(|s| **s == 502).count();
    assert!(failed > 0, "{statuses:?}");
    assert_eq!(failed + a.hits(), 20);
    assert_eq!(
        gw.metric("tollgate_upstream_retries_refused_total{service=\"orders\"}")
            .await
            .unwrap(),
        failed as f64
    );
    assert_eq!(
        gw.metric("tollgate_upstream_retries_total{service=\"orders\"}")
            .await
            .unwrap(),
        0.0
    );
}

/// A service on a raw socket, a thread per connection: reads each request head (and a
/// `Content-Length` body), answers with `answer(head)`'s bytes, and closes the connection
/// when it says so, or, given `idle_close`, when a request comes on a connection idle for
/// longer: unanswered, as a service closing an idle connection just as the request crosses
/// its close (the keep-alive race, made certain).
pub(crate) struct RawService {
    port: u16,
    requests: Arc<AtomicUsize>,
}

pub(crate) type Answer = dyn Fn(&str) -> (Vec<u8>, bool) + Send + Sync;

impl RawService {
    pub(crate) fn start(idle_close: Option<Duration>, answer: Arc<Answer>) -> RawService {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let requests = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&requests);
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { return };
                let (answer, counted) = (Arc::clone(&answer), Arc::clone(&counted));
                std::thread::spawn(move || {
                    let mut buf = Vec::new();
                    let mut answered: Option<Instant> = None;
                    loop {
                        let head_end = loop {
                            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                                break i + 4;
                            }
                            let mut chunk = [0u8; 16 * 1024];
                            match conn.read(&mut chunk) {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                        };
                        if let (Some(idle), Some(at)) = (idle_close, answered) {
                            if at.elapsed() > idle {
                                return;
                            }
                        }
                        let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
                        buf.drain(..head_end);
                        let len = head
                            .lines()
                            .find_map(|l| {
                                let (k, v) = l.split_once(':')?;
                                k.eq_ignore_ascii_case("content-length")
                                    .then(|| v.trim().parse::<usize>().ok())?
                            })
                            .unwrap_or(0);
                        counted.fetch_add(1, Ordering::SeqCst);
                        let (bytes, close) = answer(&head);
                        if close && len > buf.len() {
                            // Closed with the body unread: the kernel resets the connection.
                            return;
                        }
                        while buf.len() < len {
                            let mut chunk = [0u8; 16 * 1024];
                            match conn.read(&mut chunk) {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                        }
                        buf.drain(..len);
                        if conn.write_all(&bytes).is_err() || close {
                            return;
                        }
                        answered = Some(Instant::now());
                    }
                });
            }
        });
        RawService { port, requests }
    }

    pub(crate) fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub(crate) fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }
}

fn ok() -> Arc<Answer> {
    Arc::new(|_| {
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok".to_vec(),
            false,
        )
    })
}

#[tokio::test]
async fn a_replica_closing_idle_connections_costs_no_request() {
    // Each replica closes a connection idle for more than 100 ms when the next request
    // comes on it, unanswered (Node.js closes after 5 s idle): a gateway that reuses such a
    // connection loses the request. The gateway retires its idle connections first.
    let replicas: Vec<RawService> = (0..3)
        .map(|_| RawService::start(Some(Duration::from_millis(100)), ok()))
        .collect();
    let urls: Vec<String> = replicas.iter().map(RawService::url).collect();
    let gw = gateway(&urls, "[upstream]\nidle_timeout_ms = 60\n").await;
    let mut failed = Vec::new();
    for i in 0..60 {
        let r = gw.get("/orders", Some(&key("acme"))).await;
        if r.status() != 200 {
            failed.push((i, r.status().as_u16()));
        }
        tokio::time::sleep(Duration::from_millis(70 + 10 * (i % 6))).await;
    }
    assert!(failed.is_empty(), "{failed:?}");
}

#[tokio::test]
async fn a_request_that_crosses_a_closing_connection_is_tried_again() {
    // The same race when the gateway keeps connections longer than one replica does: the
    // try on the reused connection got no response byte, so the GET is made again, even
    // with no retry budget at all, and the replica is not blamed for it.
    let closing = RawService::start(Some(Duration::from_millis(50)), ok());
    let steady = RawService::start(None, ok());
    let gw = gateway(
        &[closing.url(), steady.url()],
        "[upstream]\neject_after = 1\nretry_budget_percent = 0\nretry_min_concurrency = 0\n",
    )
    .await;
    for _ in 0..30 {
        assert_eq!(gw.get("/orders", Some(&key("acme"))).await.status(), 200);
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    assert!(
        gw.metric("tollgate_upstream_retries_total{service=\"orders\"}")
            .await
            .unwrap()
            > 0.0,
        "no request crossed a close"
    );
    assert_eq!(total(&gw, "tollgate_upstream_ejections_total").await, 0.0);
}

#[tokio::test]
async fn a_rolling_restart_costs_no_get() {
    let mut replicas = Vec::new();
    for _ in 0..3 {
        replicas.push(Upstream::start(Behaviour::Echo).await);
    }
    let urls: Vec<String> = replicas.iter().map(Upstream::url).collect();
    let gw = Arc::new(gateway(&urls, "").await);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut clients = Vec::new();
    for _ in 0..4 {
        let (gw, stop) = (Arc::clone(&gw), Arc::clone(&stop));
        clients.push(tokio::spawn(async move {
            let mut statuses = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                statuses.push(
                    gw.get("/orders", Some(&key("acme")))
                        .await
                        .status()
                        .as_u16(),
                );
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            statuses
        }));
    }
    // Each replica stopped, started again where it was 300 ms later, one after another.
    for _ in 0..3 {
        let replica = replicas.remove(0);
        let port = replica.port;
        replica.stop().await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        replicas.push(Upstream::start_at(port, Behaviour::Echo).await);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.store(true, Ordering::SeqCst);
    let mut statuses = Vec::new();
    for c in clients {
        statuses.extend(c.await.unwrap());
    }
    let failed = statuses.iter().filter(|s| **s != 200).count();
    assert!(statuses.len() > 100, "{} requests", statuses.len());
    let odd: Vec<_> = statuses.iter().filter(|s| **s != 200).collect();
    assert_eq!(failed, 0, "{failed} of {} failed: {odd:?}", statuses.len());
}

#[tokio::test]
async fn a_reset_mid_body_is_retried_only_when_the_body_was_kept_and_the_method_allows() {
    // One replica reads a request's head and resets the connection with its body unread;
    // the other answers.
    let resets = RawService::start(None, Arc::new(|_| (Vec::new(), true)));
    let answers = RawService::start(
        None,
        Arc::new(|_| {
            (
                b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok".to_vec(),
                false,
            )
        }),
    );
    let gw = gateway(
        &[resets.url(), answers.url()],
        "[upstream]\neject_after = 0\n",
    )
    .await;
    let send = |method: reqwest::Method, body: Vec<u8>| {
        let gw = &gw;
        async move {
            gw.http
                .request(method, format!("{}/orders", gw.address))
                .header("x-api-key", key("acme"))
                .body(body)
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    // A small PUT (kept whole, idempotent): tried again on the other replica.
    for _ in 0..10 {
        assert_eq!(send(reqwest::Method::PUT, vec![b'x'; 1000]).await, 200);
    }
    // A POST may have reached the service: never sent twice.
    let posts: Vec<u16> = futures_util::future::join_all(
        (0..10).map(|_| send(reqwest::Method::POST, vec![b'x'; 1000])),
    )
    .await;
    let reset_posts = posts.iter().filter(|s| **s == 502).count();
    assert_eq!(
        reset_posts + posts.iter().filter(|s| **s == 200).count(),
        10
    );
    // A large PUT (streamed, past replay_body_bytes): its body is gone once sent.
    let large: Vec<u16> = futures_util::future::join_all(
        (0..6).map(|_| send(reqwest::Method::PUT, vec![b'x'; 1 << 20])),
    )
    .await;
    assert!(large.iter().all(|s| *s == 200 || *s == 502), "{large:?}");
    // Every request reached a service once, or twice only when it could be sent again.
    assert!(resets.requests() > 0 && answers.requests() >= 10);
}

#[tokio::test]
async fn interim_and_oddly_framed_answers_reach_the_client_by_the_book() {
    let service = RawService::start(
        None,
        Arc::new(|head: &str| {
            let path = head.split(' ').nth(1).unwrap_or("").to_string();
            let bytes: &[u8] = match path.as_str() {
                "/orders/early-hints" => b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfinal",
                "/orders/not-modified" => b"HTTP/1.1 304 Not Modified\r\nContent-Length: 10\r\nETag: \"v1\"\r\n\r\n",
                "/orders/no-content" => b"HTTP/1.1 204 No Content\r\n\r\n",
                "/orders/close-delimited" => {
                    b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nread until the service closes"
                }
                "/orders/both" => b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
                _ => b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
            };
            (bytes.to_vec(), path == "/orders/close-delimited")
        }),
    );
    let gw = gateway(&[service.url()], "").await;
    let acme = key("acme");
    let get = |path: &'static str| gw.get(path, Some(&acme));

    let r = get("/orders/early-hints").await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), "final");
    for _ in 0..3 {
        // The client's connection stays usable after a 304 that declares a length.
        let r = get("/orders/not-modified").await;
        assert_eq!(r.status(), 304);
        assert_eq!(r.headers()["etag"], "\"v1\"");
        assert_eq!(get("/orders/plain").await.text().await.unwrap(), "ok");
    }
    let r = get("/orders/no-content").await;
    assert_eq!(r.status(), 204);
    assert_eq!(r.text().await.unwrap(), "");
    let r = get("/orders/close-delimited").await;
    assert_eq!(r.text().await.unwrap(), "read until the service closes");
    let r = get("/orders/both").await;
    assert_eq!(r.text().await.unwrap(), "hello");
    assert_eq!(get("/orders/plain").await.text().await.unwrap(), "ok");
}

#[tokio::test]
async fn a_hanging_replica_gets_few_of_many_concurrent_requests() {
    let (a, b) = (
        Upstream::start(Behaviour::Echo).await,
        Upstream::start(Behaviour::Echo).await,
    );
    let hung = Upstream::start(Behaviour::Slow(Duration::from_secs(30))).await;
    let toml = format!(
        "{}[[routes]]\nservice = \"orders\"\nprefix = \"/orders\"\nupstreams = [{:?}, {:?}, {:?}]\ntimeout_ms = 500\n[upstream]\neject_after = 0\n",
        catalog_toml(("gold", 100_000.0, 100_000.0), &["acme"]),
        a.url(),
        hung.url(),
        b.url()
    );
    let gw = Arc::new(TestGateway::spawn(settings(&toml)).await);
    // Eight clients for 1.5 s, without ejection: only least-request keeps the hanging
    // replica's share down (round-robin would send it a third of everything).
    let until = Instant::now() + Duration::from_millis(1500);
    let clients: Vec<_> = (0..8)
        .map(|_| {
            let gw = Arc::clone(&gw);
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                while Instant::now() < until {
                    statuses.push(
                        gw.get("/orders", Some(&key("acme")))
                            .await
                            .status()
                            .as_u16(),
                    );
                }
                statuses
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for c in clients {
        statuses.extend(c.await.unwrap());
    }
    let waited = statuses.iter().filter(|s| **s == 504).count();
    assert!(statuses.len() > 200, "{} requests", statuses.len());
    // Each request sent to it waits 500 ms. Least-request compares it with another replica
    // on every pick, and while it holds a request it loses every comparison: it gets one
    // request at a time, not a third of them.
    assert!(
        waited * 20 < statuses.len(),
        "{waited} of {} waited",
        statuses.len()
    );
}

/// Sends `bytes` on a fresh connection to the gateway, then reads until it closes or
/// `within` passes.
async fn raw_exchange(gw: &TestGateway, bytes: &[u8], half_close: bool) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = gw.address.trim_start_matches("http://");
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(bytes).await.unwrap();
    if half_close {
        conn.shutdown().await.unwrap();
    }
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(3), conn.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).to_string()
}

#[tokio::test]
async fn a_client_that_breaks_its_own_body_gets_400_and_the_service_is_not_blamed() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&[up.url()], "").await;
    let k = key("acme");
    for declared in [1000, 200_000] {
        // Declares `declared` bytes, sends ten, and ends its side of the connection.
        let head = format!(
            "POST /orders HTTP/1.1\r\nHost: gw\r\nx-api-key: {k}\r\nContent-Length: {declared}\r\n\r\n0123456789"
        );
        let answer = raw_exchange(&gw, head.as_bytes(), true).await;
        assert!(answer.starts_with("HTTP/1.1 400"), "{declared}: {answer}");
    }
    assert_eq!(
        total(&gw, "tollgate_upstream_requests_total").await,
        0.0,
        "a client's broken body counted as the service's answer"
    );
}

#[tokio::test]
async fn a_body_that_stalls_gets_408_and_holds_nothing_for_long() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&[up.url()], "[upstream]\nbody_timeout_ms = 300\n").await;
    let k = key("acme");
    for declared in [1000, 200_000] {
        // Declares `declared` bytes, sends ten, then nothing, keeping its side open.
        let head = format!(
            "POST /orders HTTP/1.1\r\nHost: gw\r\nx-api-key: {k}\r\nContent-Length: {declared}\r\n\r\n0123456789"
        );
        let started = Instant::now();
        let answer = raw_exchange(&gw, head.as_bytes(), false).await;
        assert!(answer.starts_with("HTTP/1.1 408"), "{declared}: {answer}");
        // Answered at the body timeout, and the connection closed within the linger.
        assert!(
            started.elapsed() < Duration::from_millis(2500),
            "{declared}"
        );
    }
    assert_eq!(total(&gw, "tollgate_upstream_requests_total").await, 0.0);
}
