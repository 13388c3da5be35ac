//! Shadow-mode comparison counts, in memory (one instance: nobody else to sum with).

use super::backend::EmbeddedStore;

impl EmbeddedStore {
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
}
