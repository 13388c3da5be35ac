//! Child processes the scenarios need: `redis-server`, the release `tollgate` binary and
//! nginx, each on a free port of 127.0.0.1, with its files in a temporary directory, and
//! killed (and the directory removed) on drop.

use std::fmt::Write as _;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::http;

/// A port nobody listens on right now.
pub fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

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

/// Makes a child get SIGTERM when this tool dies, however it dies (Ctrl-C included), so
/// no redis-server, gateway or nginx outlives a run.
fn die_with_parent(cmd: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl is async-signal-safe, and this closure touches nothing else.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        })
    }
}

/// Removes the temporary directories of earlier runs that were killed before they could
/// (theirs are named after their pid, and that process is gone).
pub fn clean_stale_dirs() {
    let Ok(dir) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix("tollgate-bench-")
            .and_then(|rest| rest.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// A directory under the system's temp dir, removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(what: &str) -> anyhow::Result<TempDir> {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "tollgate-bench-{}-{what}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(TempDir(dir))
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn signal(child: &Child, sig: libc::c_int) -> anyhow::Result<()> {
    // SAFETY: kill(2) on the id of a child we spawned and have not reaped.
    if unsafe { libc::kill(child.id() as libc::pid_t, sig) } != 0 {
        bail!(
            "kill({}, {sig}): {}",
            child.id(),
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

fn wait_for_port(
    addr: SocketAddr,
    child: &mut Child,
    what: &str,
    log: &Path,
) -> anyhow::Result<()> {
    // Generous: a gateway under a profiler starts many times slower.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_ok() {
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            let log = std::fs::read_to_string(log).unwrap_or_default();
            bail!("{what} exited ({status}) before listening on {addr}:\n{log}");
        }
        if Instant::now() > deadline {
            bail!("{what} did not listen on {addr} within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A `redis-server` with no persistence.
pub struct Redis {
    child: Child,
    pub port: u16,
    _dir: TempDir,
}

impl Redis {
    pub fn start() -> anyhow::Result<Redis> {
        let dir = TempDir::new("redis")?;
        let port = free_port()?;
        let log = dir.path().join("redis.log");
        let mut child = die_with_parent(&mut Command::new("redis-server"))
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .args(["--dir", &dir.path().to_string_lossy()])
            .args(["--logfile", &log.to_string_lossy()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting redis-server (apt-get install -y redis-server)")?;
        wait_for_port(
            SocketAddr::from(([127, 0, 0, 1], port)),
            &mut child,
            "redis-server",
            &log,
        )?;
        let redis = Redis {
            child,
            port,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while redis
            .conn()
            .and_then(|mut c| {
                redis::cmd("PING")
                    .query::<String>(&mut c)
                    .map_err(anyhow::Error::from)
            })
            .is_err()
        {
            if Instant::now() > deadline {
                bail!("redis-server did not answer PING");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(redis)
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn conn(&self) -> anyhow::Result<redis::Connection> {
        Ok(redis::Client::open(self.url())?.get_connection()?)
    }

    /// Freezes the server: its sockets stay open and nothing answers.
    pub fn stall(&self) -> anyhow::Result<()> {
        signal(&self.child, libc::SIGSTOP)
    }

    pub fn resume(&self) -> anyhow::Result<()> {
        signal(&self.child, libc::SIGCONT)
    }

    /// Calls of one command so far (`INFO commandstats`), e.g. `evalsha`.
    pub fn calls(&self, command: &str) -> anyhow::Result<u64> {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut self.conn()?)?;
        let prefix = format!("cmdstat_{command}:calls=");
        Ok(info
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0))
    }

    pub fn flush(&self) -> anyhow::Result<()> {
        let _: () = redis::cmd("FLUSHALL").query(&mut self.conn()?)?;
        Ok(())
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = signal(&self.child, libc::SIGCONT);
        let _ = self.child.kill();
        let _ = self.child.wait();
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

/// A plan in the gateway's catalog.
pub struct PlanDef {
    pub name: String,
    pub capacity: f64,
    pub rate: f64,
}

/// A client in the gateway's catalog.
pub struct ClientDef {
    pub id: String,
    pub plan: String,
    pub key: String,
}

/// A route: service, prefix, replicas.
pub struct RouteDef {
    pub service: String,
    pub prefix: String,
    pub upstreams: Vec<String>,
}

/// What a gateway is started with; the rest are the compiled-in defaults.
pub struct GatewayConfig {
    pub workers: usize,
    /// `None`: the embedded store.
    pub redis_url: Option<String>,
    pub timeout_ms: u64,
    /// `"enforce"` or `"shadow"`.
    pub default_mode: &'static str,
    pub plans: Vec<PlanDef>,
    pub clients: Vec<ClientDef>,
    pub routes: Vec<RouteDef>,
}

/// The client every gateway has, on a plan that never limits: probes and warm-ups use
/// it, so they spend none of a measured client's tokens.
pub const PROBE_KEY: &str = "bench-probe-key-0000";

impl GatewayConfig {
    pub fn new(redis_url: Option<String>, routes: Vec<RouteDef>) -> GatewayConfig {
        GatewayConfig {
            workers: 1,
            redis_url,
            timeout_ms: 5,
            default_mode: "enforce",
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
        }
    }

    /// One route, `/api`, to `upstreams`, and one client (`key`) on a plan far above any
    /// offered rate, so every request takes the allowed path: the one whose cost matters
    /// (an EVALSHA, then forwarding).
    pub fn one_unlimited_client(
        redis_url: Option<String>,
        upstreams: Vec<String>,
        client: &str,
        key: &str,
    ) -> GatewayConfig {
        let mut config = GatewayConfig::new(
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

    fn toml(&self, port: u16, dir: &Path) -> String {
        let mut t = String::new();
        let _ = writeln!(
            t,
            "[server]\nlisten = \"127.0.0.1:{port}\"\nworkers = {}\nshutdown_timeout_s = 1\n",
            self.workers
        );
        let _ = writeln!(
            t,
            "[redis]\nurl = {:?}\ntimeout_ms = {}\n",
            self.redis_url.as_deref().unwrap_or(""),
            self.timeout_ms
        );
        let _ = writeln!(
            t,
            "[catalog]\nfile = {:?}\ncache_file = {:?}\n",
            dir.join("catalog.json").to_string_lossy(),
            dir.join("catalog-cache.json").to_string_lossy()
        );
        let _ = writeln!(t, "[limits]\ndefault_mode = {:?}\n", self.default_mode);
        for p in &self.plans {
            let _ = writeln!(
                t,
                "[[catalog.plans]]\nname = {:?}\ncapacity = {:?}\nrate = {:?}\n",
                p.name, p.capacity, p.rate
            );
        }
        for c in &self.clients {
            let _ = writeln!(
                t,
                "[[catalog.clients]]\nid = {:?}\nplan = {:?}\nkeys = [{:?}]\n",
                c.id, c.plan, c.key
            );
        }
        for r in &self.routes {
            let _ = writeln!(
                t,
                "[[routes]]\nservice = {:?}\nprefix = {:?}\nupstreams = {:?}\n",
                r.service, r.prefix, r.upstreams
            );
        }
        t
    }
}

/// A running gateway.
pub struct Gateway {
    child: Child,
    pub addr: SocketAddr,
    dir: TempDir,
    /// How many times the usual waits to allow (a profiler slows everything down).
    patience: u64,
}

impl Gateway {
    /// Starts the gateway and waits until it forwards a probe request on `probe_path`.
    pub fn start(config: &GatewayConfig, probe_path: &str) -> anyhow::Result<Gateway> {
        let bin = tollgate_binary()?;
        let dir = TempDir::new("gateway")?;
        let port = free_port()?;
        let file = dir.path().join("bench.toml");
        std::fs::write(&file, config.toml(port, dir.path()))?;
        let log = dir.path().join("gateway.log");
        // TOLLGATE_BENCH_WRAPPER (e.g. "valgrind --tool=callgrind") runs the gateway under
        // a profiler; everything else stays the same.
        let wrapper: Vec<String> = std::env::var("TOLLGATE_BENCH_WRAPPER")
            .unwrap_or_default()
            .split_whitespace()
            .map(str::to_string)
            .collect();
        let mut cmd = match wrapper.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(&bin);
                c
            }
            None => Command::new(&bin),
        };
        let mut child = die_with_parent(&mut cmd)
            .arg("--config")
            .arg(&file)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or("info".into()),
            )
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log)?)
            .stderr(std::fs::File::create(dir.path().join("gateway.err"))?)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        wait_for_port(addr, &mut child, "tollgate", &log)?;
        let patience = if wrapper.is_empty() { 1 } else { 10 };
        // The pid, for attaching a profiler (perf record -p).
        eprintln!("  tollgate pid {} on {addr}", child.id());
        let gw = Gateway {
            child,
            addr,
            dir,
            patience,
        };
        // Listening is not enough: the catalog must be mirrored and the route must reach
        // an upstream.
        let deadline = Instant::now() + Duration::from_secs(20 * patience);
        loop {
            let status = block_on(http::fetch(addr, probe_path, Some(PROBE_KEY)))
                .map(|(s, _)| s)
                .unwrap_or(0);
            if status == 200 {
                return Ok(gw);
            }
            if Instant::now() > deadline {
                bail!(
                    "tollgate at {addr} answered {status} to a probe on {probe_path}; log in {}",
                    gw.dir.path().display()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `GET /metrics`, parsed.
    pub fn metrics(&self) -> anyhow::Result<std::collections::HashMap<String, f64>> {
        let (status, body) = block_on(http::fetch(self.addr, "/metrics", None))?;
        if status != 200 {
            bail!("/metrics answered {status}");
        }
        Ok(http::parse_metrics(&body))
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        // SIGTERM first so it exits the way it would in production (and a profiler writes
        // its data); then make sure.
        let _ = signal(&self.child, libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(3 * self.patience);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// nginx as a reverse proxy to `upstream`, the baseline for throughput. `None` when nginx
/// is not installed.
pub struct Nginx {
    child: Child,
    pub addr: SocketAddr,
    _dir: TempDir,
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
    pub fn start(upstream: SocketAddr, workers: usize) -> anyhow::Result<Option<Nginx>> {
        let Some(bin) = Nginx::binary() else {
            return Ok(None);
        };
        let dir = TempDir::new("nginx")?;
        let port = free_port()?;
        let d = dir.path().to_string_lossy().into_owned();
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
    keepalive_requests 1000000;
    upstream backend {{ server {upstream}; keepalive 128; keepalive_requests 1000000; }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"#
        );
        let file = dir.path().join("nginx.conf");
        std::fs::write(&file, conf)?;
        let log = dir.path().join("error.log");
        let mut child = die_with_parent(&mut Command::new(bin))
            .arg("-p")
            .arg(dir.path())
            .arg("-c")
            .arg(&file)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting nginx")?;
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        wait_for_port(addr, &mut child, "nginx", &log)?;
        Ok(Some(Nginx {
            child,
            addr,
            _dir: dir,
        }))
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // TERM: the master stops its workers and exits at once (a SIGKILL would orphan
        // the workers).
        let _ = signal(&self.child, libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The bare actix-web + awc proxy (`tollgate-bench floor`), this tool run as a child.
pub struct Floor {
    child: Child,
    pub addr: SocketAddr,
    _dir: TempDir,
}

impl Floor {
    pub fn start(upstream: &str, workers: usize) -> anyhow::Result<Floor> {
        let dir = TempDir::new("floor")?;
        let port = free_port()?;
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let log = dir.path().join("floor.err");
        let mut child = die_with_parent(&mut Command::new(std::env::current_exe()?))
            .arg("floor")
            .arg("--listen")
            .arg(addr.to_string())
            .arg("--upstream")
            .arg(upstream)
            .arg("--workers")
            .arg(workers.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .context("starting the floor proxy")?;
        wait_for_port(addr, &mut child, "floor proxy", &log)?;
        Ok(Floor {
            child,
            addr,
            _dir: dir,
        })
    }
}

impl Drop for Floor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
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
