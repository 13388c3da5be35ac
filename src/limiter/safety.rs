//! The coarse safety limit: an in-process bucket per (client, service) at a multiple of
//! the client's plan. It is what the per-service limiters become once the edge enforces,
//! and what still protects services while the gateway fails open. No I/O, a sharded map,
//! idle entries evicted.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use crate::catalog::{ClientEntry, SafetyRecord};
use crate::domain::Verdict;
use crate::domain::{Bucket, ClientId};
use crate::store::LocalBuckets;

/// A (client, service) pair; cloning it copies two reference counts, never a string.
#[derive(Clone, PartialEq, Eq)]
pub struct SafetyKey(ClientId, Arc<str>);

impl Hash for SafetyKey {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.0.as_str().hash(h);
        self.1.hash(h);
    }
}

impl From<&SafetyKey> for SafetyKey {
    fn from(k: &SafetyKey) -> SafetyKey {
        k.clone()
    }
}

pub struct SafetyLimit {
    buckets: LocalBuckets<SafetyKey>,
    default_multiplier: f64,
}

impl SafetyLimit {
    pub fn new(default_multiplier: f64) -> SafetyLimit {
        SafetyLimit {
            buckets: LocalBuckets::default(),
            default_multiplier,
        }
    }

    /// The multiplier for `service`: its override, else the stored one, else the config's.
    pub fn multiplier(&self, settings: &Option<SafetyRecord>, service: &str) -> f64 {
        match settings {
            Some(s) => s.services.get(service).copied().unwrap_or(s.multiplier),
            None => self.default_multiplier,
        }
    }

    /// Takes `cost` from the client's safety bucket for `service`.
    pub fn take(
        &self,
        client: &ClientEntry,
        service: &Arc<str>,
        plan: Bucket,
        multiplier: f64,
        cost: f64,
    ) -> Verdict {
        let key = SafetyKey(client.id.clone(), Arc::clone(service));
        self.buckets
            .take_at(&key, plan.scaled(multiplier), cost, self.buckets.now_us())
    }

    /// Forgets idle pairs; returns how many remain.
    pub fn evict_idle(&self) -> usize {
        self.buckets.evict_idle()
    }
}
