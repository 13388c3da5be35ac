//! Cache mode (`catalog.mode = "cache"`): a gateway holds every plan and only the clients
//! in use. A key it does not hold costs one store read, then it is held (or remembered as
//! unknown); changes reach what it holds within `catalog.refresh_ms`; a new key is never
//! stuck as unknown; a key that cannot be checked (the store down) is `503`, while the
//! clients held are served; and the bounds hold under a flood.
//!
//! Gateway A is in cache mode; gateway B (a full mirror, the admin API) makes the changes.

use std::time::Duration;

use reqwest::Method;
use tollgate_testkit::FaultProxy;

use crate::helpers::*;

fn rw() -> String {
    admin_token("ops", "admin:read admin:write")
}

/// Gateway settings on `redis_url`: the admin API, route `/orders`, plan `gold` with the
/// `clients` declared, and `catalog` lines (`mode = "cache"` and its bounds, or none).
fn toml(redis_url: &str, up: &Upstream, clients: &[&str], catalog: &str) -> String {
    format!(
        "{}[redis]\nurl = \"{redis_url}\"\ntimeout_ms = 50\ncontrol_timeout_ms = 200\n\
         [catalog]\nrefresh_ms = 50\n{catalog}\n[edge]\nfailed_keys_sets = 0\n{}{}",
        admin_toml(),
        catalog_toml(("gold", 1_000_000.0, 1000.0), clients),
        route_toml("orders", "/orders", &[up.url()]),
    )
}

/// Cache mode without the key filter: every key not held is read (the filter's own test
/// turns it on).
const CACHE: &str = "mode = \"cache\"\nkey_filter_mib = 0";

async fn status(gw: &TestGateway, key: &str) -> u16 {
    gw.get("/orders", Some(key)).await.status().as_u16()
}

async fn lookups(gw: &TestGateway, result: &str) -> f64 {
    gw.sample(&format!(
        "tollgate_catalog_lookups_total{{result=\"{result}\"}}"
    ))
    .await
}

#[tokio::test]
async fn a_key_not_held_is_looked_up_once_then_held_and_refused_once_revoked() {
    // Arrange: acme with a key, made on B; A in cache mode, holding no client yet.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let b = TestGateway::spawn(settings(&toml(&redis.url(), &up, &["declared"], ""))).await;
    let a = TestGateway::spawn(settings(&toml(&redis.url(), &up, &[], CACHE))).await;
    put_client(&b, "acme", "gold").await;
    let (key_id, key) = new_key(&b, "acme").await;
    // (A's first lookups would otherwise find a catalog of another epoch than the one it
    // follows, until it polls: the store's first write gave it one.)
    a.wait_for_catalog(store_version(&redis)).await;
    assert_eq!(a.sample("tollgate_catalog_clients").await, 0.0);

    // Act and assert: the first request is admitted once the store answers; the next
    // ones from what A holds, with no further read.
    assert_eq!(status(&a, &key).await, 200);
    assert_eq!(lookups(&a, "client").await, 1.0);
    // The read is timed: one observation, within the histogram's last bound.
    assert_eq!(a.sample("tollgate_catalog_lookup_seconds_count").await, 1.0);
    assert_eq!(
        a.sample("tollgate_catalog_lookup_seconds_bucket{le=\"1\"}")
            .await,
        1.0
    );
    for _ in 0..5 {
        assert_eq!(status(&a, &key).await, 200);
    }
    assert_eq!(lookups(&a, "client").await, 1.0, "one read for the key");
    assert_eq!(a.sample("tollgate_catalog_lookup_seconds_count").await, 1.0);
    assert_eq!(a.sample("tollgate_catalog_clients").await, 1.0);

    // Revoked on B: refused on A within its refresh.
    revoke_key(&b, "acme", &key_id).await;
    eventually(
        Duration::from_secs(2),
        "A refuses the revoked key",
        || async { status(&a, &key).await == 401 },
    )
    .await;
    // And it stays refused: no lookup brings it back.
    for _ in 0..5 {
        assert_eq!(status(&a, &key).await, 401);
    }
    // The declared client, never used on A, was never read.
    assert_eq!(lookups(&a, "client").await, 1.0);
}

#[tokio::test]
async fn an_unknown_key_that_is_then_created_is_admitted_within_the_refresh() {
    // Arrange: A in cache mode; the key of `late` belongs to nobody yet.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let a = TestGateway::spawn(settings(&toml(&redis.url(), &up, &[], CACHE))).await;
    let late = key("late");

    // Act: refused, then remembered as unknown (one read for many requests).
    assert_eq!(status(&a, &late).await, 401);
    for _ in 0..5 {
        assert_eq!(status(&a, &late).await, 401);
    }
    assert_eq!(lookups(&a, "unknown").await, 1.0, "one read for the key");
    assert_eq!(a.sample("tollgate_catalog_unknown_keys").await, 1.0);

    // B starts, declaring `late` with that key: A admits it within its refresh.
    let _b = TestGateway::spawn(settings(&toml(&redis.url(), &up, &["late"], ""))).await;

    // Assert.
    eventually(
        Duration::from_secs(2),
        "A admits the key created after it was unknown",
        || async { status(&a, &late).await == 200 },
    )
    .await;
}

#[tokio::test]
async fn with_the_store_down_a_key_not_held_is_503_while_the_clients_held_are_served() {
    // Arrange: `held` used on A (so held), `cold` never; A reaches Redis through a proxy.
    let redis = RedisServer::start().unwrap();
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", redis.port).parse().unwrap());
    let up = Upstream::start(Behaviour::Echo).await;
    let _b = TestGateway::spawn(settings(&toml(&redis.url(), &up, &["held", "cold"], ""))).await;
    let a = TestGateway::spawn(settings(&toml(&proxy.redis_url(), &up, &[], CACHE))).await;
    assert_eq!(status(&a, &key("held")).await, 200);

    // Act: Redis unreachable from A.
    proxy.partition();

    // Assert: the held client fails open (its limit cannot be checked, its key can); the
    // cold key cannot be checked, and is not let in.
    assert_eq!(status(&a, &key("held")).await, 200);
    let r = a.get("/orders", Some(&key("cold"))).await;
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "1");
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        body["type"],
        "https://tollgate.dev/problems/catalog-unavailable"
    );
    assert!(lookups(&a, "failed").await >= 1.0);

    // Back: the cold key is looked up and admitted.
    proxy.heal();
    eventually(Duration::from_secs(5), "A admits the cold key", || async {
        status(&a, &key("cold")).await == 200
    })
    .await;
}

#[tokio::test]
async fn the_cache_holds_its_bounds_and_its_hot_client_under_a_flood() {
    // Arrange: 30 clients in the store; A holds at most 5 clients and 10 unknown keys.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let names: Vec<String> = (0..30).map(|i| format!("c{i}")).collect();
    let ids: Vec<&str> = names.iter().map(String::as_str).collect();
    let _b = TestGateway::spawn(settings(&toml(&redis.url(), &up, &ids, ""))).await;
    let a = TestGateway::spawn(settings(&toml(
        &redis.url(),
        &up,
        &[],
        &format!("{CACHE}\ncached_clients = 5\nunknown_keys = 10"),
    )))
    .await;
    let hot = key("c0");
    for _ in 0..30 {
        assert_eq!(status(&a, &hot).await, 200);
    }

    // Act: every other client once, and 300 made-up keys, the hot client in between.
    for (i, id) in ids.iter().enumerate().skip(1) {
        assert_eq!(
            status(&a, &key(id)).await,
            200,
            "{id}: a valid key, held or not"
        );
        for j in 0..10 {
            assert_eq!(
                status(&a, &format!("made-up-{i}-{j}-0123456789")).await,
                401
            );
        }
        assert_eq!(status(&a, &hot).await, 200);
    }

    // Assert: within the bounds (once the cache has let go of what it evicted, on the
    // next refresh); the hot client was never read again.
    eventually(
        Duration::from_secs(2),
        "A holds at most 5 clients",
        || async { a.sample("tollgate_catalog_clients").await <= 5.0 },
    )
    .await;
    assert!(a.sample("tollgate_catalog_unknown_keys").await <= 10.0);
    assert_eq!(lookups(&a, "client").await, 30.0, "one read per client");
    assert_eq!(lookups(&a, "unknown").await, 290.0);
    assert_eq!(status(&a, &hot).await, 200);
    assert_eq!(lookups(&a, "client").await, 30.0, "the hot client is held");
}

#[tokio::test]
async fn a_key_not_held_waits_as_an_undecided_request_and_past_max_pending_is_shed_unread() {
    // Arrange: A reaches Redis 300 ms away, and its worker may hold one undecided request.
    let redis = RedisServer::start().unwrap();
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", redis.port).parse().unwrap());
    let up = Upstream::start(Behaviour::Echo).await;
    let _b = TestGateway::spawn(settings(&toml(&redis.url(), &up, &["one", "two"], ""))).await;
    let a = TestGateway::spawn(settings(&toml(
        &proxy.redis_url(),
        &up,
        &[],
        &format!(
            "{CACHE}\nlookup_timeout_ms = 2000\n[server]\nworkers = 1\n\
             [overload]\nmax_pending = 1\nmax_wait_ms = 3000"
        ),
    )))
    .await;
    // The store answers (A's worker has its connection open).
    assert_eq!(status(&a, "made-up-key-0123456789").await, 401);
    proxy.delay(Duration::from_millis(300));

    // Act: a key not held, and another 100 ms later, while the first is read.
    let (one, two) = (key("one"), key("two"));
    let first = a.get("/orders", Some(&one));
    let second = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        a.get("/orders", Some(&two)).await
    };
    let (first, second) = tokio::join!(first, second);

    // Assert: the first read and admitted; the second shed with no store read.
    assert_eq!(first.status(), 200, "{:?}", first.text().await);
    assert_eq!(second.status(), 503);
    assert_eq!(second.headers()["retry-after"], "1");
    let body: serde_json::Value = second.json().await.unwrap();
    assert_eq!(body["type"], "https://tollgate.dev/problems/overloaded");
    assert_eq!(
        a.sample("tollgate_shed_total{reason=\"lookup\"}").await,
        1.0
    );
    assert_eq!(
        lookups(&a, "client").await,
        1.0,
        "one read: the first key's"
    );
    assert_eq!(lookups(&a, "unknown").await, 1.0, "and the warm-up's");
    assert_eq!(
        a.sample("tollgate_decisions_total{outcome=\"shed\"}").await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_a_flood_of_made_up_keys_a_late_worker_sheds_them_and_decides_its_held_client() {
    // Arrange: one worker that counts as late past 1 ms; a client held.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let _b = TestGateway::spawn(settings(&toml(&redis.url(), &up, &["hot"], ""))).await;
    let a = TestGateway::spawn(settings(&toml(
        &redis.url(),
        &up,
        &[],
        &format!("{CACHE}\n[server]\nworkers = 1\n[overload]\nmax_delay_ms = 1"),
    )))
    .await;
    let hot = key("hot");
    assert_eq!(status(&a, &hot).await, 200);

    // Act: 64 connections of made-up keys for 2 s, the held client one request at a time.
    let until = std::time::Instant::now() + Duration::from_secs(2);
    let flood = futures_util::future::join_all((0..64).map(|c| {
        let a = &a;
        async move {
            let mut statuses = Vec::new();
            let mut i = 0;
            while std::time::Instant::now() < until {
                let r = a
                    .get("/orders", Some(&format!("made-up-{c}-{i}-0123456789")))
                    .await;
                statuses.push(r.status().as_u16());
                i += 1;
            }
            statuses
        }
    }));
    let held = async {
        let mut statuses = Vec::new();
        while std::time::Instant::now() < until {
            statuses.push(status(&a, &hot).await);
        }
        statuses
    };
    let (flood, held) = tokio::join!(flood, held);

    // Assert: the held client decided every time; made-up keys refused or shed, and the
    // shed ones never read.
    assert!(held.iter().all(|s| *s == 200), "{held:?}");
    let flood: Vec<u16> = flood.concat();
    assert!(flood.iter().all(|s| *s == 401 || *s == 503), "{flood:?}");
    let shed = flood.iter().filter(|s| **s == 503).count();
    assert!(
        shed > 0,
        "a late worker sheds made-up keys ({} sent)",
        flood.len()
    );
    assert_eq!(
        a.sample("tollgate_shed_total{reason=\"lookup\"}").await,
        shed as f64
    );
    assert_eq!(
        lookups(&a, "unknown").await,
        (flood.len() - shed) as f64,
        "one read per made-up key not shed"
    );
}

#[tokio::test]
async fn with_the_key_filter_a_made_up_key_costs_no_read_and_a_key_given_later_is_admitted() {
    // Arrange: `old` (with a key) and `new` (without) exist before any filter (the admin
    // API's write gives the catalog its identity: A follows one catalog throughout); A in
    // cache mode builds a filter (1 MiB) and copies it.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let b = TestGateway::spawn(settings(&toml(&redis.url(), &up, &["old"], ""))).await;
    put_client(&b, "new", "gold").await;
    let a = TestGateway::spawn(settings(&toml(
        &redis.url(),
        &up,
        &[],
        "mode = \"cache\"\nkey_filter_mib = 1",
    )))
    .await;
    eventually(
        Duration::from_secs(5),
        "A's key filter in place",
        || async { a.sample("tollgate_catalog_key_filter_bytes").await == (1 << 20) as f64 },
    )
    .await;

    // Act and assert: 50 made-up keys refused, none read.
    for i in 0..50 {
        assert_eq!(status(&a, &format!("made-up-{i}-0123456789")).await, 401);
    }
    assert_eq!(lookups(&a, "unknown").await, 0.0);
    assert_eq!(a.sample("tollgate_catalog_keys_filtered_total").await, 50.0);

    // A key given before the filter was built is read and admitted.
    assert_eq!(status(&a, &key("old")).await, 200);
    assert_eq!(lookups(&a, "client").await, 1.0);

    // A key created now (in the feed): admitted within A's refresh.
    let r = b
        .admin(reqwest::Method::POST, "/clients/new/keys", &rw())
        .json(&serde_json::json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let body: serde_json::Value = r.json().await.unwrap();
    let new_key = body["key"].as_str().unwrap().to_string();
    eventually(
        Duration::from_secs(2),
        "A admits a key created after its filter was copied",
        || async { status(&a, &new_key).await == 200 },
    )
    .await;

    // A gateway started now copies the filter before it serves: its first made-up key
    // is refused unread.
    let c = TestGateway::spawn(settings(&toml(
        &redis.url(),
        &up,
        &[],
        "mode = \"cache\"\nkey_filter_mib = 1",
    )))
    .await;
    assert_eq!(status(&c, "made-up-at-start-0123456789").await, 401);
    assert_eq!(c.sample("tollgate_catalog_keys_filtered_total").await, 1.0);
    assert_eq!(status(&c, &new_key).await, 200);
}

#[tokio::test]
async fn on_a_redis_cluster_a_key_not_held_is_looked_up_then_refused_once_revoked() {
    // Arrange: a 3-master cluster; B (a mirror, the admin API) gives acme a key; A caches.
    let cluster = RedisCluster::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = |catalog: &str| {
        format!(
            "{}[redis]\ncluster_nodes = {:?}\ntimeout_ms = 100\n[catalog]\nrefresh_ms = 50\n{catalog}\n{}{}",
            admin_toml(),
            cluster.urls(),
            catalog_toml(("gold", 1_000_000.0, 1000.0), &[]),
            route_toml("orders", "/orders", &[up.url()]),
        )
    };
    let b = TestGateway::spawn(settings(&toml(""))).await;
    let a = TestGateway::spawn(settings(&toml(CACHE))).await;
    put_client(&b, "acme", "gold").await;
    let (key_id, key) = new_key(&b, "acme").await;
    // The client's ETag is the catalog's version after its key was written: A follows it
    // (its first lookups would otherwise meet an epoch it has not polled yet).
    let r = b
        .admin(Method::GET, "/clients/acme", &rw())
        .send()
        .await
        .unwrap();
    let version: u64 = r.headers()["etag"]
        .to_str()
        .unwrap()
        .trim_matches('"')
        .parse()
        .unwrap();
    a.wait_for_catalog(version).await;

    // Act and assert: admitted once the cluster answers (the connection is made in the
    // background), held after one read; refused within a poll once revoked.
    eventually(Duration::from_secs(10), "A admits acme", || async {
        status(&a, &key).await == 200
    })
    .await;
    let read = lookups(&a, "client").await;
    for _ in 0..5 {
        assert_eq!(status(&a, &key).await, 200);
    }
    assert_eq!(lookups(&a, "client").await, read, "held");
    revoke_key(&b, "acme", &key_id).await;
    eventually(
        Duration::from_secs(3),
        "A refuses the revoked key",
        || async { status(&a, &key).await == 401 },
    )
    .await;
}

#[tokio::test]
async fn the_catalog_is_exported_whole_at_one_version_by_a_mirror_and_refused_by_a_cache() {
    // Arrange: on B (a mirror), a plan, a client with a key, an override and safety
    // settings; A in cache mode beside it.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let b = TestGateway::spawn(settings(&toml(&redis.url(), &up, &["declared"], ""))).await;
    let a = TestGateway::spawn(settings(&toml(&redis.url(), &up, &[], CACHE))).await;
    put_client(&b, "acme", "gold").await;
    let (key_id, key) = new_key(&b, "acme").await;
    let r = b
        .send_admin(
            reqwest::Method::PUT,
            "/clients/acme/overrides/default",
            &rw(),
            Some(serde_json::json!({"capacity": 5})),
        )
        .await;
    assert_eq!(r.status(), 201, "{:?}", r.text().await);
    let r = b
        .send_admin(
            reqwest::Method::PUT,
            "/safety",
            &rw(),
            Some(serde_json::json!({"multiplier": 7})),
        )
        .await;
    assert_eq!(r.status(), 200);
    b.wait_for_catalog(store_version(&redis)).await;

    // Act
    let exported = b
        .send_admin(reqwest::Method::GET, "/catalog", &rw(), None)
        .await;
    let from_cache = a
        .send_admin(reqwest::Method::GET, "/catalog", &rw(), None)
        .await;

    // Assert: every record, at the version the ETag and the body name (the store's), the
    // key by its hash and never in plaintext; a gateway caching part of it says so.
    assert_eq!(exported.status(), 200);
    let etag = exported.headers()["etag"].to_str().unwrap().to_string();
    let text = exported.text().await.unwrap();
    assert!(!text.contains(&key), "a plaintext key in the export");
    let body: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        body["version"].as_u64(),
        Some(store_version(&redis)),
        "{body}"
    );
    assert_eq!(etag, format!("\"{}\"", body["version"]));
    let plans: Vec<&str> = body["plans"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(plans, ["gold"]);
    let ids: Vec<&str> = body["clients"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["acme", "declared"]);
    let acme = &body["clients"][0];
    assert_eq!(acme["plan"], "gold");
    assert_eq!(acme["keys"][0]["key_id"], key_id.as_str());
    let hash = tollgate::domain::KeyHash::of(&key).to_string();
    assert_eq!(acme["keys"][0]["hash"], hash.as_str());
    assert_eq!(acme["overrides"][0]["capacity"], 5.0, "{acme}");
    assert_eq!(body["safety"]["multiplier"], 7.0);
    assert_eq!(from_cache.status(), 409);
}
