//! `https://` replicas (the book, "Upstreams"): verified against `upstream.ca_file`, SNI from
//! the replica's host, a certificate that fails answered `502` with no detail of why, the
//! wire's fixes (interim responses, `304`) above TLS, pooled TLS connections reused, health
//! checks over TLS, and https routes through a reload.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::helpers::*;
use crate::reload::reload;

/// A certificate authority made for one test.
struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A certificate and its key, as a TLS service presents them.
struct Leaf {
    cert: CertificateDer<'static>,
    key: PrivateKeyDer<'static>,
}

impl TestCa {
    /// A CA named `name` (two CAs of one name would fail as a bad signature, not as an
    /// unknown issuer).
    fn new(name: &str) -> TestCa {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        TestCa { issuer }
    }

    /// A leaf for `names` (DNS names or IP addresses), valid now.
    fn leaf(&self, names: &[&str]) -> Leaf {
        self.sign(
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .unwrap(),
        )
    }

    /// A leaf for `names` that expired in 2021.
    fn expired_leaf(&self, names: &[&str]) -> Leaf {
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .unwrap();
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        self.sign(params)
    }

    fn sign(&self, params: CertificateParams) -> Leaf {
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &*self.issuer).unwrap();
        Leaf {
            cert: cert.der().clone(),
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        }
    }

    /// The CA's certificate in a PEM file of its own.
    fn pem_file(&self) -> PathBuf {
        let dir = tempfile::tempdir().unwrap().keep();
        let file = dir.join("ca.pem");
        std::fs::write(&file, self.issuer.pem()).unwrap();
        file
    }

    /// `[upstream]` trusting this CA only, and `extra` upstream settings.
    fn upstream_toml(&self, extra: &str) -> String {
        format!("[upstream]\nca_file = {:?}\n{extra}", self.pem_file())
    }
}

/// One TLS handshake a service completed.
#[derive(Debug, Clone)]
struct Handshake {
    sni: Option<String>,
    alpn: Option<Vec<u8>>,
}

/// What a [`TlsService`] answers the `n`th request (from 0) it reads with, and what it
/// does with the connection after.
type Script = dyn Fn(usize, &str) -> (Vec<u8>, Then) + Send + Sync;

/// What a [`TlsService`] does with a connection after an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Then {
    KeepOpen,
    /// Ends TLS (`close_notify`), then the TCP connection.
    CloseNotify,
    /// Closes the TCP connection without ending TLS: a cut, as far as TLS can tell.
    Cut,
}
use Then::*;

/// An HTTPS service on a raw socket, so a test controls every byte it answers: each
/// connection is TLS (`leaf`, ALPN `http/1.1`), each request head read in turn and answered
/// with the script's bytes. Counts TCP accepts and records each handshake and head.
struct TlsService {
    port: u16,
    accepted: Arc<AtomicUsize>,
    handshakes: Arc<Mutex<Vec<Handshake>>>,
    heads: Arc<Mutex<Vec<String>>>,
}

impl TlsService {
    async fn start(leaf: Leaf, script: Arc<Script>) -> TlsService {
        TlsService::start_with(leaf, rustls::DEFAULT_VERSIONS, script).await
    }

    /// [`TlsService::start`] speaking only the TLS `versions`.
    async fn start_with(
        leaf: Leaf,
        versions: &[&'static rustls::SupportedProtocolVersion],
        script: Arc<Script>,
    ) -> TlsService {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(versions)
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![leaf.cert], leaf.key)
            .unwrap();
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let service = TlsService {
            port,
            accepted: Arc::default(),
            handshakes: Arc::default(),
            heads: Arc::default(),
        };
        let (accepted, handshakes, heads) = (
            Arc::clone(&service.accepted),
            Arc::clone(&service.handshakes),
            Arc::clone(&service.heads),
        );
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                accepted.fetch_add(1, Ordering::SeqCst);
                let (acceptor, handshakes, heads, script) = (
                    acceptor.clone(),
                    Arc::clone(&handshakes),
                    Arc::clone(&heads),
                    Arc::clone(&script),
                );
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let session = tls.get_ref().1;
                    handshakes.lock().unwrap().push(Handshake {
                        sni: session.server_name().map(str::to_owned),
                        alpn: session.alpn_protocol().map(<[u8]>::to_vec),
                    });
                    let mut buf = Vec::new();
                    loop {
                        let end = loop {
                            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                                break i + 4;
                            }
                            let mut chunk = [0u8; 4096];
                            match tls.read(&mut chunk).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                        };
                        let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                        buf.drain(..end);
                        let n = {
                            let mut heads = heads.lock().unwrap();
                            heads.push(head.clone());
                            heads.len() - 1
                        };
                        let (answer, then) = script(n, &head);
                        if tls.write_all(&answer).await.is_err() {
                            return;
                        }
                        let _ = tls.flush().await;
                        match then {
                            KeepOpen => {}
                            CloseNotify => {
                                let _ = tls.shutdown().await;
                                return;
                            }
                            Cut => return,
                        }
                    }
                });
            }
        });
        service
    }

    /// A service answering every request `200` with `body`.
    async fn ok(leaf: Leaf, body: &'static str) -> TlsService {
        TlsService::start(leaf, Arc::new(move |_, _| (ok(body), KeepOpen))).await
    }

    fn url(&self, host: &str) -> String {
        format!("https://{host}:{}", self.port)
    }

    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    fn handshakes(&self) -> Vec<Handshake> {
        self.handshakes.lock().unwrap().clone()
    }

    fn heads(&self) -> Vec<String> {
        self.heads.lock().unwrap().clone()
    }
}

fn ok(body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// The value of `name` in a request head (names compared in any case).
fn field<'h>(head: &'h str, name: &str) -> Option<&'h str> {
    head.lines().find_map(|line| {
        let (n, v) = line.split_once(':')?;
        n.eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// A gateway with one route `/orders` to `upstreams`, under `[upstream]` section `upstream`.
async fn gateway(upstreams: &[String], upstream: &str) -> TestGateway {
    let toml = format!(
        "{}{}{upstream}",
        catalog_toml(("gold", 100_000.0, 100_000.0), &["acme"]),
        route_toml("orders", "/orders", upstreams),
    );
    TestGateway::spawn(settings(&toml)).await
}

/// Asserts `r` is the `502` of a replica whose TLS failed (`detail`), and shows nothing of
/// rustls's reason, in its body or its headers.
async fn assert_upstream_tls_502(r: reqwest::Response, detail: &str) {
    assert_eq!(r.status(), 502);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    let headers = format!("{:?}", r.headers());
    let body = r.text().await.unwrap();
    let problem: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        problem["type"],
        "https://tollgate.dev/problems/upstream-tls"
    );
    assert_eq!(problem["detail"], detail);
    for text in [&body, &headers] {
        for internal in [
            "rustls",
            "UnknownIssuer",
            "NotValidForName",
            "Expired",
            "invalid peer",
            "localhost",
            "127.0.0.1",
        ] {
            assert!(!text.contains(internal), "{internal} in {text}");
        }
    }
}

const NOT_VERIFIED: &str = "the upstream service's TLS certificate could not be verified";

#[tokio::test]
async fn a_request_reaches_an_https_replica_verified_by_the_configured_ca() {
    let ca = TestCa::new("tollgate test CA");
    let service = TlsService::ok(ca.leaf(&["localhost", "127.0.0.1"]), "over tls").await;
    let toml = format!(
        "{}{}{}{}",
        catalog_toml(("gold", 100_000.0, 100_000.0), &["acme"]),
        route_toml("named", "/named", &[service.url("localhost")]),
        route_toml("addressed", "/addressed", &[service.url("127.0.0.1")]),
        ca.upstream_toml(""),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;

    let r = gw.get("/named/a?b=1", Some(&key("acme"))).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), "over tls");
    let r = gw.get("/addressed", Some(&key("acme"))).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), "over tls");

    let heads = service.heads();
    assert!(
        heads[0].starts_with("GET /named/a?b=1 HTTP/1.1\r\n"),
        "{heads:?}"
    );
    assert_eq!(
        field(&heads[0], "host"),
        Some(format!("localhost:{}", service.port).as_str())
    );
    assert_eq!(
        field(&heads[1], "host"),
        Some(format!("127.0.0.1:{}", service.port).as_str())
    );
    // SNI names the host; an address is not sent (RFC 6066 §3), and is verified against
    // the certificate's IP addresses. ALPN: HTTP/1.1, though the service offers h2 first.
    let handshakes = service.handshakes();
    assert_eq!(handshakes.len(), 2, "{handshakes:?}");
    assert_eq!(handshakes[0].sni.as_deref(), Some("localhost"));
    assert_eq!(handshakes[1].sni, None);
    for h in &handshakes {
        assert_eq!(h.alpn.as_deref(), Some(&b"http/1.1"[..]));
    }
}

#[tokio::test]
async fn replicas_speaking_only_tls_1_2_or_only_tls_1_3_are_reached() {
    let ca = TestCa::new("tollgate test CA");
    for version in [&rustls::version::TLS12, &rustls::version::TLS13] {
        let service = TlsService::start_with(
            ca.leaf(&["localhost"]),
            &[version],
            Arc::new(|_, _| (ok("either"), KeepOpen)),
        )
        .await;
        let gw = gateway(&[service.url("localhost")], &ca.upstream_toml("")).await;
        let r = gw.get("/orders", Some(&key("acme"))).await;
        assert_eq!(r.status(), 200, "{version:?}");
        assert_eq!(r.text().await.unwrap(), "either");
        gw.stop().await;
    }
}

#[tokio::test]
async fn a_replica_whose_certificate_another_ca_signed_gets_502_and_the_reason_goes_to_the_log() {
    let (ca, other) = (TestCa::new("tollgate test CA"), TestCa::new("another CA"));
    let service = TlsService::ok(other.leaf(&["localhost", "127.0.0.1"]), "unseen").await;
    let toml = format!(
        "{}{}{}",
        catalog_toml(("gold", 100_000.0, 100_000.0), &["acme"]),
        route_toml("orders", "/orders", &[service.url("localhost")]),
        ca.upstream_toml(""),
    );
    let gw = gateway_process(&toml, &[("NO_COLOR", "1")]);

    let r = reqwest::Client::new()
        .get(format!("{}/orders", gw.address))
        .header("x-api-key", key("acme"))
        .send()
        .await
        .unwrap();
    assert_upstream_tls_502(r, NOT_VERIFIED).await;
    assert!(
        service.heads().is_empty(),
        "a request crossed an unverified connection"
    );
    assert!(service.accepted() >= 1);

    // The operator's log has the reason and the replica.
    let log = std::fs::read_to_string(gw.dir().join("gateway.log")).unwrap_or_default();
    let line = log
        .lines()
        .find(|l| l.contains("upstream TLS handshake failed"))
        .unwrap_or_else(|| panic!("no WARN in {log}"));
    assert!(line.contains("WARN"), "{line}");
    assert!(line.contains("UnknownIssuer"), "{line}");
    assert!(line.contains(&service.url("localhost")), "{line}");
}

#[tokio::test]
async fn a_certificate_for_another_name_or_expired_gets_502() {
    let ca = TestCa::new("tollgate test CA");
    let wrong_name = TlsService::ok(ca.leaf(&["service.internal", "10.9.9.9"]), "unseen").await;
    let expired = TlsService::ok(ca.expired_leaf(&["localhost"]), "unseen").await;
    for (service, host) in [
        (&wrong_name, "localhost"),
        (&wrong_name, "127.0.0.1"),
        (&expired, "localhost"),
    ] {
        let gw = gateway(&[service.url(host)], &ca.upstream_toml("")).await;
        let r = gw.get("/orders", Some(&key("acme"))).await;
        assert_upstream_tls_502(r, NOT_VERIFIED).await;
        gw.stop().await;
    }
    assert!(wrong_name.heads().is_empty() && expired.heads().is_empty());
}

#[tokio::test]
async fn a_replica_that_does_not_speak_tls_gets_502_upstream_tls() {
    let ca = TestCa::new("tollgate test CA");
    let plain = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(
        &[format!("https://127.0.0.1:{}", plain.port)],
        &ca.upstream_toml(""),
    )
    .await;
    let r = gw.get("/orders", Some(&key("acme"))).await;
    assert_upstream_tls_502(
        r,
        "no TLS connection to the upstream service could be established",
    )
    .await;
    assert_eq!(plain.hits(), 0);
}

#[tokio::test]
async fn early_hints_and_not_modified_are_read_right_over_tls() {
    let ca = TestCa::new("tollgate test CA");
    let service = TlsService::start(
        ca.leaf(&["localhost"]),
        Arc::new(|n, _| {
            let answer = match n {
                0 => [
                    &b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n"[..],
                    &ok("final")[..],
                ]
                .concat(),
                // A body it announces but may not have (RFC 9112 §6.3): awc would wait.
                1 => b"HTTP/1.1 304 Not Modified\r\nETag: \"v1\"\r\nContent-Length: 10\r\n\r\n"
                    .to_vec(),
                _ => ok("after"),
            };
            (answer, KeepOpen)
        }),
    )
    .await;
    let toml = format!(
        "{}[[routes]]\nservice = \"orders\"\nprefix = \"/orders\"\nupstreams = [{:?}]\ntimeout_ms = 2000\n{}",
        catalog_toml(("gold", 100_000.0, 100_000.0), &["acme"]),
        service.url("localhost"),
        ca.upstream_toml(""),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;

    let r = gw.get("/orders", Some(&key("acme"))).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), "final");
    let r = gw.get("/orders", Some(&key("acme"))).await;
    assert_eq!(r.status(), 304);
    assert_eq!(r.headers()["etag"], "\"v1\"");
    assert_eq!(r.text().await.unwrap(), "");
    let r = gw.get("/orders", Some(&key("acme"))).await;
    assert_eq!(r.text().await.unwrap(), "after");
    // One connection carried all three: the 103 and the 304 left it in step.
    assert_eq!(service.accepted(), 1);
}

#[tokio::test]
async fn a_body_delimited_by_the_close_ends_at_close_notify_and_a_cut_one_is_an_error() {
    let ca = TestCa::new("tollgate test CA");
    let body: String = (0..100_000)
        .map(|i| (b'a' + (i % 26) as u8) as char)
        .collect();
    let sent = body.clone();
    let service = TlsService::start(
        ca.leaf(&["localhost"]),
        Arc::new(move |n, _| match n {
            0 => {
                let head = "HTTP/1.1 200 OK\r\nConnection: keep-alive\r\n\r\n";
                (format!("{head}{sent}").into_bytes(), CloseNotify)
            }
            // Neither a length nor TLS's end: it may have been cut short.
            1 => (b"HTTP/1.1 200 OK\r\n\r\nthe start".to_vec(), Cut),
            _ => (ok("fresh"), KeepOpen),
        }),
    )
    .await;
    let gw = gateway(&[service.url("localhost")], &ca.upstream_toml("")).await;

    let r = gw.get("/orders", Some(&key("acme"))).await;
    assert_eq!(r.status(), 200);
    let got = r.text().await.unwrap();
    assert_eq!(got.len(), body.len());
    assert!(got == body, "the body read differs from the one sent");
    // The client's response ends in an error (its head may not even have left).
    let cut = gw
        .http
        .get(format!("{}/orders", gw.address))
        .header("x-api-key", key("acme"))
        .send()
        .await;
    if let Ok(r) = cut {
        assert!(r.text().await.is_err(), "a cut body was forwarded as whole");
    }
    let r = gw.get("/orders", Some(&key("acme"))).await;
    assert_eq!(r.text().await.unwrap(), "fresh");
    assert_eq!(service.accepted(), 3);
}

#[tokio::test]
async fn pooled_tls_connections_are_reused() {
    let ca = TestCa::new("tollgate test CA");
    let service = TlsService::ok(ca.leaf(&["localhost"]), "pooled").await;
    let gw = gateway(&[service.url("localhost")], &ca.upstream_toml("")).await;
    for _ in 0..10 {
        let r = gw.get("/orders", Some(&key("acme"))).await;
        assert_eq!(r.text().await.unwrap(), "pooled");
    }
    assert_eq!(service.heads().len(), 10);
    assert_eq!(service.accepted(), 1);
    assert_eq!(service.handshakes().len(), 1);
}

#[tokio::test]
async fn a_replica_whose_certificate_fails_is_tried_around_and_set_aside() {
    let (ca, other) = (TestCa::new("tollgate test CA"), TestCa::new("another CA"));
    let bad = TlsService::ok(other.leaf(&["localhost"]), "unseen").await;
    let good = TlsService::ok(ca.leaf(&["localhost"]), "good").await;
    let gw = gateway(
        &[bad.url("localhost"), good.url("localhost")],
        &ca.upstream_toml(""),
    )
    .await;
    for _ in 0..20 {
        let r = gw.get("/orders", Some(&key("acme"))).await;
        assert_eq!(r.status(), 200);
        assert_eq!(r.text().await.unwrap(), "good");
    }
    assert!(bad.heads().is_empty());
    let ejected = format!(
        "tollgate_upstream_ejections_total{{service=\"orders\",replica=\"{}\"}}",
        bad.url("localhost")
    );
    assert!(gw.sample(&ejected).await >= 1.0);
    let tls_failures = |replica: String| {
        format!("tollgate_upstream_tls_failures_total{{service=\"orders\",replica=\"{replica}\"}}")
    };
    assert!(gw.sample(&tls_failures(bad.url("localhost"))).await >= 1.0);
    assert_eq!(gw.sample(&tls_failures(good.url("localhost"))).await, 0.0);
}

#[tokio::test]
async fn the_tls_handshake_is_bounded_by_the_connect_timeout() {
    // Accepts connections and never says a word: the handshake never ends.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr: SocketAddr = silent.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in silent.incoming() {
            held.push(conn);
        }
    });
    let ca = TestCa::new("tollgate test CA");
    let toml = format!(
        "{}[[routes]]\nservice = \"orders\"\nprefix = \"/orders\"\nupstreams = [\"https://localhost:{}\"]\ntimeout_ms = 10000\n{}",
        catalog_toml(("gold", 100_000.0, 100_000.0), &["acme"]),
        addr.port(),
        ca.upstream_toml("connect_timeout_ms = 200\nmax_tries = 1\n"),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    let started = Instant::now();
    let r = gw.get("/orders", Some(&key("acme"))).await;
    assert_eq!(r.status(), 504);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn https_replicas_are_health_checked_over_tls_verified() {
    let (ca, other) = (TestCa::new("tollgate test CA"), TestCa::new("another CA"));
    let good = TlsService::ok(ca.leaf(&["localhost"]), "ok").await;
    let bad = TlsService::ok(other.leaf(&["localhost"]), "ok").await;
    let toml = format!(
        "{}{}[routes.health_check]\npath = \"/healthz\"\ninterval_ms = 100\nunhealthy_after = 1\nhealthy_after = 1\n{}",
        catalog_toml(("gold", 100_000.0, 100_000.0), &["acme"]),
        route_toml("orders", "/orders", &[good.url("localhost"), bad.url("localhost")]),
        ca.upstream_toml(""),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    let healthy = |replica: String| {
        format!("tollgate_upstream_replica_healthy{{service=\"orders\",replica=\"{replica}\"}}")
    };
    eventually(
        Duration::from_secs(5),
        "the verified replica passes its checks, the other fails them",
        || async {
            gw.metric(&healthy(bad.url("localhost"))).await == Some(0.0) && good.heads().len() >= 2
        },
    )
    .await;
    assert_eq!(gw.sample(&healthy(good.url("localhost"))).await, 1.0);
    let check = &good.heads()[0];
    assert!(check.starts_with("GET /healthz HTTP/1.1\r\n"), "{check}");
    assert_eq!(field(check, "user-agent"), Some("tollgate-health-check"));
    assert!(bad.heads().is_empty());
    assert!(bad.accepted() >= 1);
}

#[tokio::test]
async fn a_reload_moves_a_route_to_an_https_replica() {
    let ca = TestCa::new("tollgate test CA");
    let plain = Upstream::start(Behaviour::Body("plain")).await;
    let secure = TlsService::ok(ca.leaf(&["localhost"]), "secure").await;
    let catalog = format!(
        "{}{}",
        catalog_toml(("gold", 100_000.0, 100_000.0), &["acme"]),
        ca.upstream_toml(""),
    );
    let old = format!(
        "{catalog}{}",
        route_toml("orders", "/orders", &[plain.url()])
    );
    let gw = gateway_process(&old, &[("NO_COLOR", "1")]);
    let get = || async {
        let r = reqwest::Client::new()
            .get(format!("{}/orders", gw.address))
            .header("x-api-key", key("acme"))
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    };
    assert_eq!(get().await, (200, "plain".to_string()));

    let new = format!(
        "{catalog}{}",
        route_toml("orders", "/orders", &[secure.url("localhost")])
    );
    reload(&gw, &old, &new);
    eventually(
        Duration::from_secs(5),
        "the route goes to the https replica",
        || async { get().await == (200, "secure".to_string()) },
    )
    .await;
    assert_eq!(secure.handshakes()[0].sni.as_deref(), Some("localhost"));
}

#[tokio::test]
async fn without_a_ca_file_the_bundle_ssl_cert_file_names_is_trusted() {
    let ca = TestCa::new("tollgate test CA");
    let service = TlsService::ok(ca.leaf(&["localhost"]), "over tls").await;
    let toml = format!(
        "{}{}",
        catalog_toml(("gold", 100_000.0, 100_000.0), &["acme"]),
        route_toml("named", "/named", &[service.url("localhost")]),
    );
    let bundle = ca.pem_file();
    let get = |address: String| async move {
        reqwest::Client::new()
            .get(format!("{address}/named"))
            .header("x-api-key", key("acme"))
            .send()
            .await
            .unwrap()
    };

    // The process's environment names the bundle, as a container's would.
    let trusting = gateway_process(&toml, &[("SSL_CERT_FILE", bundle.to_str().unwrap())]);
    let r = get(trusting.address.clone()).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), "over tls");
    // Without it, the system's bundle, which does not hold the test CA.
    let system = gateway_process(&toml, &[]);
    assert_upstream_tls_502(get(system.address.clone()).await, NOT_VERIFIED).await;
}
