//! Redis Cluster: slot-safe keys, exact limits across nodes, and a node that is down
//! failing open only for the keys it owns.

use tollgate::store::{StateGroups, CLUSTER_STATE_GROUPS};

use crate::helpers::*;

/// The group hash holding `client`'s state on a cluster (`engine/lua/bucket.lua`).
fn group_of(client: &str) -> String {
    let groups = StateGroups::new("tollgate:", CLUSTER_STATE_GROUPS);
    groups
        .key(groups.locate(&format!("tollgate:b:{{{client}}}")).0)
        .to_string()
}

#[tokio::test]
async fn a_three_master_cluster_limits_every_client_exactly_and_a_stopped_node_fails_open_only_for_its_keys(
) {
    // Arrange: a cluster, two gateways on it, 48 clients of capacity 5.
    let cluster = RedisCluster::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let clients: Vec<String> = (0..48).map(|i| format!("client{i}")).collect();
    let mut refs: Vec<&str> = clients.iter().map(String::as_str).collect();
    refs.push("warmup");
    let toml = format!(
        "[redis]\ncluster_nodes = {:?}\ntimeout_ms = 100\n{}{}",
        cluster.urls(),
        catalog_toml(("five", 5.0, 0.001), &refs),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let gateways = [
        TestGateway::spawn(settings(&toml)).await,
        TestGateway::spawn(settings(&toml)).await,
    ];
    let (before, after) = clients.split_at(24);
    // The cluster connection is made in the background: wait until each gateway decides
    // (a first request that fails open while it connects would be admitted beyond 5).
    for gw in &gateways {
        eventually(std::time::Duration::from_secs(10), "connected", || async {
            gw.get("/orders", Some(&key("warmup")))
                .await
                .headers()
                .contains_key("ratelimit")
        })
        .await;
    }

    // Act 1: every node up; 8 requests per client, alternating gateways.
    for c in before {
        let mut admitted = 0;
        for i in 0..8 {
            if gateways[i % 2].get("/orders", Some(&key(c))).await.status() == 200 {
                admitted += 1;
            }
        }
        // Assert: exactly the capacity, whichever node holds the bucket.
        assert_eq!(admitted, 5, "client {c}");
    }
    let mut per_node = [0; 3];
    for c in before {
        let node = cluster.owner(&group_of(c)).unwrap();
        per_node[node] += 1;
        // The node that serves the client's group holds its state.
        let held: bool = redis::cmd("HEXISTS")
            .arg(group_of(c))
            .arg(c)
            .query(&mut cluster.nodes[node].conn().unwrap())
            .unwrap();
        assert!(held, "node {node} holds {c}'s state");
    }
    assert!(
        per_node.iter().all(|n| *n > 0),
        "state spread over the nodes: {per_node:?}"
    );

    // Act 2: a client's state group's slot moves to another node (resharding): the
    // gateways follow the MOVED redirection and the state, moved with its slot, keeps the
    // client limited.
    let moved = &before[0];
    let bucket = group_of(moved);
    let old_owner = cluster.owner(&bucket).unwrap();
    cluster.move_slot_of(&bucket, (old_owner + 1) % 3).unwrap();
    assert_ne!(cluster.owner(&bucket).unwrap(), old_owner);
    for gw in &gateways {
        let r = gw.get("/orders", Some(&key(moved))).await;
        assert_eq!(r.status(), 429, "the moved bucket is still empty");
        assert!(
            r.headers().contains_key("ratelimit"),
            "a real decision, not failing open"
        );
    }

    // Act 3: one node stops (not the one holding the catalog, so nothing else is affected).
    let catalog_node = cluster.owner("tollgate:{catalog}:plans").unwrap();
    let stopped = (catalog_node + 1) % 3;
    cluster.nodes[stopped].stall().unwrap();
    let mut failed_open = 0;
    for c in after {
        let mut admitted = 0;
        for i in 0..8 {
            if gateways[i % 2].get("/orders", Some(&key(c))).await.status() == 200 {
                admitted += 1;
            }
        }
        // Assert: the stopped node's clients are admitted (failing open, within the safety
        // limit); everyone else's limit still holds exactly.
        if cluster.owner(&group_of(c)).unwrap() == stopped {
            assert_eq!(admitted, 8, "client {c} on the stopped node fails open");
            failed_open += 1;
        } else {
            assert_eq!(admitted, 5, "client {c} on a live node");
        }
    }
    assert!(failed_open > 0, "some clients live on the stopped node");
    cluster.nodes[stopped].resume().unwrap();
}

/// EVALSHA calls summed over the cluster's masters.
fn evalsha_calls(cluster: &RedisCluster) -> u64 {
    cluster
        .nodes
        .iter()
        .map(|n| {
            n.command_calls()
                .unwrap()
                .get("evalsha")
                .copied()
                .unwrap_or(0)
        })
        .sum()
}

/// Each client's admitted requests' `RateLimit` remaining, sorted, for requests sent as
/// `(client index, response)`.
fn places(n: usize, answers: &[(usize, reqwest::Response)]) -> Vec<Vec<u64>> {
    let mut places = vec![Vec::new(); n];
    for (c, r) in answers {
        assert!(r.headers().contains_key("ratelimit"), "a real decision");
        if r.status() == 200 {
            places[*c].push(RateLimit::of(r).remaining);
        }
    }
    for p in &mut places {
        p.sort_unstable();
    }
    places
}

#[tokio::test]
async fn on_a_cluster_takes_of_one_masters_clients_share_calls_and_a_moved_slot_is_decided_alone() {
    // Arrange: a cluster, one gateway, 60 clients of capacity 3 and 30 of capacity 2.
    let cluster = RedisCluster::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let first: Vec<String> = (0..60).map(|i| format!("a{i}")).collect();
    let second: Vec<String> = (0..30).map(|i| format!("b{i}")).collect();
    let warm: Vec<String> = (0..30).map(|i| format!("w{i}")).collect();
    fn refs(v: &[String]) -> Vec<&str> {
        v.iter().map(String::as_str).collect()
    }
    let toml = format!(
        "[redis]\ncluster_nodes = {:?}\ntimeout_ms = 200\n{}{}{}",
        cluster.urls(),
        catalog_toml(("three", 3.0, 0.001), &refs(&first)),
        catalog_toml(("two", 2.0, 0.001), &[refs(&second), refs(&warm)].concat()),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let gw = &TestGateway::spawn(settings(&toml)).await;
    let (first, second) = (&first, &second);
    // Connected, and the slot map read (it is read in the background once a second): a
    // burst of 30 clients' first requests goes out in a handful of calls, not 30.
    eventually(
        std::time::Duration::from_secs(10),
        "takes gathered per master",
        || async {
            let before = evalsha_calls(&cluster);
            let keys: Vec<String> = warm.iter().map(|w| key(w)).collect();
            let answers =
                futures_util::future::join_all(keys.iter().map(|k| gw.get("/orders", Some(k))))
                    .await;
            let decided = answers
                .iter()
                .all(|r| r.headers().contains_key("ratelimit"));
            decided && evalsha_calls(&cluster) - before < 15
        },
    )
    .await;

    // Act 1: 4 requests per client, all at once.
    let before = evalsha_calls(&cluster);
    let answers: Vec<(usize, reqwest::Response)> = futures_util::future::join_all(
        (0..240)
            .map(|i| async move { (i % 60, gw.get("/orders", Some(&key(&first[i % 60]))).await) }),
    )
    .await;

    // Assert: every client exactly its 3 (remaining 2, 1, 0), in fewer calls than clients.
    assert!(
        places(60, &answers).iter().all(|p| *p == [0, 1, 2]),
        "{:?}",
        places(60, &answers)
    );
    let calls = evalsha_calls(&cluster) - before;
    assert!(
        calls < 60,
        "{calls} calls for 240 takes of 60 clients on 3 masters"
    );
    // ... each master's on a worker's own connection to it (named `tollgate-worker`).
    for (i, node) in cluster.nodes.iter().enumerate() {
        let last = node.last_commands_of("tollgate-worker").unwrap();
        assert!(last.iter().any(|c| c == "evalsha"), "node {i}: {last:?}");
    }

    // Act 2: the slot of b0's state group moves to another master; at once, before the
    // gateway reads the slot map again, 3 requests of every b client, b0's last in each
    // round: b0's take goes out with its old master's others.
    let moved = group_of(&second[0]);
    let old = cluster.owner(&moved).unwrap();
    cluster.move_slot_of(&moved, (old + 1) % 3).unwrap();
    let answers: Vec<(usize, reqwest::Response)> =
        futures_util::future::join_all((0..90).map(|i| async move {
            (
                29 - i % 30,
                gw.get("/orders", Some(&key(&second[29 - i % 30]))).await,
            )
        }))
        .await;

    // Assert: every b client, b0 included, decided exactly: 2 admitted, none failing open.
    assert!(
        places(30, &answers).iter().all(|p| *p == [0, 1]),
        "{:?}",
        places(30, &answers)
    );
    assert_eq!(gw.metric("tollgate_fail_open_total").await, Some(0.0));
}

#[tokio::test]
async fn on_a_cluster_addresses_behind_a_trusted_proxy_each_hold_their_public_limit_on_two_gateways(
) {
    // Arrange: a public route limited to 5 per address, two gateways behind a proxy.
    let cluster = RedisCluster::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "[server]\ntrusted_proxies = [\"127.0.0.1\"]\n[redis]\ncluster_nodes = {:?}\ntimeout_ms = 100\n\
         {}[[catalog.plans]]\nname = \"anonymous\"\ncapacity = 5\nrate = 0.001\n{}public_plan = \"anonymous\"\n",
        cluster.urls(),
        catalog_toml(("gold", 100.0, 100.0), &["warmup"]),
        route_toml("login", "/login", &[up.url()]),
    );
    let gateways = [
        TestGateway::spawn(settings(&toml)).await,
        TestGateway::spawn(settings(&toml)).await,
    ];
    for gw in &gateways {
        eventually(std::time::Duration::from_secs(10), "connected", || async {
            gw.get("/login", Some(&key("warmup")))
                .await
                .headers()
                .contains_key("ratelimit")
        })
        .await;
    }

    // Act: 24 addresses (IPv4 and IPv6, so their tags spread over the masters), 8
    // requests each, alternating gateways.
    let mut admitted = Vec::new();
    for i in 0..24 {
        let xff = if i % 2 == 0 {
            format!("198.51.100.{i}")
        } else {
            format!("2001:db8:{i:x}::1")
        };
        let mut n = 0;
        for j in 0..8 {
            let r = gateways[j % 2]
                .http
                .get(format!("{}/login", gateways[j % 2].address))
                .header("x-forwarded-for", &xff)
                .send()
                .await
                .unwrap();
            n += usize::from(r.status() == 200);
        }
        admitted.push(n);
    }

    // Assert: each address got its 5, across both gateways.
    assert!(admitted.iter().all(|n| *n == 5), "{admitted:?}");
}
