//! The embedded store: buckets in process memory, the catalog in a JSON file. For one
//! gateway instance only (buckets are not shared), and the zero-dependency default.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::Write;
use std::path::{Path, PathBuf};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::domain::{bucket, BucketState, Verdict};
use crate::domain::{ClientId, KeyHash, Plan, PlanName, Region};
use crate::store::records::{
    Audit, AuditEntry, CatalogChanges, CatalogDump, CatalogWrite, ClientRecord, Condition,
    PlanRecord, SafetyRecord, Versioned, WriteOutcome,
};
use crate::store::{ClientsPage, LocalBuckets, Reconcile, RegionShare, ShardState, StoreError};

const FEED_LEN: usize = 10_000;
const AUDIT_LEN: usize = 10_000;

/// Buckets and catalog of a single instance.
///
/// Writes to the catalog file are made off the async workers (`Store` runs them with
/// `spawn_blocking`), one at a time (`writer`), and without holding the catalog's lock
/// while the file is written and synced: a write is staged under the lock, written to disk
/// without it, then committed under it again, so readers never wait for the disk.
pub struct EmbeddedStore {
    buckets: LocalBuckets<Box<str>>,
    shards: Mutex<HashMap<ClientId, EmbeddedShard>>,
    catalog: Mutex<FileCatalog>,
    /// Held for a whole write (stage, persist, commit); only in blocking threads.
    writer: Mutex<()>,
    path: PathBuf,
    shadow: Mutex<HashMap<String, (u64, u64)>>,
    /// An exclusive lock on `<catalog file>.lock`, held while the store is open: a second
    /// process on the same file is refused (the embedded store is for one instance).
    _lock: std::sync::Arc<std::fs::File>,
}

/// The catalog-file locks this process holds, by lock path. A gateway rebuilt in the same
/// process (as the tests restart one) shares its predecessor's lock: the lock keeps other
/// processes out, and background tasks may keep the old store alive for a while.
static LOCKS: Mutex<Vec<(PathBuf, std::sync::Weak<std::fs::File>)>> = Mutex::new(Vec::new());

/// Takes (or, within this process, shares) the exclusive lock on `lock_path`.
fn lock_catalog(
    file: &Path,
    lock_path: PathBuf,
) -> Result<std::sync::Arc<std::fs::File>, StoreError> {
    let err = |e: std::io::Error| StoreError::File(format!("{}: {e}", file.display()));
    let mut locks = LOCKS.lock();
    locks.retain(|(_, l)| l.strong_count() > 0);
    if let Some(held) = locks
        .iter()
        .find(|(p, _)| *p == lock_path)
        .and_then(|(_, l)| l.upgrade())
    {
        return Ok(held);
    }
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(err)?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            return Err(StoreError::File(format!(
                "{} is in use by another tollgate process (the embedded store is for one instance; use Redis to run several)",
                file.display()
            )))
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(err(e)),
    }
    let lock = std::sync::Arc::new(lock);
    locks.push((lock_path, std::sync::Arc::downgrade(&lock)));
    Ok(lock)
}

impl EmbeddedStore {
    /// Opens (or creates) the catalog file, refusing it when another process has it open.
    pub fn open(file: &Path) -> Result<EmbeddedStore, StoreError> {
        let err = |e: std::io::Error| StoreError::File(format!("{}: {e}", file.display()));
        if let Some(dir) = file.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(err)?;
        }
        let mut lock_path = file.as_os_str().to_owned();
        lock_path.push(".lock");
        let lock = lock_catalog(file, PathBuf::from(lock_path))?;
        Ok(EmbeddedStore {
            buckets: LocalBuckets::default(),
            shards: Mutex::new(HashMap::new()),
            catalog: Mutex::new(FileCatalog::open(file)?),
            writer: Mutex::new(()),
            path: file.to_path_buf(),
            shadow: Mutex::new(HashMap::new()),
            _lock: lock,
        })
    }

    pub fn take(&self, key: &str, plan: Plan, cost: f64) -> Verdict {
        self.take_seeded(key, plan, cost, None)
    }

    /// [`EmbeddedStore::take`]; a new bucket starts with `initial` tokens, if given.
    pub fn take_seeded(&self, key: &str, plan: Plan, cost: f64, initial: Option<f64>) -> Verdict {
        self.buckets
            .take_seeded(key, plan, cost, self.buckets.now_us(), initial)
    }

    pub fn peek(&self, key: &str) -> Option<BucketState> {
        self.buckets.peek(key)
    }

    /// The bucket's tokens now, or `None` if it does not exist (a missing bucket is full).
    pub fn tokens_now(&self, key: &str, plan: Plan) -> Option<f64> {
        let state = self.peek(key)?;
        Some(
            bucket::take(Some(state), self.buckets.now_us(), plan, 0.0)
                .1
                .tokens,
        )
    }

    pub fn refill(&self, key: &str) {
        self.buckets.remove(key);
    }

    /// Forgets buckets that would be full by now; returns how many remain.
    pub fn evict_idle(&self) -> usize {
        self.buckets.evict_idle()
    }

    /// The same reconciliation as `lua/reconcile.lua`, for one instance.
    pub fn reconcile(&self, r: &Reconcile<'_>) -> ShardState {
        let now = now_ms();
        let mut shards = self.shards.lock();
        let seed = || {
            self.tokens_now(r.global_key, r.plan)
                .map_or(1.0, |t| t / r.plan.capacity())
        };
        let s = shards
            .entry(r.client.clone())
            .or_insert_with(|| EmbeddedShard {
                ts: now,
                since: now,
                seed: seed(),
                shares: r
                    .regions
                    .iter()
                    .map(|g| (g.to_string(), 1.0 / r.regions.len() as f64))
                    .collect(),
                demand: HashMap::new(),
                fill: HashMap::new(),
                history: VecDeque::new(),
            });
        s.demand.insert(r.region.to_string(), (r.demand, now));
        if let Some(f) = r.fill {
            s.fill.insert(r.region.to_string(), f);
        }
        if now.saturating_sub(s.ts) >= r.period_ms {
            let n = r.regions.len() as f64;
            // A region that stopped reporting counts as idle.
            let rate = |g: &Region| match s.demand.get(g.as_str()) {
                Some((d, at)) if now.saturating_sub(*at) <= 3 * r.period_ms => *d,
                _ => 0.0,
            };
            let total: f64 = r.regions.iter().map(rate).sum();
            let mut demands = serde_json::Map::new();
            for g in r.regions {
                let d = rate(g);
                let share = if total <= 0.0 {
                    1.0 / n
                } else {
                    r.floor / n + (1.0 - r.floor) * d / total
                };
                s.shares.insert(g.to_string(), share);
                demands.insert(g.to_string(), d.into());
            }
            s.ts = now;
            s.history.push_front(
                serde_json::json!({"at_ms": now, "shares": s.shares, "demand": demands}),
            );
            s.history.truncate(60);
        }
        s.state(r.regions)
    }

    pub fn shard_view(&self, client: &ClientId) -> (Option<ShardState>, Vec<serde_json::Value>) {
        let shards = self.shards.lock();
        match shards.get(client) {
            Some(s) => {
                let mut regions: Vec<Region> = s
                    .shares
                    .keys()
                    .filter_map(|r| Region::parse(r).ok())
                    .collect();
                regions.sort();
                (Some(s.state(&regions)), s.history.iter().cloned().collect())
            }
            None => (None, vec![]),
        }
    }

    /// Adds shadow-mode comparison counts (compared, disagreed) per client.
    pub fn shadow_add(&self, counts: &[(String, u64, u64)]) {
        let mut m = self.shadow.lock();
        for (client, compared, disagreed) in counts {
            let e = m.entry(client.clone()).or_default();
            e.0 += compared;
            e.1 += disagreed;
        }
    }

    /// Shadow-mode counts per client.
    pub fn shadow_counts(&self) -> Vec<(String, u64, u64)> {
        self.shadow
            .lock()
            .iter()
            .map(|(k, (c, d))| (k.clone(), *c, *d))
            .collect()
    }

    pub fn shadow_reset(&self) {
        self.shadow.lock().clear();
    }

    pub fn catalog_dump(&self) -> CatalogDump {
        self.catalog.lock().dump()
    }

    pub fn catalog_changes(&self, since: u64, epoch: Option<&str>) -> CatalogChanges {
        self.catalog.lock().changes(since, epoch)
    }

    /// Replaces the catalog with `mirror` if it is still at `seen` (as the Redis side's
    /// `lua/catalog_restore.lua`); the audit log stays.
    pub fn catalog_restore(
        &self,
        seen: (Option<&str>, u64),
        mirror: &CatalogDump,
    ) -> Result<bool, StoreError> {
        let _one = self.writer.lock();
        let audit = {
            let cat = self.catalog.lock();
            if cat.data.epoch.as_deref() != seen.0 || cat.data.version != seen.1 {
                return Ok(false);
            }
            cat.data.audit.clone()
        };
        let mut next = CatalogFile {
            epoch: mirror.epoch.clone(),
            version: mirror.version,
            plans: mirror
                .plans
                .iter()
                .map(|p| (p.value.name.clone(), p.clone()))
                .collect(),
            clients: mirror
                .clients
                .iter()
                .map(|c| (c.value.id.clone(), c.clone()))
                .collect(),
            safety: mirror.safety.clone(),
            audit,
        };
        push_audit(
            &mut next.audit,
            AuditEntry {
                at_ms: now_ms(),
                actor: "restore".into(),
                action: "catalog.restore".into(),
                kind: "catalog".into(),
                id: mirror.epoch.clone().unwrap_or_default(),
                rev: mirror.version,
                before: Some(serde_json::json!({"epoch": seen.0, "version": seen.1})),
                after: Some(serde_json::json!({"epoch": mirror.epoch, "version": mirror.version})),
            },
        );
        persist(&self.path, &next)?;
        *self.catalog.lock() = FileCatalog::from_data(next);
        Ok(true)
    }

    pub fn catalog_write(
        &self,
        write: &CatalogWrite,
        audit: &Audit,
    ) -> Result<WriteOutcome, StoreError> {
        let _one = self.writer.lock();
        let staged = match self.catalog.lock().stage(write, audit) {
            Ok(staged) => staged,
            Err(refusal) => return Ok(refusal),
        };
        persist(&self.path, &staged.data)?;
        Ok(self.catalog.lock().commit(staged))
    }

    pub fn plan(&self, name: &str) -> Option<Versioned<PlanRecord>> {
        let name = PlanName::parse(name).ok()?;
        self.catalog.lock().data.plans.get(&name).cloned()
    }

    pub fn client(&self, id: &str) -> Option<Versioned<ClientRecord>> {
        let id = ClientId::parse(id).ok()?;
        self.catalog.lock().data.clients.get(&id).cloned()
    }

    pub fn safety(&self) -> Option<Versioned<SafetyRecord>> {
        self.catalog.lock().data.safety.clone()
    }

    pub fn plans(&self) -> Vec<Versioned<PlanRecord>> {
        self.catalog.lock().data.plans.values().cloned().collect()
    }

    /// Up to `limit` clients in id order, after the id `after`.
    pub fn clients_page(&self, after: Option<&str>, limit: usize) -> ClientsPage {
        let cat = self.catalog.lock();
        let after = after.and_then(|a| ClientId::parse(a).ok());
        let range = match &after {
            Some(a) => cat.data.clients.range((
                std::ops::Bound::Excluded(a.clone()),
                std::ops::Bound::Unbounded,
            )),
            None => cat.data.clients.range(..),
        };
        let items: Vec<_> = range.take(limit).map(|(_, v)| v.clone()).collect();
        ClientsPage {
            next: (items.len() == limit)
                .then(|| items.last().map(|c| c.value.id.to_string()))
                .flatten(),
            items,
        }
    }

    /// The newest `limit` audit entries, newest first.
    pub fn audit(&self, limit: usize) -> Vec<AuditEntry> {
        self.catalog
            .lock()
            .data
            .audit
            .iter()
            .rev()
            .take(limit)
            .cloned()
            .collect()
    }

    /// Appends an audit entry for a change outside the catalog (a bucket refill).
    pub fn record_audit(&self, entry: AuditEntry) -> Result<(), StoreError> {
        let _one = self.writer.lock();
        let mut next = self.catalog.lock().data.clone();
        push_audit(&mut next.audit, entry);
        persist(&self.path, &next)?;
        self.catalog.lock().data = next;
        Ok(())
    }
}

/// A sharded client's reconciliation state (embedded mode).
struct EmbeddedShard {
    ts: u64,
    since: u64,
    seed: f64,
    shares: HashMap<String, f64>,
    /// Region → (requests/s, when reported).
    demand: HashMap<String, (f64, u64)>,
    fill: HashMap<String, f64>,
    history: VecDeque<serde_json::Value>,
}

impl EmbeddedShard {
    fn state(&self, regions: &[Region]) -> ShardState {
        ShardState {
            updated_at_ms: self.ts,
            since_ms: self.since,
            seed: self.seed,
            regions: regions
                .iter()
                .map(|g| RegionShare {
                    region: g.to_string(),
                    share: self
                        .shares
                        .get(g.as_str())
                        .copied()
                        .unwrap_or(1.0 / regions.len() as f64),
                    fill: self.fill.get(g.as_str()).copied(),
                })
                .collect(),
        }
    }
}

/// The catalog file's contents.
#[derive(Default, Clone, Serialize, Deserialize)]
struct CatalogFile {
    /// The catalog's identity, given by its first write (see `CatalogDump::epoch`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    epoch: Option<String>,
    version: u64,
    plans: BTreeMap<PlanName, Versioned<PlanRecord>>,
    clients: BTreeMap<ClientId, Versioned<ClientRecord>>,
    #[serde(default)]
    safety: Option<Versioned<SafetyRecord>>,
    /// The newest changes, oldest first.
    #[serde(default)]
    audit: VecDeque<AuditEntry>,
}

fn push_audit(log: &mut VecDeque<AuditEntry>, entry: AuditEntry) {
    log.push_back(entry);
    while log.len() > AUDIT_LEN {
        log.pop_front();
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

struct FileCatalog {
    data: CatalogFile,
    /// Plan name → clients on it.
    users: HashMap<PlanName, usize>,
    keys: HashMap<KeyHash, ClientId>,
    /// Recent changes (version, kind, id), like the Redis change feed.
    feed: VecDeque<(u64, &'static str, String)>,
}

impl FileCatalog {
    fn open(path: &Path) -> Result<FileCatalog, StoreError> {
        let data = match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| StoreError::File(format!("{}: {e}", path.display())))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => CatalogFile::default(),
            Err(e) => return Err(StoreError::File(format!("{}: {e}", path.display()))),
        };
        Ok(FileCatalog::from_data(data))
    }

    /// The catalog over `data`, with its derived indexes and an empty change feed.
    fn from_data(data: CatalogFile) -> FileCatalog {
        let mut cat = FileCatalog {
            data,
            users: HashMap::new(),
            keys: HashMap::new(),
            feed: VecDeque::new(),
        };
        for c in cat.data.clients.values() {
            *cat.users.entry(c.value.plan.clone()).or_default() += 1;
            for k in &c.value.keys {
                cat.keys.insert(k.hash, c.value.id.clone());
            }
        }
        cat
    }

    fn dump(&self) -> CatalogDump {
        CatalogDump {
            epoch: self.data.epoch.clone(),
            version: self.data.version,
            plans: self.data.plans.values().cloned().collect(),
            clients: self.data.clients.values().cloned().collect(),
            safety: self.data.safety.clone(),
        }
    }

    fn changes(&self, since: u64, epoch: Option<&str>) -> CatalogChanges {
        if self.data.epoch.as_deref() != epoch {
            return CatalogChanges::Reload(self.dump());
        }
        if since == self.data.version {
            return CatalogChanges::Unchanged;
        }
        let contiguous = self.feed.front().is_some_and(|(v, _, _)| *v <= since + 1);
        if since > self.data.version || !contiguous {
            return CatalogChanges::Reload(self.dump());
        }
        let mut plans = Vec::new();
        let mut clients = Vec::new();
        let mut safety = None;
        for (_, kind, id) in self.feed.iter().filter(|(v, _, _)| *v > since) {
            if *kind == "setting" {
                safety = Some(self.data.safety.clone());
            } else if *kind == "plan" {
                if let Ok(name) = PlanName::parse(id) {
                    let rec = self.data.plans.get(&name).cloned();
                    plans.push((name, rec));
                }
            } else if let Ok(id) = ClientId::parse(id) {
                let rec = self.data.clients.get(&id).cloned();
                clients.push((id, rec));
            }
        }
        CatalogChanges::Delta {
            version: self.data.version,
            plans,
            clients,
            safety,
            more: false,
        }
    }

    /// The same checks, in the same order, as `lua/catalog_write.lua`, on a copy: the
    /// write staged for [`FileCatalog::commit`] once it is on disk, or the refusal.
    fn stage(&self, write: &CatalogWrite, audit: &Audit) -> Result<Staged, WriteOutcome> {
        let id = write.id();
        let old: Option<(u64, String)> = match write {
            CatalogWrite::PutSafety(..) => {
                self.data.safety.as_ref().map(|v| (v.rev, json(&v.value)))
            }
            CatalogWrite::PutPlan(..) | CatalogWrite::DeletePlan(..) => PlanName::parse(id)
                .ok()
                .and_then(|n| self.data.plans.get(&n))
                .map(|v| (v.rev, json(&v.value))),
            _ => ClientId::parse(id)
                .ok()
                .and_then(|n| self.data.clients.get(&n))
                .map(|v| (v.rev, json(&v.value))),
        };
        match (write.condition(), &old) {
            (Condition::Absent, Some(_)) => return Err(WriteOutcome::Exists),
            (Condition::Rev(_), None) => return Err(WriteOutcome::Missing),
            (Condition::Rev(r), Some((rev, _))) if r != *rev => {
                return Err(WriteOutcome::Stale { current: *rev })
            }
            _ => {}
        }
        let rev = self.data.version + 1;
        // Work on a copy so a failed file write leaves memory as it was.
        let mut next_users = self.users.clone();
        let mut next_keys = self.keys.clone();
        let mut next = self.data.clone();
        next.version = rev;
        if next.epoch.is_none() && audit.names_catalog {
            next.epoch = Some(uuid::Uuid::new_v4().simple().to_string());
        }
        match write {
            CatalogWrite::PutSafety(rec, _) => {
                next.safety = Some(Versioned {
                    rev,
                    value: rec.clone(),
                });
            }
            CatalogWrite::PutPlan(p, _) => {
                next.plans.insert(
                    p.name.clone(),
                    Versioned {
                        rev,
                        value: p.clone(),
                    },
                );
            }
            CatalogWrite::DeletePlan(name, _) => {
                if old.is_none() {
                    return Err(WriteOutcome::Missing);
                }
                if next_users.get(name).copied().unwrap_or(0) > 0 {
                    return Err(WriteOutcome::PlanInUse);
                }
                next.plans.remove(name);
            }
            CatalogWrite::PutClient(c, _) => {
                if !next.plans.contains_key(&c.plan) {
                    return Err(WriteOutcome::UnknownPlan);
                }
                if c.keys
                    .iter()
                    .any(|k| next_keys.get(&k.hash).is_some_and(|owner| *owner != c.id))
                {
                    return Err(WriteOutcome::KeyConflict);
                }
                if let Some(prev) = next.clients.get(&c.id) {
                    unlink(&prev.value, &mut next_users, &mut next_keys);
                }
                *next_users.entry(c.plan.clone()).or_default() += 1;
                for k in &c.keys {
                    next_keys.insert(k.hash, c.id.clone());
                }
                next.clients.insert(
                    c.id.clone(),
                    Versioned {
                        rev,
                        value: c.clone(),
                    },
                );
            }
            CatalogWrite::DeleteClient(cid, _) => {
                let Some(prev) = next.clients.remove(cid) else {
                    return Err(WriteOutcome::Missing);
                };
                unlink(&prev.value, &mut next_users, &mut next_keys);
            }
        }
        let parse = |j: &str| serde_json::from_str(j).ok();
        push_audit(
            &mut next.audit,
            AuditEntry {
                at_ms: now_ms(),
                actor: audit.actor.clone(),
                action: audit.action.clone(),
                kind: write.kind().to_string(),
                id: id.to_string(),
                rev,
                before: old.as_ref().and_then(|(_, j)| parse(j)),
                after: write.json().as_deref().and_then(parse),
            },
        );
        Ok(Staged {
            data: next,
            users: next_users,
            keys: next_keys,
            change: (rev, write.kind(), id.to_string()),
            outcome: WriteOutcome::Written {
                rev,
                before: old.map(|(_, j)| j),
            },
        })
    }

    /// Puts a staged write in place (it is on disk).
    fn commit(&mut self, staged: Staged) -> WriteOutcome {
        self.data = staged.data;
        self.users = staged.users;
        self.keys = staged.keys;
        self.feed.push_back(staged.change);
        if self.feed.len() > FEED_LEN {
            self.feed.pop_front();
        }
        staged.outcome
    }
}

/// A write checked and applied to a copy of the catalog, not yet on disk.
struct Staged {
    data: CatalogFile,
    users: HashMap<PlanName, usize>,
    keys: HashMap<KeyHash, ClientId>,
    /// The change-feed entry (version, kind, id).
    change: (u64, &'static str, String),
    outcome: WriteOutcome,
}

fn unlink(
    c: &ClientRecord,
    users: &mut HashMap<PlanName, usize>,
    keys: &mut HashMap<KeyHash, ClientId>,
) {
    if let Some(n) = users.get_mut(&c.plan) {
        *n = n.saturating_sub(1);
    }
    for k in &c.keys {
        keys.remove(&k.hash);
    }
}

fn json<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_default()
}

/// Writes to a temporary file beside the target, fsyncs it, renames it over the target
/// and fsyncs the directory: a crash leaves the old file or the new one, never half.
fn persist(path: &Path, data: &CatalogFile) -> Result<(), StoreError> {
    let err = |e: std::io::Error| StoreError::File(format!("{}: {e}", path.display()));
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(err)?;
    // A temporary file of its own (a unique name, removed if anything fails), never one
    // another writer could be writing too.
    let mut tmp = tempfile::Builder::new()
        .prefix(".catalog-")
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(err)?;
    serde_json::to_writer_pretty(&mut tmp, data)
        .map_err(|e| StoreError::File(format!("{}: {e}", path.display())))?;
    tmp.write_all(b"\n").map_err(err)?;
    tmp.as_file().sync_all().map_err(err)?;
    tmp.persist(path).map_err(|e| err(e.error))?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::records::KeyRecord;

    fn store() -> (tempfile::TempDir, EmbeddedStore) {
        let dir = tempfile::tempdir().unwrap();
        let s = EmbeddedStore::open(&dir.path().join("c.json")).unwrap();
        (dir, s)
    }

    fn by() -> Audit {
        Audit::new("test", "test")
    }

    fn plan(name: &str) -> PlanRecord {
        PlanRecord {
            name: PlanName::parse(name).unwrap(),
            capacity: 10.0,
            rate: 1.0,
            description: None,
        }
    }

    fn client(id: &str, plan: &str, key: &str) -> ClientRecord {
        ClientRecord {
            id: ClientId::parse(id).unwrap(),
            plan: PlanName::parse(plan).unwrap(),
            mode: None,
            shards: None,
            keys: vec![KeyRecord::new(KeyHash::of(key))],
        }
    }

    #[test]
    fn idle_buckets_are_evicted_once_they_would_be_full() {
        let (_d, s) = store();
        let p = Plan::new(1.0, 1000.0).unwrap();
        s.take("k", p, 1.0);
        assert!(s.peek("k").is_some());
        std::thread::sleep(std::time::Duration::from_millis(1100));
        assert_eq!(s.evict_idle(), 0);
        assert!(s.peek("k").is_none());
    }

    #[test]
    fn the_catalog_survives_a_reopen_and_holds_no_plaintext_key() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.json");
        {
            let s = EmbeddedStore::open(&path).unwrap();
            s.catalog_write(
                &CatalogWrite::PutPlan(plan("gold"), Condition::Absent),
                &by(),
            )
            .unwrap();
            s.catalog_write(
                &CatalogWrite::PutClient(
                    client("acme", "gold", "plaintext-key-1"),
                    Condition::Absent,
                ),
                &by(),
            )
            .unwrap();
        }
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.contains("plaintext-key-1"));
        let s = EmbeddedStore::open(&path).unwrap();
        let dump = s.catalog_dump();
        assert_eq!(dump.version, 2);
        assert_eq!(dump.clients.len(), 1);
    }

    #[test]
    fn refused_writes_change_nothing() {
        let (_d, s) = store();
        let w = |w: CatalogWrite| s.catalog_write(&w, &by()).unwrap();
        assert_eq!(
            w(CatalogWrite::PutClient(
                client("acme", "gold", "key-aaaaaaa"),
                Condition::Any
            )),
            WriteOutcome::UnknownPlan
        );
        w(CatalogWrite::PutPlan(plan("gold"), Condition::Any));
        w(CatalogWrite::PutClient(
            client("acme", "gold", "key-aaaaaaa"),
            Condition::Any,
        ));
        assert_eq!(
            w(CatalogWrite::PutClient(
                client("other", "gold", "key-aaaaaaa"),
                Condition::Any
            )),
            WriteOutcome::KeyConflict
        );
        assert_eq!(
            w(CatalogWrite::DeletePlan(
                PlanName::parse("gold").unwrap(),
                Condition::Any
            )),
            WriteOutcome::PlanInUse
        );
        assert_eq!(
            w(CatalogWrite::PutPlan(plan("gold"), Condition::Rev(1_000))),
            WriteOutcome::Stale { current: 1 }
        );
        assert_eq!(s.catalog_dump().version, 2);
    }

    #[test]
    fn the_change_feed_names_what_changed() {
        let (_d, s) = store();
        s.catalog_write(&CatalogWrite::PutPlan(plan("gold"), Condition::Any), &by())
            .unwrap();
        s.catalog_write(
            &CatalogWrite::PutPlan(plan("silver"), Condition::Any),
            &by(),
        )
        .unwrap();
        let epoch = s.catalog_dump().epoch;
        assert!(epoch.is_some(), "the first write names the catalog");
        match s.catalog_changes(1, epoch.as_deref()) {
            CatalogChanges::Delta { version, plans, .. } => {
                assert_eq!(version, 2);
                assert_eq!(plans.len(), 1);
                assert_eq!(plans[0].0.as_str(), "silver");
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            s.catalog_changes(2, epoch.as_deref()),
            CatalogChanges::Unchanged
        ));
        assert!(
            matches!(
                s.catalog_changes(2, Some("another")),
                CatalogChanges::Reload(_)
            ),
            "another catalog's versions mean nothing here"
        );
    }
}
