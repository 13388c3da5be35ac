//! The catalog in Redis: whole dumps, the change feed gateways poll instead of reloading,
//! scripted writes (`lua/catalog_write.lua`), restores staged in chunks and committed at
//! once (`lua/catalog_restore_stage.lua`, `lua/catalog_restore.lua`), and reads of single
//! records and pages.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use async_trait::async_trait;
use redis::{AsyncCommands, RedisError, ScriptInvocation, Value};

use super::backend::{retrying, scan_hash, Conn, FeedEntry, RedisStore};
use crate::domain::{ClientId, KeyHash, PlanName};
use crate::store::records::{
    ApplyOutcome, Audit, CatalogApply, CatalogChanges, CatalogDump, CatalogWrite, ClientRecord,
    ClientsPage, Condition, ImportChunk, ImportOutcome, ImportProgress, KeyFilterHead,
    KeyFilterStep, KeyLookup, PlanRecord, SafetyRecord, Versioned, Wants, WriteOutcome, SAFETY,
};
use crate::store::{CatalogAt, CatalogRecords, StoreError};

/// How many change-feed entries one poll reads.
const FEED_PAGE: usize = 1000;

/// How many records one call of a restore (or a large apply) stages: every call stays this
/// small, however large the catalog (a million clients in one argument were hundreds of
/// MB), and holds Redis well under a decision's budget (1,000 records held it 15 ms: about
/// 15 µs a record; 200, some 3 ms).
const RESTORE_CHUNK: usize = 200;

/// How long a restore's staging keys outlive its latest staging call: a gateway that
/// stops mid-restore leaves keys that expire, never a catalog.
const STAGING_KEPT: Duration = Duration::from_secs(600);

/// The most writes an apply makes one by one, each with its feed entry, in one script
/// (about 30 µs of Redis each: some 3 ms); more put the whole catalog in place.
pub(super) const DELTA_MAX: usize = 100;

/// What a restore stages, one key each, in the order both restore scripts name them.
const STAGED: [&str; 6] = ["plans", "clients", "keys", "users", "index", "settings"];

#[async_trait]
impl CatalogRecords for RedisStore {
    async fn dump(&self) -> Result<CatalogDump, StoreError> {
        retrying!(self, |c| self.catalog_dump_on(c).await)
    }

    async fn changes(
        &self,
        since: u64,
        epoch: Option<&str>,
        wants: Wants<'_>,
    ) -> Result<CatalogChanges, StoreError> {
        match retrying!(self, |c| self
            .catalog_changes_on(c, since, epoch, wants)
            .await)?
        {
            Some(changes) => Ok(changes),
            None => Ok(CatalogChanges::Reload(match wants {
                Wants::Whole => self.dump().await?,
                Wants::Held(_) => retrying!(self, |c| self.catalog_head_on(c).await)?,
            })),
        }
    }

    async fn import(&self, chunk: &ImportChunk<'_>) -> Result<ImportOutcome, StoreError> {
        let mut inv = self.catalog_import.prepare_invoke();
        for part in [
            "plans", "clients", "keys", "users", "version", "changes", "index", "audit", "epoch",
        ] {
            inv.key(self.keys.catalog(part));
        }
        inv.key(self.keys.catalog(&format!("import:{}", chunk.import)))
            .key(self.keys.catalog("keyfilter"))
            .key(self.keys.catalog("keyfilter:meta"));
        inv.arg(chunk.chunk)
            .arg(if chunk.last { "1" } else { "0" })
            .arg(chunk.actor)
            .arg(chunk.import)
            .arg(uuid::Uuid::new_v4().simple().to_string())
            .arg(chunk.in_file);
        for c in chunk.clients {
            let json = serde_json::to_string(c)
                .map_err(|e| StoreError::Protocol(format!("client record: {e}")))?;
            inv.arg(c.id.as_str())
                .arg(c.plan.as_str())
                .arg(json)
                .arg(c.keys.len());
            for k in &c.keys {
                inv.arg(k.hash.to_string());
            }
        }
        // Retried on a fresh connection like any write: a resend of a chunk that ran
        // finds it done.
        let (status, detail): (String, String) =
            retrying!(self, |c| async { Ok(inv.invoke_async(c).await?) }.await)?;
        let number = || {
            detail
                .parse::<u64>()
                .map_err(|_| StoreError::Protocol(format!("catalog import: {detail}")))
        };
        Ok(match status.as_str() {
            "ok" => ImportOutcome::Written { version: number()? },
            "done" => ImportOutcome::Done,
            "out_of_order" => ImportOutcome::OutOfOrder { next: number()? },
            "exists" => ImportOutcome::Exists(detail),
            "unknown_plan" => ImportOutcome::UnknownPlan(detail),
            "key_conflict" => ImportOutcome::KeyConflict(detail),
            other => return Err(StoreError::Protocol(format!("catalog import: {other}"))),
        })
    }

    async fn import_progress(&self, import: &str) -> Result<ImportProgress, StoreError> {
        let key = self.keys.catalog(&format!("import:{import}"));
        let (next, clients, done): (Option<u64>, Option<u64>, Option<u64>) =
            retrying!(self, |c| async {
                Ok(redis::pipe()
                    .hget(&key, "next")
                    .hget(&key, "clients")
                    .hget(&key, "done")
                    .query_async(c)
                    .await?)
            }
            .await)?;
        Ok(ImportProgress {
            next: next.unwrap_or(0),
            clients: clients.unwrap_or(0),
            done: done == Some(1),
        })
    }

    async fn write(&self, write: &CatalogWrite, audit: &Audit) -> Result<WriteOutcome, StoreError> {
        let mut inv = self.catalog_write.prepare_invoke();
        for part in [
            "plans", "clients", "keys", "users", "version", "changes", "settings", "index", "audit",
        ] {
            inv.key(self.keys.catalog(part));
        }
        // This write's own id: a resend of a write that Redis already ran (its reply lost
        // with the connection) answers the first run's reply and changes nothing.
        inv.key(
            self.keys
                .catalog(&format!("write:{}", uuid::Uuid::new_v4().simple())),
        )
        .key(self.keys.catalog("epoch"))
        .key(self.keys.catalog("keyfilter"))
        .key(self.keys.catalog("keyfilter:meta"));
        let (op, plan, hashes) = match write {
            CatalogWrite::PutClient(c, _) => (
                "put",
                c.plan.to_string(),
                c.keys.iter().map(|k| k.hash.to_string()).collect(),
            ),
            CatalogWrite::PutPlan(..) | CatalogWrite::PutSafety(..) => {
                ("put", String::new(), vec![])
            }
            CatalogWrite::DeletePlan(..) | CatalogWrite::DeleteClient(..) => {
                ("delete", String::new(), vec![])
            }
        };
        let cond = match write.condition() {
            Condition::Any => "any".to_string(),
            Condition::Absent => "absent".to_string(),
            Condition::Rev(r) => r.to_string(),
        };
        inv.arg(write.kind())
            .arg(op)
            .arg(write.id())
            .arg(cond)
            .arg(write.json().unwrap_or_default())
            .arg(plan)
            .arg(&audit.actor)
            .arg(&audit.action)
            .arg(if audit.names_catalog {
                uuid::Uuid::new_v4().simple().to_string()
            } else {
                String::new()
            })
            .arg(hashes);
        let (status, rev, detail): (String, u64, Value) =
            retrying!(self, |c| async { Ok(inv.invoke_async(c).await?) }.await)?;
        Ok(match status.as_str() {
            "ok" => WriteOutcome::Written {
                rev,
                before: redis::from_redis_value::<Option<String>>(detail).unwrap_or(None),
            },
            "exists" => WriteOutcome::Exists,
            "stale" => WriteOutcome::Stale { current: rev },
            "missing" => WriteOutcome::Missing,
            "unknown_plan" => WriteOutcome::UnknownPlan,
            "plan_in_use" => WriteOutcome::PlanInUse,
            "key_conflict" => WriteOutcome::KeyConflict,
            other => return Err(StoreError::Protocol(format!("catalog write: {other}"))),
        })
    }

    /// Puts `mirror` in place of the store's catalog if the store is still at `seen`:
    /// staged under a restore id of its own, [`RESTORE_CHUNK`] records a call
    /// (`lua/catalog_restore_stage.lua`), then committed in one atomic step
    /// (`lua/catalog_restore.lua`), so no call grows with the catalog. Each call is retried
    /// on a fresh connection like any write: a staged chunk resent changes nothing, and a
    /// commit resent after a lost reply finds the store moved (to the mirror) and writes
    /// nothing.
    async fn restore(&self, seen: CatalogAt<'_>, mirror: &CatalogDump) -> Result<bool, StoreError> {
        let staging = self.restore_staging(&uuid::Uuid::new_v4().simple().to_string());
        for chunk in restore_chunks(mirror) {
            self.stage_restore(&staging, &chunk).await?;
        }
        self.commit_restore(&staging, seen, mirror).await
    }

    /// A few writes (at most [`DELTA_MAX`]) are made one by one in one script, each with
    /// its change-feed entry, so gateways follow them as single writes
    /// ([`RedisStore::apply_delta`]); more are made by putting the whole catalog they give
    /// in place ([`RedisStore::apply_swap`]), whose commit costs the same however many
    /// change, and after which gateways reload. Either way no call holds Redis much longer
    /// than a decision's budget.
    async fn apply(&self, apply: &CatalogApply<'_>) -> Result<ApplyOutcome, StoreError> {
        if apply.writes.len() <= DELTA_MAX {
            self.apply_delta(apply).await
        } else {
            self.apply_swap(apply).await
        }
    }

    async fn plan(&self, name: &str) -> Result<Option<Versioned<PlanRecord>>, StoreError> {
        self.entity("plans", name).await
    }

    async fn client(&self, id: &str) -> Result<Option<Versioned<ClientRecord>>, StoreError> {
        self.entity("clients", id).await
    }

    async fn client_by_key(
        &self,
        hash: &KeyHash,
        near_within: Duration,
    ) -> Result<KeyLookup, StoreError> {
        let mut inv = self.client_by_key.prepare_invoke();
        inv.key(self.keys.catalog("keys"))
            .key(self.keys.catalog("clients"))
            .key(self.keys.catalog("version"))
            .key(self.keys.catalog("epoch"))
            .arg(hash.to_string());
        // On the worker's own connection to the catalog's server; off the request path
        // when it has none, or the read fails on it (a dead link, a slot that moved) or
        // does not answer in time (a link gone silent: the breaker's probe retires it).
        let near = match self.backend.near(&self.keys.catalog("keys")) {
            Some(mut link) => tokio::time::timeout(near_within, inv.invoke_async(&mut link))
                .await
                .unwrap_or_else(|_| Err(RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut))))
                .map_err(|e| {
                    tracing::debug!(error = %e, "a key's lookup on the worker's connection failed; once more off it");
                }),
            None => Err(()),
        };
        let (version, epoch, raw): (Option<u64>, Option<String>, Option<String>) = match near {
            Ok(r) => r,
            Err(()) => retrying!(self, |c| async { Ok(inv.invoke_async(c).await?) }.await)?,
        };
        Ok(KeyLookup {
            epoch,
            version: version.unwrap_or(0),
            client: raw.and_then(|r| parse_entity(&r)),
        })
    }

    async fn key_filter_step(&self, bits: u64, per_step: u64) -> Result<KeyFilterStep, StoreError> {
        let mut inv = self.key_filter_build.prepare_invoke();
        inv.key(self.keys.catalog("keys"))
            .key(self.keys.catalog("keyfilter"))
            .key(self.keys.catalog("keyfilter:meta"))
            .arg(bits)
            .arg(per_step)
            .arg(uuid::Uuid::new_v4().simple().to_string());
        let reply: Vec<Value> =
            retrying!(self, |c| async { Ok(inv.invoke_async(c).await?) }.await)?;
        let text = |v: Option<&Value>| -> Option<String> {
            v.and_then(|v| redis::from_redis_value_ref::<String>(v).ok())
        };
        let int = |v: Option<&Value>| -> Option<u64> {
            v.and_then(|v| redis::from_redis_value_ref::<u64>(v).ok())
        };
        match text(reply.first()).as_deref() {
            Some("building") => Ok(KeyFilterStep::Building(int(reply.get(1)).unwrap_or(0))),
            Some("complete") => Ok(KeyFilterStep::Complete(KeyFilterHead {
                bits: int(reply.get(1)).unwrap_or(0),
                id: text(reply.get(2)).unwrap_or_default(),
            })),
            _ => Err(StoreError::Protocol(format!(
                "key filter build: unexpected reply {reply:?}"
            ))),
        }
    }

    async fn key_filter_head(&self) -> Result<Option<KeyFilterHead>, StoreError> {
        let meta = self.keys.catalog("keyfilter:meta");
        let (bits, id, complete): (Option<u64>, Option<String>, Option<String>) =
            retrying!(self, |c| async {
                Ok(redis::cmd("HMGET")
                    .arg(&meta)
                    .arg("bits")
                    .arg("id")
                    .arg("complete")
                    .query_async(c)
                    .await?)
            }
            .await)?;
        Ok(match (bits, id, complete.as_deref()) {
            (Some(bits), Some(id), Some("1")) if bits > 0 => Some(KeyFilterHead { bits, id }),
            _ => None,
        })
    }

    async fn key_filter_bytes(&self, offset: u64, len: u64) -> Result<Vec<u8>, StoreError> {
        if len == 0 {
            return Ok(Vec::new());
        }
        let filter = self.keys.catalog("keyfilter");
        retrying!(self, |c| async {
            Ok(redis::cmd("GETRANGE")
                .arg(&filter)
                .arg(offset)
                .arg(offset + len - 1)
                .query_async(c)
                .await?)
        }
        .await)
    }

    async fn safety(&self) -> Result<Option<Versioned<SafetyRecord>>, StoreError> {
        self.entity("settings", SAFETY).await
    }

    async fn plans(&self) -> Result<Vec<Versioned<PlanRecord>>, StoreError> {
        let mut out: Vec<Versioned<PlanRecord>> = retrying!(self, |c| async {
            scan_hash(c, &self.keys.catalog("plans")).await
        }
        .await)?
        .into_iter()
        .filter_map(|(_, raw)| parse_entity(&raw))
        .collect();
        out.sort_by(|a, b| a.value.name.cmp(&b.value.name));
        Ok(out)
    }

    /// Up to `limit` clients in id order, after the id `after`.
    async fn clients_page(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<ClientsPage, StoreError> {
        retrying!(self, |c| async {
            let start = after.map_or_else(|| "-".to_string(), |a| format!("({a}"));
            let ids: Vec<String> = redis::cmd("ZRANGE")
                .arg(self.keys.catalog("index"))
                .arg(start)
                .arg("+")
                .arg("BYLEX")
                .arg("LIMIT")
                .arg(0)
                .arg(limit)
                .query_async(c)
                .await?;
            if ids.is_empty() {
                return Ok(ClientsPage::default());
            }
            let raws: Vec<Option<String>> = redis::cmd("HMGET")
                .arg(self.keys.catalog("clients"))
                .arg(&ids)
                .query_async(c)
                .await?;
            // The cursor is the last id the index gave, whether or not its client was
            // deleted between the two reads: a page thinned by deletes is not the last.
            Ok(ClientsPage {
                next: (ids.len() == limit).then(|| ids[ids.len() - 1].clone()),
                items: raws
                    .into_iter()
                    .flatten()
                    .filter_map(|r| parse_entity(&r))
                    .collect(),
            })
        }
        .await)
    }
}

impl RedisStore {
    /// Stages the writes under an apply id of their own, [`RESTORE_CHUNK`] a call
    /// (`lua/catalog_apply_stage.lua`), then makes them in one atomic step
    /// (`lua/catalog_apply.lua`). Each call is retried on a fresh connection like any
    /// write: a chunk resent adds nothing, and a commit resent after a lost reply answers
    /// the first run's reply.
    async fn apply_delta(&self, apply: &CatalogApply<'_>) -> Result<ApplyOutcome, StoreError> {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let staging = self.keys.catalog(&format!("apply:{id}:writes"));
        let mut staged = 0usize;
        for chunk in apply.writes.chunks(RESTORE_CHUNK) {
            let mut inv = self.catalog_apply_stage.prepare_invoke();
            inv.key(&staging).arg(STAGING_KEPT.as_secs()).arg(staged);
            for w in chunk {
                inv.arg(staged_write(w)?);
            }
            let now: usize = retrying!(self, |c| async { Ok(inv.invoke_async(c).await?) }.await)?;
            staged += chunk.len();
            if now != staged {
                return Err(StoreError::Protocol(format!(
                    "catalog apply: {now} writes staged, {staged} sent"
                )));
            }
        }
        let mut inv = self.catalog_apply.prepare_invoke();
        for part in [
            "plans", "clients", "keys", "users", "version", "changes", "settings", "index",
            "audit", "epoch",
        ] {
            inv.key(self.keys.catalog(part));
        }
        inv.key(&staging)
            .key(self.keys.catalog(&format!("apply:{id}:reply")))
            .key(self.keys.catalog("keyfilter"))
            .key(self.keys.catalog("keyfilter:meta"));
        inv.arg(apply.at_epoch.unwrap_or(""))
            .arg(apply.at_version)
            .arg(staged)
            .arg(&apply.audit.actor)
            .arg(&id)
            .arg(if apply.audit.names_catalog {
                uuid::Uuid::new_v4().simple().to_string()
            } else {
                String::new()
            })
            .arg(apply.summary.to_string());
        let (status, version): (String, u64) =
            retrying!(self, |c| async { Ok(inv.invoke_async(c).await?) }.await)?;
        match status.as_str() {
            "applied" => Ok(ApplyOutcome::Applied { version }),
            "moved" => Ok(ApplyOutcome::Moved { version }),
            "incomplete" => Err(StoreError::Protocol(
                "catalog apply: the staged writes were not all there when committed (they \
                 expired, or the store lost them); nothing changed"
                    .into(),
            )),
            other => Err(StoreError::Protocol(format!("catalog apply: {other}"))),
        }
    }

    /// Stages the whole catalog the writes give (`apply.whole`) under an apply id of its
    /// own, [`RESTORE_CHUNK`] records a call (`lua/catalog_restore_stage.lua`), sets the key
    /// filter's bits for the keys of every client written (`lua/key_filter_add.lua`), then
    /// puts the staged catalog in place in one atomic step of a few renames
    /// (`lua/catalog_apply_swap.lua`): the commit costs the same however many records
    /// change.
    /// Each call is retried on a fresh connection like any write: a chunk staged again
    /// changes nothing, and a commit resent after a lost reply answers the first run's
    /// reply.
    async fn apply_swap(&self, apply: &CatalogApply<'_>) -> Result<ApplyOutcome, StoreError> {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let staging: Vec<String> = STAGED
            .iter()
            .map(|part| self.keys.catalog(&format!("apply:{id}:{part}")))
            .collect();
        for chunk in restore_chunks(apply.whole) {
            self.stage_restore(&staging, &chunk).await?;
        }
        let given: Vec<String> = apply
            .writes
            .iter()
            .filter_map(|w| match w {
                CatalogWrite::PutClient(c, _) => Some(c),
                _ => None,
            })
            .flat_map(|c| c.keys.iter().map(|k| k.hash.to_string()))
            .collect();
        for hashes in given.chunks(RESTORE_CHUNK) {
            let mut inv = self.key_filter_add.prepare_invoke();
            inv.key(self.keys.catalog("keyfilter"))
                .key(self.keys.catalog("keyfilter:meta"))
                .arg(hashes);
            let _: u64 = retrying!(self, |c| async { Ok(inv.invoke_async(c).await?) }.await)?;
        }
        let mut inv = self.catalog_apply_swap.prepare_invoke();
        for part in [
            "plans", "clients", "keys", "users", "version", "changes", "settings", "index",
            "audit", "epoch",
        ] {
            inv.key(self.keys.catalog(part));
        }
        for key in &staging {
            inv.key(key);
        }
        inv.key(self.keys.catalog(&format!("apply:{id}:reply")));
        inv.arg(apply.at_epoch.unwrap_or(""))
            .arg(apply.at_version)
            .arg(apply.whole.plans.len())
            .arg(apply.whole.clients.len())
            .arg(usize::from(apply.whole.safety.is_some()))
            .arg(&apply.audit.actor)
            .arg(&id)
            .arg(if apply.audit.names_catalog {
                uuid::Uuid::new_v4().simple().to_string()
            } else {
                String::new()
            })
            .arg(apply.summary.to_string())
            .arg(apply.whole.version);
        let (status, version): (String, u64) =
            retrying!(self, |c| async { Ok(inv.invoke_async(c).await?) }.await)?;
        match status.as_str() {
            "applied" => Ok(ApplyOutcome::Applied { version }),
            "moved" => Ok(ApplyOutcome::Moved { version }),
            "incomplete" => Err(StoreError::Protocol(
                "catalog apply: the staged catalog was not all there when committed (it \
                 expired, or the store lost it); nothing changed"
                    .into(),
            )),
            other => Err(StoreError::Protocol(format!("catalog apply: {other}"))),
        }
    }

    /// The staging keys of the restore `restore` (see [`STAGED`]), in the `{catalog}` slot
    /// beside the live keys.
    fn restore_staging(&self, restore: &str) -> Vec<String> {
        STAGED
            .iter()
            .map(|part| self.keys.catalog(&format!("restore:{restore}:{part}")))
            .collect()
    }

    /// Writes one chunk of a restore to its staging keys.
    async fn stage_restore(
        &self,
        staging: &[String],
        chunk: &[Staged<'_>],
    ) -> Result<(), StoreError> {
        let mut inv = self.catalog_restore_stage.prepare_invoke();
        for key in staging {
            inv.key(key);
        }
        inv.arg(STAGING_KEPT.as_secs());
        for record in chunk {
            record.add_to(&mut inv)?;
        }
        let staged: u64 = retrying!(self, |c| async { Ok(inv.invoke_async(c).await?) }.await)?;
        tracing::debug!(staged, "a chunk of the catalog's restore staged");
        Ok(())
    }

    /// Puts the staged `mirror` in place of the live catalog if the store is still at
    /// `seen`; `false` when it moved. A staging that is not all there (expired, or lost
    /// with the store) is an error, and nothing changes.
    async fn commit_restore(
        &self,
        staging: &[String],
        seen: CatalogAt<'_>,
        mirror: &CatalogDump,
    ) -> Result<bool, StoreError> {
        let mut inv = self.catalog_restore.prepare_invoke();
        for part in [
            "plans", "clients", "keys", "users", "version", "changes", "settings", "index",
            "audit", "epoch",
        ] {
            inv.key(self.keys.catalog(part));
        }
        for key in staging {
            inv.key(key);
        }
        inv.key(self.keys.catalog("keyfilter"))
            .key(self.keys.catalog("keyfilter:meta"));
        inv.arg(seen.epoch.unwrap_or(""))
            .arg(seen.version)
            .arg(mirror.epoch.as_deref().unwrap_or(""))
            .arg(mirror.version)
            .arg(mirror.plans.len())
            .arg(mirror.clients.len())
            .arg(usize::from(mirror.safety.is_some()));
        let status: String = retrying!(self, |c| async { Ok(inv.invoke_async(c).await?) }.await)?;
        match status.as_str() {
            "restored" => Ok(true),
            "moved" => Ok(false),
            "incomplete" => Err(StoreError::Protocol(
                "catalog restore: the staged copy was not all there when committed (it \
                 expired, or the store lost it); nothing changed"
                    .into(),
            )),
            other => Err(StoreError::Protocol(format!("catalog restore: {other}"))),
        }
    }

    /// The catalog without its clients: epoch, version, plans, safety settings.
    async fn catalog_head_on(&self, c: &mut Conn<'_>) -> Result<CatalogDump, StoreError> {
        let (version, epoch, plans, safety): (
            Option<u64>,
            Option<String>,
            std::collections::HashMap<String, String>,
            Option<String>,
        ) = redis::pipe()
            .get(self.keys.catalog("version"))
            .get(self.keys.catalog("epoch"))
            .hgetall(self.keys.catalog("plans"))
            .hget(self.keys.catalog("settings"), SAFETY)
            .query_async(c)
            .await?;
        let mut plans: Vec<Versioned<PlanRecord>> = plans
            .into_iter()
            .filter_map(|(name, raw)| {
                let plan = parse_entity(&raw);
                if plan.is_none() {
                    tracing::warn!(plan = %name, "unreadable plan record skipped");
                }
                plan
            })
            .collect();
        plans.sort_by(|a, b| a.value.name.cmp(&b.value.name));
        Ok(CatalogDump {
            epoch,
            version: version.unwrap_or(0),
            plans,
            clients: Vec::new(),
            safety: safety.and_then(|r| parse_entity(&r)),
        })
    }

    async fn catalog_dump_on(&self, c: &mut Conn<'_>) -> Result<CatalogDump, StoreError> {
        // The version first: anything written during the scan is in the feed after it.
        let (version, epoch): (Option<u64>, Option<String>) = redis::pipe()
            .get(self.keys.catalog("version"))
            .get(self.keys.catalog("epoch"))
            .query_async(c)
            .await?;
        let mut dump = CatalogDump {
            epoch,
            version: version.unwrap_or(0),
            ..CatalogDump::default()
        };
        for (field, raw) in scan_hash(c, &self.keys.catalog("plans")).await? {
            match parse_entity::<PlanRecord>(&raw) {
                Some(p) => dump.plans.push(p),
                None => tracing::warn!(plan = %field, "unreadable plan record skipped"),
            }
        }
        for (field, raw) in scan_hash(c, &self.keys.catalog("clients")).await? {
            match parse_entity::<ClientRecord>(&raw) {
                Some(p) => dump.clients.push(p),
                None => tracing::warn!(client = %field, "unreadable client record skipped"),
            }
        }
        let safety: Option<String> = c.hget(self.keys.catalog("settings"), SAFETY).await?;
        dump.safety = safety.and_then(|r| parse_entity(&r));
        Ok(dump)
    }

    /// What changed after `since`; `None` when the feed cannot say (reload everything).
    async fn catalog_changes_on(
        &self,
        c: &mut Conn<'_>,
        since: u64,
        epoch: Option<&str>,
        wants: Wants<'_>,
    ) -> Result<Option<CatalogChanges>, StoreError> {
        let (version, stored_epoch, entries): (Option<u64>, Option<String>, Vec<FeedEntry>) =
            redis::pipe()
                .get(self.keys.catalog("version"))
                .get(self.keys.catalog("epoch"))
                .cmd("XRANGE")
                .arg(self.keys.catalog("changes"))
                .arg(format!("{}-0", since + 1))
                .arg("+")
                .arg("COUNT")
                .arg(FEED_PAGE)
                .query_async(c)
                .await?;
        let version = version.unwrap_or(0);
        // Another catalog (or one that lost its identity): versions cannot be compared.
        if stored_epoch.as_deref() != epoch {
            return Ok(None);
        }
        if version == since {
            return Ok(Some(CatalogChanges::Unchanged));
        }
        // A gap (trimmed feed, or a store that was reset) means the feed cannot be trusted
        // to say what changed: reload everything.
        let contiguous = entries
            .first()
            .is_some_and(|(id, _)| *id == format!("{}-0", since + 1));
        if version < since || !contiguous {
            return Ok(None);
        }
        let (last, mut changed) = Changed::in_feed(&entries)?;
        // The records wanted, and those of clients the feed names no keys for (a delete,
        // or an older gateway's write): their keys are read from the record.
        let mut keys = Vec::new();
        changed.clients.retain(|(id, hashes)| {
            let Ok(client) = ClientId::parse(id) else {
                return false;
            };
            match hashes {
                Some(hashes) if !wants.record_of(&client) => {
                    keys.push((client, hashes.clone()));
                    false
                }
                _ => true,
            }
        });
        let fetched: Vec<&String> = changed.clients.iter().map(|(id, _)| id).collect();
        let mut pipe = redis::pipe();
        pipe.cmd("HMGET")
            .arg(self.keys.catalog("plans"))
            .arg(&changed.plans)
            .arg("")
            .cmd("HMGET")
            .arg(self.keys.catalog("clients"))
            .arg(&fetched)
            .arg("")
            .hget(self.keys.catalog("settings"), SAFETY);
        let (plan_vals, client_vals, safety): (
            Vec<Option<String>>,
            Vec<Option<String>>,
            Option<String>,
        ) = pipe.query_async(c).await?;
        let plans = changed
            .plans
            .iter()
            .zip(plan_vals)
            .filter_map(|(id, raw)| {
                let name = PlanName::parse(id).ok()?;
                Some((name, raw.and_then(|r| parse_entity(&r))))
            })
            .collect();
        let mut clients = Vec::new();
        for (id, raw) in fetched.iter().zip(client_vals) {
            let Ok(id) = ClientId::parse(id) else {
                continue;
            };
            let rec = raw.and_then(|r| parse_entity::<ClientRecord>(&r));
            match &rec {
                // Not wanted, but read for its keys.
                Some(r) if !wants.record_of(&id) => {
                    keys.push((id, r.value.keys.iter().map(|k| k.hash).collect()));
                }
                _ => clients.push((id, rec)),
            }
        }
        Ok(Some(CatalogChanges::Delta {
            version: last,
            plans,
            clients,
            safety: changed
                .safety
                .then(|| safety.and_then(|r| parse_entity(&r))),
            keys,
            more: entries.len() == FEED_PAGE,
        }))
    }

    async fn entity<T: serde::de::DeserializeOwned>(
        &self,
        hash: &str,
        id: &str,
    ) -> Result<Option<Versioned<T>>, StoreError> {
        let raw: Option<String> = retrying!(self, |c| async {
            Ok(c.hget(self.keys.catalog(hash), id).await?)
        }
        .await)?;
        Ok(raw.and_then(|r| parse_entity(&r)))
    }
}

/// One write as `lua/catalog_apply_stage.lua` stages it: kind, op, id, the record's JSON,
/// the client's plan and its key hashes.
fn staged_write(w: &CatalogWrite) -> Result<String, StoreError> {
    let (op, plan, hashes): (&str, &str, Vec<String>) = match w {
        CatalogWrite::PutClient(c, _) => (
            "put",
            c.plan.as_str(),
            c.keys.iter().map(|k| k.hash.to_string()).collect(),
        ),
        CatalogWrite::PutPlan(..) | CatalogWrite::PutSafety(..) => ("put", "", vec![]),
        CatalogWrite::DeletePlan(..) | CatalogWrite::DeleteClient(..) => ("delete", "", vec![]),
    };
    let json = match w.json() {
        Some(j) => j,
        None if op == "delete" => String::new(),
        None => {
            return Err(StoreError::Protocol(format!(
                "catalog apply: {} {} is not JSON",
                w.kind(),
                w.id()
            )))
        }
    };
    serde_json::to_string(&(w.kind(), op, w.id(), json, plan, hashes))
        .map_err(|e| StoreError::Protocol(format!("catalog apply: {e}")))
}

/// Parses `"<rev> <json>"`.
fn parse_entity<T: serde::de::DeserializeOwned>(raw: &str) -> Option<Versioned<T>> {
    let (rev, json) = raw.split_once(' ')?;
    Some(Versioned {
        rev: rev.parse().ok()?,
        value: serde_json::from_str(json).ok()?,
    })
}

/// What a page of the change feed names: the plans and clients changed (each once, in id
/// order; a client with every key hash its entries name, `None` when one of them named
/// none) and whether the safety settings did.
struct Changed {
    plans: Vec<String>,
    clients: Vec<(String, Option<Vec<KeyHash>>)>,
    safety: bool,
}

impl Changed {
    /// The feed page's last version, and what its entries name.
    fn in_feed(entries: &[FeedEntry]) -> Result<(u64, Changed), StoreError> {
        let last = entries
            .last()
            .and_then(|(id, _)| id.split('-').next()?.parse::<u64>().ok())
            .ok_or_else(|| StoreError::Protocol("change feed id".into()))?;
        let mut plans = BTreeSet::new();
        let mut clients: BTreeMap<String, Option<Vec<KeyHash>>> = BTreeMap::new();
        let mut safety = false;
        for (_, fields) in entries {
            let get = |name: &str| {
                fields
                    .iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v.as_str())
            };
            match (get("kind"), get("id")) {
                (Some("plan"), Some(id)) => {
                    plans.insert(id.to_string());
                }
                (Some("client"), Some(id)) => {
                    let named = get("keys").map(|list| {
                        list.split(',')
                            .filter_map(|h| h.parse::<KeyHash>().ok())
                            .collect::<Vec<_>>()
                    });
                    let slot = clients.entry(id.to_string()).or_insert(Some(Vec::new()));
                    match (slot.as_mut(), named) {
                        (Some(all), Some(named)) => all.extend(named),
                        _ => *slot = None,
                    }
                }
                (Some("setting"), Some(SAFETY)) => safety = true,
                _ => tracing::warn!("unreadable change feed entry skipped"),
            }
        }
        let changed = Changed {
            plans: plans.into_iter().collect(),
            clients: clients.into_iter().collect(),
            safety,
        };
        Ok((last, changed))
    }
}

/// One record of a mirror, as a restore stages it.
enum Staged<'a> {
    Plan(&'a Versioned<PlanRecord>),
    Client(&'a Versioned<ClientRecord>),
    Safety(&'a Versioned<SafetyRecord>),
}

impl Staged<'_> {
    /// Adds this record's arguments (see `lua/catalog_restore_stage.lua`) to `inv`.
    fn add_to(&self, inv: &mut ScriptInvocation<'_>) -> Result<(), StoreError> {
        match self {
            Staged::Plan(p) => {
                inv.arg("plan").arg(p.value.name.as_str()).arg(stored(p)?);
            }
            Staged::Safety(s) => {
                inv.arg("setting").arg(SAFETY).arg(stored(s)?);
            }
            Staged::Client(c) => {
                inv.arg("client")
                    .arg(c.value.id.as_str())
                    .arg(stored(c)?)
                    .arg(c.value.plan.as_str())
                    .arg(c.value.keys.len());
                for k in &c.value.keys {
                    inv.arg(k.hash.to_string());
                }
            }
        }
        Ok(())
    }
}

/// The record as the catalog keeps it, `"<rev> <json>"` (see [`parse_entity`]).
fn stored<T: serde::Serialize>(record: &Versioned<T>) -> Result<String, StoreError> {
    let json = serde_json::to_string(&record.value)
        .map_err(|e| StoreError::Protocol(format!("catalog record: {e}")))?;
    Ok(format!("{} {json}", record.rev))
}

/// Every record of `mirror`, once, in chunks of at most [`RESTORE_CHUNK`]: plans, then
/// clients, then the safety settings. Records are borrowed, and serialised only as their
/// chunk is sent.
fn restore_chunks(mirror: &CatalogDump) -> impl Iterator<Item = Vec<Staged<'_>>> {
    let mut records = mirror
        .plans
        .iter()
        .map(Staged::Plan)
        .chain(mirror.clients.iter().map(Staged::Client))
        .chain(mirror.safety.iter().map(Staged::Safety));
    std::iter::from_fn(move || {
        let chunk: Vec<Staged<'_>> = records.by_ref().take(RESTORE_CHUNK).collect();
        (!chunk.is_empty()).then_some(chunk)
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use secrecy::SecretString;
    use serde_json::json;
    use tollgate_testkit::{RedisCluster, RedisServer};

    use super::*;
    use crate::store::Keys;

    /// A mirror at version 9000 of epoch `e1`: plan `gold`, `clients` clients on it with
    /// one key each, and the safety settings.
    fn mirror(clients: usize) -> CatalogDump {
        mirror_keyed(clients, |i| format!("sha256:{i:064x}"))
    }

    /// [`mirror`] with client i's key hash `hash(i)`.
    fn mirror_keyed(clients: usize, hash: impl Fn(usize) -> String) -> CatalogDump {
        serde_json::from_value(json!({
            "epoch": "e1",
            "version": 9000,
            "plans": [{"rev": 1, "value": {"name": "gold", "capacity": 10.0, "rate": 1.0}}],
            "clients": (0..clients).map(|i| json!({"rev": 2 + i, "value": {
                "id": format!("c{i}"), "plan": "gold",
                "keys": [{"key_id": format!("k{i}"), "hash": hash(i),
                    "created_at": 1}]}})).collect::<Vec<_>>(),
            "safety": {"rev": 3, "value": {"multiplier": 2.0}},
        }))
        .unwrap()
    }

    fn store(redis: &RedisServer) -> RedisStore {
        RedisStore::for_test(redis)
    }

    /// An empty store, as a gateway sees it after Redis restarted empty.
    const EMPTY: CatalogAt<'static> = CatalogAt {
        epoch: None,
        version: 0,
    };

    fn name(record: &Staged<'_>) -> String {
        match record {
            Staged::Plan(p) => format!("plan {}", p.value.name.as_str()),
            Staged::Client(c) => format!("client {}", c.value.id.as_str()),
            Staged::Safety(_) => "safety".into(),
        }
    }

    fn hlen(redis: &RedisServer, part: &str) -> usize {
        redis::cmd("HLEN")
            .arg(format!("tollgate:{{catalog}}:{part}"))
            .query(&mut redis.conn().unwrap())
            .unwrap()
    }

    #[test]
    fn a_mirror_is_staged_in_chunks_of_at_most_two_hundred_records_each_record_once() {
        // Arrange: one plan, 2,500 clients, the safety settings: 2,502 records.
        let mirror = mirror(2500);

        // Act.
        let chunks: Vec<Vec<Staged<'_>>> = restore_chunks(&mirror).collect();

        // Assert.
        let sizes: Vec<usize> = chunks.iter().map(Vec::len).collect();
        assert_eq!(sizes[..12], [200; 12]);
        assert_eq!(sizes[12..], [102]);
        let sent: Vec<String> = chunks.iter().flatten().map(name).collect();
        let mut once = sent.clone();
        once.sort();
        once.dedup();
        assert_eq!(once.len(), sent.len(), "a record sent twice");
        assert_eq!(sent.len(), 2502, "a record left out");
        assert_eq!(sent[0], "plan gold");
        assert_eq!(sent[2501], "safety");
    }

    #[test]
    fn an_empty_mirror_stages_nothing() {
        let mirror = CatalogDump::default();
        assert_eq!(restore_chunks(&mirror).count(), 0);
    }

    #[tokio::test]
    async fn a_chunk_staged_twice_counts_each_client_on_its_plan_once() {
        // Arrange.
        let redis = RedisServer::start().unwrap();
        let store = store(&redis);
        let mirror = mirror(10);
        let staging = store.restore_staging("r1");
        let chunk = restore_chunks(&mirror).next().unwrap();

        // Act: the chunk resent, as after a reply lost with its connection.
        store.stage_restore(&staging, &chunk).await.unwrap();
        store.stage_restore(&staging, &chunk).await.unwrap();
        let restored = store.commit_restore(&staging, EMPTY, &mirror).await;

        // Assert.
        assert!(restored.unwrap());
        let on_gold: u64 = redis::cmd("HGET")
            .arg("tollgate:{catalog}:users")
            .arg("gold")
            .query(&mut redis.conn().unwrap())
            .unwrap();
        assert_eq!(on_gold, 10);
        assert_eq!(hlen(&redis, "keys"), 10);
    }

    #[tokio::test]
    async fn a_commit_missing_a_staged_chunk_is_refused_and_changes_nothing() {
        // Arrange: a mirror of two chunks, of which only the first was staged (the second
        // lost, say, when its staging expired).
        let redis = RedisServer::start().unwrap();
        let store = store(&redis);
        let mirror = mirror(1500);
        let staging = store.restore_staging("r1");
        let first = restore_chunks(&mirror).next().unwrap();
        store.stage_restore(&staging, &first).await.unwrap();

        // Act.
        let committed = store.commit_restore(&staging, EMPTY, &mirror).await;

        // Assert: an error, the store as it was, and the staging gone.
        assert!(committed.is_err(), "{committed:?}");
        assert_eq!(hlen(&redis, "clients"), 0);
        assert!(redis.keys("*").unwrap().is_empty(), "{:?}", redis.keys("*"));
    }

    #[tokio::test]
    async fn a_commit_after_the_store_moved_writes_nothing_and_drops_its_staging() {
        // Arrange: a whole mirror staged; then the store is written.
        let redis = RedisServer::start().unwrap();
        let store = store(&redis);
        let mirror = mirror(5);
        let staging = store.restore_staging("r1");
        for chunk in restore_chunks(&mirror) {
            store.stage_restore(&staging, &chunk).await.unwrap();
        }
        let _: () = redis::cmd("SET")
            .arg("tollgate:{catalog}:version")
            .arg(1)
            .query(&mut redis.conn().unwrap())
            .unwrap();

        // Act.
        let restored = store.commit_restore(&staging, EMPTY, &mirror).await;

        // Assert.
        assert!(!restored.unwrap());
        assert_eq!(hlen(&redis, "clients"), 0);
        assert_eq!(
            redis.keys("*").unwrap(),
            ["tollgate:{catalog}:version"],
            "staging left"
        );
    }

    #[tokio::test]
    async fn a_commit_resent_after_it_ran_finds_the_store_moved_and_changes_nothing() {
        // Arrange: a restore that ran.
        let redis = RedisServer::start().unwrap();
        let store = store(&redis);
        let mirror = mirror(5);
        let staging = store.restore_staging("r1");
        for chunk in restore_chunks(&mirror) {
            store.stage_restore(&staging, &chunk).await.unwrap();
        }
        assert!(store
            .commit_restore(&staging, EMPTY, &mirror)
            .await
            .unwrap());

        // Act: its commit again, as after a reply lost with its connection.
        let again = store.commit_restore(&staging, EMPTY, &mirror).await;

        // Assert: moved; the restored catalog kept, kept for good, audited once.
        assert!(!again.unwrap());
        assert_eq!(hlen(&redis, "clients"), 5);
        assert_eq!(hlen(&redis, "plans"), 1);
        assert_eq!(hlen(&redis, "settings"), 1);
        let mut c = redis.conn().unwrap();
        for part in ["plans", "clients", "keys", "users", "index", "settings"] {
            let ttl: i64 = redis::cmd("TTL")
                .arg(format!("tollgate:{{catalog}}:{part}"))
                .query(&mut c)
                .unwrap();
            assert_eq!(ttl, -1, "{part} would expire");
        }
        let audited: usize = redis::cmd("XLEN")
            .arg("tollgate:{catalog}:audit")
            .query(&mut c)
            .unwrap();
        assert_eq!(audited, 1);
        assert!(redis.keys("*restore:*").unwrap().is_empty());
    }

    /// Every record of `dump` put, as an apply over an empty catalog writes them.
    fn puts(dump: &CatalogDump) -> Vec<CatalogWrite> {
        let mut w: Vec<CatalogWrite> = dump
            .plans
            .iter()
            .map(|p| CatalogWrite::PutPlan(p.value.clone(), Condition::Any))
            .collect();
        w.extend(
            dump.clients
                .iter()
                .map(|c| CatalogWrite::PutClient(c.value.clone(), Condition::Any)),
        );
        w
    }

    /// The catalog an apply of [`puts`] over an empty one gives: the n-th record (plans,
    /// then clients) at version n.
    fn applied(dump: &CatalogDump) -> CatalogDump {
        let mut n = 0;
        let mut next = || {
            n += 1;
            n
        };
        let plans = dump
            .plans
            .iter()
            .map(|p| Versioned {
                rev: next(),
                ..p.clone()
            })
            .collect();
        let clients = dump
            .clients
            .iter()
            .map(|c| Versioned {
                rev: next(),
                ..c.clone()
            })
            .collect();
        CatalogDump {
            epoch: None,
            version: n,
            plans,
            clients,
            safety: None,
        }
    }

    fn applying<'a>(
        at: u64,
        writes: &'a [CatalogWrite],
        whole: &'a CatalogDump,
        audit: &'a Audit,
    ) -> CatalogApply<'a> {
        CatalogApply {
            at_epoch: None,
            at_version: at,
            writes,
            whole,
            audit,
            summary: json!({"n": writes.len()}),
        }
    }

    /// Applies every record of `source` over an empty catalog on `store`.
    async fn apply_all(store: &RedisStore, source: &CatalogDump) -> ApplyOutcome {
        let audit = Audit::new("ops", "catalog.apply");
        let (writes, whole) = (puts(source), applied(source));
        store
            .apply(&applying(0, &writes, &whole, &audit))
            .await
            .unwrap()
    }

    fn feed_len(redis: &RedisServer) -> usize {
        redis::cmd("XLEN")
            .arg("tollgate:{catalog}:changes")
            .query(&mut redis.conn().unwrap())
            .unwrap()
    }

    #[tokio::test]
    async fn a_few_writes_are_made_one_by_one_each_a_version_with_its_feed_entry() {
        // Arrange: one plan and 60 clients: 61 writes, under DELTA_MAX.
        let redis = RedisServer::start().unwrap();
        let store = store(&redis);

        // Act.
        let done = apply_all(&store, &mirror(60)).await;

        // Assert: at version 61, one feed entry and revision per write, every key
        // linked, one audit entry, no staging left; a gateway follows the feed.
        assert_eq!(done, ApplyOutcome::Applied { version: 61 });
        assert_eq!(hlen(&redis, "clients"), 60);
        assert_eq!(hlen(&redis, "keys"), 60);
        assert_eq!(feed_len(&redis), 61);
        assert_eq!(store.client("c59").await.unwrap().unwrap().rev, 61);
        assert_eq!(audited_entries(&redis), 1);
        assert!(redis
            .keys("*apply:*")
            .unwrap()
            .iter()
            .all(|k| k.ends_with(":reply")));
        let epoch = store.dump().await.unwrap().epoch;
        assert!(epoch.is_some(), "an apply gives the catalog an identity");
        let changes = store
            .changes(0, epoch.as_deref(), Wants::Whole)
            .await
            .unwrap();
        assert!(matches!(changes, CatalogChanges::Delta { version: 61, .. }));
    }

    #[tokio::test]
    async fn many_writes_put_the_whole_catalog_staged_in_chunks_in_place_at_their_versions() {
        // Arrange: one plan and 2,500 clients: thirteen chunks staged.
        let redis = RedisServer::start().unwrap();
        let store = store(&redis);

        // Act.
        let done = apply_all(&store, &mirror(2500)).await;

        // Assert: at version 2,501, each record at the version its write would have
        // (so ETags are the same either way), every key linked and counted on its plan,
        // one audit entry, no staging left; the feed dropped, so a gateway reloads.
        assert_eq!(done, ApplyOutcome::Applied { version: 2501 });
        assert_eq!(hlen(&redis, "clients"), 2500);
        assert_eq!(hlen(&redis, "keys"), 2500);
        assert_eq!(store.client("c2499").await.unwrap().unwrap().rev, 2501);
        assert_eq!(store.plan("gold").await.unwrap().unwrap().rev, 1);
        let users: u64 = redis::cmd("HGET")
            .arg("tollgate:{catalog}:users")
            .arg("gold")
            .query(&mut redis.conn().unwrap())
            .unwrap();
        assert_eq!(users, 2500);
        assert_eq!(audited_entries(&redis), 1);
        assert_eq!(feed_len(&redis), 0);
        assert!(redis
            .keys("*apply:*")
            .unwrap()
            .iter()
            .all(|k| k.ends_with(":reply")));
        let epoch = store.dump().await.unwrap().epoch;
        let changes = store
            .changes(0, epoch.as_deref(), Wants::Whole)
            .await
            .unwrap();
        assert!(matches!(changes, CatalogChanges::Reload(d) if d.clients.len() == 2500));
    }

    fn audited_entries(redis: &RedisServer) -> usize {
        redis::cmd("XLEN")
            .arg("tollgate:{catalog}:audit")
            .query(&mut redis.conn().unwrap())
            .unwrap()
    }

    #[tokio::test]
    async fn an_apply_over_a_catalog_that_moved_or_was_lost_writes_nothing_either_way() {
        for clients in [2, 200] {
            // Arrange: one apply made.
            let redis = RedisServer::start().unwrap();
            let store = store(&redis);
            let source = mirror(clients);
            let first = apply_all(&store, &source).await;
            let version = clients as u64 + 1;
            assert_eq!(first, ApplyOutcome::Applied { version });
            let epoch = store.dump().await.unwrap().epoch;
            let (writes, whole) = (puts(&source), applied(&source));
            let audit = Audit::new("ops", "catalog.apply");

            // Act: the same apply computed at version 0 of this catalog, and at the
            // version it is at of no catalog (one whose store lost it).
            let moved = store
                .apply(&CatalogApply {
                    at_epoch: epoch.as_deref(),
                    ..applying(0, &writes, &whole, &audit)
                })
                .await
                .unwrap();
            let other = store
                .apply(&applying(version, &writes, &whole, &audit))
                .await
                .unwrap();

            // Assert: refused with where the catalog is; nothing written, no staging.
            assert_eq!(moved, ApplyOutcome::Moved { version }, "{clients}");
            assert_eq!(other, ApplyOutcome::Moved { version }, "{clients}");
            assert_eq!(store_version(&redis), version);
            assert_eq!(audited_entries(&redis), 1);
            assert!(redis
                .keys("*apply:*")
                .unwrap()
                .iter()
                .all(|k| k.ends_with(":reply")));
        }
    }

    #[tokio::test]
    async fn a_key_moving_between_two_clients_of_an_apply_is_linked_to_its_new_owner() {
        // Arrange: c0 and c1 with a key each; then c1 takes c0's key and c0 gets a new one.
        let redis = RedisServer::start().unwrap();
        let store = store(&redis);
        let before = mirror(2);
        apply_all(&store, &before).await;
        let mut c0 = before.clients[0].value.clone();
        let mut c1 = before.clients[1].value.clone();
        c1.keys = c0.keys.clone();
        c0.keys = vec![crate::store::records::KeyRecord::new(
            format!("sha256:{:064x}", 77).parse().unwrap(),
        )];
        // c1 first: a naive order would link the key to c1, then drop it with c0's old keys.
        let writes = [
            CatalogWrite::PutClient(c1.clone(), Condition::Any),
            CatalogWrite::PutClient(c0.clone(), Condition::Any),
        ];
        let mut whole = applied(&before);
        whole.clients[1] = Versioned { rev: 4, value: c1 };
        whole.clients[0] = Versioned { rev: 5, value: c0 };
        whole.version = 5;
        let epoch = store.dump().await.unwrap().epoch;
        let audit = Audit::new("ops", "catalog.apply");
        let apply = CatalogApply {
            at_epoch: epoch.as_deref(),
            ..applying(3, &writes, &whole, &audit)
        };

        // Act.
        let done = store.apply(&apply).await.unwrap();

        // Assert.
        assert_eq!(done, ApplyOutcome::Applied { version: 5 });
        let owner = |i: u64| {
            let hash: KeyHash = format!("sha256:{i:064x}").parse().unwrap();
            let store = &store;
            async move {
                store
                    .client_by_key(&hash, Duration::from_millis(100))
                    .await
                    .unwrap()
                    .client
                    .map(|c| c.value.id.to_string())
            }
        };
        assert_eq!(owner(0).await.as_deref(), Some("c1"));
        assert_eq!(owner(77).await.as_deref(), Some("c0"));
        assert_eq!(owner(1).await, None);
    }

    #[tokio::test]
    async fn an_applys_keys_are_in_the_key_filter_either_way() {
        for clients in [3, 150] {
            // Arrange: a key filter built over an empty catalog.
            let redis = RedisServer::start().unwrap();
            let store = store(&redis);
            while !matches!(
                store.key_filter_step(1 << 16, 1000).await.unwrap(),
                KeyFilterStep::Complete(_)
            ) {}
            let source = mirror(clients);

            // Act.
            apply_all(&store, &source).await;

            // Assert: every key's seven bits are set.
            let head = store.key_filter_head().await.unwrap().unwrap();
            let bytes = store
                .key_filter_bytes(0, head.bits.div_ceil(8))
                .await
                .unwrap();
            for c in &source.clients {
                let hash = c.value.keys[0].hash.to_string();
                for i in 0..7 {
                    let word = u64::from_str_radix(&hash[7 + 8 * i..15 + 8 * i], 16).unwrap();
                    let bit = word % head.bits;
                    let set = bytes[(bit / 8) as usize] & (0x80 >> (bit % 8)) != 0;
                    assert!(set, "{clients}: {hash}: bit {bit}");
                }
            }
        }
    }

    fn store_version(redis: &RedisServer) -> u64 {
        redis::cmd("GET")
            .arg("tollgate:{catalog}:version")
            .query(&mut redis.conn().unwrap())
            .unwrap()
    }

    #[tokio::test]
    async fn on_a_cluster_an_apply_stages_and_commits_in_the_catalogs_slot() {
        let cluster = RedisCluster::start().unwrap();
        let urls: Vec<SecretString> = cluster.urls().into_iter().map(SecretString::from).collect();
        let store =
            RedisStore::connect_cluster(&urls, Duration::from_secs(5), Keys::new("tollgate:"))
                .unwrap();
        // Many writes (the whole catalog staged and swapped in), then a few (one by one).
        let done = apply_all(&store, &mirror(1500)).await;
        let epoch = store.dump().await.unwrap().epoch;
        let extra = mirror(1);
        let writes = [CatalogWrite::PutPlan(
            PlanRecord {
                description: Some("more".into()),
                ..extra.plans[0].value.clone()
            },
            Condition::Any,
        )];
        let mut whole = store.dump().await.unwrap();
        whole.plans[0].rev = 1502;
        whole.version = 1502;
        let audit = Audit::new("ops", "catalog.apply");
        let few = store
            .apply(&CatalogApply {
                at_epoch: epoch.as_deref(),
                ..applying(1501, &writes, &whole, &audit)
            })
            .await;

        assert_eq!(done, ApplyOutcome::Applied { version: 1501 });
        assert_eq!(few.unwrap(), ApplyOutcome::Applied { version: 1502 });
        let node = &cluster.nodes[cluster.owner("tollgate:{catalog}:clients").unwrap()];
        assert_eq!(hlen(node, "clients"), 1500);
        assert!(node
            .keys("*apply:*")
            .unwrap()
            .iter()
            .all(|k| k.ends_with(":reply")));
    }

    #[tokio::test]
    async fn on_a_cluster_a_restore_stages_and_commits_in_the_catalogs_slot() {
        // Arrange: three masters; the catalog's slot is on one of them.
        let cluster = RedisCluster::start().unwrap();
        let urls: Vec<SecretString> = cluster.urls().into_iter().map(SecretString::from).collect();
        let store =
            RedisStore::connect_cluster(&urls, Duration::from_secs(5), Keys::new("tollgate:"))
                .unwrap();
        let mirror = mirror(1500);

        // Act: two chunks staged, then the commit (all of them scripts whose keys share
        // the {catalog} tag: one slot, no CROSSSLOT).
        let restored = store.restore(EMPTY, &mirror).await;

        // Assert.
        assert!(restored.unwrap());
        let node = &cluster.nodes[cluster.owner("tollgate:{catalog}:clients").unwrap()];
        assert_eq!(hlen(node, "clients"), 1500);
        assert!(node.keys("*restore:*").unwrap().is_empty());
    }
    /// The last command each of `node`'s request-path connections ran.
    fn workers_last_commands(node: &RedisServer) -> Vec<String> {
        node.last_commands_of(tollgate_engine::pool::LINK_NAME)
            .unwrap()
    }

    /// Looks `c0`'s key up on `store` with its worker's connections kept (as a gateway's
    /// worker does) until `ran_on_link` says the lookup ran where it should; the lookup's
    /// answer.
    async fn look_up_with_links_kept(
        store: Arc<RedisStore>,
        ran_on_link: impl Fn() -> bool,
    ) -> Option<ClientId> {
        use tollgate_engine::Buckets;
        let hash: KeyHash = format!("sha256:{:064x}", 0).parse().unwrap();
        tokio::task::LocalSet::new()
            .run_until(async {
                let s = Arc::clone(&store);
                tokio::task::spawn_local(async move { s.buckets.keep_connected().await });
                let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
                loop {
                    let found = store
                        .client_by_key(&hash, Duration::from_secs(1))
                        .await
                        .unwrap();
                    if ran_on_link() || tokio::time::Instant::now() > deadline {
                        return found.client.map(|c| c.value.id);
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
            .await
    }

    #[tokio::test]
    async fn a_keys_lookup_runs_on_the_workers_own_connection() {
        // Arrange
        let redis = RedisServer::start().unwrap();
        let store = Arc::new(store(&redis));
        assert!(store.restore(EMPTY, &mirror(1)).await.unwrap());

        // Act
        let found = look_up_with_links_kept(Arc::clone(&store), || {
            workers_last_commands(&redis) == ["evalsha"]
        })
        .await;

        // Assert: found, and read on the worker's connection (the pool's are idle beside
        // it), not on a pooled one.
        assert_eq!(found.map(|c| c.to_string()).as_deref(), Some("c0"));
        assert_eq!(workers_last_commands(&redis), ["evalsha"]);
    }

    #[tokio::test]
    async fn on_a_cluster_a_keys_lookup_runs_on_the_workers_own_connection_to_the_catalogs_master()
    {
        // Arrange: three masters, the catalog on one of them.
        let cluster = RedisCluster::start().unwrap();
        let urls: Vec<SecretString> = cluster.urls().into_iter().map(SecretString::from).collect();
        let store = Arc::new(
            RedisStore::connect_cluster(&urls, Duration::from_secs(5), Keys::new("tollgate:"))
                .unwrap(),
        );
        assert!(store.restore(EMPTY, &mirror(1)).await.unwrap());
        let home = cluster.owner("tollgate:{catalog}:keys").unwrap();

        // Act: looked up until the slot map is read and the worker's links are open.
        let found = look_up_with_links_kept(Arc::clone(&store), || {
            workers_last_commands(&cluster.nodes[home]) == ["evalsha"]
        })
        .await;

        // Assert: a link to every master, and the lookup on the catalog's master's.
        assert_eq!(found.map(|c| c.to_string()).as_deref(), Some("c0"));
        for (i, node) in cluster.nodes.iter().enumerate() {
            let last = workers_last_commands(node);
            assert_eq!(last.len(), 1, "node {i}: {last:?}");
            assert_eq!(last[0] == "evalsha", i == home, "node {i}: {last:?}");
        }
    }
    /// The store's key filter built to the end; its head.
    async fn built_filter(store: &RedisStore, bits: u64) -> KeyFilterHead {
        loop {
            match store.key_filter_step(bits, 400).await.unwrap() {
                KeyFilterStep::Complete(head) => return head,
                KeyFilterStep::Building(n) => assert!(n <= 1000, "{n} keys in one step"),
            }
        }
    }

    /// A gateway's copy of the store's filter, as its catalog makes it.
    async fn copied_filter(
        store: &RedisStore,
        head: &KeyFilterHead,
    ) -> crate::catalog::key_filter::KeyFilter {
        let filter = crate::catalog::key_filter::KeyFilter::default();
        let bits = filter.begin(head.bits, head.id.clone());
        for offset in (0..bits.len()).step_by(1000) {
            let bytes = store.key_filter_bytes(offset as u64, 1000).await.unwrap();
            bits.or_at(offset, &bytes);
        }
        assert!(filter.trust(&bits));
        filter
    }

    /// A key's hash as a real key's is: uniform (SHA-256 of something).
    fn key_hash(i: usize) -> KeyHash {
        KeyHash::of(&format!("key-{i}"))
    }

    #[tokio::test]
    async fn the_key_filter_holds_every_key_built_or_written_since_and_a_restore_drops_it() {
        // Arrange: 1500 clients, no filter; then one built over them (in steps).
        let redis = RedisServer::start().unwrap();
        let store = store(&redis);
        let keyed = mirror_keyed(1500, |i| key_hash(i).to_string());
        assert!(store.restore(EMPTY, &keyed).await.unwrap());
        assert_eq!(store.key_filter_head().await.unwrap(), None);
        let head = built_filter(&store, 1 << 16).await;

        // Act: a client with a new key written through the write script, and a chunk
        // imported, after the build.
        let written: ClientRecord = serde_json::from_value(json!({
            "id": "late", "plan": "gold",
            "keys": [{"key_id": "kl", "hash": key_hash(90_001).to_string(), "created_at": 1}],
        }))
        .unwrap();
        let outcome = store
            .write(
                &CatalogWrite::PutClient(written, Condition::Absent),
                &Audit::new("t", "client.put"),
            )
            .await
            .unwrap();
        assert!(
            matches!(outcome, WriteOutcome::Written { .. }),
            "{outcome:?}"
        );
        let imported: ClientRecord = serde_json::from_value(json!({
            "id": "bulk", "plan": "gold",
            "keys": [{"key_id": "kb", "hash": key_hash(90_002).to_string(), "created_at": 1}],
        }))
        .unwrap();
        let chunk = ImportChunk {
            import: "i1",
            chunk: 0,
            last: true,
            in_file: 1,
            clients: std::slice::from_ref(&imported),
            actor: "t",
        };
        assert!(matches!(
            store.import(&chunk).await.unwrap(),
            ImportOutcome::Written { .. }
        ));

        // Assert: the store says it holds every key, and a copy of it has every one, the
        // Lua's bits and the gateway's the same; keys never given mostly not.
        assert_eq!(store.key_filter_head().await.unwrap(), Some(head.clone()));
        let filter = copied_filter(&store, &head).await;
        for i in (0..1500).chain([90_001, 90_002]) {
            assert!(filter.may_have(&key_hash(i)), "key {i}");
        }
        let absent = (100_000..101_000)
            .filter(|i| !filter.may_have(&key_hash(*i)))
            .count();
        assert!(
            absent > 950,
            "{absent} of 1000 keys never given said absent"
        );

        // A restore writes the keys whole: the filter goes with the old ones.
        let now = store.dump().await.unwrap();
        let at = CatalogAt {
            epoch: now.epoch.as_deref(),
            version: now.version,
        };
        let mut newer = mirror(10);
        newer.version = now.version + 1;
        assert!(store.restore(at, &newer).await.unwrap());
        assert_eq!(store.key_filter_head().await.unwrap(), None);
    }
}
