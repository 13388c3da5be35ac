//! `GET /admin/v1/catalog`: the whole catalog at one version, as the gateway mirrors it:
//! plans, clients with their keys' hashes (never keys), overrides and shard settings, and
//! the stored safety settings. What "the catalog as code" starts from (issue 37).

use actix_web::http::header;
use actix_web::{web, HttpResponse};
use serde::Serialize;
use utoipa::ToSchema;

use super::body::etag;
use super::clients::ShardsView;
use super::overrides::OverrideView;
use super::plans::PlanView;
use super::safety::SafetyView;
use super::shared::rfc3339;
use crate::catalog::{ClientRecord, KeyRecord};
use crate::error::ApiError;
use crate::state::AppState;

/// The whole catalog at one version.
#[derive(Serialize, ToSchema)]
pub struct CatalogExport {
    /// The catalog version it is at (also its ETag).
    #[schema(example = 42)]
    pub version: u64,
    /// Every plan, by name.
    pub plans: Vec<PlanView>,
    /// Every client, by id.
    pub clients: Vec<ClientExport>,
    /// The stored safety settings; absent: the configured defaults apply.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub safety: Option<SafetyView>,
}

/// A client as exported: its keys by hash.
#[derive(Serialize, ToSchema)]
pub struct ClientExport {
    #[schema(example = "acme")]
    pub id: String,
    #[schema(example = "gold")]
    pub plan: String,
    /// `enforce` or `shadow`; absent means the gateway's `limits.default_mode`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(example = "enforce")]
    pub mode: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shards: Option<ShardsView>,
    pub keys: Vec<KeyExport>,
    pub overrides: Vec<OverrideView>,
}

/// A key as exported: its hash, never the key.
#[derive(Serialize, ToSchema)]
pub struct KeyExport {
    #[schema(example = "3f9a0c1d2b4e5f60")]
    pub key_id: String,
    /// `sha256:` and the key's SHA-256 in hex.
    #[schema(example = "sha256:3f9a0c1d2b4e5f60a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718")]
    pub hash: String,
    /// Unix seconds.
    pub created_at: u64,
    /// When it stops working (RFC 3339); absent: never.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(format = DateTime, example = "2030-01-01T00:00:00Z")]
    pub expires_at: Option<String>,
    /// The key it was rolled from, if it was.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rolled_from: Option<String>,
}

impl From<&KeyRecord> for KeyExport {
    fn from(k: &KeyRecord) -> KeyExport {
        KeyExport {
            key_id: k.key_id.clone(),
            hash: k.hash.to_string(),
            created_at: k.created_at,
            expires_at: k.expires_at.map(|s| rfc3339(s.saturating_mul(1_000_000))),
            rolled_from: k.rolled_from.clone(),
        }
    }
}

impl From<ClientRecord> for ClientExport {
    fn from(c: ClientRecord) -> ClientExport {
        ClientExport {
            id: c.id.to_string(),
            plan: c.plan.to_string(),
            mode: c.mode.map(|m| m.to_string()),
            shards: c.shards.map(Into::into),
            keys: c.keys.iter().map(Into::into).collect(),
            overrides: c.overrides.iter().map(Into::into).collect(),
        }
    }
}

/// The whole catalog at one version, as this gateway mirrors it (within
/// `catalog.refresh_ms` of the store): plans, clients with their keys' hashes, overrides
/// and shard settings, and the stored safety settings. Its ETag is the version. A gateway
/// in `catalog.mode = "cache"` holds only the clients in use and answers `409`.
#[utoipa::path(operation_id = "exportCatalog", get, path = "/admin/v1/catalog", tag = "catalog",
    responses(
        (status = 200, description = "The catalog", body = CatalogExport,
            headers(("ETag" = String, description = "The catalog version"))),
        (status = 409, description = "This gateway caches part of the catalog (cache mode)", body = crate::error::Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn get(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let Some(dump) = state.catalog.export() else {
        return Err(ApiError::Conflict(
            "this gateway holds only the clients in use (catalog.mode = \"cache\"): export from a gateway in mirror mode"
                .into(),
        ));
    };
    let mut plans: Vec<PlanView> = dump.plans.into_iter().map(|p| p.value.into()).collect();
    plans.sort_by(|a, b| a.name.cmp(&b.name));
    let mut clients: Vec<ClientExport> = dump.clients.into_iter().map(|c| c.value.into()).collect();
    clients.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(HttpResponse::Ok()
        .insert_header((header::ETAG, etag(dump.version)))
        .json(CatalogExport {
            version: dump.version,
            plans,
            clients,
            safety: dump.safety.map(|s| SafetyView {
                multiplier: s.value.multiplier,
                services: s.value.services,
            }),
        }))
}
