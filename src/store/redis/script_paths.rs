//! `engine/lua/bucket.lua` has two paths: a lean one for a call of one entry of a set of one
//! bucket (a request alone in its call), and the general one for everything else. They
//! must decide, answer and write alike, byte for byte.

use redis::{Connection, Script, Value};
use tollgate_testkit::{FakeClock, RedisServer};

use tollgate_engine::redis::BUCKET_LUA;

const CAP: f64 = 5.0;
/// Not a divisor of a token: the time to refill a whole one is rounded up.
const RATE: f64 = 0.3;
/// After every time Redis can give: a state counted then does not refill.
const LATER: f64 = 1e17;

/// A client's state before the call.
#[derive(Clone, Copy, Debug)]
enum State {
    /// No group at all.
    NoGroup,
    /// A group (with its mark) without the client's field.
    NoField,
    /// A field that is not a state (not 24 bytes): read as missing.
    Junk,
    /// Tokens, counted at this time (unix µs).
    Tokens(f64, f64),
    /// A quota's count in a window ending then (unix µs), with the quota's mark (half a
    /// microsecond in its sweep time): a bucket reads it as missing.
    Quota(f64, f64),
}

/// One entry's operation: op ('t', 'a', 'p'), cost, n.
type Op = (u8, f64, u32);

/// The script's reply, and what it left in the group: the client's field and the mark.
#[derive(Debug, PartialEq)]
struct Outcome {
    status: String,
    level: Option<Vec<u8>>,
    errors: Vec<String>,
    /// The client's field: its tokens, its time and its sweepable-after time, the times less
    /// the reply's now when the call wrote it (not a peek).
    field: Option<(f64, f64, f64)>,
    mark: Option<Vec<u8>>,
}

/// A call's one run of entries (struct '<HBdIHH'): `len` entries of `op`, of the first
/// limit set and the first group.
fn run(op: Op, len: u16) -> Vec<u8> {
    let mut r = len.to_le_bytes().to_vec();
    r.push(op.0);
    r.extend(op.1.to_le_bytes());
    r.extend(op.2.to_le_bytes());
    r.extend(1u16.to_le_bytes());
    r.extend(1u16.to_le_bytes());
    r
}

/// Puts `group` in `state`, for client `c`.
fn prepare(conn: &mut Connection, group: &str, state: State) {
    redis::cmd("DEL").arg(group).exec(conn).unwrap();
    let field: Option<Vec<u8>> = match state {
        State::NoGroup => return,
        State::NoField => None,
        State::Junk => Some(b"not a state".to_vec()),
        State::Tokens(t, at) => Some(
            [t, at, at + 1e6]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
        ),
        State::Quota(used, end) => Some(
            [used, end, end + 1e6 + 0.5]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
        ),
    };
    let mark = format!("0 0{}", " ".repeat(72));
    let mut cmd = redis::cmd("HSET");
    cmd.arg(group).arg("~").arg(mark);
    if let Some(f) = field {
        cmd.arg("c").arg(f);
    }
    cmd.exec(conn).unwrap();
}

/// Calls the script for client `c` in `group`, alone (the lean path) or beside another
/// client (the general path).
fn call(conn: &mut Connection, group: &str, op: Op, init: &str, alone: bool) -> Outcome {
    let script = Script::new(BUCKET_LUA);
    let mut invocation = script.key(group);
    invocation
        .arg(0)
        .arg(0)
        .arg(1)
        .arg(1)
        .arg("")
        .arg("b")
        .arg(CAP)
        .arg(RATE)
        .arg(init)
        .arg("");
    if alone {
        invocation.arg(run(op, 1)).arg("c");
    } else {
        invocation.arg(run(op, 2)).arg("c").arg("other");
    }
    let reply: Vec<Value> = invocation.invoke(conn).unwrap();
    let bytes = |v: &Value| match v {
        Value::BulkString(b) => b.clone(),
        v => panic!("{v:?}"),
    };
    let now: f64 = String::from_utf8(bytes(&reply[0]))
        .unwrap()
        .parse()
        .unwrap();
    let status = String::from_utf8(bytes(&reply[1])).unwrap();
    let status = status[..1].to_string();
    let level = (status == "1").then(|| bytes(&reply[2])[..8].to_vec());
    let errors = reply[3..]
        .iter()
        .take(1)
        .map(|e| String::from_utf8(bytes(e)).unwrap())
        .collect();
    let (field, mark): (Option<Vec<u8>>, Option<Vec<u8>>) = redis::cmd("TYPE")
        .arg(group)
        .query::<String>(conn)
        .ok()
        .filter(|t| t == "hash")
        .map(|_| {
            redis::cmd("HMGET")
                .arg(group)
                .arg("c")
                .arg("~")
                .query(conn)
                .unwrap()
        })
        .unwrap_or((None, None));
    let since = if op.0 == b'p' { 0.0 } else { now };
    let field = field.filter(|f| f.len() == 24).map(|f| {
        let d = |i: usize| f64::from_le_bytes(f[8 * i..8 * i + 8].try_into().unwrap());
        (d(0), d(1) - since, d(2) - since)
    });
    Outcome {
        status,
        level,
        errors,
        field,
        mark,
    }
}

#[test]
fn the_lean_path_decides_answers_and_writes_as_the_general_path_does() {
    // Redis' clock is set to a whole second before each case, so the microseconds of the
    // time the calls answer have fewer than six digits: they must be padded.
    let clock = FakeClock::at(1_800_000_000.0).unwrap();
    let redis = RedisServer::start_with_env(&clock.env()).unwrap();
    let mut conn = redis.conn().unwrap();
    let states = [
        State::NoGroup,
        State::NoField,
        State::Junk,
        State::Tokens(2.5, LATER),
        State::Tokens(0.4, LATER),
        State::Tokens(-3.0, LATER),
        State::Tokens(1.0, 0.0),
        // A window ending in 2030: a mark of half a microsecond is exact below 2^52 µs.
        State::Quota(1.0, 1.9e15),
    ];
    let ops: [Op; 9] = [
        (b't', 1.0, 1),
        (b't', 1.0, 3),
        (b't', 0.5, 9),
        (b't', 10.0, 1),
        (b'a', 2.0, 1),
        (b'a', -2.0, 1),
        (b'a', 2e9, 1),
        (b'p', 1.0, 1),
        // No operation the gateway sends: both paths refill and write, and take nothing.
        (b'x', 1.0, 1),
    ];
    let mut compared = 0;
    for state in states {
        for op in ops {
            for init in ["", "2", "0"] {
                clock.set(1_800_000_000.0).unwrap();
                prepare(&mut conn, "t:{lean}", state);
                prepare(&mut conn, "t:{general}", state);
                let lean = call(&mut conn, "t:{lean}", op, init, true);
                let general = call(&mut conn, "t:{general}", op, init, false);
                let case = format!("{state:?} {op:?} init {init:?}");
                assert_eq!(lean.status, "1", "{case}: {lean:?}");
                if op.0 != b'p' {
                    // Counted at the time the call answered.
                    assert_eq!(lean.field.map(|f| f.1), Some(0.0), "{case}: {lean:?}");
                }
                assert_eq!(lean, general, "{case}");
                if let State::Quota(..) = state {
                    // As if the bucket had no state at all.
                    prepare(&mut conn, "t:{none}", State::NoField);
                    let none = call(&mut conn, "t:{none}", op, init, true);
                    assert_eq!(lean.level, none.level, "{case}");
                }
                compared += 1;
            }
        }
    }
    assert_eq!(compared, 8 * 9 * 3);
}

/// One take on each path, of the groups `t:{lean}` and `t:{general}` (set up alike by the
/// caller): the lean path's must be refused with `error`.
fn refused_on_both_paths(conn: &mut Connection, error: &str) -> (Outcome, Outcome) {
    let lean = call(conn, "t:{lean}", (b't', 1.0, 1), "", true);
    let general = call(conn, "t:{general}", (b't', 1.0, 1), "", false);
    assert_eq!(lean.status, "0", "{lean:?}");
    assert!(lean.errors[0].contains(error), "{lean:?}");
    (lean, general)
}

#[test]
fn an_error_on_the_lean_path_is_answered_as_the_general_path_answers_it() {
    // A group that is not a hash: HMGET fails on both paths.
    let redis = RedisServer::start().unwrap();
    let mut conn = redis.conn().unwrap();
    for group in ["t:{lean}", "t:{general}"] {
        redis::cmd("SET")
            .arg(group)
            .arg("x")
            .exec(&mut conn)
            .unwrap();
    }
    let (lean, general) = refused_on_both_paths(&mut conn, "WRONGTYPE");
    assert_eq!(lean, general);
}

#[test]
fn a_write_refused_on_the_lean_path_is_answered_as_the_general_path_answers_it() {
    // A Redis out of memory: HMGET answers, HSET is refused, on both paths.
    let redis = RedisServer::start().unwrap();
    let mut conn = redis.conn().unwrap();
    for group in ["t:{lean}", "t:{general}"] {
        prepare(&mut conn, group, State::Tokens(2.5, LATER));
    }
    for (k, v) in [("maxmemory-policy", "noeviction"), ("maxmemory", "1")] {
        redis::cmd("CONFIG")
            .arg("SET")
            .arg(k)
            .arg(v)
            .exec(&mut conn)
            .unwrap();
    }
    let (lean, general) = refused_on_both_paths(&mut conn, "OOM");
    // Nothing was taken: the field holds its 2.5 tokens (its times, unwritten, are not
    // relative to this call's now, so they are not compared).
    assert_eq!(lean.field.map(|f| f.0), Some(2.5), "{lean:?}");
    let view = |o: &Outcome| {
        (
            o.status.clone(),
            o.errors.clone(),
            o.mark.clone(),
            o.field.map(|f| f.0),
        )
    };
    assert_eq!(view(&lean), view(&general));
}
