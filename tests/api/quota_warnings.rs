//! Quota warnings: a plan's quota names percentages (`warn_at`); the window that reaches
//! one is announced to every webhook once, whichever gateways the requests went through,
//! signed with each webhook's own secret, retried with back-off, and audited. The
//! webhooks here are a server the test runs, answering what each test says.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hmac::{Hmac, Mac};
use reqwest::Method;
use serde_json::{json, Value};
use sha2::Sha256;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::helpers::*;

const SECRET: &str = "webhook-secret-0123456789-abcdefghij";
const OTHER_SECRET: &str = "another-webhook-secret-0123456789-xyz";

/// A POST a webhook got.
#[derive(Clone, Debug)]
struct Hook {
    headers: HashMap<String, String>,
    body: String,
}

impl Hook {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap()
    }

    /// Whether its `Tollgate-Signature` is the HMAC of its timestamp and body under
    /// `secret`.
    fn signed_with(&self, secret: &str) -> bool {
        let sig = &self.headers["tollgate-signature"];
        let (t, v1) = sig
            .strip_prefix("t=")
            .and_then(|s| s.split_once(",v1="))
            .unwrap_or_else(|| panic!("malformed signature {sig}"));
        let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).unwrap();
        mac.update(format!("{t}.{}", self.body).as_bytes());
        hex::encode(mac.finalize().into_bytes()) == v1
    }
}

/// A webhook: records every request, answers the statuses given in turn, then 200.
struct Receiver {
    url: String,
    hooks: Arc<Mutex<Vec<Hook>>>,
}

impl Receiver {
    async fn start(answers: &[u16]) -> Receiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hooks/tollgate", listener.local_addr().unwrap());
        let hooks = Arc::new(Mutex::new(Vec::new()));
        let answers = Arc::new(Mutex::new(answers.iter().copied().collect::<VecDeque<_>>()));
        let (h, a) = (Arc::clone(&hooks), Arc::clone(&answers));
        tokio::spawn(async move {
            loop {
                let Ok((mut conn, _)) = listener.accept().await else {
                    return;
                };
                let (h, a) = (Arc::clone(&h), Arc::clone(&a));
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    let (head_end, length) = loop {
                        let n = conn.read(&mut chunk).await.unwrap_or(0);
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            let head = String::from_utf8_lossy(&buf[..at]).to_lowercase();
                            let length = head
                                .lines()
                                .find_map(|l| l.strip_prefix("content-length:"))
                                .map_or(0, |v| v.trim().parse::<usize>().unwrap());
                            break (at + 4, length);
                        }
                    };
                    while buf.len() < head_end + length {
                        let n = conn.read(&mut chunk).await.unwrap_or(0);
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                    }
                    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
                    let headers = head
                        .lines()
                        .skip(1)
                        .filter_map(|l| l.split_once(':'))
                        .map(|(k, v)| (k.trim().to_lowercase(), v.trim().to_string()))
                        .collect();
                    let body =
                        String::from_utf8_lossy(&buf[head_end..head_end + length]).into_owned();
                    h.lock().unwrap().push(Hook { headers, body });
                    let status = a.lock().unwrap().pop_front().unwrap_or(200);
                    let _ = conn
                        .write_all(
                            format!(
                                "HTTP/1.1 {status} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                            )
                            .as_bytes(),
                        )
                        .await;
                    let _ = conn.shutdown().await;
                });
            }
        });
        Receiver { url, hooks }
    }

    fn hooks(&self) -> Vec<Hook> {
        self.hooks.lock().unwrap().clone()
    }
}

/// A gateway on `redis_url` with plan `metered` (a wide bucket and a daily quota of
/// `quota` warning at `warn_at`), client `acme`, route `/orders`, and `webhooks` (url,
/// secret) with `extra` lines under `[warnings]`.
fn toml(
    redis_url: &str,
    up: &Upstream,
    quota: u32,
    warn_at: &str,
    webhooks: &[(&str, &str)],
    extra: &str,
) -> String {
    let mut t = format!(
        "{}[redis]\nurl = \"{redis_url}\"\n[catalog]\nrefresh_ms = 50\ncache_file = \"\"\n\
         [[catalog.plans]]\nname = \"metered\"\nlimits = [\n  \
         {{ name = \"burst\", capacity = 100000, rate = 100000 }},\n  \
         {{ name = \"daily\", quota = {quota}, period = \"day\", warn_at = {warn_at} }},\n]\n\
         [[catalog.clients]]\nid = \"acme\"\nplan = \"metered\"\nkeys = [\"{}\"]\n\
         [warnings]\nbackoff_ms = 100\n{extra}\n",
        admin_toml(),
        key("acme"),
    );
    for (url, secret) in webhooks {
        t.push_str(&format!(
            "[[warnings.webhooks]]\nurl = \"{url}\"\nsecret = \"{secret}\"\n"
        ));
    }
    t + &route_toml("orders", "/orders", &[up.url()])
}

/// The audit entries of `action`, each as its fields.
fn audited_after(redis: &RedisServer, action: &str) -> Vec<Value> {
    audited(redis, action)
        .into_iter()
        .map(|fields| {
            let after = fields
                .iter()
                .find(|(k, _)| k == "after")
                .map(|(_, v)| v.clone())
                .unwrap();
            serde_json::from_str(&after).unwrap()
        })
        .collect()
}

#[tokio::test]
async fn a_quota_crossed_through_three_gateways_at_once_is_announced_once_a_warning_signed() {
    // Arrange: three gateways on one Redis, one webhook; a daily quota of 100 that warns
    // at 50% and 100%.
    clear_of_midnight().await;
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let hook = Receiver::start(&[]).await;
    let config = toml(
        &redis.url(),
        &up,
        100,
        "[50, 100]",
        &[(&hook.url, SECRET)],
        "",
    );
    let gateways = [
        TestGateway::spawn(settings(&config)).await,
        TestGateway::spawn(settings(&config)).await,
        TestGateway::spawn(settings(&config)).await,
    ];

    // Act: 120 requests at once, 40 through each gateway.
    let sends = gateways.iter().flat_map(|g| {
        (0..40).map(move |_| async move { g.get("/orders", Some(&key("acme"))).await.status() })
    });
    let statuses = futures_util::future::join_all(sends).await;

    // Assert: the quota held (100 admitted); each warning reached the webhook once, with
    // the count the store kept, signed with its secret; the fleet claimed each once; the
    // deliveries are audited.
    assert_eq!(statuses.iter().filter(|s| s.as_u16() == 200).count(), 100);
    eventually(Duration::from_secs(10), "both warnings arrive", || async {
        hook.hooks().len() >= 2
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let hooks = hook.hooks();
    assert_eq!(hooks.len(), 2, "{hooks:?}");
    let mut percents: Vec<u64> = hooks
        .iter()
        .map(|h| h.json()["percent"].as_u64().unwrap())
        .collect();
    percents.sort();
    assert_eq!(percents, [50, 100]);
    for h in &hooks {
        let body = h.json();
        assert!(h.signed_with(SECRET), "{h:?}");
        assert!(!h.signed_with(OTHER_SECRET));
        assert_eq!(body["type"], "quota.warning");
        assert_eq!(body["client"], "acme");
        assert_eq!(body["plan"], "metered");
        assert_eq!(body["limit"], "daily");
        assert_eq!(body["quota"], 100.0);
        let used = body["used"].as_f64().unwrap();
        assert!(used >= body["percent"].as_f64().unwrap(), "{body}");
        assert_eq!(h.headers["tollgate-event-id"], body["id"].as_str().unwrap());
        assert_eq!(h.headers["content-type"], "application/json");
    }
    let mut claimed = 0.0;
    for g in &gateways {
        claimed += g
            .sample("tollgate_quota_warnings_total{result=\"claimed\"}")
            .await;
    }
    assert_eq!(claimed, 2.0);
    let delivered = audited_after(&redis, "warning.delivered");
    assert_eq!(delivered.len(), 2, "{delivered:?}");
    assert!(delivered
        .iter()
        .all(|d| d["tries"] == 1 && d["status"] == 200));
}

#[tokio::test]
async fn a_failing_webhook_is_retried_with_back_off_and_each_webhook_has_its_own_signature() {
    // Arrange: a webhook that fails twice (503) then takes it; one that takes it at once
    // (another secret); one that refuses it (400: not retried); one that always fails
    // (500: given up after its retries).
    clear_of_midnight().await;
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let flaky = Receiver::start(&[503, 503]).await;
    let steady = Receiver::start(&[]).await;
    let refusing = Receiver::start(&[400, 400, 400]).await;
    let down = Receiver::start(&[500; 10]).await;
    let gw = TestGateway::spawn(settings(&toml(
        &redis.url(),
        &up,
        10,
        "[100]",
        &[
            (&flaky.url, SECRET),
            (&steady.url, OTHER_SECRET),
            (&refusing.url, SECRET),
            (&down.url, SECRET),
        ],
        "retries = 3",
    )))
    .await;

    // Act: the quota used up.
    for _ in 0..10 {
        assert_eq!(gw.get("/orders", Some(&key("acme"))).await.status(), 200);
    }

    // Assert: flaky got the same warning three times, each signed; steady once, with its
    // own secret; refusing once; down four times (the first and 3 retries), then given up.
    eventually(Duration::from_secs(15), "every delivery ends", || async {
        audited(&redis, "warning.delivered").len() + audited(&redis, "warning.failed").len() == 4
    })
    .await;
    let tries = flaky.hooks();
    assert_eq!(tries.len(), 3);
    assert!(tries.iter().all(|h| h.signed_with(SECRET)));
    assert!(tries.iter().all(|h| h.body == tries[0].body));
    let once = steady.hooks();
    assert_eq!(once.len(), 1);
    assert!(once[0].signed_with(OTHER_SECRET) && !once[0].signed_with(SECRET));
    assert_eq!(
        once[0].body, tries[0].body,
        "one warning, one body for every webhook"
    );
    assert_eq!(refusing.hooks().len(), 1);
    assert_eq!(down.hooks().len(), 4);
    let delivered = audited_after(&redis, "warning.delivered");
    let mut tried: Vec<u64> = delivered
        .iter()
        .map(|d| d["tries"].as_u64().unwrap())
        .collect();
    tried.sort();
    assert_eq!(tried, [1, 3], "{delivered:?}");
    let failed = audited_after(&redis, "warning.failed");
    let mut ends: Vec<(u64, Value)> = failed
        .iter()
        .map(|d| (d["tries"].as_u64().unwrap(), d["status"].clone()))
        .collect();
    ends.sort_by_key(|e| e.0);
    assert_eq!(ends, [(1, json!(400)), (4, json!(500))], "{failed:?}");
    assert!(failed
        .iter()
        .all(|d| d["url"].as_str().unwrap().ends_with("/hooks/tollgate")));
    assert_eq!(
        gw.sample("tollgate_quota_warning_deliveries_total{result=\"delivered\"}")
            .await,
        2.0
    );
    assert_eq!(
        gw.sample("tollgate_quota_warning_deliveries_total{result=\"failed\"}")
            .await,
        2.0
    );
    assert_eq!(gw.sample("tollgate_quota_warning_retries_total").await, 5.0);
}

#[tokio::test]
async fn warn_at_is_a_quotas_and_is_checked() {
    // Arrange
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = TestGateway::spawn(settings(&toml(&redis.url(), &up, 10, "[80]", &[], ""))).await;
    let rw = admin_token("ops", "admin:read admin:write");
    let put = |limits: Value| {
        let gw = &gw;
        let rw = rw.clone();
        async move {
            gw.send_admin(
                Method::PUT,
                "/plans/p",
                &rw,
                Some(json!({ "limits": limits })),
            )
            .await
        }
    };

    // Act
    let on_bucket = put(json!([{"name": "b", "capacity": 1, "rate": 1, "warn_at": [80]}])).await;
    let out_of_range = put(json!([
        {"name": "b", "capacity": 1, "rate": 1},
        {"name": "q", "quota": 10, "period": "day", "warn_at": [0, 101]}
    ]))
    .await;
    let twice = put(json!([
        {"name": "b", "capacity": 1, "rate": 1},
        {"name": "q", "quota": 10, "period": "day", "warn_at": [80, 80]}
    ]))
    .await;
    let ok = put(json!([
        {"name": "b", "capacity": 1, "rate": 1},
        {"name": "q", "quota": 10, "period": "day", "warn_at": [100, 80]}
    ]))
    .await;

    // Assert: refused, each naming the field; kept sorted when good.
    assert_eq!(problem_fields(on_bucket).await, ["limits[0].warn_at"]);
    assert_eq!(problem_fields(out_of_range).await, ["limits[1].warn_at"]);
    assert_eq!(problem_fields(twice).await, ["limits[1].warn_at"]);
    assert_eq!(ok.status(), 201);
    let plan: Value = ok.json().await.unwrap();
    assert_eq!(plan["limits"][1]["warn_at"], json!([80, 100]));
}

/// A webhook that takes connections and never answers: how many it holds open.
async fn hanging_webhook() -> (String, Arc<std::sync::atomic::AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hooks", listener.local_addr().unwrap());
    let open = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = Arc::clone(&open);
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = listener.accept().await {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            held.push(conn);
        }
    });
    (url, open)
}

#[tokio::test]
async fn a_webhook_that_hangs_holds_at_most_sixteen_tries_however_many_warnings_are_due() {
    // Arrange: 40 clients on a quota of 1 that warns at 100%: each one's first request is
    // a warning; the webhook never answers.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let (url, open) = hanging_webhook().await;
    let mut config = format!(
        "{}[redis]\nurl = \"{}\"\n[catalog]\nrefresh_ms = 50\ncache_file = \"\"\n\
         [[catalog.plans]]\nname = \"one\"\nlimits = [\n  \
         {{ name = \"burst\", capacity = 1000, rate = 1000 }},\n  \
         {{ name = \"daily\", quota = 1, period = \"day\", warn_at = [100] }},\n]\n",
        admin_toml(),
        redis.url(),
    );
    for i in 0..40 {
        config.push_str(&format!(
            "[[catalog.clients]]\nid = \"c{i}\"\nplan = \"one\"\nkeys = [\"{}\"]\n",
            key(&format!("c{i}"))
        ));
    }
    config.push_str(&format!(
        "[warnings]\ntimeout_ms = 60000\n[[warnings.webhooks]]\nurl = \"{url}\"\nsecret = \"{SECRET}\"\n"
    ));
    config.push_str(&route_toml("orders", "/orders", &[up.url()]));
    let gw = TestGateway::spawn(settings(&config)).await;

    // Act
    for i in 0..40 {
        let r = gw.get("/orders", Some(&key(&format!("c{i}")))).await;
        assert_eq!(r.status(), 200);
    }

    // Assert: 40 warnings claimed, 16 connections held open, no more.
    eventually(Duration::from_secs(10), "every warning claimed", || async {
        gw.sample("tollgate_quota_warnings_total{result=\"claimed\"}")
            .await
            == 40.0
    })
    .await;
    eventually(
        Duration::from_secs(5),
        "the webhook's tries in flight",
        || async { open.load(std::sync::atomic::Ordering::SeqCst) >= 16 },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(open.load(std::sync::atomic::Ordering::SeqCst), 16);
}
