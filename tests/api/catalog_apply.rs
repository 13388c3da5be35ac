//! The catalog as code: `PUT /admin/v1/catalog` applies a whole catalog, as
//! `GET /admin/v1/catalog` exports it, in one atomic step guarded by the version it was
//! reviewed at. An export applied to an empty store (Redis, or the embedded store) gives
//! the same catalog back, and its keys work; a stale apply is refused and writes nothing;
//! a dry run says what would change, and which clients' limits; a bad file is refused
//! whole, each problem named.

use reqwest::Method;
use serde_json::{json, Value};

use crate::helpers::*;

fn rw() -> String {
    admin_token("ops", "admin:read admin:write")
}

/// A gateway on `redis_url` (`None`: the embedded store, in `dir`) with the admin API and
/// route `/orders`, declaring no plan or client of its own.
fn toml(redis_url: Option<&str>, dir: &std::path::Path, up: &Upstream) -> String {
    let store = match redis_url {
        Some(url) => format!("[redis]\nurl = \"{url}\"\ncontrol_timeout_ms = 1000\n"),
        None => String::new(),
    };
    format!(
        "{}{store}[catalog]\nrefresh_ms = 50\nfile = {:?}\ncache_file = \"\"\n{}",
        admin_toml(),
        dir.join("catalog.json"),
        route_toml("orders", "/orders", &[up.url()]),
    )
}

async fn admin(gw: &TestGateway, method: Method, path: &str, body: Option<Value>) -> Value {
    let r = gw.send_admin(method.clone(), path, &rw(), body).await;
    let status = r.status();
    let text = r.text().await.unwrap();
    assert!(status.is_success(), "{method} {path}: {status} {text}");
    serde_json::from_str(&text).unwrap_or(Value::Null)
}

/// `PUT /catalog` with `If-Match` (`None`: without) and a query.
async fn apply(
    gw: &TestGateway,
    body: &Value,
    if_match: Option<u64>,
    query: &str,
) -> reqwest::Response {
    let mut req = gw
        .admin(Method::PUT, &format!("/catalog{query}"), &rw())
        .json(body);
    if let Some(v) = if_match {
        req = req.header("if-match", format!("\"{v}\""));
    }
    req.send().await.unwrap()
}

async fn export(gw: &TestGateway) -> Value {
    admin(gw, Method::GET, "/catalog", None).await
}

/// A catalog with something of everything: two plans (one of a bucket, a quota and a
/// service's bucket), clients with a mode, shards, an override, keys (one expiring, one
/// rolled), and safety settings. Returns acme's key.
async fn fill(gw: &TestGateway) -> String {
    admin(
        gw,
        Method::PUT,
        "/plans/gold",
        Some(json!({"limits": [
            {"name": "burst", "capacity": 100, "rate": 10},
            {"name": "monthly", "quota": 100000, "period": "month"},
            {"name": "search", "service": "orders", "capacity": 50, "rate": 5}
        ], "description": "gold", "max_connections": 4})),
    )
    .await;
    admin(
        gw,
        Method::PUT,
        "/plans/silver",
        Some(json!({"capacity": 10, "rate": 1})),
    )
    .await;
    admin(
        gw,
        Method::PUT,
        "/clients/acme",
        Some(json!({"plan": "gold", "mode": "enforce", "shards": {"regions": ["eu", "us"]}})),
    )
    .await;
    let (_, acme_key) = new_key(gw, "acme").await;
    admin(
        gw,
        Method::PUT,
        "/clients/acme/overrides/burst",
        Some(json!({"capacity": 400, "until": "2035-01-01T00:00:00Z"})),
    )
    .await;
    admin(
        gw,
        Method::PUT,
        "/clients/beta",
        Some(json!({"plan": "silver", "mode": "shadow"})),
    )
    .await;
    let key = admin(
        gw,
        Method::POST,
        "/clients/beta/keys",
        Some(json!({"expires_at": "2034-06-01T00:00:00Z"})),
    )
    .await;
    admin(
        gw,
        Method::POST,
        &format!(
            "/clients/beta/keys/{}/roll",
            key["key_id"].as_str().unwrap()
        ),
        Some(json!({"overlap_s": 3600})),
    )
    .await;
    admin(
        gw,
        Method::PUT,
        "/safety",
        Some(json!({"multiplier": 7, "services": {"orders": 20}})),
    )
    .await;
    acme_key
}

/// An export without its version: what two catalogs share when they are the same.
fn records(mut export: Value) -> Value {
    export.as_object_mut().unwrap().remove("version");
    export
}

#[tokio::test]
async fn an_export_applied_to_an_empty_store_gives_the_same_catalog_whose_keys_work() {
    // Arrange: a catalog of everything on Redis, exported; an empty Redis and an empty
    // embedded store, each behind a gateway of its own.
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let source_redis = RedisServer::start().unwrap();
    let source = TestGateway::spawn(settings(&toml(
        Some(&source_redis.url()),
        &dir.path().join("source"),
        &up,
    )))
    .await;
    let acme_key = fill(&source).await;
    source.wait_for_catalog(store_version(&source_redis)).await;
    let exported = export(&source).await;
    let empty_redis = RedisServer::start().unwrap();
    let redis_dir = dir.path().join("redis");
    let embedded_dir = dir.path().join("embedded");
    std::fs::create_dir_all(&embedded_dir).unwrap();
    let on_redis =
        TestGateway::spawn(settings(&toml(Some(&empty_redis.url()), &redis_dir, &up))).await;
    let embedded = TestGateway::spawn(settings(&toml(None, &embedded_dir, &up))).await;

    for (target, name) in [(&on_redis, "redis"), (&embedded, "embedded")] {
        // Act: applied over the empty catalog (version 0).
        let r = apply(target, &exported, Some(0), "").await;

        // Assert: applied, one version per record; the export it gives back is the
        // source's (the versions and ETags aside: every record is at a version of the
        // apply); acme's key is admitted and an unknown key is not.
        assert_eq!(r.status(), 200, "{name}: {:?}", r.text().await);
        let report: Value = r.json().await.unwrap();
        assert_eq!(report["applied"], true, "{name}");
        assert_eq!(report["from_version"], 0, "{name}");
        // 2 plans, 2 clients, the safety settings.
        assert_eq!(report["writes"], 5, "{name}: {report}");
        assert_eq!(report["version"], 5, "{name}: {report}");
        assert_eq!(
            report["plans"]["added"],
            json!(["gold", "silver"]),
            "{name}"
        );
        assert_eq!(
            report["clients"]["added"],
            json!(["acme", "beta"]),
            "{name}"
        );
        assert_eq!(report["safety"], true, "{name}");
        target.wait_for_catalog(5).await;
        assert_eq!(
            records(export(target).await),
            records(exported.clone()),
            "{name}: the applied catalog differs from the export"
        );
        assert_eq!(
            target.get("/orders", Some(&acme_key)).await.status(),
            200,
            "{name}"
        );
        assert_eq!(
            target
                .get("/orders", Some("made-up-key-0000"))
                .await
                .status(),
            401,
            "{name}"
        );
        // Applied again, it changes nothing.
        let again = apply(target, &exported, Some(5), "").await;
        assert_eq!(again.status(), 200, "{name}");
        let again: Value = again.json().await.unwrap();
        assert_eq!(again["writes"], 0, "{name}: {again}");
        assert_eq!(again["version"], 5, "{name}");
    }
    // One audit entry for the whole apply.
    let entries = audited(&empty_redis, "catalog.apply");
    assert_eq!(entries.len(), 1, "{entries:?}");
    let field = |k: &str| {
        entries[0]
            .iter()
            .find(|(f, _)| f == k)
            .map(|(_, v)| v.clone())
            .unwrap()
    };
    assert_eq!(field("actor"), "ops");
    assert_eq!(field("rev"), "5");
    let after: Value = serde_json::from_str(&field("after")).unwrap();
    assert_eq!(after["clients"]["added"], 2, "{after}");
}

#[tokio::test]
async fn a_dry_run_says_what_changes_then_the_apply_makes_it_at_once_for_every_gateway() {
    // Arrange: a catalog; a second gateway following it; the file: gold's burst doubled,
    // beta removed, aaa added with a key acme gives up, silver removed with beta.
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let redis = RedisServer::start().unwrap();
    let gw = TestGateway::spawn(settings(&toml(Some(&redis.url()), dir.path(), &up))).await;
    let other = TestGateway::spawn(settings(&toml(
        Some(&redis.url()),
        &dir.path().join("other"),
        &up,
    )))
    .await;
    let acme_key = fill(&gw).await;
    let (_, second) = new_key(&gw, "acme").await;
    gw.wait_for_catalog(store_version(&redis)).await;
    let mut file = export(&gw).await;
    let at = file["version"].as_u64().unwrap();
    file["plans"][0]["limits"][0]["capacity"] = json!(200.0);
    file["plans"][0]["capacity"] = json!(200.0);
    file["plans"][0]["limits"][1]["quota"] = json!(200000.0);
    file["plans"].as_array_mut().unwrap().remove(1);
    let clients = file["clients"].as_array_mut().unwrap();
    clients.remove(1);
    // acme's second key moves to aaa.
    let moved = clients[0]["keys"].as_array_mut().unwrap().remove(1);
    clients.push(json!({"id": "aaa", "plan": "gold", "keys": [
        {"hash": moved["hash"].clone()}
    ], "overrides": []}));

    // Act: a dry run, then the apply at the version reviewed.
    let dry = apply(&gw, &file, None, "?dry_run=true").await;
    assert_eq!(dry.status(), 200);
    let dry: Value = dry.json().await.unwrap();
    let unchanged = store_version(&redis);
    let applied = apply(&gw, &file, Some(at), "").await;

    // Assert: the dry run names every change and wrote nothing; the apply made them, one
    // version each, and both gateways follow; the key that moved works for its new owner.
    assert_eq!(dry["applied"], false);
    assert_eq!(dry["from_version"], at);
    assert_eq!(dry["version"], at);
    assert_eq!(dry["plans"]["changed"], json!(["gold"]), "{dry}");
    assert_eq!(dry["plans"]["removed"], json!(["silver"]), "{dry}");
    assert_eq!(dry["clients"]["added"], json!(["aaa"]), "{dry}");
    assert_eq!(dry["clients"]["changed"], json!(["acme"]), "{dry}");
    assert_eq!(dry["clients"]["removed"], json!(["beta"]), "{dry}");
    // acme's burst is its override's (400) either way; its monthly quota is gold's.
    assert_eq!(dry["limits_changed"], json!(["acme"]), "{dry}");
    assert_eq!(dry["writes"], 5, "{dry}");
    assert_eq!(unchanged, at, "a dry run wrote");
    assert_eq!(applied.status(), 200);
    let applied: Value = applied.json().await.unwrap();
    assert_eq!(applied["version"], at + 5, "{applied}");
    assert_eq!(store_version(&redis), at + 5);
    for g in [&gw, &other] {
        g.wait_for_catalog(at + 5).await;
        let r = g
            .send_admin(Method::GET, "/clients/beta", &rw(), None)
            .await;
        assert_eq!(r.status(), 404);
        let plans = admin(g, Method::GET, "/plans", None).await;
        assert_eq!(plans["items"].as_array().unwrap().len(), 1, "{plans}");
        assert_eq!(g.get("/orders", Some(&acme_key)).await.status(), 200);
        assert_eq!(g.get("/orders", Some(&second)).await.status(), 200);
    }
    let last = up.seen().pop().unwrap();
    assert_eq!(last.headers["x-client-id"], "aaa");
}

#[tokio::test]
async fn an_apply_over_a_catalog_changed_since_is_refused_and_writes_nothing_unless_forced() {
    // Arrange: a catalog exported at version `at`, then changed by someone else.
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let redis = RedisServer::start().unwrap();
    let gw = TestGateway::spawn(settings(&toml(Some(&redis.url()), dir.path(), &up))).await;
    fill(&gw).await;
    gw.wait_for_catalog(store_version(&redis)).await;
    let mut file = export(&gw).await;
    let at = file["version"].as_u64().unwrap();
    admin(
        &gw,
        Method::PUT,
        "/clients/late",
        Some(json!({"plan": "silver"})),
    )
    .await;
    file["clients"].as_array_mut().unwrap().remove(1);

    // Act
    let stale = apply(&gw, &file, Some(at), "").await;
    let unguarded = apply(&gw, &file, None, "").await;
    let after_refusals = store_version(&redis);
    let audits_after_refusals = audited(&redis, "catalog.apply").len();
    let forced = apply(&gw, &file, None, "?force=true").await;

    // Assert: 412 and 428 write nothing (late and beta stay); forced, the file wins.
    assert_eq!(stale.status(), 412);
    assert!(stale.text().await.unwrap().contains(&format!("{}", at + 1)));
    assert_eq!(unguarded.status(), 428);
    assert_eq!(after_refusals, at + 1);
    assert_eq!(audits_after_refusals, 0);
    assert_eq!(forced.status(), 200);
    let forced: Value = forced.json().await.unwrap();
    assert_eq!(
        forced["clients"]["removed"],
        json!(["beta", "late"]),
        "{forced}"
    );
    assert_eq!(forced["from_version"], at + 1);
}

#[tokio::test]
async fn a_bad_file_is_refused_whole_with_each_problem_named() {
    // Arrange
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let redis = RedisServer::start().unwrap();
    let gw = TestGateway::spawn(settings(
        &toml(Some(&redis.url()), dir.path(), &up).replacen(
            "[admin]\n",
            "[admin]\ncatalog_max_bytes = 65536\n",
            1,
        ),
    ))
    .await;
    fill(&gw).await;
    let at = store_version(&redis);
    let hash = format!("sha256:{}", "ab".repeat(32));
    let file = json!({
        "plans": [
            {"name": "gold", "capacity": 10, "rate": 1},
            {"name": "gold", "capacity": 10, "rate": 1},
            {"name": "bad", "capacity": -1, "rate": 1}
        ],
        "clients": [
            {"id": "a", "plan": "nope", "keys": [{"hash": hash}]},
            {"id": "b", "plan": "gold", "keys": [{"hash": hash}, {"hash": "md5:x"}]},
            {"id": "a", "plan": "gold"},
            {"id": "c", "plan": "gold", "keys": [{"hash": hash.replace("ab", "cd"), "key_id": "0"}],
             "overrides": [{"limit": "default", "capacity": 0}]},
            {"id": "..", "plan": "gold", "colour": "red"}
        ],
        "extra": 1
    });

    // Act
    let r = apply(&gw, &file, Some(at), "").await;

    // Assert
    assert_eq!(r.status(), 422);
    let fields = problem_fields(r).await;
    for expected in [
        "extra",
        "plans[1].name",
        "plans[2].capacity",
        "clients[0].plan",
        "clients[1].keys[0].hash",
        "clients[1].keys[1].hash",
        "clients[2].id",
        "clients[3].keys[0].key_id",
        "clients[3].overrides[0].capacity",
        "clients[4].id",
        "clients[4].colour",
    ] {
        assert!(
            fields.iter().any(|f| f == expected),
            "{expected} not in {fields:?}"
        );
    }
    assert_eq!(store_version(&redis), at, "a refused file wrote");
    // Bodies past admin.catalog_max_bytes are refused unread.
    let big = json!({"plans": [], "clients": [], "pad": "x".repeat(100_000)});
    let r = apply(&gw, &big, Some(at), "").await;
    assert_eq!(r.status(), 413);
}

/// `tollgate catalog <args>` against `gw`: its exit code, stdout and stderr.
async fn cli(gw: &TestGateway, args: &[&str]) -> (i32, String, String) {
    let out = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        tokio::process::Command::new(binary())
            .arg("catalog")
            .args(args)
            .env("TOLLGATE_URL", &gw.address)
            .env("TOLLGATE_ADMIN_TOKEN", rw())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the command ends")
    .expect("the binary runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn the_cli_exports_a_toml_file_diffs_it_and_applies_it_only_over_the_version_diffed() {
    // Arrange: a catalog; exported to TOML by the command line.
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let redis = RedisServer::start().unwrap();
    let gw = TestGateway::spawn(settings(&toml(Some(&redis.url()), dir.path(), &up))).await;
    let acme_key = fill(&gw).await;
    gw.wait_for_catalog(store_version(&redis)).await;
    let file = dir.path().join("catalog.toml");
    let file_arg = file.to_str().unwrap();
    let (code, said, err) = cli(&gw, &["export", "--out", file_arg]).await;
    assert_eq!(code, 0, "{said}{err}");
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.contains("[[clients]]"), "{text}");
    assert!(!text.contains(&acme_key), "a plaintext key in the file");

    // Act 1: diffed as exported, then with gold's description edited.
    let (same, same_said, _) = cli(&gw, &["diff", file_arg]).await;
    std::fs::write(
        &file,
        text.replace("description = \"gold\"", "description = \"gold, reviewed\""),
    )
    .unwrap();
    let (differs, differs_said, _) = cli(&gw, &["diff", file_arg]).await;
    let reviewed_at = store_version(&redis);
    // Someone changes the catalog after the review.
    admin(
        &gw,
        Method::PUT,
        "/clients/late",
        Some(json!({"plan": "silver"})),
    )
    .await;
    let at = reviewed_at.to_string();
    let (stale, _, stale_err) = cli(&gw, &["apply", file_arg, "--if-version", &at]).await;
    let after_stale = store_version(&redis);
    let (applied, applied_said, applied_err) = cli(&gw, &["apply", file_arg]).await;

    // Assert: as diff(1): 0 the same, 1 different (naming gold); the apply over the
    // version reviewed is refused (2) and writes nothing; the apply that diffs itself
    // writes gold and removes late, which the file lacks.
    assert_eq!(same, 0, "{same_said}");
    assert!(same_said.contains("0 record(s)"), "{same_said}");
    assert_eq!(differs, 1, "{differs_said}");
    assert!(differs_said.contains("~ plan gold"), "{differs_said}");
    assert_eq!(stale, 2);
    assert!(stale_err.contains("412"), "{stale_err}");
    assert_eq!(after_stale, reviewed_at + 1);
    assert_eq!(applied, 0, "{applied_said}{applied_err}");
    assert!(applied_said.contains("- client late"), "{applied_said}");
    assert!(applied_said.contains("applied"), "{applied_said}");
    let gold = admin(&gw, Method::GET, "/plans/gold", None).await;
    assert_eq!(gold["description"], "gold, reviewed");
    // Without a token the command says what it needs.
    let out = tokio::process::Command::new(binary())
        .args(["catalog", "diff", file_arg, "--url", &gw.address])
        .env_remove("TOLLGATE_ADMIN_TOKEN")
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("admin token"));
}

#[tokio::test]
async fn an_apply_of_many_changes_is_put_in_place_whole_and_every_gateway_reloads_it() {
    // Arrange: two gateways on one Redis; a file of 150 clients (past the hundred an apply
    // makes one by one), each with a key.
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let redis = RedisServer::start().unwrap();
    let gw = TestGateway::spawn(settings(&toml(Some(&redis.url()), dir.path(), &up))).await;
    let other = TestGateway::spawn(settings(&toml(
        Some(&redis.url()),
        &dir.path().join("other"),
        &up,
    )))
    .await;
    let key = |i: usize| format!("bulk-key-{i:04}-0123456789");
    let clients: Vec<Value> = (0..150)
        .map(|i| {
            let hash = tollgate::domain::KeyHash::of(&key(i)).to_string();
            json!({"id": format!("c{i:03}"), "plan": "p", "keys": [{"hash": hash}]})
        })
        .collect();
    let file = json!({"plans": [{"name": "p", "capacity": 10, "rate": 1}], "clients": clients});

    // Act
    let r = apply(&gw, &file, Some(0), "").await;

    // Assert: 151 records, at versions 1 to 151 as one by one; both gateways serve the
    // last client's key, the one that followed by reloading; one audit entry.
    assert_eq!(r.status(), 200);
    let report: Value = r.json().await.unwrap();
    assert_eq!(report["writes"], 151, "{report}");
    assert_eq!(report["version"], 151);
    for g in [&gw, &other] {
        g.wait_for_catalog(151).await;
        assert_eq!(g.get("/orders", Some(&key(149))).await.status(), 200);
    }
    let c149 = admin(&other, Method::GET, "/clients/c149", None).await;
    assert_eq!(c149["plan"], "p");
    assert_eq!(audited(&redis, "catalog.apply").len(), 1);
}
