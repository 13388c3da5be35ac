//! Connections to one Redis server, and how a dead one is noticed and left behind.
//!
//! A connection can die three ways, and each is caught here:
//! - **Closed** (Redis restarted, a reset): the connection's driver task sees the socket end
//!   and marks the [`Link`] closed at once, before anybody sends on it. A closed link is
//!   never handed out again, so a command is never written into a dead socket.
//! - **Silent** (a partition, a failover that moved the name, a NAT that dropped its state):
//!   nothing ends, nothing answers. The control plane's commands have a deadline
//!   (`redis.control_timeout_ms`); one that passes it retires *every* connection opened so
//!   far ([`Dialer::retire_all`]), since they share the path that just went quiet. On the
//!   request path the circuit breaker opens, and its probe dials a *fresh* connection: if
//!   that answers, Redis is fine and the old connections are the problem, so they are
//!   retired too. TCP keepalive and `TCP_USER_TIMEOUT` on every socket let the kernel
//!   catch what is left (a peer that stops acknowledging).
//! - **Broken** (an I/O error on a command): the link is marked and replaced.
//!
//! The request path uses one pipelined connection per worker thread ([`PerThread`], a
//! [`Link`] over `pipe`'s connection, the socket's end noticed by its reader task),
//! kept open by a keeper task on that worker, which re-dials as soon as its link is
//! closed or retired, so a request after a Redis restart finds a live connection. Every
//! other caller checks out a pooled connection (bb8 with [`RedisManager`]; bb8-redis's own
//! manager never reports a broken connection), and a link that is not usable is dropped
//! at checkout instead of failing the caller's command.

use std::cell::RefCell;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::rc::{Rc, Weak};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::{FutureExt, Shared};
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::io::tcp::{socket2, TcpSettings};
use redis::{
    AsyncConnectionConfig, Cmd, ConnectionAddr, ConnectionInfo, FromRedisValue, IntoConnectionInfo,
    Pipeline, RedisError, RedisFuture, Value,
};
use tokio::sync::{watch, Notify};

use crate::pipe::{Pipe, Stream};

/// Keepalive probes on an idle socket: a dead peer is noticed within ~11 s.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(5);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
const KEEPALIVE_RETRIES: u32 = 3;
/// Data left unacknowledged this long fails the socket (Linux `TCP_USER_TIMEOUT`).
const USER_TIMEOUT: Duration = Duration::from_secs(10);
/// A keeper whose dial failed tries again after this, doubling up to [`REDIAL_MAX`].
const REDIAL_MIN: Duration = Duration::from_millis(50);
const REDIAL_MAX: Duration = Duration::from_millis(500);

/// The name of every request-path connection, as `CLIENT LIST` shows it.
pub const LINK_NAME: &str = "tollgate-worker";

/// The TCP options every Redis socket gets (cluster connections too).
pub fn tcp_settings() -> TcpSettings {
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_RETRIES);
    TcpSettings::default()
        .set_nodelay(true)
        .set_keepalive(keepalive)
        .set_user_timeout(USER_TIMEOUT)
}

/// Whether an error means the connection itself is gone (not a Redis error reply).
pub fn is_transport_error(e: &RedisError) -> bool {
    e.is_io_error() || e.is_connection_dropped() || e.is_unrecoverable_error()
}

/// How to reach one server, and which of its connections are still trusted.
pub struct Dialer {
    info: ConnectionInfo,
    /// Bounds a dial (TCP connect and handshake) and every control-plane command.
    control_timeout: Duration,
    /// Connections dialed before the current generation are retired. Read on every
    /// request (an atomic load: the watch's lock would be a write every worker shares);
    /// the watch wakes the keepers.
    current: AtomicU64,
    generation: watch::Sender<u64>,
    /// The latest failed dial: a caller waiting for a connection gets its error at once
    /// instead of waiting out the pool's checkout timeout.
    failed: watch::Sender<Option<RedisError>>,
}

impl Dialer {
    pub fn new(url: &str, control_timeout: Duration) -> Result<Dialer, RedisError> {
        let info = url.into_connection_info()?;
        Ok(Dialer::of(info, control_timeout))
    }

    /// A cluster node at `host:port`, reached with the credentials of the seed `url`.
    pub fn node(
        url: &str,
        host: &str,
        port: u16,
        control_timeout: Duration,
    ) -> Result<Dialer, RedisError> {
        let info = url
            .into_connection_info()?
            .set_addr(ConnectionAddr::Tcp(host.to_string(), port));
        Ok(Dialer::of(info, control_timeout))
    }

    fn of(info: ConnectionInfo, control_timeout: Duration) -> Dialer {
        Dialer {
            info: info.set_tcp_settings(tcp_settings()),
            control_timeout,
            current: AtomicU64::new(0),
            generation: watch::Sender::new(0),
            failed: watch::Sender::new(None),
        }
    }

    fn generation(&self) -> u64 {
        self.current.load(Ordering::Acquire)
    }

    /// Retires every connection dialed so far: each is replaced before its next use.
    pub fn retire_all(&self) {
        let next = self.current.fetch_add(1, Ordering::AcqRel) + 1;
        self.generation.send_replace(next);
    }

    /// Notified of every failed dial from now on.
    pub fn dial_failures(&self) -> watch::Receiver<Option<RedisError>> {
        let mut rx = self.failed.subscribe();
        rx.mark_unchanged();
        rx
    }

    /// A new multiplexed connection (the pool's, the breaker's probe).
    /// `response_timeout` bounds each of its commands.
    async fn dial(
        &self,
        response_timeout: Option<Duration>,
    ) -> Result<(MultiplexedConnection, Arc<Health>), RedisError> {
        let r = self.try_dial(response_timeout).await;
        if let Err(e) = &r {
            self.failed.send_replace(Some(e.clone()));
        }
        r
    }

    /// A new request-path connection ([`Pipe`]): its commands have no deadline of their
    /// own, the request path bounds them with its decision budget.
    pub async fn dial_link(&self) -> Result<Link, RedisError> {
        let r = tokio::time::timeout(self.control_timeout, self.try_dial_link())
            .await
            .unwrap_or_else(|_| Err(dial_timed_out()));
        if let Err(e) = &r {
            self.failed.send_replace(Some(e.clone()));
        }
        r
    }

    async fn try_dial_link(&self) -> Result<Link, RedisError> {
        let health = Health::new(self.generation());
        let stream = match self.info.addr() {
            ConnectionAddr::Tcp(host, port) => Stream::Tcp(self.connect_tcp(host, *port).await?),
            ConnectionAddr::Unix(path) => {
                Stream::Unix(tokio::net::UnixStream::connect(path).await?)
            }
            other => {
                return Err(RedisError::from((
                    redis::ErrorKind::InvalidClientConfig,
                    "unsupported redis address",
                    other.to_string(),
                )))
            }
        };
        let (pipe, driver) = Pipe::start(stream);
        let h = Arc::clone(&health);
        tokio::spawn(async move {
            let e = driver.await;
            tracing::debug!(error = %e, "request-path connection ended");
            h.closed.store(true, Ordering::Release);
            h.ended.notify_waiters();
        });
        let link = Link { pipe, health };
        // What redis-rs's own handshake does for these settings.
        let settings = self.info.redis_settings();
        if let Some(password) = settings.password() {
            let mut auth = redis::cmd("AUTH");
            if let Some(user) = settings.username() {
                auth.arg(user);
            }
            auth.arg(password);
            link.query::<()>(&auth).await?;
        }
        if settings.db() != 0 {
            link.query::<()>(redis::cmd("SELECT").arg(settings.db()))
                .await?;
        }
        // Named, so `CLIENT LIST` tells the request path's connections from the rest.
        link.query::<()>(redis::cmd("CLIENT").arg("SETNAME").arg(LINK_NAME))
            .await?;
        Ok(link)
    }

    /// A TCP connection with the options every Redis socket gets.
    async fn connect_tcp(
        &self,
        host: &str,
        port: u16,
    ) -> Result<tokio::net::TcpStream, RedisError> {
        let stream = tokio::net::TcpStream::connect((host, port)).await?;
        let settings = self.info.tcp_settings();
        let sock = socket2::SockRef::from(&stream);
        sock.set_tcp_nodelay(settings.nodelay())?;
        if let Some(k) = settings.keepalive() {
            sock.set_tcp_keepalive(k)?;
        }
        if let Some(t) = settings.user_timeout() {
            sock.set_tcp_user_timeout(Some(t))?;
        }
        Ok(stream)
    }

    async fn try_dial(
        &self,
        response_timeout: Option<Duration>,
    ) -> Result<(MultiplexedConnection, Arc<Health>), RedisError> {
        let generation = self.generation();
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.control_timeout))
            .set_response_timeout(response_timeout);
        let health = Health::new(generation);
        let conn = match self.info.addr() {
            ConnectionAddr::Tcp(host, port) => {
                let connect = async {
                    let stream = self.connect_tcp(host, *port).await?;
                    let (conn, driver) = MultiplexedConnection::new_with_config(
                        self.info.redis_settings(),
                        stream,
                        config,
                    )
                    .await?;
                    // The driver ends when the socket does: the link is closed from then on.
                    let h = Arc::clone(&health);
                    tokio::spawn(async move {
                        driver.await;
                        h.closed.store(true, Ordering::Release);
                        h.ended.notify_waiters();
                    });
                    Ok::<_, RedisError>(conn)
                };
                tokio::time::timeout(self.control_timeout, connect)
                    .await
                    .map_err(|_| dial_timed_out())??
            }
            // Unix sockets and the like: the client's own connection (its end is noticed
            // by the first command that fails on it instead).
            _ => {
                redis::Client::open(self.info.clone())?
                    .get_multiplexed_async_connection_with_config(&config)
                    .await?
            }
        };
        Ok((conn, health))
    }

    /// Whether the server answers a fresh connection within `budget` (after dialing it,
    /// which has the control timeout): tells a Redis that is down from connections that
    /// are dead.
    pub async fn answers_fresh(&self, budget: Duration) -> Result<(), RedisError> {
        let (mut conn, _) = self.dial(Some(budget)).await?;
        redis::cmd("PING").query_async::<String>(&mut conn).await?;
        Ok(())
    }
}

fn dial_timed_out() -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "connecting to redis timed out",
    ))
}

/// What is known about one connection.
struct Health {
    generation: u64,
    /// The socket ended (set by the driver task).
    closed: AtomicBool,
    /// A command on it failed at the transport level.
    broken: AtomicBool,
    ended: Notify,
}

impl Health {
    fn new(generation: u64) -> Arc<Health> {
        Arc::new(Health {
            generation,
            closed: AtomicBool::new(false),
            broken: AtomicBool::new(false),
            ended: Notify::new(),
        })
    }

    /// Whether it can still be used: open, not broken, not retired.
    fn usable(&self, dialer: &Dialer) -> bool {
        !self.closed.load(Ordering::Acquire)
            && !self.broken.load(Ordering::Relaxed)
            && self.generation == dialer.generation()
    }

    /// Marks it broken when `r` failed at the transport level.
    fn check<T>(&self, r: &Result<T, RedisError>) {
        if r.as_ref().is_err_and(is_transport_error) {
            self.broken.store(true, Ordering::Relaxed);
        }
    }
}

/// A worker's request-path connection ([`Pipe`]) and what is known about it.
#[derive(Clone)]
pub struct Link {
    pipe: Pipe,
    health: Arc<Health>,
}

impl Link {
    /// Whether it can still be used: open, not broken, not retired.
    pub fn usable(&self, dialer: &Dialer) -> bool {
        self.health.usable(dialer)
    }

    /// Answers the replies its socket holds now (see [`Pipe::read_now`]).
    pub fn read_now(&self) {
        self.pipe.read_now();
    }

    /// `cmd`'s reply as a `T`; a transport error marks the link broken.
    pub async fn query<T: FromRedisValue>(&self, cmd: &Cmd) -> Result<T, RedisError> {
        let r = match self.pipe.send(cmd).await {
            Ok(v) => v
                .extract_error()
                .and_then(|v| T::from_redis_value(v).map_err(RedisError::from)),
            Err(e) => Err(e),
        };
        self.health.check(&r);
        r
    }
}

/// For reads that run redis-rs' own commands (a script's `EVALSHA`, and its load on
/// `NOSCRIPT`) on a worker's link. One command at a time: a pipeline is refused.
impl ConnectionLike for Link {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(self.query::<Value>(cmd))
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        _: &'a Pipeline,
        _: usize,
        _: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(std::future::ready(Err(RedisError::from((
            redis::ErrorKind::Client,
            "a request-path link sends one command at a time",
        )))))
    }

    fn get_db(&self) -> i64 {
        0
    }
}

type Dial = Shared<Pin<Box<dyn Future<Output = Result<Link, RedisError>>>>>;

/// One thread's request-path connection, or the dial that will bring it.
#[derive(Default)]
struct Slot {
    link: RefCell<Option<Link>>,
    dialing: RefCell<Option<Dial>>,
}

impl Slot {
    /// The dial in flight, or a new one. It is shared: requests waiting for it and the
    /// keeper all drive it, and a request that gives up does not cancel it.
    fn dial(self: &Rc<Self>, dialer: &Arc<Dialer>) -> Dial {
        if let Some(d) = &*self.dialing.borrow() {
            return d.clone();
        }
        let (slot, dialer) = (Rc::downgrade(self), Arc::clone(dialer));
        let dial: Pin<Box<dyn Future<Output = _>>> = Box::pin(async move {
            let r = dialer.dial_link().await;
            if let Some(slot) = Weak::upgrade(&slot) {
                slot.dialing.borrow_mut().take();
                if let Ok(link) = &r {
                    *slot.link.borrow_mut() = Some(link.clone());
                }
            }
            r
        });
        let dial = dial.shared();
        *self.dialing.borrow_mut() = Some(dial.clone());
        dial
    }
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    static SLOTS: RefCell<HashMap<u64, Rc<Slot>>> = RefCell::new(HashMap::new());
}

/// One pipelined connection ([`Link`]) per thread, for the request path.
///
/// Each actix worker runs its own single-threaded runtime. A connection made there has its
/// reader and writer on that worker's thread, so a decision is one hop to Redis and back;
/// a pooled connection made elsewhere would add a hop to another thread each way.
pub struct PerThread {
    id: u64,
    dialer: Arc<Dialer>,
}

impl PerThread {
    pub fn new(dialer: Arc<Dialer>) -> PerThread {
        PerThread {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            dialer,
        }
    }

    fn slot(&self) -> Rc<Slot> {
        SLOTS.with(|m| Rc::clone(m.borrow_mut().entry(self.id).or_default()))
    }

    /// This thread's usable link, dialing one (or joining the dial in flight) if needed.
    /// A dial it joined that fails is followed by one of its own: the one it joined began
    /// earlier (the keeper's, say, while Redis was still down or unreachable), and its
    /// failure says nothing about a dial begun now.
    pub async fn get(&self) -> Result<Link, RedisError> {
        let slot = self.slot();
        if let Some(link) = &*slot.link.borrow() {
            if link.usable(&self.dialer) {
                return Ok(link.clone());
            }
        }
        slot.link.borrow_mut().take();
        drop(slot);
        let (joined, dial) = self.dial();
        match dial.await {
            Err(_) if joined => self.dial().1.await,
            r => r,
        }
    }

    /// This thread's link, if it has a usable one now (without dialing).
    pub fn current(&self) -> Option<Link> {
        let slot = SLOTS.with(|m| m.borrow().get(&self.id).cloned())?;
        let link = slot.link.borrow();
        link.as_ref().filter(|l| l.usable(&self.dialer)).cloned()
    }

    /// Whether a dial was in flight already (then it is joined), and the dial.
    fn dial(&self) -> (bool, Dial) {
        let slot = self.slot();
        let joined = slot.dialing.borrow().is_some();
        (joined, slot.dial(&self.dialer))
    }

    /// Keeps this thread's link open for as long as the thread runs: re-dials as soon as
    /// it is closed or retired, so requests do not find it dead. Spawn once per worker.
    pub async fn keep(&self) {
        let mut generation = self.dialer.generation.subscribe();
        let mut backoff = REDIAL_MIN;
        loop {
            match self.get().await {
                Ok(link) => {
                    backoff = REDIAL_MIN;
                    let ended = link.health.ended.notified();
                    tokio::pin!(ended);
                    // Registered before the check, so an end in between is not missed.
                    ended.as_mut().enable();
                    if link.usable(&self.dialer) {
                        tokio::select! {
                            _ = ended => {}
                            _ = generation.changed() => {}
                            // Broken links are found by a command, not by a signal.
                            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "request-path connection not open yet");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(REDIAL_MAX);
                }
            }
        }
    }
}

/// A pooled connection: redis-rs's multiplexed connection, its commands with the control
/// timeout. A command that fails at the transport level breaks it; one that times out
/// retires every connection.
pub struct RedisConn {
    conn: MultiplexedConnection,
    health: Arc<Health>,
    dialer: Arc<Dialer>,
}

impl RedisConn {
    fn check<T>(&self, r: Result<T, RedisError>) -> Result<T, RedisError> {
        self.health.check(&r);
        if r.as_ref().is_err_and(|e| e.is_timeout()) {
            self.health.broken.store(true, Ordering::Relaxed);
            tracing::warn!("redis command timed out: replacing every connection to it");
            self.dialer.retire_all();
        }
        r
    }
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let r = self.conn.req_packed_command(cmd).await;
            self.check(r)
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let r = self.conn.req_packed_commands(cmd, offset, count).await;
            self.check(r)
        })
    }

    fn get_db(&self) -> i64 {
        self.conn.get_db()
    }
}

/// The bb8 manager of the control plane's connections.
pub struct RedisManager {
    dialer: Arc<Dialer>,
}

impl RedisManager {
    pub fn new(dialer: Arc<Dialer>) -> RedisManager {
        RedisManager { dialer }
    }
}

impl bb8::ManageConnection for RedisManager {
    type Connection = RedisConn;
    type Error = RedisError;

    async fn connect(&self) -> Result<RedisConn, RedisError> {
        let (conn, health) = self.dialer.dial(Some(self.dialer.control_timeout)).await?;
        Ok(RedisConn {
            conn,
            health,
            dialer: Arc::clone(&self.dialer),
        })
    }

    /// At checkout, without a round trip: a closed, broken or retired link is dropped
    /// and another (or a new one) is handed out instead.
    async fn is_valid(&self, conn: &mut RedisConn) -> Result<(), RedisError> {
        if conn.health.usable(&self.dialer) {
            Ok(())
        } else {
            Err(RedisError::from(std::io::Error::from(
                std::io::ErrorKind::BrokenPipe,
            )))
        }
    }

    fn has_broken(&self, conn: &mut RedisConn) -> bool {
        !conn.health.usable(&self.dialer)
    }
}

#[cfg(test)]
mod tests {
    use std::rc::Rc;
    use std::sync::Arc;
    use std::time::Duration;

    use tollgate_testkit::RedisServer;

    use super::{Dialer, PerThread};

    #[tokio::test]
    async fn the_request_path_connection_logs_in_and_selects_the_database_of_its_url() {
        // Arrange: a user of its own (the default user stays open for the test kit).
        let redis =
            RedisServer::start_with(&["--user", "gate", "on", ">s3cret", "~*", "&*", "+@all"])
                .unwrap();
        let url = format!("redis://gate:s3cret@127.0.0.1:{}/3", redis.port);
        let dialer = Arc::new(Dialer::new(&url, Duration::from_secs(2)).unwrap());

        // Act
        let link = dialer.dial_link().await.unwrap();
        let me: String = link.query(redis::cmd("ACL").arg("WHOAMI")).await.unwrap();
        link.query::<()>(redis::cmd("SET").arg("tollgate:where").arg("here"))
            .await
            .unwrap();

        // Assert
        assert_eq!(me, "gate");
        let mut c = redis.conn().unwrap();
        let in_3: Option<String> = redis::pipe()
            .cmd("SELECT")
            .arg(3)
            .ignore()
            .cmd("GET")
            .arg("tollgate:where")
            .query(&mut c)
            .map(|(v,): (Option<String>,)| v)
            .unwrap();
        assert_eq!(in_3.as_deref(), Some("here"));
    }

    #[tokio::test]
    async fn the_request_path_connection_speaks_over_a_unix_socket() {
        let dir = tollgate_testkit::temp_dir("unix").unwrap();
        let socket = dir.path().join("redis.sock");
        let redis = RedisServer::start_with(&["--unixsocket", socket.to_str().unwrap()]).unwrap();
        let url = format!("redis+unix://{}?db=2", socket.display());
        let dialer = Arc::new(Dialer::new(&url, Duration::from_secs(2)).unwrap());

        let link = dialer.dial_link().await.unwrap();
        let replies = futures_util::future::join_all((0..50).map(|i| {
            let link = &link;
            async move {
                link.query::<i64>(redis::cmd("INCRBY").arg("n").arg(i))
                    .await
            }
        }))
        .await;

        // In order, each its own: 0, 0+1, 0+1+2, ...
        for (i, r) in replies.into_iter().enumerate() {
            assert_eq!(r.unwrap(), (0..=i as i64).sum::<i64>(), "reply {i}");
        }
        let mut c = redis.conn().unwrap();
        let in_2: i64 = redis::pipe()
            .cmd("SELECT")
            .arg(2)
            .ignore()
            .cmd("GET")
            .arg("n")
            .query(&mut c)
            .map(|(v,): (i64,)| v)
            .unwrap();
        assert_eq!(in_2, (0..50).sum::<i64>());
    }

    #[tokio::test]
    async fn a_request_that_joined_a_failed_dial_begun_earlier_dials_again_itself() {
        // Arrange: a dial begun while Redis cannot be reached (its `SELECT` never answered,
        // as the keeper's is during an outage), then Redis reachable again.
        let redis = RedisServer::start().unwrap();
        let proxy = tollgate_testkit::FaultProxy::start(
            format!("127.0.0.1:{}", redis.port).parse().unwrap(),
        );
        let url = format!("redis://127.0.0.1:{}/1", proxy.port());
        let dialer = Arc::new(Dialer::new(&url, Duration::from_millis(300)).unwrap());
        let per_thread = Rc::new(PerThread::new(dialer));
        proxy.partition();
        let local = tokio::task::LocalSet::new();
        local
            .run_until(async {
                let keeper = Rc::clone(&per_thread);
                let early = tokio::task::spawn_local(async move { keeper.get().await });
                tokio::time::sleep(Duration::from_millis(50)).await;
                proxy.heal();

                // Act: a request needs the link while that dial is still in flight.
                let link = per_thread.get().await;

                // Assert: the early dial failed, the request's own succeeded and works.
                assert!(
                    early.await.unwrap().is_err(),
                    "the early dial cannot succeed"
                );
                let link = link.expect("a dial of the request's own");
                let pong: String = link.query(&redis::cmd("PING")).await.unwrap();
                assert_eq!(pong, "PONG");
            })
            .await;
    }
}
