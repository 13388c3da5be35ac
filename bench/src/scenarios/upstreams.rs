//! `upstreams`: issue 32's goals, measured with tollgate and nginx side by side. Each
//! phase starts three fresh replicas ([`Faulty`]), a gateway and an nginx in front of
//! them (both with a 1 s route timeout), sends both the same load at once, and breaks a
//! replica the phase's way:
//!
//! - `dead`: one replica's port refuses connections; `--rate` GETs for `--duration`, then
//!   as many POSTs with a small body. Every 5xx is one a client saw.
//! - `hanging`: one replica accepts and reads but never answers; requests that waited
//!   the route's timeout (a `504`, or an answer that slow) and the p99 of the rest.
//! - `keepalive`: every replica closes a keep-alive connection idle for
//!   `--idle-close-ms`; `--keepalive-requests` GETs in bursts of `--keepalive-burst`, each
//!   burst sent that long (± `--keepalive-jitter-ms`) after the last answer of the one
//!   before, so it reaches the replicas as they close the proxies' pooled connections.
//! - `restart`: the replicas restart one after another (each stopped, listening again on
//!   the same port `--restart-down` later, the next stopped `--restart-gap` after that)
//!   under `--rate` GETs.
//! - `healthy`: three healthy replicas, tollgate, nginx and direct (to the replicas in
//!   turn) at `--rate` each: the added latency of a healthy route.
//!
//! nginx is configured the usual way (`proxy_next_upstream error timeout`, `max_fails=1
//! fail_timeout=10s`, 1 s to connect, the route's timeout to read, 32 keep-alive
//! connections), tollgate with its `[upstream]` defaults; see [`crate::procs::Nginx`].
//! Each phase is measured `--runs` times (run after run, each measuring every phase) and
//! reported as the median run and the worst.
//!
//! Usage: `tollgate-bench upstreams [--runs 5] [--duration 30] [--phases
//! dead,hanging,keepalive,restart,healthy]`; a smoke run (under a minute): `--runs 1
//! --duration 2 --warmup 0.5 --keepalive-requests 60 --restart-down 1 --restart-gap 0.5`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tollgate_testkit::RedisServer;

use super::seconds;
use crate::http::{get_request, Conn};
use crate::load::{percentile, Arrivals, OpenRun, Sample, Stream};
use crate::procs::{one_unlimited_client, raise_fd_limit, Gateway, Nginx};
use crate::report::{
    self, count, machine, ms, round, runs_disturbance, CpuWatch, Outcome, OverRuns, Table, Worse,
};
use crate::upstream::Faulty;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Phase {
    Dead,
    Hanging,
    Keepalive,
    Restart,
    Healthy,
}

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The phases to measure, in this order (comma-separated).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "dead,hanging,keepalive,restart,healthy"
    )]
    phases: Vec<Phase>,
    /// Requests per second to each proxy (and direct), open loop, Poisson arrivals.
    #[arg(long, default_value_t = 500.0)]
    rate: f64,
    /// Seconds measured: `dead`'s GETs and again its POSTs, `hanging`, `healthy`.
    #[arg(long, default_value = "30", value_parser = seconds)]
    duration: f64,
    /// Seconds of load before a phase's fault (not counted).
    #[arg(long, default_value = "1", value_parser = seconds)]
    warmup: f64,
    /// The route's timeout (tollgate's `timeout_ms`, nginx's `proxy_read_timeout`).
    #[arg(long, default_value_t = 1000)]
    timeout_ms: u64,
    /// `keepalive`: requests counted per proxy.
    #[arg(long, default_value_t = 1000)]
    keepalive_requests: usize,
    /// `keepalive`: requests per burst, at once, each on a keep-alive connection of its own.
    #[arg(long, default_value_t = 20)]
    keepalive_burst: usize,
    /// `keepalive`: the replicas close connections idle this long, in ms.
    #[arg(long, default_value_t = 1000)]
    idle_close_ms: u64,
    /// `keepalive`: each burst leaves within this many ms either side of the idle close.
    #[arg(long, default_value_t = 1.5)]
    keepalive_jitter_ms: f64,
    /// `restart`: seconds a replica is down.
    #[arg(long, default_value = "2", value_parser = seconds)]
    restart_down: f64,
    /// `restart`: seconds between a replica's start and the next one's stop (and before
    /// the first, and after the last).
    #[arg(long, default_value = "2", value_parser = seconds)]
    restart_gap: f64,
    /// Gateway workers, and nginx worker processes.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// Runs: each measures every phase in turn; the report gives each figure's median and
    /// worst run.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Measure tollgate alone, even when nginx is installed.
    #[arg(long)]
    no_nginx: bool,
}

const PATH: &str = "/api/items/42";
const POST_PATH: &str = "/api/items";
const KEY: &str = "bench-upstreams-key-1";
/// An answer that took this share of the route's timeout or more waited for it.
const WAITED: f64 = 0.9;
/// The replica that dies or hangs (of 0, 1, 2).
const BROKEN: usize = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Proxy {
    Tollgate,
    Nginx,
    Direct,
}

impl Proxy {
    fn name(self) -> &'static str {
        match self {
            Proxy::Tollgate => "tollgate",
            Proxy::Nginx => "nginx",
            Proxy::Direct => "direct",
        }
    }
}

/// A row of the report: a phase (or part of one) and who served it.
type Row = (&'static str, Proxy);

/// One row's figures in one run.
#[derive(Debug, Clone, Default)]
struct Tally {
    requests: u64,
    /// Answers by status; 0: no answer (a connection error, or none within 10 s).
    statuses: BTreeMap<u16, u64>,
    /// A `504`, or an answer that took [`WAITED`] of the route's timeout or longer.
    waited: u64,
    /// Of the answers that did not wait.
    p50_ms: f64,
    p99_ms: f64,
    /// Connections a replica closed for idleness with this proxy's request unread on them.
    raced: Option<u64>,
    /// nginx: `no live upstreams` in its error log (every replica set aside, `502`).
    no_live: Option<u64>,
    /// tollgate: what its `/metrics` counted meanwhile.
    gateway: Option<GatewayCounts>,
}

/// Counters of the gateway's `/metrics` (summed over labels), or how far they moved.
#[derive(Debug, Clone, Copy, Default)]
struct GatewayCounts {
    retries: f64,
    retries_refused: f64,
    ejections: f64,
    /// Requests shed by the overload protection (`503`, never the replicas').
    shed: f64,
}

impl GatewayCounts {
    fn read(gateway: &Gateway) -> anyhow::Result<GatewayCounts> {
        let m = gateway.metrics_within(Duration::from_secs(5))?;
        let sum = |name: &str| -> f64 {
            m.iter()
                .filter(|(k, _)| k.split('{').next() == Some(name))
                .map(|(_, v)| v)
                .sum::<f64>()
                + 0.0
        };
        Ok(GatewayCounts {
            retries: sum("tollgate_upstream_retries_total"),
            retries_refused: sum("tollgate_upstream_retries_refused_total"),
            ejections: sum("tollgate_upstream_ejections_total"),
            shed: sum("tollgate_shed_total"),
        })
    }

    fn since(self, before: GatewayCounts) -> GatewayCounts {
        GatewayCounts {
            retries: self.retries - before.retries,
            retries_refused: self.retries_refused - before.retries_refused,
            ejections: self.ejections - before.ejections,
            shed: self.shed - before.shed,
        }
    }

    fn json(&self) -> Value {
        json!({
            "retries": self.retries,
            "retries_refused": self.retries_refused,
            "ejections": self.ejections,
            "shed": self.shed,
        })
    }
}

impl Tally {
    fn of<'a>(samples: impl IntoIterator<Item = &'a Sample>, timeout: Duration) -> Tally {
        let mut t = Tally::default();
        let mut rest = Vec::new();
        for s in samples {
            t.requests += 1;
            *t.statuses.entry(s.status).or_default() += 1;
            // nginx's timers run on its cached clock and may fire a few ms early.
            if s.status == 504 || s.latency >= timeout.mul_f64(WAITED) {
                t.waited += 1;
            } else {
                rest.push(s.latency.as_nanos() as u64);
            }
        }
        rest.sort_unstable();
        t.p50_ms = percentile(&rest, 0.50) as f64 / 1e6;
        t.p99_ms = percentile(&rest, 0.99) as f64 / 1e6;
        t
    }

    fn server_errors(&self) -> f64 {
        // Summed whole: an empty f64 sum is -0, printed "-0".
        self.statuses
            .iter()
            .filter(|(&s, _)| s >= 500)
            .map(|(_, &n)| n)
            .sum::<u64>() as f64
    }

    fn no_answer(&self) -> f64 {
        self.statuses.get(&0).copied().unwrap_or(0) as f64
    }

    fn json(&self) -> Value {
        json!({
            "requests": self.requests,
            "statuses": self.statuses.iter().map(|(s, n)| (status_name(*s), json!(n))).collect::<serde_json::Map<_, _>>(),
            "server_errors": self.server_errors(),
            "no_answer": self.no_answer(),
            "waited": self.waited,
            "p50_ms": round(self.p50_ms, 3),
            "p99_ms": round(self.p99_ms, 3),
            "raced": self.raced,
            "nginx_no_live_upstreams": self.no_live,
            "gateway": self.gateway.map(|g| g.json()),
        })
    }
}

fn status_name(s: u16) -> String {
    if s == 0 {
        "none".into()
    } else {
        s.to_string()
    }
}

type Figure = report::Figure<Tally>;

const FIGURES: [Figure; 6] = [
    (
        "requests",
        "requests",
        Worse::Lower,
        |t| t.requests as f64,
        count,
    ),
    (
        "server_errors",
        "5xx",
        Worse::Higher,
        Tally::server_errors,
        count,
    ),
    (
        "no_answer",
        "no answer",
        Worse::Higher,
        Tally::no_answer,
        count,
    ),
    (
        "waited",
        "waited ≥ 0.9 timeout",
        Worse::Higher,
        |t| t.waited as f64,
        count,
    ),
    ("p50_ms", "p50 ms (rest)", Worse::Higher, |t| t.p50_ms, ms),
    ("p99_ms", "p99 ms (rest)", Worse::Higher, |t| t.p99_ms, ms),
];

/// A phase's proxies in front of its replicas.
struct Stand {
    replicas: Faulty,
    gateway: Gateway,
    nginx: Option<Nginx>,
}

impl Stand {
    fn start(a: &Args, redis_url: &str, idle_close: Option<Duration>) -> anyhow::Result<Stand> {
        let replicas = Faulty::start(3, idle_close)?;
        let mut config = one_unlimited_client(
            Some(redis_url.to_string()),
            replicas.urls(),
            "upstreams-client",
            KEY,
        );
        config.workers = a.workers;
        // The route with its timeout (the config builder writes none): the last table.
        let route = config.routes.pop().expect("one route");
        config
            .extra
            .push_str(&format!("{}timeout_ms = {}\n", route.toml(), a.timeout_ms));
        let gateway = Gateway::start(&config, PATH)?;
        let nginx = if a.no_nginx {
            None
        } else {
            Nginx::start_replicas(&replicas.addrs(), a.workers, timeout(a))?
        };
        Ok(Stand {
            replicas,
            gateway,
            nginx,
        })
    }

    /// The proxies measured, with their addresses.
    fn proxies(&self) -> Vec<(Proxy, SocketAddr)> {
        let mut p = vec![(Proxy::Tollgate, self.gateway.addr)];
        p.extend(self.nginx.as_ref().map(|n| (Proxy::Nginx, n.addr)));
        p
    }

    /// Adds what the replicas and nginx's log say to each row's tally of this phase, and
    /// the gateway's counters: `marks` (row, counters when it ended), in order, from the
    /// phase's start; the last row's end is now.
    fn annotate(
        &self,
        mut rows: Vec<(Row, Tally)>,
        marks: &[(&'static str, GatewayCounts)],
    ) -> anyhow::Result<Vec<(Row, Tally)>> {
        let end = GatewayCounts::read(&self.gateway)?;
        self.say_failures();
        for ((row, proxy), tally) in &mut rows {
            if *proxy == Proxy::Tollgate {
                let at = marks.iter().position(|(r, _)| r == row);
                let until = at.map_or(end, |i| marks[i].1);
                let from = match at {
                    Some(0) => GatewayCounts::default(),
                    Some(i) => marks[i - 1].1,
                    None => marks.last().map_or_else(GatewayCounts::default, |m| m.1),
                };
                tally.gateway = Some(until.since(from));
            }
            tally.raced = self.raced(*proxy);
            if *proxy == Proxy::Nginx {
                // A phase of GETs and POSTs: each row counts its own method's lines.
                let method = ["GET", "POST"]
                    .into_iter()
                    .find(|m| row.ends_with(m))
                    .map(|m| format!("request: \"{m} "));
                tally.no_live = self.nginx.as_ref().map(|n| {
                    n.error_log()
                        .lines()
                        .filter(|l| l.contains("no live upstreams"))
                        .filter(|l| method.as_ref().is_none_or(|m| l.contains(m.as_str())))
                        .count() as u64
                });
            }
        }
        Ok(rows)
    }

    /// Says on stderr why the gateway's tries failed this phase (its log's `upstream try
    /// failed` warnings, by error) and how often its retry budget refused one: what a
    /// `502` of its own is made of.
    fn say_failures(&self) {
        let log =
            std::fs::read_to_string(self.gateway.dir().join("gateway.log")).unwrap_or_default();
        let mut errors: BTreeMap<String, u64> = BTreeMap::new();
        for line in log.lines() {
            let line = &strip_ansi(line);
            if line.contains("upstream try failed") {
                // `error=...` to the end of the line (text logs) or the JSON field.
                let e = line
                    .split_once("error=")
                    .or_else(|| line.split_once("\"error\":"))
                    .map_or("?", |(_, e)| e)
                    .trim();
                *errors.entry(e.chars().take(120).collect()).or_default() += 1;
            } else if line.contains("retry refused") {
                *errors
                    .entry("(retry refused: budget spent)".into())
                    .or_default() += 1;
            }
        }
        for (e, n) in errors {
            eprintln!("    tollgate: {n} x {e}");
        }
    }

    /// How many connections the replicas closed on a request of `proxy`'s.
    fn raced(&self, proxy: Proxy) -> Option<u64> {
        let (gateway, other) = self.replicas.raced();
        match proxy {
            Proxy::Tollgate => Some(gateway),
            Proxy::Nginx => Some(other),
            Proxy::Direct => None,
        }
    }
}

/// `line` without its terminal colour sequences (`ESC [ ... m`), as the gateway's text
/// log has them.
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn timeout(a: &Args) -> Duration {
    Duration::from_millis(a.timeout_ms)
}

fn post_request(path: &str, api_key: &str) -> Vec<u8> {
    let body = br#"{"item":"upstreams","qty":1}"#;
    let mut r = format!(
        "POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nuser-agent: tollgate-bench\r\n\
         x-api-key: {api_key}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body);
    r
}

/// An open-loop part of a phase: `requests` at `--rate` to each target, Poisson, from
/// `from` to `until` seconds; counted under `row` (`None`: the warm-up).
struct Part {
    row: Option<&'static str>,
    requests: Vec<u8>,
    from: f64,
    until: f64,
}

/// Runs `parts` against every target at once, `events` acting on the schedule meanwhile
/// (it gets the run, to sleep until a point of it); each counted row's tally per target.
fn open_phase(
    a: &Args,
    targets: &[(Proxy, Vec<SocketAddr>)],
    parts: &[Part],
    seed: u64,
    events: impl FnOnce(&OpenRun) -> anyhow::Result<()>,
) -> anyhow::Result<Vec<(Row, Tally)>> {
    let mut streams = Vec::new();
    let mut rows = Vec::new();
    for (p, part) in parts.iter().enumerate() {
        for (t, (proxy, addrs)) in targets.iter().enumerate() {
            // Direct: the replicas in turn, the rate split over them.
            for (r, &addr) in addrs.iter().enumerate() {
                streams.push(Stream {
                    addr,
                    requests: vec![part.requests.clone()],
                    rate: a.rate / addrs.len() as f64,
                    arrivals: Arrivals::Poisson {
                        seed: seed * 1000 + (p * 100 + t * 10 + r) as u64,
                    },
                    from: Duration::from_secs_f64(part.from),
                    until: Duration::from_secs_f64(part.until),
                });
                rows.push(part.row.map(|row| (row, *proxy)));
            }
        }
    }
    let run = OpenRun::start(streams);
    let acted = events(&run);
    let result = run.join()?;
    acted?;
    let mut by_row: BTreeMap<Row, Vec<Sample>> = BTreeMap::new();
    for (row, samples) in rows.iter().zip(&result.samples) {
        if let Some(row) = row {
            by_row.entry(*row).or_default().extend_from_slice(samples);
        }
    }
    Ok(by_row
        .into_iter()
        .map(|(row, samples)| (row, Tally::of(&samples, timeout(a))))
        .collect())
}

fn dead(a: &Args, redis: &str, seed: u64) -> anyhow::Result<Vec<(Row, Tally)>> {
    let stand = Stand::start(a, redis, None)?;
    let (w, d) = (a.warmup, a.duration);
    let parts = [
        Part {
            row: None,
            requests: get_request(PATH, Some(KEY)),
            from: 0.0,
            until: w,
        },
        Part {
            row: Some("dead, GET"),
            requests: get_request(PATH, Some(KEY)),
            from: w,
            until: w + d,
        },
        Part {
            row: Some("dead, POST"),
            requests: post_request(POST_PATH, KEY),
            from: w + d,
            until: w + 2.0 * d,
        },
    ];
    let targets = targets(&stand);
    let mut marks = Vec::new();
    let rows = open_phase(a, &targets, &parts, seed, |run| {
        run.sleep_until(Duration::from_secs_f64(w));
        stand.replicas.stop(BROKEN)?;
        // The gateway's counters between the GETs and the POSTs.
        run.sleep_until(Duration::from_secs_f64(w + d));
        marks.push(("dead, GET", GatewayCounts::read(&stand.gateway)?));
        Ok(())
    })?;
    stand.annotate(rows, &marks)
}

fn hanging(a: &Args, redis: &str, seed: u64) -> anyhow::Result<Vec<(Row, Tally)>> {
    let stand = Stand::start(a, redis, None)?;
    let (w, d) = (a.warmup, a.duration);
    let parts = [
        Part {
            row: None,
            requests: get_request(PATH, Some(KEY)),
            from: 0.0,
            until: w,
        },
        Part {
            row: Some("hanging"),
            requests: get_request(PATH, Some(KEY)),
            from: w,
            until: w + d,
        },
    ];
    let targets = targets(&stand);
    let rows = open_phase(a, &targets, &parts, seed, |run| {
        run.sleep_until(Duration::from_secs_f64(w));
        stand.replicas.hang(BROKEN);
        Ok(())
    })?;
    stand.annotate(rows, &[])
}

fn restart(a: &Args, redis: &str, seed: u64) -> anyhow::Result<Vec<(Row, Tally)>> {
    let stand = Stand::start(a, redis, None)?;
    let (w, down, gap) = (a.warmup, a.restart_down, a.restart_gap);
    let end = w + gap + 3.0 * (down + gap);
    let parts = [
        Part {
            row: None,
            requests: get_request(PATH, Some(KEY)),
            from: 0.0,
            until: w,
        },
        Part {
            row: Some("restart"),
            requests: get_request(PATH, Some(KEY)),
            from: w,
            until: end,
        },
    ];
    let targets = targets(&stand);
    let rows = open_phase(a, &targets, &parts, seed, |run| {
        let mut t = w + gap;
        for i in 0..3 {
            run.sleep_until(Duration::from_secs_f64(t));
            stand.replicas.stop(i)?;
            run.sleep_until(Duration::from_secs_f64(t + down));
            stand.replicas.start_one(i)?;
            t += down + gap;
        }
        Ok(())
    })?;
    stand.annotate(rows, &[])
}

fn healthy(a: &Args, redis: &str, seed: u64) -> anyhow::Result<Vec<(Row, Tally)>> {
    let stand = Stand::start(a, redis, None)?;
    let (w, d) = (a.warmup, a.duration);
    let mut targets = targets(&stand);
    targets.push((Proxy::Direct, stand.replicas.addrs()));
    let parts = [
        Part {
            row: None,
            requests: get_request(PATH, Some(KEY)),
            from: 0.0,
            until: w,
        },
        Part {
            row: Some("healthy"),
            requests: get_request(PATH, Some(KEY)),
            from: w,
            until: w + d,
        },
    ];
    let rows = open_phase(a, &targets, &parts, seed, |_| Ok(()))?;
    stand.annotate(rows, &[])
}

fn targets(stand: &Stand) -> Vec<(Proxy, Vec<SocketAddr>)> {
    stand
        .proxies()
        .into_iter()
        .map(|(p, addr)| (p, vec![addr]))
        .collect()
}

fn keepalive(a: &Args, redis: &str, seed: u64) -> anyhow::Result<Vec<(Row, Tally)>> {
    let idle = Duration::from_millis(a.idle_close_ms);
    let stand = Stand::start(a, redis, Some(idle))?;
    let rounds = a.keepalive_requests.div_ceil(a.keepalive_burst.max(1));
    let jitter = Duration::from_secs_f64(a.keepalive_jitter_ms / 1e3);
    let request = get_request(PATH, Some(KEY));
    let proxies = stand.proxies();
    let burst = a.keepalive_burst.max(1);
    let samples = std::thread::Builder::new()
        .name("bench-paced".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a tokio runtime");
            rt.block_on(async move {
                let mut tasks = Vec::new();
                for (i, (proxy, addr)) in proxies.into_iter().enumerate() {
                    let request = request.clone();
                    let seed = seed * 1000 + i as u64;
                    tasks.push((
                        proxy,
                        tokio::spawn(paced(addr, request, rounds, burst, idle, jitter, seed)),
                    ));
                }
                let mut out = Vec::new();
                for (proxy, task) in tasks {
                    out.push((proxy, task.await.unwrap_or_default()));
                }
                out
            })
        })?
        .join()
        .map_err(|_| anyhow::anyhow!("the paced load thread panicked"))?;
    let rows = samples
        .into_iter()
        .map(|(proxy, samples)| (("keepalive", proxy), Tally::of(&samples, timeout(a))))
        .collect();
    stand.annotate(rows, &[])
}

/// `rounds` bursts of `burst` requests to `addr` (and one first, not counted, that opens
/// the connections), each on a keep-alive connection of its own; every burst leaves
/// `idle` ± `jitter` after the last answer of the one before, when the replicas close the
/// proxy's connections that the burst before used.
async fn paced(
    addr: SocketAddr,
    request: Vec<u8>,
    rounds: usize,
    burst: usize,
    idle: Duration,
    jitter: Duration,
    seed: u64,
) -> Vec<Sample> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let request = std::sync::Arc::new(request);
    let mut conns: Vec<Option<Conn>> = (0..burst).map(|_| None).collect();
    let start = Instant::now();
    let mut samples = Vec::new();
    let mut next = Instant::now();
    for round in 0..=rounds {
        tokio::time::sleep_until(next.into()).await;
        let mut sends = Vec::new();
        for slot in conns.iter_mut() {
            let (conn, request) = (slot.take(), std::sync::Arc::clone(&request));
            sends.push(tokio::spawn(async move {
                let sent = Instant::now();
                let (conn, status) = match tokio::time::timeout(
                    Duration::from_secs(10),
                    exchange(conn, addr, &request),
                )
                .await
                {
                    Ok((conn, status)) => (conn, status),
                    Err(_) => (None, 0),
                };
                (conn, status, sent)
            }));
        }
        let mut last = Instant::now();
        for (slot, send) in conns.iter_mut().zip(sends) {
            let (conn, status, sent) = send.await.unwrap_or((None, 0, Instant::now()));
            let now = Instant::now();
            last = now;
            *slot = conn;
            if round > 0 {
                samples.push(Sample {
                    at: sent.saturating_duration_since(start),
                    latency: now.saturating_duration_since(sent),
                    status,
                    service_marked: false,
                });
            }
        }
        let j = jitter.as_secs_f64();
        let offset = if j > 0.0 {
            rng.random_range(-j..j)
        } else {
            0.0
        };
        next = last + Duration::from_secs_f64((idle.as_secs_f64() + offset).max(0.0));
    }
    samples
}

/// One request on `conn` (or a new connection); a kept connection found closed before
/// the answer is replaced once, as the open loop does. The connection to keep, and the
/// status (0: none).
async fn exchange(conn: Option<Conn>, addr: SocketAddr, request: &[u8]) -> (Option<Conn>, u16) {
    let reused = conn.is_some();
    let mut conn = match conn {
        Some(c) => c,
        None => match Conn::connect(addr).await {
            Ok(c) => c,
            Err(_) => return (None, 0),
        },
    };
    let reply = match conn.send(request).await {
        Ok(r) => r,
        Err(_) if reused => {
            let Ok(fresh) = Conn::connect(addr).await else {
                return (None, 0);
            };
            conn = fresh;
            match conn.send(request).await {
                Ok(r) => r,
                Err(_) => return (None, 0),
            }
        }
        Err(_) => return (None, 0),
    };
    let keep = (!conn.closed).then_some(conn);
    (keep, reply.status)
}

pub fn run(a: &Args) -> anyhow::Result<Outcome> {
    anyhow::ensure!(a.runs >= 1, "--runs must be at least 1");
    anyhow::ensure!(!a.phases.is_empty(), "--phases names none");
    raise_fd_limit();
    let machine = machine();
    let nginx_missing = !a.no_nginx && Nginx::binary().is_none();
    let redis = RedisServer::start()?;
    let url = redis.url();
    eprintln!(
        "upstreams: phases {:?}, {} req/s per proxy, {} s, route timeout {} ms, {} runs ({machine})",
        a.phases, a.rate, a.duration, a.timeout_ms, a.runs
    );
    // tallies[row][run]
    let mut tallies: BTreeMap<Row, Vec<Tally>> = BTreeMap::new();
    let mut order: Vec<Row> = Vec::new();
    let mut disturbances = Vec::new();
    for run in 1..=a.runs {
        let watch = CpuWatch::start();
        for (p, &phase) in a.phases.iter().enumerate() {
            eprintln!("  run {run}/{}, {phase:?}", a.runs);
            let seed = (run * 16 + p) as u64;
            let rows = match phase {
                Phase::Dead => dead(a, &url, seed)?,
                Phase::Hanging => hanging(a, &url, seed)?,
                Phase::Keepalive => keepalive(a, &url, seed)?,
                Phase::Restart => restart(a, &url, seed)?,
                Phase::Healthy => healthy(a, &url, seed)?,
            };
            for (row, tally) in rows {
                if !order.contains(&row) {
                    order.push(row);
                }
                tallies.entry(row).or_default().push(tally);
            }
        }
        disturbances.push(watch.and_then(|w| w.stop()));
    }
    drop(redis);

    let mut header = vec!["phase", "proxy"];
    header.extend(FIGURES.iter().map(|f| f.1));
    header.extend([
        "5xx by status",
        "raced closes",
        "tollgate retries / refused / ejections / shed",
    ]);
    let mut table = Table::new(&header);
    let mut json_rows = Vec::new();
    for row in &order {
        let runs = &tallies[row];
        let mut cells = vec![row.0.to_string(), row.1.name().to_string()];
        let mut figures = serde_json::Map::new();
        for (name, _, worse, of, fmt) in FIGURES {
            let over = OverRuns::of(runs.iter().map(of).collect(), worse);
            cells.push(over.cell(fmt));
            figures.insert(name.into(), over.json(3));
        }
        // Each status seen in any run (0 in the others), median (worst).
        let mut seen: Vec<u16> = runs
            .iter()
            .flat_map(|t| t.statuses.keys().copied())
            .filter(|&s| s >= 500 || s == 0)
            .collect();
        seen.sort_unstable();
        seen.dedup();
        let mut by_status = Vec::new();
        let mut status_json = serde_json::Map::new();
        for s in seen {
            let over = OverRuns::of(
                runs.iter()
                    .map(|t| t.statuses.get(&s).copied().unwrap_or(0) as f64)
                    .collect(),
                Worse::Higher,
            );
            by_status.push(format!("{}: {}", status_name(s), over.cell(count)));
            status_json.insert(status_name(s), over.json(0));
        }
        cells.push(if by_status.is_empty() {
            "–".into()
        } else {
            by_status.join(", ")
        });
        figures.insert("statuses".into(), Value::Object(status_json));
        let raced: Vec<f64> = runs
            .iter()
            .filter_map(|t| t.raced.map(|r| r as f64))
            .collect();
        if raced.is_empty() {
            cells.push("–".into());
        } else {
            let over = OverRuns::of(raced, Worse::Lower);
            cells.push(over.cell(count));
            figures.insert("raced".into(), over.json(0));
        }
        let counts: Vec<GatewayCounts> = runs.iter().filter_map(|t| t.gateway).collect();
        if counts.is_empty() {
            cells.push("–".into());
        } else {
            let of = |f: fn(&GatewayCounts) -> f64| {
                OverRuns::of(counts.iter().map(f).collect(), Worse::Higher)
            };
            let (retries, refused, ejections, shed) = (
                of(|c| c.retries),
                of(|c| c.retries_refused),
                of(|c| c.ejections),
                of(|c| c.shed),
            );
            cells.push(
                [&retries, &refused, &ejections, &shed]
                    .map(|o| o.cell(count))
                    .join(" / "),
            );
            figures.insert(
                "gateway".into(),
                json!({
                    "retries": retries.json(0),
                    "retries_refused": refused.json(0),
                    "ejections": ejections.json(0),
                    "shed": shed.json(0),
                }),
            );
        }
        table.row(cells);
        json_rows.push(json!({
            "phase": row.0,
            "proxy": row.1.name(),
            "runs": runs.len(),
            "figures": Value::Object(figures),
            "per_run": runs.iter().map(Tally::json).collect::<Vec<_>>(),
        }));
    }
    let no_live: Vec<String> = order
        .iter()
        .filter_map(|row| {
            let runs: Vec<f64> = tallies[row]
                .iter()
                .filter_map(|t| t.no_live.map(|n| n as f64))
                .collect();
            let over = OverRuns::of(runs, Worse::Higher);
            (over.worst > 0.0).then(|| format!("{} {}", row.0, over.cell(count)))
        })
        .collect();
    let no_live = if no_live.is_empty() {
        String::new()
    } else {
        format!(
            "nginx logged `no live upstreams` (every replica set aside by `max_fails`, \
             answered `502`) in: {}. ",
            no_live.join("; ")
        )
    };
    let (per_run_cpu, per_run_cpu_json) = runs_disturbance(disturbances.iter().map(Option::as_ref));
    let spread = if a.runs > 1 {
        format!(
            "Each cell: the median of {} runs, and in parentheses the worst run's (requests \
             and raced closes: the lowest; the rest: the highest). ",
            a.runs
        )
    } else {
        String::new()
    };
    let nginx_note = if a.no_nginx {
        "nginx not measured (--no-nginx). "
    } else if nginx_missing {
        "nginx is not installed, so no nginx rows. "
    } else {
        ""
    };
    let markdown = format!(
        "### upstreams: three replicas, one broken per phase; tollgate and nginx side by side, \
         {} req/s each, route timeout {} ms, {} worker{}, {} s per phase, {} run{}\n\n{}\n\
         {spread}{nginx_note}{no_live}The last column is the gateway's own count \
         (`/metrics`) over the phase, warm-up included: tries made again, retries the \
         budget refused, replicas ejected, and requests its overload protection shed with a \
         `503` (the replicas never answer `503`). 5xx by status: `none` is a request that got no answer at all. \
         Waited: a `504`, or an answer that took 90% of the route's timeout or longer; p50 \
         and p99 are of the other answers. Raced closes: connections a replica closed for idleness \
         with the proxy's request just arrived and unread (the keep-alive race caught on the \
         replica's side; a lower bound, and only `keepalive` sets replicas to close idle \
         connections, after {} ms, while a restart closes them too). `keepalive`: {} requests \
         in bursts of {} on {} client connections, each burst {} ms ± {} ms after the last \
         answer of the one before. `restart`: each replica down {} s, {} s apart. \
         tollgate: `[upstream]` defaults (connect 1 s, idle 4 s, eject after 3 failures for \
         10 s, 3 tries, retry budget 20% / min 3, least request), on Redis. nginx: round \
         robin, `proxy_next_upstream error timeout`, `max_fails=1 fail_timeout=10s`, \
         `proxy_connect_timeout 1s`, `proxy_read_timeout` the route's timeout, `keepalive 32`. \
         {machine}.\n{per_run_cpu}",
        a.rate,
        a.timeout_ms,
        a.workers,
        if a.workers == 1 { "" } else { "s" },
        a.duration,
        a.runs,
        if a.runs == 1 { "" } else { "s" },
        table.render(),
        a.idle_close_ms,
        a.keepalive_requests,
        a.keepalive_burst,
        a.keepalive_burst,
        a.idle_close_ms,
        a.keepalive_jitter_ms,
        a.restart_down,
        a.restart_gap,
    );
    let json = json!({
        "scenario": "upstreams",
        "phases": a.phases.iter().map(|p| format!("{p:?}").to_lowercase()).collect::<Vec<_>>(),
        "rate": a.rate,
        "duration_s": a.duration,
        "warmup_s": a.warmup,
        "timeout_ms": a.timeout_ms,
        "keepalive_requests": a.keepalive_requests,
        "keepalive_burst": a.keepalive_burst,
        "idle_close_ms": a.idle_close_ms,
        "keepalive_jitter_ms": a.keepalive_jitter_ms,
        "restart_down_s": a.restart_down,
        "restart_gap_s": a.restart_gap,
        "workers": a.workers,
        "runs": a.runs,
        "nginx": !a.no_nginx && !nginx_missing,
        "rows_note": "`figures` gives the median and the worst run of each reported figure \
                      (p50/p99: of the answers that did not wait 90% of the route's timeout or more); \
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
