//! Traces: W3C Trace Context propagated on every forwarded request ([`context`]), and,
//! when `telemetry.otlp_endpoint` is set, a request span with `decision` and `upstream`
//! children ([`request`], recorded as [`SpanRecord`]s) queued without waiting and exported
//! off the request path ([`export`]) through the OpenTelemetry OTLP exporter ([`otlp`]).
//! See the book, "Tracing".

mod context;
mod export;
mod otlp;
mod request;
mod span;

pub use context::{SpanContext, MAX_TRACESTATE};
pub use export::{ExportCounters, Tracer, DROP_REASONS, QUEUE};
pub use otlp::{exporter, EXPORT_TIMEOUT};
pub use request::{propagate, request, DecisionTimer, UpstreamSpan};
pub use span::{now_ns, Attr, SpanKind, SpanRecord};
