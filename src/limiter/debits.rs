//! Costs debited after the fact, off the request path: a cost a service reports in its
//! response, and the quotas of a client sharded by region (kept in the global store while
//! its buckets are decided in its region's shard).
//!
//! Debits are summed per worker thread, per client state and set of limits, and each sum
//! goes to the store as one `adjust` call (one `EVALSHA`) when its period ends: a client
//! with many requests in a period costs one call, not one per request, and a sum that
//! comes to nothing (debits and refunds cancelling out) costs none. Nothing here delays a
//! response, and a debit the store refuses, or does not answer within [`ANSWER_WITHIN`],
//! is logged and dropped (the store was down or stalled: the gateway failed open
//! meanwhile anyway).

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use crate::domain::{Applied, Ruling};
use crate::store::Buckets;

/// Called with the levels after a debit.
pub type OnReply = Rc<dyn Fn(&Ruling)>;

/// How long a flush waits for the store's answer to one sum before dropping it (it may
/// still have been applied). Without a bound, a stalled store would keep one waiting flush
/// per period and worker, with every sum it holds, until the connection failed.
pub const ANSWER_WITHIN: Duration = Duration::from_secs(1);

struct Pending {
    buckets: Arc<dyn Buckets>,
    applied: Vec<Applied>,
    delta: f64,
    on_reply: Option<OnReply>,
}

/// (buckets, state key, limit fields) → the sum to send.
type Queue = HashMap<(usize, Box<str>, Box<str>), Pending>;

thread_local! {
    static QUEUE: RefCell<Option<Queue>> = const { RefCell::new(None) };
}

/// Queues `delta` (a refund when negative) on the limits `applied` at `key` in `buckets`,
/// to be sent within `period`, summed with the others for the same state and limits.
/// Must run on a worker thread (a `LocalSet`).
pub fn queue(
    buckets: &Arc<dyn Buckets>,
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
        map.entry((
            Arc::as_ptr(buckets).cast::<()>() as usize,
            key.into(),
            fields.into(),
        ))
        .and_modify(|p| p.delta += delta)
        .or_insert_with(|| Pending {
            buckets: Arc::clone(buckets),
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
    let calls = queue
        .into_iter()
        .filter(|(_, p)| p.delta != 0.0)
        .map(|((_, key, _), p)| async move {
            let answer = tokio::time::timeout(
                ANSWER_WITHIN,
                p.buckets.adjust(&key, &p.applied, p.delta),
            )
            .await;
            match answer {
                Ok(Ok(ruling)) => {
                    if let Some(f) = &p.on_reply {
                        f(&ruling);
                    }
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, key = %key, delta = p.delta, "a debit was dropped")
                }
                Err(_) => tracing::warn!(
                    key = %key,
                    delta = p.delta,
                    "a debit was dropped: no answer within {ANSWER_WITHIN:?} (it may have been applied)"
                ),
            }
        });
    futures_util::future::join_all(calls).await;
}
