//! The services behind the gateway, in this process on a thread of their own: fast
//! upstreams that answer at once, and modelled replicas with finite capacity and their
//! own per-service limiter (the incident's setup).

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::net::TcpListener;
use tokio::sync::{oneshot, Semaphore};
use tollgate::domain::Bucket;
use tollgate::domain::{bucket, BucketState};

use crate::http::{serve_conn, OK};

/// A replica's own `429`: what a per-service limiter answers (marked, so the replay can
/// tell it from the gateway's).
const LIMITED: &[u8] = b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: 7\r\nx-limited-by: service\r\nretry-after: 1\r\n\r\nlimited";

/// Requests an upstream answered, in total and per client.
#[derive(Default)]
pub struct Counts {
    pub total: AtomicU64,
    per_client: Option<Mutex<HashMap<String, u64>>>,
}

impl Counts {
    /// Counting per client costs a header scan and a lock per request: only on demand.
    pub fn per_client() -> Counts {
        Counts {
            total: AtomicU64::new(0),
            per_client: Some(Mutex::new(HashMap::new())),
        }
    }

    pub fn of(&self, client: &str) -> u64 {
        self.per_client
            .as_ref()
            .and_then(|m| m.lock().get(client).copied())
            .unwrap_or(0)
    }

    fn add(&self, client: Option<String>) {
        self.total.fetch_add(1, Relaxed);
        if let (Some(m), Some(c)) = (&self.per_client, client) {
            *m.lock().entry(c).or_default() += 1;
        }
    }
}

/// A service replica with finite capacity: `workers` requests are served at a time, each
/// for an exponentially distributed time of mean `service`, the rest wait in FIFO order,
/// so queueing delay grows as load nears capacity (an M/M/c queue). In front of the queue
/// sits the per-service limiter of ADR-001: a token bucket per client, inside the replica,
/// with the client's contract.
pub struct Replica {
    limiter: Option<(Bucket, Mutex<HashMap<String, BucketState>>)>,
    workers: Semaphore,
    service_us: f64,
    rng: Mutex<SmallRng>,
    epoch: Instant,
    /// Requests served (not limited).
    pub served: AtomicU64,
    /// Requests its limiter refused.
    pub limited: AtomicU64,
    /// Summed service time, for utilisation.
    pub busy_us: AtomicU64,
}

impl Replica {
    pub fn new(workers: usize, service: Duration, limit: Option<Bucket>, seed: u64) -> Replica {
        Replica {
            limiter: limit.map(|p| (p, Mutex::new(HashMap::new()))),
            workers: Semaphore::new(workers),
            service_us: service.as_micros() as f64,
            rng: Mutex::new(SmallRng::seed_from_u64(seed)),
            epoch: Instant::now(),
            served: AtomicU64::new(0),
            limited: AtomicU64::new(0),
            busy_us: AtomicU64::new(0),
        }
    }

    async fn handle(&self, client: Option<String>) -> &'static [u8] {
        let client = client.unwrap_or_default();
        if let Some((plan, buckets)) = &self.limiter {
            // The crate's own arithmetic: the per-service limiter is the same token
            // bucket, only enforced here, per replica.
            let now = self.epoch.elapsed().as_micros() as u64;
            let mut b = buckets.lock();
            let (state, wait_us) = bucket::take(b.get(&client).copied(), now, *plan, 1.0);
            b.insert(client, state);
            if wait_us != bucket::TAKEN {
                self.limited.fetch_add(1, Relaxed);
                return LIMITED;
            }
        }
        let Ok(_permit) = self.workers.acquire().await else {
            return LIMITED;
        };
        let u: f64 = self.rng.lock().random_range(f64::EPSILON..1.0);
        let service = Duration::from_micros((-u.ln() * self.service_us) as u64);
        let started = Instant::now();
        tokio::time::sleep(service).await;
        self.busy_us
            .fetch_add(started.elapsed().as_micros() as u64, Relaxed);
        self.served.fetch_add(1, Relaxed);
        OK
    }
}

/// What one listening server does.
#[derive(Clone)]
pub enum Server {
    /// Answers `200 ok` at once, counting.
    Fast(Arc<Counts>),
    /// A modelled replica.
    Replica(Arc<Replica>),
}

/// Servers on one thread of their own (a single-threaded runtime), stopped on drop.
pub struct Upstreams {
    pub addrs: Vec<SocketAddr>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Upstreams {
    pub fn start(servers: Vec<Server>) -> anyhow::Result<Upstreams> {
        let mut listeners = Vec::new();
        let mut addrs = Vec::new();
        for _ in &servers {
            let l = StdListener::bind("127.0.0.1:0").context("binding an upstream")?;
            l.set_nonblocking(true)?;
            addrs.push(l.local_addr()?);
            listeners.push(l);
        }
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("bench-upstreams".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a tokio runtime");
                rt.block_on(async move {
                    for (l, server) in listeners.into_iter().zip(servers) {
                        let l = TcpListener::from_std(l).expect("a tokio listener");
                        tokio::spawn(accept(l, server));
                    }
                    let _ = stopped.await;
                });
            })?;
        Ok(Upstreams {
            addrs,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// `http://addr` for each server, as a gateway route lists them.
    pub fn urls(&self) -> Vec<String> {
        self.addrs.iter().map(|a| format!("http://{a}")).collect()
    }
}

impl Drop for Upstreams {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn accept(listener: TcpListener, server: Server) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            // Out of descriptors or similar: back off instead of spinning.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let server = server.clone();
        tokio::spawn(async move {
            match server {
                Server::Fast(counts) => {
                    let wants = counts.per_client.is_some();
                    let _ = serve_conn(stream, wants, |client| {
                        counts.add(client);
                        std::future::ready(OK)
                    })
                    .await;
                }
                Server::Replica(replica) => {
                    let _ = serve_conn(stream, true, |client| {
                        let replica = Arc::clone(&replica);
                        async move { replica.handle(client).await }
                    })
                    .await;
                }
            }
        });
    }
}

/// One [`Faulty`] replica.
struct Slot {
    addr: SocketAddr,
    hang: std::sync::atomic::AtomicBool,
    /// Closes a keep-alive connection idle this long (between requests).
    idle_close: Option<Duration>,
    /// Bumped by every stop: the connections of an earlier one close (at once when idle,
    /// after the answer in progress otherwise, at once when hanging).
    generation: tokio::sync::watch::Sender<u64>,
    /// The accept loop while listening; the port bound but not listening (connections
    /// refused, and the port kept for [`Faulty::start`]) while stopped.
    state: Mutex<Option<SlotState>>,
    /// Connections it closed for idleness while a request that had just arrived on them
    /// was still unread (the keep-alive race, caught on the replica's side): from the
    /// gateway (marked by its `x-client-id`), and from anything else.
    raced_gateway: AtomicU64,
    raced_other: AtomicU64,
}

enum SlotState {
    Listening(tokio::task::JoinHandle<()>),
    Stopped(tokio::net::TcpSocket),
}

/// Replicas that die, hang, close idle connections and restart, for `upstreams` (issue
/// 32): each on a port of its own, on one runtime thread of their own, controlled from
/// the scenario's thread. A stopped replica's port stays bound without listening, so a
/// connection to it is refused (a dead process's port) and it starts again on the same
/// port. Stopped on drop.
pub struct Faulty {
    rt: Option<tokio::runtime::Runtime>,
    slots: Vec<Arc<Slot>>,
}

impl Faulty {
    /// `n` replicas answering at once, each closing keep-alive connections idle for
    /// `idle_close` (`None`: never).
    pub fn start(n: usize, idle_close: Option<Duration>) -> anyhow::Result<Faulty> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("bench-faulty")
            .enable_all()
            .build()
            .context("a runtime for the replicas")?;
        let mut slots = Vec::new();
        for _ in 0..n {
            let socket = reserve("127.0.0.1:0".parse().expect("an address"))?;
            let slot = Arc::new(Slot {
                addr: socket.local_addr()?,
                hang: Default::default(),
                idle_close,
                generation: tokio::sync::watch::channel(0).0,
                state: Mutex::new(Some(SlotState::Stopped(socket))),
                raced_gateway: AtomicU64::new(0),
                raced_other: AtomicU64::new(0),
            });
            slots.push(slot);
        }
        let faulty = Faulty {
            rt: Some(rt),
            slots,
        };
        for i in 0..n {
            faulty.start_one(i)?;
        }
        Ok(faulty)
    }

    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.slots.iter().map(|s| s.addr).collect()
    }

    /// `http://addr` for each replica, as a gateway route lists them.
    pub fn urls(&self) -> Vec<String> {
        self.addrs().iter().map(|a| format!("http://{a}")).collect()
    }

    fn rt(&self) -> &tokio::runtime::Runtime {
        self.rt.as_ref().expect("running until dropped")
    }

    /// Listens again on replica `i`'s port (a no-op when it listens).
    pub fn start_one(&self, i: usize) -> anyhow::Result<()> {
        let slot = &self.slots[i];
        let mut state = slot.state.lock();
        match state.take() {
            Some(SlotState::Stopped(socket)) => {
                // `listen` registers the listener with the runtime's reactor.
                let _enter = self.rt().enter();
                let listener = socket
                    .listen(1024)
                    .with_context(|| format!("listening on {}", slot.addr))?;
                *state = Some(SlotState::Listening(
                    self.rt().spawn(accept_faulty(listener, Arc::clone(slot))),
                ));
            }
            other => *state = other,
        }
        Ok(())
    }

    /// Stops replica `i` as a process stops: its port refuses connections from now on,
    /// idle connections close at once, one with an answer in progress after writing it, a
    /// hanging one at once.
    pub fn stop(&self, i: usize) -> anyhow::Result<()> {
        let slot = &self.slots[i];
        let mut state = slot.state.lock();
        match state.take() {
            Some(SlotState::Listening(accepting)) => {
                accepting.abort();
                // Once the aborted task is joined its listener is closed, so the port can
                // be bound again (SO_REUSEADDR: past the closed connections' TIME_WAIT).
                let _ = self.rt().block_on(accepting);
                slot.generation.send_modify(|g| *g += 1);
                *state = Some(SlotState::Stopped(reserve(slot.addr)?));
            }
            other => *state = other,
        }
        Ok(())
    }

    /// Replica `i` hangs on every request it reads from now on: it never answers, and
    /// holds the connection open until it stops.
    pub fn hang(&self, i: usize) {
        self.slots[i].hang.store(true, Relaxed);
    }

    /// Over every replica: connections closed for idleness with a request unread on
    /// them, (from the gateway, from anything else). A lower bound of the races: a
    /// request that arrives just after the close is refused by the kernel, unseen here.
    pub fn raced(&self) -> (u64, u64) {
        self.slots.iter().fold((0, 0), |(g, o), s| {
            (
                g + s.raced_gateway.load(Relaxed),
                o + s.raced_other.load(Relaxed),
            )
        })
    }
}

impl Drop for Faulty {
    fn drop(&mut self) {
        for i in 0..self.slots.len() {
            let _ = self.stop(i);
        }
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

/// A socket bound to `addr` (SO_REUSEADDR) and not listening: connections to it are
/// refused, and the port stays this process's.
fn reserve(addr: SocketAddr) -> anyhow::Result<tokio::net::TcpSocket> {
    // Another socket may hold the port for a moment (a connection's ephemeral port):
    // try for a second.
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.set_reuseaddr(true)?;
        match socket.bind(addr) {
            Ok(()) => return Ok(socket),
            Err(e) if Instant::now() > deadline => {
                return Err(e).with_context(|| format!("binding {addr} again"))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

async fn accept_faulty(listener: TcpListener, slot: Arc<Slot>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        tokio::spawn(serve_faulty(stream, Arc::clone(&slot)));
    }
}

/// One connection to a [`Faulty`] replica: requests read as [`serve_conn`] reads them,
/// each answered `200 ok` or never (hanging); closed when idle for the slot's
/// `idle_close`, or when the replica stops.
async fn serve_faulty(mut stream: tokio::net::TcpStream, slot: Arc<Slot>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = stream.set_nodelay(true);
    let mut stopped = slot.generation.subscribe();
    stopped.mark_unchanged();
    let mut buf = vec![0u8; 16 * 1024];
    let mut filled = 0;
    loop {
        let complete = {
            let mut headers = [httparse::EMPTY_HEADER; 48];
            let mut req = httparse::Request::new(&mut headers);
            match req.parse(&buf[..filled]) {
                Ok(httparse::Status::Complete(head)) => {
                    let body = req
                        .headers
                        .iter()
                        .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                        .and_then(|h| std::str::from_utf8(h.value).ok())
                        .and_then(|v| v.trim().parse::<usize>().ok())
                        .unwrap_or(0);
                    Some(head + body).filter(|&total| filled >= total)
                }
                Ok(httparse::Status::Partial) => None,
                Err(_) => return,
            }
        };
        if let Some(total) = complete {
            if slot.hang.load(Relaxed) {
                // Never answered: held open until the replica stops.
                let _ = stopped.changed().await;
                return;
            }
            if stream.write_all(OK).await.is_err() {
                return;
            }
            buf.copy_within(total..filled, 0);
            filled -= total;
            if stopped.has_changed().unwrap_or(true) {
                return;
            }
            continue;
        }
        if filled == buf.len() {
            buf.resize(buf.len() * 2, 0);
        }
        // Idle: nothing of the next request read yet.
        let idle = filled == 0;
        let idle_close = async {
            match slot.idle_close {
                Some(after) if idle => tokio::time::sleep(after).await,
                _ => std::future::pending().await,
            }
        };
        tokio::select! {
            read = stream.read(&mut buf[filled..]) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => filled += n,
            },
            _ = stopped.changed(), if idle => return,
            () = idle_close => {
                // A request that arrived as the timer fired is left unread (the close
                // resets the connection, as a real server's would): counted, by sender.
                let mut peek = [0u8; 4096];
                let peeked = tokio::time::timeout(Duration::ZERO, stream.peek(&mut peek)).await;
                if let Ok(Ok(n)) = peeked {
                    if n > 0 {
                        let from_gateway = peek[..n]
                            .windows(12)
                            .any(|w| w.eq_ignore_ascii_case(b"x-client-id:"));
                        let counter = if from_gateway {
                            &slot.raced_gateway
                        } else {
                            &slot.raced_other
                        };
                        counter.fetch_add(1, Relaxed);
                    }
                }
                return;
            }
        }
    }
}
