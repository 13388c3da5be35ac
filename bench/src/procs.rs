//! Child processes only the scenarios need, and the bench's use of the shared ones: the
//! release `tollgate` binary (found beside this tool, probed until it forwards), its
//! configuration's bench defaults, nginx and the floor proxy. `redis-server`, the gateway
//! process, the config builder, ports, temp dirs and signals are `tollgate-testkit`'s.

use std::net::SocketAddr;
use std::ops::Deref;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tollgate_testkit::{
    command, free_port, stop, temp_dir, wait_for_port, ClientDef, GatewayConfig, GatewayProcess,
    Launcher, PlanDef, RouteDef, TempDir,
};

use crate::floor::Ask;
use crate::http;

/// Lets the process open as many descriptors as it may (open-loop runs hold hundreds of
/// connections, the gateway as many again).
pub fn raise_fd_limit() {
    // SAFETY: getrlimit/setrlimit on our own process with a valid struct.
    unsafe {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max.min(65_536);
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// `--pin`: the system under test (the gateway, the floor or nginx) alone on one core,
/// [`Pin::SUT`], one worker; this tool (load generator, upstreams) and `redis-server` on
/// another, [`Pin::REST`]. The way issue 14 measured: the core the system under test runs
/// on is then all its own, so its rate is its CPU cost per request, not a share of two
/// cores fought over with the load generator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pin;

impl Pin {
    /// The system under test's CPU.
    pub const SUT: usize = 1;
    /// Everything else's CPU.
    pub const REST: usize = 0;

    /// Pins every thread of this process to [`Pin::REST`]; threads and processes started
    /// afterwards (the upstreams, the load generator, `redis-server`) inherit it. Call it
    /// before starting anything.
    pub fn this_process() -> anyhow::Result<Pin> {
        let online = std::thread::available_parallelism().map_or(1, |n| n.get());
        anyhow::ensure!(
            online > Pin::SUT,
            "--pin needs at least {} CPUs; this machine has {online}",
            Pin::SUT + 1
        );
        let tasks = std::fs::read_dir("/proc/self/task").context("listing /proc/self/task")?;
        for task in tasks {
            let tid: libc::pid_t = task?
                .file_name()
                .to_string_lossy()
                .parse()
                .context("a task id in /proc/self/task")?;
            set_affinity(tid, Pin::REST)
                .with_context(|| format!("pinning thread {tid} to CPU {}", Pin::REST))?;
        }
        Ok(Pin)
    }

    /// Makes `cmd`'s process (and every thread and process it starts) run on
    /// [`Pin::SUT`] only.
    pub fn sut(cmd: &mut Command) {
        use std::os::unix::process::CommandExt;
        // SAFETY: between fork and exec only async-signal-safe calls: sched_setaffinity
        // and a stack-allocated CPU set.
        unsafe {
            cmd.pre_exec(|| set_affinity(0, Pin::SUT));
        }
    }

    /// The same for a process started through a wrapper command (the gateway's launcher).
    pub fn sut_wrapper() -> Vec<String> {
        vec!["taskset".into(), "-c".into(), Pin::SUT.to_string()]
    }
}

/// `sched_setaffinity(tid, {cpu})`; `tid` 0: the calling thread.
fn set_affinity(tid: libc::pid_t, cpu: usize) -> std::io::Result<()> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET stays within it
    // (cpu < CPU_SETSIZE).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// CPU seconds (user + system) process `pid` and its descendants have used so far, from
/// `/proc` (clock-tick resolution); `None` once it is gone.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command name (in parentheses, which may hold spaces): field 3 onwards.
    let fields: Vec<&str> = stat.get(stat.rfind(')')? + 2..)?.split(' ').collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    let mut total = ticks / hz;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let children = task
            .ok()
            .and_then(|t| std::fs::read_to_string(t.path().join("children")).ok())
            .unwrap_or_default();
        for child in children.split_whitespace().filter_map(|c| c.parse().ok()) {
            total += cpu_seconds(child).unwrap_or(0.0);
        }
    }
    Some(total)
}

/// Process `pid`'s resident set (`VmRSS` in `/proc/PID/status`), in KiB; `None` once it
/// is gone.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Samples a process's resident set on a thread of its own, at once, then every `every`,
/// and once more when stopped: whether what it holds grows while it is under load (a
/// queue of work it cannot get to does).
pub struct RssWatch {
    stop: std::sync::mpsc::Sender<()>,
    thread: std::thread::JoinHandle<Vec<u64>>,
}

impl RssWatch {
    pub fn start(pid: u32, every: Duration) -> RssWatch {
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            let mut kib = Vec::new();
            loop {
                kib.extend(rss_kib(pid));
                match stopped.recv_timeout(every) {
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
                    _ => break,
                }
            }
            kib.extend(rss_kib(pid));
            kib
        });
        RssWatch { stop, thread }
    }

    /// The samples in KiB, first to last.
    pub fn stop(self) -> Vec<u64> {
        let _ = self.stop.send(());
        self.thread.join().unwrap_or_default()
    }
}

/// Takes the CPU away from a process `stop` in every `period` (SIGSTOP, then SIGCONT), on
/// a thread of its own, until dropped (it leaves the process running). A hypervisor's
/// steal, or a neighbour's burst, as the gateway sees it, while Redis and the load keep
/// running: a gateway VM whose CPU is stolen, in front of a Redis on a host of its own
/// (real steal on this machine would stall Redis and the load generator too, and then
/// calls really do take longer than the budget).
pub struct Steal {
    stealing: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    pid: libc::pid_t,
}

/// `STOP_MS/PERIOD_MS`, e.g. `3/18`: stopped 3 ms in every 18 (17%).
#[derive(Debug, Clone, Copy)]
pub struct StealSpec {
    pub stop: Duration,
    pub period: Duration,
}

impl std::str::FromStr for StealSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<StealSpec, String> {
        let bad = || format!("{s:?} is not STOP_MS/PERIOD_MS with 0 < STOP_MS < PERIOD_MS");
        let (stop, period) = s.split_once('/').ok_or_else(bad)?;
        let ms = |v: &str| v.trim().parse::<f64>().map_err(|_| bad());
        let (stop, period) = (ms(stop)?, ms(period)?);
        if !(stop > 0.0 && stop < period && period <= 10_000.0) {
            return Err(bad());
        }
        Ok(StealSpec {
            stop: Duration::from_secs_f64(stop / 1e3),
            period: Duration::from_secs_f64(period / 1e3),
        })
    }
}

impl StealSpec {
    /// The share of the time the process is stopped.
    pub fn share(&self) -> f64 {
        self.stop.as_secs_f64() / self.period.as_secs_f64()
    }

    /// How a report says it.
    pub fn describe(&self) -> String {
        format!(
            "the gateway stopped {} ms in every {} ms ({:.0}% stolen)",
            self.stop.as_secs_f64() * 1e3,
            self.period.as_secs_f64() * 1e3,
            self.share() * 100.0
        )
    }
}

impl Steal {
    pub fn start(pid: u32, spec: StealSpec) -> Steal {
        use std::sync::atomic::Ordering::Relaxed;
        let stealing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let pid = pid as libc::pid_t;
        let thread = {
            let stealing = std::sync::Arc::clone(&stealing);
            std::thread::spawn(move || {
                while stealing.load(Relaxed) {
                    // SAFETY: kill(2) on the pid of a child this tool started.
                    unsafe { libc::kill(pid, libc::SIGSTOP) };
                    std::thread::sleep(spec.stop);
                    // SAFETY: as above.
                    unsafe { libc::kill(pid, libc::SIGCONT) };
                    std::thread::sleep(spec.period - spec.stop);
                }
            })
        };
        Steal {
            stealing,
            thread: Some(thread),
            pid,
        }
    }
}

impl Drop for Steal {
    fn drop(&mut self) {
        self.stealing
            .store(false, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // SAFETY: kill(2) on the pid of a child this tool started.
        unsafe { libc::kill(self.pid, libc::SIGCONT) };
    }
}

/// Runs the threads `tids` at real-time priority (`SCHED_FIFO`, 10): each runs as soon as it
/// has work, ahead of every ordinary process, as a process on cores of its own would.
/// For the store path (`redis-server` and the fault proxy) in a scenario that saturates the
/// gateway: a Redis on a host of its own, which the gateway's load cannot starve.
pub fn realtime(tids: &[i32]) -> anyhow::Result<()> {
    let param = libc::sched_param { sched_priority: 10 };
    for &tid in tids {
        // SAFETY: sched_setscheduler reads `param`, which outlives the call.
        if unsafe { libc::sched_setscheduler(tid, libc::SCHED_FIFO, &param) } != 0 {
            bail!(
                "cannot run thread {tid} at real-time priority: {}",
                std::io::Error::last_os_error()
            );
        }
    }
    Ok(())
}

/// The ids of every thread of process `pid`, from `/proc`.
pub fn threads_of(pid: u32) -> anyhow::Result<Vec<i32>> {
    let mut tids = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        if let Some(tid) = entry?.file_name().to_str().and_then(|s| s.parse().ok()) {
            tids.push(tid);
        }
    }
    Ok(tids)
}

/// Sets this process's nice value (children inherit it); says so when it cannot.
pub fn set_nice(n: i32) {
    // SAFETY: setpriority on our own process.
    let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, n) };
    if r != 0 {
        eprintln!(
            "note: cannot set nice {n} ({}); measuring at the default priority",
            std::io::Error::last_os_error()
        );
    }
}

/// The `tollgate` binary, found next to this one (the workspace shares one `target/`).
///
/// `cargo run -p tollgate-bench` builds only this tool and the library it uses, not the
/// gateway's binary; so when cargo started this tool (it sets `CARGO`), the gateway is
/// built first with the same profile, and a stale binary is never measured.
pub fn tollgate_binary() -> anyhow::Result<PathBuf> {
    static BUILT: std::sync::Once = std::sync::Once::new();
    let exe = std::env::current_exe().context("where is tollgate-bench?")?;
    let dir = exe
        .parent()
        .context("tollgate-bench has no parent directory")?;
    let bin = dir.join("tollgate");
    let release = !dir.ends_with("debug");
    if let Some(cargo) = std::env::var_os("CARGO") {
        let mut failed = None;
        BUILT.call_once(|| {
            let mut cmd = Command::new(cargo);
            cmd.args(["build", "-q", "-p", "tollgate", "--bin", "tollgate"]);
            if release {
                cmd.arg("--release");
            }
            match cmd.status() {
                Ok(s) if s.success() => {}
                Ok(s) => failed = Some(format!("cargo build of the gateway: {s}")),
                Err(e) => failed = Some(format!("cargo build of the gateway: {e}")),
            }
        });
        if let Some(f) = failed {
            bail!(f);
        }
    }
    if !bin.is_file() {
        bail!(
            "{} is missing: build the gateway first (cargo build --release -p tollgate)",
            bin.display()
        );
    }
    if !release {
        eprintln!("warning: measuring a debug build; use cargo run --release");
    }
    Ok(bin)
}

/// The client every gateway has, on a plan that never limits: probes and warm-ups use
/// it, so they spend none of a measured client's tokens.
pub const PROBE_KEY: &str = "bench-probe-key-0000";

/// A gateway configuration with the bench's defaults: one worker, the store at
/// `redis_url` (`None`: the embedded store), a 5 ms budget, enforcing, and the probe
/// client on a plan that never limits.
pub fn gateway_config(redis_url: Option<String>, routes: Vec<RouteDef>) -> GatewayConfig {
    GatewayConfig {
        workers: 1,
        shutdown_timeout_s: Some(1),
        redis_url: Some(redis_url.unwrap_or_default()),
        timeout_ms: Some(5),
        default_mode: Some("enforce".into()),
        plans: vec![PlanDef {
            name: "unlimited".into(),
            capacity: 1e9,
            rate: 1e9,
        }],
        clients: vec![ClientDef {
            id: "bench-probe".into(),
            plan: "unlimited".into(),
            key: PROBE_KEY.into(),
        }],
        routes,
        ..GatewayConfig::default()
    }
}

/// One route, `/api`, to `upstreams`, and one client (`key`) on a plan far above any
/// offered rate, so every request takes the allowed path: the one whose cost matters (an
/// EVALSHA, then forwarding).
pub fn one_unlimited_client(
    redis_url: Option<String>,
    upstreams: Vec<String>,
    client: &str,
    key: &str,
) -> GatewayConfig {
    let mut config = gateway_config(
        redis_url,
        vec![RouteDef {
            service: "api".into(),
            prefix: "/api".into(),
            upstreams,
        }],
    );
    config.plans.push(PlanDef {
        name: "large".into(),
        capacity: 1e9,
        rate: 1e9,
    });
    config.clients.push(ClientDef {
        id: client.into(),
        plan: "large".into(),
        key: key.into(),
    });
    config
}

/// `server.max_connections_per_address` off in every gateway this tool starts: its many
/// clients all connect from 127.0.0.1, and an open loop behind a slow gateway opens up to
/// 4,096 connections, past the default bound of 1,024 a real client address has.
const OPEN_BOUND: (&str, &str) = ("TOLLGATE__SERVER__MAX_CONNECTIONS_PER_ADDRESS", "0");

/// A running gateway (the testkit's process), ready to forward.
pub struct Gateway(GatewayProcess);

impl Gateway {
    /// Starts the release gateway and waits until it forwards a probe request on
    /// `probe_path`. `TOLLGATE_BENCH_WRAPPER` (e.g. "valgrind --tool=callgrind") runs it
    /// under a profiler; everything else stays the same, only the waits are longer.
    pub fn start(config: &GatewayConfig, probe_path: &str) -> anyhow::Result<Gateway> {
        Gateway::start_pinned(config, probe_path, None)
    }

    /// [`Gateway::start`], on [`Pin::SUT`] alone with `Some(Pin)`.
    pub fn start_pinned(
        config: &GatewayConfig,
        probe_path: &str,
        pin: Option<Pin>,
    ) -> anyhow::Result<Gateway> {
        Gateway::start_binary(&tollgate_binary()?, config, probe_path, pin)
    }

    /// [`Gateway::start_pinned`] with the gateway binary `bin` (another build, to compare).
    pub fn start_binary(
        bin: &std::path::Path,
        config: &GatewayConfig,
        probe_path: &str,
        pin: Option<Pin>,
    ) -> anyhow::Result<Gateway> {
        let profiler = std::env::var("TOLLGATE_BENCH_WRAPPER")
            .unwrap_or_default()
            .split_whitespace()
            .map(str::to_string)
            .collect::<Vec<_>>();
        let mut wrapper = pin.map(|_| Pin::sut_wrapper()).unwrap_or_default();
        // The profiler's patience below is for the profiler alone.
        let profiled = !profiler.is_empty();
        wrapper.extend(profiler);
        // How many times the usual waits to allow (a profiler slows everything down).
        let patience = if profiled { 10 } else { 1 };
        let gw = Launcher::new(bin.to_path_buf())
            .env(
                "RUST_LOG",
                &std::env::var("RUST_LOG").unwrap_or("info".into()),
            )
            .env(OPEN_BOUND.0, OPEN_BOUND.1)
            .wrapper(wrapper)
            // SIGTERM first so it exits the way it would in production (and a profiler
            // writes its data); then make sure.
            .stop_grace(Duration::from_secs(3 * patience))
            .spawn(config)?;
        // The pid, for attaching a profiler (perf record -p).
        eprintln!("  tollgate pid {} on {}", gw.child.id(), gw.addr);
        let gateway = Gateway(gw);
        gateway.wait_forwarding(probe_path, patience)?;
        Ok(gateway)
    }

    /// Stops it as an orchestrator would (SIGTERM) and waits until it has exited, at most
    /// `within`.
    pub fn terminate(&mut self, within: Duration) -> anyhow::Result<()> {
        let pid = libc::pid_t::try_from(self.0.child.id())?;
        // SAFETY: kill only reads its arguments; the pid is this gateway's child.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let deadline = std::time::Instant::now() + within;
        while self.0.child.try_wait()?.is_none() {
            anyhow::ensure!(
                std::time::Instant::now() < deadline,
                "the gateway did not stop within {within:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// [`Gateway::start`] with `env` set (settings the configuration builder does not
    /// write, e.g. `TOLLGATE__CATALOG__MODE`), probing every 10 ms: what a start's duration
    /// is measured with.
    pub fn start_env(
        config: &GatewayConfig,
        probe_path: &str,
        env: &[(&str, &str)],
    ) -> anyhow::Result<Gateway> {
        let forwards = |addr| {
            block_on(http::fetch(addr, probe_path, Some(PROBE_KEY))).is_ok_and(|(s, _)| s == 200)
        };
        Gateway::launch(config, env, Duration::from_millis(10), forwards)
    }

    /// Starts the release gateway with a listener [`Gateway::start`]'s cleartext probe
    /// cannot ask (TLS), and waits until `forwards` says it does (asked every 50 ms).
    pub fn start_probed(
        config: &GatewayConfig,
        forwards: impl Fn(SocketAddr) -> bool,
    ) -> anyhow::Result<Gateway> {
        Gateway::launch(config, &[], Duration::from_millis(50), forwards)
    }

    /// Starts the release gateway under `env` and asks `forwards` every `every`, for up to
    /// 60 s, until it says the gateway forwards.
    fn launch(
        config: &GatewayConfig,
        env: &[(&str, &str)],
        every: Duration,
        forwards: impl Fn(SocketAddr) -> bool,
    ) -> anyhow::Result<Gateway> {
        let gw = Launcher::new(tollgate_binary()?)
            .env(
                "RUST_LOG",
                &std::env::var("RUST_LOG").unwrap_or("info".into()),
            )
            .env(OPEN_BOUND.0, OPEN_BOUND.1)
            .envs(env)
            .stop_grace(Duration::from_secs(3))
            .spawn(config)?;
        eprintln!("  tollgate pid {} on {}", gw.child.id(), gw.addr);
        let deadline = Instant::now() + Duration::from_secs(60);
        while !forwards(gw.addr) {
            if Instant::now() > deadline {
                bail!(
                    "tollgate at {} does not forward; log in {}",
                    gw.addr,
                    gw.dir().display()
                );
            }
            std::thread::sleep(every);
        }
        Ok(Gateway(gw))
    }

    /// Listening is not enough: the catalog must be mirrored and the route must reach an
    /// upstream.
    fn wait_forwarding(&self, probe_path: &str, patience: u64) -> anyhow::Result<()> {
        let addr = self.0.addr;
        let deadline = Instant::now() + Duration::from_secs(20 * patience);
        loop {
            let status = block_on(http::fetch(addr, probe_path, Some(PROBE_KEY)))
                .map(|(s, _)| s)
                .unwrap_or(0);
            if status == 200 {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "tollgate at {addr} answered {status} to a probe on {probe_path}; log in {}",
                    self.0.dir().display()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops an embedded-store gateway, adds `clients` to its catalog file in one write,
    /// and starts it again on that file. Declared in its configuration instead, each client would
    /// be seeded at start with a write of the whole file of its own (the embedded store
    /// persists every catalog write): quadratic, so 10,000 clients do not start within a
    /// minute. Those already in the catalog are left as they are.
    pub fn add_clients_and_restart(
        &mut self,
        clients: &[ClientDef],
        probe_path: &str,
    ) -> anyhow::Result<()> {
        use tollgate::domain::{ClientId, KeyHash, PlanName};
        use tollgate::store::records::{ClientRecord, KeyRecord, Versioned};
        // The file is the running gateway's alone: stopped first, started again below.
        stop(&mut self.0.child, Duration::ZERO);
        let store = tollgate::store::Store::embedded(&self.0.catalog)
            .map_err(|e| anyhow::anyhow!("opening {}: {e}", self.0.catalog.display()))?;
        block_on(async {
            let mut dump = store.catalog.dump().await?;
            let seen = (dump.epoch.clone(), dump.version);
            for c in clients {
                let id = ClientId::parse(&c.id)?;
                if dump.clients.iter().any(|v| v.value.id == id) {
                    continue;
                }
                dump.version += 1;
                dump.clients.push(Versioned {
                    rev: dump.version,
                    value: ClientRecord {
                        id,
                        plan: PlanName::parse(&c.plan)?,
                        mode: None,
                        shards: None,
                        keys: vec![KeyRecord::new(KeyHash::of(&c.key))],
                        overrides: Vec::new(),
                        extra: Default::default(),
                    },
                });
            }
            let written = store
                .catalog
                .restore(
                    tollgate::store::CatalogAt {
                        epoch: seen.0.as_deref(),
                        version: seen.1,
                    },
                    &dump,
                )
                .await?;
            anyhow::ensure!(written, "the catalog file changed while clients were added");
            anyhow::Ok(())
        })?;
        drop(store);
        self.0.restart()?;
        eprintln!(
            "  tollgate pid {} on {} (restarted with {} more clients)",
            self.0.child.id(),
            self.0.addr,
            clients.len()
        );
        self.wait_forwarding(probe_path, 1)
    }

    /// `GET /metrics`, parsed.
    pub fn metrics(&self) -> anyhow::Result<std::collections::HashMap<String, f64>> {
        let (status, body) = block_on(http::fetch(self.addr, "/metrics", None))?;
        if status != 200 {
            bail!("/metrics answered {status}");
        }
        Ok(http::parse_metrics(&body))
    }

    /// [`Gateway::metrics`] from a gateway under load, asked again every 20 ms for up to
    /// `within`: an overloaded gateway may shed the scrape too.
    pub fn metrics_within(
        &self,
        within: Duration,
    ) -> anyhow::Result<std::collections::HashMap<String, f64>> {
        let deadline = Instant::now() + within;
        loop {
            match self.metrics() {
                Ok(m) => return Ok(m),
                Err(e) if Instant::now() > deadline => {
                    return Err(e.context(format!("no /metrics within {within:?}")))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

impl Deref for Gateway {
    type Target = GatewayProcess;

    fn deref(&self) -> &GatewayProcess {
        &self.0
    }
}

/// nginx as a reverse proxy to `upstream`, the baseline for throughput. `None` when nginx
/// is not installed.
pub struct Nginx {
    child: Child,
    pub addr: SocketAddr,
    dir: TempDir,
}

/// [`Nginx::start`]'s lean proxy: `workers` worker processes, keep-alive both ways, no
/// access log, its files in `dir`; `listen`: the server's `listen` directive and any lines
/// that go with it (TLS).
fn lean_conf(workers: usize, dir: &str, upstream: SocketAddr, listen: &str) -> String {
    let d = dir;
    format!(
        r#"worker_processes {workers};
daemon off;
master_process on;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    keepalive_requests 1000000;
    upstream backend {{ server {upstream}; keepalive 128; keepalive_requests 1000000; }}
    server {{
        {listen}
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"#
    )
}

impl Nginx {
    pub fn binary() -> Option<PathBuf> {
        ["/usr/sbin/nginx", "/usr/bin/nginx", "/usr/local/sbin/nginx"]
            .iter()
            .map(PathBuf::from)
            .find(|p| p.is_file())
    }

    /// `workers` worker processes, keep-alive both ways, no access log: configured as a
    /// lean proxy, so the comparison is with nginx at its best.
    pub fn start(
        upstream: SocketAddr,
        workers: usize,
        pin: Option<Pin>,
    ) -> anyhow::Result<Option<Nginx>> {
        Nginx::lean(upstream, workers, pin, |port| {
            format!("listen 127.0.0.1:{port} backlog=4096;")
        })
    }

    /// [`Nginx::start`]'s lean proxy behind TLS (`cert`, `key`; TLS 1.2 and 1.3) with
    /// HTTP/2 by ALPN beside HTTP/1.1 (nginx 1.22's `listen ... ssl http2`; `http2 on;`
    /// from 1.25).
    pub fn start_tls(
        upstream: SocketAddr,
        workers: usize,
        cert: &std::path::Path,
        key: &std::path::Path,
    ) -> anyhow::Result<Option<Nginx>> {
        let (cert, key) = (cert.display(), key.display());
        Nginx::lean(upstream, workers, None, |port| {
            format!(
                "listen 127.0.0.1:{port} ssl http2 backlog=4096;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        ssl_protocols TLSv1.2 TLSv1.3;"
            )
        })
    }

    /// The lean proxy ([`lean_conf`]) on a free port, its `listen` lines `listen(port)`.
    fn lean(
        upstream: SocketAddr,
        workers: usize,
        pin: Option<Pin>,
        listen: impl FnOnce(u16) -> String,
    ) -> anyhow::Result<Option<Nginx>> {
        let Some(bin) = Nginx::binary() else {
            return Ok(None);
        };
        let dir = temp_dir("nginx")?;
        let port = free_port()?;
        let d = dir.path().to_string_lossy().into_owned();
        let conf = lean_conf(workers, &d, upstream, &listen(port));
        Nginx::launch(bin, dir, port, &conf, pin).map(Some)
    }

    /// nginx in front of `replicas` configured the usual way for replicas that fail: a
    /// failed try (`error`, `timeout`: `proxy_next_upstream`'s default) goes to the next
    /// replica, and one failure sets a replica aside for 10 s (`max_fails=1
    /// fail_timeout=10s`); 1 s to connect, `timeout` for the response
    /// (`proxy_read_timeout`); round robin; 32 keep-alive connections to the replicas
    /// per worker; no access log. `workers` worker processes.
    pub fn start_replicas(
        replicas: &[SocketAddr],
        workers: usize,
        timeout: Duration,
    ) -> anyhow::Result<Option<Nginx>> {
        let Some(bin) = Nginx::binary() else {
            return Ok(None);
        };
        let dir = temp_dir("nginx")?;
        let port = free_port()?;
        let d = dir.path().to_string_lossy().into_owned();
        let servers: String = replicas
            .iter()
            .map(|r| format!("        server {r} max_fails=1 fail_timeout=10s;\n"))
            .collect();
        let read_timeout_ms = timeout.as_millis();
        let conf = format!(
            r#"worker_processes {workers};
daemon off;
master_process on;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    upstream backend {{
{servers}        keepalive 32;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_connect_timeout 1s;
            proxy_read_timeout {read_timeout_ms}ms;
            proxy_next_upstream error timeout;
        }}
    }}
}}
"#
        );
        Nginx::launch(bin, dir, port, &conf, None).map(Some)
    }

    fn launch(
        bin: PathBuf,
        dir: TempDir,
        port: u16,
        conf: &str,
        pin: Option<Pin>,
    ) -> anyhow::Result<Nginx> {
        let file = dir.path().join("nginx.conf");
        std::fs::write(&file, conf)?;
        let log = dir.path().join("error.log");
        let mut cmd = command(bin);
        cmd.arg("-p").arg(dir.path()).arg("-c").arg(&file);
        if pin.is_some() {
            // The master and its workers (forked from it) alike.
            Pin::sut(&mut cmd);
        }
        let mut child = cmd.spawn().context("starting nginx")?;
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        wait_for_port(addr, &mut child, "nginx", &[&log], Duration::from_secs(60))?;
        Ok(Nginx { child, addr, dir })
    }

    /// nginx's error log so far (what it says of the replicas it gave up on).
    pub fn error_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("error.log")).unwrap_or_default()
    }
}

impl Nginx {
    /// The master's pid (its workers are its children).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // TERM: the master stops its workers and exits at once (a SIGKILL would orphan
        // the workers).
        stop(&mut self.child, Duration::from_secs(3));
    }
}

/// The bare actix-web + awc proxy (`tollgate-bench floor`), this tool run as a child.
pub struct Floor {
    child: Child,
    pub addr: SocketAddr,
    /// Under a profiler: stopped with SIGTERM and time to write its data.
    grace: Duration,
    _dir: TempDir,
}

impl Floor {
    /// With `redis`, it asks the Redis at that URL once per request before forwarding.
    pub fn start(
        upstream: &str,
        workers: usize,
        pin: Option<Pin>,
        redis: Option<(&str, Ask)>,
    ) -> anyhow::Result<Floor> {
        let dir = temp_dir("floor")?;
        let port = free_port()?;
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let log = dir.path().join("floor.err");
        // `TOLLGATE_BENCH_FLOOR_WRAPPER` (e.g. "valgrind --tool=callgrind") runs it under a
        // profiler, as `TOLLGATE_BENCH_WRAPPER` does the gateway.
        let profiler = std::env::var("TOLLGATE_BENCH_FLOOR_WRAPPER").unwrap_or_default();
        let mut argv = profiler.split_whitespace().map(std::ffi::OsString::from);
        let mut cmd = match argv.next() {
            Some(program) => {
                let mut cmd = command(program);
                cmd.args(argv).arg(std::env::current_exe()?);
                cmd
            }
            None => command(std::env::current_exe()?),
        };
        let profiled = !profiler.trim().is_empty();
        cmd.arg("floor")
            .arg("--listen")
            .arg(addr.to_string())
            .arg("--upstream")
            .arg(upstream)
            .arg("--workers")
            .arg(workers.to_string())
            .stderr(std::fs::File::create(&log)?);
        if let Some((url, ask)) = redis {
            cmd.arg("--redis").arg(url).arg("--ask").arg(match ask {
                Ask::Ping => "ping",
                Ask::Script => "script",
            });
        }
        if pin.is_some() {
            Pin::sut(&mut cmd);
        }
        let mut child = cmd.spawn().context("starting the floor proxy")?;
        wait_for_port(
            addr,
            &mut child,
            "floor proxy",
            &[&log],
            Duration::from_secs(60),
        )?;
        Ok(Floor {
            child,
            addr,
            grace: if profiled {
                Duration::from_secs(30)
            } else {
                Duration::ZERO
            },
            _dir: dir,
        })
    }
}

impl Floor {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Floor {
    fn drop(&mut self) {
        stop(&mut self.child, self.grace);
    }
}

/// Runs a future to completion on a throwaway single-threaded runtime (probes, metrics).
pub fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
        .block_on(f)
}
