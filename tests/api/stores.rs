//! The embedded store and the Redis script make the same decisions.

use std::time::Duration;

use secrecy::SecretString;
use tollgate::domain::{Applied, Bucket, Level, Limit, Ruling};
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
    let plan = [Applied::of(
        0,
        &Limit::default_bucket(Bucket::new(3.0, 2.0).unwrap()),
    )];
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
            .take("t:b:{acme}", &plan, *cost, None)
            .await
            .unwrap();
        let r = remote.take("t:b:{acme}", &plan, *cost, None).await.unwrap();
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

fn tokens(r: &Ruling) -> f64 {
    match r.levels[0] {
        Level::Tokens(t) => t,
        Level::Used { .. } => panic!("a bucket"),
    }
}
