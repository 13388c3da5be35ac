//! `GET /admin/v1/clients/{client}/usage`: every limit of a client now, for the account
//! team: the values in force (the plan's, or an override's) and what is left of each.
//! Computed from the store's records and read with one `peek` of the client's state, which
//! changes nothing, so it answers the same on any gateway.

use actix_web::{web, HttpResponse};
use serde::Serialize;
use utoipa::ToSchema;

use super::plans::ResetRule;
use super::shared::{client_id, current, now_ms, plan_limits, rfc3339};
use crate::domain::ratelimit::policy_name;
use crate::domain::{Applied, ClientId, Level, Limits, Override, Period, PlanName, Ruling};
use crate::error::{ApiError, Problem};
use crate::state::AppState;

const SHARDED_NOTE: &str = "sharded by region: each region decides this client's buckets \
    in its own shard of them (see /bucket for the shares), so the bucket levels here are \
    the global state's, not any region's; quotas are counted globally and are exact here";

/// Every limit of a client now.
#[derive(Debug, Serialize, ToSchema)]
pub struct UsageView {
    #[schema(example = "acme")]
    pub client: String,
    #[schema(example = "gold")]
    pub plan: String,
    /// When the levels were read, on the store's clock (RFC 3339, UTC).
    #[schema(format = DateTime, example = "2026-11-17T09:30:00.125Z")]
    pub at: String,
    /// Whether the client is sharded by region: its buckets are then decided in each
    /// region's shard and the bucket levels here are the global state's (see `note`);
    /// its quotas are counted globally, as for every client.
    pub sharded: bool,
    /// For a sharded client: what its levels mean.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// In the plan's order.
    pub limits: Vec<LimitUsage>,
}

/// One limit of the client now.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"name": "monthly", "policy": "gold.monthly", "kind": "quota",
    "quota": 1000000.0, "period": "month", "reset": "calendar", "time_zone": "UTC",
    "remaining": 999880.0, "used": 120.0, "resets_at": "2026-12-01T00:00:00Z", "overridden": false}))]
pub struct LimitUsage {
    #[schema(example = "burst")]
    pub name: String,
    /// Its name in `RateLimit-Policy` and in a 429's `limit`: the plan's for the plan's
    /// first limit, `plan.limit` for the others.
    #[schema(example = "gold")]
    pub policy: String,
    /// The one service it applies to; absent: every request.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
    pub kind: LimitKindName,
    /// A bucket's size in force.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capacity: Option<f64>,
    /// A bucket's refill in force, tokens per second.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rate: Option<f64>,
    /// A quota's amount in force.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quota: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub period: Option<Period>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<ResetRule>)]
    pub reset: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub anchor_day: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub time_zone: Option<String>,
    /// What is left now: a bucket's tokens (fractional while it refills; below zero after
    /// costs debited after the response), or the quota less what its window has counted.
    #[schema(example = 150.5)]
    pub remaining: f64,
    /// A quota's count in its current window.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub used: Option<f64>,
    /// When it is whole again (RFC 3339, UTC, to the millisecond): a bucket full, a quota's
    /// window over. `at` when it is whole now.
    #[schema(format = DateTime, example = "2026-11-17T09:30:00.625Z")]
    pub resets_at: String,
    /// Whether an override of the client's sets the values in force.
    pub overridden: bool,
    /// Until when that override holds (RFC 3339, UTC); absent when it holds until deleted.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(format = DateTime, example = "2030-01-01T00:00:00Z")]
    pub overridden_until: Option<String>,
}

#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum LimitKindName {
    Bucket,
    Quota,
}

/// Every limit of the client now: the values in force (its plan's, with its overrides that
/// have not expired), what is left, and when each is whole again. Reads only.
#[utoipa::path(operation_id = "getUsage", get, path = "/admin/v1/clients/{client}/usage", tag = "clients",
    params(("client" = ClientId, Path, description = "Client id")),
    responses(
        (status = 200, description = "Every limit of the client now", body = UsageView),
        (status = 404, description = "No such client", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn get(
    state: web::Data<AppState>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let id = client_id(&id)?;
    let client = current(&state, &id).await?.value;
    let now_s = now_ms() / 1000;
    let limits = plan_limits(&state, &client.plan)
        .await?
        .overridden(&client.overrides, now_s);
    let applied = limits.every();
    let key = state.catalog.key_names().bucket(&id);
    let ruling = state.store.buckets.peek(&key, &applied).await?;
    Ok(HttpResponse::Ok().json(UsageView::of(
        &id,
        &client.plan,
        client.shards.is_some(),
        &limits,
        &applied,
        &ruling,
        &client.overrides,
        now_s,
    )))
}

impl UsageView {
    /// Every limit of `client` on `plan` from one `peek` (`ruling`) of its state for
    /// `applied` (every limit of `limits`, in order), with `overrides` in force at `now_s`.
    #[allow(clippy::too_many_arguments)]
    pub fn of(
        client: &ClientId,
        plan: &PlanName,
        sharded: bool,
        limits: &Limits,
        applied: &[Applied],
        ruling: &Ruling,
        overrides: &[Override],
        now_s: u64,
    ) -> UsageView {
        let now_us = ruling.now_us;
        let items = limits
            .items()
            .iter()
            .zip(applied)
            .zip(&ruling.levels)
            .map(|((limit, a), level)| {
                let spec = limit.spec();
                let o = overrides
                    .iter()
                    .find(|o| o.limit == *limit.name() && o.active(now_s));
                LimitUsage {
                    name: spec.name,
                    policy: policy_name(plan, a),
                    service: spec.service,
                    kind: if spec.quota.is_some() {
                        LimitKindName::Quota
                    } else {
                        LimitKindName::Bucket
                    },
                    capacity: spec.capacity,
                    rate: spec.rate,
                    quota: spec.quota,
                    period: spec.period,
                    reset: spec.reset,
                    anchor_day: spec.anchor_day,
                    time_zone: spec.time_zone,
                    remaining: level.remaining(&a.kind),
                    used: match level {
                        Level::Used { used, .. } => Some(*used),
                        Level::Tokens(_) => None,
                    },
                    resets_at: rfc3339(now_us.saturating_add(level.reset_us(&a.kind, now_us))),
                    overridden: o.is_some(),
                    overridden_until: o
                        .and_then(|o| o.until)
                        .map(|s| rfc3339(s.saturating_mul(1_000_000))),
                }
            })
            .collect();
        UsageView {
            client: client.to_string(),
            plan: plan.to_string(),
            at: rfc3339(now_us),
            sharded,
            note: sharded.then(|| SHARDED_NOTE.to_string()),
            limits: items,
        }
    }
}
