//! Finished spans, as the request path records them ([`SpanRecord`]: ids, a name, two
//! timestamps, a few attributes), and their form for the OpenTelemetry exporter
//! ([`SpanRecord::into_span_data`], made on the export thread, off the request path).

use std::borrow::Cow;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use opentelemetry::trace::{self as otel, TraceFlags, TraceState};
use opentelemetry::{InstrumentationScope, KeyValue, Value};
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanLinks};

/// OTLP's `SpanKind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanKind {
    Internal = 1,
    Server = 2,
    Client = 3,
}

/// An attribute's value.
#[derive(Debug, Clone, PartialEq)]
pub enum Attr {
    Str(Box<str>),
    Int(i64),
}

/// One finished span, ready to export.
#[derive(Debug, Clone)]
pub struct SpanRecord {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub parent_id: Option<[u8; 8]>,
    pub name: Box<str>,
    pub kind: SpanKind,
    pub start_ns: u64,
    pub end_ns: u64,
    pub attributes: Vec<(&'static str, Attr)>,
    /// OTLP status `ERROR` (a 5xx for the request and upstream spans); otherwise unset.
    pub error: bool,
}

/// Nanoseconds since the Unix epoch.
pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or_default()
}

impl SpanRecord {
    /// The OpenTelemetry SDK's form of this span, which the OTLP exporter encodes. Only
    /// sampled spans are recorded; a server span's parent is the caller's (remote).
    pub fn into_span_data(self, scope: &InstrumentationScope) -> SpanData {
        let kind = match self.kind {
            SpanKind::Internal => otel::SpanKind::Internal,
            SpanKind::Server => otel::SpanKind::Server,
            SpanKind::Client => otel::SpanKind::Client,
        };
        let time = |ns: u64| UNIX_EPOCH + Duration::from_nanos(ns);
        SpanData {
            span_context: otel::SpanContext::new(
                otel::TraceId::from_bytes(self.trace_id),
                otel::SpanId::from_bytes(self.span_id),
                TraceFlags::SAMPLED,
                false,
                TraceState::NONE,
            ),
            parent_span_id: self
                .parent_id
                .map_or(otel::SpanId::INVALID, otel::SpanId::from_bytes),
            parent_span_is_remote: self.kind == SpanKind::Server && self.parent_id.is_some(),
            span_kind: kind,
            name: Cow::Owned(self.name.into_string()),
            start_time: time(self.start_ns),
            end_time: time(self.end_ns.max(self.start_ns)),
            attributes: self
                .attributes
                .into_iter()
                .map(|(key, value)| {
                    let value = match value {
                        Attr::Str(s) => Value::from(s.into_string()),
                        Attr::Int(i) => Value::I64(i),
                    };
                    KeyValue::new(key, value)
                })
                .collect(),
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status: if self.error {
                otel::Status::error("")
            } else {
                otel::Status::Unset
            },
            instrumentation_scope: scope.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::transform::common::tonic::ResourceAttributesWithSchema;
    use opentelemetry_proto::transform::trace::tonic::group_spans_by_resource_and_scope;
    use serde_json::Value;

    /// The OTLP/HTTP JSON body the exporter posts for `spans`: the same conversion and
    /// encoding (`opentelemetry-proto`'s) that `opentelemetry-otlp` uses.
    fn export_request(spans: &[SpanRecord]) -> Vec<u8> {
        let scope = InstrumentationScope::builder("tollgate").build();
        let data = spans
            .iter()
            .map(|s| s.clone().into_span_data(&scope))
            .collect();
        let resource = ResourceAttributesWithSchema::default();
        let resource_spans = group_spans_by_resource_and_scope(data, &resource);
        serde_json::to_vec(&ExportTraceServiceRequest { resource_spans }).unwrap()
    }

    #[test]
    fn a_span_is_encoded_as_otlp_json() {
        let span = SpanRecord {
            trace_id: [0xab; 16],
            span_id: [1; 8],
            parent_id: Some([2; 8]),
            name: "decision".into(),
            kind: SpanKind::Internal,
            start_ns: 10,
            end_ns: 20,
            attributes: vec![
                ("tollgate.outcome", Attr::Str("allowed".into())),
                ("http.response.status_code", Attr::Int(200)),
            ],
            error: true,
        };
        let body: Value = serde_json::from_slice(&export_request(&[span])).unwrap();
        let s = &body["resourceSpans"][0]["scopeSpans"][0]["spans"][0];
        assert_eq!(s["traceId"], "abababababababababababababababab");
        assert_eq!(s["spanId"], "0101010101010101");
        assert_eq!(s["parentSpanId"], "0202020202020202");
        assert_eq!(s["kind"], 1);
        assert_eq!(s["startTimeUnixNano"], "10");
        assert_eq!(s["attributes"][0]["value"]["stringValue"], "allowed");
        assert_eq!(s["attributes"][1]["value"]["intValue"], "200");
        assert_eq!(s["status"]["code"], 2);
    }

    #[test]
    fn a_server_span_with_a_parent_has_a_remote_parent_and_an_end_after_its_start() {
        let span = SpanRecord {
            trace_id: [1; 16],
            span_id: [1; 8],
            parent_id: Some([2; 8]),
            name: "GET /orders".into(),
            kind: SpanKind::Server,
            start_ns: 30,
            end_ns: 20,
            attributes: vec![],
            error: false,
        };
        let scope = InstrumentationScope::builder("tollgate").build();
        let data = span.clone().into_span_data(&scope);
        assert!(data.parent_span_is_remote);
        assert_eq!(
            data.end_time, data.start_time,
            "a clock step back is clamped"
        );
        assert_eq!(data.status, otel::Status::Unset);
        let root = SpanRecord {
            parent_id: None,
            ..span
        };
        let data = root.into_span_data(&scope);
        assert_eq!(data.parent_span_id, otel::SpanId::INVALID);
        assert!(!data.parent_span_is_remote);
    }
}
