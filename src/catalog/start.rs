//! Whether the store got what a gateway puts in at start (its scripts, the declared
//! catalog) and the catalog was mirrored from it. When the store was down at start, who
//! gets there first does it: task `store-start-retry` every second, or an admin request,
//! which must not answer from a store the declared catalog is not in yet (`422 "no such
//! plan"` for a plan the request path enforces).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::future::BoxFuture;

/// One attempt at the store's start: load the scripts, seed, mirror.
pub type Attempt = Box<dyn Fn() -> BoxFuture<'static, anyhow::Result<()>> + Send + Sync>;

pub struct StoreStart {
    done: AtomicBool,
    /// One attempt at a time.
    one: tokio::sync::Mutex<()>,
    attempt: Attempt,
}

/// How long an admin request waits for the store's start before going on without it: a
/// store still down fails the request anyway.
pub const START_WAIT: Duration = Duration::from_secs(2);

impl StoreStart {
    pub fn new(attempt: Attempt) -> StoreStart {
        StoreStart {
            done: AtomicBool::new(false),
            one: tokio::sync::Mutex::new(()),
            attempt,
        }
    }

    /// Whether the store has been started.
    pub fn done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Starts the store unless done already (or being done: then it waits for that
    /// attempt, and tries again if it failed).
    pub async fn ensure(&self) -> anyhow::Result<()> {
        if self.done() {
            return Ok(());
        }
        let _one = self.one.lock().await;
        if self.done() {
            return Ok(());
        }
        (self.attempt)().await?;
        self.done.store(true, Ordering::Release);
        Ok(())
    }

    /// Before an admin request: the store started, or tried now (within [`START_WAIT`]).
    pub async fn before_admin(&self) {
        if self.done() {
            return;
        }
        match tokio::time::timeout(START_WAIT, self.ensure()).await {
            Ok(Ok(())) => {
                tracing::info!("store reachable; catalog seeded and mirrored (on an admin request)")
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "store still unavailable for an admin request")
            }
            Err(_) => tracing::debug!("the store's start took longer than an admin request waits"),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    use super::*;

    #[tokio::test]
    async fn an_attempt_that_failed_is_made_again_and_one_that_succeeded_never() {
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&calls);
        let start = StoreStart::new(Box::new(move || {
            let n = counted.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                anyhow::ensure!(n > 0, "down");
                Ok(())
            })
        }));
        assert!(start.ensure().await.is_err());
        assert!(!start.done());
        assert!(start.ensure().await.is_ok());
        assert!(start.ensure().await.is_ok());
        start.before_admin().await;
        assert!(start.done());
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }
}
