//! When each key was last used, in memory (one instance: nobody else writes it; lost on
//! restart, like the buckets).

use async_trait::async_trait;

use super::backend::EmbeddedStore;
use crate::store::{KeyUse, StoreError};

#[async_trait]
impl KeyUse for EmbeddedStore {
    async fn touch(&self, uses: &[(String, u64)]) -> Result<(), StoreError> {
        let mut m = self.key_use.lock();
        for (member, at) in uses {
            let e = m.entry(member.clone()).or_default();
            *e = (*e).max(*at);
        }
        Ok(())
    }

    async fn last_used(&self, members: &[String]) -> Result<Vec<Option<u64>>, StoreError> {
        let m = self.key_use.lock();
        Ok(members.iter().map(|k| m.get(k).copied()).collect())
    }

    async fn forget(&self, members: &[String]) -> Result<(), StoreError> {
        let mut m = self.key_use.lock();
        for k in members {
            m.remove(k);
        }
        Ok(())
    }
}
