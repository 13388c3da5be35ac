//! The span exporter: spans go into a bounded queue without waiting (a full queue drops the
//! span and counts it), and one thread of its own, below the request path's priority, takes
//! them in batches and hands each batch to `opentelemetry-otlp`'s exporter ([`super::otlp`]:
//! TLS, headers, gzip and retries are the crate's). A request never waits for the collector.
//!
//! The request path records [`SpanRecord`]s rather than spans of the OpenTelemetry SDK:
//! recording one request's three spans and queueing them takes 4.2k instructions (0.69 µs)
//! this way and 8.6k (3.0 µs) through the SDK's span API and `BatchSpanProcessor`
//! (`benches/span_export.rs`, the book's "Tracing"), and the SDK's processor neither reports its
//! drops nor runs below the request path's priority. The SDK's span form
//! ([`SpanRecord::into_span_data`]) is built here, on the export thread.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use opentelemetry::InstrumentationScope;
use opentelemetry_sdk::trace::SpanExporter;
use tokio::sync::{mpsc, Mutex};

use super::span::SpanRecord;
use crate::tasks::{Policy, Tasks};

/// Spans waiting to be exported; past this, new spans are dropped.
pub const QUEUE: usize = 4096;
/// The most spans in one export.
const BATCH: usize = 512;
/// How long the first span of a batch waits for others before the batch is exported.
const LINGER: Duration = Duration::from_millis(200);

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
    /// Starts exporting through `exporter` (the OTLP one, [`super::exporter`]; the
    /// benchmarks pass one that discards), on a thread of its own below the request
    /// path's priority (nice 10): converting, encoding and posting a batch of 512 spans
    /// takes milliseconds of CPU, which on a busy host would otherwise delay the requests
    /// whose turn it takes (measured: +3.5 ms at p99 when it ran beside them). The thread
    /// is the task `span-export` under `tasks`: started again if it panics (the queue is
    /// kept, so a restart loses only the batch in hand), stopped at shutdown, and ended
    /// when the last `Tracer` is dropped.
    pub fn start(exporter: impl SpanExporter + 'static, tasks: &Tasks) -> Tracer {
        let (tx, rx) = mpsc::channel(QUEUE);
        let counters = Arc::new(ExportCounters::default());
        let exporting = Arc::clone(&counters);
        let exporter = Arc::new(exporter);
        // Held by the running export; a restarted one takes it again (a panic unlocks it:
        // the guard is dropped as the thread unwinds).
        let rx = Arc::new(Mutex::new(rx));
        tasks.spawn_thread("span-export", Policy::UntilDone, move |stop| {
            // SAFETY: setpriority only reads its arguments; 0 is the calling thread.
            let niced = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 10) };
            if niced != 0 {
                tracing::debug!("the span exporter runs at the request path's priority");
            }
            match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt.block_on(async {
                    let mut rx = rx.lock().await;
                    tokio::select! {
                        () = run(&mut rx, &*exporter, &exporting) => {}
                        () = stop.cancelled() => {}
                    }
                }),
                Err(e) => tracing::error!(error = %e, "the span exporter could not start"),
            }
        });
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

/// Exports the queue in batches until every [`Tracer`] is gone. The exporter bounds each
/// export (retries included) by its timeout; a batch it fails is dropped and counted.
async fn run(
    rx: &mut mpsc::Receiver<SpanRecord>,
    exporter: &impl SpanExporter,
    counters: &ExportCounters,
) {
    let scope = InstrumentationScope::builder("tollgate")
        .with_version(env!("CARGO_PKG_VERSION"))
        .build();
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
        let spans = batch.drain(..).map(|s| s.into_span_data(&scope)).collect();
        match exporter.export(spans).await {
            Ok(()) => {
                counters.exported.fetch_add(n, Relaxed);
            }
            Err(e) => {
                tracing::debug!(error = %e, spans = n, "trace export failed; spans dropped");
                counters.dropped[1].fetch_add(n, Relaxed);
            }
        }
    }
    let _ = exporter.shutdown();
}
