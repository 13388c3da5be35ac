//! How long a take may wait, and for what.

use std::time::Duration;

use tokio::time::Instant;

/// A take's time: when its request wants the answer, and how long the store has to give
/// it. The two are apart because only the second is the store's: time a request spends
/// waiting for its worker, for a batch to be sent or for a call in flight ahead of it is
/// the gateway's, and a busy gateway must not read it as a slow store (fail open, or open
/// the breaker).
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    /// When the request wants its answer: a take queued behind a call in flight is sent
    /// in time for it (see `coalesce`). It schedules; nothing gives up at it.
    pub due: Instant,
    /// How long the store has to answer a call, from when the call is written to its
    /// connection (`redis.timeout_ms`). Past it, the call's takes answer
    /// [`StoreError::Deadline`](crate::StoreError::Deadline) unless the reply is found
    /// waiting on the socket (see `gather`).
    pub store: Duration,
}

impl Budget {
    /// A budget of `store` for a request that began at `started`: due when the store's
    /// budget would end had the call gone out at once.
    pub fn starting(started: Instant, store: Duration) -> Budget {
        Budget {
            due: started + store,
            store,
        }
    }
}
