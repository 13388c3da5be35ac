//! The catalog of plans and clients: stored in the [`Store`], held in every gateway's
//! memory. The request path reads only memory ([`Catalog::by_key`]); a background task
//! (`catalog-refresh`, [`Catalog::spawn_refresh`]) follows the store's change feed and
//! applies what changed, at most `refresh_ms` late.
//!
//! A gateway holds either the whole catalog (`catalog.mode = "mirror"`) or every plan and
//! a bounded cache of the clients in use (`"cache"`, see [`held`]): a key it does not hold
//! is looked up in the store once ([`Catalog::look_up`]), then cached, or remembered as
//! unknown.

pub mod cache;
pub mod diff;
mod held;
pub mod key_filter;
mod start;

pub use held::{LookupFailed, LOOKUP_BUCKETS};
pub use start::StoreStart;

use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use dashmap::DashMap;

pub use crate::store::records::{
    Audit, AuditEntry, CatalogChanges, CatalogDump, CatalogWrite, ClientRecord, Condition,
    KeyRecord, PlanRecord, SafetyRecord, Shards, Versioned, WriteOutcome,
};

use actix_web::http::header::HeaderValue;

use crate::configuration::{Holding, Settings};
use crate::domain::{ClientId, Decision, KeyHash, Limits, Mode, PlanName, Region};
use crate::store::records::{KeyLookup, Wants};
use crate::store::{CatalogAt, Keys, Store, StoreError};
use crate::tasks::{Policy, Tasks};
use futures_util::FutureExt;
use held::{Held, Recent};

/// How long a start waits for the key filter's copy.
pub const KEY_FILTER_AT_START: Duration = Duration::from_millis(500);
/// How often a gateway checks that its copy of the key filter is the store's.
const KEY_FILTER_CHECK: Duration = Duration::from_secs(1);
/// Bytes of the key filter read per call, and the pause after each once the gateway
/// serves: a 16 MiB filter is 256 reads over about a second, not a burst that takes a
/// 2-core host's CPU (and the catalog master's) from requests (measured: read in 1 MiB
/// calls while serving, a start's first requests had a p99 of 17-106 ms, against 3-7 ms
/// without a filter). Before it serves, a gateway reads it unpaced
/// ([`Catalog::first_key_filter`]).
const KEY_FILTER_READ: usize = 64 << 10;
const KEY_FILTER_PAUSE: Duration = Duration::from_millis(3);

/// A plan's current limits, shared by every client on it so a plan edit is one store.
pub struct PlanSlot {
    pub name: PlanName,
    current: ArcSwap<PlanState>,
}

/// One version of a plan, with what the request path derives from it, computed once.
struct PlanState {
    limits: Arc<Limits>,
    record: PlanRecord,
    /// The catalog version that last wrote it (kept so a restore keeps every ETag).
    rev: u64,
    /// The `RateLimit-Policy` value of a request its limits for every service decide.
    policy: HeaderValue,
}

impl PlanState {
    fn new(name: &PlanName, limits: Limits, record: Versioned<PlanRecord>) -> PlanState {
        let applied = limits.applied(None);
        PlanState {
            policy: crate::domain::policy_header(name, &applied),
            limits: Arc::new(limits),
            record: record.value,
            rev: record.rev,
        }
    }
}

impl PlanSlot {
    fn new(name: PlanName, limits: Limits, record: Versioned<PlanRecord>) -> PlanSlot {
        PlanSlot {
            current: ArcSwap::from_pointee(PlanState::new(&name, limits, record)),
            name,
        }
    }

    pub fn limits(&self) -> Arc<Limits> {
        Arc::clone(&self.current.load().limits)
    }

    pub fn record(&self) -> PlanRecord {
        self.current.load().record.clone()
    }

    /// A client's open upgraded (WebSocket) connections at most (`None`: no cap).
    pub fn max_connections(&self) -> Option<u32> {
        self.current
            .load()
            .record
            .max_connections
            .filter(|&n| n > 0)
    }

    /// The `RateLimit-Policy` value for a decision: the plan's, built once, when the
    /// decision was under the plan's own limits for every service, else built for it (a
    /// service's own limits, an override, a regional shard's portion).
    pub fn policy(&self, decision: &Decision) -> HeaderValue {
        if decision.as_planned {
            self.current.load().policy.clone()
        } else {
            crate::domain::policy_header(&self.name, &decision.applied)
        }
    }
}

/// What the request path needs to know about a client, resolved ahead of time.
pub struct ClientEntry {
    pub id: ClientId,
    /// The id as the `X-Client-Id` header the service gets, built once.
    pub id_header: HeaderValue,
    pub plan: Arc<PlanSlot>,
    pub mode: Mode,
    /// The Redis key of the client's bucket, built once.
    pub bucket_key: Box<str>,
    /// Set when the client's bucket is sharded by region.
    pub shard: Option<ShardEntry>,
    /// When the client stopped being sharded, if it did recently (its global bucket then
    /// starts as full as its shards were).
    pub unsharded_at: Option<Instant>,
    pub record: ClientRecord,
    /// The catalog version that last wrote it.
    pub rev: u64,
}

impl ClientEntry {
    /// Its record and version, copied (as the cache files keep them).
    fn versioned(&self) -> Versioned<ClientRecord> {
        Versioned {
            rev: self.rev,
            value: self.record.clone(),
        }
    }

    /// Whether `hash` is one of its keys that has not expired.
    pub fn active_key(&self, hash: &KeyHash) -> bool {
        let now_s = unix_now_s();
        self.record
            .keys
            .iter()
            .any(|k| k.hash == *hash && k.expires_at.is_none_or(|at| at > now_s))
    }

    /// When `hash`, one of its keys, expired (unix s), if it has.
    pub fn expired_at(&self, hash: &KeyHash) -> Option<u64> {
        let now_s = unix_now_s();
        self.record
            .keys
            .iter()
            .find(|k| k.hash == *hash)
            .and_then(|k| k.expires_at.filter(|&at| at <= now_s))
    }

    /// The limits its requests are decided against now: its plan's, with its overrides
    /// that have not expired.
    pub fn limits(&self) -> Arc<Limits> {
        let plan = self.plan.limits();
        if self.record.overrides.is_empty() {
            return plan;
        }
        let now_s = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Arc::new(plan.overridden(&self.record.overrides, now_s))
    }
}

/// A hot client's regional sharding, as this gateway sees it.
pub struct ShardEntry {
    pub regions: Vec<Region>,
    /// This gateway's region's shard key, when its region is one of `regions`.
    pub local_key: Option<Box<str>>,
}

/// A lookup's answer: the client (`None`: no client has the key), or why there is none.
type Looked = Result<Option<Arc<ClientEntry>>, LookupFailed>;

/// Cache mode's counts, for the metrics.
#[derive(Debug, Clone, Copy)]
pub struct CacheCounts {
    pub unknown_keys: u64,
    pub found: u64,
    pub unknown: u64,
    pub failed: u64,
    /// Keys the key filter refused without a read.
    pub filtered: u64,
    /// The key filter's size in bytes, when a trusted copy is in place (else 0).
    pub filter_bytes: usize,
    /// How long reads took: per bucket of [`LOOKUP_BUCKETS`], the seconds in all, the count.
    pub lookup_seconds: ([u64; LOOKUP_BUCKETS.len()], f64, u64),
}

/// Which catalog a gateway is serving.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The store's (the mirror has caught up with it at least once since start).
    Store,
    /// The last-known catalog from `catalog.cache_file`, written at `saved_at_ms`: the
    /// store has not answered since start.
    Cache { saved_at_ms: u64 },
    /// Only what the configuration declares: the store has not answered since start and
    /// there was no cache file.
    Config,
}

impl Source {
    /// The `source` label of `tollgate_catalog_source`, and what `/readyz` says.
    pub fn label(self) -> &'static str {
        match self {
            Source::Store => "store",
            Source::Cache { .. } => "cache",
            Source::Config => "config",
        }
    }
}

/// The in-memory mirror of the catalog.
pub struct Catalog {
    plans: DashMap<PlanName, Arc<PlanSlot>>,
    clients: DashMap<ClientId, Arc<ClientEntry>>,
    /// By SHA-256 of the key: already uniform, so a fast hasher is as safe as SipHash.
    keys: DashMap<KeyHash, KeySlot, foldhash::fast::RandomState>,
    /// The key-use period now: a key used marks its slot with it (see [`KeySlot::seen`]).
    use_tick: AtomicU32,
    /// Keys past their `expires_at`, with when they expired (unix s): read only when a key
    /// is not in `keys`, to answer "expired" rather than "unknown".
    expired: DashMap<KeyHash, u64, foldhash::fast::RandomState>,
    /// Keys in `keys` that will expire, by when: [`Catalog::expire_due`] moves them.
    expiring: parking_lot::Mutex<std::collections::BTreeSet<(u64, KeyHash)>>,
    safety: ArcSwap<Option<SafetyRecord>>,
    /// The catalog version that last wrote the safety settings.
    safety_rev: AtomicU64,
    /// Clients whose buckets are sharded by region.
    sharded: DashMap<ClientId, Arc<ClientEntry>>,
    /// The identity of the catalog this mirror follows (see [`CatalogDump::epoch`]).
    epoch: parking_lot::Mutex<Option<String>>,
    /// Where this mirror came from.
    source: parking_lot::Mutex<Source>,
    /// Where the last catalog seen is kept on disk (Redis mode), and what was written last.
    cache: Option<std::path::PathBuf>,
    /// The thread that writes them (started with a cache file).
    writer: Option<cache::Writer>,
    /// What the cache files need next (see [`cache`]).
    journal: parking_lot::Mutex<Journal>,
    /// Cache mode's bounds and bookkeeping; `None`: the whole catalog is held.
    held: Option<Held<Looked>>,
    /// Held while changes are applied, and while a lookup's answer is put in: the two
    /// never interleave (see [`held::Recent`]).
    apply: parking_lot::Mutex<()>,
    version: AtomicU64,
    default_mode: Mode,
    key_names: Keys,
    region: Region,
}

impl Catalog {
    pub fn new(default_mode: Mode, key_names: Keys, region: Region) -> Catalog {
        Catalog {
            sharded: DashMap::new(),
            region,
            plans: DashMap::new(),
            clients: DashMap::new(),
            keys: DashMap::default(),
            use_tick: AtomicU32::new(1),
            expired: DashMap::default(),
            expiring: Default::default(),
            safety: ArcSwap::from_pointee(None),
            safety_rev: AtomicU64::new(0),
            epoch: parking_lot::Mutex::new(None),
            source: parking_lot::Mutex::new(Source::Config),
            cache: None,
            writer: None,
            journal: parking_lot::Mutex::new(Journal::default()),
            held: None,
            apply: parking_lot::Mutex::new(()),
            version: AtomicU64::new(0),
            default_mode,
            key_names,
        }
    }

    /// The client an API key belongs to, if this gateway holds it. No I/O.
    pub fn by_key(&self, hash: &KeyHash) -> Option<Arc<ClientEntry>> {
        self.keys.get(hash).map(|slot| {
            // Two relaxed loads; a store once per key per flush period.
            let tick = self.use_tick.load(Relaxed);
            if slot.seen.load(Relaxed) != tick {
                slot.seen.store(tick, Relaxed);
            }
            if let Some(held) = &self.held {
                // A use, for the cache's policy (it counts how often each client is used).
                held.clients.get(&slot.client.id);
            }
            Arc::clone(&slot.client)
        })
    }

    /// Holds every plan and only the clients in use, within `holding`'s bounds.
    pub fn with_holding(mut self, holding: Holding) -> Catalog {
        self.held = match holding {
            Holding::Mirror => None,
            Holding::Cache(bounds) => {
                // Sized for the bound at once (see `held::PRESIZED_AT_MOST`): a map that
                // grows rehashes on the worker that inserts.
                let at_most = held::presized(bounds.clients);
                if self.clients.is_empty() && self.keys.is_empty() {
                    self.clients = DashMap::with_capacity(at_most);
                    self.keys = DashMap::with_capacity_and_hasher(at_most, Default::default());
                }
                Some(Held::new(bounds))
            }
        };
        self
    }

    /// Whether a key this gateway does not hold may still be a client's: cache mode, and
    /// the key is not remembered as unknown. No I/O.
    pub fn may_hold(&self, hash: &KeyHash) -> bool {
        let Some(held) = &self.held else {
            return false;
        };
        if held.unknown.contains_key(hash) {
            return false;
        }
        if !held.filter.may_have(hash) {
            held.lookups.filtered.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Cache mode: whether a trusted copy of the key filter is in place (keys no client has
    /// are refused before any lookup).
    pub fn key_filter_in_place(&self) -> bool {
        self.held
            .as_ref()
            .is_some_and(|h| h.filter.trusted_len() > 0)
    }

    /// Cache mode: the client whose key this is, read from the store (at most
    /// `catalog.lookup_timeout_ms`; requests waiting on the same key share one read), then
    /// held, or the key remembered as unknown. `Ok(None)`: no client has it.
    pub async fn look_up(self: &Arc<Self>, store: &Store, hash: KeyHash) -> Looked {
        let Some(held) = &self.held else {
            return Ok(None);
        };
        let shared = match held.inflight.entry(hash) {
            dashmap::Entry::Occupied(e) => e.get().clone(),
            dashmap::Entry::Vacant(v) => {
                let (catalog, store) = (Arc::clone(self), store.clone());
                let read = async move {
                    let started = Instant::now();
                    let looked = catalog.fetch(&store, hash).await;
                    if let Some(held) = &catalog.held {
                        held.lookups.took(started.elapsed());
                        held.lookups
                            .count(looked.as_ref().ok().map(Option::is_some));
                        held.inflight.remove(&hash);
                    }
                    looked
                }
                .boxed()
                .shared();
                v.insert(read.clone());
                // Driven to its end on this worker whoever waits: a request that goes away
                // (its client hung up) must not leave its read, and its entry, behind.
                actix_rt::spawn(read.clone().map(drop));
                read
            }
        };
        shared.await
    }

    /// Reads a key's client within the lookup timeout, and settles the answer.
    async fn fetch(&self, store: &Store, hash: KeyHash) -> Looked {
        let Some(held) = &self.held else {
            return Ok(None);
        };
        let reads = async {
            // An answer the feed overtook is read again, once; a second is used for this
            // request only.
            for last in [false, true] {
                let lookup = store
                    .catalog
                    .client_by_key(&hash, held.lookup_timeout / 2)
                    .await
                    .map_err(|e| LookupFailed(e.to_string()))?;
                if let Some(settled) = self.settle(lookup, hash, last) {
                    return Ok(settled);
                }
            }
            Ok(None)
        };
        tokio::time::timeout(held.lookup_timeout, reads)
            .await
            .unwrap_or_else(|_| {
                Err(LookupFailed(format!(
                    "the store did not answer within {} ms",
                    held.lookup_timeout.as_millis()
                )))
            })
    }

    /// Puts a lookup's answer in (the client held, or the key remembered as unknown), if
    /// nothing applied since it was read touched its key or client; `None`: it did, read
    /// again (unless `last`: then the answer is only returned).
    fn settle(
        &self,
        lookup: KeyLookup,
        hash: KeyHash,
        last: bool,
    ) -> Option<Option<Arc<ClientEntry>>> {
        let held = self.held.as_ref()?;
        let _apply = self.apply.lock();
        self.forget_evicted();
        let client = lookup.client.as_ref().map(|c| &c.value.id);
        let same_epoch = lookup.epoch == self.epoch();
        let stands = same_epoch && held.recent.lock().stands(lookup.version, &hash, client);
        // Another catalog than the one followed (until the next poll takes it): reading
        // again would meet it again; the answer serves this request, and is not held.
        if !stands && !last && same_epoch {
            return None;
        }
        let Some(rec) = lookup.client else {
            if stands {
                held.unknown.insert(hash, ());
            }
            return Some(None);
        };
        let id = rec.value.id.clone();
        if let Some(entry) = self.clients.get(&id).filter(|e| e.rev >= rec.rev) {
            return Some(Some(Arc::clone(&entry)));
        }
        if !stands {
            return Some(self.entry(&id, rec, None));
        }
        let entry = self.apply_client(id.clone(), Some(rec));
        if entry.is_some() {
            held.clients.insert(id, ());
        }
        Some(entry)
    }

    /// Forgets the clients the cache let go. Under the apply lock.
    fn forget_evicted(&self) {
        let Some(held) = &self.held else {
            return;
        };
        let evicted = std::mem::take(&mut *held.evicted.lock());
        for id in evicted {
            // Let go, then looked up again since: it stays.
            if !held.clients.contains_key(&id) {
                self.apply_client(id, None);
            }
        }
    }

    /// The keys used since the last call, as `<client>/<key_id>` members, each with
    /// `now_s`; later uses mark the next period. Off the request path.
    pub fn keys_used(&self, now_s: u64) -> Vec<(String, u64)> {
        let tick = self.use_tick.fetch_add(1, Relaxed);
        self.keys
            .iter()
            .filter(|slot| slot.seen.load(Relaxed) == tick)
            .filter_map(|slot| {
                let key = slot
                    .client
                    .record
                    .keys
                    .iter()
                    .find(|k| k.hash == *slot.key())?;
                Some((key_member(&slot.client.id, &key.key_id), now_s))
            })
            .collect()
    }

    /// Writes the keys used since the last flush to the store, with the time (their
    /// `last_used_at`). Best effort: a failed write is logged, and the keys are marked
    /// again by their next use.
    pub async fn flush_key_use(&self, store: &Store) {
        let used = self.keys_used(unix_now_s());
        if used.is_empty() {
            return;
        }
        if let Err(e) = store.key_use.touch(&used).await {
            tracing::warn!(error = %e, keys = used.len(), "could not record when keys were last used");
        }
    }

    /// Starts task `key-use-flush`, which calls [`Catalog::flush_key_use`] every `period`.
    pub fn spawn_key_use_flush(self: &Arc<Self>, tasks: &Tasks, store: Store, period: Duration) {
        let catalog = Arc::clone(self);
        tasks.spawn("key-use-flush", Policy::Restart, move |stop| {
            let (catalog, store) = (Arc::clone(&catalog), store.clone());
            async move {
                stop.run_until_cancelled(async {
                    let mut tick = tokio::time::interval(period);
                    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    tick.tick().await;
                    loop {
                        tick.tick().await;
                        catalog.flush_key_use(&store).await;
                    }
                })
                .await;
            }
        });
    }

    /// When a key that no longer works expired (unix s), if it did (rather than never
    /// existing, or being revoked). No I/O.
    pub fn expired_at(&self, hash: &KeyHash) -> Option<u64> {
        self.expired.get(hash).map(|at| *at)
    }

    /// Takes the keys whose `expires_at` is `now_s` or earlier out of service: they answer
    /// "expired" from now on. Run on every catalog tick, before and whatever the store
    /// answers, so keys expire on time while the store is down.
    pub fn expire_due(&self, now_s: u64) {
        loop {
            let due = {
                let mut expiring = self.expiring.lock();
                match expiring.first() {
                    Some(&(at, hash)) if at <= now_s => {
                        expiring.pop_first();
                        (at, hash)
                    }
                    _ => return,
                }
            };
            let (at, hash) = due;
            let Some(entry) = self.by_key(&hash) else {
                continue;
            };
            // Only if the client in service still has this key expiring then (a stale
            // entry: the key was revoked, or its record changed since).
            let still = entry
                .record
                .keys
                .iter()
                .any(|k| k.hash == hash && k.expires_at == Some(at));
            if still {
                self.expired.insert(hash, at);
                self.keys
                    .remove_if(&hash, |_, s| Arc::ptr_eq(&s.client, &entry));
            }
        }
    }

    /// A plan by name: what a public route limits requests without a key by. No I/O.
    pub fn plan(&self, name: &PlanName) -> Option<Arc<PlanSlot>> {
        self.plans.get(name).map(|p| Arc::clone(&p))
    }

    /// Key names (bucket keys for admin inspection).
    pub fn key_names(&self) -> &Keys {
        &self.key_names
    }

    /// The safety settings stored through the admin API, if any (no reference count
    /// taken: for the request path).
    pub fn safety_guard(&self) -> arc_swap::Guard<Arc<Option<SafetyRecord>>> {
        self.safety.load()
    }

    /// The store version this mirror reflects.
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    /// The epoch of the catalog this mirror follows.
    pub fn epoch(&self) -> Option<String> {
        self.epoch.lock().clone()
    }

    /// Keeps the last catalog seen in `file` (Redis mode; see [`cache`]).
    pub fn with_cache_file(mut self, file: Option<std::path::PathBuf>) -> Catalog {
        self.writer = file.as_ref().map(|_| cache::Writer::start());
        self.cache = file;
        self
    }

    /// Whether some plan has a quota (whose count the store must keep across its restart).
    pub fn has_quotas(&self) -> bool {
        self.plans.iter().any(|p| p.limits().has_quotas())
    }

    /// Cache mode: keys remembered as unknown, and what lookups found (clients, unknown
    /// keys, failures) since start; `None`: the whole catalog is held.
    pub fn cache_counts(&self) -> Option<CacheCounts> {
        let held = self.held.as_ref()?;
        held.unknown.run_pending_tasks();
        Some(CacheCounts {
            unknown_keys: held.unknown.entry_count(),
            found: held.lookups.client.load(Relaxed),
            unknown: held.lookups.unknown.load(Relaxed),
            failed: held.lookups.failed.load(Relaxed),
            filtered: held.lookups.filtered.load(Relaxed),
            filter_bytes: held.filter.trusted_len(),
            lookup_seconds: held.lookups.histogram(),
        })
    }

    /// How many clients the mirror holds.
    pub fn len(&self) -> usize {
        self.clients.len()
    }

    pub fn is_empty(&self) -> bool {
        self.clients.is_empty()
    }

    /// Which catalog this gateway serves.
    pub fn source(&self) -> Source {
        *self.source.lock()
    }

    /// The store did not answer at start: serve the last-known catalog from the cache
    /// file, or else what the configuration declares, until it does. Decisions fail open
    /// meanwhile (the store is down), within the safety limits; keys are recognised.
    pub fn serve_fallback(&self, settings: &Settings) -> Source {
        let source = match self.cache.as_deref().and_then(cache::load) {
            Some(cached) => {
                self.replace(cached.catalog);
                let mut journal = self.journal.lock();
                journal.seq = cached.seq + 1;
                // Served as it is on disk: nothing to write until it changes.
                journal.snapshot_due = false;
                journal.written_at = (self.epoch(), self.version());
                drop(journal);
                Source::Cache {
                    saved_at_ms: cached.saved_at_ms,
                }
            }
            None => {
                let (plans, clients) = declared(settings);
                self.replace(CatalogDump {
                    epoch: None,
                    version: 0,
                    plans: plans
                        .into_iter()
                        .map(|value| Versioned { rev: 0, value })
                        .collect(),
                    clients: clients
                        .into_iter()
                        .map(|value| Versioned { rev: 0, value })
                        .collect(),
                    safety: None,
                });
                Source::Config
            }
        };
        *self.source.lock() = source;
        source
    }

    /// Writes what changed since the last tick to the cache files, on the cache's thread:
    /// a journal line, or (after a reload, or once the journal outgrew the snapshot) a new
    /// snapshot. Errors are logged, and the next tick writes a snapshot: the cache only
    /// matters at a start during an outage.
    async fn save_cache(&self) {
        let (Some(file), Some(writer)) = (self.cache.clone(), self.writer.as_ref()) else {
            return;
        };
        let job = {
            // The changes and the version they stand at, taken together. (A snapshot's
            // records are copied after the lock is let go: a lookup, on a worker, never
            // waits for that copy. Changes applied meanwhile may be in it as well as in
            // the next line: applying a line again changes nothing.)
            let _apply = self.apply.lock();
            let at = (self.epoch(), self.version());
            let mut journal = self.journal.lock();
            if at.1 == 0 && at.0.is_none() {
                return;
            }
            // No snapshot yet (a journal needs one under it), a reload, or a journal
            // grown past its snapshot.
            let compact = journal.seq == 0
                || journal.snapshot_due
                || (journal.entries > cache::COMPACT_AFTER
                    && journal.entries > journal.snapshot_records);
            let job = if compact {
                journal.start_over(self.plans.len() + self.clients.len());
                CacheWrite::SnapshotDue(journal.seq - 1)
            } else if journal.is_empty() && journal.written_at == at {
                return;
            } else {
                CacheWrite::Line(journal.line(&at))
            };
            journal.written_at = at;
            job
        };
        let job = match job {
            CacheWrite::SnapshotDue(seq) => {
                let mut entries = self.entries();
                // The epoch and version of the changes taken under the lock.
                (entries.epoch, entries.version) = self.journal.lock().written_at.clone();
                CacheWrite::Snapshot(entries, seq)
            }
            other => other,
        };
        // Copied, encoded and written on the cache's thread, below the request path's
        // priority (see [`cache`]).
        let written = writer
            .run(move || match job {
                CacheWrite::Snapshot(entries, seq) => cache::save(&file, entries.copied(), seq),
                CacheWrite::SnapshotDue(_) => Ok(()),
                CacheWrite::Line(line) => cache::append(&file, &[line.copied()]),
            })
            .await;
        let failed = match written {
            Some(Ok(())) => return,
            Some(Err(e)) => e.to_string(),
            None => "its writer panicked".to_owned(),
        };
        tracing::warn!(error = %failed, "the catalog cache cannot be written; a snapshot is tried next");
        self.journal.lock().snapshot_due = true;
    }

    /// Follows the store until this mirror is current.
    ///
    /// When the store's catalog went back (Redis restarted empty, or from an older
    /// snapshot), this gateway puts its own copy back: every gateway holds all of it. The
    /// decision is made from the store's identity and version together, never the version
    /// alone (see [`Catalog::should_restore`]); the restore itself is one atomic write that
    /// happens only if the store is still as this gateway saw it, so gateways restoring at
    /// once write one catalog, once, and the newest copy wins.
    pub async fn refresh(&self, store: &Store) -> Result<(), StoreError> {
        self.follow(store).await?;
        *self.source.lock() = Source::Store;
        self.save_cache().await;
        Ok(())
    }

    async fn follow(&self, store: &Store) -> Result<(), StoreError> {
        let held = |id: &ClientId| self.clients.contains_key(id);
        let wants = match self.held {
            Some(_) => Wants::Held(&held),
            None => Wants::Whole,
        };
        if let Some(held) = &self.held {
            held.clients.run_pending_tasks();
            let _apply = self.apply.lock();
            self.forget_evicted();
        }
        loop {
            let epoch = self.epoch();
            match store
                .catalog
                .changes(self.version(), epoch.as_deref(), wants)
                .await?
            {
                CatalogChanges::Unchanged => return Ok(()),
                CatalogChanges::Reload(dump) if self.held.is_some() => {
                    if self.should_restore(&dump) {
                        tracing::error!(
                            cached = self.version(),
                            store = dump.version,
                            "the store's catalog went back; a gateway that caches clients \
                             cannot put it back (restore it from a backup): following it"
                        );
                    }
                    self.start_over(dump);
                    return Ok(());
                }
                CatalogChanges::Reload(dump) if self.should_restore(&dump) => {
                    tracing::error!(
                        mirror = self.version(),
                        store = dump.version,
                        "the store's catalog went back; restoring it from this gateway's copy"
                    );
                    let seen = CatalogAt {
                        epoch: dump.epoch.as_deref(),
                        version: dump.version,
                    };
                    if store.catalog.restore(seen, &self.dump()).await? {
                        return Ok(());
                    }
                    // The store moved meanwhile (another gateway restored it, or a write
                    // landed): look again.
                }
                CatalogChanges::Reload(dump) => {
                    self.replace(dump);
                    return Ok(());
                }
                CatalogChanges::Delta {
                    version,
                    plans,
                    clients,
                    safety,
                    keys,
                    more,
                } => {
                    let _apply = self.apply.lock();
                    if let Some(s) = safety {
                        self.set_safety(s);
                    }
                    for (name, rec) in plans {
                        self.apply_plan(name, rec);
                    }
                    for (id, rec) in clients {
                        self.apply_changed(version, id, rec);
                    }
                    for (id, keys) in keys {
                        self.note_changed(version, &id, &keys, None);
                    }
                    self.version.store(version, Ordering::Release);
                    if let Some(held) = &self.held {
                        held.recent.lock().trim(version);
                    }
                    if !more {
                        return Ok(());
                    }
                }
            }
        }
    }

    /// Whether the store's catalog is this mirror's, gone back in time, so the mirror
    /// (newer) should replace it; otherwise the store's view is taken.
    ///
    /// - the same epoch at an older version: a snapshot from before changes this mirror
    ///   has seen (revocations and deletes among them): restore;
    /// - no epoch at an older version: a store that lost its catalog (restarted empty; at
    ///   most the configuration's records seeded since, which this mirror holds too):
    ///   restore;
    /// - another epoch, or a version this mirror has not reached: another catalog, or a
    ///   newer one: take it, never write over it.
    ///
    /// An empty mirror restores nothing.
    fn should_restore(&self, store: &CatalogDump) -> bool {
        let mine = self.version();
        mine > 0 && store.version < mine && (store.epoch.is_none() || store.epoch == self.epoch())
    }

    /// A client the feed says changed, in a page that ends at `version`: applied as it is
    /// in a mirror. In cache mode, only to a client held (and only if what is held is not
    /// newer than the page: a lookup may have read past it), after noting the change (see
    /// [`held::Recent`]) and forgetting its keys as unknown (a key just created).
    fn apply_changed(&self, version: u64, id: ClientId, rec: Option<Versioned<ClientRecord>>) {
        if self.held.is_none() {
            self.apply_client(id, rec);
            return;
        }
        let keys: Vec<KeyHash> = rec
            .iter()
            .flat_map(|r| r.value.keys.iter().map(|k| k.hash))
            .collect();
        self.note_changed(version, &id, &keys, rec);
    }

    /// Cache mode: client `id` changed at `version`, and has `keys` now (the feed names
    /// them, or its record `rec` does). The change is noted, its keys are no longer
    /// unknown, and a client held from a read not newer than the change takes `rec`; with
    /// no record (deleted, or only its keys named: the record was not wanted when the feed
    /// was read, before the client was held) it is let go, and looked up again on its next
    /// request.
    fn note_changed(
        &self,
        version: u64,
        id: &ClientId,
        keys: &[KeyHash],
        rec: Option<Versioned<ClientRecord>>,
    ) {
        let Some(held) = &self.held else {
            return;
        };
        for k in keys {
            held.unknown.invalidate(k);
            held.filter.add(k);
        }
        held.recent
            .lock()
            .touched(version, id, keys.iter().copied());
        if self.clients.get(id).is_some_and(|e| e.rev <= version) {
            if rec.is_none() {
                held.clients.invalidate(id);
            }
            self.apply_client(id.clone(), rec);
        }
    }

    /// Cache mode: forgets every client and unknown key, and takes `dump`'s plans and
    /// safety settings (a gap in the feed, another catalog, or one gone back: whatever was
    /// held may be wrong). Each client in use is looked up again.
    fn start_over(&self, dump: CatalogDump) {
        let _apply = self.apply.lock();
        if let Some(held) = &self.held {
            held.clients.invalidate_all();
            held.unknown.invalidate_all();
            *held.recent.lock() = Recent::new(dump.version);
            held.evicted.lock().clear();
            // Keys the feed named in the gap are not in it: made again.
            held.filter.reset();
        }
        let held: Vec<ClientId> = self.clients.iter().map(|e| e.key().clone()).collect();
        for id in held {
            self.apply_client(id, None);
        }
        self.replace(dump);
    }

    /// The whole catalog at one version, as this gateway mirrors it (the admin API's
    /// export); `None` in cache mode, where it holds only the clients in use.
    pub fn export(&self) -> Option<CatalogDump> {
        if self.held.is_some() {
            return None;
        }
        // Under the apply lock, so every record is at the version it says; copied after.
        let entries = {
            let _apply = self.apply.lock();
            self.entries()
        };
        Some(entries.copied())
    }

    /// This mirror as a dump: what a restore writes.
    fn dump(&self) -> CatalogDump {
        self.entries().copied()
    }

    /// What [`Catalog::dump`] copies, not copied yet: the clients' entries (an `Arc` each,
    /// while each shard of the map is read-locked), their records copied later, off the
    /// locks (measured: a snapshot's copy under the locks put a start's first-request p99
    /// at 34-84 ms with 100,000 clients coming in, 8 ms without a cache file).
    fn entries(&self) -> Entries {
        Entries {
            epoch: self.epoch(),
            version: self.version(),
            plans: self
                .plans
                .iter()
                .map(|p| {
                    let state = p.current.load();
                    Versioned {
                        rev: state.rev,
                        value: state.record.clone(),
                    }
                })
                .collect(),
            clients: self.clients.iter().map(|c| Arc::clone(c.value())).collect(),
            safety: (*self.safety.load_full()).clone().map(|value| Versioned {
                rev: self.safety_rev.load(Ordering::Acquire),
                value,
            }),
        }
    }

    fn set_safety(&self, s: Option<Versioned<SafetyRecord>>) {
        self.journal(|j| j.safety = Some(s.clone()));
        self.safety_rev
            .store(s.as_ref().map_or(0, |s| s.rev), Ordering::Release);
        self.safety.store(Arc::new(s.map(|s| s.value)));
    }

    /// Replaces the whole mirror with a dump (cache mode: the dump's clients are held, as
    /// many as the cache admits).
    fn replace(&self, dump: CatalogDump) {
        // The snapshot after it holds all of it: no entry per record.
        self.journal.lock().paused = true;
        self.replace_records(dump);
        let mut journal = self.journal.lock();
        journal.paused = false;
        journal.clear();
        journal.snapshot_due = true;
    }

    fn replace_records(&self, dump: CatalogDump) {
        let plan_names: std::collections::HashSet<_> =
            dump.plans.iter().map(|p| p.value.name.clone()).collect();
        let client_ids: std::collections::HashSet<_> =
            dump.clients.iter().map(|c| c.value.id.clone()).collect();
        for p in dump.plans {
            self.apply_plan(p.value.name.clone(), Some(p));
        }
        for c in dump.clients {
            let id = c.value.id.clone();
            if self.apply_client(id.clone(), Some(c)).is_some() {
                if let Some(held) = &self.held {
                    held.clients.insert(id, ());
                }
            }
        }
        let gone: Vec<ClientId> = self
            .clients
            .iter()
            .map(|e| e.key().clone())
            .filter(|id| !client_ids.contains(id))
            .collect();
        for id in gone {
            self.apply_client(id, None);
        }
        self.plans.retain(|name, _| plan_names.contains(name));
        self.set_safety(dump.safety);
        *self.epoch.lock() = dump.epoch;
        self.version.store(dump.version, Ordering::Release);
    }

    fn apply_plan(&self, name: PlanName, rec: Option<Versioned<PlanRecord>>) {
        let Some(rec) = rec else {
            self.journal(|j| j.plans.push((name.clone(), None)));
            self.plans.remove(&name);
            return;
        };
        let limits = match rec.value.limits() {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(plan = %name, error = %e, "invalid plan in the store ignored");
                return;
            }
        };
        self.journal(|j| j.plans.push((name.clone(), Some(rec.clone()))));
        match self.plans.get(&name) {
            Some(slot) => slot
                .current
                .store(Arc::new(PlanState::new(&name, limits, rec))),
            None => {
                self.plans
                    .insert(name.clone(), Arc::new(PlanSlot::new(name, limits, rec)));
            }
        }
    }

    /// Sharded clients, for the reconciler.
    pub fn sharded_clients(&self) -> Vec<Arc<ClientEntry>> {
        self.sharded.iter().map(|e| Arc::clone(e.value())).collect()
    }

    /// Puts a client's new version in place (`None`: deleted). Never flickers: each of its
    /// keys moves from the old entry to the new one in a single insert, and only then are
    /// the keys the new version dropped removed, so a request in between finds the old
    /// entry or the new one, never neither.
    fn apply_client(
        &self,
        id: ClientId,
        rec: Option<Versioned<ClientRecord>>,
    ) -> Option<Arc<ClientEntry>> {
        let old = self.clients.get(&id).map(|e| Arc::clone(e.value()));
        let entry = rec.and_then(|rec| self.entry(&id, rec, old.as_deref()));
        if let Some(old) = &old {
            let mut expiring = self.expiring.lock();
            for k in &old.record.keys {
                self.expired.remove(&k.hash);
                // The new version (if any) puts its own back: a client let go leaves none.
                if let Some(at) = k.expires_at {
                    expiring.remove(&(at, k.hash));
                }
            }
        }
        match &entry {
            Some(entry) => {
                let now_s = unix_now_s();
                for k in &entry.record.keys {
                    match k.expires_at {
                        Some(at) if at <= now_s => {
                            self.expired.insert(k.hash, at);
                            continue;
                        }
                        Some(at) => {
                            self.expiring.lock().insert((at, k.hash));
                        }
                        None => {}
                    }
                    // A key kept across its client's change keeps its use mark.
                    let seen = self.keys.get(&k.hash).map_or(0, |s| s.seen.load(Relaxed));
                    self.keys.insert(
                        k.hash,
                        KeySlot {
                            client: Arc::clone(entry),
                            seen: AtomicU32::new(seen),
                        },
                    );
                }
                if entry.shard.is_some() {
                    self.sharded.insert(id.clone(), Arc::clone(entry));
                } else {
                    self.sharded.remove(&id);
                }
                self.clients.insert(id.clone(), Arc::clone(entry));
            }
            None => {
                self.clients.remove(&id);
                self.sharded.remove(&id);
            }
        }
        if let Some(old) = &old {
            for k in &old.record.keys {
                self.keys
                    .remove_if(&k.hash, |_, s| Arc::ptr_eq(&s.client, old));
            }
        }
        if old.is_some() || entry.is_some() {
            // The entry, not a copy of its record: the cache's thread copies it.
            let kept = entry.clone();
            self.journal(|j| j.clients.push((id.clone(), kept)));
        }
        entry
    }

    /// Notes a change for the cache files' next journal line (none without a cache file,
    /// or while the whole catalog is replaced).
    fn journal(&self, note: impl FnOnce(&mut Journal)) {
        if self.cache.is_some() {
            let mut journal = self.journal.lock();
            if !journal.paused {
                note(&mut journal);
                journal.entries += 1;
            }
        }
    }

    /// What the request path needs of a client's version; `None` when its plan is unknown.
    fn entry(
        &self,
        id: &ClientId,
        rec: Versioned<ClientRecord>,
        old: Option<&ClientEntry>,
    ) -> Option<Arc<ClientEntry>> {
        let Some(plan) = self
            .plans
            .get(&rec.value.plan)
            .map(|p| Arc::clone(p.value()))
        else {
            tracing::warn!(client = %id, plan = %rec.value.plan, "client on an unknown plan ignored");
            return None;
        };
        let shard = rec.value.shards.as_ref().map(|s| ShardEntry {
            local_key: s.regions.contains(&self.region).then(|| {
                self.key_names
                    .regional_bucket(id, &self.region)
                    .into_boxed_str()
            }),
            regions: s.regions.clone(),
        });
        let unsharded_at = match old {
            Some(o) if shard.is_none() && o.shard.is_some() => Some(Instant::now()),
            Some(o) if shard.is_none() => o.unsharded_at,
            _ => None,
        };
        // Ids are letters, digits, `-`, `_` and `.`: always a valid header value.
        let id_header = HeaderValue::from_str(id.as_str()).ok()?;
        Some(Arc::new(ClientEntry {
            id_header,
            bucket_key: self.key_names.bucket(id).into_boxed_str(),
            mode: rec.value.mode.unwrap_or(self.default_mode),
            id: id.clone(),
            plan,
            shard,
            unsharded_at,
            record: rec.value,
            rev: rec.rev,
        }))
    }

    /// Starts task `catalog-refresh`, which follows the store every `period` until the
    /// gateway stops. It is essential: a mirror that no longer follows the store keeps
    /// admitting revoked keys and refusing new ones, so a refresh that keeps failing (a
    /// panic, not a store that does not answer: that is logged and tried again) stops
    /// the gateway, and a new one loads the catalog whole.
    pub fn spawn_refresh(self: &Arc<Self>, tasks: &Tasks, store: Store, period: Duration) {
        let catalog = Arc::clone(self);
        let policy = Policy::Essential { restarts: 3 };
        tasks.spawn("catalog-refresh", policy, move |stop| {
            let (catalog, store) = (Arc::clone(&catalog), store.clone());
            async move {
                stop.run_until_cancelled(catalog.follow_every(&store, period))
                    .await;
            }
        });
    }

    /// Cache mode with `catalog.key_filter_mib` set: starts task `catalog-key-filter`,
    /// which builds the store's key filter if it has none (with any other gateway doing
    /// the same), copies it, and copies it again whenever it is dropped or the store's is
    /// another (see [`key_filter`]).
    pub fn spawn_key_filter(self: &Arc<Self>, tasks: &Tasks, store: Store) {
        if self.held.as_ref().is_none_or(|h| h.filter_bits == 0) {
            return;
        }
        let catalog = Arc::clone(self);
        tasks.spawn("catalog-key-filter", Policy::Restart, move |stop| {
            let (catalog, store) = (Arc::clone(&catalog), store.clone());
            async move {
                stop.run_until_cancelled(catalog.keep_key_filter(&store))
                    .await;
            }
        });
    }

    /// Cache mode: copies the store's key filter (built first if the store has none)
    /// before the gateway serves, within `within` (unpaced: nothing is served yet); what
    /// is not done by then the task does later.
    pub async fn first_key_filter(&self, store: &Store, within: Duration) {
        if self.held.as_ref().is_none_or(|h| h.filter_bits == 0) {
            return;
        }
        match tokio::time::timeout(within, self.copy_key_filter(store, false)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::debug!(error = %e, "the key filter was not copied at start"),
            Err(_) => tracing::debug!("the key filter was not copied at start in time"),
        }
    }

    async fn keep_key_filter(&self, store: &Store) {
        loop {
            if let Err(e) = self.copy_key_filter(store, true).await {
                tracing::debug!(error = %e, "the key filter could not be copied yet");
            }
            tokio::time::sleep(KEY_FILTER_CHECK).await;
        }
    }

    /// Makes the trusted copy of the store's key filter, unless it is in place already:
    /// built first if the store has none (see [`key_filter`] for why each step is there).
    /// `paced`: a pause after each read (a gateway serving requests).
    async fn copy_key_filter(&self, store: &Store, paced: bool) -> Result<(), StoreError> {
        let Some(held) = &self.held else {
            return Ok(());
        };
        let filter = &held.filter;
        let head = store.catalog.key_filter_head().await?;
        match (&head, filter.trusted_id()) {
            (Some(h), Some(id)) if h.id == id => return Ok(()),
            (_, Some(_)) => {
                tracing::info!("the store's key filter changed: copying it again");
                filter.reset();
            }
            _ => {}
        }
        let head = match head {
            Some(h) => h,
            None => key_filter::build(store, held.filter_bits).await?,
        };
        let bits = filter.begin(head.bits, head.id.clone());
        let same = async || {
            store
                .catalog
                .key_filter_head()
                .await
                .map(|h| h == Some(head.clone()))
        };
        if !same().await? {
            filter.reset();
            return Ok(());
        }
        for offset in (0..bits.len()).step_by(KEY_FILTER_READ) {
            let bytes = store
                .catalog
                .key_filter_bytes(offset as u64, KEY_FILTER_READ as u64)
                .await?;
            bits.or_at(offset, &bytes);
            if paced {
                tokio::time::sleep(KEY_FILTER_PAUSE).await;
            }
        }
        if same().await? && filter.trust(&bits) {
            tracing::info!(
                bytes = bits.len(),
                build = bits.id(),
                "key filter in place: keys no client has are refused without a store read"
            );
        } else {
            filter.reset();
        }
        Ok(())
    }

    /// Follows the store every `period`, logging when it stops answering and when it
    /// answers again.
    async fn follow_every(&self, store: &Store, period: Duration) {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failing = false;
        loop {
            tick.tick().await;
            self.expire_due(unix_now_s());
            match self.refresh(store).await {
                Ok(()) if failing => {
                    failing = false;
                    tracing::info!("catalog refresh recovered");
                }
                Ok(()) => {}
                Err(e) if !failing => {
                    failing = true;
                    tracing::warn!(error = %e, "catalog refresh failed; serving the last known catalog");
                }
                Err(_) => {}
            }
        }
    }
}

/// The changes applied since the cache files were last written, and what they hold.
#[derive(Default)]
struct Journal {
    plans: Vec<(PlanName, Option<Versioned<PlanRecord>>)>,
    clients: Vec<(ClientId, Option<Arc<ClientEntry>>)>,
    safety: Option<Option<Versioned<SafetyRecord>>>,
    /// The next line's number (0 until the first snapshot, which sets it to 1).
    seq: u64,
    /// Records written as journal lines since the snapshot, and the snapshot's records.
    entries: u64,
    snapshot_records: u64,
    /// The next write is a snapshot (the catalog was replaced whole, or a write failed).
    snapshot_due: bool,
    /// Not noting changes (the whole catalog is being replaced).
    paused: bool,
    /// The epoch and version last written.
    written_at: (Option<String>, u64),
}

impl Journal {
    fn is_empty(&self) -> bool {
        self.plans.is_empty() && self.clients.is_empty() && self.safety.is_none()
    }

    fn clear(&mut self) {
        self.plans.clear();
        self.clients.clear();
        self.safety = None;
    }

    /// A snapshot of `records` is written: the journal starts over after it.
    fn start_over(&mut self, records: usize) {
        self.clear();
        self.seq = self.seq.max(1);
        self.entries = 0;
        self.snapshot_records = records as u64;
        self.snapshot_due = false;
    }

    /// The next journal line: what changed, at `at` (its clients' records not copied yet).
    fn line(&mut self, at: &(Option<String>, u64)) -> PendingLine {
        let line = PendingLine {
            seq: self.seq,
            at_ms: cache::now_ms(),
            epoch: at.0.clone(),
            version: at.1,
            plans: std::mem::take(&mut self.plans),
            clients: std::mem::take(&mut self.clients),
            safety: self.safety.take(),
        };
        self.seq += 1;
        line
    }
}

/// A journal line whose clients are entries, their records copied by [`PendingLine::copied`]
/// on the cache's thread.
struct PendingLine {
    seq: u64,
    at_ms: u64,
    epoch: Option<String>,
    version: u64,
    plans: Vec<(PlanName, Option<Versioned<PlanRecord>>)>,
    clients: Vec<(ClientId, Option<Arc<ClientEntry>>)>,
    safety: Option<Option<Versioned<SafetyRecord>>>,
}

impl PendingLine {
    fn copied(self) -> cache::Line {
        cache::Line {
            seq: self.seq,
            at_ms: self.at_ms,
            epoch: self.epoch,
            version: self.version,
            plans: self.plans,
            clients: self
                .clients
                .into_iter()
                .map(|(id, entry)| (id, entry.map(|e| e.versioned())))
                .collect(),
            safety: self.safety,
        }
    }
}

/// The catalog held, its clients as entries (see [`Catalog::entries`]).
struct Entries {
    epoch: Option<String>,
    version: u64,
    plans: Vec<Versioned<PlanRecord>>,
    clients: Vec<Arc<ClientEntry>>,
    safety: Option<Versioned<SafetyRecord>>,
}

impl Entries {
    /// The records copied.
    fn copied(self) -> CatalogDump {
        CatalogDump {
            epoch: self.epoch,
            version: self.version,
            plans: self.plans,
            clients: self.clients.iter().map(|c| c.versioned()).collect(),
            safety: self.safety,
        }
    }
}

/// What a tick writes to the cache files.
enum CacheWrite {
    /// A snapshot holding the journal up to this line, its entries not taken yet (they
    /// are once the apply lock is let go).
    SnapshotDue(u64),
    /// The whole of what is held, holding the journal up to this line.
    Snapshot(Entries, u64),
    Line(PendingLine),
}

/// The plans and clients the settings declare, as records.
fn declared(settings: &Settings) -> (Vec<PlanRecord>, Vec<ClientRecord>) {
    let plans = settings
        .catalog
        .plans
        .iter()
        .map(|p| {
            PlanRecord::new(p.name.clone(), &p.limits, p.description.clone())
                .with_max_connections(p.max_connections)
        })
        .collect();
    let clients = settings
        .catalog
        .clients
        .iter()
        .map(|c| ClientRecord {
            id: c.id.clone(),
            plan: c.plan.clone(),
            mode: c.mode,
            shards: None,
            keys: c.keys.iter().copied().map(KeyRecord::new).collect(),
            overrides: Vec::new(),
            extra: Default::default(),
        })
        .collect();
    (plans, clients)
}

/// Creates the plans and clients declared in the settings that the store lacks. Existing
/// ones (perhaps edited through the admin API since) are left as they are.
pub async fn seed(store: &Store, settings: &Settings) -> anyhow::Result<()> {
    let (plans, clients) = declared(settings);
    for rec in plans {
        store
            .catalog
            .write(
                &CatalogWrite::PutPlan(rec, Condition::Absent),
                &Audit::seed("plan.seed"),
            )
            .await?;
    }
    for rec in clients {
        let (id, plan) = (rec.id.to_string(), rec.plan.to_string());
        match store
            .catalog
            .write(
                &CatalogWrite::PutClient(rec, Condition::Absent),
                &Audit::seed("client.seed"),
            )
            .await?
        {
            WriteOutcome::Written { .. } | WriteOutcome::Exists => {}
            WriteOutcome::UnknownPlan => anyhow::bail!(
                "catalog.clients: client {id:?} is on plan {plan:?}, which does not exist"
            ),
            WriteOutcome::KeyConflict => anyhow::bail!(
                "catalog.clients: a key of client {id:?} already belongs to another client"
            ),
            other => anyhow::bail!("catalog.clients: client {id:?}: {other:?}"),
        }
    }
    Ok(())
}

/// A key in service: its client, and the key-use period it was last used in.
struct KeySlot {
    client: Arc<ClientEntry>,
    /// The catalog's `use_tick` when the key was last used (0: not since it was loaded).
    seen: AtomicU32,
}

/// A key's member in the store's key-use set: `<client>/<key_id>` (`/` is in neither).
pub fn key_member(client: &(impl std::fmt::Display + ?Sized), key_id: &str) -> String {
    format!("{client}/{key_id}")
}

/// Unix seconds now, on this gateway's clock.
fn unix_now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    fn plan(name: &str) -> Versioned<PlanRecord> {
        Versioned {
            rev: 1,
            value: PlanRecord::new(
                PlanName::parse(name).unwrap(),
                &Limits::single(crate::domain::Bucket::new(10.0, 1.0).unwrap()),
                None,
            ),
        }
    }

    #[test]
    fn a_start_over_drops_the_key_filter_and_the_feeds_keys_go_in_it() {
        // Arrange: a trusted copy of a filter with no key.
        let catalog = cache_mode();
        let held = catalog.held.as_ref().unwrap();
        let bits = held.filter.begin(1 << 16, "b1".into());
        assert!(held.filter.trust(&bits));
        let (given, made_up) = (KeyHash::of("given"), KeyHash::of("made-up"));
        assert!(!catalog.may_hold(&given));

        // Act 1: the feed names a client's key.
        let acme = ClientId::parse("acme").unwrap();
        let _apply = catalog.apply.lock();
        catalog.note_changed(3, &acme, &[given], None);
        drop(_apply);

        // Assert: in the filter; a key never given still refused unread.
        assert!(catalog.may_hold(&given));
        assert!(!catalog.may_hold(&made_up));

        // Act 2: a gap in the feed.
        catalog.start_over(CatalogDump {
            epoch: Some("e".into()),
            version: 9,
            plans: vec![plan("gold")],
            clients: Vec::new(),
            safety: None,
        });

        // Assert: no filter until it is copied again; every key may be a client's.
        assert!(catalog.may_hold(&made_up));
    }

    fn cache_mode() -> Catalog {
        let catalog = Catalog::new(Mode::Enforce, Keys::new("t:"), Region::parse("eu").unwrap())
            .with_holding(Holding::Cache(crate::configuration::CacheBounds {
                clients: 100,
                unknown_keys: 100,
                unknown_for: Duration::from_secs(60),
                lookup_timeout: Duration::from_millis(50),
                key_filter_bits: 0,
            }));
        catalog.apply_plan(PlanName::parse("gold").unwrap(), Some(plan("gold")));
        catalog
    }

    fn acme(rev: u64, keys: &[KeyHash]) -> Versioned<ClientRecord> {
        Versioned {
            rev,
            value: ClientRecord {
                id: ClientId::parse("acme").unwrap(),
                plan: PlanName::parse("gold").unwrap(),
                mode: None,
                shards: None,
                keys: keys.iter().copied().map(KeyRecord::new).collect(),
                overrides: Vec::new(),
                extra: Default::default(),
            },
        }
    }

    fn read_at(version: u64, client: Option<Versioned<ClientRecord>>) -> KeyLookup {
        KeyLookup {
            epoch: None,
            version,
            client,
        }
    }

    #[test]
    fn a_lookup_the_feed_overtook_is_read_again_never_held() {
        // Arrange: a lookup of acme's key read at version 5; before it lands, the feed
        // applies version 6, which revoked that key (acme was not held: nothing to update).
        let catalog = cache_mode();
        let (old, new) = (KeyHash::of("old-key"), KeyHash::of("new-key"));
        let id = ClientId::parse("acme").unwrap();
        catalog.apply_changed(6, id.clone(), Some(acme(6, &[new])));

        // Act and assert: the answer read before the revocation does not stand.
        assert!(catalog
            .settle(read_at(5, Some(acme(5, &[old]))), old, false)
            .is_none());
        // Read again (at 6): acme without the key is held; the old key finds nothing.
        let again = catalog.settle(read_at(6, Some(acme(6, &[new]))), old, false);
        assert!(again.is_some_and(|e| e.is_some_and(|e| !e.active_key(&old))));
        assert!(catalog.by_key(&old).is_none());
        assert!(catalog.by_key(&new).is_some());
    }

    #[test]
    fn a_key_created_while_its_unknown_answer_was_in_flight_is_not_remembered_as_unknown() {
        // Arrange: "no client has this key", read at version 5; the feed then applies
        // version 6, where acme got it.
        let catalog = cache_mode();
        let key = KeyHash::of("fresh");
        catalog.apply_changed(6, ClientId::parse("acme").unwrap(), Some(acme(6, &[key])));

        // Act: the stale answer lands.
        let settled = catalog.settle(read_at(5, None), key, false);

        // Assert: read again rather than remembered; once read, the key is acme's.
        assert!(settled.is_none());
        assert!(catalog.may_hold(&key), "not remembered as unknown");
        let again = catalog.settle(read_at(6, Some(acme(6, &[key]))), key, false);
        assert!(again.is_some_and(|e| e.is_some()));
        assert!(catalog.by_key(&key).is_some());
    }

    #[test]
    fn a_client_held_from_a_read_older_than_a_change_named_only_by_its_keys_is_let_go() {
        // Arrange: acme held at rev 5; the feed, read before acme was held, names a change
        // at 6 with its keys only (the record was not wanted then).
        let catalog = cache_mode();
        let key = KeyHash::of("k");
        assert!(catalog
            .settle(read_at(5, Some(acme(5, &[key]))), key, false)
            .is_some());

        // Act.
        catalog.note_changed(6, &ClientId::parse("acme").unwrap(), &[], None);

        // Assert: not served from the older record; its next request looks it up.
        assert!(catalog.by_key(&key).is_none());
        assert!(catalog.may_hold(&key));
    }

    #[tokio::test]
    async fn a_change_is_a_journal_line_and_the_snapshot_is_written_again_only_when_due() {
        // Arrange: a mirror with a cache file, loaded whole (a reload: a snapshot is due).
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("catalog-cache.json");
        let catalog = Catalog::new(Mode::Enforce, Keys::new("t:"), Region::parse("eu").unwrap())
            .with_cache_file(Some(file.clone()));
        let key = KeyHash::of("k");
        catalog.replace(CatalogDump {
            epoch: Some("e".into()),
            version: 5,
            plans: vec![plan("gold")],
            clients: vec![acme(5, &[key])],
            safety: None,
        });
        catalog.save_cache().await;
        let snapshot = std::fs::read(&file).unwrap();

        // Act: the key revoked (version 6), then nothing more.
        catalog.apply_client(ClientId::parse("acme").unwrap(), Some(acme(6, &[])));
        catalog.version.store(6, Ordering::Release);
        catalog.save_cache().await;
        catalog.save_cache().await;

        // Assert: one journal line, the snapshot as it was, and read back at version 6
        // without the key.
        assert_eq!(
            std::fs::read(&file).unwrap(),
            snapshot,
            "the snapshot is not rewritten"
        );
        let journal = std::fs::read_to_string(cache::journal_of(&file)).unwrap();
        assert_eq!(journal.lines().count(), 1, "{journal}");
        let back = cache::load(&file).unwrap();
        assert_eq!(back.catalog.version, 6);
        assert!(back.catalog.clients[0].value.keys.is_empty());

        // A reload makes the next write a snapshot, which starts the journal over.
        catalog.replace(back.catalog);
        catalog.save_cache().await;
        assert!(!cache::journal_of(&file).exists());
        assert_eq!(cache::load(&file).unwrap().catalog.version, 6);
    }

    #[test]
    fn a_lookup_its_request_gave_up_on_still_ends_and_leaves_nothing_behind() {
        // Arrange: cache mode on a real Redis, on a worker's kind of runtime.
        let redis = tollgate_testkit::RedisServer::start().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        tokio::task::LocalSet::new().block_on(&rt, async {
            let store = Store::redis(
                &secrecy::SecretString::from(redis.url()),
                2,
                Duration::from_secs(1),
                Keys::new("t:"),
            )
            .unwrap();
            let catalog = Arc::new(cache_mode());
            let held = catalog.held.as_ref().unwrap();

            // Act: a made-up key's request goes away at once (its client hung up).
            let hash = KeyHash::of("made-up-key-0000");
            let gave_up = tokio::time::timeout(Duration::ZERO, catalog.look_up(&store, hash)).await;
            assert!(gave_up.is_err());

            // Assert: the read ends anyway: counted, remembered, and out of the table.
            let deadline = Instant::now() + Duration::from_secs(2);
            while !held.inflight.is_empty() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert!(held.inflight.is_empty(), "the abandoned read stayed behind");
            assert_eq!(held.lookups.unknown.load(Relaxed), 1);
            assert!(!catalog.may_hold(&hash));
        });
    }

    #[test]
    fn a_client_let_go_leaves_no_key_waiting_to_expire() {
        // Arrange: acme with a key that expires in the far future.
        let catalog = cache_mode();
        let mut rec = acme(5, &[KeyHash::of("k")]);
        rec.value.keys[0].expires_at = Some(u64::MAX / 2);
        catalog.apply_client(ClientId::parse("acme").unwrap(), Some(rec.clone()));
        assert_eq!(catalog.expiring.lock().len(), 1);

        // Act: replaced by the same version, then let go (evicted, or deleted).
        catalog.apply_client(ClientId::parse("acme").unwrap(), Some(rec));
        assert_eq!(
            catalog.expiring.lock().len(),
            1,
            "one entry per key, not per version"
        );
        catalog.apply_client(ClientId::parse("acme").unwrap(), None);

        // Assert.
        assert!(catalog.expiring.lock().is_empty());
    }

    #[test]
    fn a_feed_page_older_than_what_a_lookup_read_does_not_overwrite_it() {
        // Arrange: acme held at rev 8 (read by a lookup); a feed page ending at version 7
        // (read before the lookup) says acme had no keys.
        let catalog = cache_mode();
        let key = KeyHash::of("k");
        assert!(catalog
            .settle(read_at(8, Some(acme(8, &[key]))), key, false)
            .is_some());

        // Act.
        catalog.apply_changed(7, ClientId::parse("acme").unwrap(), Some(acme(7, &[])));

        // Assert: the newer record stays.
        assert_eq!(catalog.by_key(&key).map(|e| e.rev), Some(8));
    }

    #[test]
    fn a_key_never_disappears_while_its_client_is_replaced() {
        // Arrange: a client with one key on one of two plans.
        let catalog = Arc::new(Catalog::new(
            Mode::Enforce,
            Keys::new("t:"),
            Region::parse("eu").unwrap(),
        ));
        for p in ["gold", "silver"] {
            catalog.apply_plan(PlanName::parse(p).unwrap(), Some(plan(p)));
        }
        let hash = KeyHash::of("key-busy-0000");
        let id = ClientId::parse("busy").unwrap();
        let version = |rev: u64| Versioned {
            rev,
            value: ClientRecord {
                id: id.clone(),
                plan: PlanName::parse(if rev.is_multiple_of(2) {
                    "gold"
                } else {
                    "silver"
                })
                .unwrap(),
                mode: None,
                shards: None,
                keys: vec![KeyRecord::new(hash)],
                overrides: Vec::new(),
                extra: Default::default(),
            },
        };
        catalog.apply_client(id.clone(), Some(version(0)));

        // Act: one thread replaces the client over and over while another looks its key up.
        let done = Arc::new(AtomicBool::new(false));
        let reader = {
            let (catalog, done) = (Arc::clone(&catalog), Arc::clone(&done));
            std::thread::spawn(move || {
                let (mut misses, mut lookups) = (0u64, 0u64);
                while !done.load(Ordering::Relaxed) {
                    lookups += 1;
                    if catalog.by_key(&hash).is_none() {
                        misses += 1;
                    }
                }
                (misses, lookups)
            })
        };
        for rev in 1..=20_000 {
            catalog.apply_client(id.clone(), Some(version(rev)));
        }
        done.store(true, Ordering::Relaxed);
        let (misses, lookups) = reader.join().unwrap();

        // Assert.
        assert!(lookups > 1000, "the reader ran only {lookups} lookups");
        assert_eq!(misses, 0, "{misses} of {lookups} lookups found no client");
        assert_eq!(catalog.by_key(&hash).unwrap().rev, 20_000);
    }
}
