//! Limit takes (through the coalescer), adjustments, inspection and refills: the request
//! path's part of the Redis store, one `EVALSHA` per decision (or per batch of queued
//! decisions), whatever the number of limits.

use redis::{AsyncCommands, RedisError};

use super::backend::{retrying, Backend, RedisStore};
use super::coalesce::{Batch, Take};
use crate::domain::limits::{take_many, Level};
use crate::domain::quota::Bounds;
use crate::domain::{bucket, Applied, AppliedKind, Bucket, BucketState, Ruling};
use crate::store::StoreError;

/// What the script is asked to do (`ARGV[1]`).
#[derive(Clone, Copy)]
enum Op {
    Take,
    Adjust,
    Peek,
}

impl RedisStore {
    /// Takes `cost` from every limit in `applied` at `key`, or from none, answering by
    /// `deadline` (then with [`StoreError::Deadline`]). Takes for the same limits that
    /// arrive on this worker while a call for them is in flight go to Redis together, in
    /// time for their deadlines (see `coalesce`); each still gets the answer one-by-one
    /// calls would have given it.
    pub async fn take(
        &self,
        key: &str,
        applied: &[Applied],
        cost: f64,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<Ruling, StoreError> {
        let take = Take {
            applied,
            cost,
            deadline,
        };
        self.coalescer
            .take(key, take, |batch| self.take_batch(key, batch))
            .await
    }

    /// Script calls sent for takes, and the takes they decided, since start.
    pub fn bucket_calls(&self) -> (u64, u64) {
        self.coalescer.counts()
    }

    /// One `EVALSHA` deciding `batch.n` takes, in order. Several may be in flight for one
    /// key: they go out on this worker's one connection, which Redis serves in order, and
    /// each reply carries the levels at its own start.
    async fn take_batch(&self, key: &str, batch: Batch<'_>) -> Result<Vec<Ruling>, StoreError> {
        let (admitted, levels, now_us) = self
            .call(key, Op::Take, batch.applied, batch.cost, batch.n)
            .await?;
        let rulings = take_many(batch.applied, levels, batch.cost, batch.n, now_us);
        // The script did the same arithmetic; a different count means it is not the
        // script this gateway was built with.
        if rulings.iter().filter(|r| r.allowed).count() != admitted {
            return Err(StoreError::Protocol(format!(
                "the limits script admitted {admitted} of {}, expected otherwise",
                batch.n
            )));
        }
        Ok(rulings)
    }

    /// Debits `delta` from every limit in `applied` (a refund when negative), whatever the
    /// balance; returns the levels after it.
    pub async fn adjust(
        &self,
        key: &str,
        applied: &[Applied],
        delta: f64,
    ) -> Result<Ruling, StoreError> {
        let (_, mut levels, now_us) = self.call(key, Op::Adjust, applied, delta, 0).await?;
        for (l, a) in levels.iter_mut().zip(applied) {
            l.adjust(&a.kind, delta);
        }
        Ok(Ruling {
            allowed: true,
            levels,
            wait_us: Some(0),
            refused_by: None,
            now_us,
        })
    }

    /// Every limit's level now, on Redis' clock; writes nothing.
    pub async fn peek(&self, key: &str, applied: &[Applied]) -> Result<Ruling, StoreError> {
        let (_, levels, now_us) = self.call(key, Op::Peek, applied, 0.0, 0).await?;
        Ok(Ruling {
            allowed: true,
            levels,
            wait_us: Some(0),
            refused_by: None,
            now_us,
        })
    }

    /// One script call: (admitted, each limit's level before the op, Redis' clock).
    async fn call(
        &self,
        key: &str,
        op: Op,
        applied: &[Applied],
        cost: f64,
        n: usize,
    ) -> Result<(usize, Vec<Level>, u64), StoreError> {
        // `invoke_async` sends EVALSHA and, on NOSCRIPT (a restarted or flushed Redis),
        // loads the script and retries once.
        let mut inv = self.bucket.prepare_invoke();
        inv.key(key)
            .arg(match op {
                Op::Take => "t",
                Op::Adjust => "a",
                Op::Peek => "p",
            })
            .arg(cost)
            .arg(n)
            .arg(if applied.iter().any(|a| a.others) {
                "1"
            } else {
                ""
            });
        let now_us = wall_clock_us();
        for a in applied {
            inv.arg(&*a.field);
            match &a.kind {
                AppliedKind::Bucket { bucket, initial } => {
                    inv.arg("b")
                        .arg(bucket.capacity())
                        .arg(bucket.rate())
                        .arg(initial.map(|i| i.to_string()).unwrap_or_default())
                        .arg("");
                }
                AppliedKind::Quota { amount, clock } => match clock.bounds(now_us) {
                    Bounds::Fixed([e0, e1, e2]) => {
                        inv.arg("q").arg(amount).arg(e0).arg(e1).arg(e2);
                    }
                    Bounds::Rolling(len) => {
                        inv.arg("r").arg(amount).arg(len).arg("").arg("");
                    }
                },
            }
        }
        let reply: Result<Vec<String>, RedisError> = match &self.backend {
            Backend::Single { per_thread, .. } => {
                let link = per_thread.get().await?;
                let r = inv.invoke_async(&mut link.connection()).await;
                link.check(&r);
                r
            }
            Backend::Cluster(c) => inv.invoke_async(&mut c.conn()).await,
        };
        parse_reply(&reply?, applied)
    }

    /// Deletes the state of the buckets under `buckets` (field prefixes) at `key`.
    pub async fn refill(
        &self,
        key: &str,
        buckets: &[std::sync::Arc<str>],
    ) -> Result<(), StoreError> {
        if buckets.is_empty() {
            return Ok(());
        }
        let fields: Vec<String> = buckets
            .iter()
            .flat_map(|f| [format!("{f}tk"), format!("{f}ts")])
            .collect();
        retrying!(self, |c| async {
            let _: i64 = c.hdel(key, &fields).await?;
            Ok(())
        }
        .await)
    }

    /// The tokens now (refilled on Redis' clock) of the bucket whose state is under
    /// `field`, or `None` if it has none (a missing bucket is full).
    pub async fn tokens_now(
        &self,
        key: &str,
        field: &str,
        plan: Bucket,
    ) -> Result<Option<f64>, StoreError> {
        retrying!(self, |c| async {
            let ((tk, ts), (secs, micros)): ((Option<String>, Option<String>), (u64, u64)) =
                redis::pipe()
                    .cmd("HMGET")
                    .arg(key)
                    .arg(format!("{field}tk"))
                    .arg(format!("{field}ts"))
                    .cmd("TIME")
                    .query_async(c)
                    .await?;
            let (Some(tk), Some(ts)) = (tk, ts) else {
                return Ok(None);
            };
            let state = BucketState {
                tokens: tk.parse().unwrap_or(0.0),
                ts_us: ts.parse().unwrap_or(0),
            };
            let (_, v) = bucket::take(Some(state), secs * 1_000_000 + micros, plan, 0.0);
            Ok(Some(v.tokens))
        }
        .await)
    }
}

/// The gateway's clock in unix microseconds: only to compute quota windows around, which
/// Redis' clock then picks from.
fn wall_clock_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// `{ admitted, now, then two strings per limit }` into levels.
fn parse_reply(
    reply: &[String],
    applied: &[Applied],
) -> Result<(usize, Vec<Level>, u64), StoreError> {
    let bad = || StoreError::Protocol(format!("limits script reply {reply:?}"));
    if reply.len() != 2 + 2 * applied.len() {
        return Err(bad());
    }
    let admitted = reply[0].parse::<usize>().map_err(|_| bad())?;
    let now_us = reply[1].parse::<u64>().map_err(|_| bad())?;
    let levels = applied
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let first = reply[2 + 2 * i].parse::<f64>().map_err(|_| bad())?;
            Ok(match a.kind {
                AppliedKind::Bucket { .. } => Level::Tokens(first),
                AppliedKind::Quota { .. } => Level::Used {
                    used: first,
                    end_us: reply[3 + 2 * i].parse::<u64>().map_err(|_| bad())?,
                },
            })
        })
        .collect::<Result<Vec<_>, StoreError>>()?;
    Ok((admitted, levels, now_us))
}
