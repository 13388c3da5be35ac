//! The admin API for the account team (`/admin/v1`, Bearer JWT), its OpenAPI document and
//! Swagger UI. Reads go to the store (read-your-writes on any gateway); writes are single
//! atomic catalog scripts that every gateway's mirror picks up within `refresh_ms`.

mod audit;
pub mod auth;
mod body;
mod clients;
mod hot;
mod plans;
mod safety;
mod shadow;

use std::future::Future;

use actix_web::dev::Payload;
use actix_web::middleware::from_fn;
use actix_web::{web, FromRequest, HttpMessage, HttpRequest};
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::{Modify, OpenApi};
use utoipa_swagger_ui::SwaggerUi;

pub use auth::{Actor, JwtVerifier};

use crate::catalog::{Condition, WriteOutcome};
use crate::error::ApiError;

/// Registers `/admin/v1/...`, `/api-docs/openapi.json` and `/swagger-ui/`.
pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.service(
        web::scope("/admin/v1")
            .wrap(from_fn(auth::require_token))
            .route("/plans", web::get().to(plans::list))
            .route("/plans/{plan}", web::get().to(plans::get))
            .route("/plans/{plan}", web::put().to(plans::put))
            .route("/plans/{plan}", web::delete().to(plans::delete))
            .route("/clients", web::get().to(clients::list))
            .route("/clients/{client}", web::get().to(clients::get))
            .route("/clients/{client}", web::put().to(clients::put))
            .route("/clients/{client}", web::delete().to(clients::delete))
            .route(
                "/clients/{client}/keys",
                web::post().to(clients::create_key),
            )
            .route(
                "/clients/{client}/keys/{key_id}",
                web::delete().to(clients::revoke_key),
            )
            .route("/clients/{client}/bucket", web::get().to(clients::bucket))
            .route(
                "/clients/{client}/bucket",
                web::delete().to(clients::refill),
            )
            .route("/safety", web::get().to(safety::get))
            .route("/safety", web::put().to(safety::put))
            .route("/hot", web::get().to(hot::hot))
            .route("/shadow", web::get().to(shadow::get))
            .route("/shadow", web::delete().to(shadow::reset))
            .route("/audit", web::get().to(audit::list))
            .default_service(web::to(|| async {
                Err::<actix_web::HttpResponse, _>(ApiError::NotFound(
                    "no such admin resource".into(),
                ))
            })),
    )
    .service(SwaggerUi::new("/swagger-ui/{_:.*}").url("/api-docs/openapi.json", ApiDoc::openapi()));
}

/// The OpenAPI document, collected from the handlers' annotations.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "tollgate admin API",
        description = "Plans, clients, API keys, safety limits and the audit log of the tollgate gateway. \
            Every call needs `Authorization: Bearer <JWT>`: `admin:read` for GET, `admin:write` for the rest. \
            Every error is `application/problem+json`.",
        license(name = "MIT")
    ),
    paths(
        plans::list, plans::get, plans::put, plans::delete,
        clients::list, clients::get, clients::put, clients::delete,
        clients::create_key, clients::revoke_key, clients::bucket, clients::refill,
        safety::get, safety::put,
        shadow::get, shadow::reset, hot::hot,
        audit::list,
    ),
    components(schemas(crate::error::Problem, crate::error::FieldError)),
    modifiers(&BearerAuth),
    tags(
        (name = "plans", description = "What each plan allows"),
        (name = "clients", description = "Clients, their plans, keys and buckets"),
        (name = "safety", description = "Coarse per-service safety limits"),
        (name = "shadow", description = "Shadow-mode agreement with the services' own limiters"),
        (name = "audit", description = "Who changed what"),
    )
)]
pub struct ApiDoc;

/// Adds the Bearer scheme once, for every path's `security(("bearer" = []))`.
struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        let mut http = Http::new(HttpAuthScheme::Bearer);
        http.bearer_format = Some("JWT".to_string());
        components.add_security_scheme("bearer", SecurityScheme::Http(http));
    }
}

/// The OpenAPI document as `tollgate openapi` prints it (and `openapi/openapi.json` holds).
pub fn openapi_json() -> String {
    let mut s = ApiDoc::openapi()
        .to_pretty_json()
        .expect("the OpenAPI document serializes");
    s.push('\n');
    s
}

impl FromRequest for Actor {
    type Error = ApiError;
    type Future = std::future::Ready<Result<Actor, ApiError>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        std::future::ready(
            req.extensions()
                .get::<Actor>()
                .cloned()
                .ok_or_else(|| ApiError::InvalidToken("no authenticated caller".into())),
        )
    }
}

/// Unix milliseconds on this gateway's clock (for audit entries outside the catalog).
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Parses an id from the path, as a `422` naming it when it is not a valid id.
fn path_id<T, E: std::fmt::Display>(
    raw: &str,
    parse: impl Fn(&str) -> Result<T, E>,
    field: &str,
) -> Result<T, ApiError> {
    parse(raw).map_err(|e| ApiError::field(field, e.to_string()))
}

/// The write condition from `If-Match`; `*` needs the current revision.
async fn condition<F, Fut>(req: &HttpRequest, current: F) -> Result<Condition, ApiError>
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<Option<u64>, ApiError>>,
{
    match body::if_match(req.headers())? {
        None => Ok(Condition::Any),
        Some(Some(rev)) => Ok(Condition::Rev(rev)),
        Some(None) => match current().await? {
            Some(rev) => Ok(Condition::Rev(rev)),
            None => Err(ApiError::PreconditionFailed(
                "If-Match: * but the resource does not exist".into(),
            )),
        },
    }
}

/// The error for a write the store refused.
fn refusal(outcome: WriteOutcome, what: &str) -> ApiError {
    match outcome {
        WriteOutcome::Stale { current } => ApiError::PreconditionFailed(format!(
            "the {what} changed: it is at ETag \"{current}\" now"
        )),
        WriteOutcome::Missing => {
            ApiError::PreconditionFailed(format!("the {what} does not exist (If-Match)"))
        }
        WriteOutcome::Exists => ApiError::Conflict(format!("the {what} exists already")),
        WriteOutcome::UnknownPlan => ApiError::field("plan", "no such plan"),
        WriteOutcome::PlanInUse => {
            ApiError::Conflict("clients still use this plan: move them to another first".into())
        }
        WriteOutcome::KeyConflict => {
            ApiError::Conflict("that API key already belongs to another client".into())
        }
        WriteOutcome::Written { .. } => {
            ApiError::Internal(anyhow::anyhow!("a written {what} reported as refused"))
        }
    }
}
