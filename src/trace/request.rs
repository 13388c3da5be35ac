//! The request path's hooks. Propagation ([`propagate`]) always runs: it is a header parsed
//! and a header written. Everything else exists only when `telemetry.otlp_endpoint` is set
//! and the trace is sampled: the [`request`] middleware (the request span; registered only
//! then), the decision span ([`DecisionTimer`]) and the upstream span ([`UpstreamSpan`]).
//!
//! The spans of one request: `GET /orders` (server; the incoming `traceparent`'s span as
//! parent) with two children, `decision` and `upstream` (client). The upstream's
//! `traceparent` names the `upstream` span as its parent.

use std::sync::Arc;

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header::HeaderMap;
use actix_web::middleware::Next;
use actix_web::{web, HttpMessage, HttpRequest};

use super::context::{tracestate, SpanContext, TRACEPARENT, TRACESTATE};
use super::export::Tracer;
use super::span::{now_ns, Attr, SpanKind, SpanRecord};
use crate::domain::{Decision, Outcome};
use crate::state::AppState;

/// A sampled request's trace, in its extensions while it is served.
#[derive(Clone)]
struct RequestTrace {
    /// The request span (its id is the parent of the decision and upstream spans).
    span: SpanContext,
    /// Whether the `traceparent` came from the client (then its `tracestate` passes on).
    continued: bool,
    /// Set by the decision: what the request span reports beside the method and status.
    route: Option<(Arc<str>, Box<str>, Box<str>)>,
}

/// Middleware (only registered when export is on): the request span, from the request's
/// arrival to its response head.
pub async fn request(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let Some(tracer) = req
        .app_data::<web::Data<AppState>>()
        .and_then(|s| s.traces.clone())
    else {
        return next.call(req).await;
    };
    let incoming = SpanContext::incoming(req.headers());
    let span = match incoming {
        Some(parent) => parent.child(),
        None => SpanContext::new_root(),
    };
    if !span.sampled() {
        // The caller did not record it; neither does the gateway (`propagate` passes it on).
        return next.call(req).await;
    }
    let start_ns = now_ns();
    let method = req.method().clone();
    req.extensions_mut().insert(RequestTrace {
        span,
        continued: incoming.is_some(),
        route: None,
    });
    let res = next.call(req).await;
    let (status, trace) = match &res {
        Ok(r) => (
            r.status().as_u16(),
            r.request().extensions().get::<RequestTrace>().cloned(),
        ),
        Err(e) => (e.as_response_error().status_code().as_u16(), None),
    };
    let route = trace.and_then(|t| t.route);
    let name = match &route {
        Some((_, prefix, _)) => format!("{method} {prefix}"),
        None => method.to_string(),
    };
    let mut attributes = vec![
        ("http.request.method", Attr::Str(method.as_str().into())),
        ("http.response.status_code", Attr::Int(status.into())),
        (
            "tollgate.status_class",
            Attr::Str(format!("{}xx", status / 100).into()),
        ),
    ];
    if let Some((service, prefix, client)) = route {
        attributes.push(("http.route", Attr::Str(prefix)));
        attributes.push(("tollgate.service", Attr::Str((*service).into())));
        attributes.push(("tollgate.client_id", Attr::Str(client)));
    }
    tracer.record(SpanRecord {
        trace_id: span.trace_id,
        span_id: span.span_id,
        parent_id: incoming.map(|p| p.span_id),
        name: name.into(),
        kind: SpanKind::Server,
        start_ns,
        end_ns: now_ns(),
        attributes,
        error: status >= 500,
    });
    res
}

/// Times the decision, and only when export is on (otherwise it holds nothing and reads
/// no clock).
pub struct DecisionTimer<'a>(Option<(&'a Tracer, u64)>);

impl<'a> DecisionTimer<'a> {
    pub fn start(tracer: Option<&'a Tracer>) -> DecisionTimer<'a> {
        DecisionTimer(tracer.map(|t| (t, now_ns())))
    }

    /// Exports the decision span of a sampled request, and notes the route and client for
    /// its request span.
    pub fn finish(
        self,
        req: &ServiceRequest,
        decision: &Decision,
        client_id: &str,
        service: &Arc<str>,
        prefix: &str,
    ) {
        let Some((tracer, start_ns)) = self.0 else {
            return;
        };
        let mut extensions = req.extensions_mut();
        let Some(trace) = extensions.get_mut::<RequestTrace>() else {
            return;
        };
        trace.route = Some((Arc::clone(service), prefix.into(), client_id.into()));
        let mut attributes = vec![
            (
                "tollgate.outcome",
                Attr::Str(decision.outcome.label().into()),
            ),
            ("tollgate.service", Attr::Str((**service).into())),
            ("tollgate.client_id", Attr::Str(client_id.into())),
        ];
        if let Some(batch) = decision.ruling.as_ref().map(|r| r.batch).filter(|b| *b > 0) {
            attributes.push(("tollgate.batch_size", Attr::Int(i64::from(batch))));
        }
        if decision.outcome == Outcome::FailOpen {
            if let Some(reason) = decision.fail_open_reason {
                attributes.push((
                    "tollgate.fail_open_reason",
                    Attr::Str(reason.label().into()),
                ));
            }
        }
        tracer.record(SpanRecord {
            trace_id: trace.span.trace_id,
            span_id: trace.span.child().span_id,
            parent_id: Some(trace.span.span_id),
            name: "decision".into(),
            kind: SpanKind::Internal,
            start_ns,
            end_ns: now_ns(),
            attributes,
            error: false,
        });
    }
}

/// The upstream call of a sampled request, until its response head (or failure).
pub struct UpstreamSpan {
    tracer: Tracer,
    span: SpanContext,
    parent: [u8; 8],
    start_ns: u64,
    method: Box<str>,
}

impl UpstreamSpan {
    /// Exports it: the upstream's status, or the gateway's own (`502`, `504`) when there was
    /// no response, with `error.type`.
    pub fn finish(self, status: u16, answered: bool) {
        let mut attributes = vec![
            ("http.request.method", Attr::Str(self.method)),
            ("http.response.status_code", Attr::Int(status.into())),
        ];
        if !answered {
            let kind = if status == 504 {
                "timeout"
            } else {
                "unreachable"
            };
            attributes.push(("error.type", Attr::Str(kind.into())));
        }
        self.tracer.record(SpanRecord {
            trace_id: self.span.trace_id,
            span_id: self.span.span_id,
            parent_id: Some(self.parent),
            name: "upstream".into(),
            kind: SpanKind::Client,
            start_ns: self.start_ns,
            end_ns: now_ns(),
            attributes,
            error: !answered || status >= 500,
        });
    }
}

/// Sets the upstream request's `traceparent` (and `tracestate`) in `out`, which holds the
/// client's headers as forwarded: a child of the request span when the request is traced
/// (returned, to be finished when the upstream answers), else a child of the client's
/// valid `traceparent`, else a new trace. A `tracestate` passes on only with the client's
/// own valid `traceparent`, unchanged, and only when it is valid and at most 512 characters.
pub fn propagate(
    req: &HttpRequest,
    tracer: Option<&Tracer>,
    out: &mut HeaderMap,
) -> Option<UpstreamSpan> {
    let traced = tracer.and_then(|t| {
        let extensions = req.extensions();
        let trace = extensions.get::<RequestTrace>()?;
        Some((t, trace.span, trace.continued))
    });
    let (ctx, continued, upstream) = match traced {
        Some((tracer, request, continued)) => {
            let span = request.child();
            let upstream = UpstreamSpan {
                tracer: tracer.clone(),
                span,
                parent: request.span_id,
                start_ns: now_ns(),
                method: req.method().as_str().into(),
            };
            (span, continued, Some(upstream))
        }
        None => match SpanContext::incoming(req.headers()) {
            Some(parent) => (parent.child(), true, None),
            None => (SpanContext::new_root(), false, None),
        },
    };
    out.insert(TRACEPARENT.clone(), ctx.traceparent());
    match tracestate(req.headers()).filter(|_| continued) {
        Some(state) => {
            out.insert(TRACESTATE.clone(), state);
        }
        None => {
            out.remove(&TRACESTATE);
        }
    }
    upstream
}
