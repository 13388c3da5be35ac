//! `slowredis`: what a slow (not stalled) Redis costs. A fault-injecting proxy
//! (`tollgate-testkit`'s `FaultProxy`) between the gateway and `redis-server` delays every
//! reply by each of `--delays` in turn, while one hot client sends at `--hot-conns`
//! connections (closed loop, one bucket) and a few other clients at one connection each.
//! Per delay: the share of decisions that failed open, how often the breaker opened,
//! requests/s and p99. A Redis that answers within the budget should cost latency, not
//! limiting: no fail-opens, and never an open breaker.

use std::time::{Duration, Instant};

use serde_json::json;
use tollgate_testkit::{ClientDef, FaultProxy, PlanDef, RedisServer};

use super::seconds;
use crate::http::get_request;
use crate::load::{percentile, run_closed, ClosedResult};
use crate::procs::{one_unlimited_client, raise_fd_limit, Gateway};
use crate::report::{machine, ms, round, Outcome, Table};
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
}

const PATH: &str = "/api/items/42";
const HOT_KEY: &str = "bench-slowredis-hot-0";

fn other_key(i: usize) -> String {
    format!("bench-slowredis-other-{i}")
}

/// One delay's figures.
struct Row {
    delay_ms: f64,
    decisions: f64,
    fail_open: f64,
    timeouts: f64,
    breaker_skips: f64,
    opened: f64,
    hot: ClosedResult,
    others: ClosedResult,
    calls: f64,
}

pub fn run(a: &Args) -> anyhow::Result<Outcome> {
    raise_fd_limit();
    let machine = machine();
    let redis = RedisServer::start()?;
    let proxy = FaultProxy::start(([127, 0, 0, 1], redis.port).into());
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
        "slowredis: delays {:?} ms, budget {} ms, hot client at {} connections + {} others, {} workers ({machine})",
        a.delays, a.timeout_ms, a.hot_conns, a.others, a.workers
    );
    let (warmup, duration) = (
        Duration::from_secs_f64(a.warmup),
        Duration::from_secs_f64(a.duration),
    );
    let hot_requests = vec![get_request(PATH, Some(HOT_KEY))];
    let other_requests: Vec<Vec<u8>> = (0..a.others.max(1))
        .map(|i| get_request(PATH, Some(&other_key(i % a.others.max(1)))))
        .collect();
    let mut rows = Vec::new();
    for &delay_ms in &a.delays {
        proxy.delay(Duration::from_secs_f64(delay_ms / 1e3));
        // A breaker opened by the previous delay closes before this one is measured.
        let deadline = Instant::now() + Duration::from_secs(10);
        while gateway.metrics()?.get("tollgate_breaker_open") != Some(&0.0)
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!("  delay {delay_ms} ms");
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
            ClosedResult {
                completed: 0,
                non_2xx: 0,
                errors: 0,
                window: duration,
                latencies_ns: Vec::new(),
                cpu_s: None,
            }
        };
        let after = gateway.metrics()?;
        let delta =
            |k: &str| after.get(k).copied().unwrap_or(0.0) - before.get(k).copied().unwrap_or(0.0);
        let decisions = ["allowed", "denied", "shadow_denied", "fail_open"]
            .iter()
            .map(|o| delta(&format!("tollgate_decisions_total{{outcome=\"{o}\"}}")))
            .sum();
        rows.push(Row {
            delay_ms,
            decisions,
            fail_open: delta("tollgate_decisions_total{outcome=\"fail_open\"}"),
            timeouts: delta("tollgate_fail_open_reasons_total{reason=\"timeout\"}"),
            breaker_skips: delta("tollgate_fail_open_reasons_total{reason=\"breaker_open\"}"),
            opened: delta("tollgate_breaker_opened_total"),
            calls: delta("tollgate_store_bucket_calls_total"),
            hot,
            others,
        });
    }
    drop(gateway);

    let mut table = Table::new(&[
        "Redis delay",
        "decisions",
        "fail-open %",
        "breaker opens",
        "hot req/s",
        "hot p99 ms",
        "others req/s",
        "others p99 ms",
        "decisions per script call",
    ]);
    let mut json_rows = Vec::new();
    let p99 = |r: &ClosedResult| percentile(&r.latencies_ns, 0.99) as f64 / 1e6;
    for r in &rows {
        let pct = 100.0 * r.fail_open / r.decisions.max(1.0);
        let per_call = r.decisions / r.calls.max(1.0);
        table.row(vec![
            format!("{} ms", r.delay_ms),
            format!("{:.0}", r.decisions),
            format!("{pct:.2}%"),
            format!("{:.0}", r.opened),
            format!("{:.0}", r.hot.rate()),
            ms(p99(&r.hot)),
            format!("{:.0}", r.others.rate()),
            ms(p99(&r.others)),
            format!("{per_call:.1}"),
        ]);
        json_rows.push(json!({
            "delay_ms": r.delay_ms,
            "decisions": r.decisions,
            "fail_open": r.fail_open,
            "fail_open_timeout": r.timeouts,
            "fail_open_breaker_open": r.breaker_skips,
            "fail_open_pct": round(pct, 3),
            "breaker_opened": r.opened,
            "hot_rps": round(r.hot.rate(), 0),
            "hot_p99_ms": round(p99(&r.hot), 3),
            "hot_non_2xx": r.hot.non_2xx,
            "others_rps": round(r.others.rate(), 0),
            "others_p99_ms": round(p99(&r.others), 3),
            "script_calls": r.calls,
        }));
    }
    let markdown = format!(
        "### slowredis: Redis replies delayed, budget {} ms, hot client at {} connections + {} others, {} workers, {} s per delay\n\n{}\n\
         Fail-open % is over all decisions (the hot client's and the others'); the delay is \
         added to every reply by a proxy, on top of its own hop. {machine}.\n",
        a.timeout_ms,
        a.hot_conns,
        a.others,
        a.workers,
        a.duration,
        table.render()
    );
    let json = json!({
        "scenario": "slowredis",
        "timeout_ms": a.timeout_ms,
        "hot_conns": a.hot_conns,
        "others": a.others,
        "workers": a.workers,
        "duration_s": a.duration,
        "rows": json_rows,
        "machine": machine,
    });
    Ok(Outcome {
        markdown,
        json,
        charts: Vec::new(),
    })
}
