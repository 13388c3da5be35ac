//! `/admin/v1/plans`: what each plan allows, as a set of limits (token buckets and quotas,
//! some for one service only). The old body of one `capacity` and `rate` is still taken,
//! as one bucket named `default`, and a plan read with GET can be sent back as it is.

use actix_web::http::header;
use actix_web::{web, HttpRequest, HttpResponse};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::body::{etag, read_body, read_member, Description, Field, Fields, Preconditions};
use super::shared::{condition, path_id, put_over_current};
use super::Actor;
use crate::catalog::{Audit, CatalogWrite, Condition, PlanRecord, Versioned, WriteOutcome};
use crate::domain::limits::{MAX_LIMITS, MAX_QUOTA, MIN_QUOTA};
use crate::domain::{
    Bucket, Capacity, LimitError, LimitName, LimitSpec, Limits, MaxConnections, Period, PlanName,
    QuotaClock, QuotaError, Rate, Reset, ServiceName,
};
use crate::error::{ApiError, Problem};
use crate::state::AppState;

/// A plan: its limits. A request takes from every limit that applies to it (those for
/// every service, and those of the service it goes to), all or nothing.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({
    "name": "gold",
    "limits": [
        {"name": "burst", "capacity": 200.0, "rate": 100.0},
        {"name": "monthly", "quota": 1000000.0, "period": "month", "reset": "calendar", "time_zone": "UTC"},
        {"name": "search", "service": "search", "capacity": 10.0, "rate": 10.0}
    ],
    "capacity": 200.0,
    "rate": 100.0,
    "description": "100 req/s bursting to 200, 1,000,000 a month, /search at 10 req/s"
}))]
pub struct PlanView {
    /// 1-64 characters of `A-Z a-z 0-9 - _ .`.
    #[schema(example = "gold")]
    pub name: String,
    /// 1 to 8 limits with distinct names; the first applies to every service. Every field
    /// is shown, defaults filled in (a quota's `reset` and `time_zone`).
    pub limits: Vec<PlanLimit>,
    /// The first bucket for every service, as plans read before they had several limits;
    /// absent when the plan has no such bucket. Read-only beside `limits`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(example = 200)]
    pub capacity: Option<f64>,
    /// The same bucket's rate (tokens per second).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(example = 100)]
    pub rate: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// A client's open upgraded (WebSocket) connections at most, on each gateway; absent:
    /// no cap.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<MaxConnections>, nullable = false)]
    pub max_connections: Option<u32>,
}

/// One limit of a plan: a token bucket or a quota. Its `name` is what its state is kept
/// under, so a client moved to a plan with a limit of the same name keeps what it spent.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum PlanLimit {
    Bucket(BucketLimit),
    Quota(QuotaLimit),
}

/// A token bucket: bursts of up to `capacity`, refilled at `rate` tokens per second.
/// `capacity / rate` (the time an empty bucket takes to fill) is at most 1e12 s.
#[derive(Debug, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"name": "burst", "capacity": 200.0, "rate": 100.0}))]
pub struct BucketLimit {
    #[schema(value_type = LimitName)]
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(schema_with = service_schema)]
    pub service: Option<String>,
    #[schema(value_type = Capacity)]
    pub capacity: f64,
    #[schema(value_type = Rate)]
    pub rate: f64,
}

/// A quota: `quota` requests (or cost units) per `period`, counted in windows that start
/// over on the calendar (`reset: calendar`, the default: the top of the hour, midnight,
/// the 1st of the month in `time_zone`), on a billing day (`reset: anchor` with
/// `anchor_day`, monthly), or one period after the first request (`reset: rolling`).
#[derive(Debug, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"name": "monthly", "quota": 1000000.0, "period": "month", "reset": "calendar", "time_zone": "UTC"}))]
pub struct QuotaLimit {
    #[schema(value_type = LimitName)]
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(schema_with = service_schema)]
    pub service: Option<String>,
    #[schema(value_type = QuotaAmount)]
    pub quota: f64,
    pub period: Period,
    /// Default `calendar`; GET always shows it.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<ResetRule>, nullable = false)]
    pub reset: Option<String>,
    /// With `reset: anchor` only (and period `month`): the day of the month the window
    /// starts over, at midnight in `time_zone`; in a month without that day, its last day.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 31, example = 15, nullable = false)]
    pub anchor_day: Option<i64>,
    /// An IANA time zone (bundled with the gateway); default `UTC`; GET always shows it.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(example = "UTC", nullable = false)]
    pub time_zone: Option<String>,
    /// Percentages of the quota (1-100, at most 4, distinct) whose crossing is announced
    /// to the configured webhooks, once per window for the whole fleet (the book, "Quota
    /// warnings"); absent: none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    #[schema(schema_with = warn_at_schema)]
    pub warn_at: Vec<i64>,
}

fn warn_at_schema() -> utoipa::openapi::schema::Array {
    use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, SchemaType, Type};
    ArrayBuilder::new()
        .items(
            ObjectBuilder::new()
                .schema_type(SchemaType::Type(Type::Integer))
                .minimum(Some(1.0))
                .maximum(Some(100.0)),
        )
        .max_items(Some(crate::domain::limits::MAX_WARNINGS))
        .unique_items(true)
        .examples([serde_json::json!([80, 100])])
        .build()
}

fn service_schema() -> utoipa::openapi::RefOr<utoipa::openapi::Schema> {
    use utoipa::openapi::schema::{ObjectBuilder, SchemaType, Type};
    ObjectBuilder::new()
        .schema_type(SchemaType::Type(Type::String))
        .min_length(Some(1))
        .max_length(Some(ServiceName::MAX_LEN))
        .pattern(Some(crate::domain::ID_PATTERN))
        .description(Some(
            "Only requests to this service (a route's `service`) take from the limit; \
             absent: every request. Any valid name is accepted: plans are shared by every \
             gateway, whose routes come from each one's own configuration, so a plan may \
             name a service before its route is deployed. A name no route has never \
             applies; `GET /admin/v1/clients/{client}/usage` lists each limit with its service.",
        ))
        .examples([serde_json::json!("search")])
        .into()
}

/// When a quota's window starts over.
#[derive(Debug, Clone, Copy, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ResetRule {
    Calendar,
    Anchor,
    Rolling,
}

impl ResetRule {
    fn as_str(self) -> &'static str {
        match self {
            ResetRule::Calendar => "calendar",
            ResetRule::Anchor => "anchor",
            ResetRule::Rolling => "rolling",
        }
    }
}

/// A quota's amount: requests (or cost units) per window.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(try_from = "f64")]
pub struct QuotaAmount(f64);

impl TryFrom<f64> for QuotaAmount {
    type Error = String;
    fn try_from(v: f64) -> Result<QuotaAmount, String> {
        if v.is_finite() && (MIN_QUOTA..=MAX_QUOTA).contains(&v) {
            Ok(QuotaAmount(v))
        } else {
            Err(LimitError::Amount(v).to_string())
        }
    }
}

impl From<QuotaAmount> for f64 {
    fn from(q: QuotaAmount) -> f64 {
        q.0
    }
}

/// The schema states the bounds the parse enforces, from the same constants.
impl utoipa::PartialSchema for QuotaAmount {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::Schema> {
        use utoipa::openapi::schema::{ObjectBuilder, SchemaType, Type};
        ObjectBuilder::new()
            .schema_type(SchemaType::Type(Type::Number))
            .minimum(Some(MIN_QUOTA))
            .maximum(Some(MAX_QUOTA))
            .description(Some("Requests (or cost units) per window (1 to 1e15)."))
            .examples([serde_json::json!(1000000)])
            .into()
    }
}

impl utoipa::ToSchema for QuotaAmount {}

/// A billing day of the month, 1-31.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(try_from = "i64")]
struct AnchorDay(i64);

impl TryFrom<i64> for AnchorDay {
    type Error = String;
    fn try_from(d: i64) -> Result<AnchorDay, String> {
        if (1..=31).contains(&d) {
            Ok(AnchorDay(d))
        } else {
            Err(QuotaError::AnchorDay(d).to_string())
        }
    }
}

/// An IANA time zone the bundled database has.
#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "String")]
struct TimeZoneName(String);

impl TryFrom<String> for TimeZoneName {
    type Error = String;
    fn try_from(s: String) -> Result<TimeZoneName, String> {
        QuotaClock::new(Period::Day, Reset::Calendar, &s)
            .map(|_| TimeZoneName(s))
            .map_err(|e| e.to_string())
    }
}

/// One limit of a `PUT` body, each field parsed on its own so every bad one is named
/// (`limits[1].quota`). Its schema is [`PlanLimit`]'s.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LimitInput {
    #[serde(default)]
    name: Field<LimitName>,
    #[serde(default)]
    service: Field<ServiceName>,
    #[serde(default)]
    capacity: Field<Capacity>,
    #[serde(default)]
    rate: Field<Rate>,
    #[serde(default)]
    quota: Field<QuotaAmount>,
    #[serde(default)]
    period: Field<Period>,
    #[serde(default)]
    reset: Field<ResetRule>,
    #[serde(default)]
    anchor_day: Field<AnchorDay>,
    #[serde(default)]
    time_zone: Field<TimeZoneName>,
    #[serde(default)]
    warn_at: Field<Vec<i64>>,
}

/// The body of `PUT /admin/v1/plans/{plan}`: `limits`, or (the body of plans before they
/// had several limits) `capacity` and `rate`, meaning one bucket named `default`. Not
/// both: beside `limits`, `capacity` and `rate` may only repeat the first bucket for every
/// service, as GET shows them, so that a plan read with GET can be sent back as it is.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({
    "limits": [
        {"name": "burst", "capacity": 200, "rate": 100},
        {"name": "monthly", "quota": 1000000, "period": "month"},
        {"name": "search", "service": "search", "capacity": 10, "rate": 10}
    ],
    "description": "100 req/s bursting to 200, 1,000,000 a month, /search at 10 req/s"
}))]
pub struct PlanInput {
    /// 1 to 8 limits: see [`limits_schema`].
    #[serde(default)]
    #[schema(schema_with = limits_schema)]
    limits: Field<Vec<Value>>,
    /// Without `limits`: the size of the plan's one bucket (required then).
    #[serde(default)]
    #[schema(value_type = Option<Capacity>)]
    capacity: Field<Capacity>,
    /// Without `limits`: the refill of the plan's one bucket (required then).
    #[serde(default)]
    #[schema(value_type = Option<Rate>)]
    rate: Field<Rate>,
    #[serde(default)]
    #[schema(value_type = Option<Description>)]
    description: Field<Description>,
    /// A client's open upgraded (WebSocket) connections at most, on each gateway; absent:
    /// no cap.
    #[serde(default)]
    #[schema(value_type = Option<MaxConnections>)]
    max_connections: Field<MaxConnections>,
    /// Read-only: a plan read with GET may be sent back as it is; the name must then be
    /// the one in the path.
    #[serde(default)]
    #[schema(schema_with = read_only_name)]
    name: Field<PlanName>,
}

fn read_only_name() -> utoipa::openapi::RefOr<utoipa::openapi::Schema> {
    super::body::read_only(<PlanName as utoipa::PartialSchema>::schema())
}

fn limits_schema() -> utoipa::openapi::schema::Array {
    use utoipa::openapi::schema::{ArrayBuilder, SchemaType, Type};
    // `null` is absent, as for every member of a body.
    ArrayBuilder::new()
        .schema_type(SchemaType::from_iter([Type::Array, Type::Null]))
        .items(utoipa::openapi::Ref::from_schema_name("PlanLimit"))
        .min_items(Some(1))
        .max_items(Some(MAX_LIMITS))
        .description(Some(
            "1 to 8 limits with distinct names; the first applies to every service (no \
             `service`). Each bad field is named with its place, e.g. `limits[1].quota`; a \
             problem of the whole set (two limits of one name, more than 8, a first limit \
             for one service) is named `limits`.",
        ))
        .build()
}

#[derive(Serialize, ToSchema)]
pub struct PlanList {
    pub items: Vec<PlanView>,
}

impl From<LimitSpec> for PlanLimit {
    fn from(s: LimitSpec) -> PlanLimit {
        match (s.quota, s.period) {
            (Some(quota), Some(period)) => PlanLimit::Quota(QuotaLimit {
                name: s.name,
                service: s.service,
                quota,
                period,
                reset: s.reset,
                anchor_day: s.anchor_day,
                time_zone: s.time_zone,
                warn_at: s.warn_at,
            }),
            _ => PlanLimit::Bucket(BucketLimit {
                name: s.name,
                service: s.service,
                capacity: s.capacity.unwrap_or_default(),
                rate: s.rate.unwrap_or_default(),
            }),
        }
    }
}

impl From<PlanRecord> for PlanView {
    fn from(p: PlanRecord) -> PlanView {
        let (limits, headline) = match p.limits() {
            Ok(l) => (
                l.items().iter().map(|l| l.spec().into()).collect(),
                l.headline_bucket(),
            ),
            // A record written by hand past the checks: shown as it is.
            Err(e) => {
                tracing::warn!(plan = %p.name, error = %e, "a stored plan's limits are invalid");
                let limits = p.limits.into_iter().map(PlanLimit::from).collect();
                let headline = p
                    .capacity
                    .zip(p.rate)
                    .and_then(|(c, r)| Bucket::new(c, r).ok());
                (limits, headline)
            }
        };
        PlanView {
            name: p.name.to_string(),
            limits,
            capacity: headline.map(|b| b.capacity()),
            rate: headline.map(|b| b.rate()),
            description: p.description,
            max_connections: p.max_connections,
        }
    }
}

/// The plan `name` a body gives (its `name` member aside), every problem named in `f`.
pub(super) fn plan_record(
    name: PlanName,
    mut input: PlanInput,
    f: &mut Fields,
) -> Option<PlanRecord> {
    let description = f.optional("description", std::mem::take(&mut input.description));
    let max_connections = f.optional(
        "max_connections",
        std::mem::take(&mut input.max_connections),
    );
    let limits = parse_limits(input, f)?;
    Some(
        PlanRecord::new(name, &limits, description.map(String::from))
            .with_max_connections(max_connections),
    )
}

/// A plan's name given in its body (`GET` shows it; a catalog file names each plan so).
pub(super) fn named(input: &mut PlanInput) -> Field<PlanName> {
    std::mem::take(&mut input.name)
}

/// The limits a `PUT` body gives, every problem named in `f`.
fn parse_limits(input: PlanInput, f: &mut Fields) -> Option<Limits> {
    const ONE_OR_OTHER: &str = "give either limits or capacity and rate, not both (beside \
        limits they may only repeat the first bucket for every service, as GET shows it)";
    match input.limits {
        Field::Valid(items) => {
            let limits = limit_set(items, f);
            let capacity = f.optional("capacity", input.capacity);
            let rate = f.optional("rate", input.rate);
            let headline = limits.as_ref().map(|l| l.headline_bucket());
            if let Some(headline) = headline {
                if capacity.is_some_and(|c| headline.map(|b| b.capacity()) != Some(c.get())) {
                    f.bad("capacity", ONE_OR_OTHER);
                }
                if rate.is_some_and(|r| headline.map(|b| b.rate()) != Some(r.get())) {
                    f.bad("rate", ONE_OR_OTHER);
                }
            }
            limits
        }
        Field::Invalid(e) => {
            f.bad("limits", e);
            f.optional("capacity", input.capacity);
            f.optional("rate", input.rate);
            None
        }
        Field::Absent => {
            let mut needed = |field: &str, given: bool| {
                if !given {
                    f.bad(field, "is required (or give limits)");
                }
            };
            needed("capacity", input.capacity.is_given());
            needed("rate", input.rate.is_given());
            let capacity = f.optional("capacity", input.capacity);
            let rate = f.optional("rate", input.rate);
            Some(Limits::single(Bucket::from_parts(capacity?, rate?)))
        }
    }
}

/// `limits`: each limit checked on its own, then the set.
fn limit_set(items: Vec<Value>, f: &mut Fields) -> Option<Limits> {
    let counted = (1..=MAX_LIMITS).contains(&items.len());
    if !counted {
        f.bad("limits", LimitError::Count(items.len()).to_string());
    }
    let before = f.errors.len();
    let parsed: Vec<_> = items
        .into_iter()
        .enumerate()
        .map(|(i, v)| parse_limit(v, &format!("limits[{i}]"), f))
        .collect();
    if f.errors.len() > before || !counted {
        return None;
    }
    match Limits::new(parsed.into_iter().flatten().collect()) {
        Ok(l) => Some(l),
        Err(e) => {
            f.bad("limits", e.to_string());
            None
        }
    }
}

/// One limit at `at` (`limits[i]`), every bad field named `{at}.{field}`.
fn parse_limit(mut value: Value, at: &str, f: &mut Fields) -> Option<crate::domain::Limit> {
    let before = f.errors.len();
    // A limit is written as GET shows it: without nulls (its schema has none).
    if let Value::Object(members) = &mut value {
        members.retain(|k, v| {
            if v.is_null() {
                f.bad(&format!("{at}.{k}"), "must not be null (leave it out)");
            }
            !v.is_null()
        });
    }
    let input: LimitInput = read_member(value, at, f)?;
    let field = |name: &str| format!("{at}.{name}");
    one_kind(&input, at, f);
    let reset = f.optional(&field("reset"), input.reset);
    if input.anchor_day.is_given() && !matches!(reset, Some(ResetRule::Anchor)) {
        f.bad(&field("anchor_day"), "is for reset \"anchor\" only");
    }
    let spec = LimitSpec {
        name: f
            .required(&field("name"), input.name)
            .map(String::from)
            .unwrap_or_default(),
        service: f
            .optional(&field("service"), input.service)
            .map(String::from),
        capacity: f
            .optional(&field("capacity"), input.capacity)
            .map(f64::from),
        rate: f.optional(&field("rate"), input.rate).map(f64::from),
        quota: f.optional(&field("quota"), input.quota).map(f64::from),
        period: f.optional(&field("period"), input.period),
        reset: reset.map(|r| r.as_str().to_string()),
        anchor_day: f
            .optional(&field("anchor_day"), input.anchor_day)
            .map(|d| d.0),
        time_zone: f
            .optional(&field("time_zone"), input.time_zone)
            .map(|t| t.0),
        warn_at: f
            .optional(&field("warn_at"), input.warn_at)
            .unwrap_or_default(),
    };
    if f.errors.len() > before {
        return None;
    }
    crate::domain::Limit::from_spec(&spec)
        .map_err(|e| f.bad(&field(e.field()), e.to_string()))
        .ok()
}

/// Names what makes the limit at `at` neither a bucket nor a quota, or both, judged by
/// the fields given (valid or not): a missing field of its kind, or one of the other's.
fn one_kind(input: &LimitInput, at: &str, f: &mut Fields) {
    let field = |name: &str| format!("{at}.{name}");
    let bucket = input.capacity.is_given() || input.rate.is_given();
    let quota = input.quota.is_given() || input.period.is_given();
    let quota_only = [
        ("reset", input.reset.is_given()),
        ("anchor_day", input.anchor_day.is_given()),
        ("time_zone", input.time_zone.is_given()),
        ("warn_at", input.warn_at.is_given()),
    ];
    match (bucket, quota) {
        (true, true) => f.bad(
            &field(if input.quota.is_given() {
                "quota"
            } else {
                "period"
            }),
            "a limit is either a bucket (capacity and rate) or a quota (quota and period), \
             not both",
        ),
        (true, false) => {
            for (name, given) in [
                ("capacity", input.capacity.is_given()),
                ("rate", input.rate.is_given()),
            ] {
                if !given {
                    f.bad(&field(name), "is required for a bucket (capacity and rate)");
                }
            }
            for (name, _) in quota_only.iter().filter(|(_, given)| *given) {
                f.bad(&field(name), "only a quota has it");
            }
        }
        (false, true) => {
            for (name, given) in [
                ("quota", input.quota.is_given()),
                ("period", input.period.is_given()),
            ] {
                if !given {
                    f.bad(&field(name), "is required for a quota (quota and period)");
                }
            }
        }
        (false, false) => f.bad(
            at,
            "give capacity and rate (a token bucket) or quota and period (a quota)",
        ),
    }
}

fn one(rec: Versioned<PlanRecord>, status: actix_web::http::StatusCode) -> HttpResponse {
    let name = rec.value.name.to_string();
    let mut resp = HttpResponse::build(status);
    resp.insert_header((header::ETAG, etag(rec.rev)));
    if status == actix_web::http::StatusCode::CREATED {
        resp.insert_header((header::LOCATION, format!("/admin/v1/plans/{name}")));
    }
    resp.json(PlanView::from(rec.value))
}

/// List every plan.
#[utoipa::path(operation_id = "listPlans", get, path = "/admin/v1/plans", tag = "plans",
    responses(
        (status = 200, description = "All plans, by name", body = PlanList),
        (status = 401, description = "Missing or invalid token", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "Token lacks admin:read", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn list(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let items = state
        .store
        .catalog
        .plans()
        .await?
        .into_iter()
        .map(|p| PlanView::from(p.value))
        .collect();
    Ok(HttpResponse::Ok().json(PlanList { items }))
}

/// Read one plan.
#[utoipa::path(operation_id = "getPlan", get, path = "/admin/v1/plans/{plan}", tag = "plans",
    params(("plan" = PlanName, Path, description = "Plan name")),
    responses(
        (status = 200, description = "The plan; its ETag is its version", body = PlanView,
            headers(("ETag" = String, description = "Version, for If-Match"))),
        (status = 404, description = "No such plan", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn get(
    state: web::Data<AppState>,
    name: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let name = path_id(&name, PlanName::parse, "plan")?;
    match state.store.catalog.plan(name.as_str()).await? {
        Some(rec) => Ok(one(rec, actix_web::http::StatusCode::OK)),
        None => Err(ApiError::NotFound(format!("no plan {name}"))),
    }
}

/// Create (201) or replace (200) a plan: its `limits` (or the one bucket of `capacity` and
/// `rate`). Takes effect on every gateway within `catalog.refresh_ms`. Clients on the plan
/// keep what they have spent from each limit whose name stays (no free refill); a limit
/// with a new name starts whole.
#[utoipa::path(operation_id = "putPlan", put, path = "/admin/v1/plans/{plan}", tag = "plans",
    params(("plan" = PlanName, Path, description = "Plan name"),
        ("If-Match" = Option<String>, Header, description = "Only if the plan is at this ETag")),
    request_body(content = PlanInput, content_type = "application/json"),
    responses(
        (status = 200, description = "Replaced", body = PlanView),
        (status = 201, description = "Created", body = PlanView),
        (status = 400, description = "Malformed JSON", body = Problem, content_type = "application/problem+json"),
        (status = 412, description = "If-Match no longer matches", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body over 64 KiB", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Invalid fields, each named (`limits[1].quota`, `limits` for the whole set)", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn put(
    req: HttpRequest,
    state: web::Data<AppState>,
    name: web::Path<String>,
    actor: Actor,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let name = path_id(&name, PlanName::parse, "plan")?;
    let (mut input, mut f) = read_body::<PlanInput>(payload).await?;
    f.same_id("name", std::mem::take(&mut input.name), &name);
    let rec = plan_record(name.clone(), input, &mut f);
    f.finish()?;
    let rec = rec.expect("checked");
    let wanted = Preconditions::read(req.headers())?;
    let (written, replaced) = put_over_current(
        "plan",
        &wanted,
        async || Ok(state.store.catalog.plan(name.as_str()).await?),
        // A newer gateway's fields in the plan stay.
        |existing: Option<PlanRecord>| PlanRecord {
            extra: existing.map(|p| p.extra).unwrap_or_default(),
            ..rec.clone()
        },
        async |rec, cond| {
            Ok(state
                .store
                .catalog
                .write(
                    &CatalogWrite::PutPlan(rec.clone(), cond),
                    &Audit::new(&actor.sub, "plan.put"),
                )
                .await?)
        },
    )
    .await?;
    let status = if replaced {
        actix_web::http::StatusCode::OK
    } else {
        actix_web::http::StatusCode::CREATED
    };
    Ok(one(written, status))
}

/// Delete a plan no client uses.
#[utoipa::path(operation_id = "deletePlan", delete, path = "/admin/v1/plans/{plan}", tag = "plans",
    params(("plan" = PlanName, Path, description = "Plan name"),
        ("If-Match" = Option<String>, Header, description = "Only if the plan is at this ETag")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, description = "No such plan", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Clients still use it", body = Problem, content_type = "application/problem+json"),
        (status = 412, description = "If-Match no longer matches", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn delete(
    req: HttpRequest,
    state: web::Data<AppState>,
    name: web::Path<String>,
    actor: Actor,
) -> Result<HttpResponse, ApiError> {
    let name = path_id(&name, PlanName::parse, "plan")?;
    let cond = condition(&req, "plan", || async {
        Ok(state
            .store
            .catalog
            .plan(name.as_str())
            .await?
            .map(|p| p.rev))
    })
    .await?;
    match state
        .store
        .catalog
        .write(
            &CatalogWrite::DeletePlan(name.clone(), cond),
            &Audit::new(&actor.sub, "plan.delete"),
        )
        .await?
    {
        WriteOutcome::Written { .. } => Ok(HttpResponse::NoContent().finish()),
        WriteOutcome::Missing if cond == Condition::Any => {
            Err(ApiError::NotFound(format!("no plan {name}")))
        }
        other => Err(super::shared::refusal(other, "plan")),
    }
}
