//! `GET /admin/v1/clients/{client}/usage/history`: what a client did, per limit and per
//! hour or day, from the usage history every gateway flushes (`limiter::UsageTally`):
//! admitted and refused requests, the admitted cost, and what was admitted without the
//! store. As JSON, or CSV (`format=csv`, or `Accept: text/csv`).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use actix_web::{web, HttpRequest, HttpResponse};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::shared::{client_id, now_ms, rfc3339};
use crate::domain::ClientId;
use crate::error::{ApiError, Problem};
use crate::state::AppState;
use crate::store::{UsageCounts, DAY_S, HOUR_S};

/// Which client's history, over which time, in which buckets.
#[derive(Deserialize, IntoParams)]
pub struct HistoryQuery {
    /// The start (RFC 3339), rounded down to its UTC hour; default: 24 hours before `to`.
    /// Read as at most `usage.retention_days` (plus one) days before `to`: nothing older
    /// is kept. Before `to`.
    #[param(value_type = Option<String>, format = DateTime, example = "2026-12-01T00:00:00Z")]
    from: Option<String>,
    /// The end (RFC 3339), exclusive, rounded up to its UTC hour; default: now.
    #[param(value_type = Option<String>, format = DateTime, example = "2026-12-02T00:00:00Z")]
    to: Option<String>,
    /// One row per limit and `hour` (default) or UTC `day`.
    #[param(value_type = Option<Step>)]
    step: Option<String>,
    /// `json` (default) or `csv`; `Accept: text/csv` asks for CSV too.
    #[param(value_type = Option<Format>)]
    format: Option<String>,
}

/// A row's span.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Step {
    Hour,
    Day,
}

/// What the history is answered as.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    Json,
    Csv,
}

/// A client's usage history over a time range.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"client": "acme", "from": "2026-12-01T00:00:00Z",
    "to": "2026-12-02T00:00:00Z", "step": "day",
    "rows": [{"limit": "daily", "start": "2026-12-01T00:00:00Z", "admitted": 1200,
        "refused": 30, "cost": 1200.0, "unmetered": 2, "unmetered_cost": 2.0}],
    "totals": [{"limit": "daily", "admitted": 1200, "refused": 30, "cost": 1200.0,
        "unmetered": 2, "unmetered_cost": 2.0}]}))]
pub struct HistoryView {
    pub client: String,
    /// The range's start, as rounded, and no earlier than the retention (RFC 3339, UTC).
    #[schema(format = DateTime)]
    pub from: String,
    /// The range's end, exclusive, as rounded.
    #[schema(format = DateTime)]
    pub to: String,
    pub step: Step,
    /// One per limit and step with anything counted, by start then limit.
    pub rows: Vec<HistoryRow>,
    /// Each limit's sums over the range.
    pub totals: Vec<HistoryTotal>,
}

/// One limit's counts over one hour or day.
#[derive(Debug, Serialize, ToSchema)]
pub struct HistoryRow {
    /// The limit's name in the client's plan.
    #[schema(example = "daily")]
    pub limit: String,
    /// The hour's or day's start (RFC 3339, UTC).
    #[schema(format = DateTime, example = "2026-12-01T00:00:00Z")]
    pub start: String,
    #[serde(flatten)]
    pub counts: HistoryCounts,
}

/// One limit's counts over the whole range.
#[derive(Debug, Serialize, ToSchema)]
pub struct HistoryTotal {
    #[schema(example = "daily")]
    pub limit: String,
    #[serde(flatten)]
    pub counts: HistoryCounts,
}

/// What was counted.
#[derive(Debug, Default, Serialize, ToSchema)]
pub struct HistoryCounts {
    /// Requests the store admitted, each taking its cost from this limit.
    #[schema(example = 1200)]
    pub admitted: u64,
    /// Requests refused: by a limit (in shadow mode too, though those were forwarded), or
    /// by the gateway's safety limit.
    #[schema(example = 30)]
    pub refused: u64,
    /// What the admitted requests took (their real cost when the service reported one):
    /// over a quota's window, equal to its `used`.
    #[schema(example = 1200.0)]
    pub cost: f64,
    /// Requests admitted without the store (failing open): in no quota.
    #[schema(example = 2)]
    pub unmetered: u64,
    /// What those would have cost.
    #[schema(example = 2.0)]
    pub unmetered_cost: f64,
}

impl From<UsageCounts> for HistoryCounts {
    fn from(c: UsageCounts) -> HistoryCounts {
        HistoryCounts {
            admitted: c.admitted,
            refused: c.refused,
            cost: c.cost,
            unmetered: c.unmetered,
            unmetered_cost: c.unmetered_cost,
        }
    }
}

/// What a client did per limit and hour (or day): admitted, refused, their cost, and
/// what was admitted without the store, summed over every gateway. Counts reach the store
/// every `usage.flush_ms`; the last flush's worth may be missing. Reads only.
#[utoipa::path(operation_id = "getUsageHistory", get,
    path = "/admin/v1/clients/{client}/usage/history", tag = "clients",
    params(("client" = ClientId, Path, description = "Client id"), HistoryQuery),
    responses(
        (status = 200, description = "The client's usage history", content(
            (HistoryView = "application/json"),
            (String = "text/csv", example = "client,limit,start,admitted,refused,cost,unmetered,unmetered_cost\nacme,daily,2026-12-01T00:00:00Z,1200,30,1200,2,2\n"),
        )),
        (status = 422, description = "A bad from, to, step or format, named", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn get(
    state: web::Data<AppState>,
    req: HttpRequest,
    id: web::Path<String>,
    q: web::Query<HistoryQuery>,
) -> Result<HttpResponse, ApiError> {
    let id = client_id(&id)?;
    let now_s = now_ms() / 1000;
    let to_s = match &q.to {
        Some(t) => instant("to", t)?,
        None => now_s,
    }
    .div_ceil(HOUR_S)
    .saturating_mul(HOUR_S);
    let from_s = match &q.from {
        Some(f) => instant("from", f)?,
        None => to_s.saturating_sub(DAY_S),
    } / HOUR_S
        * HOUR_S;
    if from_s >= to_s {
        return Err(ApiError::field("from", "must be before to"));
    }
    // Nothing older is kept: a longer range reads as far back as the store keeps.
    let from_s = from_s.max(to_s.saturating_sub((state.usage.retention_days + 1) * DAY_S));
    let step = match q.step.as_deref() {
        None | Some("hour") => Step::Hour,
        Some("day") => Step::Day,
        Some(_) => return Err(ApiError::field("step", "must be hour or day")),
    };
    let csv = match q.format.as_deref() {
        Some("csv") => true,
        Some("json") => false,
        Some(_) => return Err(ApiError::field("format", "must be json or csv")),
        None => accepts_csv(&req),
    };
    let rows = state.store.usage.read(&id, from_s, to_s).await?;
    let span = match step {
        Step::Hour => HOUR_S,
        Step::Day => DAY_S,
    };
    let mut by_step: BTreeMap<(u64, String), UsageCounts> = BTreeMap::new();
    let mut totals: BTreeMap<String, UsageCounts> = BTreeMap::new();
    for r in rows {
        by_step
            .entry((r.hour_s / span * span, r.limit.clone()))
            .or_default()
            .add(&r.counts);
        totals.entry(r.limit).or_default().add(&r.counts);
    }
    let view = HistoryView {
        client: id.to_string(),
        from: rfc3339(from_s * 1_000_000),
        to: rfc3339(to_s * 1_000_000),
        step,
        rows: by_step
            .into_iter()
            .map(|((start_s, limit), counts)| HistoryRow {
                limit,
                start: rfc3339(start_s * 1_000_000),
                counts: counts.into(),
            })
            .collect(),
        totals: totals
            .into_iter()
            .map(|(limit, counts)| HistoryTotal {
                limit,
                counts: counts.into(),
            })
            .collect(),
    };
    if csv {
        return Ok(HttpResponse::Ok()
            .content_type("text/csv; charset=utf-8")
            .body(as_csv(&view)));
    }
    Ok(HttpResponse::Ok().json(view))
}

/// An RFC 3339 instant as unix seconds (one before 1970 as 1970: nothing is older); an
/// unreadable one names `field`.
fn instant(field: &str, raw: &str) -> Result<u64, ApiError> {
    let t: jiff::Timestamp = raw.parse().map_err(|_| {
        ApiError::field(
            field,
            "must be an RFC 3339 date-time, e.g. 2026-12-01T00:00:00Z",
        )
    })?;
    Ok(u64::try_from(t.as_second()).unwrap_or(0))
}

/// Whether the request's `Accept` prefers CSV: it names `text/csv` and not JSON first.
fn accepts_csv(req: &HttpRequest) -> bool {
    let Some(accept) = req
        .headers()
        .get(actix_web::http::header::ACCEPT)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let mut types = accept
        .split(',')
        .map(|t| t.split(';').next().unwrap_or("").trim());
    types
        .find(|t| *t == "text/csv" || *t == "application/json")
        .is_some_and(|t| t == "text/csv")
}

/// The rows as CSV (RFC 4180): a header, then one line per row. Ids and limit names are
/// letters, digits and `._-`, so no field needs quoting.
fn as_csv(view: &HistoryView) -> String {
    let mut out =
        String::from("client,limit,start,admitted,refused,cost,unmetered,unmetered_cost\r\n");
    for r in &view.rows {
        let c = &r.counts;
        let _ = write!(
            out,
            "{},{},{},{},{},{},{},{}\r\n",
            view.client,
            r.limit,
            r.start,
            c.admitted,
            c.refused,
            c.cost,
            c.unmetered,
            c.unmetered_cost
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_instant_is_rfc3339_and_a_bad_one_names_its_field() {
        assert_eq!(
            instant("from", "2026-12-01T00:00:00Z").unwrap(),
            1_796_083_200
        );
        assert_eq!(
            instant("to", "2026-12-01T01:00:00+01:00").unwrap(),
            1_796_083_200
        );
        assert_eq!(instant("from", "1969-12-31T23:59:59Z").unwrap(), 0);
        for bad in ["yesterday", "2026-12-01", "2026-12-01T25:00:00Z"] {
            match instant("to", bad) {
                Err(ApiError::Validation(f)) => assert_eq!(f[0].field, "to", "{bad}"),
                other => panic!("{bad}: {other:?}"),
            }
        }
    }
}
