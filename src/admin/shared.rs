//! What the handlers share: ids from the path, `If-Match` conditions, refusals, the clock.

use std::future::Future;

use actix_web::HttpRequest;

use super::body;
use crate::catalog::{Condition, WriteOutcome};
use crate::error::ApiError;

/// Unix milliseconds on this gateway's clock (for audit entries outside the catalog).
pub(super) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Parses an id from the path, as a `422` naming it when it is not a valid id.
pub(super) fn path_id<T, E: std::fmt::Display>(
    raw: &str,
    parse: impl Fn(&str) -> Result<T, E>,
    field: &str,
) -> Result<T, ApiError> {
    parse(raw).map_err(|e| ApiError::field(field, e.to_string()))
}

/// The write condition from `If-Match`: without it, any; with it, the current revision
/// when the header matches it (the store checks it again, atomically), else `412`.
pub(super) async fn condition<F, Fut>(
    req: &HttpRequest,
    what: &str,
    current: F,
) -> Result<Condition, ApiError>
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<Option<u64>, ApiError>>,
{
    match body::if_match(req.headers())? {
        None => Ok(Condition::Any),
        Some(wanted) => {
            let current = current().await?;
            precondition(&wanted, current, what)?;
            Ok(Condition::Rev(current.expect("matched")))
        }
    }
}

/// `412` unless `If-Match` matches the revision `current` (`None`: missing).
pub(super) fn precondition(
    wanted: &body::IfMatch,
    current: Option<u64>,
    what: &str,
) -> Result<(), ApiError> {
    match current {
        _ if wanted.matches(current) => Ok(()),
        None => Err(refusal(WriteOutcome::Missing, what)),
        Some(current) => Err(refusal(WriteOutcome::Stale { current }, what)),
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
