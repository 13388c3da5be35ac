//! `/admin/v1/shadow`: how often the gateway's decisions disagree with the services' own
//! limiters, summed over every gateway sharing the store. The rollout's exit criterion is
//! under 0.1% disagreement.

use actix_web::{web, HttpResponse};
use serde::Serialize;
use utoipa::ToSchema;

use super::Actor;
use crate::catalog::AuditEntry;
use crate::error::{ApiError, Problem};
use crate::state::AppState;

/// The exit criterion: enforce once disagreement is below this.
pub const EXIT_RATE: f64 = 0.001;
/// The report lists at most this many clients, most disagreeing first.
const MAX_CLIENTS: usize = 1000;

#[derive(Serialize, ToSchema)]
pub struct ShadowClient {
    pub id: String,
    pub compared: u64,
    pub disagreements: u64,
    pub rate: f64,
}

/// Shadow-mode agreement between the gateway and the services.
#[derive(Serialize, ToSchema)]
pub struct ShadowReport {
    /// Requests of shadow-mode clients whose gateway decision was compared with the
    /// service's answer (a `429` from the service means its own limiter refused).
    pub compared: u64,
    pub disagreements: u64,
    /// `disagreements / compared` (0 when nothing was compared).
    pub rate: f64,
    /// Something was compared and `rate < 0.001`.
    pub ready_to_enforce: bool,
    /// Per client, the most disagreeing first (at most 1000).
    pub clients: Vec<ShadowClient>,
}

fn rate(compared: u64, disagreements: u64) -> f64 {
    if compared == 0 {
        0.0
    } else {
        disagreements as f64 / compared as f64
    }
}

/// The shadow-mode disagreement report, over all gateways.
#[utoipa::path(operation_id = "getShadow", get, path = "/admin/v1/shadow", tag = "shadow",
    responses(
        (status = 200, description = "Agreement so far", body = ShadowReport),
        (status = 503, description = "The store is unavailable", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn get(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let counts = state.store.shadow.counts().await?;
    let compared: u64 = counts.iter().map(|c| c.compared).sum();
    let disagreements: u64 = counts.iter().map(|c| c.disagreed).sum();
    let mut clients: Vec<ShadowClient> = counts
        .into_iter()
        .map(|c| ShadowClient {
            rate: rate(c.compared, c.disagreed),
            id: c.client,
            compared: c.compared,
            disagreements: c.disagreed,
        })
        .collect();
    clients.sort_by(|a, b| {
        b.disagreements
            .cmp(&a.disagreements)
            .then_with(|| a.id.cmp(&b.id))
    });
    clients.truncate(MAX_CLIENTS);
    let r = rate(compared, disagreements);
    Ok(HttpResponse::Ok().json(ShadowReport {
        compared,
        disagreements,
        rate: r,
        ready_to_enforce: compared > 0 && r < EXIT_RATE,
        clients,
    }))
}

/// Start counting afresh (e.g. after fixing a plan).
#[utoipa::path(operation_id = "resetShadow", delete, path = "/admin/v1/shadow", tag = "shadow",
    responses((status = 204, description = "Counters reset")),
    security(("bearer" = [])))]
pub async fn reset(state: web::Data<AppState>, actor: Actor) -> Result<HttpResponse, ApiError> {
    state.store.shadow.reset().await?;
    state
        .store
        .audit
        .record(AuditEntry {
            at_ms: super::shared::now_ms(),
            actor: actor.sub,
            action: "shadow.reset".into(),
            kind: "shadow".into(),
            id: String::new(),
            rev: 0,
            before: None,
            after: None,
        })
        .await?;
    Ok(HttpResponse::NoContent().finish())
}
