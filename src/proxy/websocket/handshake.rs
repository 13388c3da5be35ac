//! The upstream half of an upgrade: a connection of the gateway's own to one replica (awc's
//! WebSocket client makes its own `Sec-WebSocket-Key`, which a pass-through must not), the
//! request head written on it, and the response head read back, bounded in size and time.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use actix_web::http::header::{HeaderMap, HeaderName, HeaderValue};
use actix_web::http::StatusCode;
use bytes::{Buf, Bytes, BytesMut};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::domain::{server_name, Upstream};

/// The longest response head read from a service.
const MAX_HEAD_BYTES: usize = 64 * 1024;

/// The longest body of a response that declines an upgrade (a `400`, a `403`) passed on;
/// a longer one is `502`.
const MAX_DECLINE_BODY: usize = 64 * 1024;

/// The upstream's connection for an upgrade: TCP, or TLS over it to an `https://` replica
/// (`wss`); everything above it only reads and writes bytes.
pub(super) enum UpstreamIo {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

/// Opens a connection to `upstream` within `timeout` (the TLS handshake included, verified
/// as every forward to it is: `tls`, the workers' client configuration), `TCP_NODELAY` set:
/// a relay writes each frame as it comes, and small frames must not wait for an earlier
/// one's ACK.
pub(super) async fn connect(
    upstream: &Upstream,
    timeout: Duration,
    tls: &Arc<rustls::ClientConfig>,
) -> io::Result<UpstreamIo> {
    let uri = upstream.uri(None).map_err(io::Error::other)?;
    let host = server_name(uri.host().unwrap_or_default()).to_owned();
    let port = uri.port_u16().unwrap_or(80);
    let opening = async {
        let stream = TcpStream::connect((host.as_str(), port)).await?;
        stream.set_nodelay(true)?;
        if !upstream.tls() {
            return Ok(UpstreamIo::Plain(stream));
        }
        let name = ServerName::try_from(host.clone())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let connector = tokio_rustls::TlsConnector::from(Arc::clone(tls));
        let stream = connector.connect(name, stream).await?;
        Ok(UpstreamIo::Tls(Box::new(stream)))
    };
    tokio::time::timeout(timeout, opening)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))?
}

impl AsyncRead for UpstreamIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            UpstreamIo::Plain(s) => Pin::new(s).poll_read(cx, buf),
            UpstreamIo::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for UpstreamIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            UpstreamIo::Plain(s) => Pin::new(s).poll_write(cx, buf),
            UpstreamIo::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            UpstreamIo::Plain(s) => Pin::new(s).poll_flush(cx),
            UpstreamIo::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            UpstreamIo::Plain(s) => Pin::new(s).poll_shutdown(cx),
            UpstreamIo::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// The request head of an upgrade: `GET path HTTP/1.1`, then `headers` as they are.
pub(super) fn request_head(path_and_query: &str, headers: &HeaderMap) -> Vec<u8> {
    let mut head = Vec::with_capacity(512);
    head.extend_from_slice(b"GET ");
    head.extend_from_slice(path_and_query.as_bytes());
    head.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in headers {
        head.extend_from_slice(name.as_str().as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(value.as_bytes());
        head.extend_from_slice(b"\r\n");
    }
    head.extend_from_slice(b"\r\n");
    head
}

/// What the service answered an upgrade.
pub(super) enum Answer {
    /// `101`: `rest` is what it sent after the head, the first bytes of the relay.
    Upgraded { headers: HeaderMap, rest: Bytes },
    /// Anything else, with its whole body.
    Declined {
        status: StatusCode,
        headers: HeaderMap,
        body: Bytes,
    },
}

/// Why the service's answer is no answer.
#[derive(Debug)]
pub(super) enum Broken {
    /// The connection failed or closed before a whole answer.
    Io(io::Error),
    /// Not HTTP, or past the size bounds.
    Malformed,
    /// Not whole by the deadline.
    TimedOut,
}

impl std::fmt::Display for Broken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Broken::Io(e) => write!(f, "{e}"),
            Broken::Malformed => f.write_str("not an HTTP response, or one past the size bounds"),
            Broken::TimedOut => f.write_str("no whole answer within the route's timeout"),
        }
    }
}

/// Reads the answer to an upgrade from `io` until `deadline`: interim `1xx` heads other than
/// `101` skipped, a declining answer's body read whole (`Content-Length`, chunked, or to the
/// connection's end).
pub(super) async fn read_answer(io: &mut UpstreamIo, deadline: Instant) -> Result<Answer, Broken> {
    tokio::time::timeout_at(deadline, read(io))
        .await
        .unwrap_or(Err(Broken::TimedOut))
}

async fn read(io: &mut UpstreamIo) -> Result<Answer, Broken> {
    let mut buf = BytesMut::with_capacity(4096);
    loop {
        let (status, headers, len) = loop {
            if let Some(head) = parse_head(&buf)? {
                break head;
            }
            if buf.len() >= MAX_HEAD_BYTES {
                return Err(Broken::Malformed);
            }
            fill(io, &mut buf)
                .await?
                .ok_or(Broken::Io(io::ErrorKind::UnexpectedEof.into()))?;
        };
        buf.advance(len);
        if status == StatusCode::SWITCHING_PROTOCOLS {
            return Ok(Answer::Upgraded {
                headers,
                rest: buf.freeze(),
            });
        }
        if status.is_informational() {
            continue;
        }
        let body = read_body(io, &mut buf, &headers, status).await?;
        return Ok(Answer::Declined {
            status,
            headers,
            body,
        });
    }
}

/// Reads more into `buf`: `None` at the connection's end.
async fn fill(io: &mut UpstreamIo, buf: &mut BytesMut) -> Result<Option<()>, Broken> {
    buf.reserve(4096);
    match io.read_buf(buf).await {
        Ok(0) => Ok(None),
        Ok(_) => Ok(Some(())),
        Err(e) => Err(Broken::Io(e)),
    }
}

/// A whole response head at the start of `buf`: its status, headers and length.
fn parse_head(buf: &[u8]) -> Result<Option<(StatusCode, HeaderMap, usize)>, Broken> {
    let mut fields = [httparse::EMPTY_HEADER; 128];
    let mut res = httparse::Response::new(&mut fields);
    let len = match res.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(_) => return Err(Broken::Malformed),
    };
    let status = res
        .code
        .and_then(|c| StatusCode::from_u16(c).ok())
        .ok_or(Broken::Malformed)?;
    let mut headers = HeaderMap::with_capacity(res.headers.len());
    for h in res.headers.iter() {
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(h.name.as_bytes()),
            HeaderValue::from_bytes(h.value),
        ) else {
            return Err(Broken::Malformed);
        };
        headers.append(name, value);
    }
    Ok(Some((status, headers, len)))
}

/// The body of a declining answer, `buf` holding what followed its head.
async fn read_body(
    io: &mut UpstreamIo,
    buf: &mut BytesMut,
    headers: &HeaderMap,
    status: StatusCode,
) -> Result<Bytes, Broken> {
    if status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
        return Ok(Bytes::new());
    }
    let chunked = headers
        .get(actix_web::http::header::TRANSFER_ENCODING)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"chunked"));
    let length = headers
        .get(actix_web::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<usize>().ok());
    loop {
        let whole = if chunked {
            dechunk(buf)?
        } else {
            match length {
                Some(n) if n > MAX_DECLINE_BODY => return Err(Broken::Malformed),
                Some(n) => (buf.len() >= n).then(|| Bytes::copy_from_slice(&buf[..n])),
                None => None,
            }
        };
        if let Some(body) = whole {
            return Ok(body);
        }
        if buf.len() > MAX_DECLINE_BODY + 16 * 1024 {
            return Err(Broken::Malformed);
        }
        if fill(io, buf).await?.is_none() {
            // Delimited by the connection's end: whole now. A framed one is cut short.
            return match (chunked, length) {
                (false, None) if buf.len() <= MAX_DECLINE_BODY => Ok(buf.split().freeze()),
                _ => Err(Broken::Io(io::ErrorKind::UnexpectedEof.into())),
            };
        }
    }
}

/// A chunked body (RFC 9112 §7.1) decoded, once all of it is in `buf` (trailers dropped).
fn dechunk(buf: &[u8]) -> Result<Option<Bytes>, Broken> {
    let mut body = Vec::new();
    let mut at = 0;
    loop {
        let Some(eol) = find_crlf(&buf[at..]) else {
            return Ok(None);
        };
        let line = std::str::from_utf8(&buf[at..at + eol]).map_err(|_| Broken::Malformed)?;
        let size = line.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size, 16).map_err(|_| Broken::Malformed)?;
        at += eol + 2;
        if size == 0 {
            // Trailer fields, then an empty line.
            loop {
                let Some(eol) = find_crlf(&buf[at..]) else {
                    return Ok(None);
                };
                at += eol + 2;
                if eol == 0 {
                    return Ok(Some(body.into()));
                }
            }
        }
        if body.len() + size > MAX_DECLINE_BODY {
            return Err(Broken::Malformed);
        }
        if buf.len() < at + size + 2 {
            return Ok(None);
        }
        body.extend_from_slice(&buf[at..at + size]);
        at += size + 2;
    }
}

fn find_crlf(b: &[u8]) -> Option<usize> {
    memchr::memmem::find(b, b"\r\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunked_body_is_whole_only_at_its_last_chunk_and_trailers() {
        let full = b"5\r\nhello\r\n6;x=y\r\n world\r\n0\r\nx-t: 1\r\n\r\n";
        for cut in 0..full.len() {
            assert!(dechunk(&full[..cut]).unwrap().is_none(), "{cut}");
        }
        assert_eq!(&dechunk(full).unwrap().unwrap()[..], b"hello world");
        assert!(dechunk(b"zz\r\n").is_err());
    }

    #[test]
    fn a_head_is_read_with_its_fields_and_length() {
        let raw = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nSec-WebSocket-Accept: abc\r\n\r\n\x81\x00";
        let (status, headers, len) = parse_head(raw).unwrap().unwrap();
        assert_eq!(status, 101);
        assert_eq!(headers.get("sec-websocket-accept").unwrap(), "abc");
        assert_eq!(&raw[len..], b"\x81\x00");
        assert!(parse_head(&raw[..20]).unwrap().is_none());
        assert!(parse_head(b"SSH-2.0-x\r\n\r\n").is_err());
    }

    #[test]
    fn the_request_head_is_the_path_then_each_field() {
        let mut h = HeaderMap::new();
        h.insert(
            HeaderName::from_static("upgrade"),
            HeaderValue::from_static("websocket"),
        );
        assert_eq!(
            request_head("/ws?a=1", &h),
            b"GET /ws?a=1 HTTP/1.1\r\nupgrade: websocket\r\n\r\n"
        );
    }
}
