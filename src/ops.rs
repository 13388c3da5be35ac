//! Operational endpoints: liveness, readiness, metrics.

use std::time::Duration;

use actix_web::{web, HttpResponse};
use serde_json::json;

use crate::state::AppState;

pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route("/healthz", web::get().to(healthz))
        .route("/readyz", web::get().to(readyz));
}

/// Where `/metrics` is served (the main listener, or `admin_listen` when set).
pub fn configure_metrics(cfg: &mut web::ServiceConfig) {
    cfg.route("/metrics", web::get().to(metrics));
}

/// `200` while the process runs.
async fn healthz() -> HttpResponse {
    HttpResponse::Ok().json(json!({"status": "ok"}))
}

/// `200` when the store answers within a second, else `503` with the reason.
async fn readyz(state: web::Data<AppState>) -> HttpResponse {
    let reason = match tokio::time::timeout(Duration::from_secs(1), state.store.ping()).await {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e.to_string()),
        Err(_) => Some("the store did not answer within 1 s".to_string()),
    };
    match reason {
        None => HttpResponse::Ok().json(json!({
            "status": "ready",
            "store": state.store.describe(),
            "catalog_version": state.catalog.version(),
        })),
        Some(reason) => HttpResponse::ServiceUnavailable().json(json!({
            "status": "unavailable",
            "store": state.store.describe(),
            "reason": reason,
        })),
    }
}

async fn metrics(state: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(state.metrics.render())
}
