//! Keys the catalog does not know are counted per client address, in each gateway's
//! memory: past `edge.failed_keys_burst` an address gets `429` with `Retry-After` instead
//! of `401`, a valid key from it too, until its allowance refills; other addresses are
//! untouched, and no store call is made for any of it.

use std::net::IpAddr;
use std::time::Duration;

use crate::helpers::*;

fn from(from: &str) -> reqwest::Client {
    reqwest::Client::builder()
        .local_address(from.parse::<IpAddr>().unwrap())
        .build()
        .unwrap()
}

async fn gateway(extra: &str, up: &Upstream) -> TestGateway {
    TestGateway::spawn(settings(&format!(
        "{extra}{}{}",
        catalog_toml(("gold", 1000.0, 1000.0), &["acme"]),
        route_toml("orders", "/orders", &[up.url()]),
    )))
    .await
}

/// The status of one request to `/orders` with `key` (none: no key), through `client`.
async fn status(
    client: &reqwest::Client,
    gw: &TestGateway,
    key: Option<&str>,
    xff: Option<&str>,
) -> reqwest::Response {
    let mut req = client.get(format!("{}/orders", gw.address));
    if let Some(key) = key {
        req = req.header("x-api-key", key);
    }
    if let Some(xff) = xff {
        req = req.header("x-forwarded-for", xff);
    }
    req.send().await.unwrap()
}

fn guess(i: usize) -> String {
    format!("tg_guess_{i:08}")
}

const FIVE_A_BURST: &str = "[edge]\nfailed_keys_burst = 5\nfailed_keys_per_minute = 6\n";

#[tokio::test]
async fn guessing_keys_gets_a_burst_of_401s_then_429s_for_that_address_alone() {
    // Arrange.
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(FIVE_A_BURST, &up).await;
    let (guesser, other) = (from("127.0.0.2"), from("127.0.0.3"));

    // Act: 20 guesses from one address.
    let mut codes = Vec::new();
    let mut last = None;
    for i in 0..20 {
        let r = status(&guesser, &gw, Some(&guess(i)), None).await;
        codes.push(r.status().as_u16());
        last = Some(r);
    }

    // Assert: 5 401s, then 429s that say when (one more guess every 10 s).
    assert_eq!(codes[..5], [401; 5]);
    assert_eq!(codes[5..], [429; 15]);
    let last = last.unwrap();
    assert_eq!(retry_after(&last), Some(10));
    let body: serde_json::Value = last.json().await.unwrap();
    assert!(
        body["type"]
            .as_str()
            .unwrap()
            .ends_with("/too-many-failed-keys"),
        "{body}"
    );
    // A valid key from that address waits too: a right guess must not pass.
    let r = status(&guesser, &gw, Some(&key("acme")), None).await;
    assert_eq!(r.status(), 429);
    // Without a key it is the usual 401 (not a guess, not counted).
    assert_eq!(status(&guesser, &gw, None, None).await.status(), 401);
    // Another address is untouched.
    assert_eq!(
        status(&other, &gw, Some(&key("acme")), None).await.status(),
        200
    );
    assert_eq!(
        status(&other, &gw, Some(&guess(99)), None).await.status(),
        401
    );
    assert_eq!(up.hits(), 1);
    let refused = gw
        .sample("tollgate_decisions_total{outcome=\"failed_keys_limited\"}")
        .await;
    assert_eq!(refused, 16.0);
}

#[tokio::test]
async fn an_address_held_back_gets_its_allowance_back_at_its_rate() {
    // One more guess every 100 ms.
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(
        "[edge]\nfailed_keys_burst = 2\nfailed_keys_per_minute = 600\n",
        &up,
    )
    .await;
    let guesser = from("127.0.0.2");
    for i in 0..3 {
        status(&guesser, &gw, Some(&guess(i)), None).await;
    }
    assert_eq!(
        status(&guesser, &gw, Some(&key("acme")), None)
            .await
            .status(),
        429
    );

    tokio::time::sleep(Duration::from_millis(150)).await;

    assert_eq!(
        status(&guesser, &gw, Some(&key("acme")), None)
            .await
            .status(),
        200
    );
    assert_eq!(
        status(&guesser, &gw, Some(&guess(9)), None).await.status(),
        401
    );
}

#[tokio::test]
async fn a_flood_of_unknown_keys_costs_no_store_call() {
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(&format!("{}{FIVE_A_BURST}", redis_toml(&redis)), &up).await;
    assert_eq!(gw.get("/orders", Some(&key("acme"))).await.status(), 200);
    let calls = || {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut redis.conn().unwrap())
            .unwrap();
        info.lines()
            .filter(|l| l.starts_with("cmdstat_eval"))
            .map(|l| {
                l.split("calls=")
                    .nth(1)
                    .unwrap()
                    .split(',')
                    .next()
                    .unwrap()
                    .parse::<u64>()
                    .unwrap()
            })
            .sum::<u64>()
    };
    let before = calls();

    let guesser = from("127.0.0.2");
    for i in 0..500 {
        status(&guesser, &gw, Some(&guess(i)), None).await;
    }

    assert_eq!(calls(), before);
}

#[tokio::test]
async fn behind_a_trusted_proxy_each_forwarded_client_is_counted_alone() {
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!("[server]\ntrusted_proxies = [\"127.0.0.1\"]\n{FIVE_A_BURST}");
    let gw = gateway(&toml, &up).await;
    let proxy = from("127.0.0.1");

    for i in 0..5 {
        let r = status(&proxy, &gw, Some(&guess(i)), Some("1.1.1.1")).await;
        assert_eq!(r.status(), 401);
    }

    let held = status(&proxy, &gw, Some(&key("acme")), Some("1.1.1.1")).await;
    let other = status(&proxy, &gw, Some(&key("acme")), Some("2.2.2.2")).await;
    // Spoofing another address left of the proxy's hop changes nothing.
    let spoof = status(&proxy, &gw, Some(&guess(7)), Some("2.2.2.2, 1.1.1.1")).await;
    assert_eq!(
        (
            held.status().as_u16(),
            other.status().as_u16(),
            spoof.status().as_u16()
        ),
        (429, 200, 429)
    );
}
