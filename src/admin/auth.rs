//! Admin authentication: Bearer JWTs checked with a key and algorithm fixed by
//! configuration (never taken from the token), then scopes by method.

use std::sync::Arc;
use std::time::Duration;

use actix_web::body::{BoxBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::{header, Method};
use actix_web::middleware::Next;
use actix_web::{web, HttpMessage, ResponseError};
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use secrecy::ExposeSecret;
use serde::{Deserialize, Serialize};

use super::jwks::{validation, Issuer, Issuers, Principal};
use crate::configuration::AdminSettings;
use crate::error::ApiError;
use crate::tasks::{Policy, Tasks};

pub const READ: &str = "admin:read";
pub const WRITE: &str = "admin:write";
/// Writes to a client's keys only (make, roll, revoke): for a team or a provider's role
/// that issues keys but must not change plans or clients. `admin:write` includes it.
pub const KEYS: &str = "admin:keys";

/// Claims tollgate reads from an admin token.
#[derive(Debug, Serialize, Deserialize)]
pub struct Claims {
    pub sub: String,
    pub iss: String,
    /// One audience or several (RFC 7519 4.1.3); the configured one must be among them.
    pub aud: Audience,
    pub exp: u64,
    /// Not before: checked when present (with the same 30 s leeway as `exp`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbf: Option<u64>,
    #[serde(default)]
    pub iat: u64,
    /// Space-separated scopes.
    #[serde(default)]
    pub scope: String,
}

/// The `aud` claim: a string or an array of strings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Audience {
    One(String),
    Many(Vec<String>),
}

/// Who is making an admin request (for the audit log).
#[derive(Debug, Clone)]
pub struct Actor {
    pub sub: String,
}

/// The configured verifier: the static key (`None` when none is configured) and the
/// identity providers (`[[admin.issuers]]`, see [`super::jwks`]).
pub struct JwtVerifier {
    key: Option<(DecodingKey, Validation)>,
    issuers: Issuers,
}

/// The one claim read before a token's signature is checked: which issuer's keys check it.
#[derive(Deserialize)]
struct IssuedBy {
    iss: Option<String>,
}

impl JwtVerifier {
    pub fn from_settings(s: &AdminSettings) -> anyhow::Result<JwtVerifier> {
        Ok(JwtVerifier {
            key: static_key(s)?,
            issuers: Issuers::new(&s.issuers, s.jwks_refetch)?,
        })
    }

    /// The identity providers' metrics (see [`Issuers::write_metrics`]).
    pub fn write_metrics(&self, out: &mut crate::metrics::Exposition) {
        self.issuers.write_metrics(out);
    }

    /// Starts task `admin-jwks-refresh`, which reads each issuer's JWKS at once and then
    /// every `every` (a failure is logged, and the keys held stay).
    pub fn spawn_refresh(&self, tasks: &Tasks, every: Duration) {
        let issuers: Vec<Arc<Issuer>> = self.issuers.all().cloned().collect();
        if issuers.is_empty() {
            return;
        }
        tasks.spawn("admin-jwks-refresh", Policy::Restart, move |stop| {
            let issuers = issuers.clone();
            async move {
                let reading = async {
                    let mut tick = tokio::time::interval(every);
                    loop {
                        tick.tick().await;
                        for issuer in &issuers {
                            match issuer.read_keys().await {
                                Ok(n) => tracing::debug!(issuer = %issuer.name(), keys = n, "JWKS read"),
                                Err(e) => tracing::warn!(issuer = %issuer.name(), error = %e, "the JWKS could not be read; the keys held stay"),
                            }
                        }
                    }
                };
                stop.run_until_cancelled(reading).await;
            }
        });
    }

    /// Verifies a token's signature, algorithm, issuer, audience and expiry: with the keys
    /// of the configured identity provider its `iss` names, else with the static key.
    pub async fn verify(&self, token: &str) -> Result<Principal, ApiError> {
        if !self.issuers.is_empty() {
            // Only picks whose keys check the token: its issuer's rules check `iss` again.
            let issued_by = jsonwebtoken::dangerous::insecure_decode::<IssuedBy>(token)
                .ok()
                .and_then(|d| d.claims.iss);
            if let Some(issuer) = issued_by.as_deref().and_then(|i| self.issuers.get(i)) {
                let kid = jsonwebtoken::decode_header(token)
                    .map_err(|e| ApiError::InvalidToken(format!("invalid token: {e}")))?
                    .kid;
                return issuer.verify(token, kid.as_deref()).await;
            }
        }
        let Some((key, validation)) = &self.key else {
            return Err(ApiError::InvalidToken(if self.issuers.is_empty() {
                "the admin API is disabled: set admin.jwt_hs256_secret, admin.jwt_public_key_pem or [[admin.issuers]]"
                    .into()
            } else {
                "invalid token: not from a configured issuer".into()
            }));
        };
        jsonwebtoken::decode::<Claims>(token, key, validation)
            .map(|d| Principal {
                scopes: d
                    .claims
                    .scope
                    .split_whitespace()
                    .map(str::to_string)
                    .collect(),
                sub: d.claims.sub,
            })
            .map_err(|e| ApiError::InvalidToken(format!("invalid token: {e}")))
    }
}

/// The configured key (`admin.jwt_public_key_pem`, else `admin.jwt_hs256_secret`) and its
/// rules; `None` when neither is set.
fn static_key(s: &AdminSettings) -> anyhow::Result<Option<(DecodingKey, Validation)>> {
    let (key, alg) = if let Some(path) = &s.jwt_public_key_pem {
        let pem =
            std::fs::read(path).map_err(|e| anyhow::anyhow!("admin.jwt_public_key_pem: {e}"))?;
        // The key's type decides the algorithm: RSA → RS256, EC P-256 → ES256.
        if let Ok(k) = DecodingKey::from_rsa_pem(&pem) {
            (k, Algorithm::RS256)
        } else if let Ok(k) = DecodingKey::from_ec_pem(&pem) {
            (k, Algorithm::ES256)
        } else {
            anyhow::bail!("admin.jwt_public_key_pem: not an RSA or EC public key in PEM");
        }
    } else if let Some(secret) = &s.jwt_hs256_secret {
        (
            DecodingKey::from_secret(secret.expose_secret().as_bytes()),
            Algorithm::HS256,
        )
    } else {
        return Ok(None);
    };
    let rules = validation(&[alg], &s.jwt_issuer, &s.jwt_audience);
    Ok(Some((key, rules)))
}

/// Whether `path` is one of a client's keys' resources (`/admin/v1/clients/{c}/keys`,
/// `.../keys/{k}`, `.../keys/{k}/roll`), as written: a spelling the router decodes
/// (`%6Beys`) needs `admin:write`, never less.
fn writes_keys(path: &str) -> bool {
    let segments: Vec<&str> = path.split('/').collect();
    matches!(
        segments.as_slice(),
        ["", "admin", "v1", "clients", _, "keys", ..]
    )
}

/// Middleware for `/admin/v1`: a valid token, and `admin:read` for reads or
/// `admin:write` for everything else (`admin:keys` is enough to write a client's keys).
pub async fn require_token(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<BoxBody>, actix_web::Error> {
    let verifier = req
        .app_data::<web::Data<JwtVerifier>>()
        .expect("JwtVerifier is registered")
        .clone();
    let token = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim);
    let claims = match token {
        None => Err(ApiError::InvalidToken(
            "an Authorization: Bearer <JWT> header is required".into(),
        )),
        Some(t) => verifier.verify(t).await,
    };
    let claims = match claims {
        Ok(c) => c,
        Err(e) => return Ok(req.into_response(e.error_response())),
    };
    let needed = if matches!(*req.method(), Method::GET | Method::HEAD) {
        READ
    } else {
        WRITE
    };
    let keys_only = needed == WRITE && writes_keys(req.path()) && claims.scopes.contains(KEYS);
    if !claims.scopes.contains(needed) && !keys_only {
        let e = ApiError::Forbidden(format!("this call needs the {needed} scope"));
        return Ok(req.into_response(e.error_response()));
    }
    req.extensions_mut().insert(Actor { sub: claims.sub });
    // The store down at start, back now: the declared catalog goes in before this request
    // reads or writes the store, not on the next retry tick.
    if let Some(state) = req.app_data::<web::Data<crate::state::AppState>>() {
        state.store_start.before_admin().await;
    }
    Ok(next.call(req).await?.map_into_boxed_body())
}

/// Signs a development token with the configured HS256 secret (`tollgate token`).
pub fn mint(s: &AdminSettings, sub: &str, scope: &str, ttl_s: u64) -> anyhow::Result<String> {
    let Some(secret) = &s.jwt_hs256_secret else {
        anyhow::bail!("admin.jwt_hs256_secret is not set: tokens come from your identity provider");
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    let claims = Claims {
        sub: sub.to_string(),
        iss: s.jwt_issuer.clone(),
        aud: Audience::One(s.jwt_audience.clone()),
        exp: now + ttl_s,
        nbf: None,
        iat: now,
        scope: scope.to_string(),
    };
    Ok(jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(secret.expose_secret().as_bytes()),
    )?)
}
