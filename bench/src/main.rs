//! `tollgate-bench`: the design's claims as measurements, reproducible on one machine.
//!
//! Each scenario starts what it needs itself (a `redis-server` on a free port, upstream
//! servers in this process, the release `tollgate` binary as separate processes, nginx as
//! a baseline when installed), drives load at 127.0.0.1 only, prints a Markdown table and,
//! with `--json FILE`, writes the same figures as JSON; with `--charts DIR` it also writes
//! SVG charts.
//!
//! How the pieces fit:
//! - [`load`]: the load generator. Open loop at a fixed rate, each request's latency
//!   measured from its *intended* send time (no coordinated omission), on a dispatcher
//!   thread with precise sleeps and a single-threaded runtime doing the I/O; and a closed
//!   loop for maximum throughput.
//! - [`http`]: a minimal keep-alive HTTP/1.1 client and server (the upstreams and the
//!   modelled service replicas), so the tool's own overhead stays small and predictable.
//! - [`procs`]: the gateway as the scenarios run it (the release binary, probed until it
//!   forwards), nginx and the floor proxy; `redis-server`, the config builder and the
//!   process plumbing come from `tollgate-testkit`, shared with the tests.
//! - [`scenarios`]: latency, throughput, accuracy, plans, redis, failopen, slowredis,
//!   overload, replay, upstreams, edge, protocols.
//! - [`tls`] and [`wire`]: certificates made and replaced by the tool, and requests over
//!   TLS (keep-alive or a handshake each) and HTTP/2, for `protocols`.
//! - [`report`] and [`svg`]: the table, the JSON and the charts.

mod floor;
mod http;
mod load;
mod procs;
mod report;
mod scenarios;
mod svg;
mod tls;
mod upstream;
mod wire;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Measures tollgate: added latency, throughput, accuracy, plans of several limits,
/// fail-open, a slow Redis, overload, failing replicas, the incident replay, and TLS and
/// HTTP/2.
#[derive(Debug, Parser)]
#[command(name = "tollgate-bench", version)]
struct Cli {
    /// Also write the figures as JSON to this file.
    #[arg(long, global = true, value_name = "FILE")]
    json: Option<PathBuf>,

    /// Write SVG charts into this directory (e.g. docs/bench).
    #[arg(long, global = true, value_name = "DIR")]
    charts: Option<PathBuf>,

    /// Before starting, wait up to this many seconds for the machine to be idle (under
    /// 15% CPU busy over one second), so a concurrent compile does not skew the run.
    #[arg(long, global = true, value_name = "SECONDS", default_value_t = 0)]
    wait_idle: u64,

    /// Scheduling priority for the tool and every process it starts (they inherit it).
    /// Below 0 (needs root) a concurrent compile disturbs the measurement less; the
    /// system under test and the baseline get the same priority.
    #[arg(long, global = true, value_name = "N", default_value_t = -10, allow_negative_numbers = true)]
    nice: i32,

    #[command(subcommand)]
    scenario: Scenario,
}

#[derive(Debug, Subcommand)]
enum Scenario {
    /// p50/p99/p99.9 direct to the upstream vs through the gateway (Redis mode), open loop.
    Latency(scenarios::latency::Args),
    /// Closed-loop maximum requests/s: direct, nginx (if installed) and the gateway.
    Throughput(scenarios::throughput::Args),
    /// Millions of clients (issue 36): 10 million imported into a 3-master Redis Cluster;
    /// a gateway caching the ones in use: its start, memory, first requests against held
    /// ones, a flood of made-up keys, and revocations.
    Catalog(scenarios::catalog::Args),
    /// One client at 9x its contract through N gateways x S services x R replicas.
    Accuracy(scenarios::accuracy::Args),
    /// A plan of 1 limit vs 3: Redis calls and CPU per decision, added latency (against
    /// direct and the floor proxy), and each limit's accuracy at 9x its rate.
    Plans(scenarios::plans::Args),
    /// Redis CPU per decision with 1, 1,000 and 10,000 active clients (uniform and
    /// Zipf-skewed), Redis driven through the gateway's store code alone.
    Redis(scenarios::redis::Args),
    /// Latency while Redis is stalled (SIGSTOP), before and after the breaker opens.
    Failopen(scenarios::failopen::Args),
    /// The September incident: per-service limiters only, then the edge limiter.
    Replay(scenarios::replay::Args),
    /// A slow (not stalled) Redis: fail-opens, breaker openings, throughput and p99 per
    /// injected reply delay, one hot client and a few others.
    Slowredis(scenarios::slowredis::Args),
    /// A client at 10x the gateway's capacity beside clients on a real limit: the status
    /// mix per class, the others' admitted count against their buckets, fail-opens,
    /// breaker openings and the gateway's memory.
    Overload(scenarios::overload::Args),
    /// Replicas that die, hang, close idle connections and restart, behind tollgate and
    /// nginx side by side: the 5xx, the waits and the latency each passes on (issue 32).
    Upstreams(scenarios::upstreams::Args),
    /// The edge for everyone (issue 34): a public route at 10x its per-address plan from
    /// one address and from one IPv6 /64, through two gateways; guessed keys from one
    /// address and from everywhere: the 401s, the Redis commands, the gateway's memory.
    Edge(scenarios::edge::Args),
    /// TLS and HTTP/2 (issue 35): failed requests and time to serve while the certificate
    /// is replaced under load; HTTP/2 and HTTP/1.1 over TLS beside nginx (added p50/p99,
    /// closed-loop throughput); others' p99 while one client does rapid reset.
    Protocols(scenarios::protocols::Args),
    /// Usage history (issue 37): Redis CPU per decision with usage history on vs off, two
    /// gateways on Redis servers of their own, the same load over N clients, its flushes
    /// included.
    Usage(scenarios::usage::Args),
    /// (Internal) the bare actix-web + awc proxy `throughput` measures as the stack's floor.
    #[command(hide = true)]
    Floor(floor::Args),
}

/// The allocator the gateway uses, so the floor proxy (this binary, `floor`) pays what
/// tollgate pays; the load generator and the upstreams get it too, on every side alike.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Scenario::Floor(a) = &cli.scenario {
        return match floor::run(a) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("floor proxy: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    procs::set_nice(cli.nice);
    tollgate_testkit::clean_stale_dirs();
    if cli.wait_idle > 0 {
        report::wait_idle(std::time::Duration::from_secs(cli.wait_idle));
    }
    let watch = report::CpuWatch::start();
    let result = match cli.scenario {
        Scenario::Latency(a) => scenarios::latency::run(&a),
        Scenario::Throughput(a) => scenarios::throughput::run(&a),
        Scenario::Catalog(a) => scenarios::catalog::run(&a),
        Scenario::Accuracy(a) => scenarios::accuracy::run(&a),
        Scenario::Plans(a) => scenarios::plans::run(&a),
        Scenario::Redis(a) => scenarios::redis::run(&a),
        Scenario::Failopen(a) => scenarios::failopen::run(&a),
        Scenario::Replay(a) => scenarios::replay::run(&a),
        Scenario::Slowredis(a) => scenarios::slowredis::run(&a),
        Scenario::Overload(a) => scenarios::overload::run(&a),
        Scenario::Upstreams(a) => scenarios::upstreams::run(&a),
        Scenario::Edge(a) => scenarios::edge::run(&a),
        Scenario::Protocols(a) => scenarios::protocols::run(&a),
        Scenario::Usage(a) => scenarios::usage::run(&a),
        Scenario::Floor(_) => unreachable!("handled above"),
    };
    let mut outcome = match result {
        Ok(outcome) => outcome,
        Err(e) => {
            eprintln!("tollgate-bench: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(d) = watch.and_then(|w| w.stop()) {
        outcome.markdown.push_str(&format!(
            "During the run, other processes used {:.1}% of the machine's CPU time and the \
             hypervisor stole {:.1}%.\n",
            d.other_processes * 100.0,
            d.steal * 100.0
        ));
        if let Some(obj) = outcome.json.as_object_mut() {
            for (k, v) in d.json_fields() {
                obj.insert(k.into(), v);
            }
        }
    }
    println!("{}", outcome.markdown);
    if let Some(path) = &cli.json {
        let text = serde_json::to_string_pretty(&outcome.json).expect("JSON values serialize");
        if let Err(e) = std::fs::write(path, text + "\n") {
            eprintln!("tollgate-bench: cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    }
    if let Some(dir) = &cli.charts {
        if let Err(e) = std::fs::create_dir_all(dir) {
            eprintln!("tollgate-bench: cannot create {}: {e}", dir.display());
            return ExitCode::FAILURE;
        }
        for (name, svg) in &outcome.charts {
            let path = dir.join(name);
            if let Err(e) = std::fs::write(&path, svg) {
                eprintln!("tollgate-bench: cannot write {}: {e}", path.display());
                return ExitCode::FAILURE;
            }
            eprintln!("chart: {}", path.display());
        }
    }
    ExitCode::SUCCESS
}
