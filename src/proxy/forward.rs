//! Forwarding an admitted request to a replica of its route with awc, bodies streamed both
//! ways. A try that failed before the service could have acted on it is made again on
//! another replica, within the route's retry budget; a replica that keeps failing is set
//! aside (see [`super::replicas`]). However many tries, a request is one decision: the
//! guard took its tokens once, before the first.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix_web::body::BoxBody;
use actix_web::dev::{Payload, ServiceRequest, ServiceResponse};
use actix_web::error::PayloadError;
use actix_web::http::header::{self, HeaderMap, HeaderValue};
use actix_web::http::uri::PathAndQuery;
use actix_web::http::{Method, StatusCode, Version};
use actix_web::{web, HttpMessage, HttpRequest, HttpResponse};
use awc::error::{ConnectError, SendRequestError};
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;

use super::clients::Clients;
use super::edge;
use super::headers::{
    connection_headers, forwardable, response_headers, Origin, RequestId, X_CLIENT_ID,
    X_FORWARDED_FOR, X_FORWARDED_HOST, X_FORWARDED_PROTO, X_REQUEST_ID,
};
use super::replicas::{now_ms, InFlight, Replica, TryResult};
use super::tls;
use super::wire::{checked_body, Probe};
use super::Route;
use crate::catalog::{ClientEntry, PlanSlot};
use crate::configuration::{KeySource, UpstreamSettings};
use crate::domain::Upstream;
use crate::error::ApiError;
use crate::limiter::Anonymous;
use crate::state::AppState;
use crate::trace;

/// Who a request is.
pub(super) enum Who {
    /// The client its key names.
    Client(Arc<ClientEntry>),
    /// No key, on a public route: its client address.
    Anonymous(Arc<Anonymous>),
}

impl Who {
    /// The plan the request is limited by.
    pub fn plan(&self) -> &Arc<PlanSlot> {
        match self {
            Who::Client(client) => &client.plan,
            Who::Anonymous(who) => &who.plan,
        }
    }
}

/// What the guard hands the forwarder for an admitted request.
pub(super) struct Admitted {
    pub who: Who,
    pub route: Arc<Route>,
    /// The normal form of the path with the query as received, when it differs from the
    /// request's; `None`: forward the request's own (most paths are already normal).
    pub path_and_query: Option<PathAndQuery>,
    /// Where its key came from (`None`: it had none); that header is not forwarded.
    pub key_source: Option<KeySource>,
}

/// Forwards an admitted request (see [`forward`]), answering a failure as a handler's
/// `Err` is answered: the error's response, with the error kept in it for the
/// middlewares above.
pub(super) async fn respond(
    req: ServiceRequest,
    admitted: Admitted,
    clients: &Clients,
) -> ServiceResponse<BoxBody> {
    let (req, payload) = req.into_parts();
    let payload = Rc::new(RefCell::new(Some(payload)));
    let res = match forward(&req, Rc::clone(&payload), admitted, clients).await {
        Ok(res) => res,
        Err(e) => HttpResponse::from_error(e),
    };
    // A body not read to its end (a failed try, a fault, a service that answered before
    // it had all of it) is held until the answer is written, so the connection closes
    // after a bounded linger rather than drain it with no timer (see `edge`); a finished
    // one keeps the connection alive.
    let res = match payload.borrow_mut().take() {
        Some(body) => edge::keep_payload(res, body),
        None => res,
    };
    ServiceResponse::new(req, res)
}

/// What the client's own body did wrong: answered as the client's fault, never counted
/// against the service.
#[derive(Debug, Clone, Copy)]
enum BodyFault {
    /// Past `server.max_body_bytes`.
    TooLarge,
    /// Nothing for `upstream.body_timeout_ms`.
    Stalled,
    /// The client ended it early or broke it.
    Broken,
}

/// The request's body, as each try sends it.
enum Body {
    None,
    /// Read whole before the first try (it fits `upstream.replay_body_bytes`): every try
    /// sends it again.
    Kept(Bytes),
    /// Streamed to the service as it arrives: only a try that never read from it can be
    /// followed by another. `len`: the declared length, when there is one.
    Streamed {
        payload: Rc<RefCell<Option<Payload>>>,
        len: Option<u64>,
    },
}

impl Body {
    /// Whether another try can send it: a streamed body only if no try read from it.
    fn replayable(&self, state: &BodyState) -> bool {
        match self {
            Body::None | Body::Kept(_) => true,
            Body::Streamed { .. } => !state.touched.get(),
        }
    }
}

/// What the body stream saw, for the forwarder.
#[derive(Default)]
struct BodyState {
    fault: Cell<Option<BodyFault>>,
    /// A try read from a streamed body: it cannot be sent again.
    touched: Cell<bool>,
}

/// How a try failed, by what the service may have seen of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TryFailure {
    /// No connection: nothing was sent (refused, connect timeout, no address, or a TLS
    /// handshake that failed, e.g. on a certificate not verified).
    NothingSent,
    /// The connection broke before any response: the service may have seen the request.
    NoResponse,
    /// The route's timeout passed without a response head.
    TimedOut,
    /// The service answered something that is not HTTP.
    Malformed,
    /// A pooled connection the replica had closed (the keep-alive race): reused, and not a
    /// byte came back on it. Not the replica's failure, and made again outside the budget.
    Stale,
}

impl TryFailure {
    fn of(e: &SendRequestError) -> TryFailure {
        match e {
            SendRequestError::Connect(ConnectError::Disconnected) => TryFailure::NoResponse,
            SendRequestError::Connect(_) => TryFailure::NothingSent,
            SendRequestError::Timeout => TryFailure::TimedOut,
            SendRequestError::Send(_)
            | SendRequestError::Response(actix_http::error::ParseError::Io(_)) => {
                TryFailure::NoResponse
            }
            _ => TryFailure::Malformed,
        }
    }

    /// How a try failed, telling a stale pooled connection (reused, and not a byte came
    /// back) from a replica that broke the connection.
    fn of_try(e: &SendRequestError, probe: &Probe) -> TryFailure {
        match TryFailure::of(e) {
            TryFailure::NoResponse if probe.reused() == Some(true) && probe.received() == 0 => {
                TryFailure::Stale
            }
            failure => failure,
        }
    }

    /// Whether a request whose try failed so may be sent again, by what the service may
    /// have seen of it (timed out or malformed: it may have acted on it).
    fn may_try_again(self, method: &Method, e: &SendRequestError) -> bool {
        match self {
            TryFailure::NothingSent => true,
            // A write that failed sent nothing the service can have read.
            TryFailure::Stale => idempotent(method) || matches!(e, SendRequestError::Send(_)),
            TryFailure::NoResponse => idempotent(method),
            TryFailure::TimedOut | TryFailure::Malformed => false,
        }
    }

    fn error(self, e: &SendRequestError) -> ApiError {
        if let Some(failure) = tls::failure(e) {
            return ApiError::UpstreamTls(failure);
        }
        match (self, e) {
            (TryFailure::TimedOut, _) | (_, SendRequestError::Connect(ConnectError::Timeout)) => {
                ApiError::GatewayTimeout
            }
            _ => ApiError::BadGateway,
        }
    }
}

/// The most stale pooled connections one request is tried on before it gives up.
const MAX_STALE: u32 = 8;

/// Methods a request of which may be sent twice (RFC 9110 §9.2.2).
fn idempotent(m: &Method) -> bool {
    matches!(
        *m,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::PUT | Method::DELETE
    )
}

/// Sends the request on to a replica of its route and streams the answer back.
#[tracing::instrument(name = "forward", level = "debug", skip_all, fields(service, upstream))]
async fn forward(
    req: &HttpRequest,
    payload: Rc<RefCell<Option<Payload>>>,
    admitted: Admitted,
    clients: &Clients,
) -> Result<HttpResponse, ApiError> {
    // Borrowed from the request rather than extracted (an extractor clones the `Arc`
    // every worker shares).
    let state = req
        .app_data::<web::Data<AppState>>()
        .ok_or_else(|| ApiError::Internal(anyhow::anyhow!("no AppState")))?;
    let route = &admitted.route;
    let settings = &state.upstream;
    let started = Instant::now();
    let deadline = started + route.timeout;
    let span = tracing::Span::current();
    span.record("service", &*route.service);

    let body_state = Rc::new(BodyState::default());
    let body = match read_body(req, payload, state).await {
        Ok(body) => body,
        Err(fault) => return Err(fault_error(fault, state)),
    };

    let _request = route.retries.request();
    let mut tries = Tries::new(route, settings, deadline);
    loop {
        let replica = tries.next_replica()?;
        span.record("upstream", replica.upstream.base());
        let remaining = deadline.saturating_duration_since(Instant::now());
        let client = clients.of(&replica.upstream);
        let (out, upstream_span) = prepare(req, &admitted, replica, state, client, remaining)?;
        let in_flight = replica.start();
        let probe = Probe::sending(out.headers().contains_key(header::EXPECT));
        let result = send(out, &body, &probe, state, &body_state).await;
        drop(in_flight);
        let e = match result {
            Ok(res) => {
                answered(route, replica, state, upstream_span, res.status(), started);
                drop(tries);
                return response(req.method(), res, &probe);
            }
            Err(e) => e,
        };
        // The client's own body failed the try: its fault, not the service's.
        if let Some(fault) = body_state.fault.get() {
            if let Some(span) = upstream_span {
                span.finish(0, false);
            }
            return Err(fault_error(fault, state));
        }
        let failure = TryFailure::of_try(&e, &probe);
        tries.failed(replica, failure);
        let err = failure.error(&e);
        if let Some(span) = upstream_span {
            span.finish(err_status(&err), false);
        }
        if matches!(err, ApiError::UpstreamTls(_)) {
            replica.count_tls_failure();
            // The precise reason (unknown issuer, name, expiry) is for the operator only.
            tracing::warn!(service = %route.service, upstream = replica.upstream.base(), error = %e, "upstream TLS handshake failed");
        } else {
            tracing::warn!(service = %route.service, upstream = replica.upstream.base(), error = %e, "upstream try failed");
        }
        if tries.again(failure, req.method(), &e, body.replayable(&body_state)) {
            continue;
        }
        state
            .metrics
            .record_upstream(&route.service, err_status(&err), started.elapsed());
        return Err(err);
    }
}

/// What one request's tries have done so far, and whether it may be tried again.
struct Tries<'r> {
    route: &'r Route,
    settings: &'r UpstreamSettings,
    deadline: Instant,
    /// The replicas tried, in order (a stale pooled connection's is not a try).
    tried: Vec<usize>,
    /// Stale pooled connections met.
    stale: u32,
    /// The room this request's retry holds in the route's retry budget.
    retry: Option<InFlight<'r>>,
}

impl<'r> Tries<'r> {
    fn new(route: &'r Route, settings: &'r UpstreamSettings, deadline: Instant) -> Tries<'r> {
        Tries {
            route,
            settings,
            deadline,
            tried: Vec::new(),
            stale: 0,
            retry: None,
        }
    }

    /// The replica the next try goes to: one not tried yet, while there is one.
    fn next_replica(&mut self) -> Result<&'r Arc<Replica>, ApiError> {
        let i = self
            .route
            .replicas
            .pick(&self.tried, now_ms())
            .ok_or_else(|| ApiError::Internal(anyhow::anyhow!("a route without replicas")))?;
        self.tried.push(i);
        Ok(self.route.replicas.get(i))
    }

    /// Counts a try that failed so: against `replica`, unless its connection was stale.
    fn failed(&mut self, replica: &Replica, failure: TryFailure) {
        if failure == TryFailure::Stale {
            // Does not count as a try either (nginx's rule for a cached connection): the
            // pool drops each stale connection it meets, so this ends.
            self.stale += 1;
            self.tried.pop();
        } else {
            record(self.route, replica, TryResult::Failed, self.settings);
        }
    }

    /// Whether the request is sent again after a try that failed so (its body
    /// `replayable` or not), taking room in the route's retry budget when it needs it.
    fn again(
        &mut self,
        failure: TryFailure,
        method: &Method,
        e: &SendRequestError,
        replayable: bool,
    ) -> bool {
        let may_retry = replayable
            && self.tried.len() < self.settings.max_tries as usize
            && self.stale <= MAX_STALE
            && Instant::now() < self.deadline
            && failure.may_try_again(method, e);
        if !may_retry {
            return false;
        }
        // A try that sent nothing, or met a stale pooled connection, is made again
        // outside the budget: it is the request's first to reach a service, and
        // `max_tries`, ejection and the pool bound it. The budget keeps retries of tries a
        // service may have worked on from becoming a storm; one retry in flight per
        // request at most.
        let retries = &self.route.retries;
        if matches!(failure, TryFailure::NothingSent | TryFailure::Stale) || self.retry.is_some() {
            retries.count_free();
            return true;
        }
        self.retry = retries.retry(self.settings);
        if self.retry.is_none() {
            tracing::warn!(service = %self.route.service, "retry refused: the route's retry budget is spent");
        }
        self.retry.is_some()
    }
}

/// One try: the request `out` with the body as this try sends it.
async fn send(
    out: awc::ClientRequest,
    body: &Body,
    probe: &Probe,
    state: &AppState,
    body_state: &Rc<BodyState>,
) -> Result<awc::ClientResponse<actix_web::dev::Decompress<Payload>>, SendRequestError> {
    match body {
        Body::None => probe.scope(out.send()).await,
        Body::Kept(bytes) => probe.scope(out.send_body(bytes.clone())).await,
        Body::Streamed { payload, len } => {
            let stream = streamed(Rc::clone(payload), state, Rc::clone(body_state));
            match len {
                Some(len) => {
                    probe
                        .scope(out.send_body(actix_web::body::SizedStream::new(*len, stream)))
                        .await
                }
                None => probe.scope(out.send_stream(stream)).await,
            }
        }
    }
}

/// A try the service answered: counted on its replica (a 502, 503 or 504 as a failure),
/// its span and the route's metrics.
fn answered(
    route: &Route,
    replica: &Replica,
    state: &AppState,
    upstream_span: Option<trace::UpstreamSpan>,
    status: StatusCode,
    started: Instant,
) {
    let result = match status {
        StatusCode::BAD_GATEWAY | StatusCode::SERVICE_UNAVAILABLE | StatusCode::GATEWAY_TIMEOUT => {
            TryResult::Failed
        }
        _ => TryResult::Answered,
    };
    record(route, replica, result, &state.upstream);
    if let Some(span) = upstream_span {
        span.finish(status.as_u16(), true);
    }
    state
        .metrics
        .record_upstream(&route.service, status.as_u16(), started.elapsed());
}

/// Records a try's outcome on its replica, and says so when it ejected it.
fn record(route: &Route, replica: &Replica, result: TryResult, s: &UpstreamSettings) {
    if let Some(length) = replica.record(result, s, now_ms()) {
        tracing::warn!(
            service = %route.service,
            upstream = replica.upstream.base(),
            ejected_ms = length.as_millis() as u64,
            "replica ejected after {} failures in a row",
            s.eject_after
        );
    }
}

/// The request to one replica, with the forwarded headers, and its trace span.
fn prepare(
    req: &HttpRequest,
    admitted: &Admitted,
    replica: &Replica,
    state: &AppState,
    client: &awc::Client,
    remaining: Duration,
) -> Result<(awc::ClientRequest, Option<trace::UpstreamSpan>), ApiError> {
    let upstream = &replica.upstream;
    // The path the request was routed on: the guard's normal form when it rewrote it.
    let path_and_query = admitted
        .path_and_query
        .as_ref()
        .or(req.uri().path_and_query());
    let uri = upstream
        .uri(path_and_query)
        .map_err(|e| ApiError::Internal(e.into()))?;
    let mut out = client
        .request(req.method().clone(), uri)
        .timeout(remaining)
        .no_decompress();

    write_forwarded_headers(req, admitted, upstream, state, out.headers_mut())?;
    let span = trace::propagate(req, state.traces.as_ref(), out.headers_mut());
    Ok((out, span))
}

/// The headers a request to a service carries (a forward's, and a WebSocket upgrade's):
/// the client's end-to-end ones but the API key, the replica's `Host`, the client's
/// identity, `X-Forwarded-*` and `Forwarded`, and the request id; written into `headers`.
pub(super) fn write_forwarded_headers(
    req: &HttpRequest,
    admitted: &Admitted,
    upstream: &Upstream,
    state: &AppState,
    headers: &mut HeaderMap,
) -> Result<(), ApiError> {
    // The scheme of this hop: the listener's, never a header the client sent (those are
    // believed only from trusted proxies, in `Origin::of`).
    let scheme = if req.app_config().secure() {
        "https"
    } else {
        "http"
    };
    let origin = Origin::of(
        req.headers(),
        req.peer_addr().map(|a| a.ip()),
        scheme,
        &state.trusted_proxies,
    );
    // Both are built from addresses and checked header text: a value they cannot make is
    // the gateway's bug, answered 500.
    let value = |v: String| HeaderValue::try_from(v).map_err(|e| ApiError::Internal(e.into()));
    let forwarded = value(origin.forwarded())?;
    let listed = connection_headers(req.headers());
    for (name, value) in req.headers() {
        if forwardable(name, state.key_sources.header(), &listed)
            && !(name == header::AUTHORIZATION && admitted.key_source == Some(KeySource::Bearer))
        {
            headers.append(name.clone(), value.clone());
        }
    }
    headers.insert(header::HOST, upstream.host().clone());
    if let Who::Client(client) = &admitted.who {
        headers.insert(X_CLIENT_ID.clone(), client.id_header.clone());
    }
    headers.insert(X_FORWARDED_FOR.clone(), value(origin.x_forwarded_for)?);
    headers.insert(
        X_FORWARDED_PROTO.clone(),
        HeaderValue::from_static(origin.proto),
    );
    headers.insert(header::FORWARDED, forwarded);
    if let Some(host) = origin.host {
        headers.insert(X_FORWARDED_HOST.clone(), host);
    }
    if let Some(id) = req.extensions().get::<RequestId>() {
        headers.insert(X_REQUEST_ID.clone(), id.0.clone());
    }
    Ok(())
}

/// The body as the tries will send it: none, kept whole (small enough to send again), or
/// streamed. A `Content-Length` past `server.max_body_bytes` is refused before a byte is
/// read.
async fn read_body(
    req: &HttpRequest,
    payload: Rc<RefCell<Option<Payload>>>,
    state: &AppState,
) -> Result<Body, BodyFault> {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    // HTTP/1.1 says a body's length with one of two fields, and a request with neither has
    // no body. HTTP/2 needs neither: a request whose stream did not end with its head has
    // a body, of the length its DATA frames come to (actix-http gives a request whose head
    // ended the stream no payload).
    let unframed = || {
        req.version() == Version::HTTP_2
            && declared.is_none()
            && payload
                .borrow()
                .as_ref()
                .is_some_and(|p| !matches!(p, Payload::None))
    };
    let chunked = req.headers().contains_key(header::TRANSFER_ENCODING) || unframed();
    match (declared, chunked) {
        (_, true) => Ok(Body::Streamed { payload, len: None }),
        (Some(len), _) if len > state.max_body_bytes => Err(BodyFault::TooLarge),
        (Some(len), _) if len > 0 && len <= state.upstream.replay_body_bytes => {
            // Out of the cell while awaited, and back after, read whole or not: an
            // unfinished one is held by the answer (see `respond`).
            let Some(mut taken) = payload.borrow_mut().take() else {
                return Ok(Body::None);
            };
            let mut kept = BytesMut::with_capacity(len as usize);
            let read = async {
                while let Some(chunk) = next_chunk(&mut taken, state.upstream.body_timeout).await? {
                    kept.extend_from_slice(&chunk);
                }
                Ok(())
            }
            .await;
            *payload.borrow_mut() = Some(taken);
            read.map(|()| Body::Kept(kept.freeze()))
        }
        (Some(len), _) if len > 0 => Ok(Body::Streamed {
            payload,
            len: Some(len),
        }),
        _ => Ok(Body::None),
    }
}

/// The next chunk of the client's body, within `idle`.
async fn next_chunk(payload: &mut Payload, idle: Duration) -> Result<Option<Bytes>, BodyFault> {
    match tokio::time::timeout(idle, payload.next()).await {
        Err(_) => Err(BodyFault::Stalled),
        Ok(None) => Ok(None),
        Ok(Some(Ok(chunk))) => Ok(Some(chunk)),
        Ok(Some(Err(PayloadError::Overflow))) => Err(BodyFault::TooLarge),
        Ok(Some(Err(_))) => Err(BodyFault::Broken),
    }
}

/// A streamed body for one try: each chunk within `upstream.body_timeout_ms`, all of it
/// within `server.max_body_bytes`; a fault is noted for the forwarder and ends the try.
fn streamed(
    payload: Rc<RefCell<Option<Payload>>>,
    state: &AppState,
    body_state: Rc<BodyState>,
) -> impl futures_util::Stream<Item = Result<Bytes, PayloadError>> + 'static {
    let (max, idle) = (state.max_body_bytes, state.upstream.body_timeout);
    futures_util::stream::unfold((payload, 0u64), move |(payload, seen)| {
        let body_state = Rc::clone(&body_state);
        async move {
            body_state.touched.set(true);
            // Out of the cell while awaited (no borrow is held across the await), and back
            // after, so a later try finds it where this one left it.
            let mut taken = payload.borrow_mut().take()?;
            let next = next_chunk(&mut taken, idle).await;
            *payload.borrow_mut() = Some(taken);
            let fault = match next {
                Ok(None) => return None,
                Ok(Some(chunk)) if seen + chunk.len() as u64 <= max => {
                    let seen = seen + chunk.len() as u64;
                    return Some((Ok(chunk), (payload, seen)));
                }
                Ok(Some(_)) => BodyFault::TooLarge,
                Err(fault) => fault,
            };
            body_state.fault.set(Some(fault));
            Some((Err(PayloadError::Incomplete(None)), (payload, seen)))
        }
    })
}

fn fault_error(fault: BodyFault, state: &AppState) -> ApiError {
    match fault {
        BodyFault::TooLarge => ApiError::PayloadTooLarge(state.max_body_bytes),
        BodyFault::Stalled => ApiError::BodyTimeout(state.upstream.body_timeout.as_millis() as u64),
        BodyFault::Broken => {
            ApiError::BadRequest("the request body ended before its declared end".into())
        }
    }
}

/// The client's response from the service's: its status and end-to-end headers, and its
/// body framed by RFC 9112 §6.3: none for `HEAD`, `204` and `304` (whatever their
/// `Content-Length` says, which a `HEAD` or `304` keeps), a declared length kept, else
/// streamed.
fn response<S>(
    method: &Method,
    upstream: awc::ClientResponse<S>,
    probe: &Probe,
) -> Result<HttpResponse, ApiError>
where
    S: futures_util::Stream<Item = Result<Bytes, PayloadError>> + Unpin + 'static,
{
    let status = upstream.status();
    let mut resp = HttpResponse::build(status);
    for (name, value) in response_headers(upstream.headers()) {
        if name != header::CONTENT_LENGTH {
            resp.append_header((name.clone(), value.clone()));
        }
    }
    let len = upstream
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let chunked = upstream.headers().contains_key(header::TRANSFER_ENCODING);
    let bodiless = *method == Method::HEAD
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
        || status.is_informational();
    // A body the upstream cuts short ends the client's response with an error, never as
    // if it were whole.
    let upstream = checked_body(upstream, probe);
    Ok(match (bodiless, len) {
        // The upstream body is dropped unread (its connection with it).
        (true, Some(len)) if status != StatusCode::NO_CONTENT => resp
            .no_chunking(len)
            .streaming(futures_util::stream::empty::<Result<Bytes, actix_web::Error>>()),
        (true, _) => resp.body(()),
        // Chunked framing wins over a length beside it (RFC 9112 §6.3 rule 3).
        (false, Some(len)) if !chunked => {
            resp.body(actix_web::body::SizedStream::new(len, upstream))
        }
        (false, _) => resp.streaming(upstream),
    })
}

fn err_status(e: &ApiError) -> u16 {
    actix_web::ResponseError::status_code(e).as_u16()
}
