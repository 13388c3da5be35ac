//! Shadow mode's scoreboard: for clients in shadow mode the gateway decides but forwards
//! anyway, and the service's answer (`429` = its own limiter said no) is compared with the
//! gateway's decision. Counts gather in process and are flushed to the store about once a
//! second, off the request path, so every gateway's comparisons add up in one place.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;

use crate::domain::ClientId;
use crate::metrics::Metrics;
use crate::store::{ShadowCount, Store};
use crate::tasks::{Policy, Tasks};

#[derive(Default)]
struct Counts {
    compared: AtomicU64,
    disagreed: AtomicU64,
}

#[derive(Default)]
pub struct ShadowStats {
    pending: DashMap<ClientId, Counts>,
}

impl ShadowStats {
    /// Records one comparison of the gateway's decision with the service's answer.
    pub fn record(
        &self,
        metrics: &Metrics,
        client: &ClientId,
        gateway_denied: bool,
        service_denied: bool,
    ) {
        metrics.record_shadow(gateway_denied, service_denied);
        let disagreed = (gateway_denied != service_denied) as u64;
        if let Some(c) = self.pending.get(client) {
            c.compared.fetch_add(1, Relaxed);
            c.disagreed.fetch_add(disagreed, Relaxed);
            return;
        }
        let c = self.pending.entry(client.clone()).or_default();
        c.compared.fetch_add(1, Relaxed);
        c.disagreed.fetch_add(disagreed, Relaxed);
    }

    /// Takes the counts gathered so far, leaving zeros.
    fn drain(&self) -> Vec<ShadowCount> {
        let mut out = Vec::new();
        self.pending.retain(|client, c| {
            let compared = c.compared.swap(0, Relaxed);
            let disagreed = c.disagreed.swap(0, Relaxed);
            if compared > 0 {
                out.push(ShadowCount {
                    client: client.to_string(),
                    compared,
                    disagreed,
                });
            }
            // Keep recently active clients' entries; drop the idle ones.
            compared > 0
        });
        out
    }

    /// Starts task `shadow-flush`, which flushes to the store every `period`; counts that
    /// fail to flush are kept for later.
    pub fn spawn_flush(self: &Arc<Self>, tasks: &Tasks, store: Store, period: Duration) {
        let stats = Arc::clone(self);
        tasks.spawn("shadow-flush", Policy::Restart, move |stop| {
            let (stats, store) = (Arc::clone(&stats), store.clone());
            async move {
                stop.run_until_cancelled(stats.flush_every(&store, period))
                    .await;
            }
        });
    }

    async fn flush_every(&self, store: &Store, period: Duration) {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut unsent: Vec<ShadowCount> = Vec::new();
        loop {
            tick.tick().await;
            unsent.extend(self.drain());
            if unsent.is_empty() {
                continue;
            }
            match tokio::time::timeout(Duration::from_secs(2), store.shadow.add(&unsent)).await {
                Ok(Ok(())) => unsent.clear(),
                _ => {
                    tracing::debug!(clients = unsent.len(), "shadow counts not flushed yet");
                    if unsent.len() > 100_000 {
                        unsent.clear();
                    }
                }
            }
        }
    }
}
