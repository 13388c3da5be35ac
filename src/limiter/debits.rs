//! Costs debited after the fact, off the request path: a cost a service reports in its
//! response, and the quotas of a client sharded by region (kept in the global store while
//! its buckets are decided in its region's shard).
//!
//! Debits are summed per worker thread, per client state and set of limits, and each sum
//! goes to the store as one `adjust` call (one `EVALSHA`) when its period ends: a client
//! with many requests in a period costs one call, not one per request. Nothing here delays
//! a response, and a debit the store refuses is logged and dropped (the store was down:
//! the gateway failed open meanwhile anyway).

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

use crate::domain::{Applied, Ruling};
use crate::store::Store;

/// Called with the levels after a debit.
pub type OnReply = Rc<dyn Fn(&Ruling)>;

struct Pending {
    store: Store,
    applied: Vec<Applied>,
    delta: f64,
    on_reply: Option<OnReply>,
}

/// (store, state key, limit fields) → the sum to send.
type Queue = HashMap<(usize, Box<str>, Box<str>), Pending>;

thread_local! {
    static QUEUE: RefCell<Option<Queue>> = const { RefCell::new(None) };
}

/// Queues `delta` (a refund when negative) on the limits `applied` at `key` in `store`,
/// to be sent within `period`, summed with the others for the same state and limits.
/// Must run on a worker thread (a `LocalSet`).
pub fn queue(
    store: &Store,
    key: &str,
    applied: &[Applied],
    delta: f64,
    period: Duration,
    on_reply: Option<OnReply>,
) {
    if delta == 0.0 || !delta.is_finite() || applied.is_empty() {
        return;
    }
    let fields: String = applied.iter().map(|a| format!("{}|", a.field)).collect();
    let first = QUEUE.with(|q| {
        let mut q = q.borrow_mut();
        let first = q.is_none();
        let map = q.get_or_insert_with(HashMap::new);
        map.entry((store.id(), key.into(), fields.into()))
            .and_modify(|p| p.delta += delta)
            .or_insert_with(|| Pending {
                store: store.clone(),
                applied: applied.to_vec(),
                delta,
                on_reply,
            });
        first
    });
    if first {
        actix_web::rt::spawn(async move {
            tokio::time::sleep(period).await;
            flush().await;
        });
    }
}

/// Sends every sum queued on this thread, concurrently.
async fn flush() {
    let Some(queue) = QUEUE.with(|q| q.borrow_mut().take()) else {
        return;
    };
    let calls = queue.into_iter().map(|((_, key, _), p)| async move {
        match p.store.adjust(&key, &p.applied, p.delta).await {
            Ok(ruling) => {
                if let Some(f) = &p.on_reply {
                    f(&ruling);
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, key = %key, delta = p.delta, "a debit was dropped")
            }
        }
    });
    futures_util::future::join_all(calls).await;
}
