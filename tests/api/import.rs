//! `tollgate import FILE`, the real binary against a real Redis: a file of clients loaded
//! in atomic chunks and audited once, a bad file refused whole by line and field, an
//! import refused midway resumed where it stopped, and a gateway in cache mode admitting
//! an imported key it had remembered as unknown, within its refresh.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use reqwest::Method;
use serde_json::json;

use crate::helpers::*;

fn rw() -> String {
    admin_token("ops", "admin:read admin:write")
}

/// Gateway B: the admin API, plan `gold`, route `/orders`, on `redis_url` (with `catalog`
/// lines).
async fn gateway(redis_url: &str, up: &Upstream, catalog: &str) -> TestGateway {
    TestGateway::spawn(settings(&format!(
        "{}[redis]\nurl = \"{redis_url}\"\n[catalog]\nrefresh_ms = 50\n{catalog}\n[edge]\nfailed_keys_sets = 0\n{}{}",
        admin_toml(),
        catalog_toml(("gold", 1_000_000.0, 1000.0), &[]),
        route_toml("orders", "/orders", &[up.url()]),
    )))
    .await
}

/// A file of clients `c<from>`..`c<to>` (exclusive) on plan gold, each with the kit's key.
fn clients_file(dir: &Path, from: usize, to: usize) -> PathBuf {
    let lines: Vec<String> = (from..to)
        .map(|i| {
            let id = format!("c{i}");
            json!({"id": id, "plan": "gold", "keys": [{"key": key(&id)}]}).to_string()
        })
        .collect();
    let file = dir.join("clients.jsonl");
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
    file
}

/// Runs `tollgate import` on `redis_url` with `args`.
fn import(dir: &Path, redis_url: &str, args: &[&str]) -> Output {
    let config = dir.join("import.toml");
    std::fs::write(&config, format!("[redis]\nurl = \"{redis_url}\"\n")).unwrap();
    std::process::Command::new(binary())
        .arg("--config")
        .arg(&config)
        .arg("import")
        .args(args)
        .output()
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn count(redis: &RedisServer, cmd: &str, key: &str) -> usize {
    redis::cmd(cmd)
        .arg(key)
        .query(&mut redis.conn().unwrap())
        .unwrap()
}

/// The audit log's `catalog.import` entries.
fn imports_audited(redis: &RedisServer) -> Vec<Vec<(String, String)>> {
    audited(redis, "catalog.import")
}

#[tokio::test]
async fn a_file_of_clients_is_imported_in_chunks_audited_once_and_admitted() {
    // Arrange.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let b = gateway(&redis.url(), &up, "").await;
    let dir = tempfile::tempdir().unwrap();
    let file = clients_file(dir.path(), 0, 2500);

    // Act.
    let out = import(
        dir.path(),
        &redis.url(),
        &[file.to_str().unwrap(), "--chunk", "1000"],
    );

    // Assert: three chunks, every client and key in the store, one audit entry, and the
    // keys admitted by the gateway that follows the feed.
    assert!(out.status.success(), "{}", text(&out.stderr));
    let said = text(&out.stdout);
    assert!(said.contains("imported 2500 clients"), "{said}");
    assert!(
        said.contains("3 chunk(s) written now, 0 written before"),
        "{said}"
    );
    assert_eq!(count(&redis, "HLEN", "tollgate:{catalog}:clients"), 2500);
    assert_eq!(count(&redis, "HLEN", "tollgate:{catalog}:keys"), 2500);
    assert_eq!(count(&redis, "ZCARD", "tollgate:{catalog}:index"), 2500);
    let audited = imports_audited(&redis);
    assert_eq!(audited.len(), 1, "one audit entry for the import");
    assert!(audited[0]
        .iter()
        .any(|(k, v)| k == "after" && v.contains("\"clients\":2500")));
    let r = b
        .admin(Method::GET, "/clients/c2499", &rw())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    eventually(Duration::from_secs(5), "B admits imported keys", || async {
        b.get("/orders", Some(&key("c0"))).await.status() == 200
            && b.get("/orders", Some(&key("c2499"))).await.status() == 200
    })
    .await;

    // The same file again: done already, nothing written.
    let out = import(dir.path(), &redis.url(), &[file.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("0 chunk(s) written now, 3 written before"));
    assert_eq!(imports_audited(&redis).len(), 1);
}

#[tokio::test]
async fn a_bad_file_is_refused_whole_naming_each_line_and_field() {
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let _b = gateway(&redis.url(), &up, "").await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.jsonl");
    std::fs::write(
        &file,
        [
            r#"{"id": "ok", "plan": "gold"}"#,
            r#"{"id": "nope", "plan": "silver"}"#,
            r#"{"id": "k", "plan": "gold", "keys": [{"key": "short"}]}"#,
            r#"{"id": "ok", "plan": "gold"}"#,
        ]
        .join("\n"),
    )
    .unwrap();

    let out = import(dir.path(), &redis.url(), &[file.to_str().unwrap()]);

    assert_eq!(out.status.code(), Some(2));
    let said = text(&out.stderr);
    for problem in ["line 2: plan:", "line 3: keys[0].key:", "line 4: id:"] {
        assert!(said.contains(problem), "{problem} in {said}");
    }
    assert!(said.contains("nothing was written"), "{said}");
    assert_eq!(count(&redis, "HLEN", "tollgate:{catalog}:clients"), 0);
}

#[tokio::test]
async fn an_import_refused_midway_resumes_where_it_stopped() {
    // Arrange: c1500, in the file's second chunk, exists already.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let b = gateway(&redis.url(), &up, "").await;
    put_client(&b, "c1500", "gold").await;
    let dir = tempfile::tempdir().unwrap();
    let file = clients_file(dir.path(), 0, 2500);
    let file = file.to_str().unwrap();

    // Act: the first run stops at the second chunk, which writes nothing of itself.
    let out = import(dir.path(), &redis.url(), &[file, "--id", "signups"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let said = text(&out.stderr);
    assert!(said.contains("chunk 1"), "{said}");
    assert!(said.contains("\"c1500\" exists already"), "{said}");
    assert!(said.contains("--id signups"), "{said}");
    assert_eq!(count(&redis, "HLEN", "tollgate:{catalog}:clients"), 1001);
    assert!(imports_audited(&redis).is_empty(), "not audited until done");

    // The conflict removed, a rerun resumes at the second chunk.
    let r = b
        .admin(Method::DELETE, "/clients/c1500", &rw())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    let out = import(dir.path(), &redis.url(), &[file, "--id", "signups"]);

    // Assert.
    assert!(out.status.success(), "{}", text(&out.stderr));
    let said = text(&out.stdout);
    assert!(
        said.contains("2 chunk(s) written now, 1 written before"),
        "{said}"
    );
    assert_eq!(count(&redis, "HLEN", "tollgate:{catalog}:clients"), 2500);
    assert_eq!(imports_audited(&redis).len(), 1);
}

#[tokio::test]
async fn a_gateway_in_cache_mode_admits_an_imported_key_it_had_as_unknown() {
    // Arrange: A in cache mode, without a key filter (which would refuse c7's key unread),
    // remembers c7's key as unknown. (An admin write first gives the catalog its epoch, so
    // the import is followed through the feed, not a reload.)
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let b = gateway(&redis.url(), &up, "").await;
    put_client(&b, "first", "gold").await;
    let a = gateway(&redis.url(), &up, "mode = \"cache\"\nkey_filter_mib = 0").await;
    a.wait_for_catalog(store_version(&redis)).await;
    assert_eq!(a.get("/orders", Some(&key("c7"))).await.status(), 401);
    assert_eq!(a.sample("tollgate_catalog_unknown_keys").await, 1.0);

    // Act.
    let dir = tempfile::tempdir().unwrap();
    let file = clients_file(dir.path(), 0, 1500);
    let out = import(dir.path(), &redis.url(), &[file.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));

    // Assert: admitted within a poll or two; A held none of the 1,500 meanwhile.
    eventually(Duration::from_secs(2), "A admits c7's key", || async {
        a.get("/orders", Some(&key("c7"))).await.status() == 200
    })
    .await;
    assert_eq!(a.sample("tollgate_catalog_clients").await, 1.0);
}
