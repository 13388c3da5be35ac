//! Usage history: one hash per client per UTC day (`Keys::usage`), in the client's slot,
//! added to by `lua/usage_add.lua` (idempotent per gateway batch) and expiring the
//! retention after the day ends. A batch is one `EVALSHA` per client-day it touches,
//! pipelined: on one server in chunks, on a cluster per slot (a client's days share one).

use std::collections::BTreeMap;

use async_trait::async_trait;
use futures_util::stream::{self, StreamExt, TryStreamExt};
use redis::aio::ConnectionLike;

use super::backend::{retrying, Backend, RedisStore};
use crate::domain::ClientId;
use crate::store::{
    day_name, key_slot, StoreError, UsageBatch, UsageCounts, UsageHistory, UsageRow, DAY_S, HOUR_S,
};

/// Script calls per pipeline on one server: a batch of thousands of clients does not
/// hold Redis for one long read.
const CHUNK: usize = 256;

/// Slots a cluster flush writes at once.
const SLOTS_AT_ONCE: usize = 32;

/// The hash's count fields, by suffix.
const ADMITTED: &str = "a";
const REFUSED: &str = "r";
const COST: &str = "c";
const UNMETERED: &str = "u";
const UNMETERED_COST: &str = "uc";

#[async_trait]
impl UsageHistory for RedisStore {
    async fn add(&self, batch: &UsageBatch) -> Result<(), StoreError> {
        // (client, day start) → the script's field/amount arguments.
        let mut days: BTreeMap<(&ClientId, u64), Vec<String>> = BTreeMap::new();
        for e in &batch.entries {
            let day = e.hour_s - e.hour_s % DAY_S;
            let hour = (e.hour_s - day) / HOUR_S;
            let args = days.entry((&e.client, day)).or_default();
            let mut put = |count: &str, amount: String| {
                args.push(format!("{}|{hour:02}|{count}", e.limit));
                args.push(amount);
            };
            let c = &e.counts;
            if c.admitted > 0 {
                put(ADMITTED, c.admitted.to_string());
            }
            if c.refused > 0 {
                put(REFUSED, c.refused.to_string());
            }
            if c.cost != 0.0 {
                put(COST, c.cost.to_string());
            }
            if c.unmetered > 0 {
                put(UNMETERED, c.unmetered.to_string());
            }
            if c.unmetered_cost != 0.0 {
                put(UNMETERED_COST, c.unmetered_cost.to_string());
            }
        }
        let calls: Vec<(u16, redis::Cmd)> = days
            .into_iter()
            .filter(|(_, args)| !args.is_empty())
            .map(|((client, day), args)| {
                let key = self.keys.usage(client, &day_name(day));
                let mut cmd = redis::cmd("EVALSHA");
                cmd.arg(self.usage_add.get_hash())
                    .arg(1)
                    .arg(&key)
                    .arg(&batch.gateway)
                    .arg(batch.seq)
                    .arg(day + DAY_S + batch.retention_s)
                    .arg(args);
                (key_slot(&key), cmd)
            })
            .collect();
        match &*self.backend {
            Backend::Single { .. } => {
                for chunk in calls.chunks(CHUNK) {
                    let mut c = self.conn().await?;
                    self.send(&mut c, chunk.iter().map(|(_, cmd)| cmd)).await?;
                }
                Ok(())
            }
            Backend::Cluster(_) => {
                let mut by_slot: BTreeMap<u16, Vec<redis::Cmd>> = BTreeMap::new();
                for (slot, cmd) in calls {
                    by_slot.entry(slot).or_default().push(cmd);
                }
                stream::iter(by_slot.into_values())
                    .map(|cmds| self.send_slot(cmds))
                    .buffer_unordered(SLOTS_AT_ONCE)
                    .try_collect::<Vec<()>>()
                    .await?;
                Ok(())
            }
        }
    }

    async fn read(
        &self,
        client: &ClientId,
        from_s: u64,
        to_s: u64,
    ) -> Result<Vec<UsageRow>, StoreError> {
        let first = from_s - from_s % DAY_S;
        let days: Vec<u64> = (first..to_s).step_by(DAY_S as usize).collect();
        if days.is_empty() {
            return Ok(Vec::new());
        }
        let hashes: Vec<Vec<(String, String)>> = retrying!(self, |c| async {
            let mut pipe = redis::pipe();
            for day in &days {
                pipe.hgetall(self.keys.usage(client, &day_name(*day)));
            }
            Ok(pipe.query_async(c).await?)
        }
        .await)?;
        let mut rows: BTreeMap<(u64, String), UsageCounts> = BTreeMap::new();
        for (day, fields) in days.iter().zip(hashes) {
            for (field, value) in fields {
                let Some((limit, hour, count)) = parse_field(&field) else {
                    continue;
                };
                let hour_s = day + hour * HOUR_S;
                if hour_s < from_s || hour_s >= to_s {
                    continue;
                }
                let counts = rows.entry((hour_s, limit.to_string())).or_default();
                let int = || value.parse::<u64>().unwrap_or(0);
                let float = || value.parse::<f64>().unwrap_or(0.0);
                match count {
                    ADMITTED => counts.admitted += int(),
                    REFUSED => counts.refused += int(),
                    COST => counts.cost += float(),
                    UNMETERED => counts.unmetered += int(),
                    UNMETERED_COST => counts.unmetered_cost += float(),
                    _ => {}
                }
            }
        }
        Ok(rows
            .into_iter()
            .map(|((hour_s, limit), counts)| UsageRow {
                limit,
                hour_s,
                counts,
            })
            .collect())
    }
}

impl RedisStore {
    /// Sends one slot's calls on a connection of their own.
    async fn send_slot(&self, cmds: Vec<redis::Cmd>) -> Result<(), StoreError> {
        let mut c = self.conn().await?;
        self.send(&mut c, cmds.iter()).await
    }

    /// Sends `cmds` (the script's calls) in one pipeline; when Redis does not have the
    /// script (restarted, flushed), loads it and sends them again: each call is idempotent.
    async fn send<'c>(
        &self,
        c: &mut (impl ConnectionLike + Send),
        cmds: impl Iterator<Item = &'c redis::Cmd>,
    ) -> Result<(), StoreError> {
        let mut pipe = redis::pipe();
        for cmd in cmds {
            pipe.add_command(cmd.clone()).ignore();
        }
        match pipe.query_async::<()>(c).await {
            Err(e) if e.code() == Some("NOSCRIPT") => {
                self.usage_add.load_async(c).await?;
                Ok(pipe.query_async::<()>(c).await?)
            }
            r => Ok(r?),
        }
    }
}

/// `<limit>|<hour>|<count>` → its parts; `None` for other fields (a gateway's last batch).
fn parse_field(field: &str) -> Option<(&str, u64, &str)> {
    let (rest, count) = field.rsplit_once('|')?;
    let (limit, hour) = rest.rsplit_once('|')?;
    Some((limit, hour.parse().ok().filter(|h| *h < 24)?, count))
}

#[cfg(test)]
mod tests {
    use super::parse_field;

    #[test]
    fn a_field_names_its_limit_hour_and_count() {
        assert_eq!(parse_field("daily|07|a"), Some(("daily", 7, "a")));
        assert_eq!(parse_field("daily|23|uc"), Some(("daily", 23, "uc")));
        assert_eq!(parse_field("~3f9a"), None);
        assert_eq!(parse_field("daily|24|a"), None);
    }
}
