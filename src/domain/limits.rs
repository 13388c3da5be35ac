//! A plan is a set of limits: token buckets and quotas, some for one service only. This
//! module holds them and the arithmetic that decides a request against every limit that
//! applies to it at once: a request any limit refuses spends from none. `lua/bucket.lua`
//! runs the same operations in the same order, so the embedded store and Redis decide
//! identically and the gateway can replay a batch of takes from the levels Redis returns.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::ids::{IdError, LimitName, ServiceName};
use tollgate_engine::limits::bucket::{self, BucketState};
use tollgate_engine::limits::{
    window_end, Bucket, Period, PlanError, QuotaClock, QuotaError, Reset, MAX_CAPACITY,
};

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
            LimitError::Count(_) | LimitError::Duplicate(_) | LimitError::FirstScoped => "limits",
        }
    }
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
}

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
        Ok(Limit::new(name, service, kind))
    }

    /// The limit as written.
    pub fn spec(&self) -> LimitSpec {
        let mut s = LimitSpec {
            name: self.name.to_string(),
            service: self.service.as_ref().map(|s| s.to_string()),
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
            .map(|(i, l)| Applied::of(i, l))
            .collect()
    }

    /// Every limit, as one request would see them all (to read every limit's state).
    pub fn every(&self) -> Vec<Applied> {
        self.items
            .iter()
            .enumerate()
            .map(|(i, l)| Applied::of(i, l))
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

/// One limit as one request sees it: its state's place and the values it is decided with
/// (a regional shard's portion of a bucket, a seed for a bucket that does not exist yet).
#[derive(Debug, Clone, PartialEq)]
pub struct Applied {
    /// Its index among the plan's limits (the first speaks for the plan in headers).
    pub index: usize,
    pub name: LimitName,
    pub field: Arc<str>,
    pub kind: AppliedKind,
}

#[derive(Debug, Clone, PartialEq)]
pub enum AppliedKind {
    Bucket {
        bucket: Bucket,
        /// Tokens a bucket that does not exist yet starts with (default: full).
        initial: Option<f64>,
    },
    Quota {
        amount: f64,
        clock: Arc<QuotaClock>,
    },
}

impl Applied {
    pub fn of(index: usize, limit: &Limit) -> Applied {
        Applied {
            index,
            name: limit.name.clone(),
            field: Arc::clone(&limit.field),
            kind: match &limit.kind {
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

    /// The most it can hold: a request costing more is never admitted.
    pub fn ceiling(&self) -> f64 {
        match &self.kind {
            AppliedKind::Bucket { bucket, .. } => bucket.capacity(),
            AppliedKind::Quota { amount, .. } => *amount,
        }
    }

    /// Its `RateLimit-Policy` item's values.
    pub fn policy(&self) -> PolicyItem {
        match &self.kind {
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

/// A limit's `RateLimit-Policy` item: `q`, the most it holds, and `w`, the seconds an empty
/// bucket takes to fill (or a quota's nominal window).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicyItem {
    pub quota: u64,
    pub window_secs: u64,
}

/// A limit's stored state.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LimitState {
    Bucket(BucketState),
    /// `used` of the quota in the window that ends at `end_us`.
    Quota {
        used: f64,
        end_us: u64,
    },
}

/// A limit's level at one instant, before any take: a bucket's tokens after refilling, a
/// quota's count in the window the instant falls in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Level {
    Tokens(f64),
    Used { used: f64, end_us: u64 },
}

/// The lowest a balance can go with costs debited after the response: minus the largest
/// capacity, so an empty bucket's refill time stays within 2e12 s (exact in ms).
pub const MIN_TOKENS: f64 = -MAX_CAPACITY;

impl Level {
    /// The level of a limit at `now_us`, from its stored state (`None`: never used, or
    /// forgotten since it was full / its window ended).
    pub fn at(kind: &AppliedKind, state: Option<LimitState>, now_us: u64) -> Level {
        match kind {
            AppliedKind::Bucket { bucket, initial } => {
                let state = match state {
                    Some(LimitState::Bucket(s)) => Some(s),
                    _ => None,
                };
                Level::Tokens(bucket::refill(state, now_us, *bucket, *initial))
            }
            AppliedKind::Quota { clock, .. } => {
                let bounds = clock.bounds(now_us);
                match state {
                    Some(LimitState::Quota { used, end_us }) if now_us < end_us => {
                        Level::Used { used, end_us }
                    }
                    _ => Level::Used {
                        used: 0.0,
                        end_us: window_end(bounds, None, now_us),
                    },
                }
            }
        }
    }

    fn fits(&self, kind: &AppliedKind, cost: f64) -> bool {
        match (self, kind) {
            (Level::Tokens(t), _) => *t >= cost,
            (Level::Used { used, .. }, AppliedKind::Quota { amount, .. }) => used + cost <= *amount,
            (Level::Used { .. }, _) => false,
        }
    }

    /// Until `cost` fits: `None` when it never can.
    fn wait_us(&self, kind: &AppliedKind, cost: f64, now_us: u64) -> Option<u64> {
        if self.fits(kind, cost) {
            return Some(0);
        }
        match (self, kind) {
            (Level::Tokens(t), AppliedKind::Bucket { bucket, .. }) => (cost <= bucket.capacity())
                .then(|| ((cost - t) / bucket.rate() * 1_000_000.0).ceil() as u64),
            (Level::Used { end_us, .. }, AppliedKind::Quota { amount, .. }) => {
                (cost <= *amount).then(|| end_us.saturating_sub(now_us))
            }
            _ => None,
        }
    }

    fn spend(&mut self, cost: f64) {
        match self {
            Level::Tokens(t) => *t -= cost,
            Level::Used { used, .. } => *used += cost,
        }
    }

    /// Debits `delta` (a refund when negative) whatever the balance: a bucket may go below
    /// zero (down to [`MIN_TOKENS`]) and waits it off; a quota's count never below zero.
    pub fn adjust(&mut self, kind: &AppliedKind, delta: f64) {
        match (self, kind) {
            (Level::Tokens(t), AppliedKind::Bucket { bucket, .. }) => {
                *t = (*t - delta).clamp(MIN_TOKENS, bucket.capacity())
            }
            (Level::Used { used, .. }, AppliedKind::Quota { amount, .. }) => {
                *used = (*used + delta).clamp(0.0, 2.0 * amount)
            }
            _ => {}
        }
    }

    /// What is left: tokens, or the quota less its count.
    pub fn remaining(&self, kind: &AppliedKind) -> f64 {
        match (self, kind) {
            (Level::Tokens(t), _) => *t,
            (Level::Used { used, .. }, AppliedKind::Quota { amount, .. }) => amount - used,
            (Level::Used { .. }, _) => 0.0,
        }
    }

    /// Microseconds until it is whole again: a bucket full, a quota's window over.
    pub fn reset_us(&self, kind: &AppliedKind, now_us: u64) -> u64 {
        match (self, kind) {
            (Level::Tokens(t), AppliedKind::Bucket { bucket, .. }) => {
                ((bucket.capacity() - t).max(0.0) / bucket.rate() * 1_000_000.0).ceil() as u64
            }
            (Level::Used { end_us, .. }, _) => end_us.saturating_sub(now_us),
            _ => 0,
        }
    }

    /// The state to store for this level at `now_us`.
    pub fn state(&self, now_us: u64) -> LimitState {
        match *self {
            Level::Tokens(tokens) => LimitState::Bucket(BucketState {
                tokens,
                ts_us: now_us,
            }),
            Level::Used { used, end_us } => LimitState::Quota { used, end_us },
        }
    }

    /// How long its state must be kept: until a bucket would be full (it then starts full
    /// anyway), until a quota's window ends; one second of slack, as in the script.
    pub fn keep_ms(&self, kind: &AppliedKind, now_us: u64) -> u64 {
        match (self, kind) {
            (Level::Tokens(t), AppliedKind::Bucket { bucket, .. }) => {
                bucket::idle_expiry_ms(*bucket, *t)
            }
            (Level::Used { end_us, .. }, _) => end_us.saturating_sub(now_us).div_ceil(1000) + 1000,
            _ => 1000,
        }
    }
}

/// The answer for one request against all the limits that apply to it.
#[derive(Debug, Clone, PartialEq)]
pub struct Ruling {
    pub allowed: bool,
    /// Each limit's level after this request, in the order of the applied limits.
    pub levels: Vec<Level>,
    /// Until every limit that refused would admit: zero when allowed, `None` when some
    /// limit can never hold the cost.
    pub wait_us: Option<u64>,
    /// The first limit that refused (index among the applied limits).
    pub refused_by: Option<usize>,
    /// The store's clock when it decided, in unix microseconds.
    pub now_us: u64,
    /// Requests decided by the same store call as this one (itself included); 0 when no
    /// call was made (the embedded store, a refusal decided in the gateway).
    pub batch: u32,
}

impl Ruling {
    /// The applied limit closest to refusing: the one that refused, else the one with the
    /// least left (on a tie, the one that takes longest to be whole again).
    pub fn tightest(&self, applied: &[Applied]) -> Option<usize> {
        if let Some(i) = self.refused_by {
            return Some(i);
        }
        (0..applied.len().min(self.levels.len())).min_by(|&a, &b| {
            let ra = self.levels[a].remaining(&applied[a].kind);
            let rb = self.levels[b].remaining(&applied[b].kind);
            ra.total_cmp(&rb).then_with(|| {
                let ta = self.levels[a].reset_us(&applied[a].kind, self.now_us);
                let tb = self.levels[b].reset_us(&applied[b].kind, self.now_us);
                tb.cmp(&ta)
            })
        })
    }
}

/// `n` takes of `cost` at one instant, in order, from `levels`: each admitted only if every
/// limit holds the cost, and then spent from all of them. What `n` separate calls at that
/// instant decide; the script does the same, so replaying its levels here gives each
/// request its exact answer. Once one is refused the rest are too (same cost, no refill).
pub fn take_many(
    applied: &[Applied],
    mut levels: Vec<Level>,
    cost: f64,
    n: usize,
    now_us: u64,
) -> Vec<Ruling> {
    let mut rulings = Vec::with_capacity(n);
    for i in 0..n {
        let refused_by = take_one(applied, &mut levels, cost);
        let wait_us = match refused_by {
            None => Some(0),
            Some(_) => applied
                .iter()
                .zip(&levels)
                .map(|(a, l)| l.wait_us(&a.kind, cost, now_us))
                .try_fold(0u64, |m, w| w.map(|w| m.max(w))),
        };
        rulings.push(Ruling {
            allowed: refused_by.is_none(),
            // The last take keeps the levels themselves (most calls decide one).
            levels: if i + 1 == n {
                std::mem::take(&mut levels)
            } else {
                levels.clone()
            },
            wait_us,
            refused_by,
            now_us,
            batch: 0,
        });
    }
    rulings
}

/// Spends from `levels` what [`take_many`] would admit of `k` takes of `cost`, without
/// their rulings: the levels the take after them sees.
pub fn spend_takes(applied: &[Applied], levels: &mut [Level], cost: f64, k: usize) {
    for _ in 0..k {
        if take_one(applied, levels, cost).is_some() {
            // Refused, and so is every later one (same cost, no refill): nothing spent.
            return;
        }
    }
}

/// One take of `cost`: spent from every limit if each holds it, else from none; the
/// first limit that refused it, if one did.
fn take_one(applied: &[Applied], levels: &mut [Level], cost: f64) -> Option<usize> {
    let refused_by = applied
        .iter()
        .zip(levels.iter())
        .position(|(a, l)| !l.fits(&a.kind, cost));
    if refused_by.is_none() {
        for l in levels.iter_mut() {
            l.spend(cost);
        }
    }
    refused_by
}

/// The levels of `applied` at `now_us` from their stored states (in the same order).
pub fn levels_at(applied: &[Applied], states: &[Option<LimitState>], now_us: u64) -> Vec<Level> {
    applied
        .iter()
        .zip(states.iter().copied().chain(std::iter::repeat(None)))
        .map(|(a, s)| Level::at(&a.kind, s, now_us))
        .collect()
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

    fn applied(limits: &[Limit]) -> Vec<Applied> {
        limits
            .iter()
            .enumerate()
            .map(|(i, l)| Applied::of(i, l))
            .collect()
    }

    const NOON: u64 = 1_796_126_400_000_000; // 2026-12-01T12:00:00Z

    #[test]
    fn a_request_refused_by_one_limit_spends_from_none() {
        let a = applied(&[bucket("burst", 5.0, 1.0), daily("day", 3.0)]);
        let levels = levels_at(&a, &[], NOON);
        let r = take_many(&a, levels, 1.0, 5, NOON);
        assert_eq!(
            r.iter().map(|r| r.allowed).collect::<Vec<_>>(),
            [true, true, true, false, false]
        );
        // Each ruling holds the levels after its own take; the bucket kept the two tokens
        // the refused requests did not take.
        assert_eq!(r[0].levels[0], Level::Tokens(4.0));
        assert_eq!(r[2].levels[0], Level::Tokens(2.0));
        assert_eq!(r[4].levels[0], Level::Tokens(2.0));
        assert_eq!(r[4].refused_by, Some(1));
        // A quota refuses until its window ends: midnight.
        assert_eq!(r[4].wait_us, Some(12 * 3600 * 1_000_000));
    }

    /// A take that joined others of its client in one script call replays theirs first:
    /// whatever their number, it gets what it would have got among them.
    #[test]
    fn takes_spent_without_rulings_leave_what_their_rulings_would_have() {
        let a = applied(&[bucket("burst", 5.0, 1.0), daily("day", 3.0)]);
        for cost in [1.0, 2.0] {
            let all = take_many(&a, levels_at(&a, &[], NOON), cost, 6, NOON);
            for skip in 0..6 {
                let mut levels = levels_at(&a, &[], NOON);
                spend_takes(&a, &mut levels, cost, skip);
                let rest = take_many(&a, levels, cost, 6 - skip, NOON);
                assert_eq!(rest, all[skip..], "cost {cost}, {skip} before");
            }
        }
    }

    #[test]
    fn the_wait_is_until_every_refusing_limit_admits() {
        let a = applied(&[bucket("burst", 2.0, 1.0), bucket("slow", 2.0, 0.5)]);
        let levels = vec![Level::Tokens(0.0), Level::Tokens(0.0)];
        let r = take_many(&a, levels, 1.0, 1, NOON);
        assert_eq!(r[0].wait_us, Some(2_000_000));
        assert_eq!(r[0].refused_by, Some(0));
    }

    #[test]
    fn a_cost_one_limit_can_never_hold_is_never_admitted() {
        let a = applied(&[bucket("burst", 100.0, 1.0), daily("day", 3.0)]);
        let r = take_many(&a, levels_at(&a, &[], NOON), 4.0, 1, NOON);
        assert_eq!(r[0].wait_us, None);
    }

    #[test]
    fn a_quota_starts_over_when_its_window_ends() {
        let a = applied(&[daily("day", 3.0)]);
        let end = NOON + 12 * 3600 * 1_000_000;
        let full = Some(LimitState::Quota {
            used: 3.0,
            end_us: end,
        });
        assert!(!take_many(&a, levels_at(&a, &[full], end - 1), 1.0, 1, end - 1)[0].allowed);
        let r = take_many(&a, levels_at(&a, &[full], end), 1.0, 1, end);
        assert!(r[0].allowed);
        assert_eq!(
            r[0].levels[0],
            Level::Used {
                used: 1.0,
                end_us: end + 24 * 3600 * 1_000_000
            }
        );
    }

    #[test]
    fn a_debit_after_the_response_can_take_a_bucket_below_zero() {
        let a = applied(&[bucket("burst", 10.0, 1.0), daily("day", 100.0)]);
        let mut levels = levels_at(&a, &[], NOON);
        for (l, a) in levels.iter_mut().zip(&a) {
            l.adjust(&a.kind, 14.0);
        }
        assert_eq!(levels[0], Level::Tokens(-4.0));
        assert_eq!(levels[0].reset_us(&a[0].kind, NOON), 14_000_000);
        let r = take_many(&a, levels.clone(), 1.0, 1, NOON);
        assert_eq!(r[0].wait_us, Some(5_000_000));
        // A refund never takes a quota's count below zero.
        levels[1].adjust(&a[1].kind, -1000.0);
        assert_eq!(levels[1].remaining(&a[1].kind), 100.0);
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
