//! `slowredis`: what a slow (not stalled) Redis costs. A fault-injecting proxy
//! (`tollgate-testkit`'s `FaultProxy`) between the gateway and `redis-server` delays every
//! reply by each of `--delays` in turn, while one hot client sends at `--hot-conns`
//! connections (closed loop, one bucket) and a few other clients at one connection each.
//! Per delay: the share of decisions that failed open, how often the breaker opened,
//! requests/s and p99, and the share of answers that were `503` (shed by an overloaded
//! gateway). A Redis that answers within the budget should cost latency, not limiting:
//! no fail-opens, and never an open breaker.
//!
//! Whether a run fails open at a small budget is decided by the host's scheduling as much
//! as by the gateway, so every delay is measured `--runs` times (run after run, each
//! measuring every delay in turn, so a slow stretch of the host spreads over the delays)
//! and reported as the median run and the worst, never the best.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tollgate_testkit::{ClientDef, FaultProxy, PlanDef, RedisServer};

use super::overload::OverloadSettings;
use super::{seconds, MetricsDelta};
use crate::http::get_request;
use crate::load::{run_closed, ClosedResult};
use crate::procs::{
    one_unlimited_client, raise_fd_limit, realtime, threads_of, Gateway, Steal, StealSpec,
};
use crate::report::{
    self, count, machine, median, ms, pct, round, runs_disturbance, CpuWatch, Outcome, OverRuns,
    Table, Worse,
};
use crate::upstream::{Server, Upstreams};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Reply delays to measure, in ms (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "0,1,2,3")]
    delays: Vec<f64>,
    /// The gateway's decision budget (`redis.timeout_ms`).
    #[arg(long, default_value_t = 5)]
    timeout_ms: u64,
    /// The hot client's concurrent connections.
    #[arg(long, default_value_t = 32)]
    hot_conns: usize,
    /// Other clients, one connection each.
    #[arg(long, default_value_t = 4)]
    others: usize,
    /// Gateway workers.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Seconds measured per delay.
    #[arg(long, default_value = "5", value_parser = seconds)]
    duration: f64,
    /// Seconds of warm-up per delay, not counted.
    #[arg(long, default_value = "1", value_parser = seconds)]
    warmup: f64,
    /// Runs: each measures every delay in turn; the report gives each figure's median and
    /// worst run.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    #[command(flatten)]
    overload: OverloadSettings,
    /// Takes the gateway's CPU away during each measured window, `STOP_MS/PERIOD_MS`
    /// (e.g. `3/18`: 17%), as a hypervisor's steal would (see `procs::Steal`).
    #[arg(long, value_name = "STOP_MS/PERIOD_MS")]
    steal: Option<StealSpec>,
    /// Runs `redis-server` and the fault proxy at real-time priority (see
    /// `procs::realtime`): a store on a host of its own, which the saturated gateway and
    /// load generator beside it cannot starve. Without it the store path shares the cores,
    /// and a call it answers late is a slow store, which fails open by design.
    #[arg(long)]
    store_realtime: bool,
}

const PATH: &str = "/api/items/42";
const HOT_KEY: &str = "bench-slowredis-hot-0";

fn other_key(i: usize) -> String {
    format!("bench-slowredis-other-{i}")
}

/// One delay's figures in one run.
struct Measured {
    /// Store verdicts (see [`MetricsDelta::verdicts`]): what fail-open % is a share of.
    decisions: f64,
    fail_open: f64,
    timeouts: f64,
    breaker_skips: f64,
    opened: f64,
    calls: f64,
    /// Requests the gateway shed (`outcome="shed"`), not among `decisions`.
    shed: f64,
    hot: ClosedResult,
    others: ClosedResult,
}

impl Measured {
    fn fail_open_pct(&self) -> f64 {
        100.0 * self.fail_open / self.decisions.max(1.0)
    }

    fn per_call(&self) -> f64 {
        self.decisions / self.calls.max(1.0)
    }

    /// The fields each row of the JSON had before `--runs`.
    fn json(&self) -> Value {
        json!({
            "decisions": self.decisions,
            "fail_open": self.fail_open,
            "fail_open_timeout": self.timeouts,
            "fail_open_breaker_open": self.breaker_skips,
            "fail_open_pct": round(self.fail_open_pct(), 3),
            "breaker_opened": self.opened,
            "hot_rps": round(self.hot.rate(), 0),
            "hot_p99_ms": round(self.hot.p99_ms(), 3),
            "hot_non_2xx": self.hot.non_2xx,
            "hot_shed_pct": round(self.hot.statuses.pct(503), 3),
            "others_rps": round(self.others.rate(), 0),
            "others_p99_ms": round(self.others.p99_ms(), 3),
            "others_shed_pct": round(self.others.statuses.pct(503), 3),
            "script_calls": self.calls,
            "shed_decisions": self.shed,
        })
    }
}

type Figure = report::Figure<Measured>;

const FIGURES: [Figure; 9] = [
    (
        "fail_open_pct",
        "fail-open %",
        Worse::Higher,
        Measured::fail_open_pct,
        pct,
    ),
    (
        "breaker_opened",
        "breaker opens",
        Worse::Higher,
        |m| m.opened,
        count,
    ),
    (
        "hot_rps",
        "hot req/s",
        Worse::Lower,
        |m| m.hot.rate(),
        count,
    ),
    (
        "hot_p99_ms",
        "hot p99 ms",
        Worse::Higher,
        |m| m.hot.p99_ms(),
        ms,
    ),
    (
        "others_rps",
        "others req/s",
        Worse::Lower,
        |m| m.others.rate(),
        count,
    ),
    (
        "others_p99_ms",
        "others p99 ms",
        Worse::Higher,
        |m| m.others.p99_ms(),
        ms,
    ),
    (
        "decisions_per_call",
        "decisions per script call",
        Worse::Lower,
        Measured::per_call,
        |v| format!("{v:.1}"),
    ),
    (
        "hot_shed_pct",
        "hot 503 %",
        Worse::Higher,
        |m| m.hot.statuses.pct(503),
        pct,
    ),
    (
        "others_shed_pct",
        "others 503 %",
        Worse::Higher,
        |m| m.others.statuses.pct(503),
        pct,
    ),
];

pub fn run(a: &Args) -> anyhow::Result<Outcome> {
    anyhow::ensure!(a.runs >= 1, "--runs must be at least 1");
    raise_fd_limit();
    let machine = machine();
    let redis = RedisServer::start()?;
    let proxy = FaultProxy::start(([127, 0, 0, 1], redis.port).into());
    if a.store_realtime {
        let mut tids = threads_of(redis.pid())?;
        tids.push(proxy.thread_id());
        realtime(&tids)?;
    }
    let upstream = Upstreams::start(vec![Server::Fast(Default::default())])?;
    // Every client on a plan far above any offered rate: each request takes the allowed
    // path, so a fail-open is the store's doing, never the limit's.
    let mut config = one_unlimited_client(
        Some(proxy.redis_url()),
        upstream.urls(),
        "slowredis-hot",
        HOT_KEY,
    );
    config.workers = a.workers;
    config.timeout_ms = Some(a.timeout_ms);
    a.overload.apply(&mut config);
    config.plans.push(PlanDef {
        name: "other".into(),
        capacity: 1e9,
        rate: 1e9,
    });
    for i in 0..a.others {
        config.clients.push(ClientDef {
            id: format!("slowredis-other-{i}"),
            plan: "other".into(),
            key: other_key(i),
        });
    }
    let gateway = Gateway::start(&config, PATH)?;
    eprintln!(
        "slowredis: delays {:?} ms, budget {} ms, hot client at {} connections + {} others, {} workers, {} runs, {} ({machine})",
        a.delays, a.timeout_ms, a.hot_conns, a.others, a.workers, a.runs, a.overload.describe()
    );
    let (warmup, duration) = (
        Duration::from_secs_f64(a.warmup),
        Duration::from_secs_f64(a.duration),
    );
    let hot_requests = vec![get_request(PATH, Some(HOT_KEY))];
    let other_requests: Vec<Vec<u8>> = (0..a.others.max(1))
        .map(|i| get_request(PATH, Some(&other_key(i % a.others.max(1)))))
        .collect();
    // measured[delay][run]
    let mut measured: Vec<Vec<Measured>> = a.delays.iter().map(|_| Vec::new()).collect();
    let mut disturbances = Vec::new();
    for run in 1..=a.runs {
        let watch = CpuWatch::start();
        for (d, &delay_ms) in a.delays.iter().enumerate() {
            proxy.delay(Duration::from_secs_f64(delay_ms / 1e3));
            // A breaker opened by the previous delay closes before this one is measured.
            let deadline = Instant::now() + Duration::from_secs(10);
            while gateway.metrics()?.get("tollgate_breaker_open") != Some(&0.0)
                && Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(50));
            }
            eprintln!("  run {run}/{}, delay {delay_ms} ms", a.runs);
            // Metrics are read around the measured window only: the warm-up runs first.
            let addr = gateway.addr;
            let warm = run_closed(
                addr,
                hot_requests.clone(),
                a.hot_conns,
                Duration::ZERO,
                warmup,
            )?;
            drop(warm);
            let before = gateway.metrics()?;
            let steal = a.steal.map(|s| Steal::start(gateway.child.id(), s));
            let others = {
                let (reqs, n) = (other_requests.clone(), a.others);
                std::thread::spawn(move || run_closed(addr, reqs, n, Duration::ZERO, duration))
            };
            let hot = run_closed(
                addr,
                hot_requests.clone(),
                a.hot_conns,
                Duration::ZERO,
                duration,
            )?;
            let others = if a.others > 0 {
                others
                    .join()
                    .map_err(|_| anyhow::anyhow!("the other clients' thread panicked"))??
            } else {
                let _ = others.join();
                ClosedResult::empty(duration)
            };
            drop(steal);
            let m = MetricsDelta {
                before,
                after: gateway.metrics()?,
            };
            measured[d].push(Measured {
                decisions: m.verdicts(),
                fail_open: m.decisions("fail_open"),
                timeouts: m.of("tollgate_fail_open_reasons_total{reason=\"timeout\"}"),
                breaker_skips: m.of("tollgate_fail_open_reasons_total{reason=\"breaker_open\"}"),
                opened: m.of("tollgate_breaker_opened_total"),
                calls: m.of("tollgate_store_bucket_calls_total"),
                shed: m.decisions("shed"),
                hot,
                others,
            });
        }
        disturbances.push(watch.and_then(|w| w.stop()));
    }
    drop(gateway);

    let mut header = vec!["Redis delay"];
    header.extend(FIGURES.iter().map(|f| f.1));
    let mut table = Table::new(&header);
    let mut json_rows = Vec::new();
    for (&delay_ms, runs) in a.delays.iter().zip(&measured) {
        let mut cells = vec![format!("{delay_ms} ms")];
        let mut row = json!({ "delay_ms": delay_ms, "runs": runs.len() });
        let obj = row.as_object_mut().expect("an object");
        // The fields a row had before `--runs`, each the median over the runs field by
        // field (one run: that run's own).
        let per_run: Vec<Value> = runs.iter().map(Measured::json).collect();
        if let Some(Value::Object(fields)) = per_run.first() {
            for k in fields.keys() {
                let values: Vec<f64> = per_run.iter().filter_map(|r| r[k].as_f64()).collect();
                obj.insert(k.clone(), json!(round(median(&values), 3)));
            }
        }
        let mut figures = serde_json::Map::new();
        for (name, _, worse, of, fmt) in FIGURES {
            let over = OverRuns::of(runs.iter().map(of).collect(), worse);
            cells.push(over.cell(fmt));
            // A row field of the same name is the figure's own median, unrounded first.
            if obj.contains_key(name) {
                obj.insert(name.into(), json!(round(over.median, 3)));
            }
            figures.insert(name.into(), over.json(3));
        }
        obj.insert("figures".into(), Value::Object(figures));
        obj.insert("per_run".into(), Value::Array(per_run));
        table.row(cells);
        json_rows.push(row);
    }
    let (per_run_cpu, per_run_cpu_json) = runs_disturbance(disturbances.iter().map(Option::as_ref));
    let spread = if a.runs > 1 {
        format!(
            "Each cell: the median of {} runs, and in parentheses the worst run's (per \
             column: {}). ",
            a.runs,
            FIGURES
                .iter()
                .map(|f| format!("{} {}", f.1, f.2.word()))
                .collect::<Vec<_>>()
                .join(", ")
        )
    } else {
        String::new()
    };
    let markdown = format!(
        "### slowredis: Redis replies delayed, budget {} ms, hot client at {} connections + {} others, {} workers, {} s per delay, {} run{}\n\n{}\n\
         {spread}Fail-open % is over the store's verdicts (allowed, denied, shadow-denied, \
         failed open; the hot client's and the others'), so requests shed with a `503` are \
         not in it: the 503 columns are their share of each class's answers. The delay is \
         added to every reply by a proxy, on top of its own hop. Overload settings: {}. Steal: {}. Store path: {}. {machine}.\n{per_run_cpu}",
        a.timeout_ms,
        a.hot_conns,
        a.others,
        a.workers,
        a.duration,
        a.runs,
        if a.runs == 1 { "" } else { "s" },
        table.render(),
        a.overload.describe(),
        a.steal.map_or("none emulated".into(), |s| s.describe()),
        if a.store_realtime {
            "redis-server and the proxy at real-time priority (a store the gateway's load cannot starve)"
        } else {
            "redis-server and the proxy share the cores with the gateway and the load"
        },
    );
    let json = json!({
        "scenario": "slowredis",
        "steal": a.steal.map(|s| s.describe()),
        "store_realtime": a.store_realtime,
        "timeout_ms": a.timeout_ms,
        "hot_conns": a.hot_conns,
        "others": a.others,
        "workers": a.workers,
        "duration_s": a.duration,
        "runs": a.runs,
        "overload": a.overload.json(),
        "rows_note": "a row's top-level fields are medians over its runs, field by field; \
                      `figures` gives the median and the worst run of each reported figure; \
                      `per_run` every run",
        "rows": json_rows,
        "per_run_cpu": per_run_cpu_json,
        "machine": machine,
    });
    Ok(Outcome {
        markdown,
        json,
        charts: Vec::new(),
    })
}
