//! The coarse safety limit: an in-process bucket per (client, service) at a multiple of
//! the client's plan. It is what the per-service limiters become once the edge enforces,
//! and what still protects services while the gateway fails open. No I/O, a sharded map,
//! idle entries evicted.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use super::addr_buckets::AddrBuckets;
use crate::catalog::{ClientEntry, SafetyRecord};
use crate::domain::{Bucket, ClientId};
use crate::store::{LocalBuckets, Probe};

/// A (client, service) pair; cloning it copies two reference counts, never a string.
#[derive(Clone, PartialEq, Eq)]
pub struct SafetyKey(ClientId, Arc<str>);

impl Hash for SafetyKey {
    fn hash<H: Hasher>(&self, h: &mut H) {
        SafetyProbe(&self.0, &self.1).hash(h)
    }
}

/// Finds a pair's bucket without copying either name (see [`Probe`]).
struct SafetyProbe<'a>(&'a ClientId, &'a Arc<str>);

impl Hash for SafetyProbe<'_> {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.0.as_str().hash(h);
        self.1.hash(h);
    }
}

impl Probe<SafetyKey> for SafetyProbe<'_> {
    fn is(&self, key: &SafetyKey) -> bool {
        key.0 == *self.0 && key.1 == *self.1
    }
    fn key(&self) -> SafetyKey {
        SafetyKey(self.0.clone(), Arc::clone(self.1))
    }
}

pub struct SafetyLimit {
    buckets: LocalBuckets<SafetyKey>,
    /// Requests without a key on public routes, per (address group, service): a table of
    /// fixed size, since the addresses are the clients' to choose.
    addresses: AddrBuckets,
    default_multiplier: f64,
}

/// Sets of the addresses' safety table: 32,768 (address group, service) pairs at once,
/// about 1.1 MiB. Past that, the pairs that hold the most are forgotten (they start full).
const ADDRESS_SETS: usize = 8192;

impl SafetyLimit {
    pub fn new(default_multiplier: f64) -> SafetyLimit {
        SafetyLimit {
            buckets: LocalBuckets::default(),
            addresses: AddrBuckets::new(ADDRESS_SETS),
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

    /// Takes `cost` from the client's safety bucket for `service`, at `now`; returns the
    /// wait until it holds the cost (`bucket::TAKEN`: it did).
    pub fn take(
        &self,
        client: &ClientEntry,
        service: &Arc<str>,
        plan: Bucket,
        multiplier: f64,
        cost: f64,
        now: std::time::Instant,
    ) -> Option<u64> {
        let key = SafetyProbe(&client.id, service);
        self.buckets
            .take_at(&key, plan.scaled(multiplier), cost, self.buckets.us_at(now))
    }

    /// [`SafetyLimit::take`] for a request without a key: `tag` is its address group's
    /// (see [`crate::domain::address_tag`]).
    pub fn take_for_address(
        &self,
        tag: &str,
        service: &str,
        plan: Bucket,
        multiplier: f64,
        cost: f64,
        now: std::time::Instant,
    ) -> Option<u64> {
        let at = self.addresses.us_at(now);
        self.addresses
            .take_at(&(tag, service), plan.scaled(multiplier), cost, at)
    }

    /// Forgets idle pairs; returns how many remain.
    pub fn evict_idle(&self) -> usize {
        self.buckets.evict_idle()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bucket found by a probe before its table grew must be found by it after: the
    /// table rehashes stored keys, so a key and its probe must hash alike.
    #[test]
    fn every_pair_keeps_its_own_bucket_while_the_table_grows() {
        let buckets = LocalBuckets::<SafetyKey>::default();
        let plan = Bucket::new(1.0, 0.001).unwrap();
        let services: Vec<Arc<str>> = vec!["orders".into(), "search".into()];
        let ids: Vec<ClientId> = (0..3000)
            .map(|i| ClientId::parse(&format!("client-{i}")).unwrap())
            .collect();
        let take = |id: &ClientId, service: &Arc<str>| {
            buckets.take_at(&SafetyProbe(id, service), plan, 1.0, 0) == crate::domain::bucket::TAKEN
        };
        for id in &ids {
            for service in &services {
                assert!(take(id, service), "first take of {}", id.as_str());
            }
        }
        for id in &ids {
            for service in &services {
                assert!(!take(id, service), "second take of {}", id.as_str());
            }
        }
        assert_eq!(buckets.evict_idle(), ids.len() * services.len());
    }
}
