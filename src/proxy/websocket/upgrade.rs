//! An upgrade request, from the guard's check to the client's `101` (or the service's
//! refusal): which requests are upgrades, what is checked before their decision, and the
//! handshake with one replica.

use std::sync::Arc;
use std::time::Duration;

use actix_http::ConnectionType;
use actix_web::body::BoxBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header::{self, HeaderMap, HeaderValue};
use actix_web::http::{Method, StatusCode, Version};
use actix_web::{web, HttpRequest, HttpResponse};
use tokio::io::AsyncWriteExt;
use tokio::time::Instant;

use super::handshake::{self, Answer, Broken, UpstreamIo};
use super::relay::Relay;
use super::relays::Slot;
use crate::error::ApiError;
use crate::metrics::UpgradeResult;
use crate::proxy::edge;
use crate::proxy::forward::{self, Admitted, Who};
use crate::proxy::headers::response_headers;
use crate::proxy::replicas::{now_ms, Replica, TryResult};
use crate::state::AppState;
use crate::trace;

/// An admitted upgrade request on its way to its decision, holding one of its client's
/// connections (see [`Upgrade::of`]).
pub struct Upgrade {
    slot: Slot,
}

impl Upgrade {
    /// Whether `req` asks for a WebSocket (RFC 6455 §4.1: `GET`, HTTP/1.1, `Connection:
    /// upgrade` and `Upgrade: websocket`, tokens in any case): `None` for every other request
    /// (a flag test for nearly all), which is forwarded as before (another `Upgrade`, such as
    /// `h2c`, is hop-by-hop and dropped). Checked before the decision, spending nothing: an
    /// upgrade with a body is `400`; one from a client that has its plan's
    /// `max_connections` open on this gateway is `429` `too-many-connections`.
    pub fn of(
        req: &ServiceRequest,
        state: &AppState,
        admitted: &Admitted,
    ) -> Result<Option<Upgrade>, ApiError> {
        if req.head().connection_type() != ConnectionType::Upgrade || !asks_for_websocket(req) {
            return Ok(None);
        }
        let headers = req.headers();
        let declared = headers
            .get(header::CONTENT_LENGTH)
            .is_some_and(|v| v.as_bytes() != b"0");
        if declared || headers.contains_key(header::TRANSFER_ENCODING) {
            return Err(ApiError::BadRequest(
                "a WebSocket upgrade request has no body".into(),
            ));
        }
        let (client, plan) = match &admitted.who {
            Who::Client(c) => (c.id.as_str(), &c.plan),
            Who::Anonymous(a) => (a.tag.as_str(), &a.plan),
        };
        let slot = state.websockets.take(client, plan.max_connections())?;
        Ok(Some(Upgrade { slot }))
    }
}

/// `GET`, HTTP/1.1, `Upgrade: websocket` (the `Connection: upgrade` is the caller's test).
fn asks_for_websocket(req: &ServiceRequest) -> bool {
    req.method() == Method::GET
        && req.version() == Version::HTTP_11
        && req
            .headers()
            .get_all(header::UPGRADE)
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case("websocket"))
}

/// Opens the upgrade on a replica and answers the client: `101` and the relay when the
/// service switched protocols, else the service's answer (and the client's connection
/// closes after it), or `502`/`504` when no replica answered.
pub async fn respond(
    req: ServiceRequest,
    admitted: Admitted,
    upgrade: Upgrade,
    tls: Arc<rustls::ClientConfig>,
) -> ServiceResponse<BoxBody> {
    let (req, payload) = req.into_parts();
    let Some(state) = req.app_data::<web::Data<AppState>>() else {
        let res = HttpResponse::from_error(ApiError::Internal(anyhow::anyhow!("no AppState")));
        return ServiceResponse::new(req, edge::keep_payload(res, payload));
    };
    let metrics = &state.metrics.websockets;
    let res = match handshake(&req, &admitted, state, &tls).await {
        Ok((io, Answer::Upgraded { headers, rest })) => {
            metrics.upgrade(UpgradeResult::Upgraded);
            let relay = Relay::new(
                payload,
                io,
                rest,
                admitted.route.service.clone(),
                upgrade.slot,
            );
            let mut res = HttpResponse::build(StatusCode::SWITCHING_PROTOCOLS);
            for (name, value) in response_headers(&headers) {
                if name != header::CONTENT_LENGTH {
                    res.append_header((name.clone(), value.clone()));
                }
            }
            return ServiceResponse::new(req, res.upgrade("websocket").body(relay));
        }
        Ok((
            _,
            Answer::Declined {
                status,
                headers,
                body,
            },
        )) => {
            metrics.upgrade(UpgradeResult::Declined);
            let mut res = HttpResponse::build(status);
            for (name, value) in response_headers(&headers) {
                if name != header::CONTENT_LENGTH {
                    res.append_header((name.clone(), value.clone()));
                }
            }
            res.body(body)
        }
        Err(e) => {
            metrics.upgrade(UpgradeResult::Failed);
            HttpResponse::from_error(e)
        }
    };
    // Whatever the client sent after its head is not read: the connection closes after the
    // answer (and a bounded linger, see `edge`).
    ServiceResponse::new(req, edge::keep_payload(res, payload))
}

/// The upgrade request sent to a replica of the route and its answer read. A replica that
/// refuses the connection (nothing was sent) is followed by another, as a forward's try is,
/// within `upstream.max_tries` and the route's timeout; once the request is written it is
/// never sent again.
#[tracing::instrument(
    name = "websocket",
    level = "debug",
    skip_all,
    fields(service, upstream)
)]
async fn handshake(
    req: &HttpRequest,
    admitted: &Admitted,
    state: &AppState,
    tls: &Arc<rustls::ClientConfig>,
) -> Result<(UpstreamIo, Answer), ApiError> {
    let route = &admitted.route;
    let span = tracing::Span::current();
    span.record("service", &*route.service);
    let started = Instant::now();
    let deadline = started + route.timeout;
    let path = admitted
        .path_and_query
        .as_ref()
        .or(req.uri().path_and_query())
        .map_or("/", |p| p.as_str());
    let mut tried = Vec::new();
    loop {
        let i = route
            .replicas
            .pick(&tried, now_ms())
            .ok_or_else(|| ApiError::Internal(anyhow::anyhow!("a route without replicas")))?;
        tried.push(i);
        let replica = route.replicas.get(i);
        span.record("upstream", replica.upstream.base());
        let within = state
            .upstream
            .connect_timeout
            .min(deadline.saturating_duration_since(Instant::now()))
            .max(Duration::from_millis(1));
        let mut io = match handshake::connect(&replica.upstream, within, tls).await {
            Ok(io) => io,
            Err(e) => {
                record(replica, TryResult::Failed, state, &route.service);
                let tls_failure = crate::proxy::tls::io_failure(&e);
                if tls_failure.is_some() {
                    replica.count_tls_failure();
                }
                tracing::warn!(service = %route.service, upstream = replica.upstream.base(), error = %e, "websocket: upstream connect failed");
                if tried.len() < state.upstream.max_tries as usize && Instant::now() < deadline {
                    continue;
                }
                let err = match (tls_failure, e.kind()) {
                    (Some(failure), _) => ApiError::UpstreamTls(failure),
                    (None, std::io::ErrorKind::TimedOut) => ApiError::GatewayTimeout,
                    (None, _) => ApiError::BadGateway,
                };
                let status = actix_web::ResponseError::status_code(&err).as_u16();
                state
                    .metrics
                    .record_upstream(&route.service, status, started.elapsed());
                return Err(err);
            }
        };
        let mut headers = forwarded_headers(req, admitted, replica, state)?;
        let upstream_span = trace::propagate(req, state.traces.as_ref(), &mut headers);
        let head = handshake::request_head(path, &headers);
        let in_flight = replica.start();
        let answer = async {
            tokio::time::timeout_at(deadline, io.write_all(&head))
                .await
                .map_err(|_| Broken::TimedOut)?
                .map_err(Broken::Io)?;
            handshake::read_answer(&mut io, deadline).await
        }
        .await;
        drop(in_flight);
        let (status, result) = match &answer {
            Ok(Answer::Upgraded { .. }) => (StatusCode::SWITCHING_PROTOCOLS, Ok(())),
            Ok(Answer::Declined { status, .. }) => (*status, Ok(())),
            Err(Broken::TimedOut) => (StatusCode::GATEWAY_TIMEOUT, Err(ApiError::GatewayTimeout)),
            Err(b) => {
                tracing::warn!(service = %route.service, upstream = replica.upstream.base(), error = %b, "websocket: the upgrade got no answer");
                (StatusCode::BAD_GATEWAY, Err(ApiError::BadGateway))
            }
        };
        let failed = result.is_err()
            || matches!(
                status,
                StatusCode::BAD_GATEWAY
                    | StatusCode::SERVICE_UNAVAILABLE
                    | StatusCode::GATEWAY_TIMEOUT
            );
        let outcome = if failed {
            TryResult::Failed
        } else {
            TryResult::Answered
        };
        record(replica, outcome, state, &route.service);
        if let Some(s) = upstream_span {
            s.finish(status.as_u16(), result.is_ok());
        }
        state
            .metrics
            .record_upstream(&route.service, status.as_u16(), started.elapsed());
        result?;
        return answer.map(|a| (io, a)).map_err(|_| ApiError::BadGateway);
    }
}

/// Records a try's outcome on its replica, and says so when it ejected it.
fn record(replica: &Replica, result: TryResult, state: &AppState, service: &str) {
    let s = &state.upstream;
    if let Some(length) = replica.record(result, s, now_ms()) {
        tracing::warn!(
            service,
            upstream = replica.upstream.base(),
            ejected_ms = length.as_millis() as u64,
            "replica ejected after {} failures in a row",
            s.eject_after
        );
    }
}

/// The headers of the upgrade as the service gets them: a forwarded request's
/// ([`forward::write_forwarded_headers`]: the client's end-to-end ones, `Sec-WebSocket-Key`,
/// `-Version`, `-Protocol`, `-Extensions`, `Origin` and cookies among them, but its API key;
/// the replica's `Host`, identity and `X-Forwarded-*`), and `Connection: Upgrade`,
/// `Upgrade: websocket`.
fn forwarded_headers(
    req: &HttpRequest,
    admitted: &Admitted,
    replica: &Replica,
    state: &AppState,
) -> Result<HeaderMap, ApiError> {
    let mut headers = HeaderMap::with_capacity(req.headers().len() + 8);
    forward::write_forwarded_headers(req, admitted, &replica.upstream, state, &mut headers)?;
    headers.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    Ok(headers)
}
