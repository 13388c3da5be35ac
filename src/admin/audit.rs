//! `/admin/v1/audit`: who (JWT `sub`) changed what, when, before and after.

use actix_web::{web, HttpResponse};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use crate::catalog::AuditEntry;
use crate::error::{ApiError, Problem};
use crate::state::AppState;

#[derive(Deserialize, IntoParams)]
pub struct AuditQuery {
    /// How many entries, newest first: 1-1000 (default 100).
    #[param(value_type = Option<usize>, minimum = 1, maximum = 1000)]
    limit: Option<String>,
}

#[derive(Serialize, ToSchema)]
pub struct AuditList {
    pub items: Vec<AuditEntry>,
}

/// The newest changes first. API keys appear only as hashes and ids, never in plaintext.
#[utoipa::path(operation_id = "listAudit", get, path = "/admin/v1/audit", tag = "audit", params(AuditQuery),
    responses(
        (status = 200, description = "Audit entries, newest first", body = AuditList),
        (status = 422, description = "Bad limit", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn list(
    state: web::Data<AppState>,
    q: web::Query<AuditQuery>,
) -> Result<HttpResponse, ApiError> {
    let limit = super::body::page_limit(q.limit.as_deref())?;
    Ok(HttpResponse::Ok().json(AuditList {
        items: state.store.audit.recent(limit).await?,
    }))
}
