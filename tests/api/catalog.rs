//! The catalog keeps its promises across resets: a store that goes back is restored from
//! the gateways' copies by its identity (epoch) and version, nothing deleted or revoked
//! comes back, gateways restoring at once write one catalog once, a restore of thousands of
//! clients goes in bounded chunks and leaves no staging behind, a gateway that missed
//! changes trimmed from the feed reloads the whole catalog, and paging never ends early or
//! lists a client twice. (That edits never flicker is tested where the race can be forced: the mirror's
//! unit test `a_key_never_disappears_while_its_client_is_replaced`.)

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use reqwest::Method;
use serde_json::{json, Value};
use tollgate_testkit::FaultProxy;

use crate::helpers::*;

fn rw() -> String {
    admin_token("ops", "admin:read admin:write")
}

/// A gateway on `redis_url` with the admin API, a route, plan `gold` and a fast catalog.
async fn gateway(redis_url: &str, up: &Upstream, refresh_ms: u64) -> TestGateway {
    let toml = format!(
        "{}[redis]\nurl = \"{redis_url}\"\ntimeout_ms = 100\n[catalog]\nrefresh_ms = {refresh_ms}\n{}{}",
        admin_toml(),
        catalog_toml(("gold", 1_000_000.0, 1.0), &["declared"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    TestGateway::spawn(settings(&toml)).await
}

async fn status(gw: &TestGateway, key: &str) -> u16 {
    gw.get("/orders", Some(key)).await.status().as_u16()
}

fn stored_client(redis: &RedisServer, id: &str) -> Option<String> {
    redis::cmd("HGET")
        .arg("tollgate:{catalog}:clients")
        .arg(id)
        .query(&mut redis.conn().unwrap())
        .unwrap()
}

/// How many restores the audit log records.
fn restores(redis: &RedisServer) -> usize {
    audited(redis, "catalog.restore").len()
}

/// Sends requests with `key` until stopped; counts the answers and the ones admitted.
struct Watch {
    stop: Arc<AtomicBool>,
    answered: Arc<AtomicUsize>,
    admitted: Arc<AtomicUsize>,
}

impl Watch {
    /// Stops it and returns how many answers were admitted, failing the test when too few
    /// came back for "never admitted" to mean anything.
    fn admitted(self) -> usize {
        self.stop.store(true, Ordering::SeqCst);
        let answered = self.answered.load(Ordering::SeqCst);
        assert!(answered >= 10, "only {answered} answers while watching");
        self.admitted.load(Ordering::SeqCst)
    }
}

fn watch_key(gw: &TestGateway, key: &str) -> Watch {
    let (stop, answered, admitted) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
    );
    let (s, n, a) = (
        Arc::clone(&stop),
        Arc::clone(&answered),
        Arc::clone(&admitted),
    );
    let (http, url, key) = (
        gw.http.clone(),
        format!("{}/orders", gw.address),
        key.to_string(),
    );
    tokio::spawn(async move {
        while !s.load(Ordering::SeqCst) {
            if let Ok(r) = http.get(&url).header("x-api-key", &key).send().await {
                n.fetch_add(1, Ordering::SeqCst);
                // Refused as unknown (401), or once this address has sent too many
                // unknown keys, held back (429): anything but a success.
                if r.status().is_success() {
                    a.fetch_add(1, Ordering::SeqCst);
                }
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    Watch {
        stop,
        answered,
        admitted,
    }
}

#[tokio::test]
async fn a_redis_restored_from_a_snapshot_older_than_a_revocation_never_lets_the_key_back() {
    // Arrange: a client with a key, saved in a snapshot; then the key is revoked.
    let mut redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&redis.url(), &up, 100).await;
    put_client(&gw, "acme", "gold").await;
    let (key_id, key) = new_key(&gw, "acme").await;
    eventually(Duration::from_secs(3), "the key works", || async {
        status(&gw, &key).await == 200
    })
    .await;
    let _: () = redis::cmd("SAVE")
        .query(&mut redis.conn().unwrap())
        .unwrap();
    let snapshot_version = store_version(&redis);
    revoke_key(&gw, "acme", &key_id).await;
    eventually(
        Duration::from_secs(3),
        "the revocation in force",
        || async { status(&gw, &key).await == 401 },
    )
    .await;
    let mirror_version = store_version(&redis);
    assert!(mirror_version > snapshot_version);
    let watch = watch_key(&gw, &key);

    // Act: Redis restarts from the snapshot taken before the revocation.
    redis.kill();
    redis.restart().unwrap();
    assert_eq!(
        store_version(&redis),
        snapshot_version,
        "the snapshot loaded"
    );

    // Assert: the gateway restores its newer copy, and the key never works again.
    eventually(
        Duration::from_secs(5),
        "the newer catalog restored",
        || async { store_version(&redis) == mirror_version },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(watch.admitted(), 0, "the revoked key was admitted");
    let keys: Vec<String> = redis::cmd("HKEYS")
        .arg("tollgate:{catalog}:keys")
        .query(&mut redis.conn().unwrap())
        .unwrap();
    assert!(
        keys.iter().all(|h| !h.contains(&key_id[..8])),
        "the revoked key's hash is back in the store: {keys:?}"
    );
    assert_eq!(restores(&redis), 1);
    // Unknown (401), or this address held back after the watch's many unknown keys (429).
    assert!([401, 429].contains(&status(&gw, &key).await));
}

#[tokio::test]
async fn a_redis_restarted_empty_gets_the_catalog_back_without_what_was_deleted() {
    // Arrange: one client deleted, one kept.
    let mut redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&redis.url(), &up, 100).await;
    put_client(&gw, "gone", "gold").await;
    let (_, gone_key) = new_key(&gw, "gone").await;
    put_client(&gw, "kept", "gold").await;
    let (_, kept_key) = new_key(&gw, "kept").await;
    let r = gw
        .admin(Method::DELETE, "/clients/gone", &rw())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    let version = store_version(&redis);
    eventually(Duration::from_secs(3), "the mirror current", || async {
        status(&gw, &gone_key).await == 401 && status(&gw, &kept_key).await == 200
    })
    .await;

    // Act.
    redis.kill();
    redis.restart().unwrap();

    // Assert: the same catalog, at the same version, with the same ETags.
    eventually(Duration::from_secs(5), "restored", || async {
        store_version(&redis) == version
    })
    .await;
    assert!(stored_client(&redis, "gone").is_none());
    assert!(stored_client(&redis, "kept").is_some());
    assert!(stored_client(&redis, "declared").is_some());
    assert_eq!(status(&gw, &gone_key).await, 401);
    assert_eq!(status(&gw, &kept_key).await, 200);
    let r = gw
        .admin(Method::GET, "/clients/kept", &rw())
        .send()
        .await
        .unwrap();
    let etag = r.headers()["etag"].to_str().unwrap().to_string();
    let r = gw
        .admin(Method::PUT, "/clients/kept", &rw())
        .header("if-match", etag)
        .json(&json!({"plan": "gold", "mode": "shadow"}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        200,
        "an ETag from before the restore still matches"
    );
    // And the catalog keeps its identity, so other gateways recognise it.
    let epoch: Option<String> = redis::cmd("GET")
        .arg("tollgate:{catalog}:epoch")
        .query(&mut redis.conn().unwrap())
        .unwrap();
    assert!(epoch.is_some());
}

#[tokio::test]
async fn a_gateway_cut_off_across_a_reset_never_brings_back_what_was_deleted_meanwhile() {
    // Arrange: gateway A through a fault proxy, gateway B direct; client "doomed" known
    // to both.
    let mut redis = RedisServer::start().unwrap();
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", redis.port).parse().unwrap());
    let up = Upstream::start(Behaviour::Echo).await;
    let a = gateway(&proxy.redis_url(), &up, 100).await;
    let b = gateway(&redis.url(), &up, 300).await;
    put_client(&b, "doomed", "gold").await;
    let (_, doomed) = new_key(&b, "doomed").await;
    eventually(Duration::from_secs(3), "A knows the client", || async {
        status(&a, &doomed).await == 200
    })
    .await;

    // Act: A is cut off; the client is deleted through B; Redis restarts empty; A comes
    // back (with its copy from before the delete) while B also restores.
    proxy.partition();
    let r = b
        .admin(Method::DELETE, "/clients/doomed", &rw())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    let version = store_version(&redis);
    b.wait_for_catalog(version).await;
    assert_eq!(status(&b, &doomed).await, 401);
    let watch_b = watch_key(&b, &doomed);
    redis.kill();
    redis.restart().unwrap();
    proxy.heal();

    // Assert: whoever restores first, the catalog converges on the newest copy (B's), A
    // takes it, and B never admitted the deleted client again.
    eventually(Duration::from_secs(8), "converged on B's copy", || async {
        store_version(&redis) == version
            && stored_client(&redis, "doomed").is_none()
            && status(&a, &doomed).await == 401
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(watch_b.admitted(), 0, "B admitted the deleted client");
    assert!(stored_client(&redis, "doomed").is_none(), "came back");
    assert_eq!(status(&a, &doomed).await, 401);
}

#[tokio::test]
async fn gateways_restoring_at_once_write_one_catalog_once() {
    // Arrange: three gateways polling every 20 ms, all with the same copy.
    let mut redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let gws = [
        gateway(&redis.url(), &up, 20).await,
        gateway(&redis.url(), &up, 20).await,
        gateway(&redis.url(), &up, 20).await,
    ];
    for i in 0..20 {
        put_client(&gws[0], &format!("c{i}"), "gold").await;
    }
    let version = store_version(&redis);
    for gw in &gws {
        gw.wait_for_catalog(version).await;
    }

    // Act.
    redis.kill();
    redis.restart().unwrap();

    // Assert: one restore, to the version every gateway holds, and nothing after it.
    eventually(Duration::from_secs(5), "restored", || async {
        store_version(&redis) == version
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(restores(&redis), 1);
    assert_eq!(store_version(&redis), version);
    let clients: usize = redis::cmd("HLEN")
        .arg("tollgate:{catalog}:clients")
        .query(&mut redis.conn().unwrap())
        .unwrap();
    assert_eq!(clients, 21);
}

#[tokio::test]
async fn paging_through_clients_while_others_are_deleted_reaches_every_survivor() {
    // Arrange: 200 clients; the even ones are deleted while the list is paged.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&redis.url(), &up, 1000).await;
    let ids: Vec<String> = (0..200).map(|i| format!("p{i:03}")).collect();
    for id in &ids {
        put_client(&gw, id, "gold").await;
    }
    let deleter = {
        let (http, base, token) = (gw.http.clone(), gw.address.clone(), rw());
        let doomed: Vec<String> = ids.iter().step_by(2).cloned().collect();
        tokio::spawn(async move {
            for id in doomed {
                http.delete(format!("{base}/admin/v1/clients/{id}"))
                    .bearer_auth(&token)
                    .send()
                    .await
                    .unwrap();
            }
        })
    };

    // Act: page 5 at a time until the server says there is no next page.
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    let mut ended = false;
    for _ in 0..1000 {
        let path = match &cursor {
            Some(c) => format!("/clients?limit=5&cursor={c}"),
            None => "/clients?limit=5".to_string(),
        };
        let r = gw.admin(Method::GET, &path, &rw()).send().await.unwrap();
        assert_eq!(r.status(), 200, "{path}");
        let page: Value = r.json().await.unwrap();
        for c in page["items"].as_array().unwrap() {
            seen.push(c["id"].as_str().unwrap().to_string());
        }
        match &page["next_cursor"] {
            Value::Null => {
                ended = true;
                break;
            }
            Value::String(c) => cursor = Some(c.clone()),
            other => panic!("next_cursor is neither a string nor null: {other}"),
        }
    }
    assert!(
        ended,
        "the cursor never ended: 1000 pages of 5 for 201 clients"
    );
    deleter.await.unwrap();

    // Assert: every client that was never deleted was listed; each listed id exists (or
    // did), once, in order.
    let survivors: Vec<&String> = ids.iter().skip(1).step_by(2).collect();
    for s in &survivors {
        assert!(
            seen.contains(s),
            "{s} missing: paging ended early at {seen:?}"
        );
    }
    assert!(seen.contains(&"declared".to_string()), "{seen:?}");
    assert!(
        seen.iter().all(|id| id == "declared" || ids.contains(id)),
        "{seen:?}"
    );
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "listed twice or out of order: {seen:?}"
    );
}

#[tokio::test]
async fn a_gateway_that_missed_changes_trimmed_from_the_feed_reloads_the_whole_catalog() {
    // Arrange: gateway A through a fault proxy, gateway B direct; acme's key works on A.
    let redis = RedisServer::start().unwrap();
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", redis.port).parse().unwrap());
    let up = Upstream::start(Behaviour::Echo).await;
    let a = TestGateway::spawn(settings(&format!(
        "{}[redis]\nurl = \"{}\"\ntimeout_ms = 50\ncontrol_timeout_ms = 200\n[catalog]\nrefresh_ms = 50\n{}{}",
        admin_toml(),
        proxy.redis_url(),
        catalog_toml(("gold", 1_000_000.0, 1.0), &["declared"]),
        route_toml("orders", "/orders", &[up.url()]),
    )))
    .await;
    let b = gateway(&redis.url(), &up, 50).await;
    put_client(&b, "acme", "gold").await;
    let (acme_key_id, acme_key) = new_key(&b, "acme").await;
    let before = store_version(&redis);
    a.wait_for_catalog(before).await;
    assert_eq!(status(&a, &acme_key).await, 200);

    // Act: while A is cut off, acme's key is revoked and newco gets a key through B; then
    // the feed is trimmed to its last entry, so what A missed first is gone from it.
    proxy.partition();
    revoke_key(&b, "acme", &acme_key_id).await;
    put_client(&b, "newco", "gold").await;
    let (_, newco_key) = new_key(&b, "newco").await;
    let now = store_version(&redis);
    assert_eq!(now, before + 3);
    let mut c = redis.conn().unwrap();
    let _: u64 = redis::cmd("XTRIM")
        .arg("tollgate:{catalog}:changes")
        .arg("MAXLEN")
        .arg(1)
        .query(&mut c)
        .unwrap();
    let feed: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg("tollgate:{catalog}:changes")
        .arg("-")
        .arg("+")
        .query(&mut c)
        .unwrap();
    let feed_ids: Vec<&str> = feed.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(
        feed_ids,
        [format!("{now}-0")],
        "the feed starts after a gap"
    );
    // A missed all of it: still at the old version, still admitting the revoked key.
    assert_eq!(
        a.metric("tollgate_catalog_version").await,
        Some(before as f64)
    );
    assert_eq!(status(&a, &acme_key).await, 200);
    assert_eq!(status(&a, &newco_key).await, 401);

    // Assert: back on the network, A reloads and serves the store's catalog: the revoked
    // key refused, the new client admitted, at the store's version.
    proxy.heal();
    eventually(
        Duration::from_secs(5),
        "A serves the store's catalog",
        || async {
            status(&a, &acme_key).await == 401
                && status(&a, &newco_key).await == 200
                && a.metric("tollgate_catalog_version").await == Some(now as f64)
        },
    )
    .await;
}

#[tokio::test]
async fn fields_a_newer_gateway_wrote_survive_this_ones_edits() {
    // Arrange: `acme` as a newer gateway would store it, with a client field and a key
    // field this gateway does not know.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&redis.url(), &up, 1000).await;
    put_client(&gw, "acme", "gold").await;
    // Stored as "<rev> <json>".
    let json_of = |stored: String| -> (String, Value) {
        let (rev, json) = stored.split_once(' ').unwrap();
        (rev.to_string(), serde_json::from_str(json).unwrap())
    };
    let (rev, mut rec) = json_of(stored_client(&redis, "acme").unwrap());
    rec["x_future"] = json!({"n": 1});
    rec["keys"] = json!([{"key_id": "k_old", "hash": format!("sha256:{}", "ab".repeat(32)), "created_at": 1,
        "x_key_future": "kept"}]);
    let _: () = redis::cmd("HSET")
        .arg("tollgate:{catalog}:clients")
        .arg("acme")
        .arg(format!("{rev} {rec}"))
        .query(&mut redis.conn().unwrap())
        .unwrap();

    // Act: every kind of edit that rewrites the record.
    let r = gw
        .admin(Method::POST, "/clients/acme/keys", &rw())
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let new_key: Value = r.json().await.unwrap();
    put_client(&gw, "acme", "gold").await;
    let r = gw
        .admin(
            Method::DELETE,
            &format!("/clients/acme/keys/{}", new_key["key_id"].as_str().unwrap()),
            &rw(),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);

    // Assert: both unknown fields are still there, as written.
    let (_, after) = json_of(stored_client(&redis, "acme").unwrap());
    assert_eq!(after["x_future"], json!({"n": 1}), "{after}");
    assert_eq!(after["keys"][0]["x_key_future"], "kept", "{after}");
    assert_eq!(after["keys"].as_array().unwrap().len(), 1, "{after}");
}

#[tokio::test]
async fn a_plans_fields_a_newer_gateway_wrote_survive_this_ones_put() {
    // Arrange: plan `gold` as a newer gateway would store it, with a field this gateway
    // does not know.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&redis.url(), &up, 1000).await;
    let stored = || -> String {
        redis::cmd("HGET")
            .arg("tollgate:{catalog}:plans")
            .arg("gold")
            .query(&mut redis.conn().unwrap())
            .unwrap()
    };
    let (rev, json) = stored()
        .split_once(' ')
        .map(|(r, j)| (r.to_owned(), j.to_owned()))
        .unwrap();
    let mut rec: Value = serde_json::from_str(&json).unwrap();
    rec["x_future"] = json!({"n": 1});
    let _: () = redis::cmd("HSET")
        .arg("tollgate:{catalog}:plans")
        .arg("gold")
        .arg(format!("{rev} {rec}"))
        .query(&mut redis.conn().unwrap())
        .unwrap();

    // Act: the plan replaced through this gateway's admin API, which knows only its own
    // fields.
    let r = gw
        .admin(Method::PUT, "/plans/gold", &rw())
        .json(&json!({"capacity": 50, "rate": 5, "max_connections": 3}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    // Assert: the new values, and the unknown field as it was written.
    let after: Value = serde_json::from_str(stored().split_once(' ').unwrap().1).unwrap();
    assert_eq!(after["x_future"], json!({"n": 1}), "{after}");
    assert_eq!(after["capacity"], json!(50.0), "{after}");
    assert_eq!(after["max_connections"], json!(3), "{after}");
    gw.stop().await;
}

fn store_epoch(redis: &RedisServer) -> Option<String> {
    redis::cmd("GET")
        .arg("tollgate:{catalog}:epoch")
        .query(&mut redis.conn().unwrap())
        .unwrap()
}

/// Every stored client of the catalog as id -> (revision, record).
fn stored_clients(redis: &RedisServer) -> std::collections::BTreeMap<String, (u64, Value)> {
    let all: std::collections::HashMap<String, String> = redis::cmd("HGETALL")
        .arg("tollgate:{catalog}:clients")
        .query(&mut redis.conn().unwrap())
        .unwrap();
    all.into_iter()
        .map(|(id, stored)| {
            let (rev, json) = stored.split_once(' ').unwrap();
            (
                id,
                (rev.parse().unwrap(), serde_json::from_str(json).unwrap()),
            )
        })
        .collect()
}

/// Clients `c0`..`c<n>` on plan gold, two keys each, loaded by `tollgate import` (the
/// real binary) into the Redis at `redis_url`.
fn import_clients(redis_url: &str, n: usize) {
    let dir = tempfile::tempdir().unwrap();
    let lines: Vec<String> = (0..n)
        .map(|i| {
            let id = format!("c{i}");
            json!({"id": id, "plan": "gold",
                "keys": [{"key": key(&id)}, {"key": key(&format!("{id}-b"))}]})
            .to_string()
        })
        .collect();
    let file = dir.path().join("clients.jsonl");
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
    let config = dir.path().join("import.toml");
    std::fs::write(&config, format!("[redis]\nurl = \"{redis_url}\"\n")).unwrap();
    let out = std::process::Command::new(binary())
        .arg("--config")
        .arg(&config)
        .arg("import")
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn a_restore_of_thousands_of_clients_goes_in_bounded_chunks_and_leaves_no_staging() {
    // Arrange: a Redis that refuses any argument over 1 MB (the least it allows), across
    // its restarts; 2,500 clients with two keys each, more than 1 MB as one argument.
    let mut redis = RedisServer::start_with(&["--proto-max-bulk-len", "1mb"]).unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&redis.url(), &up, 100).await;
    import_clients(&redis.url(), 2500);
    let version = store_version(&redis);
    gw.wait_for_catalog(version).await;
    let before = stored_clients(&redis);
    assert_eq!(before.len(), 2501, "2,500 imported and one declared");
    let epoch_before = store_epoch(&redis);
    assert!(epoch_before.is_some());

    // Act: Redis restarts empty.
    redis.restart().unwrap();

    // Assert: every client back with its revision, the gateway's version and epoch, one
    // restore audited, every key and index entry, and no staging key left behind.
    eventually(Duration::from_secs(10), "restored", || async {
        store_version(&redis) == version
    })
    .await;
    assert_eq!(stored_clients(&redis), before);
    assert_eq!(store_epoch(&redis), epoch_before);
    assert_eq!(restores(&redis), 1);
    let mut c = redis.conn().unwrap();
    let count = |c: &mut redis::Connection, cmd: &str, key: &str| -> usize {
        redis::cmd(cmd).arg(key).query(c).unwrap()
    };
    assert_eq!(count(&mut c, "HLEN", "tollgate:{catalog}:keys"), 5001);
    assert_eq!(count(&mut c, "ZCARD", "tollgate:{catalog}:index"), 2501);
    let on_gold: u64 = redis::cmd("HGET")
        .arg("tollgate:{catalog}:users")
        .arg("gold")
        .query(&mut c)
        .unwrap();
    assert_eq!(on_gold, 2501);
    assert!(
        redis.keys("*restore:*").unwrap().is_empty(),
        "staging keys left: {:?}",
        redis.keys("*restore:*").unwrap()
    );
    let ttl: i64 = redis::cmd("TTL")
        .arg("tollgate:{catalog}:clients")
        .query(&mut c)
        .unwrap();
    assert_eq!(ttl, -1, "the restored clients would expire");
    assert_eq!(status(&gw, &key("c2499-b")).await, 200);
}
