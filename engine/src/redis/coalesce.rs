//! One script call for the takes that pile up behind a busy bucket, sent in time.
//!
//! A worker sends a take for a bucket straight away when no call for that bucket is in
//! flight on its thread: an idle gateway decides every request in one round trip, as
//! before. Takes for the same bucket (at the same cost) that arrive while a call is in
//! flight queue behind it, and the queue goes to Redis as one call (`engine/lua/bucket.lua` with
//! `n`), in arrival order, at the first of two moments:
//!
//! - **a call for the bucket returns**: the first queued take leads the next call, for the
//!   whole queue (≤ [`MAX_BATCH`]). With Redis answering well within the budget this is
//!   the only moment that ever comes, so a hot client costs Redis one script call per
//!   round trip per worker instead of one per request;
//! - **the oldest queued take could no longer afford to wait**: its budget's end, less one
//!   round trip and a half (a pessimistic estimate: see [`RoundTrip`]) and 0.5 ms, or, if the
//!   call in flight is late (a Redis that just slowed down makes the estimate stale), a
//!   third of the way from that call's start to the moment the take is due. Then the queue goes
//!   at once, as a call *beside* the calls still in flight.
//!
//! A take that arrives when even that moment has passed (the round trip is as long as its
//! budget) sends its own call at once, with the queue on it.
//!
//! **Why a deadline rather than a fixed number of calls in flight.** Waiting behind a call
//! costs up to one round trip before the take's own round trip, so a queued take needs up to
//! two round trips of its budget: with Redis answering in 60% of it, most queued takes failed
//! open, although each call alone would have been answered in time. Sending at the last
//! affordable moment keeps every take within one round trip plus the wait it can afford,
//! whatever the round trip, and still coalesces as much as the budget allows: a fixed depth
//! of pipelining would be too shallow for a slow Redis and needlessly deep for a fast one.
//!
//! **Why rulings stay exact with several calls for one bucket in flight.** Redis runs each
//! script atomically, and the calls of one connection in the order they were written. Each
//! call returns the tokens at its own start, after every earlier call's subtractions, and
//! the gateway replays its `n` takes from there (`limits::take_many`): each request gets
//! the ruling that one-by-one calls in Redis' order would have given it. Admissions never
//! exceed what the bucket held, because the bucket itself, not the gateway, does the
//! counting.
//!
//! No task is spawned: the lead passes from future to future, and only the oldest queued
//! take keeps a timer. A take's `due` only schedules: the coalescer never gives up on a
//! take. Once its call is written, the store has `redis.timeout_ms` to answer it (`gather`
//! holds that deadline, one per call); a worker so busy that a queued take's moment
//! passes sends it late, and the limiter bounds the whole wait (`limiter::overload`). A
//! take dropped from the queue (its request gone) spent nothing. A leader that is dropped
//! mid-call (its client hung up) answers the requests riding on its call with
//! [`StoreError::Abandoned`], so they fail open at once instead of waiting for a reply
//! nobody will read, and hands the lead to the next queued request. The leader is the
//! newest request on its call, so the limiter's bound never drops it before its riders.
//!
//! A lane's call is one *entry* of a script call: `gather` sends the entries a worker
//! makes in one turn of its event loop, of any clients, as one `EVALSHA`.
//!
//! Lanes live in a thread-local map: an actix worker is one thread, so nothing here is
//! shared between threads or needs a lock.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::future::{poll_fn, Future};
use std::pin::pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Poll, Waker};
use std::time::Duration;

use hashbrown::HashTable;
use tokio::time::Instant;

use crate::limits::{Applied, Ruling};
use crate::StoreError;

/// Most requests one call decides; more wait for the next call.
pub const MAX_BATCH: usize = 512;

/// Kept free at the end of a queued take's budget, beyond the round trip: a timer that
/// fires late, a worker busy with other requests.
const SLACK: Duration = Duration::from_micros(500);

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// One request's take.
#[derive(Debug, Clone, Copy)]
pub struct Take<'a> {
    /// Every limit that applies to the request.
    pub applied: &'a [Applied],
    pub cost: f64,
    /// When the request wants its answer by: a queued take goes beside the call in flight
    /// at the last moment that still meets it. `None`: a queued take waits for a call in
    /// flight to return.
    pub due: Option<Instant>,
}

/// One call: `n` takes of `cost` from one client's limits, as the leader sees them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Batch<'a> {
    pub applied: &'a [Applied],
    pub cost: f64,
    pub n: usize,
}

enum State {
    /// In the queue, waiting for a call.
    Queued,
    /// Riding on a call in flight (or about to be sent) that another request leads.
    Sent,
    /// This request leads the next call, for itself and these riders (older, in order).
    Lead(Vec<Rc<Waiter>>),
    Done(Result<Ruling, StoreError>),
    Finished,
}

struct Waiter {
    state: RefCell<State>,
    waker: RefCell<Option<Waker>>,
}

impl Waiter {
    fn settle(&self, state: State) {
        *self.state.borrow_mut() = state;
        self.wake();
    }

    fn wake(&self) {
        if let Some(w) = self.waker.borrow_mut().take() {
            w.wake();
        }
    }
}

/// A bucket's calls in flight on this worker and the takes queued for the next one. A lane
/// is filed exactly while a call for its bucket is in flight (or a lead is being handed
/// on); then it goes back to the thread's spares, its buffers kept for the next bucket.
#[derive(Default)]
struct Lane {
    /// Whose lane it is (see [`LaneId`]); the bucket's key is copied into a buffer the
    /// lane keeps.
    key: String,
    store: u64,
    cost: u64,
    set: u64,
    /// Calls in flight, and leads handed on but not yet taken up.
    in_flight: usize,
    /// When the calls in flight were sent, oldest first.
    sent: VecDeque<Instant>,
    queue: VecDeque<Rc<Waiter>>,
}

impl Lane {
    /// Takes up to `n` of the queue, oldest first, for a call, marking them sent. The next
    /// oldest left behind (a queue past [`MAX_BATCH`]) keeps the timer from now on.
    fn board(&mut self, n: usize) -> Vec<Rc<Waiter>> {
        let n = self.queue.len().min(n);
        let riders: Vec<Rc<Waiter>> = self.queue.drain(..n).collect();
        for w in &riders {
            *w.state.borrow_mut() = State::Sent;
        }
        if let Some(w) = self.queue.front() {
            w.wake();
        }
        riders
    }

    /// Makes the queue (up to a batch) the next call, led by its newest member: the one
    /// with the most budget left, so the call is dropped only when nobody on it can still
    /// use the answer. Its place in `in_flight` must be reserved already.
    fn launch(&mut self) -> Option<(Rc<Waiter>, Vec<Rc<Waiter>>)> {
        let mut batch = self.board(MAX_BATCH);
        let leader = batch.pop()?;
        Some((leader, batch))
    }
}

type LaneRef = Rc<RefCell<Lane>>;

/// The lanes filed on this thread, found by a hash of their [`LaneId`], and spare ones.
/// With thousands of clients nearly every take files a lane and removes it a round trip
/// later: a spare lane makes that no allocation (the table, the spares and each spare's
/// buffers are reused), and the key is hashed once per lookup.
#[derive(Default)]
struct Lanes {
    /// Each lane with its id's hash (a table that grows rehashes by it, borrowing no lane).
    table: HashTable<(u64, LaneRef)>,
    spare: Vec<LaneRef>,
}

/// Spare lanes kept per thread: enough for the buckets a worker has in flight at once
/// with a few clients each sending bursts; more are freed.
const SPARE_LANES: usize = 256;

thread_local! {
    static LANES: RefCell<Lanes> = RefCell::new(Lanes::default());
}

/// How long a bucket call takes, pessimistically: any longer call raises the estimate at
/// once, shorter ones lower it by an eighth of the difference per call. A queued take
/// trusts it to decide how long it can still wait, so erring long costs a few more calls
/// while erring short costs fail-opens. Shared by the workers (a race between two updates
/// loses one sample, which is harmless).
#[derive(Default)]
struct RoundTrip {
    us: AtomicU64,
}

impl RoundTrip {
    fn estimate(&self) -> Duration {
        Duration::from_micros(self.us.load(Ordering::Relaxed))
    }

    fn observe(&self, took: Duration) {
        let sample = took.as_micros() as u64;
        let old = self.us.load(Ordering::Relaxed);
        let new = if sample >= old {
            sample
        } else {
            old - (old - sample) / 8
        };
        self.us.store(new, Ordering::Relaxed);
    }

    /// The latest moment a take due at `due` can still send its call: one round
    /// trip, half as much again for the variation a call sees on a busy worker (the reply
    /// waits for the worker to poll it), and [`SLACK`] before it.
    ///
    /// A call in flight since `oldest` that has not answered yet says the round trip is at
    /// least its age, whatever the estimate (a store that just slowed down); then the take
    /// also assumes its own call may take twice that age, and sends by the moment that
    /// still fits: a third of the way from `oldest` to `due`.
    fn last_send(&self, due: Instant, oldest: Option<Instant>) -> Option<Instant> {
        let rtt = self.estimate();
        let by_estimate = due.checked_sub(rtt + rtt / 2 + SLACK)?;
        let by_age = oldest
            .filter(|o| *o < due)
            .map(|o| o + (due - o) / 3)
            .and_then(|t| t.checked_sub(SLACK));
        match by_age {
            Some(a) => Some(a.min(by_estimate)),
            None => Some(by_estimate),
        }
    }
}

/// Which limits a take is decided against, as a number: their fields, in order.
fn fingerprint(applied: &[Applied]) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = foldhash::fast::FixedState::with_seed(0).build_hasher();
    for a in applied {
        h.write(a.field.as_bytes());
        h.write_u8(0xff);
    }
    h.finish()
}

/// Coalesces takes for one store.
pub struct Coalescer {
    id: u64,
    rtt: RoundTrip,
}

impl Default for Coalescer {
    fn default() -> Self {
        Coalescer {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            rtt: RoundTrip::default(),
        }
    }
}

/// Where a lane is filed.
#[derive(Clone, Copy)]
struct LaneId<'a> {
    key: &'a str,
    store: u64,
    cost: u64,
    /// Which limits: requests of one client to services with limits of their own decide
    /// against different sets, so they never share a call.
    set: u64,
}

impl LaneId<'_> {
    fn hash(&self) -> u64 {
        use std::hash::BuildHasher;
        foldhash::fast::FixedState::with_seed(0)
            .hash_one((self.key, self.store, self.cost, self.set))
    }

    fn is(&self, lane: &Lane) -> bool {
        lane.key == self.key
            && lane.store == self.store
            && lane.cost == self.cost
            && lane.set == self.set
    }

    fn find(self) -> Option<LaneRef> {
        let hash = self.hash();
        LANES.with(|m| {
            m.borrow()
                .table
                .find(hash, |(h, l)| *h == hash && self.is(&l.borrow()))
                .map(|(_, l)| Rc::clone(l))
        })
    }

    fn open(self) -> LaneRef {
        LANES.with(|m| {
            let m = &mut *m.borrow_mut();
            // A spare nobody holds any more (the last holder of a closed lane lets go of
            // it just after closing it).
            let lane = match m.spare.pop() {
                Some(l) if Rc::strong_count(&l) == 1 => l,
                _ => LaneRef::default(),
            };
            {
                let mut l = lane.borrow_mut();
                l.key.clear();
                l.key.push_str(self.key);
                (l.store, l.cost, l.set) = (self.store, self.cost, self.set);
            }
            let hash = self.hash();
            m.table
                .insert_unique(hash, (hash, Rc::clone(&lane)), |(h, _)| *h);
            lane
        })
    }

    fn close(self) {
        LANES.with(|m| {
            let m = &mut *m.borrow_mut();
            let hash = self.hash();
            let found = m
                .table
                .find_entry(hash, |(h, l)| *h == hash && self.is(&l.borrow()));
            let Ok(entry) = found else {
                return;
            };
            let ((_, lane), _) = entry.remove();
            if m.spare.len() < SPARE_LANES {
                {
                    let mut l = lane.borrow_mut();
                    l.in_flight = 0;
                    l.sent.clear();
                    l.queue.clear();
                }
                m.spare.push(lane);
            }
        });
    }

    /// A call (or a lead reserved for one) is over: the queue becomes the next call, or,
    /// with nobody queued, the call's place is given up and the lane closes once nothing
    /// is in flight.
    fn hand_on(self, lane: &LaneRef) {
        let mut l = lane.borrow_mut();
        match l.launch() {
            Some((leader, riders)) => {
                drop(l);
                leader.settle(State::Lead(riders));
            }
            None => {
                l.in_flight = l.in_flight.saturating_sub(1);
                let idle = l.in_flight == 0;
                drop(l);
                if idle {
                    self.close();
                }
            }
        }
    }
}

/// Ends a lead: hands the lane on, and on cancellation answers the riders.
struct Leading<'a> {
    id: LaneId<'a>,
    lane: LaneRef,
    riders: Vec<Rc<Waiter>>,
    rtt: &'a RoundTrip,
    sent_at: Instant,
    answered: bool,
}

impl Drop for Leading<'_> {
    fn drop(&mut self) {
        if !self.answered {
            // Dropped mid-call: the call took at least this long.
            self.rtt.observe(self.sent_at.elapsed());
        }
        {
            let mut lane = self.lane.borrow_mut();
            if let Some(i) = lane.sent.iter().position(|t| *t == self.sent_at) {
                lane.sent.remove(i);
            }
        }
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
            State::Queued => {
                let mut lane = self.lane.borrow_mut();
                let was_front = lane.queue.front().is_some_and(|w| Rc::ptr_eq(w, &self.me));
                lane.queue.retain(|w| !Rc::ptr_eq(w, &self.me));
                // The next oldest keeps the timer now.
                if let Some(w) = lane.queue.front().filter(|_| was_front) {
                    w.wake();
                }
            }
            // Given the lead and gone before sending: the newest rider leads instead.
            State::Lead(mut riders) => match riders.pop() {
                Some(next) => next.settle(State::Lead(riders)),
                None => self.id.hand_on(&self.lane),
            },
            State::Sent | State::Done(_) | State::Finished => {}
        }
    }
}

impl Coalescer {
    /// Decides `take` on the bucket `key` with `call`, alone or with other takes queued
    /// for the same bucket. `call` must return one ruling per request, in order, and
    /// bounds its own wait for the store.
    pub async fn take<'a, F, Fut>(
        &self,
        key: &str,
        take: Take<'a>,
        call: F,
    ) -> Result<Ruling, StoreError>
    where
        F: Fn(Batch<'a>) -> Fut,
        Fut: Future<Output = Result<Vec<Ruling>, StoreError>>,
    {
        let id = LaneId {
            key,
            store: self.id,
            cost: take.cost.to_bits(),
            set: fingerprint(take.applied),
        };
        let Some(lane) = id.find() else {
            // Idle: send at once.
            let lane = id.open();
            lane.borrow_mut().in_flight = 1;
            return self.lead(id, lane, take, Vec::new(), call).await;
        };
        let due = match self.due(&lane, take.due) {
            Ok(due) => due,
            // It cannot afford to wait at all: its own call now, the queue on it.
            Err(riders) => return self.lead(id, lane, take, riders, call).await,
        };
        let me = Rc::new(Waiter {
            state: RefCell::new(State::Queued),
            waker: RefCell::new(None),
        });
        lane.borrow_mut().queue.push_back(Rc::clone(&me));
        let mut queued = Queued {
            id,
            lane: Rc::clone(&lane),
            me: Rc::clone(&me),
            armed: true,
        };
        // Armed only while this take is the oldest in the queue.
        let mut timer = pin!(None::<tokio::time::Sleep>);
        let answer = poll_fn(|cx| {
            let state = std::mem::replace(&mut *me.state.borrow_mut(), State::Finished);
            match state {
                State::Queued => {
                    *me.state.borrow_mut() = State::Queued;
                    if let Some(riders) = self.launch_if_due(&me, &lane, due, timer.as_mut(), cx) {
                        return Poll::Ready(Err(riders));
                    }
                    *me.waker.borrow_mut() = Some(cx.waker().clone());
                    Poll::Pending
                }
                State::Sent => {
                    *me.state.borrow_mut() = State::Sent;
                    *me.waker.borrow_mut() = Some(cx.waker().clone());
                    Poll::Pending
                }
                State::Lead(riders) => Poll::Ready(Err(riders)),
                State::Done(r) => Poll::Ready(Ok(r)),
                State::Finished => Poll::Ready(Ok(Err(StoreError::Abandoned))),
            }
        })
        .await;
        queued.armed = false;
        match answer {
            Ok(answer) => answer,
            Err(riders) => self.lead(id, lane, take, riders, call).await,
        }
    }

    /// When a take that wants its answer by `due` must be sent to keep its budget, given
    /// the calls in flight on `lane`: it queues until then (`Ok`; `None`: no budget, it
    /// waits for its turn). `Err`: it cannot afford to wait at all, and leads a call now
    /// with the queue on it (these riders; the lane counts the call in flight).
    fn due(
        &self,
        lane: &LaneRef,
        due: Option<Instant>,
    ) -> Result<Option<Instant>, Vec<Rc<Waiter>>> {
        let oldest = lane.borrow().sent.front().copied();
        match due {
            Some(d) => match self.rtt.last_send(d, oldest) {
                Some(t) if t > Instant::now() => Ok(Some(d)),
                _ => {
                    let mut l = lane.borrow_mut();
                    l.in_flight += 1;
                    Err(l.board(MAX_BATCH - 1))
                }
            },
            None => Ok(None),
        }
    }

    /// For a take `me` queued on `lane` until `due`: while it is the oldest in the queue,
    /// arms the `timer` for the last moment it can be sent, and when that comes sends the
    /// queue beside the calls in flight. `Some`: `me` leads that call, with these riders.
    fn launch_if_due(
        &self,
        me: &Rc<Waiter>,
        lane: &LaneRef,
        due: Option<Instant>,
        mut timer: std::pin::Pin<&mut Option<tokio::time::Sleep>>,
        cx: &mut std::task::Context<'_>,
    ) -> Option<Vec<Rc<Waiter>>> {
        let front = lane
            .borrow()
            .queue
            .front()
            .is_some_and(|w| Rc::ptr_eq(w, me));
        let (true, Some(due)) = (front, due) else {
            return None;
        };
        if timer.is_none() {
            let since = lane.borrow().sent.front().copied();
            let at = self.rtt.last_send(due, since);
            // None: no time left to wait at all.
            let at = at.unwrap_or_else(Instant::now);
            timer.set(Some(tokio::time::sleep_until(at)));
        }
        let due = timer
            .as_mut()
            .as_pin_mut()
            .is_some_and(|t| t.poll(cx).is_ready());
        if !due {
            return None;
        }
        // Waiting any longer would cost this take its budget: the queue goes now, beside
        // the calls in flight.
        let launched = {
            let mut l = lane.borrow_mut();
            let launched = l.launch();
            l.in_flight += usize::from(launched.is_some());
            launched
        };
        match launched {
            Some((leader, riders)) if Rc::ptr_eq(&leader, me) => Some(riders),
            Some((leader, riders)) => {
                leader.settle(State::Lead(riders));
                None
            }
            None => None,
        }
    }

    /// Sends one call for `riders` (older, in order) and this take, last (its place in the
    /// lane is reserved).
    #[allow(clippy::too_many_arguments)]
    async fn lead<'a, F, Fut>(
        &self,
        id: LaneId<'_>,
        lane: LaneRef,
        take: Take<'a>,
        riders: Vec<Rc<Waiter>>,
        call: F,
    ) -> Result<Ruling, StoreError>
    where
        F: Fn(Batch<'a>) -> Fut,
        Fut: Future<Output = Result<Vec<Ruling>, StoreError>>,
    {
        let n = 1 + riders.len();
        let mine = riders.len();
        let sent_at = Instant::now();
        lane.borrow_mut().sent.push_back(sent_at);
        let mut leading = Leading {
            id,
            lane,
            riders,
            rtt: &self.rtt,
            sent_at,
            answered: false,
        };
        let reply = call(Batch {
            applied: take.applied,
            cost: take.cost,
            n,
        })
        .await;
        leading.answered = true;
        self.rtt.observe(leading.sent_at.elapsed());
        let riders = std::mem::take(&mut leading.riders);
        let mine = match reply {
            Ok(rulings) if rulings.len() == n => {
                let mut riders = riders.iter();
                let mut own = None;
                for (i, v) in rulings.into_iter().enumerate() {
                    if i == mine {
                        own = Some(v);
                    } else if let Some(w) = riders.next() {
                        w.settle(State::Done(Ok(v)));
                    }
                }
                own.ok_or(StoreError::Abandoned)
            }
            Ok(rulings) => {
                let e = StoreError::Protocol(format!("{} rulings for {n} requests", rulings.len()));
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
    use crate::limits::{take_many, Bucket, Level};

    static ONE_BUCKET: std::sync::LazyLock<Vec<Applied>> = std::sync::LazyLock::new(|| {
        vec![crate::redis::fixtures::default_bucket(
            Bucket::new(3.0, 0.001).unwrap(),
        )]
    });

    fn take() -> Take<'static> {
        Take {
            applied: &ONE_BUCKET,
            cost: 1.0,
            due: None,
        }
    }

    /// `n` takes from a bucket holding `tokens`, as the script decides them.
    fn rulings(tokens: f64, b: Batch) -> Vec<Ruling> {
        take_many(b.applied, vec![Level::Tokens(tokens)], b.cost, b.n, 0)
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

        async fn call(&self, b: Batch<'_>) -> Result<Vec<Ruling>, StoreError> {
            self.batches.borrow_mut().push(b.n);
            self.go.notified().await;
            let answers = rulings(self.tokens.get(), b);
            let spent = answers.iter().filter(|v| v.allowed).count() as f64 * b.cost;
            self.tokens.set(self.tokens.get() - spent);
            Ok(answers)
        }
    }

    /// A take of one token from "k" on its own local task, given up after `budget_ms`.
    fn spawn_take(
        c: &Rc<Coalescer>,
        store: &Rc<Slow>,
        budget_ms: u64,
    ) -> tokio::task::JoinHandle<Result<Result<Ruling, StoreError>, tokio::time::error::Elapsed>>
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

    /// The lane a call files is a spare from an earlier bucket's call, holding nothing of
    /// it: found only under its new bucket, and queued takes go behind the new call.
    #[tokio::test]
    async fn a_lane_is_reused_for_the_next_bucket_and_found_only_under_it() {
        let local = tokio::task::LocalSet::new();
        local
            .run_until(async {
                let c = Rc::new(Coalescer::default());
                let store = Slow::new(3.0);
                let filed = || {
                    LANES.with(|m| {
                        let m = m.borrow();
                        let keys: Vec<String> = m
                            .table
                            .iter()
                            .map(|(_, l)| l.borrow().key.clone())
                            .collect();
                        let ptrs: Vec<*const RefCell<Lane>> =
                            m.table.iter().map(|(_, l)| Rc::as_ptr(l)).collect();
                        (keys, ptrs)
                    })
                };
                let take_from = |key: &'static str| {
                    let (c, store) = (Rc::clone(&c), Rc::clone(&store));
                    tokio::task::spawn_local(
                        async move { c.take(key, take(), |b| store.call(b)).await },
                    )
                };

                // A call for "first", answered: its lane goes back to the spares.
                let first = take_from("first");
                settle().await;
                let (keys, before) = filed();
                assert_eq!(keys, ["first"]);
                store.go.notify_one();
                assert!(first.await.unwrap().unwrap().allowed);
                assert!(filed().0.is_empty());
                let spares = || LANES.with(|m| m.borrow().spare.len());
                assert_eq!(spares(), 1);

                // A call for "second" files the same lane, now under "second" alone.
                let second = take_from("second");
                settle().await;
                assert_eq!(spares(), 0);
                let (keys, after) = filed();
                assert_eq!((keys, &after), (vec!["second".to_string()], &before));
                let behind = take_from("second");
                let elsewhere = take_from("first");
                settle().await;
                assert_eq!(
                    *store.batches.borrow(),
                    [1, 1, 1],
                    "first, second, first again"
                );

                // Both calls answered: the one queued behind "second" goes next, alone.
                store.go.notify_waiters();
                settle().await;
                assert!(second.await.unwrap().unwrap().allowed);
                assert!(elsewhere.await.unwrap().unwrap().allowed);
                store.go.notify_waiters();
                assert!(
                    !behind.await.unwrap().unwrap().allowed,
                    "three tokens, four takes"
                );
                assert_eq!(*store.batches.borrow(), [1, 1, 1, 1]);
                assert!(filed().0.is_empty());
            })
            .await;
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
                assert!(LANES.with(|m| m.borrow().table.is_empty()));
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
                // Queued behind the first call: `rider`, then `leader`, which (the newest)
                // will lead the next call with `rider` on it, and give up (a budget
                // shorter than the rider's) while that call is in flight.
                let rider = spawn(1_000);
                settle().await;
                let leader = spawn(500);
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

    /// A Redis seen through a slow network: a call is run (in order, atomically) as it is
    /// sent, and its reply arrives when `go` says so. Records (size, tokens at start) per
    /// call.
    struct Pipelined {
        calls: RefCell<Vec<(usize, f64)>>,
        tokens: Cell<f64>,
        go: tokio::sync::Notify,
    }

    impl Pipelined {
        fn new(tokens: f64) -> Rc<Pipelined> {
            Rc::new(Pipelined {
                calls: RefCell::new(Vec::new()),
                tokens: Cell::new(tokens),
                go: tokio::sync::Notify::new(),
            })
        }

        async fn call(&self, b: Batch<'_>) -> Result<Vec<Ruling>, StoreError> {
            let start = self.tokens.get();
            self.calls.borrow_mut().push((b.n, start));
            let answers = rulings(start, b);
            let spent = answers.iter().filter(|v| v.allowed).count() as f64 * b.cost;
            self.tokens.set(start - spent);
            self.go.notified().await;
            Ok(answers)
        }

        fn sizes(&self) -> Vec<usize> {
            self.calls.borrow().iter().map(|(n, _)| *n).collect()
        }
    }

    /// A take of one token from "k" due `budget_ms` from now (`None`: none).
    fn spawn_due_take(
        c: &Rc<Coalescer>,
        store: &Rc<Pipelined>,
        budget_ms: Option<u64>,
    ) -> tokio::task::JoinHandle<Result<Ruling, StoreError>> {
        let (c, store) = (Rc::clone(c), Rc::clone(store));
        let t = Take {
            due: budget_ms.map(|ms| Instant::now() + Duration::from_millis(ms)),
            ..take()
        };
        tokio::task::spawn_local(async move { c.take("k", t, |b| store.call(b)).await })
    }

    #[tokio::test]
    async fn a_queue_that_cannot_wait_for_the_call_in_flight_sends_its_own_beside_it() {
        let local = tokio::task::LocalSet::new();
        local
            .run_until(async {
                // Calls have taken 300 ms; a take with 1 s to go waits behind a call in
                // flight for at most a third of its budget (~333 ms) when that call is late.
                let c = Rc::new(Coalescer::default());
                c.rtt.observe(Duration::from_millis(300));
                let store = Pipelined::new(2.0);
                let first = spawn_due_take(&c, &store, Some(1_000));
                settle().await;
                let second = spawn_due_take(&c, &store, Some(1_000));
                settle().await;
                let third = spawn_due_take(&c, &store, Some(1_000));
                settle().await;
                assert_eq!(store.sizes(), [1], "the queue waits while it can");

                // The first call has not answered when the oldest queued take must send.
                tokio::time::sleep(Duration::from_millis(550)).await;
                settle().await;
                assert_eq!(store.sizes(), [1, 2], "a second call beside the first");
                store.go.notify_waiters();

                // Exact: each call started from the tokens the one before it left, and the
                // rulings follow arrival order.
                assert_eq!(*store.calls.borrow(), [(1, 2.0), (2, 1.0)]);
                assert!(first.await.unwrap().unwrap().allowed);
                assert!(second.await.unwrap().unwrap().allowed);
                assert!(!third.await.unwrap().unwrap().allowed);
                assert!(LANES.with(|m| m.borrow().table.is_empty()));
            })
            .await;
    }

    #[tokio::test]
    async fn with_a_quick_round_trip_the_queue_waits_for_the_call_in_flight() {
        let local = tokio::task::LocalSet::new();
        local
            .run_until(async {
                let c = Rc::new(Coalescer::default());
                c.rtt.observe(Duration::from_millis(1));
                let store = Pipelined::new(10.0);
                let first = spawn_due_take(&c, &store, Some(1_000));
                settle().await;
                let queued: Vec<_> = (0..3)
                    .map(|_| spawn_due_take(&c, &store, Some(1_000)))
                    .collect();
                tokio::time::sleep(Duration::from_millis(50)).await;
                assert_eq!(store.sizes(), [1]);
                store.go.notify_waiters();
                assert!(first.await.unwrap().unwrap().allowed);
                settle().await;
                assert_eq!(
                    store.sizes(),
                    [1, 3],
                    "one call for the queue when it returns"
                );
                store.go.notify_waiters();
                for q in queued {
                    assert!(q.await.unwrap().unwrap().allowed);
                }
            })
            .await;
    }

    #[tokio::test]
    async fn a_take_that_cannot_afford_any_wait_sends_at_once_after_the_queue() {
        let local = tokio::task::LocalSet::new();
        local
            .run_until(async {
                // Calls take longer than this take's whole budget.
                let c = Rc::new(Coalescer::default());
                c.rtt.observe(Duration::from_millis(500));
                let store = Pipelined::new(2.0);
                let first = spawn_due_take(&c, &store, None);
                settle().await;
                let queued = spawn_due_take(&c, &store, None);
                settle().await;
                let hurried = spawn_due_take(&c, &store, Some(100));
                settle().await;
                // Its own call at once, with the older queued take first on it.
                assert_eq!(store.sizes(), [1, 2]);
                store.go.notify_waiters();
                assert!(first.await.unwrap().unwrap().allowed);
                assert!(queued.await.unwrap().unwrap().allowed);
                assert!(!hurried.await.unwrap().unwrap().allowed);
            })
            .await;
    }

    #[tokio::test]
    async fn past_its_due_a_queued_take_is_sent_beside_the_call_in_flight_never_given_up() {
        let local = tokio::task::LocalSet::new();
        local
            .run_until(async {
                let c = Rc::new(Coalescer::default());
                let store = Pipelined::new(10.0);
                // A leader whose call does not answer for a long time...
                let leader = spawn_due_take(&c, &store, Some(100));
                settle().await;
                // ...and a take due before it answers, queued behind it.
                let queued = spawn_due_take(&c, &store, Some(50));
                settle().await;
                tokio::time::sleep(Duration::from_millis(200)).await;
                settle().await;
                // Past both dues, nothing gave up: the queued take went beside the leader's
                // call, and both are answered when the store answers.
                assert_eq!(store.sizes(), [1, 1]);
                assert!(!leader.is_finished() && !queued.is_finished());
                store.go.notify_waiters();
                assert!(leader.await.unwrap().unwrap().allowed);
                assert!(queued.await.unwrap().unwrap().allowed);
                assert_eq!(*store.calls.borrow(), [(1, 10.0), (1, 9.0)]);
            })
            .await;
    }
}
