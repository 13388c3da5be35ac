//! Instants as the admin API and the import file give them.

use std::str::FromStr;

/// What an instant must look like, for the problem a bad one gets.
const WANTED: &str = "must be an RFC 3339 time, e.g. \"2030-01-01T00:00:00Z\"";

/// An RFC 3339 time in unix seconds, a fraction of a second rounded up.
pub fn unix_s_of_rfc3339(s: &str) -> Result<u64, String> {
    let t = jiff::Timestamp::from_str(s).map_err(|_| format!("{WANTED} (got {s:?})"))?;
    let secs = t.as_second() + i64::from(t.subsec_nanosecond() > 0);
    u64::try_from(secs).map_err(|_| "must be after 1970".into())
}

/// [`unix_s_of_rfc3339`]'s problem for a value that is not a string at all.
pub fn rfc3339_wanted() -> String {
    WANTED.into()
}
