//! The engine's public surface: the gateway's `Buckets` port, every client's limits taken
//! from once per request. The gateway's embedded store implements it in process; Redis
//! answers it through this crate.
//!
//! The port is not `Send`: a take joins the calling worker's batch and connection
//! (thread-local), so its future stays on that worker.

use std::sync::Arc;

use async_trait::async_trait;
use futures_util::future::BoxFuture;

use crate::limits::{Applied, Bucket, Ruling};
use crate::{Budget, StoreError};

/// Every client's limits, taken from once per request.
#[async_trait(?Send)]
pub trait Buckets: Send + Sync {
    /// Takes `cost` from every limit in `applied` at `key`, or from none, atomically, on
    /// the store's clock. With a `budget`, a call the store does not answer within it
    /// answers [`StoreError::Deadline`] (the embedded store always answers at once).
    async fn take(
        &self,
        key: &str,
        applied: &[Applied],
        cost: f64,
        budget: Option<Budget>,
    ) -> Result<Ruling, StoreError>;

    /// Debits `delta` from every limit in `applied` at `key` (a refund when negative),
    /// whatever the balance: a bucket may go below zero and waits it off. Returns the
    /// levels after it.
    async fn adjust(
        &self,
        key: &str,
        applied: &[Applied],
        delta: f64,
    ) -> Result<Ruling, StoreError>;

    /// Every limit's level now, on the store's clock. For inspection; changes nothing.
    async fn peek(&self, key: &str, applied: &[Applied]) -> Result<Ruling, StoreError>;

    /// The tokens now of the bucket whose state is under `field` at `key`, refilled on the
    /// store's clock; `None` when it has no state (it is full). Takes nothing. Its future
    /// is `Send`: shards' reconciliation asks it from a background task.
    fn tokens_now<'a>(
        &'a self,
        key: &'a str,
        field: &'a str,
        bucket: Bucket,
    ) -> BoxFuture<'a, Result<Option<f64>, StoreError>>;

    /// Forgets the state of the buckets whose fields are `buckets` at `key`, so they start
    /// full; the client's other limits (its quotas' counts) stay.
    async fn refill(&self, key: &str, buckets: &[Arc<str>]) -> Result<(), StoreError>;

    /// Keeps the calling worker thread's request-path connection open: opens it now and
    /// re-opens it whenever it dies. Runs until the thread ends (at once when the store
    /// has no connection to keep).
    async fn keep_connected(&self);

    /// Bucket script calls sent and the takes they decided (`None`: the store makes no
    /// calls, its buckets are in this process).
    fn calls(&self) -> Option<BucketCalls>;
}

/// Script calls sent for takes, and the takes they decided, since start: takes / calls is
/// the average batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BucketCalls {
    pub calls: u64,
    pub takes: u64,
}
