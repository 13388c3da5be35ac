//! Usage history in memory (one instance: lost on restart, like the buckets), forgotten
//! `retention` after its day ends.

use std::collections::BTreeMap;

use async_trait::async_trait;

use super::backend::EmbeddedStore;
use crate::domain::ClientId;
use std::time::Duration;

use crate::store::{
    Checkpoint, Checkpointed, StoreError, UsageBatch, UsageHistory, UsageRow, DAY_S,
};

#[async_trait]
impl UsageHistory for EmbeddedStore {
    async fn add(&self, batch: &UsageBatch) -> Result<(), StoreError> {
        let mut usage = self.usage.lock();
        let last = usage.batches.entry(batch.gateway.clone()).or_default();
        if *last >= batch.seq {
            return Ok(());
        }
        *last = batch.seq;
        for e in &batch.entries {
            let expires_s = e.hour_s - e.hour_s % DAY_S + DAY_S + batch.retention_s;
            let held = usage
                .hours
                .entry((e.client.clone(), e.hour_s))
                .or_insert_with(|| (expires_s, BTreeMap::new()));
            held.0 = expires_s;
            held.1.entry(e.limit.clone()).or_default().add(&e.counts);
        }
        let now_s = crate::store::LocalLimits::now_us() / 1_000_000;
        usage.hours.retain(|_, (expires_s, _)| *expires_s > now_s);
        Ok(())
    }

    async fn read(
        &self,
        client: &ClientId,
        from_s: u64,
        to_s: u64,
    ) -> Result<Vec<UsageRow>, StoreError> {
        let usage = self.usage.lock();
        let now_s = crate::store::LocalLimits::now_us() / 1_000_000;
        let range = (client.clone(), from_s)..(client.clone(), to_s);
        Ok(usage
            .hours
            .range(range)
            .filter(|(_, (expires_s, _))| *expires_s > now_s)
            .flat_map(|((_, hour_s), (_, limits))| {
                limits.iter().map(|(limit, counts)| UsageRow {
                    limit: limit.clone(),
                    hour_s: *hour_s,
                    counts: *counts,
                })
            })
            .collect())
    }

    // The store dies with its gateway: there is nothing to keep for another to adopt.
    async fn checkpoint(
        &self,
        _gateway: &str,
        _held: Checkpoint<'_>,
        _noted: bool,
    ) -> Result<Checkpointed, StoreError> {
        Ok(Checkpointed::Written)
    }

    async fn adopt(&self, _grace: Duration) -> Result<Option<(String, Vec<u8>)>, StoreError> {
        Ok(None)
    }

    async fn release(&self, _gateway: &str) -> Result<(), StoreError> {
        Ok(())
    }

    async fn retire(&self, _gateway: &str) -> Result<(), StoreError> {
        Ok(())
    }
}
