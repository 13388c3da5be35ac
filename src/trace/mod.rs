//! Traces: W3C Trace Context propagated on every forwarded request ([`context`]), and,
//! when `telemetry.otlp_endpoint` is set, a request span with `decision` and `upstream`
//! children exported over OTLP/HTTP JSON ([`export`]). See README, "Tracing".

mod context;
mod export;
mod request;
mod span;

pub use context::{SpanContext, MAX_TRACESTATE};
pub use export::{ExportCounters, Tracer, DROP_REASONS};
pub use request::{propagate, request, DecisionTimer, UpstreamSpan};
