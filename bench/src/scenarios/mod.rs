//! The scenarios. Each starts what it needs, measures, and returns an [`Outcome`].

pub mod accuracy;
pub mod clients;
pub mod failopen;
pub mod latency;
pub mod plans;
pub mod redis;
pub mod replay;
pub mod slowredis;
mod takes;
pub mod throughput;

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
