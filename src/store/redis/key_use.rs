//! When each key was last used: one sorted set, scored by unix seconds, each member
//! keeping its latest (`ZADD GT`, Redis 6.2 or later), written in chunks.

use async_trait::async_trait;

use super::backend::{retrying, RedisStore};
use crate::store::{KeyUse, StoreError};

/// Members per `ZADD`: a batch of thousands of keys does not hold Redis for one long call.
const CHUNK: usize = 500;

#[async_trait]
impl KeyUse for RedisStore {
    async fn touch(&self, uses: &[(String, u64)]) -> Result<(), StoreError> {
        let key = self.keys.key_use();
        for chunk in uses.chunks(CHUNK) {
            let mut cmd = redis::cmd("ZADD");
            cmd.arg(&key).arg("GT");
            for (member, at) in chunk {
                cmd.arg(*at).arg(member);
            }
            let mut c = self.conn().await?;
            let _: i64 = cmd.query_async(&mut c).await?;
        }
        Ok(())
    }

    async fn last_used(&self, members: &[String]) -> Result<Vec<Option<u64>>, StoreError> {
        if members.is_empty() {
            return Ok(Vec::new());
        }
        let key = self.keys.key_use();
        let scores: Vec<Option<f64>> = retrying!(self, |c| async {
            Ok(redis::cmd("ZMSCORE")
                .arg(&key)
                .arg(members)
                .query_async(c)
                .await?)
        }
        .await)?;
        Ok(scores.into_iter().map(|s| s.map(|s| s as u64)).collect())
    }

    async fn forget(&self, members: &[String]) -> Result<(), StoreError> {
        if members.is_empty() {
            return Ok(());
        }
        let mut c = self.conn().await?;
        let _: i64 = redis::cmd("ZREM")
            .arg(self.keys.key_use())
            .arg(members)
            .query_async(&mut c)
            .await?;
        Ok(())
    }
}
