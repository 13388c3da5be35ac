use serde::{Deserialize, Serialize};
#[cfg(feature = "schema")]
use utoipa::openapi::schema::{ObjectBuilder, SchemaType, Type};
#[cfg(feature = "schema")]
use utoipa::openapi::{RefOr, Schema};

/// Bounds on a plan. They keep the refill time `capacity / rate` (the bucket key's TTL) at
/// most [`MAX_REFILL_SECS`] = 1e12 s, so that in milliseconds (1e15) it is an exact integer
/// in an `f64` and a Lua number (< 2^53, which Redis' `%.17g` prints without an exponent,
/// so `PEXPIRE` accepts it), and in microseconds (1e18) it fits a `u64` with room to add a
/// clock reading. Safety scaling multiplies both by the same factor, and a regional
/// portion keeps its rate at least [`MIN_RATE`], so neither can leave that range.
pub const MIN_CAPACITY: f64 = 1.0;
pub const MAX_CAPACITY: f64 = 1e9;
/// One token per 1000 s at the slowest (about 86 a day).
pub const MIN_RATE: f64 = 0.001;
pub const MAX_RATE: f64 = 1e9;
/// The longest refill a plan can have, in seconds: [`MAX_CAPACITY`] / [`MIN_RATE`].
pub const MAX_REFILL_SECS: f64 = MAX_CAPACITY / MIN_RATE;

/// Why a plan was refused; [`PlanError::field`] names the offending field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    #[error(
        "capacity must be a finite number between {MIN_CAPACITY} and {MAX_CAPACITY:e} (got {0})"
    )]
    Capacity(f64),
    #[error("rate must be a finite number between {MIN_RATE} and {MAX_RATE:e} (got {0})")]
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

/// A plan's bucket size in tokens, within [`MIN_CAPACITY`]..=[`MAX_CAPACITY`].
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd, Serialize, Deserialize)]
#[serde(try_from = "f64", into = "f64")]
pub struct Capacity(f64);

/// A plan's refill in tokens per second, within [`MIN_RATE`]..=[`MAX_RATE`].
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd, Serialize, Deserialize)]
#[serde(try_from = "f64", into = "f64")]
pub struct Rate(f64);

macro_rules! bounded {
    ($name:ident, $min:expr, $max:expr, $err:path, $doc:expr, $example:expr) => {
        impl $name {
            pub fn parse(v: f64) -> Result<$name, PlanError> {
                if v.is_finite() && ($min..=$max).contains(&v) {
                    Ok($name(v))
                } else {
                    Err($err(v))
                }
            }

            pub fn get(self) -> f64 {
                self.0
            }
        }

        impl TryFrom<f64> for $name {
            type Error = PlanError;
            fn try_from(v: f64) -> Result<$name, PlanError> {
                $name::parse(v)
            }
        }

        impl From<$name> for f64 {
            fn from(v: $name) -> f64 {
                v.0
            }
        }

        /// The schema states the bounds the parse enforces, from the same constants.
        #[cfg(feature = "schema")]
        impl utoipa::PartialSchema for $name {
            fn schema() -> RefOr<Schema> {
                ObjectBuilder::new()
                    .schema_type(SchemaType::Type(Type::Number))
                    .minimum(Some($min))
                    .maximum(Some($max))
                    .description(Some($doc))
                    .examples([serde_json::json!($example)])
                    .into()
            }
        }

        #[cfg(feature = "schema")]
        impl utoipa::ToSchema for $name {}
    };
}

bounded!(
    Capacity,
    MIN_CAPACITY,
    MAX_CAPACITY,
    PlanError::Capacity,
    "Bucket size in tokens: the largest burst (1 to 1e9).",
    100
);
bounded!(
    Rate,
    MIN_RATE,
    MAX_RATE,
    PlanError::Rate,
    "Refill in tokens per second: the sustained rate (0.001 to 1e9).",
    50
);

/// A plan's limits: a bucket of `capacity` tokens refilled at `rate` tokens per second.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "RawPlan")]
pub struct Bucket {
    capacity: f64,
    rate: f64,
}

#[derive(Deserialize)]
struct RawPlan {
    capacity: f64,
    rate: f64,
}

impl TryFrom<RawPlan> for Bucket {
    type Error = PlanError;
    fn try_from(r: RawPlan) -> Result<Self, PlanError> {
        Bucket::new(r.capacity, r.rate)
    }
}

impl Bucket {
    pub fn new(capacity: f64, rate: f64) -> Result<Bucket, PlanError> {
        Ok(Bucket::from_parts(
            Capacity::parse(capacity)?,
            Rate::parse(rate)?,
        ))
    }

    pub fn from_parts(capacity: Capacity, rate: Rate) -> Bucket {
        Bucket {
            capacity: capacity.get(),
            rate: rate.get(),
        }
    }

    pub fn capacity(&self) -> f64 {
        self.capacity
    }

    pub fn rate(&self) -> f64 {
        self.rate
    }

    /// The same plan scaled by `factor` (safety limits, 1-1000): the refill time stays.
    pub fn scaled(&self, factor: f64) -> Bucket {
        Bucket {
            capacity: (self.capacity * factor).max(MIN_CAPACITY),
            rate: (self.rate * factor).max(MIN_RATE),
        }
    }

    /// A `share` (0..1) of this plan, for one region's shard; the capacity never drops
    /// below `min_capacity` (a request's cost), so a small share can still admit, and the
    /// rate never below [`MIN_RATE`], so the refill time stays within [`MAX_REFILL_SECS`].
    pub fn portion(&self, share: f64, min_capacity: f64) -> Bucket {
        Bucket {
            capacity: (self.capacity * share).max(min_capacity).min(self.capacity),
            rate: (self.rate * share).max(MIN_RATE.min(self.rate)),
        }
    }

    /// Seconds for an empty bucket to fill.
    pub fn window_secs(&self) -> f64 {
        self.capacity / self.rate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sane_plan_is_accepted() {
        let p = Bucket::new(100.0, 50.0).unwrap();
        assert_eq!(p.window_secs(), 2.0);
    }

    #[test]
    fn the_bounds_are_accepted() {
        for (c, r) in [(1.0, 0.001), (1e9, 1e9), (1e9, 0.001), (1.0, 1e9)] {
            assert!(Bucket::new(c, r).is_ok(), "{c} {r}");
        }
    }

    #[test]
    fn the_longest_refill_is_exact_in_ms_and_fits_in_us() {
        let p = Bucket::new(MAX_CAPACITY, MIN_RATE).unwrap();
        assert_eq!(p.window_secs(), MAX_REFILL_SECS);
        let ms = (p.window_secs() * 1000.0).ceil() + 1000.0;
        assert!(ms < 2f64.powi(53), "exact in an f64 and a Lua number");
        // Redis formats Lua numbers with %.17g: no exponent below 1e17, so PEXPIRE parses it.
        assert!(ms < 1e17);
        let us = (ms as u64).checked_mul(1000).unwrap();
        assert!(
            us.checked_add(u64::MAX / 4).is_some(),
            "room for a clock reading"
        );
    }

    #[test]
    fn scaling_and_portions_keep_the_refill_time_bounded() {
        let p = Bucket::new(MAX_CAPACITY, MIN_RATE).unwrap();
        assert!(p.scaled(1000.0).window_secs() <= MAX_REFILL_SECS);
        for share in [0.0, 1e-300, 1e-9, 0.5] {
            let q = Bucket::new(MAX_CAPACITY, 1.0).unwrap().portion(share, 1.0);
            assert!(q.window_secs() <= MAX_REFILL_SECS, "{share}");
            assert!(q.rate() >= MIN_RATE, "{share}");
        }
    }

    #[test]
    fn bad_capacities_are_refused_by_name() {
        for c in [0.0, -1.0, 0.5, f64::NAN, f64::INFINITY, 1e9 + 1.0, 1e13] {
            assert_eq!(Bucket::new(c, 1.0).unwrap_err().field(), "capacity", "{c}");
        }
    }

    #[test]
    fn bad_rates_are_refused_by_name() {
        for r in [0.0, -1.0, 0.0009, 1e-300, f64::NAN, f64::INFINITY, 1e10] {
            assert_eq!(Bucket::new(10.0, r).unwrap_err().field(), "rate", "{r}");
        }
    }

    #[test]
    fn plans_deserialize_through_new() {
        assert!(serde_json::from_str::<Bucket>(r#"{"capacity":0,"rate":1}"#).is_err());
        assert!(serde_json::from_str::<Bucket>(r#"{"capacity":5,"rate":1}"#).is_ok());
    }
}
