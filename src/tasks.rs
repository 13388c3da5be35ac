//! Background work with an owner: every long-lived task of the gateway starts here, under
//! a name and a [`Policy`], and is joined when the gateway stops.
//!
//! Start-up makes one [`Supervisor`] and hands out [`Tasks`], a cheap handle to start
//! tasks with, to the parts that have background work (the catalog's refresh, the
//! limiter's probers and reconciler, the health checker, the `SIGHUP` listener, ...).
//! A task is a function that makes the work, given a [`CancellationToken`] it must end
//! at; the supervisor calls it again for each restart. The work may be a future on the
//! runtime ([`Tasks::spawn`]), a future on the calling thread's `LocalSet` (an actix
//! worker's: [`Tasks::spawn_local`]), or a named OS thread ([`Tasks::spawn_thread`]).
//!
//! When a task panics (tokio reports it as a `JoinError` that `is_panic`; a thread's is
//! caught with `catch_unwind`) or ends before the gateway stops, the supervisor logs it
//! with the task's name and the panic's message, counts it ([`Tasks::restarts`]) and
//! follows the task's [`Policy`]: start it again after a pause, or stop the gateway.
//! [`Supervisor::shutdown`] cancels every task and waits for each, up to a deadline,
//! naming any that did not stop in time; dropping the supervisor cancels them too.
//!
//! What does not start here, and why: work that belongs to one request or one call and
//! ends with it. The limiter's debit flush (`limiter::debits`, one period after the first
//! debit a worker queues), a late decision seen through after its request was shed
//! (`Limiter::decide`), one health check (a child of the checker's thread, ending with
//! it), the catalog cache's write (awaited where it is made), and the store's own tasks
//! (`store::redis`: a connection's driver, which ends with its socket; a batch's send; a
//! read of the cluster's slot map), each owned by the connection or call that made it.
//! None of them outlives what started it by more than a bounded wait, none holds state a
//! restart could repair, and supervising each would put a registry write on the request
//! path. The OTLP exporter's thread (`trace::export`, task `span-export`) is here: a
//! thread of its own, its queue kept across a restart.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::task::JoinHandle;
use tokio::time::Instant;
pub use tokio_util::sync::CancellationToken;

/// What the supervisor does when a task panics or ends before the gateway stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Start it again after a pause that doubles from [`Pauses::first`] up to
    /// [`Pauses::max`], and starts over after a run of [`Pauses::steady`]; as often as it
    /// fails. For work the gateway serves without for a while (it fails open, or serves
    /// what it knew), and that starts cleanly again.
    Restart,
    /// Start it again as [`Policy::Restart`] does, at most `restarts` times in a row (runs
    /// shorter than [`Pauses::steady`]); the failure after that stops the gateway
    /// gracefully (its servers finish what they serve, its tasks are joined, and
    /// `run_until_stopped` returns the failure). For work without which the gateway must
    /// not go on serving; `restarts: 0` stops it at the first failure, where a restart
    /// cannot be right.
    Essential { restarts: u32 },
    /// Work that ends when it is done (a retry at start-up, a one-off check): its end is
    /// no failure; a panic starts it again as [`Policy::Restart`] does.
    UntilDone,
}

/// The pauses between restarts.
#[derive(Debug, Clone, Copy)]
pub struct Pauses {
    /// Before the first restart.
    pub first: Duration,
    /// The longest pause: a task failing at once every time is started again at this pace.
    pub max: Duration,
    /// A run at least this long was a success: the next failure pauses [`Pauses::first`]
    /// again, and is the first in a row.
    pub steady: Duration,
}

impl Default for Pauses {
    fn default() -> Pauses {
        Pauses {
            first: Duration::from_millis(100),
            max: Duration::from_secs(30),
            steady: Duration::from_secs(60),
        }
    }
}

/// A task whose failure stopped the gateway ([`Policy::Essential`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskFailed {
    pub task: String,
    /// How its last run ended: `panicked: <message>`, or `ended on its own`.
    pub cause: String,
}

impl fmt::Display for TaskFailed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "background task {} {}", self.task, self.cause)
    }
}

impl std::error::Error for TaskFailed {}

/// Owns the gateway's background tasks: cancels and joins them at
/// [`Supervisor::shutdown`], or cancels them when dropped.
pub struct Supervisor {
    tasks: Tasks,
}

/// Starts tasks under a [`Supervisor`]; cheap to clone.
#[derive(Clone)]
pub struct Tasks {
    shared: Arc<Shared>,
}

struct Shared {
    /// Cancelled when the gateway stops: every task ends at it.
    cancel: CancellationToken,
    /// Cancelled when an essential task failed: the gateway should stop.
    stop: CancellationToken,
    failed: Mutex<Option<TaskFailed>>,
    /// Each task's supervising loop, by name; pruned of finished ones as tasks start.
    running: Mutex<Vec<Running>>,
    /// By task name (a task started several times under one name, such as a worker's,
    /// sums its own).
    counts: Mutex<BTreeMap<String, Counts>>,
    pauses: Pauses,
}

#[derive(Default)]
struct Counts {
    restarts: u64,
    /// Runs under way: their work (a future, a thread) has not ended.
    live: usize,
}

struct Running {
    name: Arc<str>,
    handle: JoinHandle<()>,
}

impl Default for Supervisor {
    fn default() -> Supervisor {
        Supervisor::new()
    }
}

impl Supervisor {
    pub fn new() -> Supervisor {
        Supervisor::with_pauses(Pauses::default())
    }

    /// A supervisor that pauses as `pauses` says between restarts.
    pub fn with_pauses(pauses: Pauses) -> Supervisor {
        Supervisor {
            tasks: Tasks {
                shared: Arc::new(Shared {
                    cancel: CancellationToken::new(),
                    stop: CancellationToken::new(),
                    failed: Mutex::new(None),
                    running: Mutex::new(Vec::new()),
                    counts: Mutex::new(BTreeMap::new()),
                    pauses,
                }),
            },
        }
    }

    /// A handle to start tasks under this supervisor.
    pub fn tasks(&self) -> Tasks {
        self.tasks.clone()
    }

    /// Resolves when an essential task has failed and the gateway should stop; with it.
    pub async fn stop_requested(&self) -> TaskFailed {
        let shared = &self.tasks.shared;
        shared.stop.cancelled().await;
        shared.failed.lock().clone().unwrap_or_else(|| TaskFailed {
            task: String::new(),
            cause: "failed".into(),
        })
    }

    /// Cancels every task and waits for each until `within` has passed; logs each that
    /// had not stopped by then, and returns their names. A task started from now on does
    /// not run.
    pub async fn shutdown(self, within: Duration) -> Vec<String> {
        let shared = &self.tasks.shared;
        // Under the lock a task starts under, so none starts unseen after this.
        let running = {
            let mut running = shared.running.lock();
            shared.cancel.cancel();
            std::mem::take(&mut *running)
        };
        let deadline = Instant::now() + within;
        let mut late = Vec::new();
        for mut r in running {
            if tokio::time::timeout_at(deadline, &mut r.handle)
                .await
                .is_err()
            {
                // Its supervising loop aborts the work with it (a thread runs on: it can
                // only be asked).
                r.handle.abort();
                tracing::warn!(
                    task = %r.name,
                    "background task {} did not stop within {within:?} of shutdown: left behind",
                    r.name
                );
                late.push(r.name.to_string());
            }
        }
        late
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.tasks.shared.cancel.cancel();
    }
}

impl Tasks {
    /// Starts `make`'s future on the runtime as task `name`, and again as `policy` says.
    pub fn spawn<F, Fut>(&self, name: impl Into<String>, policy: Policy, make: F)
    where
        F: Fn(CancellationToken) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        self.start(name.into(), policy, |task| {
            tokio::spawn(supervise(task, move |stop, live| {
                let work = make(stop);
                joined(tokio::spawn(async move {
                    let _live = live;
                    work.await
                }))
            }))
        });
    }

    /// Starts `make`'s future on this thread's `LocalSet` (an actix worker's) as task
    /// `name`, and again as `policy` says, on the same thread. Call it on such a thread;
    /// the task ends with its worker, if not before.
    pub fn spawn_local<F, Fut>(&self, name: impl Into<String>, policy: Policy, make: F)
    where
        F: Fn(CancellationToken) -> Fut + 'static,
        Fut: Future<Output = ()> + 'static,
    {
        self.start(name.into(), policy, |task| {
            tokio::task::spawn_local(supervise(task, move |stop, live| {
                let work = make(stop);
                joined(tokio::task::spawn_local(async move {
                    let _live = live;
                    work.await
                }))
            }))
        });
    }

    /// Runs `work` on an OS thread named `name` (Linux keeps its first 15 bytes) as task
    /// `name`, and on a new thread as `policy` says. `work` should return soon after its
    /// token is cancelled: a thread can be asked to stop, not made to.
    pub fn spawn_thread<F>(&self, name: impl Into<String>, policy: Policy, work: F)
    where
        F: Fn(CancellationToken) + Send + Sync + 'static,
    {
        let work = Arc::new(work);
        self.start(name.into(), policy, |task| {
            let name = Arc::clone(&task.name);
            tokio::spawn(supervise(task, move |stop, live| {
                on_thread(&name, Arc::clone(&work), stop, live)
            }))
        });
    }

    /// Starts task `name`, a thread below the request path's priority (nice 10) that runs
    /// the CPU work [`Niced::run`] hands it, and returns the handle to hand it work with.
    /// Work a background task does for long (encoding a batch, merging counts) would
    /// otherwise take its turn from the requests on a busy host.
    pub fn spawn_niced(&self, name: impl Into<String>) -> Niced {
        let niced = Niced::default();
        let inbox = Arc::clone(&niced.inbox);
        self.spawn_thread(name, Policy::Restart, move |stop| {
            // SAFETY: setpriority only reads its arguments; 0 is the calling thread.
            if unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 10) } != 0 {
                tracing::debug!("a niced worker runs at the request path's priority");
            }
            let (tx, rx) = std::sync::mpsc::channel::<Job>();
            *inbox.lock() = Some(tx);
            while !stop.is_cancelled() {
                match rx.recv_timeout(Duration::from_millis(100)) {
                    Ok(job) => job(),
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
                }
            }
            // Work queued and not run is dropped: each `run` waiting on it runs it itself.
            *inbox.lock() = None;
        });
        niced
    }

    /// Restarts so far, by task name (for `/metrics`).
    pub fn restarts(&self) -> BTreeMap<String, u64> {
        let counts = self.shared.counts.lock();
        counts
            .iter()
            .map(|(n, c)| (n.clone(), c.restarts))
            .collect()
    }

    /// The names of the tasks whose work is under way (a future not dropped, a thread
    /// not ended), a name once for each task under it.
    pub fn running(&self) -> Vec<String> {
        let counts = self.shared.counts.lock();
        counts
            .iter()
            .flat_map(|(n, c)| std::iter::repeat_n(n.clone(), c.live))
            .collect()
    }

    fn start(&self, name: String, policy: Policy, spawn: impl FnOnce(Task) -> JoinHandle<()>) {
        let mut running = self.shared.running.lock();
        if self.shared.cancel.is_cancelled() {
            tracing::debug!(task = %name, "not started: the gateway is stopping");
            return;
        }
        running.retain(|r| !r.handle.is_finished());
        self.shared.counts.lock().entry(name.clone()).or_default();
        let name: Arc<str> = name.into();
        let handle = spawn(Task {
            name: Arc::clone(&name),
            shared: Arc::clone(&self.shared),
            policy,
        });
        running.push(Running { name, handle });
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// A handle to a niced worker ([`Tasks::spawn_niced`]).
#[derive(Clone, Default)]
pub struct Niced {
    /// The running worker's queue; `None` while none runs.
    inbox: Arc<Mutex<Option<std::sync::mpsc::Sender<Job>>>>,
}

impl Niced {
    /// Runs `work` on the worker and waits for it; on the caller, as it is, when no worker
    /// runs (the gateway stopping, or a handle of [`Niced::default`]) or the worker
    /// stopped before running it. `None` only when `work` panicked on the worker (the
    /// worker is started again).
    pub async fn run<R, F>(&self, work: F) -> Option<R>
    where
        F: FnOnce() -> R + Send + 'static,
        R: Send + 'static,
    {
        let slot = Arc::new(Mutex::new(Some(work)));
        let (tx, rx) = tokio::sync::oneshot::channel();
        let taken = Arc::clone(&slot);
        let job: Job = Box::new(move || {
            let work = taken.lock().take();
            if let Some(work) = work {
                let _ = tx.send(work());
            }
        });
        let queued = match &*self.inbox.lock() {
            Some(inbox) => inbox.send(job).is_ok(),
            None => false,
        };
        if queued {
            if let Ok(done) = rx.await {
                return Some(done);
            }
        }
        let work = slot.lock().take();
        work.map(|work| work())
    }
}

/// One task, as its supervising loop knows it.
struct Task {
    name: Arc<str>,
    policy: Policy,
    shared: Arc<Shared>,
}

/// How one run of a task ended.
enum Ended {
    /// Its work returned.
    Returned,
    /// It panicked (with the panic's message), or its thread could not start.
    Failed(String),
    /// It was cancelled from outside: aborted, or its runtime (a worker's) is gone.
    Cancelled,
}

/// Runs a task (`run` starts one run and resolves when it ends) until the gateway stops,
/// or its policy says it is over.
async fn supervise<R, E>(task: Task, mut run: R)
where
    R: FnMut(CancellationToken, Live) -> E,
    E: Future<Output = Ended>,
{
    let Task {
        name,
        policy,
        shared,
    } = task;
    let pauses = shared.pauses;
    let cancel = shared.cancel.clone();
    let (mut pause, mut in_a_row) = (pauses.first, 0u32);
    loop {
        let began = Instant::now();
        let live = Live::new(&shared, &name);
        let ended = run(cancel.clone(), live).await;
        let cause = match ended {
            Ended::Failed(message) if cancel.is_cancelled() => {
                tracing::error!(task = %name, "background task {name} panicked while stopping: {message}");
                return;
            }
            _ if cancel.is_cancelled() => return,
            Ended::Cancelled => return,
            Ended::Returned if policy == Policy::UntilDone => {
                tracing::debug!(task = %name, "background task {name} done");
                return;
            }
            Ended::Returned => "ended on its own".to_owned(),
            Ended::Failed(message) => format!("panicked: {message}"),
        };
        if began.elapsed() >= pauses.steady {
            (pause, in_a_row) = (pauses.first, 0);
        }
        if let Policy::Essential { restarts } = policy {
            if in_a_row >= restarts {
                tracing::error!(
                    task = %name,
                    restarts = in_a_row,
                    "background task {name} {cause}, after {in_a_row} restarts in a row: the gateway stops"
                );
                let mut failed = shared.failed.lock();
                failed.get_or_insert(TaskFailed {
                    task: name.to_string(),
                    cause,
                });
                shared.stop.cancel();
                return;
            }
        }
        in_a_row += 1;
        shared
            .counts
            .lock()
            .entry(name.to_string())
            .or_default()
            .restarts += 1;
        tracing::error!(
            task = %name,
            pause_ms = pause.as_millis() as u64,
            "background task {name} {cause}; starting it again in {pause:?}"
        );
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = cancel.cancelled() => return,
        }
        pause = (pause * 2).min(pauses.max);
    }
}

/// One run under way, counted in [`Tasks::running`] until its work ends (the guard is
/// dropped with the future, or at the end of the thread, that holds it).
struct Live {
    shared: Arc<Shared>,
    name: Arc<str>,
}

impl Live {
    fn new(shared: &Arc<Shared>, name: &Arc<str>) -> Live {
        shared
            .counts
            .lock()
            .entry(name.to_string())
            .or_default()
            .live += 1;
        Live {
            shared: Arc::clone(shared),
            name: Arc::clone(name),
        }
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        if let Some(c) = self.shared.counts.lock().get_mut(&*self.name) {
            c.live -= 1;
        }
    }
}

/// Aborts the task when dropped: a supervising loop that is itself aborted (at the
/// shutdown deadline) takes its work with it.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// How the spawned run `handle` ends.
async fn joined(handle: JoinHandle<()>) -> Ended {
    let mut guard = AbortOnDrop(handle);
    match (&mut guard.0).await {
        Ok(()) => Ended::Returned,
        Err(e) if e.is_panic() => Ended::Failed(message(&*e.into_panic())),
        Err(_) => Ended::Cancelled,
    }
}

/// Runs `work` on a new thread named `name`; resolves when it ends.
fn on_thread<F>(
    name: &str,
    work: Arc<F>,
    stop: CancellationToken,
    live: Live,
) -> impl Future<Output = Ended> + Send + 'static
where
    F: Fn(CancellationToken) + Send + Sync + 'static,
{
    let (tx, rx) = tokio::sync::oneshot::channel();
    let started = std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            let ended = std::panic::catch_unwind(AssertUnwindSafe(|| work(stop)));
            drop(live);
            let _ = tx.send(ended.map_err(|p| message(&*p)));
        });
    async move {
        if let Err(e) = started {
            return Ended::Failed(format!("its thread could not start: {e}"));
        }
        match rx.await {
            Ok(Ok(())) => Ended::Returned,
            Ok(Err(message)) => Ended::Failed(message),
            Err(_) => Ended::Failed("its thread ended without saying how".into()),
        }
    }
}

/// A panic's message, when it has one (`panic!` with a literal or a format).
fn message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(a panic without a message)".to_owned())
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::SeqCst};

    use super::*;

    /// Pauses short enough for a test.
    fn quick() -> Supervisor {
        Supervisor::with_pauses(Pauses {
            first: Duration::from_millis(1),
            max: Duration::from_millis(4),
            steady: Duration::from_secs(60),
        })
    }

    /// What this thread logs from now on (the tests run on a current-thread runtime, so
    /// the supervising loops log here too), until the guard is dropped.
    fn capture_logs() -> (tracing::subscriber::DefaultGuard, Arc<Mutex<Vec<u8>>>) {
        #[derive(Clone)]
        struct Sink(Arc<Mutex<Vec<u8>>>);
        impl Write for Sink {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                self.0.lock().extend_from_slice(buf);
                Ok(buf.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let logs = Arc::new(Mutex::new(Vec::new()));
        let sink = Sink(Arc::clone(&logs));
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || sink.clone())
            .finish();
        (tracing::subscriber::set_default(subscriber), logs)
    }

    /// Sets its flag when dropped.
    struct Flag(Arc<AtomicBool>);

    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, SeqCst);
        }
    }

    fn text(logs: &Mutex<Vec<u8>>) -> String {
        String::from_utf8_lossy(&logs.lock()).into_owned()
    }

    /// Waits (a bounded while) until `done` holds.
    async fn until(done: impl Fn() -> bool) {
        for _ in 0..500 {
            if done() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        panic!("not within a second");
    }

    #[tokio::test]
    async fn a_task_that_panics_is_started_again_and_the_log_names_it_and_the_panic() {
        // Arrange: a task that panics on its first run and then runs until cancelled.
        let (_guard, logs) = capture_logs();
        let supervisor = quick();
        let runs = Arc::new(AtomicU32::new(0));
        let counted = Arc::clone(&runs);

        // Act.
        supervisor
            .tasks()
            .spawn("flaky-refresh", Policy::Restart, move |stop| {
                let run = counted.fetch_add(1, SeqCst) + 1;
                async move {
                    if run == 1 {
                        panic!("the mirror broke");
                    }
                    stop.cancelled().await;
                }
            });
        until(|| runs.load(SeqCst) == 2).await;

        // Assert.
        let tasks = supervisor.tasks();
        assert_eq!(tasks.restarts()["flaky-refresh"], 1);
        assert_eq!(tasks.running(), ["flaky-refresh"]);
        let logged = text(&logs);
        assert!(
            logged.contains("background task flaky-refresh panicked: the mirror broke"),
            "{logged}"
        );
        assert!(supervisor.shutdown(Duration::from_secs(1)).await.is_empty());
    }

    #[tokio::test]
    async fn a_thread_that_panics_is_started_again_on_a_thread_named_for_its_task() {
        let (_guard, logs) = capture_logs();
        let supervisor = quick();
        let names = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&names);
        supervisor
            .tasks()
            .spawn_thread("checker", Policy::Restart, move |stop| {
                let mut seen = seen.lock();
                seen.push(std::thread::current().name().map(str::to_owned));
                if seen.len() == 1 {
                    panic!("check {} failed", 1);
                }
                drop(seen);
                while !stop.is_cancelled() {
                    std::thread::sleep(Duration::from_millis(1));
                }
            });
        until(|| names.lock().len() == 2).await;

        assert_eq!(
            *names.lock(),
            [Some("checker".into()), Some("checker".into())]
        );
        assert_eq!(supervisor.tasks().restarts()["checker"], 1);
        assert!(text(&logs).contains("background task checker panicked: check 1 failed"));
        assert!(supervisor.shutdown(Duration::from_secs(1)).await.is_empty());
    }

    #[tokio::test]
    async fn a_task_that_ends_on_its_own_is_started_again_with_longer_pauses() {
        let supervisor = quick();
        let runs = Arc::new(AtomicU32::new(0));
        let counted = Arc::clone(&runs);
        supervisor
            .tasks()
            .spawn("quitter", Policy::Restart, move |_stop| {
                counted.fetch_add(1, SeqCst);
                async {}
            });
        until(|| runs.load(SeqCst) >= 5).await;
        assert!(supervisor.tasks().restarts()["quitter"] >= 4);
        assert!(supervisor.shutdown(Duration::from_secs(1)).await.is_empty());
    }

    #[tokio::test]
    async fn a_task_that_may_not_be_restarted_stops_the_gateway_at_its_first_failure() {
        let (_guard, logs) = capture_logs();
        let supervisor = quick();
        let runs = Arc::new(AtomicU32::new(0));
        let counted = Arc::clone(&runs);
        supervisor
            .tasks()
            .spawn("vital", Policy::Essential { restarts: 0 }, move |_stop| {
                counted.fetch_add(1, SeqCst);
                async { panic!("no way on") }
            });

        let failed = tokio::time::timeout(Duration::from_secs(1), supervisor.stop_requested())
            .await
            .expect("the gateway is asked to stop");

        assert_eq!(
            failed,
            TaskFailed {
                task: "vital".into(),
                cause: "panicked: no way on".into()
            }
        );
        assert_eq!(runs.load(SeqCst), 1, "not started again");
        assert!(text(&logs).contains("the gateway stops"));
    }

    #[tokio::test]
    async fn an_essential_task_is_started_again_up_to_its_cap_then_stops_the_gateway() {
        let supervisor = quick();
        let runs = Arc::new(AtomicU32::new(0));
        let counted = Arc::clone(&runs);
        supervisor
            .tasks()
            .spawn("vital", Policy::Essential { restarts: 2 }, move |_stop| {
                counted.fetch_add(1, SeqCst);
                async {}
            });

        let failed = tokio::time::timeout(Duration::from_secs(1), supervisor.stop_requested())
            .await
            .expect("the gateway is asked to stop");

        assert_eq!(failed.cause, "ended on its own");
        assert_eq!(runs.load(SeqCst), 3, "the first run and two restarts");
        assert_eq!(supervisor.tasks().restarts()["vital"], 2);
    }

    #[tokio::test]
    async fn work_that_is_done_is_not_started_again_but_a_panic_in_it_is() {
        let supervisor = quick();
        let runs = Arc::new(AtomicU32::new(0));
        let counted = Arc::clone(&runs);
        supervisor
            .tasks()
            .spawn("start-up-retry", Policy::UntilDone, move |_stop| {
                let run = counted.fetch_add(1, SeqCst) + 1;
                async move {
                    if run == 1 {
                        panic!("first try");
                    }
                }
            });
        until(|| runs.load(SeqCst) == 2 && supervisor.tasks().running().is_empty()).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(runs.load(SeqCst), 2, "not started again once done");
        assert_eq!(supervisor.tasks().restarts()["start-up-retry"], 1);
    }

    #[tokio::test]
    async fn shutdown_cancels_and_joins_tasks_of_every_kind() {
        // Arrange: one task of each kind, each noting that it saw the cancellation.
        let supervisor = quick();
        let tasks = supervisor.tasks();
        let stopped: Vec<Arc<AtomicBool>> = (0..3).map(|_| Default::default()).collect();
        let noted = |i: usize| Arc::clone(&stopped[i]);
        let note = noted(0);
        tasks.spawn("on-the-runtime", Policy::Restart, move |stop| {
            let note = Arc::clone(&note);
            async move {
                stop.cancelled().await;
                note.store(true, SeqCst);
            }
        });
        let note = noted(1);
        tasks.spawn_thread("on-a-thread", Policy::Restart, move |stop| {
            while !stop.is_cancelled() {
                std::thread::sleep(Duration::from_millis(1));
            }
            note.store(true, SeqCst);
        });
        let local = tokio::task::LocalSet::new();
        let note = noted(2);
        local.spawn_local(async move {
            tasks.spawn_local("on-a-worker", Policy::Restart, move |stop| {
                let note = Arc::clone(&note);
                async move {
                    stop.cancelled().await;
                    note.store(true, SeqCst);
                }
            });
        });

        // Act.
        let late = local
            .run_until(async {
                tokio::task::yield_now().await;
                assert_eq!(supervisor.tasks().running().len(), 3);
                supervisor.shutdown(Duration::from_secs(1)).await
            })
            .await;

        // Assert.
        assert!(late.is_empty(), "{late:?}");
        for (i, s) in stopped.iter().enumerate() {
            assert!(s.load(SeqCst), "task {i} did not see the cancellation");
        }
    }

    #[tokio::test]
    async fn a_niced_worker_runs_work_on_its_thread_below_the_callers_priority_and_the_caller_runs_it_once_it_stopped(
    ) {
        let supervisor = quick();
        let niced = supervisor.tasks().spawn_niced("niced-work");
        let here = std::thread::current().id();
        // Running once its thread has put up its queue.
        until(|| niced.inbox.lock().is_some()).await;

        // SAFETY: getpriority only reads its arguments; 0 is the calling thread.
        let seen = niced
            .run(|| {
                (std::thread::current().id(), unsafe {
                    libc::getpriority(libc::PRIO_PROCESS, 0)
                })
            })
            .await
            .unwrap();
        assert_ne!(seen.0, here);
        assert_eq!(seen.1, 10);
        assert_eq!(niced.run(|| -> u32 { panic!("in the work") }).await, None);
        until(|| supervisor.tasks().restarts()["niced-work"] == 1).await;

        supervisor.shutdown(Duration::from_secs(1)).await;
        let after = niced.run(|| std::thread::current().id()).await;
        assert_eq!(after, Some(here), "run by the caller once no worker runs");
    }

    #[tokio::test]
    async fn a_task_that_ignores_the_cancellation_is_named_once_the_deadline_passes() {
        let (_guard, logs) = capture_logs();
        let supervisor = quick();
        let tasks = supervisor.tasks();
        let dropped = Arc::new(AtomicBool::new(false));
        let note = Arc::clone(&dropped);
        tasks.spawn("deaf", Policy::Restart, move |_stop| {
            let noted = Flag(Arc::clone(&note));
            async move {
                let _noted = noted;
                loop {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        });
        tasks.spawn("polite", Policy::Restart, |stop| async move {
            stop.cancelled().await;
        });
        tasks.spawn_thread("deaf-thread", Policy::Restart, |_stop| {
            std::thread::sleep(Duration::from_millis(300));
        });
        tokio::task::yield_now().await;

        let began = std::time::Instant::now();
        let late = supervisor.shutdown(Duration::from_millis(50)).await;

        assert_eq!(late, ["deaf", "deaf-thread"]);
        assert!(began.elapsed() < Duration::from_millis(250));
        assert!(tasks.running().contains(&"deaf-thread".to_owned()));
        let logged = text(&logs);
        assert!(
            logged.contains("background task deaf did not stop within 50ms of shutdown"),
            "{logged}"
        );
        until(|| dropped.load(SeqCst)).await;
        until(|| tasks.running().is_empty()).await;
    }

    #[tokio::test]
    async fn a_supervisor_dropped_cancels_its_tasks_and_one_stopping_starts_none() {
        let supervisor = quick();
        let tasks = supervisor.tasks();
        let stopped = Arc::new(AtomicBool::new(false));
        let note = Arc::clone(&stopped);
        tasks.spawn("held", Policy::Restart, move |stop| {
            let note = Arc::clone(&note);
            async move {
                stop.cancelled().await;
                note.store(true, SeqCst);
            }
        });
        drop(supervisor);
        until(|| stopped.load(SeqCst)).await;
        tasks.spawn("too-late", Policy::Restart, |_stop| async {});
        assert!(!tasks.restarts().contains_key("too-late"));
    }
}
