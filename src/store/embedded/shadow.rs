//! Shadow-mode comparison counts, in memory (one instance: nobody else to sum with).

use async_trait::async_trait;

use super::backend::EmbeddedStore;
use crate::store::{ShadowCount, ShadowCounts, StoreError};

#[async_trait]
impl ShadowCounts for EmbeddedStore {
    async fn add(&self, counts: &[ShadowCount]) -> Result<(), StoreError> {
        let mut m = self.shadow.lock();
        for c in counts {
            let e = m.entry(c.client.clone()).or_default();
            e.0 += c.compared;
            e.1 += c.disagreed;
        }
        Ok(())
    }

    async fn counts(&self) -> Result<Vec<ShadowCount>, StoreError> {
        Ok(self
            .shadow
            .lock()
            .iter()
            .map(|(client, (compared, disagreed))| ShadowCount {
                client: client.clone(),
                compared: *compared,
                disagreed: *disagreed,
            })
            .collect())
    }

    async fn reset(&self) -> Result<(), StoreError> {
        self.shadow.lock().clear();
        Ok(())
    }
}
