//! Operational endpoints: liveness, readiness, metrics.

use std::time::Duration;

use actix_web::{web, HttpResponse};
use serde_json::json;

use crate::state::AppState;
use crate::store::Store;

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
    use std::fmt::Write;
    let mut out = state.metrics.render();
    let (open, opened) = state.limiter.breakers().summary();
    let _ = writeln!(out, "# HELP tollgate_breaker_open Whether the store's circuit breaker is open (1) or closed (0).");
    let _ = writeln!(out, "# TYPE tollgate_breaker_open gauge");
    let _ = writeln!(out, "tollgate_breaker_open {}", open as u8);
    let _ = writeln!(
        out,
        "# HELP tollgate_breaker_opened_total Times the circuit breaker opened."
    );
    let _ = writeln!(out, "# TYPE tollgate_breaker_opened_total counter");
    let _ = writeln!(out, "tollgate_breaker_opened_total {opened}");
    if let Some((conns, idle)) = match &state.store {
        Store::Redis(r) => r.pool_state(),
        Store::Embedded(_) => None,
    } {
        let _ = writeln!(out, "# HELP tollgate_redis_pool_connections Redis connections by state; busy near the pool size means saturation.");
        let _ = writeln!(out, "# TYPE tollgate_redis_pool_connections gauge");
        let _ = writeln!(
            out,
            "tollgate_redis_pool_connections{{state=\"idle\"}} {idle}"
        );
        let _ = writeln!(
            out,
            "tollgate_redis_pool_connections{{state=\"busy\"}} {}",
            conns - idle.min(conns)
        );
    }
    let top = state.limiter.hot().top();
    let _ = writeln!(out, "# HELP tollgate_busiest_client_share The busiest client's fraction of this gateway's requests over the last 10 s (see /admin/v1/hot for who it is).");
    let _ = writeln!(out, "# TYPE tollgate_busiest_client_share gauge");
    let _ = writeln!(
        out,
        "tollgate_busiest_client_share {}",
        top.first().map_or(0.0, |c| c.share)
    );
    let _ = writeln!(out, "# HELP tollgate_busiest_client_rps The busiest client's estimated requests per second through this gateway.");
    let _ = writeln!(out, "# TYPE tollgate_busiest_client_rps gauge");
    let _ = writeln!(
        out,
        "tollgate_busiest_client_rps {}",
        top.first().map_or(0.0, |c| c.rps)
    );
    let _ = writeln!(
        out,
        "# HELP tollgate_catalog_version The catalog version this gateway's copy reflects."
    );
    let _ = writeln!(out, "# TYPE tollgate_catalog_version gauge");
    let _ = writeln!(out, "tollgate_catalog_version {}", state.catalog.version());
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(out)
}
