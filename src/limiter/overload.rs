//! Overload: a worker that cannot keep up sheds the excess (`503` + `Retry-After`) rather
//! than admit it unchecked.
//!
//! A gateway that fails open when it is busy stops limiting exactly when one client sends
//! far past its contract. So the store's budget counts only the store's time (see
//! [`crate::store::Budget`]), and the gateway's own lateness is handled here, per worker
//! (an actix worker is one thread), with two signals in the manner of Envoy's overload
//! manager (a resource is measured, and past a threshold an action sheds load):
//!
//! - **the event loop's delay**: how long a task that becomes ready waits before it runs,
//!   measured every [`PROBE_EVERY`] by a probe that yields and times its return. Past
//!   `overload.max_delay_ms`, a request whose client already has a decision pending on
//!   this worker is shed: a client sending one request at a time (within its limits, as
//!   far as a worker can tell) is still decided, while the client whose requests crowd the
//!   worker loses the ones it sends on top;
//! - **undecided requests**: past `overload.max_pending` on a worker, every new request is
//!   shed, so what the limiter holds stays bounded whatever arrives.
//!
//! A decision still not made `overload.max_wait_ms` after it began (a worker stalled
//! mid-decision) is shed too (see `Limiter::decide`). Shed requests are never forwarded
//! and are counted (`tollgate_shed_total{reason}`); a shed one spends no token, except
//! one shed at `max_wait_ms` whose call had gone out.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::catalog::ClientEntry;
use crate::configuration::OverloadSettings;
use crate::domain::KeyHash;

/// How often each worker measures its event loop's delay.
pub const PROBE_EVERY: Duration = Duration::from_millis(10);

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// One worker's load as a scrape reads it: written by the worker alone, on a cache line
/// of its own.
#[derive(Default, Debug)]
#[repr(align(128))]
pub struct WorkerLoad {
    /// Requests in the limiter's decision on this worker.
    pending: AtomicUsize,
    /// The event loop's delay, last measured (µs).
    delay_us: AtomicU64,
}

impl WorkerLoad {
    /// Requests undecided on this worker now.
    pub fn pending(&self) -> usize {
        self.pending.load(Relaxed)
    }

    /// The event loop's delay, as last measured.
    pub fn delay(&self) -> Duration {
        Duration::from_micros(self.delay_us.load(Relaxed))
    }
}

/// A worker's own state: its load, and its pending decisions per client.
struct Worker {
    load: Arc<WorkerLoad>,
    /// Undecided requests per client, keyed by the address of the client's catalog
    /// entry (it stays put while a request holds it, and a request holds it while it
    /// counts here).
    by_client: RefCell<HashMap<usize, u32, foldhash::fast::FixedState>>,
    /// The same as `load.pending`, read without an atomic.
    pending: Cell<usize>,
}

thread_local! {
    /// This thread's state per [`Overload`] (one per gateway in a process).
    static WORKERS: RefCell<Vec<(u64, Rc<Worker>)>> = const { RefCell::new(Vec::new()) };
}

/// Watches the workers and decides who is shed.
pub struct Overload {
    id: u64,
    settings: OverloadSettings,
    /// Every worker's load, for `/metrics`.
    loads: Mutex<Vec<Arc<WorkerLoad>>>,
}

/// A request admitted to the limiter: counted as pending on its worker until dropped.
pub struct Pending {
    worker: Rc<Worker>,
    client: usize,
}

impl Drop for Pending {
    fn drop(&mut self) {
        let w = &self.worker;
        w.pending.set(w.pending.get() - 1);
        w.load.pending.store(w.pending.get(), Relaxed);
        let mut by_client = w.by_client.borrow_mut();
        if let Some(n) = by_client.get_mut(&self.client) {
            *n -= 1;
            if *n == 0 {
                by_client.remove(&self.client);
            }
        }
    }
}

impl Overload {
    pub fn new(settings: OverloadSettings) -> Overload {
        Overload {
            id: NEXT_ID.fetch_add(1, Relaxed),
            settings,
            loads: Mutex::default(),
        }
    }

    /// How long a decision may take in all.
    pub fn max_wait(&self) -> Duration {
        self.settings.max_wait
    }

    /// The calling thread's worker state, made on its first request.
    fn worker(&self) -> Rc<Worker> {
        WORKERS.with(|w| {
            if let Some((_, worker)) = w.borrow().iter().find(|(id, _)| *id == self.id) {
                return Rc::clone(worker);
            }
            let load = Arc::new(WorkerLoad::default());
            self.loads
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(Arc::clone(&load));
            let worker = Rc::new(Worker {
                load,
                by_client: RefCell::default(),
                pending: Cell::new(0),
            });
            w.borrow_mut().push((self.id, Rc::clone(&worker)));
            worker
        })
    }

    /// Admits a request of `client` to a decision on this worker, or `None`: shed it.
    pub fn admit(&self, client: &ClientEntry) -> Option<Pending> {
        self.admit_key(std::ptr::from_ref(client) as usize)
    }

    /// Admits a store read for the key `hash` this worker does not hold (cache mode) and
    /// the request waiting on it, or `None`: shed it. Each waits as an undecided request
    /// (`max_pending`). Without a key filter in place (`filtered` false) the keys not held
    /// count as one client: a late worker reads one at a time, so a flood of keys that do
    /// not exist cannot take the worker from the clients it holds. With one, such keys
    /// are refused before they get here, and each key counts as a client of its own: the
    /// first requests of clients not held yet are not shed for the others'.
    pub fn admit_lookup(&self, hash: &KeyHash, filtered: bool) -> Option<Pending> {
        // No catalog entry is at address 1 (entries are aligned), nor has the top bit set.
        let key = if filtered {
            (1 << (usize::BITS - 1)) | hash.word(0) as usize
        } else {
            1
        };
        self.admit_key(key)
    }

    /// [`Overload::admit`] for the client known by `key`.
    pub(super) fn admit_key(&self, key: usize) -> Option<Pending> {
        let worker = self.worker();
        let pending = worker.pending.get();
        {
            let mut by_client = worker.by_client.borrow_mut();
            let mine = by_client.entry(key).or_insert(0);
            let late = worker.load.delay_us.load(Relaxed)
                > u64::try_from(self.settings.max_delay.as_micros()).unwrap_or(u64::MAX);
            if pending >= self.settings.max_pending || (late && *mine > 0) {
                if *mine == 0 {
                    by_client.remove(&key);
                }
                return None;
            }
            *mine += 1;
        }
        worker.pending.set(pending + 1);
        worker.load.pending.store(pending + 1, Relaxed);
        Some(Pending {
            worker,
            client: key,
        })
    }

    /// Measures the calling worker's event-loop delay every [`PROBE_EVERY`], until the
    /// worker ends (spawn once per worker).
    pub async fn watch_worker(&self) {
        let worker = self.worker();
        loop {
            tokio::time::sleep(PROBE_EVERY).await;
            let asked = Instant::now();
            // Behind every task ready now, and one poll of the I/O driver: what a request
            // that becomes ready now waits before it runs.
            tokio::task::yield_now().await;
            let delay = u64::try_from(asked.elapsed().as_micros()).unwrap_or(u64::MAX);
            worker.load.delay_us.store(delay, Relaxed);
        }
    }

    /// Every worker's load, for `/metrics`.
    pub fn loads(&self) -> Vec<Arc<WorkerLoad>> {
        self.loads.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn overload(max_pending: usize) -> Overload {
        Overload::new(OverloadSettings {
            max_delay: Duration::from_millis(10),
            max_pending,
            max_wait: Duration::from_millis(100),
        })
    }

    /// Makes this thread's worker look `late` (or on time) to `o`.
    fn running_late(o: &Overload, late: bool) {
        let us = if late { 20_000 } else { 0 };
        o.worker().load.delay_us.store(us, Relaxed);
    }

    #[test]
    fn a_worker_on_time_decides_everyone() {
        let o = overload(100);
        let held: Vec<_> = (0..10).map(|_| o.admit_key(1).expect("admitted")).collect();
        assert_eq!(o.loads()[0].pending(), 10);
        drop(held);
        assert_eq!(o.loads()[0].pending(), 0);
        assert!(
            o.worker().by_client.borrow().is_empty(),
            "nothing left behind"
        );
    }

    #[test]
    fn a_late_worker_sheds_the_clients_that_already_have_a_decision_pending() {
        let o = overload(100);
        let hot = o.admit_key(1).expect("on time");
        running_late(&o, true);
        assert!(
            o.admit_key(1).is_none(),
            "the client crowding the worker is shed"
        );
        let quiet = o
            .admit_key(2)
            .expect("a client with nothing pending is decided");
        assert!(o.admit_key(2).is_none());
        drop((hot, quiet));
        assert!(
            o.admit_key(1).is_some(),
            "with nothing pending, decided again"
        );
        running_late(&o, false);
        let _both = (o.admit_key(3), o.admit_key(3));
        assert_eq!(o.loads()[0].pending(), 2);
    }

    #[test]
    fn a_late_worker_reads_one_key_it_does_not_hold_at_a_time_and_still_decides_its_clients() {
        let o = overload(100);
        let (k1, k2) = (KeyHash::of("k1"), KeyHash::of("k2"));
        let on_time = (o.admit_lookup(&k1, false), o.admit_lookup(&k2, false));
        assert!(
            on_time.0.is_some() && on_time.1.is_some(),
            "on time: any number"
        );
        drop(on_time);
        running_late(&o, true);
        let first = o.admit_lookup(&k1, false).expect("none pending: read");
        assert!(
            o.admit_lookup(&k2, false).is_none(),
            "a second key not held is shed"
        );
        assert!(o.admit_key(7).is_some(), "a held client is still decided");
        drop(first);
        assert!(
            o.admit_lookup(&k2, false).is_some(),
            "the read done, the next is read"
        );
    }

    #[test]
    fn with_a_key_filter_a_late_worker_reads_each_key_as_a_client_of_its_own() {
        let o = overload(100);
        running_late(&o, true);
        let (k1, k2) = (KeyHash::of("k1"), KeyHash::of("k2"));
        let first = o.admit_lookup(&k1, true).expect("read");
        let second = o.admit_lookup(&k2, true).expect("another key: read too");
        assert!(
            o.admit_lookup(&k1, true).is_none(),
            "the same key again: shed"
        );
        drop((first, second));
    }

    #[test]
    fn past_max_pending_every_new_request_is_shed() {
        let o = overload(3);
        let held: Vec<_> = (0..3)
            .map(|k| o.admit_key(k).expect("under the bound"))
            .collect();
        assert!(o.admit_key(99).is_none(), "a new client too");
        assert!(!o.worker().by_client.borrow().contains_key(&99));
        drop(held);
        assert!(o.admit_key(99).is_some());
    }

    #[test]
    fn each_gateway_in_a_process_counts_its_own() {
        let (a, b) = (overload(1), overload(1));
        let _held = a.admit_key(1).expect("a's first");
        assert!(b.admit_key(1).is_some(), "b has nothing pending");
    }
}
