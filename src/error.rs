//! One error type for everything the gateway answers with an error, and the one place that
//! turns it into an `application/problem+json` response (RFC 9457).

use actix_web::http::header::{self, HeaderValue};
use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use serde::Serialize;

/// A validation error on one field.
#[derive(Debug, Clone, Serialize)]
pub struct FieldError {
    pub field: String,
    pub message: String,
}

/// Errors answered to clients; each maps to one status.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("a valid API key is required in the {0} header")]
    MissingKey(String),
    #[error("no route matches this path")]
    NoRoute,
    #[error("rate limit exceeded; retry after {retry_after_s} s")]
    RateLimited {
        retry_after_ms: u64,
        retry_after_s: u64,
    },
    #[error(
        "this request costs more tokens than the plan's capacity, so it can never be admitted"
    )]
    CostExceedsCapacity,
    #[error("request body is larger than {0} bytes")]
    PayloadTooLarge(u64),
    #[error("the upstream service could not be reached")]
    BadGateway,
    #[error("the upstream service did not answer in time")]
    GatewayTimeout,
    #[error("{0}")]
    BadRequest(String),
    #[error("an internal error occurred")]
    Internal(#[source] anyhow::Error),
}

#[derive(Serialize)]
struct Problem<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    title: &'a str,
    status: u16,
    detail: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    retry_after_ms: Option<u64>,
}

impl ApiError {
    fn slug(&self) -> &'static str {
        match self {
            ApiError::MissingKey(_) => "unauthorized",
            ApiError::NoRoute => "not-found",
            ApiError::RateLimited { .. } | ApiError::CostExceedsCapacity => "rate-limited",
            ApiError::PayloadTooLarge(_) => "payload-too-large",
            ApiError::BadGateway => "bad-gateway",
            ApiError::GatewayTimeout => "gateway-timeout",
            ApiError::BadRequest(_) => "bad-request",
            ApiError::Internal(_) => "internal",
        }
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        match self {
            ApiError::MissingKey(_) => StatusCode::UNAUTHORIZED,
            ApiError::NoRoute => StatusCode::NOT_FOUND,
            ApiError::RateLimited { .. } | ApiError::CostExceedsCapacity => {
                StatusCode::TOO_MANY_REQUESTS
            }
            ApiError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::BadGateway => StatusCode::BAD_GATEWAY,
            ApiError::GatewayTimeout => StatusCode::GATEWAY_TIMEOUT,
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn error_response(&self) -> HttpResponse {
        let status = self.status_code();
        if let ApiError::Internal(e) = self {
            tracing::error!(error = ?e, "internal error");
        }
        let type_uri = format!("https://tollgate.dev/problems/{}", self.slug());
        let body = Problem {
            kind: &type_uri,
            title: status.canonical_reason().unwrap_or("Error"),
            status: status.as_u16(),
            detail: self.to_string(),
            retry_after_ms: match self {
                ApiError::RateLimited { retry_after_ms, .. } => Some(*retry_after_ms),
                _ => None,
            },
        };
        let mut resp = HttpResponse::build(status);
        resp.insert_header((
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        ));
        match self {
            ApiError::MissingKey(_) => {
                resp.insert_header((header::WWW_AUTHENTICATE, "ApiKey"));
            }
            ApiError::RateLimited { retry_after_s, .. } => {
                resp.insert_header((header::RETRY_AFTER, retry_after_s.to_string()));
            }
            _ => {}
        }
        resp.body(serde_json::to_string(&body).unwrap_or_default())
    }
}
