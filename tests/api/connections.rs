//! Connections admitted by client address before a byte of them is read (the book,
//! "Connections"): `server.max_connections_per_address` open at once and
//! `server.new_connections_per_address` a second, refused with a reset before any TLS
//! handshake, other addresses served meanwhile, trusted proxies exempt. Clients connect from
//! chosen loopback addresses (127.0.0.1 and 127.0.0.2 are two clients to the gateway).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::ServerName;
use tokio::io::AsyncReadExt;
use tokio::net::{TcpSocket, TcpStream};

use crate::helpers::*;
use crate::tls::{addr_of, gateway, get, Ca, Files};

/// A TCP connection to `addr` from `from` (a loopback address).
async fn tcp_from(from: &str, addr: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(format!("{from}:0").parse().unwrap())?;
    socket.connect(addr).await
}

/// A TLS connection to `addr` from `from`, HTTP/1.1.
async fn tls_from(
    from: &str,
    addr: SocketAddr,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let mut config = (*tollgate::tls::probe_client_config()).clone();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let tcp = tcp_from(from, addr).await?;
    tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("gw.test").unwrap(), tcp)
        .await
}

/// Whether the gateway reset a connection that sent nothing: a refused one is reset (held
/// unread for a second first); an admitted one waits for its client to speak (3 s for a
/// TLS handshake, 5 s for a first request), then closes without a reset.
async fn reset_unread(mut tcp: TcpStream) -> bool {
    let mut byte = [0u8; 1];
    match tokio::time::timeout(Duration::from_millis(2500), tcp.read(&mut byte)).await {
        Ok(Err(e)) => e.kind() == std::io::ErrorKind::ConnectionReset,
        Ok(Ok(0)) | Err(_) => false,
        Ok(Ok(_)) => panic!("the gateway spoke first"),
    }
}

/// Whether a cleartext connection is served: `/healthz` answered `200`.
async fn served(mut tcp: TcpStream) -> bool {
    use tokio::io::AsyncWriteExt;
    if tcp
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: gw.test\r\n\r\n")
        .await
        .is_err()
    {
        return false;
    }
    let mut head = [0u8; 12];
    matches!(
        tokio::time::timeout(Duration::from_secs(3), tcp.read_exact(&mut head)).await,
        Ok(Ok(_)) if &head == b"HTTP/1.1 200"
    )
}

fn sample(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{series} in {metrics}"))
}

/// `/metrics` of a cleartext listener, asked from `from`.
async fn cleartext_metrics_from(from: &str, addr: SocketAddr) -> String {
    use tokio::io::AsyncWriteExt;
    let mut tcp = tcp_from(from, addr).await.unwrap();
    tcp.write_all(b"GET /metrics HTTP/1.1\r\nHost: gw.test\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut text = String::new();
    tcp.read_to_string(&mut text).await.unwrap();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    text
}

async fn metrics_from(from: &str, addr: SocketAddr) -> String {
    let mut tls = tls_from(from, addr).await.unwrap();
    let (status, body) = get(&mut tls, "/metrics").await.unwrap();
    assert_eq!(status, 200);
    body
}

/// A cleartext gateway with `server` (lines of `[server]`) in front of an echoing
/// upstream, and its address.
async fn cleartext_gateway(server: &str) -> (TestGateway, SocketAddr, Upstream) {
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}{}[server]\n{server}\n",
        catalog_toml(("gold", 1000.0, 1000.0), &["acme"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    let addr = gw.address.trim_start_matches("http://").parse().unwrap();
    (gw, addr, up)
}

#[tokio::test]
async fn an_address_with_its_connections_open_is_reset_before_its_handshake_and_others_are_served()
{
    let dir = tempfile::tempdir().unwrap();
    let files = Files::write(dir.path(), "gw", &Ca::new().leaf(&["gw.test"]));
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}[server]\nmax_connections_per_address = 3\n",
        files.toml()
    );
    let gw = gateway(&toml, &up).await;
    let addr = addr_of(&gw);

    // Three open, saying nothing yet (a TLS handshake waits up to 3 s for them).
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(tcp_from("127.0.0.1", addr).await.unwrap());
    }
    let fourth = tcp_from("127.0.0.1", addr).await.unwrap();
    assert!(
        reset_unread(fourth).await,
        "a fourth connection from the address is reset without a byte read"
    );
    // Another address is served meanwhile, TLS and all.
    let mut other = tls_from("127.0.0.2", addr).await.unwrap();
    assert_eq!(get(&mut other, "/orders/1").await.unwrap().0, 200);
    // One of the three closes: the address may open one again.
    drop(held.pop());
    let mut again = None;
    for _ in 0..5 {
        if let Ok(tls) = tls_from("127.0.0.1", addr).await {
            again = Some(tls);
            break;
        }
    }
    let mut again = again.expect("a connection once one of the three closed");
    assert_eq!(get(&mut again, "/orders/1").await.unwrap().0, 200);

    let m = metrics_from("127.0.0.2", addr).await;
    let refused = "tollgate_connections_refused_total{listener=\"public\",reason=\"open\"}";
    assert!(sample(&m, refused) >= 1.0, "{m}");
    assert_eq!(
        sample(
            &m,
            "tollgate_connections_refused_total{listener=\"public\",reason=\"rate\"}"
        ),
        0.0
    );
    // Two held and `again` from 127.0.0.1, `other` and this one from 127.0.0.2.
    assert_eq!(
        sample(&m, "tollgate_connections_open{listener=\"public\"}"),
        5.0
    );
    gw.stop().await;
}

#[tokio::test]
async fn an_address_opening_connections_faster_than_its_rate_is_reset_until_its_bucket_refills() {
    let (gw, addr, _up) = cleartext_gateway("new_connections_per_address = 5").await;

    // A second's worth at once: five, then a sixth within milliseconds.
    let mut five = Vec::new();
    for _ in 0..5 {
        five.push(tcp_from("127.0.0.1", addr).await.unwrap());
    }
    let sixth = tcp_from("127.0.0.1", addr).await.unwrap();
    // Another address has its own bucket.
    let other = tcp_from("127.0.0.2", addr).await.unwrap();
    assert!(reset_unread(sixth).await);
    for tcp in five {
        assert!(served(tcp).await);
    }
    assert!(served(other).await);
    // Time gives the address more (a fifth of a second, one more at 5 a second).
    let later = tcp_from("127.0.0.1", addr).await.unwrap();
    assert!(served(later).await);

    let m = cleartext_metrics_from("127.0.0.3", addr).await;
    assert_eq!(
        sample(
            &m,
            "tollgate_connections_refused_total{listener=\"public\",reason=\"rate\"}"
        ),
        1.0
    );
    gw.stop().await;
}

#[tokio::test]
async fn trusted_proxies_carry_many_clients_and_are_not_bounded() {
    let (gw, addr, _up) = cleartext_gateway(
        "max_connections_per_address = 1\nnew_connections_per_address = 2\n\
         trusted_proxies = [\"127.0.0.1\"]",
    )
    .await;

    let mut held = Vec::new();
    for _ in 0..10 {
        held.push(tcp_from("127.0.0.1", addr).await.unwrap());
    }
    for tcp in held.drain(..) {
        assert!(served(tcp).await);
    }
    // An address that is not a proxy is bounded on the same listener, cleartext too.
    let first = tcp_from("127.0.0.2", addr).await.unwrap();
    let second = tcp_from("127.0.0.2", addr).await.unwrap();
    assert!(reset_unread(second).await);
    drop(first);

    // Once the closed ones are seen closed, only the scrape is open.
    let mut m = String::new();
    for _ in 0..100 {
        m = cleartext_metrics_from("127.0.0.1", addr).await;
        if sample(&m, "tollgate_connections_open{listener=\"public\"}") == 1.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        sample(
            &m,
            "tollgate_connections_refused_total{listener=\"public\",reason=\"open\"}"
        ),
        1.0
    );
    // With no admin listener, no admin series.
    assert_eq!(
        sample(&m, "tollgate_connections_open{listener=\"public\"}"),
        1.0
    );
    assert!(!m.contains("listener=\"admin\""), "{m}");
    gw.stop().await;
}
