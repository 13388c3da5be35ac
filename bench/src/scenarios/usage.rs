//! `usage`: what usage history costs Redis (issue 37). Two gateways, usage history on and
//! off (`usage.enabled`), each with a `redis-server` of its own (so each Redis' counters
//! belong to one setting), both knowing N clients on a plan that never refuses. The same
//! open-loop load (fixed rate, a seeded draw of the clients per request) goes to each in
//! alternating slices. Per round and gateway: decisions, `EVALSHA` calls, and Redis' CPU
//! per decision (`INFO cpu`, minus what that Redis spends idle over the same wall time),
//! its usage checkpoints (and folds, when `--fold-ms` puts one there) included: the
//! round's window starts after the warm-up's counts were checkpointed, and ends a flush
//! period after the load, so every decision of the window was checkpointed inside it.
//! Last, the gateway with history on is stopped (SIGTERM), which folds all it holds: that
//! fold's Redis CPU, over the records it wrote, is a record's cost.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tollgate_testkit::RedisServer;

use super::clients::Clients;
use super::seconds;
use super::takes::RedisSpent;
use crate::load::{Arrivals, OpenRun, Stream};
use crate::procs::{one_unlimited_client, Gateway};
use crate::report::{machine, median, round, Outcome, Table};
use crate::upstream::{Server, Upstreams};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Requests per second, on each gateway while it has its slice.
    #[arg(long, default_value_t = 2000.0)]
    rate: f64,
    /// Seconds of load per gateway per round (in slices).
    #[arg(long, default_value = "20", value_parser = seconds)]
    duration: f64,
    /// Seconds per alternation slice.
    #[arg(long, default_value = "1", value_parser = seconds)]
    slice: f64,
    /// Rounds.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// `usage.flush_ms` of the gateway with usage history on.
    #[arg(long, default_value_t = 10_000)]
    flush_ms: u64,
    /// `usage.fold_ms` of the gateway with usage history on.
    #[arg(long, default_value_t = 3_600_000)]
    fold_ms: u64,
    /// Seconds each Redis is watched idle per round, to subtract its own CPU.
    #[arg(long, default_value = "3", value_parser = seconds)]
    idle_seconds: f64,
    #[command(flatten)]
    clients: Clients,
}

const PATH: &str = "/api/items/42";
const KEY: &str = "bench-usage-key-0001";

/// One gateway's figures over the rounds.
#[derive(Default)]
struct Side {
    /// Redis CPU µs per decision, one per round.
    cpu_us: Vec<f64>,
    /// `EVALSHA` calls per decision, one per round.
    calls: Vec<f64>,
    /// µs inside `EVALSHA` per decision (`INFO commandstats`), one per round.
    script_us: Vec<f64>,
    decisions: u64,
    non_200: u64,
    spent: RedisSpent,
}

pub fn run(a: &Args) -> anyhow::Result<Outcome> {
    a.clients.check()?;
    anyhow::ensure!(a.rounds >= 1, "--rounds must be at least 1");
    let machine = machine();
    let upstream = Upstreams::start(vec![Server::Fast(Default::default())])?;
    let redis = [RedisServer::start()?, RedisServer::start()?];
    let names = ["usage history on", "usage history off"];
    let mut gateways = Vec::new();
    for (i, r) in redis.iter().enumerate() {
        let mut config = one_unlimited_client(Some(r.url()), upstream.urls(), "usage-client", KEY);
        a.clients.add_to(&mut config, "large");
        config.extra.push_str(&format!(
            "[usage]\nenabled = {}\nflush_ms = {}\nfold_ms = {}\n",
            i == 0,
            a.flush_ms,
            a.fold_ms.max(a.flush_ms)
        ));
        gateways.push(Gateway::start(&config, PATH)?);
    }
    let requests = a.clients.requests(PATH, KEY);
    // Each slice goes on in the draw where the last one stopped (a stream sends its
    // requests from the first): every client is drawn, not the first slice's alone.
    let mut next = 0usize;
    // `first`: the gateway whose slice comes first (after an idle spell the first slice
    // meets a cold load generator and host: rounds take turns, so neither side always
    // pays for it).
    let mut streams_for = |from: f64, per_side: f64, first: usize| {
        let order = [&gateways[first], &gateways[1 - first]];
        let mut streams = Vec::new();
        let (mut t, mut left) = (from, per_side);
        while left > 1e-9 {
            let len = left.min(a.slice);
            let mut drawn = requests.clone();
            drawn.rotate_left(next % requests.len());
            next += (a.rate * len).ceil() as usize;
            for g in order {
                streams.push(Stream {
                    addr: g.addr,
                    requests: drawn.clone(),
                    rate: a.rate,
                    arrivals: Arrivals::Uniform,
                    from: Duration::from_secs_f64(t),
                    until: Duration::from_secs_f64(t + len),
                });
                t += len;
            }
            left -= len;
        }
        streams
    };
    let flush = Duration::from_millis(a.flush_ms) + Duration::from_secs(1);
    let mut sides: [Side; 2] = Default::default();
    eprintln!(
        "usage: {} req/s, {} s per gateway per round, {} rounds, {}, checkpoint every {} ms, fold every {} ms ({machine})",
        a.rate,
        a.duration,
        a.rounds,
        a.clients.describe(),
        a.flush_ms,
        a.fold_ms
    );
    for round_i in 0..a.rounds {
        // Warm-up: every client's state in each Redis, then its counts flushed.
        let first = round_i % 2;
        OpenRun::start(streams_for(0.0, 2.0, first)).join()?;
        std::thread::sleep(flush);
        let idle0 = [RedisSpent::read(&redis[0])?, RedisSpent::read(&redis[1])?];
        let idle_started = Instant::now();
        std::thread::sleep(Duration::from_secs_f64(a.idle_seconds));
        let before = [RedisSpent::read(&redis[0])?, RedisSpent::read(&redis[1])?];
        let idle_s = idle_started.elapsed().as_secs_f64();
        let started = Instant::now();
        let result = OpenRun::start(streams_for(0.0, a.duration, first)).join()?;
        // The last counts flushed.
        std::thread::sleep(flush);
        let wall_s = started.elapsed().as_secs_f64();
        for (i, side) in sides.iter_mut().enumerate() {
            let spent = RedisSpent::read(&redis[i])?.since(&before[i]);
            let idle_cpu = before[i].since(&idle0[i]).cpu_s / idle_s * wall_s;
            let samples = result
                .samples
                .iter()
                .skip(usize::from(i != first))
                .step_by(gateways.len())
                .flatten();
            let (mut ok, mut other) = (0u64, 0u64);
            for s in samples {
                if s.status == 200 {
                    ok += 1;
                } else {
                    other += 1;
                }
            }
            let cpu_us = (spent.cpu_s - idle_cpu).max(0.0) * 1e6 / ok.max(1) as f64;
            let calls = spent.calls("evalsha") as f64 / ok.max(1) as f64;
            let script_us = spent.usec("evalsha") as f64 / ok.max(1) as f64;
            eprintln!(
                "  round {}: {}: {ok} decisions, {:.2} µs Redis CPU each, {calls:.3} EVALSHA each, {script_us:.2} µs inside EVALSHA each",
                round_i + 1,
                names[i],
                cpu_us
            );
            side.cpu_us.push(cpu_us);
            side.calls.push(calls);
            side.script_us.push(script_us);
            side.decisions += ok;
            side.non_200 += other;
            side.spent.add(&spent);
        }
    }

    // Why answers were not 200, by the gateways' own counts.
    let mut outcomes = Vec::new();
    for (i, g) in gateways.iter().enumerate() {
        let m = g.metrics()?;
        let of = |outcome: &str| {
            m.get(&format!(
                "tollgate_decisions_total{{outcome=\"{outcome}\"}}"
            ))
            .copied()
            .unwrap_or(0.0)
        };
        let said = format!(
            "{}: shed {}, failed open {}, denied {}",
            names[i],
            of("shed"),
            of("fail_open"),
            of("denied")
        );
        eprintln!("  {said}");
        outcomes.push(said);
    }
    // The fold: the gateway with history on stops, adding everything it holds.
    let before = RedisSpent::read(&redis[0])?;
    let stopping = Instant::now();
    gateways[0].terminate(Duration::from_secs(60))?;
    let stop_s = stopping.elapsed().as_secs_f64();
    let fold = RedisSpent::read(&redis[0])?.since(&before);
    let fold_records = fold.calls("expireat");
    let per_record_us = fold.cpu_s * 1e6 / fold_records.max(1) as f64;
    let fold_said = format!(
        "the fold at its stop (SIGTERM to exit {stop_s:.2} s): {fold_records} records, {:.1} ms of Redis CPU, {per_record_us:.2} µs per record ({:.2} µs inside usage_add's EVALSHA per record)",
        fold.cpu_s * 1e3,
        fold.usec("evalsha") as f64 / fold_records.max(1) as f64
    );
    eprintln!("  {fold_said}");
    let mut table = Table::new(&[
        "gateway",
        "decisions",
        "non-200",
        "Redis CPU µs per decision, median",
        "worst",
        "each round",
        "EVALSHA per decision",
        "µs inside EVALSHA per decision, median (each round)",
        "usage records written per decision",
    ]);
    let mut json_sides = Vec::new();
    for (i, s) in sides.iter().enumerate() {
        let worst = s.cpu_us.iter().copied().fold(f64::MIN, f64::max);
        // Each record a fold adds to gets one `EXPIREAT` (nothing else sends one).
        let records = s.spent.calls("expireat") as f64 / s.decisions.max(1) as f64;
        table.row(vec![
            names[i].into(),
            s.decisions.to_string(),
            s.non_200.to_string(),
            format!("**{:.2}**", median(&s.cpu_us)),
            format!("{worst:.2}"),
            s.cpu_us
                .iter()
                .map(|v| format!("{v:.2}"))
                .collect::<Vec<_>>()
                .join(", "),
            format!("{:.3}", median(&s.calls)),
            format!(
                "{:.2} ({})",
                median(&s.script_us),
                s.script_us
                    .iter()
                    .map(|v| format!("{v:.2}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            format!("{records:.3}"),
        ]);
        json_sides.push(json!({
            "gateway": names[i],
            "decisions": s.decisions,
            "non_200": s.non_200,
            "redis_cpu_us_per_decision_median": round(median(&s.cpu_us), 3),
            "redis_cpu_us_per_decision_worst": round(worst, 3),
            "rounds_redis_cpu_us_per_decision": s.cpu_us.iter().map(|v| round(*v, 3)).collect::<Vec<_>>(),
            "evalsha_per_decision_rounds": s.calls.iter().map(|v| round(*v, 4)).collect::<Vec<_>>(),
            "script_us_per_decision_rounds": s.script_us.iter().map(|v| round(*v, 3)).collect::<Vec<_>>(),
            "usage_records_per_decision": round(records, 4),
            "commands": s.spent.commands.iter().map(|(k, (c, u))| (k.clone(), json!({"calls": c, "usec": u}))).collect::<serde_json::Map<String, Value>>(),
        }));
    }
    let markdown = format!(
        "### Usage history: Redis CPU per decision, on vs off\n\n{}, {} req/s per gateway in \
         alternating {} s slices, {} s each per round, {} rounds, checkpoint every {} ms, fold every {} ms ({machine}).\n\n{}",
        a.clients.describe(),
        a.rate,
        a.slice,
        a.duration,
        a.rounds,
        a.flush_ms,
        a.fold_ms,
        table.render()
    ) + &format!(
        "\nThe gateways' own counts over the whole run: {}.\n\nThen {fold_said}.\n",
        outcomes.join("; ")
    );
    Ok(Outcome {
        markdown,
        json: json!({
            "scenario": "usage",
            "machine": machine,
            "rate": a.rate,
            "duration_s": a.duration,
            "rounds": a.rounds,
            "flush_ms": a.flush_ms,
            "fold_ms": a.fold_ms,
            "fold_at_stop": {
                "records": fold_records,
                "redis_cpu_ms": round(fold.cpu_s * 1e3, 3),
                "redis_cpu_us_per_record": round(per_record_us, 3),
                "seconds_to_exit": round(stop_s, 3),
            },
            "clients": a.clients.describe(),
            "sides": json_sides,
        }),
        charts: Vec::new(),
    })
}
