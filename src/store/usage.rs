//! Usage history's vocabulary: what a gateway counted for one client, one limit and one
//! hour ([`UsageCounts`]), the batches it flushes them in ([`UsageBatch`]), and what the
//! store answers when asked for a client's history ([`UsageRow`]). The port is
//! [`UsageHistory`](super::UsageHistory).

use crate::domain::ClientId;

/// Seconds in an hour: history is kept per UTC hour.
pub const HOUR_S: u64 = 3600;

/// Seconds in a day: the store keeps one record per client per UTC day.
pub const DAY_S: u64 = 86_400;

/// What one limit of one client counted in one hour.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct UsageCounts {
    /// Requests the store admitted (each took `cost` from this limit).
    pub admitted: u64,
    /// Requests refused: by the store (enforce and shadow mode), or by the gateway without
    /// it (the safety limit, a cost the limit can never hold).
    pub refused: u64,
    /// What the admitted requests took from this limit (their real cost when the service
    /// reported one): over a quota's window, its `used`.
    pub cost: f64,
    /// Requests admitted without the store counting them (failing open: timeout, error,
    /// breaker open); never in `admitted` or `cost`.
    pub unmetered: u64,
    /// What those would have cost.
    pub unmetered_cost: f64,
}

impl UsageCounts {
    /// Adds `other` to these counts.
    pub fn add(&mut self, other: &UsageCounts) {
        self.admitted += other.admitted;
        self.refused += other.refused;
        self.cost += other.cost;
        self.unmetered += other.unmetered;
        self.unmetered_cost += other.unmetered_cost;
    }

    pub fn is_empty(&self) -> bool {
        *self == UsageCounts::default()
    }
}

/// One client's counts for one limit in one hour.
#[derive(Clone, Debug, PartialEq)]
pub struct UsageEntry {
    pub client: ClientId,
    /// The limit's name in the client's plan.
    pub limit: String,
    /// The hour's start, unix seconds (a multiple of [`HOUR_S`]).
    pub hour_s: u64,
    pub counts: UsageCounts,
}

/// A gateway's counts, flushed together. `gateway` and `seq` make it idempotent: a batch the
/// store has already added (its reply was lost) is not added again when it is sent again,
/// so a gateway resends a batch unchanged until the store says it has it, and numbers its
/// batches in increasing order.
#[derive(Clone, Debug)]
pub struct UsageBatch {
    /// This gateway process's id (random at start).
    pub gateway: String,
    /// Increasing within `gateway`, from 1.
    pub seq: u64,
    /// How long the store keeps each day's record (`usage.retention_days`).
    pub retention_s: u64,
    pub entries: Vec<UsageEntry>,
}

/// What the store holds of one client, one limit, one hour.
#[derive(Clone, Debug, PartialEq)]
pub struct UsageRow {
    pub limit: String,
    pub hour_s: u64,
    pub counts: UsageCounts,
}

/// The UTC day `t_s` (unix s) falls in, as `YYYYMMDD`: the suffix of a day's record.
pub fn day_name(t_s: u64) -> String {
    let days = (t_s / DAY_S) as i64;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}{m:02}{d:02}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_day_is_named_by_its_utc_date() {
        assert_eq!(day_name(0), "19700101");
        assert_eq!(day_name(86_399), "19700101");
        assert_eq!(day_name(86_400), "19700102");
        // 2024-02-29T12:00:00Z, a leap day.
        assert_eq!(day_name(1_709_208_000), "20240229");
        // 2026-12-07T23:59:59Z.
        assert_eq!(day_name(1_796_687_999), "20261207");
    }
}
