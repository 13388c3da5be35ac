//! The upstream connection's bytes, kept to RFC 9112 where awc is not: an IO wrapper under
//! awc's HTTP/1.1 codec, put on every upstream connection by the connector services of
//! [`client`] (TCP) and `super::tls` (on TLS's plaintext).
//!
//! awc (3.11, actix-http 3.20) reads one response head per request and believes it, and
//! has no hook to change that. Three ways that goes wrong, each fixed here by rewriting
//! what the codec reads, never what it writes:
//!
//! - **Interim responses.** A `103 Early Hints` or a stray `100 Continue` is taken for the
//!   final response; the real one is lost, or read by the next request the pool gives the
//!   connection to (another client's). RFC 9110 §15.2: a client must be able to parse and
//!   ignore any number of 1xx before the final response. The wrapper drops every 1xx head
//!   but `101` before awc sees it.
//! - **Bodiless statuses and close-delimited bodies.** RFC 9112 §6.3: a `204` or `304`
//!   ends at its head whatever its `Content-Length` or `Transfer-Encoding` say (awc waits
//!   for the body they announce, forever when it never comes), so those two fields are
//!   removed from such a head. A final response with neither field is delimited by the
//!   connection closing (awc reads an HTTP/1.1 one as empty and loses the body), so its
//!   status line is rewritten to `HTTP/1.0`, which awc's decoder reads to EOF and never
//!   pools (`ResponseHead::decode` marks an HTTP/1.0 head without a length
//!   `ConnectionType::Close`, which outranks any `Connection: keep-alive`).
//! - **Truncation.** When the upstream closes in the middle of a `Content-Length` or
//!   chunked body, awc ends the body stream as if it were complete. The wrapper sees that
//!   EOF and records it in the request's [`Probe`]; [`checked_body`] turns the clean end
//!   into an error, so the client's connection is aborted rather than its response
//!   finished short.
//!
//! The wrapper knows where each exchange begins because awc writes the whole request
//! before it reads, and never pipelines: the first write after a final response head
//! starts the next exchange. That write also tells it the request's method (the response
//! to `HEAD` has no body, RFC 9110 §9.3.2) and whether the request carries
//! `Expect: 100-continue` (then the first `100` is awc's to read, RFC 9110 §10.1.1). The
//! same moment tells the [`Probe`] in scope, if any, whether the connection was fresh or
//! came back from the pool, and the probe counts the bytes the upstream answered.
//!
//! For an `https://` replica the wrapper sits above TLS, on the plaintext stream
//! (`super::tls` shakes hands inside the connector service), so the same fixes hold there.

use std::cell::Cell;
use std::fmt;
use std::future::Future;
use std::io;
use std::ops::Range;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use actix_service::{Service, ServiceExt};
use actix_tls::connect::{ConnectError, ConnectInfo, Connection, Resolver};
use actix_web::rt::net::{ActixStream, TcpStream};
use awc::error::PayloadError;
use awc::http::Uri;
use bytes::{Buf, Bytes, BytesMut};
use futures_util::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf, Ready};

/// The longest response head (status line and fields) the wrapper buffers while it looks
/// for the head's end; a longer one is an I/O error.
const MAX_HEAD_BYTES: usize = 64 * 1024;

/// How much is read from the socket at a time while a head is gathered.
const HEAD_READ: usize = 8 * 1024;

/// An awc client whose upstream connections go through the wrapper: no default headers,
/// no redirects, a request timeout of an hour (each route sets its own), up to 4096
/// connections, `connect_timeout` for DNS and TCP connect, and pooled connections reused
/// only within `idle_timeout` of their last use. Plain TCP; `https://` replicas have
/// their own client (`super::tls`).
pub fn client(connect_timeout: Duration, idle_timeout: Duration) -> awc::Client {
    client_over(tcp(), connect_timeout, idle_timeout)
}

/// [`client`]'s settings over the connector service `connect`, which opens a connection
/// and wraps it in [`Wire`] (plain TCP here, TLS in `super::tls`); `connect_timeout`
/// bounds all of its work.
pub fn client_over<S, Io>(
    connect: S,
    connect_timeout: Duration,
    idle_timeout: Duration,
) -> awc::Client
where
    S: Service<ConnectInfo<Uri>, Response = Connection<Uri, Wire<Io>>, Error = ConnectError>
        + Clone
        + 'static,
    Io: ActixStream + fmt::Debug + 'static,
{
    awc::Client::builder()
        .no_default_headers()
        .disable_redirects()
        .timeout(Duration::from_secs(3600))
        .connector(
            awc::Connector::new()
                .connector(connect)
                .timeout(connect_timeout)
                .limit(4096)
                .conn_keep_alive(idle_timeout),
        )
        .finish()
}

/// awc's connector with every TCP connection it opens wrapped in [`Wire`]; further
/// settings (limit, keep-alive) are the caller's.
pub fn connector(
    connect_timeout: Duration,
) -> awc::Connector<
    impl Service<ConnectInfo<Uri>, Response = Connection<Uri, Wire<TcpStream>>, Error = ConnectError>
        + Clone
        + 'static,
> {
    awc::Connector::new()
        .connector(tcp())
        .timeout(connect_timeout)
}

/// The TCP service awc's own `Connector::new` builds (same resolver), each connection
/// wrapped. Its URLs are all `http` (`domain::Upstream::uri`), so every one is inspected.
fn tcp(
) -> impl Service<ConnectInfo<Uri>, Response = Connection<Uri, Wire<TcpStream>>, Error = ConnectError>
       + Clone
       + 'static {
    actix_tls::connect::Connector::new(Resolver::default())
        .service()
        .map(|conn: Connection<Uri, TcpStream>| {
            let (io, conn) = conn.replace_io(());
            conn.replace_io(Wire::new(io, true)).1
        })
}

/// What one exchange on the wire showed, for whoever sent the request.
#[derive(Debug, Default)]
struct Exchange {
    /// Whether the connection had carried an exchange before this one (came from the pool).
    reused: Cell<Option<bool>>,
    /// Bytes the upstream sent in this exchange, interim heads included.
    received: Cell<u64>,
    /// The upstream closed the connection before the end of a framed body.
    truncated: Cell<bool>,
    /// [`checked_body`] has seen the body end; later reads are not this exchange's.
    finished: Cell<bool>,
    /// Whether the request carries `Expect: 100-continue`, when its sender said so
    /// ([`Probe::sending`]); else the wrapper looks for it in the request's head.
    expects_continue: Cell<Option<bool>>,
}

tokio::task_local! {
    /// The probe of the request being sent, read by the wrapper when an exchange starts.
    static CURRENT: Rc<Exchange>;
}

/// A per-request window onto the upstream connection: enter it around awc's send with
/// [`Probe::scope`], then read it, and hand it to [`checked_body`] with the response.
///
/// It describes the last exchange started within its scope, so use one probe per attempt.
#[derive(Clone, Debug, Default)]
pub struct Probe(Rc<Exchange>);

impl Probe {
    /// A probe that has seen no exchange yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// A probe for a request whose sender knows whether it carries
    /// `Expect: 100-continue` (so its head need not be searched for it).
    pub fn sending(expects_continue: bool) -> Self {
        let probe = Self::default();
        probe.0.expects_continue.set(Some(expects_continue));
        probe
    }

    /// Runs `send` (awc's `send`, `send_body`, `send_stream`) with this probe current, so
    /// the exchange it starts is recorded here.
    pub fn scope<F: Future>(&self, send: F) -> impl Future<Output = F::Output> {
        CURRENT.scope(self.0.clone(), send)
    }

    /// `Some(true)` when the request went out on a connection from the pool, `Some(false)`
    /// on a fresh one, `None` when no request was written in scope (connect failed, or the
    /// client does not use the wrapper).
    pub fn reused(&self) -> Option<bool> {
        self.0.reused.get()
    }

    /// Bytes received from the upstream in this exchange so far (0: not a byte of an
    /// answer, e.g. a stale pooled connection closed under the request).
    pub fn received(&self) -> u64 {
        self.0.received.get()
    }
}

/// The response's body, ending in an error instead of a clean end when the upstream
/// closed the connection before the body's `Content-Length` or last chunk: awc reports
/// that as a complete body. `probe` is the one the request was sent in.
pub fn checked_body<S>(res: awc::ClientResponse<S>, probe: &Probe) -> CheckedBody<S>
where
    S: Stream<Item = Result<Bytes, PayloadError>> + Unpin,
{
    CheckedBody {
        res,
        exchange: Some(probe.0.clone()),
    }
}

/// The stream [`checked_body`] returns.
pub struct CheckedBody<S> {
    res: awc::ClientResponse<S>,
    /// Dropped once the stream has ended (cleanly or with the truncation error).
    exchange: Option<Rc<Exchange>>,
}

impl<S> Stream for CheckedBody<S>
where
    S: Stream<Item = Result<Bytes, PayloadError>> + Unpin,
{
    type Item = Result<Bytes, PayloadError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let Some(exchange) = &this.exchange else {
            return Poll::Ready(None);
        };
        match ready!(Pin::new(&mut this.res).poll_next(cx)) {
            Some(item) => Poll::Ready(Some(item)),
            None => {
                let truncated = exchange.truncated.get();
                exchange.finished.set(true);
                this.exchange = None;
                Poll::Ready(truncated.then(|| {
                    Err(PayloadError::Incomplete(Some(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the upstream closed the connection before the end of the body",
                    ))))
                }))
            }
        }
    }
}

/// How the body after a final head ends, as far as truncation is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Framing {
    /// No body (HEAD, 204, 304), or the wrapper leaves it to awc (unparsed head, 101,
    /// an unusual `Transfer-Encoding`).
    Unchecked,
    /// `Content-Length` or chunked: EOF before its end is truncation.
    Framed,
    /// Read to EOF: EOF is its end.
    Close,
}

#[derive(Debug)]
enum ReadState {
    /// Gathering a response head in `buf`.
    Head,
    /// The final head was handed on; bytes pass through.
    Body(Framing),
}

/// An upstream connection as awc's codec sees it: interim responses removed, bodiless and
/// close-delimited heads rewritten, EOF in a framed body recorded (see the module doc).
pub struct Wire<Io> {
    io: Io,
    /// `false`: pass everything through untouched (after `101`).
    inspect: bool,
    read: ReadState,
    /// Bytes read but not yet parsed (a head being gathered).
    buf: BytesMut,
    /// Bytes ready for awc, handed out before the socket is read again.
    pending: BytesMut,
    /// The next write starts a new exchange (set once the final head of the last one is
    /// known, and on a fresh connection).
    next_write_starts: bool,
    /// Exchanges started on this connection.
    exchanges: u64,
    /// The current request is `HEAD`: its response has no body.
    head_request: bool,
    /// The current request carries `Expect: 100-continue`, and no `100` was handed on yet.
    expects_continue: bool,
    /// The probe of the current exchange, when its sender entered one.
    exchange: Option<Rc<Exchange>>,
    /// Where a head is read into, zeroed once per connection (not per read: zeroing
    /// `HEAD_READ` bytes on every poll was a third of a request's instructions).
    scratch: Option<Box<[u8]>>,
}

impl<Io> Wire<Io> {
    /// Wraps a connection; with `inspect` false, it only passes bytes through.
    pub fn new(io: Io, inspect: bool) -> Self {
        Self {
            io,
            inspect,
            read: ReadState::Body(Framing::Unchecked),
            buf: BytesMut::new(),
            pending: BytesMut::new(),
            next_write_starts: true,
            exchanges: 0,
            head_request: false,
            expects_continue: false,
            exchange: None,
            scratch: None,
        }
    }

    /// The first write of a request: a new exchange, whose response head is awaited.
    fn start_exchange(&mut self, request: &[u8]) {
        self.next_write_starts = false;
        self.head_request = request.starts_with(b"HEAD ");
        self.exchange = CURRENT.try_with(Rc::clone).ok();
        self.expects_continue = match self
            .exchange
            .as_ref()
            .and_then(|x| x.expects_continue.get())
        {
            Some(expects) => expects,
            None => expects_continue(request),
        };
        self.read = ReadState::Head;
        // Bytes awc left unread (the pool's check would have refused the connection).
        if !self.pending.is_empty() {
            let mut stale = self.pending.split();
            stale.extend_from_slice(&self.buf);
            self.buf = stale;
        }
        if let Some(x) = &self.exchange {
            x.reused.set(Some(self.exchanges > 0));
            x.received.set(0);
            x.truncated.set(false);
            x.finished.set(false);
        }
        self.exchanges += 1;
    }

    fn received(&self, n: usize) {
        if let Some(x) = &self.exchange {
            x.received.set(x.received.get() + n as u64);
        }
    }

    /// What to do with a complete head (`None`: not a status line awc can parse either).
    fn judge(&self, head: Option<&Head>) -> HeadAction {
        let Some(head) = head else {
            // awc will say what is wrong with it.
            return HeadAction::Final(Framing::Unchecked);
        };
        match head.status {
            // The connection becomes something else (RFC 9110 §15.2.2).
            101 => HeadAction::Upgrade,
            // awc asked for it: hand it on, the request body follows, then the final head.
            100 if self.expects_continue => HeadAction::Continue,
            100..=199 => HeadAction::Interim,
            // RFC 9112 §6.3 ¶2: ends at its head, whatever these say.
            204 | 304 if head.content_length || head.transfer_encoding.is_some() => {
                HeadAction::StripLength
            }
            204 | 304 => HeadAction::Final(Framing::Unchecked),
            _ if self.head_request => HeadAction::Final(Framing::Unchecked),
            _ => match head.transfer_encoding {
                Some(true) => HeadAction::Final(Framing::Framed),
                Some(false) => HeadAction::Final(Framing::Unchecked),
                None if head.content_length => HeadAction::Final(Framing::Framed),
                // RFC 9112 §6.3 ¶8: read until the connection closes. awc does that for
                // HTTP/1.0 only: `HTTP/1.1` → `HTTP/1.0`, same length.
                None if head.http11 => HeadAction::CloseDelimited11,
                None => HeadAction::Final(Framing::Close),
            },
        }
    }

    /// A head read straight into awc's buffer (`fresh`, the bytes this read added), when it
    /// is complete and can be handed on as it is or changed in place: the state moves on
    /// and `true` is returned. Otherwise (`false`) the caller takes the bytes back and
    /// gathers the head in `buf`.
    fn pass_head(&mut self, fresh: &mut [u8]) -> bool {
        if matches!(fresh.first(), Some(b'\r' | b'\n')) {
            return false;
        }
        let Some((_, head)) = Head::scan(fresh) else {
            return false;
        };
        let framing = match self.judge(head.as_ref()) {
            HeadAction::Final(framing) => framing,
            HeadAction::Upgrade => {
                self.inspect = false;
                Framing::Unchecked
            }
            HeadAction::CloseDelimited11 => {
                fresh[7] = b'0';
                Framing::Close
            }
            HeadAction::Continue | HeadAction::Interim | HeadAction::StripLength => return false,
        };
        self.read = ReadState::Body(framing);
        self.next_write_starts = true;
        true
    }

    /// Acts on the head at the front of `buf`, if it is complete: `Ok(true)` when
    /// something was done (call again), `Ok(false)` when more bytes are needed.
    fn step_head(&mut self) -> io::Result<bool> {
        // Empty lines before a status line are skipped, as awc's parser does.
        let blank = self
            .buf
            .iter()
            .take_while(|&&b| b == b'\r' || b == b'\n')
            .count();
        self.buf.advance(blank);
        let Some((end, head)) = Head::scan(&self.buf) else {
            if self.buf.len() >= MAX_HEAD_BYTES {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "upstream response head longer than 64 KiB",
                ));
            }
            return Ok(false);
        };
        match self.judge(head.as_ref()) {
            HeadAction::Final(framing) => self.finish_head(framing),
            HeadAction::Upgrade => {
                self.inspect = false;
                self.finish_head(Framing::Unchecked);
            }
            HeadAction::Continue => {
                self.expects_continue = false;
                self.hand_on(end);
            }
            HeadAction::Interim => self.buf.advance(end),
            HeadAction::StripLength => {
                let kept = without_length_fields(&self.buf[..end]);
                self.buf.advance(end);
                self.pending.extend_from_slice(&kept);
                self.finish_head(Framing::Unchecked);
            }
            HeadAction::CloseDelimited11 => {
                self.buf[7] = b'0';
                self.finish_head(Framing::Close);
            }
        }
        Ok(true)
    }

    /// Moves the first `n` buffered bytes to those awc reads next (without a copy when
    /// nothing is waiting there).
    fn hand_on(&mut self, n: usize) {
        let bytes = self.buf.split_to(n);
        if self.pending.is_empty() {
            self.pending = bytes;
        } else {
            self.pending.extend_from_slice(&bytes);
        }
    }

    /// The final head (or what stands for it) is at the front of `buf`: hand all buffered
    /// bytes on and pass the rest of the exchange through.
    fn finish_head(&mut self, framing: Framing) {
        self.hand_on(self.buf.len());
        self.read = ReadState::Body(framing);
        self.next_write_starts = true;
    }
}

/// What a complete response head calls for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HeadAction {
    /// The final head, handed on as it is; its body is framed so.
    Final(Framing),
    /// `101`: the connection is no longer HTTP; everything passes through.
    Upgrade,
    /// The `100` awc waits for (its request carries `Expect: 100-continue`): handed on.
    Continue,
    /// Any other `1xx`: dropped.
    Interim,
    /// A `204` or `304` announcing a body: handed on without its length fields.
    StripLength,
    /// An HTTP/1.1 final head with no length: rewritten to `HTTP/1.0`, read to the close.
    CloseDelimited11,
}

impl<Io: AsyncRead + Unpin> AsyncRead for Wire<Io> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.inspect && this.pending.is_empty() {
            return Pin::new(&mut this.io).poll_read(cx, out);
        }
        if out.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        loop {
            if !this.pending.is_empty() {
                let n = this.pending.len().min(out.remaining());
                out.put_slice(&this.pending[..n]);
                this.pending.advance(n);
                return Poll::Ready(Ok(()));
            }
            match this.read {
                ReadState::Body(framing) => {
                    let before = out.filled().len();
                    ready!(Pin::new(&mut this.io).poll_read(cx, out))?;
                    let n = out.filled().len() - before;
                    if n > 0 {
                        this.received(n);
                    } else if framing == Framing::Framed {
                        if let Some(x) = &this.exchange {
                            if !x.finished.get() {
                                x.truncated.set(true);
                            }
                        }
                    }
                    return Poll::Ready(Ok(()));
                }
                ReadState::Head if this.buf.is_empty() => {
                    // Nearly every head arrives whole in one read and is handed on as it
                    // is: read it where awc wants it, and look at it there.
                    let before = out.filled().len();
                    ready!(Pin::new(&mut this.io).poll_read(cx, out))?;
                    let n = out.filled().len() - before;
                    if n == 0 {
                        // EOF before a head: awc sees it, and reports it.
                        this.finish_head(Framing::Unchecked);
                        return Poll::Ready(Ok(()));
                    }
                    this.received(n);
                    if this.pass_head(&mut out.filled_mut()[before..]) {
                        return Poll::Ready(Ok(()));
                    }
                    this.buf.extend_from_slice(&out.filled()[before..]);
                    out.set_filled(before);
                }
                ReadState::Head => {
                    if this.step_head()? {
                        continue;
                    }
                    let start = this.buf.len();
                    let want = (MAX_HEAD_BYTES - start).min(HEAD_READ);
                    let scratch = this
                        .scratch
                        .get_or_insert_with(|| vec![0; HEAD_READ].into_boxed_slice());
                    let mut into = ReadBuf::new(&mut scratch[..want]);
                    let polled = Pin::new(&mut this.io).poll_read(cx, &mut into);
                    let n = into.filled().len();
                    this.buf.extend_from_slice(&scratch[..n]);
                    ready!(polled)?;
                    if n == 0 {
                        // EOF before a complete head: awc gets what there is, then EOF,
                        // and reports it.
                        this.finish_head(Framing::Unchecked);
                        if this.pending.is_empty() {
                            return Poll::Ready(Ok(()));
                        }
                    } else {
                        this.received(n);
                    }
                }
            }
        }
    }
}

impl<Io: AsyncWrite + Unpin> AsyncWrite for Wire<Io> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.inspect && this.next_write_starts && !buf.is_empty() {
            this.start_exchange(buf);
        }
        Pin::new(&mut this.io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

impl<Io: ActixStream> ActixStream for Wire<Io> {
    fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<Ready>> {
        let buffered = !self.pending.is_empty()
            || (matches!(self.read, ReadState::Head) && head_end(&self.buf).is_some());
        if buffered {
            return Poll::Ready(Ok(Ready::READABLE));
        }
        self.io.poll_read_ready(cx)
    }

    fn poll_write_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<Ready>> {
        self.io.poll_write_ready(cx)
    }
}

impl<Io: fmt::Debug> fmt::Debug for Wire<Io> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Wire")
            .field("io", &self.io)
            .field("inspect", &self.inspect)
            .field("read", &self.read)
            .field("buffered", &(self.buf.len() + self.pending.len()))
            .field("exchanges", &self.exchanges)
            .finish_non_exhaustive()
    }
}

/// What the wrapper needs of a response head.
#[derive(Debug, PartialEq, Eq)]
struct Head {
    status: u16,
    /// `HTTP/1.1` (else `HTTP/1.0`).
    http11: bool,
    content_length: bool,
    /// `Some(true)`: a `Transfer-Encoding` whose last coding is `chunked`.
    transfer_encoding: Option<bool>,
}

impl Head {
    /// Looks at the head at the front of `buf` in one pass: `None` until its empty line
    /// (`\r\n` or bare `\n`, RFC 9112 §2.2) is there; then the head's length through that
    /// line, and what it says (`None` when the status line is not `HTTP/1.0` or
    /// `HTTP/1.1`, a space and three digits).
    fn scan(buf: &[u8]) -> Option<(usize, Option<Head>)> {
        let mut at = 0;
        // `None` until the status line has been read.
        let mut parsed: Option<Option<Head>> = None;
        loop {
            let len = memchr::memchr(b'\n', &buf[at..])? + 1;
            let line = &buf[at..at + len - 1];
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            at += len;
            match &mut parsed {
                Some(head) if line.is_empty() => return Some((at, head.take())),
                None => parsed = Some(Head::status_line(line)),
                Some(Some(head)) => head.field_line(line),
                Some(None) => {}
            }
        }
    }

    fn status_line(line: &[u8]) -> Option<Head> {
        let http11 = match line.get(..8)? {
            b"HTTP/1.1" => true,
            b"HTTP/1.0" => false,
            _ => return None,
        };
        let code = line.get(9..12)?;
        if line[8] != b' '
            || !code.iter().all(u8::is_ascii_digit)
            || line.get(12).is_some_and(|&b| b != b' ')
        {
            return None;
        }
        Some(Head {
            status: code.iter().fold(0u16, |n, d| n * 10 + u16::from(d - b'0')),
            http11,
            content_length: false,
            transfer_encoding: None,
        })
    }

    /// Takes in one field line (not empty); only `Content-Length` and `Transfer-Encoding`
    /// matter here.
    fn field_line(&mut self, line: &[u8]) {
        if !matches!(line[0] | 0x20, b'c' | b't') {
            return;
        }
        match field(line) {
            Some((name, _)) if name.eq_ignore_ascii_case(b"content-length") => {
                self.content_length = true;
            }
            Some((name, value)) if name.eq_ignore_ascii_case(b"transfer-encoding") => {
                let last = value.rsplit(|&b| b == b',').next().unwrap_or_default();
                self.transfer_encoding = Some(last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
            }
            _ => {}
        }
    }
}

/// The length of the head at the front of `buf`, if it is all there.
fn head_end(buf: &[u8]) -> Option<usize> {
    Head::scan(buf).map(|(end, _)| end)
}

/// The lines of a head: each one's range in `head` (terminator included) and its text
/// (without `\r\n` or `\n`). The empty line that ends the head is not one of them.
fn lines(head: &[u8]) -> impl Iterator<Item = (Range<usize>, &[u8])> {
    let mut at = 0;
    std::iter::from_fn(move || {
        let rest = head.get(at..)?;
        let len = rest.iter().position(|&b| b == b'\n')? + 1;
        let start = at;
        at += len;
        let text = &rest[..len - 1];
        let text = text.strip_suffix(b"\r").unwrap_or(text);
        (!text.is_empty()).then_some((start..at, text))
    })
}

/// A field line's name and value (`None` for a continuation or a line without `:`).
fn field(line: &[u8]) -> Option<(&[u8], &[u8])> {
    if line.first().is_some_and(|&b| b == b' ' || b == b'\t') {
        return None;
    }
    let colon = line.iter().position(|&b| b == b':')?;
    // awc's parser allows whitespace between a response field's name and the colon.
    Some((
        line[..colon].trim_ascii_end(),
        line[colon + 1..].trim_ascii(),
    ))
}

/// A complete head without its `Content-Length` and `Transfer-Encoding` lines.
fn without_length_fields(head: &[u8]) -> BytesMut {
    let mut kept = BytesMut::with_capacity(head.len());
    let mut last = 0;
    for (range, line) in lines(head) {
        let drop = field(line).is_some_and(|(name, _)| {
            name.eq_ignore_ascii_case(b"content-length")
                || name.eq_ignore_ascii_case(b"transfer-encoding")
        });
        if !drop {
            kept.extend_from_slice(&head[range.clone()]);
        }
        last = range.end;
    }
    kept.extend_from_slice(&head[last..]);
    kept
}

/// Whether a request's head (at the front of `request`) asks for `100-continue`. Most
/// heads have no `Expect` (the forwarder drops it): only a line starting with `e` is
/// looked at, and the scan stops at the head's empty line.
fn expects_continue(request: &[u8]) -> bool {
    // One vectorised pass rules out nearly every request: the value holds `100-`, in any case.
    static VALUE: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
        std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"100-"));
    if VALUE.find(request).is_none() {
        return false;
    }
    for i in memchr::memchr_iter(b'\n', request) {
        let rest = &request[i + 1..];
        match rest.first() {
            None | Some(b'\r' | b'\n') => return false,
            Some(&c) if c | 0x20 == b'e' => {
                let line = &rest[..memchr::memchr2(b'\r', b'\n', rest).unwrap_or(rest.len())];
                let expect = field(line).is_some_and(|(name, value)| {
                    name.eq_ignore_ascii_case(b"expect")
                        && value.eq_ignore_ascii_case(b"100-continue")
                });
                if expect {
                    return true;
                }
            }
            Some(_) => {}
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::{Shutdown, TcpListener};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use futures_util::StreamExt;

    use super::*;

    /// One thing a scripted upstream does on a connection.
    enum Step {
        /// Read one request head (through its empty line).
        Request,
        /// Read this many bytes of request body.
        RequestBody(usize),
        /// Write these bytes, then pause briefly, so the next write is a separate read.
        Send(Vec<u8>),
        /// Close the connection (after writing what was sent).
        Close,
    }
    use Step::*;

    fn send(bytes: &[u8]) -> Step {
        Send(bytes.to_vec())
    }

    /// An upstream on a std thread that writes exactly the bytes a test wants: it accepts
    /// one connection per script, in order, and plays the script on it (a connection not
    /// closed by its script is held until the client closes it). Returns the base URL and
    /// the count of connections accepted.
    fn upstream(scripts: Vec<Vec<Step>>) -> (String, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        std::thread::spawn(move || {
            for script in scripts {
                let (mut conn, _) = listener.accept().unwrap();
                count.fetch_add(1, Ordering::SeqCst);
                conn.set_read_timeout(Some(Duration::from_secs(10)))
                    .unwrap();
                let mut closed = false;
                for step in script {
                    match step {
                        Request => {
                            let mut head = Vec::new();
                            let mut byte = [0u8; 1];
                            while !head.ends_with(b"\r\n\r\n") {
                                if conn.read(&mut byte).unwrap_or(0) == 0 {
                                    return;
                                }
                                head.push(byte[0]);
                            }
                        }
                        RequestBody(n) => {
                            let mut body = vec![0u8; n];
                            conn.read_exact(&mut body).unwrap();
                        }
                        Send(bytes) => {
                            conn.write_all(&bytes).unwrap();
                            conn.flush().unwrap();
                            std::thread::sleep(Duration::from_millis(50));
                        }
                        Close => {
                            let _ = conn.shutdown(Shutdown::Both);
                            closed = true;
                        }
                    }
                }
                if !closed {
                    // Held open: the client decides when it ends.
                    let mut rest = Vec::new();
                    let _ = conn.read_to_end(&mut rest);
                }
            }
        });
        (base, accepted)
    }

    fn test_client() -> awc::Client {
        client(Duration::from_secs(2), Duration::from_secs(30))
    }

    /// One response as the forwarder would see it.
    struct Fetched {
        probe: Probe,
        status: u16,
        body: Result<Vec<u8>, PayloadError>,
    }

    /// Sends `req` in a probe and reads the whole (checked) body, within 5 s.
    async fn fetch(req: awc::ClientRequest, body: &'static str) -> Result<Fetched, String> {
        let probe = Probe::new();
        let exchange = async {
            let res = probe
                .scope(req.send_body(body))
                .await
                .map_err(|e| e.to_string())?;
            let status = res.status().as_u16();
            let mut stream = checked_body(res, &probe);
            let mut body = Ok(Vec::new());
            while let Some(chunk) = stream.next().await {
                match (chunk, &mut body) {
                    (Ok(bytes), Ok(all)) => all.extend_from_slice(&bytes),
                    (Err(e), _) => body = Err(e),
                    (Ok(_), Err(_)) => {}
                }
            }
            Ok(Fetched {
                probe: probe.clone(),
                status,
                body,
            })
        };
        tokio::time::timeout(Duration::from_secs(5), exchange)
            .await
            .map_err(|_| "timed out".to_string())?
    }

    async fn get(client: &awc::Client, base: &str) -> Result<Fetched, String> {
        fetch(client.get(format!("{base}/x")), "").await
    }

    fn ok(body: &str) -> Vec<u8> {
        format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .into_bytes()
    }

    const EARLY_HINTS: &[u8] = b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n";

    #[actix_web::test]
    async fn early_hints_and_the_final_response_in_one_write() {
        let mut both = EARLY_HINTS.to_vec();
        both.extend_from_slice(&ok("hello"));
        let (base, _) = upstream(vec![vec![Request, Send(both)]]);
        let res = get(&test_client(), &base).await.unwrap();
        assert_eq!(res.status, 200);
        assert_eq!(res.body.unwrap(), b"hello");
    }

    #[actix_web::test]
    async fn early_hints_split_across_writes_then_the_final_response() {
        let (base, _) = upstream(vec![vec![
            Request,
            send(b"HTTP/1.1 10"),
            send(b"3 Early Hints\r\nLink: </a.css>; rel=preload\r\n"),
            send(b"\r\n"),
            Send(ok("hello")),
        ]]);
        let res = get(&test_client(), &base).await.unwrap();
        assert_eq!(res.status, 200);
        assert_eq!(res.body.unwrap(), b"hello");
    }

    #[actix_web::test]
    async fn a_stray_continue_is_dropped_and_the_connection_stays_in_step() {
        let (base, accepted) = upstream(vec![vec![
            Request,
            send(b"HTTP/1.1 100 Continue\r\n\r\n"),
            Send(ok("first")),
            Request,
            Send(ok("second")),
        ]]);
        let client = test_client();
        let first = get(&client, &base).await.unwrap();
        assert_eq!(
            (first.status, first.body.unwrap()),
            (200, b"first".to_vec())
        );
        let second = get(&client, &base).await.unwrap();
        assert_eq!(
            (second.status, second.body.unwrap()),
            (200, b"second".to_vec())
        );
        assert_eq!(second.probe.reused(), Some(true));
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[actix_web::test]
    async fn two_interim_responses_with_bare_newlines_then_the_final_one() {
        let (base, _) = upstream(vec![vec![
            Request,
            send(b"HTTP/1.1 100 Continue\n\nHTTP/1.1 103 Early Hints\nLink: </b.js>\n\n"),
            Send(ok("hello")),
        ]]);
        let res = get(&test_client(), &base).await.unwrap();
        assert_eq!(res.status, 200);
        assert_eq!(res.body.unwrap(), b"hello");
    }

    #[actix_web::test]
    async fn an_interim_head_longer_than_the_cap_is_an_error() {
        // Few long lines: within awc's own limits (96 fields, 128 KiB), so without the cap
        // awc would wait for the rest of the head.
        let mut long = b"HTTP/1.1 103 Early Hints\r\n".to_vec();
        while long.len() <= MAX_HEAD_BYTES {
            long.extend_from_slice(format!("Link: </{}.css>\r\n", "a".repeat(4000)).as_bytes());
        }
        let (base, _) = upstream(vec![vec![Request, Send(long)]]);
        let err = get(&test_client(), &base).await.err().unwrap();
        assert!(err.contains("64 KiB"), "{err}");
    }

    #[actix_web::test]
    async fn not_modified_with_a_content_length_ends_at_its_head() {
        let (base, accepted) = upstream(vec![vec![
            Request,
            send(b"HTTP/1.1 304 Not Modified\r\nETag: \"v1\"\r\nContent-Length: 10\r\n\r\n"),
            Request,
            Send(ok("after")),
        ]]);
        let client = test_client();
        let res = get(&client, &base).await.unwrap();
        assert_eq!(res.status, 304);
        assert_eq!(res.body.unwrap(), b"");
        let next = get(&client, &base).await.unwrap();
        assert_eq!(next.body.unwrap(), b"after");
        assert_eq!(next.probe.reused(), Some(true));
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[actix_web::test]
    async fn no_content_ends_at_its_head_whatever_it_says() {
        let (base, accepted) = upstream(vec![vec![
            Request,
            send(b"HTTP/1.1 204 No Content\r\n\r\n"),
            Request,
            send(b"HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked\r\n\r\n"),
            Request,
            Send(ok("after")),
        ]]);
        let client = test_client();
        for _ in 0..2 {
            let res = get(&client, &base).await.unwrap();
            assert_eq!(res.status, 204);
            assert_eq!(res.body.unwrap(), b"");
        }
        let next = get(&client, &base).await.unwrap();
        assert_eq!(next.body.unwrap(), b"after");
        assert_eq!(next.probe.reused(), Some(true));
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[actix_web::test]
    async fn a_close_delimited_body_is_read_to_eof_and_not_pooled() {
        let body: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let mut response = b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\n\r\n".to_vec();
        response.extend_from_slice(&body);
        let (base, accepted) = upstream(vec![
            vec![Request, Send(response), Close],
            vec![Request, Send(ok("fresh"))],
        ]);
        let client = test_client();
        let res = get(&client, &base).await.unwrap();
        assert_eq!(res.status, 200);
        let got = res.body.unwrap();
        assert_eq!(got.len(), body.len());
        assert!(got == body, "the body read differs from the one sent");
        let next = get(&client, &base).await.unwrap();
        assert_eq!(next.body.unwrap(), b"fresh");
        assert_eq!(next.probe.reused(), Some(false));
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    /// Heads usually arrive whole and are looked at in awc's own buffer; these arrive in
    /// pieces, and are gathered before they are judged.
    #[actix_web::test]
    async fn heads_split_across_reads_are_gathered_then_judged() {
        let (base, accepted) = upstream(vec![
            vec![
                Request,
                send(b"HTTP/1.1 200 OK\r\nContent-"),
                send(b"Length: 5\r\n"),
                send(b"\r\nfirst"),
                Request,
                send(b"HTTP/1.1 304 Not Modified\r\nContent-Length: 9\r"),
                send(b"\n\r\n"),
                Request,
                send(b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\n"),
                send(b"\r\nto the close"),
                Close,
            ],
            vec![Request, Send(ok("fresh"))],
        ]);
        let client = test_client();
        let first = get(&client, &base).await.unwrap();
        assert_eq!(first.body.unwrap(), b"first");
        let not_modified = get(&client, &base).await.unwrap();
        assert_eq!(not_modified.status, 304);
        assert_eq!(not_modified.body.unwrap(), b"");
        assert_eq!(not_modified.probe.reused(), Some(true));
        let closing = get(&client, &base).await.unwrap();
        assert_eq!(closing.body.unwrap(), b"to the close");
        assert_eq!(closing.probe.reused(), Some(true));
        let next = get(&client, &base).await.unwrap();
        assert_eq!(next.body.unwrap(), b"fresh");
        assert_eq!(next.probe.reused(), Some(false));
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[actix_web::test]
    async fn a_head_response_has_no_body_and_keeps_the_connection() {
        let (base, accepted) = upstream(vec![vec![
            Request,
            send(b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n"),
            Request,
            send(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n"),
            Request,
            Send(ok("after")),
        ]]);
        let client = test_client();
        for _ in 0..2 {
            let res = fetch(client.head(format!("{base}/x")), "").await.unwrap();
            assert_eq!(res.status, 200);
            assert_eq!(res.body.unwrap(), b"");
        }
        let next = get(&client, &base).await.unwrap();
        assert_eq!(next.body.unwrap(), b"after");
        assert_eq!(next.probe.reused(), Some(true));
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[actix_web::test]
    async fn eof_inside_a_content_length_body_is_an_error() {
        let (base, _) = upstream(vec![vec![
            Request,
            send(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b"),
            Close,
        ]]);
        let res = get(&test_client(), &base).await.unwrap();
        assert_eq!(res.status, 200);
        let err = res.body.unwrap_err();
        assert!(matches!(err, PayloadError::Incomplete(Some(_))), "{err}");
    }

    #[actix_web::test]
    async fn eof_inside_a_chunked_body_is_an_error() {
        let (base, _) = upstream(vec![vec![
            Request,
            send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"),
            Close,
        ]]);
        let res = get(&test_client(), &base).await.unwrap();
        assert_eq!(res.status, 200);
        let err = res.body.unwrap_err();
        assert!(matches!(err, PayloadError::Incomplete(Some(_))), "{err}");
    }

    #[actix_web::test]
    async fn complete_bodies_followed_by_a_close_are_not_truncated() {
        let (base, _) = upstream(vec![
            vec![
                Request,
                send(
                    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
                ),
                Close,
            ],
            vec![Request, Send(ok("hello")), Close],
        ]);
        let client = test_client();
        for _ in 0..2 {
            let res = get(&client, &base).await.unwrap();
            assert_eq!(res.body.unwrap(), b"hello");
            // Given time to arrive, the close is seen by the pool's check of the connection,
            // which then opens a fresh one.
            assert_eq!(res.probe.reused(), Some(false));
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    #[actix_web::test]
    async fn keep_alive_exchanges_reuse_the_connection() {
        let (base, accepted) = upstream(vec![vec![
            Request,
            Send(ok("first")),
            Request,
            Send(ok("second")),
        ]]);
        let client = test_client();
        let first = get(&client, &base).await.unwrap();
        assert_eq!(first.body.unwrap(), b"first");
        assert_eq!(first.probe.reused(), Some(false));
        assert_eq!(first.probe.received(), ok("first").len() as u64);
        let second = get(&client, &base).await.unwrap();
        assert_eq!(second.body.unwrap(), b"second");
        assert_eq!(second.probe.reused(), Some(true));
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[actix_web::test]
    async fn an_expected_continue_reaches_awc_and_the_body_follows() {
        let mut interim = EARLY_HINTS.to_vec();
        interim.extend_from_slice(b"HTTP/1.1 100 Continue\r\n\r\n");
        let (base, accepted) = upstream(vec![vec![
            Request,
            Send(interim),
            RequestBody(5),
            Send(ok("stored")),
            Request,
            Send(ok("after")),
        ]]);
        let client = test_client();
        let req = client
            .post(format!("{base}/x"))
            .insert_header(("expect", "100-continue"));
        let res = fetch(req, "hello").await.unwrap();
        assert_eq!((res.status, res.body.unwrap()), (200, b"stored".to_vec()));
        let next = get(&client, &base).await.unwrap();
        assert_eq!(next.body.unwrap(), b"after");
        assert_eq!(next.probe.reused(), Some(true));
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn heads_are_parsed_and_their_length_fields_removed() {
        let head = b"HTTP/1.1 304 Not Modified\r\nETag: \"v1\"\r\ncontent-length : 10\nTransfer-Encoding: gzip, chunked\r\nVary: a\r\n\r\n";
        assert_eq!(head_end(head), Some(head.len()));
        assert_eq!(
            Head::scan(head).and_then(|(_, head)| head),
            Some(Head {
                status: 304,
                http11: true,
                content_length: true,
                transfer_encoding: Some(true),
            })
        );
        assert_eq!(
            &without_length_fields(head)[..],
            b"HTTP/1.1 304 Not Modified\r\nETag: \"v1\"\r\nVary: a\r\n\r\n"
        );
        assert_eq!(head_end(b"HTTP/1.1 200 OK\r\nA: b\r\n"), None);
        assert_eq!(Head::scan(b"HTTP/2 200 OK\r\n\r\n"), Some((17, None)));
        assert_eq!(Head::scan(b"HTTP/1.1 20 OK\r\n\r\n"), Some((18, None)));
        assert!(expects_continue(
            b"POST / HTTP/1.1\r\nexpect: 100-continue\r\n\r\nbody"
        ));
        assert!(!expects_continue(
            b"POST / HTTP/1.1\r\n\r\nexpect: 100-continue\r\n"
        ));
    }
}
