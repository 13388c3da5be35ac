//! Bucket takes (through the coalescer), inspection and refills: the request path's part
//! of the Redis store, one `EVALSHA` per decision (or per batch of queued decisions).

use redis::{AsyncCommands, RedisError};

use super::backend::{retrying, Backend, RedisStore};
use super::coalesce::{Batch, Take};
use crate::domain::{bucket, BucketState, Plan, Verdict};
use crate::store::StoreError;

impl RedisStore {
    /// Takes `cost` tokens from the bucket at `key`, answering by `deadline` (then with
    /// [`StoreError::Deadline`]). Takes for one bucket that arrive on this worker while a
    /// call for it is in flight go to Redis together, in time for their deadlines (see
    /// `coalesce`); each still gets the verdict one-by-one calls would have given it.
    pub async fn take(
        &self,
        key: &str,
        plan: Plan,
        cost: f64,
        initial: Option<f64>,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<Verdict, StoreError> {
        let take = Take {
            plan,
            cost,
            initial,
            deadline,
        };
        self.coalescer
            .take(key, take, |batch| self.take_batch(key, batch))
            .await
    }

    /// Bucket script calls sent and the takes they decided, since start.
    pub fn bucket_calls(&self) -> (u64, u64) {
        self.coalescer.counts()
    }

    /// One `EVALSHA` deciding `batch.n` takes, in order. Several may be in flight for one
    /// bucket: they go out on this worker's one connection, which Redis serves in order,
    /// and each reply carries the tokens at its own start.
    async fn take_batch(&self, key: &str, batch: Batch) -> Result<Vec<Verdict>, StoreError> {
        // `invoke_async` sends EVALSHA and, on NOSCRIPT (a restarted or flushed Redis),
        // loads the script and retries once.
        let mut inv = self.bucket.prepare_invoke();
        inv.key(key)
            .arg(batch.plan.capacity())
            .arg(batch.plan.rate())
            .arg(batch.cost)
            .arg(batch.initial.map(|i| i.to_string()).unwrap_or_default());
        if batch.n > 1 {
            inv.arg(batch.n);
        }
        let reply: Result<(usize, String), RedisError> = match &self.backend {
            Backend::Single { per_thread, .. } => {
                let link = per_thread.get().await?;
                let r = inv.invoke_async(&mut link.connection()).await;
                link.check(&r);
                r
            }
            Backend::Cluster(c) => inv.invoke_async(&mut c.conn()).await,
        };
        let (admitted, refilled) = reply?;
        let refilled = refilled
            .parse::<f64>()
            .map_err(|_| StoreError::Protocol(format!("tokens {refilled:?}")))?;
        let verdicts = bucket::take_many(refilled, batch.plan, batch.cost, batch.n);
        // The script did the same subtractions; a different count means it is not the
        // script this gateway was built with.
        if verdicts.iter().filter(|v| v.allowed).count() != admitted {
            return Err(StoreError::Protocol(format!(
                "bucket script admitted {admitted} of {}, expected otherwise",
                batch.n
            )));
        }
        Ok(verdicts)
    }

    pub async fn refill(&self, key: &str) -> Result<(), StoreError> {
        retrying!(self, |c| async {
            let _: i64 = c.del(key).await?;
            Ok(())
        }
        .await)
    }

    /// The bucket's tokens now (refilled on Redis' clock), or `None` if it does not exist
    /// (a missing bucket is full).
    pub async fn tokens_now(&self, key: &str, plan: Plan) -> Result<Option<f64>, StoreError> {
        retrying!(self, |c| async {
            let ((tk, ts), (secs, micros)): ((Option<String>, Option<String>), (u64, u64)) =
                redis::pipe()
                    .cmd("HMGET")
                    .arg(key)
                    .arg("tk")
                    .arg("ts")
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
            let (_, v) =
                crate::domain::bucket::take(Some(state), secs * 1_000_000 + micros, plan, 0.0);
            Ok(Some(v.tokens))
        }
        .await)
    }
}
