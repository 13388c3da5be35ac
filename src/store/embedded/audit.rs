//! The audit log, kept in the catalog file (the newest entries): reads, and entries for
//! changes made outside the catalog.

use async_trait::async_trait;

use super::backend::{persist, push_audit, EmbeddedStore};
use crate::store::records::AuditEntry;
use crate::store::{AuditLog, StoreError};

#[async_trait]
impl AuditLog for EmbeddedStore {
    async fn recent(&self, limit: usize) -> Result<Vec<AuditEntry>, StoreError> {
        Ok(self
            .file
            .catalog
            .lock()
            .data
            .audit
            .iter()
            .rev()
            .take(limit)
            .cloned()
            .collect())
    }

    async fn record(&self, entry: AuditEntry) -> Result<(), StoreError> {
        self.file
            .off_worker(move |file| {
                let _one = file.writer.lock();
                let mut next = file.catalog.lock().data.clone();
                push_audit(&mut next.audit, entry);
                persist(&file.path, &next)?;
                file.catalog.lock().data = next;
                Ok(())
            })
            .await
    }
}
