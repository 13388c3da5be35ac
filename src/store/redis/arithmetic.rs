//! The limits arithmetic exists twice: in `engine/lua/bucket.lua`, which Redis runs, and in
//! `tollgate_engine::limits` (bucket, quota, take), which the embedded store runs
//! ([`LocalLimits`]) and with which the gateway replays a script call's takes. This
//! property test proves the two equal on random histories: every answer the Redis store
//! gives is the answer the embedded store's arithmetic gives at the same instant, and every
//! state the script leaves in Redis is the state the Rust side keeps.
//!
//! **What a history holds.** A plan of one to four limits (buckets of any capacity and
//! rate; quotas per hour, day or month, calendar, anchored or rolling, in zones with DST
//! and with half- and quarter-hour offsets), some for one service only, so that requests
//! to different services apply different sets; then random steps of two clients:
//! - takes made in one turn of the worker: several of one client (joined into one script
//!   entry of `n` takes, or queued behind the first one's call and sent as one entry of
//!   the next), of both clients (two entries in one call, perhaps of different limit
//!   sets), at costs that fit, that do not, and that never can; some seeded (buckets that
//!   do not exist yet start with a fraction of their capacity, as a regional shard's do);
//! - adjustments: debits after the response, refunds, debits far past empty;
//! - peeks;
//! - plan changes (a limit redefined under its name: new capacity and rate, new amount,
//!   period, reset or zone, scoped or not) and client overrides, some expiring as the
//!   clock moves;
//! - clock steps: none, up to a second, seconds to hours, up to 40 days, and to a limit's
//!   next boundary (its quota window's end, its bucket full again): exactly, a
//!   microsecond after, or half a second before. Histories start around DST changes, a
//!   year's end, a leap day and a January 31st.
//!
//! **How.** The Redis side goes through the product's own path: the engine's `take`,
//! `adjust` and `peek` (the coalescer, `gather`'s call encoding, the script, the reply's
//! parsing and `buckets`' replay) against a real `redis-server`. The Rust side is
//! [`LocalLimits::run`] (what the embedded store calls) at the same instant (see the clock,
//! below); a take from or a peek at a set of one bucket is also decided by the engine's
//! `limits::bucket` alone (the in-process buckets' arithmetic). Compared exactly (`f64`
//! equality, no tolerance): each ruling's verdict, every limit's level after it (tokens; a
//! quota's count and window end), the wait until a retry, the refusing limit, the time.
//! Then the state group is read back and every field compared with the state the Rust side
//! keeps: a bucket's tokens and their time, a quota's count and its window's end. That
//! readback checks the script's own takes and clamps, which the gateway's replay recomputes
//! in Rust and so would hide from the answers alone (the script answers the levels *before*
//! an operation). A field's third number, when the sweep may delete it, has no Rust twin
//! (the embedded store keeps one expiry per client, in milliseconds), so it is checked for
//! what it promises: by then the bucket is full again under the values it was written with,
//! or the quota's window is over (+1 s, and the half microsecond that marks a quota's
//! state; a bucket's is whole).
//!
//! **Sweeps.** The script deletes fields that are due (see `Replay::sweep`), and the
//! embedded store forgets idle clients on a schedule of its own: under values changed
//! since, or with a seed, a forgotten bucket does not read as the kept one would. So the
//! test sweeps at moments of its own choosing, before each step, and the Rust side forgets
//! what the sweep deleted.
//!
//! **The clock.** Redis and the gateway read one clock, as in production: quota windows
//! are computed on the gateway's clock around its own now, and placed by the script on
//! Redis' `TIME`. So the test runs in a child process of the test binary under the
//! [`FakeClock`] that Redis runs under too (`LD_PRELOAD`), stopped: each step happens at
//! an instant the test chooses to the microsecond, so a history replays exactly (and
//! shrinks), a zero step is zero, a boundary is met exactly, and the Rust side decides at
//! the very instant Redis must have (each answer's time is compared too). On a stopped
//! clock the calls of one step share an instant, so a client's takes in one step are of
//! one limit set: the order of its calls for different sets is the scheduler's.
//!
//! **Kinds.** A plan change may turn a limit from a bucket into a quota or back under its
//! name: its state's field stays. The script tells a quota's state by its mark (half a
//! microsecond in the sweep time, see `engine/lua/bucket.lua`), so a bucket never reads a
//! quota's count as its tokens; the Rust side keeps the kind beside each state.
//!
//! **Run it** with `cargo test --lib store::redis::arithmetic` (128 histories, a few
//! seconds in a debug build; `redis-server` and `cc` on the PATH); `PROPTEST_CASES=2000`
//! runs more. A failure prints the first difference and the shrunk history.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::PathBuf;
use std::process::Command;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestError, TestRunner};
use secrecy::SecretString;
use tollgate_testkit::{FakeClock, RedisServer};

use super::RedisStore;
use crate::domain::{
    bucket, Applied, AppliedKind, Bounds, Bucket, BucketState, Level, Limit, LimitKind, LimitName,
    LimitState, Limits, Override, Period, Quota, QuotaClock, Reset, Ruling, ServiceName,
};
use crate::store::{Buckets, Budget, Keys, LocalLimits, LocalOp, StoreError};
use tollgate_engine::redis::BUCKET_LUA;
use tollgate_engine::redis::{one_bucket, SWEEP_FIELDS};

/// Histories per run, unless `PROPTEST_CASES` says otherwise.
const CASES: u32 = 128;
/// Most steps in a history.
const MAX_STEPS: usize = 24;
/// Set (to the Redis URL) in the child process that runs the property.
const CHILD: &str = "TOLLGATE_ARITHMETIC_REDIS";
/// Names the file of the clock the child runs under (see [`FakeClock::env`]).
const CLOCK_FILE: &str = "TOLLGATE_FAKE_CLOCK";
const SECOND_US: u64 = 1_000_000;
const DAY_S: u64 = 86_400;
/// The clients' bucket keys; their hash tags are their fields in the state group.
const CLIENTS: [&str; 2] = ["tollgate:b:{a}", "tollgate:b:{b}"];
const TAGS: [&str; 2] = ["a", "b"];
/// Where histories start (unix seconds, plus up to two hours): before calendar events.
const STARTS: [(u64, &str); 8] = [
    (1_774_744_200, "Berlin springs forward at 01:00Z"),
    (1_792_888_200, "Berlin falls back at 01:00Z"),
    (1_798_759_800, "the year ends at 00:00Z"),
    (1_835_391_600, "Feb 29 begins at 00:00Z"),
    (
        1_801_346_400,
        "Jan 31 begins at 00:00Z: a month from it is Feb 28",
    ),
    (1_775_313_000, "Lord Howe falls back half an hour at 15:00Z"),
    (1_791_043_200, "Adelaide springs forward at 16:30Z"),
    (1_793_511_000, "New York falls back at 06:00Z"),
];
const ZONES: [&str; 8] = [
    "UTC",
    "Europe/Berlin",
    "America/New_York",
    "Asia/Kolkata",
    "Asia/Kathmandu",
    "Australia/Lord_Howe",
    "Australia/Adelaide",
    "Pacific/Chatham",
];

/// Runs the property in a child process under a fake clock shared with its Redis.
#[test]
fn redis_and_the_rust_arithmetic_answer_alike_and_leave_the_same_state() {
    under_one_clock(
        "redis_and_the_rust_arithmetic_answer_alike_and_leave_the_same_state",
        property,
    );
}

/// A limit redefined from a quota into a bucket under its name: the bucket starts as one
/// that does not exist yet (full), on both sides, not with the quota's count for tokens.
/// Here, a quota of 5 an hour counts one request, then becomes a bucket of 10 (1/s): both
/// admit the next request from 10 tokens and leave 9. (Before the quota's mark, Redis
/// admitted it from 1 token and left 0.) The property meets such changes at random too;
/// this history is the one that found the difference.
#[test]
fn a_quota_redefined_as_a_bucket_starts_alike_on_both_sides() {
    under_one_clock(
        "a_quota_redefined_as_a_bucket_starts_alike_on_both_sides",
        |world| {
            let quota = LimitDef::Quota {
                amount: 5.0,
                period: Period::Hour,
                reset: Reset::Calendar,
                zone: "UTC",
                scoped: false,
            };
            let bucket = LimitDef::Bucket {
                capacity: 10.0,
                rate: 1.0,
                scoped: false,
            };
            let take = Step::Takes {
                who: vec![0],
                services: [None, None],
                cost: 1.0,
                hurried: false,
                seed: None,
            };
            let history = History {
                start: Start(STARTS[2].0),
                limits: vec![quota],
                default_first: true,
                steps: vec![
                    take.clone(),
                    Step::Plan {
                        limit: 0,
                        def: bucket,
                    },
                    take,
                ],
            };
            if let Err(e) = world.replay(&history) {
                panic!("{e}\nin {history:#?}");
            }
        },
    );
}

/// Runs `body` in a child process of the test binary (the test `name` of this module,
/// alone) under a fake clock that its Redis reads too, so that the gateway's clock (quota
/// windows) and Redis' (`TIME`) are one, as in production.
fn under_one_clock(name: &str, body: impl FnOnce(&World)) {
    if let Ok(url) = std::env::var(CHILD) {
        return body(&World::connect(&url));
    }
    // Arrange: one clock for Redis and for the child (each history sets it again).
    let clock = FakeClock::at(STARTS[0].0 as f64).expect("a fake clock (cc)");
    let redis = RedisServer::start_with_env(&clock.env()).expect("redis-server");
    let (_, path) = module_path!()
        .split_once("::")
        .expect("a module of the crate");
    let exe = std::env::current_exe().expect("the test binary");

    // Act: the same test, alone, in the child (ignored or not, as it was chosen here).
    let out = Command::new(exe)
        .arg(format!("{path}::{name}"))
        .args(["--exact", "--include-ignored", "--nocapture"])
        .args(["--test-threads", "1"])
        .envs(clock.env())
        .env(CHILD, redis.url())
        .output()
        .expect("the test binary runs");

    // Assert: it passed (and said what it compared); if not, its output says where the
    // two sides differ.
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "{name} failed in the child process:\n{stdout}{stderr}"
    );
    eprint!("{stderr}");
}

impl World {
    /// Redis at `url`, a store on it, and the clock this process runs under.
    fn connect(url: &str) -> World {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        let store = runtime
            .block_on(async {
                RedisStore::connect(
                    &SecretString::from(url.to_owned()),
                    2,
                    Duration::from_secs(5),
                    Keys::new("tollgate:"),
                )
            })
            .expect("a Redis store");
        let conn = redis::Client::open(url)
            .and_then(|c| c.get_connection())
            .expect("a connection to Redis");
        World {
            runtime,
            store: Rc::new(store),
            conn: RefCell::new(conn),
            clock: Clock::from_env(),
            seen: RefCell::default(),
        }
    }
}

/// The property itself, in the child: random histories, each replayed on both sides.
fn property(world: &World) {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(CASES);
    let mut runner = TestRunner::new(Config {
        cases,
        // Histories depend on the real microseconds between calls: a saved seed would
        // not replay one exactly, and the printed history says more.
        failure_persistence: None,
        max_shrink_iters: 2_000,
        ..Config::default()
    });
    let started = std::time::Instant::now();
    match runner.run(&history(), |h| world.replay(&h)) {
        Ok(()) => eprintln!(
            "{cases} histories in {:.1?}: {:?}",
            started.elapsed(),
            world.seen.borrow()
        ),
        Err(TestError::Fail(why, h)) => panic!("{why}\nminimal failing history: {h:#?}"),
        Err(TestError::Abort(why)) => panic!("the property gave up: {why}"),
    }
}

// ---------------------------------------------------------------------------------------
// Histories.

/// A plan and what happens to it.
#[derive(Clone, Debug)]
struct History {
    start: Start,
    /// The plan's limits; the first applies to every service.
    limits: Vec<LimitDef>,
    /// Whether the first limit is named `default` (its state is the tag's own field).
    default_first: bool,
    steps: Vec<Step>,
}

/// Unix seconds, shown as a date.
#[derive(Clone, Copy)]
struct Start(u64);

impl fmt::Debug for Start {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match jiff::Timestamp::from_second(self.0 as i64) {
            Ok(t) => write!(f, "{t}"),
            Err(_) => write!(f, "{}", self.0),
        }
    }
}

#[derive(Clone, Debug)]
enum LimitDef {
    Bucket {
        capacity: f64,
        rate: f64,
        scoped: bool,
    },
    Quota {
        amount: f64,
        period: Period,
        reset: Reset,
        zone: &'static str,
        scoped: bool,
    },
}

/// A request's service: `alpha` has the scoped limits of its own, `beta` none.
type Service = Option<&'static str>;

#[derive(Clone, Debug)]
enum Step {
    /// Takes of `cost` made in one turn, in order, by the clients `who`, each to its
    /// service in `services`. `hurried`: each is due at once, so each sends its call at
    /// once and a client's takes join one script entry; else a client's takes after its
    /// first queue behind that first call and go in one entry of the next. `seed`: buckets
    /// not in Redis yet start with this fraction of their capacity.
    ///
    /// One service per client: a client's takes of different limit sets go in separate
    /// calls, whose order is the scheduler's, and on a stopped clock nothing tells it.
    Takes {
        who: Vec<usize>,
        services: [Service; 2],
        cost: f64,
        hurried: bool,
        seed: Option<f64>,
    },
    Adjust {
        client: usize,
        service: Service,
        delta: f64,
    },
    Peek {
        client: usize,
        service: Service,
        seed: Option<f64>,
    },
    Wait(Wait),
    /// The plan's limit `limit` (modulo their number) is redefined under its name: new
    /// capacity and rate, new amount and window, perhaps scoped now or no longer (the
    /// first limit never). To the other kind only if the history allows it.
    Plan {
        limit: usize,
        def: LimitDef,
    },
    /// Both clients get these values for limit `limit`, for `secs` seconds or for good.
    Override {
        limit: usize,
        capacity: Option<f64>,
        rate: Option<f64>,
        amount: f64,
        secs: Option<u64>,
    },
}

#[derive(Clone, Copy, Debug)]
enum Wait {
    /// Only the real time until the next call.
    Micros(u64),
    Secs(u64),
    /// To when limit `limit` (of client `a`) is whole again: a quota's window ends, a
    /// bucket is full.
    Boundary {
        limit: usize,
        at: Near,
    },
}

#[derive(Clone, Copy, Debug)]
enum Near {
    Exactly,
    JustAfter,
    HalfASecondBefore,
}

fn history() -> impl Strategy<Value = History> {
    (
        start(),
        limit_def(),
        vec(limit_def(), 0..4),
        any::<bool>(),
        vec(step(), 1..MAX_STEPS),
    )
        .prop_map(|(start, first, rest, default_first, steps)| {
            let first = match first {
                LimitDef::Bucket { capacity, rate, .. } => LimitDef::Bucket {
                    capacity,
                    rate,
                    scoped: false,
                },
                LimitDef::Quota {
                    amount,
                    period,
                    reset,
                    zone,
                    ..
                } => LimitDef::Quota {
                    amount,
                    period,
                    reset,
                    zone,
                    scoped: false,
                },
            };
            History {
                start,
                limits: std::iter::once(first).chain(rest).collect(),
                default_first,
                steps,
            }
        })
}

fn start() -> impl Strategy<Value = Start> {
    (0..STARTS.len(), 0u64..7_200).prop_map(|(i, s)| Start(STARTS[i].0 + s))
}

fn capacity() -> impl Strategy<Value = f64> {
    prop_oneof![
        Just(1.0),
        Just(3.0),
        Just(10.0),
        Just(2.5),
        Just(1e9),
        1.0..50.0f64,
    ]
}

fn rate() -> impl Strategy<Value = f64> {
    prop_oneof![
        Just(0.001),
        Just(0.3),
        Just(1.0),
        Just(10.0),
        Just(1e9),
        0.001..20.0f64,
    ]
}

fn amount() -> impl Strategy<Value = f64> {
    prop_oneof![
        Just(1.0),
        Just(3.0),
        Just(10.0),
        Just(7.5),
        (1u32..30).prop_map(f64::from),
    ]
}

fn window() -> impl Strategy<Value = (Period, Reset)> {
    let period = || prop_oneof![Just(Period::Hour), Just(Period::Day), Just(Period::Month)];
    prop_oneof![
        period().prop_map(|p| (p, Reset::Calendar)),
        period().prop_map(|p| (p, Reset::Rolling)),
        (1u8..=31).prop_map(|d| (Period::Month, Reset::Anchor(d))),
    ]
}

fn limit_def() -> impl Strategy<Value = LimitDef> {
    prop_oneof![
        (capacity(), rate(), prop::bool::weighted(0.3)).prop_map(|(capacity, rate, scoped)| {
            LimitDef::Bucket {
                capacity,
                rate,
                scoped,
            }
        }),
        (
            amount(),
            window(),
            0..ZONES.len(),
            prop::bool::weighted(0.3)
        )
            .prop_map(|(amount, (period, reset), z, scoped)| LimitDef::Quota {
                amount,
                period,
                reset,
                zone: ZONES[z],
                scoped,
            }),
    ]
}

fn service() -> impl Strategy<Value = Service> {
    prop_oneof![Just(None), Just(Some("alpha")), Just(Some("beta"))]
}

fn cost() -> impl Strategy<Value = f64> {
    prop_oneof![
        Just(0.0),
        Just(1.0),
        Just(2.0),
        Just(0.5),
        (0u32..48).prop_map(|q| f64::from(q) / 4.0),
        0.0..12.0f64,
        // More than any limit holds.
        Just(2e9),
    ]
}

fn delta() -> impl Strategy<Value = f64> {
    prop_oneof![
        Just(1.0),
        Just(-1.0),
        Just(0.5),
        -10.0..10.0f64,
        // A refund far past full, a debit far past empty.
        Just(-1e12),
        Just(3e9),
    ]
}

fn seed() -> impl Strategy<Value = Option<f64>> {
    prop_oneof![4 => Just(None), 1 => Just(Some(0.0)), 1 => (0.0..=1.0f64).prop_map(Some)]
}

fn wait() -> impl Strategy<Value = Wait> {
    let near = prop_oneof![
        Just(Near::Exactly),
        Just(Near::JustAfter),
        Just(Near::HalfASecondBefore)
    ];
    prop_oneof![
        Just(Wait::Micros(0)),
        (1u64..SECOND_US).prop_map(Wait::Micros),
        (1u64..7_200).prop_map(Wait::Secs),
        (1u64..40 * DAY_S).prop_map(Wait::Secs),
        (0usize..4, near).prop_map(|(limit, at)| Wait::Boundary { limit, at }),
    ]
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        5 => (
            vec(0usize..2, 1..=5),
            [service(), service()],
            cost(),
            any::<bool>(),
            seed()
        )
            .prop_map(|(who, services, cost, hurried, seed)| Step::Takes {
                who,
                services,
                cost,
                hurried,
                seed
            }),
        2 => (0usize..2, service(), delta())
            .prop_map(|(client, service, delta)| Step::Adjust { client, service, delta }),
        2 => (0usize..2, service(), seed())
            .prop_map(|(client, service, seed)| Step::Peek { client, service, seed }),
        4 => wait().prop_map(Step::Wait),
        2 => (0usize..4, limit_def()).prop_map(|(limit, def)| Step::Plan { limit, def }),
        1 => (
            0usize..4,
            prop::option::of(capacity()),
            prop::option::of(rate()),
            amount(),
            prop::option::of(1u64..7_200),
        )
            .prop_map(|(limit, capacity, rate, amount, secs)| Step::Override {
                limit,
                capacity,
                rate,
                amount,
                secs,
            }),
    ]
}

// ---------------------------------------------------------------------------------------
// Replaying a history on both sides.

/// What every history shares: Redis, the store on it, the clock, and what was compared.
struct World {
    runtime: tokio::runtime::Runtime,
    seen: RefCell<Seen>,
    store: Rc<RedisStore>,
    /// For what the store does not do: flushing Redis, reading the group hash back.
    conn: RefCell<redis::Connection>,
    clock: Clock,
}

/// What the histories compared, to show they reach what they should.
#[derive(Debug, Default)]
struct Seen {
    admitted: u64,
    refused: u64,
    never: u64,
    adjusted: u64,
    peeked: u64,
    one_bucket: u64,
    /// Takes decided by a script call that decided others too.
    in_shared_calls: u64,
    /// States read back from Redis and compared.
    states: u64,
    /// Quota windows a write opened (none kept, or one that ended).
    windows: u64,
    swept: u64,
    /// Plan changes that turned a limit into the other kind under its name.
    retyped: u64,
}

/// One history's replay: the plan as it stands, the embedded store's arithmetic, and the
/// state it keeps, as the script should have left it in Redis.
struct Replay<'a> {
    world: &'a World,
    limits: Vec<Limit>,
    default_first: bool,
    overrides: Vec<Override>,
    local: LocalLimits,
    kept: HashMap<(usize, Arc<str>), Kept>,
}

/// A limit's state as the Rust side keeps it, with what it was decided against and the
/// sweep time the script wrote beside it.
struct Kept {
    state: LimitState,
    kind: AppliedKind,
    sweep_after: f64,
}

/// A history that failed, and why.
fn fail(why: String) -> TestCaseError {
    TestCaseError::fail(why)
}

impl World {
    /// Replays `h` on both sides, from an empty Redis and the clock at its start.
    fn replay(&self, h: &History) -> Result<(), TestCaseError> {
        redis::cmd("FLUSHALL")
            .exec(&mut self.conn.borrow_mut())
            .map_err(|e| fail(format!("FLUSHALL: {e}")))?;
        self.clock.set_us(h.start.0 * SECOND_US);
        let limits = h
            .limits
            .iter()
            .enumerate()
            .map(|(i, d)| build_limit(i, d, h.default_first))
            .collect();
        let mut replay = Replay {
            world: self,
            limits,
            default_first: h.default_first,
            overrides: Vec::new(),
            local: LocalLimits::default(),
            kept: HashMap::new(),
        };
        for (i, step) in h.steps.iter().enumerate() {
            replay
                .step(step)
                .map_err(|e| fail(format!("step {i} ({step:?}): {e}")))?;
        }
        Ok(())
    }
}

/// The plan's `i`th limit, as `d` defines it.
fn build_limit(i: usize, d: &LimitDef, default_first: bool) -> Limit {
    let name = match i {
        0 if default_first => "default".to_owned(),
        0 => "first".to_owned(),
        i => format!("l{i}"),
    };
    let name = LimitName::parse(&name).expect("a valid name");
    let (kind, scoped) = match d {
        LimitDef::Bucket {
            capacity,
            rate,
            scoped,
        } => (
            LimitKind::Bucket(Bucket::new(*capacity, *rate).expect("a valid bucket")),
            *scoped,
        ),
        LimitDef::Quota {
            amount,
            period,
            reset,
            zone,
            scoped,
        } => {
            let clock = QuotaClock::new(*period, *reset, zone).expect("a valid quota clock");
            (
                LimitKind::Quota(Quota::new(*amount, clock).expect("a valid quota")),
                *scoped,
            )
        }
    };
    let service = (scoped && i > 0).then(|| ServiceName::parse("alpha").expect("a valid service"));
    Limit::new(name, service, kind)
}

impl Replay<'_> {
    /// Runs `step` on both sides and compares what they answer and keep.
    fn step(&mut self, step: &Step) -> Result<(), String> {
        if matches!(
            step,
            Step::Takes { .. } | Step::Adjust { .. } | Step::Peek { .. }
        ) {
            self.sweep()?;
        }
        match step {
            Step::Takes {
                who,
                services,
                cost,
                hurried,
                seed,
            } => self.takes(who, services, *cost, *hurried, *seed)?,
            Step::Adjust {
                client,
                service,
                delta,
            } => {
                let applied = self.applied(*service, None);
                let redis = self.world.runtime.block_on(self.world.store.buckets.adjust(
                    CLIENTS[*client],
                    &applied,
                    *delta,
                ));
                let redis = redis.map_err(|e| format!("Redis refused the adjustment: {e}"))?;
                let rust =
                    self.decide(*client, &applied, LocalOp::Adjust { delta: *delta }, &redis);
                same_ruling(&redis, &rust)?;
            }
            Step::Peek {
                client,
                service,
                seed,
            } => {
                let applied = self.applied(*service, *seed);
                let redis = self
                    .world
                    .runtime
                    .block_on(self.world.store.buckets.peek(CLIENTS[*client], &applied))
                    .map_err(|e| format!("Redis refused the peek: {e}"))?;
                if one_bucket(&applied) {
                    self.one_bucket_peek(*client, &applied[0], &redis)?;
                }
                let rust = self.decide(*client, &applied, LocalOp::Peek, &redis);
                same_ruling(&redis, &rust)?;
            }
            Step::Wait(w) => {
                self.wait(*w);
                return Ok(());
            }
            Step::Plan { limit, def } => {
                let i = limit % self.limits.len();
                let limit = build_limit(i, def, self.default_first);
                if !matches!(
                    (self.limits[i].kind(), limit.kind()),
                    (LimitKind::Bucket(_), LimitKind::Bucket(_))
                        | (LimitKind::Quota(_), LimitKind::Quota(_))
                ) {
                    self.world.seen.borrow_mut().retyped += 1;
                }
                self.limits[i] = limit;
                return Ok(());
            }
            Step::Override {
                limit,
                capacity,
                rate,
                amount,
                secs,
            } => {
                let l = &self.limits[limit % self.limits.len()];
                let (capacity, rate, quota) = match l.kind() {
                    LimitKind::Bucket(b) => (capacity.or(Some(b.capacity())), *rate, None),
                    LimitKind::Quota(_) => (None, None, Some(*amount)),
                };
                let o = Override {
                    limit: l.name().clone(),
                    capacity,
                    rate,
                    quota,
                    until: secs.map(|s| Clock::now_us() / SECOND_US + s),
                };
                self.overrides.retain(|x| x.limit != o.limit);
                self.overrides.push(o);
                return Ok(());
            }
        }
        self.check_kept()
    }

    /// The limits a request to `service` applies now, overrides in force, buckets that do
    /// not exist yet starting at `seed` of their capacity.
    fn applied(&self, service: Service, seed: Option<f64>) -> Vec<Applied> {
        let limits = Limits::new(self.limits.clone()).expect("a valid plan");
        let now_s = Clock::now_us() / SECOND_US;
        let mut applied = limits.overridden(&self.overrides, now_s).applied(service);
        for a in &mut applied {
            if let AppliedKind::Bucket { bucket, initial } = &mut a.kind {
                *initial = seed.map(|s| s * bucket.capacity());
            }
        }
        applied
    }

    /// Takes made in one turn of the worker, decided by Redis; then each decided by the
    /// Rust side in Redis' order: a client's in the order they were made (whether in one
    /// entry or in two calls), clients' apart from each other.
    fn takes(
        &mut self,
        who: &[usize],
        services: &[Service; 2],
        cost: f64,
        hurried: bool,
        seed: Option<f64>,
    ) -> Result<(), String> {
        let sets: [Rc<Vec<Applied>>; 2] = services.map(|s| Rc::new(self.applied(s, seed)));
        let store = &self.world.store;
        let rulings: Vec<Result<Ruling, StoreError>> = self.world.runtime.block_on(async {
            let local = tokio::task::LocalSet::new();
            local
                .run_until(async {
                    let tasks: Vec<_> = who
                        .iter()
                        .map(|client| {
                            let (store, applied) = (Rc::clone(store), Rc::clone(&sets[*client]));
                            let key = CLIENTS[*client];
                            let budget = hurried.then(|| Budget {
                                due: tokio::time::Instant::now(),
                                store: Duration::from_secs(5),
                            });
                            tokio::task::spawn_local(async move {
                                store.buckets.take(key, &applied, cost, budget).await
                            })
                        })
                        .collect();
                    let mut rulings = Vec::new();
                    for t in tasks {
                        rulings.push(t.await.unwrap_or(Err(StoreError::Abandoned)));
                    }
                    rulings
                })
                .await
        });
        for (i, redis) in rulings.into_iter().enumerate() {
            let redis = redis.map_err(|e| format!("Redis refused take {i}: {e}"))?;
            let (client, applied) = (who[i], &sets[who[i]]);
            if one_bucket(applied) {
                self.one_bucket_take(client, &applied[0], cost, &redis)
                    .map_err(|e| format!("take {i}: {e}"))?;
            }
            let rust = self.decide(client, applied, LocalOp::Take { cost }, &redis);
            same_ruling(&redis, &rust).map_err(|e| format!("take {i}: {e}"))?;
        }
        Ok(())
    }

    /// The embedded store's arithmetic on `op`, now (the clock stands still: Redis must
    /// have decided at this instant too); keeps the state it writes.
    fn decide(
        &mut self,
        client: usize,
        applied: &[Applied],
        op: LocalOp,
        redis: &Ruling,
    ) -> Ruling {
        let now = Clock::now_us();
        let rust = self.local.run(CLIENTS[client], applied, op, now);
        {
            let mut seen = self.world.seen.borrow_mut();
            match op {
                LocalOp::Take { .. } if rust.allowed => seen.admitted += 1,
                LocalOp::Take { .. } if rust.wait_us.is_none() => seen.never += 1,
                LocalOp::Take { .. } => seen.refused += 1,
                LocalOp::Adjust { .. } => seen.adjusted += 1,
                LocalOp::Peek => seen.peeked += 1,
            }
            if redis.batch > 1 {
                seen.in_shared_calls += 1;
            }
        }
        if !matches!(op, LocalOp::Peek) {
            for (a, level) in applied.iter().zip(&rust.levels) {
                let before = self.kept.get(&(client, Arc::clone(&a.field)));
                if let Level::Used { end_us, .. } = level {
                    let same = matches!(
                        before,
                        Some(Kept { state: LimitState::Quota { end_us: e, .. }, .. }) if e == end_us
                    );
                    if !same {
                        self.world.seen.borrow_mut().windows += 1;
                    }
                }
                self.kept.insert(
                    (client, Arc::clone(&a.field)),
                    Kept {
                        state: level.state(now),
                        kind: a.kind.clone(),
                        sweep_after: f64::INFINITY,
                    },
                );
            }
        }
        rust
    }

    /// The state the Rust side keeps for `client`'s one bucket, if any.
    fn kept_bucket(&self, client: usize, a: &Applied) -> Option<BucketState> {
        match self.kept.get(&(client, Arc::clone(&a.field))) {
            Some(Kept {
                state: LimitState::Bucket(s),
                ..
            }) => Some(*s),
            _ => None,
        }
    }

    /// A take from a set of one bucket, as the engine's `limits::bucket` decides it alone
    /// (the in-process buckets' arithmetic).
    fn one_bucket_take(
        &self,
        client: usize,
        a: &Applied,
        cost: f64,
        redis: &Ruling,
    ) -> Result<(), String> {
        let AppliedKind::Bucket { bucket, initial } = a.kind else {
            return Err("not a bucket".into());
        };
        self.world.seen.borrow_mut().one_bucket += 1;
        let state = self.kept_bucket(client, a);
        let (after, wait_us) = bucket::take_seeded(state, Clock::now_us(), bucket, cost, initial);
        let level = redis.levels.first().copied();
        if (
            wait_us == bucket::TAKEN,
            Some(Level::Tokens(after.tokens)),
            wait_us,
        ) != (redis.allowed, level, redis.wait_us)
        {
            return Err(format!(
                "domain::bucket decides a wait of {wait_us:?} leaving {after:?} from {state:?}, Redis {redis:?}"
            ));
        }
        Ok(())
    }

    /// A peek at a set of one bucket, as `limits::bucket::refill` sees it.
    fn one_bucket_peek(&self, client: usize, a: &Applied, redis: &Ruling) -> Result<(), String> {
        let AppliedKind::Bucket { bucket, initial } = a.kind else {
            return Err("not a bucket".into());
        };
        self.world.seen.borrow_mut().one_bucket += 1;
        let state = self.kept_bucket(client, a);
        let tokens = bucket::refill(state, Clock::now_us(), bucket, initial);
        if redis.levels != [Level::Tokens(tokens)] {
            return Err(format!(
                "domain::bucket::refill gives {tokens} from {state:?}, Redis {redis:?}"
            ));
        }
        Ok(())
    }

    /// Moves the clock.
    fn wait(&mut self, w: Wait) {
        let now = Clock::now_us();
        let target = match w {
            Wait::Micros(us) => now + us,
            Wait::Secs(s) => now + s * SECOND_US,
            Wait::Boundary { limit, at } => {
                let applied = self.applied(Some("alpha"), None);
                let Some(a) = applied.get(limit % applied.len()) else {
                    return;
                };
                let Some(whole) = self.whole_again(a, now) else {
                    return;
                };
                match at {
                    Near::Exactly => whole,
                    Near::JustAfter => whole + 1,
                    Near::HalfASecondBefore => whole.saturating_sub(SECOND_US / 2),
                }
            }
        };
        if target > now {
            self.world.clock.set_us(target);
        }
    }

    /// When `a` of client `a` is whole again: its stored quota window's end (else the end
    /// of the window now falls in), or when its bucket is full.
    fn whole_again(&self, a: &Applied, now: u64) -> Option<u64> {
        let kept = self.kept.get(&(0, Arc::clone(&a.field))).map(|k| k.state);
        match (&a.kind, kept) {
            (AppliedKind::Quota { .. }, Some(LimitState::Quota { end_us, .. })) if end_us > now => {
                Some(end_us)
            }
            (AppliedKind::Quota { clock, .. }, _) => Some(match clock.bounds(now) {
                Bounds::Fixed(ends) => ends[1],
                Bounds::Rolling(len) => now + len,
            }),
            (AppliedKind::Bucket { bucket, .. }, Some(LimitState::Bucket(s))) => {
                let us = ((bucket.capacity() - s.tokens) / bucket.rate() * 1e6).ceil();
                (us > 0.0 && us < 1e14).then(|| s.ts_us + us as u64)
            }
            (AppliedKind::Bucket { .. }, _) => None,
        }
    }

    /// Sweeps the state group now, so that no sweep can run during the step.
    ///
    /// The script sweeps at most once a second of Redis' clock, in whichever call the
    /// gatherer asks it to (every 100 ms of real time), deleting the fields that say
    /// nothing a missing one would not: a bucket full again, a quota's window over, each
    /// under the limit's values when it was written. Under other values a missing field
    /// does say something else (a bucket that starts at its seed, or full at a raised
    /// capacity, instead of refilling from what it held), and both stores forget idle
    /// state on their own schedule: the embedded store's is not the script's. So the test
    /// picks the moment. Before each step that calls Redis, it makes the group's sweep due
    /// (its mark's time, keeping its cursor) and calls the script with a sweep and a peek
    /// of a client of its own; whatever that sweep deleted, the Rust side forgets too
    /// ([`Replay::check_kept`]). A step then runs within that second: the script's own
    /// sweeps during it find the group not due.
    fn sweep(&mut self) -> Result<(), String> {
        let group = self.world.store.groups.key(0).to_owned();
        self.sweep_call(&group)?;
        self.check_kept()
    }

    /// [`Replay::sweep`]'s call, unless there is no group to sweep.
    fn sweep_call(&self, group: &str) -> Result<(), String> {
        let conn = &mut *self.world.conn.borrow_mut();
        let mark: Option<String> = redis::cmd("HGET")
            .arg(group)
            .arg("~")
            .query(conn)
            .map_err(|e| format!("HGET {group} ~: {e}"))?;
        // A peek writes nothing, not even a group: with none, there is nothing to sweep.
        let Some(mark) = mark else {
            return Ok(());
        };
        let cursor = mark.split(' ').next().unwrap_or("0");
        redis::cmd("HSET")
            .arg(group)
            .arg("~")
            .arg(format!("{cursor} 0{}", " ".repeat(72)))
            .exec(conn)
            .map_err(|e| format!("HSET {group} ~: {e}"))?;
        // struct '<HBdIHH': one entry, a peek, of the first set and group.
        let mut run = 1u16.to_le_bytes().to_vec();
        run.push(b'p');
        run.extend(0f64.to_le_bytes());
        run.extend(1u32.to_le_bytes());
        run.extend(1u16.to_le_bytes());
        run.extend(1u16.to_le_bytes());
        let reply: Vec<Vec<u8>> = redis::Script::new(BUCKET_LUA)
            .key(group)
            .arg(0) // no groups beyond KEYS
            .arg(SWEEP_FIELDS)
            .arg(1) // one limit set: one bucket of 1, 1/s
            .arg(1)
            .arg("")
            .arg("b")
            .arg(1)
            .arg(1)
            .arg("")
            .arg("")
            .arg(run)
            .arg("sweeper")
            .invoke(conn)
            .map_err(|e| format!("the sweeping call: {e}"))?;
        let now = reply
            .first()
            .and_then(|n| std::str::from_utf8(n).ok()?.parse::<u64>().ok());
        if now != Some(Clock::now_us()) || reply.get(1).map(Vec::as_slice) != Some(b"1") {
            return Err(format!("the sweeping call answered {reply:?}"));
        }
        Ok(())
    }

    /// Reads the state group back: every field is what the Rust side keeps. A field gone
    /// was swept: it must have been due, and the Rust side forgets it too.
    fn check_kept(&mut self) -> Result<(), String> {
        let group = self.world.store.groups.key(0).to_owned();
        let fields: Vec<(String, Vec<u8>)> = redis::cmd("HGETALL")
            .arg(&group)
            .query(&mut self.world.conn.borrow_mut())
            .map_err(|e| format!("HGETALL {group}: {e}"))?;
        let mut seen = HashSet::new();
        for (field, value) in fields {
            if field == "~" {
                continue;
            }
            let (tag, suffix) = field.split_once('/').unwrap_or((&field, ""));
            let client = TAGS
                .iter()
                .position(|t| *t == tag)
                .ok_or_else(|| format!("a field of no client: {field:?}"))?;
            let key = (client, Arc::<str>::from(suffix));
            let [v0, v1, v2] = decode(&value)
                .ok_or_else(|| format!("field {field:?} is not a state: {value:?}"))?;
            let kept = self.kept.get_mut(&key).ok_or_else(|| {
                format!("Redis keeps {field:?} = {:?}, Rust nothing", [v0, v1, v2])
            })?;
            match (kept.state, &kept.kind) {
                (LimitState::Bucket(s), AppliedKind::Bucket { bucket, .. }) => {
                    if (v0, v1) != (s.tokens, s.ts_us as f64) {
                        return Err(format!(
                            "Redis keeps {field:?} = {v0} tokens at {v1}, Rust {s:?}"
                        ));
                    }
                    let full = bucket::refill(Some(s), v2 as u64, *bucket, None);
                    if full != bucket.capacity() || v2.fract() != 0.0 {
                        return Err(format!(
                            "{field:?} may be swept at {v2}, when it holds {full} of {}",
                            bucket.capacity()
                        ));
                    }
                }
                (LimitState::Quota { used, end_us }, _) => {
                    if (v0, v1, v2) != (used, end_us as f64, end_us as f64 + 1e6 + 0.5) {
                        return Err(format!(
                            "Redis keeps {field:?} = {:?}, Rust {:?}",
                            [v0, v1, v2],
                            kept.state
                        ));
                    }
                }
                (state, kind) => return Err(format!("{field:?}: {state:?} for {kind:?}")),
            }
            kept.sweep_after = v2;
            seen.insert(key);
            self.world.seen.borrow_mut().states += 1;
        }
        let swept: Vec<(usize, Arc<str>)> = self
            .kept
            .keys()
            .filter(|k| !seen.contains(*k))
            .cloned()
            .collect();
        for key in swept {
            let (after, now) = (self.kept[&key].sweep_after, Clock::now_us());
            if after >= now as f64 {
                return Err(format!(
                    "Redis lost {}/{} (sweepable after {after}, now {now})",
                    TAGS[key.0], key.1
                ));
            }
            self.local
                .forget(CLIENTS[key.0], std::slice::from_ref(&key.1));
            self.kept.remove(&key);
            self.world.seen.borrow_mut().swept += 1;
        }
        Ok(())
    }
}

/// A state field's three numbers (struct `<ddd`).
fn decode(v: &[u8]) -> Option<[f64; 3]> {
    let word = |i: usize| -> Option<f64> {
        Some(f64::from_le_bytes(
            v.get(8 * i..8 * i + 8)?.try_into().ok()?,
        ))
    };
    (v.len() == 24).then_some(())?;
    Some([word(0)?, word(1)?, word(2)?])
}

/// Both sides' answers, field by field (`batch` counts the call's takes: Redis' own).
fn same_ruling(redis: &Ruling, rust: &Ruling) -> Result<(), String> {
    let view = |r: &Ruling| {
        (
            r.allowed,
            r.levels.clone(),
            r.wait_us,
            r.refused_by,
            r.now_us,
        )
    };
    if view(redis) != view(rust) {
        return Err(format!("Redis answers\n  {redis:?}\nRust\n  {rust:?}"));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The clock.

/// The fake clock this process and its Redis read (`testkit/src/fake_clock.c`), stopped
/// at an instant the test chooses: the file it is read from holds `@` and that instant in
/// seconds.
struct Clock {
    file: PathBuf,
}

impl Clock {
    fn from_env() -> Clock {
        let file = std::env::var_os(CLOCK_FILE).expect("the child runs under a fake clock");
        Clock { file: file.into() }
    }

    /// Now, as this process (and Redis) read the clock, in unix µs.
    fn now_us() -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64)
    }

    /// Stops the clock at `unix_us`.
    fn set_us(&self, unix_us: u64) {
        let instant = format!("@{}.{:06}", unix_us / SECOND_US, unix_us % SECOND_US);
        // Renamed into place: a reader sees the old instant or the new.
        let next = self.file.with_extension("next");
        std::fs::write(&next, instant).expect("writing the clock's file");
        std::fs::rename(&next, &self.file).expect("moving the clock");
    }
}
