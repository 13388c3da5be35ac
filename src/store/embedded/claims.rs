//! Names claimed once, in memory: the embedded store serves one gateway, which claims
//! every name first (kept for their time, lost on restart).

use std::time::{Duration, Instant};

use async_trait::async_trait;

use super::backend::EmbeddedStore;
use crate::store::{Claims, StoreError};

#[async_trait]
impl Claims for EmbeddedStore {
    async fn claim(&self, name: &str, holder: &str, ttl: Duration) -> Result<bool, StoreError> {
        let now = Instant::now();
        let mut claims = self.claims.lock();
        claims.retain(|_, (_, until)| *until > now);
        match claims.get(name) {
            Some((held, _)) => Ok(held == holder),
            None => {
                claims.insert(name.to_string(), (holder.to_string(), now + ttl));
                Ok(true)
            }
        }
    }
}
