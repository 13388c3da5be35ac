//! `accuracy`: does one client's limit hold across N gateways x S services x R replicas?
//! One client sends `--multiplier` times its contract rate, spread evenly over every
//! gateway and service; the gateways share one Redis. A bucket that starts full admits at
//! most `capacity + rate x T` over T seconds: the error is how far the admitted count is
//! from that. The upstreams count what reached them, to show denied requests never do.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tollgate_testkit::{ClientDef, GatewayConfig, PlanDef, RedisServer, RouteDef};

use super::seconds;
use crate::http::get_request;
use crate::load::{run_open, Arrivals, Stream};
use crate::procs::{gateway_config, raise_fd_limit, Gateway, PROBE_KEY};
use crate::report::{machine, round, Outcome, Table};
use crate::upstream::{Counts, Server, Upstreams};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    topology: Topology,
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

/// Where one client's requests go: gateways sharing one Redis, services, replicas.
#[derive(Debug, Clone, clap::Args)]
pub struct Topology {
    /// Gateway instances sharing one Redis.
    #[arg(long, default_value_t = 3)]
    pub gateways: usize,
    /// Services (routes) the client's requests are spread over.
    #[arg(long, default_value_t = 3)]
    pub services: usize,
    /// Replicas per service.
    #[arg(long, default_value_t = 3)]
    pub replicas: usize,
}

impl std::fmt::Display for Topology {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} gateways x {} services x {} replicas",
            self.gateways, self.services, self.replicas
        )
    }
}

const CLIENT: &str = "heavy-client";
const KEY: &str = "bench-heavy-key-9x";

pub fn run(a: &Args) -> anyhow::Result<Outcome> {
    raise_fd_limit();
    let machine = machine();
    let redis = RedisServer::start()?;
    let fleet = Fleet::start(&redis, &a.topology, a.timeout_ms, |config| {
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
    })?;
    eprintln!(
        "accuracy: {}x contract ({} + {}/s) through {} for {} s ({machine})",
        a.multiplier, a.capacity, a.rate, a.topology, a.duration
    );
    let o = fleet.offer(&redis, CLIENT, KEY, a.multiplier * a.rate, a.duration)?;
    let expected = a.capacity + a.rate * o.span;
    let error_pct = o.error_pct(expected);
    let breaker_opened = metric_sum(&fleet.gateways, "tollgate_breaker_opened_total")?;

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
    table.row(vec![
        a.topology.to_string(),
        format!("{} ({}x contract)", o.sent, a.multiplier),
        format!("{:.3}", o.span),
        format!("{expected:.1}"),
        o.admitted.to_string(),
        format!("**{error_pct:+.2}%**"),
        o.denied.to_string(),
        o.reached.to_string(),
    ]);
    let markdown = format!(
        "### accuracy: one client at {}x its contract ({} tokens + {}/s)\n\n{}\n\
         Other answers: {}. Redis calls per request: {:.3}. \
         Decisions by outcome (all gateways): {}. Breaker openings: {breaker_opened}. \
         Decision budget {} ms. {machine}.\n",
        a.multiplier,
        a.capacity,
        a.rate,
        table.render(),
        o.other,
        o.calls_per_request(),
        o.outcomes_text(),
        a.timeout_ms,
    );
    let json = json!({
        "scenario": "accuracy",
        "gateways": a.topology.gateways,
        "services": a.topology.services,
        "replicas": a.topology.replicas,
        "capacity": a.capacity,
        "rate": a.rate,
        "multiplier": a.multiplier,
        "sent": o.sent,
        "span_s": round(o.span, 4),
        "expected": round(expected, 2),
        "admitted": o.admitted,
        "denied": o.denied,
        "other": o.other,
        "error_pct": round(error_pct, 3),
        "reached_services": o.reached,
        "redis_calls_per_request": round(o.calls_per_request(), 4),
        "decisions": o.outcomes,
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

/// Gateways sharing one Redis in front of services x replicas that count, per client,
/// what reaches them; warmed up (every gateway's connections to Redis and to every
/// replica open) before it is handed out.
pub struct Fleet {
    pub gateways: Vec<Gateway>,
    counts: Vec<Arc<Counts>>,
    paths: Vec<String>,
    _upstreams: Upstreams,
}

/// What one client got when it offered a rate to a [`Fleet`].
pub struct Offered {
    pub sent: usize,
    pub admitted: usize,
    pub denied: usize,
    /// Answers other than 200 and 429.
    pub other: usize,
    /// Seconds from the first request's intended send time to the last one's.
    pub span: f64,
    /// Requests of the client that reached a replica.
    pub reached: u64,
    /// `EVALSHA` calls Redis served meanwhile.
    pub evalsha: u64,
    /// Decisions by outcome over the gateways, meanwhile (only those that happened).
    pub outcomes: BTreeMap<String, f64>,
}

impl Offered {
    /// How far `admitted` is from `allowance`, in % of it.
    pub fn error_pct(&self, allowance: f64) -> f64 {
        (self.admitted as f64 - allowance) / allowance * 100.0
    }

    pub fn calls_per_request(&self) -> f64 {
        self.evalsha as f64 / self.sent.max(1) as f64
    }

    /// `allowed 1099, denied 7901`.
    pub fn outcomes_text(&self) -> String {
        self.outcomes
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl Fleet {
    /// Starts the upstreams and `t.gateways` gateways on `redis`, each configured by
    /// [`gateway_config`] with the decision budget `timeout_ms`, one route per service
    /// (`/svc0`, ...), then `configure` (the measured clients and their plans).
    pub fn start(
        redis: &RedisServer,
        t: &Topology,
        timeout_ms: u64,
        configure: impl Fn(&mut GatewayConfig),
    ) -> anyhow::Result<Fleet> {
        anyhow::ensure!(
            t.gateways >= 1 && t.services >= 1 && t.replicas >= 1,
            "--gateways, --services and --replicas must be at least 1"
        );
        let counts: Vec<Arc<Counts>> = (0..t.services * t.replicas)
            .map(|_| Arc::new(Counts::per_client()))
            .collect();
        let upstreams = Upstreams::start(counts.iter().cloned().map(Server::Fast).collect())?;
        let urls = upstreams.urls();
        let routes = || {
            (0..t.services)
                .map(|s| RouteDef {
                    service: format!("svc{s}"),
                    prefix: format!("/svc{s}"),
                    upstreams: urls[s * t.replicas..(s + 1) * t.replicas].to_vec(),
                })
                .collect::<Vec<_>>()
        };
        let mut gateways = Vec::new();
        for _ in 0..t.gateways {
            let mut config = gateway_config(Some(redis.url()), routes());
            config.timeout_ms = Some(timeout_ms);
            configure(&mut config);
            gateways.push(Gateway::start(&config, "/svc0/probe")?);
        }
        let paths: Vec<String> = (0..t.services)
            .map(|s| format!("/svc{s}/orders/1"))
            .collect();

        // Warm-up with the probe client: opens every gateway's connections to Redis and
        // to every replica, and spends none of a measured client's tokens.
        let warm: Vec<Stream> = gateways
            .iter()
            .map(|g| Stream {
                addr: g.addr,
                requests: paths
                    .iter()
                    .map(|p| get_request(p, Some(PROBE_KEY)))
                    .collect(),
                rate: 50.0 * t.services as f64 * t.replicas as f64,
                arrivals: Arrivals::Uniform,
                from: Duration::ZERO,
                until: Duration::from_secs(1),
            })
            .collect();
        run_open(warm)?;
        Ok(Fleet {
            gateways,
            counts,
            paths,
            _upstreams: upstreams,
        })
    }

    /// `client` (API key `key`) sends `total_rate` requests/s for `duration` s,
    /// interleaved evenly over the gateways (each stream offset by one gap), each stream
    /// cycling through the services.
    pub fn offer(
        &self,
        redis: &RedisServer,
        client: &str,
        key: &str,
        total_rate: f64,
        duration: f64,
    ) -> anyhow::Result<Offered> {
        let evalsha_before = redis.calls("evalsha")?;
        let outcomes_before = decisions(&self.gateways)?;
        let reached_before = self.reached(client);
        let services = self.paths.len();
        let per_gateway = total_rate / self.gateways.len() as f64;
        let streams: Vec<Stream> = self
            .gateways
            .iter()
            .enumerate()
            .map(|(i, g)| {
                let offset = Duration::from_secs_f64(i as f64 / total_rate);
                Stream {
                    addr: g.addr,
                    // Rotated per gateway, so consecutive requests go to different services.
                    requests: (0..services)
                        .map(|s| get_request(&self.paths[(s + i) % services], Some(key)))
                        .collect(),
                    rate: per_gateway,
                    arrivals: Arrivals::Uniform,
                    from: offset,
                    until: offset + Duration::from_secs_f64(duration),
                }
            })
            .collect();
        let result = run_open(streams)?;
        let evalsha = redis.calls("evalsha")? - evalsha_before;

        let all: Vec<_> = result.samples.iter().flatten().collect();
        let sent = all.len();
        let admitted = all.iter().filter(|s| s.status == 200).count();
        let denied = all.iter().filter(|s| s.status == 429).count();
        let first = all.iter().map(|s| s.at).min().unwrap_or_default();
        let last = all.iter().map(|s| s.at).max().unwrap_or_default();
        let mut outcomes = decisions(&self.gateways)?;
        for (k, v) in outcomes.iter_mut() {
            *v -= outcomes_before.get(k).copied().unwrap_or(0.0);
        }
        outcomes.retain(|_, v| *v > 0.0);
        Ok(Offered {
            sent,
            admitted,
            denied,
            other: sent - admitted - denied,
            span: (last - first).as_secs_f64(),
            reached: self.reached(client) - reached_before,
            evalsha,
            outcomes,
        })
    }

    fn reached(&self, client: &str) -> u64 {
        self.counts.iter().map(|c| c.of(client)).sum()
    }
}

/// `tollgate_decisions_total` by outcome, summed over the gateways.
pub fn decisions(gateways: &[Gateway]) -> anyhow::Result<BTreeMap<String, f64>> {
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
pub fn metric_sum(gateways: &[Gateway], name: &str) -> anyhow::Result<f64> {
    let mut sum = 0.0;
    for g in gateways {
        sum += g.metrics()?.get(name).copied().unwrap_or(0.0);
    }
    Ok(sum)
}
