//! The audit log, kept in the catalog file (the newest entries): reads, and entries for
//! changes made outside the catalog.

use super::backend::{persist, push_audit, EmbeddedStore};
use crate::store::records::AuditEntry;
use crate::store::StoreError;

impl EmbeddedStore {
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
