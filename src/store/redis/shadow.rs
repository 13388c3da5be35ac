//! Shadow-mode comparison counts: one hash per count, summed over every gateway.

use super::backend::{retrying, scan_hash, RedisStore};
use crate::store::StoreError;

impl RedisStore {
    /// Adds shadow-mode comparison counts (compared, disagreed) per client.
    pub async fn shadow_add(&self, counts: &[(String, u64, u64)]) -> Result<(), StoreError> {
        let mut pipe = redis::pipe();
        for (client, compared, disagreed) in counts {
            pipe.hincr(self.keys.shadow("compared"), client, *compared)
                .ignore();
            if *disagreed > 0 {
                pipe.hincr(self.keys.shadow("disagreed"), client, *disagreed)
                    .ignore();
            }
        }
        let mut c = self.conn().await?;
        let _: () = pipe.query_async(&mut c).await?;
        Ok(())
    }

    /// Shadow-mode counts per client, summed over every gateway sharing this store.
    pub async fn shadow_counts(&self) -> Result<Vec<(String, u64, u64)>, StoreError> {
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
                let d = disagreed
                    .get(&client)
                    .and_then(|d| d.parse().ok())
                    .unwrap_or(0);
                (client, n.parse().unwrap_or(0), d)
            })
            .collect())
    }

    pub async fn shadow_reset(&self) -> Result<(), StoreError> {
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
