//! One error type for everything the gateway answers with an error, and the one place that
//! turns it into an `application/problem+json` response (RFC 9457).

use actix_web::http::header::{self, HeaderValue};
use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use serde::Serialize;

/// A validation error on one field.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct FieldError {
    pub field: String,
    pub message: String,
}

/// Errors answered to clients; each maps to one status.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("a valid API key is required {0}")]
    MissingKey(String),
    /// The key was issued with an `expires_at`, now past (unix seconds).
    #[error("this API key expired at {}", unix_s_rfc3339(*.0))]
    KeyExpired(u64),
    #[error("no route matches this path")]
    NoRoute,
    /// A request path the gateway will not route (see `proxy::PathError`).
    #[error("{0}")]
    BadPath(String),
    #[error("the path is longer than {0} bytes")]
    PathTooLong(usize),
    #[error("rate limit exceeded{}; retry after {retry_after_s} s", by(.limit))]
    RateLimited {
        retry_after_ms: u64,
        retry_after_s: u64,
        /// The policy name of the limit that refused.
        limit: Option<String>,
    },
    #[error(
        "this request costs more than a limit of the plan can ever hold{}, so it can never be admitted", by(.limit)
    )]
    CostExceedsCapacity { limit: Option<String> },
    #[error("request body is larger than {0} bytes")]
    PayloadTooLarge(u64),
    #[error("the upstream service could not be reached")]
    BadGateway,
    #[error("the upstream service did not answer in time")]
    GatewayTimeout,
    /// No TLS connection to an `https://` replica: the client is told which kind of
    /// failure, never rustls's reason (that is logged).
    #[error("{0}")]
    UpstreamTls(UpstreamTls),
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    InvalidToken(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    NotFound(String),
    /// The path exists, the method does not; the value is the `Allow` header.
    #[error("this resource allows {0}")]
    MethodNotAllowed(&'static str),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    PreconditionFailed(String),
    /// A write that must name the version it was made against (RFC 6585, `428`).
    #[error("{0}")]
    PreconditionRequired(String),
    #[error("the request has invalid fields: {}", fields(.0))]
    Validation(Vec<FieldError>),
    #[error("the store is unavailable: {0}")]
    StoreUnavailable(String),
    /// A key this gateway does not hold (cache mode), not yet looked up: the guard looks it
    /// up and checks the request again. Never an answer (it would be `503`, as below).
    #[error("this API key is not in this gateway's catalog cache yet")]
    NotHeld(crate::domain::KeyHash),
    /// A key this gateway does not hold could not be looked up in the store in time: it
    /// cannot be checked, so it is not let in.
    #[error("this API key cannot be checked now: {0}")]
    CatalogUnavailable(String),
    /// A public route's plan is not in this gateway's catalog (deleted, or not yet
    /// loaded): requests without a key cannot be limited, so they are not forwarded.
    #[error("this route's plan for requests without a key ({0}) is not in the catalog")]
    PublicPlanMissing(String),
    /// Too many unknown keys from this client address: its requests wait (in seconds).
    #[error("too many requests with an unknown API key from this address; retry after {0} s")]
    TooManyFailedKeys(u64),
    /// An upgrade request (WebSocket) from a client that has its plan's `max_connections`
    /// upgraded connections open on this gateway.
    #[error("this client already has {0} upgraded connections open, its plan's max_connections; close one first")]
    TooManyConnections(u32),
    /// The gateway is overloaded and shed the request before deciding or forwarding it.
    #[error("the gateway is overloaded; retry after 1 s")]
    Overloaded,
    /// The client's request body sent nothing for `upstream.body_timeout_ms` (ms).
    #[error("the request body sent nothing for {0} ms")]
    BodyTimeout(u64),
    #[error("an internal error occurred")]
    Internal(#[source] anyhow::Error),
}

/// How a TLS handshake with an upstream replica failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum UpstreamTls {
    /// Its certificate is not trusted, not valid now, or not for its host.
    #[error("the upstream service's TLS certificate could not be verified")]
    Certificate,
    /// Anything else (a protocol error, an alert, a service that does not speak TLS).
    #[error("no TLS connection to the upstream service could be established")]
    Handshake,
}

fn by(limit: &Option<String>) -> String {
    limit
        .as_deref()
        .map(|l| format!(" (limit {l:?})"))
        .unwrap_or_default()
}

fn fields(errors: &[FieldError]) -> String {
    errors
        .iter()
        .map(|e| format!("{}: {}", e.field, e.message))
        .collect::<Vec<_>>()
        .join("; ")
}

impl ApiError {
    /// One invalid field.
    pub fn field(field: &str, message: impl Into<String>) -> ApiError {
        ApiError::Validation(vec![FieldError {
            field: field.to_string(),
            message: message.into(),
        }])
    }
}

/// What the admin API and `/readyz` say of a store out of memory (`maxmemory` reached
/// under `noeviction`).
pub const STORE_OUT_OF_MEMORY: &str = "the store refuses writes: it is out of memory";

/// The store's error goes to the log, not to the caller: it names hosts, scripts and
/// their lines.
impl From<crate::store::StoreError> for ApiError {
    fn from(e: crate::store::StoreError) -> ApiError {
        tracing::warn!(error = %e, "store call failed");
        ApiError::StoreUnavailable(if e.out_of_memory() {
            format!("{STORE_OUT_OF_MEMORY} (Redis maxmemory); the gateway's log has the error")
        } else {
            "it failed or did not answer; the gateway's log has the error".into()
        })
    }
}

/// An RFC 9457 problem, as every error body is.
#[derive(Serialize, utoipa::ToSchema)]
pub struct Problem {
    /// A URI naming the kind of problem.
    #[serde(rename = "type")]
    pub kind: String,
    pub title: String,
    pub status: u16,
    pub detail: String,
    /// 429 only: milliseconds until the request would be admitted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
    /// 429 only: the limit that refused, by its `RateLimit-Policy` name (`gold`, or
    /// `gold.monthly` for a plan's other limits).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit: Option<String>,
    /// Validation errors only: each invalid field and what is wrong with it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub errors: Option<Vec<FieldError>>,
}

/// Unix seconds as RFC 3339 (`2026-12-03T19:00:00Z`).
fn unix_s_rfc3339(s: u64) -> String {
    jiff::Timestamp::from_second(i64::try_from(s).unwrap_or(i64::MAX))
        .unwrap_or(jiff::Timestamp::MAX)
        .to_string()
}

impl ApiError {
    fn slug(&self) -> &'static str {
        match self {
            ApiError::MissingKey(_) => "unauthorized",
            ApiError::KeyExpired(_) => "key-expired",
            ApiError::NoRoute => "not-found",
            ApiError::BadPath(_) => "bad-path",
            ApiError::PathTooLong(_) => "uri-too-long",
            ApiError::RateLimited { .. } | ApiError::CostExceedsCapacity { .. } => "rate-limited",
            ApiError::PayloadTooLarge(_) => "payload-too-large",
            ApiError::BadGateway => "bad-gateway",
            ApiError::GatewayTimeout => "gateway-timeout",
            ApiError::UpstreamTls(_) => "upstream-tls",
            ApiError::BadRequest(_) => "bad-request",
            ApiError::InvalidToken(_) => "invalid-token",
            ApiError::Forbidden(_) => "forbidden",
            ApiError::NotFound(_) => "not-found",
            ApiError::MethodNotAllowed(_) => "method-not-allowed",
            ApiError::Conflict(_) => "conflict",
            ApiError::PreconditionFailed(_) => "precondition-failed",
            ApiError::PreconditionRequired(_) => "precondition-required",
            ApiError::Validation(_) => "validation",
            ApiError::StoreUnavailable(_) => "store-unavailable",
            ApiError::NotHeld(_) | ApiError::CatalogUnavailable(_) => "catalog-unavailable",
            ApiError::Overloaded => "overloaded",
            ApiError::PublicPlanMissing(_) => "public-plan-unavailable",
            ApiError::TooManyFailedKeys(_) => "too-many-failed-keys",
            ApiError::TooManyConnections(_) => "too-many-connections",
            ApiError::BodyTimeout(_) => "request-timeout",
            ApiError::Internal(_) => "internal",
        }
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        match self {
            ApiError::MissingKey(_) | ApiError::KeyExpired(_) => StatusCode::UNAUTHORIZED,
            ApiError::NoRoute => StatusCode::NOT_FOUND,
            ApiError::BadPath(_) => StatusCode::BAD_REQUEST,
            ApiError::PathTooLong(_) => StatusCode::URI_TOO_LONG,
            ApiError::RateLimited { .. }
            | ApiError::CostExceedsCapacity { .. }
            | ApiError::TooManyFailedKeys(_)
            | ApiError::TooManyConnections(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::BadGateway | ApiError::UpstreamTls(_) => StatusCode::BAD_GATEWAY,
            ApiError::GatewayTimeout => StatusCode::GATEWAY_TIMEOUT,
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::InvalidToken(_) => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::PreconditionFailed(_) => StatusCode::PRECONDITION_FAILED,
            ApiError::PreconditionRequired(_) => StatusCode::PRECONDITION_REQUIRED,
            ApiError::Validation(_) => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::StoreUnavailable(_)
            | ApiError::NotHeld(_)
            | ApiError::CatalogUnavailable(_)
            | ApiError::Overloaded
            | ApiError::PublicPlanMissing(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn error_response(&self) -> HttpResponse {
        let status = self.status_code();
        if let ApiError::Internal(e) = self {
            tracing::error!(error = ?e, "internal error");
        }
        let body = Problem {
            kind: format!("https://tollgate.dev/problems/{}", self.slug()),
            title: status.canonical_reason().unwrap_or("Error").to_string(),
            status: status.as_u16(),
            detail: self.to_string(),
            retry_after_ms: match self {
                ApiError::RateLimited { retry_after_ms, .. } => Some(*retry_after_ms),
                _ => None,
            },
            limit: match self {
                ApiError::RateLimited { limit, .. } | ApiError::CostExceedsCapacity { limit } => {
                    limit.clone()
                }
                _ => None,
            },
            errors: match self {
                ApiError::Validation(e) => Some(e.clone()),
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
            ApiError::KeyExpired(_) => {
                resp.insert_header((header::WWW_AUTHENTICATE, "ApiKey error=\"expired\""));
            }
            ApiError::RateLimited { retry_after_s, .. } => {
                resp.insert_header((header::RETRY_AFTER, retry_after_s.to_string()));
            }
            ApiError::Overloaded | ApiError::NotHeld(_) | ApiError::CatalogUnavailable(_) => {
                resp.insert_header((header::RETRY_AFTER, "1"));
            }
            ApiError::TooManyFailedKeys(retry_after_s) => {
                resp.insert_header((header::RETRY_AFTER, retry_after_s.to_string()));
            }
            ApiError::MethodNotAllowed(allow) => {
                resp.insert_header((header::ALLOW, *allow));
            }
            ApiError::InvalidToken(_) => {
                resp.insert_header((
                    header::WWW_AUTHENTICATE,
                    "Bearer realm=\"tollgate-admin\", error=\"invalid_token\"",
                ));
            }
            _ => {}
        }
        resp.body(serde_json::to_string(&body).unwrap_or_default())
    }
}
