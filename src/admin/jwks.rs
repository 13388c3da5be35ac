//! Admin tokens from identity providers (`[[admin.issuers]]`): each issuer's signing keys,
//! read from its JWKS (its `jwks_url`, or the `jwks_uri` of its OpenID Connect discovery
//! document), at start, every `admin.jwks_refresh_ms`, and when a token names a key id
//! the keys held lack, at most once per `admin.jwks_refetch_ms` (so a flood of tokens with
//! made-up `kid`s costs the provider one read per interval). A read that fails keeps the
//! keys held: a provider that is down locks no one out whose key is known.
//!
//! A token is verified with the algorithms its issuer's configuration names (never the
//! token's choice, and never a symmetric one: a JWKS is public), against the `iss`,
//! `aud`, `exp` and `nbf` rules of the static key; its roles (`roles_claim`) give the admin
//! scopes through the issuer's `roles` table, beside the scopes of its `scope` claim.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use jsonwebtoken::jwk::{AlgorithmParameters, JwkSet};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde_json::Value;

use crate::configuration::IssuerSettings;
use crate::error::ApiError;
use crate::metrics::{Exposition, Kind};

/// How long one read of a JWKS or a discovery document may take.
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);
/// The largest JWKS or discovery document read.
const FETCH_MAX_BYTES: usize = 1 << 20;

/// A client for a provider's documents: hyper over rustls (ring), Mozilla's roots and the
/// issuer's `ca_file`.
#[derive(Clone)]
pub struct Fetcher {
    client: Client<HttpsConnector<HttpConnector>, Empty<bytes::Bytes>>,
}

impl Fetcher {
    /// Trusting the public roots and the certificates of `ca_file` (`key`, for errors).
    pub fn new(ca_file: Option<&std::path::Path>, key: &str) -> anyhow::Result<Fetcher> {
        Ok(Fetcher {
            client: crate::tls::https_client(ca_file, key)?,
        })
    }

    /// `GET url` as JSON, within [`FETCH_TIMEOUT`] and [`FETCH_MAX_BYTES`].
    async fn json(&self, url: &str) -> anyhow::Result<Value> {
        let read = async {
            let uri: http::Uri = url.parse()?;
            let response = self.client.get(uri).await?;
            anyhow::ensure!(
                response.status().is_success(),
                "{url} answered {}",
                response.status()
            );
            let body = Limited::new(response.into_body(), FETCH_MAX_BYTES)
                .collect()
                .await
                .map_err(|e| anyhow::anyhow!("{url}: {e}"))?
                .to_bytes();
            Ok(serde_json::from_slice(&body)?)
        };
        tokio::time::timeout(FETCH_TIMEOUT, read)
            .await
            .map_err(|_| anyhow::anyhow!("{url} did not answer within {FETCH_TIMEOUT:?}"))?
    }
}

/// One identity provider: its configuration, and the keys last read from its JWKS.
pub struct Issuer {
    settings: IssuerSettings,
    validation: Validation,
    /// Key id → key; a key without an id under `""`.
    keys: ArcSwap<HashMap<String, DecodingKey>>,
    /// When its JWKS was last read (or tried), for the refetch interval.
    read_at: parking_lot::Mutex<Option<Instant>>,
    /// One read at a time.
    reading: tokio::sync::Mutex<()>,
    refetch: Duration,
    fetcher: Fetcher,
    /// Reads of its JWKS that put keys in place, and that failed.
    reads_ok: AtomicU64,
    reads_failed: AtomicU64,
    /// When a read last put keys in place (unix seconds; 0: never).
    read_ok_at_s: AtomicU64,
}

impl Issuer {
    pub fn new(settings: IssuerSettings, refetch: Duration, fetcher: Fetcher) -> Issuer {
        let validation = validation(&settings.algorithms, &settings.issuer, &settings.audience);
        Issuer {
            settings,
            validation,
            keys: ArcSwap::from_pointee(HashMap::new()),
            read_at: parking_lot::Mutex::new(None),
            reading: tokio::sync::Mutex::new(()),
            refetch,
            fetcher,
            reads_ok: AtomicU64::new(0),
            reads_failed: AtomicU64::new(0),
            read_ok_at_s: AtomicU64::new(0),
        }
    }

    /// The `iss` its tokens carry.
    pub fn name(&self) -> &str {
        &self.settings.issuer
    }

    /// Reads its JWKS now and puts its keys in place; on failure the keys held stay.
    pub async fn read_keys(&self) -> anyhow::Result<usize> {
        let _one = self.reading.lock().await;
        self.read_locked().await
    }

    /// [`Self::read_keys`], `reading` held.
    async fn read_locked(&self) -> anyhow::Result<usize> {
        let read = self.read_now().await;
        match &read {
            Ok(_) => {
                self.reads_ok.fetch_add(1, Ordering::Relaxed);
                self.read_ok_at_s.store(unix_s(), Ordering::Relaxed);
            }
            Err(_) => {
                self.reads_failed.fetch_add(1, Ordering::Relaxed);
            }
        }
        read
    }

    async fn read_now(&self) -> anyhow::Result<usize> {
        *self.read_at.lock() = Some(Instant::now());
        let url = match &self.settings.jwks_url {
            Some(url) => url.clone(),
            None => {
                let discovery = format!(
                    "{}/.well-known/openid-configuration",
                    self.settings.issuer.trim_end_matches('/')
                );
                let doc = self.fetcher.json(&discovery).await?;
                let uri = doc
                    .get("jwks_uri")
                    .and_then(Value::as_str)
                    .ok_or_else(|| anyhow::anyhow!("{discovery} names no jwks_uri"))?;
                // An https issuer's keys are not read over plain http.
                anyhow::ensure!(
                    !discovery.starts_with("https://") || uri.starts_with("https://"),
                    "{discovery} names a jwks_uri that is not https: {uri}"
                );
                uri.to_string()
            }
        };
        let set: JwkSet = serde_json::from_value(self.fetcher.json(&url).await?)
            .map_err(|e| anyhow::anyhow!("{url}: not a JWKS: {e}"))?;
        let mut keys = HashMap::new();
        for jwk in &set.keys {
            // A JWKS is public: a symmetric key in it would let anyone sign.
            if matches!(jwk.algorithm, AlgorithmParameters::OctetKey(_)) {
                continue;
            }
            if let Ok(key) = DecodingKey::from_jwk(jwk) {
                keys.insert(jwk.common.key_id.clone().unwrap_or_default(), key);
            }
        }
        anyhow::ensure!(!keys.is_empty(), "{url}: no usable public key");
        let n = keys.len();
        self.keys.store(Arc::new(keys));
        Ok(n)
    }

    /// Reads its JWKS again for a key id not held, unless it was read within the refetch
    /// interval (then the keys held answer).
    async fn read_for(&self, kid: &str) {
        // After a read in flight (at start, or for another token), which may bring it.
        let _one = self.reading.lock().await;
        let due = self
            .read_at
            .lock()
            .is_none_or(|at| at.elapsed() >= self.refetch);
        if !due || key_for(&self.keys.load(), kid).is_some() {
            return;
        }
        match self.read_locked().await {
            Ok(n) => {
                tracing::info!(issuer = %self.name(), kid = ?kid, keys = n, "JWKS read again for a key id not held")
            }
            Err(e) => {
                tracing::warn!(issuer = %self.name(), error = %e, "the JWKS could not be read; the keys held stay")
            }
        }
    }

    /// Verifies `token` (whose `iss` is this issuer's) and returns who it is and the
    /// scopes its roles and `scope` claim give.
    pub async fn verify(&self, token: &str, kid: Option<&str>) -> Result<Principal, ApiError> {
        let kid = kid.unwrap_or_default();
        if key_for(&self.keys.load(), kid).is_none() {
            self.read_for(kid).await;
        }
        let keys = self.keys.load();
        let key = key_for(&keys, kid).ok_or_else(|| {
            ApiError::InvalidToken(format!(
                "invalid token: issuer {} has no key {kid:?}",
                self.name()
            ))
        })?;
        let claims =
            jsonwebtoken::decode::<serde_json::Map<String, Value>>(token, key, &self.validation)
                .map_err(|e| ApiError::InvalidToken(format!("invalid token: {e}")))?
                .claims;
        let sub = claims
            .get("sub")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let mut scopes: HashSet<String> = claims
            .get("scope")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .split_whitespace()
            .map(str::to_string)
            .collect();
        if let Some(path) = &self.settings.roles_claim {
            for role in roles(&claims, path) {
                scopes.extend(
                    self.settings
                        .roles
                        .get(&role)
                        .into_iter()
                        .flatten()
                        .cloned(),
                );
            }
        }
        Ok(Principal { sub, scopes })
    }
}

/// The key a token naming key id `kid` (`""`: none) is checked with: the one of that id;
/// for a token naming none, the key without an id, or the issuer's only key.
fn key_for<'k>(keys: &'k HashMap<String, DecodingKey>, kid: &str) -> Option<&'k DecodingKey> {
    keys.get(kid).or_else(|| {
        let only = (kid.is_empty() && keys.len() == 1).then(|| keys.values().next());
        only.flatten()
    })
}

/// The rules every admin token is checked by, the static key's and each issuer's: one of
/// `algorithms` (never the token's choice), `iss` and `aud` as given, `exp` and `sub`
/// required, `nbf` checked when present, 30 s of leeway.
pub fn validation(algorithms: &[Algorithm], iss: &str, aud: &str) -> Validation {
    let mut v = Validation::new(algorithms[0]);
    v.algorithms = algorithms.to_vec();
    v.set_issuer(&[iss]);
    v.set_audience(&[aud]);
    v.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
    v.validate_nbf = true;
    v.leeway = 30;
    v
}

/// Who an admin token names, and what it may do.
#[derive(Debug, Clone)]
pub struct Principal {
    pub sub: String,
    pub scopes: HashSet<String>,
}

/// The roles at `path` (dotted, into nested objects) of `claims`: an array of strings, or
/// a space-separated string.
fn roles(claims: &serde_json::Map<String, Value>, path: &str) -> Vec<String> {
    let mut parts = path.split('.');
    let first = parts.next().unwrap_or_default();
    let mut at = claims.get(first);
    for part in parts {
        at = at.and_then(|v| v.get(part));
    }
    match at {
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(Value::as_str)
            .map(str::to_string)
            .collect(),
        Some(Value::String(s)) => s.split_whitespace().map(str::to_string).collect(),
        _ => Vec::new(),
    }
}

fn unix_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The configured issuers, by `iss`.
#[derive(Default)]
pub struct Issuers(BTreeMap<String, Arc<Issuer>>);

impl Issuers {
    pub fn new(settings: &[IssuerSettings], refetch: Duration) -> anyhow::Result<Issuers> {
        let mut issuers = BTreeMap::new();
        for (i, s) in settings.iter().enumerate() {
            let key = format!("admin.issuers[{i}].ca_file");
            let fetcher = Fetcher::new(s.ca_file.as_deref(), &key)?;
            let issuer = Issuer::new(s.clone(), refetch, fetcher);
            issuers.insert(s.issuer.clone(), Arc::new(issuer));
        }
        Ok(Issuers(issuers))
    }

    pub fn get(&self, iss: &str) -> Option<&Arc<Issuer>> {
        self.0.get(iss)
    }

    pub fn all(&self) -> impl Iterator<Item = &Arc<Issuer>> {
        self.0.values()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `tollgate_admin_jwks_*`, per issuer: reads by result, keys held, and the age of the
    /// keys (since the last read that put keys in place), for a provider that stopped
    /// answering.
    pub fn write_metrics(&self, out: &mut Exposition) {
        if self.is_empty() {
            return;
        }
        let mut reads = out.family(
            "tollgate_admin_jwks_reads_total",
            Kind::Counter,
            "Reads of each identity provider's JWKS, by result (failed: the keys held stay).",
        );
        for i in self.0.values() {
            let read = |c: &AtomicU64| c.load(Ordering::Relaxed);
            reads
                .sample(&[("issuer", i.name()), ("result", "ok")], read(&i.reads_ok))
                .sample(
                    &[("issuer", i.name()), ("result", "failed")],
                    read(&i.reads_failed),
                );
        }
        let mut keys = out.family(
            "tollgate_admin_jwks_keys",
            Kind::Gauge,
            "Public keys held for each identity provider.",
        );
        for i in self.0.values() {
            keys.sample(&[("issuer", i.name())], i.keys.load().len());
        }
        let mut age = out.family(
            "tollgate_admin_jwks_age_seconds",
            Kind::Gauge,
            "Seconds since each identity provider's keys were last read (absent: never).",
        );
        for i in self.0.values() {
            let at = i.read_ok_at_s.load(Ordering::Relaxed);
            if at > 0 {
                age.sample(&[("issuer", i.name())], unix_s().saturating_sub(at));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_are_read_from_a_dotted_path_as_an_array_or_a_string() {
        let claims: serde_json::Map<String, Value> = serde_json::from_value(serde_json::json!({
            "groups": ["ops", 7, "viewers"],
            "realm_access": {"roles": ["admins"]},
            "roles": "a b",
        }))
        .unwrap();
        assert_eq!(roles(&claims, "groups"), ["ops", "viewers"]);
        assert_eq!(roles(&claims, "realm_access.roles"), ["admins"]);
        assert_eq!(roles(&claims, "roles"), ["a", "b"]);
        assert!(roles(&claims, "realm_access.missing").is_empty());
        assert!(roles(&claims, "nothing").is_empty());
    }
}
