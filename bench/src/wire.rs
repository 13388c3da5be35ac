//! How an open-loop stream's requests travel ([`Wire`]) beyond cleartext HTTP/1.1: over
//! TLS on pooled keep-alive connections, over TLS on a new connection per request (a full
//! handshake each), and as HTTP/2 streams over TLS. The requests stay the prepared
//! HTTP/1.1 byte strings every scenario writes; for HTTP/2 each is read once, at the
//! start, into its method, path and headers.

use std::cell::RefCell;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

use crate::http::{Conn, Reply};

/// How a stream's requests travel.
#[derive(Clone)]
pub enum Wire {
    /// HTTP/1.1 in cleartext, on pooled keep-alive connections.
    Http1,
    /// HTTP/1.1 over TLS, on pooled keep-alive connections.
    Tls(Arc<rustls::ClientConfig>),
    /// HTTP/1.1 over TLS, each request on a new connection (a full handshake), closed
    /// after its answer.
    TlsFresh(Arc<rustls::ClientConfig>),
    /// HTTP/2 over TLS (ALPN `h2`): each request a stream on one of `conns` connections,
    /// taken in turn (many clients, each with many streams).
    H2 {
        config: Arc<rustls::ClientConfig>,
        conns: usize,
    },
}

/// Idle TLS connections by address.
pub type TlsPool = Rc<RefCell<HashMap<SocketAddr, Vec<Conn<TlsStream<TcpStream>>>>>>;

/// One request over TLS, on a pooled connection when `pool` is given (a stale one is
/// replaced once), else on a new one, closed after.
pub async fn tls_exchange(
    pool: Option<&TlsPool>,
    config: &Arc<rustls::ClientConfig>,
    addr: SocketAddr,
    req: &[u8],
) -> Option<Reply> {
    let pooled = pool.and_then(|p| p.borrow_mut().get_mut(&addr).and_then(Vec::pop));
    let reused = pooled.is_some();
    let mut conn = match pooled {
        Some(c) => c,
        None => Conn::over(crate::tls::connect(addr, config).await.ok()?),
    };
    let reply = match conn.send(req).await {
        Ok(r) => r,
        Err(_) if reused => {
            conn = Conn::over(crate::tls::connect(addr, config).await.ok()?);
            conn.send(req).await.ok()?
        }
        Err(_) => return None,
    };
    if let Some(pool) = pool.filter(|_| !conn.closed) {
        pool.borrow_mut().entry(addr).or_default().push(conn);
    }
    Some(reply)
}

/// A prepared HTTP/1.1 request as HTTP/2 wants it.
#[derive(Clone)]
pub struct H2Request {
    method: http::Method,
    uri: http::Uri,
    headers: http::HeaderMap,
}

impl H2Request {
    /// Reads `raw` (as [`crate::http::get_request`] writes it); the authority is
    /// [`crate::tls::HOST`], and the connection-specific headers HTTP/2 forbids are left
    /// out.
    pub fn parse(raw: &[u8]) -> anyhow::Result<H2Request> {
        let mut headers = [httparse::EMPTY_HEADER; 48];
        let mut req = httparse::Request::new(&mut headers);
        req.parse(raw)?;
        let method = http::Method::from_bytes(req.method.unwrap_or("GET").as_bytes())?;
        let uri: http::Uri =
            format!("https://{}{}", crate::tls::HOST, req.path.unwrap_or("/")).parse()?;
        let mut map = http::HeaderMap::new();
        for h in req.headers.iter() {
            let name = h.name.to_ascii_lowercase();
            if matches!(
                name.as_str(),
                "host" | "connection" | "keep-alive" | "transfer-encoding" | "content-length"
            ) {
                continue;
            }
            map.append(
                http::HeaderName::from_bytes(name.as_bytes())?,
                http::HeaderValue::from_bytes(h.value)?,
            );
        }
        Ok(H2Request {
            method,
            uri,
            headers: map,
        })
    }

    fn build(&self) -> http::Request<()> {
        let mut req = http::Request::new(());
        *req.method_mut() = self.method.clone();
        *req.uri_mut() = self.uri.clone();
        *req.headers_mut() = self.headers.clone();
        req
    }
}

/// HTTP/2 connections to one address, used in turn; one that failed (or got a GOAWAY) is
/// made again when its turn comes.
pub struct H2Conns {
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
    slots: RefCell<Vec<Option<h2::client::SendRequest<Bytes>>>>,
    next: std::cell::Cell<usize>,
}

impl H2Conns {
    pub fn new(addr: SocketAddr, config: Arc<rustls::ClientConfig>, conns: usize) -> H2Conns {
        H2Conns {
            addr,
            config,
            slots: RefCell::new(vec![None; conns.max(1)]),
            next: Default::default(),
        }
    }

    /// Opens every connection (within `within`), so the first requests do not each open
    /// their own.
    pub async fn open_all(&self, within: Duration) {
        let n = self.slots.borrow().len();
        for i in 0..n {
            if let Ok(Some(c)) = tokio::time::timeout(within, self.open()).await {
                self.slots.borrow_mut()[i] = Some(c);
            }
        }
    }

    async fn open(&self) -> Option<h2::client::SendRequest<Bytes>> {
        let tls = crate::tls::connect(self.addr, &self.config).await.ok()?;
        let (client, conn) = h2::client::Builder::new()
            .initial_window_size(1 << 20)
            .handshake(tls)
            .await
            .ok()?;
        tokio::task::spawn_local(async move {
            let _ = conn.await;
        });
        Some(client)
    }

    /// One request as a stream on the next connection in turn: its status, or `None`.
    pub async fn exchange(&self, req: &H2Request) -> Option<Reply> {
        let i = self.next.get();
        self.next.set((i + 1) % self.slots.borrow().len());
        let slot = self.slots.borrow()[i].clone();
        let client = match slot {
            Some(c) => c,
            None => {
                let c = self.open().await?;
                self.slots.borrow_mut()[i] = Some(c.clone());
                c
            }
        };
        let result = async {
            let mut client = client.ready().await?;
            let (response, _) = client.send_request(req.build(), true)?;
            let response = response.await?;
            let status = response.status().as_u16();
            let mut body = response.into_body();
            while let Some(chunk) = body.data().await {
                let chunk = chunk?;
                let _ = body.flow_control().release_capacity(chunk.len());
            }
            Ok::<_, h2::Error>(status)
        }
        .await;
        match result {
            Ok(status) => Some(Reply {
                status,
                service_marked: false,
            }),
            Err(e) => {
                // A connection-level failure (not one stream's reset): made again on its
                // next turn.
                if !e.is_reset() {
                    self.slots.borrow_mut()[i] = None;
                }
                None
            }
        }
    }
}
