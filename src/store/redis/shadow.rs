//! Shadow-mode comparison counts: one hash per count, summed over every gateway.

use async_trait::async_trait;

use super::backend::{retrying, scan_hash, RedisStore};
use crate::store::{ShadowCount, ShadowCounts, StoreError};

#[async_trait]
impl ShadowCounts for RedisStore {
    /// Adds shadow-mode comparison counts (compared, disagreed) per client.
    async fn add(&self, counts: &[ShadowCount]) -> Result<(), StoreError> {
        let mut pipe = redis::pipe();
        for c in counts {
            pipe.hincr(self.keys.shadow("compared"), &c.client, c.compared)
                .ignore();
            if c.disagreed > 0 {
                pipe.hincr(self.keys.shadow("disagreed"), &c.client, c.disagreed)
                    .ignore();
            }
        }
        let mut c = self.conn().await?;
        let _: () = pipe.query_async(&mut c).await?;
        Ok(())
    }

    /// Shadow-mode counts per client, summed over every gateway sharing this store.
    async fn counts(&self) -> Result<Vec<ShadowCount>, StoreError> {
        let (compared, disagreed) = retrying!(self, |c| async {
            Ok((
                scan_hash(c, &self.keys.shadow("compared")).await?,
                scan_hash(c, &self.keys.shadow("disagreed")).await?,
            ))
        }
        .await)?;
        let disagreed: std::collections::HashMap<String, String> = disagreed.into_iter().collect();
        Ok(compared
            .into_iter()
            .map(|(client, n)| {
                let disagreed = disagreed
                    .get(&client)
                    .and_then(|d| d.parse().ok())
                    .unwrap_or(0);
                ShadowCount {
                    compared: n.parse().unwrap_or(0),
                    client,
                    disagreed,
                }
            })
            .collect())
    }

    async fn reset(&self) -> Result<(), StoreError> {
        retrying!(self, |c| async {
            let _: () = redis::pipe()
                .del(self.keys.shadow("compared"))
                .ignore()
                .del(self.keys.shadow("disagreed"))
                .ignore()
                .query_async(c)
                .await?;
            Ok(())
        }
        .await)
    }
}
