//! Usage history: one hash per client per UTC day (`Keys::usage`), tagged as the client's
//! state group, added to by `lua/usage_add.lua` (idempotent per gateway batch) and
//! expiring the retention after the day ends. A batch is one `EVALSHA` per state group and
//! [`KEYS_PER_CALL`] client-days, pipelined: on one server (one group) in pipelines of
//! [`CALLS_PER_PIPELINE`], on a cluster per slot, [`SLOTS_AT_ONCE`] at a time.

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::stream::{self, StreamExt, TryStreamExt};
use redis::aio::ConnectionLike;

use super::backend::{retrying, Backend, RedisStore};
use crate::domain::ClientId;
use crate::store::{
    day_name, key_slot, Checkpoint, Checkpointed, StoreError, UsageBatch, UsageCounts,
    UsageHistory, UsageRow, DAY_S, HOUR_S,
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

    async fn checkpoint(
        &self,
        gateway: &str,
        held: Checkpoint<'_>,
        noted: bool,
    ) -> Result<Checkpointed, StoreError> {
        let (how, bytes): (&str, &[u8]) = match held {
            Checkpoint::Same => ("same", b""),
            Checkpoint::Empty => ("empty", b""),
            Checkpoint::Holds(bytes) => ("holds", bytes),
        };
        let mut inv = self.usage_checkpoint.prepare_invoke();
        inv.key(self.keys.usage_fold(&format!("ck:{gateway}")))
            .key(self.keys.usage_fold("gateways"))
            .arg(gateway)
            .arg(if noted { "1" } else { "0" })
            .arg(how)
            .arg(bytes);
        let reply: String = retrying!(self, |c| async { Ok(inv.invoke_async(c).await?) }.await)?;
        match reply.as_str() {
            "ok" => Ok(Checkpointed::Written),
            "adopted" => Ok(Checkpointed::Adopted),
            other => Err(StoreError::Protocol(format!(
                "usage_checkpoint.lua answered {other:?}"
            ))),
        }
    }

    async fn adopt(&self, grace: Duration) -> Result<Option<(String, Vec<u8>)>, StoreError> {
        let grace_ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX);
        let mut find = self.usage_orphan.prepare_invoke();
        find.key(self.keys.usage_fold("gateways"))
            .key(self.keys.usage_fold("adoptions"))
            .arg(grace_ms);
        let found: Option<String> =
            retrying!(self, |c| async { Ok(find.invoke_async(c).await?) }.await)?;
        let Some(gateway) = found else {
            return Ok(None);
        };
        let mut take = self.usage_adopt.prepare_invoke();
        take.key(self.keys.usage_fold("gateways"))
            .key(self.keys.usage_fold("adoptions"))
            .key(self.keys.usage_fold(&format!("ck:{gateway}")))
            .key(self.keys.usage_fold(&format!("adopted:{gateway}")))
            .arg(&gateway)
            .arg(grace_ms);
        let held: Option<Vec<u8>> =
            retrying!(self, |c| async { Ok(take.invoke_async(c).await?) }.await)?;
        Ok(held.map(|held| (gateway, held)))
    }

    async fn release(&self, gateway: &str) -> Result<(), StoreError> {
        let mut pipe = redis::pipe();
        pipe.atomic()
            .del(self.keys.usage_fold(&format!("adopted:{gateway}")))
            .ignore()
            .zrem(self.keys.usage_fold("adoptions"), gateway)
            .ignore();
        retrying!(self, |c| async { Ok(pipe.query_async::<()>(c).await?) }
            .await)
    }

    async fn retire(&self, gateway: &str) -> Result<(), StoreError> {
        let mut pipe = redis::pipe();
        pipe.atomic()
            .del(self.keys.usage_fold(&format!("ck:{gateway}")))
            .ignore()
            .zrem(self.keys.usage_fold("gateways"), gateway)
            .ignore();
        retrying!(self, |c| async { Ok(pipe.query_async::<()>(c).await?) }
            .await)
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
    use std::time::Duration;

    use redis::AsyncCommands;
    use tollgate_testkit::RedisServer;

    use super::parse_field;
    use crate::domain::ClientId;
    use crate::store::redis::RedisStore;
    use crate::store::{
        decode_checkpoint, encode_checkpoint, Checkpoint, Checkpointed, UsageBatch, UsageCounts,
        UsageEntry, UsageHistory, DAY_S, HOUR_S,
    };

    fn store(redis: &RedisServer) -> RedisStore {
        RedisStore::for_test(redis)
    }

    fn batch(gateway: &str, seq: u64, admitted: u64) -> UsageBatch {
        let hour_s = 1_796_000_000 / HOUR_S * HOUR_S;
        UsageBatch {
            gateway: gateway.into(),
            seq,
            retention_s: 35 * DAY_S,
            entries: vec![UsageEntry {
                client: ClientId::parse("acme").unwrap(),
                limit: "per-second".into(),
                hour_s,
                counts: UsageCounts {
                    admitted,
                    cost: admitted as f64,
                    ..UsageCounts::default()
                },
            }],
        }
    }

    async fn admitted(store: &RedisStore) -> u64 {
        let acme = ClientId::parse("acme").unwrap();
        let rows = store
            .read(&acme, 1_795_000_000, 1_797_000_000)
            .await
            .unwrap();
        rows.iter().map(|r| r.counts.admitted).sum()
    }

    const GRACE: Duration = Duration::from_millis(300);
    const SILENCE: Duration = Duration::from_millis(450);

    #[tokio::test]
    async fn a_silent_gateways_checkpoint_is_taken_once_and_each_batch_added_once() {
        // Arrange: gateway aa holds batch 1 (being added) and batch 2 (open).
        let redis = RedisServer::start().unwrap();
        let store = store(&redis);
        let (one, two) = (batch("aa", 1, 10), batch("aa", 2, 5));
        let held = encode_checkpoint(&[&one, &two]);
        store
            .checkpoint("aa", Checkpoint::Holds(&held), false)
            .await
            .unwrap();
        store.add(&one).await.unwrap();
        assert_eq!(
            store.adopt(GRACE).await.unwrap(),
            None,
            "aa is not silent yet"
        );

        // Act: aa goes silent; two gateways look for it at once.
        tokio::time::sleep(SILENCE).await;
        let (a, b) = tokio::join!(store.adopt(GRACE), store.adopt(GRACE));
        let taken: Vec<_> = [a.unwrap(), b.unwrap()].into_iter().flatten().collect();

        // Assert: one took it, whole; adding it again, and aa adding its batches after it
        // came back, adds each once.
        assert_eq!(taken.len(), 1);
        let (gateway, bytes) = &taken[0];
        assert_eq!(gateway, "aa");
        for b in decode_checkpoint(bytes).unwrap() {
            store.add(&b).await.unwrap();
        }
        store.add(&two).await.unwrap();
        assert_eq!(admitted(&store).await, 15);
        store.release("aa").await.unwrap();
        tokio::time::sleep(SILENCE).await;
        assert_eq!(
            store.adopt(GRACE).await.unwrap(),
            None,
            "released, and out of the registry"
        );
    }

    #[tokio::test]
    async fn an_adopter_that_goes_silent_is_taken_over_and_a_gateway_back_is_noted_anew() {
        let redis = RedisServer::start().unwrap();
        let store = store(&redis);
        let one = batch("bb", 1, 3);
        let held = encode_checkpoint(&[&one]);
        store
            .checkpoint("bb", Checkpoint::Holds(&held), false)
            .await
            .unwrap();
        tokio::time::sleep(SILENCE).await;

        // An adopter takes it and dies before releasing it: taken again, the same.
        let first = store.adopt(GRACE).await.unwrap().unwrap();
        assert_eq!(
            store.adopt(GRACE).await.unwrap(),
            None,
            "its adopter is not silent yet"
        );
        tokio::time::sleep(SILENCE).await;
        let again = store.adopt(GRACE).await.unwrap().unwrap();
        assert_eq!(again, first);

        // bb comes back meanwhile with a newer checkpoint: it waits until the adoption
        // is released, then is its own.
        let two = batch("bb", 2, 4);
        let newer = encode_checkpoint(&[&two]);
        let back = store
            .checkpoint("bb", Checkpoint::Holds(&newer), true)
            .await;
        assert_eq!(back.unwrap(), Checkpointed::Adopted, "nothing written");
        store
            .checkpoint("bb", Checkpoint::Holds(&newer), false)
            .await
            .unwrap();
        store.release("bb").await.unwrap();
        assert_eq!(store.adopt(GRACE).await.unwrap(), None, "bb is alive");
        // Noted alive without rewriting it, then silent: its newer checkpoint is taken.
        store
            .checkpoint("bb", Checkpoint::Same, true)
            .await
            .unwrap();
        tokio::time::sleep(SILENCE).await;
        let later = store.adopt(GRACE).await.unwrap().unwrap();
        assert_eq!(later, ("bb".to_string(), newer));
    }

    #[tokio::test]
    async fn a_checkpoint_of_nothing_and_a_retired_gateway_leave_nothing_to_adopt() {
        let redis = RedisServer::start().unwrap();
        let store = store(&redis);
        let held = encode_checkpoint(&[&batch("cc", 1, 1)]);
        store
            .checkpoint("cc", Checkpoint::Holds(&held), false)
            .await
            .unwrap();
        store
            .checkpoint("cc", Checkpoint::Empty, true)
            .await
            .unwrap();
        store
            .checkpoint("dd", Checkpoint::Holds(&held), false)
            .await
            .unwrap();
        store.retire("dd").await.unwrap();
        tokio::time::sleep(SILENCE).await;

        // cc is silent but holds nothing: out of the registry, nothing to add.
        assert_eq!(store.adopt(GRACE).await.unwrap(), None);
        assert_eq!(store.adopt(GRACE).await.unwrap(), None);
        let mut c = redis::Client::open(redis.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let keys: Vec<String> = c.keys("tollgate:{usage}:*").await.unwrap();
        assert!(keys.is_empty(), "{keys:?}");
    }

    #[test]
    fn a_field_names_its_limit_hour_and_count() {
        assert_eq!(parse_field("daily|07|a"), Some(("daily", 7, "a")));
        assert_eq!(parse_field("daily|23|uc"), Some(("daily", 23, "uc")));
        assert_eq!(parse_field("~3f9a"), None);
        assert_eq!(parse_field("daily|24|a"), None);
    }
}
