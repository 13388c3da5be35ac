//! In-process buckets: takes, inspection, refills, and forgetting idle buckets.

use super::backend::EmbeddedStore;
use crate::domain::{bucket, BucketState, Plan, Verdict};

impl EmbeddedStore {
    pub fn take(&self, key: &str, plan: Plan, cost: f64) -> Verdict {
        self.take_seeded(key, plan, cost, None)
    }

    /// [`EmbeddedStore::take`]; a new bucket starts with `initial` tokens, if given.
    pub fn take_seeded(&self, key: &str, plan: Plan, cost: f64, initial: Option<f64>) -> Verdict {
        self.buckets
            .take_seeded(key, plan, cost, self.buckets.now_us(), initial)
    }

    pub fn peek(&self, key: &str) -> Option<BucketState> {
        self.buckets.peek(key)
    }

    /// The bucket's tokens now, or `None` if it does not exist (a missing bucket is full).
    pub fn tokens_now(&self, key: &str, plan: Plan) -> Option<f64> {
        let state = self.peek(key)?;
        Some(
            bucket::take(Some(state), self.buckets.now_us(), plan, 0.0)
                .1
                .tokens,
        )
    }

    pub fn refill(&self, key: &str) {
        self.buckets.remove(key);
    }

    /// Forgets buckets that would be full by now; returns how many remain.
    pub fn evict_idle(&self) -> usize {
        self.buckets.evict_idle()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_buckets_are_evicted_once_they_would_be_full() {
        let dir = tempfile::tempdir().unwrap();
        let s = EmbeddedStore::open(&dir.path().join("c.json")).unwrap();
        let p = Plan::new(1.0, 1000.0).unwrap();
        s.take("k", p, 1.0);
        assert!(s.peek("k").is_some());
        std::thread::sleep(std::time::Duration::from_millis(1100));
        assert_eq!(s.evict_idle(), 0);
        assert!(s.peek("k").is_none());
    }
}
