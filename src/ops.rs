//! Operational endpoints: liveness, readiness, metrics; and [`probe`], the client the
//! `healthcheck` subcommand uses to ask a running gateway for one of them.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use anyhow::{bail, Context};

use actix_web::{web, HttpResponse};
use serde_json::json;

use crate::metrics::{Exposition, Kind};
use crate::state::AppState;
use crate::store::{BucketCalls, PoolState};
use crate::trace::{ExportCounters, DROP_REASONS};

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

/// `200` when the store answers within a second and no decision met it refusing writes
/// (out of memory) in the last 10 s, else `503` with a generic reason; both
/// say which catalog the gateway serves (`store`, `cache` with its age, or `config`).
/// `/readyz` is served on the public listener, so it names no Redis host, user or error
/// text: the store's error goes to the log (a `WARN` per failed probe), for operators.
async fn readyz(state: web::Data<AppState>) -> HttpResponse {
    let reason = match tokio::time::timeout(Duration::from_secs(1), state.store.lifecycle.ping())
        .await
    {
        // It answers, but refused the decisions' writes lately: every one fails open.
        Ok(Ok(())) if state.limiter.store_refuses_writes() => {
            tracing::warn!(store = %state.store.lifecycle.describe(), "not ready: the store refuses writes (out of memory)");
            Some(crate::error::STORE_OUT_OF_MEMORY)
        }
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

/// A connection the probe reads and writes: TCP, or TLS over it.
trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

/// `GET path` from the gateway listening on `listen` (`server.listen`); returns the
/// response's status code. An unspecified address (`0.0.0.0`, `[::]`) is asked on
/// loopback. For container health checks: the runtime image has no shell and no curl.
/// `timeout` bounds the connect and each read and write. `tls`: the listener serves TLS
/// (`tls.cert_file`), and is asked over it, whatever certificate it serves.
pub fn probe(listen: SocketAddr, path: &str, timeout: Duration, tls: bool) -> anyhow::Result<u16> {
    let mut addr = listen;
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr.ip() {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
        });
    }
    let tcp = TcpStream::connect_timeout(&addr, timeout)
        .with_context(|| format!("cannot connect to {addr}"))?;
    tcp.set_read_timeout(Some(timeout))?;
    tcp.set_write_timeout(Some(timeout))?;
    let mut stream: Box<dyn ReadWrite> = if tls {
        let name = rustls::pki_types::ServerName::IpAddress(addr.ip().into());
        let conn = rustls::ClientConnection::new(crate::tls::probe_client_config(), name)
            .context("TLS client")?;
        Box::new(rustls::StreamOwned::new(conn, tcp))
    } else {
        Box::new(tcp)
    };
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

/// `/metrics`: the Prometheus text exposition, every family written by one
/// [`Exposition`]: the request path's counters ([`crate::metrics::Metrics`]), then what
/// the limiter, the routes, the exporter, the store and the catalog report.
async fn metrics(
    state: web::Data<AppState>,
    jwt: Option<web::Data<crate::admin::JwtVerifier>>,
) -> HttpResponse {
    let mut out = Exposition::new();
    state.metrics.write(&mut out);
    write_breaker(&mut out, &state);
    state.routes.load().write_metrics(&mut out);
    write_workers(&mut out, &state);
    if let Some(tracer) = &state.traces {
        write_traces(&mut out, tracer.counters());
    }
    write_store(&mut out, &state);
    write_hot(&mut out, &state);
    write_catalog(&mut out, &state);
    write_tasks(&mut out, &state);
    state.tls.write_metrics(&mut out);
    state.connections.write_metrics(&mut out);
    state.webhooks.write_metrics(&mut out);
    if let Some(jwt) = jwt {
        jwt.write_metrics(&mut out);
    }
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(out.finish())
}

fn write_breaker(out: &mut Exposition, state: &AppState) {
    let breakers = state.limiter.breakers().summary();
    let (open, opened) = (breakers.open, breakers.times_opened);
    out.family(
        "tollgate_breaker_open",
        Kind::Gauge,
        "Whether the store's circuit breaker is open (1) or closed (0).",
    )
    .sample(&[], u8::from(open));
    out.family(
        "tollgate_breaker_opened_total",
        Kind::Counter,
        "Times the circuit breaker opened.",
    )
    .sample(&[], opened);
}

fn write_workers(out: &mut Exposition, state: &AppState) {
    let loads = state.limiter.worker_loads();
    let pending: usize = loads.iter().map(|l| l.pending()).sum();
    out.family(
        "tollgate_pending_decisions",
        Kind::Gauge,
        "Requests being decided now, over all workers (each worker sheds new ones past overload.max_pending).",
    )
    .sample(&[], pending);
    let mut f = out.family(
        "tollgate_worker_delay_seconds",
        Kind::Gauge,
        "How late each worker's event loop runs a task that becomes ready, last measured (every 10 ms); past overload.max_delay_ms the worker sheds.",
    );
    for (i, l) in loads.iter().enumerate() {
        f.sample(&[("worker", &i.to_string())], l.delay().as_secs_f64());
    }
}

/// Only when export is on.
fn write_traces(out: &mut Exposition, counters: &ExportCounters) {
    out.family(
        "tollgate_trace_spans_exported_total",
        Kind::Counter,
        "Spans the OTLP collector accepted.",
    )
    .sample(&[], counters.exported.load(Relaxed));
    let mut f = out.family(
        "tollgate_trace_spans_dropped_total",
        Kind::Counter,
        "Spans not exported: the queue was full, or the collector failed or did not answer.",
    );
    for (reason, n) in DROP_REASONS.iter().zip(&counters.dropped) {
        f.sample(&[("reason", reason)], n.load(Relaxed));
    }
}

fn write_store(out: &mut Exposition, state: &AppState) {
    if let Some(PoolState { open: conns, idle }) = state.store.lifecycle.pool() {
        out.family(
            "tollgate_redis_pool_connections",
            Kind::Gauge,
            "Redis connections by state; busy near the pool size means saturation.",
        )
        .sample(&[("state", "idle")], idle)
        .sample(&[("state", "busy")], conns - idle.min(conns));
    }
    if let Some(BucketCalls { calls, takes }) = state.limiter.bucket_calls() {
        out.family(
            "tollgate_store_bucket_calls_total",
            Kind::Counter,
            "Limits script calls sent to Redis for takes; one call decides the takes a worker made in one turn of its event loop, of any clients.",
        )
        .sample(&[], calls);
        out.family(
            "tollgate_store_bucket_takes_total",
            Kind::Counter,
            "Takes those calls decided (takes / calls is the average batch).",
        )
        .sample(&[], takes);
    }
}

fn write_hot(out: &mut Exposition, state: &AppState) {
    let top = state.limiter.hot().top();
    let busiest = top.first();
    out.family(
        "tollgate_busiest_client_share",
        Kind::Gauge,
        "The busiest client's fraction of this gateway's requests over the last periods.hot_window_ms (see /admin/v1/hot for who it is).",
    )
    .sample(&[], busiest.map_or(0.0, |c| c.share));
    out.family(
        "tollgate_busiest_client_rps",
        Kind::Gauge,
        "The busiest client's estimated requests per second through this gateway.",
    )
    .sample(&[], busiest.map_or(0.0, |c| c.rps));
}

fn write_tasks(out: &mut Exposition, state: &AppState) {
    let mut f = out.family(
        "tollgate_task_restarts_total",
        Kind::Counter,
        "Times a background task was started again after it panicked or ended (see the log line naming it); one that keeps failing is a bug to report.",
    );
    for (task, n) in state.tasks.restarts() {
        f.sample(&[("task", &task)], n);
    }
}

fn write_catalog(out: &mut Exposition, state: &AppState) {
    out.family(
        "tollgate_catalog_version",
        Kind::Gauge,
        "The catalog version this gateway's copy reflects.",
    )
    .sample(&[], state.catalog.version());
    let source = state.catalog.source();
    let mut f = out.family(
        "tollgate_catalog_source",
        Kind::Gauge,
        "Which catalog this gateway serves (1): the store's, the cache file's (the store has not answered since start), or only the configuration's.",
    );
    for s in ["store", "cache", "config"] {
        f.sample(&[("source", s)], u8::from(source.label() == s));
    }
    out.family(
        "tollgate_catalog_clients",
        Kind::Gauge,
        "Clients this gateway holds in memory: all of them (catalog.mode = \"mirror\"), or the ones in use (\"cache\", at most catalog.cached_clients).",
    )
    .sample(&[], state.catalog.len());
    if let Some(counts) = state.catalog.cache_counts() {
        out.family(
            "tollgate_catalog_unknown_keys",
            Kind::Gauge,
            "Keys this gateway remembers as belonging to no client (cache mode), at most catalog.unknown_keys.",
        )
        .sample(&[], counts.unknown_keys);
        let mut f = out.family(
            "tollgate_catalog_lookups_total",
            Kind::Counter,
            "Keys not held looked up in the store (cache mode), by what was found: a client (then held), no client (then remembered as unknown), or no answer in catalog.lookup_timeout_ms (the request answered 503).",
        );
        f.sample(&[("result", "client")], counts.found);
        f.sample(&[("result", "unknown")], counts.unknown);
        f.sample(&[("result", "failed")], counts.failed);
        out.family(
            "tollgate_catalog_keys_filtered_total",
            Kind::Counter,
            "Keys refused without a store read because the key filter (cache mode) says no client has them.",
        )
        .sample(&[], counts.filtered);
        out.family(
            "tollgate_catalog_key_filter_bytes",
            Kind::Gauge,
            "The size of this gateway's copy of the store's key filter once it is trusted (cache mode; 0: none yet, every key not held is read).",
        )
        .sample(&[], counts.filter_bytes);
        let (buckets, sum, count) = &counts.lookup_seconds;
        out.family(
            "tollgate_catalog_lookup_seconds",
            Kind::Histogram,
            "How long a store read of a key not held took (cache mode), from its start to its answer, or to its failure at catalog.lookup_timeout_ms; one per key, however many requests waited on it.",
        )
        .histogram(&[], &crate::catalog::LOOKUP_BUCKETS, buckets, *sum, *count);
    }
    if let crate::catalog::Source::Cache { saved_at_ms } = source {
        let age = crate::catalog::cache::now_ms().saturating_sub(saved_at_ms) as f64 / 1000.0;
        out.family(
            "tollgate_catalog_cache_age_seconds",
            Kind::Gauge,
            "How old the cache file being served is.",
        )
        .sample(&[], age);
    }
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
            false,
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
            false,
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
            false,
        );
        assert!(err.unwrap_err().to_string().contains("not an HTTP answer"));
    }
}
