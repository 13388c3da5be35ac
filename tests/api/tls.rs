//! TLS on the listeners: certificates chosen by SNI, loaded again when their files change
//! (or on `SIGHUP`) with no connection dropped, a bad file refused while the old
//! certificate keeps serving, the expiry gauge, and the admin listener's own certificate.
//! Certificates are made in the test (rcgen); clients are rustls over raw sockets (to see
//! the certificate and keep a connection across a reload) and curl.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::client::TlsStream;

use crate::helpers::*;

/// A test CA, and leaves it signs.
pub(crate) struct Ca {
    issuer: Issuer<'static, KeyPair>,
    /// Its certificate, PEM.
    pub(crate) pem: String,
}

/// A certificate and its key, in PEM, and the leaf's DER (to recognise it on the wire).
#[derive(Clone)]
pub(crate) struct Leaf {
    pub(crate) cert_pem: String,
    pub(crate) key_pem: String,
    der: Vec<u8>,
}

impl Ca {
    pub(crate) fn new() -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        // rcgen names every certificate alike; a leaf named as its issuer looks
        // self-signed to OpenSSL.
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "tollgate test CA");
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        Ca {
            pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    pub(crate) fn leaf(&self, names: &[&str]) -> Leaf {
        let params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .unwrap();
        let mut params = params;
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, names[0]);
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Leaf {
            cert_pem: format!("{}{}", cert.pem(), self.pem),
            key_pem: key.serialize_pem(),
            der: cert.der().to_vec(),
        }
    }
}

/// Where a certificate's files live: written as a deploy tool writes them (a new file
/// renamed over the old), so a reader never sees half of one.
pub(crate) struct Files {
    cert: PathBuf,
    key: PathBuf,
}

impl Files {
    pub(crate) fn write(dir: &Path, name: &str, leaf: &Leaf) -> Files {
        let files = Files {
            cert: dir.join(format!("{name}.crt")),
            key: dir.join(format!("{name}.key")),
        };
        files.replace(leaf);
        files
    }

    fn replace(&self, leaf: &Leaf) {
        replace(&self.key, &leaf.key_pem);
        replace(&self.cert, &leaf.cert_pem);
    }

    pub(crate) fn toml(&self) -> String {
        format!(
            "cert_file = \"{}\"\nkey_file = \"{}\"\n",
            self.cert.display(),
            self.key.display()
        )
    }
}

fn replace(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// A TLS connection to `addr`, naming `sni` (`None`: no name, as a client asking by IP
/// address), offering `http/1.1` by ALPN.
pub(crate) async fn connect(
    addr: SocketAddr,
    sni: Option<&str>,
) -> std::io::Result<TlsStream<tokio::net::TcpStream>> {
    connect_offering(addr, sni, &[b"http/1.1"]).await
}

/// [`connect`], offering `alpn`.
pub(crate) async fn connect_offering(
    addr: SocketAddr,
    sni: Option<&str>,
    alpn: &[&[u8]],
) -> std::io::Result<TlsStream<tokio::net::TcpStream>> {
    // Any certificate is taken (as `tollgate healthcheck` takes it): these tests look at
    // which one is served; verification is curl's test.
    let mut config = (*tollgate::tls::probe_client_config()).clone();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let name = match sni {
        Some(host) => ServerName::try_from(host.to_owned()).unwrap(),
        None => ServerName::IpAddress(addr.ip().into()),
    };
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
}

/// The leaf certificate `addr` serves to a client naming `sni`.
async fn served(addr: SocketAddr, sni: Option<&str>) -> Vec<u8> {
    let tls = connect(addr, sni).await.expect("TLS handshake");
    tls.get_ref().1.peer_certificates().unwrap()[0].to_vec()
}

/// One `GET path` on an open connection, kept alive: the status and the body.
pub(crate) async fn get(
    tls: &mut TlsStream<tokio::net::TcpStream>,
    path: &str,
) -> std::io::Result<(u16, String)> {
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: gw.test\r\nx-api-key: {}\r\n\r\n",
        key("acme")
    );
    tls.write_all(request.as_bytes()).await?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = tls.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&buf).to_string();
        let Some(end) = text.find("\r\n\r\n") else {
            continue;
        };
        let head = text[..end].to_ascii_lowercase();
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .map_or(0, |v| v.trim().parse().unwrap());
        if buf.len() >= end + 4 + len {
            let status = text[9..12].parse().unwrap();
            return Ok((status, text[end + 4..end + 4 + len].to_owned()));
        }
    }
}

/// curl with `args`, run beside the gateway (which serves on this test's runtime), for at
/// most 15 s.
async fn curl(args: &[&str]) -> std::process::Output {
    let run = tokio::process::Command::new("curl")
        .args(["-sS", "--max-time", "10"])
        .args(args)
        .kill_on_drop(true)
        .output();
    tokio::time::timeout(Duration::from_secs(15), run)
        .await
        .expect("curl ends")
        .expect("curl runs (Debian's curl package)")
}

pub(crate) fn addr_of(gw: &TestGateway) -> SocketAddr {
    gw.address.trim_start_matches("http://").parse().unwrap()
}

pub(crate) async fn metrics(addr: SocketAddr) -> String {
    let mut tls = connect(addr, None).await.unwrap();
    let (status, body) = get(&mut tls, "/metrics").await.unwrap();
    assert_eq!(status, 200);
    body
}

/// A gateway serving `tls` (the `[tls]` section's keys) in front of an echoing upstream.
pub(crate) async fn gateway(tls: &str, up: &Upstream) -> TestGateway {
    let toml = format!(
        "{}{}[tls]\n{tls}",
        catalog_toml(("gold", 1000.0, 1000.0), &["acme"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    TestGateway::spawn(settings(&toml)).await
}

#[tokio::test]
async fn a_tls_listener_forwards_as_https_and_offers_h2_unless_http2_is_off() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new();
    let files = Files::write(dir.path(), "gw", &ca.leaf(&["gw.test"]));
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&files.toml(), &up).await;
    let h1_only = gateway(&format!("{}[server]\nhttp2 = false\n", files.toml()), &up).await;
    let both: &[&[u8]] = &[b"h2", b"http/1.1"];

    let h2 = connect_offering(addr_of(&gw), Some("gw.test"), both)
        .await
        .unwrap();
    let h1 = connect_offering(addr_of(&h1_only), Some("gw.test"), both)
        .await
        .unwrap();
    assert_eq!(h2.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    assert_eq!(h1.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
    h1_only.stop().await;
    let mut tls = connect(addr_of(&gw), Some("gw.test")).await.unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
    let (status, _) = get(&mut tls, "/orders/1").await.unwrap();

    assert_eq!(status, 200);
    let seen = &up.seen()[0];
    assert_eq!(seen.headers["x-forwarded-proto"], "https");
    assert!(
        seen.headers["forwarded"].contains("proto=https"),
        "{:?}",
        seen.headers
    );
    // Plain HTTP on a TLS listener gets no answer a client could mistake for one.
    assert!(gw
        .http
        .get(format!("{}/orders/1", gw.address))
        .send()
        .await
        .is_err());
    gw.stop().await;
}

#[tokio::test]
async fn curl_verifies_the_chain_and_the_name_and_speaks_http2_when_it_asks() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new();
    let files = Files::write(dir.path(), "gw", &ca.leaf(&["gw.test"]));
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, &ca.pem).unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&files.toml(), &up).await;
    let port = addr_of(&gw).port();

    let ca_file = ca_file.display().to_string();
    let get = |host: &'static str, extra: &'static [&'static str]| {
        let (ca_file, key) = (ca_file.clone(), format!("x-api-key: {}", key("acme")));
        let resolve = format!("{host}:{port}:127.0.0.1");
        let url = format!("https://{host}:{port}/orders/1");
        async move {
            let mut args = vec!["-o", "/dev/null", "-w", "%{http_code} %{http_version}"];
            args.extend(["--cacert", &ca_file, "--resolve", &resolve, "-H", &key]);
            args.extend(extra);
            args.push(&url);
            curl(&args).await
        }
    };
    let ok = get("gw.test", &["--http2"]).await;
    let wrong_name = get("other.test", &[]).await;
    let tls13 = get("gw.test", &["--tlsv1.3"]).await;
    let tls12_only = get("gw.test", &["--tlsv1.2", "--tls-max", "1.2"]).await;

    assert_eq!(String::from_utf8_lossy(&ok.stdout), "200 2", "{ok:?}");
    assert!(
        !wrong_name.status.success(),
        "a certificate for another name is refused"
    );
    assert_eq!(String::from_utf8_lossy(&tls13.stdout), "200 2");
    assert_eq!(String::from_utf8_lossy(&tls12_only.stdout), "200 2");
    let h1 = get("gw.test", &["--http1.1"]).await;
    assert_eq!(String::from_utf8_lossy(&h1.stdout), "200 1.1");
    gw.stop().await;
}

#[tokio::test]
async fn tls_1_2_is_refused_when_the_minimum_is_1_3() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new();
    let files = Files::write(dir.path(), "gw", &ca.leaf(&["gw.test"]));
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&format!("{}min_version = \"1.3\"\n", files.toml()), &up).await;
    let port = addr_of(&gw).port();

    let url = format!("https://127.0.0.1:{port}/healthz");
    let out = curl(&["-k", "--tlsv1.2", "--tls-max", "1.2", &url]).await;
    let ok13 = curl(&[
        "-k",
        "--tlsv1.3",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        &url,
    ])
    .await;

    assert!(!out.status.success(), "TLS 1.2 was accepted: {out:?}");
    assert_eq!(String::from_utf8_lossy(&ok13.stdout), "200");
    gw.stop().await;
}

#[tokio::test]
async fn each_client_gets_the_certificate_for_the_host_it_names() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new();
    let default = ca.leaf(&["gw.test"]);
    let api = ca.leaf(&["api.example.com"]);
    let wild = ca.leaf(&["*.tenants.example.com"]);
    let (d, a, w) = (
        Files::write(dir.path(), "default", &default),
        Files::write(dir.path(), "api", &api),
        Files::write(dir.path(), "wild", &wild),
    );
    let toml = format!(
        "{}sni = [{{ cert_file = \"{}\", key_file = \"{}\" }}, {{ cert_file = \"{}\", key_file = \"{}\" }}]\n",
        d.toml(),
        a.cert.display(),
        a.key.display(),
        w.cert.display(),
        w.key.display()
    );
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&toml, &up).await;
    let addr = addr_of(&gw);

    assert_eq!(served(addr, Some("api.example.com")).await, api.der);
    assert_eq!(served(addr, Some("API.Example.COM")).await, api.der);
    assert_eq!(
        served(addr, Some("acme.tenants.example.com")).await,
        wild.der
    );
    // A wildcard covers one label, as RFC 6125 has it.
    assert_eq!(
        served(addr, Some("a.b.tenants.example.com")).await,
        default.der
    );
    assert_eq!(served(addr, Some("tenants.example.com")).await, default.der);
    assert_eq!(served(addr, Some("unknown.test")).await, default.der);
    assert_eq!(served(addr, None).await, default.der);
    gw.stop().await;
}

#[tokio::test]
async fn a_replaced_certificate_is_served_to_new_connections_and_open_ones_go_on() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new();
    let (old, new) = (ca.leaf(&["gw.test"]), ca.leaf(&["gw.test"]));
    let files = Files::write(dir.path(), "gw", &old);
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&format!("{}watch_ms = 100\n", files.toml()), &up).await;
    let addr = addr_of(&gw);
    let mut open = connect(addr, Some("gw.test")).await.unwrap();
    assert_eq!(get(&mut open, "/orders/1").await.unwrap().0, 200);

    let replaced = Instant::now();
    files.replace(&new);
    eventually(
        Duration::from_secs(10),
        "the new certificate is served",
        || async { served(addr, Some("gw.test")).await == new.der },
    )
    .await;
    eprintln!(
        "new certificate served {:?} after the files were replaced",
        replaced.elapsed()
    );

    // The connection made before the reload is still served, on its old session.
    assert_eq!(get(&mut open, "/orders/2").await.unwrap().0, 200);
    assert_eq!(
        open.get_ref().1.peer_certificates().unwrap()[0].to_vec(),
        old.der
    );
    let text = metrics(addr).await;
    assert!(
        sample_in(
            &text,
            "tollgate_tls_reloads_total{listener=\"public\",result=\"ok\"}"
        ) >= Some(1.0)
    );
    assert_eq!(
        sample_in(&text, "tollgate_tls_reload_failing{listener=\"public\"}"),
        Some(0.0)
    );
    gw.stop().await;
}

#[tokio::test]
async fn a_bad_file_is_refused_and_the_old_certificate_keeps_serving_until_a_good_one_comes() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new();
    let (old, new, other) = (
        ca.leaf(&["gw.test"]),
        ca.leaf(&["gw.test"]),
        ca.leaf(&["gw.test"]),
    );
    let files = Files::write(dir.path(), "gw", &old);
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&format!("{}watch_ms = 100\n", files.toml()), &up).await;
    let addr = addr_of(&gw);
    let failing = "tollgate_tls_reload_failing{listener=\"public\"}";

    // Not PEM, then a key that is not the certificate's: each refused.
    let rejected = "tollgate_tls_reloads_total{listener=\"public\",result=\"rejected\"}";
    let bad = [
        Leaf {
            cert_pem: "garbage".into(),
            ..new.clone()
        },
        Leaf {
            key_pem: other.key_pem.clone(),
            ..new.clone()
        },
    ];
    for (i, bad) in bad.iter().enumerate() {
        files.replace(bad);
        eventually(
            Duration::from_secs(10),
            "the bad files are refused",
            || async { sample_in(&metrics(addr).await, rejected) > Some(i as f64) },
        )
        .await;
        assert_eq!(sample_in(&metrics(addr).await, failing), Some(1.0));
        assert_eq!(served(addr, Some("gw.test")).await, old.der);
        let mut tls = connect(addr, Some("gw.test")).await.unwrap();
        assert_eq!(get(&mut tls, "/orders/1").await.unwrap().0, 200);
    }
    files.replace(&new);
    eventually(
        Duration::from_secs(10),
        "the good files are served",
        || async { served(addr, Some("gw.test")).await == new.der },
    )
    .await;

    let text = metrics(addr).await;
    assert_eq!(sample_in(&text, failing), Some(0.0));
    assert!(
        sample_in(
            &text,
            "tollgate_tls_reloads_total{listener=\"public\",result=\"rejected\"}"
        )
        .unwrap()
            >= 2.0
    );
    gw.stop().await;
}

#[tokio::test]
async fn the_expiry_gauge_is_the_served_certificates_end() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new();
    let mut params = CertificateParams::new(vec!["gw.test".to_string()]).unwrap();
    params.not_after = rcgen::date_time_ymd(2031, 3, 4);
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, &ca.issuer).unwrap();
    let leaf = Leaf {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
        der: cert.der().to_vec(),
    };
    let files = Files::write(dir.path(), "gw", &leaf);
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&files.toml(), &up).await;

    let text = metrics(addr_of(&gw)).await;
    let series = format!(
        "tollgate_tls_certificate_expiry_timestamp_seconds{{listener=\"public\",file=\"{}\"}}",
        files.cert.display()
    );
    // 2031-03-04T00:00:00Z
    assert_eq!(sample_in(&text, &series), Some(1_930_348_800.0), "{text}");
    gw.stop().await;
}

#[tokio::test]
async fn the_admin_listener_serves_its_own_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new();
    let (public, admin) = (ca.leaf(&["gw.test"]), ca.leaf(&["admin.test"]));
    let p = Files::write(dir.path(), "public", &public);
    let a = Files::write(dir.path(), "admin", &admin);
    let toml = format!(
        "{}{}[server]\nadmin_listen = \"127.0.0.1:0\"\n[tls]\n{}admin_cert_file = \"{}\"\nadmin_key_file = \"{}\"\n",
        catalog_toml(("gold", 1000.0, 1000.0), &["acme"]),
        admin_toml(),
        p.toml(),
        a.cert.display(),
        a.key.display()
    );
    let app = tollgate::startup::Application::build(settings(&toml))
        .await
        .unwrap();
    let (port, admin_port) = (app.port(), app.admin_port().unwrap());
    let handles = app.handles();
    let running = tokio::spawn(app.run_until_stopped());

    assert_eq!(
        served(([127, 0, 0, 1], port).into(), None).await,
        public.der
    );
    let admin_addr = ([127, 0, 0, 1], admin_port).into();
    assert_eq!(served(admin_addr, None).await, admin.der);
    let text = metrics(admin_addr).await;
    assert!(
        text.contains("tollgate_tls_reload_failing{listener=\"admin\"} 0"),
        "{text}"
    );
    assert!(
        text.contains("tollgate_tls_reload_failing{listener=\"public\"} 0"),
        "{text}"
    );
    for h in handles {
        h.stop(true).await;
    }
    running.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_certificate_that_does_not_load_at_start_stops_the_start_naming_its_key() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new();
    let files = Files::write(dir.path(), "gw", &ca.leaf(&["gw.test"]));
    std::fs::write(&files.key, "not a key").unwrap();
    let toml = format!("[tls]\n{}", files.toml());

    let e = match tollgate::startup::Application::build(settings(&toml)).await {
        Ok(_) => panic!("started with a key that does not load"),
        Err(e) => format!("{e:#}"),
    };

    assert!(e.starts_with("tls.key_file: "), "{e}");
    assert!(e.contains(&files.key.display().to_string()), "{e}");
}

#[tokio::test]
async fn sighup_loads_the_certificates_again_in_the_real_binary() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new();
    let (old, new) = (ca.leaf(&["gw.test"]), ca.leaf(&["gw.test"]));
    let files = Files::write(dir.path(), "gw", &old);
    // No watching: only the signal reloads.
    let gw = gateway_process(&format!("[tls]\n{}watch_ms = 0\n", files.toml()), &[]);
    assert_eq!(served(gw.addr, Some("gw.test")).await, old.der);

    files.replace(&new);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        served(gw.addr, Some("gw.test")).await,
        old.der,
        "reloaded without a signal"
    );
    tollgate_testkit::signal(&gw.child, libc::SIGHUP).unwrap();

    eventually(
        Duration::from_secs(10),
        "SIGHUP serves the new certificate",
        || async { served(gw.addr, Some("gw.test")).await == new.der },
    )
    .await;
}

#[tokio::test]
async fn ten_reloads_under_traffic_fail_no_request() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new();
    let files = Files::write(dir.path(), "gw", &ca.leaf(&["gw.test"]));
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&format!("{}watch_ms = 50\n", files.toml()), &up).await;
    let addr = addr_of(&gw);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));

    // Four clients: two keep one connection each, two make a new connection per request.
    let clients: Vec<_> = (0..4)
        .map(|i| {
            let stop = Arc::clone(&stop);
            tokio::spawn(async move {
                let (mut ok, mut failed) = (0u32, Vec::new());
                let mut conn = None;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if conn.is_none() || i >= 2 {
                        conn = Some(connect(addr, Some("gw.test")).await);
                    }
                    let result = match conn.as_mut().unwrap() {
                        Ok(tls) => get(tls, "/orders/1").await.map(|(s, _)| s),
                        Err(e) => Err(std::io::Error::new(e.kind(), e.to_string())),
                    };
                    match result {
                        Ok(200) => ok += 1,
                        other => failed.push(format!("{other:?}")),
                    }
                }
                (ok, failed)
            })
        })
        .collect();
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let before = served(addr, Some("gw.test")).await;
        let next = ca.leaf(&["gw.test"]);
        files.replace(&next);
        eventually(
            Duration::from_secs(10),
            "the next certificate is served",
            || async { served(addr, Some("gw.test")).await != before },
        )
        .await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);

    let (mut ok, mut failed) = (0, Vec::new());
    for c in clients {
        let (o, f) = c.await.unwrap();
        ok += o;
        failed.extend(f);
    }
    eprintln!("{ok} requests across 10 reloads");
    assert!(
        failed.is_empty(),
        "{} failed: {:?}",
        failed.len(),
        &failed[..failed.len().min(5)]
    );
    assert!(ok > 100, "only {ok} requests");
    let text = metrics(addr).await;
    // A check between the key's write and the certificate's refuses the pair, and the
    // next one loads it: at least one load per replacement.
    let loads = sample_in(
        &text,
        "tollgate_tls_reloads_total{listener=\"public\",result=\"ok\"}",
    );
    assert!(loads >= Some(10.0), "{loads:?}");
    gw.stop().await;
}

#[tokio::test]
async fn the_container_healthcheck_asks_a_tls_listener_over_tls() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new();
    let files = Files::write(dir.path(), "gw", &ca.leaf(&["gw.test"]));
    let gw = gateway_process(&format!("[tls]\n{}", files.toml()), &[]);
    let config = gw.dir().join("gateway.toml");

    let healthcheck = tokio::process::Command::new(binary())
        .arg("--config")
        .arg(&config)
        .arg("healthcheck")
        .output()
        .await
        .unwrap();

    assert!(healthcheck.status.success(), "{healthcheck:?}");
}
