//! How the engine reaches Redis ([`Backend`]): one server (a connection per worker thread
//! for the request path, a pool for the rest) or a cluster, and the retry rule for calls
//! off the request path ([`retrying!`](crate::retrying)). The gateway's Redis store shares
//! the same [`Backend`] for its own commands.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use redis::aio::ConnectionLike;
use redis::cluster_async::ClusterConnection;
use redis::{RedisFuture, Value};

use crate::pool::{tcp_settings, Dialer, Link, PerThread, RedisManager};
use crate::{key_slot, Every, StoreError};

/// How commands reach Redis.
pub enum Backend {
    /// One server: the request path uses one pipelined connection of our own per worker
    /// thread (`pipe.rs`); everything else a bb8 pool of redis-rs multiplexed connections.
    /// Both dial through one [`Dialer`], which knows which connections are still trusted.
    Single {
        pool: bb8::Pool<RedisManager>,
        per_thread: PerThread,
        dialer: Arc<Dialer>,
    },
    /// Redis Cluster: one multiplexed cluster connection (it follows MOVED/ASK and keeps a
    /// connection per node); cloning it is cheap. The request path reaches each master on
    /// a connection of its worker's own, as one server does ([`Node`]).
    Cluster(Box<ClusterBackend>),
}

/// The cluster connection, and how to make a fresh one. The cluster client re-dials a
/// node connection that fails with an I/O error, but not one that merely stops answering
/// (a partition, a node's name moved to a new host): its requests time out and are
/// retried on the same socket. So when calls time out and a fresh cluster connection
/// answers, the fresh one replaces the shared one.
pub struct ClusterBackend {
    conn: ArcSwap<ClusterConnection>,
    client: redis::cluster::ClusterClient,
    config: redis::cluster::ClusterConfig,
    control_timeout: Duration,
    /// One renewal at a time.
    renewing: tokio::sync::Mutex<()>,
    /// Which master serves each slot, as last read: takes for keys of one master go to it
    /// in one call (`gather`), on the worker's own connection to it.
    masters: Arc<ArcSwap<Option<Masters>>>,
    /// A seed's URL: the nodes are reached with its credentials.
    seed: String,
    /// Opens when `masters` should be read again.
    masters_due: Every,
}

/// How often the slot map is read again; a stale one only costs takes a second call.
const MASTERS_EVERY: Duration = Duration::from_secs(1);

/// How often a keeper looks for the slot map before it was first read.
const FIRST_READ_EVERY: Duration = Duration::from_millis(50);

/// The slot map as last read: each slot's master, as an index into `nodes` (ordered by
/// address).
pub struct Masters {
    of_slot: Vec<u16>,
    nodes: Vec<Arc<Node>>,
}

/// A master, and each worker's own connection to it (the request path's: a take or a
/// catalog lookup is one hop each way on the worker's thread, where the cluster
/// connection's replies are read on another thread). A node that leaves the slot map
/// keeps its workers' connections until it closes them.
pub struct Node {
    /// `host:port`, as `CLUSTER SLOTS` names it.
    pub addr: String,
    pub dialer: Arc<Dialer>,
    per_thread: PerThread,
}

impl Node {
    /// This worker's connection to the node (dialed, or the dial joined, when it has none).
    pub async fn link(&self) -> Result<Link, StoreError> {
        Ok(self.per_thread.get().await?)
    }
}

impl ClusterBackend {
    pub fn conn(&self) -> ClusterConnection {
        ClusterConnection::clone(&self.conn.load())
    }

    /// The master serving `slot` as last read, reading the slot map again in the
    /// background when it is older than a second. `None` until it was read once.
    pub fn master_of(&self, slot: u16) -> Option<u16> {
        if self.masters_due.due() {
            let (conn, masters) = (self.conn(), Arc::clone(&self.masters));
            let (seed, control_timeout) = (self.seed.clone(), self.control_timeout);
            tokio::spawn(async move {
                let known = masters.load_full();
                match read_masters(conn, (*known).as_ref(), &seed, control_timeout).await {
                    Ok(m) => masters.store(Arc::new(Some(m))),
                    Err(e) => tracing::debug!(error = %e, "reading the cluster's slot map"),
                }
            });
        }
        self.masters
            .load()
            .as_ref()
            .as_ref()
            .and_then(|m| m.of_slot.get(usize::from(slot)).copied())
            .filter(|m| *m != u16::MAX)
    }

    /// The master `index` (as [`Self::master_of`] names it).
    pub fn node(&self, index: u16) -> Option<Arc<Node>> {
        let masters = self.masters.load();
        let m = (**masters).as_ref()?;
        m.nodes.get(usize::from(index)).cloned()
    }

    /// The master serving `key`'s slot, as last read.
    pub fn node_of(&self, key: &str) -> Option<Arc<Node>> {
        self.master_of(key_slot(key)).and_then(|m| self.node(m))
    }

    /// Keeps this worker's connection to every master open (see [`PerThread::keep`]),
    /// following the slot map as it changes. Spawn once per worker.
    pub async fn keep(&self) {
        let mut kept: Vec<Arc<Node>> = Vec::new();
        let mut keepers = tokio::task::JoinSet::new();
        loop {
            // Reads the slot map when it is due.
            let _ = self.master_of(0);
            let now: Vec<Arc<Node>> = (*self.masters.load_full())
                .as_ref()
                .map(|m| m.nodes.clone())
                .unwrap_or_default();
            if now.len() != kept.len() || now.iter().zip(&kept).any(|(a, b)| !Arc::ptr_eq(a, b)) {
                keepers.abort_all();
                for node in &now {
                    let node = Arc::clone(node);
                    keepers.spawn_local(async move { node.per_thread.keep().await });
                }
                kept = now;
            }
            // Soon after start, until the slot map is first read.
            let known = !kept.is_empty();
            tokio::time::sleep(if known {
                MASTERS_EVERY
            } else {
                FIRST_READ_EVERY
            })
            .await;
        }
    }

    /// A fresh cluster connection (seed nodes, slot map, node connections), within the
    /// control timeout. It replaces the shared one when `check` passes on it.
    pub async fn renew<F, Fut>(&self, check: F) -> Result<(), StoreError>
    where
        F: FnOnce(ClusterConnection) -> Fut,
        Fut: std::future::Future<Output = Result<(), StoreError>>,
    {
        let Ok(_one) = self.renewing.try_lock() else {
            return Err(StoreError::Pool(
                "a cluster reconnection is under way".into(),
            ));
        };
        let fresh = tokio::time::timeout(
            self.control_timeout,
            self.client
                .get_async_connection_with_config(self.config.clone()),
        )
        .await
        .map_err(|_| StoreError::Pool("connecting to the cluster timed out".into()))??;
        check(fresh.clone()).await?;
        self.conn.store(Arc::new(fresh));
        tracing::warn!(
            "cluster connections stopped answering while the cluster answers: replaced them"
        );
        Ok(())
    }
}

/// A connection for one operation.
pub enum Conn<'a> {
    Pooled(bb8::PooledConnection<'a, RedisManager>),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn<'_> {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Pooled(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Pooled(c) => c.req_packed_commands(cmd, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Pooled(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// Runs `$body` with `$c` bound to a pooled connection and, when that connection turns
/// out dead (a transport error, or no answer within the control timeout), once more on a
/// fresh one. Only for operations that may run twice: reads, deletes, script loads, and
/// catalog writes, which the script makes idempotent (`catalog_write`). Counters (shadow
/// counts), audit appends and reconciliation reports are not retried: a reply lost after
/// Redis ran the command would count it twice; they are sent again at their next period
/// instead (shadow counts are kept until they are flushed).
///
/// A macro, not a function taking an async closure: the futures stay `Send` for
/// `tokio::spawn` (async closures borrowing their argument do not, yet).
#[macro_export]
macro_rules! retrying {
    ($store:expr, |$c:ident| $body:expr) => {{
        let first = {
            let mut conn = $store.conn().await?;
            let $c = &mut conn;
            $body
        };
        match first {
            Err($crate::StoreError::Redis(e))
                if $crate::pool::is_transport_error(&e) || e.is_timeout() =>
            {
                tracing::debug!(error = %e, "store call failed on its connection; once more on a fresh one");
                if e.is_timeout() {
                    $store.after_timeout().await;
                }
                let mut conn = $store.conn().await?;
                let $c = &mut conn;
                $body
            }
            r => r,
        }
    }};
}

/// The limits script (`engine/lua/bucket.lua`).
pub const BUCKET_LUA: &str = include_str!("../../lua/bucket.lua");

impl Backend {
    /// Builds the pool without connecting: a gateway starts (and fails open) while Redis
    /// is down, and connects once it answers.
    /// `control_timeout` bounds every call off the request path (and each dial).
    pub fn single(
        url: &str,
        pool_size: u32,
        control_timeout: Duration,
    ) -> Result<Backend, StoreError> {
        let dialer = Arc::new(Dialer::new(url, control_timeout)?);
        let pool = bb8::Pool::builder()
            .max_size(pool_size)
            .min_idle(Some(pool_size))
            // A checkout may have to dial, and a dial has the control timeout.
            .connection_timeout(control_timeout * 2)
            .retry_connection(false)
            // Checked without a round trip (`RedisManager::is_valid`): closed, broken and
            // retired connections are dropped here rather than failing a command.
            .test_on_check_out(true)
            .build_unchecked(RedisManager::new(Arc::clone(&dialer)));
        Ok(Backend::Single {
            pool,
            per_thread: PerThread::new(Arc::clone(&dialer)),
            dialer,
        })
    }

    /// Redis Cluster from seed nodes. Connects in the background, so the gateway starts
    /// (failing open) while the cluster is unreachable.
    pub fn cluster(urls: &[&str], control_timeout: Duration) -> Result<Backend, StoreError> {
        let client = redis::cluster::ClusterClientBuilder::new(urls.to_vec())
            .connection_timeout(control_timeout)
            .response_timeout(control_timeout)
            .tcp_settings(tcp_settings())
            .retries(2)
            .build()?;
        let config = redis::cluster::ClusterConfig::new()
            .set_connection_timeout(control_timeout)
            .set_response_timeout(control_timeout);
        let conn = client.get_pending_async_connection_with_config(config.clone());
        Ok(Backend::Cluster(Box::new(ClusterBackend {
            seed: urls.first().map(|u| u.to_string()).unwrap_or_default(),
            conn: ArcSwap::from_pointee(conn),
            client,
            config,
            control_timeout,
            renewing: tokio::sync::Mutex::new(()),
            masters: Arc::new(ArcSwap::from_pointee(None)),
            masters_due: Every::new(MASTERS_EVERY),
        })))
    }

    /// A connection off the request path: checked out of the pool (one server), or the
    /// shared cluster connection.
    pub async fn conn(&self) -> Result<Conn<'_>, StoreError> {
        match self {
            Backend::Single { pool, dialer, .. } => {
                // bb8 makes a caller wait out its checkout timeout when the connection it
                // waits for cannot be dialed; a Redis that refuses gets a quick answer.
                let mut failures = dialer.dial_failures();
                tokio::select! {
                    biased;
                    r = pool.get() => r.map(Conn::Pooled).map_err(|e| match e {
                        bb8::RunError::User(e) => StoreError::Redis(e),
                        bb8::RunError::TimedOut => {
                            StoreError::Pool("timed out waiting for a connection".into())
                        }
                    }),
                    Ok(()) = failures.changed() => Err(failures
                        .borrow()
                        .clone()
                        .map_or_else(|| StoreError::Pool("no connection".into()), StoreError::Redis)),
                }
            }
            Backend::Cluster(c) => Ok(Conn::Cluster(c.conn())),
        }
    }

    /// The worker's own connection for a read on the request path, if it has one open
    /// now (its keeper keeps it so): one server's ([`PerThread`]), or in a cluster the one
    /// to the master of `key`'s slot as the slot map last said. Its commands have no
    /// deadline of their own, and a redirection is not followed: the caller bounds the
    /// read, and runs it off the request path ([`Self::conn`]) when there is no link or
    /// the read fails on it.
    pub fn near(&self, key: &str) -> Option<Link> {
        match self {
            Backend::Single { per_thread, .. } => per_thread.current(),
            Backend::Cluster(c) => c.node_of(key)?.per_thread.current(),
        }
    }

    /// After a control-plane call timed out: a cluster gets a fresh connection (a single
    /// server's connections were already retired by the one that timed out).
    pub async fn after_timeout(&self) {
        if let Backend::Cluster(cluster) = self {
            if let Err(e) = cluster.renew(async |_| Ok(())).await {
                tracing::debug!(error = %e, "cluster reconnection after a timeout failed");
            }
        }
    }
}

/// A range of hash slots and the node serving it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotRange {
    pub first: u16,
    pub last: u16,
    /// `host:port`.
    pub node: String,
}

/// `CLUSTER SLOTS` as slot ranges and the node serving each.
pub fn parse_slots(ranges: Vec<Value>) -> Result<Vec<SlotRange>, StoreError> {
    let mut out = Vec::new();
    for r in ranges {
        let Value::Array(parts) = r else { continue };
        let (Some(start), Some(end), Some(Value::Array(master))) =
            (parts.first(), parts.get(1), parts.get(2))
        else {
            continue;
        };
        let int = |v: Option<&Value>| -> Result<i64, StoreError> {
            v.map(redis::from_redis_value_ref::<i64>)
                .transpose()
                .map_err(|e| StoreError::Protocol(format!("CLUSTER SLOTS: {e}")))
                .map(Option::unwrap_or_default)
        };
        let (start, end, port) = (int(Some(start))?, int(Some(end))?, int(master.get(1))?);
        let host: String = master
            .first()
            .and_then(|v| redis::from_redis_value_ref::<String>(v).ok())
            .unwrap_or_default();
        out.push(SlotRange {
            first: start as u16,
            last: end as u16,
            node: format!("{host}:{port}"),
        });
    }
    Ok(out)
}

/// The master of every slot, as an index among the masters (ordered by address). A
/// master `known` already keeps its node (and its workers' connections).
async fn read_masters(
    mut conn: ClusterConnection,
    known: Option<&Masters>,
    seed: &str,
    control_timeout: Duration,
) -> Result<Masters, StoreError> {
    let ranges: Vec<Value> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(&mut conn)
        .await?;
    let ranges = parse_slots(ranges)?;
    let mut addrs: Vec<&str> = ranges.iter().map(|r| r.node.as_str()).collect();
    addrs.sort_unstable();
    addrs.dedup();
    let mut of_slot = vec![u16::MAX; 16_384];
    for r in &ranges {
        let m = addrs.binary_search(&r.node.as_str()).unwrap_or(0) as u16;
        for slot in r.first..=r.last.min(16_383) {
            of_slot[usize::from(slot)] = m;
        }
    }
    let nodes = addrs
        .iter()
        .map(|addr| {
            if let Some(n) = known.and_then(|k| k.nodes.iter().find(|n| n.addr == *addr)) {
                return Ok(Arc::clone(n));
            }
            let (host, port) = addr
                .rsplit_once(':')
                .and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
                .ok_or_else(|| StoreError::Protocol(format!("CLUSTER SLOTS: node {addr}")))?;
            let dialer = Arc::new(Dialer::node(seed, host, port, control_timeout)?);
            Ok(Arc::new(Node {
                addr: addr.to_string(),
                per_thread: PerThread::new(Arc::clone(&dialer)),
                dialer,
            }))
        })
        .collect::<Result<Vec<_>, StoreError>>()?;
    Ok(Masters { of_slot, nodes })
}
