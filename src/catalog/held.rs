//! Cache mode (`catalog.mode = "cache"`): what a gateway that does not hold the whole
//! catalog keeps besides its clients.
//!
//! - **Which clients it holds**: a W-TinyLFU cache of client ids (`moka`), bounded by
//!   `catalog.cached_clients`. A client it evicts (or declines to admit: seen once, less
//!   often than the one it would push out) is queued and forgotten by the catalog under its
//!   apply lock, so the request path's maps never disagree with a change being applied.
//! - **Keys known to be unknown**, bounded by `catalog.unknown_keys` and remembered for
//!   `catalog.unknown_for_ms`: a flood of made-up keys costs the store one read each, and
//!   cannot push a client in use out (they never enter the clients' cache).
//! - **What the feed changed lately** ([`Recent`]): a lookup's answer is cached only if no
//!   change applied since the version it was read at touched its client or its key; else it
//!   is read again. This closes the race between a lookup in flight and the feed (a key
//!   revoked, or created, while its lookup was on the wire).
//! - **Lookups in flight**, one per key: a client's first burst costs one store read.
//! - **The key filter** ([`KeyFilter`]): a copy of the store's Bloom filter of every key, so
//!   a key no client has is refused without a read.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dashmap::DashMap;
use futures_util::future::{BoxFuture, Shared};

use super::key_filter::KeyFilter;
use crate::configuration::CacheBounds;
use crate::domain::{ClientId, KeyHash};

/// How long [`Recent`] keeps what it saw before starting over, and how many entries at
/// most. A lookup takes at most `catalog.lookup_timeout_ms`; one read before a start-over
/// is read again, which is all a start-over costs.
const RECENT_FOR: Duration = Duration::from_secs(30);
const RECENT_AT_MOST: usize = 100_000;

/// Cache mode's maps are made this large at start (or as large as their bound, if less),
/// so that they do not rehash on a request's path until they hold as many; past it they
/// grow as they fill (a bound of 100 million is not allocated up front).
pub(super) const PRESIZED_AT_MOST: u64 = 1_000_000;

/// The initial capacity of a map bounded by `bound`: [`PRESIZED_AT_MOST`] at most.
pub(super) fn presized(bound: u64) -> usize {
    usize::try_from(bound.min(PRESIZED_AT_MOST)).unwrap_or(usize::MAX)
}

/// Why a key not cached could not be looked up: the store did not answer in time, or
/// failed. The request is answered `503`: a key the gateway cannot check is not let in.
#[derive(Debug, Clone)]
pub struct LookupFailed(pub String);

impl std::fmt::Display for LookupFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// What cache mode keeps; `L` is a lookup's answer (shared by the requests waiting on
/// the same key).
pub(super) struct Held<L> {
    /// The clients held, by id (the catalog's maps hold their entries).
    pub(super) clients: moka::sync::Cache<ClientId, ()>,
    /// Clients the cache let go, for the catalog to forget under its apply lock.
    pub(super) evicted: Arc<parking_lot::Mutex<Vec<ClientId>>>,
    pub(super) unknown: moka::sync::Cache<KeyHash, ()>,
    pub(super) recent: parking_lot::Mutex<Recent>,
    pub(super) inflight: DashMap<KeyHash, Shared<BoxFuture<'static, L>>>,
    pub(super) lookup_timeout: Duration,
    pub(super) lookups: Lookups,
    pub(super) filter: KeyFilter,
    /// The size of a key filter this gateway starts (0: it neither starts nor uses one).
    pub(super) filter_bits: u64,
}

impl<L> Held<L> {
    pub(super) fn new(bounds: CacheBounds) -> Held<L> {
        let evicted = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let queue = Arc::clone(&evicted);
        // Both caches are sized for their bounds at once (up to [`PRESIZED_AT_MOST`]): a
        // cache that grows rehashes its table on the worker that inserts (seen at 100,000
        // clients as milliseconds on the first requests' path).
        let clients = moka::sync::Cache::builder()
            .max_capacity(bounds.clients)
            .initial_capacity(presized(bounds.clients))
            .eviction_listener(move |id: Arc<ClientId>, (), cause| {
                // `Replaced` and `Explicit` are the catalog's own doing; the rest (`Size`,
                // which includes a newcomer the policy declined) it must forget.
                if cause.was_evicted() {
                    queue.lock().push((*id).clone());
                }
            })
            .build();
        Held {
            clients,
            evicted,
            unknown: moka::sync::Cache::builder()
                .max_capacity(bounds.unknown_keys)
                .initial_capacity(presized(bounds.unknown_keys))
                .time_to_live(bounds.unknown_for)
                .build(),
            recent: parking_lot::Mutex::new(Recent::new(0)),
            inflight: DashMap::new(),
            lookup_timeout: bounds.lookup_timeout,
            lookups: Lookups::default(),
            filter: KeyFilter::default(),
            filter_bits: bounds.key_filter_bits,
        }
    }
}

/// The clients and keys the change feed touched lately, with the version that did, and
/// the version from which this is complete.
pub(super) struct Recent {
    /// Every change after this version is recorded here.
    floor: u64,
    started: Instant,
    clients: HashMap<ClientId, u64>,
    keys: HashMap<KeyHash, u64>,
}

impl Recent {
    pub(super) fn new(floor: u64) -> Recent {
        Recent {
            floor,
            started: Instant::now(),
            clients: HashMap::new(),
            keys: HashMap::new(),
        }
    }

    /// A change at `version` touched `client` and these keys.
    pub(super) fn touched(
        &mut self,
        version: u64,
        client: &ClientId,
        keys: impl Iterator<Item = KeyHash>,
    ) {
        self.clients.insert(client.clone(), version);
        for k in keys {
            self.keys.insert(k, version);
        }
    }

    /// Starts over (complete from `version` on) once old or large enough.
    pub(super) fn trim(&mut self, version: u64) {
        if self.started.elapsed() > RECENT_FOR
            || self.clients.len() + self.keys.len() > RECENT_AT_MOST
        {
            *self = Recent::new(version);
        }
    }

    /// Whether an answer read at `version` about `key` (and its client, if it has one)
    /// still stands: nothing applied since touched either.
    pub(super) fn stands(&self, version: u64, key: &KeyHash, client: Option<&ClientId>) -> bool {
        let untouched = |at: Option<&u64>| at.is_none_or(|&at| at <= version);
        version >= self.floor
            && untouched(self.keys.get(key))
            && client.is_none_or(|c| untouched(self.clients.get(c)))
    }
}

/// Upper bounds (seconds) of the lookup-time histogram (`tollgate_catalog_lookup_seconds`):
/// a read is a round trip (a tenth of a millisecond to a millisecond: a tenth apart there,
/// so a read's p99 can be set beside a cached request's), bounded by
/// `catalog.lookup_timeout_ms` (50 ms by default).
pub const LOOKUP_BUCKETS: [f64; 14] = [
    0.000_1, 0.000_2, 0.000_3, 0.000_4, 0.000_5, 0.000_75, 0.001, 0.002_5, 0.005, 0.01, 0.025,
    0.05, 0.1, 1.0,
];

/// What lookups found, and how long they took, for the metrics.
#[derive(Default)]
pub(super) struct Lookups {
    pub(super) client: AtomicU64,
    pub(super) unknown: AtomicU64,
    pub(super) failed: AtomicU64,
    /// Keys the key filter said no client has: refused without a read.
    pub(super) filtered: AtomicU64,
    /// Reads by [`LOOKUP_BUCKETS`] (not cumulative; a read past the last bound is only in
    /// `took_count`), their total time and their count.
    pub(super) took: [AtomicU64; LOOKUP_BUCKETS.len()],
    pub(super) took_sum_ns: AtomicU64,
    pub(super) took_count: AtomicU64,
}

impl Lookups {
    /// A read of a key not held, from its start to its answer (or its failure).
    pub(super) fn took(&self, took: Duration) {
        let secs = took.as_secs_f64();
        if let Some(i) = LOOKUP_BUCKETS.iter().position(|b| secs <= *b) {
            self.took[i].fetch_add(1, Relaxed);
        }
        self.took_count.fetch_add(1, Relaxed);
        self.took_sum_ns
            .fetch_add(u64::try_from(took.as_nanos()).unwrap_or(u64::MAX), Relaxed);
    }

    /// The histogram: per bucket, the total seconds, the count.
    pub(super) fn histogram(&self) -> ([u64; LOOKUP_BUCKETS.len()], f64, u64) {
        (
            std::array::from_fn(|i| self.took[i].load(Relaxed)),
            self.took_sum_ns.load(Relaxed) as f64 / 1e9,
            self.took_count.load(Relaxed),
        )
    }

    /// Counts a lookup that found a client (`Some(true)`), no client (`Some(false)`), or
    /// had no answer (`None`).
    pub(super) fn count(&self, found: Option<bool>) {
        match found {
            Some(true) => &self.client,
            Some(false) => &self.unknown,
            None => &self.failed,
        }
        .fetch_add(1, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_stands_only_if_nothing_since_touched_its_key_or_client() {
        let (acme, other) = (
            ClientId::parse("acme").unwrap(),
            ClientId::parse("b").unwrap(),
        );
        let (k1, k2) = (KeyHash::of("k1"), KeyHash::of("k2"));
        let mut recent = Recent::new(10);
        recent.touched(12, &acme, [k1].into_iter());

        assert!(!recent.stands(9, &k2, None), "read before the floor");
        assert!(!recent.stands(11, &k1, None), "k1 created since");
        assert!(!recent.stands(11, &k2, Some(&acme)), "acme changed since");
        assert!(recent.stands(12, &k1, Some(&acme)), "read after the change");
        assert!(recent.stands(10, &k2, Some(&other)), "untouched");
    }
}
