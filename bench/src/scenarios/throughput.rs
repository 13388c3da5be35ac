//! `throughput`: the closed-loop maximum, direct to the upstream, through nginx (the
//! baseline, when installed) and through tollgate, each as a ratio to direct. Everything
//! shares the machine's cores with the load generator and the upstream, so the ratio, not
//! the absolute rate, is what carries over to other machines.

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::json;
use tollgate_testkit::RedisServer;

use super::clients::Clients;
use super::seconds;
use crate::load::run_closed_watching;
use crate::procs::{one_unlimited_client, raise_fd_limit, Floor, Gateway, Nginx, Pin};
use crate::report::{machine, median, round, Outcome, Table};
use crate::svg;
use crate::upstream::{Server, Upstreams};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Concurrent keep-alive connections.
    #[arg(long, default_value_t = 64)]
    conns: usize,
    /// Seconds measured per target in all, split over the rounds.
    #[arg(long, default_value = "9", value_parser = seconds)]
    duration: f64,
    /// Rounds: every target is measured once per round, in turn.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Seconds of warm-up before each measurement (new connections), not counted.
    #[arg(long, default_value = "1", value_parser = seconds)]
    warmup: f64,
    /// Worker counts to measure nginx and tollgate with (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    workers: Vec<usize>,
    /// Skip the nginx baseline even when nginx is installed.
    #[arg(long)]
    no_nginx: bool,
    /// Skip the embedded-store rows.
    #[arg(long)]
    no_embedded: bool,
    /// Skip the floor rows (bare actix-web + awc, no limiter).
    #[arg(long)]
    no_floor: bool,
    /// The system under test (nginx, the floor, tollgate) alone on CPU 1, everything else
    /// (this tool's load generator and upstream, redis-server) on CPU 0: each proxy's rate
    /// is then what one core of its own serves. For 2-core machines; use `--workers 1`.
    #[arg(long)]
    pin: bool,
    /// Also measure this other build of the gateway (a `tollgate` binary) on Redis, in
    /// the same rounds as the others: an A/B comparison of two builds on a machine whose
    /// speed drifts from minute to minute (a shared host), which two runs cannot make.
    #[arg(long, value_name = "TOLLGATE")]
    compare: Option<std::path::PathBuf>,
    #[command(flatten)]
    clients: Clients,
}

const PATH: &str = "/api/items/42";
const KEY: &str = "bench-throughput-key-1";

/// A target measured over the rounds.
struct Row {
    name: String,
    addr: SocketAddr,
    /// The process whose CPU time is counted (none for direct: the upstream is in this one).
    pid: Option<u32>,
    /// CPU µs (user + system) its process spent per request, one per round.
    cpu_us: Vec<f64>,
    /// Requests/s, one per round.
    rates: Vec<f64>,
    /// Ratio to the direct rate of the same round, one per round.
    ratios: Vec<f64>,
    non_2xx: u64,
    errors: u64,
    /// A gateway on Redis: its bucket takes per script call, one per round (how well its
    /// takes gathered; the per-call cost is spread over them).
    takes_per_call: Option<Vec<f64>>,
}

impl Row {
    fn new(name: String, addr: SocketAddr, pid: Option<u32>) -> Row {
        Row {
            name,
            addr,
            pid,
            cpu_us: Vec::new(),
            rates: Vec::new(),
            ratios: Vec::new(),
            non_2xx: 0,
            errors: 0,
            takes_per_call: None,
        }
    }

    fn rate(&self) -> f64 {
        median(&self.rates)
    }

    fn ratio(&self) -> f64 {
        median(&self.ratios)
    }

    fn cpu_us(&self) -> Option<f64> {
        (!self.cpu_us.is_empty()).then(|| median(&self.cpu_us))
    }
}

pub fn run(a: &Args) -> anyhow::Result<Outcome> {
    anyhow::ensure!(a.rounds >= 1, "--rounds must be at least 1");
    a.clients.check()?;
    raise_fd_limit();
    let machine = machine();
    // Before anything starts: every thread and child inherits it.
    let pin = a.pin.then(Pin::this_process).transpose()?;
    let upstream = Upstreams::start(vec![Server::Fast(Default::default())])?;
    let requests = a.clients.requests(PATH, KEY);
    let (warmup, slice) = (
        Duration::from_secs_f64(a.warmup),
        Duration::from_secs_f64(a.duration / a.rounds as f64),
    );
    eprintln!(
        "throughput: {} connections, {} s per target in {} rounds{} ({machine})",
        a.conns,
        a.duration,
        a.rounds,
        pinned(pin)
    );

    // Every target runs for the whole scenario and is measured in turn, round after round:
    // drift in the machine's speed (a shared host) then falls on all of them alike, and
    // each ratio compares a target with direct in the same round.
    let mut rows = vec![Row::new(
        "direct to the upstream".into(),
        upstream.addrs[0],
        None,
    )];
    let mut keep: Vec<Box<dyn std::any::Any>> = Vec::new();
    let mut nginx_missing = false;
    if !a.no_nginx {
        for &w in &a.workers {
            match Nginx::start(upstream.addrs[0], w, pin)? {
                Some(nginx) => {
                    rows.push(Row::new(
                        format!("nginx proxy, {w} worker{}", plural(w)),
                        nginx.addr,
                        Some(nginx.pid()),
                    ));
                    keep.push(Box::new(nginx));
                }
                None => {
                    nginx_missing = true;
                    break;
                }
            }
        }
    }
    if !a.no_floor {
        for &w in &a.workers {
            let floor = Floor::start(&upstream.urls()[0], w, pin, None)?;
            rows.push(Row::new(
                format!(
                    "floor: actix-web + awc, no limiter, {w} worker{}",
                    plural(w)
                ),
                floor.addr,
                Some(floor.pid()),
            ));
            keep.push(Box::new(floor));
        }
    }
    let redis = RedisServer::start()?;
    for &w in &a.workers {
        if let Some(bin) = &a.compare {
            let mut config =
                one_unlimited_client(Some(redis.url()), upstream.urls(), "throughput-client", KEY);
            config.workers = w;
            a.clients.add_to(&mut config, "large");
            let gateway = Gateway::start_binary(bin, &config, PATH, pin)?;
            let mut row = Row::new(
                format!("compared build (Redis), {w} worker{}", plural(w)),
                gateway.addr,
                Some(gateway.child.id()),
            );
            row.takes_per_call = Some(Vec::new());
            rows.push(row);
            keep.push(Box::new(gateway));
        }
        for embedded in [false, true] {
            if embedded && a.no_embedded {
                continue;
            }
            let store = if embedded { "embedded" } else { "Redis" };
            let mut config = one_unlimited_client(
                (!embedded).then(|| redis.url()),
                upstream.urls(),
                "throughput-client",
                KEY,
            );
            config.workers = w;
            let gateway = if embedded {
                // Into its catalog file in one write (see `add_clients_and_restart`).
                let mut gateway = Gateway::start_pinned(&config, PATH, pin)?;
                gateway.add_clients_and_restart(&a.clients.defs("large"), PATH)?;
                gateway
            } else {
                a.clients.add_to(&mut config, "large");
                Gateway::start_pinned(&config, PATH, pin)?
            };
            let mut row = Row::new(
                format!("tollgate ({store}), {w} worker{}", plural(w)),
                gateway.addr,
                Some(gateway.child.id()),
            );
            row.takes_per_call = (!embedded).then(Vec::new);
            rows.push(row);
            keep.push(Box::new(gateway));
        }
    }
    for round in 0..a.rounds {
        let mut direct = 0.0;
        for (i, row) in rows.iter_mut().enumerate() {
            eprintln!("  round {}: {}", round + 1, row.name);
            let gathered = row.takes_per_call.is_some();
            let before = if gathered {
                bucket_calls(row.addr)?
            } else {
                (0.0, 0.0)
            };
            let r =
                run_closed_watching(row.addr, requests.clone(), a.conns, warmup, slice, row.pid)?;
            if let Some(per_call) = row.takes_per_call.as_mut() {
                let after = bucket_calls(row.addr)?;
                per_call.push((after.1 - before.1) / (after.0 - before.0).max(1.0));
            }
            row.cpu_us.extend(r.cpu_us_per_request());
            if i == 0 {
                direct = r.rate();
            }
            row.rates.push(r.rate());
            row.ratios.push(r.rate() / direct.max(1.0));
            row.non_2xx += r.non_2xx;
            row.errors += r.errors;
        }
    }
    drop(keep);

    let direct = rows[0].rate();
    let mut table = Table::new(&[
        "target",
        "requests/s (median)",
        "x direct (median)",
        "rounds (requests/s)",
        "CPU µs per request (median)",
        "non-2xx",
        "errors",
    ]);
    let mut json_rows = Vec::new();
    for r in &rows {
        table.row(vec![
            r.name.clone(),
            format!("{:.0}", r.rate()),
            format!("{:.2}", r.ratio()),
            r.rates
                .iter()
                .map(|v| format!("{v:.0}"))
                .collect::<Vec<_>>()
                .join(", "),
            r.cpu_us().map_or(String::new(), |c| format!("{c:.1}")),
            r.non_2xx.to_string(),
            r.errors.to_string(),
        ]);
        json_rows.push(json!({
            "target": r.name,
            "requests_per_s": round(r.rate(), 0),
            "ratio_to_direct": round(r.ratio(), 3),
            "rounds_requests_per_s": r.rates.iter().map(|v| round(*v, 0)).collect::<Vec<_>>(),
            "cpu_us_per_request": r.cpu_us().map(|c| round(c, 2)),
            "rounds_cpu_us_per_request": r.cpu_us.iter().map(|v| round(*v, 2)).collect::<Vec<_>>(),
            "non_2xx": r.non_2xx,
            "errors": r.errors,
            "takes_per_redis_call": r.takes_per_call.as_deref().map(|v| round(median(v), 2)),
            "rounds_takes_per_redis_call": r.takes_per_call.as_deref().map(|v| v.iter().map(|t| round(*t, 2)).collect::<Vec<_>>()),
        }));
    }
    // The best worker count of each kind, by its ratio to direct.
    let best = |prefix: &str| {
        rows.iter()
            .filter(|r| r.name.starts_with(prefix))
            .map(|r| (r.ratio(), r.rate()))
            .fold((0.0, 0.0), |a, b| if b.0 > a.0 { b } else { a })
    };
    let ((gw_ratio, gw), (gw_embedded_ratio, gw_embedded), (nginx_ratio, nginx)) = (
        best("tollgate (Redis)"),
        best("tollgate (embedded)"),
        best("nginx"),
    );
    let (floor_ratio, floor) = best("floor");
    let mut markdown = format!(
        "### throughput: closed loop, {} connections, {} s per target in {} rounds, {}{}\n\n{}\n",
        a.conns,
        a.duration,
        a.rounds,
        a.clients.describe(),
        pinned(pin),
        table.render()
    );
    markdown.push_str(&format!(
        "Best tollgate (Redis) / direct: **{gw_ratio:.2}x**"
    ));
    if nginx > 0.0 {
        markdown.push_str(&format!(
            "; best nginx / direct: {nginx_ratio:.2}x; tollgate (Redis) / nginx: {:.2}x",
            gw_ratio / nginx_ratio
        ));
    } else if nginx_missing {
        markdown.push_str("; nginx is not installed, so no baseline row");
    }
    if floor > 0.0 {
        markdown.push_str(&format!(
            "; best floor (actix-web + awc alone) / direct: {floor_ratio:.2}x; tollgate (Redis) / floor: {:.2}x",
            gw_ratio / floor_ratio
        ));
    }
    markdown.push_str(&format!(". {machine}.\n"));
    for r in &rows {
        if let Some(per_call) = r.takes_per_call.as_deref() {
            let rounds: Vec<String> = per_call.iter().map(|t| format!("{t:.1}")).collect();
            markdown.push_str(&format!(
                "{}: {:.1} takes per Redis call (median; rounds: {}), warm-up included.\n",
                r.name,
                median(per_call),
                rounds.join(", ")
            ));
        }
    }

    let json = json!({
        "scenario": "throughput",
        "clients": a.clients.describe(),
        "conns": a.conns,
        "duration_s": a.duration,
        "rounds": a.rounds,
        "pinned": pin.is_some(),
        "direct_rps": round(direct, 0),
        "gateway_rps": round(gw, 0),
        "gateway_ratio": round(gw_ratio, 3),
        "gateway_embedded_rps": round(gw_embedded, 0),
        "gateway_embedded_ratio": round(gw_embedded_ratio, 3),
        "nginx_rps": if nginx > 0.0 { json!(round(nginx, 0)) } else { json!(null) },
        "nginx_ratio": if nginx > 0.0 { json!(round(nginx_ratio, 3)) } else { json!(null) },
        "floor_rps": if floor > 0.0 { json!(round(floor, 0)) } else { json!(null) },
        "floor_ratio": if floor > 0.0 { json!(round(floor_ratio, 3)) } else { json!(null) },
        "rows": json_rows,
        "machine": machine,
    });
    let names: Vec<String> = rows.iter().map(|r| short(&r.name)).collect();
    let chart = svg::bars(
        "Closed-loop throughput",
        &format!(
            "{} connections, {} s per target, one 2-core machine for everything",
            a.conns, a.duration
        ),
        "requests/s",
        &names,
        &[(
            "requests/s",
            svg::BLUE,
            rows.iter().map(|r| r.rate().round()).collect(),
        )],
    );
    Ok(Outcome {
        markdown,
        json,
        charts: vec![("throughput.svg".into(), chart)],
    })
}

/// How the run placed its processes, for the heading.
/// The gateway's script calls and the takes they decided, from its `/metrics`.
fn bucket_calls(addr: SocketAddr) -> anyhow::Result<(f64, f64)> {
    let (status, body) = crate::procs::block_on(crate::http::fetch(addr, "/metrics", None))?;
    anyhow::ensure!(status == 200, "/metrics answered {status}");
    let m = crate::http::parse_metrics(&body);
    let get = |k: &str| m.get(k).copied().unwrap_or(0.0);
    Ok((
        get("tollgate_store_bucket_calls_total"),
        get("tollgate_store_bucket_takes_total"),
    ))
}

pub fn pinned(pin: Option<Pin>) -> String {
    match pin {
        Some(_) => format!(
            "; pinned: the system under test alone on CPU {}, load generator, upstream and redis-server on CPU {}",
            Pin::SUT,
            Pin::REST
        ),
        None => String::new(),
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

/// A bar label that fits under the bar.
fn short(name: &str) -> String {
    name.replace("direct to the upstream", "direct")
        .replace("nginx proxy, ", "nginx ")
        .replace("tollgate (Redis), ", "redis ")
        .replace("tollgate (embedded), ", "embed. ")
        .replace("floor: actix-web + awc, no limiter, ", "floor ")
        .replace(" workers", "w")
        .replace(" worker", "w")
}
