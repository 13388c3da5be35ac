//! `accuracy`: does one client's limit hold across N gateways x S services x R replicas?
//! One client sends `--multiplier` times its contract rate, spread evenly over every
//! gateway and service; the gateways share one Redis. A bucket that starts full admits at
//! most `capacity + rate x T` over T seconds: the error is how far the admitted count is
//! from that. The upstreams count what reached them, to show denied requests never do.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::json;
use tollgate_testkit::{ClientDef, PlanDef, RedisServer, RouteDef};

use super::seconds;
use crate::http::get_request;
use crate::load::{run_open, Arrivals, Stream};
use crate::procs::{gateway_config, raise_fd_limit, Gateway, PROBE_KEY};
use crate::report::{machine, round, Outcome, Table};
use crate::upstream::{Counts, Server, Upstreams};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Gateway instances sharing one Redis.
    #[arg(long, default_value_t = 3)]
    gateways: usize,
    /// Services (routes) the client's requests are spread over.
    #[arg(long, default_value_t = 3)]
    services: usize,
    /// Replicas per service.
    #[arg(long, default_value_t = 3)]
    replicas: usize,
    /// Seconds the client sends for.
    #[arg(long, default_value = "10", value_parser = seconds)]
    duration: f64,
    /// The contract: bucket capacity (tokens).
    #[arg(long, default_value_t = 100.0)]
    capacity: f64,
    /// The contract: refill rate (tokens per second).
    #[arg(long, default_value_t = 100.0)]
    rate: f64,
    /// Offered load as a multiple of the contract rate.
    #[arg(long, default_value_t = 9.0)]
    multiplier: f64,
    /// The gateways' decision budget (`redis.timeout_ms`); past it a request fails open.
    #[arg(long, default_value_t = 5)]
    timeout_ms: u64,
}

const CLIENT: &str = "heavy-client";
const KEY: &str = "bench-heavy-key-9x";

pub fn run(a: &Args) -> anyhow::Result<Outcome> {
    anyhow::ensure!(
        a.gateways >= 1 && a.services >= 1 && a.replicas >= 1,
        "--gateways, --services and --replicas must be at least 1"
    );
    raise_fd_limit();
    let machine = machine();
    let redis = RedisServer::start()?;
    let counts: Vec<std::sync::Arc<Counts>> = (0..a.services * a.replicas)
        .map(|_| std::sync::Arc::new(Counts::per_client()))
        .collect();
    let upstreams = Upstreams::start(counts.iter().cloned().map(Server::Fast).collect())?;
    let urls = upstreams.urls();
    let routes = || {
        (0..a.services)
            .map(|s| RouteDef {
                service: format!("svc{s}"),
                prefix: format!("/svc{s}"),
                upstreams: urls[s * a.replicas..(s + 1) * a.replicas].to_vec(),
            })
            .collect::<Vec<_>>()
    };
    let mut gateways = Vec::new();
    for _ in 0..a.gateways {
        let mut config = gateway_config(Some(redis.url()), routes());
        config.timeout_ms = Some(a.timeout_ms);
        config.plans.push(PlanDef {
            name: "contract".into(),
            capacity: a.capacity,
            rate: a.rate,
        });
        config.clients.push(ClientDef {
            id: CLIENT.into(),
            plan: "contract".into(),
            key: KEY.into(),
        });
        gateways.push(Gateway::start(&config, "/svc0/probe")?);
    }
    let paths: Vec<String> = (0..a.services)
        .map(|s| format!("/svc{s}/orders/1"))
        .collect();
    eprintln!(
        "accuracy: {}x contract ({} + {}/s) through {} gateways x {} services x {} replicas for {} s ({machine})",
        a.multiplier, a.capacity, a.rate, a.gateways, a.services, a.replicas, a.duration
    );

    // Warm-up with the probe client: opens every gateway's connections to Redis and to
    // every replica, and spends none of the measured client's tokens.
    let warm: Vec<Stream> = gateways
        .iter()
        .map(|g| Stream {
            addr: g.addr,
            requests: paths
                .iter()
                .map(|p| get_request(p, Some(PROBE_KEY)))
                .collect(),
            rate: 50.0 * a.services as f64 * a.replicas as f64,
            arrivals: Arrivals::Uniform,
            from: Duration::ZERO,
            until: Duration::from_secs(1),
        })
        .collect();
    run_open(warm)?;
    let evalsha_before = redis.calls("evalsha")?;
    let outcomes_before = decisions(&gateways)?;

    // The client: `multiplier x rate` in total, interleaved evenly over the gateways
    // (each stream offset by one gap), each stream cycling through the services.
    let total_rate = a.multiplier * a.rate;
    let per_gateway = total_rate / a.gateways as f64;
    let streams: Vec<Stream> = gateways
        .iter()
        .enumerate()
        .map(|(i, g)| {
            let offset = Duration::from_secs_f64(i as f64 / total_rate);
            Stream {
                addr: g.addr,
                // Rotated per gateway, so consecutive requests go to different services.
                requests: (0..a.services)
                    .map(|s| get_request(&paths[(s + i) % a.services], Some(KEY)))
                    .collect(),
                rate: per_gateway,
                arrivals: Arrivals::Uniform,
                from: offset,
                until: offset + Duration::from_secs_f64(a.duration),
            }
        })
        .collect();
    let result = run_open(streams)?;
    let evalsha = redis.calls("evalsha")? - evalsha_before;

    let all: Vec<_> = result.samples.iter().flatten().collect();
    let sent = all.len();
    let admitted = all.iter().filter(|s| s.status == 200).count();
    let denied = all.iter().filter(|s| s.status == 429).count();
    let other = sent - admitted - denied;
    let first = all.iter().map(|s| s.at).min().unwrap_or_default();
    let last = all.iter().map(|s| s.at).max().unwrap_or_default();
    let span = (last - first).as_secs_f64();
    let expected = a.capacity + a.rate * span;
    let error_pct = (admitted as f64 - expected) / expected * 100.0;
    let reached: u64 = counts.iter().map(|c| c.of(CLIENT)).sum();
    let mut outcomes = decisions(&gateways)?;
    for (k, v) in outcomes.iter_mut() {
        *v -= outcomes_before.get(k).copied().unwrap_or(0.0);
    }
    outcomes.retain(|_, v| *v > 0.0);
    let calls_per_request = evalsha as f64 / sent.max(1) as f64;
    let breaker_opened = metric_sum(&gateways, "tollgate_breaker_opened_total")?;

    let mut table = Table::new(&[
        "topology",
        "offered",
        "T (s)",
        "capacity + rate x T",
        "admitted",
        "error",
        "denied (429)",
        "reached services",
    ]);
    let topology = format!(
        "{} gateways x {} services x {} replicas",
        a.gateways, a.services, a.replicas
    );
    table.row(vec![
        topology.clone(),
        format!("{sent} ({}x contract)", a.multiplier),
        format!("{span:.3}"),
        format!("{expected:.1}"),
        admitted.to_string(),
        format!("**{error_pct:+.2}%**"),
        denied.to_string(),
        reached.to_string(),
    ]);
    let markdown = format!(
        "### accuracy: one client at {}x its contract ({} tokens + {}/s)\n\n{}\n\
         Other answers: {other}. Redis calls per request: {calls_per_request:.3}. \
         Decisions by outcome (all gateways): {}. Breaker openings: {breaker_opened}. \
         Decision budget {} ms. {machine}.\n",
        a.multiplier,
        a.capacity,
        a.rate,
        table.render(),
        outcomes
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", "),
        a.timeout_ms,
    );
    let json = json!({
        "scenario": "accuracy",
        "gateways": a.gateways,
        "services": a.services,
        "replicas": a.replicas,
        "capacity": a.capacity,
        "rate": a.rate,
        "multiplier": a.multiplier,
        "sent": sent,
        "span_s": round(span, 4),
        "expected": round(expected, 2),
        "admitted": admitted,
        "denied": denied,
        "other": other,
        "error_pct": round(error_pct, 3),
        "reached_services": reached,
        "redis_calls_per_request": round(calls_per_request, 4),
        "decisions": outcomes,
        "breaker_opened": breaker_opened,
        "timeout_ms": a.timeout_ms,
        "machine": machine,
    });
    Ok(Outcome {
        markdown,
        json,
        charts: vec![],
    })
}

/// `tollgate_decisions_total` by outcome, summed over the gateways.
fn decisions(gateways: &[Gateway]) -> anyhow::Result<BTreeMap<String, f64>> {
    let mut outcomes = BTreeMap::new();
    for g in gateways {
        for (k, v) in g.metrics()? {
            if let Some(label) = k
                .strip_prefix("tollgate_decisions_total{outcome=\"")
                .and_then(|r| r.strip_suffix("\"}"))
            {
                *outcomes.entry(label.to_string()).or_insert(0.0) += v;
            }
        }
    }
    Ok(outcomes)
}

/// One metric summed over the gateways.
fn metric_sum(gateways: &[Gateway], name: &str) -> anyhow::Result<f64> {
    let mut sum = 0.0;
    for g in gateways {
        sum += g.metrics()?.get(name).copied().unwrap_or(0.0);
    }
    Ok(sum)
}
