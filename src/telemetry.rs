//! Logging: `tracing` to stdout, filtered by `RUST_LOG` (default `info`), and one root span
//! per request carrying its id.

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::HttpMessage;
use tracing::Span;
use tracing_actix_web::RootSpanBuilder;
use tracing_subscriber::EnvFilter;

use crate::proxy::RequestId;

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

/// Root spans named by method and path, with the request id that the upstream and the
/// response carry too (API keys are never recorded).
pub struct RequestSpan;

impl RootSpanBuilder for RequestSpan {
    fn on_request_start(request: &ServiceRequest) -> Span {
        let span = tracing::debug_span!(
            "request",
            method = %request.method(),
            path = %request.path(),
            request_id = tracing::field::Empty,
            status = tracing::field::Empty,
        );
        // Nothing to build for a span nobody records (the default, `info`).
        if !span.is_disabled() {
            if let Some(id) = request.extensions().get::<RequestId>() {
                span.record("request_id", id.0.to_str().unwrap_or_default());
            }
        }
        span
    }

    fn on_request_end<B: MessageBody>(
        span: Span,
        outcome: &Result<ServiceResponse<B>, actix_web::Error>,
    ) {
        let status = match outcome {
            Ok(r) => r.status().as_u16(),
            Err(e) => e.as_response_error().status_code().as_u16(),
        };
        span.record("status", status);
    }
}
