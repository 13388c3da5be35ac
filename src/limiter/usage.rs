//! Usage history's tally: every decision about a client is counted here, in process, per
//! (client, limit, UTC hour): admitted, refused, their cost, and what was admitted without
//! the store (unmetered). The request's own store call is unchanged. Task `usage-flush`
//! does the rest, its CPU work on a thread below the request path's priority
//! (`usage-work`):
//!
//! - every `usage.flush_ms` it takes what was counted, merges it into what it holds since
//!   the last fold, and writes that to the store as this gateway's **checkpoint** (one
//!   value, replaced each time: `UsageHistory::checkpoint`);
//! - every `usage.fold_ms` (on the hour, by default) it **folds**: what the checkpoint
//!   holds becomes a numbered batch, added to each client's history
//!   (`UsageHistory::add`), so a client costs the store one record per fold, however many
//!   of its decisions were counted;
//! - a gateway silent for `usage.adopt_after_ms` (killed, cut off) has its checkpoint
//!   **adopted**: another adds its batches on its behalf (`UsageHistory::adopt`).
//!
//! Each batch is added once however many times it is sent: by this gateway again after a
//! reply was lost, or by both it and an adopter should it come back. That holds because a
//! batch never changes once numbered, every writer adds one gateway's batches in the order
//! of their numbers, and the checkpoint holds the batches not yet added, in order, and the
//! open one. What a gateway counted after its last checkpoint is lost if it dies (at most
//! `usage.flush_ms` of it); a graceful stop folds everything.
//!
//! The hour of a decision the store made is the store's clock (the ruling's `now_us`, the
//! clock a quota's window is read on), so a quota's window holds exactly the hours whose
//! admitted cost it counted; the others use this gateway's clock. Counts held, unsent
//! included, are bounded by `usage.max_entries`: past it, new ones are dropped and
//! counted.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;
use dashmap::DashMap;
use parking_lot::Mutex;

use crate::configuration::UsageSettings;
use crate::domain::{ClientId, Decision, Outcome};
use crate::metrics::Metrics;
use crate::store::{
    decode_checkpoint, encode_checkpoint, Checkpoint, Checkpointed, LocalLimits, Store, UsageBatch,
    UsageCounts, UsageEntry, DAY_S, HOUR_S,
};
use crate::tasks::{Niced, Policy, Tasks};

/// One client's counts being summed: per hour (unix s), per limit name.
type ClientHours = Vec<(u64, Vec<(Arc<str>, UsageCounts)>)>;

type Summing = DashMap<ClientId, ClientHours, foldhash::fast::RandomState>;

/// One count's place: client, limit, hour (unix s).
type Place = (ClientId, String, u64);

/// Adoptions one flush takes on at most (each is one gateway's checkpoint).
const ADOPTIONS_PER_FLUSH: usize = 4;

/// What a gateway counted and has not yet added to the history.
pub struct UsageTally {
    settings: UsageSettings,
    /// This process's id in the store's batch records.
    gateway: String,
    /// What is being summed. Decisions update it without a lock of its own (each client
    /// under its shard's lock, which only decisions take); taking it swaps in an empty
    /// map and goes through the old one once no decision holds it. The niced worker, which
    /// a busy host may not run for a while, never holds (nor waits for) a lock a decision
    /// would then wait on: a lock it held would stall the request path (priority
    /// inversion), as the benchmark's sheds showed.
    pending: ArcSwap<Summing>,
    /// (client, limit, hour) counts in `pending`.
    summing: AtomicUsize,
    /// What was taken from `pending` and not yet added; only the flush task changes it.
    held: Mutex<Held>,
    /// Counts in `held`.
    held_entries: AtomicUsize,
    seq: AtomicU64,
    /// When the next fold is due (unix ms).
    next_fold_ms: AtomicU64,
    /// The store has noted this gateway (a checkpoint was written), and has not adopted
    /// it since.
    noted: AtomicBool,
    metrics: Arc<Metrics>,
}

/// What a gateway took from its tally and has not yet added.
#[derive(Default)]
struct Held {
    /// Batches to add, oldest first, each until the store has it; every one of them is in
    /// the checkpoint last written.
    folding: VecDeque<Arc<UsageBatch>>,
    /// The counts since the last fold, as the checkpoint last written holds them (a
    /// batch, numbered when written).
    open: Option<UsageBatch>,
    /// Counts taken since that checkpoint.
    since: HashMap<Place, UsageCounts>,
    /// `folding` changed since the checkpoint last written.
    changed: bool,
}

impl Held {
    fn entries(&self) -> usize {
        self.folding.iter().map(|b| b.entries.len()).sum::<usize>()
            + self.open.as_ref().map_or(0, |b| b.entries.len())
            + self.since.len()
    }
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
            pending: ArcSwap::from_pointee(Summing::default()),
            summing: AtomicUsize::new(0),
            held: Mutex::new(Held::default()),
            held_entries: AtomicUsize::new(0),
            seq: AtomicU64::new(0),
            next_fold_ms: AtomicU64::new(0),
            noted: AtomicBool::new(false),
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
        let pending = self.pending.load();
        let mut hours = match pending.get_mut(client) {
            Some(hours) => hours,
            None => pending.entry(client.clone()).or_default(),
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

    /// Counts held: summing and not yet added.
    fn held(&self) -> usize {
        self.summing.load(Relaxed) + self.held_entries.load(Relaxed)
    }

    fn batch(&self, entries: Vec<UsageEntry>) -> UsageBatch {
        UsageBatch {
            gateway: self.gateway.clone(),
            seq: self.seq.fetch_add(1, Relaxed) + 1,
            retention_s: self.settings.retention_days * DAY_S,
            entries,
        }
    }

    /// Takes what was summed so far into `held.since`.
    fn take_pending(&self, held: &mut Held) {
        let mut summed = self.pending.swap(Arc::new(Summing::default()));
        // A decision that loaded the old map before the swap may be counting in it still:
        // it is done within microseconds.
        let summed = loop {
            match Arc::try_unwrap(summed) {
                Ok(summed) => break summed,
                Err(shared) => {
                    summed = shared;
                    std::thread::sleep(Duration::from_micros(100));
                }
            }
        };
        let mut drained = 0;
        for (client, hours) in summed {
            for (hour_s, limits) in hours {
                drained += limits.len();
                for (limit, counts) in limits {
                    if !counts.is_empty() {
                        let place = (client.clone(), limit.to_string(), hour_s);
                        held.since.entry(place).or_default().add(&counts);
                    }
                }
            }
        }
        // Each count was added to `summing` under its client's lock, when it was made.
        self.summing.fetch_sub(drained, Relaxed);
        self.held_entries.store(held.entries(), Relaxed);
    }

    /// The next checkpoint (CPU work, for the niced worker): what was summed is taken, and
    /// merged with the open batch into a new one, numbered anew.
    fn prepare(&self) -> Prepared {
        let mut held = self.held.lock();
        self.take_pending(&mut held);
        if held.since.is_empty() && !held.changed {
            return Prepared {
                open: None,
                write: Write::Same,
            };
        }
        // The open batch merged with what was taken since, numbered anew; when nothing
        // was taken, the open batch as it is.
        let merged = (!held.since.is_empty()).then(|| {
            let mut merged: HashMap<Place, UsageCounts> = HashMap::new();
            for e in held.open.iter().flat_map(|b| &b.entries) {
                let place = (e.client.clone(), e.limit.clone(), e.hour_s);
                merged.insert(place, e.counts);
            }
            for (place, counts) in &held.since {
                merged.entry(place.clone()).or_default().add(counts);
            }
            self.batch(entries(merged))
        });
        let open = merged.as_ref().or(held.open.as_ref());
        let batches: Vec<&UsageBatch> = held.folding.iter().map(|b| &**b).chain(open).collect();
        let write = if batches.is_empty() {
            Write::Empty
        } else {
            Write::Holds(encode_checkpoint(&batches))
        };
        Prepared {
            open: merged,
            write,
        }
    }

    /// Writes the checkpoint `prepare` made; once the store has it, its open batch is the
    /// one held. Adopted meanwhile: the open batch last written is the adopter's too, so it
    /// is added as it is (each batch is added once, whoever adds it), merged into nothing
    /// more; what was taken since is kept, for the next checkpoint, written as a new one.
    async fn checkpoint(&self, store: &Store, within: Duration, prepared: Prepared) {
        let held = match &prepared.write {
            Write::Same => Checkpoint::Same,
            Write::Empty => Checkpoint::Empty,
            Write::Holds(bytes) => Checkpoint::Holds(bytes),
        };
        let noted = self.noted.load(Relaxed);
        let write = store.usage.checkpoint(&self.gateway, held, noted);
        let answer = tokio::time::timeout(within, write).await;
        self.metrics
            .usage
            .checkpoint(matches!(answer, Ok(Ok(Checkpointed::Written))));
        let mut held = self.held.lock();
        match answer {
            Ok(Ok(Checkpointed::Written)) => {
                if let Some(open) = prepared.open {
                    held.open = Some(open);
                    held.since.clear();
                }
                held.changed = false;
                self.noted.store(true, Relaxed);
            }
            Ok(Ok(Checkpointed::Adopted)) => {
                tracing::warn!(
                    "this gateway was silent long enough for another to add the usage history it held: both add it, once"
                );
                if let Some(open) = held.open.take() {
                    held.folding.push_back(Arc::new(open));
                }
                held.changed = true;
                self.noted.store(false, Relaxed);
            }
            answer => tracing::warn!(
                error = %failure(answer.map(|r| r.map(|_| ())), within),
                "usage history not checkpointed: what was counted is kept, and written at the next flush"
            ),
        }
        self.held_entries.store(held.entries(), Relaxed);
    }

    /// Makes what is held ready to add (CPU work, for the niced worker): the open batch as
    /// the checkpoint holds it, then what was taken since as a batch of its own, never
    /// merged into one an adopter may have added.
    fn freeze(&self) {
        let mut held = self.held.lock();
        self.take_pending(&mut held);
        let open = held.open.take();
        let since = held.since.drain().collect::<Vec<_>>();
        let since = (!since.is_empty()).then(|| self.batch(entries(since)));
        for batch in open.into_iter().chain(since) {
            held.folding.push_back(Arc::new(batch));
            held.changed = true;
        }
    }

    /// Adds what is held, oldest first, each batch within `within`, until one fails (it
    /// is kept, and added first next time). Whether all was added.
    async fn fold(self: &Arc<Self>, store: &Store, within: Duration, niced: &Niced) -> bool {
        let tally = Arc::clone(self);
        niced.run(move || tally.freeze()).await;
        loop {
            let Some(batch) = self.held.lock().folding.front().cloned() else {
                return true;
            };
            let answer = tokio::time::timeout(within, store.usage.add(&batch)).await;
            if matches!(answer, Ok(Ok(()))) {
                self.metrics.usage.flush(true);
                let mut held = self.held.lock();
                held.folding.pop_front();
                held.changed = true;
                self.held_entries.store(held.entries(), Relaxed);
            } else {
                self.metrics.usage.flush(false);
                tracing::warn!(
                    error = %failure(answer, within),
                    batch = batch.seq,
                    entries = batch.entries.len(),
                    "usage history not added: kept, and added again at the next flush"
                );
                return false;
            }
        }
    }

    /// Adds the checkpoints of gateways silent past `usage.adopt_after_ms` on their
    /// behalf, a few per flush.
    async fn adopt(&self, store: &Store, within: Duration, niced: &Niced) {
        for _ in 0..ADOPTIONS_PER_FLUSH {
            let taken = tokio::time::timeout(within, store.usage.adopt(self.settings.adopt_after));
            let (gateway, bytes) = match taken.await {
                Ok(Ok(Some(taken))) => taken,
                Ok(Ok(None)) => return,
                answer => {
                    tracing::warn!(error = %failure(answer.map(|r| r.map(|_| ())), within), "silent gateways' usage history not looked for");
                    return;
                }
            };
            let batches = niced.run(move || decode_checkpoint(&bytes)).await;
            match batches {
                Some(Ok(batches)) => {
                    for batch in &batches {
                        let answer = tokio::time::timeout(within, store.usage.add(batch)).await;
                        if !matches!(answer, Ok(Ok(()))) {
                            tracing::warn!(gateway = %gateway, error = %failure(answer, within), "a silent gateway's usage history not added: taken again later");
                            return;
                        }
                    }
                    tracing::info!(gateway = %gateway, batches = batches.len(), "added the usage history a silent gateway held");
                    self.metrics.usage.adopted(true);
                }
                other => {
                    let error = match other {
                        Some(Err(e)) => e,
                        _ => "its reading panicked".into(),
                    };
                    tracing::error!(gateway = %gateway, error = %error, "a silent gateway's usage history cannot be read: dropped");
                    self.metrics.usage.adopted(false);
                }
            }
            let released = tokio::time::timeout(within, store.usage.release(&gateway)).await;
            if !matches!(released, Ok(Ok(()))) {
                tracing::warn!(gateway = %gateway, error = %failure(released, within), "an adopted usage history not released: added again later (once)");
            }
        }
    }

    /// One flush: the checkpoint, the fold when due (or `stopping`), and the silent
    /// gateways' checkpoints. Store calls are each bounded by `within`; the CPU work runs
    /// on `niced`.
    pub async fn flush(
        self: &Arc<Self>,
        store: &Store,
        within: Duration,
        niced: &Niced,
        stopping: bool,
    ) {
        let tally = Arc::clone(self);
        if let Some(prepared) = niced.run(move || tally.prepare()).await {
            self.checkpoint(store, within, prepared).await;
        }
        let now_ms = unix_ms();
        let due = stopping || now_ms >= self.next_fold_ms.load(Relaxed);
        if due && self.fold(store, within, niced).await {
            self.next_fold_ms.store(self.fold_after(now_ms), Relaxed);
        }
        if stopping {
            let empty = self.held.lock().entries() == 0;
            if empty {
                let retired = tokio::time::timeout(within, store.usage.retire(&self.gateway)).await;
                if !matches!(retired, Ok(Ok(()))) {
                    tracing::debug!(error = %failure(retired, within), "usage history's checkpoint not removed: another gateway finds it empty");
                }
            } else {
                // What could not be added is left for another gateway to add.
                let tally = Arc::clone(self);
                if let Some(prepared) = niced.run(move || tally.prepare()).await {
                    self.checkpoint(store, within, prepared).await;
                }
            }
        } else {
            self.adopt(store, within, niced).await;
        }
        self.metrics.usage.set_held(self.held());
    }

    /// When the fold after `now_ms` is due: the next multiple of `usage.fold_ms`, plus
    /// this gateway's own delay (up to a tenth of it, at most a minute), so that a
    /// fleet's folds spread out.
    fn fold_after(&self, now_ms: u64) -> u64 {
        let fold = u64::try_from(self.settings.fold.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        let spread = (fold / 10).clamp(1, 60_000);
        let delay = u64::from_str_radix(&self.gateway, 16).unwrap_or(0) % spread;
        (now_ms / fold + 1) * fold + delay
    }

    /// Starts task `usage-flush` (a flush every `usage.flush_ms`, and a last one when the
    /// gateway stops, after its servers have, so every decision is in it) and its niced
    /// worker `usage-work`, each store call bounded by `within`.
    pub fn spawn_flush(self: &Arc<Self>, tasks: &Tasks, store: Store, within: Duration) {
        if !self.settings.enabled {
            return;
        }
        self.next_fold_ms.store(self.fold_after(unix_ms()), Relaxed);
        let niced = tasks.spawn_niced("usage-work");
        let tally = Arc::clone(self);
        tasks.spawn("usage-flush", Policy::Restart, move |stop| {
            let (tally, store, niced) = (Arc::clone(&tally), store.clone(), niced.clone());
            async move {
                let mut tick = tokio::time::interval(tally.settings.flush);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                tick.tick().await;
                stop.run_until_cancelled(async {
                    loop {
                        tick.tick().await;
                        tally.flush(&store, within, &niced, false).await;
                    }
                })
                .await;
                tally.flush(&store, within, &niced, true).await;
            }
        });
    }
}

/// The next checkpoint: the open batch it holds (`None`: the one held, unchanged), and
/// what to write.
struct Prepared {
    open: Option<UsageBatch>,
    write: Write,
}

/// A batch's entries, from counts by place.
fn entries(counts: impl IntoIterator<Item = (Place, UsageCounts)>) -> Vec<UsageEntry> {
    counts
        .into_iter()
        .map(|((client, limit, hour_s), counts)| UsageEntry {
            client,
            limit,
            hour_s,
            counts,
        })
        .collect()
}

enum Write {
    /// Nothing changed since the last checkpoint: the gateway is only noted alive.
    Same,
    Empty,
    Holds(Vec<u8>),
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Why a store call bounded by `within` failed.
fn failure<E: std::fmt::Display>(
    answer: Result<Result<(), E>, tokio::time::error::Elapsed>,
    within: Duration,
) -> String {
    match answer {
        Ok(Err(e)) => e.to_string(),
        Ok(Ok(())) => "none".into(),
        Err(_) => format!("no answer within {within:?}"),
    }
}
