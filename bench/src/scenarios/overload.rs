//! `overload`: a client at 10x the gateway's capacity (issue 31). One hot client on a plan
//! far above any rate (its limit never refuses it: it only saturates the gateway) sends
//! closed-loop on `--hot-conns` connections, about ten times the 32 that saturate two
//! workers; beside it `--others` clients on a plan with a real limit send closed-loop on
//! one connection each, as fast as their answers come, so each offers more than its limit
//! and is refused with `429`s. A gateway that copes sheds the excess (`503`) rather than
//! queueing it without bound or admitting it undecided: the others keep their contract
//! (each admitted what its bucket allows), no decision fails open, the breaker stays
//! closed, and the gateway's memory stays flat.
//!
//! Every run starts its own `redis-server` and gateway, so every bucket starts full and
//! no run inherits the previous one's queues or memory; `--runs` runs are reported as the
//! median run and the worst, never the best.

use std::collections::HashMap;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{json, Value};
use tollgate_testkit::{ClientDef, GatewayConfig, PlanDef, RedisServer};

use super::{seconds, MetricsDelta};
use crate::http::get_request;
use crate::load::{run_closed, ClosedResult};
use crate::procs::{one_unlimited_client, raise_fd_limit, Gateway, RssWatch};
use crate::report::{
    self, count, machine, median, ms, pct, round, runs_disturbance, CpuWatch, Disturbance, Outcome,
    OverRuns, Table, Worse,
};
use crate::upstream::{Server, Upstreams};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Gateway workers.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// The hot client's connections (closed loop): about 10x the 32 that saturate two
    /// workers (see `slowredis`, `throughput`).
    #[arg(long, default_value_t = 320)]
    hot_conns: usize,
    /// Other clients, one connection each, on a plan with a real limit.
    #[arg(long, default_value_t = 4)]
    others: usize,
    /// The other clients' bucket: capacity, in tokens (one per request).
    #[arg(long, default_value_t = 20.0)]
    other_capacity: f64,
    /// The other clients' bucket: rate, in tokens per second.
    #[arg(long, default_value_t = 50.0)]
    other_rate: f64,
    /// The gateway's decision budget (`redis.timeout_ms`).
    #[arg(long, default_value_t = 5)]
    timeout_ms: u64,
    /// Seconds measured per run.
    #[arg(long, default_value = "10", value_parser = seconds)]
    duration: f64,
    /// Seconds of warm-up per run, not counted: long enough for every other client to
    /// empty its bucket, so the window opens with the bucket's state known.
    #[arg(long, default_value = "2", value_parser = seconds)]
    warmup: f64,
    /// Runs, each with a gateway and a Redis of its own.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    #[command(flatten)]
    overload: OverloadSettings,
}

/// The gateway's `[overload]` settings. Each is written only when given: left out, the
/// gateway's own defaults apply, and a build that does not know the section (it refuses
/// unknown keys) can still be measured.
#[derive(Debug, Clone, clap::Args)]
pub struct OverloadSettings {
    /// `overload.max_delay_ms`: how far behind a worker may fall before it sheds.
    #[arg(long, value_name = "MS")]
    max_delay_ms: Option<u64>,
    /// `overload.max_pending`: decisions a worker may have waiting before it sheds.
    #[arg(long, value_name = "N")]
    max_pending: Option<u64>,
    /// `overload.max_wait_ms`: how long a request may wait for its decision.
    #[arg(long, value_name = "MS")]
    max_wait_ms: Option<u64>,
}

impl OverloadSettings {
    fn given(&self) -> Vec<(&'static str, u64)> {
        [
            ("max_delay_ms", self.max_delay_ms),
            ("max_pending", self.max_pending),
            ("max_wait_ms", self.max_wait_ms),
        ]
        .into_iter()
        .filter_map(|(k, v)| Some((k, v?)))
        .collect()
    }

    /// Adds the `[overload]` section to `config` when any setting was given.
    pub fn apply(&self, config: &mut GatewayConfig) {
        let given = self.given();
        if !given.is_empty() {
            config.extra.push_str("[overload]\n");
            for (k, v) in given {
                config.extra.push_str(&format!("{k} = {v}\n"));
            }
        }
    }

    /// "the gateway's defaults" or "max_pending 256, max_wait_ms 20".
    pub fn describe(&self) -> String {
        let given = self.given();
        if given.is_empty() {
            return "the gateway's defaults".into();
        }
        given
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The settings given (`{}`: the gateway's defaults).
    pub fn json(&self) -> Value {
        Value::Object(
            self.given()
                .into_iter()
                .map(|(k, v)| (k.to_string(), json!(v)))
                .collect(),
        )
    }
}

const PATH: &str = "/api/items/42";
const HOT_KEY: &str = "bench-overload-hot-0";
/// The gateway's resident set is sampled this often.
const RSS_EVERY: Duration = Duration::from_millis(500);
/// How long a scrape of the loaded gateway may take (it may shed it too).
const SCRAPE_WITHIN: Duration = Duration::from_secs(5);

fn other_key(i: usize) -> String {
    format!("bench-overload-other-{i}")
}

/// One other client's window, against what its bucket allows.
struct OtherClient {
    result: ClosedResult,
    /// `rate x window`: what the bucket allows over the window if it was empty when the
    /// window opened.
    expected: f64,
    /// Tokens the bucket may still have held when the window opened: under one at the
    /// warm-up's last `429`, refilled at `rate` since (at most `capacity`); `capacity` when
    /// the warm-up saw no `429` (the bucket's state unknown).
    slack: f64,
}

impl OtherClient {
    fn new(result: ClosedResult, capacity: f64, rate: f64) -> OtherClient {
        let slack = result.last_429_before_window.map_or(capacity, |gap| {
            (1.0 + rate * gap.as_secs_f64()).min(capacity)
        });
        OtherClient {
            expected: rate * result.window.as_secs_f64(),
            slack,
            result,
        }
    }

    fn admitted(&self) -> u64 {
        self.result.statuses.of(200)
    }

    /// `admitted / expected - 1`, in %.
    fn accuracy_pct(&self) -> f64 {
        (self.admitted() as f64 / self.expected - 1.0) * 100.0
    }

    fn json(&self, i: usize) -> Value {
        let s = &self.result.statuses;
        json!({
            "client": format!("overload-other-{i}"),
            "answers": self.result.completed,
            "admitted": self.admitted(),
            "limited": s.of(429),
            "shed": s.of(503),
            "other": s.other_than(&[200, 429, 503]),
            "errors": self.result.errors,
            "warmup_limited": self.result.warmup_statuses.of(429),
            "expected": round(self.expected, 2),
            "slack_tokens": round(self.slack, 2),
            "accuracy_pct": round(self.accuracy_pct(), 3),
        })
    }
}

/// One run's figures.
struct Run {
    hot: ClosedResult,
    /// The other clients as one class.
    others: ClosedResult,
    other_clients: Vec<OtherClient>,
    metrics: MetricsDelta,
    /// A scrape half-way through the window, for the gauges (`None`: it failed).
    mid: Option<HashMap<String, f64>>,
    rss_kib: Vec<u64>,
    disturbance: Option<Disturbance>,
}

impl Run {
    fn pending_mid(&self) -> f64 {
        self.mid
            .as_ref()
            .and_then(|m| m.get("tollgate_pending_decisions").copied())
            .unwrap_or(0.0)
    }

    /// The most any worker was behind, half-way through the window, in ms.
    fn worker_delay_mid_ms(&self) -> f64 {
        self.mid.as_ref().map_or(0.0, |m| {
            m.iter()
                .filter(|(k, _)| k.starts_with("tollgate_worker_delay_seconds{"))
                .map(|(_, v)| v * 1e3)
                .fold(0.0, f64::max)
        })
    }

    fn rss_mib(&self, pick: fn(&[u64]) -> Option<u64>) -> f64 {
        pick(&self.rss_kib).unwrap_or(0) as f64 / 1024.0
    }

    fn json(&self) -> Value {
        let class = |r: &ClosedResult| {
            json!({
                "rps": round(r.rate(), 1),
                "answers": r.completed,
                "ok": r.statuses.of(200),
                "limited": r.statuses.of(429),
                "shed": r.statuses.of(503),
                "other": r.statuses.other_than(&[200, 429, 503]),
                "errors": r.errors,
                "p50_ms": round(crate::load::percentile(&r.latencies_ns, 0.50) as f64 / 1e6, 3),
                "p99_ms": round(r.p99_ms(), 3),
                "max_ms": round(r.latencies_ns.last().copied().unwrap_or(0) as f64 / 1e6, 3),
            })
        };
        let m = &self.metrics;
        let mut decisions = serde_json::Map::new();
        for o in [
            "allowed",
            "denied",
            "shadow_denied",
            "fail_open",
            "shed",
            "safety_denied",
            "unknown_key",
        ] {
            decisions.insert(o.into(), json!(m.decisions(o)));
        }
        json!({
            "hot": class(&self.hot),
            "others": class(&self.others),
            "other_clients": self
                .other_clients
                .iter()
                .enumerate()
                .map(|(i, c)| c.json(i))
                .collect::<Vec<_>>(),
            "decisions": decisions,
            "fail_open_timeout": m.of("tollgate_fail_open_reasons_total{reason=\"timeout\"}"),
            "fail_open_breaker_open": m.of("tollgate_fail_open_reasons_total{reason=\"breaker_open\"}"),
            "breaker_opened": m.of("tollgate_breaker_opened_total"),
            "shed_overloaded": m.shed("overloaded"),
            "shed_decision_wait": m.shed("decision_wait"),
            "pending_decisions_mid": self.mid.as_ref().map(|_| self.pending_mid()),
            "worker_delay_mid_ms": self.mid.as_ref().map(|_| round(self.worker_delay_mid_ms(), 3)),
            "rss_kib": self.rss_kib,
            "cpu": self.disturbance.as_ref().map(Disturbance::json),
        })
    }
}

type Figure = report::Figure<Run>;

fn mib(v: f64) -> String {
    format!("{v:.1}")
}

const FIGURES: [Figure; 23] = [
    (
        "hot_rps",
        "hot client: answers/s",
        Worse::Lower,
        |r| r.hot.rate(),
        count,
    ),
    (
        "hot_ok_pct",
        "hot client: 200 %",
        Worse::Lower,
        |r| r.hot.statuses.pct(200),
        pct,
    ),
    (
        "hot_limited_pct",
        "hot client: 429 %",
        Worse::Higher,
        |r| r.hot.statuses.pct(429),
        pct,
    ),
    (
        "hot_shed_pct",
        "hot client: 503 %",
        Worse::Higher,
        |r| r.hot.statuses.pct(503),
        pct,
    ),
    (
        "hot_other_pct",
        "hot client: other status %",
        Worse::Higher,
        |r| other_pct(&r.hot),
        pct,
    ),
    (
        "hot_p99_ms",
        "hot client: p99 ms",
        Worse::Higher,
        |r| r.hot.p99_ms(),
        ms,
    ),
    (
        "others_rps",
        "others (all): answers/s",
        Worse::Lower,
        |r| r.others.rate(),
        count,
    ),
    (
        "others_ok_pct",
        "others: 200 %",
        Worse::Lower,
        |r| r.others.statuses.pct(200),
        pct,
    ),
    (
        "others_limited_pct",
        "others: 429 %",
        Worse::Higher,
        |r| r.others.statuses.pct(429),
        pct,
    ),
    (
        "others_shed_pct",
        "others: 503 %",
        Worse::Higher,
        |r| r.others.statuses.pct(503),
        pct,
    ),
    (
        "others_other_pct",
        "others: other status %",
        Worse::Higher,
        |r| other_pct(&r.others),
        pct,
    ),
    (
        "others_p99_ms",
        "others: p99 ms",
        Worse::Higher,
        |r| r.others.p99_ms(),
        ms,
    ),
    (
        "connection_errors",
        "connection errors (all clients)",
        Worse::Higher,
        |r| (r.hot.errors + r.others.errors) as f64,
        count,
    ),
    (
        "fail_open",
        "fail-open decisions",
        Worse::Higher,
        |r| r.metrics.decisions("fail_open"),
        count,
    ),
    (
        "fail_open_pct",
        "fail-open % of verdicts",
        Worse::Higher,
        |r| 100.0 * r.metrics.decisions("fail_open") / r.metrics.verdicts().max(1.0),
        pct,
    ),
    (
        "breaker_opened",
        "breaker openings",
        Worse::Higher,
        |r| r.metrics.of("tollgate_breaker_opened_total"),
        count,
    ),
    (
        "shed_overloaded",
        "shed, worker overloaded (metrics)",
        Worse::Higher,
        |r| r.metrics.shed("overloaded"),
        count,
    ),
    (
        "shed_decision_wait",
        "shed, decision wait (metrics)",
        Worse::Higher,
        |r| r.metrics.shed("decision_wait"),
        count,
    ),
    (
        "pending_decisions_mid",
        "pending decisions, mid-window",
        Worse::Higher,
        Run::pending_mid,
        count,
    ),
    (
        "worker_delay_mid_ms",
        "most delayed worker, mid-window ms",
        Worse::Higher,
        Run::worker_delay_mid_ms,
        ms,
    ),
    (
        "rss_start_mib",
        "gateway RSS MiB: start",
        Worse::Higher,
        |r| r.rss_mib(|k| k.first().copied()),
        mib,
    ),
    (
        "rss_max_mib",
        "gateway RSS MiB: max",
        Worse::Higher,
        |r| r.rss_mib(|k| k.iter().copied().max()),
        mib,
    ),
    (
        "rss_end_mib",
        "gateway RSS MiB: end",
        Worse::Higher,
        |r| r.rss_mib(|k| k.last().copied()),
        mib,
    ),
];

fn other_pct(r: &ClosedResult) -> f64 {
    100.0 * r.statuses.other_than(&[200, 429, 503]) as f64 / r.statuses.total().max(1) as f64
}

pub fn run(a: &Args) -> anyhow::Result<Outcome> {
    anyhow::ensure!(a.runs >= 1, "--runs must be at least 1");
    anyhow::ensure!(
        a.other_rate > 0.0 && a.other_capacity >= 1.0,
        "--other-rate must be above 0 and --other-capacity at least 1"
    );
    raise_fd_limit();
    let machine = machine();
    let upstream = Upstreams::start(vec![Server::Fast(Default::default())])?;
    eprintln!(
        "overload: hot client at {} connections + {} others on {} tokens + {}/s, {} workers, \
         budget {} ms, {} runs of {} s, {} ({machine})",
        a.hot_conns,
        a.others,
        a.other_capacity,
        a.other_rate,
        a.workers,
        a.timeout_ms,
        a.runs,
        a.duration,
        a.overload.describe()
    );
    let mut runs = Vec::new();
    for run in 1..=a.runs {
        eprintln!("  run {run}/{}", a.runs);
        runs.push(one_run(a, upstream.urls())?);
    }

    let mut table = Table::new(&["", "median", "worst run"]);
    let mut figures = serde_json::Map::new();
    for (name, label, worse, of, fmt) in FIGURES {
        let over = OverRuns::of(runs.iter().map(of).collect(), worse);
        table.row(vec![
            label.into(),
            fmt(over.median),
            format!("{} ({})", fmt(over.worst), worse.word()),
        ]);
        figures.insert(name.into(), over.json(3));
    }
    let mut clients = Table::new(&[
        "other client",
        "admitted (median)",
        "expected: rate x window",
        "tokens at the window's start, at most",
        "429 (median)",
        "503 (median)",
        "accuracy (median)",
        "accuracy (worst run)",
    ]);
    let mut clients_json = Vec::new();
    for i in 0..a.others {
        let of = |f: fn(&OtherClient) -> f64| -> Vec<f64> {
            runs.iter().map(|r| f(&r.other_clients[i])).collect()
        };
        let accuracy = OverRuns::of(of(OtherClient::accuracy_pct), Worse::FartherFromZero);
        let slack = of(|c| c.slack).into_iter().fold(0.0, f64::max);
        let expected = runs[0].other_clients[i].expected;
        clients.row(vec![
            format!("overload-other-{i}"),
            format!("{:.0}", median(&of(|c| c.admitted() as f64))),
            format!("{expected:.0}"),
            format!("{slack:.1}"),
            format!("{:.0}", median(&of(|c| c.result.statuses.of(429) as f64))),
            format!("{:.0}", median(&of(|c| c.result.statuses.of(503) as f64))),
            format!("{:+.2}%", accuracy.median),
            format!("{:+.2}%", accuracy.worst),
        ]);
        clients_json.push(json!({
            "client": format!("overload-other-{i}"),
            "expected": round(expected, 2),
            "slack_tokens_max": round(slack, 2),
            "accuracy_pct": accuracy.json(3),
        }));
    }
    let (per_run_cpu, per_run_cpu_json) =
        runs_disturbance(runs.iter().map(|r| r.disturbance.as_ref()));
    let markdown = format!(
        "### overload: one client at {} connections (about 10x what saturates {} workers) + {} others on {} tokens + {}/s, {} run{} of {} s\n\n{}\n\
         Worst run: per row, the run with the value named. Statuses are shares of each \
         class's answers in the window; `503` is what an overloaded gateway sheds. Fail-open % \
         is over the store's verdicts (allowed, denied, shadow-denied, failed open); shed \
         requests are not verdicts. RSS sampled every {} ms from the run's start (idle \
         gateway) to the window's end.\n\n{}\n\
         Expected is what the bucket allows over the {} s window if it was empty when the \
         window opened: rate x window. The warm-up ran each client past its limit, so its \
         bucket held under one token at its last `429` before the window and at most 1 + \
         rate x the time since when the window opened (the column before 429, the largest \
         over the runs; the capacity where the warm-up saw no `429`). A correct limiter \
         admits between expected and expected + that, in the window (answers counted by \
         when they completed), and less only if the client's requests that reached a \
         decision (the shed ones do not) fell below its rate. Accuracy = admitted / \
         expected - 1; its worst run is the one farthest from 0.\n\n\
         Decision budget {} ms; overload settings: {}. {machine}.\n{per_run_cpu}",
        a.hot_conns,
        a.workers,
        a.others,
        a.other_capacity,
        a.other_rate,
        a.runs,
        if a.runs == 1 { "" } else { "s" },
        a.duration,
        table.render(),
        RSS_EVERY.as_millis(),
        clients.render(),
        a.duration,
        a.timeout_ms,
        a.overload.describe(),
    );
    let json = json!({
        "scenario": "overload",
        "workers": a.workers,
        "hot_conns": a.hot_conns,
        "others": a.others,
        "other_capacity": a.other_capacity,
        "other_rate": a.other_rate,
        "timeout_ms": a.timeout_ms,
        "duration_s": a.duration,
        "warmup_s": a.warmup,
        "runs": a.runs,
        "overload": a.overload.json(),
        "expected_note": "expected = other_rate x duration (the bucket empty when the window \
                          opened); slack_tokens: what it may still have held then",
        "figures": figures,
        "other_clients": clients_json,
        "per_run": runs.iter().map(Run::json).collect::<Vec<_>>(),
        "per_run_cpu": per_run_cpu_json,
        "machine": machine,
    });
    Ok(Outcome {
        markdown,
        json,
        charts: Vec::new(),
    })
}

/// One run: a fresh Redis and gateway, every client started at once, the warm-up, then
/// the window, with `/metrics` read as it opens, half-way through and after it.
fn one_run(a: &Args, upstreams: Vec<String>) -> anyhow::Result<Run> {
    // A Redis of its own: every bucket starts full, whatever the previous run left.
    let redis = RedisServer::start()?;
    let mut config = one_unlimited_client(Some(redis.url()), upstreams, "overload-hot", HOT_KEY);
    config.workers = a.workers;
    config.timeout_ms = Some(a.timeout_ms);
    a.overload.apply(&mut config);
    config.plans.push(PlanDef {
        name: "limited".into(),
        capacity: a.other_capacity,
        rate: a.other_rate,
    });
    for i in 0..a.others {
        config.clients.push(ClientDef {
            id: format!("overload-other-{i}"),
            plan: "limited".into(),
            key: other_key(i),
        });
    }
    let gateway = Gateway::start(&config, PATH)?;
    let addr = gateway.addr;
    let (warmup, duration) = (
        Duration::from_secs_f64(a.warmup),
        Duration::from_secs_f64(a.duration),
    );
    let watch = CpuWatch::start();
    let rss = RssWatch::start(gateway.child.id(), RSS_EVERY);
    let started = Instant::now();
    let spawn =
        |requests: Vec<Vec<u8>>, conns: usize| -> JoinHandle<anyhow::Result<ClosedResult>> {
            std::thread::spawn(move || run_closed(addr, requests, conns, warmup, duration))
        };
    let hot = spawn(vec![get_request(PATH, Some(HOT_KEY))], a.hot_conns);
    // One load thread per other client: a closed loop's connections take its requests in
    // turn, so clients sharing one would each be counted on the others' connections.
    let others: Vec<_> = (0..a.others)
        .map(|i| spawn(vec![get_request(PATH, Some(&other_key(i)))], 1))
        .collect();
    sleep_until(started + warmup);
    let before = gateway.metrics_within(SCRAPE_WITHIN);
    sleep_until(started + warmup + duration / 2);
    let mid = gateway.metrics_within(SCRAPE_WITHIN).ok();
    let join = |t: JoinHandle<anyhow::Result<ClosedResult>>| {
        t.join()
            .map_err(|_| anyhow::anyhow!("a load thread panicked"))?
    };
    let hot = join(hot)?;
    let others = others
        .into_iter()
        .map(join)
        .collect::<anyhow::Result<Vec<_>>>()?;
    let after = gateway.metrics_within(SCRAPE_WITHIN)?;
    let rss_kib = rss.stop();
    let disturbance = watch.and_then(|w| w.stop());
    drop(gateway);
    Ok(Run {
        hot,
        others: ClosedResult::combined(&others, duration),
        other_clients: others
            .into_iter()
            .map(|r| OtherClient::new(r, a.other_capacity, a.other_rate))
            .collect(),
        metrics: MetricsDelta {
            before: before.context("reading /metrics as the window opened")?,
            after,
        },
        mid,
        rss_kib,
        disturbance,
    })
}

fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        std::thread::sleep(t - now);
    }
}
