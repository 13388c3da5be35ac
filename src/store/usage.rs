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

/// What a gateway's checkpoint write says (`UsageHistory::checkpoint`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Checkpoint<'a> {
    /// What it holds has not changed: it is only noted alive.
    Same,
    /// It holds nothing.
    Empty,
    /// What it holds, from [`encode_checkpoint`].
    Holds(&'a [u8]),
}

/// What a checkpoint write found (`UsageHistory::checkpoint`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Checkpointed {
    Written,
    /// Not written: the gateway, noted before, was not any more. Another gateway took
    /// its checkpoint, as a silent one's, and adds what it held; the gateway adds those
    /// batches as they were (each is added once) and merges nothing more into them.
    Adopted,
}

/// The format of a checkpoint: what a gateway holds and has not yet folded into the
/// history, as batches (each with its number: adding one twice adds it once), so that
/// another gateway can add them if this one dies.
///
/// Version byte 1, then the batch count; per batch: the gateway, its number, retention
/// and entries; per entry: client, limit, hour (hours since the epoch), a byte saying
/// which counts follow, and those counts (integers as LEB128, a cost as LEB128 when
/// whole, else as the `f64`'s 8 bytes). An entry takes its client id and
/// limit name plus about 10 bytes.
const CHECKPOINT_V1: u8 = 1;

const HAS_ADMITTED: u8 = 1;
const HAS_REFUSED: u8 = 2;
const HAS_COST: u8 = 4;
const COST_WHOLE: u8 = 8;
const HAS_UNMETERED: u8 = 16;
const HAS_UNMETERED_COST: u8 = 32;
const UNMETERED_COST_WHOLE: u8 = 64;

/// `batches` as a checkpoint.
pub fn encode_checkpoint(batches: &[&UsageBatch]) -> Vec<u8> {
    let entries: usize = batches.iter().map(|b| b.entries.len()).sum();
    let mut out = Vec::with_capacity(16 + entries * 28);
    out.push(CHECKPOINT_V1);
    put_uint(&mut out, batches.len() as u64);
    for b in batches {
        put_str(&mut out, &b.gateway);
        put_uint(&mut out, b.seq);
        put_uint(&mut out, b.retention_s);
        put_uint(&mut out, b.entries.len() as u64);
        for e in &b.entries {
            put_str(&mut out, e.client.as_str());
            put_str(&mut out, &e.limit);
            put_uint(&mut out, e.hour_s / HOUR_S);
            let c = &e.counts;
            let whole = |v: f64| (0.0..9.0e15).contains(&v) && v.fract() == 0.0;
            let mut has = 0;
            for (on, bit) in [
                (c.admitted > 0, HAS_ADMITTED),
                (c.refused > 0, HAS_REFUSED),
                (c.cost != 0.0, HAS_COST),
                (c.cost != 0.0 && whole(c.cost), COST_WHOLE),
                (c.unmetered > 0, HAS_UNMETERED),
                (c.unmetered_cost != 0.0, HAS_UNMETERED_COST),
                (
                    c.unmetered_cost != 0.0 && whole(c.unmetered_cost),
                    UNMETERED_COST_WHOLE,
                ),
            ] {
                if on {
                    has |= bit;
                }
            }
            out.push(has);
            if has & HAS_ADMITTED != 0 {
                put_uint(&mut out, c.admitted);
            }
            if has & HAS_REFUSED != 0 {
                put_uint(&mut out, c.refused);
            }
            if has & HAS_COST != 0 {
                put_cost(&mut out, c.cost, has & COST_WHOLE != 0);
            }
            if has & HAS_UNMETERED != 0 {
                put_uint(&mut out, c.unmetered);
            }
            if has & HAS_UNMETERED_COST != 0 {
                put_cost(&mut out, c.unmetered_cost, has & UNMETERED_COST_WHOLE != 0);
            }
        }
    }
    out
}

/// The batches of a checkpoint, in the order written; `Err` names what is wrong with it.
pub fn decode_checkpoint(mut bytes: &[u8]) -> Result<Vec<UsageBatch>, String> {
    let b = &mut bytes;
    if take(b, 1)?[0] != CHECKPOINT_V1 {
        return Err("not a version 1 checkpoint".into());
    }
    let count = take_uint(b)?;
    let mut batches = Vec::new();
    for _ in 0..count {
        let gateway = take_str(b)?.to_string();
        let seq = take_uint(b)?;
        let retention_s = take_uint(b)?;
        let n = take_uint(b)?;
        // Each entry takes at least 5 bytes: a count past what is left is corrupt.
        if n > b.len() as u64 / 5 {
            return Err("more entries than bytes".into());
        }
        let mut entries = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let client = ClientId::parse(take_str(b)?).map_err(|e| e.to_string())?;
            let limit = take_str(b)?.to_string();
            let hour_s = take_uint(b)?
                .checked_mul(HOUR_S)
                .ok_or("an hour out of range")?;
            let has = take(b, 1)?[0];
            let mut counts = UsageCounts::default();
            if has & HAS_ADMITTED != 0 {
                counts.admitted = take_uint(b)?;
            }
            if has & HAS_REFUSED != 0 {
                counts.refused = take_uint(b)?;
            }
            if has & HAS_COST != 0 {
                counts.cost = take_cost(b, has & COST_WHOLE != 0)?;
            }
            if has & HAS_UNMETERED != 0 {
                counts.unmetered = take_uint(b)?;
            }
            if has & HAS_UNMETERED_COST != 0 {
                counts.unmetered_cost = take_cost(b, has & UNMETERED_COST_WHOLE != 0)?;
            }
            entries.push(UsageEntry {
                client,
                limit,
                hour_s,
                counts,
            });
        }
        batches.push(UsageBatch {
            gateway,
            seq,
            retention_s,
            entries,
        });
    }
    if !b.is_empty() {
        return Err("bytes after the last batch".into());
    }
    Ok(batches)
}

fn put_uint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    put_uint(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

fn put_cost(out: &mut Vec<u8>, v: f64, whole: bool) {
    if whole {
        put_uint(out, v as u64);
    } else {
        out.extend_from_slice(&v.to_le_bytes());
    }
}

fn take<'a>(b: &mut &'a [u8], n: usize) -> Result<&'a [u8], String> {
    if b.len() < n {
        return Err("cut short".into());
    }
    let (head, rest) = b.split_at(n);
    *b = rest;
    Ok(head)
}

fn take_uint(b: &mut &[u8]) -> Result<u64, String> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = take(b, 1)?[0];
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err("a number too long".into())
}

fn take_str<'a>(b: &mut &'a [u8]) -> Result<&'a str, String> {
    let n = usize::try_from(take_uint(b)?).map_err(|_| "a name too long")?;
    std::str::from_utf8(take(b, n)?).map_err(|_| "a name not UTF-8".into())
}

fn take_cost(b: &mut &[u8], whole: bool) -> Result<f64, String> {
    if whole {
        return Ok(take_uint(b)? as f64);
    }
    let raw: [u8; 8] = take(b, 8)?.try_into().map_err(|_| "cut short")?;
    Ok(f64::from_le_bytes(raw))
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
    fn a_checkpoint_gives_back_its_batches_and_refuses_what_is_not_one() {
        let entry = |client: &str, limit: &str, hour: u64, counts: UsageCounts| UsageEntry {
            client: ClientId::parse(client).unwrap(),
            limit: limit.into(),
            hour_s: hour * HOUR_S,
            counts,
        };
        let a = UsageBatch {
            gateway: "3f9a".into(),
            seq: 7,
            retention_s: 35 * DAY_S,
            entries: vec![
                entry(
                    "acme",
                    "per-second",
                    493_000,
                    UsageCounts {
                        admitted: 300,
                        refused: 2,
                        cost: 300.0,
                        ..UsageCounts::default()
                    },
                ),
                entry(
                    "beta.co",
                    "monthly",
                    493_001,
                    UsageCounts {
                        admitted: 1,
                        cost: 2.5,
                        unmetered: 1 << 40,
                        unmetered_cost: 0.1,
                        ..UsageCounts::default()
                    },
                ),
                entry(
                    "acme",
                    "daily",
                    0,
                    UsageCounts {
                        refused: 1,
                        cost: -1.0,
                        ..UsageCounts::default()
                    },
                ),
            ],
        };
        let b = UsageBatch {
            seq: 9,
            entries: Vec::new(),
            ..a.clone()
        };
        let bytes = encode_checkpoint(&[&a, &b]);
        let back = decode_checkpoint(&bytes).unwrap();
        assert_eq!(back.len(), 2);
        assert_eq!((back[0].gateway.as_str(), back[0].seq), ("3f9a", 7));
        assert_eq!(back[0].retention_s, a.retention_s);
        assert_eq!(back[0].entries, a.entries);
        assert_eq!((back[1].seq, back[1].entries.len()), (9, 0));
        assert_eq!(decode_checkpoint(&encode_checkpoint(&[])).unwrap().len(), 0);
        // Every cut is refused, never read as fewer counts.
        for end in 0..bytes.len() {
            assert!(decode_checkpoint(&bytes[..end]).is_err(), "cut at {end}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode_checkpoint(&longer).is_err());
        let mut other = bytes;
        other[0] = 2;
        assert!(decode_checkpoint(&other).is_err());
    }

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
