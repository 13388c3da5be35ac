//! `protocols`: issue 35's goals (TLS on the listeners, HTTP/2, hardened against HTTP/2
//! attacks), measured. Every phase of every run starts fresh processes: a fast upstream
//! (this tool), the release gateway on the embedded store with one client on a plan that
//! never limits (so only the forwarding path is measured), its certificate made by this
//! tool's own CA (rcgen) into files it serves (`[tls]`, `watch_ms` at its default).
//!
//! - `reload`: `--reload-rate` GETs/s over TLS, open loop, Poisson, for the whole run:
//!   `--fresh-share` of them each on a new connection (a full handshake, no resumption),
//!   the rest on keep-alive connections. Meanwhile the certificate files are replaced
//!   `--reloads` times, `--reload-every` apart plus a shift of up to 1 s (so they fall at
//!   different points of the gateway's watch period), key then certificate, each renamed
//!   over the old, a new leaf with a new key each time; after each, new connections ask every
//!   20 ms until the new leaf is served: its time to be served (goal: within 2 s). Failed:
//!   any answer but 2xx, a connection error or no answer in 10 s (goal: none).
//! - `h2`: direct to the upstream (cleartext HTTP/1.1, the baseline), nginx with TLS
//!   (`listen ... ssl http2`, the lean proxy of [`crate::procs::Nginx`]) and tollgate with
//!   TLS, the same `--rate` to each at once, open loop: over HTTP/2 (`--h2-conns`
//!   connections each, requests spread over them as streams) and over HTTP/1.1 with TLS
//!   (keep-alive). p50/p99 from each request's intended send time, and the added latency
//!   over direct. Then, one target at a time, closed-loop throughput with `h2load` (when
//!   installed): `--closed-conns` connections, `--closed-streams` streams each for HTTP/2.
//! - `reset`: `--reset-rate` GETs/s over HTTP/2 with TLS from other clients, open loop,
//!   `--reset-duration` without an attack, then as long with one attacker doing rapid
//!   reset (CVE-2023-44487: HEADERS and RST_STREAM pairs written as fast as the socket
//!   takes them, a new connection whenever the gateway sends GOAWAY or closes, at once
//!   after one refused), from 127.0.0.2 while the others are on 127.0.0.1: the others' p99
//!   without and with, their ratio (goal: within 2x), the attacker's streams, the GOAWAYs
//!   it got and its connections refused. Two rows: the gateway as configured, then with
//!   `server.new_connections_per_address = --reset-new-connections`. The attacker thread runs at `--attacker-nice` (19: on the CPU
//!   time the rest leave, as an attacker on a host of its own).
//!
//! The gateway has `--workers` workers, nginx as many worker processes. Each figure is
//! reported as the median run and the worst of `--runs`.
//!
//! Usage: `tollgate-bench protocols [--runs 5] [--phases reload,h2,reset]`; a smoke run:
//! `--runs 1 --reloads 2 --reload-every 2 --duration 3 --closed-duration 2
//! --reset-duration 2`.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tollgate_testkit::h2_frames::{
    hpack, push_frame, CANCEL, END_HEADERS, END_STREAM, GOAWAY, HEADERS, PREFACE, RST_STREAM,
    SETTINGS,
};
use tollgate_testkit::temp_dir;

use super::seconds;
use crate::http::{get_request, Conn};
use crate::load::{percentile, Arrivals, OpenRun, Sample, Stream};
use crate::procs::{block_on, one_unlimited_client, raise_fd_limit, Gateway, Nginx, PROBE_KEY};
use crate::report::{
    count, machine, ms, round, runs_disturbance, CpuWatch, Outcome, OverRuns, Table, Worse,
};
use crate::tls::{self, Ca, CertFiles};
use crate::upstream::{Server, Upstreams};
use crate::wire::Wire;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Phase {
    Reload,
    H2,
    Reset,
}

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The phases to measure, in this order (comma-separated).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "reload,h2,reset"
    )]
    phases: Vec<Phase>,
    /// Runs: each measures every phase with fresh processes; the report gives each
    /// figure's median and worst run.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Gateway workers, and nginx worker processes.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// Seconds of load before anything is measured.
    #[arg(long, default_value = "1", value_parser = seconds)]
    warmup: f64,
    /// `reload`: requests per second over TLS, open loop.
    #[arg(long, default_value_t = 500.0)]
    reload_rate: f64,
    /// `reload`: the share of those on a new connection each (the rest keep-alive).
    #[arg(long, default_value_t = 0.5)]
    fresh_share: f64,
    /// `reload`: how many times the certificate is replaced.
    #[arg(long, default_value_t = 10)]
    reloads: usize,
    /// `reload`: seconds between replacements (and after the last).
    #[arg(long, default_value = "3", value_parser = seconds)]
    reload_every: f64,
    /// `h2`: requests per second to each target and protocol, open loop.
    #[arg(long, default_value_t = 500.0)]
    rate: f64,
    /// `h2`: seconds measured, open loop.
    #[arg(long, default_value = "20", value_parser = seconds)]
    duration: f64,
    /// `h2` and `reset`: HTTP/2 connections per target, the requests spread over them.
    #[arg(long, default_value_t = 16)]
    h2_conns: usize,
    /// `h2`: seconds of closed loop per target (after a 1 s warm-up), with h2load.
    #[arg(long, default_value = "10", value_parser = seconds)]
    closed_duration: f64,
    /// `h2`: h2load's connections (`-c`).
    #[arg(long, default_value_t = 16)]
    closed_conns: usize,
    /// `h2`: h2load's streams at once per HTTP/2 connection (`-m`).
    #[arg(long, default_value_t = 8)]
    closed_streams: usize,
    /// `reset`: the other clients' requests per second, HTTP/2 over TLS, open loop.
    #[arg(long, default_value_t = 500.0)]
    reset_rate: f64,
    /// `reset`: seconds without the attack, then as many with it. At 500 req/s a p99 over
    /// 10 s is the 50th slowest request, so one stall of 0.1 s on the host sets it (seen:
    /// p99s of 0.6 to 3.1 ms without any attack); over 30 s it takes three.
    #[arg(long, default_value = "30", value_parser = seconds)]
    reset_duration: f64,
    /// `reset`: the attacker thread's nice value. At 19 it gets only CPU time the gateway,
    /// the upstream and the other clients leave: an attacker on a host of its own, which
    /// on 2 cores would otherwise take most of one from them (in development runs on a
    /// quiet host, at the tool's own nice it used 70% of a core and the others' p99 rose
    /// 5x; at 19, with as many streams written, under 2x). Set it to the tool's `--nice`
    /// to have it compete as an equal.
    #[arg(long, default_value_t = 19, allow_negative_numbers = true)]
    attacker_nice: i32,
    /// `reset`: a second row with `server.new_connections_per_address` at this (0: none).
    #[arg(long, default_value_t = 20)]
    reset_new_connections: u32,
}

const PATH: &str = "/api/items/42";
const KEY: &str = "bench-protocols-key-1";
/// The reload goal: a new certificate served within this.
const SERVED_GOAL: Duration = Duration::from_secs(2);

/// One row's figures in one run, by name.
type Figures = BTreeMap<&'static str, f64>;

/// Each row's figures, one per run.
type PerRun = BTreeMap<String, Vec<Figures>>;

/// A figure a table shows: (name, header, which way is worse, the cell's format).
type Column = (&'static str, &'static str, Worse, fn(f64) -> String);

/// The samples' failures (not 2xx: an error status, a connection error or no answer),
/// count, p50 and p99 in ms, into `f`.
fn tally(f: &mut Figures, samples: &[&Sample]) {
    let mut ns: Vec<u64> = samples
        .iter()
        .map(|s| s.latency.as_nanos() as u64)
        .collect();
    ns.sort_unstable();
    f.insert("requests", samples.len() as f64);
    f.insert(
        "failed",
        samples
            .iter()
            .filter(|s| !(200..300).contains(&s.status))
            .count() as f64,
    );
    f.insert("p50_ms", percentile(&ns, 0.50) as f64 / 1e6);
    f.insert("p99_ms", percentile(&ns, 0.99) as f64 / 1e6);
}

/// How late the open loop's dispatcher woke for its requests, p99 in ms: the generator's
/// own precision (a run where it is late by milliseconds was disturbed, on the tool's side
/// or the host's).
fn late_ms(result: &crate::load::OpenResult) -> f64 {
    result.dispatch_late_p99.as_secs_f64() * 1e3
}

/// A fast upstream, a CA, its first leaf in files, and the gateway serving them.
struct Stand {
    upstream: Upstreams,
    ca: Ca,
    files: CertFiles,
    gateway: Gateway,
    _dir: tollgate_testkit::TempDir,
}

impl Stand {
    /// `server`: more `[server]` settings, TOML lines.
    fn start(a: &Args, server: &str) -> anyhow::Result<Stand> {
        let upstream = Upstreams::start(vec![Server::Fast(Default::default())])?;
        let ca = Ca::new()?;
        let dir = temp_dir("protocols")?;
        let files = CertFiles::write(dir.path(), "gateway", &ca.leaf()?)?;
        let mut config = one_unlimited_client(None, upstream.urls(), "protocols-client", KEY);
        config.workers = a.workers;
        config.server = server.to_owned();
        config.extra.push_str(&files.toml());
        let h1 = ca.client(&[b"http/1.1"])?;
        let gateway = Gateway::start_probed(&config, |addr| {
            block_on(async {
                let Ok(tls) = tls::connect(addr, &h1).await else {
                    return false;
                };
                let mut conn = Conn::over(tls);
                matches!(conn.send(&get_request(PATH, Some(PROBE_KEY))).await, Ok(r) if r.status == 200)
            })
        })?;
        Ok(Stand {
            upstream,
            ca,
            files,
            gateway,
            _dir: dir,
        })
    }
}

/// `get_request` asking the server to close after its answer.
fn closing_request(path: &str, key: &str) -> Vec<u8> {
    let mut r = get_request(path, Some(key));
    r.truncate(r.len() - 2);
    r.extend_from_slice(b"connection: close\r\n\r\n");
    r
}

fn poisson(addr: SocketAddr, request: Vec<u8>, rate: f64, seed: u64, until: f64) -> Stream {
    Stream {
        addr,
        requests: vec![request],
        rate,
        arrivals: Arrivals::Poisson { seed },
        from: Duration::ZERO,
        until: Duration::from_secs_f64(until),
    }
}

/// How long `reload` asks for a new leaf before recording it as not served.
fn poll_limit(a: &Args) -> Duration {
    let until_next = a.reload_every - (a.reload_every / 2.0).min(1.0);
    Duration::from_secs_f64((SERVED_GOAL.as_secs_f64() + 0.5).max(until_next - 0.05))
}

const RELOAD_COLUMNS: [Column; 9] = [
    ("requests", "requests", Worse::Lower, count),
    ("failed", "failed", Worse::Higher, count),
    (
        "failed_keepalive",
        "failed, keep-alive",
        Worse::Higher,
        count,
    ),
    ("failed_fresh", "failed, new conn.", Worse::Higher, count),
    ("served_p50_ms", "served in, median ms", Worse::Higher, ms),
    ("served_max_ms", "served in, worst ms", Worse::Higher, ms),
    ("not_served_2s", "not served in 2 s", Worse::Higher, count),
    ("p99_keepalive_ms", "p99 ms keep-alive", Worse::Higher, ms),
    ("p99_fresh_ms", "p99 ms new conn.", Worse::Higher, ms),
];

fn reload(a: &Args, seed: u64) -> anyhow::Result<Vec<(String, Figures)>> {
    let stand = Stand::start(a, "")?;
    // Made before the run, so making them does not take the CPU from it.
    let leaves = (0..a.reloads)
        .map(|_| stand.ca.leaf())
        .collect::<anyhow::Result<Vec<_>>>()?;
    let h1 = stand.ca.client(&[b"http/1.1"])?;
    let end = a.warmup + a.reloads as f64 * a.reload_every + a.reload_every;
    let addr = stand.gateway.addr;
    let fresh = a.reload_rate * a.fresh_share.clamp(0.0, 1.0);
    let streams = vec![
        poisson(
            addr,
            get_request(PATH, Some(KEY)),
            a.reload_rate - fresh,
            seed * 10,
            end,
        ),
        poisson(addr, closing_request(PATH, KEY), fresh, seed * 10 + 1, end),
    ];
    let wires = vec![Wire::Tls(Arc::clone(&h1)), Wire::TlsFresh(Arc::clone(&h1))];
    let run = OpenRun::start_wired(streams, wires);
    let mut served = Vec::new();
    let acted = (|| -> anyhow::Result<()> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        for (i, leaf) in leaves.iter().enumerate() {
            // Each replacement at another point of the gateway's watch period (the golden
            // ratio's multiples spread over up to 1 s): replacements whole periods apart
            // would all wait the same.
            let shift = (i as f64 * 0.618_034).fract() * (a.reload_every / 2.0).min(1.0);
            let at = a.warmup + i as f64 * a.reload_every + shift;
            run.sleep_until(Duration::from_secs_f64(at));
            stand.files.replace(leaf)?;
            let replaced = Instant::now();
            // Asked until served, for up to half of the time to the next replacement
            // past 2 s; one not served by then is recorded at that wait.
            let give_up = replaced + poll_limit(a);
            let mut took = None;
            while Instant::now() < give_up {
                let asked = rt.block_on(async {
                    tokio::time::timeout(Duration::from_secs(1), tls::served_leaf(addr, &h1)).await
                });
                if matches!(&asked, Ok(Ok(der)) if *der == leaf.der) {
                    took = Some(replaced.elapsed());
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            served.push(took);
        }
        Ok(())
    })();
    let result = run.join()?;
    acted?;
    let measured = |s: &&Sample| s.at >= Duration::from_secs_f64(a.warmup);
    let keepalive: Vec<&Sample> = result.samples[0].iter().filter(measured).collect();
    let fresh: Vec<&Sample> = result.samples[1].iter().filter(measured).collect();
    let mut f = Figures::new();
    let all: Vec<&Sample> = keepalive.iter().chain(&fresh).copied().collect();
    tally(&mut f, &all);
    let mut k = Figures::new();
    tally(&mut k, &keepalive);
    let mut n = Figures::new();
    tally(&mut n, &fresh);
    f.insert("failed_keepalive", k["failed"]);
    f.insert("failed_fresh", n["failed"]);
    f.insert("p99_keepalive_ms", k["p99_ms"]);
    f.insert("p99_fresh_ms", n["p99_ms"]);
    let times: Vec<f64> = served
        .iter()
        .map(|t| t.unwrap_or(poll_limit(a)).as_secs_f64() * 1e3)
        .collect();
    f.insert("served_p50_ms", crate::report::median(&times));
    f.insert("served_max_ms", times.iter().copied().fold(0.0, f64::max));
    f.insert(
        "never_served",
        served.iter().filter(|t| t.is_none()).count() as f64,
    );
    f.insert(
        "not_served_2s",
        times
            .iter()
            .filter(|&&t| t > SERVED_GOAL.as_secs_f64() * 1e3)
            .count() as f64,
    );
    f.insert("reloads", served.len() as f64);
    f.insert("generator_late_p99_ms", late_ms(&result));
    drop(stand);
    Ok(vec![("reload".into(), f)])
}

const H2_COLUMNS: [Column; 8] = [
    ("requests", "requests", Worse::Lower, count),
    ("failed", "failed", Worse::Higher, count),
    ("p50_ms", "p50 ms", Worse::Higher, ms),
    ("p99_ms", "p99 ms", Worse::Higher, ms),
    ("added_p50_ms", "added p50 ms", Worse::Higher, ms),
    ("added_p99_ms", "added p99 ms", Worse::Higher, ms),
    ("closed_rps", "closed loop req/s", Worse::Lower, count),
    (
        "generator_late_p99_ms",
        "generator late p99 ms",
        Worse::Higher,
        ms,
    ),
];

/// What `h2` measures: (row, target address, wire, h2load's URL and flags).
struct Target {
    row: &'static str,
    addr: SocketAddr,
    wire: Wire,
    h2load: Vec<String>,
}

fn h2(a: &Args, seed: u64) -> anyhow::Result<Vec<(String, Figures)>> {
    let stand = Stand::start(a, "")?;
    let nginx = Nginx::start_tls(
        stand.upstream.addrs[0],
        a.workers,
        &stand.files.cert,
        &stand.files.key,
    )?;
    let h1 = stand.ca.client(&[b"http/1.1"])?;
    let h2c = stand.ca.client(&[b"h2"])?;
    let h2 = Wire::H2 {
        config: h2c,
        conns: a.h2_conns,
    };
    let (c, m) = (a.closed_conns.to_string(), a.closed_streams.to_string());
    let h1_flags = |url: String| vec![url, "--h1".into(), "-c".into(), c.clone()];
    let h2_flags = |url: String| vec![url, "-c".into(), c.clone(), "-m".into(), m.clone()];
    let mut targets = vec![Target {
        row: "direct, HTTP/1.1",
        addr: stand.upstream.addrs[0],
        wire: Wire::Http1,
        h2load: h1_flags(format!("http://{}{PATH}", stand.upstream.addrs[0])),
    }];
    let mut proxies = vec![("tollgate", stand.gateway.addr)];
    proxies.extend(nginx.as_ref().map(|n| ("nginx", n.addr)));
    for (name, addr) in proxies {
        let url = format!("https://{addr}{PATH}");
        targets.push(Target {
            row: if name == "tollgate" {
                "tollgate, HTTP/2 + TLS"
            } else {
                "nginx, HTTP/2 + TLS"
            },
            addr,
            wire: h2.clone(),
            h2load: h2_flags(url.clone()),
        });
        targets.push(Target {
            row: if name == "tollgate" {
                "tollgate, HTTP/1.1 + TLS"
            } else {
                "nginx, HTTP/1.1 + TLS"
            },
            addr,
            wire: Wire::Tls(Arc::clone(&h1)),
            h2load: h1_flags(url),
        });
    }
    let end = a.warmup + a.duration;
    let streams = targets
        .iter()
        .enumerate()
        .map(|(i, t)| {
            poisson(
                t.addr,
                get_request(PATH, Some(KEY)),
                a.rate,
                seed * 10 + i as u64,
                end,
            )
        })
        .collect();
    let wires = targets.iter().map(|t| t.wire.clone()).collect();
    let result = OpenRun::start_wired(streams, wires).join()?;
    let mut rows: Vec<(String, Figures)> = Vec::new();
    for (t, samples) in targets.iter().zip(&result.samples) {
        let measured: Vec<&Sample> = samples
            .iter()
            .filter(|s| s.at >= Duration::from_secs_f64(a.warmup))
            .collect();
        let mut f = Figures::new();
        tally(&mut f, &measured);
        f.insert("generator_late_p99_ms", late_ms(&result));
        rows.push((t.row.into(), f));
    }
    let (base50, base99) = (rows[0].1["p50_ms"], rows[0].1["p99_ms"]);
    for (_, f) in rows.iter_mut().skip(1) {
        f.insert("added_p50_ms", f["p50_ms"] - base50);
        f.insert("added_p99_ms", f["p99_ms"] - base99);
    }
    if let Some(bin) = h2load() {
        for (t, (_, f)) in targets.iter().zip(rows.iter_mut()) {
            if let Some(rps) = closed_loop(&bin, a, t)? {
                f.insert("closed_rps", rps);
            }
        }
    }
    drop(nginx);
    drop(stand);
    Ok(rows)
}

fn h2load() -> Option<std::path::PathBuf> {
    ["/usr/bin/h2load", "/usr/local/bin/h2load"]
        .iter()
        .map(std::path::PathBuf::from)
        .find(|p| p.is_file())
}

/// h2load against one target: its requests per second over the window, `None` when
/// some failed (said on stderr).
fn closed_loop(bin: &std::path::Path, a: &Args, t: &Target) -> anyhow::Result<Option<f64>> {
    let out = tollgate_testkit::command(bin)
        .args(&t.h2load)
        .args(["-H", &format!("x-api-key: {KEY}")])
        .args(["-t", "1", "--warm-up-time", "1", "-D"])
        .arg(format!("{}", a.closed_duration.ceil() as u64))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .output()
        .context("running h2load")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let rps = text
        .lines()
        .find_map(|l| l.strip_prefix("finished in "))
        .and_then(|l| l.split(", ").nth(1))
        .and_then(|v| v.trim_end_matches(" req/s").parse::<f64>().ok());
    let failed = text
        .lines()
        .find_map(|l| l.strip_prefix("requests: "))
        .map(|l| {
            l.split(", ")
                .filter(|p| {
                    p.ends_with(" failed") || p.ends_with(" errored") || p.ends_with(" timeout")
                })
                .filter_map(|p| p.split(' ').next()?.parse::<u64>().ok())
                .sum::<u64>()
        });
    let non_2xx = text
        .lines()
        .find_map(|l| l.strip_prefix("status codes: "))
        .map(|l| {
            l.split(", ")
                .filter(|p| !p.ends_with(" 2xx"))
                .filter_map(|p| p.split(' ').next()?.parse::<u64>().ok())
                .sum::<u64>()
        });
    match (rps, failed, non_2xx) {
        (Some(rps), Some(0), Some(0)) => Ok(Some(rps)),
        _ => {
            eprintln!(
                "    h2load on {} did not finish cleanly:\n{text}{}",
                t.row,
                String::from_utf8_lossy(&out.stderr)
            );
            Ok(None)
        }
    }
}

const RESET_COLUMNS: [Column; 12] = [
    ("requests", "others' requests", Worse::Lower, count),
    ("failed", "others failed", Worse::Higher, count),
    ("p99_without_ms", "p99 ms without", Worse::Higher, ms),
    ("p99_with_ms", "p99 ms with attack", Worse::Higher, ms),
    ("p99_ratio", "ratio", Worse::Higher, ratio),
    (
        "attack_streams",
        "attacker streams written",
        Worse::Lower,
        count,
    ),
    (
        "attack_taken",
        "taken up by the gateway",
        Worse::Higher,
        count,
    ),
    ("attack_goaways", "GOAWAYs", Worse::Lower, count),
    ("attack_conns", "attacker connections", Worse::Lower, count),
    (
        "attack_refused",
        "refused before a handshake",
        Worse::Lower,
        count,
    ),
    (
        "attack_cpu_pct",
        "attacker CPU % of a core",
        Worse::Higher,
        count,
    ),
    (
        "generator_late_p99_ms",
        "generator late p99 ms",
        Worse::Higher,
        ms,
    ),
];

fn ratio(v: f64) -> String {
    format!("{v:.2}x")
}

/// The attacker's address: to the gateway, a client of its own (the others are on
/// 127.0.0.1).
const ATTACKER: std::net::IpAddr = std::net::IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 2));

/// Both rows of `reset`: the gateway as configured by default, then with
/// `server.new_connections_per_address`.
fn resets(a: &Args, seed: u64) -> anyhow::Result<Vec<(String, Figures)>> {
    let mut rows = vec![("rapid reset".to_owned(), reset(a, seed, "")?)];
    if a.reset_new_connections > 0 {
        let n = a.reset_new_connections;
        let server = format!("new_connections_per_address = {n}\n");
        rows.push((
            format!("rapid reset, {n} new connections/s per address"),
            reset(a, seed, &server)?,
        ));
    }
    Ok(rows)
}

fn reset(a: &Args, seed: u64, server: &str) -> anyhow::Result<Figures> {
    let stand = Stand::start(a, server)?;
    let addr = stand.gateway.addr;
    let h2c = stand.ca.client(&[b"h2"])?;
    let (w, d) = (a.warmup, a.reset_duration);
    let streams = vec![poisson(
        addr,
        get_request(PATH, Some(KEY)),
        a.reset_rate,
        seed * 10,
        w + 2.0 * d,
    )];
    let wires = vec![Wire::H2 {
        config: Arc::clone(&h2c),
        conns: a.h2_conns,
    }];
    let run = OpenRun::start_wired(streams, wires);
    let attack = (|| -> anyhow::Result<Attack> {
        run.sleep_until(Duration::from_secs_f64(w + d));
        let until = run.start + Duration::from_secs_f64(w + 2.0 * d);
        let config = Arc::clone(&h2c);
        let attacker_nice = a.attacker_nice;
        std::thread::Builder::new()
            .name("bench-attacker".into())
            .spawn(move || {
                // SAFETY: gettid has no preconditions; setpriority on this thread alone
                // (Linux applies PRIO_PROCESS with a thread id to that thread).
                unsafe {
                    let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
                    libc::setpriority(libc::PRIO_PROCESS, tid, attacker_nice);
                }
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a tokio runtime")
                    .block_on(async {
                        let mut attack = rapid_reset(addr, config, until).await;
                        attack.cpu_s = thread_cpu_seconds();
                        attack
                    })
            })?
            .join()
            .map_err(|_| anyhow::anyhow!("the attacker panicked"))
    })();
    let result = run.join()?;
    let attack = attack?;
    let (from, split) = (Duration::from_secs_f64(w), Duration::from_secs_f64(w + d));
    let without: Vec<&Sample> = result.samples[0]
        .iter()
        .filter(|s| s.at >= from && s.at < split)
        .collect();
    let with: Vec<&Sample> = result.samples[0].iter().filter(|s| s.at >= split).collect();
    let mut f = Figures::new();
    let all: Vec<&Sample> = without.iter().chain(&with).copied().collect();
    tally(&mut f, &all);
    let (mut wo, mut wi) = (Figures::new(), Figures::new());
    tally(&mut wo, &without);
    tally(&mut wi, &with);
    f.insert("p99_without_ms", wo["p99_ms"]);
    f.insert("p99_with_ms", wi["p99_ms"]);
    f.insert("p99_ratio", wi["p99_ms"] / wo["p99_ms"].max(1e-9));
    f.insert("failed_without", wo["failed"]);
    f.insert("failed_with", wi["failed"]);
    f.insert("attack_streams", attack.streams as f64);
    f.insert("attack_taken", attack.taken as f64);
    f.insert("attack_goaways", attack.goaways as f64);
    f.insert("attack_conns", attack.conns as f64);
    f.insert("attack_refused", attack.refused as f64);
    f.insert("attack_cpu_pct", attack.cpu_s / d * 100.0);
    f.insert("generator_late_p99_ms", late_ms(&result));
    drop(stand);
    Ok(f)
}

/// What the attacker did.
#[derive(Debug, Default)]
struct Attack {
    /// Streams opened and reset at once, written to the socket (some after the gateway
    /// had stopped reading: the kernel buffers them).
    streams: u64,
    /// Of those, the ones the gateway took up before closing: the last stream id of each
    /// GOAWAY, as a count of client streams.
    taken: u64,
    /// GOAWAY frames the gateway sent it.
    goaways: u64,
    /// TLS connections it made.
    conns: u64,
    /// Connections the gateway reset before their handshake, or held unanswered past the
    /// attacker's 1 s wait for one.
    refused: u64,
    /// CPU seconds its thread used: on a 2-core host, time the gateway and the other
    /// clients could not have.
    cpu_s: f64,
}

/// CPU seconds (user + system) the calling thread has used, from `/proc` (0 when it
/// cannot be read).
fn thread_cpu_seconds() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let Ok(stat) = std::fs::read_to_string("/proc/thread-self/stat") else {
        return 0.0;
    };
    // After the command name (in parentheses): utime and stime are the 12th and 13th.
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let at = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (at(11) + at(12)) / hz
}

/// HEADERS + RST_STREAM pairs per write.
const BURST: u32 = 100;

/// A `GET` of [`PATH`] with the client's key, as a header block.
fn request_block() -> Vec<u8> {
    hpack(&[
        (":method", "GET"),
        (":scheme", "https"),
        (":path", PATH),
        (":authority", tls::HOST),
        ("x-api-key", KEY),
    ])
}

/// Rapid reset until `until`: on each connection, HEADERS and RST_STREAM pairs in bursts
/// of [`BURST`] as fast as the socket takes them, while its frames are read; a new
/// connection once the gateway sends GOAWAY or closes.
async fn rapid_reset(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
    until: Instant,
) -> Attack {
    let mut attack = Attack::default();
    let block = request_block();
    let until = tokio::time::Instant::from_std(until);
    while tokio::time::Instant::now() < until {
        let connect = tls::connect_from(ATTACKER, addr, &config);
        let tls = match tokio::time::timeout(Duration::from_secs(1), connect).await {
            Ok(Ok(tls)) if tls.get_ref().1.alpn_protocol() == Some(b"h2") => tls,
            // Refused: at once again, as an attacker would.
            Ok(Err(_)) => {
                attack.refused += 1;
                tokio::task::yield_now().await;
                continue;
            }
            // Held unanswered (a refused connection, until its reset), or not h2.
            _ => {
                attack.refused += 1;
                continue;
            }
        };
        attack.conns += 1;
        let (mut rd, mut wr) = tokio::io::split(tls);
        let closed = Rc::new(Cell::new(false));
        let goaways = Rc::new(Cell::new(0u64));
        let sent = Rc::new(Cell::new(0u64));
        // The streams the gateway says it took up (its GOAWAY's last stream id).
        let taken = Rc::new(Cell::new(0u64));
        let reader = {
            let (closed, goaways, taken) =
                (Rc::clone(&closed), Rc::clone(&goaways), Rc::clone(&taken));
            async move {
                let mut buf = Vec::new();
                let mut chunk = vec![0u8; 64 * 1024];
                let deadline = until + Duration::from_millis(500);
                loop {
                    match tokio::time::timeout_at(deadline, rd.read(&mut chunk)).await {
                        Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
                        _ => break,
                    }
                    let mut at = 0;
                    while buf.len() >= at + 9 {
                        let len = (usize::from(buf[at]) << 16)
                            | (usize::from(buf[at + 1]) << 8)
                            | usize::from(buf[at + 2]);
                        if buf.len() < at + 9 + len {
                            break;
                        }
                        if buf[at + 3] == GOAWAY && len >= 8 {
                            goaways.set(goaways.get() + 1);
                            let last = u32::from_be_bytes(
                                buf[at + 9..at + 13].try_into().expect("four bytes"),
                            ) & 0x7fff_ffff;
                            taken.set(u64::from(last).div_ceil(2));
                        }
                        at += 9 + len;
                    }
                    buf.drain(..at);
                }
                closed.set(true);
            }
        };
        let writer = {
            let (closed, sent) = (Rc::clone(&closed), Rc::clone(&sent));
            let block = &block;
            async move {
                let mut hello = PREFACE.to_vec();
                push_frame(&mut hello, SETTINGS, 0, 0, &[]);
                if wr.write_all(&hello).await.is_err() {
                    return;
                }
                let mut stream = 1u32;
                let mut burst = Vec::new();
                // The reader sets `closed` once the gateway closes (after its GOAWAY).
                while !closed.get()
                    && tokio::time::Instant::now() < until
                    && stream < (1 << 31) - 2 * BURST
                {
                    burst.clear();
                    for _ in 0..BURST {
                        push_frame(&mut burst, HEADERS, END_STREAM | END_HEADERS, stream, block);
                        push_frame(&mut burst, RST_STREAM, 0, stream, &CANCEL.to_be_bytes());
                        stream += 2;
                    }
                    match tokio::time::timeout(Duration::from_secs(1), wr.write_all(&burst)).await {
                        Ok(Ok(())) => sent.set(sent.get() + u64::from(BURST)),
                        _ => break,
                    }
                    // The socket takes bursts long after the gateway stopped reading (the
                    // kernel buffers them): let the reader see its GOAWAY between bursts,
                    // rather than only once the buffer is full.
                    tokio::task::yield_now().await;
                }
                let _ = wr.shutdown().await;
            }
        };
        tokio::join!(reader, writer);
        attack.streams += sent.get();
        attack.goaways += goaways.get();
        attack.taken += taken.get();
    }
    attack
}

/// One phase's table: a row per row name, each column's median (worst) over the runs.
fn table(columns: &[Column], order: &[String], runs: &PerRun) -> (String, Value) {
    let mut header = vec!["row"];
    header.extend(columns.iter().map(|c| c.1));
    let mut t = Table::new(&header);
    let mut json_rows = Vec::new();
    for row in order {
        let per_run = &runs[row];
        let mut cells = vec![row.clone()];
        let mut figures = serde_json::Map::new();
        for &(name, _, worse, fmt) in columns {
            let values: Vec<f64> = per_run
                .iter()
                .filter_map(|f| f.get(name).copied())
                .collect();
            if values.is_empty() {
                cells.push("–".into());
                continue;
            }
            let over = OverRuns::of(values, worse);
            cells.push(over.cell(fmt));
            figures.insert(name.into(), over.json(3));
        }
        t.row(cells);
        json_rows.push(json!({
            "row": row,
            "figures": Value::Object(figures),
            "per_run": per_run.iter().map(|f| {
                f.iter().map(|(k, v)| (k.to_string(), json!(round(*v, 3)))).collect::<serde_json::Map<_, _>>()
            }).collect::<Vec<_>>(),
        }));
    }
    (t.render(), Value::Array(json_rows))
}

pub fn run(a: &Args) -> anyhow::Result<Outcome> {
    anyhow::ensure!(a.runs >= 1, "--runs must be at least 1");
    anyhow::ensure!(!a.phases.is_empty(), "--phases names none");
    anyhow::ensure!(a.reload_every > 0.5, "--reload-every must be over 0.5 s");
    raise_fd_limit();
    let machine = machine();
    eprintln!(
        "protocols: phases {:?}, {} runs ({machine})",
        a.phases, a.runs
    );
    let mut results: BTreeMap<Phase, (Vec<String>, PerRun)> = BTreeMap::new();
    let mut disturbances = Vec::new();
    for run in 1..=a.runs {
        let watch = CpuWatch::start();
        for (p, &phase) in a.phases.iter().enumerate() {
            eprintln!("  run {run}/{}, {phase:?}", a.runs);
            let seed = (run * 16 + p) as u64;
            let rows = match phase {
                Phase::Reload => reload(a, seed)?,
                Phase::H2 => h2(a, seed)?,
                Phase::Reset => resets(a, seed)?,
            };
            let (order, runs) = results.entry(phase).or_default();
            for (row, f) in rows {
                if !order.contains(&row) {
                    order.push(row.clone());
                }
                runs.entry(row).or_default().push(f);
            }
        }
        disturbances.push(watch.and_then(|w| w.stop()));
    }
    let (per_run_cpu, per_run_cpu_json) = runs_disturbance(disturbances.iter().map(Option::as_ref));
    let spread = if a.runs > 1 {
        format!(
            "Each cell: the median of {} runs, and in parentheses the worst run's (requests, \
             throughput and the attacker's counts: the lowest; the rest: the highest). ",
            a.runs
        )
    } else {
        String::new()
    };
    let mut markdown = format!(
        "### protocols: TLS, HTTP/2 and rapid reset (issue 35), {} run{}, {} worker{}\n\n",
        a.runs,
        if a.runs == 1 { "" } else { "s" },
        a.workers,
        if a.workers == 1 { "" } else { "s" },
    );
    let mut json_phases = serde_json::Map::new();
    for (phase, (order, runs)) in &results {
        let (columns, title, note): (&[Column], &str, String) = match phase {
            Phase::Reload => (
                &RELOAD_COLUMNS,
                "reload",
                format!(
                    "{} req/s over TLS, open loop (Poisson), {:.0}% each on a new connection \
                     (a full handshake, no resumption, `connection: close`), the rest on \
                     keep-alive connections, HTTP/1.1; the certificate files replaced {} \
                     times, {} s apart plus a shift of up to 1 s (the golden ratio's multiples, so each \
                     falls at another point of the gateway's watch period; key then certificate, each renamed over the old, a new \
                     leaf and key each time), `tls.watch_ms` at its default (1000). Served in: \
                     from the certificate's rename to the first new connection served the new \
                     leaf (asked every 20 ms; one never served is counted at the wait given up \
                     after, {:.1} s); the median and worst of the {} replacements of a run \
                     (goal: within 2 s). Failed: any answer but 2xx, a connection error, \
                     or none in 10 s (goal: none), from the end of a {} s warm-up.",
                    a.reload_rate,
                    a.fresh_share * 100.0,
                    a.reloads,
                    a.reload_every,
                    poll_limit(a).as_secs_f64(),
                    a.reloads,
                    a.warmup
                ),
            ),
            Phase::H2 => (
                &H2_COLUMNS,
                "h2",
                format!(
                    "{} req/s to each row's target at once, open loop (Poisson), {} s after a {} s \
                     warm-up; latency from each request's intended send time; added: over \
                     direct's. HTTP/2: {} connections per target, each request a stream on the \
                     next. nginx: `listen ... ssl http2`, keep-alive to the upstream, no access \
                     log, {} worker process{}. Generator late: how late the tool's dispatcher \
                     woke for a request, p99 (milliseconds here: the run was disturbed, \
                     every row alike). Closed loop: h2load alone on one target at a time, {} connections ({} streams each for HTTP/2), 1 s warm-up, {} s.",
                    a.rate,
                    a.duration,
                    a.warmup,
                    a.h2_conns,
                    a.workers,
                    if a.workers == 1 { "" } else { "es" },
                    a.closed_conns,
                    a.closed_streams,
                    a.closed_duration.ceil()
                ),
            ),
            Phase::Reset => (
                &RESET_COLUMNS,
                "reset",
                format!(
                    "Other clients: {} req/s over HTTP/2 with TLS ({} connections), open loop, \
                     {} s without an attack, then {} s with one attacker connection doing rapid \
                     reset (HEADERS + RST_STREAM(CANCEL) pairs, {} per write, as fast as the \
                     socket takes them; a new connection after each GOAWAY or close, and at once after a \
                     connection reset before its handshake), from 127.0.0.2 (the others: \
                     127.0.0.1): the gateway as configured by default, then with \
                     `server.new_connections_per_address = {}`. Ratio: \
                     p99 with / without (goal: within 2x). Streams written: to the socket, \
                     some after the gateway had stopped reading (the kernel buffers them until \
                     the attacker reads the GOAWAY, which it looks for after every write); \
                     attacker CPU: its thread's (in this tool, at nice {}: {}); taken up: the streams each GOAWAY says the gateway had begun \
                     (its last stream id), summed over the attacker's connections.",
                    a.reset_rate,
                    a.h2_conns,
                    a.reset_duration,
                    a.reset_duration,
                    BURST,
                    a.reset_new_connections,
                    a.attacker_nice,
                    if a.attacker_nice >= 19 {
                        "it runs on CPU time the gateway, the upstream and the other clients \
                         leave, as an attacker on a host of its own would"
                    } else {
                        "it competes for the 2 cores with the gateway and the other clients"
                    }
                ),
            ),
        };
        let (text, rows) = table(columns, order, runs);
        markdown.push_str(&format!("#### {title}\n\n{text}\n{note}\n\n"));
        json_phases.insert(title.into(), rows);
    }
    markdown.push_str(&format!(
        "{spread}Each phase of each run starts its own upstream, gateway (embedded store, \
         one client on a plan that never limits) and nginx; certificates from the tool's own \
         CA (ECDSA P-256), clients verify them. {machine}.\n{per_run_cpu}"
    ));
    let json = json!({
        "scenario": "protocols",
        "phases": a.phases.iter().map(|p| format!("{p:?}").to_lowercase()).collect::<Vec<_>>(),
        "runs": a.runs,
        "workers": a.workers,
        "warmup_s": a.warmup,
        "reload_rate": a.reload_rate,
        "fresh_share": a.fresh_share,
        "reloads": a.reloads,
        "reload_every_s": a.reload_every,
        "rate": a.rate,
        "duration_s": a.duration,
        "h2_conns": a.h2_conns,
        "closed_duration_s": a.closed_duration.ceil(),
        "closed_conns": a.closed_conns,
        "closed_streams": a.closed_streams,
        "reset_rate": a.reset_rate,
        "reset_duration_s": a.reset_duration,
        "attacker_nice": a.attacker_nice,
        "results": Value::Object(json_phases),
        "per_run_cpu": per_run_cpu_json,
        "machine": machine,
    });
    Ok(Outcome {
        markdown,
        json,
        charts: Vec::new(),
    })
}
