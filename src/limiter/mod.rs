//! The decision path: given a client and a cost, decide allow / deny / fail open.
//!
//! Every request takes the same steps, and later features join as steps rather than
//! rewrites: (1) the store's bucket, bounded by `redis.timeout_ms` (a circuit breaker
//! joins here); (2) the client's mode turns a deny into a shadow deny; the coarse safety
//! limit joins as a step before (1).

pub mod bucket;
mod headers;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

pub use bucket::{BucketState, Verdict};
pub use headers::RateLimitHeaders;

use crate::catalog::ClientEntry;
use crate::domain::{Mode, Plan};
use crate::metrics::Metrics;
use crate::store::Store;

/// What the gateway does with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Forward it.
    Allowed,
    /// Answer 429.
    Denied,
    /// Over the limit, but the client is in shadow mode: forward it.
    ShadowDenied,
    /// The store did not answer in time: forward it.
    FailOpen,
}

impl Outcome {
    /// Whether the request goes on to the service.
    pub fn forwards(self) -> bool {
        !matches!(self, Outcome::Denied)
    }

    /// The `outcome` label of `tollgate_decisions_total`.
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Allowed => "allowed",
            Outcome::Denied => "denied",
            Outcome::ShadowDenied => "shadow_denied",
            Outcome::FailOpen => "fail_open",
        }
    }
}

/// A decision and what the response headers need from it.
#[derive(Debug, Clone, Copy)]
pub struct Decision {
    pub outcome: Outcome,
    pub plan: Plan,
    /// The store's verdict; `None` when it did not answer.
    pub verdict: Option<Verdict>,
}

/// Decides requests against the store.
pub struct Limiter {
    store: Store,
    timeout: Duration,
    metrics: std::sync::Arc<Metrics>,
    /// Whether the store is failing, so a fail-open episode is logged once, not per request.
    failing: AtomicBool,
}

impl Limiter {
    pub fn new(store: Store, timeout: Duration, metrics: std::sync::Arc<Metrics>) -> Limiter {
        Limiter {
            store,
            timeout,
            metrics,
            failing: AtomicBool::new(false),
        }
    }

    /// Takes `cost` tokens from the client's bucket: one store call, bounded by the timeout.
    pub async fn decide(&self, client: &ClientEntry, cost: f64) -> Decision {
        let plan = client.plan.limits();
        let started = Instant::now();
        let verdict = match tokio::time::timeout(
            self.timeout,
            self.store.take(&client.bucket_key, plan, cost),
        )
        .await
        {
            Ok(Ok(v)) => {
                if self.failing.swap(false, Ordering::Relaxed) {
                    tracing::info!("store answers again; limiting resumed");
                }
                Some(v)
            }
            Ok(Err(e)) => {
                if !self.failing.swap(true, Ordering::Relaxed) {
                    tracing::warn!(error = %e, "store failed; failing open until it answers");
                }
                None
            }
            Err(_) => {
                if !self.failing.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        timeout_ms = self.timeout.as_millis() as u64,
                        "store too slow; failing open until it answers in time"
                    );
                }
                None
            }
        };
        let outcome = match verdict {
            None => Outcome::FailOpen,
            Some(v) if v.allowed => Outcome::Allowed,
            Some(_) if client.mode == Mode::Shadow => Outcome::ShadowDenied,
            Some(_) => Outcome::Denied,
        };
        self.metrics.record_decision(outcome, started.elapsed());
        Decision {
            outcome,
            plan,
            verdict,
        }
    }

    pub fn store(&self) -> &Store {
        &self.store
    }
}
