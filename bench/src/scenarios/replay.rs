//! `replay`: the September incident, from mechanism.
//!
//! S services x R replicas, each replica a queue with finite capacity (`--workers` at a
//! time, exponential service times of mean `--service-ms`, so waiting grows sharply as
//! load nears capacity) and its own per-service limiter (ADR-001: a token bucket per
//! client, inside the replica, set to the client's contract). Clients reach the services
//! through tollgate, which routes by path and balances replicas round-robin. One noisy
//! client sends `--noisy-multiplier` times its contract, spread over every service; many
//! normal clients send about half of theirs, Poisson arrivals for all.
//!
//! Two phases on the same traffic (same seeds):
//! - `per-service`: the gateway in shadow mode (it decides and counts, but forwards
//!   everything), so only the replicas' limiters act. Each replica sees about 1/(S x R) of
//!   the noisy client's traffic and admits up to the contract, so the client gets up to
//!   S x R times it; the replicas fill up and everyone's tail latency rises.
//! - `edge`: the gateway enforces the contract once, in Redis; the replicas' limiters
//!   stay (they no longer bind).
//!
//! Nothing is tuned to the design's numbers: change `--services`/`--replicas` and the
//! admitted ratio follows S x R (capped by what the client offers).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tollgate::domain::Bucket;
use tollgate_testkit::{ClientDef, PlanDef, RedisServer, RouteDef};

use super::{seconds, summary_json};
use crate::http::get_request;
use crate::load::{Arrivals, OpenRun, Sample, Stream, Summary};
use crate::procs::{gateway_config, raise_fd_limit, Gateway};
use crate::report::{machine, ms, round, Outcome, Table};
use crate::svg;
use crate::upstream::{Replica, Server, Upstreams};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Seconds measured per phase, after the warm-up.
    #[arg(long, default_value = "30", value_parser = seconds)]
    duration: f64,
    /// Seconds of warm-up per phase (queues and buckets reach steady state), not counted.
    #[arg(long, default_value = "5", value_parser = seconds)]
    warmup: f64,
    /// Services behind the gateway.
    #[arg(long, default_value_t = 3)]
    services: usize,
    /// Replicas per service.
    #[arg(long, default_value_t = 3)]
    replicas: usize,
    /// Requests a replica serves at once.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// Mean service time of one request, in milliseconds (exponentially distributed).
    #[arg(long, default_value_t = 20.0)]
    service_ms: f64,
    /// Normal clients.
    #[arg(long, default_value_t = 20)]
    clients: usize,
    /// The contract every client has: tokens per second (and the burst capacity).
    #[arg(long, default_value_t = 20.0)]
    contract_rate: f64,
    /// The noisy client's load as a multiple of its contract.
    #[arg(long, default_value_t = 9.0)]
    noisy_multiplier: f64,
    /// The normal clients' load, all together, as a fraction of all replicas' capacity.
    #[arg(long, default_value_t = 0.45)]
    others_load: f64,
    /// Seed of the arrival and service-time draws (both phases use the same).
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// The gateway's decision budget (`redis.timeout_ms`); past it a request fails open.
    #[arg(long, default_value_t = 5)]
    timeout_ms: u64,
}

const NOISY: &str = "noisy";

struct Phase {
    name: &'static str,
    noisy_offered_ratio: f64,
    noisy_admitted_ratio: f64,
    noisy_limited_gateway: usize,
    noisy_limited_services: usize,
    others: Summary,
    others_limited: usize,
    others_failed: usize,
    utilisation: f64,
    decisions: Value,
}

pub fn run(a: &Args) -> anyhow::Result<Outcome> {
    anyhow::ensure!(
        a.services >= 1 && a.replicas >= 1 && a.workers >= 1 && a.clients >= 1,
        "--services, --replicas, --workers and --clients must be at least 1"
    );
    raise_fd_limit();
    let machine = machine();
    let redis = RedisServer::start()?;
    let replicas = a.services * a.replicas;
    let capacity_rps = replicas as f64 * a.workers as f64 * 1000.0 / a.service_ms;
    let per_client = a.others_load * capacity_rps / a.clients as f64;
    eprintln!(
        "replay: {} services x {} replicas ({capacity_rps:.0} req/s capacity), noisy client at {}x \
         its {}/s contract, {} others at {per_client:.1}/s each; {} s per phase ({machine})",
        a.services, a.replicas, a.noisy_multiplier, a.contract_rate, a.clients, a.duration
    );
    let mut phases = Vec::new();
    for (name, mode) in [("per-service", "shadow"), ("edge", "enforce")] {
        redis.flush()?;
        phases.push(phase(a, &redis, name, mode, per_client)?);
    }

    let mut table = Table::new(&[
        "phase",
        "noisy offered (x contract)",
        "noisy admitted (x contract)",
        "noisy 429 at gateway",
        "noisy 429 by services",
        "others p50 ms",
        "others p99 ms",
        "others p99.9 ms",
        "others 429",
        "replica utilisation",
        "gateway fail-opens",
    ]);
    for p in &phases {
        table.row(vec![
            p.name.to_string(),
            format!("{:.1}", p.noisy_offered_ratio),
            format!("**{:.2}**", p.noisy_admitted_ratio),
            p.noisy_limited_gateway.to_string(),
            p.noisy_limited_services.to_string(),
            ms(p.others.p50_ms),
            format!("**{}**", ms(p.others.p99_ms)),
            ms(p.others.p999_ms),
            p.others_limited.to_string(),
            format!("{:.0}%", p.utilisation * 100.0),
            p.decisions
                .get("fail_open")
                .and_then(Value::as_f64)
                .unwrap_or(0.0)
                .to_string(),
        ]);
    }
    let reduction = phases[0].others.p99_ms / phases[1].others.p99_ms.max(1e-9);
    let markdown = format!(
        "### replay: {} services x {} replicas, one client at {}x its contract, {} others\n\n{}\n\
         Others' p99 fell **{reduction:.1}x** from per-service limiters to the edge limiter \
         (the design's canary: 412 ms → 214 ms and below). {machine}.\n",
        a.services,
        a.replicas,
        a.noisy_multiplier,
        a.clients,
        table.render()
    );
    let json = json!({
        "scenario": "replay",
        "services": a.services,
        "replicas": a.replicas,
        "workers_per_replica": a.workers,
        "service_ms": a.service_ms,
        "clients": a.clients,
        "contract_rate": a.contract_rate,
        "noisy_multiplier": a.noisy_multiplier,
        "others_rate_per_client": round(per_client, 3),
        "timeout_ms": a.timeout_ms,
        "duration_s": a.duration,
        "phases": phases.iter().map(|p| json!({
            "name": p.name,
            "noisy_offered_ratio": round(p.noisy_offered_ratio, 3),
            "noisy_admitted_ratio": round(p.noisy_admitted_ratio, 3),
            "noisy_limited_at_gateway": p.noisy_limited_gateway,
            "noisy_limited_by_services": p.noisy_limited_services,
            "others_p50_ms": round(p.others.p50_ms, 3),
            "others_p99_ms": round(p.others.p99_ms, 3),
            "others_p999_ms": round(p.others.p999_ms, 3),
            "others": summary_json(&p.others),
            "others_limited": p.others_limited,
            "others_failed": p.others_failed,
            "replica_utilisation": round(p.utilisation, 3),
            "gateway_decisions": p.decisions,
        })).collect::<Vec<_>>(),
        "others_p99_reduction": round(reduction, 3),
        "machine": machine,
    });

    let labels = vec![
        "per-service limiters".to_string(),
        "edge limiter (tollgate)".to_string(),
    ];
    let topology = format!(
        "{} services x {} replicas, one client at {}x its contract, {} others",
        a.services, a.replicas, a.noisy_multiplier, a.clients
    );
    let p99_chart = svg::bars(
        "Incident replay: everyone else's latency",
        &topology,
        "others' latency (ms)",
        &labels,
        &[
            (
                "p50",
                svg::BLUE,
                phases.iter().map(|p| p.others.p50_ms).collect(),
            ),
            (
                "p99",
                svg::ORANGE,
                phases.iter().map(|p| p.others.p99_ms).collect(),
            ),
        ],
    );
    let admitted_chart = svg::bars(
        "Incident replay: what the noisy client got",
        &topology,
        "x its contract",
        &labels,
        &[
            (
                "offered",
                svg::GREY,
                phases.iter().map(|p| p.noisy_offered_ratio).collect(),
            ),
            (
                "admitted",
                svg::RED,
                phases.iter().map(|p| p.noisy_admitted_ratio).collect(),
            ),
        ],
    );
    Ok(Outcome {
        markdown,
        json,
        charts: vec![
            ("replay-p99.svg".into(), p99_chart),
            ("replay-admitted.svg".into(), admitted_chart),
        ],
    })
}

fn phase(
    a: &Args,
    redis: &RedisServer,
    name: &'static str,
    mode: &'static str,
    per_client: f64,
) -> anyhow::Result<Phase> {
    let contract = Bucket::new(a.contract_rate, a.contract_rate)?;
    let service = Duration::from_secs_f64(a.service_ms / 1000.0);
    let replicas: Vec<Arc<Replica>> = (0..a.services * a.replicas)
        .map(|i| {
            Arc::new(Replica::new(
                a.workers,
                service,
                Some(contract),
                a.seed.wrapping_mul(1000).wrapping_add(i as u64),
            ))
        })
        .collect();
    let upstreams = Upstreams::start(replicas.iter().cloned().map(Server::Replica).collect())?;
    let urls = upstreams.urls();
    let routes = (0..a.services)
        .map(|s| RouteDef {
            service: format!("svc{s}"),
            prefix: format!("/svc{s}"),
            upstreams: urls[s * a.replicas..(s + 1) * a.replicas].to_vec(),
        })
        .collect();
    let mut config = gateway_config(Some(redis.url()), routes);
    config.default_mode = Some(mode.into());
    config.timeout_ms = Some(a.timeout_ms);
    config.plans.push(PlanDef {
        name: "standard".into(),
        capacity: a.contract_rate,
        rate: a.contract_rate,
    });
    let key = |c: &str| format!("bench-key-{c}");
    config.clients.push(ClientDef {
        id: NOISY.into(),
        plan: "standard".into(),
        key: key(NOISY),
    });
    let others: Vec<String> = (0..a.clients).map(|i| format!("client-{i:03}")).collect();
    for c in &others {
        config.clients.push(ClientDef {
            id: c.clone(),
            plan: "standard".into(),
            key: key(c),
        });
    }
    let gateway = Gateway::start(&config, "/svc0/probe")?;

    let paths: Vec<String> = (0..a.services)
        .map(|s| format!("/svc{s}/orders/1"))
        .collect();
    let requests = |client: &str, rotate: usize| -> Vec<Vec<u8>> {
        (0..a.services)
            .map(|s| get_request(&paths[(s + rotate) % a.services], Some(&key(client))))
            .collect()
    };
    let end = Duration::from_secs_f64(a.warmup + a.duration);
    let mut streams = vec![Stream {
        addr: gateway.addr,
        requests: requests(NOISY, 0),
        rate: a.noisy_multiplier * a.contract_rate,
        arrivals: Arrivals::Poisson { seed: a.seed },
        from: Duration::ZERO,
        until: end,
    }];
    for (i, c) in others.iter().enumerate() {
        streams.push(Stream {
            addr: gateway.addr,
            requests: requests(c, i),
            rate: per_client,
            arrivals: Arrivals::Poisson {
                seed: a.seed.wrapping_add(1 + i as u64),
            },
            from: Duration::ZERO,
            until: end,
        });
    }
    eprintln!("  phase {name} (gateway in {mode} mode)");
    let busy = || -> u64 { replicas.iter().map(|r| r.busy_us.load(Relaxed)).sum() };
    let run = OpenRun::start(streams);
    let warm = Duration::from_secs_f64(a.warmup);
    run.sleep_until(warm);
    let busy_start = busy();
    run.sleep_until(end);
    let busy_end = busy();
    let result = run.join()?;
    let metrics = gateway.metrics()?;

    let counted = |s: &&Sample| s.at >= warm && s.at < end;
    let noisy: Vec<&Sample> = result.samples[0].iter().filter(counted).collect();
    let admitted = noisy.iter().filter(|s| s.status == 200).count();
    let limited_services = noisy
        .iter()
        .filter(|s| s.status == 429 && s.service_marked)
        .count();
    let limited_gateway = noisy
        .iter()
        .filter(|s| s.status == 429 && !s.service_marked)
        .count();
    let rest: Vec<&Sample> = result.samples[1..]
        .iter()
        .flatten()
        .filter(counted)
        .collect();
    let others_ok: Vec<&Sample> = rest.iter().copied().filter(|s| s.status == 200).collect();
    let others_limited = rest.iter().filter(|s| s.status == 429).count();
    let others_failed = rest.len() - others_ok.len() - others_limited;
    let allowance = a.contract_rate * a.duration;
    let decisions: serde_json::Map<String, Value> = metrics
        .iter()
        .filter_map(|(k, v)| {
            let label = k
                .strip_prefix("tollgate_decisions_total{outcome=\"")?
                .strip_suffix("\"}")?;
            (*v > 0.0).then(|| (label.to_string(), json!(v)))
        })
        .collect();
    let window_us = a.duration * 1e6 * (a.services * a.replicas * a.workers) as f64;
    Ok(Phase {
        name,
        noisy_offered_ratio: noisy.len() as f64 / allowance,
        noisy_admitted_ratio: admitted as f64 / allowance,
        noisy_limited_gateway: limited_gateway,
        noisy_limited_services: limited_services,
        others: Summary::of(others_ok.iter().copied()),
        others_limited,
        others_failed,
        utilisation: (busy_end - busy_start) as f64 / window_us,
        decisions: Value::Object(decisions),
    })
}
