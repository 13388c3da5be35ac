//! The Redis side of the store: one `EVALSHA` per decision, a scripted catalog write, and
//! a change feed that gateways poll instead of reloading the catalog.

use std::collections::BTreeSet;
use std::time::Duration;

use bb8_redis::RedisConnectionManager;
use redis::{AsyncCommands, Script, Value};
use secrecy::{ExposeSecret, SecretString};

use super::{Keys, StoreError};
use crate::catalog::{
    CatalogChanges, CatalogDump, CatalogWrite, ClientRecord, Condition, PlanRecord, Versioned,
    WriteOutcome,
};
use crate::configuration::redact_url;
use crate::domain::{ClientId, Plan, PlanName};
use crate::limiter::{BucketState, Verdict};

/// One change-feed entry: its id and fields.
type FeedEntry = (String, Vec<(String, String)>);

/// How many change-feed entries one poll reads.
const FEED_PAGE: usize = 1000;

/// A Redis server reached through a bb8 pool of multiplexed connections.
pub struct RedisStore {
    pool: bb8::Pool<RedisConnectionManager>,
    keys: Keys,
    bucket: Script,
    catalog_write: Script,
    url: String,
}

impl RedisStore {
    /// Builds the pool without connecting: a gateway starts (and fails open) while Redis
    /// is down, and connects once it answers.
    pub fn connect(
        url: &SecretString,
        pool_size: u32,
        keys: Keys,
    ) -> Result<RedisStore, StoreError> {
        let manager = RedisConnectionManager::new(url.expose_secret())?;
        let pool = bb8::Pool::builder()
            .max_size(pool_size)
            .min_idle(Some(pool_size))
            .connection_timeout(Duration::from_secs(2))
            .retry_connection(false)
            .test_on_check_out(false)
            .build_unchecked(manager);
        Ok(RedisStore {
            pool,
            keys,
            bucket: Script::new(include_str!("../../lua/bucket.lua")),
            catalog_write: Script::new(include_str!("../../lua/catalog_write.lua")),
            url: redact_url(url.expose_secret()),
        })
    }

    pub fn describe(&self) -> String {
        format!("redis {}", self.url)
    }

    async fn conn(&self) -> Result<bb8::PooledConnection<'_, RedisConnectionManager>, StoreError> {
        self.pool.get().await.map_err(|e| match e {
            bb8::RunError::User(e) => StoreError::Redis(e),
            bb8::RunError::TimedOut => {
                StoreError::Pool("timed out waiting for a connection".into())
            }
        })
    }

    /// `SCRIPT LOAD`s both scripts, so the first requests already hit `EVALSHA`.
    pub async fn load_scripts(&self) -> Result<(), StoreError> {
        let mut c = self.conn().await?;
        self.bucket.load_async(&mut *c).await?;
        self.catalog_write.load_async(&mut *c).await?;
        Ok(())
    }

    pub async fn take(&self, key: &str, plan: Plan, cost: f64) -> Result<Verdict, StoreError> {
        let mut c = self.conn().await?;
        // `invoke_async` sends EVALSHA and, on NOSCRIPT (a restarted or flushed Redis),
        // loads the script and retries once.
        let (allowed, tokens, wait): (i64, String, i64) = self
            .bucket
            .key(key)
            .arg(plan.capacity())
            .arg(plan.rate())
            .arg(cost)
            .invoke_async(&mut *c)
            .await?;
        let tokens = tokens
            .parse::<f64>()
            .map_err(|_| StoreError::Protocol(format!("tokens {tokens:?}")))?;
        Ok(Verdict {
            allowed: allowed == 1,
            tokens,
            wait_us: u64::try_from(wait).ok(),
        })
    }

    pub async fn peek(&self, key: &str) -> Result<Option<BucketState>, StoreError> {
        let mut c = self.conn().await?;
        let (tk, ts): (Option<String>, Option<String>) = redis::cmd("HMGET")
            .arg(key)
            .arg("tk")
            .arg("ts")
            .query_async(&mut *c)
            .await?;
        Ok(match (tk, ts) {
            (Some(tk), Some(ts)) => Some(BucketState {
                tokens: tk.parse().unwrap_or(0.0),
                ts_us: ts.parse().unwrap_or(0),
            }),
            _ => None,
        })
    }

    pub async fn refill(&self, key: &str) -> Result<(), StoreError> {
        let mut c = self.conn().await?;
        let _: i64 = c.del(key).await?;
        Ok(())
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        let mut c = self.conn().await?;
        let _: String = redis::cmd("PING").query_async(&mut *c).await?;
        Ok(())
    }

    pub async fn catalog_dump(&self) -> Result<CatalogDump, StoreError> {
        let mut c = self.conn().await?;
        // The version first: anything written during the scan is in the feed after it.
        let version: Option<u64> = c.get(self.keys.catalog("version")).await?;
        let mut dump = CatalogDump {
            version: version.unwrap_or(0),
            ..CatalogDump::default()
        };
        for (field, raw) in scan_hash(&mut c, &self.keys.catalog("plans")).await? {
            match parse_entity::<PlanRecord>(&raw) {
                Some(p) => dump.plans.push(p),
                None => tracing::warn!(plan = %field, "unreadable plan record skipped"),
            }
        }
        for (field, raw) in scan_hash(&mut c, &self.keys.catalog("clients")).await? {
            match parse_entity::<ClientRecord>(&raw) {
                Some(p) => dump.clients.push(p),
                None => tracing::warn!(client = %field, "unreadable client record skipped"),
            }
        }
        Ok(dump)
    }

    pub async fn catalog_changes(&self, since: u64) -> Result<CatalogChanges, StoreError> {
        let mut c = self.conn().await?;
        let (version, entries): (Option<u64>, Vec<FeedEntry>) = redis::pipe()
            .get(self.keys.catalog("version"))
            .cmd("XRANGE")
            .arg(self.keys.catalog("changes"))
            .arg(format!("{}-0", since + 1))
            .arg("+")
            .arg("COUNT")
            .arg(FEED_PAGE)
            .query_async(&mut *c)
            .await?;
        let version = version.unwrap_or(0);
        if version == since {
            return Ok(CatalogChanges::Unchanged);
        }
        // A gap (trimmed feed, or a store that was reset) means the feed cannot be trusted
        // to say what changed: reload everything.
        let contiguous = entries
            .first()
            .is_some_and(|(id, _)| *id == format!("{}-0", since + 1));
        if version < since || !contiguous {
            drop(c);
            return Ok(CatalogChanges::Reload(self.catalog_dump().await?));
        }
        let last = entries
            .last()
            .and_then(|(id, _)| id.split('-').next()?.parse::<u64>().ok())
            .ok_or_else(|| StoreError::Protocol("change feed id".into()))?;
        let mut plan_ids = BTreeSet::new();
        let mut client_ids = BTreeSet::new();
        for (_, fields) in &entries {
            let get = |name: &str| {
                fields
                    .iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v.as_str())
            };
            match (get("kind"), get("id")) {
                (Some("plan"), Some(id)) => {
                    plan_ids.insert(id.to_string());
                }
                (Some("client"), Some(id)) => {
                    client_ids.insert(id.to_string());
                }
                _ => tracing::warn!("unreadable change feed entry skipped"),
            }
        }
        let plan_ids: Vec<String> = plan_ids.into_iter().collect();
        let client_ids: Vec<String> = client_ids.into_iter().collect();
        let mut pipe = redis::pipe();
        pipe.cmd("HMGET")
            .arg(self.keys.catalog("plans"))
            .arg(&plan_ids)
            .arg("")
            .cmd("HMGET")
            .arg(self.keys.catalog("clients"))
            .arg(&client_ids)
            .arg("");
        let (plan_vals, client_vals): (Vec<Option<String>>, Vec<Option<String>>) =
            pipe.query_async(&mut *c).await?;
        let plans = plan_ids
            .iter()
            .zip(plan_vals)
            .filter_map(|(id, raw)| {
                let name = PlanName::parse(id).ok()?;
                Some((name, raw.and_then(|r| parse_entity(&r))))
            })
            .collect();
        let clients = client_ids
            .iter()
            .zip(client_vals)
            .filter_map(|(id, raw)| {
                let id = ClientId::parse(id).ok()?;
                Some((id, raw.and_then(|r| parse_entity(&r))))
            })
            .collect();
        Ok(CatalogChanges::Delta {
            version: last,
            plans,
            clients,
            more: entries.len() == FEED_PAGE,
        })
    }

    pub async fn catalog_write(&self, write: &CatalogWrite) -> Result<WriteOutcome, StoreError> {
        let mut inv = self.catalog_write.prepare_invoke();
        for part in ["plans", "clients", "keys", "users", "version", "changes"] {
            inv.key(self.keys.catalog(part));
        }
        let (op, json, plan, hashes) = match write {
            CatalogWrite::PutPlan(p, _) => ("put", to_json(p)?, String::new(), vec![]),
            CatalogWrite::PutClient(c, _) => (
                "put",
                to_json(c)?,
                c.plan.to_string(),
                c.keys.iter().map(|k| k.hash.to_string()).collect(),
            ),
            CatalogWrite::DeletePlan(..) | CatalogWrite::DeleteClient(..) => {
                ("delete", String::new(), String::new(), vec![])
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
            .arg(json)
            .arg(plan)
            .arg(hashes);
        let mut c = self.conn().await?;
        let (status, rev, detail): (String, u64, Value) = inv.invoke_async(&mut *c).await?;
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
}

fn to_json<T: serde::Serialize>(v: &T) -> Result<String, StoreError> {
    serde_json::to_string(v).map_err(|e| StoreError::Protocol(e.to_string()))
}

/// Parses `"<rev> <json>"`.
fn parse_entity<T: serde::de::DeserializeOwned>(raw: &str) -> Option<Versioned<T>> {
    let (rev, json) = raw.split_once(' ')?;
    Some(Versioned {
        rev: rev.parse().ok()?,
        value: serde_json::from_str(json).ok()?,
    })
}

/// Every field of a hash, with HSCAN (a catalog may hold millions of clients).
async fn scan_hash(
    c: &mut redis::aio::MultiplexedConnection,
    key: &str,
) -> Result<Vec<(String, String)>, StoreError> {
    let mut out = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, page): (u64, Vec<(String, String)>) = redis::cmd("HSCAN")
            .arg(key)
            .arg(cursor)
            .arg("COUNT")
            .arg(1000)
            .query_async(c)
            .await?;
        out.extend(page);
        if next == 0 {
            return Ok(out);
        }
        cursor = next;
    }
}
