//! A minimal keep-alive HTTP/1.1 client and server over tokio TCP.
//!
//! Hand-written rather than awc/actix so the load generator and the upstreams cost little
//! and always the same: a request is one prepared byte string, a response is parsed only
//! as far as its status, one marker header and its length.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

/// The header a modelled service replica puts on its own `429`, so the replay can tell
/// "limited by the service" from "limited by the gateway" (which forwards it unchanged).
pub const LIMITED_BY_SERVICE: &str = "x-limited-by";

/// A `GET` request with an API key, ready to write.
pub fn get_request(path: &str, api_key: Option<&str>) -> Vec<u8> {
    let mut r = format!("GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nuser-agent: tollgate-bench\r\n");
    if let Some(key) = api_key {
        r.push_str(&format!("x-api-key: {key}\r\n"));
    }
    r.push_str("\r\n");
    r.into_bytes()
}

/// What the load generator keeps of a response.
#[derive(Debug, Clone, Copy)]
pub struct Reply {
    pub status: u16,
    /// The response carried [`LIMITED_BY_SERVICE`].
    pub service_marked: bool,
}

/// One keep-alive client connection, over TCP or over anything else that reads and
/// writes (TLS).
pub struct Conn<S = TcpStream> {
    stream: S,
    buf: Vec<u8>,
    /// Bytes of `buf` that hold data not yet consumed.
    filled: usize,
    /// The server asked to close, or a response could not be framed: do not reuse.
    pub closed: bool,
    /// The body of the last response, when [`Conn::keep_body`] is set.
    pub body: Vec<u8>,
    pub keep_body: bool,
}

impl Conn {
    pub async fn connect(addr: SocketAddr) -> io::Result<Conn> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(Conn::over(stream))
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> Conn<S> {
    /// A connection on `stream`, already established (a TLS session).
    pub fn over(stream: S) -> Conn<S> {
        Conn {
            stream,
            buf: vec![0; 16 * 1024],
            filled: 0,
            closed: false,
            body: Vec::new(),
            keep_body: false,
        }
    }

    /// Writes `request` and reads the whole response.
    pub async fn send(&mut self, request: &[u8]) -> io::Result<Reply> {
        self.stream.write_all(request).await?;
        // A no-op on TCP; TLS may hold the last record until flushed.
        self.stream.flush().await?;
        loop {
            if let Some(reply) = self.try_parse()? {
                return Ok(reply);
            }
            if self.filled == self.buf.len() {
                self.buf.resize(self.buf.len() * 2, 0);
            }
            let n = self.stream.read(&mut self.buf[self.filled..]).await?;
            if n == 0 {
                self.closed = true;
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed before a full response",
                ));
            }
            self.filled += n;
        }
    }

    /// A complete response at the start of the buffer, consumed; `None` if more bytes
    /// are needed.
    fn try_parse(&mut self) -> io::Result<Option<Reply>> {
        let mut headers = [httparse::EMPTY_HEADER; 48];
        let mut res = httparse::Response::new(&mut headers);
        let head_len = match res.parse(&self.buf[..self.filled]) {
            Ok(httparse::Status::Complete(n)) => n,
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(e) => {
                self.closed = true;
                return Err(io::Error::new(io::ErrorKind::InvalidData, e));
            }
        };
        let status = res.code.unwrap_or(0);
        let mut content_length = None;
        let mut chunked = false;
        let mut service_marked = false;
        for h in res.headers.iter() {
            if h.name.eq_ignore_ascii_case("content-length") {
                content_length = std::str::from_utf8(h.value)
                    .ok()
                    .and_then(|v| v.trim().parse::<usize>().ok());
            } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
                chunked = h.value.eq_ignore_ascii_case(b"chunked");
            } else if h.name.eq_ignore_ascii_case("connection") {
                if h.value.eq_ignore_ascii_case(b"close") {
                    self.closed = true;
                }
            } else if h.name.eq_ignore_ascii_case(LIMITED_BY_SERVICE) {
                service_marked = true;
            }
        }
        let (body_start, body_end, total) = if chunked {
            match chunked_end(&self.buf[head_len..self.filled])? {
                Some(end) => (head_len, head_len + end, head_len + end),
                None => return Ok(None),
            }
        } else {
            let len = content_length.unwrap_or(0);
            if self.filled < head_len + len {
                return Ok(None);
            }
            (head_len, head_len + len, head_len + len)
        };
        if self.keep_body {
            self.body.clear();
            self.body.extend_from_slice(&self.buf[body_start..body_end]);
        }
        // Keep anything after this response (there should be nothing: no pipelining).
        self.buf.copy_within(total..self.filled, 0);
        self.filled -= total;
        Ok(Some(Reply {
            status,
            service_marked,
        }))
    }
}

/// Where a chunked body ends (after the last chunk's trailer), if it is all there. The
/// body bytes themselves are not needed, so they are not decoded.
fn chunked_end(data: &[u8]) -> io::Result<Option<usize>> {
    let mut pos = 0;
    loop {
        let Some(line_end) = find(&data[pos..], b"\r\n") else {
            return Ok(None);
        };
        let line = std::str::from_utf8(&data[pos..pos + line_end])
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        let size_text = line.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        pos += line_end + 2;
        if size == 0 {
            // Trailers (none expected) end with an empty line.
            return Ok(find(&data[pos..], b"\r\n").map(|e| pos + e + 2));
        }
        if data.len() < pos + size + 2 {
            return Ok(None);
        }
        pos += size + 2;
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// A complete `200` with a two-byte body: what the fast upstreams answer.
pub const OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: text/plain\r\n\r\nok";

/// Serves one keep-alive connection: for every request, `handle` gets the client
/// (`x-client-id` as the gateway sets it, else `x-api-key` when called directly; only
/// looked for when `wants_client`) and returns the complete response bytes.
pub async fn serve_conn<F, Fut>(
    mut stream: TcpStream,
    wants_client: bool,
    handle: F,
) -> io::Result<()>
where
    F: Fn(Option<String>) -> Fut,
    Fut: Future<Output = &'static [u8]>,
{
    let _ = stream.set_nodelay(true);
    let mut buf = vec![0u8; 16 * 1024];
    let mut filled = 0;
    loop {
        // Parse what is buffered; read more until a whole head (and body) is there.
        let parsed = {
            let mut headers = [httparse::EMPTY_HEADER; 48];
            let mut req = httparse::Request::new(&mut headers);
            match req.parse(&buf[..filled]) {
                Ok(httparse::Status::Complete(head_len)) => {
                    let mut body_len = 0usize;
                    let mut by_id = None;
                    let mut by_key = None;
                    let mut close = false;
                    for h in req.headers.iter() {
                        if h.name.eq_ignore_ascii_case("content-length") {
                            body_len = std::str::from_utf8(h.value)
                                .ok()
                                .and_then(|v| v.trim().parse().ok())
                                .unwrap_or(0);
                        } else if h.name.eq_ignore_ascii_case("connection") {
                            close = h.value.eq_ignore_ascii_case(b"close");
                        } else if wants_client && h.name.eq_ignore_ascii_case("x-client-id") {
                            by_id = Some(h.value);
                        } else if wants_client && h.name.eq_ignore_ascii_case("x-api-key") {
                            by_key = Some(h.value);
                        }
                    }
                    let client = by_id
                        .or(by_key)
                        .map(|v| String::from_utf8_lossy(v).into_owned());
                    Some((head_len + body_len, client, close))
                }
                Ok(httparse::Status::Partial) => None,
                Err(_) => return Ok(()),
            }
        };
        if let Some((total, client, close)) = parsed {
            if filled >= total {
                let response = handle(client).await;
                stream.write_all(response).await?;
                buf.copy_within(total..filled, 0);
                filled -= total;
                if close {
                    return Ok(());
                }
                continue;
            }
        }
        if filled == buf.len() {
            buf.resize(buf.len() * 2, 0);
        }
        let n = stream.read(&mut buf[filled..]).await?;
        if n == 0 {
            return Ok(());
        }
        filled += n;
    }
}

/// Fetches `path` once on a fresh connection (probes and `/metrics`): status and body.
pub async fn fetch(
    addr: SocketAddr,
    path: &str,
    api_key: Option<&str>,
) -> io::Result<(u16, String)> {
    let mut conn = Conn::connect(addr).await?;
    conn.keep_body = true;
    let reply = conn.send(&get_request(path, api_key)).await?;
    Ok((
        reply.status,
        String::from_utf8_lossy(&conn.body).into_owned(),
    ))
}

/// Prometheus text → `name{labels}` → value (samples only).
pub fn parse_metrics(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            Some((name.to_string(), value.parse().ok()?))
        })
        .collect()
}
