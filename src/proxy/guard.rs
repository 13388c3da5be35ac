//! The proxy's service: API key → client → route → decision, before any upstream call, then
//! the forward of an admitted request.

use std::future::{ready, Ready};
use std::rc::Rc;
use std::sync::Arc;

use actix_web::body::BoxBody;
use actix_web::dev::{always_ready, Service, ServiceFactory, ServiceRequest, ServiceResponse};
use actix_web::http::header::{self, HeaderMap, HeaderName, HeaderValue};
use actix_web::http::uri::PathAndQuery;
use actix_web::http::Version;
use actix_web::{web, ResponseError};
use futures_util::future::LocalBoxFuture;

use super::caller::{client_ip, client_of, look_up, LookedUp};
use super::clients::Clients;
use super::forward::{self, Admitted, Who};
use super::headers::{drop_client_ip_claims, has_client_ip_claims, peer_trusted};
use super::keys::FoundKey;
use super::websocket::{self, Upgrade};
use super::{edge, view};
use super::{NormalPath, Route};
use crate::configuration::{KeySource, UpstreamSettings};
use crate::domain::ratelimit::policy_name;
use crate::domain::{address_tag, Mode, PlanName};
use crate::domain::{Decision, Outcome, RateLimitHeaders};
use crate::error::ApiError;
use crate::limiter::Anonymous;
use crate::metrics::CostReport;
use crate::state::AppState;
use crate::trace::DecisionTimer;

/// The proxy: every path no other service claims. Each request is decided by [`guard`]
/// and, when admitted, forwarded by `forward` within the same future. One service rather
/// than a middleware over a forwarding service: the admission goes to the forward as an
/// argument, not through the request's extensions (a boxed value and a map insert and
/// removal per request), and one boxed future serves both. A client's own view
/// (`edge.limits_path`) is answered here too.
pub struct Guard {
    pub upstream: UpstreamSettings,
    /// `edge.limits_path` (`None`: off, the path is forwarded like any other).
    pub limits_path: Option<String>,
}

impl ServiceFactory<ServiceRequest> for Guard {
    type Response = ServiceResponse<BoxBody>;
    type Error = actix_web::Error;
    type Config = ();
    type Service = GuardService;
    type InitError = ();
    type Future = Ready<Result<GuardService, ()>>;

    fn new_service(&self, _: ()) -> Self::Future {
        ready(match Clients::new(&self.upstream) {
            Ok(clients) => Ok(GuardService {
                clients: Rc::new(clients),
                limits_path: self.limits_path.clone(),
            }),
            Err(e) => {
                tracing::error!(error = %e, "the upstream TLS client could not be built");
                Err(())
            }
        })
    }
}

/// One per worker, each with its own awc clients (their pools keep upstream connections
/// alive).
pub struct GuardService {
    clients: Rc<Clients>,
    /// `edge.limits_path`: answered here (one string compare) rather than by a resource
    /// of its own, which the router would try before every proxied request.
    limits_path: Option<String>,
}

impl Service<ServiceRequest> for GuardService {
    type Response = ServiceResponse<BoxBody>;
    type Error = actix_web::Error;
    type Future = LocalBoxFuture<'static, Result<ServiceResponse<BoxBody>, actix_web::Error>>;

    always_ready!();

    fn call(&self, mut req: ServiceRequest) -> Self::Future {
        if req.version() == Version::HTTP_2 {
            let authority = req.uri().authority().cloned();
            edge::authority_as_host(authority.as_ref(), req.headers_mut());
        }
        if self.limits_path.as_deref() == Some(req.path()) {
            return Box::pin(view::answer(req));
        }
        Box::pin(guard(req, Rc::clone(&self.clients)))
    }
}

/// The largest real cost a service may report (the largest `cost` a route may have).
const MAX_REPORTED_COST: f64 = 1e9;

/// Decides a request: `405` for `TRACE` and `CONNECT`, `400` for a missing, repeated or
/// invalid `Host` or a repeated key header (see [`edge::refusal`]), `400`/`414` for a path
/// it will not route (see [`NormalPath`]), `401` for a missing or unknown key (no store
/// call), `404` without a route for the normal path, `413` for a declared body over the
/// limit, `429` when the bucket is empty; for a WebSocket upgrade also `400` with a body
/// and `429` `too-many-connections` at its plan's `max_connections` (see [`Upgrade::of`]).
/// All before a token is spent or a service is called. Admitted requests go on to the
/// forwarder (an upgrade to its relay, [`websocket::respond`]), and every answer carries the
/// client's rate-limit headers. On a route with a `cost_header`, the real cost the
/// service reports in its response is settled (see [`CostedRoute::settle`]) as soon as
/// the response head is in, before its body streams.
#[tracing::instrument(name = "guard", level = "debug", skip_all, fields(client_id = tracing::field::Empty))]
async fn guard(
    mut req: ServiceRequest,
    upstream: Rc<Clients>,
) -> Result<ServiceResponse<BoxBody>, actix_web::Error> {
    // Borrowed, not cloned: every worker shares `AppState`, and an `Arc` count bumped by
    // both workers on every request is a cache line bouncing between their cores.
    let Some(state) = req.app_data::<web::Data<AppState>>() else {
        return Ok(reject(
            req,
            ApiError::Internal(anyhow::anyhow!("no AppState")),
            None,
        )
        .await);
    };

    let mut recognition = recognised(&req, state, &LookedUp::Not);
    if let Err(ApiError::NotHeld(hash)) = recognition {
        // Cache mode, a key not held: one store read (boxed: off every request's future).
        recognition = match Box::pin(look_up(state, hash)).await {
            Ok(looked_up) => recognised(&req, state, &looked_up),
            Err(e) => Err(e),
        };
    }
    let admitted = match recognition {
        Ok(Recognised::Forward(admitted)) => admitted,
        // Boxed, as `public` below: a rare path's state is not in every request's future.
        Ok(Recognised::OwnView) => return Box::pin(view::answer(req)).await,
        Err(e) => return Ok(reject(req, e, None).await),
    };
    // A WebSocket upgrade (nearly every request is none: a flag test) is checked before
    // its decision, as the rest above: a body, or a client at its `max_connections`.
    let upgrade = match Upgrade::of(&req, state, &admitted) {
        Ok(upgrade) => upgrade,
        Err(e) => return Ok(reject(req, e, None).await),
    };
    let client = match &admitted.who {
        Who::Client(client) => client,
        // Boxed: `public`'s state is not carried in every keyed request's future (which is
        // moved into its box, and polled, at its full size).
        Who::Anonymous(_) => return Box::pin(public(req, admitted, upstream, upgrade)).await,
    };
    let route = &admitted.route;

    let timer = DecisionTimer::start(state.traces.as_ref());
    let mut decision = state
        .limiter
        .decide(client, &route.service, route.cost)
        .await;
    timer.finish(
        &req,
        &decision,
        client.id.as_str(),
        &route.service,
        &route.prefix,
    );
    if decision.outcome == Outcome::Shed {
        return Ok(reject(req, ApiError::Overloaded, None).await);
    }
    let mut rl =
        RateLimitHeaders::with_policy(&client.plan.name, &decision, client.plan.policy(&decision));
    if !decision.outcome.forwards() {
        let err = refusal(&decision, &client.plan.name);
        return Ok(reject(req, err, Some(rl)).await);
    }

    // Only shadow-mode answers are compared with the service's; only they need the
    // limiter (and the client) after the forward.
    let shadow =
        (client.mode == Mode::Shadow).then(|| (Arc::clone(&state.limiter), Arc::clone(client)));
    // Likewise only a route whose service reports costs needs them after the forward.
    let costed = route.cost_header.is_some().then(|| CostedRoute {
        route: Arc::clone(route),
        payer: Who::Client(Arc::clone(client)),
        state: state.clone(),
    });
    // Addresses a client claims for itself are believed only from a trusted proxy.
    // (`headers_mut` requires the request unshared: nothing before the guard keeps a
    // clone of it, neither the logger, nor `request_id`, nor `trace::request`.)
    if has_client_ip_claims(req.headers())
        && !peer_trusted(req.peer_addr().map(|a| a.ip()), &state.trusted_proxies)
    {
        drop_client_ip_claims(req.headers_mut());
    }
    let mut res = pass_on(req, admitted, &upstream, upgrade).await;
    if let Some((limiter, client)) = shadow {
        limiter.compare(&client, &decision, res.status().as_u16());
    }
    if let Some(costed) = costed {
        if costed.settle(&mut decision, res.headers_mut()) {
            let plan = costed.payer.plan();
            rl = RateLimitHeaders::with_policy(&plan.name, &decision, plan.policy(&decision));
        }
    }
    rl.apply(res.headers_mut());
    Ok(res)
}

/// [`guard`] for a request without a key on a public route: decided per client address by
/// the route's plan, always enforced, forwarded without `X-Client-Id` (a service tells such
/// requests by its absence).
async fn public(
    mut req: ServiceRequest,
    admitted: Admitted,
    upstream: Rc<Clients>,
    upgrade: Option<Upgrade>,
) -> Result<ServiceResponse<BoxBody>, actix_web::Error> {
    let (Some(state), Who::Anonymous(who)) = (
        req.app_data::<web::Data<AppState>>().cloned(),
        &admitted.who,
    ) else {
        return Ok(reject(req, ApiError::Internal(anyhow::anyhow!("not public")), None).await);
    };
    let who = Arc::clone(who);
    let route = &admitted.route;
    let timer = DecisionTimer::start(state.traces.as_ref());
    let mut decision = state
        .limiter
        .decide_public(&who, &route.service, route.cost)
        .await;
    timer.finish(&req, &decision, "", &route.service, &route.prefix);
    if decision.outcome == Outcome::Shed {
        return Ok(reject(req, ApiError::Overloaded, None).await);
    }
    let plan = &who.plan;
    let mut rl = RateLimitHeaders::with_policy(&plan.name, &decision, plan.policy(&decision));
    if !decision.outcome.forwards() {
        let err = refusal(&decision, &plan.name);
        return Ok(reject(req, err, Some(rl)).await);
    }
    let costed = route.cost_header.is_some().then(|| CostedRoute {
        route: Arc::clone(route),
        payer: Who::Anonymous(Arc::clone(&who)),
        state: state.clone(),
    });
    if has_client_ip_claims(req.headers())
        && !peer_trusted(req.peer_addr().map(|a| a.ip()), &state.trusted_proxies)
    {
        drop_client_ip_claims(req.headers_mut());
    }
    let mut res = pass_on(req, admitted, &upstream, upgrade).await;
    if let Some(costed) = costed {
        if costed.settle(&mut decision, res.headers_mut()) {
            rl = RateLimitHeaders::with_policy(&plan.name, &decision, plan.policy(&decision));
        }
    }
    rl.apply(res.headers_mut());
    Ok(res)
}

/// An admitted request to its service: forwarded, or, an upgrade, relayed (boxed: its
/// state is not in every request's future).
async fn pass_on(
    req: ServiceRequest,
    admitted: Admitted,
    upstream: &Clients,
    upgrade: Option<Upgrade>,
) -> ServiceResponse<BoxBody> {
    match upgrade {
        None => forward::respond(req, admitted, upstream).await,
        Some(upgrade) => {
            let tls = Arc::clone(upstream.tls_config());
            Box::pin(websocket::respond(req, admitted, upgrade, tls)).await
        }
    }
}

/// What [`recognised`] found a request to be.
enum Recognised {
    /// For the limiter, then the forward.
    Forward(Admitted),
    /// A client's own view, in a form only its normal path shows (`/_tollgate/%6Cimits`,
    /// `/_tollgate/./limits`; the exact path is answered before the guard): the gateway's
    /// own path is routed by its normal form too, and never reaches a service.
    OwnView,
}

/// What the guard checks before the limiter, in order: the method and head, the path, the
/// key, the route, the declared body's size. These cost nothing (no store call), and a
/// bad request must never be charged. The request's client, its route and the path to
/// forward (see [`Admitted`]), or why it is refused.
fn recognised(
    req: &ServiceRequest,
    state: &AppState,
    looked_up: &LookedUp,
) -> Result<Recognised, ApiError> {
    if let Some(err) = edge::refusal(
        req.method(),
        req.version(),
        req.uri().authority(),
        req.headers(),
        state.key_sources.header(),
    ) {
        return Err(err);
    }
    let path = NormalPath::parse(req.path())?;
    if path.is_rewritten() && state.edge.limits_path.as_deref() == Some(path.as_str()) {
        return Ok(Recognised::OwnView);
    }
    let unknown = || {
        state.metrics.count_outcome("unknown_key");
        state.key_sources.missing()
    };
    let found = state.key_sources.find(req.headers(), req.uri().query())?;
    let key_source = found.as_ref().map(|f| f.source);
    let client = client_of(req.request(), state, found.as_ref(), looked_up)?;
    // Without a key, an unrouted path is `401` as a private route is: which paths are
    // routed is not told to whoever has no key.
    let Some(route) = state.routes.load().find(path.as_str()).cloned() else {
        return Err(match client {
            Some(_) => ApiError::NoRoute,
            None => unknown(),
        });
    };
    let who = match client {
        Some(client) => {
            tracing::Span::current().record("client_id", client.id.as_str());
            Who::Client(client)
        }
        None => match &route.public_plan {
            Some(plan) => Who::Anonymous(Arc::new(anonymous(req, state, plan)?)),
            None => return Err(unknown()),
        },
    };
    // The service must see exactly the path that was routed, and never a key in the query.
    let path_and_query = match found {
        Some(FoundKey {
            source: KeySource::Query,
            rest_of_query,
            ..
        }) => Some(with_query(&path, rest_of_query.as_deref())?),
        _ if path.is_rewritten() => Some(with_query(&path, req.uri().query())?),
        _ => None,
    };
    let declared_len = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared_len.is_some_and(|n| n > state.max_body_bytes) {
        return Err(ApiError::PayloadTooLarge(state.max_body_bytes));
    }
    Ok(Recognised::Forward(Admitted {
        who,
        route,
        path_and_query,
        key_source,
    }))
}

/// Who a request without a key on a public route with `plan` is: the group of its client
/// address (the peer, or the nearest untrusted `X-Forwarded-For` hop from a trusted
/// proxy: the address that is forwarded), in the plan's buckets.
fn anonymous(
    req: &ServiceRequest,
    state: &AppState,
    plan: &PlanName,
) -> Result<Anonymous, ApiError> {
    let Some(slot) = state.catalog.plan(plan) else {
        state.metrics.count_outcome("public_plan_missing");
        return Err(ApiError::PublicPlanMissing(plan.to_string()));
    };
    let ip = client_ip(req.request(), state);
    let tag = address_tag(
        plan.as_str(),
        ip,
        state.edge.ipv4_prefix,
        state.edge.ipv6_prefix,
    );
    let bucket_key = state.catalog.key_names().address_bucket(&tag);
    Ok(Anonymous {
        tag,
        bucket_key,
        plan: slot,
    })
}

/// Why a decision that does not forward refuses: when the tokens will be there (`429`
/// with `Retry-After`), naming the limit that refused, or never at this cost.
fn refusal(decision: &Decision, plan: &PlanName) -> ApiError {
    let (wait, limit) = match decision.outcome {
        Outcome::SafetyDenied => (decision.safety_wait_us, None),
        _ => {
            let ruling = decision.ruling.as_ref();
            let refused = ruling
                .and_then(|r| r.refused_by)
                .and_then(|i| decision.applied.get(i))
                .map(|a| policy_name(plan, a));
            (ruling.and_then(|r| r.wait_us), refused)
        }
    };
    match wait {
        Some(wait_us) => ApiError::RateLimited {
            retry_after_ms: wait_us.div_ceil(1000),
            // Whole seconds, rounded up, at least 1: a retry after this long finds the
            // tokens in every limit, and it is never more than a second pessimistic.
            retry_after_s: wait_us.div_ceil(1_000_000).max(1),
            limit,
        },
        None => ApiError::CostExceedsCapacity { limit },
    }
}

/// What settling a reported cost needs once the response head is in: only requests to a
/// route with a `cost_header` carry it past the forward.
struct CostedRoute {
    route: Arc<Route>,
    payer: Who,
    state: web::Data<AppState>,
}

impl CostedRoute {
    /// Takes the service's cost report out of its response (it is the service's
    /// accounting, not the client's business: the client sees its effect in `RateLimit`)
    /// and, for an admitted request, counts it and queues the difference to what was
    /// taken up front as a debit or a refund ([`crate::limiter::Limiter::settle`]:
    /// batched, off the request path). Returns whether that moved the decision's levels,
    /// which then show the real cost. A request that was not admitted (failed open, or a
    /// shadow-mode refusal) took nothing to settle against; a malformed report is ignored.
    fn settle(&self, decision: &mut Decision, headers: &mut HeaderMap) -> bool {
        let Some(name) = &self.route.cost_header else {
            return false;
        };
        let Some(reported) = take_reported_cost(headers, name) else {
            return false;
        };
        if decision.outcome != Outcome::Allowed {
            return false;
        }
        let Some(real) = reported else {
            tracing::debug!(service = %self.route.service, header = %name, "a malformed cost report was ignored");
            self.state
                .metrics
                .record_cost_report(&self.route.service, CostReport::Invalid);
            return false;
        };
        let delta = real - decision.cost;
        let report = match delta.partial_cmp(&0.0) {
            Some(std::cmp::Ordering::Greater) => CostReport::Debit,
            Some(std::cmp::Ordering::Less) => CostReport::Refund,
            _ => CostReport::Same,
        };
        let service = &self.route.service;
        self.state.metrics.record_cost_report(service, report);
        if report == CostReport::Same {
            return false;
        }
        match &self.payer {
            Who::Client(client) => self.state.limiter.settle(client, decision, real),
            Who::Anonymous(who) => self.state.limiter.settle_public(who, decision, real),
        }
        if let Some(ruling) = decision.ruling.as_mut() {
            for (level, applied) in ruling.levels.iter_mut().zip(&decision.applied) {
                level.adjust(&applied.kind, delta);
            }
        }
        true
    }
}

/// Removes the service's cost report from `headers`: `None` when there was none,
/// `Some(None)` when it is not one finite number from 0 to [`MAX_REPORTED_COST`] (sent
/// more than once included).
fn take_reported_cost(headers: &mut HeaderMap, name: &HeaderName) -> Option<Option<f64>> {
    let mut values = headers.remove(name);
    let first = values.next()?;
    if values.next().is_some() {
        return Some(None);
    }
    Some(parse_cost(&first))
}

fn parse_cost(value: &HeaderValue) -> Option<f64> {
    let cost: f64 = value.to_str().ok()?.trim().parse().ok()?;
    (cost.is_finite() && (0.0..=MAX_REPORTED_COST).contains(&cost)).then_some(cost)
}

/// The path and query to forward when they differ from the request's: the normal path,
/// then `query` byte for byte.
fn with_query(path: &NormalPath, query: Option<&str>) -> Result<PathAndQuery, ApiError> {
    let pq = match query {
        Some(q) => format!("{}?{q}", path.as_str()),
        None => path.as_str().to_string(),
    };
    PathAndQuery::try_from(pq).map_err(|e| ApiError::Internal(e.into()))
}

/// Answers without forwarding. Of the request's body, what has already arrived is read
/// (so a client that sent all of it keeps its connection); the rest is held until the
/// answer is written, so the connection is closed after at most a bounded linger rather
/// than drained for as long as the client cares to send ([`edge::keep_payload`]).
async fn reject(
    req: ServiceRequest,
    err: ApiError,
    rl: Option<RateLimitHeaders>,
) -> ServiceResponse<BoxBody> {
    let mut resp = err.error_response();
    if let Some(rl) = rl {
        rl.apply(resp.headers_mut());
    }
    let (req, mut payload) = req.into_parts();
    edge::read_arrived(&mut payload).await;
    ServiceResponse::new(req, edge::keep_payload(resp, payload))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reported(values: &[&'static str]) -> (Option<Option<f64>>, HeaderMap) {
        let name = HeaderName::from_static("x-tollgate-cost");
        let mut headers = HeaderMap::new();
        for v in values {
            headers.append(name.clone(), HeaderValue::from_static(v));
        }
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        (take_reported_cost(&mut headers, &name), headers)
    }

    #[test]
    fn a_reported_cost_is_a_finite_number_from_zero_to_a_billion() {
        for (value, cost) in [
            ("5", 5.0),
            (" 2.5 ", 2.5),
            ("0", 0.0),
            ("1e9", 1e9),
            ("1e3", 1000.0),
        ] {
            assert_eq!(reported(&[value]).0, Some(Some(cost)), "{value:?}");
        }
        for value in ["", "-1", "1e10", "NaN", "inf", "five", "5 tokens", "0x10"] {
            assert_eq!(reported(&[value]).0, Some(None), "{value:?}");
        }
    }

    #[test]
    fn a_cost_reported_twice_is_malformed_and_none_is_nothing() {
        assert_eq!(reported(&["1", "2"]).0, Some(None));
        assert_eq!(reported(&[]).0, None);
    }

    #[test]
    fn the_report_is_taken_out_of_the_response_and_nothing_else() {
        let (_, headers) = reported(&["1", "x"]);
        assert!(!headers.contains_key("x-tollgate-cost"));
        assert!(headers.contains_key(header::CONTENT_TYPE));
    }
}
