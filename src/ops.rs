//! Operational endpoints: liveness, readiness, metrics; and [`probe`], the client the
//! `healthcheck` subcommand uses to ask a running gateway for one of them.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{bail, Context};

use actix_web::{web, HttpResponse};
use serde_json::json;

use crate::metrics::family;
use crate::state::AppState;
use crate::store::{BucketCalls, PoolState};
use crate::trace::DROP_REASONS;

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
    let reason = match tokio::time::timeout(Duration::from_secs(1), state.store.lifecycle.ping())
        .await
    {
        Ok(Ok(())) => None,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, store = %state.store.lifecycle.describe(), "not ready: the store failed");
            Some("the store failed; the gateway's log has the error")
        }
        Err(_) => {
            tracing::warn!(store = %state.store.lifecycle.describe(), "not ready: the store did not answer within 1 s");
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

/// `GET path` from the gateway listening on `listen` (`server.listen`); returns the
/// response's status code. An unspecified address (`0.0.0.0`, `[::]`) is asked on
/// loopback. For container health checks: the runtime image has no shell and no curl.
/// `timeout` bounds the connect and each read and write.
pub fn probe(listen: SocketAddr, path: &str, timeout: Duration) -> anyhow::Result<u16> {
    let mut addr = listen;
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr.ip() {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
        });
    }
    let mut stream = TcpStream::connect_timeout(&addr, timeout)
        .with_context(|| format!("cannot connect to {addr}"))?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    // One write: `write!` on the stream could send the request in pieces.
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .with_context(|| format!("cannot send to {addr}"))?;
    // Only the status line matters: read until its end (bounded), ignore the rest.
    let mut head = Vec::with_capacity(256);
    let mut buf = [0u8; 256];
    while !head.windows(2).any(|w| w == b"\r\n") && head.len() < 1024 {
        let n = stream
            .read(&mut buf)
            .with_context(|| format!("no answer from {addr}"))?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = String::from_utf8_lossy(&head);
    let line = line.lines().next().unwrap_or_default();
    match line.split_whitespace().collect::<Vec<_>>()[..] {
        [version, status, ..] if version.starts_with("HTTP/") => status
            .parse()
            .with_context(|| format!("bad status line from {addr}: {line:?}")),
        _ => bail!("not an HTTP answer from {addr}: {line:?}"),
    }
}

async fn metrics(state: web::Data<AppState>) -> HttpResponse {
    use std::fmt::Write;
    let mut out = state.metrics.render();
    let breakers = state.limiter.breakers().summary();
    let (open, opened) = (breakers.open, breakers.times_opened);
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
    state.routes.load().render_metrics(&mut out);
    let loads = state.limiter.worker_loads();
    family(
        &mut out,
        "tollgate_pending_decisions",
        "gauge",
        "Requests being decided now, over all workers (each worker sheds new ones past overload.max_pending).",
    );
    let pending: usize = loads.iter().map(|l| l.pending()).sum();
    let _ = writeln!(out, "tollgate_pending_decisions {pending}");
    family(
        &mut out,
        "tollgate_worker_delay_seconds",
        "gauge",
        "How late each worker's event loop runs a task that becomes ready, last measured (every 10 ms); past overload.max_delay_ms the worker sheds.",
    );
    for (i, l) in loads.iter().enumerate() {
        let _ = writeln!(
            out,
            "tollgate_worker_delay_seconds{{worker=\"{i}\"}} {}",
            l.delay().as_secs_f64()
        );
    }
    if let Some(tracer) = &state.traces {
        let counters = tracer.counters();
        family(
            &mut out,
            "tollgate_trace_spans_exported_total",
            "counter",
            "Spans the OTLP collector accepted.",
        );
        let exported = counters.exported.load(std::sync::atomic::Ordering::Relaxed);
        let _ = writeln!(out, "tollgate_trace_spans_exported_total {exported}");
        family(
            &mut out,
            "tollgate_trace_spans_dropped_total",
            "counter",
            "Spans not exported: the queue was full, or the collector failed or did not answer.",
        );
        for (reason, n) in DROP_REASONS.iter().zip(&counters.dropped) {
            let n = n.load(std::sync::atomic::Ordering::Relaxed);
            let _ = writeln!(
                out,
                "tollgate_trace_spans_dropped_total{{reason=\"{reason}\"}} {n}"
            );
        }
    }
    if let Some(PoolState { open: conns, idle }) = state.store.lifecycle.pool() {
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
    if let Some(BucketCalls { calls, takes }) = state.limiter.bucket_calls() {
        family(
            &mut out,
            "tollgate_store_bucket_calls_total",
            "counter",
            "Limits script calls sent to Redis for takes; one call decides the takes a worker made in one turn of its event loop, of any clients.",
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

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpListener};
    use std::time::Duration;

    use super::probe;

    /// A one-shot server that answers the first request with `response`.
    fn answer_once(response: &'static str) -> u16 {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            // The whole request first: closing on a half-read one would reset it.
            let mut request = Vec::new();
            let mut buf = [0u8; 1024];
            while !request.ends_with(b"\r\n\r\n") {
                match conn.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => request.extend_from_slice(&buf[..n]),
                }
            }
            conn.write_all(response.as_bytes()).unwrap();
        });
        port
    }

    #[test]
    fn a_probe_returns_the_status_the_server_answers() {
        let port = answer_once("HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n");
        let status = probe(
            SocketAddr::from(([127, 0, 0, 1], port)),
            "/readyz",
            Duration::from_secs(2),
        );
        assert_eq!(status.unwrap(), 503);
    }

    #[test]
    fn a_probe_of_an_unspecified_address_asks_loopback() {
        let port = answer_once("HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n");
        let status = probe(
            SocketAddr::from(([0, 0, 0, 0], port)),
            "/healthz",
            Duration::from_secs(2),
        );
        assert_eq!(status.unwrap(), 200);
    }

    #[test]
    fn a_probe_of_something_that_is_not_http_fails() {
        let port = answer_once("-ERR unknown command\r\n");
        let err = probe(
            SocketAddr::from(([127, 0, 0, 1], port)),
            "/healthz",
            Duration::from_secs(2),
        );
        assert!(err.unwrap_err().to_string().contains("not an HTTP answer"));
    }
}
