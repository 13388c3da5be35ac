//! `catalog`: millions of clients (issue 36), measured on a 3-master Redis Cluster.
//!
//! Once: `--clients` clients (10 million) are loaded with `tollgate import` (its time, and
//! the store's memory per client, summed over the masters). Then `--runs` runs, each with a
//! gateway of its own in `--mode` (`cache`: `catalog.mode = "cache"`; `mirror` to compare,
//! at sizes a mirror holds):
//!
//! - **start**: from the process's spawn to its first forwarded request;
//! - **first requests**: `--active` clients (100,000, spread over the catalog) each send
//!   one request, open loop at `--rate`/s: in cache mode each is a key not held (one store
//!   read); **cached**: the same requests again. The difference of their p99s is what a
//!   miss adds, against a Redis round trip's p99 measured beside (`PING`, the catalog's
//!   master);
//! - **resident set** with the active clients held;
//! - **unknown keys**: `--unknown` distinct made-up keys (1 million) over
//!   `--unknown-seconds` (60), beside the active clients at `--working-rate`/s: the store
//!   reads they cost, how often an active client had to be read again (the working set's
//!   hit rate), its p99, the made-up keys a late worker shed unread (`503`), and the
//!   resident set's peak. The failed-keys count per address is
//!   off (`edge.failed_keys_sets = 0`), as if the keys came from as many addresses as it
//!   holds: with it on, one address is answered `429` after 20 keys, with no store read;
//! - **revocation**: `--revocations` active clients lose their key through the store (as
//!   the admin API writes it); how long until the gateway refuses it, asked every 2 ms,
//!   against `catalog.refresh_ms`.

use std::io::{BufWriter, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use secrecy::SecretString;
use serde_json::{json, Value};
use tollgate::domain::{Bucket, Limits, PlanName};
use tollgate::store::records::{Audit, CatalogWrite, Condition, PlanRecord};
use tollgate::store::{Keys, Store};
use tollgate_testkit::{GatewayConfig, RedisCluster, RouteDef};

use super::{seconds, summary_json, MetricsDelta};
use crate::http::get_request;
use crate::load::{Arrivals, OpenRun, Stream, Summary};
use crate::procs::{block_on, gateway_config, raise_fd_limit, rss_kib, Gateway, RssWatch};
use crate::report::{
    self, count, machine, mib, ms, round, runs_disturbance, CpuWatch, Disturbance, Hiccup, Hiccups,
    Outcome, Worse,
};
use crate::upstream::{Counts, Server, Upstreams};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Clients in the store.
    #[arg(long, default_value_t = 10_000_000)]
    clients: usize,
    /// Clients in use during a run (each sends a first request, then more).
    #[arg(long, default_value_t = 100_000)]
    active: usize,
    /// Open-loop rate of the first and the cached requests (requests/s).
    #[arg(long, default_value_t = 5_000.0)]
    rate: f64,
    /// Distinct made-up keys sent during the unknown-keys phase.
    #[arg(long, default_value_t = 1_000_000)]
    unknown: usize,
    /// Seconds the made-up keys are spread over.
    #[arg(long, default_value = "60", value_parser = seconds)]
    unknown_seconds: f64,
    /// The active clients' rate beside the made-up keys (requests/s).
    #[arg(long, default_value_t = 1_000.0)]
    working_rate: f64,
    /// Keys revoked per run (each timed).
    #[arg(long, default_value_t = 5)]
    revocations: usize,
    /// Runs, each with a gateway of its own (the store is loaded once).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// `catalog.mode` of the measured gateway: `cache` or `mirror`.
    #[arg(long, default_value = "cache")]
    mode: String,
    /// `catalog.refresh_ms`.
    #[arg(long, default_value_t = 1000)]
    refresh_ms: u64,
    /// `catalog.cached_clients` (cache mode).
    #[arg(long, default_value_t = 100_000)]
    cached_clients: u64,
    /// `catalog.unknown_keys` (cache mode).
    #[arg(long, default_value_t = 100_000)]
    unknown_keys: u64,
    /// `catalog.key_filter_mib` (cache mode; 0: no key filter, every key not held read).
    #[arg(long, default_value_t = 16)]
    key_filter_mib: u64,
    /// No `catalog.cache_file` (its snapshots and journal), to see what writing it costs.
    #[arg(long)]
    no_cache_file: bool,
    /// Beside each pass, a `PING` every millisecond to each master, printed with each slow
    /// window (a silent Redis told from a gateway that does not read). Off by default: its
    /// three threads and 3,000 calls a second load the host being measured.
    #[arg(long)]
    ping_redis: bool,
}

/// The plan every client is on: never refuses.
const PLAN: &str = "unlimited";
/// Clients per import chunk.
const CHUNK: &str = "1000";

fn client_id(i: usize) -> String {
    format!("c{i:08}")
}

fn client_key(i: usize) -> String {
    format!("bench-catalog-key-{i:08}")
}

/// The `n` active clients, spread evenly over the catalog's `total`.
fn active(n: usize, total: usize) -> Vec<usize> {
    let stride = (total / n.max(1)).max(1);
    (0..n.min(total)).map(|i| i * stride).collect()
}

/// What the store cost, measured once.
struct Loaded {
    import_s: f64,
    bytes_per_client: f64,
}

/// One run's figures.
struct Run {
    start_s: f64,
    first: Summary,
    cached: Summary,
    rtt_p99_ms: f64,
    rss_idle_mib: f64,
    rss_warm_mib: f64,
    rss_flood_peak_mib: f64,
    /// Store reads for the made-up keys, per key sent.
    unknown_reads_per_key: f64,
    unknown_401_pct: f64,
    /// Made-up keys the key filter refused without a read.
    unknown_filtered_pct: f64,
    /// Made-up keys answered `503` (shed by a late worker, or a read that failed).
    unknown_503_pct: f64,
    /// Active clients read again during the flood, per active request (0: all held).
    working_misses_pct: f64,
    working: Summary,
    revocations_ms: Vec<f64>,
    lookups_first: f64,
    /// The store reads of the first requests (`tollgate_catalog_lookup_seconds`): the
    /// histogram's smallest bound holding 99% of them.
    first_read_p99_ms: f64,
    /// p99 of the first and the held requests sent outside the host's pauses (see [`Pass`]).
    first_clear_p99_ms: f64,
    held_clear_p99_ms: f64,
    /// The host's pauses of at least [`PAUSE`] during the first requests, and the longest.
    first_pauses: usize,
    first_pause_max_ms: f64,
    /// Requests not answered 200: first, held, the working set during the flood.
    first_failed: usize,
    /// Of the first requests' 503s: shed unread (`tollgate_shed_total{reason="lookup"}`),
    /// and reads that failed (`tollgate_catalog_lookups_total{result="failed"}`).
    first_shed: f64,
    first_reads_failed: f64,
    cached_failed: usize,
    working_failed: usize,
    disturbance: Option<Disturbance>,
}

pub fn run(a: &Args) -> anyhow::Result<Outcome> {
    anyhow::ensure!(
        a.mode == "cache" || a.mode == "mirror",
        "--mode is cache or mirror"
    );
    anyhow::ensure!(
        a.active >= 1 && a.active <= a.clients,
        "--active within --clients"
    );
    anyhow::ensure!(a.revocations <= a.active, "--revocations at most --active");
    raise_fd_limit();
    let machine = machine();
    eprintln!(
        "catalog: {} clients, {} active, mode {}, {} runs ({machine})",
        a.clients, a.active, a.mode, a.runs
    );
    let cluster = RedisCluster::start()?;
    // The store's connections live on this runtime, for the whole scenario.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let store = rt.block_on(async { cluster_store(&cluster) })?;
    let loaded = load(a, &rt, &cluster, &store)?;
    let counts = Arc::new(Counts::default());
    let upstreams = Upstreams::start(vec![Server::Fast(counts)])?;
    let mut runs = Vec::new();
    for i in 0..a.runs {
        eprintln!("run {}/{}", i + 1, a.runs);
        let watch = CpuWatch::start();
        let mut run = one_run(a, i, &rt, &cluster, &store, &upstreams.urls())?;
        run.disturbance = watch.and_then(|w| w.stop());
        runs.push(run);
    }
    Ok(report(a, &loaded, &runs, machine))
}

fn cluster_store(cluster: &RedisCluster) -> anyhow::Result<Store> {
    let nodes: Vec<SecretString> = cluster.urls().into_iter().map(SecretString::from).collect();
    Store::cluster(&nodes, Duration::from_secs(5), Keys::new("tollgate:"))
        .map_err(|e| anyhow::anyhow!("the cluster store: {e}"))
}

/// Creates the plan, writes the file and imports it; the store's memory per client.
fn load(
    a: &Args,
    rt: &tokio::runtime::Runtime,
    cluster: &RedisCluster,
    store: &Store,
) -> anyhow::Result<Loaded> {
    rt.block_on(async {
        store
            .catalog
            .write(
                &CatalogWrite::PutPlan(
                    PlanRecord::new(
                        PlanName::parse(PLAN)?,
                        &Limits::single(Bucket::new(1e9, 1e9)?),
                        None,
                    ),
                    Condition::Any,
                ),
                &Audit::new("bench", "plan.put"),
            )
            .await?;
        anyhow::Ok(())
    })?;
    let dir = tollgate_testkit::temp_dir("bench-catalog")?;
    let file = dir.path().join("clients.jsonl");
    {
        let mut out = BufWriter::with_capacity(1 << 20, std::fs::File::create(&file)?);
        for i in 0..a.clients {
            writeln!(
                out,
                "{{\"id\":\"{}\",\"plan\":\"{PLAN}\",\"keys\":[{{\"key\":\"{}\"}}]}}",
                client_id(i),
                client_key(i)
            )?;
        }
        out.flush()?;
    }
    let config = dir.path().join("import.toml");
    std::fs::write(
        &config,
        // Cache mode's key filter is built before the first chunk, and takes each key.
        format!(
            "[redis]\ncluster_nodes = {:?}\n[catalog]\nmode = \"{}\"\nkey_filter_mib = {}\n",
            cluster.urls(),
            a.mode,
            a.key_filter_mib
        ),
    )?;
    let before = used_memory(cluster)?;
    eprintln!("  importing {} clients", a.clients);
    let started = Instant::now();
    let out = std::process::Command::new(crate::procs::tollgate_binary()?)
        .arg("--config")
        .arg(&config)
        .arg("import")
        .arg(&file)
        .arg("--chunk")
        .arg(CHUNK)
        .env("RUST_LOG", "warn")
        .output()?;
    let import_s = started.elapsed().as_secs_f64();
    anyhow::ensure!(
        out.status.success(),
        "tollgate import failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("  {}", String::from_utf8_lossy(&out.stdout).trim());
    std::fs::remove_file(&file)?;
    let after = used_memory(cluster)?;
    Ok(Loaded {
        import_s,
        bytes_per_client: (after - before) as f64 / a.clients as f64,
    })
}

/// `used_memory` summed over the cluster's nodes.
fn used_memory(cluster: &RedisCluster) -> anyhow::Result<u64> {
    let mut total = 0;
    for node in &cluster.nodes {
        let info: String = redis::cmd("INFO").arg("memory").query(&mut node.conn()?)?;
        total += info
            .lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .context("used_memory")?;
    }
    Ok(total)
}

fn one_run(
    a: &Args,
    run: usize,
    rt: &tokio::runtime::Runtime,
    cluster: &RedisCluster,
    store: &Store,
    upstreams: &[String],
) -> anyhow::Result<Run> {
    let mut config: GatewayConfig = gateway_config(
        None,
        vec![RouteDef {
            service: "api".into(),
            prefix: "/api".into(),
            upstreams: upstreams.to_vec(),
        }],
    );
    config.redis_url = None;
    config.timeout_ms = None;
    config.plans.clear();
    config.extra = format!(
        "[redis]\ncluster_nodes = {:?}\ntimeout_ms = 5\n[edge]\nfailed_keys_sets = 0\n",
        cluster.urls()
    );
    // The probe client's plan (declared in the configuration, seeded at start).
    config.plans.push(tollgate_testkit::PlanDef {
        name: PLAN.into(),
        capacity: 1e9,
        rate: 1e9,
    });
    for c in &mut config.clients {
        c.plan = PLAN.into();
    }
    let refresh = a.refresh_ms.to_string();
    let (cached_clients, unknown_keys) = (a.cached_clients.to_string(), a.unknown_keys.to_string());
    let key_filter = a.key_filter_mib.to_string();
    // Warnings, unless the bench's own `RUST_LOG` says more (its log is quoted when first
    // requests fail).
    let log_filter = std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into());
    let env = [
        ("TOLLGATE__CATALOG__MODE", a.mode.as_str()),
        ("TOLLGATE__CATALOG__REFRESH_MS", refresh.as_str()),
        ("TOLLGATE__CATALOG__CACHED_CLIENTS", cached_clients.as_str()),
        ("TOLLGATE__CATALOG__UNKNOWN_KEYS", unknown_keys.as_str()),
        ("TOLLGATE__CATALOG__KEY_FILTER_MIB", key_filter.as_str()),
        ("RUST_LOG", log_filter.as_str()),
    ];
    let no_cache_file = [("TOLLGATE__CATALOG__CACHE_FILE", "")];
    let env: Vec<(&str, &str)> = if a.no_cache_file {
        env.iter().chain(&no_cache_file).copied().collect()
    } else {
        env.to_vec()
    };
    let started = Instant::now();
    let gw = Gateway::start_env(&config, "/api/probe", &env)?;
    let start_s = started.elapsed().as_secs_f64();
    let pid = gw.child.id();
    let rss_idle_mib = rss_kib(pid).unwrap_or(0) as f64 / 1024.0;
    eprintln!("  started in {start_s:.2} s, {rss_idle_mib:.0} MiB");

    // First requests, then the same again (held).
    let active_ids = active(a.active, a.clients);
    let requests: Vec<Vec<u8>> = active_ids
        .iter()
        .map(|&i| get_request("/api/x", Some(&client_key(i))))
        .collect();
    let pass = |requests: Vec<Vec<u8>>| -> anyhow::Result<Pass> {
        let n = requests.len() as f64;
        let open = OpenRun::start(vec![Stream {
            addr: gw.addr,
            requests,
            rate: a.rate,
            arrivals: Arrivals::Poisson { seed: 36 },
            from: Duration::ZERO,
            until: Duration::from_secs_f64(n / a.rate),
        }]);
        let meter = Hiccups::start(open.start);
        let stores = cluster
            .nodes
            .iter()
            .filter(|_| a.ping_redis)
            .map(|n| Hiccups::start_redis(open.start, n.port).map(|m| (n.port, m)))
            .collect::<std::io::Result<Vec<_>>>()?;
        let result = open.join()?;
        let hiccups = meter.stop();
        let stores: Vec<(u16, Vec<Hiccup>)> = stores
            .into_iter()
            .map(|(port, m)| (port, m.stop()))
            .collect();
        let samples = &result.samples[0];
        let failed = samples.iter().filter(|s| s.status != 200).count();
        slow_windows(samples, &hiccups, &stores);
        if failed > 0 {
            let mut statuses = std::collections::BTreeMap::new();
            for s in samples.iter().filter(|s| s.status != 200) {
                *statuses.entry(s.status).or_insert(0usize) += 1;
            }
            eprintln!("  {failed} of {} not 200: {statuses:?}", samples.len());
        }
        Ok(Pass::of(samples, failed, &hiccups))
    };
    let before = gw.metrics()?;
    latency_monitor(cluster)?;
    let first_pass = pass(requests.clone())?;
    let (first, first_failed) = (first_pass.summary, first_pass.failed);
    let first_delta = MetricsDelta {
        before,
        after: gw.metrics()?,
    };
    let lookups_first = first_delta.of("tollgate_catalog_lookups_total{result=\"client\"}");
    // Why first requests were answered 503: shed unread, or a read that failed (the
    // store's answer later than `catalog.lookup_timeout_ms`, or an error).
    let first_read_p99_ms = read_p99_bound_ms(&first_delta);
    let first_shed = first_delta.of("tollgate_shed_total{reason=\"lookup\"}");
    let first_reads_failed = first_delta.of("tollgate_catalog_lookups_total{result=\"failed\"}");
    let moved: Vec<String> = first_delta
        .after
        .keys()
        .filter(|k| {
            k.starts_with("tollgate_fail_open_reasons_total")
                || k.starts_with("tollgate_store_errors_total")
        })
        .filter(|k| first_delta.of(k) > 0.0)
        .map(|k| format!("{k} +{}", first_delta.of(k)))
        .collect();
    if !moved.is_empty() {
        eprintln!("  during the first requests: {}", moved.join(", "));
    }
    if first_failed > 0 {
        eprintln!("  503s: {first_shed} shed unread, {first_reads_failed} reads failed");
        // The first two lines of each kind the gateway logged (its `RUST_LOG` is the
        // bench's own): what it said about the reads that failed, and around them.
        let log = std::fs::read_to_string(gw.dir().join("gateway.log")).unwrap_or_default();
        let mut kinds = std::collections::HashMap::<String, usize>::new();
        for line in log.lines() {
            // The message, without its time and fields.
            let kind: String = line.chars().skip(40).take(60).collect();
            let seen = kinds.entry(kind).or_default();
            *seen += 1;
            if *seen <= 2 {
                eprintln!("  gateway: {line}");
            }
        }
        eprintln!(
            "  redis stalls (LATENCY LATEST, >= 5 ms): {}",
            latency_latest(cluster)?
        );
    }
    let held_pass = pass(requests)?;
    let (cached, cached_failed) = (held_pass.summary, held_pass.failed);
    let rss_warm_mib = rss_kib(pid).unwrap_or(0) as f64 / 1024.0;
    let rtt_p99_ms = ping_p99_ms(cluster)?;
    eprintln!(
        "  first p99 {:.3} ms, cached p99 {:.3} ms, redis rtt p99 {rtt_p99_ms:.3} ms, {rss_warm_mib:.0} MiB",
        first.p99_ms, cached.p99_ms
    );

    // Made-up keys beside the working set.
    let unknown: Vec<Vec<u8>> = (0..a.unknown)
        .map(|i| get_request("/api/x", Some(&format!("bench-made-up-{run}-{i:09}"))))
        .collect();
    let working: Vec<Vec<u8>> = active_ids
        .iter()
        .map(|&i| get_request("/api/x", Some(&client_key(i))))
        .collect();
    let window = Duration::from_secs_f64(a.unknown_seconds);
    let before = gw.metrics()?;
    let rss = RssWatch::start(pid, Duration::from_millis(250));
    let flood = OpenRun::start(vec![
        Stream {
            addr: gw.addr,
            requests: unknown,
            rate: a.unknown as f64 / a.unknown_seconds,
            arrivals: Arrivals::Poisson { seed: 361 },
            from: Duration::ZERO,
            until: window,
        },
        Stream {
            addr: gw.addr,
            requests: working,
            rate: a.working_rate,
            arrivals: Arrivals::Poisson { seed: 362 },
            from: Duration::ZERO,
            until: window,
        },
    ])
    .join()?;
    let peak = rss.stop().into_iter().max().unwrap_or(0);
    let delta = MetricsDelta {
        before,
        after: gw.metrics()?,
    };
    let sent_unknown = flood.samples[0].len() as f64;
    let unknown_401 = flood.samples[0].iter().filter(|s| s.status == 401).count() as f64;
    let unknown_503 = flood.samples[0].iter().filter(|s| s.status == 503).count() as f64;
    let working_sent = flood.samples[1].len() as f64;
    let working_ok = flood.samples[1].iter().filter(|s| s.status == 200).count();
    let unknown_reads = delta.of("tollgate_catalog_lookups_total{result=\"unknown\"}");
    let filtered = delta.of("tollgate_catalog_keys_filtered_total");
    let working_reads = delta.of("tollgate_catalog_lookups_total{result=\"client\"}");
    eprintln!(
        "  flood: {sent_unknown} made-up keys, {unknown_reads} store reads, {working_reads} active re-reads"
    );

    // Revocations, each timed from the write's answer to the first refusal.
    let mut revocations_ms = Vec::new();
    for r in 0..a.revocations {
        // A client beside the active ones (made active by `revoke`), so that a later run's
        // first requests do not meet this run's revoked keys.
        let i = active_ids[(r * 7919 + run * 104_729) % active_ids.len()];
        let i = if a.clients > a.active { i + 1 } else { i };
        revocations_ms.push(revoke(rt, store, gw.addr, i)?);
    }
    eprintln!("  revoked in {revocations_ms:?} ms");
    Ok(Run {
        start_s,
        first,
        cached,
        rtt_p99_ms,
        rss_idle_mib,
        rss_warm_mib,
        rss_flood_peak_mib: peak as f64 / 1024.0,
        unknown_reads_per_key: unknown_reads / sent_unknown.max(1.0),
        unknown_filtered_pct: filtered / sent_unknown.max(1.0) * 100.0,
        unknown_401_pct: unknown_401 / sent_unknown.max(1.0) * 100.0,
        unknown_503_pct: unknown_503 / sent_unknown.max(1.0) * 100.0,
        working_misses_pct: working_reads / working_sent.max(1.0) * 100.0,
        working: Summary::of(&flood.samples[1]),
        revocations_ms,
        lookups_first,
        first_clear_p99_ms: first_pass.clear_p99_ms,
        first_read_p99_ms,
        first_pauses: first_pass.pauses,
        first_pause_max_ms: first_pass.pause_max_ms,
        held_clear_p99_ms: held_pass.clear_p99_ms,
        first_failed,
        first_shed,
        first_reads_failed,
        cached_failed,
        working_failed: working_sent as usize - working_ok,
        disturbance: None,
    })
}

/// Makes client `i` active (one request, so the gateway holds it), revokes its key through
/// the store (as the admin API writes it) and asks the gateway every 2 ms until it refuses
/// the key: the milliseconds from the write's answer.
fn revoke(
    rt: &tokio::runtime::Runtime,
    store: &Store,
    gateway: SocketAddr,
    i: usize,
) -> anyhow::Result<f64> {
    let id = client_id(i);
    let key = client_key(i);
    let status = block_on(crate::http::fetch(gateway, "/api/x", Some(&key))).map(|(s, _)| s)?;
    anyhow::ensure!(
        status == 200,
        "client {id} answered {status} before its revocation"
    );
    let written = rt.block_on(async {
        let current = store
            .catalog
            .client(&id)
            .await?
            .context("an active client")?;
        let mut rec = current.value;
        rec.keys.clear();
        store
            .catalog
            .write(
                &CatalogWrite::PutClient(rec, Condition::Rev(current.rev)),
                &Audit::new("bench", "key.revoke"),
            )
            .await?;
        anyhow::Ok(Instant::now())
    })?;
    loop {
        let status = block_on(crate::http::fetch(gateway, "/api/x", Some(&key)))
            .map(|(s, _)| s)
            .unwrap_or(0);
        if status == 401 {
            return Ok(written.elapsed().as_secs_f64() * 1000.0);
        }
        anyhow::ensure!(
            written.elapsed() < Duration::from_secs(30),
            "client {id}'s revoked key still answered {status} after 30 s"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A Redis round trip's p99 (ms): 20,000 `PING`s, one at a time, to each node; the worst
/// node's.
/// The smallest bound of `tollgate_catalog_lookup_seconds` holding 99% of the reads in
/// `delta` (ms; infinite when the last bound holds fewer, 0 without reads).
fn read_p99_bound_ms(delta: &MetricsDelta) -> f64 {
    let count = delta.of("tollgate_catalog_lookup_seconds_count");
    if count <= 0.0 {
        return 0.0;
    }
    let mut bounds: Vec<(f64, &String)> = delta
        .after
        .keys()
        .filter_map(|k| {
            let le = k
                .strip_prefix("tollgate_catalog_lookup_seconds_bucket{le=\"")?
                .strip_suffix("\"}")?;
            Some((le.parse::<f64>().ok()?, k))
        })
        .collect();
    bounds.sort_by(|a, b| a.0.total_cmp(&b.0));
    bounds
        .iter()
        .find(|(_, series)| delta.of(series) >= 0.99 * count)
        .map_or(f64::INFINITY, |(b, _)| b * 1e3)
}

/// Host pauses of at least this long mark their 100 ms window, and the next, as paused.
const PAUSE: Duration = Duration::from_millis(10);

/// The 100 ms windows (from the run's start) a pause of at least [`PAUSE`] touched, and
/// the window after each (the backlog it left).
fn paused_windows(hiccups: &[Hiccup]) -> std::collections::BTreeSet<u128> {
    hiccups
        .iter()
        .filter(|h| h.late >= PAUSE)
        .flat_map(|h| {
            let from = h.ended.saturating_sub(h.late).as_millis() / 100;
            from..=h.ended.as_millis() / 100 + 1
        })
        .collect()
}

/// One pass of requests: its latencies, and the host's pauses meanwhile.
struct Pass {
    summary: Summary,
    failed: usize,
    /// p99 of the requests sent outside [`paused_windows`]: what the gateway adds when the
    /// host does not stop it.
    clear_p99_ms: f64,
    /// Pauses of at least [`PAUSE`], and the longest.
    pauses: usize,
    pause_max_ms: f64,
}

impl Pass {
    fn of(samples: &[crate::load::Sample], failed: usize, hiccups: &[Hiccup]) -> Pass {
        let paused = paused_windows(hiccups);
        let clear = samples
            .iter()
            .filter(|s| !paused.contains(&(s.at.as_millis() / 100)));
        Pass {
            summary: Summary::of(samples),
            failed,
            clear_p99_ms: Summary::of(clear).p99_ms,
            pauses: hiccups.iter().filter(|h| h.late >= PAUSE).count(),
            pause_max_ms: hiccups
                .iter()
                .map(|h| h.late.as_secs_f64() * 1e3)
                .fold(0.0, f64::max),
        }
    }
}

/// Prints the 100 ms windows of a pass whose worst answer took over 20 ms, or that had
/// answers other than 200 (at most 12), with the host's pauses in them: when in the pass
/// the tail came, and whether the host had stopped.
fn slow_windows(
    samples: &[crate::load::Sample],
    hiccups: &[Hiccup],
    stores: &[(u16, Vec<Hiccup>)],
) {
    let mut windows = std::collections::BTreeMap::<u128, (usize, usize, Duration)>::new();
    for s in samples {
        let w = windows.entry(s.at.as_millis() / 100).or_default();
        w.0 += 1;
        w.1 += usize::from(s.status != 200);
        w.2 = w.2.max(s.latency);
    }
    let slow: Vec<String> = windows
        .iter()
        .filter(|(_, w)| w.1 > 0 || w.2 > Duration::from_millis(20))
        .take(12)
        .map(|(at, (n, bad, worst))| {
            let paused = hiccups
                .iter()
                .filter(|h| (h.ended.as_millis() / 100).abs_diff(*at) <= 1)
                .map(|h| h.late.as_secs_f64() * 1e3)
                .fold(0.0, f64::max);
            // Each master's slowest `PING` near the window (5 ms or more).
            let redis: Vec<String> = stores
                .iter()
                .filter_map(|(port, seen)| {
                    let worst = seen
                        .iter()
                        .filter(|h| (h.ended.as_millis() / 100).abs_diff(*at) <= 1)
                        .map(|h| h.late.as_secs_f64() * 1e3)
                        .fold(0.0, f64::max);
                    (worst > 0.0).then(|| format!("{port} {worst:.0} ms"))
                })
                .collect();
            format!(
                "{:.1}s: {n} sent, {bad} not 200, worst {:.1} ms, host paused {paused:.0} ms, redis PING {}",
                *at as f64 / 10.0,
                worst.as_secs_f64() * 1e3,
                match (stores.is_empty(), redis.is_empty()) {
                    (true, _) => "not measured".into(),
                    (false, true) => "< 5 ms".into(),
                    (false, false) => redis.join(" "),
                }
            )
        })
        .collect();
    if !slow.is_empty() {
        eprintln!("  slow windows: {}", slow.join("; "));
    }
}

/// Every master records its own stalls of 5 ms or more from now on (`LATENCY`).
fn latency_monitor(cluster: &RedisCluster) -> anyhow::Result<()> {
    for node in &cluster.nodes {
        let mut conn = node.conn()?;
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("latency-monitor-threshold")
            .arg(5)
            .query(&mut conn)?;
        let _: () = redis::cmd("LATENCY").arg("RESET").query(&mut conn)?;
    }
    Ok(())
}

/// The stalls each master recorded since [`latency_monitor`]: `port event max_ms`.
fn latency_latest(cluster: &RedisCluster) -> anyhow::Result<String> {
    let mut out = Vec::new();
    for node in &cluster.nodes {
        let events: Vec<(String, u64, u64, u64)> = redis::cmd("LATENCY")
            .arg("LATEST")
            .query(&mut node.conn()?)?;
        for (event, _, _, max_ms) in events {
            out.push(format!("{} {event} {max_ms} ms", node.port));
        }
    }
    Ok(if out.is_empty() {
        "none".into()
    } else {
        out.join(", ")
    })
}

fn ping_p99_ms(cluster: &RedisCluster) -> anyhow::Result<f64> {
    let mut worst = 0.0f64;
    for node in &cluster.nodes {
        let mut conn = TcpStream::connect(("127.0.0.1", node.port))?;
        conn.set_nodelay(true)?;
        let mut ns = Vec::with_capacity(20_000);
        let mut buf = [0u8; 7];
        for _ in 0..20_000 {
            let t = Instant::now();
            conn.write_all(b"PING\r\n")?;
            conn.read_exact(&mut buf)?;
            ns.push(t.elapsed().as_nanos() as u64);
        }
        ns.sort_unstable();
        worst = worst.max(crate::load::percentile(&ns, 0.99) as f64 / 1e6);
    }
    Ok(worst)
}

type Figure = report::Figure<Run>;

fn secs(v: f64) -> String {
    format!("{v:.2} s")
}

fn share(v: f64) -> String {
    format!("{v:.3}%")
}

fn per_key(v: f64) -> String {
    format!("{v:.3}")
}

const FIGURES: [Figure; 26] = [
    (
        "start_s",
        "start, spawn to first forwarded request",
        Worse::Higher,
        |r| r.start_s,
        secs,
    ),
    (
        "rss_warm_mib",
        "resident set, active clients held",
        Worse::Higher,
        |r| r.rss_warm_mib,
        mib,
    ),
    (
        "first_p99_ms",
        "first request of an active client: p99",
        Worse::Higher,
        |r| r.first.p99_ms,
        ms,
    ),
    (
        "first_read_p99_ms",
        "a first request's store read: p99 at most (tollgate_catalog_lookup_seconds' bound)",
        Worse::Higher,
        |r| r.first_read_p99_ms,
        ms,
    ),
    (
        "first_clear_p99_ms",
        "first request: p99 outside the host's pauses (10 ms or more: their 100 ms and the next)",
        Worse::Higher,
        |r| r.first_clear_p99_ms,
        ms,
    ),
    (
        "held_clear_p99_ms",
        "held: p99 outside the host's pauses",
        Worse::Higher,
        |r| r.held_clear_p99_ms,
        ms,
    ),
    (
        "first_pauses",
        "host pauses of 10 ms or more during the first requests (a thread's 1 ms sleep)",
        Worse::Higher,
        |r| r.first_pauses as f64,
        count,
    ),
    (
        "first_pause_max_ms",
        "the longest host pause during the first requests",
        Worse::Higher,
        |r| r.first_pause_max_ms,
        ms,
    ),
    (
        "first_failed",
        "first requests not answered 200",
        Worse::Higher,
        |r| r.first_failed as f64,
        count,
    ),
    (
        "first_shed",
        "first requests shed unread (503, lookup)",
        Worse::Higher,
        |r| r.first_shed,
        count,
    ),
    (
        "first_reads_failed",
        "first requests whose read failed or was late (503)",
        Worse::Higher,
        |r| r.first_reads_failed,
        count,
    ),
    (
        "cached_failed",
        "held requests not answered 200",
        Worse::Higher,
        |r| r.cached_failed as f64,
        count,
    ),
    (
        "working_failed",
        "active clients during the flood not answered 200",
        Worse::Higher,
        |r| r.working_failed as f64,
        count,
    ),
    (
        "cached_p99_ms",
        "the same requests again (held): p99",
        Worse::Higher,
        |r| r.cached.p99_ms,
        ms,
    ),
    (
        "miss_added_p99_ms",
        "what a first request adds at p99 (first - held)",
        Worse::Higher,
        |r| r.first.p99_ms - r.cached.p99_ms,
        ms,
    ),
    (
        "redis_rtt_p99_ms",
        "a Redis round trip (PING): p99",
        Worse::Higher,
        |r| r.rtt_p99_ms,
        ms,
    ),
    (
        "first_p50_ms",
        "first request: p50",
        Worse::Higher,
        |r| r.first.p50_ms,
        ms,
    ),
    (
        "cached_p50_ms",
        "held: p50",
        Worse::Higher,
        |r| r.cached.p50_ms,
        ms,
    ),
    (
        "unknown_reads_per_key",
        "made-up keys: store reads per key sent",
        Worse::Higher,
        |r| r.unknown_reads_per_key,
        per_key,
    ),
    (
        "unknown_filtered_pct",
        "made-up keys refused by the key filter, unread",
        Worse::Lower,
        |r| r.unknown_filtered_pct,
        share,
    ),
    (
        "unknown_401_pct",
        "made-up keys answered 401",
        Worse::Lower,
        |r| r.unknown_401_pct,
        share,
    ),
    (
        "unknown_503_pct",
        "made-up keys answered 503 (shed unread by a late worker)",
        Worse::Higher,
        |r| r.unknown_503_pct,
        share,
    ),
    (
        "working_misses_pct",
        "active clients read again during the flood (per request)",
        Worse::Higher,
        |r| r.working_misses_pct,
        share,
    ),
    (
        "working_p99_ms",
        "active clients during the flood: p99",
        Worse::Higher,
        |r| r.working.p99_ms,
        ms,
    ),
    (
        "rss_flood_peak_mib",
        "resident set, peak during the flood",
        Worse::Higher,
        |r| r.rss_flood_peak_mib,
        mib,
    ),
    (
        "revocation_max_ms",
        "revocation: the slowest to be refused",
        Worse::Higher,
        |r| r.revocations_ms.iter().copied().fold(0.0, f64::max),
        ms,
    ),
];

impl Run {
    fn json(&self) -> Value {
        let mut v = json!({
            "start_s": round(self.start_s, 3),
            "rss_idle_mib": round(self.rss_idle_mib, 1),
            "rss_warm_mib": round(self.rss_warm_mib, 1),
            "rss_flood_peak_mib": round(self.rss_flood_peak_mib, 1),
            "first": summary_json(&self.first),
            "cached": summary_json(&self.cached),
            "redis_rtt_p99_ms": round(self.rtt_p99_ms, 3),
            "lookups_first": self.lookups_first,
            "first_clear_p99_ms": round(self.first_clear_p99_ms, 3),
            "first_read_p99_le_ms": self.first_read_p99_ms,
            "held_clear_p99_ms": round(self.held_clear_p99_ms, 3),
            "first_pauses": self.first_pauses,
            "first_pause_max_ms": round(self.first_pause_max_ms, 1),
            "first_failed": self.first_failed,
            "first_shed": self.first_shed,
            "first_reads_failed": self.first_reads_failed,
            "cached_failed": self.cached_failed,
            "working_failed": self.working_failed,
            "unknown_reads_per_key": round(self.unknown_reads_per_key, 4),
            "unknown_401_pct": round(self.unknown_401_pct, 3),
            "unknown_503_pct": round(self.unknown_503_pct, 3),
            "unknown_filtered_pct": round(self.unknown_filtered_pct, 3),
            "working_misses_pct": round(self.working_misses_pct, 4),
            "working": summary_json(&self.working),
            "revocations_ms": self.revocations_ms.iter().map(|m| round(*m, 1)).collect::<Vec<_>>(),
        });
        if let (Some(d), Some(obj)) = (&self.disturbance, v.as_object_mut()) {
            for (k, val) in d.json_fields() {
                obj.insert(k.into(), val);
            }
        }
        v
    }
}

fn report(a: &Args, loaded: &Loaded, runs: &[Run], machine: String) -> Outcome {
    let (table, figures) = report::figures_over(runs, &FIGURES);
    let (steal, cpu) = runs_disturbance(runs.iter().map(|r| r.disturbance.as_ref()));
    let markdown = format!(
        "### catalog: {} clients on a 3-master Redis Cluster, mode {}\n\n{}\n\
         Loaded once with `tollgate import` (chunks of {CHUNK}): {:.1} s; the store's memory \
         {:.0} bytes per client (`used_memory` over the masters, after minus before). \
         {} active clients spread over the catalog at {}/s (Poisson), first then held; \
         {} made-up keys over {} s beside them at {}/s; {} revocations per run; \
         `catalog.refresh_ms` {}; cache bounds {} clients, {} unknown keys; key filter {} MiB; \
         one worker; \
         {} runs, each with a gateway of its own.\n{steal}{machine}.\n",
        a.clients,
        a.mode,
        table.render(),
        loaded.import_s,
        loaded.bytes_per_client,
        a.active,
        a.rate,
        a.unknown,
        a.unknown_seconds,
        a.working_rate,
        a.revocations,
        a.refresh_ms,
        a.cached_clients,
        a.unknown_keys,
        a.key_filter_mib,
        runs.len(),
    );
    let json = json!({
        "scenario": "catalog",
        "clients": a.clients,
        "active": a.active,
        "mode": a.mode,
        "rate": a.rate,
        "unknown": a.unknown,
        "unknown_seconds": a.unknown_seconds,
        "working_rate": a.working_rate,
        "refresh_ms": a.refresh_ms,
        "cached_clients": a.cached_clients,
        "unknown_keys": a.unknown_keys,
        "key_filter_mib": a.key_filter_mib,
        "import_s": round(loaded.import_s, 2),
        "store_bytes_per_client": round(loaded.bytes_per_client, 1),
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
