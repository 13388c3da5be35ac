//! The OTLP/HTTP JSON exporter: spans go into a bounded queue without waiting (a full queue
//! drops the span and counts it), and one background task posts them to the collector's
//! `/v1/traces` in batches. A request never waits for the collector.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use super::span::{export_request, SpanRecord};
use crate::domain::Upstream;

/// Spans waiting to be posted; past this, new spans are dropped.
pub const QUEUE: usize = 4096;
/// The most spans in one post.
const BATCH: usize = 512;
/// How long the first span of a batch waits for others before the batch is posted.
const LINGER: Duration = Duration::from_millis(200);
/// The longest a post may take (connect, send, status line); a batch past it is dropped.
const POST_TIMEOUT: Duration = Duration::from_secs(2);

/// The `reason` label of `tollgate_trace_spans_dropped_total`.
pub const DROP_REASONS: [&str; 2] = ["queue_full", "export_failed"];

/// What the exporter has done, for `/metrics`.
#[derive(Default)]
pub struct ExportCounters {
    pub exported: AtomicU64,
    /// By [`DROP_REASONS`].
    pub dropped: [AtomicU64; 2],
}

/// Where spans go: cheap to clone (a channel sender and counters).
#[derive(Clone)]
pub struct Tracer {
    tx: mpsc::Sender<SpanRecord>,
    counters: Arc<ExportCounters>,
}

impl Tracer {
    /// Starts the exporter posting to `endpoint`'s `/v1/traces`, on a thread of its own
    /// below the request path's priority (nice 10): encoding and posting a batch of 512
    /// spans takes milliseconds of CPU, which on a busy host would otherwise delay the
    /// requests whose turn it takes (measured: +3.5 ms at p99 when it ran beside them). It
    /// ends when the last `Tracer` is dropped.
    pub fn start(endpoint: &Upstream) -> Tracer {
        let (tx, rx) = mpsc::channel(QUEUE);
        let counters = Arc::new(ExportCounters::default());
        let authority = endpoint.base().trim_start_matches("http://").to_string();
        let exporting = Arc::clone(&counters);
        let started = std::thread::Builder::new()
            .name("otlp-export".into())
            .spawn(move || {
                // SAFETY: setpriority only reads its arguments; 0 is the calling thread.
                let niced = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 10) };
                if niced != 0 {
                    tracing::debug!("the span exporter runs at the request path's priority");
                }
                match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt.block_on(run(rx, authority, exporting)),
                    Err(e) => tracing::error!(error = %e, "the span exporter could not start"),
                }
            });
        if let Err(e) = started {
            tracing::error!(error = %e, "the span exporter could not start");
        }
        Tracer { tx, counters }
    }

    /// Queues a finished span; never waits.
    pub fn record(&self, span: SpanRecord) {
        if self.tx.try_send(span).is_err() {
            self.counters.dropped[0].fetch_add(1, Relaxed);
        }
    }

    pub fn counters(&self) -> &ExportCounters {
        &self.counters
    }
}

async fn run(mut rx: mpsc::Receiver<SpanRecord>, authority: String, counters: Arc<ExportCounters>) {
    let mut batch = Vec::with_capacity(BATCH);
    while let Some(first) = rx.recv().await {
        batch.push(first);
        let linger = tokio::time::sleep(LINGER);
        tokio::pin!(linger);
        while batch.len() < BATCH {
            tokio::select! {
                span = rx.recv() => match span {
                    Some(span) => batch.push(span),
                    None => break,
                },
                _ = &mut linger => break,
            }
        }
        let n = batch.len() as u64;
        let body = export_request(&batch);
        batch.clear();
        match tokio::time::timeout(POST_TIMEOUT, post(&authority, &body)).await {
            Ok(Ok(())) => {
                counters.exported.fetch_add(n, Relaxed);
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, spans = n, "trace export failed; spans dropped");
                counters.dropped[1].fetch_add(n, Relaxed);
            }
            Err(_) => {
                tracing::debug!(spans = n, "trace export timed out; spans dropped");
                counters.dropped[1].fetch_add(n, Relaxed);
            }
        }
    }
}

/// One `POST /v1/traces` over a new connection: HTTP/1.1, `Connection: close`; a 2xx
/// status line is success (the body is not read).
async fn post(authority: &str, body: &[u8]) -> anyhow::Result<()> {
    let address = if authority.contains(':') && !authority.ends_with(']') {
        authority.to_string()
    } else {
        format!("{authority}:80")
    };
    let mut stream = tokio::net::TcpStream::connect(&address)
        .await
        .with_context(|| format!("connecting to {address}"))?;
    let head = format!(
        "POST /v1/traces HTTP/1.1\r\nHost: {authority}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body).await?;
    let mut head = Vec::with_capacity(64);
    let mut buf = [0u8; 256];
    while !head.contains(&b'\n') && head.len() < 4096 {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = String::from_utf8_lossy(&head);
    let status = line.split_whitespace().nth(1).unwrap_or_default();
    if !status.starts_with('2') || status.len() != 3 {
        bail!(
            "the collector answered {:?}",
            line.lines().next().unwrap_or_default()
        );
    }
    Ok(())
}
