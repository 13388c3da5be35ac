//! A TCP proxy whose faults a test switches at will.
//!
//! Modes apply to connections as a network would: [`FaultProxy::delay`] slows every open
//! and future connection; [`FaultProxy::blackhole`] silences the connections open now
//! (bytes are accepted and dropped both ways, so neither side's kernel notices) while new
//! ones pass, as when a name moves to a new server or a NAT forgets its state;
//! [`FaultProxy::partition`] silences new connections too; [`FaultProxy::heal`] lets new
//! connections pass again (silenced ones stay silent: their peer state is gone);
//! [`FaultProxy::reset`] tears down every open connection with an RST; while
//! [`FaultProxy::refuse`] is on, new connections are reset as soon as they arrive.

use std::collections::VecDeque;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;

/// What happens to connections that arrive now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arrivals {
    Pass,
    Silent,
    Refuse,
}

/// One open connection's switches.
struct Conn {
    silent: AtomicBool,
    reset: watch::Sender<bool>,
}

struct Shared {
    target: SocketAddr,
    arrivals: Mutex<Arrivals>,
    /// Added to every reply (server → client), in µs.
    delay_us: AtomicU64,
    conns: Mutex<Vec<Arc<Conn>>>,
    accepted: AtomicUsize,
}

/// A fault-injecting TCP proxy on 127.0.0.1, forwarding to `target`. Stops on drop.
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The proxy thread's id in the kernel (for `chrt`, `taskset`).
    tid: i32,
}

impl FaultProxy {
    /// Starts a proxy in front of `target` (e.g. a `redis-server`'s address), passing
    /// everything until told otherwise.
    pub fn start(target: SocketAddr) -> FaultProxy {
        let listener = StdListener::bind("127.0.0.1:0").expect("bind a loopback port");
        listener
            .set_nonblocking(true)
            .expect("non-blocking listener");
        let addr = listener.local_addr().expect("local address");
        let shared = Arc::new(Shared {
            target,
            arrivals: Mutex::new(Arrivals::Pass),
            delay_us: AtomicU64::new(0),
            conns: Mutex::new(Vec::new()),
            accepted: AtomicUsize::new(0),
        });
        let (stop, stopped) = oneshot::channel();
        let s = Arc::clone(&shared);
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("fault-proxy".into())
            .spawn(move || {
                // SAFETY: gettid has no preconditions.
                let _ = tid_tx.send(unsafe { libc::gettid() });
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("proxy runtime");
                rt.block_on(async move {
                    let listener = TcpListener::from_std(listener).expect("tokio listener");
                    tokio::select! {
                        _ = accept_loop(listener, s) => {}
                        _ = stopped => {}
                    }
                });
            })
            .expect("proxy thread");
        let tid = tid_rx.recv().expect("the proxy thread's id");
        FaultProxy {
            addr,
            shared,
            stop: Some(stop),
            thread: Some(thread),
            tid,
        }
    }

    /// The kernel's id of the one thread that runs the proxy (its scheduling can be set
    /// apart from the rest of the process's, e.g. with `chrt -p`).
    pub fn thread_id(&self) -> i32 {
        self.tid
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// `redis://127.0.0.1:<port>`: where to point the gateway.
    pub fn redis_url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.addr.port())
    }

    /// Connections accepted since start.
    pub fn accepted(&self) -> usize {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Connections open now (silenced ones included).
    pub fn open(&self) -> usize {
        let mut conns = self.shared.conns.lock().unwrap();
        conns.retain(|c| !c.reset.is_closed());
        conns.len()
    }

    /// Every reply, on open and future connections, arrives `d` late (order kept).
    pub fn delay(&self, d: Duration) {
        self.shared
            .delay_us
            .store(d.as_micros() as u64, Ordering::SeqCst);
    }

    /// Open connections go silent; new ones pass.
    pub fn blackhole(&self) {
        for c in self.shared.conns.lock().unwrap().iter() {
            c.silent.store(true, Ordering::SeqCst);
        }
        self.set_arrivals(Arrivals::Pass);
    }

    /// Open connections go silent, and so do new ones (they connect, nothing answers).
    pub fn partition(&self) {
        self.blackhole();
        self.set_arrivals(Arrivals::Silent);
    }

    /// New connections pass again, undelayed. Connections silenced earlier stay silent.
    pub fn heal(&self) {
        self.delay(Duration::ZERO);
        self.set_arrivals(Arrivals::Pass);
    }

    /// Every open connection is torn down with an RST.
    pub fn reset(&self) {
        for c in self.shared.conns.lock().unwrap().drain(..) {
            let _ = c.reset.send(true);
        }
    }

    /// New connections are reset as they arrive, until [`FaultProxy::heal`].
    pub fn refuse(&self) {
        self.set_arrivals(Arrivals::Refuse);
    }

    fn set_arrivals(&self, a: Arrivals) {
        *self.shared.arrivals.lock().unwrap() = a;
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.reset();
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        shared.accepted.fetch_add(1, Ordering::SeqCst);
        let arrivals = *shared.arrivals.lock().unwrap();
        if arrivals == Arrivals::Refuse {
            let _ = client.set_zero_linger();
            drop(client);
            continue;
        }
        let (reset, reset_rx) = watch::channel(false);
        let conn = Arc::new(Conn {
            silent: AtomicBool::new(arrivals == Arrivals::Silent),
            reset,
        });
        shared.conns.lock().unwrap().push(Arc::clone(&conn));
        let shared = Arc::clone(&shared);
        tokio::spawn(async move {
            let _ = client.set_nodelay(true);
            // A silent arrival never reaches the server: its peer is unreachable.
            let server = if conn.silent.load(Ordering::SeqCst) {
                None
            } else {
                TcpStream::connect(shared.target).await.ok()
            };
            pump(client, server, &conn, &shared, reset_rx).await;
        });
    }
}

/// Moves bytes both ways until either side closes or the connection is reset.
async fn pump(
    mut client: TcpStream,
    mut server: Option<TcpStream>,
    conn: &Conn,
    shared: &Shared,
    mut reset: watch::Receiver<bool>,
) {
    if let Some(s) = &server {
        let _ = s.set_nodelay(true);
    }
    let mut from_client = vec![0u8; 64 * 1024];
    let mut from_server = vec![0u8; 64 * 1024];
    // Replies waiting for their delay to pass: (when due, bytes).
    let mut replies: VecDeque<(Instant, Vec<u8>)> = VecDeque::new();
    loop {
        let next_due = replies.front().map(|(due, _)| *due);
        tokio::select! {
            _ = reset.changed() => {
                let _ = client.set_zero_linger();
                return;
            }
            n = client.read(&mut from_client) => {
                let Ok(n @ 1..) = n else { return };
                if conn.silent.load(Ordering::SeqCst) {
                    continue;
                }
                if let Some(s) = &mut server {
                    if s.write_all(&from_client[..n]).await.is_err() {
                        return;
                    }
                }
            }
            n = read_opt(&mut server, &mut from_server) => {
                let Ok(n @ 1..) = n else { return };
                if conn.silent.load(Ordering::SeqCst) {
                    continue;
                }
                let delay = Duration::from_micros(shared.delay_us.load(Ordering::SeqCst));
                // Never before an earlier reply: a connection's bytes stay in order.
                let due = (Instant::now() + delay).max(next_due.unwrap_or_else(Instant::now));
                replies.push_back((due, from_server[..n].to_vec()));
            }
            _ = sleep_until_opt(next_due) => {
                let now = Instant::now();
                while replies.front().is_some_and(|(due, _)| *due <= now) {
                    let (_, bytes) = replies.pop_front().expect("checked");
                    if conn.silent.load(Ordering::SeqCst) {
                        continue;
                    }
                    if client.write_all(&bytes).await.is_err() {
                        return;
                    }
                }
            }
        }
    }
}

async fn read_opt(s: &mut Option<TcpStream>, buf: &mut [u8]) -> std::io::Result<usize> {
    match s {
        Some(s) => s.read(buf).await,
        None => std::future::pending().await,
    }
}

async fn sleep_until_opt(due: Option<Instant>) {
    match due {
        Some(due) => tokio::time::sleep_until(due).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpStream as StdStream;

    /// An echo server on a thread: each connection echoes what it reads.
    fn echo() -> SocketAddr {
        let l = StdListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else { continue };
                std::thread::spawn(move || {
                    let mut buf = [0u8; 1024];
                    while let Ok(n @ 1..) = s.read(&mut buf) {
                        if s.write_all(&buf[..n]).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        addr
    }

    fn roundtrip(s: &mut StdStream, timeout: Duration) -> std::io::Result<Vec<u8>> {
        s.set_read_timeout(Some(timeout))?;
        s.write_all(b"ping")?;
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf)?;
        Ok(buf.to_vec())
    }

    fn connect(p: &FaultProxy) -> StdStream {
        StdStream::connect(("127.0.0.1", p.port())).unwrap()
    }

    #[test]
    fn it_passes_bytes_both_ways() {
        let p = FaultProxy::start(echo());
        let mut s = connect(&p);
        assert_eq!(roundtrip(&mut s, Duration::from_secs(2)).unwrap(), b"ping");
    }

    #[test]
    fn a_delay_holds_every_reply_that_long() {
        let p = FaultProxy::start(echo());
        let mut s = connect(&p);
        p.delay(Duration::from_millis(150));
        let t = std::time::Instant::now();
        roundtrip(&mut s, Duration::from_secs(2)).unwrap();
        assert!(
            t.elapsed() >= Duration::from_millis(150),
            "{:?}",
            t.elapsed()
        );
    }

    #[test]
    fn a_blackhole_silences_open_connections_while_new_ones_pass() {
        let p = FaultProxy::start(echo());
        let mut old = connect(&p);
        roundtrip(&mut old, Duration::from_secs(2)).unwrap();
        p.blackhole();
        let e = roundtrip(&mut old, Duration::from_millis(200)).unwrap_err();
        assert!(matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ));
        let mut new = connect(&p);
        assert_eq!(
            roundtrip(&mut new, Duration::from_secs(2)).unwrap(),
            b"ping"
        );
    }

    #[test]
    fn a_partition_silences_new_connections_until_healed() {
        let p = FaultProxy::start(echo());
        p.partition();
        let mut during = connect(&p);
        assert!(roundtrip(&mut during, Duration::from_millis(200)).is_err());
        p.heal();
        assert!(roundtrip(&mut during, Duration::from_millis(200)).is_err());
        let mut after = connect(&p);
        assert_eq!(
            roundtrip(&mut after, Duration::from_secs(2)).unwrap(),
            b"ping"
        );
    }

    #[test]
    fn a_reset_tears_down_open_connections_and_refuse_resets_new_ones() {
        let p = FaultProxy::start(echo());
        let mut s = connect(&p);
        roundtrip(&mut s, Duration::from_secs(2)).unwrap();
        p.reset();
        assert!(roundtrip(&mut s, Duration::from_secs(2)).is_err());
        p.refuse();
        let mut r = connect(&p);
        assert!(roundtrip(&mut r, Duration::from_secs(2)).is_err());
        p.heal();
        let mut ok = connect(&p);
        assert_eq!(roundtrip(&mut ok, Duration::from_secs(2)).unwrap(), b"ping");
    }
}
