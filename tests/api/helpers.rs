//! Real parts for the tests: `redis-server` processes on free ports, upstream HTTP
//! services, and the gateway itself (in process through `Application::build`, or as the
//! real binary when a test needs a process of its own).

use std::collections::HashMap;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer};
use tollgate::configuration::Settings;
use tollgate::startup::Application;

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A `redis-server` on a free port, killed on drop.
pub struct RedisServer {
    child: Child,
    pub port: u16,
    _dir: tempfile::TempDir,
}

fn spawn_redis(port: u16, dir: &std::path::Path) -> Child {
    Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .args(["--dir", dir.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server must be installed (.ci/run installs it)")
}

impl RedisServer {
    pub fn start() -> RedisServer {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let child = spawn_redis(port, dir.path());
        let server = RedisServer {
            child,
            port,
            _dir: dir,
        };
        server.wait_until_ready();
        server
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig}");
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing answers.
    pub fn stall(&self) {
        self.signal("-STOP");
    }

    /// Thaws a stalled server (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    /// Kills the server; [`RedisServer::restart`] brings an empty one back on the port.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts a fresh, empty server on the same port.
    pub fn restart(&mut self) {
        self.kill();
        self.child = spawn_redis(self.port, self._dir.path());
        self.wait_until_ready();
    }

    pub fn wait_until_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut c) = redis::Client::open(self.url()).and_then(|c| c.get_connection()) {
                if redis::cmd("PING").query::<String>(&mut c).is_ok() {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A blocking connection for inspecting what the gateway wrote.
    pub fn conn(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .unwrap()
            .get_connection()
            .unwrap()
    }

    /// `INFO commandstats` as command → calls.
    /// Zeroes `INFO commandstats`, so later counts are only what follows.
    pub fn reset_command_stats(&self) {
        let _: () = redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query(&mut self.conn())
            .unwrap();
    }

    pub fn command_calls(&self) -> HashMap<String, u64> {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut self.conn())
            .unwrap();
        info.lines()
            .filter_map(|l| l.strip_prefix("cmdstat_"))
            .filter_map(|l| {
                let (name, rest) = l.split_once(':')?;
                let calls = rest.split(',').find_map(|kv| kv.strip_prefix("calls="))?;
                Some((name.to_string(), calls.parse().ok()?))
            })
            .collect()
    }

    pub fn keys(&self, pattern: &str) -> Vec<String> {
        redis::cmd("KEYS")
            .arg(pattern)
            .query(&mut self.conn())
            .unwrap()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What an upstream saw of one request.
#[derive(Debug, Clone)]
pub struct Seen {
    pub path: String,
    pub headers: HashMap<String, String>,
    pub body_len: usize,
}

/// How a test upstream answers.
#[derive(Clone, Copy)]
pub enum Behaviour {
    /// 200, echoing the request body.
    Echo,
    /// Sleeps this long, then answers 200.
    Slow(Duration),
    /// A service's own limiter: admits this many requests per `x-client-id`, then 429.
    Limit(usize),
}

/// An HTTP service that records what reaches it.
pub struct Upstream {
    pub port: u16,
    seen: Arc<Mutex<Vec<Seen>>>,
    hits: Arc<AtomicUsize>,
}

impl Upstream {
    pub async fn start(behaviour: Behaviour) -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let hits = Arc::new(AtomicUsize::new(0));
        let (s, h) = (seen.clone(), hits.clone());
        let server = HttpServer::new(move || {
            let (s, h) = (s.clone(), h.clone());
            App::new()
                .app_data(web::PayloadConfig::new(64 << 20))
                .default_service(web::to(move |req: HttpRequest, body: web::Bytes| {
                    let (s, h) = (s.clone(), h.clone());
                    async move {
                        h.fetch_add(1, Ordering::SeqCst);
                        s.lock().unwrap().push(Seen {
                            path: req
                                .uri()
                                .path_and_query()
                                .map(|p| p.to_string())
                                .unwrap_or_default(),
                            headers: req
                                .headers()
                                .iter()
                                .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("").to_string()))
                                .collect(),
                            body_len: body.len(),
                        });
                        if let Behaviour::Slow(d) = behaviour {
                            tokio::time::sleep(d).await;
                        }
                        if let Behaviour::Limit(n) = behaviour {
                            let client = req
                                .headers()
                                .get("x-client-id")
                                .and_then(|v| v.to_str().ok())
                                .unwrap_or("");
                            let seen = s
                                .lock()
                                .unwrap()
                                .iter()
                                .filter(|r| {
                                    r.headers.get("x-client-id").map(String::as_str) == Some(client)
                                })
                                .count();
                            if seen > n {
                                return HttpResponse::TooManyRequests().finish();
                            }
                        }
                        HttpResponse::Ok()
                            .insert_header(("x-upstream-port", port.to_string()))
                            .body(body)
                    }
                }))
        })
        .workers(1)
        .disable_signals()
        .listen(listener)
        .unwrap()
        .run();
        tokio::spawn(server);
        Upstream { port, seen, hits }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

/// Settings from TOML, through the same loader `main` uses.
pub fn settings(toml: &str) -> Settings {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("test.toml");
    std::fs::write(&file, toml).unwrap();
    let catalog = dir.keep().join("catalog.json");
    let base = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nworkers = 1\nshutdown_timeout_s = 1\n[catalog]\nfile = {:?}\ncache_file = {:?}\n",
        catalog.to_str().unwrap(),
        catalog.with_file_name("catalog-cache.json").to_str().unwrap()
    );
    let base_file = file.with_file_name("base.toml");
    std::fs::write(&base_file, base).unwrap();
    Settings::load_with_env(&[base_file, file], std::iter::empty()).expect("test settings")
}

/// A gateway running in this process.
pub struct TestGateway {
    pub address: String,
    pub app: actix_web::web::Data<tollgate::state::AppState>,
    pub http: reqwest::Client,
    handles: Vec<actix_web::dev::ServerHandle>,
}

impl TestGateway {
    pub async fn spawn(settings: Settings) -> TestGateway {
        let app = Application::build(settings).await.expect("gateway builds");
        let address = format!("http://127.0.0.1:{}", app.port());
        let state = app.state();
        let handles = app.handles();
        tokio::spawn(app.run_until_stopped());
        TestGateway {
            address,
            app: state,
            handles,
            http: reqwest::Client::builder()
                .pool_max_idle_per_host(256)
                .build()
                .unwrap(),
        }
    }

    /// Stops serving (gracefully) and waits until it has.
    pub async fn stop(self) {
        for h in &self.handles {
            h.stop(true).await;
        }
    }

    /// An admin call with a Bearer token.
    pub fn admin(
        &self,
        method: reqwest::Method,
        path: &str,
        token: &str,
    ) -> reqwest::RequestBuilder {
        self.http
            .request(method, format!("{}/admin/v1{}", self.address, path))
            .bearer_auth(token)
    }

    pub async fn get(&self, path: &str, key: Option<&str>) -> reqwest::Response {
        let mut req = self.http.get(format!("{}{}", self.address, path));
        if let Some(k) = key {
            req = req.header("x-api-key", k);
        }
        req.send().await.expect("gateway answers")
    }
}

/// The gateway as its own process (for clocks, signals and exit codes).
pub struct GatewayProcess {
    pub child: Child,
    pub address: String,
    /// Its embedded catalog file.
    pub catalog: PathBuf,
    port: u16,
    config: PathBuf,
    env: Vec<(String, String)>,
}

impl GatewayProcess {
    /// Runs the binary with `toml` layered over the defaults, under `env`.
    pub fn spawn(toml: &str, env: &[(&str, &str)]) -> GatewayProcess {
        let port = free_port();
        let dir = tempfile::tempdir().unwrap().keep();
        let config = dir.join("gw.toml");
        std::fs::write(
            &config,
            format!(
                "[server]\nlisten = \"127.0.0.1:{port}\"\nworkers = 1\n[catalog]\nfile = {:?}\ncache_file = {:?}\n{toml}",
                dir.join("catalog.json").to_str().unwrap(),
                dir.join("catalog-cache.json").to_str().unwrap()
            ),
        )
        .unwrap();
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let child = GatewayProcess::start(&config, &env, port);
        GatewayProcess {
            child,
            address: format!("http://127.0.0.1:{port}"),
            catalog: dir.join("catalog.json"),
            port,
            config,
            env,
        }
    }

    /// Kills it (SIGKILL) and starts it again with the same configuration and files.
    pub fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = GatewayProcess::start(&self.config, &self.env, self.port);
    }

    fn start(config: &std::path::Path, env: &[(String, String)], port: u16) -> Child {
        let child = Command::new(binary())
            .arg("--config")
            .arg(config)
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "gateway process did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        child
    }
}

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_tollgate"))
}

/// A plan, a client with key `key-<id>` and routes, as TOML.
pub fn catalog_toml(plan: (&str, f64, f64), clients: &[&str]) -> String {
    let mut t = format!(
        "[[catalog.plans]]\nname = \"{}\"\ncapacity = {:?}\nrate = {:?}\n",
        plan.0, plan.1, plan.2
    );
    for c in clients {
        t.push_str(&format!(
            "[[catalog.clients]]\nid = \"{c}\"\nplan = \"{}\"\nkeys = [\"key-{c}-0000\"]\n",
            plan.0
        ));
    }
    t
}

pub fn key(client: &str) -> String {
    format!("key-{client}-0000")
}

pub fn route_toml(service: &str, prefix: &str, upstreams: &[String]) -> String {
    format!(
        "[[routes]]\nservice = \"{service}\"\nprefix = \"{prefix}\"\nupstreams = {upstreams:?}\n"
    )
}

/// A local Redis Cluster of three masters (no replicas), formed with `redis-cli --cluster
/// create`, killed on drop.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start() -> RedisCluster {
        let mut nodes = Vec::new();
        while nodes.len() < 3 {
            // The cluster bus listens on port + 10000.
            let port = free_port();
            if port > 55_000 || TcpListener::bind(("127.0.0.1", port + 10_000)).is_err() {
                continue;
            }
            let dir = tempfile::tempdir().unwrap();
            let child = Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no"])
                .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"])
                .args(["--cluster-config-file", "nodes.conf"])
                .args(["--dir", dir.path().to_str().unwrap()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server");
            let node = RedisServer {
                child,
                port,
                _dir: dir,
            };
            node.wait_until_ready();
            nodes.push(node);
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let ok = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap()
            .success();
        assert!(ok, "redis-cli --cluster create failed");
        let deadline = Instant::now() + Duration::from_secs(20);
        for n in &nodes {
            loop {
                let info: String = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query(&mut n.conn())
                    .unwrap_or_default();
                if info.contains("cluster_state:ok") {
                    break;
                }
                assert!(Instant::now() < deadline, "the cluster did not form");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        RedisCluster { nodes }
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.url()).collect()
    }

    /// Puts a fault proxy in front of every node and makes the nodes announce the
    /// proxies' ports (`cluster-announce-port`), so a cluster client reaches every node,
    /// seeds and redirects alike, through its proxy. Returns once every node's slot map
    /// names only proxies.
    pub fn behind_proxies(&self) -> Vec<tollgate_testkit::FaultProxy> {
        let proxies: Vec<_> = self
            .nodes
            .iter()
            .map(|n| {
                tollgate_testkit::FaultProxy::start(
                    format!("127.0.0.1:{}", n.port).parse().unwrap(),
                )
            })
            .collect();
        for (n, p) in self.nodes.iter().zip(&proxies) {
            let _: () = redis::cmd("CONFIG")
                .arg("SET")
                .arg("cluster-announce-port")
                .arg(p.port())
                .query(&mut n.conn())
                .unwrap();
        }
        let wanted: std::collections::BTreeSet<i64> =
            proxies.iter().map(|p| p.port() as i64).collect();
        let deadline = Instant::now() + Duration::from_secs(20);
        for n in &self.nodes {
            loop {
                let slots: Vec<Vec<redis::Value>> = redis::cmd("CLUSTER")
                    .arg("SLOTS")
                    .query(&mut n.conn())
                    .unwrap();
                let ports: std::collections::BTreeSet<i64> = slots
                    .iter()
                    .filter_map(|r| match r.get(2)? {
                        redis::Value::Array(m) => redis::from_redis_value_ref(m.get(1)?).ok(),
                        _ => None,
                    })
                    .collect();
                if ports == wanted {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "nodes did not announce the proxies"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        proxies
    }

    /// Moves `key`'s slot, with its keys, from its node to node `to` (what resharding
    /// does), so clients that still route by the old map get `MOVED`.
    pub fn move_slot_of(&self, key: &str, to: usize) {
        let from = self.owner(key);
        assert_ne!(from, to);
        let slot = tollgate::store::key_slot(key);
        let id = |i: usize| -> String {
            redis::cmd("CLUSTER")
                .arg("MYID")
                .query(&mut self.nodes[i].conn())
                .unwrap()
        };
        let (from_id, to_id) = (id(from), id(to));
        let setslot = |i: usize, args: &[&str]| {
            let _: () = redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg(args)
                .query(&mut self.nodes[i].conn())
                .unwrap();
        };
        setslot(to, &["IMPORTING", &from_id]);
        setslot(from, &["MIGRATING", &to_id]);
        let keys: Vec<String> = redis::cmd("CLUSTER")
            .arg("GETKEYSINSLOT")
            .arg(slot)
            .arg(1000)
            .query(&mut self.nodes[from].conn())
            .unwrap();
        if !keys.is_empty() {
            let _: () = redis::cmd("MIGRATE")
                .arg("127.0.0.1")
                .arg(self.nodes[to].port)
                .arg("")
                .arg(0)
                .arg(5000)
                .arg("KEYS")
                .arg(&keys)
                .query(&mut self.nodes[from].conn())
                .unwrap();
        }
        for i in 0..self.nodes.len() {
            setslot(i, &["NODE", &to_id]);
        }
    }

    /// The index of the node that serves `key`.
    pub fn owner(&self, key: &str) -> usize {
        let slot = tollgate::store::key_slot(key) as i64;
        let ranges: Vec<(i64, i64, Vec<redis::Value>)> = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query::<Vec<redis::Value>>(&mut self.nodes[0].conn())
            .unwrap()
            .into_iter()
            .map(|r| match r {
                redis::Value::Array(p) => (
                    redis::from_redis_value_ref(&p[0]).unwrap(),
                    redis::from_redis_value_ref(&p[1]).unwrap(),
                    redis::from_redis_value_ref(&p[2]).unwrap(),
                ),
                other => panic!("{other:?}"),
            })
            .collect();
        let (_, _, master) = ranges
            .iter()
            .find(|(s, e, _)| (*s..=*e).contains(&slot))
            .expect("every slot is served");
        let port: i64 = redis::from_redis_value_ref(&master[1]).unwrap();
        self.nodes
            .iter()
            .position(|n| n.port as i64 == port)
            .unwrap()
    }
}

/// The HS256 secret test gateways share for the admin API (see [`admin_toml`]).
pub const ADMIN_SECRET: &str = "test-secret-please-change-0123456789";

/// `[admin]` settings with [`ADMIN_SECRET`].
pub fn admin_toml() -> String {
    format!("[admin]\njwt_hs256_secret = \"{ADMIN_SECRET}\"\n")
}

/// An admin token for `sub` with `scope`, signed as `tollgate token` signs it.
pub fn admin_token(sub: &str, scope: &str) -> String {
    tollgate::admin::auth::mint(&settings(&admin_toml()).admin, sub, scope, 600).unwrap()
}

/// Polls until `check` holds, or fails after `within`.
pub async fn eventually<F, Fut>(within: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    loop {
        if check().await {
            return;
        }
        assert!(Instant::now() < deadline, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A new API key for `client` through the admin API: (key_id, key).
pub async fn new_key(gw: &TestGateway, client: &str) -> (String, String) {
    let created: serde_json::Value = gw
        .admin(
            reqwest::Method::POST,
            &format!("/clients/{client}/keys"),
            &admin_token("ops", "admin:read admin:write"),
        )
        .json(&serde_json::json!({}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    (
        created["key_id"].as_str().unwrap().to_string(),
        created["key"].as_str().unwrap().to_string(),
    )
}
