//! The decision path: given a client, a service and a cost, decide allow / deny / fail open.
//!
//! Every request takes the same steps, each of which can settle it:
//! 1. the coarse safety limit (in process, per client and service) — `SafetyDenied`;
//! 2. the circuit breaker: if the store is known to be down, fail open at once;
//! 3. the store's bucket, answered by `redis.timeout_ms` — `FailOpen` past it, except for
//!    a cost the plan's capacity can never hold, which is `Denied` whatever the store says;
//! 4. the client's mode: in shadow mode a deny becomes `ShadowDenied` and is forwarded.

pub mod breaker;
mod breakers;
mod hot;
mod safety;
mod shadow;
pub mod shares;

use std::sync::Arc;
use std::time::{Duration, Instant};

pub use breaker::Breaker;
pub use breakers::Breakers;
pub use hot::{HotClient, HotClients};
pub use safety::SafetyLimit;
pub use shadow::ShadowStats;
pub use shares::ShareBook;

use crate::catalog::{Catalog, ClientEntry};
use crate::configuration::Periods;
use crate::domain::{Decision, Mode, Outcome, Plan};
use crate::metrics::{FailOpenReason, Metrics};
use crate::store::{Store, StoreError};

/// Decides requests: safety limit, breaker, store, mode.
pub struct Limiter {
    store: Store,
    /// Where this region's shards of hot clients live (the global store if not set apart).
    regional: Store,
    regional_breakers: Breakers,
    region: crate::domain::Region,
    shares: Arc<ShareBook>,
    hot: Arc<HotClients>,
    catalog: Arc<Catalog>,
    timeout: Duration,
    metrics: Arc<Metrics>,
    breakers: Breakers,
    safety: SafetyLimit,
    shadow: Arc<ShadowStats>,
    periods: Periods,
}

impl Limiter {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        store: Store,
        regional: Store,
        region: crate::domain::Region,
        catalog: Arc<Catalog>,
        timeout: Duration,
        metrics: Arc<Metrics>,
        default_multiplier: f64,
        periods: Periods,
    ) -> Limiter {
        Limiter {
            regional_breakers: Breakers::new(&regional, timeout, periods.backoff),
            regional,
            region,
            shares: Arc::new(ShareBook::new(periods)),
            hot: Arc::new(HotClients::new(periods.hot_window)),
            store: store.clone(),
            catalog,
            timeout,
            metrics,
            breakers: Breakers::new(&store, timeout, periods.backoff),
            safety: SafetyLimit::new(default_multiplier),
            shadow: Arc::new(ShadowStats::default()),
            periods,
        }
    }

    /// Starts the breaker's prober, the shadow flusher and the safety evictor.
    pub fn spawn_background(self: &Arc<Self>) {
        self.breakers.spawn_refresh();
        self.hot.spawn_rotation();
        self.regional_breakers.spawn_refresh();
        self.shares.spawn_reconciler(
            Arc::clone(&self.catalog),
            self.store.clone(),
            self.regional.clone(),
            self.region.clone(),
        );
        self.shadow
            .spawn_flush(self.store.clone(), self.periods.shadow_flush);
        let me = Arc::clone(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tick.tick().await;
                me.safety.evict_idle();
            }
        });
    }

    /// Keeps the calling worker's request-path connections open (spawn once per worker;
    /// runs until the worker ends).
    pub async fn keep_connected(&self) {
        if self.regional.same_as(&self.store) {
            self.store.keep_connected().await;
        } else {
            futures_util::future::join(self.store.keep_connected(), self.regional.keep_connected())
                .await;
        }
    }

    /// Decides one request for `client` to `service`, costing `cost` tokens.
    pub async fn decide(&self, client: &ClientEntry, service: &Arc<str>, cost: f64) -> Decision {
        let started = Instant::now();
        self.hot.observe(&client.id);
        let plan = client.plan.limits();
        let decision = self.decide_inner(client, service, cost, plan).await;
        self.metrics
            .record_decision(decision.outcome, started.elapsed());
        decision
    }

    async fn decide_inner(
        &self,
        client: &ClientEntry,
        service: &Arc<str>,
        cost: f64,
        plan: Plan,
    ) -> Decision {
        let multiplier = self
            .safety
            .multiplier(&self.catalog.safety_guard(), service);
        let safety = self.safety.take(client, service, plan, multiplier, cost);
        if !safety.allowed {
            return Decision {
                outcome: Outcome::SafetyDenied,
                plan,
                verdict: None,
                safety_wait_us: safety.wait_us,
            };
        }

        // A hot client sharded by region takes from this region's shard, in the regional
        // store, holding its share of the plan; everyone else from their global bucket.
        let shard = client
            .shard
            .as_ref()
            .and_then(|s| s.local_key.as_deref())
            .and_then(|k| Some((k, self.shares.observe(&client.id)?)));
        let (store, breakers, key, plan, initial) = match shard {
            Some((key, now)) => {
                let portion = plan.portion(now.share, cost.max(1.0));
                let initial = now.seed.map(|s| s * portion.capacity());
                (
                    &self.regional,
                    &self.regional_breakers,
                    key,
                    portion,
                    initial,
                )
            }
            None => {
                // Just un-sharded: the global bucket starts as full as the shards were.
                let initial = client
                    .unsharded_at
                    .filter(|t| t.elapsed() < self.periods.unshard_window)
                    .and_then(|_| self.shares.fill(&client.id))
                    .map(|f| f * plan.capacity());
                (
                    &self.store,
                    &self.breakers,
                    &*client.bucket_key,
                    plan,
                    initial,
                )
            }
        };
        let answer = if breakers.with(key, Breaker::is_open) {
            Err(FailOpenReason::BreakerOpen)
        } else {
            // The store answers by the deadline itself, saying whether the call went out;
            // the timeout around it only guards against a store that would not.
            let deadline = tokio::time::Instant::now() + self.timeout;
            let answer = tokio::time::timeout_at(
                deadline,
                store.take_seeded(key, plan, cost, initial, Some(deadline)),
            )
            .await
            .unwrap_or(Err(StoreError::Deadline { sent: true }));
            // The breaker judges the store: see `Breaker::observe`.
            breakers.with(key, |b| b.observe(&answer));
            answer.map_err(|e| match e {
                StoreError::Deadline { .. } => FailOpenReason::Timeout,
                e => {
                    self.metrics.store_error(e.kind());
                    FailOpenReason::Error
                }
            })
        };
        let outcome = match answer {
            Ok(v) if v.allowed => Outcome::Allowed,
            Ok(_) if client.mode == Mode::Shadow => Outcome::ShadowDenied,
            Ok(_) => Outcome::Denied,
            // A cost the bucket can never hold is refused whatever the store would say, so
            // not hearing from the store is no reason to admit it.
            Err(_) if cost > plan.capacity() && client.mode == Mode::Enforce => Outcome::Denied,
            Err(reason) => {
                self.metrics.fail_open(reason);
                Outcome::FailOpen
            }
        };
        Decision {
            outcome,
            plan,
            verdict: answer.ok(),
            safety_wait_us: None,
        }
    }

    /// For shadow-mode clients: compares the decision with the service's answer.
    pub fn compare(&self, client: &ClientEntry, decision: &Decision, service_status: u16) {
        // No comparison without a gateway decision (failing open), or without an answer
        // from the service (the gateway's own 502/504).
        if client.mode != Mode::Shadow
            || decision.verdict.is_none()
            || matches!(service_status, 502 | 504)
        {
            return;
        }
        let gateway_denied = decision.outcome == Outcome::ShadowDenied;
        self.shadow.record(
            &self.metrics,
            &client.id,
            gateway_denied,
            service_status == 429,
        );
    }

    /// Bucket script calls and the takes they decided, over the global store and (when
    /// it is another one) the regional store; `None` on the embedded store.
    pub fn bucket_calls(&self) -> Option<(u64, u64)> {
        let global = self.store.bucket_calls();
        if self.regional.same_as(&self.store) {
            return global;
        }
        match (global, self.regional.bucket_calls()) {
            (Some((c, t)), Some((rc, rt))) => Some((c + rc, t + rt)),
            (g, r) => g.or(r),
        }
    }

    pub fn hot(&self) -> &HotClients {
        &self.hot
    }

    pub fn breakers(&self) -> &Breakers {
        &self.breakers
    }
}
