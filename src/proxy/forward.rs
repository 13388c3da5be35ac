//! Forwarding an admitted request to one replica with awc, bodies streamed both ways.

use std::cell::Cell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use actix_web::body::BoxBody;
use actix_web::dev::{Payload, ServiceRequest, ServiceResponse};
use actix_web::http::header::{self, HeaderValue};
use actix_web::http::uri::PathAndQuery;
use actix_web::{web, HttpMessage, HttpRequest, HttpResponse};
use awc::error::{ConnectError, SendRequestError};
use bytes::Bytes;
use futures_util::StreamExt;

use super::headers::{
    connection_headers, forwardable, response_headers, Origin, RequestId, X_CLIENT_ID,
    X_FORWARDED_FOR, X_FORWARDED_HOST, X_FORWARDED_PROTO, X_REQUEST_ID,
};
use super::Route;
use crate::catalog::ClientEntry;
use crate::error::ApiError;
use crate::state::AppState;
use crate::trace;

/// What the guard hands the forwarder for an admitted request.
pub(super) struct Admitted {
    pub client: Arc<ClientEntry>,
    pub route: Arc<Route>,
    /// The normal form of the path with the query as received, when it differs from the
    /// request's; `None`: forward the request's own (most paths are already normal).
    pub path_and_query: Option<PathAndQuery>,
}

/// Forwards an admitted request (see [`forward`]), answering a failure as a handler's
/// `Err` is answered: the error's response, with the error kept in it for the
/// middlewares above.
pub(super) async fn respond(
    req: ServiceRequest,
    admitted: Admitted,
    client: &awc::Client,
) -> ServiceResponse<BoxBody> {
    let (req, payload) = req.into_parts();
    let res = match forward(&req, payload, admitted, client).await {
        Ok(res) => res,
        Err(e) => HttpResponse::from_error(e),
    };
    ServiceResponse::new(req, res)
}

/// One awc client per worker: its connection pool keeps upstream connections alive.
pub(super) fn upstream_client() -> awc::Client {
    awc::Client::builder()
        .no_default_headers()
        .disable_redirects()
        .timeout(Duration::from_secs(3600))
        .connector(
            awc::Connector::new()
                .limit(4096)
                .timeout(Duration::from_secs(5))
                .conn_keep_alive(Duration::from_secs(30)),
        )
        .finish()
}

/// Sends the request on to a replica of its route and streams the answer back.
#[tracing::instrument(name = "forward", level = "debug", skip_all, fields(service, upstream))]
async fn forward(
    req: &HttpRequest,
    payload: Payload,
    admitted: Admitted,
    client: &awc::Client,
) -> Result<HttpResponse, ApiError> {
    // Borrowed from the request rather than extracted (an extractor clones the `Arc`
    // every worker shares).
    let state = req
        .app_data::<web::Data<AppState>>()
        .ok_or_else(|| ApiError::Internal(anyhow::anyhow!("no AppState")))?;
    let route = &admitted.route;
    let upstream = route.pick();
    let span = tracing::Span::current();
    span.record("service", &*route.service);
    span.record("upstream", upstream.base());

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
        .timeout(route.timeout)
        .no_decompress();

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
    // Into the map directly: `append_header` and `insert_header` move the whole request
    // builder in and out per header.
    let headers = out.headers_mut();
    let listed = connection_headers(req.headers());
    for (name, value) in req.headers() {
        if forwardable(name, &state.api_key_header, &listed) {
            headers.append(name.clone(), value.clone());
        }
    }
    headers.insert(header::HOST, upstream.host().clone());
    headers.insert(X_CLIENT_ID.clone(), admitted.client.id_header.clone());
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
    let upstream_span = trace::propagate(req, state.traces.as_ref(), out.headers_mut());

    let declared_len = req
        .headers()
        .get(actix_web::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let chunked = req
        .headers()
        .contains_key(actix_web::http::header::TRANSFER_ENCODING);
    let too_large = Rc::new(Cell::new(false));
    let result = match (declared_len, chunked) {
        (Some(len), _) if len > 0 => {
            let body = limited(payload, state.max_body_bytes, too_large.clone());
            out.send_body(actix_web::body::SizedStream::new(len, body))
                .await
        }
        (_, true) => {
            out.send_stream(limited(payload, state.max_body_bytes, too_large.clone()))
                .await
        }
        _ => out.send().await,
    };
    let upstream_res = match result {
        Ok(r) => r,
        Err(e) => {
            if too_large.get() {
                return Err(ApiError::PayloadTooLarge(state.max_body_bytes));
            }
            let err = match e {
                SendRequestError::Timeout | SendRequestError::Connect(ConnectError::Timeout) => {
                    ApiError::GatewayTimeout
                }
                _ => ApiError::BadGateway,
            };
            if let Some(span) = upstream_span {
                span.finish(err_status(&err), false);
            }
            tracing::warn!(service = %route.service, upstream = upstream.base(), error = %e, "upstream failed");
            state
                .metrics
                .record_upstream(&route.service, err_status(&err));
            return Err(err);
        }
    };

    let status = upstream_res.status();
    if let Some(span) = upstream_span {
        span.finish(status.as_u16(), true);
    }
    state
        .metrics
        .record_upstream(&route.service, status.as_u16());
    let mut resp = HttpResponse::build(status);
    for (name, value) in response_headers(upstream_res.headers()) {
        if name != actix_web::http::header::CONTENT_LENGTH {
            resp.append_header((name.clone(), value.clone()));
        }
    }
    let len = upstream_res
        .headers()
        .get(actix_web::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    Ok(match len {
        Some(len) => resp.body(actix_web::body::SizedStream::new(len, upstream_res)),
        None => resp.streaming(upstream_res),
    })
}

fn err_status(e: &ApiError) -> u16 {
    actix_web::ResponseError::status_code(e).as_u16()
}

/// The request body, cut off with an error once it passes `max` bytes.
fn limited(
    payload: Payload,
    max: u64,
    too_large: Rc<Cell<bool>>,
) -> impl futures_util::Stream<Item = Result<Bytes, actix_web::error::PayloadError>> + 'static {
    let mut seen: u64 = 0;
    payload.map(move |chunk| {
        let chunk = chunk?;
        seen += chunk.len() as u64;
        if seen > max {
            too_large.set(true);
            return Err(actix_web::error::PayloadError::Overflow);
        }
        Ok(chunk)
    })
}
