//! `plans`: what a plan of three limits costs next to a plan of one (issue 13).
//!
//! Three parts, each against its baselines in the same run:
//! - **cost**: the same open-loop load (fixed rate, latency from the intended send time)
//!   goes, in alternating slices, to the upstream directly, to the bare actix-web + awc
//!   floor proxy, to a gateway whose client has a plan of one bucket, and to a gateway
//!   whose client has a plan of three limits (two buckets and a calendar-month quota, all
//!   applying to every request, none ever refusing). Each gateway has a `redis-server` of
//!   its own, so Redis' counters (`INFO commandstats`, `INFO cpu`) belong to one plan:
//!   Redis calls per request, the time inside the script per call, and Redis' CPU per
//!   decision.
//! - **redis**: Redis alone, kept busy by the gateway's own store code (`Buckets::take`)
//!   with many takes in flight for distinct clients: the same two figures when Redis is
//!   saturated rather than woken once per request.
//! - **accuracy**: one client offers 9x the rate of the limit meant to bind, through N
//!   gateways x S services x R replicas (as `accuracy`), once per case: the one-bucket
//!   plan, then a three-limit plan where the first bucket, the second bucket, and the
//!   quota in turn is the binding one (the other two hold three times what the binding
//!   one can admit in the run). Admitted is compared with the binding limit's allowance
//!   (a bucket: capacity + rate x T; a quota: its amount), and the quota's count in Redis
//!   with the admitted requests (a refused request spends from no limit).

use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tollgate::domain::{Applied, Bucket, Limit, LimitSpec, Limits, Period};
use tollgate_testkit::{ClientDef, GatewayConfig, PlanDef, RedisServer};

use super::accuracy::{metric_sum, Fleet, Topology};
use super::takes::{client_key, Draw, Driver, RedisSpent};
use super::{seconds, summary_json};
use crate::http::get_request;
use crate::load::{sorted_ns, Arrivals, OpenRun, Sample, Stream, Summary};
use crate::procs::{one_unlimited_client, raise_fd_limit, Floor, Gateway};
use crate::report::{machine, ms, round, Outcome, Table};
use crate::svg;
use crate::upstream::{Server, Upstreams};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Run one part only (default: all three, in this order: cost, redis, accuracy).
    #[arg(long, value_enum)]
    only: Option<Part>,
    /// Cost: requests per second, on each target.
    #[arg(long, default_value_t = 1000.0)]
    rate: f64,
    /// Cost: seconds measured on each target, after the warm-up.
    #[arg(long, default_value = "20", value_parser = seconds)]
    duration: f64,
    /// Cost: seconds of warm-up on each target, not counted.
    #[arg(long, default_value = "2", value_parser = seconds)]
    warmup: f64,
    /// Cost: seconds per alternation slice. Four targets take turns, so a target idles
    /// three slices: keep that under the gateway's 5 s keep-alive.
    #[arg(long, default_value = "1", value_parser = seconds)]
    slice: f64,
    /// Cost: gateway (and floor proxy) worker threads.
    #[arg(long, default_value_t = 1)]
    gateway_workers: usize,
    /// The gateways' decision budget (`redis.timeout_ms`); past it a request fails open.
    #[arg(long, default_value_t = 5)]
    timeout_ms: u64,
    /// Redis part: seconds per plan per round (two rounds, alternating 1 limit and 3).
    #[arg(long, default_value = "3", value_parser = seconds)]
    redis_seconds: f64,
    /// Redis part: takes in flight at once, each for a client of its own (so none
    /// coalesce).
    #[arg(long, default_value_t = 64)]
    redis_concurrency: usize,
    #[command(flatten)]
    topology: Topology,
    /// Accuracy: seconds the client sends for, per case.
    #[arg(long, default_value = "10", value_parser = seconds)]
    accuracy_duration: f64,
    /// Accuracy: the binding bucket's capacity (tokens).
    #[arg(long, default_value_t = 100.0)]
    capacity: f64,
    /// Accuracy: the binding bucket's rate (tokens per second); the binding quota is this
    /// rate times `--accuracy-duration`.
    #[arg(long, default_value_t = 100.0)]
    limit_rate: f64,
    /// Accuracy: offered load as a multiple of the binding limit's rate.
    #[arg(long, default_value_t = 9.0)]
    multiplier: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Part {
    Cost,
    Redis,
    Accuracy,
}

pub fn run(a: &Args) -> anyhow::Result<Outcome> {
    raise_fd_limit();
    let mut markdown = String::new();
    let mut json = serde_json::Map::new();
    json.insert("scenario".into(), "plans".into());
    let mut charts = Vec::new();
    let runs = |part: Part| a.only.is_none_or(|only| only == part);
    if runs(Part::Cost) {
        let (md, j, chart) = cost(a)?;
        markdown.push_str(&md);
        json.insert("cost".into(), j);
        charts.push(("plans-percentiles.svg".to_string(), chart));
    }
    if runs(Part::Redis) {
        if !markdown.is_empty() {
            markdown.push('\n');
        }
        let (md, j) = saturated(a)?;
        markdown.push_str(&md);
        json.insert("redis".into(), j);
    }
    if runs(Part::Accuracy) {
        if !markdown.is_empty() {
            markdown.push('\n');
        }
        let (md, j) = accuracy(a)?;
        markdown.push_str(&md);
        json.insert("accuracy".into(), j);
    }
    Ok(Outcome {
        markdown,
        json: Value::Object(json),
        charts,
    })
}

/// One limit of a plan, as the bench writes it.
#[derive(Debug, Clone, Copy)]
struct Lim {
    name: &'static str,
    kind: Kind,
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Bucket {
        capacity: f64,
        rate: f64,
    },
    /// Per calendar month, UTC (the defaults for `reset` and `time_zone`).
    Quota {
        amount: f64,
    },
}

impl Lim {
    fn bucket(name: &'static str, capacity: f64, rate: f64) -> Lim {
        Lim {
            name,
            kind: Kind::Bucket { capacity, rate },
        }
    }

    fn monthly(name: &'static str, amount: f64) -> Lim {
        Lim {
            name,
            kind: Kind::Quota { amount },
        }
    }

    fn toml(&self) -> String {
        match self.kind {
            Kind::Bucket { capacity, rate } => format!(
                "{{ name = {:?}, capacity = {capacity:?}, rate = {rate:?} }}",
                self.name
            ),
            Kind::Quota { amount } => format!(
                "{{ name = {:?}, quota = {amount:?}, period = \"month\" }}",
                self.name
            ),
        }
    }

    /// `burst 100 @ 100/s`, `monthly 1e12 / month`.
    fn describe(&self) -> String {
        match self.kind {
            Kind::Bucket { capacity, rate } => {
                format!("{} {} @ {}/s", self.name, num(capacity), num(rate))
            }
            Kind::Quota { amount } => format!("{} {} / month", self.name, num(amount)),
        }
    }
}

/// A limit's value for a table: `300`, `1100000`, `1e9`.
fn num(v: f64) -> String {
    if v >= 1e7 {
        format!("{v:e}")
    } else {
        format!("{v}")
    }
}

impl Lim {
    /// The limit as the gateway holds it.
    fn limit(&self) -> Limit {
        let mut spec = LimitSpec {
            name: self.name.into(),
            ..LimitSpec::default()
        };
        match self.kind {
            Kind::Bucket { capacity, rate } => {
                spec.capacity = Some(capacity);
                spec.rate = Some(rate);
            }
            Kind::Quota { amount } => {
                spec.quota = Some(amount);
                spec.period = Some(Period::Month);
            }
        }
        Limit::from_spec(&spec).expect("the bench's limits are valid")
    }
}

/// `[[catalog.plans]]` with `limits`, for [`GatewayConfig::extra`].
fn plan_toml(name: &str, limits: &[Lim]) -> String {
    let limits: Vec<String> = limits.iter().map(Lim::toml).collect();
    format!(
        "[[catalog.plans]]\nname = {name:?}\nlimits = [{}]\n",
        limits.join(", ")
    )
}

// ---------------------------------------------------------------------------------------
// Cost: Redis calls, Redis CPU and added latency, one limit vs three.

/// The three-limit plan of the cost and Redis parts: all for every service, none ever
/// refusing at the rates measured, so a request takes from each in the one script call.
fn never_refusing() -> [Lim; 3] {
    [
        Lim::bucket("burst", 1e9, 1e9),
        Lim::bucket("steady", 1e9, 1e9),
        Lim::monthly("monthly", 1e12),
    ]
}

const PATH: &str = "/api/items/42";
// The same length, so every target parses the same bytes.
const KEY_ONE: &str = "bench-plans-key-one1";
const KEY_THREE: &str = "bench-plans-key-thr3";

/// One target of the cost run.
struct Target {
    name: &'static str,
    addr: std::net::SocketAddr,
    key: &'static str,
}

type CostResult = (String, Value, String);

fn cost(a: &Args) -> anyhow::Result<CostResult> {
    let machine = machine();
    let redis_one = RedisServer::start()?;
    let redis_three = RedisServer::start()?;
    let upstream = Upstreams::start(vec![Server::Fast(Default::default())])?;

    let config = |redis: &RedisServer, client: &str, key: &str| {
        let mut c = one_unlimited_client(Some(redis.url()), upstream.urls(), client, key);
        c.workers = a.gateway_workers;
        c.timeout_ms = Some(a.timeout_ms);
        c
    };
    // One bucket: the plan as every client had it before issue 13 (`capacity`, `rate`).
    let one = config(&redis_one, "plan-one", KEY_ONE);
    // Three limits, all for every service, none ever refusing at this rate: a request
    // takes from each of them in the one script call.
    let three_limits = never_refusing();
    let mut three = config(&redis_three, "plan-three", KEY_THREE);
    let client = three
        .clients
        .last_mut()
        .expect("one_unlimited_client adds the client last");
    client.plan = "three".into();
    three.extra.push_str(&plan_toml("three", &three_limits));

    let gw_one = Gateway::start(&one, PATH)?;
    let gw_three = Gateway::start(&three, PATH)?;
    let floor = Floor::start(&upstream.urls()[0], a.gateway_workers, None, None)?;
    let targets = [
        Target {
            name: "direct to the upstream",
            addr: upstream.addrs[0],
            key: KEY_ONE,
        },
        Target {
            name: "floor: actix-web + awc, no limiter",
            addr: floor.addr,
            key: KEY_ONE,
        },
        Target {
            name: "tollgate, plan of 1 limit",
            addr: gw_one.addr,
            key: KEY_ONE,
        },
        Target {
            name: "tollgate, plan of 3 limits",
            addr: gw_three.addr,
            key: KEY_THREE,
        },
    ];
    let n = targets.len();
    let stream = |t: &Target, from: f64, until: f64| Stream {
        addr: t.addr,
        requests: vec![get_request(PATH, Some(t.key))],
        rate: a.rate,
        arrivals: Arrivals::Uniform,
        from: Duration::from_secs_f64(from),
        until: Duration::from_secs_f64(until),
    };
    // Warm-up: each target in turn; then the targets alternate, slice by slice. Stream
    // i serves target i % n.
    let mut streams: Vec<Stream> = Vec::new();
    let mut t = 0.0;
    for target in &targets {
        streams.push(stream(target, t, t + a.warmup));
        t += a.warmup;
    }
    let mut left = a.duration;
    while left > 1e-9 {
        let len = left.min(a.slice);
        for target in &targets {
            streams.push(stream(target, t, t + len));
            t += len;
        }
        left -= len;
    }

    // Redis' CPU while nothing is sent (its timers, the gateways' catalog polls), to
    // subtract from the run's.
    let idle_window = Duration::from_secs(3);
    let idle0 = [
        RedisSpent::read(&redis_one)?,
        RedisSpent::read(&redis_three)?,
    ];
    let idle_started = Instant::now();
    std::thread::sleep(idle_window);
    let before = [
        RedisSpent::read(&redis_one)?,
        RedisSpent::read(&redis_three)?,
    ];
    let idle_s = idle_started.elapsed().as_secs_f64();
    let idle_cpu_per_s = [
        before[0].since(&idle0[0]).cpu_s / idle_s,
        before[1].since(&idle0[1]).cpu_s / idle_s,
    ];
    eprintln!(
        "plans/cost: {} req/s, {} s per target, {n} targets alternating every {} s ({machine})",
        a.rate, a.duration, a.slice
    );
    let started = Instant::now();
    let run = OpenRun::start(streams.clone());
    // The plans measured are the plans meant: a client keeps one field per limit in the
    // state group (`tollgate:s:{0}` on one server). Looked at halfway through
    // each gateway's last slice, while its client's state exists (a bucket that is full
    // again expires a second later).
    for (i, redis, client, limits) in [
        (2, &redis_one, "plan-one", 1),
        (3, &redis_three, "plan-three", three_limits.len()),
    ] {
        // Streams come n at a time, one per target in order.
        let last = &streams[streams.len() - n + i];
        run.sleep_until((last.from + last.until) / 2);
        let names: Vec<String> = redis::cmd("HKEYS")
            .arg("tollgate:s:{0}")
            .query(&mut redis.conn()?)?;
        let fields = names
            .iter()
            .filter(|f| *f == client || f.starts_with(&format!("{client}/")))
            .count();
        anyhow::ensure!(
            fields == limits,
            "{client}'s state in Redis has {fields} fields, not the {limits} of {limits} limits"
        );
    }
    let result = run.join()?;
    let wall_s = started.elapsed().as_secs_f64();
    let spent = [
        RedisSpent::read(&redis_one)?.since(&before[0]),
        RedisSpent::read(&redis_three)?.since(&before[1]),
    ];

    let mut measured: Vec<Vec<Sample>> = vec![Vec::new(); n];
    let mut sent = vec![0usize; n];
    for (i, samples) in result.samples.iter().enumerate() {
        sent[i % n] += samples.len();
        if i >= n {
            measured[i % n].extend_from_slice(samples);
        }
    }
    let summaries: Vec<Summary> = measured.iter().map(Summary::of).collect();
    let non_200: Vec<usize> = measured
        .iter()
        .map(|v| v.iter().filter(|s| s.status != 200).count())
        .collect();
    let direct = &summaries[0];

    let mut table = Table::new(&[
        "path", "requests", "non-200", "p50 ms", "p90 ms", "p99 ms", "p99.9 ms", "max ms",
    ]);
    for (i, t) in targets.iter().enumerate() {
        let s = &summaries[i];
        table.row(vec![
            t.name.into(),
            s.count.to_string(),
            non_200[i].to_string(),
            ms(s.p50_ms),
            ms(s.p90_ms),
            ms(s.p99_ms),
            ms(s.p999_ms),
            ms(s.max_ms),
        ]);
    }
    for (i, t) in targets.iter().enumerate().skip(1) {
        let s = &summaries[i];
        let bold = |v: f64| format!("**{}**", ms(v));
        table.row(vec![
            format!(
                "**added by {}**",
                t.name.split(':').next().unwrap_or(t.name)
            ),
            String::new(),
            String::new(),
            bold(s.p50_ms - direct.p50_ms),
            ms(s.p90_ms - direct.p90_ms),
            bold(s.p99_ms - direct.p99_ms),
            ms(s.p999_ms - direct.p999_ms),
            String::new(),
        ]);
    }

    // Per plan: Redis' own counters over the whole run (warm-up included, as are its
    // requests: each gateway's Redis served that gateway only).
    let mut cost_table = Table::new(&[
        "plan",
        "gateway requests",
        "Redis calls per request (EVALSHA)",
        "µs inside EVALSHA per call",
        "Redis CPU per decision µs",
        "added p50 ms",
        "added p99 ms",
        "fail-opens",
    ]);
    let mut plans_json = Vec::new();
    let mut mixes = Vec::new();
    for (k, (label, gw)) in [("1 limit", &gw_one), ("3 limits", &gw_three)]
        .into_iter()
        .enumerate()
    {
        let i = k + 2;
        let s = &spent[k];
        let requests = sent[i] as f64;
        let evalsha = s.calls("evalsha");
        let per_call_us = s.usec("evalsha") as f64 / evalsha.max(1) as f64;
        let busy_cpu_s = (s.cpu_s - idle_cpu_per_s[k] * wall_s).max(0.0);
        let cpu_per_decision_us = busy_cpu_s * 1e6 / requests.max(1.0);
        let fail_open = gw
            .metrics()?
            .get("tollgate_fail_open_total")
            .copied()
            .unwrap_or(0.0);
        let added_p50 = summaries[i].p50_ms - direct.p50_ms;
        let added_p99 = summaries[i].p99_ms - direct.p99_ms;
        cost_table.row(vec![
            label.into(),
            sent[i].to_string(),
            format!("**{:.3}**", evalsha as f64 / requests.max(1.0)),
            format!("{per_call_us:.1}"),
            format!("**{cpu_per_decision_us:.1}**"),
            ms(added_p50),
            format!("**{}**", ms(added_p99)),
            fail_open.to_string(),
        ]);
        let mix: BTreeMap<&str, f64> = s
            .commands
            .iter()
            .map(|(c, &(calls, _))| (c.as_str(), round(calls as f64 / requests.max(1.0), 4)))
            .collect();
        mixes.push(format!(
            "{label}: {}",
            mix.iter()
                .map(|(c, v)| format!("{c} {v:.3}"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
        plans_json.push(json!({
            "plan": label,
            "gateway_requests": sent[i],
            "evalsha": evalsha,
            "redis_calls_per_request": round(evalsha as f64 / requests.max(1.0), 4),
            "evalsha_usec_per_call": round(per_call_us, 2),
            "redis_cpu_s": round(s.cpu_s, 4),
            "redis_idle_cpu_s_per_s": round(idle_cpu_per_s[k], 6),
            "redis_cpu_per_decision_us": round(cpu_per_decision_us, 2),
            "commands_per_request": mix,
            "added_p50_ms": round(added_p50, 3),
            "added_p99_ms": round(added_p99, 3),
            "fail_open": fail_open,
        }));
    }
    let three_vs_one_p50 = summaries[3].p50_ms - summaries[2].p50_ms;
    let three_vs_one_p99 = summaries[3].p99_ms - summaries[2].p99_ms;

    let markdown = format!(
        "### plans, cost: {} req/s open loop, {} s per target, alternating every {} s\n\n{}\n\
         Plan of 3 limits: {}.\n\n{}\n\
         3 limits vs 1: p50 {:+.3} ms, p99 {:+.3} ms. Redis commands per gateway request over \
         the run (a script's own calls counted too): {}. Redis CPU per decision is the \
         process's `used_cpu_sys + used_cpu_user` over the run, less its idle rate ({:.0} / \
         {:.0} µs/s, measured over {} s before), divided by the gateway's requests; µs \
         inside EVALSHA is `INFO commandstats` (the script's run, without reading the \
         request or writing the reply). Generator wake-up lateness p50/p99: {:.0}/{:.0} µs \
         (included on every side). {machine}.\n",
        a.rate,
        a.duration,
        a.slice,
        table.render(),
        three_limits
            .iter()
            .map(Lim::describe)
            .collect::<Vec<_>>()
            .join(", "),
        cost_table.render(),
        three_vs_one_p50,
        three_vs_one_p99,
        mixes.join("; "),
        idle_cpu_per_s[0] * 1e6,
        idle_cpu_per_s[1] * 1e6,
        idle_window.as_secs(),
        result.dispatch_late_p50.as_secs_f64() * 1e6,
        result.dispatch_late_p99.as_secs_f64() * 1e6,
    );
    let json = json!({
        "rate": a.rate,
        "duration_s": a.duration,
        "slice_s": a.slice,
        "gateway_workers": a.gateway_workers,
        "timeout_ms": a.timeout_ms,
        "targets": targets.iter().enumerate().map(|(i, t)| json!({
            "target": t.name,
            "latency": summary_json(&summaries[i]),
            "non_200": non_200[i],
            "added_p50_ms": round(summaries[i].p50_ms - direct.p50_ms, 3),
            "added_p99_ms": round(summaries[i].p99_ms - direct.p99_ms, 3),
        })).collect::<Vec<_>>(),
        "plans": plans_json,
        "three_vs_one_p50_ms": round(three_vs_one_p50, 3),
        "three_vs_one_p99_ms": round(three_vs_one_p99, 3),
        "generator_late_p50_us": round(result.dispatch_late_p50.as_secs_f64() * 1e6, 1),
        "generator_late_p99_us": round(result.dispatch_late_p99.as_secs_f64() * 1e6, 1),
        "machine": machine,
    });

    let nines = (summaries.iter().map(|s| s.count).min().unwrap_or(10) as f64)
        .log10()
        .floor()
        .clamp(1.0, 4.0);
    let colors = [svg::BLUE, svg::GREY, svg::ORANGE, svg::RED];
    let names = ["direct", "floor", "tollgate, 1 limit", "tollgate, 3 limits"];
    let series: Vec<svg::Series> = (0..n)
        .map(|i| svg::Series {
            name: names[i],
            color: colors[i],
            points: svg::percentile_curve(&sorted_ns(&measured[i]), nines),
            dots: false,
        })
        .collect();
    let chart = svg::Plot {
        title: "Latency percentiles: a plan of 1 limit vs 3",
        subtitle: &format!(
            "{} req/s open loop, {} s per target; added p99: 1 limit {:.3} ms, 3 limits {:.3} ms",
            a.rate,
            a.duration,
            summaries[2].p99_ms - direct.p99_ms,
            summaries[3].p99_ms - direct.p99_ms
        ),
        x_label: "percentile",
        y_label: "latency (ms, from intended send time)",
        x_ticks: svg::percentile_ticks(nines),
        x_max: nines,
        log_y: false,
        markers: vec![],
    }
    .render(&series);
    Ok((markdown, json, chart))
}

// ---------------------------------------------------------------------------------------
// Redis alone, saturated: what a decision costs Redis when it is busy.

/// Redis kept busy by the gateway's own store code (`Buckets::take`, as the limiter calls
/// it: one multiplexed connection, `EVALSHA`), from one thread, with
/// `--redis-concurrency` takes in flight, each for a client of its own so none coalesce:
/// Redis reads many calls per wake-up, so its per-call cost is the script's and the
/// protocol's, without the idle wake-ups a 1,000 req/s run pays.
fn saturated(a: &Args) -> anyhow::Result<(String, Value)> {
    let machine = machine();
    let redis = RedisServer::start()?;
    let driver = Driver::new(&redis)?;
    let one = Limits::new(vec![Limit::default_bucket(Bucket::new(1e9, 1e9)?)])?;
    let three = Limits::new(never_refusing().iter().map(Lim::limit).collect())?;
    let plans = [("1 limit", one.every()), ("3 limits", three.every())];
    // Each take in flight on a client of its own, one set of clients per plan.
    let keys: Vec<Rc<Vec<String>>> = plans
        .iter()
        .map(|(label, _)| {
            Rc::new(
                (0..a.redis_concurrency)
                    .map(|i| client_key(&format!("hot-{}-{i}", label.replace(' ', "-"))))
                    .collect(),
            )
        })
        .collect();
    let own = Rc::new(Draw::Own);
    let drive = |k: usize, applied: &Vec<Applied>, seconds: f64| {
        driver.drive(&keys[k], &own, applied, a.redis_concurrency, seconds)
    };
    eprintln!(
        "plans/redis: {} takes in flight, {} s per plan x 2 rounds ({machine})",
        a.redis_concurrency, a.redis_seconds
    );
    // Warm-up: loads the script, opens the connection, creates every client's state.
    for (k, (_, applied)) in plans.iter().enumerate() {
        drive(k, applied, 0.5);
    }
    let mut totals: Vec<(RedisSpent, u64, u64, f64)> = vec![Default::default(); plans.len()];
    for _round in 0..2 {
        for (k, (_, applied)) in plans.iter().enumerate() {
            let before = RedisSpent::read(&redis)?;
            let started = Instant::now();
            let (ok, failed) = drive(k, applied, a.redis_seconds);
            let wall = started.elapsed().as_secs_f64();
            let spent = RedisSpent::read(&redis)?.since(&before);
            let t = &mut totals[k];
            t.0.add(&spent);
            t.1 += ok;
            t.2 += failed;
            t.3 += wall;
        }
    }
    let mut table = Table::new(&[
        "plan",
        "takes",
        "takes/s",
        "EVALSHA per take",
        "µs inside EVALSHA per call",
        "Redis CPU per decision µs",
        "failed",
    ]);
    let mut rows = Vec::new();
    for (k, (label, _)) in plans.iter().enumerate() {
        let (spent, ok, failed, wall) = &totals[k];
        let evalsha = spent.calls("evalsha");
        let per_call = spent.usec("evalsha") as f64 / evalsha.max(1) as f64;
        let cpu = spent.cpu_s * 1e6 / (*ok).max(1) as f64;
        table.row(vec![
            label.to_string(),
            ok.to_string(),
            format!("{:.0}", *ok as f64 / wall),
            format!("{:.3}", evalsha as f64 / (*ok).max(1) as f64),
            format!("**{per_call:.1}**"),
            format!("**{cpu:.1}**"),
            failed.to_string(),
        ]);
        rows.push(json!({
            "plan": label,
            "takes": ok,
            "takes_per_s": round(*ok as f64 / wall, 0),
            "evalsha": evalsha,
            "evalsha_usec_per_call": round(per_call, 2),
            "redis_cpu_per_decision_us": round(cpu, 2),
            "failed": failed,
        }));
    }
    let markdown = format!(
        "### plans, Redis alone: {} takes in flight through `Buckets::take`, {} s per plan x 2 \
         rounds\n\n{}\n\
         Redis CPU per decision: `used_cpu_sys + used_cpu_user` over the rounds / takes (no \
         idle to subtract: Redis is busy throughout); µs inside EVALSHA: `INFO \
         commandstats`. The caller shares the machine's two cores with Redis. {machine}.\n",
        a.redis_concurrency,
        a.redis_seconds,
        table.render(),
    );
    let json = json!({
        "concurrency": a.redis_concurrency,
        "seconds_per_round": a.redis_seconds,
        "rounds": 2,
        "plans": rows,
        "machine": machine,
    });
    Ok((markdown, json))
}

// ---------------------------------------------------------------------------------------
// Accuracy: each limit of a three-limit plan binding in turn, at 9x its rate.

/// One accuracy case: a client on its own plan, and which limit should bind.
struct Case {
    client: &'static str,
    key: &'static str,
    plan: &'static str,
    /// `None`: the plan is one `capacity` and `rate` (the bucket named `default`).
    limits: Option<Vec<Lim>>,
    binds: &'static str,
    /// What the binding limit admits in a run of `span` seconds.
    allowance: Allowance,
}

#[derive(Debug, Clone, Copy)]
enum Allowance {
    Bucket { capacity: f64, rate: f64 },
    Quota(f64),
}

impl Allowance {
    fn of(&self, span: f64) -> f64 {
        match *self {
            Allowance::Bucket { capacity, rate } => capacity + rate * span,
            Allowance::Quota(q) => q,
        }
    }

    fn formula(&self) -> &'static str {
        match self {
            Allowance::Bucket { .. } => "capacity + rate x T",
            Allowance::Quota(_) => "quota",
        }
    }
}

fn cases(a: &Args) -> Vec<Case> {
    let (c, r, d) = (a.capacity, a.limit_rate, a.accuracy_duration);
    let quota = (r * d).round();
    // A limit that must not bind holds three times what the binding one can admit in the
    // run (and refills at twice its rate); the quota that must not bind, a thousand times.
    let loose = || Lim::bucket("x", 3.0 * (c + r * d), 2.0 * r);
    let named = |name: &'static str, l: Lim| Lim { name, ..l };
    let loose_quota = Lim::monthly("monthly", 1000.0 * (c + r * d));
    let bucket = Allowance::Bucket {
        capacity: c,
        rate: r,
    };
    vec![
        Case {
            client: "acc-one",
            key: "bench-plans-acc-one-key",
            plan: "acc-one",
            limits: None,
            binds: "the plan's one bucket",
            allowance: bucket,
        },
        Case {
            client: "acc-burst",
            key: "bench-plans-acc-burst-key",
            plan: "acc-burst",
            limits: Some(vec![
                Lim::bucket("burst", c, r),
                named("steady", loose()),
                loose_quota,
            ]),
            binds: "burst (1st, a bucket)",
            allowance: bucket,
        },
        Case {
            client: "acc-steady",
            key: "bench-plans-acc-steady-key",
            plan: "acc-steady",
            limits: Some(vec![
                named("burst", loose()),
                Lim::bucket("steady", c, r),
                loose_quota,
            ]),
            binds: "steady (2nd, a bucket)",
            allowance: bucket,
        },
        Case {
            client: "acc-monthly",
            key: "bench-plans-acc-monthly-key",
            plan: "acc-monthly",
            limits: Some(vec![
                named("burst", loose()),
                named("steady", loose()),
                Lim::monthly("monthly", quota),
            ]),
            binds: "monthly (3rd, a quota)",
            allowance: Allowance::Quota(quota),
        },
    ]
}

fn accuracy(a: &Args) -> anyhow::Result<(String, Value)> {
    let machine = machine();
    let cases = cases(a);
    let redis = RedisServer::start()?;
    let fleet = Fleet::start(
        &redis,
        &a.topology,
        a.timeout_ms,
        |config: &mut GatewayConfig| {
            for case in &cases {
                match &case.limits {
                    None => {
                        let Allowance::Bucket { capacity, rate } = case.allowance else {
                            unreachable!("a one-bucket plan binds with its bucket")
                        };
                        config.plans.push(PlanDef {
                            name: case.plan.into(),
                            capacity,
                            rate,
                        });
                    }
                    Some(limits) => config.extra.push_str(&plan_toml(case.plan, limits)),
                }
                config.clients.push(ClientDef {
                    id: case.client.into(),
                    plan: case.plan.into(),
                    key: case.key.into(),
                });
            }
        },
    )?;
    let offered_rate = a.multiplier * a.limit_rate;
    eprintln!(
        "plans/accuracy: {} cases at {offered_rate} req/s through {} for {} s each ({machine})",
        cases.len(),
        a.topology,
        a.accuracy_duration
    );

    let mut table = Table::new(&[
        "plan",
        "binding limit",
        "offered",
        "T (s)",
        "allowance",
        "admitted",
        "of which failed open",
        "error",
        "quota counted",
        "denied (429)",
        "reached services",
        "Redis calls per request",
    ]);
    let mut rows_json = Vec::new();
    let mut notes = Vec::new();
    for case in &cases {
        let o = fleet.offer(
            &redis,
            case.client,
            case.key,
            offered_rate,
            a.accuracy_duration,
        )?;
        let allowance = case.allowance.of(o.span);
        let fail_open = o.outcomes.get("fail_open").copied().unwrap_or(0.0);
        let error_pct = o.error_pct(allowance);
        // What the quota counted, from the client's field in Redis' state group: every admitted
        // request, and no refused one.
        let counted: Option<u64> = match &case.limits {
            Some(limits) if limits.iter().any(|l| l.name == "monthly") => redis::cmd("HGET")
                .arg("tollgate:s:{0}")
                .arg(format!("{}/monthly:", case.client))
                .query::<Option<Vec<u8>>>(&mut redis.conn()?)?
                .and_then(|v| Some(f64::from_le_bytes(v.get(..8)?.try_into().ok()?) as u64)),
            _ => None,
        };
        let plan = match &case.limits {
            None => match case.allowance {
                Allowance::Bucket { capacity, rate } => {
                    format!("1 limit: {capacity} @ {rate}/s")
                }
                Allowance::Quota(_) => unreachable!("a one-bucket plan"),
            },
            Some(limits) => format!(
                "3 limits: {}",
                limits
                    .iter()
                    .map(Lim::describe)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        table.row(vec![
            plan.clone(),
            case.binds.into(),
            format!("{} ({}x)", o.sent, a.multiplier),
            format!("{:.3}", o.span),
            format!("{allowance:.1} ({})", case.allowance.formula()),
            o.admitted.to_string(),
            fail_open.to_string(),
            format!("**{error_pct:+.2}%**"),
            counted.map_or("-".into(), |c| c.to_string()),
            o.denied.to_string(),
            o.reached.to_string(),
            format!("{:.3}", o.calls_per_request()),
        ]);
        notes.push(format!("{}: {}", case.plan, o.outcomes_text()));
        rows_json.push(json!({
            "plan": case.plan,
            "limits": plan,
            "binding": case.binds,
            "offered_rate": offered_rate,
            "sent": o.sent,
            "span_s": round(o.span, 4),
            "allowance": round(allowance, 2),
            "admitted": o.admitted,
            "fail_open": fail_open,
            "denied": o.denied,
            "other": o.other,
            "error_pct": round(error_pct, 3),
            "quota_counted": counted,
            "reached_services": o.reached,
            "redis_calls_per_request": round(o.calls_per_request(), 4),
            "decisions": o.outcomes,
        }));
    }
    let breaker_opened = metric_sum(&fleet.gateways, "tollgate_breaker_opened_total")?;
    let markdown = format!(
        "### plans, accuracy: each limit binding in turn, offered {}x its rate\n\n{}\n\
         Through {} sharing one Redis, {} s per case. Admitted: answered 200 (the \
         services saw them: reached); failed open: admitted without an answer from Redis \
         within the budget. Quota counted: the quota's count in Redis afterwards (the \
         client's `monthly:n`): the requests the script admitted, a refused one spends \
         from no limit; a request that failed open is in it only if its call still ran \
         after the gateway stopped waiting. Decisions by outcome (all gateways): {}. \
         Breaker openings: {breaker_opened}. Decision budget {} ms. {machine}.\n",
        a.multiplier,
        table.render(),
        a.topology,
        a.accuracy_duration,
        notes.join("; "),
        a.timeout_ms,
    );
    let json = json!({
        "gateways": a.topology.gateways,
        "services": a.topology.services,
        "replicas": a.topology.replicas,
        "duration_s": a.accuracy_duration,
        "multiplier": a.multiplier,
        "cases": rows_json,
        "breaker_opened": breaker_opened,
        "timeout_ms": a.timeout_ms,
        "machine": machine,
    });
    Ok((markdown, json))
}
