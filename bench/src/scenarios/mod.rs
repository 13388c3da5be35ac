//! The scenarios. Each starts what it needs, measures, and returns an [`Outcome`].

pub mod accuracy;
pub mod catalog;
pub mod clients;
pub mod edge;
pub mod failopen;
pub mod latency;
pub mod overload;
pub mod plans;
pub mod protocols;
pub mod redis;
pub mod replay;
pub mod slowredis;
mod takes;
pub mod throughput;
pub mod upstreams;
pub mod usage;

use std::collections::HashMap;

use serde_json::{json, Value};

use crate::load::Summary;
use crate::report::round;

/// A latency summary as JSON, in milliseconds with microsecond resolution.
pub fn summary_json(s: &Summary) -> Value {
    json!({
        "count": s.count,
        "p50_ms": round(s.p50_ms, 3),
        "p90_ms": round(s.p90_ms, 3),
        "p99_ms": round(s.p99_ms, 3),
        "p999_ms": round(s.p999_ms, 3),
        "max_ms": round(s.max_ms, 3),
        "mean_ms": round(s.mean_ms, 3),
    })
}

/// Parses a positive number of seconds for clap.
pub fn seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() && v <= 3600.0 => Ok(v),
        _ => Err(format!("{s:?} is not a number of seconds in (0, 3600]")),
    }
}

/// The decision outcomes that are the store's verdict, or its failing to give one in
/// time: what a fail-open share is a share of. Requests shed (`outcome="shed"`: refused
/// for want of room, before any verdict) and those without a limiter decision
/// (`safety_denied`, `unknown_key`) are not among them.
const VERDICTS: [&str; 4] = ["allowed", "denied", "shadow_denied", "fail_open"];

/// Two readings of a gateway's `/metrics`: how far counters moved between them. A series
/// missing from a reading counts as 0, so a gateway that does not export it yet (or
/// exports it only once it is non-zero) reads as none.
pub struct MetricsDelta {
    pub before: HashMap<String, f64>,
    pub after: HashMap<String, f64>,
}

impl MetricsDelta {
    /// `after - before` of one series (`name{labels}` as exported).
    pub fn of(&self, series: &str) -> f64 {
        let at = |m: &HashMap<String, f64>| m.get(series).copied().unwrap_or(0.0);
        at(&self.after) - at(&self.before)
    }

    /// `tollgate_decisions_total` of one outcome.
    pub fn decisions(&self, outcome: &str) -> f64 {
        self.of(&format!(
            "tollgate_decisions_total{{outcome=\"{outcome}\"}}"
        ))
    }

    /// Decisions the store gave (or failed to give) a verdict on; see [`VERDICTS`].
    pub fn verdicts(&self) -> f64 {
        VERDICTS.iter().map(|o| self.decisions(o)).sum()
    }

    /// `tollgate_shed_total` of one reason.
    pub fn shed(&self, reason: &str) -> f64 {
        self.of(&format!("tollgate_shed_total{{reason=\"{reason}\"}}"))
    }
}
