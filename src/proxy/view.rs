//! A client's own view of its limits (`edge.limits_path`, `GET /_tollgate/limits`):
//! authenticated by its key as any request is, answering every limit that applies to it
//! (what is left, when it is whole again, the override in force and its end) with the
//! `RateLimit` headers a request would carry, and spending nothing. It reads the client's
//! state with one `peek`, which writes nothing, on the store's control path (never
//! delaying a decision). Not a way to flood: unknown keys count against their address as
//! on any route, and each client may read it [`VIEW_BURST`] times, then once every
//! [`VIEW_EVERY_S`] seconds, per gateway.

use std::time::Instant;

use actix_web::body::BoxBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header::{self, HeaderValue};
use actix_web::http::Method;
use actix_web::{web, HttpRequest, HttpResponse, ResponseError};

use super::caller::{client_of, look_up, LookedUp};
use super::edge;
use crate::admin::UsageView;
use crate::domain::{bucket, Bucket, Decision, Outcome, RateLimitHeaders};
use crate::error::ApiError;
use crate::state::AppState;

/// Views a client may read at once...
pub const VIEW_BURST: f64 = 5.0;
/// ...then one every this many seconds, per gateway.
pub const VIEW_EVERY_S: f64 = 2.0;

/// A request for `edge.limits_path` (matched by the proxy's service: one comparison, not a
/// route the router would try before every proxied request). It meets the edge's checks
/// as any proxied request does ([`edge::refusal`]: `TRACE`, `Host`, a key header sent
/// twice), then `GET`/`HEAD` read the client's own limits and anything else is `405`. It
/// reads no body: what has arrived is read, the rest held until the answer is written
/// ([`edge::keep_payload`]), so a client can hold the connection no longer than any
/// refused request's.
pub(super) async fn answer(
    req: ServiceRequest,
) -> Result<ServiceResponse<BoxBody>, actix_web::Error> {
    let (http, mut payload) = req.into_parts();
    let resp = match http.app_data::<web::Data<AppState>>().cloned() {
        None => ApiError::Internal(anyhow::anyhow!("no AppState")).error_response(),
        Some(state) => {
            let refused = edge::refusal(
                http.method(),
                http.version(),
                http.uri().authority(),
                http.headers(),
                state.key_sources.header(),
            );
            match (refused, http.method()) {
                (Some(err), _) => err.error_response(),
                (None, &Method::GET | &Method::HEAD) => own_limits(&http, state)
                    .await
                    .unwrap_or_else(|e| e.error_response()),
                (None, _) => ApiError::MethodNotAllowed("GET, HEAD").error_response(),
            }
        }
    };
    edge::read_arrived(&mut payload).await;
    Ok(ServiceResponse::new(
        http,
        edge::keep_payload(resp, payload),
    ))
}

/// `GET`/`HEAD` on `edge.limits_path`.
async fn own_limits(
    req: &HttpRequest,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let found = state.key_sources.find(req.headers(), req.uri().query())?;
    let client = match client_of(req, &state, found.as_ref(), &LookedUp::Not) {
        Err(ApiError::NotHeld(hash)) => {
            let looked_up = look_up(&state, hash).await?;
            client_of(req, &state, found.as_ref(), &looked_up)
        }
        other => other,
    }?;
    let Some(client) = client else {
        state.metrics.count_outcome("unknown_key");
        return Err(state.key_sources.missing());
    };
    let allowance = Bucket::new(VIEW_BURST, 1.0 / VIEW_EVERY_S).expect("a valid bucket");
    let now_us = state.views.us_at(Instant::now());
    let wait_us = state.views.take_at(&client.id, allowance, 1.0, now_us);
    if let Some(wait_us) = wait_us.filter(|w| *w > 0) {
        return Err(ApiError::RateLimited {
            retry_after_ms: wait_us.div_ceil(1000),
            retry_after_s: wait_us.div_ceil(1_000_000).max(1),
            limit: Some("view".into()),
        });
    }
    debug_assert_eq!(wait_us, bucket::TAKEN);
    let limits = client.limits();
    let applied = limits.every();
    let ruling = state
        .store
        .buckets
        .peek(&client.bucket_key, &applied)
        .await?;
    let now_s = ruling.now_us / 1_000_000;
    let body = UsageView::of(
        &client.id,
        &client.plan.name,
        client.shard.is_some(),
        &limits,
        &applied,
        &ruling,
        &client.record.overrides,
        now_s,
    );
    let decision = Decision {
        outcome: Outcome::Allowed,
        as_planned: !limits.has_scoped() && client.record.overrides.is_empty(),
        applied,
        ruling: Some(ruling),
        cost: 0.0,
        sharded: false,
        safety_wait_us: None,
        fail_open_reason: None,
    };
    let plan = &client.plan;
    let mut resp = HttpResponse::Ok().json(body);
    RateLimitHeaders::with_policy(&plan.name, &decision, plan.policy(&decision))
        .apply(resp.headers_mut());
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    Ok(resp)
}
