//! STUB: replaced by the quota helper's module. UTC calendar only.
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Period {
    Hour,
    Day,
    Month,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reset {
    Calendar,
    Anchor(u8),
    Rolling,
}

#[derive(Debug, Clone, PartialEq)]
pub struct QuotaClock {
    period: Period,
    reset: Reset,
    tz_name: String,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum QuotaError {
    #[error("unknown time zone {0:?}")]
    UnknownTimeZone(String),
    #[error("must be 1 to 31 (got {0})")]
    AnchorDay(i64),
    #[error("an anchor day needs period \"month\" (got {0:?})")]
    AnchorNeedsMonth(Period),
}

impl QuotaError {
    pub fn field(&self) -> &'static str {
        match self {
            QuotaError::UnknownTimeZone(_) => "time_zone",
            _ => "anchor_day",
        }
    }
}

impl QuotaClock {
    pub fn new(period: Period, reset: Reset, time_zone: &str) -> Result<QuotaClock, QuotaError> {
        Ok(QuotaClock {
            period,
            reset,
            tz_name: time_zone.to_string(),
        })
    }
    pub fn period(&self) -> Period {
        self.period
    }
    pub fn reset(&self) -> Reset {
        self.reset
    }
    pub fn time_zone(&self) -> &str {
        &self.tz_name
    }
    pub fn bounds(&self, now_us: u64) -> Bounds {
        let len = match self.period {
            Period::Hour => 3_600_000_000,
            Period::Day => 86_400_000_000,
            Period::Month => 2_592_000_000_000,
        };
        if self.reset == Reset::Rolling {
            return Bounds::Rolling(len);
        }
        let start = now_us / len * len;
        Bounds::Fixed([start, start + len, start + 2 * len])
    }
    pub fn nominal_secs(&self) -> u64 {
        match self.period {
            Period::Hour => 3600,
            Period::Day => 86_400,
            Period::Month => 2_592_000,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bounds {
    Fixed([u64; 3]),
    Rolling(u64),
}

pub fn window_end(bounds: Bounds, stored_end: Option<u64>, now_us: u64) -> u64 {
    if let Some(e) = stored_end.filter(|e| now_us < *e) {
        return e;
    }
    match bounds {
        Bounds::Fixed(ends) => ends.into_iter().find(|e| *e > now_us).unwrap_or(ends[2]),
        Bounds::Rolling(len) => now_us + len,
    }
}
