//! `/admin/v1/clients`: clients, their plan and mode, their API keys, their live bucket.
//! Overrides and usage, under a client too, are in `overrides.rs` and `usage.rs`.

use crate::store::records::MAX_KEYS;
use actix_web::http::{header, StatusCode};
use actix_web::{web, HttpRequest, HttpResponse};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::{IntoParams, ToSchema};

use super::body::{etag, read_body, Field, Fields, Preconditions};
use super::overrides::Until;
use super::shared::{
    client_id, current, now_ms, put_over_current, refusal, rfc3339, unconditional, update_client,
};
use super::Actor;
use crate::catalog::{
    key_member, Audit, AuditEntry, CatalogWrite, ClientRecord, Condition, KeyRecord, Shards,
    Versioned, WriteOutcome,
};
use crate::domain::{ApiKey, ClientId, Mode, PlanName, Region};
use crate::error::{ApiError, Problem};
use crate::state::AppState;

/// A client may hold at most this many API keys (rotation needs two; imports a few more).
/// A sharded client names at most this many regions.
const MAX_REGIONS: usize = 16;

/// One of a client's keys. The key itself is shown only once, when it is created.
#[derive(Debug, Serialize, ToSchema)]
pub struct KeyView {
    #[schema(example = "3f9a0c1d2b4e5f60")]
    pub key_id: String,
    /// Unix seconds.
    pub created_at: u64,
    /// When it stops working (RFC 3339); absent: never.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(format = DateTime, example = "2030-01-01T00:00:00Z")]
    pub expires_at: Option<String>,
    /// Whether `expires_at` has passed: the key answers `401` `key-expired`.
    pub expired: bool,
    /// The key it was rolled from, if it was.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rolled_from: Option<String>,
    /// When a gateway last admitted a request with it (RFC 3339, to within
    /// `periods.key_use_flush_ms`); absent: not since the store began counting.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(format = DateTime, example = "2026-12-03T19:30:00Z")]
    pub last_used_at: Option<String>,
}

impl KeyView {
    fn of(k: &KeyRecord, now_s: u64) -> KeyView {
        KeyView {
            key_id: k.key_id.clone(),
            created_at: k.created_at,
            expires_at: k.expires_at.map(|s| rfc3339(s.saturating_mul(1_000_000))),
            expired: k.expired(now_s),
            rolled_from: k.rolled_from.clone(),
            last_used_at: None,
        }
    }
}

/// Fills in every listed key's `last_used_at` from the store, with one read. Best effort:
/// a store that does not answer leaves them out.
async fn with_last_use(state: &AppState, mut views: Vec<ClientView>) -> Vec<ClientView> {
    let members: Vec<String> = views
        .iter()
        .flat_map(|c| c.keys.iter().map(move |k| key_member(&c.id, &k.key_id)))
        .collect();
    let Ok(times) = state.store.key_use.last_used(&members).await else {
        return views;
    };
    let mut times = times.into_iter();
    for k in views.iter_mut().flat_map(|c| c.keys.iter_mut()) {
        k.last_used_at = times
            .next()
            .flatten()
            .map(|s| rfc3339(s.saturating_mul(1_000_000)));
    }
    views
}

/// Regional sharding of a hot client's bucket.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ShardsView {
    #[schema(example = json!(["eu", "us"]))]
    pub regions: Vec<String>,
}

impl From<Shards> for ShardsView {
    fn from(s: Shards) -> ShardsView {
        ShardsView {
            regions: s.regions.iter().map(|r| r.to_string()).collect(),
        }
    }
}

/// A client of the gateway.
#[derive(Debug, Serialize, ToSchema)]
pub struct ClientView {
    /// 1-128 characters of `A-Z a-z 0-9 - _ .`.
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
    /// Read-only here: keys are managed under `/keys`.
    pub keys: Vec<KeyView>,
    /// Read-only here: overrides are managed under `/overrides`.
    pub overrides: Vec<super::overrides::OverrideView>,
}

/// The body of `PUT /admin/v1/clients/{client}` (its keys and overrides are kept as they
/// are).
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ClientInput {
    /// An existing plan (an unknown one is refused with `422`).
    #[serde(default)]
    #[schema(value_type = PlanName, required = true)]
    plan: Field<PlanName>,
    /// Absent means the gateway's `limits.default_mode`.
    #[serde(default)]
    #[schema(value_type = Option<Mode>)]
    mode: Field<Mode>,
    #[serde(default)]
    #[schema(value_type = Option<ShardsInput>)]
    shards: Field<ShardsInput>,
    /// Read-only: a client read with GET may be sent back as it is; the id must then be
    /// the one in the path.
    #[serde(default)]
    #[schema(schema_with = read_only_id)]
    id: Field<ClientId>,
    /// Ignored (a client read with GET may be sent back as it is): keys are managed
    /// under `/keys`.
    #[serde(default)]
    #[schema(value_type = Vec<Object>)]
    keys: Field<Vec<serde_json::Map<String, Value>>>,
    /// Ignored (a client read with GET may be sent back as it is): overrides are managed
    /// under `/overrides`.
    #[serde(default)]
    #[schema(value_type = Option<Vec<Object>>)]
    overrides: Field<Vec<serde_json::Map<String, Value>>>,
}

fn read_only_id() -> utoipa::openapi::RefOr<utoipa::openapi::Schema> {
    super::body::read_only(<ClientId as utoipa::PartialSchema>::schema())
}

/// Regional sharding of a hot client's bucket: 1-16 distinct regions.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields, try_from = "RawShards")]
pub struct ShardsInput {
    #[schema(schema_with = distinct_regions)]
    pub(super) regions: Vec<Region>,
}

fn distinct_regions() -> utoipa::openapi::schema::Array {
    use utoipa::PartialSchema;
    utoipa::openapi::schema::ArrayBuilder::new()
        .items(Region::schema())
        .min_items(Some(1))
        .max_items(Some(MAX_REGIONS))
        .unique_items(true)
        .build()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawShards {
    regions: Vec<Region>,
}

impl TryFrom<RawShards> for ShardsInput {
    type Error = String;
    fn try_from(r: RawShards) -> Result<ShardsInput, String> {
        let mut regions: Vec<Region> = Vec::new();
        for g in r.regions {
            if regions.contains(&g) {
                return Err(format!("regions: {g} is listed twice"));
            }
            regions.push(g);
        }
        if regions.is_empty() || regions.len() > MAX_REGIONS {
            return Err(format!(
                "regions: must be a list of 1-{MAX_REGIONS} regions"
            ));
        }
        Ok(ShardsInput { regions })
    }
}

/// A page of clients, in id order.
#[derive(Serialize, ToSchema)]
pub struct ClientList {
    pub items: Vec<ClientView>,
    /// Pass as `cursor` for the next page; `null` on the last one.
    pub next_cursor: Option<String>,
}

#[derive(Deserialize, IntoParams)]
pub struct Page {
    /// Page size, 1-1000 (default 100).
    #[param(value_type = Option<usize>, minimum = 1, maximum = 1000)]
    limit: Option<String>,
    /// `next_cursor` of the previous page (a client id).
    #[param(value_type = Option<ClientId>)]
    cursor: Option<String>,
}

/// The body of `POST .../keys`: `{}` generates a key, `{"key": "..."}` imports one.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct KeyInput {
    /// An existing key to import (8-256 printable ASCII characters, no spaces).
    #[serde(default)]
    #[schema(value_type = Option<ApiKey>)]
    key: Field<ApiKey>,
    /// When the key stops working: an RFC 3339 time in the future, kept in whole seconds
    /// (a fraction rounds up). Absent: never.
    #[serde(default)]
    #[schema(value_type = Option<String>, format = DateTime, example = "2030-01-01T00:00:00Z")]
    expires_at: Field<Until>,
}

/// A key just created: the only time the key is shown.
#[derive(Serialize, ToSchema)]
pub struct NewKey {
    pub key_id: String,
    pub key: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(format = DateTime)]
    pub expires_at: Option<String>,
}

/// The body of `POST .../keys/{key_id}/roll`: how long the old key keeps working, either
/// as `overlap_s` from now or as `old_expires_at`; the new key as `POST .../keys` takes it.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RollInput {
    /// Seconds the old key keeps working from now (0-31536000; 0: it stops now).
    #[serde(default)]
    #[schema(value_type = Option<u32>, maximum = 31536000)]
    overlap_s: Field<u64>,
    /// Or: when the old key stops working (RFC 3339, in the future). A roll never makes
    /// a key work longer than its own `expires_at`.
    #[serde(default)]
    #[schema(value_type = Option<String>, format = DateTime, example = "2030-01-01T00:00:00Z")]
    old_expires_at: Field<Until>,
    /// The new key, to import one (as `POST .../keys`); absent: generated.
    #[serde(default)]
    #[schema(value_type = Option<ApiKey>)]
    key: Field<ApiKey>,
    /// When the new key stops working (RFC 3339, in the future); absent: never.
    #[serde(default)]
    #[schema(value_type = Option<String>, format = DateTime, example = "2031-01-01T00:00:00Z")]
    expires_at: Field<Until>,
}

/// A key rolled: the new key (shown only here) and until when the old one works.
#[derive(Serialize, ToSchema)]
pub struct RolledKey {
    pub key_id: String,
    pub key: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(format = DateTime)]
    pub expires_at: Option<String>,
    pub old: OldKey,
}

/// The key a roll replaces.
#[derive(Serialize, ToSchema)]
pub struct OldKey {
    pub key_id: String,
    /// When it stops working (RFC 3339).
    #[schema(format = DateTime)]
    pub expires_at: String,
}

/// A client's bucket right now.
#[derive(Serialize, ToSchema)]
pub struct BucketView {
    pub client: String,
    pub plan: String,
    pub capacity: f64,
    pub rate: f64,
    /// Tokens available now.
    pub tokens: f64,
    /// Whether the bucket is full (no recent traffic).
    pub full: bool,
    /// For a client sharded by region: each region's share of the plan, and how the
    /// shares moved (one snapshot per reconciliation, newest first). `tokens` above is the
    /// global bucket's; each region's shard lives in that region's Redis.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shards: Option<ShardsBucketView>,
}

#[derive(Serialize, ToSchema)]
pub struct ShardsBucketView {
    /// `null` until the first reconciliation.
    pub current: Option<crate::store::ShardState>,
    #[schema(value_type = Vec<Object>)]
    pub history: Vec<Value>,
}

impl From<ClientRecord> for ClientView {
    fn from(c: ClientRecord) -> ClientView {
        ClientView {
            id: c.id.to_string(),
            plan: c.plan.to_string(),
            mode: c.mode.map(|m| m.to_string()),
            shards: c.shards.map(Into::into),
            keys: c
                .keys
                .iter()
                .map(|k| KeyView::of(k, now_ms() / 1000))
                .collect(),
            overrides: c.overrides.iter().map(Into::into).collect(),
        }
    }
}

async fn one(state: &AppState, rec: Versioned<ClientRecord>, status: StatusCode) -> HttpResponse {
    let id = rec.value.id.to_string();
    let mut resp = HttpResponse::build(status);
    resp.insert_header((header::ETAG, etag(rec.rev)));
    if status == StatusCode::CREATED {
        resp.insert_header((header::LOCATION, format!("/admin/v1/clients/{id}")));
    }
    let view = with_last_use(state, vec![ClientView::from(rec.value)]).await;
    resp.json(&view[0])
}

/// List clients, a page at a time, in id order.
#[utoipa::path(operation_id = "listClients", get, path = "/admin/v1/clients", tag = "clients", params(Page),
    responses(
        (status = 200, description = "A page of clients", body = ClientList),
        (status = 422, description = "Bad limit or cursor", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn list(
    state: web::Data<AppState>,
    page: web::Query<Page>,
) -> Result<HttpResponse, ApiError> {
    let limit = super::body::page_limit(page.limit.as_deref())?;
    if let Some(c) = &page.cursor {
        client_id(c).map_err(|_| ApiError::field("cursor", "is not a cursor from next_cursor"))?;
    }
    let page = state
        .store
        .catalog
        .clients_page(page.cursor.as_deref(), limit)
        .await?;
    let items = page
        .items
        .into_iter()
        .map(|c| ClientView::from(c.value))
        .collect();
    Ok(HttpResponse::Ok().json(ClientList {
        next_cursor: page.next,
        items: with_last_use(&state, items).await,
    }))
}

/// Read one client.
#[utoipa::path(operation_id = "getClient", get, path = "/admin/v1/clients/{client}", tag = "clients",
    params(("client" = ClientId, Path, description = "Client id")),
    responses(
        (status = 200, description = "The client", body = ClientView,
            headers(("ETag" = String, description = "Version, for If-Match"))),
        (status = 404, description = "No such client", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn get(
    state: web::Data<AppState>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let id = client_id(&id)?;
    Ok(one(&state, current(&state, &id).await?, StatusCode::OK).await)
}

/// Checks a client body: every bad field is named.
fn parse_client(
    input: ClientInput,
    mut f: super::body::Fields,
    id: &ClientId,
) -> Result<(PlanName, Option<Mode>, Option<Shards>), ApiError> {
    f.same_id("id", input.id, id);
    f.optional("keys", input.keys);
    f.optional("overrides", input.overrides);
    let plan = f.required("plan", input.plan);
    let mode = f.optional("mode", input.mode);
    let shards = f
        .optional("shards", input.shards)
        .map(|s| Shards { regions: s.regions });
    f.finish()?;
    Ok((plan.expect("checked"), mode, shards))
}

/// Create (201) or replace (200) a client; its keys and overrides are kept. Unknown plan:
/// 422. A new plan keeps what the client has spent from each limit whose name the new plan
/// has too (no free refill); overrides of limits the new plan lacks do nothing.
#[utoipa::path(operation_id = "putClient", put, path = "/admin/v1/clients/{client}", tag = "clients",
    params(("client" = ClientId, Path, description = "Client id"),
        ("If-Match" = Option<String>, Header, description = "Only if the client is at this ETag")),
    request_body(content = ClientInput, content_type = "application/json"),
    responses(
        (status = 200, description = "Replaced", body = ClientView),
        (status = 201, description = "Created", body = ClientView),
        (status = 400, description = "Malformed JSON", body = Problem, content_type = "application/problem+json"),
        (status = 412, description = "If-Match no longer matches", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Invalid fields, or an unknown plan", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn put(
    req: HttpRequest,
    state: web::Data<AppState>,
    id: web::Path<String>,
    actor: Actor,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let id = client_id(&id)?;
    let (input, f) = read_body::<ClientInput>(payload).await?;
    let (plan, mode, shards) = parse_client(input, f, &id)?;
    let wanted = Preconditions::read(req.headers())?;
    let (written, replaced) = put_over_current(
        "client",
        &wanted,
        async || Ok(state.store.catalog.client(id.as_str()).await?),
        |existing: Option<ClientRecord>| {
            let (keys, overrides, extra) = existing
                .map(|c| (c.keys, c.overrides, c.extra))
                .unwrap_or_default();
            ClientRecord {
                id: id.clone(),
                plan: plan.clone(),
                mode,
                shards: shards.clone(),
                keys,
                overrides,
                extra,
            }
        },
        async |rec, cond| {
            Ok(state
                .store
                .catalog
                .write(
                    &CatalogWrite::PutClient(rec.clone(), cond),
                    &Audit::new(&actor.sub, "client.put"),
                )
                .await?)
        },
    )
    .await?;
    let status = if replaced {
        StatusCode::OK
    } else {
        StatusCode::CREATED
    };
    Ok(one(&state, written, status).await)
}

/// Delete a client and all its keys.
#[utoipa::path(operation_id = "deleteClient", delete, path = "/admin/v1/clients/{client}", tag = "clients",
    params(("client" = ClientId, Path, description = "Client id"),
        ("If-Match" = Option<String>, Header, description = "Only if the client is at this ETag")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, description = "No such client", body = Problem, content_type = "application/problem+json"),
        (status = 412, description = "If-Match no longer matches", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn delete(
    req: HttpRequest,
    state: web::Data<AppState>,
    id: web::Path<String>,
    actor: Actor,
) -> Result<HttpResponse, ApiError> {
    let id = client_id(&id)?;
    let cond = super::shared::condition(&req, "client", || async {
        Ok(state
            .store
            .catalog
            .client(id.as_str())
            .await?
            .map(|c| c.rev))
    })
    .await?;
    match state
        .store
        .catalog
        .write(
            &CatalogWrite::DeleteClient(id.clone(), cond),
            &Audit::new(&actor.sub, "client.delete"),
        )
        .await?
    {
        WriteOutcome::Written { before, .. } => {
            // Its keys' last use goes with it (best effort).
            let keys = before
                .and_then(|b| serde_json::from_str::<ClientRecord>(&b).ok())
                .map(|c| c.keys)
                .unwrap_or_default();
            let members: Vec<String> = keys.iter().map(|k| key_member(&id, &k.key_id)).collect();
            let _ = state.store.key_use.forget(&members).await;
            Ok(HttpResponse::NoContent().finish())
        }
        WriteOutcome::Missing if cond == Condition::Any => {
            Err(ApiError::NotFound(format!("no client {id}")))
        }
        other => Err(refusal(other, "client")),
    }
}

/// Generate a key (`{}`) or import an existing one (`{"key": "..."}`). The key is shown in
/// this response only; the gateway stores its SHA-256 hash.
#[utoipa::path(operation_id = "createKey", post, path = "/admin/v1/clients/{client}/keys", tag = "clients",
    params(("client" = ClientId, Path, description = "Client id")),
    request_body(content = KeyInput, content_type = "application/json", description = "Optional: an empty body (or `{}`) generates a key that never expires"),
    responses(
        (status = 201, description = "Created; the key is shown only here", body = NewKey),
        (status = 404, description = "No such client", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "The key belongs to a client already", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Invalid key, or too many keys", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn create_key(
    state: web::Data<AppState>,
    id: web::Path<String>,
    actor: Actor,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let id = client_id(&id)?;
    let (input, mut f) = read_body::<KeyInput>(payload).await?;
    let key = f.optional("key", input.key);
    let expires_at = future(&mut f, "expires_at", input.expires_at);
    f.finish()?;
    let key = key.unwrap_or_else(ApiKey::generate);
    let record = KeyRecord {
        expires_at,
        ..KeyRecord::new(key.hash())
    };
    let key_id = record.key_id.clone();
    update_client(
        &state,
        &id,
        Audit::new(&actor.sub, "key.create"),
        unconditional(),
        async |c| {
            room_for(c, &record)?;
            c.keys.push(record.clone());
            Ok(())
        },
    )
    .await?;
    Ok(HttpResponse::Created().json(NewKey {
        key_id,
        key: key.expose().to_string(),
        expires_at: expires_at.map(|s| rfc3339(s.saturating_mul(1_000_000))),
    }))
}

/// Whether `c` may take `record`: not a key it has, and not past [`MAX_KEYS`].
fn room_for(c: &ClientRecord, record: &KeyRecord) -> Result<(), ApiError> {
    if c.keys.iter().any(|k| k.hash == record.hash) {
        return Err(ApiError::Conflict(
            "this client has that key already".into(),
        ));
    }
    if c.keys.len() >= MAX_KEYS {
        return Err(ApiError::field(
            "key",
            format!("a client has at most {MAX_KEYS} keys"),
        ));
    }
    Ok(())
}

/// An optional RFC 3339 time that must be in the future, as unix seconds.
fn future(f: &mut Fields, name: &str, value: Field<Until>) -> Option<u64> {
    let at = f.optional(name, value).map(|u| u.0);
    if at.is_some_and(|at| at <= now_ms() / 1000) {
        f.bad(name, "must be in the future");
    }
    at
}

/// The most seconds a rolled key may keep working alongside its successor: a year.
const MAX_OVERLAP_S: u64 = 31_536_000;

/// Roll a key: a new key (generated, or imported as `key`) starts working now, and the old
/// one keeps working until `overlap_s` from now or `old_expires_at`, never longer than it
/// would have, so a client can deploy the new key before the old stops. One write, one
/// audit entry (`key.roll`); both are in force on every gateway within
/// `catalog.refresh_ms`, and the old key answers `401` `key-expired` from its end.
#[utoipa::path(operation_id = "rollKey", post, path = "/admin/v1/clients/{client}/keys/{key_id}/roll", tag = "clients",
    params(("client" = ClientId, Path, description = "Client id"),
        ("key_id" = String, Path, description = "The key to roll")),
    request_body(content = RollInput, content_type = "application/json"),
    responses(
        (status = 201, description = "Rolled; the new key is shown only here", body = RolledKey),
        (status = 404, description = "No such client or key", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "The key has expired already, or the imported key belongs to a client already", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Invalid fields, each named: neither or both of `overlap_s` and `old_expires_at`, a time not in the future, too many keys", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn roll_key(
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
    actor: Actor,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let (id, old_id) = path.into_inner();
    let id = client_id(&id)?;
    let (input, mut f) = read_body::<RollInput>(payload).await?;
    let now_s = now_ms() / 1000;
    let overlap = f.optional("overlap_s", input.overlap_s);
    if overlap.is_some_and(|s| s > MAX_OVERLAP_S) {
        f.bad(
            "overlap_s",
            format!("must be at most {MAX_OVERLAP_S} (a year)"),
        );
    }
    let old_until = future(&mut f, "old_expires_at", input.old_expires_at);
    let chosen = match (overlap, old_until) {
        (Some(s), None) => Some(now_s.saturating_add(s)),
        (None, Some(at)) => Some(at),
        (Some(_), Some(_)) => {
            f.bad("overlap_s", "give overlap_s or old_expires_at, not both");
            None
        }
        (None, None) => {
            f.bad("overlap_s", "give overlap_s or old_expires_at");
            None
        }
    };
    let key = f.optional("key", input.key);
    let expires_at = future(&mut f, "expires_at", input.expires_at);
    f.finish()?;
    let chosen = chosen.expect("checked");
    let key = key.unwrap_or_else(ApiKey::generate);
    let record = KeyRecord {
        expires_at,
        rolled_from: Some(old_id.clone()),
        ..KeyRecord::new(key.hash())
    };
    let new_id = record.key_id.clone();
    let (old_end, _) = update_client(
        &state,
        &id,
        Audit::new(&actor.sub, "key.roll"),
        unconditional(),
        async |c| {
            room_for(c, &record)?;
            let Some(old) = c.keys.iter_mut().find(|k| k.key_id == old_id) else {
                return Err(ApiError::NotFound(format!(
                    "client {id} has no key {old_id}"
                )));
            };
            if old.expired(now_s) {
                return Err(ApiError::Conflict(format!(
                    "key {old_id} has expired already"
                )));
            }
            let end = old.expires_at.map_or(chosen, |at| at.min(chosen));
            old.expires_at = Some(end);
            c.keys.push(record.clone());
            Ok(end)
        },
    )
    .await?;
    Ok(HttpResponse::Created().json(RolledKey {
        key_id: new_id,
        key: key.expose().to_string(),
        expires_at: expires_at.map(|s| rfc3339(s.saturating_mul(1_000_000))),
        old: OldKey {
            key_id: old_id,
            expires_at: rfc3339(old_end.saturating_mul(1_000_000)),
        },
    }))
}

/// Revoke a key: it stops working on every gateway within `catalog.refresh_ms`.
#[utoipa::path(operation_id = "revokeKey", delete, path = "/admin/v1/clients/{client}/keys/{key_id}", tag = "clients",
    params(("client" = ClientId, Path, description = "Client id"),
        ("key_id" = String, Path, description = "The key's id")),
    responses(
        (status = 204, description = "Revoked"),
        (status = 404, description = "No such client or key", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn revoke_key(
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
    actor: Actor,
) -> Result<HttpResponse, ApiError> {
    let (id, key_id) = path.into_inner();
    let id = client_id(&id)?;
    update_client(
        &state,
        &id,
        Audit::new(&actor.sub, "key.revoke"),
        unconditional(),
        async |c| {
            let before = c.keys.len();
            c.keys.retain(|k| k.key_id != key_id);
            if c.keys.len() == before {
                return Err(ApiError::NotFound(format!(
                    "client {id} has no key {key_id}"
                )));
            }
            Ok(())
        },
    )
    .await?;
    // Its last use goes with it (best effort).
    let _ = state
        .store
        .key_use
        .forget(&[key_member(&id, &key_id)])
        .await;
    Ok(HttpResponse::NoContent().finish())
}

/// The client's bucket now: tokens available, capacity and rate.
#[utoipa::path(operation_id = "getBucket", get, path = "/admin/v1/clients/{client}/bucket", tag = "clients",
    params(("client" = ClientId, Path, description = "Client id")),
    responses(
        (status = 200, description = "The live bucket", body = BucketView),
        (status = 404, description = "No such client", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn bucket(
    state: web::Data<AppState>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let id = client_id(&id)?;
    let client = current(&state, &id).await?.value;
    let limits = super::shared::plan_limits(&state, &client.plan).await?;
    // The plan's first bucket for every service (see `/usage` for every limit).
    let (field, plan) = crate::limiter::shares::headline(&limits).ok_or_else(|| {
        ApiError::NotFound(format!(
            "plan {} has no bucket for every service",
            client.plan
        ))
    })?;
    let key = state.catalog.key_names().bucket(&id);
    let tokens = state.store.buckets.tokens_now(&key, &field, plan).await?;
    let shards = match client.shards {
        Some(_) => {
            let view = state.store.shards.view(&id).await?;
            Some(ShardsBucketView {
                current: view.state,
                history: view.history,
            })
        }
        None => None,
    };
    Ok(HttpResponse::Ok().json(BucketView {
        client: id.to_string(),
        plan: client.plan.to_string(),
        capacity: plan.capacity(),
        rate: plan.rate(),
        tokens: tokens.unwrap_or(plan.capacity()),
        full: tokens.is_none_or(|t| t >= plan.capacity()),
        shards,
    }))
}

/// Refill the client's buckets: they start full again. Its quotas' counts are kept (a
/// refill is not a free month); a quota is changed with an override.
#[utoipa::path(operation_id = "refillBucket", delete, path = "/admin/v1/clients/{client}/bucket", tag = "clients",
    params(("client" = ClientId, Path, description = "Client id")),
    responses(
        (status = 204, description = "Refilled: every bucket full, quota counts kept"),
        (status = 404, description = "No such client", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn refill(
    state: web::Data<AppState>,
    id: web::Path<String>,
    actor: Actor,
) -> Result<HttpResponse, ApiError> {
    let id = client_id(&id)?;
    let client = current(&state, &id).await?.value;
    // Every bucket of the plan, for every service; the quotas' fields stay.
    let buckets: Vec<std::sync::Arc<str>> = super::shared::plan_limits(&state, &client.plan)
        .await?
        .items()
        .iter()
        .filter(|l| matches!(l.kind(), crate::domain::LimitKind::Bucket(_)))
        .map(|l| std::sync::Arc::clone(l.field()))
        .collect();
    state
        .store
        .buckets
        .refill(&state.catalog.key_names().bucket(&id), &buckets)
        .await?;
    state
        .store
        .audit
        .record(AuditEntry {
            at_ms: super::shared::now_ms(),
            actor: actor.sub,
            action: "bucket.refill".into(),
            kind: "bucket".into(),
            id: id.to_string(),
            rev: 0,
            before: None,
            after: None,
        })
        .await?;
    Ok(HttpResponse::NoContent().finish())
}
