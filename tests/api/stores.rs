//! The embedded store and the Redis script make the same decisions.

use std::time::Duration;

use secrecy::SecretString;
use tollgate::domain::{Bucket, Level, Limit, Limits, Ruling};
use tollgate::store::{Keys, Store};

use crate::helpers::*;

#[tokio::test]
async fn the_embedded_store_decides_like_the_redis_script_on_the_same_timeline() {
    let redis = RedisServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let embedded = Store::embedded(&dir.path().join("c.json")).unwrap();
    let remote = Store::redis(
        &SecretString::from(redis.url()),
        2,
        std::time::Duration::from_secs(1),
        Keys::new("t:"),
    )
    .unwrap();
    let plan = [Limit::default_bucket(Bucket::new(3.0, 2.0).unwrap()).applied(0)];
    // (pause before, cost): a burst past capacity, a partial refill, a cost the refill
    // does not cover yet, a full refill, and a cost the bucket can never hold. Every
    // decision has at least 250 ms of slack, so a loaded machine decides the same.
    let timeline: Vec<(u64, f64)> = [(0, 1.0); 5]
        .into_iter()
        .chain([(750, 1.0), (0, 1.0), (0, 1.0)])
        .chain([(250, 2.0), (0, 2.0)])
        .chain([(1500, 3.0), (0, 4.0)])
        .collect();

    let mut decisions = Vec::new();
    for (pause, cost) in &timeline {
        tokio::time::sleep(Duration::from_millis(*pause)).await;
        let e = embedded
            .buckets
            .take("t:b:{acme}", &plan, *cost, None)
            .await
            .unwrap();
        let r = remote
            .buckets
            .take("t:b:{acme}", &plan, *cost, None)
            .await
            .unwrap();
        decisions.push((e, r));
    }

    for (i, (e, r)) in decisions.iter().enumerate() {
        assert_eq!(e.allowed, r.allowed, "step {i}: {decisions:?}");
        assert_eq!(e.wait_us.is_some(), r.wait_us.is_some(), "step {i}");
        assert!(
            (tokens(e) - tokens(r)).abs() < 0.3,
            "step {i}: {e:?} vs {r:?}"
        );
    }
    let allowed: Vec<bool> = decisions.iter().map(|(e, _)| e.allowed).collect();
    assert_eq!(
        allowed,
        [true, true, true, false, false, true, false, false, false, false, true, false]
    );
}

#[tokio::test]
async fn the_embedded_store_and_redis_agree_on_a_timeline_of_three_limits() {
    // Arrange: two buckets and a monthly quota, decided at once, on both stores.
    let redis = RedisServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let embedded = Store::embedded(&dir.path().join("c.json")).unwrap();
    let remote = Store::redis(
        &SecretString::from(redis.url()),
        2,
        Duration::from_secs(1),
        Keys::new("t:"),
    )
    .unwrap();
    let limits: Limits = serde_json::from_str(
        r#"[{"name":"burst","capacity":4,"rate":4},
            {"name":"steady","capacity":6,"rate":1},
            {"name":"monthly","quota":7,"period":"month"}]"#,
    )
    .unwrap();
    let applied = limits.applied(None);
    // (pause before, cost, whether admitted, the limit that refuses): each limit refuses
    // once on its own while the others would hold the request, the quota once used up,
    // and last a cost the burst bucket can never hold. Every refusal by a bucket has at
    // least 250 ms of slack, so a loaded machine decides the same.
    let timeline = [
        (0, 2.0, true, None),
        (0, 2.0, true, None),
        (0, 1.0, false, Some(0)),    // burst empty: 250 ms to a token
        (600, 2.0, true, None),      // burst 2.4, steady 2.6
        (500, 2.0, false, Some(1)),  // burst 2.4 holds it, steady 1.1 does not
        (0, 1.0, true, None),        // the quota's 7th
        (1000, 1.0, false, Some(2)), // both buckets hold it, the quota is used up
        (0, 5.0, false, Some(0)),    // more than the burst bucket ever holds
    ];

    // Act
    let mut decisions = Vec::new();
    for (pause, cost, ..) in &timeline {
        tokio::time::sleep(Duration::from_millis(*pause)).await;
        let e = embedded
            .buckets
            .take("t:b:{acme}", &applied, *cost, None)
            .await
            .unwrap();
        let r = remote
            .buckets
            .take("t:b:{acme}", &applied, *cost, None)
            .await
            .unwrap();
        decisions.push((e, r));
    }

    // Assert: the same decisions, refused by the same limit, with the same wait (none for
    // the cost no wait helps), and the same levels: tokens within a few ms of refill, the
    // quota's count and window exactly.
    for (i, ((e, r), (_, _, allowed, refused_by))) in decisions.iter().zip(&timeline).enumerate() {
        assert_eq!(
            (e.allowed, r.allowed),
            (*allowed, *allowed),
            "step {i}: {e:?} vs {r:?}"
        );
        assert_eq!(
            (e.refused_by, r.refused_by),
            (*refused_by, *refused_by),
            "step {i}"
        );
        match (e.wait_us, r.wait_us) {
            (Some(a), Some(b)) => assert!(a.abs_diff(b) < 100_000, "step {i}: {e:?} vs {r:?}"),
            (None, None) => assert_eq!(i, 7, "step {i}: {e:?}"),
            _ => panic!("step {i}: {e:?} vs {r:?}"),
        }
        for (a, b) in e.levels.iter().zip(&r.levels) {
            match (a, b) {
                (Level::Tokens(a), Level::Tokens(b)) => {
                    assert!((a - b).abs() < 0.1, "step {i}: {e:?} vs {r:?}")
                }
                _ => assert_eq!(a, b, "step {i}"),
            }
        }
    }
    // The quota refused with a wait until the month's end, and both stores keep its 7.
    let (e, _) = &decisions[6];
    assert_eq!(
        e.wait_us,
        Some(e.levels[2].reset_us(&applied[2].kind, e.now_us))
    );
    for store in [&embedded, &remote] {
        let now = store.buckets.peek("t:b:{acme}", &applied).await.unwrap();
        assert_eq!(now.levels[2].remaining(&applied[2].kind), 0.0);
    }
}

fn tokens(r: &Ruling) -> f64 {
    match r.levels[0] {
        Level::Tokens(t) => t,
        Level::Used { .. } => panic!("a bucket"),
    }
}

/// A key's client found in one call, as a gateway holding only part of the catalog will
/// ask it: the record once written, nothing once its key is revoked, its client deleted,
/// or for a key no client has. The same on every store.
#[tokio::test]
async fn every_store_finds_a_keys_client_and_forgets_it_once_revoked_or_deleted() {
    use tollgate::domain::{ClientId, KeyHash, PlanName};
    use tollgate::store::records::{
        Audit, CatalogWrite, ClientRecord, Condition, KeyRecord, PlanRecord,
    };

    let redis = RedisServer::start().unwrap();
    let cluster = RedisCluster::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let nodes: Vec<SecretString> = cluster.urls().into_iter().map(SecretString::from).collect();
    let stores = [
        (
            "embedded",
            Store::embedded(&dir.path().join("c.json")).unwrap(),
        ),
        (
            "redis",
            Store::redis(
                &SecretString::from(redis.url()),
                2,
                Duration::from_secs(2),
                Keys::new("t:"),
            )
            .unwrap(),
        ),
        (
            "cluster",
            Store::cluster(&nodes, Duration::from_secs(2), Keys::new("t:")).unwrap(),
        ),
    ];
    let gold = PlanName::parse("gold").unwrap();
    let (first, second) = (KeyHash::of("acme-key-1"), KeyHash::of("acme-key-2"));
    let client = |keys: &[&KeyHash]| ClientRecord {
        id: ClientId::parse("acme").unwrap(),
        plan: gold.clone(),
        mode: None,
        shards: None,
        keys: keys.iter().map(|k| KeyRecord::new(**k)).collect(),
        overrides: Vec::new(),
        extra: Default::default(),
    };
    for (name, store) in &stores {
        let write = |w: CatalogWrite| async move {
            store
                .catalog
                .write(&w, &Audit::new("test", "test"))
                .await
                .unwrap()
        };
        let bucket = Limits::single(Bucket::new(10.0, 1.0).unwrap());
        write(CatalogWrite::PutPlan(
            PlanRecord::new(gold.clone(), &bucket, None),
            Condition::Any,
        ))
        .await;
        let by_key = |k: KeyHash| async move {
            store
                .catalog
                .client_by_key(&k, Duration::from_millis(500))
                .await
                .unwrap()
                .client
        };

        assert!(by_key(first).await.is_none(), "{name}: nothing yet");
        write(CatalogWrite::PutClient(
            client(&[&first, &second]),
            Condition::Any,
        ))
        .await;
        let found = by_key(second).await.expect(name);
        assert_eq!(found.value, client(&[&first, &second]), "{name}");
        assert_eq!(
            Some(found.rev),
            store.catalog.client("acme").await.unwrap().map(|c| c.rev),
            "{name}: the record's revision, as a read by id gives it"
        );
        assert!(by_key(KeyHash::of("nobody's")).await.is_none(), "{name}");

        // The first key revoked: it finds nothing; the second still finds the client.
        write(CatalogWrite::PutClient(client(&[&second]), Condition::Any)).await;
        assert!(by_key(first).await.is_none(), "{name}: revoked");
        assert_eq!(
            by_key(second).await.map(|c| c.value),
            Some(client(&[&second])),
            "{name}"
        );
        write(CatalogWrite::DeleteClient(
            ClientId::parse("acme").unwrap(),
            Condition::Any,
        ))
        .await;
        assert!(by_key(second).await.is_none(), "{name}: deleted");
    }
}
