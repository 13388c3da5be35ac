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
            let (state, verdict) = bucket::take(b.get(&client).copied(), now, *plan, 1.0);
            b.insert(client, state);
            if !verdict.allowed {
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
