//! Operating tollgate: the alerts and the dashboard in `deploy/`, checked against a real
//! gateway by Prometheus's own tools (the book, "Operating tollgate"). A gateway with
//! Redis serves traffic of every kind the dashboard shows (admitted, refused, shadow,
//! unknown keys, a fail-open while Redis is stalled); `promtool check metrics` lints its
//! `/metrics`, and a real `prometheus` scrapes it every second, evaluates the alert rules
//! and answers every query of the dashboard. The rules' own unit tests run in
//! `.ci/alerts-check` (`promtool test rules`).
//!
//! Needs Debian's `prometheus` package (`prometheus` and `promtool`); without it these
//! tests fail and say so (`.ci/run` installs it).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use tollgate_testkit::{command, on_a_free_port, stop, temp_dir, wait_for_port, TempDir};

use crate::helpers::*;

/// What Grafana's `$__rate_interval` becomes here: four scrapes at 1 s (Grafana makes it
/// at least four scrape intervals).
const RATE_INTERVAL: &str = "5s";

fn repo_file(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// `program` on the `PATH`, or a failure saying how to install it: these checks never
/// skip silently.
fn installed(program: &str) -> PathBuf {
    std::env::var_os("PATH")
        .and_then(|path| {
            std::env::split_paths(&path)
                .map(|dir| dir.join(program))
                .find(|p| p.is_file())
        })
        .unwrap_or_else(|| {
            panic!(
                "{program} is not installed: apt-get install prometheus (Debian's package \
                 has prometheus and promtool; .ci/run installs it)"
            )
        })
}

/// A gateway on Redis serving, in the background, traffic of every kind the dashboard
/// shows; the traffic stops when it is dropped.
struct Busy {
    gw: TestGateway,
    redis: RedisServer,
    _upstreams: [Upstream; 2],
    stop: Arc<AtomicBool>,
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// The traffic: `acme` on a plan of 5/s sends up to 40/s (mostly refused), `shade` the
/// same in shadow mode (compared with a service that refuses a client past 20 requests),
/// `bulk` on a large plan to a service that reports costs, and a key nobody has, from an
/// address of its own (127.0.0.9: it is soon held back, see "Unknown keys"). A 200 ms
/// budget: a debug build on a busy host does not fail open by chance, and a stalled Redis
/// still opens the breaker within a second. The busiest-client gauges change once per
/// hot window: 1 s instead of 10, so they have a value before the test ends.
async fn busy_gateway() -> Busy {
    let redis = RedisServer::start().unwrap();
    let orders = Upstream::start(Behaviour::Limit(20)).await;
    let llm = Upstream::start(Behaviour::Header("x-cost", "2")).await;
    let toml = format!(
        "[redis]\nurl = \"{}\"\ntimeout_ms = 200\n[periods]\nhot_window_ms = 1000\n\
         [[catalog.plans]]\nname = \"small\"\ncapacity = 5\nrate = 5\n\
         [[catalog.plans]]\nname = \"big\"\ncapacity = 1000000\nrate = 1000000\n\
         [[catalog.clients]]\nid = \"acme\"\nplan = \"small\"\nkeys = [\"{}\"]\n\
         [[catalog.clients]]\nid = \"shade\"\nplan = \"small\"\nmode = \"shadow\"\nkeys = [\"{}\"]\n\
         [[catalog.clients]]\nid = \"bulk\"\nplan = \"big\"\nkeys = [\"{}\"]\n\
         {}{}cost_header = \"x-cost\"\n",
        redis.url(),
        key("acme"),
        key("shade"),
        key("bulk"),
        route_toml("orders", "/orders", &[orders.url()]),
        route_toml("llm", "/llm", &[llm.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    let stop = Arc::new(AtomicBool::new(false));
    for (path, key) in [
        ("/orders", key("acme")),
        ("/orders", key("shade")),
        ("/llm", key("bulk")),
        ("/orders", "key-nobody-0000".to_string()),
    ] {
        let http = if key.starts_with("key-nobody") {
            reqwest::Client::builder()
                .local_address(std::net::IpAddr::from([127, 0, 0, 9]))
                .build()
                .unwrap()
        } else {
            gw.http.clone()
        };
        let (url, stop) = (format!("{}{path}", gw.address), stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let _ = http.get(&url).header("x-api-key", &key).send().await;
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        });
    }
    Busy {
        gw,
        redis,
        _upstreams: [orders, llm],
        stop,
    }
}

impl Busy {
    /// Waits until every kind has been served once: refused, shadow-refused, and a
    /// service's 429.
    async fn warmed(&self) {
        for series in [
            "tollgate_decisions_total{outcome=\"denied\"}",
            "tollgate_decisions_total{outcome=\"shadow_denied\"}",
            "tollgate_upstream_requests_total{service=\"orders\",status_class=\"4xx\"}",
        ] {
            eventually(Duration::from_secs(10), series, || async {
                self.gw.metric(series).await.is_some_and(|n| n > 0.0)
            })
            .await;
        }
    }

    /// Stalls Redis past three decision budgets: requests fail open, the breaker opens;
    /// then thaws it and waits until the breaker has closed.
    async fn fail_open_for_a_moment(&self) {
        self.redis.stall().unwrap();
        eventually(Duration::from_secs(5), "the breaker opens", || async {
            self.gw.breaker_open().await
        })
        .await;
        self.redis.resume().unwrap();
        eventually(Duration::from_secs(5), "the breaker closes", || async {
            !self.gw.breaker_open().await
        })
        .await;
        assert!(self.gw.sample("tollgate_fail_open_total").await > 0.0);
    }

    /// The gateway's `/metrics` text.
    async fn metrics(&self) -> String {
        self.gw.get("/metrics", None).await.text().await.unwrap()
    }

    /// `host:port`, as Prometheus names the target (its `instance` label).
    fn instance(&self) -> String {
        self.gw.address.trim_start_matches("http://").to_string()
    }
}

/// A `prometheus` process on a free port, its TSDB in a temporary directory, scraping
/// `target` every second in the job `tollgate` and evaluating the alert rules every
/// second; killed on drop.
struct Prometheus {
    child: Child,
    url: String,
    http: reqwest::Client,
    _dir: TempDir,
}

impl Prometheus {
    fn start(target: &str) -> Prometheus {
        let binary = installed("prometheus");
        let dir = temp_dir("prometheus").unwrap();
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 rule_files:\n  - {:?}\n\
                 scrape_configs:\n  - job_name: tollgate\n    static_configs:\n      - targets: [{target:?}]\n",
                repo_file("deploy/prometheus/alerts.yml"),
            ),
        )
        .unwrap();
        let log = dir.path().join("prometheus.log");
        let (child, port) = on_a_free_port("prometheus", |port| {
            let mut child = command(&binary)
                .arg(format!("--config.file={}", config.display()))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.path().join("tsdb").display()
                ))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .stderr(Stdio::from(std::fs::File::create(&log)?))
                .spawn()?;
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            match wait_for_port(
                addr,
                &mut child,
                "prometheus",
                &[&log],
                Duration::from_secs(20),
            ) {
                Ok(()) => Ok((child, port)),
                Err(e) => {
                    stop(&mut child, Duration::ZERO);
                    Err(e)
                }
            }
        })
        .expect("prometheus starts");
        Prometheus {
            child,
            url: format!("http://127.0.0.1:{port}"),
            http: reqwest::Client::new(),
            _dir: dir,
        }
    }

    /// `GET /api/v1/<path>` with `params`: its `data`, or the error Prometheus gave.
    async fn api(&self, path: &str, params: &[(&str, &str)]) -> Result<Value, String> {
        let body: Value = self
            .http
            .get(format!("{}/api/v1/{path}", self.url))
            .query(params)
            .send()
            .await
            .map_err(|e| e.to_string())?
            .json()
            .await
            .map_err(|e| e.to_string())?;
        match body["status"].as_str() {
            Some("success") => Ok(body["data"].clone()),
            _ => Err(format!("{}: {}", body["errorType"], body["error"])),
        }
    }

    /// An instant query's result (a vector's samples).
    async fn query(&self, expr: &str) -> Result<Vec<Value>, String> {
        let data = self.api("query", &[("query", expr)]).await?;
        match data["result"].as_array() {
            Some(samples) if data["resultType"] == "vector" => Ok(samples.clone()),
            _ => Err(format!("not a vector: {data}")),
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        stop(&mut self.child, Duration::from_secs(2));
    }
}

/// Every query in a dashboard: `(panel title, expr)`, rows' nested panels included.
fn dashboard_queries(dashboard: &Value) -> Vec<(String, String)> {
    fn walk(panels: &Value, out: &mut Vec<(String, String)>) {
        for panel in panels.as_array().into_iter().flatten() {
            walk(&panel["panels"], out);
            for target in panel["targets"].as_array().into_iter().flatten() {
                let title = panel["title"].as_str().unwrap_or_default().to_string();
                out.push((
                    title,
                    target["expr"].as_str().unwrap_or_default().to_string(),
                ));
            }
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

/// A query as Grafana sends it: variables replaced by what this test has.
fn substitute(expr: &str, instance: &str) -> String {
    expr.replace("$__rate_interval", RATE_INTERVAL)
        .replace("${instance}", instance)
        .replace("$instance", instance)
}

/// Every `tollgate_*` metric name in `text`.
fn metric_names(text: &str) -> Vec<String> {
    let mut names: Vec<String> = text
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("tollgate_"))
        .map(str::to_string)
        .collect();
    names.sort();
    names.dedup();
    names
}

#[tokio::test]
async fn a_busy_gateways_metrics_pass_promtool_check_metrics() {
    let promtool = installed("promtool");
    let busy = busy_gateway().await;
    busy.warmed().await;
    busy.fail_open_for_a_moment().await;
    let text = busy.metrics().await;
    // Every kind of series is there to be linted, labelled ones included.
    for series in [
        "tollgate_upstream_requests_total{service=\"orders\",status_class=\"4xx\"}",
        "tollgate_cost_reports_total{service=\"llm\",outcome=\"debit\"}",
        "tollgate_redis_pool_connections{state=\"idle\"}",
    ] {
        assert!(text.contains(series), "no {series} in:\n{text}");
    }

    let mut child = std::process::Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let findings = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && findings.trim().is_empty(),
        "promtool check metrics ({}):\n{findings}",
        out.status
    );
}

#[tokio::test]
async fn a_real_prometheus_scraping_a_busy_gateway_answers_every_dashboard_query_and_evaluates_every_alert(
) {
    // Arrange: the dashboard and the rules, a busy gateway, Prometheus scraping it.
    installed("prometheus");
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(repo_file("deploy/grafana/tollgate.json")).unwrap(),
    )
    .expect("the dashboard is JSON");
    let rules = std::fs::read_to_string(repo_file("deploy/prometheus/alerts.yml")).unwrap();
    let busy = busy_gateway().await;
    let instance = busy.instance();
    let started = Instant::now();
    let prometheus = Prometheus::start(&instance);
    // Prometheus's first scrape comes about 5 s after it starts (its service discovery
    // sends targets every 5 s): the traffic warms up and fails open meanwhile.
    busy.warmed().await;
    busy.fail_open_for_a_moment().await;
    eventually(
        Duration::from_secs(30),
        "Prometheus has scraped the gateway 5 times",
        || async {
            prometheus
                .query(&format!(
                    "count_over_time(up{{job=\"tollgate\",instance=\"{instance}\"}}[1m]) >= 5"
                ))
                .await
                .is_ok_and(|r| !r.is_empty())
        },
    )
    .await;

    // Every metric the rules, their tests and the dashboard name is one the gateway exports:
    // this busy one, or (the certificates' families) one serving TLS.
    let exported = busy.metrics().await + &tls_gateway_metrics().await;
    let deployed = [
        rules.clone(),
        std::fs::read_to_string(repo_file("deploy/prometheus/alerts_test.yml")).unwrap(),
        dashboard.to_string(),
    ]
    .concat();
    let unknown: Vec<String> = metric_names(&deployed)
        .into_iter()
        .filter(|name| {
            !exported
                .lines()
                .any(|l| l.starts_with(&format!("{name} ")) || l.starts_with(&format!("{name}{{")))
        })
        .collect();
    assert!(
        unknown.is_empty(),
        "not on the gateway's /metrics: {unknown:?}"
    );

    // The instance variable lists this gateway.
    let variables = dashboard["templating"]["list"]
        .as_array()
        .expect("templating");
    assert!(
        variables.iter().any(|v| v["name"] == "datasource"
            && v["type"] == "datasource"
            && v["query"] == "prometheus"),
        "no Prometheus datasource variable"
    );
    let definition = variables
        .iter()
        .find(|v| v["name"] == "instance")
        .and_then(|v| v["definition"].as_str())
        .expect("an instance variable");
    let (metric, label) = definition
        .strip_prefix("label_values(")
        .and_then(|d| d.strip_suffix(')'))
        .and_then(|d| d.split_once(','))
        .unwrap_or_else(|| panic!("not label_values(metric, label): {definition}"));
    let values = prometheus
        .api(
            &format!("label/{}/values", label.trim()),
            &[("match[]", metric.trim())],
        )
        .await
        .unwrap();
    assert!(
        values.as_array().unwrap().iter().any(|v| *v == *instance),
        "{definition} gives {values}, not {instance}"
    );

    // Act and assert: every query parses and returns at least one number.
    let queries = dashboard_queries(&dashboard);
    assert!(
        queries.len() >= 20,
        "only {} queries in the dashboard",
        queries.len()
    );
    let mut failures = Vec::new();
    for (panel, expr) in &queries {
        if !expr.contains("$instance") {
            failures.push(format!("{panel}: not filtered by $instance: {expr}"));
        }
        let sent = substitute(expr, &instance);
        if sent.contains('$') {
            failures.push(format!(
                "{panel}: a variable this test does not know: {sent}"
            ));
            continue;
        }
        match prometheus.query(&sent).await {
            Err(e) => failures.push(format!("{panel}: {e}\n  {sent}")),
            Ok(samples) => {
                let numbers = samples
                    .iter()
                    .filter_map(|s| s["value"][1].as_str()?.parse::<f64>().ok())
                    .filter(|v| v.is_finite())
                    .count();
                if numbers == 0 {
                    failures.push(format!("{panel}: no data ({samples:?})\n  {sent}"));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "dashboard queries that failed:\n{}",
        failures.join("\n")
    );

    // Every alert rule is loaded and has been evaluated without an error.
    let alerts = rules.matches("- alert: ").count();
    let deadline = Instant::now() + Duration::from_secs(5);
    let seen = loop {
        let data = prometheus.api("rules", &[]).await.unwrap();
        let seen: Vec<String> = data["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .map(|r| format!("{} {} {}", r["name"], r["health"], r["lastError"]))
            .collect();
        if seen.len() == alerts && seen.iter().all(|r| r.contains("\"ok\"")) {
            break seen;
        }
        assert!(
            Instant::now() < deadline,
            "{alerts} alerts in alerts.yml; Prometheus has (name, health, last error):\n{}",
            seen.join("\n")
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    eprintln!(
        "{} queries and {} rules in {:?}",
        queries.len(),
        seen.len(),
        started.elapsed()
    );
}

/// The `/metrics` of a gateway serving TLS (read over TLS): the families only such a
/// gateway has (its certificates' expiry and reloads).
async fn tls_gateway_metrics() -> String {
    let dir = tempfile::tempdir().unwrap();
    let ca = crate::tls::Ca::new();
    let files = crate::tls::Files::write(dir.path(), "gw", &ca.leaf(&["gw.test"]));
    let gw = TestGateway::spawn(settings(&format!("[tls]\n{}", files.toml()))).await;
    let addr = gw.address.trim_start_matches("http://").parse().unwrap();
    let text = crate::tls::metrics(addr).await;
    gw.stop().await;
    text
}
