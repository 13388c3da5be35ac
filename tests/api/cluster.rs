//! Redis Cluster: slot-safe keys, exact limits across nodes, and a node that is down
//! failing open only for the keys it owns.

use crate::helpers::*;

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
        per_node[cluster.owner(&format!("tollgate:b:{{{c}}}")).unwrap()] += 1;
    }
    assert!(
        per_node.iter().all(|n| *n > 0),
        "buckets spread over the nodes: {per_node:?}"
    );
    let warmup_node = cluster.owner("tollgate:b:{warmup}").unwrap();
    for (i, node) in cluster.nodes.iter().enumerate() {
        let here = node.keys("tollgate:b:*").unwrap().len() - usize::from(i == warmup_node);
        assert_eq!(here, per_node[i], "node {i} holds its clients' buckets");
    }

    // Act 2: a client's slot moves to another node (resharding): the gateways follow the
    // MOVED redirection and the bucket, moved with its slot, keeps the client limited.
    let moved = &before[0];
    let bucket = format!("tollgate:b:{{{moved}}}");
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
        if cluster.owner(&format!("tollgate:b:{{{c}}}")).unwrap() == stopped {
            assert_eq!(admitted, 8, "client {c} on the stopped node fails open");
            failed_open += 1;
        } else {
            assert_eq!(admitted, 5, "client {c} on a live node");
        }
    }
    assert!(failed_open > 0, "some clients live on the stopped node");
    cluster.nodes[stopped].resume().unwrap();
}
