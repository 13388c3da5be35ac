//! The audit log: a capped stream beside the catalog, read newest first. Catalog writes
//! append to it in their script; this appends what happens outside the catalog.

use async_trait::async_trait;

use super::backend::{retrying, FeedEntry, RedisStore};
use crate::store::records::AuditEntry;
use crate::store::{AuditLog, StoreError};

#[async_trait]
impl AuditLog for RedisStore {
    /// The newest `limit` audit entries, newest first.
    async fn recent(&self, limit: usize) -> Result<Vec<AuditEntry>, StoreError> {
        retrying!(self, |c| async {
            let entries: Vec<FeedEntry> = redis::cmd("XREVRANGE")
                .arg(self.keys.catalog("audit"))
                .arg("+")
                .arg("-")
                .arg("COUNT")
                .arg(limit)
                .query_async(c)
                .await?;
            Ok(entries
                .into_iter()
                .map(|(_, fields)| {
                    let get = |name: &str| {
                        fields
                            .iter()
                            .find(|(k, _)| k == name)
                            .map(|(_, v)| v.clone())
                            .unwrap_or_default()
                    };
                    let json = |name: &str| serde_json::from_str(&get(name)).ok();
                    AuditEntry {
                        at_ms: get("at_ms").parse().unwrap_or(0),
                        actor: get("actor"),
                        action: get("action"),
                        kind: get("kind"),
                        id: get("id"),
                        rev: get("rev").parse().unwrap_or(0),
                        before: json("before"),
                        after: json("after"),
                    }
                })
                .collect())
        }
        .await)
    }

    /// Appends an audit entry for a change outside the catalog (a bucket refill).
    async fn record(&self, entry: AuditEntry) -> Result<(), StoreError> {
        let mut c = self.conn().await?;
        let _: String = redis::cmd("XADD")
            .arg(self.keys.catalog("audit"))
            .arg("MAXLEN")
            .arg("~")
            .arg(100_000)
            .arg("*")
            .arg("at_ms")
            .arg(entry.at_ms)
            .arg("actor")
            .arg(&entry.actor)
            .arg("action")
            .arg(&entry.action)
            .arg("kind")
            .arg(&entry.kind)
            .arg("id")
            .arg(&entry.id)
            .arg("rev")
            .arg(entry.rev)
            .arg("before")
            .arg(
                entry
                    .before
                    .as_ref()
                    .map(|v| v.to_string())
                    .unwrap_or_default(),
            )
            .arg("after")
            .arg(
                entry
                    .after
                    .as_ref()
                    .map(|v| v.to_string())
                    .unwrap_or_default(),
            )
            .query_async(&mut c)
            .await?;
        Ok(())
    }
}
