//! Quota windows: "N requests per hour, day or month", counted in Redis.
//!
//! The Lua script that counts only has Redis' clock (unix microseconds) and no calendar, so
//! the gateway does the calendar math here, around *its own* clock's now, and hands the
//! script a [`Bounds`]: three consecutive window ends for a fixed window, or a length for a
//! rolling one. The script then places the request with Redis' time as [`window_end`] does.
//! Three ends rather than one let the script stay right when the two clocks straddle a
//! boundary by a few milliseconds.
//!
//! Calendar periods are civil periods in the quota's IANA time zone (bundled with the
//! binary, so every replica uses the same rules whatever the host has installed): a day in
//! Europe/Berlin is 23 or 25 hours across DST, and the hour in Asia/Kolkata (UTC+5:30)
//! turns at :30 UTC. A boundary (top of the hour, midnight) that falls in a DST gap or fold
//! is resolved with jiff's `compatible` disambiguation: a time the clocks skip moves forward
//! by the gap, a repeated one is its first occurrence.

use std::fmt;
use std::str::FromStr;

use jiff::civil::{Date, DateTime, Time};
use jiff::tz::TimeZone;
use jiff::{Timestamp, ToSpan};
use serde::{Deserialize, Serialize};

const SECOND_US: u64 = 1_000_000;
const HOUR_US: u64 = 3_600 * SECOND_US;

/// How long a quota's window is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum Period {
    Hour,
    Day,
    Month,
}

impl FromStr for Period {
    type Err = String;
    fn from_str(s: &str) -> Result<Period, String> {
        match s {
            "hour" => Ok(Period::Hour),
            "day" => Ok(Period::Day),
            "month" => Ok(Period::Month),
            other => Err(format!(
                "must be \"hour\", \"day\" or \"month\" (got {other:?})"
            )),
        }
    }
}

impl fmt::Display for Period {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Period::Hour => "hour",
            Period::Day => "day",
            Period::Month => "month",
        })
    }
}

/// When a quota's window starts over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reset {
    /// On the period's calendar boundary in the time zone (top of the hour, midnight, the 1st).
    Calendar,
    /// Monthly on this day of the month (1..=31) at midnight in the time zone; in a month
    /// without that day, on its last day (anchor 31 → Feb 28/29, Apr 30). Month period only.
    Anchor(u8),
    /// One period from the first request after the previous window ended.
    Rolling,
}

/// Why a quota clock was refused; [`QuotaError::field`] names the offending JSON field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum QuotaError {
    #[error("unknown IANA time zone {0:?}")]
    UnknownTimeZone(String),
    #[error("anchor day must be between 1 and 31 (got {0})")]
    AnchorDay(i64),
    #[error("an anchor day needs period \"month\" (got \"{0}\")")]
    AnchorNeedsMonth(Period),
}

impl QuotaError {
    pub fn field(&self) -> &'static str {
        match self {
            QuotaError::UnknownTimeZone(_) => "time_zone",
            QuotaError::AnchorDay(_) | QuotaError::AnchorNeedsMonth(_) => "anchor_day",
        }
    }
}

/// A quota's clock: period, reset rule and time zone. Once constructed it is valid, so
/// [`QuotaClock::bounds`] cannot fail on a bad rule. Cheap to clone (the zone is shared).
#[derive(Debug, Clone, PartialEq)]
pub struct QuotaClock {
    period: Period,
    reset: Reset,
    tz_name: String,
    tz: TimeZone,
}

/// What the script needs to place a request in a window; see [`QuotaClock::bounds`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bounds {
    /// Calendar or anchor: the ends (unix µs) of the previous window (= the start of the
    /// current one), of the current window, and of the next one, all around now_us:
    /// `ends[0] <= now_us < ends[1] < ends[2]`.
    Fixed([u64; 3]),
    /// Rolling: the length in µs of a window that would start at now_us (a month from now
    /// in the time zone: 28 to 31 days; a day: 23 to 25 hours across DST).
    Rolling(u64),
}

impl QuotaClock {
    /// Looks the zone up once here, so the request path never parses a name.
    pub fn new(period: Period, reset: Reset, time_zone: &str) -> Result<QuotaClock, QuotaError> {
        if let Reset::Anchor(day) = reset {
            if !(1..=31).contains(&day) {
                return Err(QuotaError::AnchorDay(i64::from(day)));
            }
            if period != Period::Month {
                return Err(QuotaError::AnchorNeedsMonth(period));
            }
        }
        let tz = TimeZone::get(time_zone)
            .map_err(|_| QuotaError::UnknownTimeZone(time_zone.to_owned()))?;
        // The database matches names case-insensitively; keep its spelling.
        let tz_name = tz.iana_name().unwrap_or(time_zone).to_owned();
        Ok(QuotaClock {
            period,
            reset,
            tz_name,
            tz,
        })
    }

    pub fn period(&self) -> Period {
        self.period
    }

    pub fn reset(&self) -> Reset {
        self.reset
    }

    /// The IANA name, as the time zone database spells it ("europe/berlin" → "Europe/Berlin").
    pub fn time_zone(&self) -> &str {
        &self.tz_name
    }

    /// What the script needs to place a request in a window, computed around `now_us`
    /// (unix microseconds on the gateway's clock).
    ///
    /// Called per request: it does not allocate. Past the calendar jiff supports (year
    /// 9999) it falls back to windows of [`QuotaClock::nominal_secs`] rather than panic.
    pub fn bounds(&self, now_us: u64) -> Bounds {
        let nominal_us = self.nominal_secs() * SECOND_US;
        match self.reset {
            Reset::Rolling => Bounds::Rolling(self.rolling_len(now_us).unwrap_or(nominal_us)),
            Reset::Calendar | Reset::Anchor(_) => Bounds::Fixed(
                self.fixed_ends(now_us)
                    .unwrap_or_else(|| epoch_grid(now_us, nominal_us)),
            ),
        }
    }

    /// A nominal window length in whole seconds, for the IETF RateLimit-Policy `w`
    /// parameter: 3600, 86400, or 2,592,000 (30 days) for a month.
    pub fn nominal_secs(&self) -> u64 {
        match self.period {
            Period::Hour => 3_600,
            Period::Day => 86_400,
            Period::Month => 30 * 86_400,
        }
    }

    /// The window's start is the instant of the civil period holding now (its key: the
    /// top of the hour, midnight, the 1st or the anchor date); the ends after it are the
    /// next keys' instants.
    fn fixed_ends(&self, now_us: u64) -> Option<[u64; 3]> {
        let now = timestamp(now_us)?;
        let mut key = self.window_key(self.tz.to_datetime(now))?;
        let mut start = self.instant(key)?;
        // A key the clocks skip resolves forward by the gap (see `instant`), possibly past
        // now: then now is still in the window before.
        if start > now.as_microsecond() {
            key = self.window_key(key.checked_sub(1.nanosecond()).ok()?)?;
            start = self.instant(key)?;
        }
        let (key, end) = self.next_boundary(key, start)?;
        let (_, next) = self.next_boundary(key, end)?;
        Some([start, end, next].map(saturate))
    }

    /// The first key after `key` whose instant is later than `after`. Keys the clocks skip
    /// can resolve to the instant of the next key (02:00 and 03:00 in Berlin on the spring
    /// change, Dec 30 and 31 of 2011 in Samoa): a period the clocks skip is no window.
    fn next_boundary(&self, mut key: DateTime, after: i64) -> Option<(DateTime, i64)> {
        for _ in 0..3 {
            key = self.next_key(key)?;
            let at = self.instant(key)?;
            if at > after {
                return Some((key, at));
            }
        }
        None
    }

    /// The civil start of the hour, day, month or anchor window holding local time `t`.
    fn window_key(&self, t: DateTime) -> Option<DateTime> {
        let date = match (self.period, self.reset) {
            (Period::Hour, _) => return Some(t.date().at(t.hour(), 0, 0, 0)),
            (_, Reset::Anchor(day)) => {
                let d = t.date();
                let this = anchor_in(d.year(), d.month(), day)?;
                if this <= d {
                    this
                } else {
                    let (y, m) = month_before(d.year(), d.month());
                    anchor_in(y, m, day)?
                }
            }
            (Period::Day, _) => t.date(),
            (Period::Month, _) => t.date().first_of_month(),
        };
        Some(date.to_datetime(Time::midnight()))
    }

    /// The key of the window after the one starting at `key`.
    fn next_key(&self, key: DateTime) -> Option<DateTime> {
        let date = match (self.period, self.reset) {
            (Period::Hour, _) => return key.checked_add(1.hour()).ok(),
            (Period::Day, _) => key.date().tomorrow().ok()?,
            (Period::Month, reset) => {
                let (y, m) = month_after(key.year(), key.month());
                match reset {
                    Reset::Anchor(day) => anchor_in(y, m, day)?,
                    _ => Date::new(y, m, 1).ok()?,
                }
            }
        };
        Some(date.to_datetime(Time::midnight()))
    }

    /// A key's instant in unix µs, a gap or fold resolved compatibly: a local time the
    /// clocks skip moves forward by the gap (02:00 in a 02:00-03:00 gap is 03:00), a
    /// repeated one is its first occurrence (so the 02:00 hour on Berlin's autumn change,
    /// like that day, runs two real hours).
    fn instant(&self, key: DateTime) -> Option<i64> {
        let ts = self.tz.to_ambiguous_timestamp(key).compatible().ok()?;
        Some(ts.as_microsecond())
    }

    /// The length of a rolling window starting now: the same local time one period later,
    /// resolved compatibly. jiff clamps month arithmetic to the end of the shorter month,
    /// so a month from Jan 31 ends on Feb 28 (29 in a leap year), not in March.
    fn rolling_len(&self, now_us: u64) -> Option<u64> {
        if self.period == Period::Hour {
            return Some(HOUR_US);
        }
        let now = timestamp(now_us)?;
        let local = self.tz.to_datetime(now);
        let later = match self.period {
            Period::Day => local.checked_add(1.day()),
            _ => local.checked_add(1.month()),
        }
        .ok()?;
        let end = self.tz.to_ambiguous_timestamp(later).compatible().ok()?;
        u64::try_from(end.as_microsecond() - now.as_microsecond())
            .ok()
            .filter(|&len| len > 0)
    }
}

/// The end of the window a request at `now_us` (the *store's* clock, which may differ from
/// the gateway's by some ms) falls in, given the window end the store has on record
/// (`None`: no state yet), exactly as the Lua script will decide it:
/// - `stored_end` = `Some(e)` with now_us < e: still that window, e;
/// - else `Fixed(ends)`: the first of `ends[0]`, `ends[1]`, `ends[2]` that is > now_us
///   (fallback `ends[2]` if none is: the clocks are more than a period apart);
/// - else `Rolling(len)`: now_us + len.
pub fn window_end(bounds: Bounds, stored_end: Option<u64>, now_us: u64) -> u64 {
    match (stored_end, bounds) {
        (Some(end), _) if now_us < end => end,
        (_, Bounds::Fixed(ends)) => ends.into_iter().find(|&e| e > now_us).unwrap_or(ends[2]),
        (_, Bounds::Rolling(len)) => now_us.saturating_add(len),
    }
}

/// `now_us` as a jiff instant, or `None` past jiff's range (checked first, because a jiff
/// error allocates and this is on the request path).
fn timestamp(now_us: u64) -> Option<Timestamp> {
    let us = i64::try_from(now_us).ok()?;
    let range = Timestamp::MIN.as_microsecond()..=Timestamp::MAX.as_microsecond();
    if range.contains(&us) {
        Timestamp::from_microsecond(us).ok()
    } else {
        None
    }
}

/// A boundary before 1970 (a zone east of UTC around now = 0) is 0 for a `u64` clock.
fn saturate(us: i64) -> u64 {
    u64::try_from(us).unwrap_or(0)
}

/// Windows of a fixed length from the epoch: only for instants jiff cannot place.
fn epoch_grid(now_us: u64, len_us: u64) -> [u64; 3] {
    let start = now_us - now_us % len_us;
    [
        start,
        start.saturating_add(len_us),
        start.saturating_add(2 * len_us),
    ]
}

/// The anchor date in month `m` of year `y`: `day`, or the month's last day if shorter.
fn anchor_in(y: i16, m: i8, day: u8) -> Option<Date> {
    let first = Date::new(y, m, 1).ok()?;
    let day = i8::try_from(day).ok()?.min(first.days_in_month());
    Date::new(y, m, day).ok()
}

fn month_before(y: i16, m: i8) -> (i16, i8) {
    if m == 1 {
        (y - 1, 12)
    } else {
        (y, m - 1)
    }
}

fn month_after(y: i16, m: i8) -> (i16, i8) {
    if m == 12 {
        (y + 1, 1)
    } else {
        (y, m + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: u64 = 60 * 1_000_000;
    const HOUR: u64 = 60 * MINUTE;
    const DAY: u64 = 24 * HOUR;
    const MS: u64 = 1_000;

    /// Unix µs of an RFC 3339 instant.
    fn us(instant: &str) -> u64 {
        let ts: Timestamp = instant.parse().unwrap();
        u64::try_from(ts.as_microsecond()).unwrap()
    }

    fn clock(period: Period, reset: Reset, tz: &str) -> QuotaClock {
        QuotaClock::new(period, reset, tz).unwrap()
    }

    fn fixed(c: &QuotaClock, now: &str) -> [u64; 3] {
        match c.bounds(us(now)) {
            Bounds::Fixed(ends) => ends,
            other => panic!("expected fixed bounds, got {other:?}"),
        }
    }

    fn rolling(c: &QuotaClock, now: &str) -> u64 {
        match c.bounds(us(now)) {
            Bounds::Rolling(len) => len,
            other => panic!("expected a rolling length, got {other:?}"),
        }
    }

    fn ends(instants: [&str; 3]) -> [u64; 3] {
        instants.map(us)
    }

    #[test]
    fn a_calendar_month_in_utc_runs_from_the_first_to_the_first() {
        let c = clock(Period::Month, Reset::Calendar, "UTC");
        assert_eq!(
            fixed(&c, "2026-12-15T10:00:00Z"),
            ends([
                "2026-12-01T00:00:00Z",
                "2027-01-01T00:00:00Z",
                "2027-02-01T00:00:00Z"
            ])
        );
    }

    #[test]
    fn exactly_at_a_boundary_the_new_window_has_begun() {
        let c = clock(Period::Month, Reset::Calendar, "UTC");
        assert_eq!(
            fixed(&c, "2027-01-01T00:00:00.000000Z"),
            ends([
                "2027-01-01T00:00:00Z",
                "2027-02-01T00:00:00Z",
                "2027-03-01T00:00:00Z"
            ])
        );
        assert_eq!(
            fixed(&c, "2026-12-31T23:59:59.999999Z"),
            ends([
                "2026-12-01T00:00:00Z",
                "2027-01-01T00:00:00Z",
                "2027-02-01T00:00:00Z"
            ])
        );
    }

    #[test]
    fn a_calendar_month_in_new_york_turns_at_local_midnight() {
        let c = clock(Period::Month, Reset::Calendar, "America/New_York");
        // 03:00Z on Dec 1 is still Nov 30 in New York. Nov 1 midnight is EDT (-4), the
        // later ones EST (-5).
        assert_eq!(
            fixed(&c, "2026-12-01T03:00:00Z"),
            ends([
                "2026-11-01T04:00:00Z",
                "2026-12-01T05:00:00Z",
                "2027-01-01T05:00:00Z"
            ])
        );
    }

    #[test]
    fn a_day_in_berlin_is_23_hours_in_spring_and_25_in_autumn() {
        let c = clock(Period::Day, Reset::Calendar, "Europe/Berlin");
        let spring = fixed(&c, "2026-03-29T12:00:00Z");
        assert_eq!(
            spring,
            ends([
                "2026-03-28T23:00:00Z",
                "2026-03-29T22:00:00Z",
                "2026-03-30T22:00:00Z"
            ])
        );
        assert_eq!(spring[1] - spring[0], 23 * HOUR);
        let autumn = fixed(&c, "2026-10-25T12:00:00Z");
        assert_eq!(
            autumn,
            ends([
                "2026-10-24T22:00:00Z",
                "2026-10-25T23:00:00Z",
                "2026-10-26T23:00:00Z"
            ])
        );
        assert_eq!(autumn[1] - autumn[0], 25 * HOUR);
    }

    #[test]
    fn an_hour_in_kolkata_turns_at_half_past_utc() {
        let c = clock(Period::Hour, Reset::Calendar, "Asia/Kolkata");
        assert_eq!(
            fixed(&c, "2026-06-01T10:45:00Z"),
            ends([
                "2026-06-01T10:30:00Z",
                "2026-06-01T11:30:00Z",
                "2026-06-01T12:30:00Z"
            ])
        );
        assert_eq!(
            fixed(&c, "2026-06-01T10:15:00Z"),
            ends([
                "2026-06-01T09:30:00Z",
                "2026-06-01T10:30:00Z",
                "2026-06-01T11:30:00Z"
            ])
        );
    }

    #[test]
    fn the_repeated_hour_of_a_dst_fold_is_one_two_hour_window() {
        // 02:15 local happens twice in Berlin on 2026-10-25, at 00:15Z (+02) and 01:15Z
        // (+01); compatibly, 02:00 is its first occurrence, so that hour runs 00:00Z-02:00Z.
        let c = clock(Period::Hour, Reset::Calendar, "Europe/Berlin");
        let fold = ends([
            "2026-10-25T00:00:00Z",
            "2026-10-25T02:00:00Z",
            "2026-10-25T03:00:00Z",
        ]);
        assert_eq!(fixed(&c, "2026-10-25T00:15:00Z"), fold);
        assert_eq!(fixed(&c, "2026-10-25T01:15:00Z"), fold);
    }

    #[test]
    fn the_hour_the_clocks_skip_is_no_window() {
        // Adelaide jumps from 02:00 (+09:30) to 03:00 (+10:30) at 16:30Z on 2026-10-03;
        // the 02:00 hour's window is empty, so 01:00 is followed by 03:00.
        let c = clock(Period::Hour, Reset::Calendar, "Australia/Adelaide");
        assert_eq!(
            fixed(&c, "2026-10-03T16:00:00Z"),
            ends([
                "2026-10-03T15:30:00Z",
                "2026-10-03T16:30:00Z",
                "2026-10-03T17:30:00Z"
            ])
        );
        assert_eq!(
            fixed(&c, "2026-10-03T16:30:00Z"),
            ends([
                "2026-10-03T16:30:00Z",
                "2026-10-03T17:30:00Z",
                "2026-10-03T18:30:00Z"
            ])
        );
    }

    #[test]
    fn a_day_the_clocks_skip_is_no_window() {
        // Samoa skipped 2011-12-30: 23:59:59 on the 29th (-10) was followed by 00:00 on the
        // 31st (+14), at 10:00Z on the 30th.
        let c = clock(Period::Day, Reset::Calendar, "Pacific/Apia");
        assert_eq!(
            fixed(&c, "2011-12-30T09:00:00Z"),
            ends([
                "2011-12-29T10:00:00Z",
                "2011-12-30T10:00:00Z",
                "2011-12-31T10:00:00Z"
            ])
        );
    }

    #[test]
    fn a_midnight_inside_a_dst_gap_starts_its_day_late() {
        // A made-up zone whose clocks jump from 23:30 to 00:30 (-05 to -04) on 2026-03-08:
        // compatibly, midnight of the 9th is 01:00 local (05:00Z), so at 00:45 local the
        // 8th's window is still open.
        let tz = TimeZone::posix("XST5XDT,M3.2.0/23:30,M11.1.0/1").unwrap();
        let c = QuotaClock {
            period: Period::Day,
            reset: Reset::Calendar,
            tz_name: "XST5XDT".into(),
            tz,
        };
        assert_eq!(
            fixed(&c, "2026-03-09T04:45:00Z"),
            ends([
                "2026-03-08T05:00:00Z",
                "2026-03-09T05:00:00Z",
                "2026-03-10T04:00:00Z"
            ])
        );
    }

    #[test]
    fn anchor_31_falls_on_the_last_day_of_february() {
        let c = clock(Period::Month, Reset::Anchor(31), "UTC");
        assert_eq!(
            fixed(&c, "2027-02-15T00:00:00Z"),
            ends([
                "2027-01-31T00:00:00Z",
                "2027-02-28T00:00:00Z",
                "2027-03-31T00:00:00Z"
            ])
        );
        assert_eq!(
            fixed(&c, "2027-03-01T00:00:00Z"),
            ends([
                "2027-02-28T00:00:00Z",
                "2027-03-31T00:00:00Z",
                "2027-04-30T00:00:00Z"
            ])
        );
        assert_eq!(
            fixed(&c, "2028-02-20T00:00:00Z"),
            ends([
                "2028-01-31T00:00:00Z",
                "2028-02-29T00:00:00Z",
                "2028-03-31T00:00:00Z"
            ])
        );
    }

    #[test]
    fn anchor_15_runs_from_the_15th_to_the_15th() {
        let c = clock(Period::Month, Reset::Anchor(15), "UTC");
        assert_eq!(
            fixed(&c, "2026-12-20T08:00:00Z"),
            ends([
                "2026-12-15T00:00:00Z",
                "2027-01-15T00:00:00Z",
                "2027-02-15T00:00:00Z"
            ])
        );
        assert_eq!(
            fixed(&c, "2026-12-10T08:00:00Z"),
            ends([
                "2026-11-15T00:00:00Z",
                "2026-12-15T00:00:00Z",
                "2027-01-15T00:00:00Z"
            ])
        );
    }

    #[test]
    fn on_the_anchor_day_the_window_turns_at_local_midnight() {
        let c = clock(Period::Month, Reset::Anchor(15), "America/New_York");
        // Local midnight of Dec 15 is 05:00Z; one µs before it is still the 14th.
        assert_eq!(
            fixed(&c, "2026-12-15T04:59:59.999999Z"),
            ends([
                "2026-11-15T05:00:00Z",
                "2026-12-15T05:00:00Z",
                "2027-01-15T05:00:00Z"
            ])
        );
        assert_eq!(
            fixed(&c, "2026-12-15T05:00:00Z"),
            ends([
                "2026-12-15T05:00:00Z",
                "2027-01-15T05:00:00Z",
                "2027-02-15T05:00:00Z"
            ])
        );
    }

    #[test]
    fn a_rolling_month_from_january_31_ends_on_the_last_of_february() {
        // jiff clamps: Jan 31 + 1 month = Feb 28 (Feb 29 in a leap year), same time of day.
        let c = clock(Period::Month, Reset::Rolling, "UTC");
        assert_eq!(rolling(&c, "2027-01-31T10:00:00Z"), 28 * DAY);
        assert_eq!(rolling(&c, "2028-01-31T10:00:00Z"), 29 * DAY);
        assert_eq!(rolling(&c, "2027-03-15T10:00:00Z"), 31 * DAY);
    }

    #[test]
    fn a_rolling_day_across_dst_is_23_or_25_hours() {
        let c = clock(Period::Day, Reset::Rolling, "Europe/Berlin");
        // Noon local to noon local.
        assert_eq!(rolling(&c, "2026-03-28T11:00:00Z"), 23 * HOUR);
        assert_eq!(rolling(&c, "2026-10-24T10:00:00Z"), 25 * HOUR);
        assert_eq!(rolling(&c, "2026-06-01T10:00:00Z"), 24 * HOUR);
    }

    #[test]
    fn a_rolling_hour_is_an_hour() {
        let c = clock(Period::Hour, Reset::Rolling, "Asia/Kolkata");
        assert_eq!(rolling(&c, "2026-06-01T10:17:00Z"), HOUR);
    }

    #[test]
    fn a_stored_end_still_ahead_keeps_its_window() {
        let b = Bounds::Fixed([100, 200, 300]);
        assert_eq!(window_end(b, Some(150), 120), 150);
        assert_eq!(window_end(Bounds::Rolling(1_000), Some(150), 120), 150);
    }

    #[test]
    fn a_stored_end_that_has_passed_gives_way_to_the_bounds() {
        let b = Bounds::Fixed([100, 200, 300]);
        assert_eq!(window_end(b, Some(100), 120), 200);
        assert_eq!(
            window_end(b, Some(200), 200),
            300,
            "a window's end is in the next one"
        );
        assert_eq!(window_end(b, None, 120), 200);
        assert_eq!(window_end(Bounds::Rolling(1_000), Some(100), 120), 1_120);
    }

    #[test]
    fn a_store_clock_behind_just_after_a_boundary_still_counts_the_old_window() {
        let c = clock(Period::Day, Reset::Calendar, "UTC");
        let boundary = us("2026-06-02T00:00:00Z");
        let bounds = c.bounds(boundary + 2 * MS);
        let store_now = boundary - 3 * MS;
        assert_eq!(window_end(bounds, None, store_now), boundary);
    }

    #[test]
    fn a_store_clock_ahead_just_before_a_boundary_counts_the_new_window() {
        let c = clock(Period::Day, Reset::Calendar, "UTC");
        let boundary = us("2026-06-02T00:00:00Z");
        let bounds = c.bounds(boundary - 2 * MS);
        let store_now = boundary + 3 * MS;
        assert_eq!(window_end(bounds, None, store_now), boundary + DAY);
    }

    #[test]
    fn clocks_more_than_a_period_apart_fall_back_to_the_last_end() {
        let b = Bounds::Fixed([100, 200, 300]);
        assert_eq!(window_end(b, None, 5_000), 300);
    }

    #[test]
    fn an_unknown_time_zone_is_refused_by_name() {
        let err = QuotaClock::new(Period::Day, Reset::Calendar, "Mars/Olympus").unwrap_err();
        assert_eq!(err, QuotaError::UnknownTimeZone("Mars/Olympus".into()));
        assert_eq!(err.field(), "time_zone");
    }

    #[test]
    fn anchor_days_outside_1_to_31_are_refused() {
        for day in [0, 32] {
            let err = QuotaClock::new(Period::Month, Reset::Anchor(day), "UTC").unwrap_err();
            assert_eq!(err, QuotaError::AnchorDay(i64::from(day)));
            assert_eq!(err.field(), "anchor_day");
        }
    }

    #[test]
    fn an_anchor_needs_a_monthly_period() {
        let err = QuotaClock::new(Period::Day, Reset::Anchor(15), "UTC").unwrap_err();
        assert_eq!(err, QuotaError::AnchorNeedsMonth(Period::Day));
        assert_eq!(err.field(), "anchor_day");
    }

    #[test]
    fn a_clock_keeps_what_it_was_built_with() {
        let c = clock(Period::Month, Reset::Anchor(3), "europe/berlin");
        assert_eq!(c.period(), Period::Month);
        assert_eq!(c.reset(), Reset::Anchor(3));
        assert_eq!(c.time_zone(), "Europe/Berlin");
    }

    #[test]
    fn periods_parse_and_print_their_names() {
        for p in [Period::Hour, Period::Day, Period::Month] {
            assert_eq!(p.to_string().parse::<Period>(), Ok(p));
            assert_eq!(serde_json::to_string(&p).unwrap(), format!("\"{p}\""));
        }
        let err = "week".parse::<Period>().unwrap_err();
        assert!(
            err.contains("\"hour\", \"day\" or \"month\"") && err.contains("week"),
            "{err}"
        );
    }

    #[test]
    fn nominal_windows_are_an_hour_a_day_and_30_days() {
        let secs = |p| clock(p, Reset::Calendar, "UTC").nominal_secs();
        assert_eq!(
            [secs(Period::Hour), secs(Period::Day), secs(Period::Month)],
            [3_600, 86_400, 2_592_000]
        );
    }

    #[test]
    fn every_instant_of_a_year_sits_inside_its_bounds() {
        let resets = [
            (Period::Hour, Reset::Calendar),
            (Period::Day, Reset::Calendar),
            (Period::Month, Reset::Calendar),
            (Period::Month, Reset::Anchor(31)),
            (Period::Month, Reset::Anchor(1)),
        ];
        // Lord Howe shifts by 30 minutes; Santiago and Havana change their clocks at midnight.
        let zones = [
            "UTC",
            "Europe/Berlin",
            "Asia/Kolkata",
            "Australia/Adelaide",
            "Australia/Lord_Howe",
            "America/Santiago",
            "America/Havana",
        ];
        let (from, to) = (us("2026-01-01T00:00:00Z"), us("2027-01-01T00:00:00Z"));
        for tz in zones {
            for (period, reset) in resets {
                let c = clock(period, reset, tz);
                let mut now = from;
                while now < to {
                    // Straight from the calendar: the epoch-grid fallback could hide a miss.
                    let e = c.fixed_ends(now).expect("calendar bounds");
                    assert!(
                        e[0] <= now && now < e[1] && e[1] < e[2],
                        "{tz} {period} {reset:?} at {now}: {e:?}"
                    );
                    // The window after is the one that starts at this one's end.
                    let after = c.fixed_ends(e[1]).expect("calendar bounds");
                    assert_eq!(&after[..2], &e[1..], "{tz} {period} {reset:?} at {now}");
                    now += 67 * MINUTE + 13 * 1_000_000;
                }
            }
        }
    }

    #[test]
    fn instants_past_the_calendar_fall_back_to_nominal_windows() {
        let c = clock(Period::Month, Reset::Calendar, "UTC");
        let far = us("9999-06-01T00:00:00Z") * 2;
        let Bounds::Fixed(e) = c.bounds(far) else {
            panic!("fixed")
        };
        assert!(e[0] <= far && far < e[1] && e[1] < e[2], "{e:?}");
        assert_eq!(e[1] - e[0], 30 * DAY);
        assert!(matches!(c.bounds(u64::MAX), Bounds::Fixed(_)));
        let r = clock(Period::Month, Reset::Rolling, "UTC");
        assert_eq!(r.bounds(u64::MAX), Bounds::Rolling(30 * DAY));
    }
}
