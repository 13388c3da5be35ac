//! A bb8 manager for multiplexed Redis connections that notices dead ones.
//!
//! bb8-redis's manager reports a connection as never broken, so after a Redis restart its
//! pool keeps handing out connections whose socket is gone. Here a connection that failed
//! with an I/O error is marked, and bb8 drops it and opens a fresh one.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::{AsyncConnectionConfig, Cmd, Pipeline, RedisError, RedisFuture, Value};

pub struct RedisManager {
    client: redis::Client,
}

impl RedisManager {
    pub fn new(url: &str) -> Result<RedisManager, RedisError> {
        // TCP_NODELAY (redis-rs leaves Nagle on): several calls in flight on one
        // multiplexed connection must not wait for the previous one's ACK, which a slow
        // Redis sends only with its reply or after the delayed-ACK timer (40 ms on Linux).
        let info = redis::IntoConnectionInfo::into_connection_info(url)?;
        let tcp = info.tcp_settings().clone().set_nodelay(true);
        Ok(RedisManager {
            client: redis::Client::open(info.set_tcp_settings(tcp))?,
        })
    }

    pub fn client(&self) -> redis::Client {
        self.client.clone()
    }
}

fn config() -> AsyncConnectionConfig {
    // No response timeout of its own: the decision budget bounds every call, and a
    // reply that arrives after it is matched to its own (abandoned) request by the
    // multiplexer, never to the next one.
    AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(1)))
        .set_response_timeout(None)
}

/// Whether an error means the connection itself is gone (not a Redis error reply).
pub fn is_transport_error(e: &RedisError) -> bool {
    e.is_io_error() || e.is_connection_dropped() || e.is_unrecoverable_error()
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

type Slot = Rc<tokio::sync::OnceCell<MultiplexedConnection>>;

thread_local! {
    static CONNECTIONS: RefCell<HashMap<u64, Slot>> = RefCell::new(HashMap::new());
}

/// One multiplexed connection per thread, for the request path.
///
/// Each actix worker runs its own single-threaded runtime. A connection made there has its
/// reader and writer on that worker's thread, so a decision is one hop to Redis and back;
/// a pooled connection made elsewhere would add a hop to another thread each way (and, on
/// a busy machine, waits for that thread to be scheduled).
pub struct PerThread {
    id: u64,
    client: redis::Client,
}

impl PerThread {
    pub fn new(client: redis::Client) -> PerThread {
        PerThread {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            client,
        }
    }

    /// This thread's connection, made on first use; concurrent first uses share one
    /// connection attempt.
    pub async fn get(&self) -> Result<MultiplexedConnection, RedisError> {
        let slot = CONNECTIONS.with(|m| m.borrow_mut().entry(self.id).or_default().clone());
        slot.get_or_try_init(|| async {
            self.client
                .get_multiplexed_async_connection_with_config(&config())
                .await
        })
        .await
        .cloned()
    }

    /// Drops this thread's connection after a transport error; the next call reconnects.
    pub fn forget(&self) {
        CONNECTIONS.with(|m| m.borrow_mut().remove(&self.id));
    }
}

/// A multiplexed connection that remembers whether it failed at the transport level.
pub struct RedisConn {
    inner: MultiplexedConnection,
    broken: bool,
}

impl RedisConn {
    fn check<T>(&mut self, r: Result<T, RedisError>) -> Result<T, RedisError> {
        if r.as_ref().is_err_and(is_transport_error) {
            self.broken = true;
        }
        r
    }
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let r = self.inner.req_packed_command(cmd).await;
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
            let r = self.inner.req_packed_commands(cmd, offset, count).await;
            self.check(r)
        })
    }

    fn get_db(&self) -> i64 {
        self.inner.get_db()
    }
}

impl bb8::ManageConnection for RedisManager {
    type Connection = RedisConn;
    type Error = RedisError;

    async fn connect(&self) -> Result<RedisConn, RedisError> {
        Ok(RedisConn {
            inner: self
                .client
                .get_multiplexed_async_connection_with_config(&config())
                .await?,
            broken: false,
        })
    }

    async fn is_valid(&self, conn: &mut RedisConn) -> Result<(), RedisError> {
        let _: String = redis::cmd("PING").query_async(conn).await?;
        Ok(())
    }

    fn has_broken(&self, conn: &mut RedisConn) -> bool {
        conn.broken
    }
}
