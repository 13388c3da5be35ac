//! `/admin/v1/clients/{client}/overrides`: a client's own values for some of its plan's
//! limits, optionally until a time (a temporary raise), without a plan of its own. They are
//! part of the client's record (written with its version, audited as `override.put` and
//! `override.delete`), managed here like its keys and kept when the client is replaced.
//! An override changes a limit's values, not its state: what the client has spent stays.

use actix_web::http::{header, StatusCode};
use actix_web::{web, HttpRequest, HttpResponse};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::body::{etag, read_body, Field, Fields, Preconditions};
use super::plans::QuotaAmount;
use super::shared::{
    client_id, current, now_ms, path_id, plan_limits, rfc3339, update_client, PartPreconditions,
};
use super::Actor;
use crate::catalog::{Audit, ClientRecord};
use crate::domain::limits::MAX_LIMITS;
use crate::domain::{Capacity, ClientId, LimitName, Override, Rate};
use crate::error::{ApiError, Problem};
use crate::state::AppState;

/// A client keeps at most this many overrides (one per limit of its plan, and room for
/// those of limits a former plan had, which do nothing until deleted).
const MAX_OVERRIDES: usize = 2 * MAX_LIMITS;

/// A client's own values for one of its plan's limits. Values left out are the plan's.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"limit": "burst", "capacity": 400.0, "until": "2030-01-01T00:00:00Z"}))]
pub struct OverrideView {
    /// The plan's limit it changes.
    #[schema(value_type = LimitName)]
    pub limit: String,
    /// A bucket's size instead of the plan's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capacity: Option<f64>,
    /// A bucket's refill instead of the plan's, tokens per second.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rate: Option<f64>,
    /// A quota's amount instead of the plan's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quota: Option<f64>,
    /// Until when it holds (RFC 3339, UTC, whole seconds); absent: until deleted. An
    /// override past it does nothing (it stays listed until deleted).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(format = DateTime, example = "2030-01-01T00:00:00Z")]
    pub until: Option<String>,
}

impl From<&Override> for OverrideView {
    fn from(o: &Override) -> OverrideView {
        OverrideView {
            limit: o.limit.to_string(),
            capacity: o.capacity,
            rate: o.rate,
            quota: o.quota,
            until: o.until.map(|s| rfc3339(s.saturating_mul(1_000_000))),
        }
    }
}

/// The body of `PUT .../overrides/{limit}`: at least one value, of the limit's kind
/// (`capacity` and/or `rate` for a bucket, `quota` for a quota), within the bounds of a
/// plan's; optionally `until`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"capacity": 400, "until": "2030-01-01T00:00:00Z"}))]
pub struct OverrideInput {
    /// A bucket's size instead of the plan's.
    #[serde(default)]
    #[schema(value_type = Option<Capacity>)]
    capacity: Field<Capacity>,
    /// A bucket's refill instead of the plan's.
    #[serde(default)]
    #[schema(value_type = Option<Rate>)]
    rate: Field<Rate>,
    /// A quota's amount instead of the plan's.
    #[serde(default)]
    #[schema(value_type = Option<QuotaAmount>)]
    quota: Field<QuotaAmount>,
    /// Until when it holds: an RFC 3339 time in the future (`2030-01-01T00:00:00Z`,
    /// `2030-01-01T01:00:00+01:00`), kept in whole seconds (a fraction rounds up).
    /// Absent: until deleted.
    #[serde(default)]
    #[schema(value_type = Option<String>, format = DateTime, example = "2030-01-01T00:00:00Z")]
    until: Field<Until>,
    /// Read-only: an override read with GET may be sent back as it is; the limit must
    /// then be the one in the path.
    #[serde(default)]
    #[schema(schema_with = read_only_limit)]
    limit: Field<LimitName>,
}

fn read_only_limit() -> utoipa::openapi::RefOr<utoipa::openapi::Schema> {
    super::body::read_only(<LimitName as utoipa::PartialSchema>::schema())
}

/// An instant given as RFC 3339, in unix seconds (rounded up).
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(try_from = "Value")]
pub(super) struct Until(pub(super) u64);

impl TryFrom<Value> for Until {
    type Error = String;
    fn try_from(v: Value) -> Result<Until, String> {
        let Value::String(s) = v else {
            return Err(crate::domain::rfc3339_wanted());
        };
        crate::domain::unix_s_of_rfc3339(&s).map(Until)
    }
}

/// The override of `limit` a body gives (its `limit` member aside), every problem named in
/// `f`; `until` may be past (a catalog file keeps overrides that ran out).
pub(super) fn override_of(limit: LimitName, input: OverrideInput, f: &mut Fields) -> Override {
    Override {
        limit,
        capacity: f.optional("capacity", input.capacity).map(Capacity::get),
        rate: f.optional("rate", input.rate).map(Rate::get),
        quota: f.optional("quota", input.quota).map(f64::from),
        until: f.optional("until", input.until).map(|u| u.0),
    }
}

/// The limit an override's body names (`GET` shows it; a catalog file names each so).
pub(super) fn limit_named(input: &mut OverrideInput) -> Field<LimitName> {
    std::mem::take(&mut input.limit)
}

/// A client's overrides.
#[derive(Serialize, ToSchema)]
pub struct OverrideList {
    pub items: Vec<OverrideView>,
}

/// A client's overrides, in force or past their `until`.
#[utoipa::path(operation_id = "listOverrides", get, path = "/admin/v1/clients/{client}/overrides", tag = "clients",
    params(("client" = ClientId, Path, description = "Client id")),
    responses(
        (status = 200, description = "The client's overrides; the ETag is the client's", body = OverrideList,
            headers(("ETag" = String, description = "The client's version, for If-Match"))),
        (status = 404, description = "No such client", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn list(
    state: web::Data<AppState>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let id = client_id(&id)?;
    let client = current(&state, &id).await?;
    Ok(HttpResponse::Ok()
        .insert_header((header::ETAG, etag(client.rev)))
        .json(OverrideList {
            items: client.value.overrides.iter().map(Into::into).collect(),
        }))
}

/// Create (201) or replace (200) the client's override of one of its plan's limits,
/// checked against that plan. In force on every gateway within `catalog.refresh_ms`, until
/// `until`; what the client has spent stays (a raised capacity is not a refill).
#[utoipa::path(operation_id = "putOverride", put, path = "/admin/v1/clients/{client}/overrides/{limit}", tag = "clients",
    params(("client" = ClientId, Path, description = "Client id"),
        ("limit" = LimitName, Path, description = "The name of one of the plan's limits"),
        ("If-Match" = Option<String>, Header, description = "Only if the client is at this ETag")),
    request_body(content = OverrideInput, content_type = "application/json"),
    responses(
        (status = 200, description = "Replaced", body = OverrideView,
            headers(("ETag" = String, description = "The client's new version"))),
        (status = 201, description = "Created", body = OverrideView,
            headers(("ETag" = String, description = "The client's new version"),
                ("Location" = String, description = "The override"))),
        (status = 404, description = "No such client", body = Problem, content_type = "application/problem+json"),
        (status = 412, description = "If-Match no longer matches the client", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Invalid fields, each named: `limit` when the plan has no such limit, a value of the other kind of limit, `until` not in the future", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn put(
    req: HttpRequest,
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
    actor: Actor,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let (id, limit) = path.into_inner();
    let id = client_id(&id)?;
    let limit = path_id(&limit, LimitName::parse, "limit")?;
    let (mut input, mut f) = read_body::<OverrideInput>(payload).await?;
    f.same_id("limit", std::mem::take(&mut input.limit), &limit);
    let o = override_of(limit, input, &mut f);
    if o.until.is_some_and(|u| u <= now_ms() / 1000) {
        f.bad("until", "must be in the future");
    }
    f.finish()?;
    let wanted = Preconditions::read(req.headers())?;
    let audit = Audit::new(&actor.sub, "override.put");
    let part = PartPreconditions {
        wanted: &wanted,
        exists: |c: &ClientRecord| c.overrides.iter().any(|x| x.limit == o.limit),
        what: "override",
        deletes: false,
    };
    let (created, rev) = update_client(&state, &id, audit, part, async |c| {
        // Against the plan the client is on in the version written.
        let limits = plan_limits(&state, &c.plan).await?;
        limits
            .check_override(&o)
            .map_err(|e| ApiError::field(e.field, e.message))?;
        let held = c.overrides.len();
        match c.overrides.iter_mut().find(|x| x.limit == o.limit) {
            Some(existing) => {
                *existing = o.clone();
                Ok(false)
            }
            None if held >= MAX_OVERRIDES => Err(ApiError::field(
                "limit",
                format!(
                    "a client has at most {MAX_OVERRIDES} overrides: delete those of limits \
                     its plan no longer has"
                ),
            )),
            None => {
                c.overrides.push(o.clone());
                Ok(true)
            }
        }
    })
    .await?;
    let mut resp = HttpResponse::build(if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    });
    resp.insert_header((header::ETAG, etag(rev)));
    if created {
        resp.insert_header((
            header::LOCATION,
            format!("/admin/v1/clients/{id}/overrides/{}", o.limit),
        ));
    }
    Ok(resp.json(OverrideView::from(&o)))
}

/// Delete the client's override of a limit: the plan's values hold again, from what the
/// client has spent.
#[utoipa::path(operation_id = "deleteOverride", delete, path = "/admin/v1/clients/{client}/overrides/{limit}", tag = "clients",
    params(("client" = ClientId, Path, description = "Client id"),
        ("limit" = LimitName, Path, description = "The limit the override changes"),
        ("If-Match" = Option<String>, Header, description = "Only if the client is at this ETag")),
    responses(
        (status = 204, description = "Deleted",
            headers(("ETag" = String, description = "The client's new version"))),
        (status = 404, description = "No such client, or it has no override of that limit", body = Problem, content_type = "application/problem+json"),
        (status = 412, description = "If-Match no longer matches the client", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn delete(
    req: HttpRequest,
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
    actor: Actor,
) -> Result<HttpResponse, ApiError> {
    let (id, limit) = path.into_inner();
    let id = client_id(&id)?;
    let limit = path_id(&limit, LimitName::parse, "limit")?;
    let wanted = Preconditions::read(req.headers())?;
    let audit = Audit::new(&actor.sub, "override.delete");
    let part = PartPreconditions {
        wanted: &wanted,
        exists: |c: &ClientRecord| c.overrides.iter().any(|x| x.limit == limit),
        what: "override",
        deletes: true,
    };
    let ((), rev) = update_client(&state, &id, audit, part, async |c| {
        let before = c.overrides.len();
        c.overrides.retain(|o| o.limit != limit);
        if c.overrides.len() == before {
            return Err(ApiError::NotFound(format!(
                "client {id} has no override of {limit}"
            )));
        }
        Ok(())
    })
    .await?;
    Ok(HttpResponse::NoContent()
        .insert_header((header::ETAG, etag(rev)))
        .finish())
}
