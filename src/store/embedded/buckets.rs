//! In-process limits: takes, adjustments, inspection, refills, and forgetting idle state.

use std::sync::Arc;

use async_trait::async_trait;
use futures_util::future::BoxFuture;

use super::backend::EmbeddedStore;
use crate::domain::{bucket, Applied, Bucket, Ruling};
use crate::store::{BucketCalls, Buckets, Budget, LocalLimits, LocalOp, StoreError};

/// Every call answers at once: the arithmetic on this process's own map.
#[async_trait(?Send)]
impl Buckets for EmbeddedStore {
    async fn take(
        &self,
        key: &str,
        applied: &[Applied],
        cost: f64,
        _budget: Option<Budget>,
    ) -> Result<Ruling, StoreError> {
        Ok(self
            .limits
            .run(key, applied, LocalOp::Take { cost }, LocalLimits::now_us()))
    }

    async fn adjust(
        &self,
        key: &str,
        applied: &[Applied],
        delta: f64,
    ) -> Result<Ruling, StoreError> {
        Ok(self.limits.run(
            key,
            applied,
            LocalOp::Adjust { delta },
            LocalLimits::now_us(),
        ))
    }

    async fn peek(&self, key: &str, applied: &[Applied]) -> Result<Ruling, StoreError> {
        Ok(self
            .limits
            .run(key, applied, LocalOp::Peek, LocalLimits::now_us()))
    }

    fn tokens_now<'a>(
        &'a self,
        key: &'a str,
        field: &'a str,
        plan: Bucket,
    ) -> BoxFuture<'a, Result<Option<f64>, StoreError>> {
        Box::pin(std::future::ready(Ok(self.bucket_tokens(key, field, plan))))
    }

    async fn refill(&self, key: &str, buckets: &[Arc<str>]) -> Result<(), StoreError> {
        self.limits.forget(key, buckets);
        Ok(())
    }

    async fn keep_connected(&self) {}

    fn calls(&self) -> Option<BucketCalls> {
        None
    }
}

impl EmbeddedStore {
    /// The tokens now of the bucket under `field`, or `None` if it has no state (a
    /// missing bucket is full).
    pub(super) fn bucket_tokens(&self, key: &str, field: &str, plan: Bucket) -> Option<f64> {
        let state = self.limits.bucket_state(key, field)?;
        Some(bucket::refill(
            Some(state),
            LocalLimits::now_us(),
            plan,
            None,
        ))
    }

    /// Forgets clients whose limits would all be whole by now; returns how many remain.
    pub(super) fn evict_idle(&self) -> usize {
        self.limits.evict_idle()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Limit;

    #[test]
    fn idle_state_is_evicted_once_every_limit_would_be_whole() {
        let dir = tempfile::tempdir().unwrap();
        let s = EmbeddedStore::open(&dir.path().join("c.json")).unwrap();
        let applied = [Limit::default_bucket(Bucket::new(1.0, 1000.0).unwrap()).applied(0)];
        s.limits.run(
            "k",
            &applied,
            LocalOp::Take { cost: 1.0 },
            LocalLimits::now_us(),
        );
        assert!(s.bucket_tokens("k", "", applied_bucket(&applied)).is_some());
        std::thread::sleep(std::time::Duration::from_millis(1100));
        assert_eq!(s.evict_idle(), 0);
        assert!(s.bucket_tokens("k", "", applied_bucket(&applied)).is_none());
    }

    fn applied_bucket(a: &[Applied]) -> Bucket {
        match a[0].kind {
            crate::domain::AppliedKind::Bucket { bucket, .. } => bucket,
            _ => unreachable!(),
        }
    }
}
