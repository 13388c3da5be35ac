//! One script call for the takes that pile up behind a busy bucket.
//!
//! A worker sends a take for a bucket straight away when no call for that bucket is in
//! flight on its thread: an idle gateway decides every request in one round trip, as
//! before. Takes for the same bucket (at the same cost) that arrive while a call is in
//! flight queue behind it; when it returns, the first of them leads the next call, which
//! decides the whole queue at once (`lua/bucket.lua` with `n`), in arrival order. So a hot
//! client costs Redis one script call per round trip per worker instead of one per
//! request, and every request still gets the exact verdict that one-by-one calls at that
//! instant would have given it.
//!
//! No task is spawned: the lead passes from future to future. A leader that is dropped
//! mid-call (its decision budget ran out) answers the requests riding on its call with
//! [`StoreError::Abandoned`], so they fail open at once instead of waiting for a reply
//! nobody will read, and hands the lead to the next queued request.
//!
//! Lanes live in a thread-local map: an actix worker is one thread, so nothing here is
//! shared between threads or needs a lock.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::future::{poll_fn, Future};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Poll, Waker};

use super::StoreError;
use crate::domain::Plan;
use crate::limiter::Verdict;

/// Most requests one call decides; more wait for the next call.
pub const MAX_BATCH: usize = 512;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// One request's take.
#[derive(Debug, Clone, Copy)]
pub struct Take {
    pub plan: Plan,
    pub cost: f64,
    /// Tokens a bucket that does not exist yet starts with (default: full).
    pub initial: Option<f64>,
}

/// One call: `n` takes of `cost` from one bucket, under the leader's plan.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Batch {
    pub plan: Plan,
    pub cost: f64,
    pub initial: Option<f64>,
    pub n: usize,
}

enum State {
    Waiting,
    /// This request leads the next call.
    Lead,
    Done(Result<Verdict, StoreError>),
    Finished,
}

struct Waiter {
    state: RefCell<State>,
    waker: RefCell<Option<Waker>>,
}

impl Waiter {
    fn settle(&self, state: State) {
        *self.state.borrow_mut() = state;
        if let Some(w) = self.waker.borrow_mut().take() {
            w.wake();
        }
    }
}

/// The takes queued behind a bucket's in-flight call. A lane exists exactly while a call
/// for its bucket is in flight (or its lead is being handed on).
#[derive(Default)]
struct Lane {
    queue: VecDeque<Rc<Waiter>>,
}

type LaneRef = Rc<RefCell<Lane>>;

/// Per bucket key: (coalescer, cost bits, lane). Lookups by `&str` allocate nothing.
type Lanes = HashMap<Box<str>, Vec<(u64, u64, LaneRef)>, foldhash::fast::RandomState>;

thread_local! {
    static LANES: RefCell<Lanes> = RefCell::new(HashMap::default());
}

/// Coalesces takes for one store.
pub struct Coalescer {
    id: u64,
    calls: AtomicU64,
    takes: AtomicU64,
}

impl Default for Coalescer {
    fn default() -> Self {
        Coalescer {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            calls: AtomicU64::new(0),
            takes: AtomicU64::new(0),
        }
    }
}

/// Where a lane is filed.
#[derive(Clone, Copy)]
struct LaneId<'a> {
    key: &'a str,
    store: u64,
    cost: u64,
}

impl LaneId<'_> {
    fn find(self) -> Option<LaneRef> {
        LANES.with(|m| {
            m.borrow().get(self.key).and_then(|v| {
                v.iter()
                    .find(|(s, c, _)| *s == self.store && *c == self.cost)
                    .map(|(_, _, l)| Rc::clone(l))
            })
        })
    }

    fn open(self) -> LaneRef {
        let lane = LaneRef::default();
        LANES.with(|m| {
            m.borrow_mut().entry(self.key.into()).or_default().push((
                self.store,
                self.cost,
                Rc::clone(&lane),
            ))
        });
        lane
    }

    fn close(self) {
        LANES.with(|m| {
            let mut m = m.borrow_mut();
            if let Some(v) = m.get_mut(self.key) {
                v.retain(|(s, c, _)| !(*s == self.store && *c == self.cost));
                if v.is_empty() {
                    m.remove(self.key);
                }
            }
        });
    }

    /// The call in flight is over: the first queued request leads the next one, or, with
    /// nobody queued, the lane closes.
    fn hand_on(self, lane: &LaneRef) {
        let next = lane.borrow_mut().queue.pop_front();
        match next {
            Some(w) => w.settle(State::Lead),
            None => self.close(),
        }
    }
}

/// Ends a lead: hands the lane on, and on cancellation answers the riders.
struct Leading<'a> {
    id: LaneId<'a>,
    lane: LaneRef,
    riders: Vec<Rc<Waiter>>,
}

impl Drop for Leading<'_> {
    fn drop(&mut self) {
        // Riders still here were not answered: the leader was dropped mid-call.
        for w in self.riders.drain(..) {
            w.settle(State::Done(Err(StoreError::Abandoned)));
        }
        self.id.hand_on(&self.lane);
    }
}

/// A queued request; if it is dropped, it leaves the queue (or passes on a lead it got).
struct Queued<'a> {
    id: LaneId<'a>,
    lane: LaneRef,
    me: Rc<Waiter>,
    armed: bool,
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let state = std::mem::replace(&mut *self.me.state.borrow_mut(), State::Finished);
        match state {
            State::Waiting => self
                .lane
                .borrow_mut()
                .queue
                .retain(|w| !Rc::ptr_eq(w, &self.me)),
            State::Lead => self.id.hand_on(&self.lane),
            State::Done(_) | State::Finished => {}
        }
    }
}

impl Coalescer {
    /// Calls made and the takes they decided, since start.
    pub fn counts(&self) -> (u64, u64) {
        (
            self.calls.load(Ordering::Relaxed),
            self.takes.load(Ordering::Relaxed),
        )
    }

    /// Decides `take` on the bucket `key` with `call`, alone or with the takes queued
    /// behind the call in flight. `call` must return one verdict per request, in order.
    pub async fn take<F, Fut>(&self, key: &str, take: Take, call: F) -> Result<Verdict, StoreError>
    where
        F: Fn(Batch) -> Fut,
        Fut: Future<Output = Result<Vec<Verdict>, StoreError>>,
    {
        let id = LaneId {
            key,
            store: self.id,
            cost: take.cost.to_bits(),
        };
        let lane = match id.find() {
            None => id.open(),
            Some(lane) => {
                let me = Rc::new(Waiter {
                    state: RefCell::new(State::Waiting),
                    waker: RefCell::new(None),
                });
                lane.borrow_mut().queue.push_back(Rc::clone(&me));
                let mut queued = Queued {
                    id,
                    lane: Rc::clone(&lane),
                    me: Rc::clone(&me),
                    armed: true,
                };
                let lead = poll_fn(|cx| {
                    let mut state = me.state.borrow_mut();
                    match std::mem::replace(&mut *state, State::Finished) {
                        State::Waiting => {
                            *state = State::Waiting;
                            *me.waker.borrow_mut() = Some(cx.waker().clone());
                            Poll::Pending
                        }
                        State::Lead => Poll::Ready(None),
                        State::Done(r) => Poll::Ready(Some(r)),
                        State::Finished => Poll::Ready(Some(Err(StoreError::Abandoned))),
                    }
                })
                .await;
                queued.armed = false;
                if let Some(answer) = lead {
                    return answer;
                }
                lane
            }
        };
        self.lead(id, lane, take, call).await
    }

    async fn lead<F, Fut>(
        &self,
        id: LaneId<'_>,
        lane: LaneRef,
        take: Take,
        call: F,
    ) -> Result<Verdict, StoreError>
    where
        F: Fn(Batch) -> Fut,
        Fut: Future<Output = Result<Vec<Verdict>, StoreError>>,
    {
        let riders: Vec<Rc<Waiter>> = {
            let mut lane = lane.borrow_mut();
            let n = lane.queue.len().min(MAX_BATCH - 1);
            lane.queue.drain(..n).collect()
        };
        let mut leading = Leading { id, lane, riders };
        let n = 1 + leading.riders.len();
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.takes.fetch_add(n as u64, Ordering::Relaxed);
        let reply = call(Batch {
            plan: take.plan,
            cost: take.cost,
            initial: take.initial,
            n,
        })
        .await;
        let riders = std::mem::take(&mut leading.riders);
        let mine = match reply {
            Ok(verdicts) if verdicts.len() == n => {
                let mut verdicts = verdicts.into_iter();
                let mine = verdicts.next();
                for (w, v) in riders.iter().zip(verdicts) {
                    w.settle(State::Done(Ok(v)));
                }
                mine.ok_or(StoreError::Abandoned)
            }
            Ok(verdicts) => {
                let e =
                    StoreError::Protocol(format!("{} verdicts for {n} requests", verdicts.len()));
                for w in &riders {
                    w.settle(State::Done(Err(e.clone())));
                }
                Err(e)
            }
            Err(e) => {
                for w in &riders {
                    w.settle(State::Done(Err(e.clone())));
                }
                Err(e)
            }
        };
        drop(leading);
        mine
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use std::cell::Cell;

    use tokio::sync::mpsc;

    use super::*;
    use crate::limiter::bucket;

    fn take() -> Take {
        Take {
            plan: Plan::new(3.0, 0.001).unwrap(),
            cost: 1.0,
            initial: None,
        }
    }

    /// A store whose calls wait for `go`, and which records each batch's size.
    struct Slow {
        batches: RefCell<Vec<usize>>,
        tokens: Cell<f64>,
        go: tokio::sync::Notify,
    }

    impl Slow {
        fn new(tokens: f64) -> Rc<Slow> {
            Rc::new(Slow {
                batches: RefCell::new(Vec::new()),
                tokens: Cell::new(tokens),
                go: tokio::sync::Notify::new(),
            })
        }

        async fn call(&self, b: Batch) -> Result<Vec<Verdict>, StoreError> {
            self.batches.borrow_mut().push(b.n);
            self.go.notified().await;
            let verdicts = bucket::take_many(self.tokens.get(), b.plan, b.cost, b.n);
            let spent = verdicts.iter().filter(|v| v.allowed).count() as f64 * b.cost;
            self.tokens.set(self.tokens.get() - spent);
            Ok(verdicts)
        }
    }

    /// A take of one token from "k" on its own local task, given up after `budget_ms`.
    fn spawn_take(
        c: &Rc<Coalescer>,
        store: &Rc<Slow>,
        budget_ms: u64,
    ) -> tokio::task::JoinHandle<Result<Result<Verdict, StoreError>, tokio::time::error::Elapsed>>
    {
        let (c, store) = (Rc::clone(c), Rc::clone(store));
        tokio::task::spawn_local(async move {
            tokio::time::timeout(
                Duration::from_millis(budget_ms),
                c.take("k", take(), |b| store.call(b)),
            )
            .await
        })
    }

    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn takes_behind_a_call_in_flight_go_together_and_in_order() {
        let local = tokio::task::LocalSet::new();
        local
            .run_until(async {
                let c = Rc::new(Coalescer::default());
                let store = Slow::new(3.0);
                let (tx, mut rx) = mpsc::unbounded_channel();
                for i in 0..5 {
                    let (c, store, tx) = (Rc::clone(&c), Rc::clone(&store), tx.clone());
                    tokio::task::spawn_local(async move {
                        let v = c.take("k", take(), |b| store.call(b)).await;
                        tx.send((i, v.unwrap())).unwrap();
                    });
                    settle().await;
                }
                // The first went alone; four queued behind it.
                assert_eq!(*store.batches.borrow(), [1]);
                store.go.notify_one();
                settle().await;
                assert_eq!(*store.batches.borrow(), [1, 4]);
                store.go.notify_one();
                settle().await;
                drop(tx);
                let mut got = Vec::new();
                while let Some((i, v)) = rx.recv().await {
                    got.push((i, v.allowed));
                }
                got.sort_by_key(|(i, _)| *i);
                assert_eq!(
                    got,
                    [(0, true), (1, true), (2, true), (3, false), (4, false)]
                );
                // Idle again: the lane is gone and the next take goes alone.
                assert!(LANES.with(|m| m.borrow().is_empty()));
            })
            .await;
    }

    #[tokio::test]
    async fn a_dropped_leader_releases_its_riders_and_hands_on_the_lead() {
        let local = tokio::task::LocalSet::new();
        local
            .run_until(async {
                let c = Rc::new(Coalescer::default());
                let store = Slow::new(10.0);
                let spawn = |budget_ms| spawn_take(&c, &store, budget_ms);
                let first = spawn(1_000);
                settle().await;
                // Queued behind the first call: `leader` will lead the next one, with
                // `rider` on it, and give up (its budget) while that call is in flight.
                let leader = spawn(500);
                settle().await;
                let rider = spawn(1_000);
                settle().await;
                store.go.notify_one();
                assert!(first.await.unwrap().unwrap().unwrap().allowed);
                settle().await;
                assert_eq!(*store.batches.borrow(), [1, 2]);
                assert!(leader.await.unwrap().is_err(), "the leader timed out");
                let rider = rider.await.unwrap().expect("answered before its budget");
                assert!(matches!(rider, Err(StoreError::Abandoned)));
                // Nobody is left holding the lane: a new take leads its own call.
                let next = spawn(1_000);
                settle().await;
                store.go.notify_one();
                assert!(next.await.unwrap().unwrap().unwrap().allowed);
                assert_eq!(*store.batches.borrow(), [1, 2, 1]);
            })
            .await;
    }

    #[tokio::test]
    async fn a_queued_take_that_gives_up_leaves_the_queue() {
        let local = tokio::task::LocalSet::new();
        local
            .run_until(async {
                let c = Rc::new(Coalescer::default());
                let store = Slow::new(10.0);
                let spawn = |budget_ms| spawn_take(&c, &store, budget_ms);
                let leader = spawn(1_000);
                settle().await;
                let quitter = spawn(10);
                settle().await;
                let stayer = spawn(1_000);
                settle().await;
                assert!(quitter.await.unwrap().is_err());
                store.go.notify_one();
                assert!(leader.await.unwrap().unwrap().unwrap().allowed);
                settle().await;
                store.go.notify_one();
                assert!(stayer.await.unwrap().unwrap().unwrap().allowed);
                // The one that gave up took nothing: the second call decided one request.
                assert_eq!(*store.batches.borrow(), [1, 1]);
            })
            .await;
    }
}
