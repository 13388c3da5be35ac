//! One script call for the takes of many clients.
//!
//! With thousands of clients, the coalescer (`coalesce`) rarely finds two takes for the
//! same bucket, and one script call per decision makes Redis pay its per-call cost (parse
//! the command, enter Lua, reply: about 10 µs) for every request. So the takes a worker
//! makes go to Redis gathered: the first take of a worker's turn opens a batch and
//! schedules its sending as a task behind the requests already woken; every take made
//! before that task runs joins the batch, one entry each. Then one `EVALSHA`
//! (`lua/bucket.lua`, one entry per key) decides them all, in order, on the worker's
//! connection.
//!
//! Nothing waits for a batch to fill: an idle gateway sends each take as soon as the
//! worker has nothing else to run, one scheduler hop later (microseconds), so a lone
//! request still costs one round trip. A busy worker gathers as many takes as it handled
//! in that turn, up to [`MAX_ENTRIES`]; the entries of one call share Redis' `TIME` and its
//! per-call cost.
//!
//! The sending is a task of its own, not a request's future: a request that gives up
//! (its budget, a client that hung up) never takes the others' call down with it.
//!
//! On Redis Cluster the keys a command declares must share a slot, and a script may only
//! touch keys its node serves. So a batch holds the takes of one master (`Group::Master`,
//! from the slot map read once a second): the call declares its first key, which routes
//! it, and passes the others as arguments. Each entry runs under `pcall`: a key whose slot
//! moved since the map was read fails alone (`Answer::bytes` says why) and is sent again
//! on its own, declared, where the cluster client follows the redirection. Until the map
//! is read, a batch holds the takes of one slot (`Group::Slot`).

use std::cell::RefCell;
use std::collections::HashMap;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use redis::cluster_async::ClusterConnection;
use redis::{RedisError, RedisWrite, Script, ToRedisArgs};
use tokio::sync::oneshot;

use super::pool::Link;
use crate::domain::quota::Bounds;
use crate::domain::{Applied, AppliedKind};
use crate::store::StoreError;

/// Most entries one call carries; more open the next batch.
pub const MAX_ENTRIES: usize = 128;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The script's arguments, packed in one buffer: one allocation per batch rather than
/// one per argument.
#[derive(Default)]
pub struct Argv {
    buf: Vec<u8>,
    ends: Vec<usize>,
}

impl Argv {
    /// Appends one argument, as `v` displays.
    pub fn push(&mut self, v: impl std::fmt::Display) -> &mut Self {
        // Writing into a Vec cannot fail.
        let _ = write!(self.buf, "{v}");
        self.ends.push(self.buf.len());
        self
    }
}

impl ToRedisArgs for Argv {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + RedisWrite,
    {
        let mut start = 0;
        for &end in &self.ends {
            out.write_arg(&self.buf[start..end]);
            start = end;
        }
    }
}

/// The connection a batch goes out on.
pub enum Conn {
    /// The worker's own connection to the one server.
    Single(Link),
    Cluster(ClusterConnection),
}

/// Which takes may share a call.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub enum Group {
    /// One server: every take of a worker's turn.
    All,
    /// A cluster slot: the keys are declared.
    Slot(u16),
    /// A cluster master (an index among the masters): only the first key is declared.
    Master(u16),
}

/// An entry's part of a call's reply: Redis' clock (unix µs) and the entry's binary
/// string (see `lua/bucket.lua`), or why it failed.
/// A call's per-entry strings (the first is Redis' clock).
type Replies = Arc<Vec<Vec<u8>>>;

#[derive(Debug)]
pub struct Answer {
    pub now_us: u64,
    /// The requests the whole call decided (the takes of all its entries).
    pub takes: u64,
    replies: Replies,
    at: usize,
}

impl Answer {
    /// The entry's reply, or the error it met (e.g. a key whose slot moved).
    pub fn bytes(&self) -> Result<&[u8], String> {
        let reply = &self.replies[self.at];
        if self.replies[1].get(self.at - 2) == Some(&b'1') {
            Ok(reply)
        } else {
            Err(String::from_utf8_lossy(reply).into_owned())
        }
    }
}

/// What an entry asks of its limits (its `op`).
#[derive(Clone, Copy)]
pub enum Op {
    Take,
    Adjust,
    Peek,
}

/// One entry to decide: `n` requests at `key`, each costing `cost` of every limit in
/// `applied`.
#[derive(Clone, Copy)]
pub struct Entry<'a> {
    pub key: &'a str,
    pub op: Op,
    pub cost: f64,
    pub n: usize,
    pub applied: &'a [Applied],
}

/// The batch a worker is filling.
struct Pending {
    conn: Conn,
    /// Whether the call declares every key (else only the first).
    declare_all: bool,
    keys: Vec<String>,
    /// The distinct limit sets of the entries, and their arguments.
    sets: Vec<Vec<Applied>>,
    set_args: Argv,
    entry_args: Argv,
    waiters: Vec<oneshot::Sender<Result<Answer, StoreError>>>,
    takes: u64,
    /// Still taking entries: its task has not run yet.
    open: bool,
}

type Shared = Arc<Mutex<Pending>>;

thread_local! {
    /// The open batch per (gatherer, group) on this thread.
    static OPEN: RefCell<HashMap<(u64, Group), Shared>> = RefCell::new(HashMap::new());
}

/// Gathers one store's entries into calls of the limits script.
pub struct Gatherer {
    id: u64,
    script: Arc<Lua>,
    counts: Arc<Counts>,
}

/// A script's text and its SHA1.
struct Lua {
    code: &'static str,
    hash: String,
}

#[derive(Default)]
struct Counts {
    calls: AtomicU64,
    takes: AtomicU64,
}

impl Gatherer {
    pub fn new(code: &'static str) -> Gatherer {
        Gatherer {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            script: Arc::new(Lua {
                code,
                hash: Script::new(code).get_hash().to_owned(),
            }),
            counts: Arc::default(),
        }
    }

    /// Calls sent and the takes they decided, since start.
    pub fn counts(&self) -> (u64, u64) {
        (
            self.counts.calls.load(Ordering::Relaxed),
            self.counts.takes.load(Ordering::Relaxed),
        )
    }

    /// Decides `entry` in the batch open for `group` on this worker, or in a new one sent
    /// on the connection `conn` brings.
    pub async fn decide<C, Fut>(
        &self,
        group: Group,
        entry: Entry<'_>,
        conn: C,
    ) -> Result<Answer, StoreError>
    where
        C: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<Conn, StoreError>>,
    {
        let (tx, rx) = oneshot::channel();
        let mut tx = Some(tx);
        let open = OPEN.with(|m| m.borrow().get(&(self.id, group)).cloned());
        if let Some(batch) = open {
            let mut b = batch.lock().unwrap_or_else(|p| p.into_inner());
            if b.open && b.waiters.len() < MAX_ENTRIES {
                b.add(&entry, tx.take().expect("not used yet"));
            }
        }
        if let Some(tx) = tx {
            let mut pending = Pending {
                conn: conn().await?,
                declare_all: !matches!(group, Group::Master(_)),
                keys: Vec::new(),
                sets: Vec::new(),
                set_args: Argv::default(),
                entry_args: Argv::default(),
                waiters: Vec::new(),
                takes: 0,
                open: true,
            };
            pending.add(&entry, tx);
            let batch = Arc::new(Mutex::new(pending));
            OPEN.with(|m| m.borrow_mut().insert((self.id, group), Arc::clone(&batch)));
            tokio::spawn(send(
                batch,
                Arc::clone(&self.script),
                Arc::clone(&self.counts),
            ));
        }
        rx.await.unwrap_or(Err(StoreError::Abandoned))
    }
}

impl Pending {
    fn add(&mut self, e: &Entry<'_>, tx: oneshot::Sender<Result<Answer, StoreError>>) {
        let set = match self.sets.iter().position(|s| same_limits(s, e.applied)) {
            Some(i) => i,
            None => {
                encode_set(&mut self.set_args, e.applied);
                self.sets.push(e.applied.to_vec());
                self.sets.len() - 1
            }
        };
        self.keys.push(e.key.to_owned());
        self.entry_args
            .push(match e.op {
                Op::Take => "t",
                Op::Adjust => "a",
                Op::Peek => "p",
            })
            .push(e.cost)
            .push(e.n)
            .push(set + 1);
        self.waiters.push(tx);
        if matches!(e.op, Op::Take) {
            self.takes += e.n as u64;
        }
    }
}

/// Whether two entries decide against the same limits, as the script sees them.
fn same_limits(a: &[Applied], b: &[Applied]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(a, b)| a.field == b.field && a.kind == b.kind)
}

/// A limit set's arguments (see `lua/bucket.lua`).
fn encode_set(argv: &mut Argv, applied: &[Applied]) {
    argv.push(applied.len());
    let now_us = wall_clock_us();
    for a in applied {
        argv.push(&*a.field);
        match &a.kind {
            AppliedKind::Bucket { bucket, initial } => {
                argv.push("b").push(bucket.capacity()).push(bucket.rate());
                match initial {
                    Some(i) => argv.push(i),
                    None => argv.push(""),
                };
                argv.push("");
            }
            AppliedKind::Quota { amount, clock } => match clock.bounds(now_us) {
                Bounds::Fixed([e0, e1, e2]) => {
                    argv.push("q").push(amount).push(e0).push(e1).push(e2);
                }
                Bounds::Rolling(len) => {
                    argv.push("r").push(amount).push(len).push("").push("");
                }
            },
        }
    }
}

/// The gateway's clock in unix microseconds: only to compute quota windows around, which
/// Redis' clock then picks from.
fn wall_clock_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// Closes the batch and sends it as one call; answers every entry.
async fn send(batch: Shared, script: Arc<Lua>, counts: Arc<Counts>) {
    let (mut conn, declare_all, keys, sets, set_args, entry_args, waiters, takes) = {
        let mut b = batch.lock().unwrap_or_else(|p| p.into_inner());
        b.open = false;
        let conn = match &b.conn {
            Conn::Single(l) => Conn::Single(l.clone()),
            Conn::Cluster(c) => Conn::Cluster(c.clone()),
        };
        (
            conn,
            b.declare_all,
            std::mem::take(&mut b.keys),
            b.sets.len(),
            std::mem::take(&mut b.set_args),
            std::mem::take(&mut b.entry_args),
            std::mem::take(&mut b.waiters),
            b.takes,
        )
    };
    drop(batch);
    counts.calls.fetch_add(1, Ordering::Relaxed);
    counts.takes.fetch_add(takes, Ordering::Relaxed);
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(&script.hash);
    if declare_all {
        cmd.arg(keys.len()).arg(&keys).arg(0);
    } else {
        cmd.arg(1).arg(&keys[0]).arg(keys.len() - 1).arg(&keys[1..]);
    }
    cmd.arg(sets).arg(&set_args).arg(&entry_args);
    let answer = match call(&mut conn, &cmd, &script).await {
        Ok(r) => split(r, waiters.len()),
        Err(e) => Err(StoreError::Redis(e)),
    };
    match answer {
        Ok((now_us, replies)) => {
            for (at, tx) in waiters.into_iter().enumerate() {
                let _ = tx.send(Ok(Answer {
                    now_us,
                    takes,
                    replies: Arc::clone(&replies),
                    at: at + 2,
                }));
            }
        }
        Err(e) => {
            for tx in waiters {
                let _ = tx.send(Err(e.clone()));
            }
        }
    }
}

/// `{ now, one status byte per entry ('1': done), one string per entry }`.
fn split(reply: Vec<Vec<u8>>, entries: usize) -> Result<(u64, Replies), StoreError> {
    let now_us = reply
        .first()
        .and_then(|n| std::str::from_utf8(n).ok())
        .and_then(|n| n.parse::<u64>().ok());
    match now_us {
        Some(now_us) if reply.len() == 2 + entries && reply[1].len() == entries => {
            Ok((now_us, Arc::new(reply)))
        }
        _ => Err(StoreError::Protocol(format!(
            "limits script reply of {} strings for {entries} entries",
            reply.len()
        ))),
    }
}

/// `cmd` (an `EVALSHA` of `script`) on `conn`; on `NOSCRIPT` (a restarted or flushed
/// Redis) loads the script and sends it once more.
async fn call(conn: &mut Conn, cmd: &redis::Cmd, script: &Lua) -> Result<Vec<Vec<u8>>, RedisError> {
    let first = query(conn, cmd).await;
    match first {
        Err(e) if e.code() == Some("NOSCRIPT") => {
            let mut load = redis::cmd("SCRIPT");
            load.arg("LOAD").arg(script.code);
            let _: String = query(conn, &load).await?;
            query(conn, cmd).await
        }
        r => r,
    }
}

async fn query<T: redis::FromRedisValue>(
    conn: &mut Conn,
    cmd: &redis::Cmd,
) -> Result<T, RedisError> {
    match conn {
        Conn::Single(link) => link.query(cmd).await,
        Conn::Cluster(c) => cmd.query_async(c).await,
    }
}

#[cfg(test)]
mod tests {
    use std::rc::Rc;
    use std::time::Duration;

    use secrecy::SecretString;
    use tollgate_testkit::{FaultProxy, RedisServer};

    use crate::domain::limits::{Limit, Limits};
    use crate::domain::Bucket;
    use crate::store::redis::RedisStore;
    use crate::store::Keys;

    #[tokio::test]
    async fn a_peek_at_a_redis_that_stopped_answering_gives_up_at_the_control_timeout() {
        let redis = RedisServer::start().unwrap();
        let proxy = FaultProxy::start(format!("127.0.0.1:{}", redis.port).parse().unwrap());
        let store = RedisStore::connect(
            &SecretString::from(proxy.redis_url()),
            2,
            Duration::from_millis(200),
            Keys::new("tollgate:"),
        )
        .unwrap();
        let plan =
            Limits::new(vec![Limit::default_bucket(Bucket::new(5.0, 1.0).unwrap())]).unwrap();
        let applied = plan.every();
        store.peek("tollgate:b:{a}", &applied).await.unwrap();

        proxy.blackhole();
        let answer = tokio::time::timeout(
            Duration::from_secs(5),
            store.peek("tollgate:b:{a}", &applied),
        )
        .await
        .expect("an answer, not a wait without end");
        assert!(
            matches!(
                answer,
                Err(crate::store::StoreError::Deadline { sent: true })
            ),
            "{answer:?}"
        );
    }

    #[tokio::test]
    async fn takes_whose_requests_give_up_never_take_the_others_call_with_them() {
        // Arrange: Redis 30 ms away, so a call is in flight long enough to give up on.
        let redis = RedisServer::start().unwrap();
        let proxy = FaultProxy::start(format!("127.0.0.1:{}", redis.port).parse().unwrap());
        let store = Rc::new(
            RedisStore::connect(
                &SecretString::from(proxy.redis_url()),
                2,
                Duration::from_secs(1),
                Keys::new("tollgate:"),
            )
            .unwrap(),
        );
        let plan = Limits::new(vec![Limit::default_bucket(
            Bucket::new(5.0, 0.001).unwrap(),
        )])
        .unwrap();
        let applied = Rc::new(plan.every());
        let local = tokio::task::LocalSet::new();
        local
            .run_until(async {
                // The connection open and the script loaded.
                store
                    .take("tollgate:b:{w}", &applied, 1.0, None)
                    .await
                    .unwrap();
                proxy.delay(Duration::from_millis(30));
                let calls_before = store.bucket_calls().0;

                // Act: ten clients' takes in one turn (one call); the even ones' requests
                // give up while it is on its way.
                let takes: Vec<_> = (0..10)
                    .map(|i| {
                        let (store, applied) = (Rc::clone(&store), Rc::clone(&applied));
                        tokio::task::spawn_local(async move {
                            store
                                .take(&format!("tollgate:b:{{c{i}}}"), &applied, 1.0, None)
                                .await
                        })
                    })
                    .collect();
                tokio::time::sleep(Duration::from_millis(10)).await;
                for t in takes.iter().step_by(2) {
                    t.abort();
                }

                // Assert: the odd ones are all decided by that one call.
                for t in takes.into_iter().skip(1).step_by(2) {
                    let ruling = t.await.unwrap().expect("decided, not abandoned");
                    assert!(ruling.allowed);
                }
                assert_eq!(
                    store.bucket_calls().0 - calls_before,
                    1,
                    "one call for all ten"
                );
            })
            .await;
    }
}
