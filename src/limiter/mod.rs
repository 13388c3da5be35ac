//! The decision path: given a client, a service and a cost, decide allow / deny / fail open.
//!
//! Every request takes the same steps, each of which can settle it:
//! 1. the coarse safety limit (in process, per client and service) — `SafetyDenied`;
//! 2. the circuit breaker: if the store is known to be down, fail open at once;
//! 3. the store's bucket: a call Redis does not answer within `redis.timeout_ms` of being
//!    written is `FailOpen`, except for a cost the plan's capacity can never hold, which
//!    is `Denied` whatever the store says;
//! 4. the client's mode: in shadow mode a deny becomes `ShadowDenied` and is forwarded.
//!
//! Before them all, an overloaded worker sheds the request (`Shed`, see [`overload`]), and
//! a decision not made within `overload.max_wait_ms` is shed too: the gateway's own
//! lateness never admits a request unchecked.

mod addr_buckets;
pub mod breaker;
mod breakers;
pub mod debits;
mod failed_keys;
mod hot;
pub mod overload;
mod public;
mod safety;
mod shadow;
pub mod shares;
mod usage;
pub mod warnings;

use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use breaker::Breaker;
pub use breakers::Breakers;
pub use failed_keys::FailedKeys;
pub use hot::{HotClient, HotClients};
pub use overload::{Overload, WorkerLoad};
use public::anonymous_opening;
pub use public::Anonymous;
pub use safety::SafetyLimit;
pub use shadow::ShadowStats;
pub use shares::ShareBook;
pub use usage::UsageTally;
pub use warnings::{Crossing, Warnings};

use crate::catalog::{Catalog, ClientEntry};
use crate::configuration::{OverloadSettings, Periods, UsageSettings};
use crate::domain::limits::Level;
use crate::domain::{
    bucket, Applied, AppliedKind, ClientId, Decision, KeyHash, Limits, Mode, Outcome, Ruling,
};
use crate::metrics::{FailOpenReason, Metrics, ShedReason};
use crate::store::{BucketCalls, Budget, Every, Store, StoreError};
use crate::tasks::{Policy, Tasks};

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
    overload: Overload,
    /// Sharded clients whose global quota is used up, until when (unix µs).
    /// With the quotas' amounts then: a raised quota (an override, a plan change) lifts it.
    quota_blocks: Arc<dashmap::DashMap<ClientId, (u64, f64)>>,
    /// Quota warnings found (`None`: no webhook is configured).
    warnings: Option<Arc<Warnings>>,
    /// Store errors the request path met, said in the log at most every
    /// [`ERROR_LOG_EVERY`].
    error_log: ErrorLog,
    /// Usage history: every client decision counted, flushed in batches.
    usage: Arc<UsageTally>,
    /// `redis.control_timeout_ms`: the bound on each usage flush's store call.
    control_timeout: Duration,
    /// Where its background tasks and its workers' start.
    tasks: Tasks,
}

/// The request path logs a failed store call at most this often (each is counted in
/// `tollgate_store_errors_total`): one line names the error, not one per request.
const ERROR_LOG_EVERY: Duration = Duration::from_secs(10);

/// When the request path may log a store error again, and how many it has not logged
/// since it last did.
struct ErrorLog {
    gate: Every,
    unlogged: std::sync::atomic::AtomicU64,
    /// When a decision last met a store out of memory (unix ms; 0: never).
    out_of_memory_at: std::sync::atomic::AtomicU64,
}

/// `/readyz` says the store refuses writes for this long after a decision met one out of
/// memory.
pub const OUT_OF_MEMORY_SHOWN: Duration = Duration::from_secs(10);

impl ErrorLog {
    fn new() -> ErrorLog {
        ErrorLog {
            gate: Every::new(ERROR_LOG_EVERY),
            unlogged: Default::default(),
            out_of_memory_at: Default::default(),
        }
    }

    /// A decision the store answered: it takes writes again (one load on the request
    /// path; a store only when it had refused them).
    #[inline]
    fn answered(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        if self.out_of_memory_at.load(Relaxed) != 0 {
            self.out_of_memory_at.store(0, Relaxed);
        }
    }

    /// Logs `e` if no error was logged within [`ERROR_LOG_EVERY`], with how many were not.
    fn note(&self, e: &StoreError) {
        use std::sync::atomic::Ordering::Relaxed;
        if e.out_of_memory() {
            self.out_of_memory_at.store(unix_ms(), Relaxed);
        }
        if !self.gate.due() {
            self.unlogged.fetch_add(1, Relaxed);
            return;
        }
        let unlogged = self.unlogged.swap(0, Relaxed);
        tracing::warn!(
            error = %e,
            kind = e.kind().label(),
            unlogged_since_last = unlogged,
            "store call failed: failing open (logged at most every {} s; every one is counted in tollgate_store_errors_total)",
            ERROR_LOG_EVERY.as_secs()
        );
    }
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// What a limiter is made of: start-up builds it from `Settings`.
pub struct LimiterParts {
    /// The global store: every client's buckets and quotas, the shares, shadow counts.
    pub store: Store,
    /// Where this region's shards of hot clients live (the global store if not set apart).
    pub regional: Store,
    /// This gateway's region (`server.region`).
    pub region: crate::domain::Region,
    pub catalog: Arc<Catalog>,
    pub metrics: Arc<Metrics>,
    /// `redis.timeout_ms`: how long a request's store call may take before it fails open.
    pub timeout: Duration,
    /// `limits.safety_multiplier`: the safety limit's scale of a plan's first bucket,
    /// unless the admin API stored another.
    pub safety_multiplier: f64,
    pub periods: Periods,
    pub overload: OverloadSettings,
    /// Where quota warnings go (`None`: nowhere; none are looked for).
    pub warnings: Option<Arc<Warnings>>,
    /// `[usage]`: usage history.
    pub usage: UsageSettings,
    /// `redis.control_timeout_ms`: deadline of store calls off the request path.
    pub control_timeout: Duration,
    /// Where its background tasks start.
    pub tasks: Tasks,
}

impl Limiter {
    /// A limiter of `parts`, with its background tasks started under `parts.tasks`: a
    /// breaker prober per store (per node on a Redis Cluster, with the slot map's
    /// refresh), the hot clients' rotation, the shares' reconciler, the shadow counts'
    /// flush and the safety limit's eviction of idle clients.
    pub fn start(parts: LimiterParts) -> Arc<Limiter> {
        let LimiterParts {
            store,
            regional,
            region,
            catalog,
            metrics,
            timeout,
            safety_multiplier,
            periods,
            overload,
            warnings,
            usage,
            control_timeout,
            tasks,
        } = parts;
        let limiter = Arc::new(Limiter {
            regional_breakers: Breakers::new(
                &regional,
                timeout,
                periods.backoff,
                &tasks,
                "regional",
            ),
            regional,
            region,
            shares: Arc::new(ShareBook::new(periods)),
            hot: Arc::new(HotClients::new(periods.hot_window)),
            breakers: Breakers::new(&store, timeout, periods.backoff, &tasks, "store"),
            store,
            catalog,
            timeout,
            metrics: Arc::clone(&metrics),
            safety: SafetyLimit::new(safety_multiplier),
            shadow: Arc::new(ShadowStats::default()),
            periods,
            overload: Overload::new(overload),
            quota_blocks: Arc::new(dashmap::DashMap::new()),
            warnings,
            error_log: ErrorLog::new(),
            usage: Arc::new(UsageTally::new(usage, Arc::clone(&metrics))),
            control_timeout,
            tasks,
        });
        limiter.spawn_background();
        limiter
    }

    fn spawn_background(self: &Arc<Self>) {
        let tasks = &self.tasks;
        self.breakers.spawn_refresh(tasks);
        self.hot.spawn_rotation(tasks);
        self.regional_breakers.spawn_refresh(tasks);
        self.shares.spawn_reconciler(
            tasks,
            Arc::clone(&self.catalog),
            self.store.clone(),
            self.regional.clone(),
            self.region.clone(),
        );
        self.shadow
            .spawn_flush(tasks, self.store.clone(), self.periods.shadow_flush);
        self.usage
            .spawn_flush(tasks, self.store.clone(), self.control_timeout);
        let me = Arc::clone(self);
        tasks.spawn("safety-eviction", Policy::Restart, move |stop| {
            let me = Arc::clone(&me);
            async move {
                let mut tick = tokio::time::interval(Duration::from_secs(5));
                while stop.run_until_cancelled(tick.tick()).await.is_some() {
                    me.safety.evict_idle();
                }
            }
        });
    }

    /// Starts the calling worker's own tasks, which end with it: one keeps its
    /// request-path connections open from now on, re-opened as soon as one dies (rather
    /// than on its first request), and is done at once when the store has none (the
    /// embedded store); the other measures its event loop's delay (see [`overload`]).
    /// Call it once on each worker's thread.
    pub fn start_worker(self: &Arc<Self>) {
        let me = Arc::clone(self);
        self.tasks
            .spawn_local("worker-store-connections", Policy::UntilDone, move |stop| {
                let me = Arc::clone(&me);
                async move {
                    stop.run_until_cancelled(me.keep_connected()).await;
                }
            });
        let me = Arc::clone(self);
        self.tasks
            .spawn_local("worker-delay-watch", Policy::Restart, move |stop| {
                let me = Arc::clone(&me);
                async move {
                    stop.run_until_cancelled(me.overload.watch_worker()).await;
                }
            });
    }

    /// Keeps the calling worker's request-path connections open (runs until the worker
    /// ends).
    async fn keep_connected(&self) {
        if self.regional.same_as(&self.store) {
            self.store.buckets.keep_connected().await;
        } else {
            futures_util::future::join(
                self.store.buckets.keep_connected(),
                self.regional.buckets.keep_connected(),
            )
            .await;
        }
    }

    /// Whether this worker may read the store for a key it does not hold (cache mode):
    /// held while the read is, or `None`, and the request is shed, counted (see
    /// [`Overload::admit_lookup`]).
    pub fn admit_lookup(&self, hash: &KeyHash, filtered: bool) -> Option<overload::Pending> {
        let admitted = self.overload.admit_lookup(hash, filtered);
        if admitted.is_none() {
            self.metrics.shed(ShedReason::Lookup);
            self.metrics.count_outcome(Outcome::Shed.label());
        }
        admitted
    }

    /// Every worker's load, for `/metrics`.
    /// Whether a decision met the store refusing writes (out of memory) within
    /// [`OUT_OF_MEMORY_SHOWN`], and none was answered since: then every decision fails
    /// open while the store still answers a `PING`, and `/readyz` says so.
    pub fn store_refuses_writes(&self) -> bool {
        let at = self
            .error_log
            .out_of_memory_at
            .load(std::sync::atomic::Ordering::Relaxed);
        at != 0 && unix_ms().saturating_sub(at) < OUT_OF_MEMORY_SHOWN.as_millis() as u64
    }

    pub fn worker_loads(&self) -> Vec<Arc<WorkerLoad>> {
        self.overload.loads()
    }

    /// Decides one request for `client` to `service`, costing `cost` tokens from every
    /// limit that applies to it.
    pub async fn decide(
        self: &Arc<Self>,
        client: &Arc<ClientEntry>,
        service: &Arc<str>,
        cost: f64,
    ) -> Decision {
        // The one clock read the decision's steps share (the safety bucket's time, the
        // store's budget, the bound on the whole); each read costs tens of nanoseconds.
        let started = Instant::now();
        // Counted whether or not it is shed: the client that overloads a worker is the
        // hottest one (`/admin/v1/hot` names it).
        self.hot.observe(&client.id);
        let limits = client.limits();
        let decision = match self.overload.admit(client) {
            Some(_pending) => {
                let bound = tokio::time::Instant::from_std(started) + self.overload.max_wait();
                // Owned, so that it can outlive a shed request (below).
                let (this, owner, to) = (Arc::clone(self), Arc::clone(client), Arc::clone(service));
                let held = Arc::clone(&limits);
                let mut decided =
                    Box::pin(
                        async move { this.decide_inner(&owner, &to, cost, &held, started).await },
                    );
                match tokio::time::timeout_at(bound, decided.as_mut()).await {
                    Ok(decision) => decision,
                    Err(_) => {
                        // Its store call may be on its way and take the tokens after all:
                        // it is seen through off the request path, and what it took is
                        // given back, so a shed request spends nothing.
                        let (this, owner) = (Arc::clone(self), Arc::clone(client));
                        tokio::task::spawn_local(async move {
                            let late = decided.await;
                            if late.outcome == Outcome::Allowed {
                                // Not in the usage history: it was not counted.
                                this.debit(&owner, &late, -late.cost);
                            }
                        });
                        self.shed(client, &limits, cost, ShedReason::DecisionWait)
                    }
                }
            }
            None => self.shed(client, &limits, cost, ShedReason::Overloaded),
        };
        self.metrics
            .record_decision(decision.outcome, started.elapsed());
        if let (Some(w), Some(r)) = (&self.warnings, &decision.ruling) {
            w.observe(
                &client.id,
                &client.plan.name,
                &limits,
                &decision.applied,
                &r.levels,
                r.now_us,
            );
        }
        self.usage.record(&client.id, &decision);
        decision
    }

    /// A request shed for `reason`: not decided, not forwarded, counted; as cheap as a
    /// refusal can be (no limits applied: its answer carries no rate-limit headers).
    fn shed(
        &self,
        client: &ClientEntry,
        limits: &Limits,
        cost: f64,
        reason: ShedReason,
    ) -> Decision {
        self.metrics.shed(reason);
        opening(client, limits, cost, Outcome::Shed)
    }

    /// The decision's steps after admission: the safety limit, then the store's buckets
    /// (this region's shard for a sharded client), behind the breaker, then the mode.
    /// Each step is a helper the compiler inlines; none allocates or waits but the store
    /// call, which stays here: this is the request path.
    async fn decide_inner(
        &self,
        client: &ClientEntry,
        service: &Arc<str>,
        cost: f64,
        limits: &Limits,
        started: Instant,
    ) -> Decision {
        let mut applied = limits.applied(Some(service));
        let mut decision = opening(client, limits, cost, Outcome::Allowed);
        if let Some(wait_us) = self.safety_refusal(client, service, limits, cost, started) {
            decision.outcome = Outcome::SafetyDenied;
            decision.safety_wait_us = wait_us;
            decision.applied = applied;
            return decision;
        }

        // A hot client sharded by region takes from this region's shard, in the regional
        // store, holding its share of each bucket; its quotas stay global (see
        // `quota_in_shard`). Everyone else takes from their global state.
        let (store, breakers, key) = match self.shard(client, limits) {
            Some((key, now)) => {
                let Some(buckets) = self.cut_to_shard(client, applied, now, cost, &mut decision)
                else {
                    return decision;
                };
                applied = buckets;
                (&self.regional, &self.regional_breakers, key)
            }
            None => {
                self.as_full_as_the_shards_were(client, &mut applied);
                (&self.store, &self.breakers, &*client.bucket_key)
            }
        };
        let answer = if breakers.with(key, Breaker::is_open) {
            Err(FailOpenReason::BreakerOpen)
        } else {
            // The store's budget runs from when the call is written (`Buckets::take`), so
            // time this request waits for its worker is never read as a slow store.
            let budget = Budget::starting(tokio::time::Instant::from_std(started), self.timeout);
            let answer = store.buckets.take(key, &applied, cost, Some(budget)).await;
            self.judged(breakers, key, answer)
        };
        self.rule(client.mode, &applied, cost, &answer, &mut decision);
        if decision.sharded {
            // Admitted in the region: its quotas are counted globally, after the fact.
            let quotas = std::mem::take(&mut decision.applied);
            if decision.outcome == Outcome::Allowed {
                self.debit_global_quotas(client, &quotas, cost);
            }
            applied.extend(quotas);
        }
        decision.applied = applied;
        decision.ruling = answer.ok();
        decision
    }

    /// The coarse safety limit, which scales the plan's first bucket (a plan of quotas
    /// alone has none): `Some` when it refuses the request, with how long until it would
    /// not (`None` inside: never, at this cost).
    #[inline]
    fn safety_refusal(
        &self,
        client: &ClientEntry,
        service: &Arc<str>,
        limits: &Limits,
        cost: f64,
        started: Instant,
    ) -> Option<Option<u64>> {
        let bucket = limits.headline_bucket()?;
        let multiplier = self
            .safety
            .multiplier(&self.catalog.safety_guard(), service);
        let wait_us = self
            .safety
            .take(client, service, bucket, multiplier, cost, started);
        (wait_us != bucket::TAKEN).then_some(wait_us)
    }

    /// This region's shard key of a sharded client, and its share now; `None` for a
    /// client that takes from its global state (not sharded here, a plan of quotas alone,
    /// or no share known yet).
    #[inline]
    fn shard<'c>(
        &self,
        client: &'c ClientEntry,
        limits: &Limits,
    ) -> Option<(&'c str, shares::ShareNow)> {
        client
            .shard
            .as_ref()
            .and_then(|s| s.local_key.as_deref())
            .filter(|_| limits.headline_bucket().is_some())
            .and_then(|k| Some((k, self.shares.observe(&client.id)?)))
    }

    /// A sharded request's buckets, cut to this region's share (`now`), to be taken from
    /// its shard; its quotas are set apart in `decision.applied`, decided from what the
    /// region knows of them. `None` when one of them refuses the request: `decision` then
    /// says so.
    #[inline]
    fn cut_to_shard(
        &self,
        client: &ClientEntry,
        mut applied: Vec<Applied>,
        now: shares::ShareNow,
        cost: f64,
        decision: &mut Decision,
    ) -> Option<Vec<Applied>> {
        for a in &mut applied {
            if let AppliedKind::Bucket { bucket, initial } = &mut a.kind {
                let portion = bucket.portion(now.share, cost.max(1.0));
                *initial = now.seed.map(|s| s * portion.capacity());
                *bucket = portion;
            }
        }
        let (quotas, buckets): (Vec<Applied>, Vec<Applied>) = applied
            .into_iter()
            .partition(|a| matches!(a.kind, AppliedKind::Quota { .. }));
        decision.as_planned = false;
        if let Some(refusal) = self.quota_in_shard(client, &quotas, cost) {
            decision.applied = quotas;
            decision.outcome = match client.mode {
                Mode::Shadow => Outcome::ShadowDenied,
                Mode::Enforce => Outcome::Denied,
            };
            decision.ruling = Some(refusal);
            return None;
        }
        decision.sharded = true;
        decision.applied = quotas;
        Some(buckets)
    }

    /// Just un-sharded: the global buckets start as full as the shards were.
    #[inline]
    fn as_full_as_the_shards_were(&self, client: &ClientEntry, applied: &mut [Applied]) {
        let fill = client
            .unsharded_at
            .filter(|t| t.elapsed() < self.periods.unshard_window)
            .and_then(|_| self.shares.fill(&client.id));
        if let Some(fill) = fill {
            for a in applied {
                if let AppliedKind::Bucket { bucket, initial } = &mut a.kind {
                    *initial = Some(fill * bucket.capacity());
                }
            }
        }
    }

    /// The store's answer, as the breaker guarding `key` learns it (see
    /// `Breaker::observe`), and a failure as the reason it fails open (counted, and
    /// logged now and then).
    #[inline]
    fn judged(
        &self,
        breakers: &Breakers,
        key: &str,
        answer: Result<Ruling, StoreError>,
    ) -> Result<Ruling, FailOpenReason> {
        breakers.with(key, |b| b.observe(&answer));
        if answer.is_ok() {
            self.error_log.answered();
        }
        answer.map_err(|e| match e {
            StoreError::Deadline => FailOpenReason::Timeout,
            e => {
                self.metrics.store_error(e.kind());
                self.error_log.note(&e);
                FailOpenReason::Error
            }
        })
    }

    /// The outcome of the store's `answer` for a request decided in `mode`.
    #[inline]
    fn rule(
        &self,
        mode: Mode,
        applied: &[Applied],
        cost: f64,
        answer: &Result<Ruling, FailOpenReason>,
        decision: &mut Decision,
    ) {
        let never = applied.iter().any(|a| cost > a.ceiling());
        decision.outcome = match answer {
            Ok(r) if r.allowed => Outcome::Allowed,
            Ok(_) if mode == Mode::Shadow => Outcome::ShadowDenied,
            Ok(_) => Outcome::Denied,
            // A cost some limit can never hold is refused whatever the store would say, so
            // not hearing from the store is no reason to admit it.
            Err(_) if never && mode == Mode::Enforce => Outcome::Denied,
            Err(reason) => {
                self.metrics.fail_open(*reason);
                decision.fail_open_reason = Some(*reason);
                Outcome::FailOpen
            }
        };
    }

    /// A sharded client's quotas live in the global store, beside its global bucket, while
    /// its buckets are decided in its region's shard: one round trip per request still. The
    /// region counts them after the fact ([`debits`], summed per period) and learns from
    /// each count whether a quota is used up; until its window ends, it refuses here. The
    /// error bound: what every region admits in one debit period plus one round trip.
    fn quota_in_shard(
        &self,
        client: &ClientEntry,
        quotas: &[Applied],
        cost: f64,
    ) -> Option<Ruling> {
        if quotas.is_empty() {
            return None;
        }
        let now_us = crate::store::LocalLimits::now_us();
        let amounts = amounts(quotas);
        let blocked = self
            .quota_blocks
            .get(&client.id)
            .map(|b| *b)
            .filter(|(until, then)| *until > now_us && *then == amounts)
            .map(|(until, _)| until);
        let until = match blocked {
            Some(until) => until,
            None if quotas.iter().any(|a| cost > a.ceiling()) => now_us,
            None => return None,
        };
        let levels = quotas
            .iter()
            .map(|a| Level::Used {
                used: a.ceiling(),
                end_us: until,
            })
            .collect();
        Some(Ruling {
            allowed: false,
            levels,
            wait_us: (until > now_us).then(|| until - now_us),
            refused_by: Some(0),
            now_us,
            batch: 0,
        })
    }

    fn debit_global_quotas(&self, client: &ClientEntry, quotas: &[Applied], cost: f64) {
        if quotas.is_empty() {
            return;
        }
        let blocks = Arc::clone(&self.quota_blocks);
        let (id, kinds) = (client.id.clone(), quotas.to_vec());
        let amounts = amounts(quotas);
        let warned = self
            .warnings
            .clone()
            .map(|w| (w, client.plan.name.clone(), client.limits()));
        let on_reply: debits::OnReply = Rc::new(move |r: &Ruling| {
            if let Some((w, plan, limits)) = &warned {
                w.observe(&id, plan, limits, &kinds, &r.levels, r.now_us);
            }
            // Used up: refused here until the latest exhausted window ends.
            let until = r
                .levels
                .iter()
                .zip(&kinds)
                .filter(|(l, a)| l.remaining(&a.kind) <= 0.0)
                .filter_map(|(l, _)| match l {
                    Level::Used { end_us, .. } => Some(*end_us),
                    Level::Tokens(_) => None,
                })
                .max();
            match until {
                Some(until) => {
                    blocks.insert(id.clone(), (until, amounts));
                }
                None => {
                    blocks.remove(&id);
                }
            }
        });
        debits::queue(
            &self.store.buckets,
            &client.bucket_key,
            quotas,
            cost,
            self.periods.debit,
            Some(on_reply),
        );
    }

    /// After the response: the request's real cost, as its service reported it. The
    /// difference to what was taken up front is debited (or refunded) from the limits
    /// it was decided against, off the request path and batched (see [`debits`]); a
    /// balance may go below zero, and the client's next requests wait it off.
    pub fn settle(&self, client: &ClientEntry, decision: &Decision, real_cost: f64) {
        if decision.outcome != Outcome::Allowed || !real_cost.is_finite() {
            return;
        }
        let delta = real_cost - decision.cost;
        self.usage.settle(&client.id, decision, delta);
        self.debit(client, decision, delta);
    }

    /// Debits `delta` (a refund when negative) from the limits an admitted `decision` was
    /// decided against, batched (see [`debits`]).
    fn debit(&self, client: &ClientEntry, decision: &Decision, delta: f64) {
        let period = self.periods.debit;
        match (
            decision.sharded,
            client.shard.as_ref().and_then(|s| s.local_key.as_deref()),
        ) {
            (true, Some(local)) => {
                // Buckets to the region's shard, quotas to the global state.
                let (quotas, buckets): (Vec<Applied>, Vec<Applied>) = decision
                    .applied
                    .iter()
                    .cloned()
                    .partition(|a| matches!(a.kind, AppliedKind::Quota { .. }));
                debits::queue(&self.regional.buckets, local, &buckets, delta, period, None);
                self.debit_global_quotas(client, &quotas, delta);
            }
            _ => debits::queue(
                &self.store.buckets,
                &client.bucket_key,
                &decision.applied,
                delta,
                period,
                self.warnings_on_reply(client, &decision.applied),
            ),
        }
    }

    /// What a debit's reply is looked at for: the quota warnings its levels reach.
    fn warnings_on_reply(
        &self,
        client: &ClientEntry,
        applied: &[Applied],
    ) -> Option<debits::OnReply> {
        let w = Arc::clone(self.warnings.as_ref()?);
        let (id, plan, limits) = (client.id.clone(), client.plan.name.clone(), client.limits());
        let applied = applied.to_vec();
        Some(Rc::new(move |r: &Ruling| {
            w.observe(&id, &plan, &limits, &applied, &r.levels, r.now_us);
        }))
    }

    /// For shadow-mode clients: compares the decision with the service's answer.
    pub fn compare(&self, client: &ClientEntry, decision: &Decision, service_status: u16) {
        // No comparison without a gateway decision (failing open), or without an answer
        // from the service (the gateway's own 502/504).
        if client.mode != Mode::Shadow
            || decision.ruling.is_none()
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
    pub fn bucket_calls(&self) -> Option<BucketCalls> {
        let global = self.store.buckets.calls();
        if self.regional.same_as(&self.store) {
            return global;
        }
        match (global, self.regional.buckets.calls()) {
            (Some(g), Some(r)) => Some(BucketCalls {
                calls: g.calls + r.calls,
                takes: g.takes + r.takes,
            }),
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

/// Requests without a key, on public routes (see [`public`]).
impl Limiter {
    /// Decides one request without a key to `service`, costing `cost` from every limit of
    /// `who`'s plan that applies to it: the same steps as a client's (shed when the worker
    /// is overloaded or the decision late, the safety limit, the breaker, the store), in
    /// enforce mode, never sharded. A decision shed for lateness may still have taken its
    /// tokens (unlike a client's, they are not given back).
    pub async fn decide_public(
        self: &Arc<Self>,
        who: &Anonymous,
        service: &Arc<str>,
        cost: f64,
    ) -> Decision {
        let started = Instant::now();
        let limits = who.plan.limits();
        // One address group is one "client" to the overload guard.
        let key = std::hash::BuildHasher::hash_one(
            &foldhash::fast::FixedState::default(),
            who.bucket_key.as_str(),
        ) as usize;
        let decision = match self.overload.admit_key(key) {
            Some(_pending) => {
                let bound = tokio::time::Instant::from_std(started) + self.overload.max_wait();
                let decided = self.decide_anonymous(who, service, cost, &limits, started);
                match tokio::time::timeout_at(bound, decided).await {
                    Ok(decision) => decision,
                    Err(_) => self.shed_anonymous(&limits, cost, ShedReason::DecisionWait),
                }
            }
            None => self.shed_anonymous(&limits, cost, ShedReason::Overloaded),
        };
        self.metrics
            .record_decision(decision.outcome, started.elapsed());
        decision
    }

    fn shed_anonymous(&self, limits: &Limits, cost: f64, reason: ShedReason) -> Decision {
        self.metrics.shed(reason);
        anonymous_opening(limits, cost, Outcome::Shed)
    }

    /// [`Limiter::decide_public`]'s steps after admission.
    async fn decide_anonymous(
        &self,
        who: &Anonymous,
        service: &Arc<str>,
        cost: f64,
        limits: &Limits,
        started: Instant,
    ) -> Decision {
        let applied = limits.applied(Some(service));
        let mut decision = anonymous_opening(limits, cost, Outcome::Allowed);
        if let Some(bucket) = limits.headline_bucket() {
            let multiplier = self
                .safety
                .multiplier(&self.catalog.safety_guard(), service);
            let wait_us = self
                .safety
                .take_for_address(&who.tag, service, bucket, multiplier, cost, started);
            if wait_us != bucket::TAKEN {
                decision.outcome = Outcome::SafetyDenied;
                decision.safety_wait_us = wait_us;
                decision.applied = applied;
                return decision;
            }
        }
        let key = who.bucket_key.as_str();
        let answer = if self.breakers.with(key, Breaker::is_open) {
            Err(FailOpenReason::BreakerOpen)
        } else {
            let budget = Budget::starting(tokio::time::Instant::from_std(started), self.timeout);
            let answer = self
                .store
                .buckets
                .take(key, &applied, cost, Some(budget))
                .await;
            self.judged(&self.breakers, key, answer)
        };
        self.rule(Mode::Enforce, &applied, cost, &answer, &mut decision);
        decision.applied = applied;
        decision.ruling = answer.ok();
        decision
    }

    /// [`Limiter::settle`] for a request without a key: the difference between what a
    /// service reported and what was taken, queued against the address's bucket.
    pub fn settle_public(&self, who: &Anonymous, decision: &Decision, real_cost: f64) {
        if decision.outcome != Outcome::Allowed || !real_cost.is_finite() {
            return;
        }
        debits::queue(
            &self.store.buckets,
            &who.bucket_key,
            &decision.applied,
            real_cost - decision.cost,
            self.periods.debit,
            None,
        );
    }
}

/// A decision of `outcome` for `cost` with nothing applied or ruled yet.
fn opening(client: &ClientEntry, limits: &Limits, cost: f64, outcome: Outcome) -> Decision {
    let mut decision = anonymous_opening(limits, cost, outcome);
    decision.as_planned &= client.record.overrides.is_empty();
    decision
}

/// The quotas' amounts together: a block learned under other amounts no longer holds.
fn amounts(quotas: &[Applied]) -> f64 {
    quotas.iter().map(Applied::ceiling).sum()
}
