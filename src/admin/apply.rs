//! `PUT /admin/v1/catalog`: the whole catalog from a file, as `GET /admin/v1/catalog`
//! exports it (the catalog as code). What it would change is computed against the
//! catalog as the store holds it (`?dry_run=true` stops there); then every change is
//! made in one atomic step, only if the catalog is still at the version the request
//! names (`If-Match`), or at the one the changes were computed against (`?force=true`).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use actix_web::http::header;
use actix_web::{web, HttpRequest, HttpResponse};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use utoipa::{IntoParams, ToSchema};

use super::body::{etag, if_match, read_member, read_object_within, Field, Fields};
use super::clients::ShardsInput;
use super::export::CatalogExport;
use super::overrides::{limit_named, override_of, OverrideInput, Until};
use super::plans::{named, plan_record, PlanInput};
use super::safety::{safety_record, SafetyInput};
use super::shared::now_ms;
use super::Actor;
use crate::catalog::diff::{diff, whole, CatalogDiff, Changes, Desired};
use crate::catalog::{Audit, ClientRecord, KeyRecord, PlanRecord};
use crate::domain::limits::MAX_LIMITS;
use crate::domain::{ClientId, KeyHash, Mode, PlanName};
use crate::error::{ApiError, FieldError, Problem};
use crate::state::AppState;
use crate::store::records::{ApplyOutcome, CatalogApply, MAX_KEYS};

/// At most this many problems of a file are listed (then one saying how many more).
const PROBLEMS_LISTED: usize = 100;

/// A forced apply whose catalog moves while it is computed is computed again this many
/// times at most.
const FORCED_TRIES: usize = 3;

/// A client keeps at most this many overrides (as `PUT .../overrides/{limit}` allows).
const MAX_OVERRIDES: usize = 2 * MAX_LIMITS;

/// How the catalog is put.
#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ApplyQuery {
    /// Only say what would change; write nothing.
    #[serde(default)]
    dry_run: bool,
    /// Without `If-Match`: apply over whatever the catalog is now (it is still one atomic
    /// step, against the version the changes were computed for).
    #[serde(default)]
    force: bool,
}

/// What an apply changed (or, dry, would change).
#[derive(Serialize, ToSchema)]
pub struct ApplyReport {
    /// Whether the changes were made (`false`: a dry run).
    pub applied: bool,
    /// The catalog version the changes were computed against.
    #[schema(example = 41)]
    pub from_version: u64,
    /// The version after them (the ETag); a dry run or no change: `from_version`.
    #[schema(example = 44)]
    pub version: u64,
    pub plans: ChangeList,
    pub clients: ChangeList,
    /// Whether the safety settings change (a file without them leaves them as they are).
    pub safety: bool,
    /// Clients kept whose limits in force (plan and overrides) change, by id.
    #[schema(example = json!(["acme"]))]
    pub limits_changed: Vec<String>,
    /// How many records are written (each one catalog version).
    #[schema(example = 3)]
    pub writes: usize,
}

/// Records of one kind added, changed and removed, by id.
#[derive(Serialize, ToSchema)]
pub struct ChangeList {
    #[schema(example = json!(["newco"]))]
    pub added: Vec<String>,
    #[schema(example = json!(["acme"]))]
    pub changed: Vec<String>,
    #[schema(example = json!([]))]
    pub removed: Vec<String>,
}

impl From<Changes> for ChangeList {
    fn from(c: Changes) -> ChangeList {
        ChangeList {
            added: c.added,
            changed: c.changed,
            removed: c.removed,
        }
    }
}

/// Replace the whole catalog with a file's: plans, clients with their keys (by hash) and
/// overrides, and the safety settings, in the form `GET /admin/v1/catalog` exports.
/// Records the file lacks are deleted; records it has unchanged keep their ETags; a file
/// without `safety` leaves the stored settings. The changes are computed against the
/// store's catalog and made in one atomic step, each record one version and one entry of
/// the change feed (gateways follow it within `catalog.refresh_ms`), audited as one
/// `catalog.apply`. `If-Match: "<version>"` (the version a diff was reviewed at) is
/// required unless `force=true`; `dry_run=true` only says what would change.
#[utoipa::path(operation_id = "applyCatalog", put, path = "/admin/v1/catalog", tag = "catalog",
    params(ApplyQuery,
        ("If-Match" = Option<String>, Header, description = "Only if the catalog is at this version (required unless force=true or dry_run=true)")),
    request_body(content = CatalogExport, content_type = "application/json",
        description = "The catalog as `GET /admin/v1/catalog` exports it. In a key, `key_id` (derived from the hash) and `created_at` may be left out; `version` is not read."),
    responses(
        (status = 200, description = "Applied (or, dry, what would change)", body = ApplyReport,
            headers(("ETag" = String, description = "The catalog version after it"))),
        (status = 400, description = "Malformed JSON", body = Problem, content_type = "application/problem+json"),
        (status = 412, description = "The catalog is no longer at the If-Match version", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body over admin.catalog_max_bytes", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Invalid records, each named (`clients[3].keys[0].hash`); nothing written", body = Problem, content_type = "application/problem+json"),
        (status = 428, description = "Neither If-Match nor force=true", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn put(
    req: HttpRequest,
    state: web::Data<AppState>,
    query: web::Query<ApplyQuery>,
    actor: Actor,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let guard = if_match(req.headers())?;
    if guard.is_none() && !query.force && !query.dry_run {
        return Err(ApiError::PreconditionRequired(
            "a whole catalog is put over a version: send If-Match: \"<version>\" (the one \
             its diff was reviewed at), or force=true to apply over whatever it is now"
                .into(),
        ));
    }
    let body = read_object_within(payload, state.catalog_max_bytes).await?;
    // Read and checked once, before the store is read: a bad file costs no dump. Reading
    // and diffing a catalog of thousands of clients takes a while: off the worker, whose
    // requests it would hold up.
    let wanted = Arc::new(off_worker(move || desired(body)).await?);
    for _ in 0..FORCED_TRIES {
        let current = state.store.catalog.dump().await?;
        if let Some(tags) = &guard {
            if !tags.matches(Some(current.version)) {
                return Err(ApiError::PreconditionFailed(format!(
                    "the catalog is at version {} (If-Match)",
                    current.version
                )));
            }
        }
        let file = Arc::clone(&wanted);
        let (changes, current, after) = off_worker(move || {
            let changes = diff(&current, Desired::clone(&file), now_ms() / 1000);
            let after = whole(&current, &changes.writes);
            Ok((changes, current, after))
        })
        .await?;
        if query.dry_run || changes.is_empty() {
            return Ok(report(changes, current.version, current.version, false));
        }
        let audit = Audit::new(&actor.sub, "catalog.apply");
        let apply = CatalogApply {
            at_epoch: current.epoch.as_deref(),
            at_version: current.version,
            writes: &changes.writes,
            whole: &after,
            audit: &audit,
            summary: summary(&changes, current.version),
        };
        match state.store.catalog.apply(&apply).await? {
            ApplyOutcome::Applied { version } => {
                tracing::info!(
                    actor = %actor.sub,
                    from = current.version,
                    version,
                    writes = changes.writes.len(),
                    "catalog applied"
                );
                return Ok(report(changes, current.version, version, true));
            }
            ApplyOutcome::Moved { version } if guard.is_some() => {
                return Err(ApiError::PreconditionFailed(format!(
                    "the catalog moved to version {version} while this apply was checked"
                )));
            }
            ApplyOutcome::Moved { .. } => continue,
        }
    }
    Err(ApiError::Conflict(format!(
        "the catalog changed under each of {FORCED_TRIES} tries; try again"
    )))
}

/// `work` on a blocking thread.
async fn off_worker<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    web::block(work)
        .await
        .map_err(|e| ApiError::Internal(anyhow::anyhow!("the catalog's check stopped: {e}")))?
}

/// The audit entry's `after`: the version the apply ends at and what it counted.
fn summary(d: &CatalogDiff, from: u64) -> Value {
    let counts = |c: &Changes| {
        serde_json::json!({
            "added": c.added.len(), "changed": c.changed.len(), "removed": c.removed.len()
        })
    };
    serde_json::json!({
        "version": from + d.writes.len() as u64,
        "plans": counts(&d.plans),
        "clients": counts(&d.clients),
        "safety": d.safety,
        "limits_changed": d.limits_changed.len(),
    })
}

fn report(d: CatalogDiff, from: u64, version: u64, applied: bool) -> HttpResponse {
    HttpResponse::Ok()
        .insert_header((header::ETAG, etag(version)))
        .json(ApplyReport {
            applied,
            from_version: from,
            version,
            writes: d.writes.len(),
            plans: d.plans.into(),
            clients: d.clients.into(),
            safety: d.safety,
            limits_changed: d.limits_changed,
        })
}

/// A catalog file's top level.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CatalogInput {
    /// Ignored: the version it was exported at.
    #[serde(default)]
    #[allow(dead_code)]
    version: Field<u64>,
    #[serde(default)]
    plans: Field<Vec<Value>>,
    #[serde(default)]
    clients: Field<Vec<Value>>,
    #[serde(default)]
    safety: Field<Value>,
}

/// A client in a catalog file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ClientEntry {
    #[serde(default)]
    id: Field<ClientId>,
    #[serde(default)]
    plan: Field<PlanName>,
    #[serde(default)]
    mode: Field<Mode>,
    #[serde(default)]
    shards: Field<ShardsInput>,
    #[serde(default)]
    keys: Field<Vec<Value>>,
    #[serde(default)]
    overrides: Field<Vec<Value>>,
}

/// A key in a catalog file: its hash, never the key.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyEntry {
    #[serde(default)]
    key_id: Field<String>,
    #[serde(default)]
    hash: Field<KeyHash>,
    #[serde(default)]
    created_at: Field<u64>,
    #[serde(default)]
    expires_at: Field<Until>,
    #[serde(default)]
    rolled_from: Field<String>,
}

/// The catalog a file describes, every record checked as its own `PUT` checks it and the
/// whole as a catalog: ids and key hashes once, each client's plan in the file, each
/// override against its plan. `422` lists the problems, each named by its place.
fn desired(body: Map<String, Value>) -> Result<Desired, ApiError> {
    let mut f = Fields::default();
    let out = read_desired(Value::Object(body), &mut f);
    if f.errors.len() > PROBLEMS_LISTED {
        let more = f.errors.len() - PROBLEMS_LISTED;
        f.errors.truncate(PROBLEMS_LISTED);
        f.errors.push(FieldError {
            field: "body".into(),
            message: format!("and {more} more problems"),
        });
    }
    f.finish()?;
    out.ok_or_else(|| ApiError::BadRequest("the catalog does not read".into()))
}

fn read_desired(body: Value, f: &mut Fields) -> Option<Desired> {
    let input = read_member::<CatalogInput>(body, "", f)?;
    let plan_items = f.required("plans", input.plans).unwrap_or_default();
    let client_items = f.required("clients", input.clients).unwrap_or_default();
    let safety = f.optional("safety", input.safety).and_then(|v| {
        let mut inner = Fields::default();
        let rec =
            read_member::<SafetyInput>(v, "safety", f).and_then(|s| safety_record(s, &mut inner));
        f.within("safety", inner);
        rec
    });

    let mut plans: Vec<PlanRecord> = Vec::new();
    let mut plan_at: HashMap<PlanName, usize> = HashMap::new();
    for (i, v) in plan_items.into_iter().enumerate() {
        let at = format!("plans[{i}]");
        let Some(mut input) = read_member::<PlanInput>(v, &at, f) else {
            continue;
        };
        let Some(name) = f.required(&format!("{at}.name"), named(&mut input)) else {
            continue;
        };
        if plan_at.insert(name.clone(), i).is_some() {
            f.bad(
                &format!("{at}.name"),
                format!("plan {name} is listed twice"),
            );
            continue;
        }
        let mut inner = Fields::default();
        let rec = plan_record(name, input, &mut inner);
        f.within(&at, inner);
        plans.extend(rec);
    }
    let limits: HashMap<&PlanName, crate::domain::Limits> = plans
        .iter()
        .filter_map(|p| Some((&p.name, p.limits().ok()?)))
        .collect();

    let mut clients = Vec::new();
    let mut ids = HashSet::new();
    let mut owners: HashMap<KeyHash, String> = HashMap::new();
    for (i, v) in client_items.into_iter().enumerate() {
        let at = format!("clients[{i}]");
        let Some(entry) = read_member::<ClientEntry>(v, &at, f) else {
            continue;
        };
        let id = f.required(&format!("{at}.id"), entry.id);
        let plan = f.required(&format!("{at}.plan"), entry.plan);
        let mode = f.optional(&format!("{at}.mode"), entry.mode);
        let shards = f.optional(&format!("{at}.shards"), entry.shards);
        let key_items = f
            .optional(&format!("{at}.keys"), entry.keys)
            .unwrap_or_default();
        let override_items = f
            .optional(&format!("{at}.overrides"), entry.overrides)
            .unwrap_or_default();
        let Some(id) = id else { continue };
        if !ids.insert(id.clone()) {
            f.bad(&format!("{at}.id"), format!("client {id} is listed twice"));
            continue;
        }
        let plan_limits = plan.as_ref().and_then(|p| {
            let l = limits.get(p);
            if !plan_at.contains_key(p) {
                f.bad(
                    &format!("{at}.plan"),
                    format!("{p} is not a plan of this catalog"),
                );
            }
            l
        });
        if key_items.len() > MAX_KEYS {
            f.bad(
                &format!("{at}.keys"),
                format!("a client has at most {MAX_KEYS} keys"),
            );
        }
        let mut keys: Vec<KeyRecord> = Vec::new();
        for (j, v) in key_items.into_iter().enumerate() {
            let kat = format!("{at}.keys[{j}]");
            let Some(key) = read_key(v, &kat, f) else {
                continue;
            };
            match owners.get(&key.hash) {
                Some(owner) => f.bad(
                    &format!("{kat}.hash"),
                    format!("this key belongs to client {owner} too"),
                ),
                None => {
                    owners.insert(key.hash, id.to_string());
                    keys.push(key);
                }
            }
        }
        if override_items.len() > MAX_OVERRIDES {
            f.bad(
                &format!("{at}.overrides"),
                format!("a client has at most {MAX_OVERRIDES} overrides"),
            );
        }
        let mut overrides: Vec<crate::domain::Override> = Vec::new();
        for (j, v) in override_items.into_iter().enumerate() {
            let oat = format!("{at}.overrides[{j}]");
            let Some(mut input) = read_member::<OverrideInput>(v, &oat, f) else {
                continue;
            };
            let Some(limit) = f.required(&format!("{oat}.limit"), limit_named(&mut input)) else {
                continue;
            };
            let mut inner = Fields::default();
            let o = override_of(limit, input, &mut inner);
            f.within(&oat, inner);
            if overrides.iter().any(|x| x.limit == o.limit) {
                f.bad(
                    &format!("{oat}.limit"),
                    format!("the override of {} is listed twice", o.limit),
                );
                continue;
            }
            // An override of a limit its plan lacks does nothing, and is kept (as a
            // plan change keeps it); one of a limit the plan has must fit it.
            if let Some(l) = plan_limits.filter(|l| l.get(o.limit.as_str()).is_some()) {
                if let Err(e) = l.check_override(&o) {
                    f.bad(&format!("{oat}.{}", e.field), e.message);
                }
            }
            overrides.push(o);
        }
        let Some(plan) = plan else { continue };
        clients.push(ClientRecord {
            id,
            plan,
            mode,
            shards: shards.map(|s| crate::catalog::Shards { regions: s.regions }),
            keys,
            overrides,
            extra: Default::default(),
        });
    }
    Some(Desired {
        plans,
        clients,
        safety,
    })
}

/// One key of a client in a file, at `at` (`clients[3].keys[0]`).
fn read_key(v: Value, at: &str, f: &mut Fields) -> Option<KeyRecord> {
    let entry = read_member::<KeyEntry>(v, at, f)?;
    let hash = f.required(&format!("{at}.hash"), entry.hash);
    let key_id = f.optional(&format!("{at}.key_id"), entry.key_id);
    let created_at = f.optional(&format!("{at}.created_at"), entry.created_at);
    let expires_at = f.optional(&format!("{at}.expires_at"), entry.expires_at);
    let rolled_from = f.optional(&format!("{at}.rolled_from"), entry.rolled_from);
    let hash = hash?;
    if key_id.as_ref().is_some_and(|k| *k != hash.key_id()) {
        f.bad(
            &format!("{at}.key_id"),
            format!(
                "is the hash's first 16 hex digits ({}), or left out",
                hash.key_id()
            ),
        );
        return None;
    }
    let mut key = KeyRecord::new(hash);
    if let Some(at) = created_at {
        key.created_at = at;
    }
    key.expires_at = expires_at.map(|u| u.0);
    key.rolled_from = rolled_from;
    Some(key)
}
