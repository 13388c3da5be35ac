//! The Redis side of the store: one `EVALSHA` per decision, a scripted catalog write, and
//! a change feed that gateways poll instead of reloading the catalog.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use redis::aio::ConnectionLike;
use redis::cluster_async::ClusterConnection;
use redis::{AsyncCommands, RedisError, RedisFuture, Script, Value};
use secrecy::{ExposeSecret, SecretString};

use super::coalesce::{Batch, Coalescer, Take};
use super::pool::{is_transport_error, tcp_settings, Dialer, PerThread, RedisManager};
use crate::configuration::redact_url;
use crate::domain::{bucket, BucketState, Verdict};
use crate::domain::{ClientId, Plan, PlanName};
use crate::store::records::{
    Audit, AuditEntry, CatalogChanges, CatalogDump, CatalogWrite, ClientRecord, Condition,
    PlanRecord, SafetyRecord, Versioned, WriteOutcome, SAFETY,
};
use crate::store::{ClientsPage, Keys, Reconcile, RegionShare, ShardState, StoreError};

/// One change-feed entry: its id and fields.
type FeedEntry = (String, Vec<(String, String)>);

/// How many change-feed entries one poll reads.
const FEED_PAGE: usize = 1000;

/// How commands reach Redis.
enum Backend {
    /// One server: the request path uses one multiplexed connection per worker thread;
    /// everything else a bb8 pool of multiplexed connections. Both dial through one
    /// [`Dialer`], which knows which connections are still trusted.
    Single {
        pool: bb8::Pool<RedisManager>,
        per_thread: PerThread,
        dialer: Arc<Dialer>,
    },
    /// Redis Cluster: one multiplexed cluster connection (it follows MOVED/ASK and keeps a
    /// connection per node); cloning it is cheap.
    Cluster(Box<ClusterBackend>),
}

/// The cluster connection, and how to make a fresh one. The cluster client re-dials a
/// node connection that fails with an I/O error, but not one that merely stops answering
/// (a partition, a node's name moved to a new host): its requests time out and are
/// retried on the same socket. So when calls time out and a fresh cluster connection
/// answers, the fresh one replaces the shared one.
struct ClusterBackend {
    conn: ArcSwap<ClusterConnection>,
    client: redis::cluster::ClusterClient,
    config: redis::cluster::ClusterConfig,
    control_timeout: Duration,
    /// One renewal at a time.
    renewing: tokio::sync::Mutex<()>,
}

impl ClusterBackend {
    fn conn(&self) -> ClusterConnection {
        ClusterConnection::clone(&self.conn.load())
    }

    /// A fresh cluster connection (seed nodes, slot map, node connections), within the
    /// control timeout. It replaces the shared one when `check` passes on it.
    async fn renew<F, Fut>(&self, check: F) -> Result<(), StoreError>
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
enum Conn<'a> {
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
macro_rules! retrying {
    ($store:expr, |$c:ident| $body:expr) => {{
        let first = {
            let mut conn = $store.conn().await?;
            let $c = &mut conn;
            $body
        };
        match first {
            Err(StoreError::Redis(e)) if is_transport_error(&e) || e.is_timeout() => {
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

/// Redis (one server or a cluster) as the store.
pub struct RedisStore {
    backend: Backend,
    keys: Keys,
    bucket: Script,
    catalog_write: Script,
    catalog_restore: Script,
    reconcile: Script,
    url: String,
    coalescer: Coalescer,
}

impl RedisStore {
    fn new(backend: Backend, keys: Keys, url: String) -> RedisStore {
        RedisStore {
            backend,
            keys,
            bucket: Script::new(include_str!("../../../lua/bucket.lua")),
            catalog_write: Script::new(include_str!("../../../lua/catalog_write.lua")),
            catalog_restore: Script::new(include_str!("../../../lua/catalog_restore.lua")),
            reconcile: Script::new(include_str!("../../../lua/reconcile.lua")),
            url,
            coalescer: Coalescer::default(),
        }
    }

    /// Builds the pool without connecting: a gateway starts (and fails open) while Redis
    /// is down, and connects once it answers.
    /// `control_timeout` bounds every call off the request path (and each dial).
    pub fn connect(
        url: &SecretString,
        pool_size: u32,
        control_timeout: Duration,
        keys: Keys,
    ) -> Result<RedisStore, StoreError> {
        let dialer = Arc::new(Dialer::new(url.expose_secret(), control_timeout)?);
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
        Ok(RedisStore::new(
            Backend::Single {
                pool,
                per_thread: PerThread::new(Arc::clone(&dialer)),
                dialer,
            },
            keys,
            redact_url(url.expose_secret()),
        ))
    }

    /// Redis Cluster from seed nodes. Connects in the background, so the gateway starts
    /// (failing open) while the cluster is unreachable.
    pub fn connect_cluster(
        nodes: &[SecretString],
        control_timeout: Duration,
        keys: Keys,
    ) -> Result<RedisStore, StoreError> {
        let urls: Vec<&str> = nodes.iter().map(|n| n.expose_secret()).collect();
        let client = redis::cluster::ClusterClientBuilder::new(urls.clone())
            .connection_timeout(control_timeout)
            .response_timeout(control_timeout)
            .tcp_settings(tcp_settings())
            .retries(2)
            .build()?;
        let config = redis::cluster::ClusterConfig::new()
            .set_connection_timeout(control_timeout)
            .set_response_timeout(control_timeout);
        let conn = client.get_pending_async_connection_with_config(config.clone());
        let url = format!(
            "cluster {}",
            urls.iter()
                .map(|u| redact_url(u))
                .collect::<Vec<_>>()
                .join(",")
        );
        let backend = Backend::Cluster(Box::new(ClusterBackend {
            conn: ArcSwap::from_pointee(conn),
            client,
            config,
            control_timeout,
            renewing: tokio::sync::Mutex::new(()),
        }));
        Ok(RedisStore::new(backend, keys, url))
    }

    pub fn describe(&self) -> String {
        format!("redis {}", self.url)
    }

    pub fn is_cluster(&self) -> bool {
        matches!(self.backend, Backend::Cluster(_))
    }

    /// Connections open and idle, for the pool saturation metrics (one server only).
    pub fn pool_state(&self) -> Option<(u32, u32)> {
        match &self.backend {
            Backend::Single { pool, .. } => {
                let s = pool.state();
                Some((s.connections, s.idle_connections))
            }
            Backend::Cluster(_) => None,
        }
    }

    /// Which node serves which slots: (first slot, last slot, "host:port") per range.
    pub async fn cluster_slots(&self) -> Result<Vec<(u16, u16, String)>, StoreError> {
        let ranges: Vec<Value> = retrying!(self, |c| async {
            Ok(redis::cmd("CLUSTER").arg("SLOTS").query_async(c).await?)
        }
        .await)?;
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
            out.push((start as u16, end as u16, format!("{host}:{port}")));
        }
        Ok(out)
    }

    pub async fn reconcile(&self, r: &Reconcile<'_>) -> Result<ShardState, StoreError> {
        let mut inv = self.reconcile.prepare_invoke();
        inv.key(self.keys.shard_state(r.client))
            .key(self.keys.shard_history(r.client))
            .key(self.keys.bucket(r.client))
            .arg(r.period_ms)
            .arg(r.region.as_str())
            .arg(r.demand)
            .arg(r.fill.map(|f| f.to_string()).unwrap_or_default())
            .arg(r.floor)
            .arg(r.plan.capacity())
            .arg(r.plan.rate());
        for region in r.regions {
            inv.arg(region.as_str());
        }
        let mut c = self.conn().await?;
        let out: Vec<Option<String>> = inv.invoke_async(&mut c).await?;
        parse_shard_state(&out).ok_or_else(|| StoreError::Protocol("reconcile reply".into()))
    }

    pub async fn shard_view(
        &self,
        client: &ClientId,
    ) -> Result<(Option<ShardState>, Vec<serde_json::Value>), StoreError> {
        let (fields, history): (std::collections::HashMap<String, String>, Vec<String>) =
            retrying!(self, |c| async {
                Ok(redis::pipe()
                    .hgetall(self.keys.shard_state(client))
                    .lrange(self.keys.shard_history(client), 0, 59)
                    .query_async(c)
                    .await?)
            }
            .await)?;
        let history = history
            .iter()
            .filter_map(|h| serde_json::from_str(h).ok())
            .collect();
        if fields.is_empty() {
            return Ok((None, history));
        }
        let num = |k: &str| fields.get(k).and_then(|v| v.parse::<f64>().ok());
        let mut regions: Vec<RegionShare> = fields
            .iter()
            .filter_map(|(k, v)| {
                let region = k.strip_prefix("s:")?;
                Some(RegionShare {
                    region: region.to_string(),
                    share: v.parse().ok()?,
                    fill: num(&format!("f:{region}")),
                })
            })
            .collect();
        regions.sort_by(|a, b| a.region.cmp(&b.region));
        Ok((
            Some(ShardState {
                updated_at_ms: num("ts").unwrap_or(0.0) as u64,
                since_ms: num("since").unwrap_or(0.0) as u64,
                seed: num("seed").unwrap_or(1.0),
                regions,
            }),
            history,
        ))
    }

    /// Adds shadow-mode comparison counts (compared, disagreed) per client.
    pub async fn shadow_add(&self, counts: &[(String, u64, u64)]) -> Result<(), StoreError> {
        let mut pipe = redis::pipe();
        for (client, compared, disagreed) in counts {
            pipe.hincr(self.keys.shadow("compared"), client, *compared)
                .ignore();
            if *disagreed > 0 {
                pipe.hincr(self.keys.shadow("disagreed"), client, *disagreed)
                    .ignore();
            }
        }
        let mut c = self.conn().await?;
        let _: () = pipe.query_async(&mut c).await?;
        Ok(())
    }

    /// Shadow-mode counts per client, summed over every gateway sharing this store.
    pub async fn shadow_counts(&self) -> Result<Vec<(String, u64, u64)>, StoreError> {
        let (compared, disagreed) = retrying!(self, |c| async {
            Ok((
                scan_hash(c, &self.keys.shadow("compared")).await?,
                scan_hash(c, &self.keys.shadow("disagreed")).await?,
            ))
        }
        .await)?;
        let disagreed: std::collections::HashMap<String, String> = disagreed.into_iter().collect();
        Ok(compared
            .into_iter()
            .map(|(client, n)| {
                let d = disagreed
                    .get(&client)
                    .and_then(|d| d.parse().ok())
                    .unwrap_or(0);
                (client, n.parse().unwrap_or(0), d)
            })
            .collect())
    }

    pub async fn shadow_reset(&self) -> Result<(), StoreError> {
        retrying!(self, |c| async {
            let _: () = redis::pipe()
                .del(self.keys.shadow("compared"))
                .ignore()
                .del(self.keys.shadow("disagreed"))
                .ignore()
                .query_async(c)
                .await?;
            Ok(())
        }
        .await)
    }

    async fn conn(&self) -> Result<Conn<'_>, StoreError> {
        match &self.backend {
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

    /// `SCRIPT LOAD`s both scripts, so the first requests already hit `EVALSHA`.
    pub async fn load_scripts(&self) -> Result<(), StoreError> {
        retrying!(self, |c| async {
            self.bucket.load_async(c).await?;
            self.catalog_write.load_async(c).await?;
            Ok(())
        }
        .await)
    }

    /// Takes `cost` tokens from the bucket at `key`, answering by `deadline` (then with
    /// [`StoreError::Deadline`]). Takes for one bucket that arrive on this worker while a
    /// call for it is in flight go to Redis together, in time for their deadlines (see
    /// `coalesce`); each still gets the verdict one-by-one calls would have given it.
    pub async fn take(
        &self,
        key: &str,
        plan: Plan,
        cost: f64,
        initial: Option<f64>,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<Verdict, StoreError> {
        let take = Take {
            plan,
            cost,
            initial,
            deadline,
        };
        self.coalescer
            .take(key, take, |batch| self.take_batch(key, batch))
            .await
    }

    /// Bucket script calls sent and the takes they decided, since start.
    pub fn bucket_calls(&self) -> (u64, u64) {
        self.coalescer.counts()
    }

    /// One `EVALSHA` deciding `batch.n` takes, in order. Several may be in flight for one
    /// bucket: they go out on this worker's one connection, which Redis serves in order,
    /// and each reply carries the tokens at its own start.
    async fn take_batch(&self, key: &str, batch: Batch) -> Result<Vec<Verdict>, StoreError> {
        // `invoke_async` sends EVALSHA and, on NOSCRIPT (a restarted or flushed Redis),
        // loads the script and retries once.
        let mut inv = self.bucket.prepare_invoke();
        inv.key(key)
            .arg(batch.plan.capacity())
            .arg(batch.plan.rate())
            .arg(batch.cost)
            .arg(batch.initial.map(|i| i.to_string()).unwrap_or_default());
        if batch.n > 1 {
            inv.arg(batch.n);
        }
        let reply: Result<(usize, String), RedisError> = match &self.backend {
            Backend::Single { per_thread, .. } => {
                let link = per_thread.get().await?;
                let r = inv.invoke_async(&mut link.connection()).await;
                link.check(&r);
                r
            }
            Backend::Cluster(c) => inv.invoke_async(&mut c.conn()).await,
        };
        let (admitted, refilled) = reply?;
        let refilled = refilled
            .parse::<f64>()
            .map_err(|_| StoreError::Protocol(format!("tokens {refilled:?}")))?;
        let verdicts = bucket::take_many(refilled, batch.plan, batch.cost, batch.n);
        // The script did the same subtractions; a different count means it is not the
        // script this gateway was built with.
        if verdicts.iter().filter(|v| v.allowed).count() != admitted {
            return Err(StoreError::Protocol(format!(
                "bucket script admitted {admitted} of {}, expected otherwise",
                batch.n
            )));
        }
        Ok(verdicts)
    }

    /// Keeps this worker thread's request-path connection open, from before the first
    /// request until the thread ends (one server; a cluster connection keeps itself).
    pub async fn keep_connected(&self) {
        if let Backend::Single { per_thread, .. } = &self.backend {
            per_thread.keep().await;
        }
    }

    /// Whether Redis answers a round trip within `budget` on a *fresh* connection (the
    /// breaker's probe; `key`: a key on the node the breaker guards, in a cluster). When
    /// it does, the connections opened before are retired: the breaker opened because
    /// they failed, and a fresh one works, so they may be dead (a partition, a failover
    /// behind the name) even though Redis is not.
    pub async fn probe(&self, key: Option<&str>, budget: Duration) -> Result<(), StoreError> {
        match &self.backend {
            Backend::Single { dialer, .. } => {
                dialer.answers_fresh(budget).await?;
                dialer.retire_all();
                Ok(())
            }
            Backend::Cluster(cluster) => {
                let check = async |mut c: ClusterConnection| {
                    let mut cmd = redis::cmd("EXISTS");
                    cmd.arg(key.unwrap_or("tollgate:probe"));
                    tokio::time::timeout(budget, cmd.query_async::<i64>(&mut c))
                        .await
                        .map_err(|_| StoreError::Pool("probe timed out".into()))??;
                    Ok(())
                };
                if check(cluster.conn()).await.is_ok() {
                    return Ok(());
                }
                cluster.renew(check).await
            }
        }
    }

    /// After a control-plane call timed out: a cluster gets a fresh connection (a single
    /// server's connections were already retired by the one that timed out).
    async fn after_timeout(&self) {
        if let Backend::Cluster(cluster) = &self.backend {
            if let Err(e) = cluster.renew(async |_| Ok(())).await {
                tracing::debug!(error = %e, "cluster reconnection after a timeout failed");
            }
        }
    }

    pub async fn refill(&self, key: &str) -> Result<(), StoreError> {
        retrying!(self, |c| async {
            let _: i64 = c.del(key).await?;
            Ok(())
        }
        .await)
    }

    /// A round trip on a pooled connection (readiness). Dead connections are dropped at
    /// checkout, and one found dead on the way is retried on a fresh one, so the answer is
    /// about Redis, not about a stale socket.
    pub async fn ping(&self) -> Result<(), StoreError> {
        retrying!(self, |c| async {
            redis::cmd("PING").query_async::<String>(c).await?;
            Ok(())
        }
        .await)
    }

    pub async fn catalog_dump(&self) -> Result<CatalogDump, StoreError> {
        retrying!(self, |c| self.catalog_dump_on(c).await)
    }

    async fn catalog_dump_on(&self, c: &mut Conn<'_>) -> Result<CatalogDump, StoreError> {
        // The version first: anything written during the scan is in the feed after it.
        let (version, epoch): (Option<u64>, Option<String>) = redis::pipe()
            .get(self.keys.catalog("version"))
            .get(self.keys.catalog("epoch"))
            .query_async(c)
            .await?;
        let mut dump = CatalogDump {
            epoch,
            version: version.unwrap_or(0),
            ..CatalogDump::default()
        };
        for (field, raw) in scan_hash(c, &self.keys.catalog("plans")).await? {
            match parse_entity::<PlanRecord>(&raw) {
                Some(p) => dump.plans.push(p),
                None => tracing::warn!(plan = %field, "unreadable plan record skipped"),
            }
        }
        for (field, raw) in scan_hash(c, &self.keys.catalog("clients")).await? {
            match parse_entity::<ClientRecord>(&raw) {
                Some(p) => dump.clients.push(p),
                None => tracing::warn!(client = %field, "unreadable client record skipped"),
            }
        }
        let safety: Option<String> = c.hget(self.keys.catalog("settings"), SAFETY).await?;
        dump.safety = safety.and_then(|r| parse_entity(&r));
        Ok(dump)
    }

    pub async fn catalog_changes(
        &self,
        since: u64,
        epoch: Option<&str>,
    ) -> Result<CatalogChanges, StoreError> {
        match retrying!(self, |c| self.catalog_changes_on(c, since, epoch).await)? {
            Some(changes) => Ok(changes),
            None => Ok(CatalogChanges::Reload(self.catalog_dump().await?)),
        }
    }

    /// What changed after `since`; `None` when the feed cannot say (reload everything).
    async fn catalog_changes_on(
        &self,
        c: &mut Conn<'_>,
        since: u64,
        epoch: Option<&str>,
    ) -> Result<Option<CatalogChanges>, StoreError> {
        let (version, stored_epoch, entries): (Option<u64>, Option<String>, Vec<FeedEntry>) =
            redis::pipe()
                .get(self.keys.catalog("version"))
                .get(self.keys.catalog("epoch"))
                .cmd("XRANGE")
                .arg(self.keys.catalog("changes"))
                .arg(format!("{}-0", since + 1))
                .arg("+")
                .arg("COUNT")
                .arg(FEED_PAGE)
                .query_async(c)
                .await?;
        let version = version.unwrap_or(0);
        // Another catalog (or one that lost its identity): versions cannot be compared.
        if stored_epoch.as_deref() != epoch {
            return Ok(None);
        }
        if version == since {
            return Ok(Some(CatalogChanges::Unchanged));
        }
        // A gap (trimmed feed, or a store that was reset) means the feed cannot be trusted
        // to say what changed: reload everything.
        let contiguous = entries
            .first()
            .is_some_and(|(id, _)| *id == format!("{}-0", since + 1));
        if version < since || !contiguous {
            return Ok(None);
        }
        let last = entries
            .last()
            .and_then(|(id, _)| id.split('-').next()?.parse::<u64>().ok())
            .ok_or_else(|| StoreError::Protocol("change feed id".into()))?;
        let mut plan_ids = BTreeSet::new();
        let mut client_ids = BTreeSet::new();
        let mut safety_changed = false;
        for (_, fields) in &entries {
            let get = |name: &str| {
                fields
                    .iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v.as_str())
            };
            match (get("kind"), get("id")) {
                (Some("plan"), Some(id)) => {
                    plan_ids.insert(id.to_string());
                }
                (Some("client"), Some(id)) => {
                    client_ids.insert(id.to_string());
                }
                (Some("setting"), Some(SAFETY)) => safety_changed = true,
                _ => tracing::warn!("unreadable change feed entry skipped"),
            }
        }
        let plan_ids: Vec<String> = plan_ids.into_iter().collect();
        let client_ids: Vec<String> = client_ids.into_iter().collect();
        let mut pipe = redis::pipe();
        pipe.cmd("HMGET")
            .arg(self.keys.catalog("plans"))
            .arg(&plan_ids)
            .arg("")
            .cmd("HMGET")
            .arg(self.keys.catalog("clients"))
            .arg(&client_ids)
            .arg("")
            .hget(self.keys.catalog("settings"), SAFETY);
        let (plan_vals, client_vals, safety): (
            Vec<Option<String>>,
            Vec<Option<String>>,
            Option<String>,
        ) = pipe.query_async(c).await?;
        let plans = plan_ids
            .iter()
            .zip(plan_vals)
            .filter_map(|(id, raw)| {
                let name = PlanName::parse(id).ok()?;
                Some((name, raw.and_then(|r| parse_entity(&r))))
            })
            .collect();
        let clients = client_ids
            .iter()
            .zip(client_vals)
            .filter_map(|(id, raw)| {
                let id = ClientId::parse(id).ok()?;
                Some((id, raw.and_then(|r| parse_entity(&r))))
            })
            .collect();
        Ok(Some(CatalogChanges::Delta {
            version: last,
            plans,
            clients,
            safety: safety_changed.then(|| safety.and_then(|r| parse_entity(&r))),
            more: entries.len() == FEED_PAGE,
        }))
    }

    pub async fn catalog_write(
        &self,
        write: &CatalogWrite,
        audit: &Audit,
    ) -> Result<WriteOutcome, StoreError> {
        let mut inv = self.catalog_write.prepare_invoke();
        for part in [
            "plans", "clients", "keys", "users", "version", "changes", "settings", "index", "audit",
        ] {
            inv.key(self.keys.catalog(part));
        }
        // This write's own id: a resend of a write that Redis already ran (its reply lost
        // with the connection) answers the first run's reply and changes nothing.
        inv.key(
            self.keys
                .catalog(&format!("write:{}", uuid::Uuid::new_v4().simple())),
        )
        .key(self.keys.catalog("epoch"));
        let (op, plan, hashes) = match write {
            CatalogWrite::PutClient(c, _) => (
                "put",
                c.plan.to_string(),
                c.keys.iter().map(|k| k.hash.to_string()).collect(),
            ),
            CatalogWrite::PutPlan(..) | CatalogWrite::PutSafety(..) => {
                ("put", String::new(), vec![])
            }
            CatalogWrite::DeletePlan(..) | CatalogWrite::DeleteClient(..) => {
                ("delete", String::new(), vec![])
            }
        };
        let cond = match write.condition() {
            Condition::Any => "any".to_string(),
            Condition::Absent => "absent".to_string(),
            Condition::Rev(r) => r.to_string(),
        };
        inv.arg(write.kind())
            .arg(op)
            .arg(write.id())
            .arg(cond)
            .arg(write.json().unwrap_or_default())
            .arg(plan)
            .arg(&audit.actor)
            .arg(&audit.action)
            .arg(if audit.names_catalog {
                uuid::Uuid::new_v4().simple().to_string()
            } else {
                String::new()
            })
            .arg(hashes);
        let (status, rev, detail): (String, u64, Value) =
            retrying!(self, |c| async { Ok(inv.invoke_async(c).await?) }.await)?;
        Ok(match status.as_str() {
            "ok" => WriteOutcome::Written {
                rev,
                before: redis::from_redis_value::<Option<String>>(detail).unwrap_or(None),
            },
            "exists" => WriteOutcome::Exists,
            "stale" => WriteOutcome::Stale { current: rev },
            "missing" => WriteOutcome::Missing,
            "unknown_plan" => WriteOutcome::UnknownPlan,
            "plan_in_use" => WriteOutcome::PlanInUse,
            "key_conflict" => WriteOutcome::KeyConflict,
            other => return Err(StoreError::Protocol(format!("catalog write: {other}"))),
        })
    }

    /// Puts `mirror` in place of the store's catalog if the store is still at `seen`
    /// (`lua/catalog_restore.lua`). Retried on a fresh connection like any write: a resend
    /// after a lost reply finds the store moved (to the mirror) and writes nothing.
    pub async fn catalog_restore(
        &self,
        seen: (Option<&str>, u64),
        mirror: &CatalogDump,
    ) -> Result<bool, StoreError> {
        let record = |kind: &str, id: &str, rev: u64, json: Option<String>| {
            json.map(|json| serde_json::json!({"kind": kind, "id": id, "rev": rev, "json": json}))
        };
        let mut records = Vec::new();
        for p in &mirror.plans {
            records.extend(record(
                "plan",
                p.value.name.as_str(),
                p.rev,
                serde_json::to_string(&p.value).ok(),
            ));
        }
        for c in &mirror.clients {
            if let Some(mut r) = record(
                "client",
                c.value.id.as_str(),
                c.rev,
                serde_json::to_string(&c.value).ok(),
            ) {
                r["plan"] = c.value.plan.as_str().into();
                r["hashes"] = c
                    .value
                    .keys
                    .iter()
                    .map(|k| serde_json::Value::from(k.hash.to_string()))
                    .collect();
                records.push(r);
            }
        }
        if let Some(s) = &mirror.safety {
            records.extend(record(
                "setting",
                SAFETY,
                s.rev,
                serde_json::to_string(&s.value).ok(),
            ));
        }
        let mut inv = self.catalog_restore.prepare_invoke();
        for part in [
            "plans", "clients", "keys", "users", "version", "changes", "settings", "index",
            "audit", "epoch",
        ] {
            inv.key(self.keys.catalog(part));
        }
        inv.arg(seen.0.unwrap_or(""))
            .arg(seen.1)
            .arg(mirror.epoch.as_deref().unwrap_or(""))
            .arg(mirror.version)
            .arg(serde_json::Value::Array(records).to_string());
        let status: String = retrying!(self, |c| async { Ok(inv.invoke_async(c).await?) }.await)?;
        Ok(status == "restored")
    }

    pub async fn plan(&self, name: &str) -> Result<Option<Versioned<PlanRecord>>, StoreError> {
        self.entity("plans", name).await
    }

    pub async fn client(&self, id: &str) -> Result<Option<Versioned<ClientRecord>>, StoreError> {
        self.entity("clients", id).await
    }

    pub async fn safety(&self) -> Result<Option<Versioned<SafetyRecord>>, StoreError> {
        self.entity("settings", SAFETY).await
    }

    async fn entity<T: serde::de::DeserializeOwned>(
        &self,
        hash: &str,
        id: &str,
    ) -> Result<Option<Versioned<T>>, StoreError> {
        let raw: Option<String> = retrying!(self, |c| async {
            Ok(c.hget(self.keys.catalog(hash), id).await?)
        }
        .await)?;
        Ok(raw.and_then(|r| parse_entity(&r)))
    }

    pub async fn plans(&self) -> Result<Vec<Versioned<PlanRecord>>, StoreError> {
        let mut out: Vec<Versioned<PlanRecord>> = retrying!(self, |c| async {
            scan_hash(c, &self.keys.catalog("plans")).await
        }
        .await)?
        .into_iter()
        .filter_map(|(_, raw)| parse_entity(&raw))
        .collect();
        out.sort_by(|a, b| a.value.name.cmp(&b.value.name));
        Ok(out)
    }

    /// Up to `limit` clients in id order, after the id `after`.
    pub async fn clients_page(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<ClientsPage, StoreError> {
        retrying!(self, |c| async {
            let start = after.map_or_else(|| "-".to_string(), |a| format!("({a}"));
            let ids: Vec<String> = redis::cmd("ZRANGE")
                .arg(self.keys.catalog("index"))
                .arg(start)
                .arg("+")
                .arg("BYLEX")
                .arg("LIMIT")
                .arg(0)
                .arg(limit)
                .query_async(c)
                .await?;
            if ids.is_empty() {
                return Ok(ClientsPage::default());
            }
            let raws: Vec<Option<String>> = redis::cmd("HMGET")
                .arg(self.keys.catalog("clients"))
                .arg(&ids)
                .query_async(c)
                .await?;
            // The cursor is the last id the index gave, whether or not its client was
            // deleted between the two reads: a page thinned by deletes is not the last.
            Ok(ClientsPage {
                next: (ids.len() == limit).then(|| ids[ids.len() - 1].clone()),
                items: raws
                    .into_iter()
                    .flatten()
                    .filter_map(|r| parse_entity(&r))
                    .collect(),
            })
        }
        .await)
    }

    /// The newest `limit` audit entries, newest first.
    pub async fn audit(&self, limit: usize) -> Result<Vec<AuditEntry>, StoreError> {
        retrying!(self, |c| async {
            let entries: Vec<FeedEntry> = redis::cmd("XREVRANGE")
                .arg(self.keys.catalog("audit"))
                .arg("+")
                .arg("-")
                .arg("COUNT")
                .arg(limit)
                .query_async(c)
                .await?;
            Ok(entries
                .into_iter()
                .map(|(_, fields)| {
                    let get = |name: &str| {
                        fields
                            .iter()
                            .find(|(k, _)| k == name)
                            .map(|(_, v)| v.clone())
                            .unwrap_or_default()
                    };
                    let json = |name: &str| serde_json::from_str(&get(name)).ok();
                    AuditEntry {
                        at_ms: get("at_ms").parse().unwrap_or(0),
                        actor: get("actor"),
                        action: get("action"),
                        kind: get("kind"),
                        id: get("id"),
                        rev: get("rev").parse().unwrap_or(0),
                        before: json("before"),
                        after: json("after"),
                    }
                })
                .collect())
        }
        .await)
    }

    /// Appends an audit entry for a change outside the catalog (a bucket refill).
    pub async fn record_audit(&self, entry: &AuditEntry) -> Result<(), StoreError> {
        let mut c = self.conn().await?;
        let _: String = redis::cmd("XADD")
            .arg(self.keys.catalog("audit"))
            .arg("MAXLEN")
            .arg("~")
            .arg(100_000)
            .arg("*")
            .arg("at_ms")
            .arg(entry.at_ms)
            .arg("actor")
            .arg(&entry.actor)
            .arg("action")
            .arg(&entry.action)
            .arg("kind")
            .arg(&entry.kind)
            .arg("id")
            .arg(&entry.id)
            .arg("rev")
            .arg(entry.rev)
            .arg("before")
            .arg(
                entry
                    .before
                    .as_ref()
                    .map(|v| v.to_string())
                    .unwrap_or_default(),
            )
            .arg("after")
            .arg(
                entry
                    .after
                    .as_ref()
                    .map(|v| v.to_string())
                    .unwrap_or_default(),
            )
            .query_async(&mut c)
            .await?;
        Ok(())
    }

    /// The bucket's tokens now (refilled on Redis' clock), or `None` if it does not exist
    /// (a missing bucket is full).
    pub async fn tokens_now(&self, key: &str, plan: Plan) -> Result<Option<f64>, StoreError> {
        retrying!(self, |c| async {
            let ((tk, ts), (secs, micros)): ((Option<String>, Option<String>), (u64, u64)) =
                redis::pipe()
                    .cmd("HMGET")
                    .arg(key)
                    .arg("tk")
                    .arg("ts")
                    .cmd("TIME")
                    .query_async(c)
                    .await?;
            let (Some(tk), Some(ts)) = (tk, ts) else {
                return Ok(None);
            };
            let state = BucketState {
                tokens: tk.parse().unwrap_or(0.0),
                ts_us: ts.parse().unwrap_or(0),
            };
            let (_, v) =
                crate::domain::bucket::take(Some(state), secs * 1_000_000 + micros, plan, 0.0);
            Ok(Some(v.tokens))
        }
        .await)
    }
}

/// Parses the reconcile script's reply.
fn parse_shard_state(out: &[Option<String>]) -> Option<ShardState> {
    let num = |i: usize| out.get(i)?.as_deref()?.parse::<f64>().ok();
    let regions = out
        .get(3..)?
        .chunks(3)
        .filter_map(|c| {
            Some(RegionShare {
                region: c.first()?.clone()?,
                share: c.get(1)?.as_deref()?.parse().ok()?,
                fill: c.get(2)?.as_deref().and_then(|f| f.parse().ok()),
            })
        })
        .collect();
    Some(ShardState {
        updated_at_ms: num(0)? as u64,
        since_ms: num(1)? as u64,
        seed: num(2).unwrap_or(1.0),
        regions,
    })
}

/// Parses `"<rev> <json>"`.
fn parse_entity<T: serde::de::DeserializeOwned>(raw: &str) -> Option<Versioned<T>> {
    let (rev, json) = raw.split_once(' ')?;
    Some(Versioned {
        rev: rev.parse().ok()?,
        value: serde_json::from_str(json).ok()?,
    })
}

/// Every field of a hash, with HSCAN (a catalog may hold millions of clients).
async fn scan_hash(
    c: &mut impl ConnectionLike,
    key: &str,
) -> Result<Vec<(String, String)>, StoreError> {
    let mut out = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, page): (u64, Vec<(String, String)>) = redis::cmd("HSCAN")
            .arg(key)
            .arg(cursor)
            .arg("COUNT")
            .arg(1000)
            .query_async(c)
            .await?;
        out.extend(page);
        if next == 0 {
            return Ok(out);
        }
        cursor = next;
    }
}
