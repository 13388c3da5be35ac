//! The limiter middleware: API key → client → route → decision, before any upstream call.

use std::sync::Arc;

use actix_web::body::{BoxBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header;
use actix_web::http::uri::PathAndQuery;
use actix_web::middleware::Next;
use actix_web::{web, HttpMessage, ResponseError};

use super::{NormalPath, Route};
use crate::catalog::ClientEntry;
use crate::domain::ratelimit::policy_name;
use crate::domain::{KeyHash, Mode};
use crate::domain::{Outcome, RateLimitHeaders};
use crate::error::ApiError;
use crate::state::AppState;

/// What the guard hands the forwarder for an admitted request.
#[derive(Clone)]
pub struct Admitted {
    pub client: Arc<ClientEntry>,
    pub route: Arc<Route>,
    /// The normal form of the path with the query as received, when it differs from the
    /// request's; `None`: forward the request's own (most paths are already normal).
    pub path_and_query: Option<PathAndQuery>,
}

/// Decides a request: `400`/`414` for a path it will not route (see [`NormalPath`]),
/// `401` for a missing or unknown key (no store call), `404` without a route for the
/// normal path, `413` for a declared body over the limit, `429` when the bucket is empty.
/// All before a token is spent or a service is called. Admitted requests go on to the
/// forwarder, and every answer carries the client's rate-limit headers.
#[tracing::instrument(name = "guard", level = "debug", skip_all, fields(client_id = tracing::field::Empty))]
pub async fn guard(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<BoxBody>, actix_web::Error> {
    // Borrowed, not cloned: every worker shares `AppState`, and an `Arc` count bumped by
    // both workers on every request is a cache line bouncing between their cores.
    let Some(state) = req.app_data::<web::Data<AppState>>() else {
        return Ok(reject(
            req,
            ApiError::Internal(anyhow::anyhow!("no AppState")),
            None,
        ));
    };

    // First: it costs nothing, needs no key, and a bad path must never be charged.
    let path = match NormalPath::parse(req.path()) {
        Ok(path) => path,
        Err(e) => return Ok(reject(req, e.into(), None)),
    };

    let client = req
        .headers()
        .get(&state.api_key_header)
        .and_then(|v| v.to_str().ok())
        .and_then(|key| state.catalog.by_key(&KeyHash::of(key)));
    let Some(client) = client else {
        state.metrics.count_outcome("unknown_key");
        let err = ApiError::MissingKey(state.api_key_header.to_string());
        return Ok(reject(req, err, None));
    };
    tracing::Span::current().record("client_id", client.id.as_str());

    let Some(route) = state.routes.find(path.as_str()).cloned() else {
        return Ok(reject(req, ApiError::NoRoute, None));
    };
    // The service must see exactly the path that was routed.
    let path_and_query = match rewritten(&path, req.uri().query()) {
        Ok(pq) => pq,
        Err(e) => return Ok(reject(req, e, None)),
    };
    let declared_len = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared_len.is_some_and(|n| n > state.max_body_bytes) {
        let err = ApiError::PayloadTooLarge(state.max_body_bytes);
        return Ok(reject(req, err, None));
    }

    let decision = state
        .limiter
        .decide(&client, &route.service, route.cost)
        .await;
    let rl =
        RateLimitHeaders::with_policy(&client.plan.name, &decision, client.plan.policy(&decision));
    if !decision.outcome.forwards() {
        let (wait, limit) = match decision.outcome {
            Outcome::SafetyDenied => (decision.safety_wait_us, None),
            _ => {
                let ruling = decision.ruling.as_ref();
                let refused = ruling
                    .and_then(|r| r.refused_by)
                    .and_then(|i| decision.applied.get(i))
                    .map(|a| policy_name(&client.plan.name, a));
                (ruling.and_then(|r| r.wait_us), refused)
            }
        };
        let err = match wait {
            Some(wait_us) => ApiError::RateLimited {
                retry_after_ms: wait_us.div_ceil(1000),
                // Whole seconds, rounded up, at least 1: a retry after this long finds
                // the tokens in every limit, and it is never more than a second
                // pessimistic.
                retry_after_s: wait_us.div_ceil(1_000_000).max(1),
                limit,
            },
            None => ApiError::CostExceedsCapacity { limit },
        };
        return Ok(reject(req, err, Some(rl)));
    }

    // Only shadow-mode answers are compared with the service's; only they need the
    // limiter (and the client) after the forward.
    let shadow =
        (client.mode == Mode::Shadow).then(|| (Arc::clone(&state.limiter), Arc::clone(&client)));
    req.extensions_mut().insert(Admitted {
        client,
        route,
        path_and_query,
    });
    let mut res = next.call(req).await?.map_into_boxed_body();
    if let Some((limiter, client)) = shadow {
        limiter.compare(&client, &decision, res.status().as_u16());
    }
    rl.apply(res.headers_mut());
    Ok(res)
}

/// The path and query to forward when the path was rewritten: the normal path, then the
/// query byte for byte.
fn rewritten(path: &NormalPath, query: Option<&str>) -> Result<Option<PathAndQuery>, ApiError> {
    if !path.is_rewritten() {
        return Ok(None);
    }
    let pq = match query {
        Some(q) => format!("{}?{q}", path.as_str()),
        None => path.as_str().to_string(),
    };
    PathAndQuery::try_from(pq)
        .map(Some)
        .map_err(|e| ApiError::Internal(e.into()))
}

fn reject(
    req: ServiceRequest,
    err: ApiError,
    rl: Option<RateLimitHeaders>,
) -> ServiceResponse<BoxBody> {
    let mut resp = err.error_response();
    if let Some(rl) = rl {
        rl.apply(resp.headers_mut());
    }
    req.into_response(resp)
}
