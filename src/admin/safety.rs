//! `/admin/v1/safety`: the coarse per-(client, service) limits kept while failing open.

use std::collections::BTreeMap;

use actix_web::http::header;
use actix_web::{web, HttpRequest, HttpResponse};
use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;

use super::body::{etag, read_object, Fields};
use super::{condition, refusal, Actor};
use crate::catalog::{Audit, CatalogWrite, SafetyRecord, WriteOutcome};
use crate::error::{ApiError, Problem};
use crate::state::AppState;

/// Safety limits: each (client, service) may use `multiplier` x the client's plan, or the
/// service's own multiplier.
#[derive(Serialize, ToSchema)]
pub struct SafetyView {
    #[schema(example = 10.0)]
    pub multiplier: f64,
    #[schema(example = json!({"orders": 20.0}))]
    pub services: BTreeMap<String, f64>,
}

fn check_multiplier(f: &mut Fields, field: &str, v: Option<&Value>) -> Option<f64> {
    match v.and_then(Value::as_f64) {
        Some(m) if m.is_finite() && (1.0..=1000.0).contains(&m) => Some(m),
        Some(_) => {
            f.bad(field, "must be between 1 and 1000");
            None
        }
        None => {
            f.bad(
                field,
                if v.is_none() {
                    "is required"
                } else {
                    "must be a number"
                },
            );
            None
        }
    }
}

/// Read the safety limits (the configured `limits.safety_multiplier` until set here).
#[utoipa::path(operation_id = "getSafety", get, path = "/admin/v1/safety", tag = "safety",
    responses((status = 200, description = "The safety limits", body = SafetyView)),
    security(("bearer" = [])))]
pub async fn get(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    Ok(match state.store.safety().await? {
        Some(rec) => HttpResponse::Ok()
            .insert_header((header::ETAG, etag(rec.rev)))
            .json(SafetyView {
                multiplier: rec.value.multiplier,
                services: rec.value.services,
            }),
        None => HttpResponse::Ok().json(SafetyView {
            multiplier: state.safety_multiplier,
            services: BTreeMap::new(),
        }),
    })
}

/// Replace the safety limits. Live on every gateway within `catalog.refresh_ms`.
#[utoipa::path(operation_id = "putSafety", put, path = "/admin/v1/safety", tag = "safety",
    params(("If-Match" = Option<String>, Header, description = "Only if the settings are at this ETag")),
    request_body(content = SafetyView, content_type = "application/json"),
    responses(
        (status = 200, description = "Stored", body = SafetyView),
        (status = 412, description = "If-Match no longer matches", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Invalid fields, each named", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn put(
    req: HttpRequest,
    state: web::Data<AppState>,
    actor: Actor,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let obj = read_object(payload).await?;
    let mut f = Fields::default();
    f.only(&obj, &["multiplier", "services"], &[]);
    let multiplier = check_multiplier(&mut f, "multiplier", obj.get("multiplier"));
    let mut services = BTreeMap::new();
    match obj.get("services") {
        None | Some(Value::Null) => {}
        Some(Value::Object(m)) => {
            for (name, v) in m {
                let field = format!("services.{name}");
                let ok_name = !name.is_empty()
                    && name.len() <= 64
                    && name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
                if !ok_name {
                    f.bad(
                        &field,
                        "service names are 1-64 characters of A-Z a-z 0-9 - _ .",
                    );
                } else if let Some(m) = check_multiplier(&mut f, &field, Some(v)) {
                    services.insert(name.clone(), m);
                }
            }
        }
        Some(_) => f.bad(
            "services",
            "must be an object of service name to multiplier",
        ),
    }
    f.finish()?;
    let rec = SafetyRecord {
        multiplier: multiplier.expect("checked"),
        services,
    };
    let cond = condition(&req, || async {
        Ok(state.store.safety().await?.map(|s| s.rev))
    })
    .await?;
    match state
        .store
        .catalog_write(
            &CatalogWrite::PutSafety(rec.clone(), cond),
            &Audit::new(&actor.sub, "safety.put"),
        )
        .await?
    {
        WriteOutcome::Written { rev, .. } => Ok(HttpResponse::Ok()
            .insert_header((header::ETAG, etag(rev)))
            .json(SafetyView {
                multiplier: rec.multiplier,
                services: rec.services,
            })),
        other => Err(refusal(other, "safety settings")),
    }
}
