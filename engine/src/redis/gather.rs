//! One script call for the takes of many clients.
//!
//! With thousands of clients, the coalescer (`coalesce`) rarely finds two takes for the
//! same bucket, and one script call per decision makes Redis pay its per-call cost (parse
//! the command, enter Lua, reply: about 10 µs) for every request. So the takes a worker
//! makes go to Redis gathered: the first take of a worker's turn opens a batch and
//! schedules its sending as a task behind the requests already woken; every take made
//! before that task runs joins the batch, one entry per client (a client's takes at one
//! cost from the same limits share one: a hot client on a saturated worker, whose takes
//! each lead a call, still costs one entry per turn). Then one `EVALSHA`
//! (`engine/lua/bucket.lua`, one entry per key) decides them all, in order, on the worker's
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

use crate::limits::quota::Bounds;
use crate::limits::{Applied, AppliedKind};
use crate::pool::Link;
use crate::{BucketCalls, Every, StoreError};

/// Most entries one call carries; more open the next batch.
pub const MAX_ENTRIES: usize = 128;

/// A call still unanswered after this is dropped as soon as every entry's caller has
/// given up on it.
const ABANDON_CHECK: std::time::Duration = std::time::Duration::from_secs(1);

/// A budget's end seen later than this was not watched: the gateway (or its whole host)
/// was not running, and the store is given the time back (see `MAX_GRACES`).
const LATE_LOOK: std::time::Duration = std::time::Duration::from_millis(1);

/// How many times a call's budget is extended for a late look, each by the lateness, at
/// most one budget: a call waits at most three budgets, however late the gateway runs.
const MAX_GRACES: u32 = 2;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The script's arguments, packed in one buffer: one allocation per batch rather than
/// one per argument.
#[derive(Default)]
pub struct Argv {
    buf: Vec<u8>,
    ends: Vec<usize>,
}

impl Argv {
    /// Room for `args` arguments of `bytes` in all before either grows.
    pub fn with_capacity(bytes: usize, args: usize) -> Argv {
        Argv {
            buf: Vec::with_capacity(bytes),
            ends: Vec::with_capacity(args),
        }
    }

    /// Appends one argument, these bytes.
    pub fn push_bytes(&mut self, v: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(v);
        self.ends.push(self.buf.len());
        self
    }

    /// Appends one argument, as `v` displays.
    pub fn push(&mut self, v: impl std::fmt::Display) -> &mut Self {
        // Writing into a Vec cannot fail.
        let _ = write!(self.buf, "{v}");
        self.ends.push(self.buf.len());
        self
    }

    /// Appends one argument, a whole number in decimal.
    pub fn push_int(&mut self, v: impl itoa::Integer) -> &mut Self {
        self.push_bytes(itoa::Buffer::new().format(v).as_bytes())
    }

    /// Appends one argument, a number that Lua's `tonumber` reads back exactly: a whole
    /// one as an integer, any other as its shortest round-tripping decimal (without the
    /// formatting machinery `push` goes through: this runs for every limit of every call).
    pub fn push_num(&mut self, v: f64) -> &mut Self {
        if v.fract() == 0.0 && v.abs() < 1e15 {
            self.push_int(v as i64)
        } else {
            self.push_bytes(ryu::Buffer::new().format(v).as_bytes())
        }
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

/// A call's reply: Redis' clock, a status per entry, the decided entries' results
/// concatenated, then the failed entries' errors (see `engine/lua/bucket.lua`); and where each
/// entry's part is.
#[derive(Debug)]
struct Reply {
    strings: Vec<Vec<u8>>,
    /// Per entry: its result's range in the results string, or its error's index.
    parts: Vec<Result<std::ops::Range<usize>, usize>>,
}

/// An entry's part of a call's reply.
#[derive(Debug)]
pub struct Answer {
    /// Redis' clock (unix µs) when the call ran.
    pub now_us: u64,
    /// The requests the whole call decided (the takes of all its entries).
    pub takes: u64,
    /// The takes of the entry's client decided before this caller's, in the same entry
    /// (see [`Pending::add`]): the caller's rulings follow theirs.
    pub skip: usize,
    reply: Arc<Reply>,
    at: usize,
}

impl Answer {
    /// The entry's result, or the error it met (e.g. a group whose slot moved).
    pub fn bytes(&self) -> Result<&[u8], String> {
        match &self.reply.parts[self.at] {
            Ok(range) => Ok(&self.reply.strings[2][range.clone()]),
            Err(i) => Err(String::from_utf8_lossy(&self.reply.strings[*i]).into_owned()),
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

/// One entry to decide: `n` requests of the client whose state is under `tag` in the
/// group hash `group`, each costing `cost` of every limit in `applied`.
#[derive(Clone, Copy)]
pub struct Entry<'a> {
    pub group: &'a str,
    pub tag: &'a str,
    pub op: Op,
    pub cost: f64,
    pub n: usize,
    pub applied: &'a [Applied],
    /// How long Redis has to answer the call, from when it is written (`None`: the caller
    /// bounds its wait).
    pub budget: Option<std::time::Duration>,
}

/// The batch a worker is filling.
struct Pending {
    conn: Conn,
    /// Whether the call declares every group (else only the first).
    declare_all: bool,
    /// The distinct groups of the entries.
    groups: Vec<String>,
    /// The distinct limit sets of the entries, and their arguments.
    sets: Vec<Vec<Applied>>,
    set_args: Argv,
    /// The entries, in arrival order, and their tags (concatenated).
    entries: Vec<Queued>,
    tags: Vec<u8>,
    /// Each entry's (group, tag), hashed, and the entry's index: a client appears in a
    /// call once.
    seen: HashMap<u64, usize, foldhash::fast::FixedState>,
    /// Who waits for which entry, and how many of that entry's takes come before theirs.
    waiters: Vec<(Waiter, usize, usize)>,
    takes: u64,
    /// The shortest budget of its entries: how long Redis has to answer the call.
    budget: Option<std::time::Duration>,
    /// Still taking entries: its task has not run yet.
    open: bool,
}

/// An entry as the script takes it (see `engine/lua/bucket.lua`).
struct Queued {
    /// Its group and limit set (0-based indices).
    group: u16,
    set: u16,
    op: u8,
    cost: f64,
    n: u32,
    tag: std::ops::Range<usize>,
    /// Its levels' length in the reply: 8 bytes for a set of one bucket, else 16 per limit.
    size: usize,
}

impl Queued {
    /// Entries with the same key go in one run (and groups' runs are consecutive).
    fn run_key(&self) -> (u16, u16, u8, u64, u32) {
        (self.group, self.set, self.op, self.cost.to_bits(), self.n)
    }
}

type Shared = Arc<Mutex<Pending>>;

/// Where an entry's answer goes.
type Waiter = oneshot::Sender<Result<Answer, StoreError>>;

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

struct Counts {
    calls: AtomicU64,
    takes: AtomicU64,
    /// Opens when this gatherer's next call should ask for a sweep of its first group.
    sweep: Every,
}

/// The least number of fields a sweep examines (see `engine/lua/bucket.lua`: a sixtieth of the
/// group if more).
pub const SWEEP_FIELDS: u64 = 64;
/// A gatherer's calls ask for a sweep at most this often; the script sweeps a group at
/// most once a second, whatever the number of gateways asking.
pub const SWEEP_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

impl Default for Counts {
    fn default() -> Counts {
        Counts {
            calls: AtomicU64::new(0),
            takes: AtomicU64::new(0),
            sweep: Every::new(SWEEP_EVERY),
        }
    }
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
    pub fn counts(&self) -> BucketCalls {
        BucketCalls {
            calls: self.counts.calls.load(Ordering::Relaxed),
            takes: self.counts.takes.load(Ordering::Relaxed),
        }
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
                // Given back when the batch holds this client already.
                tx = b.add(&entry, tx.take().expect("not used yet")).err();
            }
        }
        if let Some(tx) = tx {
            // A connection that takes longer than the budget to come (a dial to a store
            // that does not answer) is the store's failure, as a call would be.
            let conn = match entry.budget {
                Some(budget) => tokio::time::timeout(budget, conn())
                    .await
                    .map_err(|_| StoreError::Deadline)??,
                None => conn().await?,
            };
            // Sized for a lone entry of a one-bucket plan (most calls, with many clients),
            // so that one grows none of them step by step.
            let mut pending = Pending {
                conn,
                declare_all: !matches!(group, Group::Master(_)),
                groups: Vec::new(),
                sets: Vec::new(),
                set_args: Argv::with_capacity(64, SET_ARGS),
                entries: Vec::new(),
                tags: Vec::with_capacity(64),
                seen: Default::default(),
                waiters: Vec::new(),
                takes: 0,
                budget: None,
                open: true,
            };
            let _ = pending.add(&entry, tx);
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
    /// Adds `e`, or gives `tx` back if the batch holds an entry of its client already that
    /// it cannot join (that entry then goes in a call of its own, so it reads what this one
    /// wrote). It joins one that takes at the same cost from the same limits: the entry's
    /// takes grow by `e.n`, decided after the ones it held, in order, as one call per
    /// caller would have decided them. So a hot client's takes within one turn of the
    /// worker cost Redis one entry, however many requests they are (the coalescer queues
    /// takes behind a call in flight only while their budgets can afford it: with a
    /// worker so busy that a round trip takes most of a budget, each take leads a call of
    /// its own, and they meet here).
    fn add(&mut self, e: &Entry<'_>, tx: Waiter) -> Result<(), Waiter> {
        self.budget = match (self.budget, e.budget) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let seen = seen_hash(e);
        if let Some(&i) = self.seen.get(&seen) {
            let q = &mut self.entries[i];
            let same = self.groups[usize::from(q.group)] == e.group
                && &self.tags[q.tag.clone()] == e.tag.as_bytes()
                && matches!(e.op, Op::Take)
                && q.op == b't'
                && q.cost.to_bits() == e.cost.to_bits()
                && same_limits(&self.sets[usize::from(q.set)], e.applied);
            let grown = u32::try_from(e.n).ok().and_then(|n| q.n.checked_add(n));
            let (true, Some(n)) = (same, grown) else {
                return Err(tx);
            };
            self.waiters.push((tx, i, q.n as usize));
            q.n = n;
            self.takes += e.n as u64;
            return Ok(());
        }
        self.seen.insert(seen, self.entries.len());
        let set = match self.sets.iter().position(|s| same_limits(s, e.applied)) {
            Some(i) => i,
            None => {
                encode_set(&mut self.set_args, e.applied);
                self.sets.push(e.applied.to_vec());
                self.sets.len() - 1
            }
        };
        let group = match self.groups.iter().position(|g| g == e.group) {
            Some(i) => i,
            None => {
                self.groups.push(e.group.to_owned());
                self.groups.len() - 1
            }
        };
        let start = self.tags.len();
        self.tags.extend_from_slice(e.tag.as_bytes());
        self.entries.push(Queued {
            group: group as u16,
            set: set as u16,
            op: match e.op {
                Op::Take => b't',
                Op::Adjust => b'a',
                Op::Peek => b'p',
            },
            cost: e.cost,
            n: u32::try_from(e.n).unwrap_or(u32::MAX),
            tag: start..self.tags.len(),
            size: if one_bucket(e.applied) {
                8
            } else {
                16 * e.applied.len()
            },
        });
        self.waiters.push((tx, self.entries.len() - 1, 0));
        if matches!(e.op, Op::Take) {
            self.takes += e.n as u64;
        }
        Ok(())
    }
}

/// Whether the script decides `applied` on its one-bucket path (and answers one level).
pub fn one_bucket(applied: &[Applied]) -> bool {
    matches!(applied, [a] if a.field.is_empty() && matches!(a.kind, AppliedKind::Bucket { .. }))
}

/// An entry's client, hashed (a collision only sends an entry in a call of its own).
fn seen_hash(e: &Entry<'_>) -> u64 {
    use std::hash::BuildHasher;
    foldhash::fast::FixedState::with_seed(0).hash_one((e.group, e.tag))
}

/// Whether two entries decide against the same limits, as the script sees them.
fn same_limits(a: &[Applied], b: &[Applied]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(a, b)| a.field == b.field && a.kind == b.kind)
}

/// How many arguments [`encode_set`] writes for a set of one bucket.
const SET_ARGS: usize = 7;

/// A limit set's arguments (see `engine/lua/bucket.lua`).
fn encode_set(argv: &mut Argv, applied: &[Applied]) {
    argv.push_int(applied.len());
    for a in applied {
        // Its state's field suffix: none for the first limit, `/name:` for the others.
        match &*a.field {
            "" => argv.push_bytes(b""),
            f => argv.push(format_args!("/{f}")),
        };
        match &a.kind {
            AppliedKind::Bucket { bucket, initial } => {
                argv.push_bytes(b"b")
                    .push_num(bucket.capacity())
                    .push_num(bucket.rate());
                match initial {
                    Some(i) => argv.push_num(*i),
                    None => argv.push_bytes(b""),
                };
                argv.push_bytes(b"");
            }
            AppliedKind::Quota { amount, clock } => match clock.bounds(wall_clock_us()) {
                Bounds::Fixed([e0, e1, e2]) => {
                    argv.push_bytes(b"q")
                        .push_num(*amount)
                        .push_int(e0)
                        .push_int(e1)
                        .push_int(e2);
                }
                Bounds::Rolling(len) => {
                    argv.push_bytes(b"r")
                        .push_num(*amount)
                        .push_int(len)
                        .push_bytes(b"")
                        .push_bytes(b"");
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
    let (contents, delivery) = close(batch);
    let Delivery {
        mut conn,
        reader,
        budget,
        mut waiters,
        takes,
    } = delivery;
    counts.calls.fetch_add(1, Ordering::Relaxed);
    counts.takes.fetch_add(takes, Ordering::Relaxed);
    let sweep = if counts.sweep.due() { SWEEP_FIELDS } else { 0 };
    let Call { cmd, sizes, at } = contents.encode(&script.hash, sweep);
    let reply = match budget {
        Some(budget) => {
            match within_budget(&mut conn, &cmd, &script, budget, reader.as_ref()).await {
                Some(r) => r,
                None => {
                    for (tx, _, _) in waiters {
                        let _ = tx.send(Err(StoreError::Deadline));
                    }
                    return;
                }
            }
        }
        None => match unless_abandoned(&mut conn, &cmd, &script, &mut waiters).await {
            Some(r) => r,
            None => return,
        },
    };
    let answer = match reply {
        Ok(r) => split(r, &sizes),
        Err(e) => Err(StoreError::Redis(e)),
    };
    answer_all(waiters, answer, takes, &at);
}

/// What a closed batch's call says: its entries, their groups and limit sets.
struct Contents {
    /// Whether the call declares every group (else only the first).
    declare_all: bool,
    groups: Vec<String>,
    /// How many limit sets `set_args` holds.
    sets: usize,
    set_args: Argv,
    entries: Vec<Queued>,
    tags: Vec<u8>,
}

/// Where a closed batch's call goes, and who waits for its answer.
struct Delivery {
    conn: Conn,
    /// A second handle on the link, to look for the reply on its socket when the budget
    /// ends (the call holds the first).
    reader: Option<Link>,
    budget: Option<std::time::Duration>,
    waiters: Vec<(Waiter, usize, usize)>,
    takes: u64,
}

/// A batch's script call: the command, each entry's result size in the reply's order, and
/// where each entry went in that order (`at[i]`: entry i's place).
struct Call {
    cmd: redis::Cmd,
    sizes: Vec<usize>,
    at: Vec<usize>,
}

/// Closes the batch to new entries and takes what its call needs out of it.
fn close(batch: Shared) -> (Contents, Delivery) {
    let mut b = batch.lock().unwrap_or_else(|p| p.into_inner());
    b.open = false;
    let conn = match &b.conn {
        Conn::Single(l) => Conn::Single(l.clone()),
        Conn::Cluster(c) => Conn::Cluster(c.clone()),
    };
    let reader = match &b.conn {
        Conn::Single(l) if b.budget.is_some() => Some(l.clone()),
        _ => None,
    };
    let contents = Contents {
        declare_all: b.declare_all,
        groups: std::mem::take(&mut b.groups),
        sets: b.sets.len(),
        set_args: std::mem::take(&mut b.set_args),
        entries: std::mem::take(&mut b.entries),
        tags: std::mem::take(&mut b.tags),
    };
    let delivery = Delivery {
        conn,
        reader,
        budget: b.budget,
        waiters: std::mem::take(&mut b.waiters),
        takes: b.takes,
    };
    (contents, delivery)
}

impl Contents {
    /// The `EVALSHA` of the script `hash`, asking for a sweep of `sweep` fields: the
    /// entries in runs (their clients are distinct, so their order is free).
    fn encode(&self, hash: &str, sweep: u64) -> Call {
        let Contents {
            declare_all,
            groups,
            sets,
            set_args,
            entries,
            tags,
        } = self;
        let mut order: Vec<usize> = (0..entries.len()).collect();
        order.sort_by_key(|&i| entries[i].run_key());
        let mut at = vec![0; entries.len()];
        let mut runs = Vec::with_capacity(19 * entries.len());
        let mut tag_args = Argv::with_capacity(tags.len(), entries.len());
        let mut sizes = Vec::with_capacity(entries.len());
        let mut run_start = 0;
        for (pos, &i) in order.iter().enumerate() {
            at[i] = pos;
            let e = &entries[i];
            tag_args.push_bytes(&tags[e.tag.clone()]);
            sizes.push(e.size);
            let last = order
                .get(pos + 1)
                .is_none_or(|&next| entries[next].run_key() != e.run_key());
            if last {
                // struct '<HBdIHH': length, op, cost, n, set, group (both 1-based).
                runs.extend_from_slice(&((pos + 1 - run_start) as u16).to_le_bytes());
                runs.push(e.op);
                runs.extend_from_slice(&e.cost.to_le_bytes());
                runs.extend_from_slice(&e.n.to_le_bytes());
                runs.extend_from_slice(&(e.set + 1).to_le_bytes());
                runs.extend_from_slice(&(e.group + 1).to_le_bytes());
                run_start = pos + 1;
            }
        }

        // Its arguments: 7 of their own (the name, the hash, the two group counts, the
        // sweep, the set count, the runs), one per group, the sets' and the tags'; 3 to
        // spare.
        let args = 10 + groups.len() + set_args.ends.len() + tag_args.ends.len();
        let bytes = 64
            + groups.iter().map(String::len).sum::<usize>()
            + set_args.buf.len()
            + runs.len()
            + tag_args.buf.len();
        let mut cmd = redis::Cmd::with_capacity(args, bytes);
        cmd.arg("EVALSHA").arg(hash);
        if *declare_all {
            cmd.arg(groups.len()).arg(groups).arg(0);
        } else {
            cmd.arg(1)
                .arg(&groups[0])
                .arg(groups.len() - 1)
                .arg(&groups[1..]);
        }
        cmd.arg(sweep)
            .arg(*sets)
            .arg(set_args)
            .arg(&runs)
            .arg(&tag_args);
        Call { cmd, sizes, at }
    }
}

/// `cmd` on `conn` within the store's `budget`, counted from when it is written; `None`:
/// no answer in time.
async fn within_budget(
    conn: &mut Conn,
    cmd: &redis::Cmd,
    script: &Lua,
    budget: std::time::Duration,
    reader: Option<&Link>,
) -> Option<Result<Vec<Vec<u8>>, RedisError>> {
    // The store's budget starts now: the call is written in its first poll, just below.
    // Time the worker took to get here is its own, not the store's.
    let mut end = tokio::time::Instant::now() + budget;
    let mut call = std::pin::pin!(call(conn, cmd, script));
    let mut graces = 0;
    loop {
        let in_time = tokio::select! {
            biased;
            r = &mut call => Some(r),
            () = tokio::time::sleep_until(end) => None,
        };
        if let Some(r) = in_time {
            return Some(r);
        }
        // The timer fired, perhaps long after `end` on a busy worker, before the
        // connection's driver ran: a reply on the socket now came in time, or is late by
        // less than the worker's own delay. Either way the store answered, and its answer
        // is used.
        if let Some(link) = reader {
            link.read_now();
        }
        if let Some(r) = futures_util::FutureExt::now_or_never(call.as_mut()) {
            return Some(r);
        }
        // No reply. If the gateway looked late, it was not running while the budget ran
        // out (a busy worker, a stopped process, a paused host, which stops the store on
        // the same host too): the store gets that time back, up to one budget, at most
        // twice. A punctual look is the store's answer.
        let late = tokio::time::Instant::now().saturating_duration_since(end);
        if late <= LATE_LOOK || graces == MAX_GRACES {
            return None;
        }
        graces += 1;
        end = tokio::time::Instant::now() + late.min(budget);
    }
}

/// `cmd` on `conn` with no deadline of its own; `None`: nobody waits for it any more.
///
/// Each waiter bounds its own wait (the control timeout), but the call has no deadline of
/// its own: on a connection gone silent it would wait, and keep the connection open,
/// forever. So it is dropped once nobody waits for it any more, checked only after
/// `ABANDON_CHECK` (a call normally answers long before).
async fn unless_abandoned(
    conn: &mut Conn,
    cmd: &redis::Cmd,
    script: &Lua,
    waiters: &mut [(Waiter, usize, usize)],
) -> Option<Result<Vec<Vec<u8>>, RedisError>> {
    let nobody_waits = async {
        tokio::time::sleep(ABANDON_CHECK).await;
        futures_util::future::join_all(waiters.iter_mut().map(|(tx, _, _)| tx.closed())).await;
    };
    tokio::select! {
        r = call(conn, cmd, script) => Some(r),
        () = nobody_waits => None,
    }
}

/// Gives every waiter its entry's part of the call's `answer` (or its error).
fn answer_all(
    waiters: Vec<(Waiter, usize, usize)>,
    answer: Result<(u64, Arc<Reply>), StoreError>,
    takes: u64,
    at: &[usize],
) {
    match answer {
        Ok((now_us, reply)) => {
            for (tx, entry, skip) in waiters {
                let _ = tx.send(Ok(Answer {
                    now_us,
                    takes,
                    skip,
                    reply: Arc::clone(&reply),
                    at: at[entry],
                }));
            }
        }
        Err(e) => {
            for (tx, _, _) in waiters {
                let _ = tx.send(Err(e.clone()));
            }
        }
    }
}

/// The `EVALSHA` of one call of `tags.len()` entries, each a take of `cost` from the limits
/// `applied` of the client under its tag in `group`, as the gatherer encodes it. For the
/// engine's benchmarks.
#[doc(hidden)]
pub fn encode_takes(group: &str, tags: &[&str], applied: &[Applied], cost: f64) -> redis::Cmd {
    let mut set_args = Argv::with_capacity(64, SET_ARGS);
    encode_set(&mut set_args, applied);
    let mut contents = Contents {
        declare_all: true,
        groups: vec![group.to_owned()],
        sets: 1,
        set_args,
        entries: Vec::with_capacity(tags.len()),
        tags: Vec::new(),
    };
    for tag in tags {
        let start = contents.tags.len();
        contents.tags.extend_from_slice(tag.as_bytes());
        contents.entries.push(Queued {
            group: 0,
            set: 0,
            op: b't',
            cost,
            n: 1,
            tag: start..contents.tags.len(),
            size: if one_bucket(applied) {
                8
            } else {
                16 * applied.len()
            },
        });
    }
    contents
        .encode("0123456789abcdef0123456789abcdef01234567", 0)
        .cmd
}

/// Each entry's part of a call's `reply`, for entries of these result `sizes`, the call
/// having decided `takes` requests: what the gatherer makes of a reply. For the engine's
/// benchmarks.
#[doc(hidden)]
pub fn answers(
    reply: Vec<Vec<u8>>,
    sizes: &[usize],
    takes: u64,
) -> Result<Vec<Answer>, StoreError> {
    let (now_us, reply) = split(reply, sizes)?;
    Ok((0..sizes.len())
        .map(|at| Answer {
            now_us,
            takes,
            skip: 0,
            reply: Arc::clone(&reply),
            at,
        })
        .collect())
}

/// `{ now, one status byte per entry ('1': decided), the decided entries' results, the
/// failed entries' errors }`, checked against the entries' result `sizes`.
fn split(strings: Vec<Vec<u8>>, sizes: &[usize]) -> Result<(u64, Arc<Reply>), StoreError> {
    let bad = || {
        StoreError::Protocol(format!(
            "limits script reply of {} strings for {} entries",
            strings.len(),
            sizes.len()
        ))
    };
    let now_us = strings
        .first()
        .and_then(|n| std::str::from_utf8(n).ok())
        .and_then(|n| n.parse::<u64>().ok())
        .ok_or_else(bad)?;
    let status = strings
        .get(1)
        .filter(|s| s.len() == sizes.len())
        .ok_or_else(bad)?;
    let (mut offset, mut error) = (0, 3);
    let parts = status
        .iter()
        .zip(sizes)
        .map(|(&s, &size)| {
            if s == b'1' {
                offset += size;
                Ok(offset - size..offset)
            } else {
                error += 1;
                Err(error - 1)
            }
        })
        .collect();
    if strings.get(2).map(Vec::len) != Some(offset) || strings.len() != error {
        return Err(bad());
    }
    Ok((now_us, Arc::new(Reply { strings, parts })))
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
pub(super) mod tests {
    use std::rc::Rc;
    use std::sync::Arc;
    use std::time::Duration;

    use tollgate_testkit::{FaultProxy, RedisServer};

    use crate::limits::{Bucket, Level};
    use crate::redis::fixtures::default_bucket;
    use crate::redis::{Backend, RedisBuckets as RedisStore};
    use crate::{Buckets, Budget, StoreError};

    use super::ABANDON_CHECK;

    /// A store on the Redis at `url`, with a control timeout of 1 s.
    pub(in crate::redis) fn store_at(url: String) -> Rc<RedisStore> {
        let backend = Backend::single(&url, 2, Duration::from_secs(1)).unwrap();
        Rc::new(RedisStore::new(
            Arc::new(backend),
            "tollgate:",
            Duration::from_secs(1),
        ))
    }

    /// A Redis behind a fault proxy, a store on it through the proxy, and a bucket of 5.
    fn behind_proxy() -> (
        RedisServer,
        FaultProxy,
        Rc<RedisStore>,
        Rc<Vec<crate::limits::Applied>>,
    ) {
        let redis = RedisServer::start().unwrap();
        let proxy = FaultProxy::start(([127, 0, 0, 1], redis.port).into());
        let store = store_at(proxy.redis_url());
        (redis, proxy, store, bucket_of_five())
    }

    /// A plan of one bucket of 5, with next to no refill.
    /// The tokens `key`'s bucket holds now (a peek: nothing taken).
    pub(in crate::redis) async fn tokens_in(
        store: &RedisStore,
        key: &str,
        applied: &[crate::limits::Applied],
    ) -> f64 {
        let now = store.peek(key, applied).await.unwrap();
        let Level::Tokens(tokens) = now.levels[0] else {
            panic!("{now:?}")
        };
        tokens
    }

    pub(in crate::redis) fn bucket_of_five() -> Rc<Vec<crate::limits::Applied>> {
        Rc::new(vec![default_bucket(Bucket::new(5.0, 0.001).unwrap())])
    }

    #[test]
    fn numbers_are_written_as_decimals_that_read_back_exactly() {
        let values = [
            0.0,
            5.0,
            -3.0,
            0.1,
            0.3,
            1.0 / 3.0,
            1e-7,
            2.5e15,
            1e20,
            123_456.789,
            1e15 - 1.0,
        ];
        let mut argv = super::Argv::default();
        for v in values {
            argv.push_num(v);
        }
        argv.push_int(u64::MAX);
        let mut start = 0;
        for (i, end) in argv.ends.iter().enumerate() {
            let text = std::str::from_utf8(&argv.buf[start..*end]).unwrap();
            start = *end;
            match values.get(i) {
                Some(v) => {
                    assert_eq!(text.parse::<f64>().unwrap(), *v, "{text}");
                    if v.fract() == 0.0 && v.abs() < 1e15 {
                        assert!(
                            text.bytes().all(|b| b.is_ascii_digit() || b == b'-'),
                            "{text}"
                        );
                    }
                }
                None => assert_eq!(text, u64::MAX.to_string()),
            }
        }
    }

    /// A lone call's buffers are sized for a one-bucket set: one that outgrew them would
    /// still be right, only slower.
    #[test]
    fn a_one_bucket_set_fills_the_arguments_a_lone_call_makes_room_for() {
        let applied = [default_bucket(Bucket::new(5.0, 1.0).unwrap())];
        assert!(super::one_bucket(&applied));
        let mut argv = super::Argv::with_capacity(64, super::SET_ARGS);
        super::encode_set(&mut argv, &applied);
        assert_eq!(argv.ends.len(), super::SET_ARGS);
        assert_eq!(argv.ends.capacity(), super::SET_ARGS);
        assert!(argv.buf.len() <= 64);
    }

    #[tokio::test]
    async fn a_peek_at_a_redis_that_stopped_answering_gives_up_at_the_control_timeout() {
        let redis = RedisServer::start().unwrap();
        let proxy = FaultProxy::start(format!("127.0.0.1:{}", redis.port).parse().unwrap());
        let backend = Backend::single(&proxy.redis_url(), 2, Duration::from_millis(200)).unwrap();
        let store = RedisStore::new(Arc::new(backend), "tollgate:", Duration::from_millis(200));
        let applied = [default_bucket(Bucket::new(5.0, 1.0).unwrap())];
        store.peek("tollgate:b:{a}", &applied).await.unwrap();
        // A peek writes nothing, not even a new group's mark.
        let exists: bool = redis::cmd("EXISTS")
            .arg("tollgate:s:{0}")
            .query(&mut redis.conn().unwrap())
            .unwrap();
        assert!(!exists, "a peek created the state group");

        proxy.blackhole();
        let answer = tokio::time::timeout(
            Duration::from_secs(5),
            store.peek("tollgate:b:{a}", &applied),
        )
        .await
        .expect("an answer, not a wait without end");
        assert!(
            matches!(answer, Err(crate::StoreError::Deadline)),
            "{answer:?}"
        );
    }

    #[tokio::test]
    async fn two_takes_of_one_client_in_one_turn_go_in_two_calls_and_both_count() {
        // Arrange: one client, a bucket of 5 with next to no refill.
        let redis = RedisServer::start().unwrap();
        let (store, applied) = (store_at(redis.url()), bucket_of_five());
        let local = tokio::task::LocalSet::new();
        local
            .run_until(async {
                store.peek("tollgate:b:{w}", &applied).await.unwrap();
                let calls_before = store.calls().unwrap_or_default().calls;

                // Act: in one turn, a take of 1 and a take of 2 (apart in the coalescer,
                // which keeps takes of different costs apart).
                let takes: Vec<_> = [1.0, 2.0]
                    .into_iter()
                    .map(|cost| {
                        let (store, applied) = (Rc::clone(&store), Rc::clone(&applied));
                        tokio::task::spawn_local(async move {
                            store.take("tollgate:b:{c}", &applied, cost, None).await
                        })
                    })
                    .collect();
                for t in takes {
                    assert!(t.await.unwrap().unwrap().allowed);
                }

                // Assert: two calls, and the bucket holds 5 - 1 - 2: the second saw the
                // first's write (in one call, both would have read 5).
                assert_eq!(store.calls().unwrap_or_default().calls - calls_before, 2);
                let tokens = tokens_in(&store, "tollgate:b:{c}", &applied).await;
                assert!((tokens - 2.0).abs() < 0.01, "{tokens}");
            })
            .await;
    }

    #[tokio::test]
    async fn takes_whose_requests_give_up_never_take_the_others_call_with_them() {
        // Arrange: Redis 30 ms away, so a call is in flight long enough to give up on.
        let (_redis, proxy, store, applied) = behind_proxy();
        let local = tokio::task::LocalSet::new();
        local
            .run_until(async {
                // The connection open and the script loaded.
                store
                    .take("tollgate:b:{w}", &applied, 1.0, None)
                    .await
                    .unwrap();
                proxy.delay(Duration::from_millis(30));
                let calls_before = store.calls().unwrap_or_default().calls;

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
                    store.calls().unwrap_or_default().calls - calls_before,
                    1,
                    "one call for all ten"
                );
            })
            .await;
    }

    #[tokio::test]
    async fn a_call_without_a_budget_on_a_silent_connection_ends_once_nobody_waits_for_it() {
        // Arrange: a connection open, then silenced (it stays open, nothing answers).
        let (_redis, proxy, store, applied) = behind_proxy();
        let local = tokio::task::LocalSet::new();
        local
            .run_until(async {
                store
                    .take("tollgate:b:{w}", &applied, 1.0, None)
                    .await
                    .unwrap();
                let before = alive_tasks();
                proxy.blackhole();

                // Act: a take with no budget, whose caller gives up after 50 ms.
                let r = tokio::time::timeout(
                    Duration::from_millis(50),
                    store.take("tollgate:b:{c}", &applied, 1.0, None),
                )
                .await;
                assert!(r.is_err(), "{r:?}");
                assert_eq!(alive_tasks(), before + 1, "the call's task waits on");

                // Assert: its call's task ends soon after the check, not never.
                tokio::time::sleep(ABANDON_CHECK + Duration::from_millis(300)).await;
                assert_eq!(alive_tasks(), before, "the call's task is gone");
            })
            .await;
    }

    /// Tasks alive on this runtime (a call's sending task among them).
    fn alive_tasks() -> usize {
        tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks()
    }

    /// A budget of `ms` for a take starting now.
    fn budget_ms(ms: u64) -> Option<Budget> {
        Some(Budget::starting(
            tokio::time::Instant::now(),
            Duration::from_millis(ms),
        ))
    }

    #[tokio::test]
    async fn a_call_the_store_does_not_answer_within_its_budget_fails_and_ends_then() {
        let (_redis, proxy, store, applied) = behind_proxy();
        let local = tokio::task::LocalSet::new();
        local
            .run_until(async {
                store
                    .take("tollgate:b:{w}", &applied, 1.0, None)
                    .await
                    .unwrap();
                let before = alive_tasks();
                proxy.blackhole();

                let started = std::time::Instant::now();
                let r = store
                    .take("tollgate:b:{c}", &applied, 1.0, budget_ms(50))
                    .await;
                assert!(matches!(r, Err(StoreError::Deadline)), "{r:?}");
                assert!(started.elapsed() >= Duration::from_millis(50));
                tokio::task::yield_now().await;
                assert_eq!(
                    alive_tasks(),
                    before,
                    "the call's task ended with its budget"
                );
            })
            .await;
    }

    #[tokio::test]
    async fn a_reply_that_came_in_time_while_the_worker_was_busy_is_used_not_failed() {
        // Arrange: Redis 5 ms away, a budget of 20 ms.
        let (_redis, proxy, store, applied) = behind_proxy();
        let local = tokio::task::LocalSet::new();
        local
            .run_until(async {
                store
                    .take("tollgate:b:{w}", &applied, 1.0, None)
                    .await
                    .unwrap();
                proxy.delay(Duration::from_millis(5));

                // Act: the take's call goes out, then the worker is held by a CPU-bound
                // burst of 200 ms (ten budgets): Redis answers meanwhile, and nothing on
                // the worker runs until the burst ends, when every timer is long due.
                let take = {
                    let (store, applied) = (Rc::clone(&store), Rc::clone(&applied));
                    tokio::task::spawn_local(async move {
                        store
                            .take("tollgate:b:{c}", &applied, 1.0, budget_ms(20))
                            .await
                    })
                };
                for _ in 0..20 {
                    tokio::task::yield_now().await;
                }
                std::thread::sleep(Duration::from_millis(200));

                // Assert: decided by Redis' answer, not failed for the worker's delay.
                let r = take.await.unwrap();
                assert!(r.is_ok_and(|r| r.allowed), "the store answered in time");
            })
            .await;
    }

    #[tokio::test]
    async fn a_budget_that_ran_out_while_nothing_watched_is_given_back() {
        // Arrange: Redis 60 ms away, a budget of 20 ms.
        let (_redis, proxy, store, applied) = behind_proxy();
        let local = tokio::task::LocalSet::new();
        local
            .run_until(async {
                store
                    .take("tollgate:b:{w}", &applied, 1.0, None)
                    .await
                    .unwrap();
                proxy.delay(Duration::from_millis(60));

                // Act: the call goes out, then the worker stops for 45 ms (as a paused
                // host stops it and the store alike): the budget ends 25 ms before anyone
                // looks, and the reply is not there yet.
                let take = {
                    let (store, applied) = (Rc::clone(&store), Rc::clone(&applied));
                    tokio::task::spawn_local(async move {
                        store
                            .take("tollgate:b:{c}", &applied, 1.0, budget_ms(20))
                            .await
                    })
                };
                for _ in 0..20 {
                    tokio::task::yield_now().await;
                }
                std::thread::sleep(Duration::from_millis(45));

                // Assert: the late look gave the store its time back (up to a budget,
                // twice), and its answer at 60 ms decided.
                let r = take.await.unwrap();
                assert!(r.is_ok_and(|r| r.allowed), "failed for a late look");
            })
            .await;
    }

    #[tokio::test]
    async fn a_punctual_look_at_a_silent_store_fails_at_the_budget() {
        let (_redis, proxy, store, applied) = behind_proxy();
        let local = tokio::task::LocalSet::new();
        local
            .run_until(async {
                store
                    .take("tollgate:b:{w}", &applied, 1.0, None)
                    .await
                    .unwrap();
                proxy.delay(Duration::from_millis(200));
                let started = std::time::Instant::now();
                let r = store
                    .take("tollgate:b:{c}", &applied, 1.0, budget_ms(20))
                    .await;
                assert!(matches!(r, Err(StoreError::Deadline)), "{r:?}");
                assert!(started.elapsed() < Duration::from_millis(150));
            })
            .await;
    }
}
