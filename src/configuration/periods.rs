//! `[periods]`: how often the limiter's background work runs, handed down from start-up
//! as one value. The defaults are the design's; tests shorten them so they wait on events
//! instead of sleeping through a 10 s window, and operators may tune them.

use std::time::Duration;

/// The limiter's periods.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Periods {
    /// The window over which the hottest clients are counted (`/admin/v1/hot`).
    pub hot_window: Duration,
    /// How often shares of sharded clients are recomputed; each gateway reports its demand
    /// twice a period, so a recomputation sees demand at most half a period old.
    pub share: Duration,
    /// How long after un-sharding the global bucket starts from the shards' fill.
    pub unshard_window: Duration,
    /// How often shadow-mode counts are flushed to the store.
    pub shadow_flush: Duration,
    /// How often the keys used since the last time are written to the store, with the
    /// time (each key's `last_used_at`, to within this period).
    pub key_use_flush: Duration,
    /// How long costs debited after the fact (reported by a service; a sharded client's
    /// quotas) are summed on a worker before they go to the store as one call.
    pub debit: Duration,
    /// The breaker's back-off between probes of a store that stopped answering.
    pub backoff: BackOff,
}

/// A breaker's back-off: `base` after opening, doubled (up to `max`) each time it re-opens
/// within `stable` of closing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackOff {
    pub base: Duration,
    pub max: Duration,
    pub stable: Duration,
}

impl Default for Periods {
    fn default() -> Self {
        Periods {
            hot_window: Duration::from_secs(10),
            share: Duration::from_secs(1),
            unshard_window: Duration::from_secs(60),
            shadow_flush: Duration::from_secs(1),
            key_use_flush: Duration::from_secs(60),
            debit: Duration::from_millis(20),
            backoff: BackOff::default(),
        }
    }
}

impl Default for BackOff {
    fn default() -> Self {
        BackOff {
            base: Duration::from_millis(100),
            max: Duration::from_secs(2),
            stable: Duration::from_secs(5),
        }
    }
}

impl Periods {
    /// How often each gateway reports demand and reads the shares: twice a share period.
    pub fn share_report(&self) -> Duration {
        self.share / 2
    }
}
