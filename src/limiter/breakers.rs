//! Which circuit breaker guards a key. One server: one breaker. Redis Cluster: one per
//! node, found through the key's slot, so a node that is down fails open only for the
//! keys it owns while every other key is still limited.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use parking_lot::Mutex;

use super::Breaker;
use crate::configuration::BackOff;
use crate::store::{key_in_slot, key_slot, SlotRange, Store, StoreKind};
use crate::tasks::{Policy, Tasks};

const SLOTS: usize = 16384;
/// How often the slot map is read again (failovers and resharding move slots).
const SLOT_REFRESH: Duration = Duration::from_secs(2);

pub enum Breakers {
    One(Arc<Breaker>),
    PerNode(Arc<NodeBreakers>),
}

pub struct NodeBreakers {
    /// Slot → the breaker of the node serving it.
    by_slot: ArcSwap<Vec<Arc<Breaker>>>,
    by_node: Mutex<HashMap<String, Arc<Breaker>>>,
    store: Store,
    budget: Duration,
    backoff: BackOff,
    /// Where a node's prober starts, when the slot map first names the node.
    tasks: Tasks,
    /// Which store its tasks' names say they serve.
    label: &'static str,
}

impl Breakers {
    /// The breakers of `store`, each with its prober started under `tasks`; `label`
    /// (`store`, `regional`) names their tasks.
    pub fn new(
        store: &Store,
        budget: Duration,
        backoff: BackOff,
        tasks: &Tasks,
        label: &'static str,
    ) -> Breakers {
        let prober = format!("{label}-breaker-probe");
        if store.lifecycle.kind() == StoreKind::Cluster {
            // Until the slot map is known, one breaker stands for the whole cluster.
            let unknown = Arc::new(Breaker::new(budget, backoff));
            unknown.spawn_prober(tasks, prober, store.clone(), None, budget);
            Breakers::PerNode(Arc::new(NodeBreakers {
                by_slot: ArcSwap::from_pointee(vec![unknown; SLOTS]),
                by_node: Mutex::new(HashMap::new()),
                store: store.clone(),
                budget,
                backoff,
                tasks: tasks.clone(),
                label,
            }))
        } else {
            let b = Arc::new(Breaker::new(budget, backoff));
            b.spawn_prober(tasks, prober, store.clone(), None, budget);
            Breakers::One(b)
        }
    }

    /// Runs `f` with the breaker guarding `key`.
    pub fn with<T>(&self, key: &str, f: impl FnOnce(&Breaker) -> T) -> T {
        match self {
            Breakers::One(b) => f(b),
            Breakers::PerNode(n) => f(&n.by_slot.load()[key_slot(key) as usize]),
        }
    }

    /// Whether any breaker is open, and how many times any opened (for metrics).
    pub fn summary(&self) -> BreakersSummary {
        match self {
            Breakers::One(b) => BreakersSummary {
                open: b.is_open(),
                times_opened: b.times_opened(),
            },
            Breakers::PerNode(n) => {
                let nodes = n.by_node.lock();
                BreakersSummary {
                    open: nodes.values().any(|b| b.is_open()),
                    times_opened: nodes.values().map(|b| b.times_opened()).sum(),
                }
            }
        }
    }

    /// Keeps the slot map current (Redis Cluster only), as a task of `tasks`.
    pub fn spawn_refresh(&self, tasks: &Tasks) {
        if let Breakers::PerNode(n) = self {
            let n = Arc::clone(n);
            let name = format!("{}-slot-refresh", n.label);
            tasks.spawn(name, Policy::Restart, move |stop| {
                let n = Arc::clone(&n);
                async move {
                    stop.run_until_cancelled(n.keep_current()).await;
                }
            });
        }
    }
}

/// The breakers at a glance, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakersSummary {
    /// Whether any is open now.
    pub open: bool,
    /// How many times any opened, since start.
    pub times_opened: u64,
}

impl NodeBreakers {
    /// Reads the slot map every [`SLOT_REFRESH`].
    async fn keep_current(&self) {
        let mut tick = tokio::time::interval(SLOT_REFRESH);
        loop {
            tick.tick().await;
            self.refresh().await;
        }
    }

    async fn refresh(&self) {
        let Ok(Ok(ranges)) =
            tokio::time::timeout(Duration::from_secs(1), self.store.lifecycle.cluster_slots())
                .await
        else {
            return;
        };
        if ranges.is_empty() {
            return;
        }
        let mut table = (**self.by_slot.load()).clone();
        let mut nodes = self.by_node.lock();
        for SlotRange { first, last, node } in ranges {
            let breaker = nodes
                .entry(node)
                .or_insert_with_key(|node| {
                    let b = Arc::new(Breaker::new(self.budget, self.backoff));
                    let name = format!("{}-breaker-probe:{node}", self.label);
                    let probe_key = Some(key_in_slot(first));
                    b.spawn_prober(
                        &self.tasks,
                        name,
                        self.store.clone(),
                        probe_key,
                        self.budget,
                    );
                    b
                })
                .clone();
            for slot in first..=last.min(SLOTS as u16 - 1) {
                table[slot as usize] = Arc::clone(&breaker);
            }
        }
        self.by_slot.store(Arc::new(table));
    }
}
