//! The catalog in Redis: whole dumps, the change feed gateways poll instead of reloading,
//! scripted writes (`lua/catalog_write.lua`) and restores (`lua/catalog_restore.lua`), and
//! reads of single records and pages.

use std::collections::{BTreeMap, BTreeSet};

use async_trait::async_trait;
use redis::{AsyncCommands, Value};

use super::backend::{retrying, scan_hash, Conn, FeedEntry, RedisStore};
use crate::domain::{ClientId, KeyHash, PlanName};
use crate::store::records::{
    Audit, CatalogChanges, CatalogDump, CatalogWrite, ClientRecord, ClientsPage, Condition,
    ImportChunk, ImportOutcome, ImportProgress, KeyLookup, PlanRecord, SafetyRecord, Versioned,
    Wants, WriteOutcome, SAFETY,
};
use crate::store::{CatalogAt, CatalogRecords, StoreError};

/// How many change-feed entries one poll reads.
const FEED_PAGE: usize = 1000;

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
        inv.key(self.keys.catalog(&format!("import:{}", chunk.import)));
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
        .key(self.keys.catalog("epoch"));
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

    /// Puts `mirror` in place of the store's catalog if the store is still at `seen`
    /// (`lua/catalog_restore.lua`). Retried on a fresh connection like any write: a resend
    /// after a lost reply finds the store moved (to the mirror) and writes nothing.
    async fn restore(&self, seen: CatalogAt<'_>, mirror: &CatalogDump) -> Result<bool, StoreError> {
        let record = |kind: &str, id: &str, rev: u64, json: Option<String>| {
            json.map(|json| serde_json::json!({"kind": kind, "id": id, "rev": rev, "json": json}))
        };
        let mut records = Vec::new();
        for p in &mirror.plans {
            records.extend(record(
                "plan",
                p.value.name.as_str(),
                p.rev,
                serde_json::to_string(&p.value).ok(),
            ));
        }
        for c in &mirror.clients {
            if let Some(mut r) = record(
                "client",
                c.value.id.as_str(),
                c.rev,
                serde_json::to_string(&c.value).ok(),
            ) {
                r["plan"] = c.value.plan.as_str().into();
                r["hashes"] = c
                    .value
                    .keys
                    .iter()
                    .map(|k| serde_json::Value::from(k.hash.to_string()))
                    .collect();
                records.push(r);
            }
        }
        if let Some(s) = &mirror.safety {
            records.extend(record(
                "setting",
                SAFETY,
                s.rev,
                serde_json::to_string(&s.value).ok(),
            ));
        }
        let mut inv = self.catalog_restore.prepare_invoke();
        for part in [
            "plans", "clients", "keys", "users", "version", "changes", "settings", "index",
            "audit", "epoch",
        ] {
            inv.key(self.keys.catalog(part));
        }
        inv.arg(seen.epoch.unwrap_or(""))
            .arg(seen.version)
            .arg(mirror.epoch.as_deref().unwrap_or(""))
            .arg(mirror.version)
            .arg(serde_json::Value::Array(records).to_string());
        let status: String = retrying!(self, |c| async { Ok(inv.invoke_async(c).await?) }.await)?;
        Ok(status == "restored")
    }

    async fn plan(&self, name: &str) -> Result<Option<Versioned<PlanRecord>>, StoreError> {
        self.entity("plans", name).await
    }

    async fn client(&self, id: &str) -> Result<Option<Versioned<ClientRecord>>, StoreError> {
        self.entity("clients", id).await
    }

    async fn client_by_key(&self, hash: &KeyHash) -> Result<KeyLookup, StoreError> {
        let mut inv = self.client_by_key.prepare_invoke();
        inv.key(self.keys.catalog("keys"))
            .key(self.keys.catalog("clients"))
            .key(self.keys.catalog("version"))
            .key(self.keys.catalog("epoch"))
            .arg(hash.to_string());
        let (version, epoch, raw): (Option<u64>, Option<String>, Option<String>) =
            retrying!(self, |c| async { Ok(inv.invoke_async(c).await?) }.await)?;
        Ok(KeyLookup {
            epoch,
            version: version.unwrap_or(0),
            client: raw.and_then(|r| parse_entity(&r)),
        })
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
