//! A plan is a set of limits: token buckets and quotas, some for one service only. This
//! module holds them and what applies to a request ([`Applied`]); the arithmetic that
//! decides a request against every limit that applies to it at once is the engine's
//! (`tollgate_engine::limits::take`), re-exported here.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::ids::{IdError, LimitName, ServiceName};
pub use tollgate_engine::limits::{
    levels_at, spend_takes, take_many, Applied, AppliedKind, Level, LimitState, Ruling, MIN_TOKENS,
};
use tollgate_engine::limits::{Bucket, Period, PlanError, QuotaClock, QuotaError, Reset};

/// Most limits one plan holds.
pub const MAX_LIMITS: usize = 8;
pub const MIN_QUOTA: f64 = 1.0;
/// Counts stay exact integers in an `f64` and a Lua number (< 2^53).
pub const MAX_QUOTA: f64 = 1e15;
/// The name a plan given as one `capacity` and `rate` gives its bucket. Its state lives in
/// the fields a single-bucket plan always used (`tk`, `ts`), so gateways of either kind
/// agree on it during an upgrade.
pub const DEFAULT_LIMIT: &str = "default";

/// Why a limit or a set of limits was refused; [`LimitError::field`] names the field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LimitError {
    #[error(transparent)]
    Bucket(#[from] PlanError),
    #[error(transparent)]
    Quota(#[from] QuotaError),
    #[error("quota must be a finite number between {MIN_QUOTA} and {MAX_QUOTA:e} (got {0})")]
    Amount(f64),
    #[error("{0}")]
    Name(#[from] IdError),
    #[error("{0}")]
    Service(IdError),
    #[error("a limit is either a bucket (capacity and rate) or a quota (quota and period)")]
    Kind,
    #[error("reset must be \"calendar\", \"anchor\" or \"rolling\" (got {0:?})")]
    Reset(String),
    #[error("an anchored reset needs anchor_day")]
    AnchorMissing,
    #[error("a plan needs 1 to {MAX_LIMITS} limits (got {0})")]
    Count(usize),
    #[error("two limits are named {0:?}")]
    Duplicate(String),
    #[error("the first limit applies to every service (no service)")]
    FirstScoped,
    #[error("{0}")]
    WarnAt(String),
}

impl LimitError {
    /// The field of a limit (or `limits`) the error is about.
    pub fn field(&self) -> &'static str {
        match self {
            LimitError::Bucket(e) => e.field(),
            LimitError::Quota(e) => e.field(),
            LimitError::Amount(_) => "quota",
            LimitError::Name(_) => "name",
            LimitError::Service(_) => "service",
            LimitError::Kind => "quota",
            LimitError::Reset(_) => "reset",
            LimitError::AnchorMissing => "anchor_day",
            LimitError::WarnAt(_) => "warn_at",
            LimitError::Count(_) | LimitError::Duplicate(_) | LimitError::FirstScoped => "limits",
        }
    }
}

/// Checks a limit's `warn_at`: percentages 1-100 of a quota, distinct, at most
/// [`MAX_WARNINGS`]; sorted.
fn warnings(given: &[i64], kind: &LimitKind) -> Result<Arc<[u8]>, LimitError> {
    if given.is_empty() {
        return Ok(Arc::from([]));
    }
    if matches!(kind, LimitKind::Bucket(_)) {
        return Err(LimitError::WarnAt(
            "only a quota warns (a bucket refills as it is used)".into(),
        ));
    }
    if given.len() > MAX_WARNINGS {
        return Err(LimitError::WarnAt(format!(
            "at most {MAX_WARNINGS} warnings a quota"
        )));
    }
    let mut out = Vec::with_capacity(given.len());
    for &p in given {
        let p = u8::try_from(p)
            .ok()
            .filter(|p| (1..=100).contains(p))
            .ok_or_else(|| LimitError::WarnAt(format!("percentages are 1-100 (got {p})")))?;
        if out.contains(&p) {
            return Err(LimitError::WarnAt(format!("{p} is given twice")));
        }
        out.push(p);
    }
    out.sort_unstable();
    Ok(Arc::from(out))
}

/// `amount` per window of a [`QuotaClock`].
#[derive(Debug, Clone, PartialEq)]
pub struct Quota {
    amount: f64,
    /// Shared: every request to the plan carries it, and a clock holds its zone's name.
    clock: Arc<QuotaClock>,
}

impl Quota {
    pub fn new(amount: f64, clock: QuotaClock) -> Result<Quota, LimitError> {
        Ok(Quota {
            amount: Quota::check(amount)?,
            clock: Arc::new(clock),
        })
    }

    fn check(amount: f64) -> Result<f64, LimitError> {
        if amount.is_finite() && (MIN_QUOTA..=MAX_QUOTA).contains(&amount) {
            Ok(amount)
        } else {
            Err(LimitError::Amount(amount))
        }
    }

    pub fn amount(&self) -> f64 {
        self.amount
    }

    pub fn clock(&self) -> &QuotaClock {
        &self.clock
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum LimitKind {
    Bucket(Bucket),
    Quota(Quota),
}

/// One limit: a bucket or a quota, for every service or only `service`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "LimitSpec", into = "LimitSpec")]
pub struct Limit {
    name: LimitName,
    service: Option<ServiceName>,
    kind: LimitKind,
    /// Where its state lives in the client's hash: `""` for [`DEFAULT_LIMIT`], else `name:`.
    field: Arc<str>,
    /// A quota's warnings: the percentages of it whose crossing is announced, ascending.
    warn_at: Arc<[u8]>,
}

/// Most warnings one quota names.
pub const MAX_WARNINGS: usize = 4;

/// A limit as it is written (TOML, JSON, the store): flat, every field optional, checked by
/// [`Limit::from_spec`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LimitSpec {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quota: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub period: Option<Period>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reset: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub anchor_day: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_zone: Option<String>,
    /// A quota's warnings, in percent of it (1-100, at most [`MAX_WARNINGS`], distinct).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warn_at: Vec<i64>,
}

impl TryFrom<LimitSpec> for Limit {
    type Error = LimitError;
    fn try_from(s: LimitSpec) -> Result<Limit, LimitError> {
        Limit::from_spec(&s)
    }
}

impl From<Limit> for LimitSpec {
    fn from(l: Limit) -> LimitSpec {
        l.spec()
    }
}

impl Limit {
    pub fn new(name: LimitName, service: Option<ServiceName>, kind: LimitKind) -> Limit {
        let field = if name.as_str() == DEFAULT_LIMIT {
            Arc::from("")
        } else {
            Arc::from(format!("{name}:"))
        };
        Limit {
            name,
            service,
            kind,
            field,
            warn_at: Arc::from([]),
        }
    }

    /// The one bucket of a plan given as `capacity` and `rate`.
    pub fn default_bucket(bucket: Bucket) -> Limit {
        let name = LimitName::parse(DEFAULT_LIMIT).expect("a valid name");
        Limit::new(name, None, LimitKind::Bucket(bucket))
    }

    /// Checks a written limit; the first problem found, by field.
    pub fn from_spec(s: &LimitSpec) -> Result<Limit, LimitError> {
        let name = LimitName::parse(&s.name)?;
        let service = s
            .service
            .as_deref()
            .map(ServiceName::parse)
            .transpose()
            .map_err(LimitError::Service)?;
        let kind = match (s.capacity, s.rate, s.quota, s.period) {
            (Some(c), Some(r), None, None)
                if s.reset.is_none() && s.anchor_day.is_none() && s.time_zone.is_none() =>
            {
                LimitKind::Bucket(Bucket::new(c, r)?)
            }
            (None, None, Some(q), Some(period)) => {
                let reset = match (s.reset.as_deref().unwrap_or("calendar"), s.anchor_day) {
                    ("calendar", None) => Reset::Calendar,
                    ("rolling", None) => Reset::Rolling,
                    ("anchor", Some(d)) => {
                        Reset::Anchor(u8::try_from(d).map_err(|_| QuotaError::AnchorDay(d))?)
                    }
                    ("anchor", None) => return Err(LimitError::AnchorMissing),
                    ("calendar" | "rolling", Some(_)) => {
                        return Err(LimitError::Reset(
                            "anchor_day given without reset \"anchor\"".into(),
                        ))
                    }
                    (other, _) => return Err(LimitError::Reset(other.to_string())),
                };
                let clock =
                    QuotaClock::new(period, reset, s.time_zone.as_deref().unwrap_or("UTC"))?;
                LimitKind::Quota(Quota::new(q, clock)?)
            }
            (None, Some(_), _, _) => return Err(PlanError::Capacity(f64::NAN).into()),
            (Some(_), None, None, None) => return Err(PlanError::Rate(f64::NAN).into()),
            _ => return Err(LimitError::Kind),
        };
        let warn_at = warnings(&s.warn_at, &kind)?;
        Ok(Limit {
            warn_at,
            ..Limit::new(name, service, kind)
        })
    }

    /// A quota's warnings, in percent of it, ascending (none for a bucket).
    pub fn warn_at(&self) -> &[u8] {
        &self.warn_at
    }

    /// The limit as written.
    pub fn spec(&self) -> LimitSpec {
        let mut s = LimitSpec {
            name: self.name.to_string(),
            service: self.service.as_ref().map(|s| s.to_string()),
            warn_at: self.warn_at.iter().map(|&p| i64::from(p)).collect(),
            ..LimitSpec::default()
        };
        match &self.kind {
            LimitKind::Bucket(b) => {
                s.capacity = Some(b.capacity());
                s.rate = Some(b.rate());
            }
            LimitKind::Quota(q) => {
                s.quota = Some(q.amount);
                s.period = Some(q.clock.period());
                let (reset, anchor) = match q.clock.reset() {
                    Reset::Calendar => ("calendar", None),
                    Reset::Rolling => ("rolling", None),
                    Reset::Anchor(d) => ("anchor", Some(d as i64)),
                };
                s.reset = Some(reset.into());
                s.anchor_day = anchor;
                s.time_zone = Some(q.clock.time_zone().to_string());
            }
        }
        s
    }

    pub fn name(&self) -> &LimitName {
        &self.name
    }

    pub fn service(&self) -> Option<&ServiceName> {
        self.service.as_ref()
    }

    pub fn kind(&self) -> &LimitKind {
        &self.kind
    }

    pub fn field(&self) -> &Arc<str> {
        &self.field
    }

    /// Whether a request to `service` takes from this limit.
    pub fn applies_to(&self, service: &str) -> bool {
        self.service.as_ref().is_none_or(|s| s.as_str() == service)
    }

    /// The same limit with other values (an override); `None` values keep the plan's.
    pub fn with_values(
        &self,
        capacity: Option<f64>,
        rate: Option<f64>,
        quota: Option<f64>,
    ) -> Result<Limit, LimitError> {
        let kind = match &self.kind {
            LimitKind::Bucket(b) => LimitKind::Bucket(Bucket::new(
                capacity.unwrap_or(b.capacity()),
                rate.unwrap_or(b.rate()),
            )?),
            LimitKind::Quota(q) => {
                // The clock is shared, not rebuilt: an override changes the amount only.
                LimitKind::Quota(Quota {
                    amount: Quota::check(quota.unwrap_or(q.amount))?,
                    clock: Arc::clone(&q.clock),
                })
            }
        };
        Ok(Limit {
            kind,
            ..self.clone()
        })
    }

    /// Whether a request costing `cost` can ever be admitted.
    pub fn can_hold(&self, cost: f64) -> bool {
        match &self.kind {
            LimitKind::Bucket(b) => cost <= b.capacity(),
            LimitKind::Quota(q) => cost <= q.amount,
        }
    }
}

/// A plan's limits: 1 to [`MAX_LIMITS`], distinct names, the first for every service.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "Vec<Limit>", into = "Vec<Limit>")]
pub struct Limits {
    items: Vec<Limit>,
}

impl TryFrom<Vec<Limit>> for Limits {
    type Error = LimitError;
    fn try_from(v: Vec<Limit>) -> Result<Limits, LimitError> {
        Limits::new(v)
    }
}

impl From<Limits> for Vec<Limit> {
    fn from(l: Limits) -> Vec<Limit> {
        l.items
    }
}

impl Limits {
    pub fn new(items: Vec<Limit>) -> Result<Limits, LimitError> {
        if items.is_empty() || items.len() > MAX_LIMITS {
            return Err(LimitError::Count(items.len()));
        }
        if items[0].service.is_some() {
            return Err(LimitError::FirstScoped);
        }
        for (i, l) in items.iter().enumerate() {
            if items[..i].iter().any(|o| o.name == l.name) {
                return Err(LimitError::Duplicate(l.name.to_string()));
            }
        }
        Ok(Limits { items })
    }

    /// One bucket, the plan of ADR-002.
    pub fn single(bucket: Bucket) -> Limits {
        Limits {
            items: vec![Limit::default_bucket(bucket)],
        }
    }

    pub fn items(&self) -> &[Limit] {
        &self.items
    }

    pub fn get(&self, name: &str) -> Option<&Limit> {
        self.items.iter().find(|l| l.name.as_str() == name)
    }

    /// The first bucket for every service: what the coarse safety limit scales.
    pub fn headline_bucket(&self) -> Option<Bucket> {
        self.items.iter().find_map(|l| match (&l.kind, &l.service) {
            (LimitKind::Bucket(b), None) => Some(*b),
            _ => None,
        })
    }

    pub fn has_quotas(&self) -> bool {
        self.items
            .iter()
            .any(|l| matches!(l.kind, LimitKind::Quota(_)))
    }

    /// Whether some limit applies to one service only (then which limits apply depends on
    /// the service).
    pub fn has_scoped(&self) -> bool {
        self.items.iter().any(|l| l.service.is_some())
    }

    /// The limits a request to `service` takes from (`None`: those for every service).
    pub fn applied(&self, service: Option<&str>) -> Vec<Applied> {
        self.items
            .iter()
            .enumerate()
            .filter(|(_, l)| match service {
                Some(s) => l.applies_to(s),
                None => l.service.is_none(),
            })
            .map(|(i, l)| l.applied(i))
            .collect()
    }

    /// Every limit, as one request would see them all (to read every limit's state).
    pub fn every(&self) -> Vec<Applied> {
        self.items
            .iter()
            .enumerate()
            .map(|(i, l)| l.applied(i))
            .collect()
    }

    /// These limits with `f` applied to the named ones (an override's values).
    pub fn replaced(&self, f: impl Fn(&Limit) -> Option<Limit>) -> Limits {
        Limits {
            items: self
                .items
                .iter()
                .map(|l| f(l).unwrap_or(l.clone()))
                .collect(),
        }
    }
}

/// A client's own values for one of its plan's limits, optionally until a time (a
/// temporary raise). Values left out keep the plan's; an override of a limit the plan no
/// longer has does nothing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Override {
    /// The plan's limit it changes.
    #[schema(value_type = String, example = "burst")]
    pub limit: LimitName,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(example = 400)]
    pub capacity: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quota: Option<f64>,
    /// Until when it holds, in unix seconds; absent: until removed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until: Option<u64>,
}

impl Override {
    /// Whether it still holds at `now_s` (unix seconds).
    pub fn active(&self, now_s: u64) -> bool {
        self.until.is_none_or(|u| now_s < u)
    }
}

impl Limits {
    /// These limits with the overrides that hold at `now_s` applied.
    pub fn overridden(&self, overrides: &[Override], now_s: u64) -> Limits {
        self.replaced(|l| {
            let o = overrides
                .iter()
                .find(|o| o.limit == l.name && o.active(now_s))?;
            l.with_values(o.capacity, o.rate, o.quota).ok()
        })
    }

    /// Checks an override against these limits: the limit exists, and the values fit its
    /// kind and bounds. The error names the field.
    pub fn check_override(&self, o: &Override) -> Result<(), OverrideError> {
        let refuse = |field: &'static str, message: String| Err(OverrideError { field, message });
        let Some(limit) = self.get(o.limit.as_str()) else {
            return refuse(
                "limit",
                format!("the plan has no limit {:?}", o.limit.as_str()),
            );
        };
        match (&limit.kind, o.quota, o.capacity.or(o.rate)) {
            (LimitKind::Bucket(_), Some(_), _) => {
                return refuse(
                    "quota",
                    "this limit is a bucket: give capacity or rate".into(),
                )
            }
            (LimitKind::Quota(_), _, Some(_)) => {
                let f = if o.capacity.is_some() {
                    "capacity"
                } else {
                    "rate"
                };
                return refuse(f, "this limit is a quota: give quota".into());
            }
            _ => {}
        }
        if o.capacity.is_none() && o.rate.is_none() && o.quota.is_none() {
            return refuse("limit", "an override changes at least one value".into());
        }
        limit
            .with_values(o.capacity, o.rate, o.quota)
            .map(|_| ())
            .map_err(|e| OverrideError {
                field: e.field(),
                message: e.to_string(),
            })
    }
}

/// Why an override does not fit its plan's limits, naming the field at fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverrideError {
    pub field: &'static str,
    pub message: String,
}

impl Limit {
    /// This limit as a request sees it, at `index` among its plan's limits.
    pub fn applied(&self, index: usize) -> Applied {
        Applied {
            index,
            name: self.name.shared(),
            field: Arc::clone(&self.field),
            kind: match &self.kind {
                LimitKind::Bucket(b) => AppliedKind::Bucket {
                    bucket: *b,
                    initial: None,
                },
                LimitKind::Quota(q) => AppliedKind::Quota {
                    amount: q.amount,
                    clock: Arc::clone(&q.clock),
                },
            },
        }
    }
}

/// A limit's `RateLimit-Policy` item: `q`, the most it holds, and `w`, the seconds an empty
/// bucket takes to fill (or a quota's nominal window).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicyItem {
    pub quota: u64,
    pub window_secs: u64,
}

impl PolicyItem {
    /// The item of the limit `applied`.
    pub fn of(applied: &Applied) -> PolicyItem {
        match &applied.kind {
            AppliedKind::Bucket { bucket, .. } => PolicyItem {
                quota: bucket.capacity().floor() as u64,
                window_secs: bucket.window_secs().ceil() as u64,
            },
            AppliedKind::Quota { amount, clock } => PolicyItem {
                quota: amount.floor() as u64,
                window_secs: clock.nominal_secs(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bucket(name: &str, capacity: f64, rate: f64) -> Limit {
        Limit::new(
            LimitName::parse(name).unwrap(),
            None,
            LimitKind::Bucket(Bucket::new(capacity, rate).unwrap()),
        )
    }

    fn daily(name: &str, amount: f64) -> Limit {
        let clock = QuotaClock::new(Period::Day, Reset::Calendar, "UTC").unwrap();
        Limit::new(
            LimitName::parse(name).unwrap(),
            None,
            LimitKind::Quota(Quota::new(amount, clock).unwrap()),
        )
    }

    #[test]
    fn plans_refuse_bad_sets_by_name() {
        let dup = Limits::new(vec![bucket("a", 1.0, 1.0), bucket("a", 2.0, 1.0)]);
        assert_eq!(dup.unwrap_err().field(), "limits");
        assert_eq!(Limits::new(vec![]).unwrap_err().field(), "limits");
        let spec = LimitSpec {
            name: "m".into(),
            quota: Some(0.0),
            period: Some(Period::Month),
            ..LimitSpec::default()
        };
        assert_eq!(Limit::from_spec(&spec).unwrap_err().field(), "quota");
        let spec = LimitSpec {
            name: "m".into(),
            capacity: Some(1.0),
            ..LimitSpec::default()
        };
        assert_eq!(Limit::from_spec(&spec).unwrap_err().field(), "rate");
    }

    #[test]
    fn limits_round_trip_through_their_written_form() {
        let l = Limits::new(vec![bucket("default", 200.0, 100.0), daily("day", 1e6)]).unwrap();
        let json = serde_json::to_string(&l).unwrap();
        assert_eq!(serde_json::from_str::<Limits>(&json).unwrap(), l);
        assert_eq!(&*l.items()[0].field, "");
        assert_eq!(&*l.items()[1].field, "day:");
    }
}
