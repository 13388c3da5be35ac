//! The engine's own micro-benchmarks (`cargo bench -p tollgate-engine`): the steps of a
//! take's road that run in the gateway's process, without Redis. A batch's call encoded
//! (gather), a call's reply split into its entries and each replayed (the replay), and
//! the arithmetic of one take (`take_many`), for a plan of one bucket and one of four
//! limits. What Redis spends is measured by `tollgate-bench redis` and
//! `bench/scripts/script-cost.sh` (see the README).

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use tollgate_engine::limits::{
    levels_at, take_many, Applied, AppliedKind, Bucket, Period, QuotaClock, Reset,
};
use tollgate_engine::redis::bench::{encode_takes, replay_call};

/// 2026-12-01T12:00:00Z, in unix microseconds.
const NOON: u64 = 1_796_126_400_000_000;

fn bucket(index: usize, name: &str, capacity: f64, rate: f64) -> Applied {
    Applied {
        index,
        name: Arc::from(name),
        // The plan's first limit lives in the client's own field, the others beside it.
        field: Arc::from(if index == 0 {
            String::new()
        } else {
            format!("{name}:")
        }),
        kind: AppliedKind::Bucket {
            bucket: Bucket::new(capacity, rate).expect("a valid bucket"),
            initial: None,
        },
    }
}

fn quota(index: usize, name: &str, amount: f64, period: Period) -> Applied {
    let clock = QuotaClock::new(period, Reset::Calendar, "UTC").expect("a valid clock");
    Applied {
        index,
        name: Arc::from(name),
        field: Arc::from(format!("{name}:")),
        kind: AppliedKind::Quota {
            amount,
            clock: Arc::new(clock),
        },
    }
}

/// A plan of one bucket (most plans), and one of four limits: a burst bucket, a slower
/// bucket, a daily and a monthly quota.
fn plans() -> [(&'static str, Vec<Applied>); 2] {
    [
        ("one bucket", vec![bucket(0, "default", 100.0, 50.0)]),
        (
            "four limits",
            vec![
                bucket(0, "default", 100.0, 50.0),
                bucket(1, "sustained", 1e6, 1e3),
                quota(2, "daily", 1e7, Period::Day),
                quota(3, "monthly", 1e9, Period::Month),
            ],
        ),
    ]
}

/// One call of `entries` takes, each a client of its own, encoded as the gatherer sends it.
fn call_encoding(c: &mut Criterion) {
    for (plan, applied) in plans() {
        for entries in [1, 32] {
            let tags: Vec<String> = (0..entries).map(|i| format!("client-{i}")).collect();
            let tags: Vec<&str> = tags.iter().map(String::as_str).collect();
            c.bench_function(&format!("encode a call ({entries} entries, {plan})"), |b| {
                b.iter(|| encode_takes("tollgate:s:{0}", black_box(&tags), &applied, 1.0))
            });
        }
    }
}

/// A reply to a call of `entries` takes, every entry decided, each limit's level what a
/// fresh client's would be.
fn reply(entries: usize, applied: &[Applied]) -> Vec<Vec<u8>> {
    let one = applied.len() == 1;
    let mut levels = Vec::new();
    for _ in 0..entries {
        for a in applied {
            match a.kind {
                AppliedKind::Bucket { bucket, .. } => {
                    levels.extend_from_slice(&bucket.capacity().to_le_bytes());
                    if !one {
                        levels.extend_from_slice(&0f64.to_le_bytes());
                    }
                }
                AppliedKind::Quota { .. } => {
                    levels.extend_from_slice(&0f64.to_le_bytes());
                    levels.extend_from_slice(&((NOON + 43_200_000_000) as f64).to_le_bytes());
                }
            }
        }
    }
    vec![NOON.to_string().into_bytes(), vec![b'1'; entries], levels]
}

/// A call's reply split into its entries, each parsed and replayed into its take's ruling.
fn reply_replay(c: &mut Criterion) {
    for (plan, applied) in plans() {
        for entries in [1, 32] {
            let reply = reply(entries, &applied);
            c.bench_function(
                &format!("split and replay a reply ({entries} entries, {plan})"),
                |b| {
                    b.iter_batched(
                        || reply.clone(),
                        |r| replay_call(r, &applied, 1.0).expect("a well-formed reply"),
                        BatchSize::SmallInput,
                    )
                },
            );
        }
    }
}

/// One take's arithmetic: the levels from stored states (none: a fresh client), then the
/// take from all of them or none.
fn take_arithmetic(c: &mut Criterion) {
    for (plan, applied) in plans() {
        c.bench_function(&format!("take_many (one take, {plan})"), |b| {
            b.iter(|| {
                let levels = levels_at(&applied, &[], black_box(NOON));
                take_many(&applied, levels, 1.0, 1, NOON)
            })
        });
    }
}

criterion_group!(benches, call_encoding, reply_replay, take_arithmetic);
criterion_main!(benches);
