//! Logging: `tracing` to stdout, filtered by `RUST_LOG` (default `info`), and one root span
//! per request carrying its id.

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::middleware::Next;
use actix_web::HttpMessage;
use tracing::Instrument;
use tracing_subscriber::EnvFilter;

use crate::proxy::{RequestId, X_REQUEST_ID};

/// Installs the global subscriber once; later calls (tests) are no-ops.
pub fn init() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let json = std::env::var("TOLLGATE_LOG_FORMAT").is_ok_and(|v| v == "json");
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false);
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}

/// Middleware, the outermost: settles the request's id before anything logs, runs the
/// rest of the request inside its root span (named `request`, with method, path, id and
/// status; at `debug`, so by default nothing is built for it), echoes the id in the
/// response, and logs an answer made from an error (a warning for 4xx, an error
/// otherwise). API keys are never recorded.
///
/// This replaces `tracing_actix_web::TracingLogger`, which did the same at every level:
/// a UUID of its own, two extension inserts and a span-wrapped body per request, although
/// at `info` nothing is recorded.
pub async fn request(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let id = RequestId::for_request(req.headers());
    let span = tracing::debug_span!(
        "request",
        method = %req.method(),
        path = %req.path(),
        request_id = tracing::field::Empty,
        status = tracing::field::Empty,
    );
    req.extensions_mut().insert(id.clone());
    let outcome = if span.is_disabled() {
        next.call(req).await
    } else {
        span.record("request_id", id.0.to_str().unwrap_or_default());
        let outcome = next.call(req).instrument(span.clone()).await;
        span.record("status", status_of(&outcome));
        outcome
    };
    span.in_scope(|| log_error(&outcome));
    let mut res = outcome?;
    res.headers_mut().insert(X_REQUEST_ID.clone(), id.0);
    Ok(res)
}

fn status_of<B>(outcome: &Result<ServiceResponse<B>, actix_web::Error>) -> u16 {
    match outcome {
        Ok(r) => r.status().as_u16(),
        Err(e) => e.as_response_error().status_code().as_u16(),
    }
}

/// An answer made from an error, logged as `tracing_actix_web` did.
fn log_error<B>(outcome: &Result<ServiceResponse<B>, actix_web::Error>) {
    let (error, status) = match outcome {
        Ok(res) => match res.response().error() {
            Some(e) => (e.as_response_error(), res.status()),
            None => return,
        },
        Err(e) => (e.as_response_error(), e.as_response_error().status_code()),
    };
    let prefix = "Error encountered while processing the incoming HTTP request";
    if status.is_client_error() {
        tracing::warn!("{prefix}: {error:?}");
    } else {
        tracing::error!("{prefix}: {error:?}");
    }
}
