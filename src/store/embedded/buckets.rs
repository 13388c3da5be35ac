//! In-process limits: takes, adjustments, inspection, refills, and forgetting idle state.

use super::backend::EmbeddedStore;
use crate::domain::{bucket, Applied, Bucket, Ruling};
use crate::store::{LocalLimits, LocalOp};

impl EmbeddedStore {
    /// Takes `cost` from every limit in `applied` at `key`, or from none.
    pub fn take(&self, key: &str, applied: &[Applied], cost: f64) -> Ruling {
        self.limits
            .run(key, applied, LocalOp::Take { cost }, LocalLimits::now_us())
    }

    /// Debits `delta` from every limit in `applied` (a refund when negative).
    pub fn adjust(&self, key: &str, applied: &[Applied], delta: f64) -> Ruling {
        self.limits.run(
            key,
            applied,
            LocalOp::Adjust { delta },
            LocalLimits::now_us(),
        )
    }

    /// Every limit's level now; changes nothing.
    pub fn peek(&self, key: &str, applied: &[Applied]) -> Ruling {
        self.limits
            .run(key, applied, LocalOp::Peek, LocalLimits::now_us())
    }

    /// The tokens now of the bucket under `field`, or `None` if it has no state (a
    /// missing bucket is full).
    pub fn tokens_now(&self, key: &str, field: &str, plan: Bucket) -> Option<f64> {
        let state = self.limits.bucket_state(key, field)?;
        Some(
            bucket::take(Some(state), LocalLimits::now_us(), plan, 0.0)
                .1
                .tokens,
        )
    }

    /// Forgets the state of the buckets under `buckets` (field prefixes) at `key`.
    pub fn refill(&self, key: &str, buckets: &[std::sync::Arc<str>]) {
        self.limits.forget(key, buckets);
    }

    /// Forgets clients whose limits would all be whole by now; returns how many remain.
    pub fn evict_idle(&self) -> usize {
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
        let applied = [Applied::of(
            0,
            &Limit::default_bucket(Bucket::new(1.0, 1000.0).unwrap()),
        )];
        s.take("k", &applied, 1.0);
        assert!(s.tokens_now("k", "", applied_bucket(&applied)).is_some());
        std::thread::sleep(std::time::Duration::from_millis(1100));
        assert_eq!(s.evict_idle(), 0);
        assert!(s.tokens_now("k", "", applied_bucket(&applied)).is_none());
    }

    fn applied_bucket(a: &[Applied]) -> Bucket {
        match a[0].kind {
            crate::domain::AppliedKind::Bucket { bucket, .. } => bucket,
            _ => unreachable!(),
        }
    }
}
