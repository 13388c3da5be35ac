//! The admin API's write rules on the Redis store, the one production runs: a client's keys
//! survive its replacement, keys, deletes and refills are audited with who and what, stale
//! preconditions and conflicts are refused by the catalog script, a refused write changes
//! nothing in Redis, and a write's audit entry is written by the same script as the change.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::Duration;

use reqwest::Method;
use serde_json::{json, Value};

use tollgate_testkit::FaultProxy;

use crate::helpers::*;

/// A read-write token for `sub` (who the audit log names).
fn token(sub: &str) -> String {
    admin_token(sub, "admin:read admin:write")
}

/// A gateway on `redis_url` with the admin API, a route to `up` and a fast catalog.
async fn gateway(redis_url: &str, up: &Upstream) -> TestGateway {
    TestGateway::spawn(settings(&format!(
        "{}[redis]\nurl = \"{redis_url}\"\ntimeout_ms = 1000\n[catalog]\nrefresh_ms = 50\n{}",
        admin_toml(),
        route_toml("orders", "/orders", &[up.url()])
    )))
    .await
}

/// `method path` as `ops`, with a JSON body when given.
async fn call(
    gw: &TestGateway,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> reqwest::Response {
    gw.send_admin(method, path, &token("ops"), body).await
}

/// Plan `plan` (a bucket of 100, 10 a second), client `client` on it, and a key of its
/// that the gateway admits: the key's id and the key.
async fn client_with_key(gw: &TestGateway, plan: &str, client: &str) -> (String, String) {
    let r = call(
        gw,
        Method::PUT,
        &format!("/plans/{plan}"),
        Some(json!({"capacity": 100, "rate": 10})),
    )
    .await;
    assert_eq!(r.status(), 201);
    let r = call(
        gw,
        Method::PUT,
        &format!("/clients/{client}"),
        Some(json!({"plan": plan})),
    )
    .await;
    assert_eq!(r.status(), 201);
    let (key_id, key) = new_key(gw, client).await;
    eventually(Duration::from_secs(3), "the key works", || async {
        gw.get("/orders", Some(&key)).await.status() == 200
    })
    .await;
    (key_id, key)
}

fn etag(r: &reqwest::Response) -> String {
    r.headers()["etag"].to_str().unwrap().to_string()
}

/// The catalog version an ETag names.
fn version(etag: &str) -> u64 {
    etag.trim_matches('"').parse().unwrap()
}

/// Every catalog key in Redis with its value, sorted (records, key index, plan users,
/// version, epoch, change feed, audit log, write ids).
fn catalog_contents(redis: &RedisServer) -> Vec<(String, String)> {
    let mut c = redis.conn().unwrap();
    let mut keys = redis.keys("tollgate:{catalog}:*").unwrap();
    keys.sort();
    keys.into_iter()
        .map(|key| {
            let kind: String = redis::cmd("TYPE").arg(&key).query(&mut c).unwrap();
            let value = match kind.as_str() {
                "string" => {
                    let v: String = redis::cmd("GET").arg(&key).query(&mut c).unwrap();
                    v
                }
                "hash" => {
                    // Sorted: a hash's field order is Redis's own business.
                    let mut pairs: Vec<(String, String)> =
                        redis::cmd("HGETALL").arg(&key).query(&mut c).unwrap();
                    pairs.sort();
                    format!("{pairs:?}")
                }
                "zset" => {
                    let members: Vec<(String, f64)> = redis::cmd("ZRANGE")
                        .arg(&key)
                        .arg(0)
                        .arg(-1)
                        .arg("WITHSCORES")
                        .query(&mut c)
                        .unwrap();
                    format!("{members:?}")
                }
                "stream" => {
                    let entries: redis::Value = redis::cmd("XRANGE")
                        .arg(&key)
                        .arg("-")
                        .arg("+")
                        .query(&mut c)
                        .unwrap();
                    format!("{entries:?}")
                }
                other => panic!("unexpected type {other} for {key}"),
            };
            (key, value)
        })
        .collect()
}

#[tokio::test]
async fn keys_are_kept_when_a_client_is_replaced_with_put() {
    // Arrange: acme on gold, with a key that works.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&redis.url(), &up).await;
    let (key_id, key) = client_with_key(&gw, "gold", "acme").await;
    let r = call(
        &gw,
        Method::PUT,
        "/plans/silver",
        Some(json!({"capacity": 50, "rate": 10})),
    )
    .await;
    assert_eq!(r.status(), 201);

    // Act: replace the client twice: without `keys`, then with the body a GET gave,
    // its `keys` emptied.
    let r = call(
        &gw,
        Method::PUT,
        "/clients/acme",
        Some(json!({"plan": "silver", "mode": "enforce"})),
    )
    .await;
    assert_eq!(r.status(), 200);
    let replaced: Value = r.json().await.unwrap();
    assert_eq!(replaced["keys"][0]["key_id"], key_id.as_str());
    let mut read: Value = call(&gw, Method::GET, "/clients/acme", None)
        .await
        .json()
        .await
        .unwrap();
    read["keys"] = json!([]);
    read["mode"] = json!("shadow");
    let r = call(&gw, Method::PUT, "/clients/acme", Some(read)).await;
    assert_eq!(r.status(), 200);
    let last = etag(&r);

    // Assert: the admin API, the store's key index and the data plane all still have the
    // key, now on the new plan.
    let got: Value = call(&gw, Method::GET, "/clients/acme", None)
        .await
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = got["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["key_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [key_id.as_str()], "{got}");
    assert_eq!(got["mode"], "shadow");
    let index: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg("tollgate:{catalog}:keys")
        .query(&mut redis.conn().unwrap())
        .unwrap();
    assert_eq!(index.len(), 1, "{index:?}");
    assert_eq!(index[0].1, "acme", "{index:?}");
    gw.wait_for_catalog(version(&last)).await;
    let r = gw.get("/orders", Some(&key)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["ratelimit-policy"], "\"silver\";q=50;w=5");
}

/// Makes a key, revokes it, refills the bucket and deletes the client, each as someone
/// else, and checks the audit log names each change, who made it and what it changed.
async fn keys_deletes_and_refills_are_audited(gw: &TestGateway, store: &str) {
    let r = call(
        gw,
        Method::PUT,
        "/plans/gold",
        Some(json!({"capacity": 10, "rate": 1})),
    )
    .await;
    assert_eq!(r.status(), 201, "{store}");
    let r = call(
        gw,
        Method::PUT,
        "/clients/acme",
        Some(json!({"plan": "gold"})),
    )
    .await;
    assert_eq!(r.status(), 201, "{store}");
    let as_who = |method: Method, path: String, sub: &'static str| {
        let req = gw.admin(method, &path, &token(sub));
        async move { req.send().await.unwrap() }
    };

    let r = as_who(Method::POST, "/clients/acme/keys".into(), "kim").await;
    assert_eq!(r.status(), 201, "{store}");
    let created: Value = r.json().await.unwrap();
    let (key_id, key) = (
        created["key_id"].as_str().unwrap().to_string(),
        created["key"].as_str().unwrap().to_string(),
    );
    let r = as_who(
        Method::DELETE,
        format!("/clients/acme/keys/{key_id}"),
        "lee",
    )
    .await;
    assert_eq!(r.status(), 204, "{store}");
    let r = as_who(Method::DELETE, "/clients/acme/bucket".into(), "max").await;
    assert_eq!(r.status(), 204, "{store}");
    let r = as_who(Method::DELETE, "/clients/acme".into(), "ned").await;
    assert_eq!(r.status(), 204, "{store}");

    let r = call(gw, Method::GET, "/audit?limit=4", None).await;
    assert_eq!(r.status(), 200, "{store}");
    let text = r.text().await.unwrap();
    assert!(
        !text.contains(&key),
        "{store}: a plaintext key in the audit log"
    );
    let audit: Value = serde_json::from_str(&text).unwrap();
    let items = audit["items"].as_array().unwrap();
    let seen: Vec<(&str, &str, &str, &str)> = items
        .iter()
        .map(|e| {
            (
                e["action"].as_str().unwrap(),
                e["actor"].as_str().unwrap(),
                e["kind"].as_str().unwrap(),
                e["id"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            ("client.delete", "ned", "client", "acme"),
            ("bucket.refill", "max", "bucket", "acme"),
            ("key.revoke", "lee", "client", "acme"),
            ("key.create", "kim", "client", "acme"),
        ],
        "{store}: newest first"
    );
    let key_ids = |record: &Value| -> Vec<String> {
        record["keys"]
            .as_array()
            .unwrap_or_else(|| panic!("{store}: no keys in {record}"))
            .iter()
            .map(|k| k["key_id"].as_str().unwrap().to_string())
            .collect()
    };
    let (delete, revoke, create) = (&items[0], &items[2], &items[3]);
    assert_eq!(key_ids(&create["before"]), Vec::<String>::new(), "{store}");
    assert_eq!(key_ids(&create["after"]), [key_id.as_str()], "{store}");
    assert_eq!(key_ids(&revoke["before"]), [key_id.as_str()], "{store}");
    assert_eq!(key_ids(&revoke["after"]), Vec::<String>::new(), "{store}");
    assert_eq!(delete["before"]["id"], "acme", "{store}");
    assert!(delete["after"].is_null(), "{store}: {delete}");
    for e in items {
        assert!(e["at_ms"].as_u64().unwrap() > 0, "{store}: {e}");
    }
}

#[tokio::test]
async fn key_creation_revocation_client_deletion_and_refills_are_audited_on_either_store() {
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    keys_deletes_and_refills_are_audited(&gateway(&redis.url(), &up).await, "redis").await;
    let embedded = TestGateway::spawn(settings(&admin_toml())).await;
    keys_deletes_and_refills_are_audited(&embedded, "embedded").await;
}

#[tokio::test]
async fn on_redis_stale_preconditions_and_conflicts_are_refused_and_change_nothing() {
    // Arrange: gold (used by acme, whose key was imported) and other, at known ETags.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&redis.url(), &up).await;
    let first = call(
        &gw,
        Method::PUT,
        "/plans/gold",
        Some(json!({"capacity": 10, "rate": 1})),
    )
    .await;
    let stale_plan = etag(&first);
    let r = call(
        &gw,
        Method::PUT,
        "/plans/gold",
        Some(json!({"capacity": 20, "rate": 1})),
    )
    .await;
    assert_eq!(r.status(), 200);
    let r = call(
        &gw,
        Method::PUT,
        "/clients/acme",
        Some(json!({"plan": "gold"})),
    )
    .await;
    let stale_client = etag(&r);
    let r = call(
        &gw,
        Method::POST,
        "/clients/acme/keys",
        Some(json!({"key": "imported-key-0001"})),
    )
    .await;
    assert_eq!(r.status(), 201);
    let r = call(
        &gw,
        Method::PUT,
        "/clients/other",
        Some(json!({"plan": "gold"})),
    )
    .await;
    assert_eq!(r.status(), 201);
    let before = catalog_contents(&redis);
    assert!(
        before.iter().any(|(k, _)| k == "tollgate:{catalog}:audit"),
        "{before:?}"
    );

    // Act: writes the rules refuse.
    let with_if_match = |method: Method, path: &'static str, tag: &str, body: Option<Value>| {
        let req = gw
            .admin(method, path, &token("ops"))
            .header("if-match", tag);
        let req = match body {
            Some(b) => req.json(&b),
            None => req,
        };
        async move { req.send().await.unwrap() }
    };
    let refused = [
        (
            "a plan PUT at a stale ETag",
            with_if_match(
                Method::PUT,
                "/plans/gold",
                &stale_plan,
                Some(json!({"capacity": 1, "rate": 1})),
            )
            .await,
            412,
        ),
        (
            "a plan DELETE at a stale ETag",
            with_if_match(Method::DELETE, "/plans/gold", &stale_plan, None).await,
            412,
        ),
        (
            "deleting a plan a client uses",
            call(&gw, Method::DELETE, "/plans/gold", None).await,
            409,
        ),
        (
            "importing a key that belongs to another client",
            call(
                &gw,
                Method::POST,
                "/clients/other/keys",
                Some(json!({"key": "imported-key-0001"})),
            )
            .await,
            409,
        ),
        (
            "a client PUT at a stale ETag",
            with_if_match(
                Method::PUT,
                "/clients/acme",
                &stale_client,
                Some(json!({"plan": "gold", "mode": "shadow"})),
            )
            .await,
            412,
        ),
        (
            "a client DELETE at a stale ETag",
            with_if_match(Method::DELETE, "/clients/acme", &stale_client, None).await,
            412,
        ),
        (
            "If-Match: * for a client that does not exist",
            with_if_match(
                Method::PUT,
                "/clients/newco",
                "*",
                Some(json!({"plan": "gold"})),
            )
            .await,
            412,
        ),
        (
            "a client moved to a plan that does not exist",
            call(
                &gw,
                Method::PUT,
                "/clients/acme",
                Some(json!({"plan": "platinum"})),
            )
            .await,
            422,
        ),
    ];

    // Assert: each refused as documented, and the store exactly as it was: no record,
    // index, version, change-feed or audit entry written.
    for (what, r, status) in refused {
        assert_eq!(r.status(), status, "{what}");
        assert_eq!(
            r.headers()["content-type"],
            "application/problem+json",
            "{what}"
        );
    }
    let after = catalog_contents(&redis);
    let names = |c: &[(String, String)]| c.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>();
    assert_eq!(names(&after), names(&before), "keys added or removed");
    let changed: Vec<&(String, String)> = after
        .iter()
        .zip(&before)
        .filter(|(a, b)| a != b)
        .map(|(a, _)| a)
        .collect();
    assert!(
        changed.is_empty(),
        "changed by a refused write: {changed:?}"
    );
}

#[tokio::test]
async fn on_redis_concurrent_puts_with_the_same_if_match_let_exactly_one_through() {
    // Arrange: a gateway whose Redis answers 250 ms late, so that writers who all read
    // the plan at one ETag all send their write before the first one lands: the catalog
    // script, not the handler's read, has to refuse the late ones.
    let redis = RedisServer::start().unwrap();
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", redis.port).parse().unwrap());
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&proxy.redis_url(), &up).await;
    let r = call(
        &gw,
        Method::PUT,
        "/plans/gold",
        Some(json!({"capacity": 10, "rate": 1})),
    )
    .await;
    let tag = etag(&r);
    proxy.delay(Duration::from_millis(250));
    redis.reset_command_stats().unwrap();

    // Act: 16 writers at once, each with If-Match at that ETag.
    let writers = (0..16u32).map(|i| {
        let req = gw
            .admin(Method::PUT, "/plans/gold", &token("ops"))
            .header("if-match", &tag)
            .json(&json!({"capacity": 100 + i, "rate": 1}));
        async move {
            let r = req.send().await.unwrap();
            (i, r.status().as_u16())
        }
    });
    let answers = futures_util::future::join_all(writers).await;
    let scripts_run = redis.calls("evalsha").unwrap();
    proxy.heal();

    // Assert: several writes reached the script; one won, every other got 412; the store
    // holds the winner's plan, with one audit entry for it.
    assert!(
        scripts_run >= 2,
        "the writes did not race: {scripts_run} script calls"
    );
    let winners: Vec<u32> = answers
        .iter()
        .filter(|(_, s)| *s == 200)
        .map(|(i, _)| *i)
        .collect();
    assert_eq!(winners.len(), 1, "{answers:?}");
    assert!(
        answers.iter().all(|(_, s)| *s == 200 || *s == 412),
        "{answers:?}"
    );
    let stored: Value = call(&gw, Method::GET, "/plans/gold", None)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(stored["capacity"], f64::from(100 + winners[0]));
    let audit: Value = call(&gw, Method::GET, "/audit?limit=100", None)
        .await
        .json()
        .await
        .unwrap();
    let puts = audit["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["action"] == "plan.put")
        .count();
    assert_eq!(puts, 2, "the create and the one winner");
}

/// One line of `MONITOR`: whether a script ran it, and the command with its arguments.
fn monitored(line: &str) -> (bool, Vec<String>) {
    let (_, rest) = line
        .split_once(" [")
        .unwrap_or_else(|| panic!("not a MONITOR line: {line}"));
    let (source, args) = rest
        .split_once("] ")
        .unwrap_or_else(|| panic!("not a MONITOR line: {line}"));
    let mut words = Vec::new();
    let mut chars = args.chars();
    while let Some(c) = chars.next() {
        if c != '"' {
            continue;
        }
        let mut word = String::new();
        loop {
            match chars.next() {
                Some('\\') => word.extend(chars.next()),
                Some('"') | None => break,
                Some(c) => word.push(c),
            }
        }
        words.push(word);
    }
    (source.ends_with(" lua"), words)
}

#[tokio::test]
async fn on_redis_a_catalog_write_and_its_audit_entry_are_one_script() {
    // Arrange: a gateway, a plan, and Redis's MONITOR feed of every command it runs.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&redis.url(), &up).await;
    let r = call(
        &gw,
        Method::PUT,
        "/plans/gold",
        Some(json!({"capacity": 10, "rate": 1})),
    )
    .await;
    assert_eq!(r.status(), 201);
    let mut monitor = TcpStream::connect(("127.0.0.1", redis.port)).unwrap();
    monitor
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    monitor.write_all(b"MONITOR\r\n").unwrap();
    let mut lines = BufReader::new(monitor);
    let mut ok = String::new();
    lines.read_line(&mut ok).unwrap();
    assert_eq!(ok.trim_end(), "+OK");

    // Act: a client is created; then a marker ends what the feed is read for.
    let r = gw
        .admin(Method::PUT, "/clients/acme", &token("kim"))
        .json(&json!({"plan": "gold"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let rev = etag_version(&r).to_string();
    let _: String = redis::cmd("ECHO")
        .arg("end-of-the-write")
        .query(&mut redis.conn().unwrap())
        .unwrap();
    let feed = tokio::task::spawn_blocking(move || {
        let mut feed = Vec::new();
        loop {
            let mut line = String::new();
            lines
                .read_line(&mut line)
                .expect("MONITOR shows the marker within 5 s");
            let line = line.trim_end().trim_start_matches('+').to_string();
            if line.contains("\"end-of-the-write\"") {
                return feed;
            }
            feed.push(monitored(&line));
        }
    })
    .await
    .unwrap();

    // Assert: every write to the catalog ran inside a script, and the record, the change
    // feed and the audit entry were written by one run of it: one unbroken run of
    // script lines, which nothing else can interleave with.
    let catalog_key = |words: &[String]| {
        words
            .get(1)
            .is_some_and(|k| k.starts_with("tollgate:{catalog}:"))
    };
    let writes = [
        "HSET", "HDEL", "HINCRBY", "XADD", "INCR", "ZADD", "ZREM", "SET", "DEL",
    ];
    for (lua, words) in &feed {
        if catalog_key(words) && writes.contains(&words[0].to_uppercase().as_str()) {
            assert!(*lua, "a catalog write outside the script: {words:?}");
        }
    }
    let runs: Vec<Vec<&Vec<String>>> = feed
        .chunk_by(|a, b| a.0 == b.0)
        .filter(|run| run[0].0)
        .map(|run| run.iter().map(|(_, w)| w).collect())
        .collect();
    let is = |words: &Vec<String>, cmd: &str, key: &str| {
        words[0].eq_ignore_ascii_case(cmd) && words[1] == format!("tollgate:{{catalog}}:{key}")
    };
    let run = runs
        .iter()
        .find(|run| {
            run.iter()
                .any(|w| is(w, "HSET", "clients") && w[2] == "acme")
        })
        .unwrap_or_else(|| panic!("no script wrote the client: {feed:?}"));
    assert!(
        run.iter()
            .any(|w| is(w, "XADD", "changes") && w.contains(&format!("{rev}-0"))),
        "the change feed entry is not in the script's run: {run:?}"
    );
    let audit = run
        .iter()
        .find(|w| is(w, "XADD", "audit"))
        .unwrap_or_else(|| panic!("the audit entry is not in the script's run: {run:?}"));
    let field = |name: &str| {
        let at = audit
            .iter()
            .position(|w| w == name)
            .unwrap_or_else(|| panic!("no {name} in {audit:?}"));
        audit[at + 1].as_str()
    };
    assert_eq!(
        (field("actor"), field("action"), field("id"), field("rev")),
        ("kim", "client.put", "acme", rev.as_str())
    );
}

#[tokio::test]
async fn a_gateway_started_with_redis_down_seeds_its_declared_plans_before_an_admin_write() {
    // Arrange: Redis unreachable at start; the configuration declares plan `p`, which the
    // request path serves from the configuration meanwhile.
    let redis = RedisServer::start().unwrap();
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", redis.port).parse().unwrap());
    proxy.refuse();
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = TestGateway::spawn(settings(&format!(
        "{}[redis]\nurl = \"{}\"\ntimeout_ms = 200\n[catalog]\nrefresh_ms = 50\n{}{}",
        admin_toml(),
        proxy.redis_url(),
        route_toml("orders", "/orders", &[up.url()]),
        catalog_toml(("p", 10.0, 1.0), &["acme"]),
    )))
    .await;

    // Act: Redis comes back, and at once (well within the retry task's second) the account
    // team puts a client on `p`.
    proxy.heal();
    let r = call(
        &gw,
        Method::PUT,
        "/clients/late",
        Some(json!({"plan": "p"})),
    )
    .await;

    // Assert: the plan the request path enforces is one the admin API knows.
    let status = r.status();
    let body = r.text().await.unwrap();
    assert_eq!(status, 201, "{body}");
    let plans: Value = call(&gw, Method::GET, "/plans/p", None)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(plans["name"], "p", "{plans}");
}

#[tokio::test]
async fn on_redis_out_of_memory_readyz_and_the_admin_api_say_the_store_refuses_writes_without_internals(
) {
    // Arrange: the eviction policy the README recommends; a client with a key that works.
    let redis = RedisServer::start_with(&["--maxmemory-policy", "noeviction"]).unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&redis.url(), &up).await;
    let (_, key) = client_with_key(&gw, "p", "acme").await;
    assert_eq!(gw.get("/readyz", None).await.status(), 200);

    // Act: memory runs out.
    redis.fill_memory().unwrap();
    let decided = gw.get("/orders", Some(&key)).await;
    let ready = gw.get("/readyz", None).await;
    let (ready_status, ready_body) = (ready.status(), ready.text().await.unwrap());
    let write = call(
        &gw,
        Method::PUT,
        "/plans/q",
        Some(json!({"capacity": 5, "rate": 1})),
    )
    .await;
    let (write_status, write_body) = (write.status(), write.text().await.unwrap());

    // Assert: the request fails open (it is forwarded); readiness and the admin API say the
    // store refuses writes, and neither carries Redis' error (the script, its SHA, a line).
    assert_eq!(decided.status(), 200);
    assert_eq!(ready_status, 503, "{ready_body}");
    assert!(ready_body.contains("refuses writes"), "{ready_body}");
    assert_eq!(write_status, 503, "{write_body}");
    assert!(write_body.contains("refuses writes"), "{write_body}");
    for body in [&ready_body, &write_body] {
        let internals = ["script", "OOM command", "user_script", "maxmemory'"];
        assert!(!internals.iter().any(|s| body.contains(s)), "{body}");
        let hex_run = body
            .as_bytes()
            .windows(40)
            .any(|w| w.iter().all(u8::is_ascii_hexdigit));
        assert!(!hex_run, "a script's SHA in {body}");
    }

    // Assert: memory freed, the next decision succeeds and readiness comes back with it.
    redis.free_memory().unwrap();
    assert_eq!(gw.get("/orders", Some(&key)).await.status(), 200);
    assert_eq!(gw.get("/readyz", None).await.status(), 200);
}
