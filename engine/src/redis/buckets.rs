//! [`RedisBuckets`], the [`Buckets`] port on Redis: limit takes (through the coalescer),
//! adjustments, inspection and refills, one `EVALSHA` per decision (or per batch of queued
//! decisions), whatever the number of limits.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::future::BoxFuture;
use redis::AsyncCommands;

use super::backend::{Backend, BUCKET_LUA};
use super::coalesce::{Batch, Coalescer, Take};
use super::gather::{answers, one_bucket, Conn, Entry, Gatherer, Group, Op};
use crate::limits::{bucket, Applied, AppliedKind, Bucket, BucketState, Ruling};
use crate::limits::{spend_takes, take_many, Level};
use crate::retrying;
use crate::{key_slot, state_field, StateGroups, CLUSTER_STATE_GROUPS};
use crate::{BucketCalls, Buckets, Budget, StoreError};

/// Every client's limits on Redis (one server or a cluster): the [`Buckets`] port.
pub struct RedisBuckets {
    backend: Arc<Backend>,
    /// Where client state lives (`engine/lua/bucket.lua`).
    groups: StateGroups,
    /// Bounds a peek (`redis.control_timeout_ms`).
    control_timeout: Duration,
    coalescer: Coalescer,
    /// Take entries, gathered per worker turn into script calls.
    takes: Gatherer,
    /// Adjustments and peeks, gathered apart from the takes.
    others: Gatherer,
}

impl RedisBuckets {
    /// Buckets on `backend`, their state under `prefix` (one state group on one server,
    /// [`CLUSTER_STATE_GROUPS`] on a cluster); a peek waits at most `control_timeout`.
    pub fn new(backend: Arc<Backend>, prefix: &str, control_timeout: Duration) -> RedisBuckets {
        let groups = StateGroups::new(
            prefix,
            match *backend {
                Backend::Single { .. } => 1,
                Backend::Cluster(_) => CLUSTER_STATE_GROUPS,
            },
        );
        RedisBuckets {
            backend,
            groups,
            control_timeout,
            coalescer: Coalescer::default(),
            takes: Gatherer::new(BUCKET_LUA),
            others: Gatherer::new(BUCKET_LUA),
        }
    }

    /// Where client state lives.
    pub fn groups(&self) -> &StateGroups {
        &self.groups
    }
}

#[async_trait(?Send)]
impl Buckets for RedisBuckets {
    /// Takes `cost` from every limit in `applied` at `key`, or from none; a call Redis
    /// does not answer within `budget.store` answers [`StoreError::Deadline`]. Takes for
    /// the same limits that arrive on this worker while a call for them is in flight go
    /// to Redis together, in time for their `due` (see `coalesce`); each still gets the
    /// answer one-by-one calls would have given it.
    async fn take(
        &self,
        key: &str,
        applied: &[Applied],
        cost: f64,
        budget: Option<Budget>,
    ) -> Result<Ruling, StoreError> {
        let take = Take {
            applied,
            cost,
            due: budget.map(|b| b.due),
        };
        let store = budget.map(|b| b.store);
        self.coalescer
            .take(key, take, |batch| self.take_batch(key, batch, store))
            .await
    }

    fn calls(&self) -> Option<BucketCalls> {
        Some(self.takes.counts())
    }

    /// Keeps this worker thread's request-path connections open (one server's, or one
    /// to each master of a cluster), from before the first request until the thread ends.
    async fn keep_connected(&self) {
        match &*self.backend {
            Backend::Single { per_thread, .. } => per_thread.keep().await,
            Backend::Cluster(c) => c.keep().await,
        }
    }

    /// Debits `delta` from every limit in `applied` (a refund when negative), whatever the
    /// balance; returns the levels after it.
    async fn adjust(
        &self,
        key: &str,
        applied: &[Applied],
        delta: f64,
    ) -> Result<Ruling, StoreError> {
        let EntryReply { levels, now_us, .. } =
            self.call(key, Op::Adjust, applied, delta, 0, None).await?;
        Ok(Ruling::adjusted(levels, applied, delta, now_us))
    }

    /// Every limit's level now, on Redis' clock; writes nothing. Within the control
    /// timeout: past it, [`StoreError::Deadline`].
    async fn peek(&self, key: &str, applied: &[Applied]) -> Result<Ruling, StoreError> {
        let EntryReply { levels, now_us, .. } = tokio::time::timeout(
            self.control_timeout,
            self.call(key, Op::Peek, applied, 0.0, 0, None),
        )
        .await
        .map_err(|_| StoreError::Deadline)??;
        Ok(Ruling::levels(levels, now_us))
    }

    /// Deletes the state of the buckets under `buckets` (field prefixes) at `key`.
    async fn refill(&self, key: &str, buckets: &[Arc<str>]) -> Result<(), StoreError> {
        if buckets.is_empty() {
            return Ok(());
        }
        let (g, tag) = self.groups.locate(key);
        let fields: Vec<String> = buckets.iter().map(|f| state_field(tag, f)).collect();
        retrying!(self.backend, |c| async {
            let _: i64 = c.hdel(self.groups.key(g), &fields).await?;
            Ok(())
        }
        .await)
    }

    fn tokens_now<'a>(
        &'a self,
        key: &'a str,
        field: &'a str,
        plan: Bucket,
    ) -> BoxFuture<'a, Result<Option<f64>, StoreError>> {
        Box::pin(self.bucket_tokens(key, field, plan))
    }
}

impl RedisBuckets {
    /// One `EVALSHA` deciding `batch.n` takes, in order. Several may be in flight for one
    /// key: they go out on this worker's one connection, which Redis serves in order, and
    /// each reply carries the levels at its own start.
    async fn take_batch(
        &self,
        key: &str,
        batch: Batch<'_>,
        budget: Option<Duration>,
    ) -> Result<Vec<Ruling>, StoreError> {
        let reply = self
            .call(key, Op::Take, batch.applied, batch.cost, batch.n, budget)
            .await?;
        Ok(replay(reply, batch))
    }

    /// One entry of a script call. Takes are gathered with the other takes this
    /// worker makes in the same turn (`gather`); adjustments and peeks with each other, so
    /// the take calls stay countable. `budget`: how long Redis has to answer the call,
    /// from when it is written (`None`: the caller bounds the wait).
    async fn call(
        &self,
        key: &str,
        op: Op,
        applied: &[Applied],
        cost: f64,
        n: usize,
        budget: Option<Duration>,
    ) -> Result<EntryReply, StoreError> {
        let (g, tag) = self.groups.locate(key);
        let group = self.groups.key(g);
        let entry = Entry {
            group,
            tag,
            op,
            cost,
            n,
            applied,
            budget,
        };
        let gatherer = match op {
            Op::Take => &self.takes,
            Op::Adjust | Op::Peek => &self.others,
        };
        // A master's takes go on the worker's own connection to it; a slot's on the
        // cluster connection, which follows a redirection.
        let conn = |to: Group| async move {
            Ok(match (&*self.backend, to) {
                (Backend::Single { per_thread, .. }, _) => Conn::Single(per_thread.get().await?),
                (Backend::Cluster(c), Group::Master(m)) => match c.node(m) {
                    Some(node) => Conn::Single(node.link().await?),
                    None => Conn::Cluster(c.conn()),
                },
                (Backend::Cluster(c), _) => Conn::Cluster(c.conn()),
            })
        };
        let batch = match &*self.backend {
            Backend::Single { .. } => Group::All,
            Backend::Cluster(c) => {
                let slot = key_slot(group);
                c.master_of(slot).map_or(Group::Slot(slot), Group::Master)
            }
        };
        let first = gatherer.decide(batch, entry, || conn(batch)).await;
        let moved = match (&first, batch) {
            // Its group's slot moved since the map was read: the master answered the call
            // (its first key's slot) or this entry (another's) with a redirection.
            (Err(StoreError::Redis(e)), Group::Master(_)) => e.is_cluster_error(),
            (Ok(a), Group::Master(_)) => a.bytes().is_err(),
            _ => false,
        };
        let answer = if moved {
            // On its own, the cluster client follows the redirection.
            tracing::debug!("a take sent with its master's failed; once more alone");
            let alone = Group::Slot(key_slot(group));
            gatherer.decide(alone, entry, || conn(alone)).await?
        } else {
            first?
        };
        let bytes = answer.bytes().map_err(StoreError::Refused)?;
        Ok(EntryReply {
            levels: parse_reply(bytes, applied)?,
            now_us: answer.now_us,
            takes: answer.takes,
            skip: answer.skip,
        })
    }

    /// The tokens now (refilled on Redis' clock) of the bucket whose state is under
    /// `field`, or `None` if it has none (a missing bucket is full).
    pub async fn bucket_tokens(
        &self,
        key: &str,
        field: &str,
        plan: Bucket,
    ) -> Result<Option<f64>, StoreError> {
        let (g, tag) = self.groups.locate(key);
        let field = state_field(tag, field);
        retrying!(self.backend, |c| async {
            let (value, (secs, micros)): (Option<Vec<u8>>, (u64, u64)) = redis::pipe()
                .hget(self.groups.key(g), &field)
                .cmd("TIME")
                .query_async(c)
                .await?;
            let Some(state) = value.as_deref().and_then(decode_state) else {
                return Ok(None);
            };
            let now_us = secs * 1_000_000 + micros;
            Ok(Some(bucket::refill(Some(state), now_us, plan, None)))
        }
        .await)
    }
}

/// Each of `batch`'s takes' ruling, from the levels the script answered for its entry.
/// The script did the same arithmetic from the same levels, for the takes of this client
/// that joined the entry before these (`skip`), then these: redone here, each take gets
/// its own exact answer.
fn replay(reply: EntryReply, batch: Batch<'_>) -> Vec<Ruling> {
    let EntryReply {
        mut levels,
        now_us,
        takes,
        skip,
    } = reply;
    spend_takes(batch.applied, &mut levels, batch.cost, skip);
    let mut rulings = take_many(batch.applied, levels, batch.cost, batch.n, now_us);
    for r in &mut rulings {
        r.batch = u32::try_from(takes).unwrap_or(u32::MAX);
    }
    rulings
}

/// What the script answered for one entry.
struct EntryReply {
    /// Each limit's level before the entry's operation.
    levels: Vec<Level>,
    /// Redis' clock when it ran the call, in unix microseconds.
    now_us: u64,
    /// The requests the whole call decided.
    takes: u64,
    /// How many takes of the same client the entry decided before these (see `gather`).
    skip: usize,
}

/// A bucket's stored state: struct `<ddd` (tokens, when, and when it may be swept).
/// `None` for a quota's state (its sweep time carries half a microsecond: the mark
/// `engine/lua/bucket.lua` describes), as for anything else that is not a bucket's.
fn decode_state(v: &[u8]) -> Option<BucketState> {
    let word = |at: usize| -> Option<f64> {
        Some(f64::from_le_bytes(v.get(at..at + 8)?.try_into().ok()?))
    };
    (v.len() == 24).then_some(())?;
    (word(16)?.fract() == 0.0).then_some(())?;
    Some(BucketState {
        tokens: word(0)?,
        ts_us: word(8)? as u64,
    })
}

/// An entry's levels in the reply (little-endian doubles, see `engine/lua/bucket.lua`): one for
/// a set of one bucket, else two per limit.
fn parse_reply(reply: &[u8], applied: &[Applied]) -> Result<Vec<Level>, StoreError> {
    let word =
        |at: usize| -> f64 { f64::from_le_bytes(reply[at..at + 8].try_into().expect("8 bytes")) };
    let width = if one_bucket(applied) { 8 } else { 16 };
    if reply.len() != width * applied.len() {
        return Err(StoreError::Protocol(format!(
            "limits script reply of {} bytes for {} limits",
            reply.len(),
            applied.len()
        )));
    }
    Ok(applied
        .iter()
        .enumerate()
        .map(|(i, a)| match a.kind {
            AppliedKind::Bucket { .. } => Level::Tokens(word(width * i)),
            AppliedKind::Quota { .. } => Level::Used {
                used: word(16 * i),
                end_us: word(16 * i + 8) as u64,
            },
        })
        .collect())
}

/// A call's `reply` (one entry per status byte, each one take of `cost` from `applied` by
/// a client of its own) split into its entries' parts, each parsed and replayed: what the
/// takes of a call do with its reply. For the engine's benchmarks.
#[doc(hidden)]
pub fn replay_call(
    reply: Vec<Vec<u8>>,
    applied: &[Applied],
    cost: f64,
) -> Result<Vec<Vec<Ruling>>, StoreError> {
    let size = if one_bucket(applied) {
        8
    } else {
        16 * applied.len()
    };
    let entries = reply.get(1).map_or(0, Vec::len);
    let sizes = vec![size; entries];
    answers(reply, &sizes, entries as u64)?
        .into_iter()
        .map(|answer| {
            let bytes = answer.bytes().map_err(StoreError::Refused)?;
            let reply = EntryReply {
                levels: parse_reply(bytes, applied)?,
                now_us: answer.now_us,
                takes: answer.takes,
                skip: answer.skip,
            };
            Ok(replay(
                reply,
                Batch {
                    applied,
                    cost,
                    n: 1,
                },
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::rc::Rc;

    use tollgate_testkit::RedisServer;

    use crate::redis::coalesce::Batch;
    use crate::redis::gather::tests::{bucket_of_five, store_at, tokens_in};
    use crate::Buckets;

    /// A worker so busy that every take of a hot client leads a call of its own (see
    /// `coalesce`): the takes it makes in one turn still cost Redis one entry of one call,
    /// and each gets the ruling one call per take would have given it.
    #[tokio::test]
    async fn one_clients_takes_in_one_turn_share_an_entry_and_keep_their_order() {
        // Arrange: one client, a bucket of 5 with next to no refill.
        let redis = RedisServer::start().unwrap();
        let (store, applied) = (store_at(redis.url()), bucket_of_five());
        let local = tokio::task::LocalSet::new();
        local
            .run_until(async {
                store.peek("tollgate:b:{w}", &applied).await.unwrap();
                let calls_before = store.calls().unwrap_or_default().calls;

                // Act: eight takes of one request each, in one turn, none queued behind
                // another's call.
                let takes: Vec<_> = (0..8)
                    .map(|_| {
                        let (store, applied) = (Rc::clone(&store), Rc::clone(&applied));
                        tokio::task::spawn_local(async move {
                            let batch = Batch {
                                applied: &applied,
                                cost: 1.0,
                                n: 1,
                            };
                            store.take_batch("tollgate:b:{c}", batch, None).await
                        })
                    })
                    .collect();
                let mut admitted = Vec::new();
                for t in takes {
                    let rulings = t.await.unwrap().unwrap();
                    assert_eq!(rulings.len(), 1);
                    assert_eq!(rulings[0].batch, 8, "the call decided all eight");
                    admitted.push(rulings[0].allowed);
                }

                // Assert: one call; the first five in arrival order took the five tokens,
                // the last three were refused, and the bucket is empty.
                assert_eq!(store.calls().unwrap_or_default().calls - calls_before, 1);
                assert_eq!(
                    admitted,
                    [true, true, true, true, true, false, false, false]
                );
                let tokens = tokens_in(&store, "tollgate:b:{c}", &applied).await;
                assert!(tokens.abs() < 0.01, "{tokens}");
            })
            .await;
    }

    #[test]
    fn a_quotas_state_is_no_buckets() {
        let value = |third: f64| -> Vec<u8> {
            [2.0, 1.8e15, third]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect()
        };
        // A bucket's sweep time is whole; a quota's carries its mark, half a microsecond.
        let bucket = super::decode_state(&value(1.8e15 + 1e6)).expect("a bucket's state");
        assert_eq!((bucket.tokens, bucket.ts_us), (2.0, 1_800_000_000_000_000));
        assert_eq!(super::decode_state(&value(1.8e15 + 1e6 + 0.5)), None);
        assert_eq!(super::decode_state(b"not a state"), None);
    }
}
