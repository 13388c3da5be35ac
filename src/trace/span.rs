//! Finished spans and their OTLP/HTTP JSON encoding (the OTLP specification's JSON form of
//! `ExportTraceServiceRequest`: ids in lowercase hex, 64-bit integers as strings).

use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

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
    fn to_json(&self) -> Value {
        let attributes: Vec<Value> = self
            .attributes
            .iter()
            .map(|(key, value)| {
                let value = match value {
                    Attr::Str(s) => json!({ "stringValue": s }),
                    Attr::Int(i) => json!({ "intValue": i.to_string() }),
                };
                json!({ "key": key, "value": value })
            })
            .collect();
        let mut span = json!({
            "traceId": hex::encode(self.trace_id),
            "spanId": hex::encode(self.span_id),
            "name": self.name,
            "kind": self.kind as u8,
            "startTimeUnixNano": self.start_ns.to_string(),
            "endTimeUnixNano": self.end_ns.max(self.start_ns).to_string(),
            "attributes": attributes,
        });
        if let Some(parent) = self.parent_id {
            span["parentSpanId"] = json!(hex::encode(parent));
        }
        if self.error {
            span["status"] = json!({ "code": 2 });
        }
        span
    }
}

/// One `POST /v1/traces` body for `spans`, from the resource `service.name = tollgate`.
pub fn export_request(spans: &[SpanRecord]) -> Vec<u8> {
    let spans: Vec<Value> = spans.iter().map(SpanRecord::to_json).collect();
    let body = json!({
        "resourceSpans": [{
            "resource": {
                "attributes": [
                    { "key": "service.name", "value": { "stringValue": "tollgate" } },
                    { "key": "service.version", "value": { "stringValue": env!("CARGO_PKG_VERSION") } },
                ]
            },
            "scopeSpans": [{
                "scope": { "name": "tollgate", "version": env!("CARGO_PKG_VERSION") },
                "spans": spans,
            }]
        }]
    });
    serde_json::to_vec(&body).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
