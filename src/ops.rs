//! Operational endpoints: liveness, readiness, metrics.

use std::time::Duration;

use actix_web::{web, HttpResponse};
use serde_json::json;

use crate::metrics::family;
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

/// `200` when the store answers within a second, else `503` with a generic reason; both
/// say which catalog the gateway serves (`store`, `cache` with its age, or `config`).
/// `/readyz` is served on the public listener, so it names no Redis host, user or error
/// text: the store's error goes to the log (a `WARN` per failed probe), for operators.
async fn readyz(state: web::Data<AppState>) -> HttpResponse {
    let reason = match tokio::time::timeout(Duration::from_secs(1), state.store.ping()).await {
        Ok(Ok(())) => None,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, store = %state.store.describe(), "not ready: the store failed");
            Some("the store failed; the gateway's log has the error")
        }
        Err(_) => {
            tracing::warn!(store = %state.store.describe(), "not ready: the store did not answer within 1 s");
            Some("the store did not answer within 1 s")
        }
    };
    let source = state.catalog.source();
    let mut body = match reason {
        None => json!({"status": "ready"}),
        Some(reason) => json!({"status": "unavailable", "reason": reason}),
    };
    body["catalog"] = source.label().into();
    if let crate::catalog::Source::Cache { saved_at_ms } = source {
        body["catalog_age_s"] =
            (crate::catalog::cache::now_ms().saturating_sub(saved_at_ms) / 1000).into();
    }
    match reason {
        None => HttpResponse::Ok().json(body),
        Some(_) => HttpResponse::ServiceUnavailable().json(body),
    }
}

async fn metrics(state: web::Data<AppState>) -> HttpResponse {
    use std::fmt::Write;
    let mut out = state.metrics.render();
    let (open, opened) = state.limiter.breakers().summary();
    family(
        &mut out,
        "tollgate_breaker_open",
        "gauge",
        "Whether the store's circuit breaker is open (1) or closed (0).",
    );
    let _ = writeln!(out, "tollgate_breaker_open {}", open as u8);
    family(
        &mut out,
        "tollgate_breaker_opened_total",
        "counter",
        "Times the circuit breaker opened.",
    );
    let _ = writeln!(out, "tollgate_breaker_opened_total {opened}");
    if let Some((conns, idle)) = match &state.store {
        Store::Redis(r) => r.pool_state(),
        Store::Embedded(_) => None,
    } {
        family(
            &mut out,
            "tollgate_redis_pool_connections",
            "gauge",
            "Redis connections by state; busy near the pool size means saturation.",
        );
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
    if let Some((calls, takes)) = state.limiter.bucket_calls() {
        family(
            &mut out,
            "tollgate_store_bucket_calls_total",
            "counter",
            "Bucket script calls sent to Redis; one call decides every take for a bucket queued behind the previous call.",
        );
        let _ = writeln!(out, "tollgate_store_bucket_calls_total {calls}");
        family(
            &mut out,
            "tollgate_store_bucket_takes_total",
            "counter",
            "Takes those calls decided (takes / calls is the average batch).",
        );
        let _ = writeln!(out, "tollgate_store_bucket_takes_total {takes}");
    }
    let top = state.limiter.hot().top();
    family(&mut out, "tollgate_busiest_client_share", "gauge", "The busiest client's fraction of this gateway's requests over the last 10 s (see /admin/v1/hot for who it is).");
    let _ = writeln!(
        out,
        "tollgate_busiest_client_share {}",
        top.first().map_or(0.0, |c| c.share)
    );
    family(
        &mut out,
        "tollgate_busiest_client_rps",
        "gauge",
        "The busiest client's estimated requests per second through this gateway.",
    );
    let _ = writeln!(
        out,
        "tollgate_busiest_client_rps {}",
        top.first().map_or(0.0, |c| c.rps)
    );
    family(
        &mut out,
        "tollgate_catalog_version",
        "gauge",
        "The catalog version this gateway's copy reflects.",
    );
    let _ = writeln!(out, "tollgate_catalog_version {}", state.catalog.version());
    let source = state.catalog.source();
    family(
        &mut out,
        "tollgate_catalog_source",
        "gauge",
        "Which catalog this gateway serves (1): the store's, the cache file's (the store has not answered since start), or only the configuration's.",
    );
    for s in ["store", "cache", "config"] {
        let _ = writeln!(
            out,
            "tollgate_catalog_source{{source=\"{s}\"}} {}",
            u8::from(source.label() == s)
        );
    }
    if let crate::catalog::Source::Cache { saved_at_ms } = source {
        family(
            &mut out,
            "tollgate_catalog_cache_age_seconds",
            "gauge",
            "How old the cache file being served is.",
        );
        let age = crate::catalog::cache::now_ms().saturating_sub(saved_at_ms) as f64 / 1000.0;
        let _ = writeln!(out, "tollgate_catalog_cache_age_seconds {age}");
    }
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(out)
}
