//! Usage history: one hash per client per UTC day (`Keys::usage`), tagged as the client's
//! state group, added to by `lua/usage_add.lua` (idempotent per gateway batch) and
//! expiring the retention after the day ends. A batch is one `EVALSHA` per state group and
//! [`KEYS_PER_CALL`] client-days, pipelined: on one server (one group) in pipelines of
//! [`CALLS_PER_PIPELINE`], on a cluster per slot, [`SLOTS_AT_ONCE`] at a time.

use std::collections::BTreeMap;

use async_trait::async_trait;
use futures_util::stream::{self, StreamExt, TryStreamExt};
use redis::aio::ConnectionLike;

use super::backend::{retrying, Backend, RedisStore};
use crate::domain::ClientId;
use crate::store::{
    day_name, key_slot, StoreError, UsageBatch, UsageCounts, UsageHistory, UsageRow, DAY_S, HOUR_S,
};

/// Client-days per script call: a call adds a few fields to each, so it holds Redis for
/// well under a millisecond.
const KEYS_PER_CALL: usize = 100;

/// Script calls per pipeline on one server.
const CALLS_PER_PIPELINE: usize = 64;

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
        // A script call per state group (one slot) and chunk of its clients' days.
        let mut by_group: BTreeMap<usize, Vec<(String, u64, Vec<String>)>> = BTreeMap::new();
        for ((client, day), args) in days {
            if args.is_empty() {
                continue;
            }
            let (group, key) = self.usage_key(client, day);
            by_group.entry(group).or_default().push((key, day, args));
        }
        let mut calls: Vec<(u16, redis::Cmd)> = Vec::new();
        for days in by_group.into_values() {
            for chunk in days.chunks(KEYS_PER_CALL) {
                let mut cmd = redis::cmd("EVALSHA");
                cmd.arg(self.usage_add.get_hash()).arg(chunk.len());
                for (key, _, _) in chunk {
                    cmd.arg(key);
                }
                cmd.arg(&batch.gateway).arg(batch.seq);
                for (_, day, args) in chunk {
                    cmd.arg(day + DAY_S + batch.retention_s)
                        .arg(args.len() / 2)
                        .arg(args);
                }
                calls.push((key_slot(&chunk[0].0), cmd));
            }
        }
        match &*self.backend {
            Backend::Single { .. } => {
                for chunk in calls.chunks(CALLS_PER_PIPELINE) {
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
                pipe.hgetall(self.usage_key(client, *day).1);
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
    /// `client`'s record of the day starting at `day` (unix s), and its state group: the
    /// usage key carries the group's tag, beside the client's bucket state.
    fn usage_key(&self, client: &ClientId, day: u64) -> (usize, String) {
        let groups = self.buckets.groups();
        let (group, _) = groups.locate(&self.keys.bucket(client));
        let key = groups.key(group);
        let tag = key
            .split_once('{')
            .and_then(|(_, t)| t.split_once('}'))
            .map_or("0", |(t, _)| t);
        (group, self.keys.usage(tag, client, &day_name(day)))
    }

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
