//! Which clients are hot: a sampled count of requests per client over a window (10 s by
//! default, `periods.hot_window_ms`), so a
//! client worth sharding by region shows up without a per-request map update for every
//! client. `/admin/v1/hot` lists the top ones; `/metrics` has the busiest client's share of
//! traffic (without its id: labels never carry client ids).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use dashmap::DashMap;
use serde::Serialize;

use crate::domain::ClientId;
use crate::tasks::{Policy, Tasks};

/// One request in this many is counted.
const SAMPLE: u64 = 16;
const KEEP: usize = 100;

/// A client's estimated request rate over the last window.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct HotClient {
    pub id: String,
    /// Requests per second through this gateway (estimated from a 1-in-16 sample).
    pub rps: f64,
    /// Its fraction of this gateway's requests.
    pub share: f64,
}

thread_local! {
    /// Requests seen by this thread, for the 1-in-[`SAMPLE`] choice: a counter of its own
    /// per worker, so sampling writes no cache line another worker writes.
    static SEEN: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

pub struct HotClients {
    counts: DashMap<ClientId, AtomicU64>,
    top: ArcSwap<Vec<HotClient>>,
    window: Duration,
}

impl HotClients {
    /// Counts over windows of `window`.
    pub fn new(window: Duration) -> HotClients {
        HotClients {
            counts: DashMap::new(),
            top: ArcSwap::default(),
            window,
        }
    }

    /// Counts a request (one in [`SAMPLE`] is recorded).
    pub fn observe(&self, client: &ClientId) {
        let seen = SEEN.with(|n| n.replace(n.get().wrapping_add(1)));
        if !seen.is_multiple_of(SAMPLE) {
            return;
        }
        if let Some(c) = self.counts.get(client) {
            c.fetch_add(1, Relaxed);
            return;
        }
        self.counts
            .entry(client.clone())
            .or_default()
            .fetch_add(1, Relaxed);
    }

    /// The busiest clients of the last window, busiest first.
    pub fn top(&self) -> Arc<Vec<HotClient>> {
        self.top.load_full()
    }

    fn rotate(&self) {
        let mut all: Vec<(ClientId, u64)> = self
            .counts
            .iter()
            .map(|e| (e.key().clone(), e.value().load(Relaxed)))
            .collect();
        self.counts.clear();
        let total: u64 = all.iter().map(|(_, n)| n).sum();
        all.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        all.truncate(KEEP);
        let secs = self.window.as_secs_f64();
        self.top.store(Arc::new(
            all.into_iter()
                .map(|(id, n)| HotClient {
                    id: id.to_string(),
                    rps: (n * SAMPLE) as f64 / secs,
                    share: n as f64 / total.max(1) as f64,
                })
                .collect(),
        ));
    }

    /// Starts task `hot-clients-rotation`, which ranks the clients and starts a new count
    /// every window.
    pub fn spawn_rotation(self: &Arc<Self>, tasks: &Tasks) {
        let me = Arc::clone(self);
        tasks.spawn("hot-clients-rotation", Policy::Restart, move |stop| {
            let me = Arc::clone(&me);
            async move {
                stop.run_until_cancelled(me.rotate_every_window()).await;
            }
        });
    }

    async fn rotate_every_window(&self) {
        let mut tick = tokio::time::interval(self.window);
        tick.tick().await;
        loop {
            tick.tick().await;
            self.rotate();
        }
    }
}
