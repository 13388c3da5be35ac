//! The binary's outside: start-up, bad configuration, health.

use std::process::Command;

use crate::helpers::*;

#[test]
fn a_bad_configuration_exits_2_naming_every_bad_key() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.toml");
    std::fs::write(
        &file,
        "[redis]\ntimeout_ms = 0\n[[catalog.plans]]\nname = \"gold\"\ncapacity = -1\nrate = 1\n",
    )
    .unwrap();
    let out = Command::new(binary())
        .arg("--config")
        .arg(&file)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("redis.timeout_ms"), "{err}");
    assert!(err.contains("catalog.plans[0].capacity"), "{err}");
}

#[test]
fn an_environment_override_is_validated_too() {
    let out = Command::new(binary())
        .env("TOLLGATE__SERVER__LISTEN", "not-an-address")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("server.listen"));
}

/// `tollgate --config GLOBAL... check-config FILE...` in `dir`, each file written there
/// first (`None`: not written): its exit code and its stdout's lines.
fn check_config(
    dir: &std::path::Path,
    global: &[(&str, &str)],
    files: &[(&str, Option<&str>)],
) -> (Option<i32>, Vec<String>) {
    let mut cmd = Command::new(binary());
    cmd.current_dir(dir);
    for (name, toml) in global {
        std::fs::write(dir.join(name), toml).unwrap();
        cmd.arg("--config").arg(name);
    }
    cmd.arg("check-config");
    for (name, toml) in files {
        if let Some(toml) = toml {
            std::fs::write(dir.join(name), toml).unwrap();
        }
        cmd.arg(name);
    }
    // Within a deadline: a check that started the gateway would not end.
    let out = output_within(&mut cmd, std::time::Duration::from_secs(20));
    let stdout = String::from_utf8_lossy(&out.stdout);
    (
        out.status.code(),
        stdout.lines().map(str::to_string).collect(),
    )
}

#[test]
fn check_config_says_ok_for_a_good_file_and_exits_0() {
    let dir = tempfile::tempdir().unwrap();

    let (code, lines) = check_config(
        dir.path(),
        &[],
        &[(
            "good.toml",
            Some("[server]\nlisten = \"127.0.0.1:8080\"\n[usage]\nflush_ms = 5000\n"),
        )],
    );

    assert_eq!(lines, ["good.toml: ok"]);
    assert_eq!(code, Some(0));
}

#[test]
fn check_config_names_a_bad_value_by_its_key_and_exits_1() {
    let dir = tempfile::tempdir().unwrap();

    let (code, lines) = check_config(
        dir.path(),
        &[],
        &[("flush.toml", Some("[usage]\nflush_ms = 1\n"))],
    );

    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].starts_with("flush.toml: usage.flush_ms: "),
        "{lines:?}"
    );
    assert_eq!(code, Some(1));
}

#[test]
fn check_config_says_on_one_line_why_a_file_is_not_toml_and_exits_1() {
    let dir = tempfile::tempdir().unwrap();

    let (code, lines) = check_config(
        dir.path(),
        &[],
        &[("prose.toml", Some("this is not toml\n"))],
    );

    // The parser's own message spans lines (it draws the bad one): folded into one.
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].starts_with("prose.toml: TOML parse error at line 1, column 6: "),
        "{lines:?}"
    );
    assert!(lines[0].contains("expected `=`"), "{lines:?}");
    assert_eq!(code, Some(1));
}

#[test]
fn check_config_reports_every_file_and_exits_1_when_one_is_bad() {
    let dir = tempfile::tempdir().unwrap();

    let (code, lines) = check_config(
        dir.path(),
        &[],
        &[
            (
                "bad.toml",
                Some("[redis]\ntimeout_ms = 0\n[usage]\nflush_ms = 1\n"),
            ),
            ("good.toml", Some("[usage]\nflush_ms = 5000\n")),
        ],
    );

    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(lines[0].starts_with("bad.toml: "), "{lines:?}");
    assert!(lines[0].contains("redis.timeout_ms: "), "{lines:?}");
    assert!(lines[0].contains("usage.flush_ms: "), "{lines:?}");
    assert_eq!(lines[1], "good.toml: ok");
    assert_eq!(code, Some(1));
}

#[test]
fn check_config_exits_2_for_a_file_it_cannot_read_and_still_checks_the_others() {
    let dir = tempfile::tempdir().unwrap();

    let (code, lines) = check_config(
        dir.path(),
        &[],
        &[
            ("missing.toml", None),
            ("bad.toml", Some("[usage]\nflush_ms = 1\n")),
        ],
    );

    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[0], "missing.toml: cannot be read: no such file");
    assert!(
        lines[1].starts_with("bad.toml: usage.flush_ms: "),
        "{lines:?}"
    );
    assert_eq!(code, Some(2));
}

#[test]
fn check_config_layers_each_file_over_the_global_config_files_and_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    // An admin certificate needs the admin listener, which only the global file sets.
    let admin_tls = "[tls]\nadmin_cert_file = \"admin.pem\"\nadmin_key_file = \"admin.key\"\n";
    let admin_listen = "[server]\nadmin_listen = \"127.0.0.1:9090\"\n";

    let (alone, alone_lines) = check_config(dir.path(), &[], &[("tls.toml", Some(admin_tls))]);
    let (layered, layered_lines) = check_config(
        dir.path(),
        &[("base.toml", admin_listen)],
        &[("tls.toml", Some(admin_tls))],
    );
    let by_env = output_within(
        Command::new(binary())
            .current_dir(dir.path())
            .env("TOLLGATE__USAGE__FLUSH_MS", "1")
            .args(["--config", "base.toml", "check-config", "tls.toml"]),
        std::time::Duration::from_secs(20),
    );

    assert_eq!(alone, Some(1));
    assert!(
        alone_lines[0].starts_with("tls.toml: tls.admin_cert_file: "),
        "{alone_lines:?}"
    );
    assert_eq!(layered_lines, ["tls.toml: ok"]);
    assert_eq!(layered, Some(0));
    let stdout = String::from_utf8_lossy(&by_env.stdout);
    assert!(stdout.starts_with("tls.toml: usage.flush_ms: "), "{stdout}");
    assert_eq!(by_env.status.code(), Some(1));
}

#[test]
fn check_config_starts_nothing_and_leaves_what_is_read_at_start_unchecked() {
    let dir = tempfile::tempdir().unwrap();
    // A listen address in use, a Redis no one serves, certificate files that are not
    // there: each stops `serve` at start, none is the configuration load's to check.
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let toml = format!(
        "[server]\nlisten = \"{}\"\n[redis]\nurl = \"redis://127.0.0.1:{}\"\n\
         [tls]\ncert_file = \"absent.pem\"\nkey_file = \"absent.key\"\n",
        held.local_addr().unwrap(),
        free_port().unwrap(),
    );

    let (code, lines) = check_config(dir.path(), &[], &[("start.toml", Some(&toml))]);

    assert_eq!(lines, ["start.toml: ok"]);
    assert_eq!(code, Some(0));
}

/// `tollgate healthcheck` (the image's HEALTHCHECK) under the environment the gateway has.
fn healthcheck(listen: &str) -> Option<i32> {
    Command::new(binary())
        .arg("healthcheck")
        .env("TOLLGATE__SERVER__LISTEN", listen)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
        .status
        .code()
}

#[test]
fn the_healthcheck_command_exits_0_while_the_gateway_serves_and_1_once_it_is_gone() {
    let mut gw = gateway_process("", &[]);
    let port = gw.address.rsplit(':').next().unwrap().to_string();

    assert_eq!(healthcheck(&format!("127.0.0.1:{port}")), Some(0));
    // The image listens on 0.0.0.0: the check asks loopback.
    assert_eq!(healthcheck(&format!("0.0.0.0:{port}")), Some(0));

    gw.child.kill().unwrap();
    gw.child.wait().unwrap();
    assert_eq!(healthcheck(&format!("127.0.0.1:{port}")), Some(1));
}

#[tokio::test]
async fn health_and_readiness_answer() {
    let redis = RedisServer::start().unwrap();
    let redis_port = redis.port;
    let gw = TestGateway::spawn(settings(&format!("[redis]\nurl = \"{}\"\n", redis.url()))).await;
    assert_eq!(gw.get("/healthz", None).await.status(), 200);
    let ready = gw.get("/readyz", None).await;
    assert_eq!(ready.status(), 200);
    let body: serde_json::Value = ready.json().await.unwrap();
    assert_eq!(
        body,
        serde_json::json!({"status": "ready", "catalog": "store"})
    );
    drop(redis);
    let ready = gw.get("/readyz", None).await;
    assert_eq!(ready.status(), 503);
    let body = ready.text().await.unwrap();
    assert!(body.contains("\"reason\""), "{body}");
    // The public listener names no Redis host, port or user.
    assert!(
        !body.contains("127.0.0.1") && !body.contains(&redis_port.to_string()),
        "{body}"
    );
}

/// The start-up log lines of the binary (stdout), up to "tollgate started".
fn startup_log(toml: &str) -> String {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("gw.toml");
    std::fs::write(
        &file,
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nworkers = 1\n{toml}[catalog]\nfile = {:?}\ncache_file = {:?}\n",
            dir.path().join("catalog.json").to_str().unwrap(),
            dir.path().join("catalog-cache.json").to_str().unwrap()
        ),
    )
    .unwrap();
    let mut child = Command::new(binary())
        .arg("--config")
        .arg(&file)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Lines arrive on a thread, so a gateway that never logs its start fails the test
    // after 20 s instead of hanging it.
    let (tx, rx) = std::sync::mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut log = String::new();
    let started = loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                log.push_str(&line);
                log.push('\n');
                if line.contains("tollgate started") {
                    break true;
                }
            }
            Err(_) => break false,
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(started, "no start-up line within 20 s: {log}");
    log
}

#[test]
fn one_warning_at_start_when_admin_and_metrics_share_the_public_listener() {
    let shared = startup_log("");
    let warnings: Vec<&str> = shared
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("admin_listen"))
        .collect();
    assert_eq!(warnings.len(), 1, "{shared}");
    let apart = startup_log("admin_listen = \"127.0.0.1:0\"\n");
    assert!(!apart.contains("admin_listen is empty"), "{apart}");
}

#[tokio::test]
async fn the_start_up_log_names_the_store_without_its_password() {
    let redis = RedisServer::start().unwrap();
    // Read until the start-up line itself (waiting for the port raced the log: the
    // listener is bound before the line is written).
    let log = startup_log(&format!(
        "region = \"eu\"\n[redis]\nurl = \"redis://:hunter2@127.0.0.1:{}\"\n",
        redis.port
    ));
    assert!(log.contains("tollgate started"), "{log}");
    assert!(log.contains("listen=127.0.0.1:"), "{log}");
    assert!(log.contains("region=eu"), "{log}");
    assert!(
        log.contains(&format!("redis://:***@127.0.0.1:{}", redis.port)),
        "{log}"
    );
    assert!(!log.contains("hunter2"));
}

#[tokio::test]
async fn sigterm_lets_in_flight_requests_finish_then_exits_0() {
    let up = Upstream::start(Behaviour::Slow(std::time::Duration::from_millis(800))).await;
    let toml = format!(
        "{}{}",
        catalog_toml(("gold", 10.0, 1.0), &["acme"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let mut gw = gateway_process(&toml, &[]);
    let url = format!("{}/orders", gw.address);
    let in_flight = tokio::spawn(async move {
        reqwest::Client::new()
            .get(url)
            .header("x-api-key", key("acme"))
            .send()
            .await
            .map(|r| r.status().as_u16())
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;

    let killed = Command::new("kill")
        .args(["-TERM", &gw.child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());

    assert_eq!(in_flight.await.unwrap().unwrap(), 200);
    let status = tokio::task::spawn_blocking(move || gw.child.wait().unwrap())
        .await
        .unwrap();
    assert_eq!(status.code(), Some(0));
}

#[test]
fn a_second_process_on_the_same_embedded_catalog_file_is_refused() {
    // Arrange: a gateway running on the embedded store with catalog file F.
    let first = gateway_process("", &[]);
    let catalog = first.catalog.clone();

    // Act: a second gateway is started on F.
    let out = output_within(
        Command::new(binary())
            .env(
                "TOLLGATE__SERVER__LISTEN",
                format!("127.0.0.1:{}", free_port().unwrap()),
            )
            .env("TOLLGATE__CATALOG__FILE", &catalog),
        std::time::Duration::from_secs(10),
    );

    // Assert: it stops with a line that says why, and the first one still serves.
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("in use by another tollgate process"), "{err}");
    let health = std::net::TcpStream::connect(first.address.trim_start_matches("http://"));
    assert!(health.is_ok(), "the first gateway still listens");
}

#[tokio::test]
async fn concurrent_embedded_catalog_writes_all_land_and_leave_no_temporary_file() {
    // Arrange.
    let s = settings(&admin_toml());
    let file = s.catalog.file.clone();
    let gw = TestGateway::spawn(s).await;
    let token = admin_token("ops", "admin:read admin:write");

    // Act: writes from several requests at once.
    let writes = (0..20).map(|i| {
        gw.admin(reqwest::Method::PUT, &format!("/plans/p{i}"), &token)
            .json(&serde_json::json!({"capacity": 10, "rate": 1}))
            .send()
    });
    for r in futures_util::future::join_all(writes).await {
        assert_eq!(r.unwrap().status(), 201);
    }

    // Assert: every write is in the file, and nothing else is beside it but its lock.
    let stored: serde_json::Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    assert_eq!(stored["plans"].as_object().unwrap().len(), 20);
    let beside: Vec<String> = std::fs::read_dir(file.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .filter(|n| n.contains("catalog") && !n.ends_with(".toml"))
        .collect();
    let mut beside = beside;
    beside.sort();
    assert_eq!(beside, ["catalog.json", "catalog.json.lock"], "{beside:?}");
}
