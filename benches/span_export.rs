//! What a traced request's spans cost the request path (README, "Tracing"): recording the
//! three spans of one request (`GET /orders`, `decision`, `upstream`) and queueing them for
//! export, two ways:
//!
//! - **tollgate**: `SpanRecord`s into the bounded queue of `trace::Tracer`, built as
//!   `trace::request` builds them;
//! - **opentelemetry_sdk**: the same spans, with the same attributes, made through the
//!   OpenTelemetry span API and queued by the SDK's `BatchSpanProcessor` (queue 4,096,
//!   batches of 512, 200 ms: tollgate's numbers), sampled by the default `ParentBased`.
//!
//! Each is drained by its own export thread (tollgate's `run` loop, the SDK's processor
//! thread) into an exporter that discards the batches. What is timed is the request
//! path's share alone, with room in the queue (see [`timed`]; a run in which a queue filled
//! fails). Not timed on
//! either side: parsing the incoming `traceparent` and writing the upstream's (done with
//! export off too), and keeping the request's trace in its extensions.
//!
//! `cargo bench --bench span_export` times them (criterion). With `SPAN_EXPORT_CALLS=N`
//! it records N requests each way and exits, to count instructions under callgrind (only
//! inside the two `record_*` functions, on the thread that calls them):
//!
//! ```sh
//! SPAN_EXPORT_CALLS=10000 valgrind --tool=callgrind --toggle-collect='span_export::record_*' \
//!     target/release/deps/span_export-<hash>
//! ```

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::Criterion;
use opentelemetry::trace::{
    Span as _, SpanKind as OtelKind, TraceContextExt, TraceFlags, TraceState, Tracer as _,
    TracerProvider as _,
};
use opentelemetry::{trace as otel, Context, KeyValue};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, SdkTracer, SdkTracerProvider, SpanData, SpanExporter,
};
use tollgate::trace::{now_ns, Attr, SpanContext, SpanKind, SpanRecord, Tracer, QUEUE};

/// The gateway's allocator (`src/main.rs`): both ways allocate per span.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const TRACEPARENT: &[u8] = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const PREFIX: &str = "/orders";
const CLIENT: &str = "acme";

/// One request's spans, as `trace::request` records them: the request span's context at
/// arrival, the decision span when it is made, the upstream span when the service answers,
/// the request span at the response head.
#[inline(never)]
fn record_tollgate(tracer: &Tracer, incoming: Option<SpanContext>, service: &Arc<str>) {
    let method = actix_web::http::Method::GET;
    let span = match incoming {
        Some(parent) => parent.child(),
        None => SpanContext::new_root(),
    };
    let start_ns = now_ns();

    let decision_start = now_ns();
    let route: (Arc<str>, Box<str>, Box<str>) = (Arc::clone(service), PREFIX.into(), CLIENT.into());
    tracer.record(SpanRecord {
        trace_id: span.trace_id,
        span_id: span.child().span_id,
        parent_id: Some(span.span_id),
        name: "decision".into(),
        kind: SpanKind::Internal,
        start_ns: decision_start,
        end_ns: now_ns(),
        attributes: vec![
            ("tollgate.outcome", Attr::Str("allowed".into())),
            ("tollgate.service", Attr::Str((**service).into())),
            ("tollgate.client_id", Attr::Str(CLIENT.into())),
        ],
        error: false,
    });

    let upstream = span.child();
    let upstream_start = now_ns();
    let upstream_method: Box<str> = method.as_str().into();
    tracer.record(SpanRecord {
        trace_id: upstream.trace_id,
        span_id: upstream.span_id,
        parent_id: Some(span.span_id),
        name: "upstream".into(),
        kind: SpanKind::Client,
        start_ns: upstream_start,
        end_ns: now_ns(),
        attributes: vec![
            ("http.request.method", Attr::Str(upstream_method)),
            ("http.response.status_code", Attr::Int(200)),
        ],
        error: false,
    });

    let status = 200u16;
    let (service, prefix, client) = route;
    let mut attributes = vec![
        ("http.request.method", Attr::Str(method.as_str().into())),
        ("http.response.status_code", Attr::Int(status.into())),
        (
            "tollgate.status_class",
            Attr::Str(format!("{}xx", status / 100).into()),
        ),
    ];
    let name = format!("{method} {prefix}");
    attributes.push(("http.route", Attr::Str(prefix)));
    attributes.push(("tollgate.service", Attr::Str((*service).into())));
    attributes.push(("tollgate.client_id", Attr::Str(client)));
    tracer.record(SpanRecord {
        trace_id: span.trace_id,
        span_id: span.span_id,
        parent_id: incoming.map(|p| p.span_id),
        name: name.into(),
        kind: SpanKind::Server,
        start_ns,
        end_ns: now_ns(),
        attributes,
        error: false,
    });
}

/// The same spans through the OpenTelemetry span API: the request span started at arrival
/// (its context is what the request would carry), its children started and ended, then it
/// is named, given its attributes and ended.
#[inline(never)]
fn record_opentelemetry_sdk(tracer: &SdkTracer, incoming: &Context, service: &Arc<str>) {
    let method = actix_web::http::Method::GET;
    let request = tracer
        .span_builder(method.to_string())
        .with_kind(OtelKind::Server)
        .start_with_context(tracer, incoming);
    let cx = incoming.with_span(request);

    tracer
        .span_builder("decision")
        .with_kind(OtelKind::Internal)
        .with_attributes([
            KeyValue::new("tollgate.outcome", "allowed"),
            KeyValue::new("tollgate.service", service.to_string()),
            KeyValue::new("tollgate.client_id", CLIENT.to_string()),
        ])
        .start_with_context(tracer, &cx)
        .end();

    let mut upstream = tracer
        .span_builder("upstream")
        .with_kind(OtelKind::Client)
        .with_attributes([KeyValue::new(
            "http.request.method",
            method.as_str().to_string(),
        )])
        .start_with_context(tracer, &cx);
    upstream.set_attribute(KeyValue::new("http.response.status_code", 200i64));
    upstream.end();

    let status = 200i64;
    let span = cx.span();
    span.update_name(format!("{method} {PREFIX}"));
    span.set_attributes([
        KeyValue::new("http.request.method", method.as_str().to_string()),
        KeyValue::new("http.response.status_code", status),
        KeyValue::new("tollgate.status_class", format!("{}xx", status / 100)),
        KeyValue::new("http.route", PREFIX.to_string()),
        KeyValue::new("tollgate.service", service.to_string()),
        KeyValue::new("tollgate.client_id", CLIENT.to_string()),
    ]);
    span.end();
}

/// An exporter that counts the spans it is given and drops them.
#[derive(Debug, Default)]
struct Discard(Arc<AtomicU64>);

impl SpanExporter for Discard {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        self.0.fetch_add(batch.len() as u64, Relaxed);
        Ok(())
    }
}

/// Requests recorded between two waits for the export thread: 1,536 spans, three full
/// batches of 512 (exported at once, no linger), well within the queue of 4,096.
const CHUNK: u64 = 512;

/// One way of recording, with its export thread.
trait Way {
    fn record(&mut self);
    /// Spans the export thread has taken so far, and spans dropped.
    fn taken(&self) -> (u64, u64);
}

/// tollgate's tracer and export thread (its real `run` loop), exporting into [`Discard`].
struct Tollgate {
    tracer: Tracer,
    /// The export thread's supervisor, and the runtime it supervises on.
    _tasks: (tollgate::tasks::Supervisor, tokio::runtime::Runtime),
    exported: Arc<AtomicU64>,
    incoming: Option<SpanContext>,
    service: Arc<str>,
}

impl Tollgate {
    fn new() -> Tollgate {
        let exported = Arc::new(AtomicU64::new(0));
        // Its own worker drives the supervisor, which starts the export thread.
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("a runtime");
        let supervisor = {
            let _in = runtime.enter();
            tollgate::tasks::Supervisor::new()
        };
        let tracer = {
            let _in = runtime.enter();
            Tracer::start(Discard(Arc::clone(&exported)), &supervisor.tasks())
        };
        Tollgate {
            tracer,
            _tasks: (supervisor, runtime),
            exported,
            incoming: incoming().0,
            service: Arc::from("orders"),
        }
    }
}

impl Way for Tollgate {
    fn record(&mut self) {
        record_tollgate(&self.tracer, black_box(self.incoming), &self.service);
    }

    fn taken(&self) -> (u64, u64) {
        let dropped = self.tracer.counters().dropped[0].load(Relaxed);
        (self.exported.load(Relaxed), dropped)
    }
}

/// The SDK's tracer: a `BatchSpanProcessor` with tollgate's queue, batch and delay,
/// exporting into [`Discard`].
struct Sdk {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    exported: Arc<AtomicU64>,
    recorded: u64,
    incoming: Context,
    service: Arc<str>,
}

impl Sdk {
    fn new() -> Sdk {
        let exported = Arc::new(AtomicU64::new(0));
        let processor = BatchSpanProcessor::builder(Discard(Arc::clone(&exported)))
            .with_batch_config(
                BatchConfigBuilder::default()
                    .with_max_queue_size(QUEUE)
                    .with_max_export_batch_size(512)
                    .with_scheduled_delay(Duration::from_millis(200))
                    .build(),
            )
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .build();
        let tracer = provider.tracer("tollgate");
        Sdk {
            provider,
            tracer,
            exported,
            recorded: 0,
            incoming: incoming().1,
            service: Arc::from("orders"),
        }
    }
}

impl Way for Sdk {
    fn record(&mut self) {
        self.recorded += 3;
        record_opentelemetry_sdk(&self.tracer, black_box(&self.incoming), &self.service);
    }

    /// The SDK keeps its count of drops to itself: what was recorded and never exported.
    fn taken(&self) -> (u64, u64) {
        let exported = self.exported.load(Relaxed);
        (exported, self.recorded.saturating_sub(exported))
    }
}

impl Drop for Sdk {
    fn drop(&mut self) {
        let _ = self.provider.shutdown();
    }
}

/// Records `iters` requests' spans (rounded up to whole chunks, the time scaled back),
/// timing only the recording: after each chunk, untimed, it waits until the export
/// thread has taken every span so far, so the queue always has room, as it has at any
/// sustainable rate.
fn timed(way: &mut impl Way, iters: u64) -> Duration {
    let chunks = iters.div_ceil(CHUNK);
    let mut spent = Duration::ZERO;
    for _ in 0..chunks {
        let (before, dropped_before) = way.taken();
        let start = Instant::now();
        for _ in 0..CHUNK {
            way.record();
        }
        spent += start.elapsed();
        let deadline = Instant::now() + Duration::from_secs(2);
        while way.taken().0 < before + 3 * CHUNK && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(200));
        }
        let (taken, dropped) = way.taken();
        assert!(
            taken == before + 3 * CHUNK && dropped == dropped_before,
            "spans dropped or not exported: the queue filled"
        );
    }
    spent.mul_f64(iters as f64 / (chunks * CHUNK) as f64)
}

fn incoming() -> (Option<SpanContext>, Context) {
    let ours = SpanContext::parse(TRACEPARENT);
    let parent = ours.expect("a valid traceparent");
    let theirs = Context::new().with_remote_span_context(otel::SpanContext::new(
        otel::TraceId::from_bytes(parent.trace_id),
        otel::SpanId::from_bytes(parent.span_id),
        TraceFlags::SAMPLED,
        true,
        TraceState::NONE,
    ));
    (ours, theirs)
}

fn one_requests_spans(c: &mut Criterion) {
    let mut group = c.benchmark_group("one request's 3 spans, recorded and queued");
    let mut ours = Tollgate::new();
    group.bench_function("tollgate (SpanRecord, tokio mpsc)", |b| {
        b.iter_custom(|iters| timed(&mut ours, iters))
    });
    let mut theirs = Sdk::new();
    group.bench_function("opentelemetry_sdk (span API, BatchSpanProcessor)", |b| {
        b.iter_custom(|iters| timed(&mut theirs, iters))
    });
    group.finish();
}

/// `SPAN_EXPORT_CALLS=N`: each way N requests (whole chunks, waiting for the export
/// thread between them as [`timed`] does), for callgrind; else criterion.
fn main() {
    if let Some(n) = std::env::var("SPAN_EXPORT_CALLS")
        .ok()
        .and_then(|n| n.parse::<u64>().ok())
    {
        timed(&mut Tollgate::new(), n);
        timed(&mut Sdk::new(), n);
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    one_requests_spans(&mut c);
    c.final_summary();
}
