//! The catalog in the file: dumps, the change feed, writes (the same checks, in the same
//! order, as `lua/catalog_write.lua`), restores, and reads of single records and pages.
//! Each write is staged on a copy, put on disk, then committed, as [`EmbeddedStore`] says.

use std::collections::HashMap;
use std::time::Duration;

use async_trait::async_trait;
use serde::Serialize;

use super::backend::{
    now_ms, persist, push_audit, CatalogFile, EmbeddedStore, FileCatalog, FileStore,
};
use crate::domain::{ClientId, KeyHash, PlanName};
use crate::store::records::{
    ApplyOutcome, Audit, AuditEntry, CatalogApply, CatalogChanges, CatalogDump, CatalogWrite,
    ClientRecord, ClientsPage, Condition, ImportChunk, ImportOutcome, ImportProgress,
    KeyFilterHead, KeyFilterStep, KeyLookup, PlanRecord, SafetyRecord, Versioned, Wants,
    WriteOutcome,
};
use crate::store::{CatalogAt, CatalogRecords, StoreError};

const FEED_LEN: usize = 10_000;

#[async_trait]
impl CatalogRecords for EmbeddedStore {
    async fn dump(&self) -> Result<CatalogDump, StoreError> {
        Ok(self.file.catalog.lock().dump())
    }

    async fn changes(
        &self,
        since: u64,
        epoch: Option<&str>,
        wants: Wants<'_>,
    ) -> Result<CatalogChanges, StoreError> {
        Ok(match self.file.catalog.lock().changes(since, epoch) {
            CatalogChanges::Reload(mut dump) if matches!(wants, Wants::Held(_)) => {
                dump.clients.clear();
                CatalogChanges::Reload(dump)
            }
            changes => changes,
        })
    }

    async fn restore(&self, seen: CatalogAt<'_>, mirror: &CatalogDump) -> Result<bool, StoreError> {
        let (epoch, version) = (seen.epoch.map(str::to_string), seen.version);
        let mirror = mirror.clone();
        self.file
            .off_worker(move |file| {
                let seen = CatalogAt {
                    epoch: epoch.as_deref(),
                    version,
                };
                file.restore(seen, &mirror)
            })
            .await
    }

    /// The embedded store's catalog belongs to its one gateway, which holds its file: a bulk
    /// import goes to Redis (`tollgate import` says so before it reads the file).
    async fn import(&self, _chunk: &ImportChunk<'_>) -> Result<ImportOutcome, StoreError> {
        Err(StoreError::File(
            "a bulk import needs Redis; the embedded store takes clients through the admin API"
                .into(),
        ))
    }

    async fn import_progress(&self, _import: &str) -> Result<ImportProgress, StoreError> {
        Ok(ImportProgress::default())
    }

    async fn apply(&self, apply: &CatalogApply<'_>) -> Result<ApplyOutcome, StoreError> {
        let at = (apply.at_epoch.map(str::to_string), apply.at_version);
        let writes = apply.writes.to_vec();
        let (audit, summary) = (apply.audit.clone(), apply.summary.clone());
        self.file
            .off_worker(move |file| file.apply(at, &writes, &audit, summary))
            .await
    }

    async fn write(&self, write: &CatalogWrite, audit: &Audit) -> Result<WriteOutcome, StoreError> {
        let (write, audit) = (write.clone(), audit.clone());
        self.file
            .off_worker(move |file| file.write(&write, &audit))
            .await
    }

    async fn plan(&self, name: &str) -> Result<Option<Versioned<PlanRecord>>, StoreError> {
        let Ok(name) = PlanName::parse(name) else {
            return Ok(None);
        };
        Ok(self.file.catalog.lock().data.plans.get(&name).cloned())
    }

    async fn client(&self, id: &str) -> Result<Option<Versioned<ClientRecord>>, StoreError> {
        let Ok(id) = ClientId::parse(id) else {
            return Ok(None);
        };
        Ok(self.file.catalog.lock().data.clients.get(&id).cloned())
    }

    async fn client_by_key(
        &self,
        hash: &KeyHash,
        _near_within: Duration,
    ) -> Result<KeyLookup, StoreError> {
        let catalog = self.file.catalog.lock();
        Ok(KeyLookup {
            epoch: catalog.data.epoch.clone(),
            version: catalog.data.version,
            client: catalog
                .keys
                .get(hash)
                .and_then(|id| catalog.data.clients.get(id))
                .cloned(),
        })
    }

    /// The embedded store holds every key in this process: no filter to build or read.
    async fn key_filter_step(&self, _: u64, _: u64) -> Result<KeyFilterStep, StoreError> {
        Err(StoreError::Protocol(
            "the embedded store has no key filter".into(),
        ))
    }

    async fn key_filter_head(&self) -> Result<Option<KeyFilterHead>, StoreError> {
        Ok(None)
    }

    async fn key_filter_bytes(&self, _: u64, _: u64) -> Result<Vec<u8>, StoreError> {
        Ok(Vec::new())
    }

    async fn safety(&self) -> Result<Option<Versioned<SafetyRecord>>, StoreError> {
        Ok(self.file.catalog.lock().data.safety.clone())
    }

    async fn plans(&self) -> Result<Vec<Versioned<PlanRecord>>, StoreError> {
        Ok(self
            .file
            .catalog
            .lock()
            .data
            .plans
            .values()
            .cloned()
            .collect())
    }

    async fn clients_page(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<ClientsPage, StoreError> {
        let cat = self.file.catalog.lock();
        let after = after.and_then(|a| ClientId::parse(a).ok());
        let range = match &after {
            Some(a) => cat.data.clients.range((
                std::ops::Bound::Excluded(a.clone()),
                std::ops::Bound::Unbounded,
            )),
            None => cat.data.clients.range(..),
        };
        let items: Vec<_> = range.take(limit).map(|(_, v)| v.clone()).collect();
        Ok(ClientsPage {
            next: (items.len() == limit)
                .then(|| items.last().map(|c| c.value.id.to_string()))
                .flatten(),
            items,
        })
    }
}

impl FileStore {
    /// Replaces the catalog with `mirror` if it is still at `seen` (as the Redis side's
    /// `lua/catalog_restore.lua`); the audit log stays.
    pub(super) fn restore(
        &self,
        seen: CatalogAt<'_>,
        mirror: &CatalogDump,
    ) -> Result<bool, StoreError> {
        let _one = self.writer.lock();
        let audit = {
            let cat = self.catalog.lock();
            if cat.data.epoch.as_deref() != seen.epoch || cat.data.version != seen.version {
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
                before: Some(serde_json::json!({"epoch": seen.epoch, "version": seen.version})),
                after: Some(serde_json::json!({"epoch": mirror.epoch, "version": mirror.version})),
            },
        );
        persist(&self.path, &next)?;
        *self.catalog.lock() = FileCatalog::from_data(next);
        Ok(true)
    }

    /// Many writes as one (as the Redis side's `lua/catalog_apply.lua`), if the catalog is
    /// still at `at` (epoch, version): staged on one copy, put on disk, then committed,
    /// each write a version and an entry of the change feed.
    pub(super) fn apply(
        &self,
        at: (Option<String>, u64),
        writes: &[CatalogWrite],
        audit: &Audit,
        summary: serde_json::Value,
    ) -> Result<ApplyOutcome, StoreError> {
        let _one = self.writer.lock();
        let mut next = {
            let cat = self.catalog.lock();
            if cat.data.epoch != at.0 || cat.data.version != at.1 {
                return Ok(ApplyOutcome::Moved {
                    version: cat.data.version,
                });
            }
            Staged {
                data: cat.data.clone(),
                users: cat.users.clone(),
                keys: cat.keys.clone(),
                change: (0, "", String::new()),
                outcome: WriteOutcome::Missing,
            }
        };
        // Every client written or deleted lets go of its keys and its plan first, so a key
        // that moves between two clients of the apply finds its new owner in any order.
        for w in writes {
            if let CatalogWrite::PutClient(ClientRecord { id, .. }, _)
            | CatalogWrite::DeleteClient(id, _) = w
            {
                if let Some(prev) = next.data.clients.get(id) {
                    unlink(&prev.value, &mut next.users, &mut next.keys);
                }
            }
        }
        let mut feed = Vec::with_capacity(writes.len());
        for w in writes {
            let rev = next.data.version + 1;
            next.data.version = rev;
            next.place(w, rev);
            feed.push((rev, w.kind(), w.id().to_string()));
        }
        if next.data.epoch.is_none() && audit.names_catalog {
            next.data.epoch = Some(uuid::Uuid::new_v4().simple().to_string());
        }
        push_audit(
            &mut next.data.audit,
            AuditEntry {
                at_ms: now_ms(),
                actor: audit.actor.clone(),
                action: "catalog.apply".into(),
                kind: "catalog".into(),
                id: uuid::Uuid::new_v4().simple().to_string(),
                rev: next.data.version,
                before: Some(serde_json::json!({"version": at.1})),
                after: Some(summary),
            },
        );
        persist(&self.path, &next.data)?;
        let version = next.data.version;
        let mut cat = self.catalog.lock();
        cat.data = next.data;
        cat.users = next.users;
        cat.keys = next.keys;
        for change in feed {
            cat.feed.push_back(change);
            if cat.feed.len() > FEED_LEN {
                cat.feed.pop_front();
            }
        }
        Ok(ApplyOutcome::Applied { version })
    }

    /// One write with its audit entry, staged, put on disk, then committed.
    pub(super) fn write(
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
}

impl FileCatalog {
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
            keys: Vec::new(),
            more: false,
        }
    }

    /// The same checks, in the same order, as `lua/catalog_write.lua`, on a copy: the
    /// write staged for [`FileCatalog::commit`] once it is on disk, or the refusal.
    fn stage(&self, write: &CatalogWrite, audit: &Audit) -> Result<Staged, WriteOutcome> {
        let id = write.id();
        let old = self.current(write);
        admits(write.condition(), old.as_ref().map(|(rev, _)| *rev))?;
        let rev = self.data.version + 1;
        // Work on a copy so a failed file write leaves memory as it was.
        let mut next = Staged {
            data: self.data.clone(),
            users: self.users.clone(),
            keys: self.keys.clone(),
            change: (rev, write.kind(), id.to_string()),
            outcome: WriteOutcome::Written { rev, before: None },
        };
        next.data.version = rev;
        if next.data.epoch.is_none() && audit.names_catalog {
            next.data.epoch = Some(uuid::Uuid::new_v4().simple().to_string());
        }
        next.apply(write, rev, old.is_some())?;
        let parse = |j: &str| serde_json::from_str(j).ok();
        push_audit(
            &mut next.data.audit,
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
        next.outcome = WriteOutcome::Written {
            rev,
            before: old.map(|(_, j)| j),
        };
        Ok(next)
    }

    /// The record `write` replaces or deletes, as it stands: its revision and its JSON.
    fn current(&self, write: &CatalogWrite) -> Option<(u64, String)> {
        let id = write.id();
        match write {
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
        }
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

/// Whether a write under `condition` may go ahead on a record at revision `current`
/// (`None`: there is none).
fn admits(condition: Condition, current: Option<u64>) -> Result<(), WriteOutcome> {
    match (condition, current) {
        (Condition::Absent, Some(_)) => Err(WriteOutcome::Exists),
        (Condition::Rev(_), None) => Err(WriteOutcome::Missing),
        (Condition::Rev(r), Some(rev)) if r != rev => Err(WriteOutcome::Stale { current: rev }),
        _ => Ok(()),
    }
}

impl Staged {
    /// Applies `write` at revision `rev` to the staged copy (`existed`: the record it names
    /// exists), keeping the plans' user counts and the key index with it.
    fn apply(&mut self, write: &CatalogWrite, rev: u64, existed: bool) -> Result<(), WriteOutcome> {
        match write {
            CatalogWrite::DeletePlan(name, _) => {
                if !existed {
                    return Err(WriteOutcome::Missing);
                }
                if self.users.get(name).copied().unwrap_or(0) > 0 {
                    return Err(WriteOutcome::PlanInUse);
                }
            }
            CatalogWrite::PutClient(c, _) => {
                if !self.data.plans.contains_key(&c.plan) {
                    return Err(WriteOutcome::UnknownPlan);
                }
                if c.keys
                    .iter()
                    .any(|k| self.keys.get(&k.hash).is_some_and(|owner| *owner != c.id))
                {
                    return Err(WriteOutcome::KeyConflict);
                }
                if let Some(prev) = self.data.clients.get(&c.id) {
                    unlink(&prev.value, &mut self.users, &mut self.keys);
                }
            }
            CatalogWrite::DeleteClient(cid, _) => {
                let Some(prev) = self.data.clients.get(cid) else {
                    return Err(WriteOutcome::Missing);
                };
                unlink(&prev.value, &mut self.users, &mut self.keys);
            }
            CatalogWrite::PutSafety(..) | CatalogWrite::PutPlan(..) => {}
        }
        self.place(write, rev);
        Ok(())
    }
}

impl Staged {
    /// Makes `write` at revision `rev`, checked before and its client's old keys let go
    /// (by [`Staged::apply`] for one write, by an apply of many for all of them first).
    fn place(&mut self, write: &CatalogWrite, rev: u64) {
        let next = &mut self.data;
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
                next.plans.remove(name);
            }
            CatalogWrite::PutClient(c, _) => {
                *self.users.entry(c.plan.clone()).or_default() += 1;
                for k in &c.keys {
                    self.keys.insert(k.hash, c.id.clone());
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
                next.clients.remove(cid);
            }
        }
    }
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
        PlanRecord::new(
            PlanName::parse(name).unwrap(),
            &crate::domain::Limits::single(crate::domain::Bucket::new(10.0, 1.0).unwrap()),
            None,
        )
    }

    fn client(id: &str, plan: &str, key: &str) -> ClientRecord {
        ClientRecord {
            overrides: Vec::new(),
            id: ClientId::parse(id).unwrap(),
            plan: PlanName::parse(plan).unwrap(),
            mode: None,
            shards: None,
            keys: vec![KeyRecord::new(KeyHash::of(key))],
            extra: Default::default(),
        }
    }

    #[test]
    fn the_catalog_survives_a_reopen_and_holds_no_plaintext_key() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.json");
        {
            let s = EmbeddedStore::open(&path).unwrap();
            s.file
                .write(
                    &CatalogWrite::PutPlan(plan("gold"), Condition::Absent),
                    &by(),
                )
                .unwrap();
            s.file
                .write(
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
        let dump = s.file.catalog.lock().dump();
        assert_eq!(dump.version, 2);
        assert_eq!(dump.clients.len(), 1);
    }

    #[test]
    fn refused_writes_change_nothing() {
        let (_d, s) = store();
        let w = |w: CatalogWrite| s.file.write(&w, &by()).unwrap();
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
        assert_eq!(s.file.catalog.lock().dump().version, 2);
    }

    #[test]
    fn the_change_feed_names_what_changed() {
        let (_d, s) = store();
        s.file
            .write(&CatalogWrite::PutPlan(plan("gold"), Condition::Any), &by())
            .unwrap();
        s.file
            .write(
                &CatalogWrite::PutPlan(plan("silver"), Condition::Any),
                &by(),
            )
            .unwrap();
        let epoch = s.file.catalog.lock().dump().epoch;
        assert!(epoch.is_some(), "the first write names the catalog");
        match s.file.catalog.lock().changes(1, epoch.as_deref()) {
            CatalogChanges::Delta { version, plans, .. } => {
                assert_eq!(version, 2);
                assert_eq!(plans.len(), 1);
                assert_eq!(plans[0].0.as_str(), "silver");
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            s.file.catalog.lock().changes(2, epoch.as_deref()),
            CatalogChanges::Unchanged
        ));
        assert!(
            matches!(
                s.file.catalog.lock().changes(2, Some("another")),
                CatalogChanges::Reload(_)
            ),
            "another catalog's versions mean nothing here"
        );
    }
}
