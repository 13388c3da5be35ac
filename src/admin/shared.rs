//! What the handlers share: ids from the path, `If-Match` and `If-None-Match`
//! conditions, refusals, the clock
//! and how times are written, a plan's limits, a client read and changed.

use std::future::Future;

use actix_web::HttpRequest;

use super::body::{IfMatch, IfNoneMatch, Preconditions};
use crate::catalog::{Audit, CatalogWrite, ClientRecord, Condition, Versioned, WriteOutcome};
use crate::domain::{ClientId, Limits, PlanName};
use crate::error::ApiError;
use crate::state::AppState;

/// Unix milliseconds on this gateway's clock (for audit entries outside the catalog).
pub(super) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A unix time in microseconds as RFC 3339 in UTC, to the millisecond (rounded up, so a
/// reset is never shown before it happens), e.g. `2026-12-01T00:00:00Z`,
/// `2026-11-17T09:30:01.25Z`.
pub(super) fn rfc3339(unix_us: u64) -> String {
    let ms = i64::try_from(unix_us.div_ceil(1000)).unwrap_or(i64::MAX);
    jiff::Timestamp::from_millisecond(ms)
        .unwrap_or(jiff::Timestamp::MAX)
        .to_string()
}

/// A plan's limits, read from the store (as written; overrides not applied). A client's
/// plan always exists (a plan in use cannot be deleted), so a missing one is a `404` of a
/// race with a delete.
pub(super) async fn plan_limits(state: &AppState, plan: &PlanName) -> Result<Limits, ApiError> {
    state
        .store
        .catalog
        .plan(plan.as_str())
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no plan {plan}")))?
        .value
        .limits()
        .map_err(|e| ApiError::Internal(e.into()))
}

/// Parses an id from the path, as a `422` naming it when it is not a valid id.
pub(super) fn path_id<T, E: std::fmt::Display>(
    raw: &str,
    parse: impl Fn(&str) -> Result<T, E>,
    field: &str,
) -> Result<T, ApiError> {
    parse(raw).map_err(|e| ApiError::field(field, e.to_string()))
}

/// The write condition from `If-Match` and `If-None-Match`: without them, any; with them,
/// the current revision (or its absence) when they hold for it (the store checks it again,
/// atomically), else `412`.
pub(super) async fn condition<F, Fut>(
    req: &HttpRequest,
    what: &str,
    current: F,
) -> Result<Condition, ApiError>
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<Option<u64>, ApiError>>,
{
    let wanted = Preconditions::read(req.headers())?;
    if !wanted.any() {
        return Ok(Condition::Any);
    }
    let current = current().await?;
    // RFC 9110 13.2.1: a request that would fail without its preconditions (a `DELETE` of
    // nothing: `404`) fails so with them; they are not evaluated.
    if current.is_none() && req.method() == actix_web::http::Method::DELETE {
        return Ok(Condition::Any);
    }
    precondition(&wanted, current, what)?;
    Ok(match current {
        Some(rev) => Condition::Rev(rev),
        None => Condition::Absent,
    })
}

/// `412` unless `If-Match` matches the revision `current` (`None`: missing) and
/// `If-None-Match` does not.
pub(super) fn precondition(
    wanted: &Preconditions,
    current: Option<u64>,
    what: &str,
) -> Result<(), ApiError> {
    if let Some(m) = &wanted.if_match {
        if_match_holds(m, current, what)?;
    }
    if let Some(n) = &wanted.if_none_match {
        if_none_match_holds(n, current, what)?;
    }
    Ok(())
}

/// `412` unless `If-Match` matches the revision `current` (`None`: missing).
fn if_match_holds(m: &IfMatch, current: Option<u64>, what: &str) -> Result<(), ApiError> {
    match current {
        _ if m.matches(current) => Ok(()),
        None => Err(refusal(WriteOutcome::Missing, what)),
        Some(current) => Err(refusal(WriteOutcome::Stale { current }, what)),
    }
}

/// `412` when `If-None-Match` matches the revision `current` (`None`: missing).
fn if_none_match_holds(n: &IfNoneMatch, current: Option<u64>, what: &str) -> Result<(), ApiError> {
    match current {
        Some(current) if n.matches(Some(current)) => Err(ApiError::PreconditionFailed(match n {
            IfNoneMatch::Any => format!("the {what} exists already (If-None-Match: *)"),
            IfNoneMatch::Revisions(_) => {
                format!("the {what} is at ETag \"{current}\" (If-None-Match)")
            }
        })),
        _ => Ok(()),
    }
}

/// The error for a write the store refused.
pub(super) fn refusal(outcome: WriteOutcome, what: &str) -> ApiError {
    match outcome {
        WriteOutcome::Stale { current } => ApiError::PreconditionFailed(format!(
            "the {what} changed: it is at ETag \"{current}\" now"
        )),
        WriteOutcome::Missing => {
            ApiError::PreconditionFailed(format!("the {what} does not exist (If-Match)"))
        }
        WriteOutcome::Exists => ApiError::Conflict(format!("the {what} exists already")),
        WriteOutcome::UnknownPlan => ApiError::field("plan", "no such plan"),
        WriteOutcome::PlanInUse => {
            ApiError::Conflict("clients still use this plan: move them to another first".into())
        }
        WriteOutcome::KeyConflict => {
            ApiError::Conflict("that API key already belongs to another client".into())
        }
        WriteOutcome::Written { .. } => {
            ApiError::Internal(anyhow::anyhow!("a written {what} reported as refused"))
        }
    }
}

/// Writes that lose a race with another writer are retried this often.
pub(super) const WRITE_TRIES: usize = 5;

/// A client id from the path.
pub(super) fn client_id(raw: &str) -> Result<ClientId, ApiError> {
    path_id(raw, ClientId::parse, "client")
}

/// A client as stored now; `404` when there is none.
pub(super) async fn current(
    state: &AppState,
    id: &ClientId,
) -> Result<Versioned<ClientRecord>, ApiError> {
    state
        .store
        .catalog
        .client(id.as_str())
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no client {id}")))
}

/// Creates or replaces a record (a `PUT`) over the one stored now: `read` it, `build` the
/// new one from what it had (what a `PUT` does not replace: a client's keys, the fields a
/// newer gateway wrote), and `write` it only over that revision (or only while still
/// absent), retrying when another writer got in between; with `If-Match` or
/// `If-None-Match` (`wanted`), only while they hold, and `412` rather than a retry. Returns
/// the record as written and whether it replaced one.
pub(super) async fn put_over_current<T, R>(
    what: &str,
    wanted: &Preconditions,
    read: impl AsyncFn() -> Result<Option<Versioned<T>>, ApiError>,
    build: impl Fn(Option<T>) -> R,
    write: impl AsyncFn(&R, Condition) -> Result<WriteOutcome, ApiError>,
) -> Result<(Versioned<R>, bool), ApiError> {
    for _ in 0..WRITE_TRIES {
        let existing = read().await?;
        precondition(wanted, existing.as_ref().map(|e| e.rev), what)?;
        let cond = match &existing {
            Some(cur) => Condition::Rev(cur.rev),
            None => Condition::Absent,
        };
        let rec = build(existing.map(|e| e.value));
        match write(&rec, cond).await? {
            WriteOutcome::Written { rev, before } => {
                return Ok((Versioned { rev, value: rec }, before.is_some()))
            }
            WriteOutcome::Stale { .. } | WriteOutcome::Exists | WriteOutcome::Missing
                if !wanted.any() =>
            {
                continue
            }
            // Created meanwhile by another writer: `If-None-Match` no longer holds.
            WriteOutcome::Exists => {
                return Err(ApiError::PreconditionFailed(format!(
                    "the {what} exists already (If-None-Match)"
                )))
            }
            other => return Err(refusal(other, what)),
        }
    }
    Err(ApiError::Conflict(format!(
        "the {what} kept changing; try again"
    )))
}

/// What a change to part of a client's record is checked against: `If-Match` against the
/// client's version (the part's ETag), `If-None-Match` against the part, which `exists`
/// says is there (or not) in a record; `what` names the part.
pub(super) struct PartPreconditions<'a, E> {
    pub wanted: &'a Preconditions,
    pub exists: E,
    pub what: &'a str,
    /// A `DELETE`: of a part that is not there it is a `404` (from `edit`), whatever the
    /// preconditions (RFC 9110 13.2.1).
    pub deletes: bool,
}

/// No preconditions: a change to a client's record that states none.
pub(super) fn unconditional() -> PartPreconditions<'static, fn(&ClientRecord) -> bool> {
    static NONE: Preconditions = Preconditions {
        if_match: None,
        if_none_match: None,
    };
    PartPreconditions {
        wanted: &NONE,
        exists: |_| true,
        what: "client",
        deletes: false,
    }
}

/// Changes a client's record with `edit`, retrying when another writer got there first;
/// with `If-Match` or `If-None-Match` (`part`), only while they hold, and `412` rather than
/// a retry. Returns what `edit` returned and the client's new version (its ETag).
pub(super) async fn update_client<T>(
    state: &AppState,
    id: &ClientId,
    audit: Audit,
    part: PartPreconditions<'_, impl Fn(&ClientRecord) -> bool>,
    edit: impl AsyncFn(&mut ClientRecord) -> Result<T, ApiError>,
) -> Result<(T, u64), ApiError> {
    let wanted = part.wanted;
    for _ in 0..WRITE_TRIES {
        let cur = current(state, id).await?;
        let there = (part.exists)(&cur.value);
        if let Some(m) = wanted.if_match.as_ref().filter(|_| there || !part.deletes) {
            if_match_holds(m, Some(cur.rev), "client")?;
        }
        if let Some(n) = &wanted.if_none_match {
            if_none_match_holds(n, there.then_some(cur.rev), part.what)?;
        }
        let mut rec = cur.value;
        let out = edit(&mut rec).await?;
        match state
            .store
            .catalog
            .write(
                &CatalogWrite::PutClient(rec, Condition::Rev(cur.rev)),
                &audit,
            )
            .await?
        {
            WriteOutcome::Written { rev, .. } => return Ok((out, rev)),
            WriteOutcome::Stale { .. } if !wanted.any() => continue,
            WriteOutcome::Missing => return Err(ApiError::NotFound(format!("no client {id}"))),
            other => return Err(refusal(other, "client")),
        }
    }
    Err(ApiError::Conflict(
        "the client kept changing; try again".into(),
    ))
}
