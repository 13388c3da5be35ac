//! A bb8 manager for multiplexed Redis connections that notices dead ones.
//!
//! bb8-redis's manager reports a connection as never broken, so after a Redis restart its
//! pool keeps handing out connections whose socket is gone. Here a connection that failed
//! with an I/O error is marked, and bb8 drops it and opens a fresh one.

use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::{AsyncConnectionConfig, Cmd, Pipeline, RedisError, RedisFuture, Value};

pub struct RedisManager {
    client: redis::Client,
}

impl RedisManager {
    pub fn new(url: &str) -> Result<RedisManager, RedisError> {
        Ok(RedisManager {
            client: redis::Client::open(url)?,
        })
    }
}

/// A multiplexed connection that remembers whether it failed at the transport level.
pub struct RedisConn {
    inner: MultiplexedConnection,
    broken: bool,
}

impl RedisConn {
    fn check<T>(&mut self, r: Result<T, RedisError>) -> Result<T, RedisError> {
        if let Err(e) = &r {
            if e.is_io_error() || e.is_connection_dropped() || e.is_unrecoverable_error() {
                self.broken = true;
            }
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
        // No response timeout of its own: the decision budget bounds every call, and a
        // reply that arrives after it is matched to its own (abandoned) request by the
        // multiplexer, never to the next one.
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(1)))
            .set_response_timeout(None);
        Ok(RedisConn {
            inner: self
                .client
                .get_multiplexed_async_connection_with_config(&config)
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
