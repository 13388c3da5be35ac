//! `failopen`: what a stalled Redis costs. Open-loop load through the gateway; partway
//! through, Redis is frozen with SIGSTOP (its sockets stay open and nothing answers, the
//! worst case: no error, only silence), later thawed with SIGCONT. Until the breaker
//! opens, requests wait the full `redis.timeout_ms` and fail open; once it is open they
//! fail open at once, so the stall should cost only its first few requests.

use std::time::Duration;

use serde_json::json;
use tollgate_testkit::RedisServer;

use super::{seconds, summary_json};
use crate::http::get_request;
use crate::load::{OpenRun, Sample, Stream, Summary};
use crate::procs::{one_unlimited_client, raise_fd_limit, Gateway};
use crate::report::{machine, ms, round, Outcome, Table};
use crate::svg;
use crate::upstream::{Server, Upstreams};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Requests per second.
    #[arg(long, default_value_t = 1000.0)]
    rate: f64,
    /// Seconds of warm-up, not counted.
    #[arg(long, default_value = "2", value_parser = seconds)]
    warmup: f64,
    /// Seconds measured with Redis healthy, before the stall.
    #[arg(long, default_value = "3", value_parser = seconds)]
    healthy: f64,
    /// Seconds Redis stays stalled.
    #[arg(long, default_value = "5", value_parser = seconds)]
    stall: f64,
    /// Seconds measured after Redis is thawed.
    #[arg(long, default_value = "3", value_parser = seconds)]
    recover: f64,
    /// The gateway's decision budget (`redis.timeout_ms`).
    #[arg(long, default_value_t = 5)]
    timeout_ms: u64,
}

const PATH: &str = "/api/items/42";
const KEY: &str = "bench-failopen-key-1";
/// The stall's first moments, in which the breaker opens (after 3 failures).
const OPENING: Duration = Duration::from_millis(50);

pub fn run(a: &Args) -> anyhow::Result<Outcome> {
    raise_fd_limit();
    let machine = machine();
    let redis = RedisServer::start()?;
    let upstream = Upstreams::start(vec![Server::Fast(Default::default())])?;
    let mut config =
        one_unlimited_client(Some(redis.url()), upstream.urls(), "failopen-client", KEY);
    config.timeout_ms = Some(a.timeout_ms);
    let gateway = Gateway::start(&config, PATH)?;
    let stall_at = Duration::from_secs_f64(a.warmup + a.healthy);
    let resume_at = stall_at + Duration::from_secs_f64(a.stall);
    let end = resume_at + Duration::from_secs_f64(a.recover);
    eprintln!(
        "failopen: {} req/s; Redis stalled (SIGSTOP) from {:.1} s to {:.1} s, budget {} ms ({machine})",
        a.rate,
        stall_at.as_secs_f64(),
        resume_at.as_secs_f64(),
        a.timeout_ms
    );
    let before = gateway.metrics()?;
    let run = OpenRun::start(vec![Stream {
        addr: gateway.addr,
        requests: vec![get_request(PATH, Some(KEY))],
        rate: a.rate,
        arrivals: crate::load::Arrivals::Uniform,
        from: Duration::ZERO,
        until: end,
    }]);
    run.sleep_until(stall_at);
    let stall_t = run.start.elapsed();
    redis.stall()?;
    run.sleep_until(resume_at);
    let resume_t = run.start.elapsed();
    redis.resume()?;
    let result = run.join()?;
    let after = gateway.metrics()?;
    let delta =
        |k: &str| after.get(k).copied().unwrap_or(0.0) - before.get(k).copied().unwrap_or(0.0);

    let samples = &result.samples[0];
    let window = |from: Duration, to: Duration| -> Vec<Sample> {
        samples
            .iter()
            .filter(|s| s.at >= from && s.at < to)
            .copied()
            .collect()
    };
    let warm = Duration::from_secs_f64(a.warmup);
    let phases = [
        ("healthy", window(warm, stall_t)),
        (
            "stalled, breaker opening (first 50 ms)",
            window(stall_t, stall_t + OPENING),
        ),
        ("stalled, breaker open", window(stall_t + OPENING, resume_t)),
        ("after SIGCONT", window(resume_t, end)),
    ];
    let budget = Duration::from_millis(a.timeout_ms);
    let mut table = Table::new(&[
        "phase",
        "requests",
        "non-200",
        "took ≥ budget",
        "p50 ms",
        "p99 ms",
        "p99.9 ms",
        "max ms",
    ]);
    let mut json_phases = Vec::new();
    for (name, s) in &phases {
        let sum = Summary::of(s);
        let waited = s.iter().filter(|x| x.latency >= budget).count();
        let non_200 = s.iter().filter(|x| x.status != 200).count();
        table.row(vec![
            name.to_string(),
            sum.count.to_string(),
            non_200.to_string(),
            waited.to_string(),
            ms(sum.p50_ms),
            ms(sum.p99_ms),
            ms(sum.p999_ms),
            ms(sum.max_ms),
        ]);
        let mut j = summary_json(&sum);
        j["name"] = json!(name);
        j["non_200"] = json!(non_200);
        j["waited_budget"] = json!(waited);
        json_phases.push(j);
    }
    let timeouts = delta("tollgate_fail_open_reasons_total{reason=\"timeout\"}");
    let breaker_open = delta("tollgate_fail_open_reasons_total{reason=\"breaker_open\"}");
    let fail_open = delta("tollgate_fail_open_total");
    let opened = delta("tollgate_breaker_opened_total");
    let healthy = Summary::of(&phases[0].1);
    let open = Summary::of(&phases[2].1);
    let markdown = format!(
        "### failopen: {} req/s, Redis stalled for {} s, budget {} ms\n\n{}\n\
         Fail-opens: {fail_open} ({timeouts} after waiting the budget, {breaker_open} at once with the \
         breaker open); the breaker opened {opened} time(s). p99 with the breaker open minus healthy p99: \
         **{:+.3} ms**. {machine}.\n",
        a.rate,
        a.stall,
        a.timeout_ms,
        table.render(),
        open.p99_ms - healthy.p99_ms
    );
    let json = json!({
        "scenario": "failopen",
        "rate": a.rate,
        "timeout_ms": a.timeout_ms,
        "stall_s": a.stall,
        "phases": json_phases,
        "fail_open": fail_open,
        "fail_open_timeout": timeouts,
        "fail_open_breaker_open": breaker_open,
        "breaker_opened": opened,
        "healthy_p99_ms": round(healthy.p99_ms, 3),
        "breaker_open_p99_ms": round(open.p99_ms, 3),
        "machine": machine,
    });

    // Timeline: the slowest request of every 20 ms, so the chart stays small.
    let bucket = Duration::from_millis(20);
    let mut worst: std::collections::BTreeMap<u128, f64> = Default::default();
    for s in samples.iter().filter(|s| s.at >= warm) {
        let k = (s.at - warm).as_millis() / bucket.as_millis();
        let v = s.latency.as_secs_f64() * 1e3;
        let e = worst.entry(k).or_insert(0.0);
        *e = e.max(v);
    }
    let points: Vec<(f64, f64)> = worst
        .iter()
        .map(|(k, v)| (*k as f64 * bucket.as_secs_f64(), *v))
        .collect();
    let span = (end - warm).as_secs_f64();
    let ticks = (0..=span.floor() as usize)
        .map(|t| (t as f64, format!("{t}")))
        .collect();
    let chart = svg::Plot {
        title: "Latency through tollgate while Redis is stalled",
        subtitle: &format!(
            "{} req/s; slowest request per 20 ms; budget {} ms; breaker opens after 3 failures",
            a.rate, a.timeout_ms
        ),
        x_label: "seconds",
        y_label: "latency (ms, log scale)",
        x_ticks: ticks,
        x_max: span,
        log_y: true,
        markers: vec![
            ((stall_t - warm).as_secs_f64(), "SIGSTOP".into()),
            ((resume_t - warm).as_secs_f64(), "SIGCONT".into()),
        ],
    }
    .render(&[svg::Series {
        name: "slowest per 20 ms",
        color: svg::RED,
        points,
        dots: true,
    }]);
    Ok(Outcome {
        markdown,
        json,
        charts: vec![("failopen-timeline.svg".into(), chart)],
    })
}
