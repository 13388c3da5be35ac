//! The metrics reference (`docs/src/reference/metrics.md`) checked against live gateways:
//! every family their `/metrics` declares (a `# TYPE` line) is in the page's tables, and
//! every series the page lists is declared by one of them. Two gateways between them
//! expose every family: one on a healthy Redis with every optional part configured (cache
//! mode, a route, the admin API with an identity provider, a webhook, span export), and
//! the same catalog settings started again while Redis is down (serving the cache file the
//! first one wrote) behind TLS.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::helpers::*;

/// The page, from the repository's root.
const PAGE: &str = "docs/src/reference/metrics.md";

/// The families a `/metrics` text declares, with their types: its `# TYPE` lines.
fn families(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .map(|(name, kind)| (name.to_string(), kind.trim().to_string()))
        .collect()
}

/// The series the page documents, with their types: the first cell of each table row, a
/// name in backticks, and the first word of the second. A row whose first cell names a
/// `tollgate_` series any other way, or a series listed twice, fails the test: the page is
/// to list each family once, by its family name.
fn documented(page: &str) -> BTreeMap<String, String> {
    let mut names = BTreeMap::new();
    let mut problems = Vec::new();
    for (i, line) in page.lines().enumerate() {
        let Some(row) = line.trim().strip_prefix('|') else {
            continue;
        };
        let mut cells = row.split('|').map(str::trim);
        let first = cells.next().unwrap_or_default();
        let kind = cells
            .next()
            .and_then(|c| c.split_whitespace().next())
            .unwrap_or_default();
        let name = first
            .strip_prefix('`')
            .and_then(|c| c.strip_suffix('`'))
            .filter(|n| {
                n.starts_with("tollgate_")
                    && n.chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            });
        match name {
            Some(n) if names.insert(n.to_string(), kind.to_string()).is_some() => {
                problems.push(format!("line {}: {n} listed again", i + 1))
            }
            Some(_) => {}
            None if first.contains("tollgate_") => problems.push(format!(
                "line {}: not one series name in backticks: {first}",
                i + 1
            )),
            None => {}
        }
    }
    assert!(problems.is_empty(), "{PAGE}:\n{}", problems.join("\n"));
    names
}

#[tokio::test]
async fn the_metrics_reference_lists_every_family_on_metrics_and_no_other() {
    // Arrange: a gateway with every optional family's configuration, on a healthy Redis.
    let mut redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let idp = Upstream::start(Behaviour::Body("{\"keys\":[]}")).await;
    let webhook = Upstream::start(Behaviour::Echo).await;
    let collector = Collector::start().await;
    let dir = tempfile::tempdir().unwrap();
    let cache_file = dir.path().join("catalog-cache.json");
    // Cache mode (its lookups' families) and a cache file, for the second gateway to serve.
    let common = format!(
        "{}[catalog]\nmode = \"cache\"\nrefresh_ms = 50\ncache_file = {:?}\n{}{}",
        redis_toml(&redis),
        cache_file.to_string_lossy(),
        catalog_toml(("gold", 1000.0, 1000.0), &["acme"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let everything = format!(
        "{common}{}\
         [[admin.issuers]]\nissuer = \"docs-idp\"\njwks_url = \"{}/jwks\"\n\
         [[warnings.webhooks]]\nurl = \"{}/hook\"\nsecret = \"webhook-secret-0123456789-abcdefghij\"\n\
         [telemetry]\notlp_endpoint = \"{}\"\n",
        admin_toml(),
        idp.url(),
        webhook.url(),
        collector.url(),
    );
    let gw = TestGateway::spawn(settings(&everything)).await;

    // Act: a request admitted (the key looked up, then held), one with a key nobody has,
    // an admin call; then the first gateway's /metrics, once the cache file is written.
    assert_eq!(gw.get("/orders", Some(&key("acme"))).await.status(), 200);
    assert_eq!(
        gw.get("/orders", Some("key-nobody-0000")).await.status(),
        401
    );
    let plans = gw
        .admin(
            reqwest::Method::GET,
            "/plans",
            &admin_token("ops", "admin:read"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(plans.status(), 200);
    eventually(Duration::from_secs(10), "the cache file is written", || {
        let file = cache_file.clone();
        async move { file.exists() }
    })
    .await;
    let first = gw.get("/metrics", None).await.text().await.unwrap();
    gw.stop().await;

    // Act: the same catalog settings started again with Redis down, so the cache file is
    // served (its age), behind TLS (the certificates' families).
    redis.kill();
    let ca = crate::tls::Ca::new();
    let files = crate::tls::Files::write(dir.path(), "gw", &ca.leaf(&["gw.test"]));
    let outage = TestGateway::spawn(settings(&format!("{common}[tls]\n{}", files.toml()))).await;
    let second = crate::tls::metrics(crate::tls::addr_of(&outage)).await;
    outage.stop().await;

    // Assert: the page and the gateways agree, both ways.
    let mut exposed = families(&first);
    exposed.extend(families(&second));
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(PAGE);
    let page = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{PAGE}: {e}"));
    let listed = documented(&page);
    let undocumented: Vec<&String> = exposed
        .keys()
        .filter(|n| !listed.contains_key(*n))
        .collect();
    let unexposed: Vec<&String> = listed
        .keys()
        .filter(|n| !exposed.contains_key(*n))
        .collect();
    assert!(
        undocumented.is_empty() && unexposed.is_empty(),
        "on /metrics but not in {PAGE}: {undocumented:?}\n\
         in {PAGE} but on neither gateway's /metrics: {unexposed:?}"
    );
    let mistyped: Vec<String> = listed
        .iter()
        .filter(|(name, kind)| exposed[*name] != **kind)
        .map(|(name, kind)| format!("{name}: {kind} in {PAGE}, {} on /metrics", exposed[name]))
        .collect();
    assert!(
        mistyped.is_empty(),
        "types that differ:\n{}",
        mistyped.join("\n")
    );
    assert!(
        exposed.len() >= 50,
        "only {} families: {exposed:?}",
        exposed.len()
    );
}
