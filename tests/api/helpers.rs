//! The tests' own parts: upstream HTTP services that record what reaches them, and the
//! gateway in process (through `Application::build`), which needs the `tollgate` crate.
//! Processes (`redis-server`, a Redis Cluster, the real binary) and the configuration
//! builder come from `tollgate-testkit`, shared with the load tool; they are re-exported
//! here so every test module reads its fixtures from one place.

use std::collections::HashMap;
use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer};
use secrecy::SecretString;
use tollgate::configuration::Settings;
use tollgate::domain::Limits;
use tollgate::startup::Application;
use tollgate::store::{state_field, Keys, StateGroups, Store};
pub use tollgate_testkit::{
    admin_toml, catalog_toml, free_port, key, limits_catalog_toml, route_toml, FakeClock,
    GatewayProcess, RedisCluster, RedisServer, ADMIN_SECRET,
};
use tollgate_testkit::{temp_dir, GatewayConfig, Launcher};

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
    /// 200, echoing the request body, with this response header (name, value): e.g. the
    /// real cost of the request, reported in a route's `cost_header`.
    Header(&'static str, &'static str),
    /// 200, echoing the request body, except `/healthz`: `200` while the flag (see
    /// [`health_flag`]) is true, `503` while it is false: a replica whose active health
    /// checks pass or fail, as the test tells it.
    Checked(&'static AtomicBool),
    /// 200 with this body whatever the request (a `HEAD` gets the head alone, with the
    /// body's `Content-Length`), and `x-request` naming the request: `METHOD path`.
    Body(&'static str),
}

/// A flag for [`Behaviour::Checked`], set to `healthy` (it lives as long as the tests).
pub fn health_flag(healthy: bool) -> &'static AtomicBool {
    Box::leak(Box::new(AtomicBool::new(healthy)))
}

/// An HTTP service that records what reaches it.
pub struct Upstream {
    pub port: u16,
    seen: Arc<Mutex<Vec<Seen>>>,
    hits: Arc<AtomicUsize>,
    handle: actix_web::dev::ServerHandle,
}

impl Upstream {
    pub async fn start(behaviour: Behaviour) -> Upstream {
        Upstream::start_at(0, behaviour).await
    }

    /// On `port` (0: a free one), e.g. a replica coming back where it was.
    pub async fn start_at(port: u16, behaviour: Behaviour) -> Upstream {
        let listener = TcpListener::bind(("127.0.0.1", port)).unwrap();
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
                        if let Behaviour::Checked(healthy) = behaviour {
                            if req.path() == "/healthz" && !healthy.load(Ordering::SeqCst) {
                                return HttpResponse::ServiceUnavailable().finish();
                            }
                        }
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
                        let mut ok = HttpResponse::Ok();
                        if let Behaviour::Header(name, value) = behaviour {
                            ok.insert_header((name, value));
                        }
                        if let Behaviour::Body(fixed) = behaviour {
                            let request = format!("{} {}", req.method(), req.path());
                            return ok.insert_header(("x-request", request)).body(fixed);
                        }
                        ok.insert_header(("x-upstream-port", port.to_string()))
                            .body(body)
                    }
                }))
        })
        .workers(1)
        .disable_signals()
        .listen(listener)
        .unwrap()
        .run();
        let handle = server.handle();
        tokio::spawn(server);
        Upstream {
            port,
            seen,
            hits,
            handle,
        }
    }

    /// Stops at once, as a killed replica does: its connections close, its port refuses.
    pub async fn stop(self) {
        self.handle.stop(false).await;
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

    /// Requests seen whose path starts with `prefix` (e.g. client traffic on a route, not
    /// the gateway's health checks).
    pub fn hits_on(&self, prefix: &str) -> usize {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.path.starts_with(prefix))
            .count()
    }
}

/// Settings from TOML, through the same loader `main` uses: `toml` layered over a base
/// (a free port, one worker, a catalog file in a directory of its own).
pub fn settings(toml: &str) -> Settings {
    let dir = temp_dir("settings").unwrap().keep();
    let file = dir.join("test.toml");
    std::fs::write(&file, toml).unwrap();
    let base = GatewayConfig {
        shutdown_timeout_s: Some(1),
        ..GatewayConfig::default()
    };
    let base_file = dir.join("base.toml");
    std::fs::write(&base_file, base.toml("127.0.0.1:0", &dir)).unwrap();
    // A debug build on a CI host running many tests at once on two cores often runs its
    // event loop 10 ms late (the default `overload.max_delay_ms`), and would shed a test's
    // bursts; tests about overload set their own thresholds over this one.
    let lenient = dir.join("overload.toml");
    std::fs::write(&lenient, "[overload]\nmax_delay_ms = 1000\n").unwrap();
    Settings::load_with_env(&[base_file, lenient, file], std::iter::empty()).expect("test settings")
}

/// Redis settings with a generous decision budget, for tests about the limit rather than
/// about failing open (a debug build on two cores can take more than 5 ms under load).
pub fn redis_toml(redis: &RedisServer) -> String {
    format!("[redis]\nurl = \"{}\"\ntimeout_ms = 2000\n", redis.url())
}

/// The limits of `plan` as a gateway configured with `toml` reads them.
pub fn plan_limits(toml: &str, plan: &str) -> Limits {
    settings(toml)
        .catalog
        .plans
        .into_iter()
        .find(|p| p.name.as_str() == plan)
        .unwrap_or_else(|| panic!("no plan {plan} in the configuration"))
        .limits
}

/// A client's stored state for one limit, as `engine/lua/bucket.lua` keeps it on one Redis
/// server (group hash `tollgate:s:{0}`, field `<tag>` for a plan's first limit or
/// `<tag>/<prefix>` for another; `tag` is the client, or `client:region` for a shard):
/// (a bucket's tokens or a quota's count; when they were counted or the window's end,
/// unix µs; when the field may be swept, unix µs).
pub fn stored(redis: &RedisServer, tag: &str, prefix: &str) -> Option<[f64; 3]> {
    let group = StateGroups::new("tollgate:", 1);
    let v: Option<Vec<u8>> = redis::cmd("HGET")
        .arg(group.key(0))
        .arg(state_field(tag, prefix))
        .query(&mut redis.conn().unwrap())
        .unwrap();
    let v = v?;
    assert_eq!(v.len(), 24, "state of {tag}/{prefix}: {v:?}");
    let word = |i: usize| f64::from_le_bytes(v[8 * i..8 * i + 8].try_into().unwrap());
    Some([word(0), word(1), word(2)])
}

/// A store on `redis` with the gateway's default key prefix, to read what the gateway
/// wrote: a client's bucket key is `tollgate:b:{<client>}` (its state: [`stored`]).
pub fn redis_store(redis: &RedisServer) -> Store {
    Store::redis(
        &SecretString::from(redis.url()),
        2,
        Duration::from_secs(1),
        Keys::new("tollgate:"),
    )
    .unwrap()
}

/// A response's `RateLimit` field, `"<policy>";r=<remaining>;t=<reset s>`, read back.
#[derive(Debug, Clone, PartialEq)]
pub struct RateLimit {
    pub policy: String,
    pub remaining: u64,
    pub reset: u64,
}

impl RateLimit {
    /// The `RateLimit` of `r`, which must have one.
    pub fn of(r: &reqwest::Response) -> RateLimit {
        let v = r
            .headers()
            .get("ratelimit")
            .unwrap_or_else(|| panic!("no RateLimit in {:?}", r.headers()))
            .to_str()
            .unwrap();
        let mut parts = v.split(';');
        let policy = parts.next().unwrap().trim_matches('"').to_string();
        let mut field = |name: &str| -> u64 {
            parts
                .next()
                .and_then(|p| p.strip_prefix(name))
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("no {name} in {v:?}"))
        };
        let remaining = field("r=");
        let reset = field("t=");
        RateLimit {
            policy,
            remaining,
            reset,
        }
    }
}

/// A response's `Retry-After` in seconds, if it has one.
pub fn retry_after(r: &reqwest::Response) -> Option<u64> {
    r.headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().parse().unwrap())
}

/// A gateway running in this process.
pub struct TestGateway {
    pub address: String,
    pub http: reqwest::Client,
    handles: Vec<actix_web::dev::ServerHandle>,
    /// `run_until_stopped`: it ends once the servers and the background tasks have.
    running: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl TestGateway {
    pub async fn spawn(settings: Settings) -> TestGateway {
        let app = Application::build(settings).await.expect("gateway builds");
        let address = format!("http://127.0.0.1:{}", app.port());
        let handles = app.handles();
        let running = tokio::spawn(app.run_until_stopped());
        TestGateway {
            address,
            handles,
            running,
            http: reqwest::Client::builder()
                .pool_max_idle_per_host(256)
                .build()
                .unwrap(),
        }
    }

    /// Stops serving (gracefully) and waits until it has, its background tasks too.
    pub async fn stop(self) {
        for h in &self.handles {
            h.stop(true).await;
        }
        self.running
            .await
            .expect("run_until_stopped")
            .expect("the gateway stops cleanly");
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

    /// `method path` on the admin API as `token`, with a JSON body when given.
    pub async fn send_admin(
        &self,
        method: reqwest::Method,
        path: &str,
        token: &str,
        body: Option<serde_json::Value>,
    ) -> reqwest::Response {
        let req = self.admin(method, path, token);
        let req = match body {
            Some(b) => req.json(&b),
            None => req,
        };
        req.send().await.expect("gateway answers")
    }

    /// A sample from this gateway's `/metrics`: the line starting `series ` (a name, or a
    /// name with its labels).
    pub async fn metric(&self, series: &str) -> Option<f64> {
        let text = self.get("/metrics", None).await.text().await.ok()?;
        sample_in(&text, series)
    }

    /// [`TestGateway::metric`] for a series that must be there: a missing one fails the test.
    pub async fn sample(&self, series: &str) -> f64 {
        self.metric(series)
            .await
            .unwrap_or_else(|| panic!("no {series} on /metrics"))
    }

    /// Whether `/metrics` shows the breaker open (`tollgate_breaker_open 1`).
    pub async fn breaker_open(&self) -> bool {
        self.sample("tollgate_breaker_open").await == 1.0
    }

    /// Waits until this gateway's catalog mirror has applied `version` (a write's ETag), as
    /// `tollgate_catalog_version` on `/metrics` shows it.
    pub async fn wait_for_catalog(&self, version: u64) {
        eventually(
            Duration::from_secs(5),
            &format!("the catalog mirror reaches version {version}"),
            || async {
                self.metric("tollgate_catalog_version")
                    .await
                    .is_some_and(|v| v >= version as f64)
            },
        )
        .await;
    }

    pub async fn get(&self, path: &str, key: Option<&str>) -> reqwest::Response {
        let mut req = self.http.get(format!("{}{}", self.address, path));
        if let Some(k) = key {
            req = req.header("x-api-key", k);
        }
        req.send().await.expect("gateway answers")
    }
}

/// The sample of `series` (a name, or a name with its labels) in a `/metrics` page.
pub fn sample_in(text: &str, series: &str) -> Option<f64> {
    let prefix = format!("{series} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
}

/// The gateway's binary as its own process (for clocks, signals and exit codes): `toml`
/// after the kit's base (a free port, one worker, a catalog file of its own), under `env`.
pub fn gateway_process(toml: &str, env: &[(&str, &str)]) -> GatewayProcess {
    Launcher::new(binary())
        .envs(env)
        .spawn(&GatewayConfig::with_extra(toml))
        .expect("gateway process")
}

pub fn binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_tollgate"))
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

/// The catalog version a write's `ETag` names (`"42"` -> 42).
pub fn etag_version(r: &reqwest::Response) -> u64 {
    r.headers()["etag"]
        .to_str()
        .unwrap()
        .trim_matches('"')
        .parse()
        .unwrap()
}

/// Runs `cmd` to its end and returns its output, failing the test (after killing it) when
/// it has not ended `within`: a process that should stop at once must not hang the suite.
pub fn output_within(cmd: &mut std::process::Command, within: Duration) -> std::process::Output {
    let child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the binary starts");
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(within) {
        Ok(out) => out.expect("its output"),
        Err(_) => {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
            panic!("the process had not ended after {within:?}");
        }
    }
}

/// Whether a response carries a real bucket decision: only then is `RateLimit` (the token
/// count) sent; a fail-open answer has `RateLimit-Policy` alone.
pub fn decided(r: &reqwest::Response) -> bool {
    r.headers().contains_key("ratelimit")
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// Waits out the last 30 s before midnight UTC, if the test starts in them: a test with a
/// daily quota must not see its window end halfway through.
pub async fn clear_of_midnight() {
    let to_midnight = 86_400 - unix_now() % 86_400;
    if to_midnight <= 30 {
        tokio::time::sleep(Duration::from_secs(to_midnight + 1)).await;
    }
}

/// The `field` of every error in a `422` problem, sorted.
pub async fn problem_fields(r: reqwest::Response) -> Vec<String> {
    let problem: serde_json::Value = r.json().await.unwrap();
    let mut fields: Vec<String> = problem["errors"]
        .as_array()
        .unwrap_or_else(|| panic!("no errors in {problem}"))
        .iter()
        .map(|e| e["field"].as_str().unwrap().to_string())
        .collect();
    fields.sort();
    fields
}

/// One span as an OTLP collector received it (OTLP/HTTP JSON).
#[derive(Debug, Clone)]
pub struct ExportedSpan {
    pub trace_id: String,
    pub span_id: String,
    /// `""` for a root span.
    pub parent_id: String,
    pub name: String,
    pub kind: u64,
    /// Every attribute's value as text (`intValue`s are strings in OTLP JSON).
    pub attributes: HashMap<String, String>,
    /// OTLP status code (`2`: error; `0`: unset).
    pub status: u64,
}

/// One `POST /v1/traces` as the collector received it.
#[derive(Debug, Clone)]
pub struct Post {
    /// Every header (names in lowercase).
    pub headers: HashMap<String, String>,
    /// The spans as OTLP JSON (a protobuf body is decoded and written as JSON).
    pub body: String,
}

/// A small OTLP/HTTP receiver: records every `POST /v1/traces` (OTLP JSON, or protobuf;
/// gzip is undone by actix-web) and answers 200; over TLS when started with a certificate.
pub struct Collector {
    pub port: u16,
    posts: Arc<Mutex<Vec<Post>>>,
    tls: bool,
}

/// A test service's TLS configuration: the chain `cert_pem` (leaf first) and its key
/// `key_pem`, TLS 1.2 and 1.3.
pub fn tls_server_config(cert_pem: &str, key_pem: &str) -> rustls::ServerConfig {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let chain = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .unwrap()
}

/// A self-signed certificate for `127.0.0.1` and `localhost`, and its key, in PEM.
pub struct SelfSigned {
    pub cert_pem: String,
    pub key_pem: String,
}

impl SelfSigned {
    pub fn generate() -> SelfSigned {
        let certified =
            rcgen::generate_simple_self_signed(vec!["127.0.0.1".into(), "localhost".into()])
                .unwrap();
        SelfSigned {
            cert_pem: certified.cert.pem(),
            key_pem: certified.signing_key.serialize_pem(),
        }
    }
}

impl Collector {
    pub async fn start() -> Collector {
        Collector::serve(None)
    }

    /// Over TLS (`https://`), presenting `cert`.
    pub async fn start_tls(cert: &SelfSigned) -> Collector {
        Collector::serve(Some(tls_server_config(&cert.cert_pem, &cert.key_pem)))
    }

    fn serve(tls: Option<rustls::ServerConfig>) -> Collector {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let posts = Arc::new(Mutex::new(Vec::new()));
        let p = posts.clone();
        let server = HttpServer::new(move || {
            let p = p.clone();
            App::new().route(
                "/v1/traces",
                web::post().to(move |req: HttpRequest, body: web::Bytes| {
                    let p = p.clone();
                    async move {
                        let content_type = req.headers().get("content-type");
                        let body = match content_type.map(|v| v.as_bytes()) {
                            Some(b"application/json") => {
                                String::from_utf8_lossy(&body).into_owned()
                            }
                            Some(b"application/x-protobuf") => {
                                use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
                                use prost::Message;
                                let Ok(request) = ExportTraceServiceRequest::decode(body) else {
                                    return HttpResponse::BadRequest().finish();
                                };
                                serde_json::to_string(&request).unwrap()
                            }
                            _ => return HttpResponse::UnsupportedMediaType().finish(),
                        };
                        let headers = req
                            .headers()
                            .iter()
                            .map(|(k, v)| {
                                (
                                    k.as_str().to_string(),
                                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                                )
                            })
                            .collect();
                        p.lock().unwrap().push(Post { headers, body });
                        HttpResponse::Ok()
                            .content_type("application/json")
                            .body("{}")
                    }
                }),
            )
        })
        .workers(1)
        .disable_signals();
        let tls_on = tls.is_some();
        let server = match tls {
            Some(config) => server.listen_rustls_0_23(listener, config),
            None => server.listen(listener),
        }
        .unwrap()
        .run();
        tokio::spawn(server);
        Collector {
            port,
            posts,
            tls: tls_on,
        }
    }

    pub fn url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    /// The posts received so far.
    pub fn posts(&self) -> Vec<Post> {
        self.posts.lock().unwrap().clone()
    }

    /// The raw bodies posted so far.
    pub fn bodies(&self) -> Vec<String> {
        self.posts().into_iter().map(|p| p.body).collect()
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ExportedSpan> {
        let mut out = Vec::new();
        for body in self.bodies() {
            let v: serde_json::Value = serde_json::from_str(&body).expect("OTLP JSON");
            let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
            for rs in v["resourceSpans"].as_array().into_iter().flatten() {
                for ss in rs["scopeSpans"].as_array().into_iter().flatten() {
                    for s in ss["spans"].as_array().into_iter().flatten() {
                        let attributes = s["attributes"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .map(|a| {
                                let value = &a["value"];
                                let value = value["stringValue"]
                                    .as_str()
                                    .or(value["intValue"].as_str())
                                    .unwrap_or_default();
                                (text(&a["key"]), value.to_string())
                            })
                            .collect();
                        out.push(ExportedSpan {
                            trace_id: text(&s["traceId"]),
                            span_id: text(&s["spanId"]),
                            parent_id: text(&s["parentSpanId"]),
                            name: text(&s["name"]),
                            kind: s["kind"].as_u64().unwrap_or_default(),
                            attributes,
                            status: s["status"]["code"].as_u64().unwrap_or_default(),
                        });
                    }
                }
            }
        }
        out
    }

    /// The spans of `trace_id`, once `n` of them have arrived (fails the test after 5 s).
    pub async fn trace(&self, trace_id: &str, n: usize) -> Vec<ExportedSpan> {
        eventually(
            Duration::from_secs(5),
            &format!("{n} spans of trace {trace_id} exported"),
            || async {
                self.spans()
                    .iter()
                    .filter(|s| s.trace_id == trace_id)
                    .count()
                    >= n
            },
        )
        .await;
        self.spans()
            .into_iter()
            .filter(|s| s.trace_id == trace_id)
            .collect()
    }
}

/// The store's catalog version (0: never written).
pub fn store_version(redis: &RedisServer) -> u64 {
    redis::cmd("GET")
        .arg("tollgate:{catalog}:version")
        .query::<Option<u64>>(&mut redis.conn().unwrap())
        .unwrap()
        .unwrap_or(0)
}

/// The audit log's entries of `action` (each its fields), oldest first.
pub fn audited(redis: &RedisServer, action: &str) -> Vec<Vec<(String, String)>> {
    let entries: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg("tollgate:{catalog}:audit")
        .arg("-")
        .arg("+")
        .query(&mut redis.conn().unwrap())
        .unwrap();
    entries
        .into_iter()
        .map(|(_, fields)| fields)
        .filter(|f| f.iter().any(|(k, v)| k == "action" && v == action))
        .collect()
}

/// Puts client `id` on `plan` through `gw`'s admin API (created or replaced).
pub async fn put_client(gw: &TestGateway, id: &str, plan: &str) {
    let r = gw
        .admin(
            reqwest::Method::PUT,
            &format!("/clients/{id}"),
            &admin_token("ops", "admin:read admin:write"),
        )
        .json(&serde_json::json!({"plan": plan}))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
}

/// Revokes `client`'s key `key_id` through `gw`'s admin API.
pub async fn revoke_key(gw: &TestGateway, client: &str, key_id: &str) {
    let r = gw
        .admin(
            reqwest::Method::DELETE,
            &format!("/clients/{client}/keys/{key_id}"),
            &admin_token("ops", "admin:read admin:write"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
}

/// Makes a key pair with openssl: `private` (PKCS#8 PEM) and `public` (SPKI PEM).
pub fn key_pair(genpkey_args: &[&str], private: &std::path::Path, public: &std::path::Path) {
    let quiet = || std::process::Stdio::null();
    let ok = std::process::Command::new("openssl")
        .arg("genpkey")
        .args(genpkey_args)
        .arg("-out")
        .arg(private)
        .stderr(quiet())
        .status()
        .unwrap()
        .success()
        && std::process::Command::new("openssl")
            .args(["pkey", "-pubout", "-in"])
            .arg(private)
            .arg("-out")
            .arg(public)
            .stderr(quiet())
            .status()
            .unwrap()
            .success();
    assert!(ok, "openssl could not make a key pair");
}
