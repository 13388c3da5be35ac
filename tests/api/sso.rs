//! Single sign-on for the admin API: tokens from identity providers the test runs (a JWKS
//! and a discovery document served over HTTP from a thread), verified against keys that
//! rotate during the test, with roles from a claim, several issuers, a flood of made-up key
//! ids, and a provider that goes down.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use jsonwebtoken::jwk::{Jwk, JwkSet};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use reqwest::Method;
use serde_json::json;

use crate::helpers::*;

/// An identity provider: JWKS documents by path, a discovery document naming `/jwks`, the
/// reads of each path counted, and a switch that makes it drop every connection.
struct Provider {
    base: String,
    documents: Arc<Mutex<HashMap<String, String>>>,
    reads: Arc<Mutex<HashMap<String, usize>>>,
    down: Arc<AtomicBool>,
    /// Connections are taken and never answered.
    hung: Arc<AtomicBool>,
    served: Arc<AtomicUsize>,
}

impl Provider {
    fn start() -> Provider {
        Provider::serve(None)
    }

    /// Over TLS (`https://`), presenting `cert`.
    fn start_tls(cert: &SelfSigned) -> Provider {
        Provider::serve(Some(Arc::new(tls_server_config(
            &cert.cert_pem,
            &cert.key_pem,
        ))))
    }

    fn serve(tls: Option<Arc<rustls::ServerConfig>>) -> Provider {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let scheme = if tls.is_some() { "https" } else { "http" };
        let base = format!("{scheme}://{}", listener.local_addr().unwrap());
        let documents = Arc::new(Mutex::new(HashMap::new()));
        documents.lock().unwrap().insert(
            "/.well-known/openid-configuration".to_string(),
            json!({"issuer": base, "jwks_uri": format!("{base}/jwks")}).to_string(),
        );
        let reads = Arc::new(Mutex::new(HashMap::new()));
        let down = Arc::new(AtomicBool::new(false));
        let hung = Arc::new(AtomicBool::new(false));
        let served = Arc::new(AtomicUsize::new(0));
        let (docs, counted, off, silent, n) = (
            Arc::clone(&documents),
            Arc::clone(&reads),
            Arc::clone(&down),
            Arc::clone(&hung),
            Arc::clone(&served),
        );
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                if off.load(Ordering::SeqCst) {
                    continue; // dropped: the connection closes unanswered
                }
                if silent.load(Ordering::SeqCst) {
                    held.push(stream); // kept open, never answered
                    continue;
                }
                let answer = |path: &str| {
                    *counted.lock().unwrap().entry(path.to_string()).or_insert(0) += 1;
                    n.fetch_add(1, Ordering::SeqCst);
                    match docs.lock().unwrap().get(path) {
                        Some(b) => ("200 OK", b.clone()),
                        None => ("404 Not Found", "{}".to_string()),
                    }
                };
                match &tls {
                    Some(config) => {
                        let Ok(conn) = rustls::ServerConnection::new(Arc::clone(config)) else {
                            continue;
                        };
                        exchange(rustls::StreamOwned::new(conn, stream), answer);
                    }
                    None => exchange(stream, answer),
                }
            }
        });
        Provider {
            base,
            documents,
            reads,
            down,
            hung,
            served,
        }
    }

    /// Serves these keys at `path`.
    fn publish(&self, path: &str, keys: &[&Key]) {
        let set = JwkSet {
            keys: keys.iter().map(|k| k.jwk.clone()).collect(),
        };
        self.documents
            .lock()
            .unwrap()
            .insert(path.to_string(), serde_json::to_string(&set).unwrap());
    }

    fn reads(&self, path: &str) -> usize {
        self.reads.lock().unwrap().get(path).copied().unwrap_or(0)
    }
}

/// Reads one request's head from `stream` and writes the answer `answer` gives its path.
fn exchange<S: Read + Write>(mut stream: S, answer: impl Fn(&str) -> (&'static str, String)) {
    let mut reader = BufReader::new(&mut stream);
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return;
    }
    let mut header = String::new();
    while reader.read_line(&mut header).is_ok_and(|n| n > 2) {
        header.clear();
    }
    drop(reader);
    let (status, body) = answer(line.split(' ').nth(1).unwrap_or("/"));
    let _ = write!(
        stream,
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.flush();
}

/// A signing key of a provider: RSA, with its key id.
struct Key {
    kid: String,
    encoding: EncodingKey,
    jwk: Jwk,
}

impl Key {
    fn new(kid: &str) -> Key {
        let dir = tempfile::tempdir().unwrap();
        let (private, public) = (dir.path().join("key.pem"), dir.path().join("pub.pem"));
        key_pair(
            &["-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048"],
            &private,
            &public,
        );
        let encoding = EncodingKey::from_rsa_pem(&std::fs::read(&private).unwrap()).unwrap();
        let mut jwk = Jwk::from_encoding_key(&encoding, Algorithm::RS256).unwrap();
        jwk.common.key_id = Some(kid.to_string());
        Key {
            kid: kid.to_string(),
            encoding,
            jwk,
        }
    }

    /// A token of `iss` for `sub` with these groups, signed with this key under `kid`.
    fn token(&self, iss: &str, sub: &str, groups: &[&str], kid: &str) -> String {
        let exp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
            + 600;
        let mut header = Header::new(Algorithm::RS256);
        header.kid = Some(kid.to_string());
        let claims =
            json!({"iss": iss, "sub": sub, "aud": "tollgate-admin", "exp": exp, "groups": groups});
        jsonwebtoken::encode(&header, &claims, &self.encoding).unwrap()
    }

    fn signed(&self, iss: &str, sub: &str, groups: &[&str]) -> String {
        self.token(iss, sub, groups, &self.kid)
    }
}

/// A gateway taking tokens from `provider` (found through its discovery document) and from
/// issuer `ops-idp` (its JWKS at `/jwks2`), with roles from `groups`.
async fn gateway(provider: &Provider, refetch_ms: u64) -> TestGateway {
    gateway_with(provider, refetch_ms, "").await
}

/// [`gateway`], with `extra` in the first issuer's table.
async fn gateway_with(provider: &Provider, refetch_ms: u64, extra: &str) -> TestGateway {
    let roles = r#"roles = { "tg-admins" = "admin:read admin:write", "tg-viewers" = "admin:read", "tg-keys" = "admin:keys" }"#;
    TestGateway::spawn(settings(&format!(
        "{}jwks_refetch_ms = {refetch_ms}\n\
         [[admin.issuers]]\nissuer = \"{base}\"\nroles_claim = \"groups\"\n{roles}\n{extra}\n\
         [[admin.issuers]]\nissuer = \"ops-idp\"\njwks_url = \"{base}/jwks2\"\nroles_claim = \"groups\"\n{roles}\n",
        admin_toml(),
        base = provider.base,
    )))
    .await
}

async fn status(gw: &TestGateway, method: Method, path: &str, token: &str) -> u16 {
    let mut req = gw.admin(method.clone(), path, token);
    if method == Method::PUT {
        req = req.json(&json!({"capacity": 10, "rate": 1}));
    }
    req.send().await.unwrap().status().as_u16()
}

#[tokio::test]
async fn tokens_of_rotated_keys_are_taken_without_a_restart_and_roles_give_the_scopes() {
    // Arrange: two providers' keys; the gateway reads them at start.
    let provider = Provider::start();
    let (a, b, d) = (Key::new("a"), Key::new("b"), Key::new("d"));
    provider.publish("/jwks", &[&a]);
    provider.publish("/jwks2", &[&d]);
    let gw = gateway(&provider, 200).await;
    let iss = provider.base.clone();

    // Assert: roles give the scopes: a viewer reads and may not write; an admin writes.
    let viewer = a.signed(&iss, "vera", &["tg-viewers"]);
    let admin = a.signed(&iss, "ada", &["staff", "tg-admins"]);
    assert_eq!(status(&gw, Method::GET, "/plans", &viewer).await, 200);
    assert_eq!(status(&gw, Method::PUT, "/plans/sso", &viewer).await, 403);
    assert_eq!(status(&gw, Method::PUT, "/plans/sso", &admin).await, 201);
    let nobody = a.signed(&iss, "nora", &["staff"]);
    assert_eq!(status(&gw, Method::GET, "/plans", &nobody).await, 403);
    // A key issuer makes and revokes a client's keys, and writes nothing else.
    let r = gw
        .send_admin(
            Method::PUT,
            "/clients/acme",
            &admin,
            Some(json!({"plan": "sso"})),
        )
        .await;
    assert_eq!(r.status(), 201);
    let keys = a.signed(&iss, "kim", &["tg-keys"]);
    let made = gw
        .send_admin(Method::POST, "/clients/acme/keys", &keys, None)
        .await;
    assert_eq!(made.status(), 201);
    let key_id = made.json::<serde_json::Value>().await.unwrap()["key_id"]
        .as_str()
        .unwrap()
        .to_string();
    let revoke = format!("/clients/acme/keys/{key_id}");
    assert_eq!(status(&gw, Method::DELETE, &revoke, &keys).await, 204);
    assert_eq!(status(&gw, Method::PUT, "/plans/sso", &keys).await, 403);
    assert_eq!(
        status(&gw, Method::DELETE, "/clients/acme", &keys).await,
        403
    );
    assert_eq!(status(&gw, Method::GET, "/clients/acme", &keys).await, 403);
    assert_eq!(
        status(&gw, Method::POST, "/clients/acme/k%65ys", &keys).await,
        403
    );
    // The audit log names the provider's subjects.
    let audit: serde_json::Value = gw
        .send_admin(Method::GET, "/audit?limit=10", &admin, None)
        .await
        .json()
        .await
        .unwrap();
    let by: Vec<(&str, &str)> = audit["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["action"].as_str().unwrap(), e["actor"].as_str().unwrap()))
        .collect();
    for done in [
        ("plan.put", "ada"),
        ("key.create", "kim"),
        ("key.revoke", "kim"),
    ] {
        assert!(by.contains(&done), "{done:?} not in {by:?}");
    }

    // The second issuer, found by its jwks_url; its key does not sign for the first.
    let ops = d.signed("ops-idp", "otto", &["tg-admins"]);
    assert_eq!(status(&gw, Method::PUT, "/plans/ops", &ops).await, 201);
    let crossed = d.token(&iss, "mallory", &["tg-admins"], "a");
    assert_eq!(status(&gw, Method::GET, "/plans", &crossed).await, 401);

    // Act: the provider rotates to key b (a withdrawn).
    provider.publish("/jwks", &[&b]);
    let rotated = b.signed(&iss, "ada", &["tg-admins"]);

    // Assert: a token of the new key is taken within seconds, with no restart.
    eventually(
        Duration::from_secs(5),
        "the rotated key is taken",
        || async { status(&gw, Method::GET, "/plans", &rotated).await == 200 },
    )
    .await;
    // A token naming the new key id, signed by another key, or with no signature to check.
    let forged = a.token(&iss, "mallory", &["tg-admins"], "b");
    assert_eq!(status(&gw, Method::GET, "/plans", &forged).await, 401);
    let mut header = Header::new(Algorithm::HS256);
    header.kid = Some("b".into());
    let hs = jsonwebtoken::encode(
        &header,
        &json!({"iss": iss, "sub": "mallory", "aud": "tollgate-admin", "exp": 4_000_000_000u64, "groups": ["tg-admins"]}),
        &EncodingKey::from_secret(b"a secret anyone can pick, 32 bytes at least"),
    )
    .unwrap();
    assert_eq!(status(&gw, Method::GET, "/plans", &hs).await, 401);
    // A token naming no key id is checked with the issuer's only key.
    let mut header = Header::new(Algorithm::RS256);
    header.kid = None;
    let exp = 4_000_000_000u64;
    let claims = json!({"iss": iss, "sub": "ada", "aud": "tollgate-admin", "exp": exp, "groups": ["tg-viewers"]});
    let no_kid = jsonwebtoken::encode(&header, &claims, &b.encoding).unwrap();
    assert_eq!(status(&gw, Method::GET, "/plans", &no_kid).await, 200);
    let no_kid_forged = jsonwebtoken::encode(&header, &claims, &a.encoding).unwrap();
    assert_eq!(
        status(&gw, Method::GET, "/plans", &no_kid_forged).await,
        401
    );
    // The configured static key still works beside the providers.
    let local = admin_token("ops", "admin:read");
    assert_eq!(status(&gw, Method::GET, "/plans", &local).await, 200);
}

#[tokio::test]
async fn a_flood_of_made_up_key_ids_reads_the_jwks_at_most_once_per_interval() {
    // Arrange: a refetch interval of 10 s (the default), the keys read at start.
    let provider = Provider::start();
    let a = Key::new("a");
    provider.publish("/jwks", &[&a]);
    let gw = gateway(&provider, 10_000).await;
    let iss = provider.base.clone();
    let good = a.signed(&iss, "ada", &["tg-viewers"]);
    assert_eq!(status(&gw, Method::GET, "/plans", &good).await, 200);
    let before = provider.reads("/jwks");

    // Act: 200 tokens, each naming a key id of its own.
    let began = Instant::now();
    let mut refused = 0;
    for i in 0..200 {
        let t = a.token(&iss, "mallory", &["tg-admins"], &format!("made-up-{i}"));
        refused += usize::from(status(&gw, Method::GET, "/plans", &t).await == 401);
    }

    // Assert: every one refused, for one read of the JWKS at most in each 10 s (one, on
    // a host that sends them within 10 s).
    assert_eq!(refused, 200);
    let reads = provider.reads("/jwks") - before;
    let intervals = 1 + began.elapsed().as_secs() as usize / 10;
    assert!(
        reads <= intervals,
        "{reads} reads of the JWKS for 200 made-up key ids in {:?}",
        began.elapsed()
    );
}

#[tokio::test]
async fn a_provider_that_is_down_locks_out_no_token_whose_key_is_held() {
    // Arrange: the keys read at start.
    let provider = Provider::start();
    let a = Key::new("a");
    provider.publish("/jwks", &[&a]);
    let gw = gateway(&provider, 100).await;
    let iss = provider.base.clone();
    let good = a.signed(&iss, "ada", &["tg-admins"]);
    assert_eq!(status(&gw, Method::GET, "/plans", &good).await, 200);

    // Act: the provider stops answering; a token with an unknown key id makes the gateway
    // try it (and fail) more than once.
    provider.down.store(true, Ordering::SeqCst);
    // A read the provider took before it went down (the start's, or a refetch racing it)
    // may still be answering: counted before the count is read.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let served = provider.served.load(Ordering::SeqCst);
    for i in 0..3 {
        let t = a.token(&iss, "mallory", &["tg-admins"], &format!("new-{i}"));
        assert_eq!(status(&gw, Method::GET, "/plans", &t).await, 401);
        tokio::time::sleep(Duration::from_millis(150)).await;
    }

    // Assert: the held key still admits its tokens, and nothing was served meanwhile.
    assert_eq!(status(&gw, Method::GET, "/plans", &good).await, 200);
    assert_eq!(status(&gw, Method::PUT, "/plans/still", &good).await, 201);
    assert_eq!(provider.served.load(Ordering::SeqCst), served);
    // The metrics show it: reads failing, the key still held.
    let series = |name: &str, rest: &str| format!("{name}{{issuer=\"{iss}\"{rest}}}");
    let failed = gw
        .sample(&series(
            "tollgate_admin_jwks_reads_total",
            ",result=\"failed\"",
        ))
        .await;
    assert!(failed >= 2.0, "{failed} failed reads");
    assert!(
        gw.sample(&series("tollgate_admin_jwks_reads_total", ",result=\"ok\""))
            .await
            >= 1.0
    );
    assert_eq!(
        gw.sample(&series("tollgate_admin_jwks_keys", "")).await,
        1.0
    );
}

#[tokio::test]
async fn a_provider_behind_a_private_ca_is_read_over_tls_when_its_ca_file_is_trusted() {
    // Arrange: a provider over https with a self-signed certificate.
    let cert = SelfSigned::generate();
    let provider = Provider::start_tls(&cert);
    let a = Key::new("a");
    provider.publish("/jwks", &[&a]);
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, &cert.cert_pem).unwrap();
    let iss = provider.base.clone();
    let token = a.signed(&iss, "ada", &["tg-viewers"]);

    // Act: one gateway trusting the certificate, one with the public roots alone.
    let trusting = gateway_with(
        &provider,
        100,
        &format!("ca_file = {:?}", ca.to_str().unwrap()),
    )
    .await;
    let public_only = gateway(&provider, 100).await;

    // Assert: the certificate is verified: only the gateway that trusts it reads the keys.
    assert_eq!(status(&trusting, Method::GET, "/plans", &token).await, 200);
    assert_eq!(
        status(&public_only, Method::GET, "/plans", &token).await,
        401
    );
    assert!(provider.reads("/jwks") >= 1);

    // And an https issuer whose discovery document names keys over plain http (served
    // there) is not followed there.
    let plain = Provider::start();
    plain.publish("/jwks", &[&a]);
    provider.documents.lock().unwrap().insert(
        "/.well-known/openid-configuration".to_string(),
        json!({"issuer": iss, "jwks_uri": format!("{}/jwks", plain.base)}).to_string(),
    );
    let ca_file = format!("ca_file = {:?}", ca.to_str().unwrap());
    let downgraded = gateway_with(&provider, 100, &ca_file).await;
    assert_eq!(
        status(&downgraded, Method::GET, "/plans", &token).await,
        401
    );
}

#[tokio::test]
async fn a_provider_that_hangs_delays_only_tokens_of_unknown_key_ids_and_no_longer_than_the_read_timeout(
) {
    // Arrange: the keys read at start; then the provider takes connections and never
    // answers.
    let provider = Provider::start();
    let a = Key::new("a");
    provider.publish("/jwks", &[&a]);
    let gw = gateway(&provider, 100).await;
    let iss = provider.base.clone();
    let good = a.signed(&iss, "ada", &["tg-viewers"]);
    assert_eq!(status(&gw, Method::GET, "/plans", &good).await, 200);
    provider.hung.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(150)).await; // past the refetch interval

    // Act: a token naming a new key id, and beside it one of the key held.
    let unknown = a.token(&iss, "mallory", &["tg-admins"], "new");
    let began = Instant::now();
    let waiting = status(&gw, Method::GET, "/plans", &unknown);
    let beside = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let at = Instant::now();
        (
            status(&gw, Method::GET, "/plans", &good).await,
            at.elapsed(),
        )
    };
    let (refused, (admitted, beside_took)) = tokio::join!(waiting, beside);

    // Assert: the unknown key id is refused once the read's 5 s are up, not later; the
    // held key is answered meanwhile without waiting for it.
    let took = began.elapsed();
    assert_eq!(refused, 401);
    assert!(
        took >= Duration::from_secs(4) && took < Duration::from_secs(8),
        "{took:?}"
    );
    assert_eq!(admitted, 200);
    assert!(beside_took < Duration::from_secs(2), "{beside_took:?}");
}
