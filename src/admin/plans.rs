//! `/admin/v1/plans`: what each plan allows (capacity, rate).

use actix_web::http::header;
use actix_web::{web, HttpRequest, HttpResponse};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::body::{etag, read_body, Description, Field};
use super::shared::{condition, path_id};
use super::Actor;
use crate::catalog::{Audit, CatalogWrite, Condition, PlanRecord, Versioned, WriteOutcome};
use crate::domain::{Bucket, Capacity, Limits, PlanName, Rate};
use crate::error::{ApiError, Problem};
use crate::state::AppState;

/// A plan: a bucket of `capacity` tokens, refilled at `rate` tokens per second.
#[derive(Debug, Serialize, ToSchema)]
pub struct PlanView {
    /// 1-64 characters of `A-Z a-z 0-9 - _ .`.
    #[schema(example = "gold")]
    pub name: String,
    /// Bucket size in tokens: the largest burst (1 to 1e9).
    #[schema(example = 100)]
    pub capacity: f64,
    /// Refill in tokens per second: the sustained rate (0.001 to 1e9).
    #[schema(example = 50)]
    pub rate: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
}

/// The body of `PUT /admin/v1/plans/{plan}`. `capacity / rate` (the time an empty bucket
/// takes to fill) is at most 1e12 s by these bounds.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PlanInput {
    #[serde(default)]
    #[schema(value_type = Capacity, required = true)]
    capacity: Field<Capacity>,
    #[serde(default)]
    #[schema(value_type = Rate, required = true)]
    rate: Field<Rate>,
    #[serde(default)]
    #[schema(value_type = Option<Description>)]
    description: Field<Description>,
    /// Read-only: a plan read with GET may be sent back as it is; the name must then be
    /// the one in the path.
    #[serde(default)]
    #[schema(schema_with = read_only_name)]
    name: Field<PlanName>,
}

fn read_only_name() -> utoipa::openapi::RefOr<utoipa::openapi::Schema> {
    super::body::read_only(<PlanName as utoipa::PartialSchema>::schema())
}

#[derive(Serialize, ToSchema)]
pub struct PlanList {
    pub items: Vec<PlanView>,
}

impl From<PlanRecord> for PlanView {
    fn from(p: PlanRecord) -> PlanView {
        PlanView {
            name: p.name.to_string(),
            capacity: p.capacity.unwrap_or_default(),
            rate: p.rate.unwrap_or_default(),
            description: p.description,
        }
    }
}

fn one(rec: Versioned<PlanRecord>, status: actix_web::http::StatusCode) -> HttpResponse {
    let name = rec.value.name.to_string();
    let mut resp = HttpResponse::build(status);
    resp.insert_header((header::ETAG, etag(rec.rev)));
    if status == actix_web::http::StatusCode::CREATED {
        resp.insert_header((header::LOCATION, format!("/admin/v1/plans/{name}")));
    }
    resp.json(PlanView::from(rec.value))
}

/// List every plan.
#[utoipa::path(operation_id = "listPlans", get, path = "/admin/v1/plans", tag = "plans",
    responses(
        (status = 200, description = "All plans, by name", body = PlanList),
        (status = 401, description = "Missing or invalid token", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "Token lacks admin:read", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn list(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let items = state
        .store
        .plans()
        .await?
        .into_iter()
        .map(|p| PlanView::from(p.value))
        .collect();
    Ok(HttpResponse::Ok().json(PlanList { items }))
}

/// Read one plan.
#[utoipa::path(operation_id = "getPlan", get, path = "/admin/v1/plans/{plan}", tag = "plans",
    params(("plan" = PlanName, Path, description = "Bucket name")),
    responses(
        (status = 200, description = "The plan; its ETag is its version", body = PlanView,
            headers(("ETag" = String, description = "Version, for If-Match"))),
        (status = 404, description = "No such plan", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn get(
    state: web::Data<AppState>,
    name: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let name = path_id(&name, PlanName::parse, "plan")?;
    match state.store.plan(name.as_str()).await? {
        Some(rec) => Ok(one(rec, actix_web::http::StatusCode::OK)),
        None => Err(ApiError::NotFound(format!("no plan {name}"))),
    }
}

/// Create (201) or replace (200) a plan. Takes effect on every gateway within
/// `catalog.refresh_ms`.
#[utoipa::path(operation_id = "putPlan", put, path = "/admin/v1/plans/{plan}", tag = "plans",
    params(("plan" = PlanName, Path, description = "Bucket name"),
        ("If-Match" = Option<String>, Header, description = "Only if the plan is at this ETag")),
    request_body(content = PlanInput, content_type = "application/json"),
    responses(
        (status = 200, description = "Replaced", body = PlanView),
        (status = 201, description = "Created", body = PlanView),
        (status = 400, description = "Malformed JSON", body = Problem, content_type = "application/problem+json"),
        (status = 412, description = "If-Match no longer matches", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body over 64 KiB", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Invalid fields, each named", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn put(
    req: HttpRequest,
    state: web::Data<AppState>,
    name: web::Path<String>,
    actor: Actor,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let name = path_id(&name, PlanName::parse, "plan")?;
    let (input, mut f) = read_body::<PlanInput>(payload).await?;
    f.same_id("name", input.name, &name);
    let capacity = f.required("capacity", input.capacity);
    let rate = f.required("rate", input.rate);
    let description = f.optional("description", input.description);
    f.finish()?;
    let plan = Bucket::from_parts(capacity.expect("checked"), rate.expect("checked"));
    let rec = PlanRecord::new(
        name.clone(),
        &Limits::single(plan),
        description.map(String::from),
    );
    let cond = condition(&req, "plan", || async {
        Ok(state.store.plan(name.as_str()).await?.map(|p| p.rev))
    })
    .await?;
    let outcome = state
        .store
        .catalog_write(
            &CatalogWrite::PutPlan(rec.clone(), cond),
            &Audit::new(&actor.sub, "plan.put"),
        )
        .await?;
    match outcome {
        WriteOutcome::Written { rev, before } => {
            let status = if before.is_some() {
                actix_web::http::StatusCode::OK
            } else {
                actix_web::http::StatusCode::CREATED
            };
            Ok(one(Versioned { rev, value: rec }, status))
        }
        other => Err(super::shared::refusal(other, "plan")),
    }
}

/// Delete a plan no client uses.
#[utoipa::path(operation_id = "deletePlan", delete, path = "/admin/v1/plans/{plan}", tag = "plans",
    params(("plan" = PlanName, Path, description = "Bucket name"),
        ("If-Match" = Option<String>, Header, description = "Only if the plan is at this ETag")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, description = "No such plan", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Clients still use it", body = Problem, content_type = "application/problem+json"),
        (status = 412, description = "If-Match no longer matches", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn delete(
    req: HttpRequest,
    state: web::Data<AppState>,
    name: web::Path<String>,
    actor: Actor,
) -> Result<HttpResponse, ApiError> {
    let name = path_id(&name, PlanName::parse, "plan")?;
    let cond = condition(&req, "plan", || async {
        Ok(state.store.plan(name.as_str()).await?.map(|p| p.rev))
    })
    .await?;
    match state
        .store
        .catalog_write(
            &CatalogWrite::DeletePlan(name.clone(), cond),
            &Audit::new(&actor.sub, "plan.delete"),
        )
        .await?
    {
        WriteOutcome::Written { .. } => Ok(HttpResponse::NoContent().finish()),
        WriteOutcome::Missing if cond == Condition::Any => {
            Err(ApiError::NotFound(format!("no plan {name}")))
        }
        other => Err(super::shared::refusal(other, "plan")),
    }
}
