//! `edge`: the edge for everyone (issue 34), measured. Every run starts its own
//! `redis-server` and gateways; `--runs` runs are reported as the median and the worst,
//! never the best. The load reaches the gateways from 127.0.0.1, their one trusted proxy
//! (`server.trusted_proxies`), as through a load balancer: each request names its client
//! in `X-Forwarded-For`.
//!
//! - **Public route, per address.** Two gateways share one Redis and a route on a
//!   per-address plan (`--capacity` + `--rate`/s). One IPv4 address sends `--multiplier`
//!   times the plan's rate, spread evenly over both gateways; so does a crowd of addresses
//!   inside one IPv6 /64 (one subscriber's network, one bucket); another IPv4 address sends
//!   half the rate. Each address's admitted count is compared with what its bucket allows
//!   over the window, `capacity + rate x T`; the quiet address must lose nothing. Each
//!   class has a route and a replica of its own, to count what reached a service.
//! - **Guessed keys.** `--guesses` distinct random keys from one address, at
//!   `--guess-rate`/s through one gateway, beside a client with a valid key from another
//!   address: how many guesses were answered `401` (at most the failed-keys burst and its
//!   refill over the window) and how many `429`; the Redis commands served meanwhile
//!   against a window as long just before with the valid client alone (the guesses must
//!   cost none); the gateway's resident set before, at its peak and after; the valid
//!   client admitted every time.
//! - **Guessed keys from everywhere.** The same number of random keys, each from an
//!   address of its own (the failed-keys table at its bound: more addresses than it
//!   holds): the resident set again.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use serde_json::{json, Value};
use tollgate_testkit::{ClientDef, GatewayConfig, PlanDef, RedisServer};

use super::accuracy::decisions;
use super::seconds;
use crate::load::{run_open, Arrivals, Sample, Stream};
use crate::procs::{gateway_config, raise_fd_limit, rss_kib, Gateway, RssWatch, PROBE_KEY};
use crate::report::{
    self, count, machine, mib, pct, round, runs_disturbance, CpuWatch, Disturbance, Outcome, Worse,
};
use crate::upstream::{Counts, Server, Upstreams};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Runs, each with a Redis and gateways of its own.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// The per-address plan: capacity (tokens, one per request).
    #[arg(long, default_value_t = 100.0)]
    capacity: f64,
    /// The per-address plan: rate (tokens per second).
    #[arg(long, default_value_t = 100.0)]
    rate: f64,
    /// What the loud addresses offer, as a multiple of the plan's rate.
    #[arg(long, default_value_t = 10.0)]
    multiplier: f64,
    /// Seconds the public route is offered load for.
    #[arg(long, default_value = "10", value_parser = seconds)]
    duration: f64,
    /// Distinct random keys sent by the guesser (and, again, from as many addresses).
    #[arg(long, default_value_t = 100_000)]
    guesses: usize,
    /// Guesses per second.
    #[arg(long, default_value_t = 10_000.0)]
    guess_rate: f64,
    /// Requests per second of the valid client beside the guesser.
    #[arg(long, default_value_t = 100.0)]
    valid_rate: f64,
    /// The gateways' decision budget (`redis.timeout_ms`).
    #[arg(long, default_value_t = 5)]
    timeout_ms: u64,
}

/// The per-address plan's name.
const PLAN: &str = "per-address";
/// The loud IPv4 address, the quiet one, the guesser, and the valid client's.
const LOUD_V4: &str = "203.0.113.7";
const QUIET_V4: &str = "203.0.113.8";
const GUESSER: &str = "198.51.100.66";
const VALID_FROM: &str = "198.51.100.9";
/// The /64 whose addresses act as one subscriber, and how many of them send.
const V6_NET: &str = "2001:db8:7:7";
const V6_HOSTS: usize = 512;
const VALID_KEY: &str = "bench-edge-valid-0000";
/// The gateways' `[edge]` settings: the defaults, written out so the report can state them.
const FAILED_KEYS_BURST: f64 = 20.0;
const FAILED_KEYS_PER_MINUTE: f64 = 10.0;
/// The gateway's resident set is sampled this often.
const RSS_EVERY: Duration = Duration::from_millis(250);

/// The three classes of the public route, each on a route (and a replica) of its own.
const CLASSES: [&str; 3] = ["loud IPv4 address", "loud IPv6 /64", "quiet IPv4 address"];

/// One class's share of the public route in one run.
struct Public {
    sent: usize,
    admitted: usize,
    denied: usize,
    /// Answers other than 200 and 429.
    other: usize,
    /// What the bucket allows over the class's window: `capacity + rate x T` for a loud
    /// class, every request for the quiet one (it offers half the rate).
    allowed: f64,
    /// Requests of the class that reached its replica.
    reached: u64,
    /// The statuses of the other answers (0: none came), and how many of each.
    others: BTreeMap<u16, usize>,
}

impl Public {
    fn error_pct(&self) -> f64 {
        (self.admitted as f64 - self.allowed) / self.allowed * 100.0
    }

    fn json(&self) -> Value {
        json!({
            "sent": self.sent,
            "admitted": self.admitted,
            "denied": self.denied,
            "other": self.other,
            "allowed": round(self.allowed, 2),
            "error_pct": round(self.error_pct(), 3),
            "reached_service": self.reached,
            "other_statuses": statuses_json(&self.others),
        })
    }
}

/// The statuses of `samples` other than `but`, and how many of each.
fn other_statuses<'a>(
    samples: impl Iterator<Item = &'a Sample>,
    but: &[u16],
) -> BTreeMap<u16, usize> {
    let mut others = BTreeMap::new();
    for s in samples.filter(|s| !but.contains(&s.status)) {
        *others.entry(s.status).or_default() += 1;
    }
    others
}

fn statuses_json(statuses: &BTreeMap<u16, usize>) -> Value {
    Value::Object(
        statuses
            .iter()
            .map(|(k, v)| (k.to_string(), json!(v)))
            .collect(),
    )
}

/// A flood of guessed keys through one gateway.
struct Flood {
    sent: usize,
    unauthorized: usize,
    limited: usize,
    other: usize,
    /// Seconds from the first guess's intended send time to the last one's.
    span: f64,
    /// Resident set before the flood, at its peak, and after (KiB).
    rss_before: u64,
    rss_peak: u64,
    rss_after: u64,
}

impl Flood {
    fn of(samples: &[Sample], rss: Vec<u64>, rss_before: u64) -> Flood {
        let status = |s: u16| samples.iter().filter(|x| x.status == s).count();
        let (unauthorized, limited) = (status(401), status(429));
        let first = samples.iter().map(|s| s.at).min().unwrap_or_default();
        let last = samples.iter().map(|s| s.at).max().unwrap_or_default();
        Flood {
            sent: samples.len(),
            unauthorized,
            limited,
            other: samples.len() - unauthorized - limited,
            span: (last - first).as_secs_f64(),
            rss_before,
            rss_peak: rss.iter().copied().max().unwrap_or(rss_before),
            rss_after: rss.last().copied().unwrap_or(rss_before),
        }
    }

    /// The most an address may be answered `401` over the flood: the burst, and the
    /// refill over its span (whole guesses).
    fn allowance(&self) -> f64 {
        FAILED_KEYS_BURST + (FAILED_KEYS_PER_MINUTE * self.span / 60.0).floor()
    }

    fn growth_mib(&self) -> f64 {
        self.rss_peak.saturating_sub(self.rss_before) as f64 / 1024.0
    }

    fn json(&self) -> Value {
        json!({
            "sent": self.sent,
            "unauthorized_401": self.unauthorized,
            "limited_429": self.limited,
            "other": self.other,
            "span_s": round(self.span, 3),
            "allowance_401": self.allowance(),
            "rss_kib_before": self.rss_before,
            "rss_kib_peak": self.rss_peak,
            "rss_kib_after": self.rss_after,
        })
    }
}

/// One run's figures.
struct Run {
    public: Vec<Public>,
    /// The gateways' decisions by outcome while the public route was offered load.
    public_decisions: BTreeMap<String, f64>,
    guessed: Flood,
    /// What Redis served while the guesser sent.
    commands: Commands,
    /// The valid client beside the guesser.
    valid: Valid,
    everywhere: Flood,
    disturbance: Option<Disturbance>,
}

impl Run {
    fn json(&self) -> Value {
        json!({
            "public_decisions": self.public_decisions,
            "public": CLASSES.iter().zip(&self.public).map(|(c, p)| (c.to_string(), p.json())).collect::<serde_json::Map<_, _>>(),
            "guessed_keys": self.guessed.json(),
            "redis_commands_during_flood": self.commands.flood,
            "redis_commands_control_window": self.commands.control,
            "valid_client": {
                "sent": self.valid.sent,
                "admitted": self.valid.admitted,
                "other_statuses": statuses_json(&self.valid.others),
            },
            "guessed_keys_each_from_its_own_address": self.everywhere.json(),
            "cpu": self.disturbance.as_ref().map(Disturbance::json),
        })
    }
}

pub fn run(a: &Args) -> anyhow::Result<Outcome> {
    anyhow::ensure!(a.runs >= 1, "--runs must be at least 1");
    anyhow::ensure!(
        a.guesses >= 1 && a.guess_rate > 0.0,
        "--guesses and --guess-rate must be positive"
    );
    raise_fd_limit();
    let machine = machine();
    eprintln!(
        "edge: a public route at {}x its per-address plan ({} + {}/s) through 2 gateways; \
         {} guessed keys at {}/s; {} runs ({machine})",
        a.multiplier, a.capacity, a.rate, a.guesses, a.guess_rate, a.runs
    );
    let mut runs = Vec::new();
    for i in 0..a.runs {
        eprintln!("run {}/{}", i + 1, a.runs);
        let watch = CpuWatch::start();
        let mut run = one_run(a)?;
        run.disturbance = watch.and_then(|w| w.stop());
        runs.push(run);
    }
    Ok(report(a, &runs, machine))
}

fn one_run(a: &Args) -> anyhow::Result<Run> {
    let redis = RedisServer::start()?;
    let counts: Vec<Arc<Counts>> = CLASSES.iter().map(|_| Default::default()).collect();
    let upstreams = Upstreams::start(counts.iter().cloned().map(Server::Fast).collect())?;
    let config = config(a, &redis, &upstreams.urls());
    let gateways = [
        Gateway::start(&config, "/pub0/probe")?,
        Gateway::start(&config, "/pub0/probe")?,
    ];
    warm_up(&gateways)?;
    let decided = decisions(&gateways)?;
    let public = public_route(a, &gateways, &counts)?;
    let mut public_decisions = decisions(&gateways)?;
    for (k, v) in public_decisions.iter_mut() {
        *v -= decided.get(k).copied().unwrap_or(0.0);
    }
    public_decisions.retain(|_, v| *v > 0.0);
    let (guessed, commands, valid) = guessed_keys(a, &redis, &gateways[0])?;
    let everywhere = guessed_everywhere(a, &gateways[1])?;
    Ok(Run {
        public,
        public_decisions,
        guessed,
        commands,
        valid,
        everywhere,
        disturbance: None,
    })
}

/// The gateways' configuration: the probe's plan and the valid client, the per-address
/// plan, a public route per class (`/pub0`, ...), and 127.0.0.1 as the trusted proxy.
fn config(a: &Args, redis: &RedisServer, urls: &[String]) -> GatewayConfig {
    let mut config = gateway_config(Some(redis.url()), Vec::new());
    config.timeout_ms = Some(a.timeout_ms);
    config.server = "trusted_proxies = [\"127.0.0.1/32\"]\n".into();
    config.plans.push(PlanDef {
        name: PLAN.into(),
        capacity: a.capacity,
        rate: a.rate,
    });
    config.clients.push(ClientDef {
        id: "bench-edge-valid".into(),
        plan: "unlimited".into(),
        key: VALID_KEY.into(),
    });
    for (i, url) in urls.iter().enumerate() {
        config.extra.push_str(&format!(
            "[[routes]]\nservice = \"pub{i}\"\nprefix = \"/pub{i}\"\nupstreams = [{url:?}]\n\
             public_plan = {PLAN:?}\n"
        ));
    }
    config.extra.push_str(&format!(
        "[edge]\nfailed_keys_burst = {FAILED_KEYS_BURST}\nfailed_keys_per_minute = {FAILED_KEYS_PER_MINUTE}\n"
    ));
    config
}

/// A request for `path` naming `from` as its client, with `key` if given.
fn request(path: &str, from: &str, key: Option<&str>) -> Vec<u8> {
    let mut r = format!(
        "GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nuser-agent: tollgate-bench\r\n\
         x-forwarded-for: {from}\r\n"
    );
    if let Some(key) = key {
        r.push_str(&format!("x-api-key: {key}\r\n"));
    }
    r.push_str("\r\n");
    r.into_bytes()
}

fn stream(g: &Gateway, requests: Vec<Vec<u8>>, rate: f64, from: f64, secs: f64) -> Stream {
    Stream {
        addr: g.addr,
        requests,
        rate,
        arrivals: Arrivals::Uniform,
        from: Duration::from_secs_f64(from),
        until: Duration::from_secs_f64(from + secs),
    }
}

/// Opens every gateway's connections to Redis and to every replica with the probe
/// client's key, spending nothing of an address's bucket.
fn warm_up(gateways: &[Gateway]) -> anyhow::Result<()> {
    let streams = gateways
        .iter()
        .map(|g| {
            let requests = (0..CLASSES.len())
                .map(|i| request(&format!("/pub{i}/warm"), "192.0.2.1", Some(PROBE_KEY)))
                .collect();
            stream(g, requests, 300.0, 0.0, 1.0)
        })
        .collect();
    run_open(streams)?;
    Ok(())
}

/// The public route's three classes at once, each spread over both gateways (the
/// gateways' streams offset by half a gap).
fn public_route(
    a: &Args,
    gateways: &[Gateway; 2],
    counts: &[Arc<Counts>],
) -> anyhow::Result<Vec<Public>> {
    let loud = a.multiplier * a.rate;
    let offered = [loud, loud, a.rate / 2.0];
    let froms: [Vec<String>; 3] = [
        vec![LOUD_V4.into()],
        (1..=V6_HOSTS).map(|h| format!("{V6_NET}::{h:x}")).collect(),
        vec![QUIET_V4.into()],
    ];
    let reached_before: Vec<u64> = counts.iter().map(|c| c.total.load(Relaxed)).collect();
    let mut streams = Vec::new();
    for (class, (rate, from)) in offered.iter().zip(&froms).enumerate() {
        let requests: Vec<Vec<u8>> = from
            .iter()
            .map(|f| request(&format!("/pub{class}/login"), f, None))
            .collect();
        for (i, g) in gateways.iter().enumerate() {
            let offset = i as f64 / rate;
            streams.push(stream(g, requests.clone(), rate / 2.0, offset, a.duration));
        }
    }
    let result = run_open(streams)?;
    let mut out = Vec::new();
    for (class, pair) in result.samples.chunks(2).enumerate() {
        let all: Vec<&Sample> = pair.iter().flatten().collect();
        let first = all.iter().map(|s| s.at).min().unwrap_or_default();
        let last = all.iter().map(|s| s.at).max().unwrap_or_default();
        let status = |s: u16| all.iter().filter(|x| x.status == s).count();
        let (admitted, denied) = (status(200), status(429));
        let others = other_statuses(all.iter().copied(), &[200, 429]);
        let allowed = match class {
            2 => all.len() as f64,
            _ => a.capacity + a.rate * (last - first).as_secs_f64(),
        };
        out.push(Public {
            sent: all.len(),
            admitted,
            denied,
            other: all.len() - admitted - denied,
            allowed,
            reached: counts[class].total.load(Relaxed) - reached_before[class],
            others,
        });
    }
    Ok(out)
}

use std::sync::atomic::Ordering::Relaxed;

/// `n` distinct random keys, each in a request from `from(i)`.
fn guesses(n: usize, from: impl Fn(usize) -> String) -> Vec<Vec<u8>> {
    use rand::Rng;
    let mut rng = rand::rng();
    (0..n)
        .map(|i| {
            let key = format!("tg_{:032x}", rng.random::<u128>());
            request("/pub0/orders", &from(i), Some(&key))
        })
        .collect()
}

/// Calls per command Redis has served so far, but for the bench's own (`INFO`, and what
/// its connection sends when it opens).
fn commands(redis: &RedisServer) -> anyhow::Result<HashMap<String, u64>> {
    let mut calls = redis.command_calls()?;
    calls.retain(|name, _| {
        !["info", "client", "hello"]
            .iter()
            .any(|own| name.starts_with(own))
    });
    Ok(calls)
}

/// What `before` and `after` (of [`commands`]) differ by, per command that moved.
fn moved(before: &HashMap<String, u64>, after: &HashMap<String, u64>) -> HashMap<String, u64> {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0)))
        .filter(|(_, v)| *v > 0)
        .collect()
}

/// What Redis served while the guesser sent, against the same window without it.
struct Commands {
    /// Per command that moved, during the flood (the commands the script runs inside
    /// Redis are counted too: `TIME`, `HMGET`, `HSET` per decision).
    flood: HashMap<String, u64>,
    /// The same over a window as long just before, with the valid client alone: what the
    /// valid client's decisions and the gateways' own work (the catalog's poll, the
    /// reconciler) ask of Redis.
    control: HashMap<String, u64>,
}

/// `EVALSHA` and the commands the bucket script runs inside Redis (its reads, writes and
/// sweeps): what the valid client's decisions cost, in a number that moves with how many
/// of its takes shared a call.
const SCRIPT: [&str; 7] = ["evalsha", "time", "hmget", "hset", "hdel", "hlen", "hscan"];

impl Commands {
    /// Calls of the commands that are not the script's.
    fn outside_script(m: &HashMap<String, u64>) -> u64 {
        m.iter()
            .filter(|(k, _)| !SCRIPT.contains(&k.as_str()))
            .map(|(_, v)| v)
            .sum()
    }

    /// `EVALSHA` during the flood: the valid client's decisions only, if the guesses cost none.
    fn flood_evalsha(&self) -> u64 {
        self.flood.get("evalsha").copied().unwrap_or(0)
    }

    /// Commands but the script's during the flood, less the control window's.
    fn over_control(&self) -> f64 {
        Commands::outside_script(&self.flood) as f64
            - Commands::outside_script(&self.control) as f64
    }
}

/// What the valid client beside the guesser got.
struct Valid {
    sent: usize,
    admitted: usize,
    /// Its other answers by status (0: none came).
    others: BTreeMap<u16, usize>,
}

/// The guesser's flood through `g`, the valid client beside it, and what Redis served
/// meanwhile.
fn guessed_keys(
    a: &Args,
    redis: &RedisServer,
    g: &Gateway,
) -> anyhow::Result<(Flood, Commands, Valid)> {
    let secs = a.guesses as f64 / a.guess_rate;
    let valid = || {
        stream(
            g,
            vec![request("/pub0/orders", VALID_FROM, Some(VALID_KEY))],
            a.valid_rate,
            0.0,
            secs,
        )
    };
    let requests = guesses(a.guesses, |_| GUESSER.into());
    let before = commands(redis)?;
    run_open(vec![valid()])?;
    let between = commands(redis)?;
    let control = moved(&before, &between);

    let pid = g.child.id();
    let rss_before = rss_kib(pid).context("the gateway's resident set")?;
    let rss = RssWatch::start(pid, RSS_EVERY);
    let result = run_open(vec![stream(g, requests, a.guess_rate, 0.0, secs), valid()])?;
    let flood = moved(&between, &commands(redis)?);
    let guessed = Flood::of(&result.samples[0], rss.stop(), rss_before);
    let valid = &result.samples[1];
    Ok((
        guessed,
        Commands { flood, control },
        Valid {
            sent: valid.len(),
            admitted: valid.iter().filter(|s| s.status == 200).count(),
            others: other_statuses(valid.iter(), &[200]),
        },
    ))
}

/// As many guesses, each from an address of its own (10.x.y.z), through `g`.
fn guessed_everywhere(a: &Args, g: &Gateway) -> anyhow::Result<Flood> {
    let requests = guesses(a.guesses, |i| {
        let i = i + 1;
        format!("10.{}.{}.{}", (i >> 16) & 255, (i >> 8) & 255, i & 255)
    });
    let pid = g.child.id();
    let rss_before = rss_kib(pid).context("the gateway's resident set")?;
    let rss = RssWatch::start(pid, RSS_EVERY);
    let secs = a.guesses as f64 / a.guess_rate;
    let result = run_open(vec![stream(g, requests, a.guess_rate, 0.0, secs)])?;
    Ok(Flood::of(&result.samples[0], rss.stop(), rss_before))
}

type Figure = report::Figure<Run>;

fn signed_pct(v: f64) -> String {
    format!("{v:+.2}%")
}

const FIGURES: [Figure; 15] = [
    (
        "loud_v4_error_pct",
        "public, loud IPv4 address: admitted vs capacity + rate x T",
        Worse::FartherFromZero,
        |r| r.public[0].error_pct(),
        signed_pct,
    ),
    (
        "loud_v6_error_pct",
        "public, loud IPv6 /64 (512 addresses): admitted vs capacity + rate x T",
        Worse::FartherFromZero,
        |r| r.public[1].error_pct(),
        signed_pct,
    ),
    (
        "quiet_v4_error_pct",
        "public, quiet IPv4 address (half the rate): admitted vs sent",
        Worse::FartherFromZero,
        |r| r.public[2].error_pct(),
        signed_pct,
    ),
    (
        "public_refused_reaching_service",
        "public: refused requests that reached a service (all classes)",
        Worse::Higher,
        |r| {
            r.public
                .iter()
                .map(|p| p.reached as f64 - p.admitted as f64)
                .sum()
        },
        count,
    ),
    (
        "public_other_answers",
        "public: answers other than 200 and 429",
        Worse::Higher,
        |r| r.public.iter().map(|p| p.other as f64).sum(),
        count,
    ),
    (
        "public_fail_open",
        "public: decisions that failed open (both gateways)",
        Worse::Higher,
        |r| r.public_decisions.get("fail_open").copied().unwrap_or(0.0),
        count,
    ),
    (
        "guessed_401",
        "guessed keys, one address: answered 401",
        Worse::Higher,
        |r| r.guessed.unauthorized as f64,
        count,
    ),
    (
        "guessed_401_allowance",
        "guessed keys, one address: the most 401s allowed (burst + refill over the flood)",
        Worse::Lower,
        |r| r.guessed.allowance(),
        count,
    ),
    (
        "guessed_429_pct",
        "guessed keys, one address: answered 429",
        Worse::Lower,
        |r| r.guessed.limited as f64 / r.guessed.sent.max(1) as f64 * 100.0,
        pct,
    ),
    (
        "guessed_evalsha_minus_valid",
        "guessed keys, one address: EVALSHA during the flood minus the valid client's requests",
        Worse::Higher,
        |r| r.commands.flood_evalsha() as f64 - r.valid.sent as f64,
        count,
    ),
    (
        "guessed_redis_commands_over_control",
        "guessed keys, one address: other Redis commands (not the script's) during the flood, minus the same window without the guesses",
        Worse::Higher,
        |r| r.commands.over_control(),
        count,
    ),
    (
        "valid_client_refused",
        "valid client beside the flood (another address): not admitted",
        Worse::Higher,
        |r| (r.valid.sent - r.valid.admitted) as f64,
        count,
    ),
    (
        "guessed_rss_growth_mib",
        "guessed keys, one address: gateway RSS, peak minus before",
        Worse::Higher,
        |r| r.guessed.growth_mib(),
        mib,
    ),
    (
        "everywhere_rss_growth_mib",
        "guessed keys, each from its own address: gateway RSS, peak minus before",
        Worse::Higher,
        |r| r.everywhere.growth_mib(),
        mib,
    ),
    (
        "everywhere_401_pct",
        "guessed keys, each from its own address: answered 401",
        Worse::Higher,
        |r| r.everywhere.unauthorized as f64 / r.everywhere.sent.max(1) as f64 * 100.0,
        pct,
    ),
];

fn report(a: &Args, runs: &[Run], machine: String) -> Outcome {
    let (table, figures) = report::figures_over(runs, &FIGURES);
    let (steal, cpu) = runs_disturbance(runs.iter().map(|r| r.disturbance.as_ref()));
    let rss = |f: fn(&Run) -> &Flood| {
        runs.iter()
            .map(|r| {
                let f = f(r);
                format!(
                    "{:.1} → {:.1} → {:.1}",
                    f.rss_before as f64 / 1024.0,
                    f.rss_peak as f64 / 1024.0,
                    f.rss_after as f64 / 1024.0
                )
            })
            .collect::<Vec<_>>()
            .join("; ")
    };
    let markdown = format!(
        "### edge: a public route at {}x its per-address plan, {} guessed keys\n\n{}\n\
         Plan `{PLAN}`: {} tokens + {}/s per address group (IPv4 /32, IPv6 /64), through 2 \
         gateways sharing one Redis, {} s; the failed-keys allowance {FAILED_KEYS_BURST} + \
         {FAILED_KEYS_PER_MINUTE} a minute; guesses at {}/s, the valid client at {}/s; \
         decision budget {} ms; {} runs, each with a Redis and gateways of its own.\n\
         Gateway RSS in MiB (before → peak → after), guesses from one address: {}; from \
         one address each: {}.\n{steal}{machine}.\n",
        a.multiplier,
        a.guesses,
        table.render(),
        a.capacity,
        a.rate,
        a.duration,
        a.guess_rate,
        a.valid_rate,
        a.timeout_ms,
        runs.len(),
        rss(|r| &r.guessed),
        rss(|r| &r.everywhere),
    );
    let json = json!({
        "scenario": "edge",
        "capacity": a.capacity,
        "rate": a.rate,
        "multiplier": a.multiplier,
        "duration_s": a.duration,
        "guesses": a.guesses,
        "guess_rate": a.guess_rate,
        "valid_rate": a.valid_rate,
        "failed_keys_burst": FAILED_KEYS_BURST,
        "failed_keys_per_minute": FAILED_KEYS_PER_MINUTE,
        "timeout_ms": a.timeout_ms,
        "figures": figures,
        "runs": runs.iter().map(Run::json).collect::<Vec<_>>(),
        "cpu_per_run": cpu,
        "machine": machine,
    });
    Outcome {
        markdown,
        json,
        charts: vec![],
    }
}
