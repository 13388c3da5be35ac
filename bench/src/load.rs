//! The load generator.
//!
//! Open loop: a dispatcher thread decides *when* each request is due (a fixed rate, or
//! Poisson arrivals at a fixed mean rate) and sleeps precisely until then; a
//! single-threaded runtime sends it on an idle keep-alive connection (or a new one) and
//! records the latency from the **intended** send time. A slow answer therefore never
//! delays the next request's schedule, and time a request spends waiting for the
//! generator itself counts against the system, not for it (no coordinated omission).
//!
//! Closed loop: `conns` connections each send the next request as soon as the previous
//! answer is in, for the maximum rate.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use anyhow::Context;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::sync::{mpsc, Notify, Semaphore};

use crate::http::Conn;
use crate::wire::{tls_exchange, H2Conns, H2Request, TlsPool, Wire};

/// How long one request may take before it is recorded as failed (status 0).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections the open loop may hold at once, over all targets.
const MAX_CONNS: usize = 4096;

/// When requests are due.
#[derive(Debug, Clone, Copy)]
pub enum Arrivals {
    /// Exactly every 1/rate.
    Uniform,
    /// Exponential gaps of mean 1/rate (independent clients), seeded for repeatability.
    Poisson { seed: u64 },
}

/// One open-loop request stream.
#[derive(Debug, Clone)]
pub struct Stream {
    pub addr: SocketAddr,
    /// Sent in turn.
    pub requests: Vec<Vec<u8>>,
    /// Requests per second.
    pub rate: f64,
    pub arrivals: Arrivals,
    /// Active from this offset after the run's start...
    pub from: Duration,
    /// ...until this one.
    pub until: Duration,
}

/// One request's fate.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    /// Intended send time, as an offset from the run's start.
    pub at: Duration,
    /// From the intended send time to the last byte of the answer.
    pub latency: Duration,
    /// HTTP status; 0 when no answer came (connection error or timeout).
    pub status: u16,
    /// The answer was a modelled service replica's own `429`.
    pub service_marked: bool,
}

struct Job {
    stream: usize,
    seq: u64,
    intended: Instant,
}

/// An open-loop run in progress; [`OpenRun::join`] waits for it.
pub struct OpenRun {
    /// Offsets in [`Stream`] and [`Sample`] are from this instant.
    pub start: Instant,
    dispatcher: std::thread::JoinHandle<(Vec<u64>, Vec<Stream>)>,
    io: std::thread::JoinHandle<Vec<Vec<Sample>>>,
}

/// What an open-loop run measured.
pub struct OpenResult {
    /// Per stream, in completion order.
    pub samples: Vec<Vec<Sample>>,
    /// How late the dispatcher woke for a request (the generator's own precision), p50
    /// and p99.
    pub dispatch_late_p50: Duration,
    pub dispatch_late_p99: Duration,
}

impl OpenRun {
    /// Starts the streams; the schedule begins a little after this call, once the I/O
    /// thread is up.
    pub fn start(streams: Vec<Stream>) -> OpenRun {
        let wires = vec![Wire::Http1; streams.len()];
        OpenRun::start_wired(streams, wires)
    }

    /// [`OpenRun::start`], each stream's requests travelling its [`Wire`] (`wires[i]` for
    /// `streams[i]`). HTTP/2 connections are opened before the schedule begins (within
    /// its first second).
    pub fn start_wired(streams: Vec<Stream>, wires: Vec<Wire>) -> OpenRun {
        assert_eq!(streams.len(), wires.len(), "one wire per stream");
        let h2 = wires.iter().any(|w| matches!(w, Wire::H2 { .. }));
        let lead = if h2 { 1000 } else { 200 };
        let start = Instant::now() + Duration::from_millis(lead);
        let (tx, rx) = mpsc::unbounded_channel::<Job>();
        let io_streams = streams.clone();
        let io = std::thread::Builder::new()
            .name("bench-load-io".into())
            .spawn(move || io_thread(io_streams, wires, rx, start))
            .expect("spawning the load thread");
        let dispatcher = std::thread::Builder::new()
            .name("bench-dispatch".into())
            .spawn(move || dispatch(streams, tx, start))
            .expect("spawning the dispatcher");
        OpenRun {
            start,
            dispatcher,
            io,
        }
    }

    /// Sleeps until `offset` after the start (to act at a point of the schedule).
    pub fn sleep_until(&self, offset: Duration) {
        let target = self.start + offset;
        let now = Instant::now();
        if target > now {
            std::thread::sleep(target - now);
        }
    }

    pub fn join(self) -> anyhow::Result<OpenResult> {
        let (mut late, streams) = self
            .dispatcher
            .join()
            .map_err(|_| anyhow::anyhow!("the dispatcher panicked"))?;
        let samples = self
            .io
            .join()
            .map_err(|_| anyhow::anyhow!("the load thread panicked"))?;
        // Freed only now: with many clients the streams hold hundreds of thousands of
        // requests, whose freeing, on the cores the upstream and Redis share, delayed the
        // run's last requests by milliseconds when the dispatcher freed them on its way out.
        drop(streams);
        late.sort_unstable();
        Ok(OpenResult {
            samples,
            dispatch_late_p50: Duration::from_nanos(percentile(&late, 0.50)),
            dispatch_late_p99: Duration::from_nanos(percentile(&late, 0.99)),
        })
    }
}

/// Runs streams to completion (a convenience for runs with nothing to do meanwhile).
pub fn run_open(streams: Vec<Stream>) -> anyhow::Result<OpenResult> {
    OpenRun::start(streams).join()
}

/// Decides when requests are due and hands them to the I/O thread; returns how late it
/// woke for each, in nanoseconds, and the streams, for the caller to free once the last
/// requests are answered.
fn dispatch(
    streams: Vec<Stream>,
    tx: mpsc::UnboundedSender<Job>,
    start: Instant,
) -> (Vec<u64>, Vec<Stream>) {
    precise_sleeps();
    struct Next {
        at: Duration,
        seq: u64,
        rng: SmallRng,
    }
    let mut next: Vec<Next> = streams
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let seed = match s.arrivals {
                Arrivals::Poisson { seed } => seed,
                Arrivals::Uniform => i as u64,
            };
            let mut n = Next {
                at: s.from,
                seq: 0,
                rng: SmallRng::seed_from_u64(seed),
            };
            // Poisson streams start at a random point too, so their first requests do
            // not all coincide.
            if let Arrivals::Poisson { .. } = s.arrivals {
                n.at += exp_gap(&mut n.rng, s.rate);
            }
            n
        })
        .collect();
    let mut late = Vec::new();
    while let Some((i, _)) = next
        .iter()
        .enumerate()
        .filter(|(i, n)| n.at < streams[*i].until && streams[*i].rate > 0.0)
        .min_by_key(|(_, n)| n.at)
    {
        let target = start + next[i].at;
        let now = Instant::now();
        if target > now {
            std::thread::sleep(target - now);
        }
        late.push(Instant::now().saturating_duration_since(target).as_nanos() as u64);
        if tx
            .send(Job {
                stream: i,
                seq: next[i].seq,
                intended: target,
            })
            .is_err()
        {
            break;
        }
        let s = &streams[i];
        let n = &mut next[i];
        n.seq += 1;
        n.at = match s.arrivals {
            Arrivals::Uniform => s.from + Duration::from_secs_f64(n.seq as f64 / s.rate),
            Arrivals::Poisson { .. } => n.at + exp_gap(&mut n.rng, s.rate),
        };
    }
    (late, streams)
}

fn exp_gap(rng: &mut SmallRng, rate: f64) -> Duration {
    let u: f64 = rng.random_range(f64::EPSILON..1.0);
    Duration::from_secs_f64(-u.ln() / rate)
}

/// Asks Linux for exact sleeps: the default 50 µs timer slack would add up to 50 µs of
/// the generator's own lateness to every request.
fn precise_sleeps() {
    // SAFETY: PR_SET_TIMERSLACK only changes this thread's timer slack.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0);
    }
}

type Pool = Rc<RefCell<HashMap<SocketAddr, Vec<Conn>>>>;

/// Per stream, how its requests are sent.
enum Sender {
    Http1,
    Tls {
        config: std::sync::Arc<rustls::ClientConfig>,
        pooled: bool,
    },
    H2 {
        conns: Rc<H2Conns>,
        requests: Vec<H2Request>,
    },
}

fn io_thread(
    streams: Vec<Stream>,
    wires: Vec<Wire>,
    mut rx: mpsc::UnboundedReceiver<Job>,
    start: Instant,
) -> Vec<Vec<Sample>> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let local = tokio::task::LocalSet::new();
    let samples: Rc<RefCell<Vec<Vec<Sample>>>> =
        Rc::new(RefCell::new(vec![Vec::new(); streams.len()]));
    let streams = Rc::new(streams);
    let pool: Pool = Rc::default();
    let tls_pool: TlsPool = Rc::default();
    let senders: Rc<Vec<Sender>> = Rc::new(
        streams
            .iter()
            .zip(wires)
            .map(|(s, w)| match w {
                Wire::Http1 => Sender::Http1,
                Wire::Tls(config) => Sender::Tls {
                    config,
                    pooled: true,
                },
                Wire::TlsFresh(config) => Sender::Tls {
                    config,
                    pooled: false,
                },
                Wire::H2 { config, conns } => Sender::H2 {
                    conns: Rc::new(H2Conns::new(s.addr, config, conns)),
                    requests: s
                        .requests
                        .iter()
                        .map(|r| H2Request::parse(r).expect("a request the tool wrote"))
                        .collect(),
                },
            })
            .collect(),
    );
    let conns = Rc::new(Semaphore::new(MAX_CONNS));
    let in_flight = Rc::new(Cell::new(0usize));
    let idle = Rc::new(Notify::new());
    {
        let samples = Rc::clone(&samples);
        local.block_on(&rt, async move {
            for s in senders.iter() {
                if let Sender::H2 { conns, .. } = s {
                    conns.open_all(Duration::from_millis(500)).await;
                }
            }
            while let Some(job) = rx.recv().await {
                let (streams, samples, pool, conns) = (
                    Rc::clone(&streams),
                    Rc::clone(&samples),
                    Rc::clone(&pool),
                    Rc::clone(&conns),
                );
                let (senders, tls_pool) = (Rc::clone(&senders), Rc::clone(&tls_pool));
                let (in_flight_t, idle_t) = (Rc::clone(&in_flight), Rc::clone(&idle));
                in_flight.set(in_flight.get() + 1);
                tokio::task::spawn_local(async move {
                    let s = &streams[job.stream];
                    let at = (job.seq % s.requests.len() as u64) as usize;
                    let req = &s.requests[at];
                    let send = async {
                        match &senders[job.stream] {
                            Sender::Http1 => exchange(&pool, &conns, s.addr, req).await,
                            Sender::Tls { config, pooled } => {
                                let _permit = conns.acquire().await.ok()?;
                                let pool = pooled.then_some(&tls_pool);
                                tls_exchange(pool, config, s.addr, req).await
                            }
                            Sender::H2 { conns, requests } => conns.exchange(&requests[at]).await,
                        }
                    };
                    let reply = tokio::time::timeout(REQUEST_TIMEOUT, send)
                        .await
                        .ok()
                        .flatten();
                    let latency = Instant::now().saturating_duration_since(job.intended);
                    samples.borrow_mut()[job.stream].push(Sample {
                        at: job.intended.saturating_duration_since(start),
                        latency,
                        status: reply.map_or(0, |r| r.status),
                        service_marked: reply.is_some_and(|r| r.service_marked),
                    });
                    in_flight_t.set(in_flight_t.get() - 1);
                    if in_flight_t.get() == 0 {
                        idle_t.notify_one();
                    }
                });
            }
            // The schedule is over: let the last requests finish (each is bounded).
            let deadline = tokio::time::Instant::now() + REQUEST_TIMEOUT + Duration::from_secs(1);
            while in_flight.get() > 0 {
                if tokio::time::timeout_at(deadline, idle.notified())
                    .await
                    .is_err()
                {
                    break;
                }
            }
        });
    }
    Rc::try_unwrap(samples)
        .map(RefCell::into_inner)
        .unwrap_or_else(|rc| rc.borrow().clone())
}

/// One request on a pooled connection; a stale pooled connection (closed by the server
/// while idle) is replaced once.
async fn exchange(
    pool: &Pool,
    conns: &Semaphore,
    addr: SocketAddr,
    req: &[u8],
) -> Option<crate::http::Reply> {
    let _permit = conns.acquire().await.ok()?;
    let pooled = pool.borrow_mut().get_mut(&addr).and_then(Vec::pop);
    let reused = pooled.is_some();
    let mut conn = match pooled {
        Some(c) => c,
        None => Conn::connect(addr).await.ok()?,
    };
    let reply = match conn.send(req).await {
        Ok(r) => r,
        Err(_) if reused => {
            conn = Conn::connect(addr).await.ok()?;
            conn.send(req).await.ok()?
        }
        Err(_) => return None,
    };
    if !conn.closed {
        pool.borrow_mut().entry(addr).or_default().push(conn);
    }
    Some(reply)
}

/// Answers by HTTP status.
#[derive(Debug, Clone, Default)]
pub struct Statuses(BTreeMap<u16, u64>);

impl Statuses {
    fn add(&mut self, status: u16) {
        *self.0.entry(status).or_default() += 1;
    }

    /// Answers with `status`.
    pub fn of(&self, status: u16) -> u64 {
        self.0.get(&status).copied().unwrap_or(0)
    }

    pub fn total(&self) -> u64 {
        self.0.values().sum()
    }

    /// Answers with none of `statuses`.
    pub fn other_than(&self, statuses: &[u16]) -> u64 {
        self.0
            .iter()
            .filter(|(s, _)| !statuses.contains(s))
            .map(|(_, n)| n)
            .sum()
    }

    fn merge(&mut self, other: &Statuses) {
        for (&s, &n) in &other.0 {
            *self.0.entry(s).or_default() += n;
        }
    }

    /// The share of answers with `status`, in % (0 with none).
    pub fn pct(&self, status: u16) -> f64 {
        100.0 * self.of(status) as f64 / self.total().max(1) as f64
    }
}

/// What a closed-loop run measured.
pub struct ClosedResult {
    /// Answers completed inside the measured window.
    pub completed: u64,
    /// Of those, answers other than 2xx.
    pub non_2xx: u64,
    /// The same answers by status.
    pub statuses: Statuses,
    /// Answers completed during the warm-up, by status: whether a client's bucket was
    /// emptied before the window opened.
    pub warmup_statuses: Statuses,
    /// How long before the window opened the warm-up's last `429` came, if one did: the
    /// bucket held under one token then, so at most `1 + rate x this` when the window
    /// opened.
    pub last_429_before_window: Option<Duration>,
    /// Failed exchanges (connection errors), over the whole run.
    pub errors: u64,
    pub window: Duration,
    /// Latencies of the answers completed inside the window, in ns, sorted.
    pub latencies_ns: Vec<u64>,
    /// CPU seconds (user + system) the watched process and its children used inside the
    /// window, when one was watched.
    pub cpu_s: Option<f64>,
}

impl ClosedResult {
    /// A run of no connections (a class of clients with none in it).
    pub fn empty(window: Duration) -> ClosedResult {
        ClosedResult {
            completed: 0,
            non_2xx: 0,
            statuses: Statuses::default(),
            warmup_statuses: Statuses::default(),
            last_429_before_window: None,
            errors: 0,
            window,
            latencies_ns: Vec::new(),
            cpu_s: None,
        }
    }

    /// Several runs over the same `window` (clients measured side by side, each on its
    /// own connections) as one class of clients.
    pub fn combined(parts: &[ClosedResult], window: Duration) -> ClosedResult {
        let mut all = ClosedResult::empty(window);
        for p in parts {
            all.completed += p.completed;
            all.non_2xx += p.non_2xx;
            all.statuses.merge(&p.statuses);
            all.warmup_statuses.merge(&p.warmup_statuses);
            all.errors += p.errors;
            all.latencies_ns.extend_from_slice(&p.latencies_ns);
        }
        all.latencies_ns.sort_unstable();
        all
    }

    pub fn rate(&self) -> f64 {
        self.completed as f64 / self.window.as_secs_f64()
    }

    /// The 99th percentile latency in the window, in ms.
    pub fn p99_ms(&self) -> f64 {
        percentile(&self.latencies_ns, 0.99) as f64 / 1e6
    }

    /// CPU µs the watched process spent per answer completed in the window.
    pub fn cpu_us_per_request(&self) -> Option<f64> {
        self.cpu_s
            .map(|cpu| cpu * 1e6 / self.completed.max(1) as f64)
    }
}

/// `conns` connections to `addr`, each sending `requests` in turn as fast as answers come,
/// for `warmup` (not counted) then `duration` (counted).
pub fn run_closed(
    addr: SocketAddr,
    requests: Vec<Vec<u8>>,
    conns: usize,
    warmup: Duration,
    duration: Duration,
) -> anyhow::Result<ClosedResult> {
    run_closed_watching(addr, requests, conns, warmup, duration, None)
}

/// [`run_closed`], also counting the CPU time process `watch` (and its children: nginx's
/// workers) spends inside the measured window.
pub fn run_closed_watching(
    addr: SocketAddr,
    requests: Vec<Vec<u8>>,
    conns: usize,
    warmup: Duration,
    duration: Duration,
    watch: Option<u32>,
) -> anyhow::Result<ClosedResult> {
    std::thread::Builder::new()
        .name("bench-closed".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a tokio runtime");
            let local = tokio::task::LocalSet::new();
            local.block_on(&rt, closed(addr, requests, conns, warmup, duration, watch))
        })
        .context("spawning the closed-loop thread")?
        .join()
        .map_err(|_| anyhow::anyhow!("the closed-loop thread panicked"))?
}

async fn closed(
    addr: SocketAddr,
    requests: Vec<Vec<u8>>,
    conns: usize,
    warmup: Duration,
    duration: Duration,
    watch: Option<u32>,
) -> anyhow::Result<ClosedResult> {
    let start = Instant::now();
    let (from, until) = (start + warmup, start + warmup + duration);
    // The watched process's CPU time at the window's two ends.
    let cpu = watch.map(|pid| {
        tokio::task::spawn_local(async move {
            tokio::time::sleep_until(from.into()).await;
            let before = crate::procs::cpu_seconds(pid);
            tokio::time::sleep_until(until.into()).await;
            Some(crate::procs::cpu_seconds(pid)? - before?)
        })
    });
    let requests = Rc::new(requests);
    let completed = Rc::new(Cell::new(0u64));
    let non_2xx = Rc::new(Cell::new(0u64));
    let errors = Rc::new(Cell::new(0u64));
    let latencies = Rc::new(RefCell::new(Vec::new()));
    let statuses = Rc::new(RefCell::new(Statuses::default()));
    let warmup_statuses = Rc::new(RefCell::new(Statuses::default()));
    let last_429 = Rc::new(Cell::new(None::<Instant>));
    let mut tasks = Vec::new();
    for c in 0..conns {
        let (requests, completed, non_2xx, errors, latencies) = (
            Rc::clone(&requests),
            Rc::clone(&completed),
            Rc::clone(&non_2xx),
            Rc::clone(&errors),
            Rc::clone(&latencies),
        );
        let (statuses, warmup_statuses, last_429) = (
            Rc::clone(&statuses),
            Rc::clone(&warmup_statuses),
            Rc::clone(&last_429),
        );
        tasks.push(tokio::task::spawn_local(async move {
            let mut conn: Option<Conn> = None;
            // Connections start spread over the requests, so with many clients' requests
            // they do not send the same ones a step apart.
            let mut i = c * (requests.len() / conns.max(1)).max(1);
            while Instant::now() < until {
                if conn.is_none() {
                    match Conn::connect(addr).await {
                        Ok(fresh) => conn = Some(fresh),
                        Err(_) => {
                            errors.set(errors.get() + 1);
                            tokio::time::sleep(Duration::from_millis(10)).await;
                            continue;
                        }
                    }
                }
                let Some(open) = conn.as_mut() else { continue };
                let req = &requests[i % requests.len()];
                i += 1;
                let sent = Instant::now();
                match tokio::time::timeout(REQUEST_TIMEOUT, open.send(req)).await {
                    Ok(Ok(reply)) => {
                        let now = Instant::now();
                        if now >= from && now < until {
                            completed.set(completed.get() + 1);
                            latencies.borrow_mut().push((now - sent).as_nanos() as u64);
                            statuses.borrow_mut().add(reply.status);
                            if !(200..300).contains(&reply.status) {
                                non_2xx.set(non_2xx.get() + 1);
                            }
                        } else if now < from {
                            warmup_statuses.borrow_mut().add(reply.status);
                            if reply.status == 429 {
                                last_429.set(Some(now));
                            }
                        }
                        if open.closed {
                            conn = None;
                        }
                    }
                    _ => {
                        errors.set(errors.get() + 1);
                        conn = None;
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.context("a closed-loop connection task failed")?;
    }
    let cpu_s = match cpu {
        Some(task) => task.await.context("the CPU watch failed")?,
        None => None,
    };
    let mut latencies_ns = latencies.take();
    latencies_ns.sort_unstable();
    Ok(ClosedResult {
        cpu_s,
        completed: completed.get(),
        non_2xx: non_2xx.get(),
        statuses: statuses.take(),
        warmup_statuses: warmup_statuses.take(),
        last_429_before_window: last_429.get().map(|t| from - t),
        errors: errors.get(),
        window: duration,
        latencies_ns,
    })
}

/// The `q` quantile of sorted values (nearest rank); 0 for none.
pub fn percentile(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// Latency percentiles of a set of samples, in milliseconds.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Summary {
    pub count: usize,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
    pub mean_ms: f64,
}

impl Summary {
    pub fn of<'a>(samples: impl IntoIterator<Item = &'a Sample>) -> Summary {
        let mut ns: Vec<u64> = samples
            .into_iter()
            .map(|s| s.latency.as_nanos() as u64)
            .collect();
        ns.sort_unstable();
        Summary::of_sorted_ns(&ns)
    }

    pub fn of_sorted_ns(ns: &[u64]) -> Summary {
        let ms = |v: u64| v as f64 / 1e6;
        let mean = if ns.is_empty() {
            0.0
        } else {
            ns.iter().map(|&v| v as f64).sum::<f64>() / ns.len() as f64 / 1e6
        };
        Summary {
            count: ns.len(),
            p50_ms: ms(percentile(ns, 0.50)),
            p90_ms: ms(percentile(ns, 0.90)),
            p99_ms: ms(percentile(ns, 0.99)),
            p999_ms: ms(percentile(ns, 0.999)),
            max_ms: ms(ns.last().copied().unwrap_or(0)),
            mean_ms: mean,
        }
    }
}

/// Sorted latencies in nanoseconds (for percentile curves).
pub fn sorted_ns<'a>(samples: impl IntoIterator<Item = &'a Sample>) -> Vec<u64> {
    let mut ns: Vec<u64> = samples
        .into_iter()
        .map(|s| s.latency.as_nanos() as u64)
        .collect();
    ns.sort_unstable();
    ns
}
