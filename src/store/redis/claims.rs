//! Names claimed once by the fleet: `SET NX` with a time to live, the holder's id as the
//! value, so a claim asked again after its reply was lost finds it its own.

use std::time::Duration;

use async_trait::async_trait;

use super::backend::{retrying, RedisStore};
use crate::store::{Claims, StoreError};

#[async_trait]
impl Claims for RedisStore {
    async fn claim(&self, name: &str, holder: &str, ttl: Duration) -> Result<bool, StoreError> {
        let key = self.keys.claim(name);
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
        retrying!(self, |c| async {
            let set: Option<String> = redis::cmd("SET")
                .arg(&key)
                .arg(holder)
                .arg("NX")
                .arg("PX")
                .arg(ttl_ms)
                .query_async(c)
                .await?;
            if set.is_some() {
                return Ok(true);
            }
            let held: Option<String> = redis::cmd("GET").arg(&key).query_async(c).await?;
            Ok(held.as_deref() == Some(holder))
        }
        .await)
    }
}
