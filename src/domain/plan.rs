use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Upper bounds that keep the bucket arithmetic exact in an `f64` and a Lua number.
pub const MAX_CAPACITY: f64 = 1e12;
pub const MAX_RATE: f64 = 1e9;

/// Why a plan was refused; [`PlanError::field`] names the offending field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    #[error("capacity must be a finite number between 1 and {MAX_CAPACITY:e} (got {0})")]
    Capacity(f64),
    #[error("rate must be a finite number greater than 0 and at most {MAX_RATE:e} (got {0})")]
    Rate(f64),
}

impl PlanError {
    pub fn field(&self) -> &'static str {
        match self {
            PlanError::Capacity(_) => "capacity",
            PlanError::Rate(_) => "rate",
        }
    }
}

/// A plan's limits: a bucket of `capacity` tokens refilled at `rate` tokens per second.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "RawPlan")]
pub struct Plan {
    capacity: f64,
    rate: f64,
}

#[derive(Deserialize)]
struct RawPlan {
    capacity: f64,
    rate: f64,
}

impl TryFrom<RawPlan> for Plan {
    type Error = PlanError;
    fn try_from(r: RawPlan) -> Result<Self, PlanError> {
        Plan::new(r.capacity, r.rate)
    }
}

impl Plan {
    pub fn new(capacity: f64, rate: f64) -> Result<Plan, PlanError> {
        if !(capacity.is_finite() && (1.0..=MAX_CAPACITY).contains(&capacity)) {
            return Err(PlanError::Capacity(capacity));
        }
        if !(rate.is_finite() && rate > 0.0 && rate <= MAX_RATE) {
            return Err(PlanError::Rate(rate));
        }
        Ok(Plan { capacity, rate })
    }

    pub fn capacity(&self) -> f64 {
        self.capacity
    }

    pub fn rate(&self) -> f64 {
        self.rate
    }

    /// The same plan scaled by `factor` (safety limits, regional shares).
    pub fn scaled(&self, factor: f64) -> Plan {
        Plan {
            capacity: (self.capacity * factor).max(1.0),
            rate: (self.rate * factor).max(f64::MIN_POSITIVE),
        }
    }

    /// A `share` (0..1) of this plan, for one region's shard; the capacity never drops
    /// below `min_capacity` (a request's cost), so a small share can still admit.
    pub fn portion(&self, share: f64, min_capacity: f64) -> Plan {
        Plan {
            capacity: (self.capacity * share).max(min_capacity).min(self.capacity),
            rate: (self.rate * share).max(f64::MIN_POSITIVE),
        }
    }

    /// Seconds for an empty bucket to fill.
    pub fn window_secs(&self) -> f64 {
        self.capacity / self.rate
    }
}

/// Whether a client's decisions are enforced or only observed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Over-limit requests are answered `429` by the gateway.
    Enforce,
    /// Decisions are counted but every request is forwarded.
    Shadow,
}

impl FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Mode, String> {
        match s {
            "enforce" => Ok(Mode::Enforce),
            "shadow" => Ok(Mode::Shadow),
            other => Err(format!("must be \"enforce\" or \"shadow\" (got {other:?})")),
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::Enforce => "enforce",
            Mode::Shadow => "shadow",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sane_plan_is_accepted() {
        let p = Plan::new(100.0, 50.0).unwrap();
        assert_eq!(p.window_secs(), 2.0);
    }

    #[test]
    fn bad_capacities_are_refused_by_name() {
        for c in [0.0, -1.0, 0.5, f64::NAN, f64::INFINITY, 1e13] {
            assert_eq!(Plan::new(c, 1.0).unwrap_err().field(), "capacity", "{c}");
        }
    }

    #[test]
    fn bad_rates_are_refused_by_name() {
        for r in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e10] {
            assert_eq!(Plan::new(10.0, r).unwrap_err().field(), "rate", "{r}");
        }
    }

    #[test]
    fn plans_deserialize_through_new() {
        assert!(serde_json::from_str::<Plan>(r#"{"capacity":0,"rate":1}"#).is_err());
        assert!(serde_json::from_str::<Plan>(r#"{"capacity":5,"rate":1}"#).is_ok());
    }
}
