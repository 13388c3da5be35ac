//! Regional shards of hot clients: what this gateway's region may take of a sharded
//! client's plan. The request path reads a share from memory and counts demand (no Redis
//! call); a reconciler reports the demand to the global store twice a second, where the
//! shares are recomputed from every region's demand once a second (`lua/reconcile.lua`),
//! and reads them back.
//!
//! Bounded error (documented in README): shares always sum to 1, so the regional
//! capacities sum to the plan's capacity and the rates to its rate; the error comes only
//! from gateways using a share up to one period (plus one round trip) out of date.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;

use crate::catalog::{Catalog, ClientEntry};
use crate::configuration::Periods;
use crate::domain::{ClientId, Region};
use crate::store::{Reconcile, ShardState, Store};
use crate::tasks::{Policy, Tasks};

/// The part of the plan that idle regions keep, summed over all regions, so a region whose
/// demand starts is not starved until the next reconciliation.
pub const FLOOR: f64 = 0.1;

#[derive(Default)]
struct Entry {
    /// This region's share (f64 bits); 0 until the first reconciliation.
    share: AtomicU64,
    demand: AtomicU64,
    /// Fill (0..1) new shard buckets start with, while sharding is recent (f64 bits; 0 = none).
    seed: AtomicU64,
    /// Share-weighted fill of all regions' shards at the last reconciliation (f64 bits).
    fill: AtomicU64,
    /// Reconciliations since the client was last seen sharded (for forgetting it).
    idle_rounds: AtomicU64,
    /// When demand was last flushed (ms on the process clock), to turn counts into rates.
    flushed_ms: AtomicU64,
}

/// What the request path uses for a sharded client.
pub struct ShareNow {
    pub share: f64,
    /// Fill a shard bucket that does not exist yet starts with.
    pub seed: Option<f64>,
}

pub struct ShareBook {
    entries: DashMap<ClientId, Entry>,
    epoch: std::time::Instant,
    periods: Periods,
}

fn f(bits: &AtomicU64) -> f64 {
    f64::from_bits(bits.load(Relaxed))
}

impl ShareBook {
    /// A book reconciled every `periods.share`.
    pub fn new(periods: Periods) -> ShareBook {
        ShareBook {
            entries: DashMap::new(),
            epoch: std::time::Instant::now(),
            periods,
        }
    }

    /// Counts one request of a sharded client in this region and returns its share, or
    /// `None` until the first reconciliation (the client's global bucket serves meanwhile,
    /// so starting to shard hands out no fresh burst).
    pub fn observe(&self, client: &ClientId) -> Option<ShareNow> {
        let read = |e: &Entry| {
            e.demand.fetch_add(1, Relaxed);
            let share = f(&e.share);
            (share > 0.0).then(|| ShareNow {
                share,
                seed: Some(f(&e.seed)).filter(|s| *s > 0.0),
            })
        };
        if let Some(e) = self.entries.get(client) {
            return read(&e);
        }
        read(&self.entries.entry(client.clone()).or_default())
    }

    /// The share-weighted fill of a recently un-sharded client's shards.
    pub fn fill(&self, client: &ClientId) -> Option<f64> {
        self.entries.get(client).map(|e| f(&e.fill))
    }

    fn update(&self, client: &ClientId, region: &Region, state: &ShardState, seed_valid: bool) {
        let e = self.entries.entry(client.clone()).or_default();
        let mine = state
            .regions
            .iter()
            .find(|r| r.region == region.as_str())
            .map_or(0.0, |r| r.share);
        e.share.store(mine.to_bits(), Relaxed);
        let seed = if seed_valid {
            state.seed.max(f64::MIN_POSITIVE)
        } else {
            0.0
        };
        e.seed.store(seed.to_bits(), Relaxed);
        let known: Vec<_> = state
            .regions
            .iter()
            .filter_map(|r| Some((r.share, r.fill?)))
            .collect();
        let weight: f64 = known.iter().map(|(s, _)| s).sum();
        if weight > 0.0 {
            let fill = known.iter().map(|(s, f)| s * f).sum::<f64>() / weight;
            e.fill.store(fill.clamp(0.0, 1.0).to_bits(), Relaxed);
        }
        e.idle_rounds.store(0, Relaxed);
    }

    /// Starts task `shares-reconciler`, which reconciles every sharded client of this
    /// region once a period, off the request path.
    pub fn spawn_reconciler(
        self: &Arc<Self>,
        tasks: &Tasks,
        catalog: Arc<Catalog>,
        global: Store,
        regional: Store,
        region: Region,
    ) {
        let book = Arc::clone(self);
        tasks.spawn("shares-reconciler", Policy::Restart, move |stop| {
            let book = Arc::clone(&book);
            let (catalog, global) = (Arc::clone(&catalog), global.clone());
            let (regional, region) = (regional.clone(), region.clone());
            async move {
                let reconciling =
                    book.reconcile_every_period(&catalog, &global, &regional, &region);
                stop.run_until_cancelled(reconciling).await;
            }
        });
    }

    async fn reconcile_every_period(
        &self,
        catalog: &Catalog,
        global: &Store,
        regional: &Store,
        region: &Region,
    ) {
        let mut tick = tokio::time::interval(self.periods.share_report());
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let clients = catalog.sharded_clients();
            for client in &clients {
                self.reconcile_one(client, global, regional, region).await;
            }
            // Forget clients that have not been sharded for a while.
            let window = self.periods.unshard_window.as_millis() as u64
                / self.periods.share_report().as_millis().max(1) as u64;
            self.entries.retain(|id, e| {
                clients.iter().any(|c| &c.id == id) || e.idle_rounds.fetch_add(1, Relaxed) < window
            });
        }
    }

    async fn reconcile_one(
        &self,
        client: &ClientEntry,
        global: &Store,
        regional: &Store,
        region: &Region,
    ) {
        let Some(shard) = &client.shard else { return };
        let Some(local_key) = &shard.local_key else {
            return;
        };
        // Shares divide the plan's first bucket for every service (and, by the same share,
        // its other buckets); a plan of quotas alone is not sharded.
        let limits = client.limits();
        let Some((field, plan)) = headline(&limits) else {
            return;
        };
        let now_ms = self.epoch.elapsed().as_millis() as u64;
        let (count, since_ms) = self.entries.get(&client.id).map_or((0, 0), |e| {
            (
                e.demand.swap(0, Relaxed),
                e.flushed_ms.swap(now_ms, Relaxed),
            )
        });
        // A rate over this region's own interval: reports from regions need not line up
        // with the reconciliation periods.
        let interval_s = (now_ms.saturating_sub(since_ms)).clamp(100, 10_000) as f64 / 1000.0;
        let demand = count as f64 / interval_s;
        // How full this region's shard is, for a later un-sharding.
        let share = self.entries.get(&client.id).map_or(0.0, |e| f(&e.share));
        let fill = if share > 0.0 {
            let portion = plan.portion(share, 1.0);
            match tokio::time::timeout(
                Duration::from_millis(200),
                regional.buckets.tokens_now(local_key, &field, portion),
            )
            .await
            {
                Ok(Ok(t)) => Some(t.map_or(1.0, |t| t / portion.capacity())),
                _ => None,
            }
        } else {
            None
        };
        let global_key = client.bucket_key.to_string();
        let r = Reconcile {
            client: &client.id,
            region,
            demand,
            fill,
            regions: &shard.regions,
            global_key: &global_key,
            field: &field,
            plan,
            period_ms: (self.periods.share.as_millis() as u64).saturating_sub(50),
            floor: FLOOR,
        };
        match tokio::time::timeout(Duration::from_millis(500), global.shards.reconcile(&r)).await {
            Ok(Ok(state)) => {
                let now_ms = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64);
                let window_ms = (plan.window_secs() * 1000.0) as u64 + 2000;
                let seed_valid = now_ms.saturating_sub(state.since_ms) < window_ms;
                self.update(&client.id, region, &state, seed_valid);
            }
            _ => {
                // Keep the demand for the next round.
                if let Some(e) = self.entries.get(&client.id) {
                    e.demand.fetch_add(count, Relaxed);
                    e.flushed_ms.store(since_ms, Relaxed);
                }
                tracing::debug!(client = %client.id, "shard reconciliation failed; keeping the last shares");
            }
        }
    }
}

/// The plan's first bucket for every service, and where its state lives.
pub fn headline(
    limits: &crate::domain::Limits,
) -> Option<(std::sync::Arc<str>, crate::domain::Bucket)> {
    limits
        .items()
        .iter()
        .find_map(|l| match (l.kind(), l.service()) {
            (crate::domain::LimitKind::Bucket(b), None) => {
                Some((std::sync::Arc::clone(l.field()), *b))
            }
            _ => None,
        })
}
