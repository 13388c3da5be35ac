//! Plans of several limits, through the real gateway on real Redis: a request takes from
//! every limit that applies to it or from none, per-service limits apply beside the plan's,
//! and the headers and the 429 body name the limit that decided.

use futures_util::future::join_all;
use tollgate::domain::Limits;

use crate::helpers::*;

/// Two buckets and a daily quota; bucket `b` (20) is the tightest.
const B_TIGHTEST: &str = r#"[{ name = "a", capacity = 30, rate = 0.001 },
    { name = "b", capacity = 20, rate = 0.001 },
    { name = "c", quota = 25, period = "day" }]"#;
/// The same with `b` roomier than the quota: quota `c` (25) is the tightest.
const C_TIGHTEST: &str = r#"[{ name = "a", capacity = 30, rate = 0.001 },
    { name = "b", capacity = 40, rate = 0.001 },
    { name = "c", quota = 25, period = "day" }]"#;

/// What is left of each of `client`'s limits in Redis, read with the store's own peek.
async fn left(redis: &RedisServer, client: &str, limits: &Limits) -> Vec<f64> {
    let every = limits.every();
    let now = redis_store(redis)
        .buckets
        .peek(&format!("tollgate:b:{{{client}}}"), &every)
        .await
        .unwrap();
    now.levels
        .iter()
        .zip(&every)
        .map(|(l, a)| l.remaining(&a.kind))
        .collect()
}

/// The 429 body's `limit`: the policy name of the limit that refused.
async fn refused_by(r: reqwest::Response) -> String {
    let body: serde_json::Value = r.json().await.unwrap();
    body["limit"]
        .as_str()
        .unwrap_or_else(|| panic!("no limit in {body}"))
        .to_string()
}

/// `n` requests at once from `client`: (the admitted answers' `RateLimit`, the refused
/// answers' `limit`), failing on any answer that is not a decision of the store.
async fn burst(gw: &TestGateway, client: &str, n: usize) -> (Vec<RateLimit>, Vec<String>) {
    let k = key(client);
    let answers = join_all((0..n).map(|_| gw.get("/orders/1", Some(&k)))).await;
    let (mut admitted, mut refused) = (Vec::new(), Vec::new());
    for r in answers {
        assert!(decided(&r), "not decided by the store: {:?}", r.headers());
        match r.status().as_u16() {
            200 => admitted.push(RateLimit::of(&r)),
            429 => refused.push(refused_by(r).await),
            other => panic!("{other}"),
        }
    }
    (admitted, refused)
}

#[tokio::test]
async fn a_request_any_of_three_limits_refuses_spends_from_none_even_in_coalesced_calls() {
    clear_of_midnight().await;
    // Arrange: one worker, so concurrent requests for a client queue behind its call in
    // flight and go to Redis together.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}{}{}{}",
        redis_toml(&redis),
        limits_catalog_toml("trio", B_TIGHTEST, &["acme"]),
        limits_catalog_toml("roomy", C_TIGHTEST, &["beta"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;

    // Act 1: 200 requests at once on the plan whose bucket b is the tightest.
    let (admitted, refused) = burst(&gw, "acme", 200).await;

    // Assert: exactly b's 20 admitted, each told its own place in b (19 down to 0: one
    // verdict per request, replayed from a shared call), and every refusal names b...
    let mut places: Vec<u64> = admitted
        .iter()
        .inspect(|rl| assert_eq!(rl.policy, "trio.b", "{admitted:?}"))
        .map(|rl| rl.remaining)
        .collect();
    places.sort_unstable();
    assert_eq!(places, (0..20).collect::<Vec<u64>>());
    assert_eq!(refused.len(), 180);
    assert!(refused.iter().all(|l| l == "trio.b"), "{refused:?}");
    assert_eq!(up.hits(), 20);
    // ...and every limit spent exactly 20: the 180 refused requests took nothing from a
    // or c, which could have held them.
    let left_acme = left(&redis, "acme", &plan_limits(&toml, "trio")).await;
    assert!((10.0..10.1).contains(&left_acme[0]), "a: {left_acme:?}");
    assert!((0.0..0.1).contains(&left_acme[1]), "b: {left_acme:?}");
    assert_eq!(left_acme[2], 5.0, "c: {left_acme:?}");

    // Act 2: the same on the plan whose quota c is the tightest.
    let (admitted, refused) = burst(&gw, "beta", 200).await;

    // Assert: exactly c's 25, and nothing more taken from either bucket.
    let mut places: Vec<u64> = admitted
        .iter()
        .inspect(|rl| assert_eq!(rl.policy, "roomy.c", "{admitted:?}"))
        .map(|rl| rl.remaining)
        .collect();
    places.sort_unstable();
    assert_eq!(places, (0..25).collect::<Vec<u64>>());
    assert!(
        refused.len() == 175 && refused.iter().all(|l| l == "roomy.c"),
        "{refused:?}"
    );
    let left_beta = left(&redis, "beta", &plan_limits(&toml, "roomy")).await;
    assert!((5.0..5.1).contains(&left_beta[0]), "a: {left_beta:?}");
    assert!((15.0..15.1).contains(&left_beta[1]), "b: {left_beta:?}");
    assert_eq!(left_beta[2], 0.0, "c: {left_beta:?}");
    assert_eq!(up.hits(), 45);

    // The 400 takes went to Redis in shared calls: one per round trip, not per request.
    let calls = gw.sample("tollgate_store_bucket_calls_total").await;
    let takes = gw.sample("tollgate_store_bucket_takes_total").await;
    eprintln!("plans: {calls} script calls for {takes} takes");
    assert_eq!(takes, 400.0);
    assert!(
        calls * 10.0 <= takes,
        "{calls} script calls for {takes} takes: the queued requests were not batched"
    );
}

#[tokio::test]
async fn a_per_service_limit_applies_beside_the_plans_and_its_refusals_spend_nothing() {
    // Arrange: gold = 10 tokens for every service, and 3 more for search only; next to no
    // refill, so every count is exact.
    let redis = RedisServer::start().unwrap();
    let search = Upstream::start(Behaviour::Echo).await;
    let orders = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}{}{}{}",
        redis_toml(&redis),
        limits_catalog_toml(
            "gold",
            r#"[{ name = "default", capacity = 10, rate = 0.001 },
                { name = "search", service = "search", capacity = 3, rate = 0.001 }]"#,
            &["acme"],
        ),
        route_toml("search", "/search", &[search.url()]),
        route_toml("orders", "/orders", &[orders.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    let k = key("acme");

    // Act 1: six searches, one after another.
    let mut searches = Vec::new();
    for _ in 0..6 {
        searches.push(gw.get("/search?q=x", Some(&k)).await);
    }

    // Assert: three admitted, each taking from both limits; the search limit, the tighter,
    // is the one reported; then 429s naming it.
    for r in &searches {
        assert_eq!(
            r.headers()["ratelimit-policy"],
            "\"gold\";q=10;w=10000, \"gold.search\";q=3;w=3000"
        );
    }
    let statuses: Vec<u16> = searches.iter().map(|r| r.status().as_u16()).collect();
    assert_eq!(statuses, [200, 200, 200, 429, 429, 429]);
    let reported: Vec<(String, u64)> = searches
        .iter()
        .map(RateLimit::of)
        .map(|rl| (rl.policy, rl.remaining))
        .collect();
    let search_left = |r| ("gold.search".to_string(), r);
    assert_eq!(
        reported,
        [2, 1, 0, 0, 0, 0].map(search_left),
        "{reported:?}"
    );
    for r in searches.into_iter().skip(3) {
        assert_eq!(refused_by(r).await, "gold.search");
    }
    assert_eq!(search.hits(), 3);

    // Act 2: orders, which only the plan's limit applies to.
    let mut answers = Vec::new();
    for _ in 0..9 {
        answers.push(gw.get("/orders/1", Some(&k)).await);
    }

    // Assert: 7 left of the 10 (the three searches took from them, the three refused ones
    // did not), and the search limit is neither listed nor reported.
    for r in &answers {
        assert_eq!(r.headers()["ratelimit-policy"], "\"gold\";q=10;w=10000");
        assert_eq!(RateLimit::of(r).policy, "gold");
    }
    let admitted: Vec<u64> = answers
        .iter()
        .filter(|r| r.status() == 200)
        .map(|r| RateLimit::of(r).remaining)
        .collect();
    assert_eq!(admitted, [6, 5, 4, 3, 2, 1, 0]);
    let last = answers.pop().unwrap();
    assert_eq!(last.status(), 429);
    assert_eq!(refused_by(last).await, "gold");
    assert_eq!(orders.hits(), 7);
}

#[tokio::test]
async fn ratelimit_reports_the_limit_closest_to_refusing() {
    clear_of_midnight().await;
    // Arrange: a bucket of 10 that refills within a millisecond, and a daily quota of 14:
    // the bucket is closest to refusing until the quota has no more left than it (a tie
    // goes to the limit that takes longer to be whole again: the quota).
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}{}{}",
        redis_toml(&redis),
        limits_catalog_toml(
            "metered",
            r#"[{ name = "default", capacity = 10, rate = 10000 },
                { name = "daily", quota = 14, period = "day" }]"#,
            &["acme"],
        ),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    let k = key("acme");

    // Act: 15 requests, one after another.
    let mut answers = Vec::new();
    for _ in 0..15 {
        answers.push(gw.get("/orders", Some(&k)).await);
    }

    // Assert: the bucket (9 left) for the first four; from the fifth on the quota, down to
    // 0, with the seconds until midnight UTC as its reset...
    let to_midnight = 86_400 - unix_now() % 86_400;
    let reported: Vec<RateLimit> = answers.iter().map(RateLimit::of).collect();
    for (i, rl) in reported.iter().enumerate() {
        if i < 4 {
            assert_eq!((rl.policy.as_str(), rl.remaining), ("metered", 9), "{i}");
            assert_eq!(rl.reset, 1, "{i}: {reported:?}");
        } else {
            let left = 13u64.saturating_sub(i as u64);
            assert_eq!((rl.policy.as_str(), rl.remaining), ("metered.daily", left));
            assert!(rl.reset.abs_diff(to_midnight) <= 2, "{i}: {reported:?}");
        }
    }
    // ...and the 15th is refused by the quota until midnight.
    let refused = answers.pop().unwrap();
    assert_eq!(refused.status(), 429);
    assert!(
        retry_after(&refused).unwrap().abs_diff(to_midnight) <= 2,
        "{:?}",
        refused.headers()
    );
    assert_eq!(refused_by(refused).await, "metered.daily");
    assert_eq!(up.hits(), 14);
}

#[tokio::test]
async fn a_cost_one_limit_can_never_hold_gets_429_without_retry_after_naming_that_limit() {
    clear_of_midnight().await;
    // Arrange: a bucket of 100 and a daily quota of 10; /bulk costs 12, more than the
    // quota can ever hold (but not the bucket), /orders costs 1.
    let redis = RedisServer::start().unwrap();
    let bulk = Upstream::start(Behaviour::Echo).await;
    let orders = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}{}{}cost = 12.0\n{}",
        redis_toml(&redis),
        limits_catalog_toml(
            "capped",
            r#"[{ name = "default", capacity = 100, rate = 1 },
                { name = "daily", quota = 10, period = "day" }]"#,
            &["acme"],
        ),
        route_toml("bulk", "/bulk", &[bulk.url()]),
        route_toml("orders", "/orders", &[orders.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    let k = key("acme");

    // Act + Assert: refused every time, with no wait that would help, naming the quota.
    for _ in 0..3 {
        let r = gw.get("/bulk/export", Some(&k)).await;
        assert_eq!(r.status(), 429);
        assert_eq!(retry_after(&r), None, "{:?}", r.headers());
        assert_eq!(RateLimit::of(&r).policy, "capped.daily");
        assert_eq!(RateLimit::of(&r).remaining, 10);
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(body["limit"], "capped.daily", "{body}");
        assert!(body.get("retry_after_ms").is_none(), "{body}");
        assert!(
            body["detail"]
                .as_str()
                .unwrap()
                .contains("can never be admitted"),
            "{body}"
        );
    }
    assert_eq!(bulk.hits(), 0);

    // ...and refusing it spent nothing: the quota is whole for /orders.
    let r = gw.get("/orders", Some(&k)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        (RateLimit::of(&r).policy, RateLimit::of(&r).remaining),
        ("capped.daily".to_string(), 9)
    );
}
