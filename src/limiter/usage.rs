//! Usage history's tally: every decision about a client is counted here, in process, per
//! (client, limit, UTC hour): admitted, refused, their cost, and what was admitted without
//! the store (unmetered). Task `usage-flush` sends the counts to the store every
//! `usage.flush_ms` as one numbered batch (`store::UsageHistory`), off the request path:
//! the request's own store call is unchanged.
//!
//! The hour of a decision the store made is the store's clock (the ruling's `now_us`, the
//! clock a quota's window is read on), so a quota's window holds exactly the hours whose
//! admitted cost it counted; the others use this gateway's clock.
//!
//! A batch the store does not acknowledge is kept, unchanged and with its number, and sent
//! again before any newer one; the store adds a batch once (a batch whose reply was lost is
//! not added twice). Counts held, unsent included, are bounded by `usage.max_entries`: past
//! it, new ones are dropped and counted.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use parking_lot::Mutex;

use crate::configuration::UsageSettings;
use crate::domain::{ClientId, Decision, Outcome};
use crate::metrics::Metrics;
use crate::store::{LocalLimits, Store, UsageBatch, UsageCounts, UsageEntry, DAY_S, HOUR_S};
use crate::tasks::{Policy, Tasks};

/// One client's counts being summed: per hour (unix s), per limit name.
type ClientHours = Vec<(u64, Vec<(Arc<str>, UsageCounts)>)>;

/// What a gateway counted and has not yet flushed.
pub struct UsageTally {
    settings: UsageSettings,
    /// This process's id in the store's batch records.
    gateway: String,
    pending: DashMap<ClientId, ClientHours, foldhash::fast::RandomState>,
    /// (client, limit, hour) counts in `pending`.
    summing: AtomicUsize,
    /// Batches made and not yet acknowledged, oldest first.
    unsent: Mutex<VecDeque<UsageBatch>>,
    /// Counts in `unsent`.
    unsent_entries: AtomicUsize,
    seq: AtomicU64,
    metrics: Arc<Metrics>,
}

/// How a decision counts.
#[derive(Clone, Copy)]
enum Counted {
    Admitted,
    Refused,
    Unmetered,
}

impl UsageTally {
    pub fn new(settings: UsageSettings, metrics: Arc<Metrics>) -> UsageTally {
        UsageTally {
            settings,
            gateway: format!("{:016x}", rand::random::<u64>()),
            pending: DashMap::default(),
            summing: AtomicUsize::new(0),
            unsent: Mutex::new(VecDeque::new()),
            unsent_entries: AtomicUsize::new(0),
            seq: AtomicU64::new(0),
            metrics,
        }
    }

    /// Counts `decision` about `client`: on each limit it was decided against, admitted
    /// (with its cost) when the store took it, refused when a limit (or the safety limit)
    /// refused it, unmetered when it was admitted without the store. A shed request was
    /// not decided: not counted.
    pub fn record(&self, client: &ClientId, decision: &Decision) {
        if !self.settings.enabled || decision.applied.is_empty() {
            return;
        }
        let counted = match (decision.outcome, &decision.ruling) {
            (Outcome::Allowed, Some(_)) => Counted::Admitted,
            (Outcome::Allowed | Outcome::FailOpen, _) => Counted::Unmetered,
            (Outcome::Denied | Outcome::ShadowDenied | Outcome::SafetyDenied, _) => {
                Counted::Refused
            }
            (Outcome::Shed, _) => return,
        };
        let cost = decision.cost;
        self.add(client, decision, |counts| match counted {
            Counted::Admitted => {
                counts.admitted += 1;
                counts.cost += cost;
            }
            Counted::Refused => counts.refused += 1,
            Counted::Unmetered => {
                counts.unmetered += 1;
                counts.unmetered_cost += cost;
            }
        });
    }

    /// Adds `delta` to the cost of an admitted `decision`, when its service reported a
    /// real cost other than the one taken up front (the same difference is debited from
    /// its limits, `Limiter::settle`): in the decision's hour, so `cost` stays what its
    /// quota counted.
    pub fn settle(&self, client: &ClientId, decision: &Decision, delta: f64) {
        if !self.settings.enabled || delta == 0.0 || !delta.is_finite() {
            return;
        }
        if decision.outcome == Outcome::Allowed && decision.ruling.is_some() {
            self.add(client, decision, |counts| counts.cost += delta);
        }
    }

    /// Applies `count` to `client`'s counts of each limit `decision` applied, in its hour:
    /// the store's clock when the store decided, else this gateway's.
    fn add(&self, client: &ClientId, decision: &Decision, count: impl Fn(&mut UsageCounts)) {
        if decision.applied.is_empty() {
            return;
        }
        let now_us = match &decision.ruling {
            Some(r) if r.now_us > 0 => r.now_us,
            _ => LocalLimits::now_us(),
        };
        let hour_s = now_us / 1_000_000 / HOUR_S * HOUR_S;
        let mut hours = match self.pending.get_mut(client) {
            Some(hours) => hours,
            None => self.pending.entry(client.clone()).or_default(),
        };
        let at = match hours.iter().position(|(h, _)| *h == hour_s) {
            Some(at) => at,
            None => {
                hours.push((hour_s, Vec::with_capacity(decision.applied.len())));
                hours.len() - 1
            }
        };
        let limits = &mut hours[at].1;
        for a in &decision.applied {
            if let Some((_, counts)) = limits.iter_mut().find(|(n, _)| **n == *a.name) {
                count(counts);
            } else if self.held() < self.settings.max_entries {
                let mut counts = UsageCounts::default();
                count(&mut counts);
                limits.push((Arc::clone(&a.name), counts));
                self.summing.fetch_add(1, Relaxed);
            } else {
                self.metrics.usage.dropped(1);
            }
        }
    }

    /// Counts held: summing and unsent.
    fn held(&self) -> usize {
        self.summing.load(Relaxed) + self.unsent_entries.load(Relaxed)
    }

    /// Takes the counts summed so far as the next batch, if there are any.
    fn cut_batch(&self) {
        let (mut entries, mut drained) = (Vec::new(), 0);
        self.pending.retain(|client, hours| {
            for (hour_s, limits) in hours.drain(..) {
                drained += limits.len();
                for (limit, counts) in limits {
                    if !counts.is_empty() {
                        entries.push(UsageEntry {
                            client: client.clone(),
                            limit: limit.to_string(),
                            hour_s,
                            counts,
                        });
                    }
                }
            }
            false
        });
        // Each entry was counted in `summing` under its client's lock, when it was made.
        self.summing.fetch_sub(drained, Relaxed);
        if entries.is_empty() {
            return;
        }
        let seq = self.seq.fetch_add(1, Relaxed) + 1;
        self.unsent_entries.fetch_add(entries.len(), Relaxed);
        self.unsent.lock().push_back(UsageBatch {
            gateway: self.gateway.clone(),
            seq,
            retention_s: self.settings.retention_days * DAY_S,
            entries,
        });
    }

    /// Cuts a batch of what was summed, then sends the unsent batches, oldest first, each
    /// within `within`, until one fails (it is kept, and sent first next time).
    pub async fn flush(&self, store: &Store, within: Duration) {
        self.cut_batch();
        loop {
            let Some(batch) = self.unsent.lock().front().cloned() else {
                break;
            };
            match tokio::time::timeout(within, store.usage.add(&batch)).await {
                Ok(Ok(())) => {
                    self.metrics.usage.flush(true);
                    self.unsent.lock().pop_front();
                    self.unsent_entries.fetch_sub(batch.entries.len(), Relaxed);
                }
                answer => {
                    self.metrics.usage.flush(false);
                    let error = match answer {
                        Ok(Err(e)) => e.to_string(),
                        _ => format!("no answer within {within:?}"),
                    };
                    tracing::warn!(
                        error = %error,
                        batch = batch.seq,
                        entries = batch.entries.len(),
                        "usage history not flushed: kept, and sent again at the next flush"
                    );
                    break;
                }
            }
        }
        self.metrics.usage.set_held(self.held());
    }

    /// Starts task `usage-flush`: a flush every `usage.flush_ms`, and one more when the
    /// gateway stops (after its servers have, so every decision is in it), each store call
    /// bounded by `within`.
    pub fn spawn_flush(self: &Arc<Self>, tasks: &Tasks, store: Store, within: Duration) {
        if !self.settings.enabled {
            return;
        }
        let tally = Arc::clone(self);
        tasks.spawn("usage-flush", Policy::Restart, move |stop| {
            let (tally, store) = (Arc::clone(&tally), store.clone());
            async move {
                let mut tick = tokio::time::interval(tally.settings.flush);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                tick.tick().await;
                stop.run_until_cancelled(async {
                    loop {
                        tick.tick().await;
                        tally.flush(&store, within).await;
                    }
                })
                .await;
                tally.flush(&store, within).await;
            }
        });
    }
}
