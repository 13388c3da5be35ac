//! `/admin/v1/safety`: the coarse per-(client, service) limits kept while failing open.

use std::collections::BTreeMap;

use actix_web::http::header;
use actix_web::{web, HttpRequest, HttpResponse};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::body::{etag, read_body, Field, Fields};
use super::shared::{condition, refusal};
use super::Actor;
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

/// A safety multiplier: 1-1000.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(try_from = "f64")]
struct Multiplier(f64);

impl TryFrom<f64> for Multiplier {
    type Error = &'static str;
    fn try_from(m: f64) -> Result<Multiplier, &'static str> {
        if m.is_finite() && (1.0..=1000.0).contains(&m) {
            Ok(Multiplier(m))
        } else {
            Err("must be between 1 and 1000")
        }
    }
}

/// The body of `PUT /admin/v1/safety`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SafetyInput {
    /// The default multiplier of a client's plan, 1-1000.
    #[serde(default)]
    #[schema(value_type = f64, required = true, minimum = 1, maximum = 1000, example = 10.0)]
    multiplier: Field<Multiplier>,
    /// Per service (1-64 characters of `A-Z a-z 0-9 - _ .`): its own multiplier, 1-1000.
    #[serde(default)]
    #[schema(schema_with = services_schema)]
    services: Field<BTreeMap<String, Value>>,
}

fn services_schema() -> utoipa::openapi::schema::Object {
    use utoipa::openapi::schema::{ObjectBuilder, SchemaType, Type};
    ObjectBuilder::new()
        .schema_type(SchemaType::from_iter([Type::Object, Type::Null]))
        .property_names(Some(
            ObjectBuilder::new()
                .schema_type(SchemaType::Type(Type::String))
                .min_length(Some(1))
                .max_length(Some(64))
                .pattern(Some(crate::domain::ID_PATTERN))
                .build(),
        ))
        .additional_properties(Some(
            ObjectBuilder::new()
                .schema_type(SchemaType::Type(Type::Number))
                .minimum(Some(1.0))
                .maximum(Some(1000.0)),
        ))
        .examples([serde_json::json!({"orders": 20.0})])
        .build()
}

fn service_name_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

/// The safety settings a body gives, every problem named in `f`.
pub(super) fn safety_record(input: SafetyInput, f: &mut Fields) -> Option<SafetyRecord> {
    let multiplier = f.required("multiplier", input.multiplier);
    let mut services = BTreeMap::new();
    // Each service is its own field, so every bad one is named.
    for (name, v) in f.optional("services", input.services).unwrap_or_default() {
        let field = format!("services.{name}");
        if !service_name_ok(&name) {
            f.bad(
                &field,
                "service names are 1-64 characters of A-Z a-z 0-9 - _ .",
            );
        } else if let Some(m) = f.required(
            &field,
            serde_json::from_value::<Field<Multiplier>>(v)
                .unwrap_or_else(|e| Field::Invalid(e.to_string())),
        ) {
            services.insert(name, m.0);
        }
    }
    Some(SafetyRecord {
        multiplier: multiplier?.0,
        services,
    })
}

/// Read the safety limits (the configured `limits.safety_multiplier` until set here).
#[utoipa::path(operation_id = "getSafety", get, path = "/admin/v1/safety", tag = "safety",
    responses((status = 200, description = "The safety limits", body = SafetyView)),
    security(("bearer" = [])))]
pub async fn get(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    Ok(match state.store.catalog.safety().await? {
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
    request_body(content = SafetyInput, content_type = "application/json"),
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
    let (input, mut f) = read_body::<SafetyInput>(payload).await?;
    let rec = safety_record(input, &mut f);
    f.finish()?;
    let rec = rec.expect("checked");
    let cond = condition(&req, "safety settings", || async {
        Ok(state.store.catalog.safety().await?.map(|s| s.rev))
    })
    .await?;
    match state
        .store
        .catalog
        .write(
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
