//! Prometheus metrics: plain atomics on the request path, summed and written as text on
//! scrape by [`Exposition`], the one writer of the `/metrics` text (this module's
//! families, and those `ops` and the route table add). No label carries a client id or an
//! API key.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;

pub use crate::domain::FailOpenReason;
use crate::domain::Outcome;

/// Upper bounds (seconds) of the decision-time histogram.
const BUCKETS: [f64; 10] = [
    0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.1, 1.0,
];

const OUTCOMES: [&str; 9] = [
    "allowed",
    "denied",
    "shadow_denied",
    "fail_open",
    "safety_denied",
    "shed",
    "unknown_key",
    "public_plan_missing",
    "failed_keys_limited",
];

/// Why a request was shed (answered `503` by an overloaded gateway, see
/// `limiter::overload`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShedReason {
    /// The worker was overloaded when the request arrived.
    Overloaded,
    /// Its decision took longer than `overload.max_wait_ms`.
    DecisionWait,
    /// Its key was not held (cache mode), and an overloaded worker does not read the
    /// store for it.
    Lookup,
}

const SHED_REASONS: [&str; 3] = ["overloaded", "decision_wait", "lookup"];

impl ShedReason {
    /// The `reason` label of `tollgate_shed_total`.
    pub fn label(self) -> &'static str {
        SHED_REASONS[self as usize]
    }
}

/// The `kind` label of `tollgate_store_errors_total`, in [`StoreErrorKind`] order.
const ERROR_KINDS: [&str; 5] = StoreErrorKind::LABELS;

/// What kind of store failure a call met (the store classifies its own errors; the engine
/// defines the kinds).
pub use tollgate_engine::StoreErrorKind;

/// What a service's report of a request's real cost (a route's `cost_header`) came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CostReport {
    /// More than the route's cost: the difference is debited.
    Debit,
    /// Less: the difference is refunded.
    Refund,
    /// Exactly the route's cost: nothing to do.
    Same,
    /// Not a number from 0 to 1e9 (or sent twice): ignored.
    Invalid,
}

/// The `outcome` label of `tollgate_cost_reports_total`, in [`CostReport`] order.
const COST_REPORTS: [&str; 4] = ["debit", "refund", "same", "invalid"];

/// How many sets of per-request counters there are; each thread writes one of them.
const SHARDS: usize = 16;

static NEXT_SHARD: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static SHARD: usize = NEXT_SHARD.fetch_add(1, Relaxed) % SHARDS;
}

/// The counters every request bumps, one set per worker thread and a cache line (pair)
/// of its own, so two workers never write the same line: a counter shared by all workers
/// is a cache line bouncing between their cores on every request. A scrape sums the sets.
#[derive(Default)]
#[repr(align(128))]
struct Shard {
    decisions: [AtomicU64; OUTCOMES.len()],
    fail_open: AtomicU64,
    limiter_buckets: [AtomicU64; BUCKETS.len()],
    limiter_count: AtomicU64,
    limiter_sum_ns: AtomicU64,
    /// Service → responses by status class and how long they took. Keyed by the route's
    /// own `Arc<str>`, so counting a response allocates nothing.
    upstream: DashMap<Arc<str>, Upstream, foldhash::fast::RandomState>,
    /// Service → cost reports by [`CostReport`], keyed like `upstream`.
    cost_reports: DashMap<Arc<str>, [AtomicU64; COST_REPORTS.len()], foldhash::fast::RandomState>,
}

/// One service's responses on one shard.
#[derive(Default)]
struct Upstream {
    /// By status class, 1xx..5xx.
    classes: [AtomicU64; 5],
    /// `tollgate_upstream_seconds`: from the first try to the response head (or the
    /// gateway's error), over every try.
    buckets: [AtomicU64; UPSTREAM_BUCKETS.len()],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

/// Upper bounds (seconds) of the upstream-time histogram.
const UPSTREAM_BUCKETS: [f64; 12] = [
    0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

pub struct Metrics {
    fail_open_reasons: [AtomicU64; FailOpenReason::ALL.len()],
    shed: [AtomicU64; SHED_REASONS.len()],
    store_errors: [AtomicU64; ERROR_KINDS.len()],
    /// [gateway deny][service deny]
    shadow: [[AtomicU64; 2]; 2],
    shards: Box<[Shard]>,
    /// Configuration reloads (`SIGHUP`).
    pub reloads: Reloads,
    /// Upgraded (WebSocket) connections.
    pub websockets: WebSockets,
    /// Usage history's flushes and what it holds.
    pub usage: UsageMetrics,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            fail_open_reasons: Default::default(),
            shed: Default::default(),
            store_errors: Default::default(),
            shadow: Default::default(),
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
            reloads: Reloads::default(),
            websockets: WebSockets::default(),
            usage: UsageMetrics::default(),
        }
    }
}

impl Metrics {
    /// This thread's counters.
    fn shard(&self) -> &Shard {
        &self.shards[SHARD.with(|s| *s)]
    }

    /// A counter summed over the shards.
    fn sum(&self, counter: impl Fn(&Shard) -> &AtomicU64) -> u64 {
        self.shards.iter().map(|s| counter(s).load(Relaxed)).sum()
    }

    pub fn record_decision(&self, outcome: Outcome, took: Duration) {
        let shard = self.shard();
        shard.decisions[outcome as usize].fetch_add(1, Relaxed);
        if outcome == Outcome::FailOpen {
            shard.fail_open.fetch_add(1, Relaxed);
        }
        let secs = took.as_secs_f64();
        if let Some(i) = BUCKETS.iter().position(|b| secs <= *b) {
            shard.limiter_buckets[i].fetch_add(1, Relaxed);
        }
        shard.limiter_count.fetch_add(1, Relaxed);
        shard
            .limiter_sum_ns
            .fetch_add(took.as_nanos() as u64, Relaxed);
    }

    pub fn fail_open(&self, reason: FailOpenReason) {
        self.fail_open_reasons[reason as usize].fetch_add(1, Relaxed);
    }

    /// Requests that failed open for `reason`.
    pub fn fail_open_count(&self, reason: FailOpenReason) -> u64 {
        self.fail_open_reasons[reason as usize].load(Relaxed)
    }

    /// Counts a request shed for `reason` (its decision is counted by `record_decision`).
    pub fn shed(&self, reason: ShedReason) {
        self.shed[reason as usize].fetch_add(1, Relaxed);
    }

    pub fn store_error(&self, kind: StoreErrorKind) {
        self.store_errors[kind as usize].fetch_add(1, Relaxed);
    }

    pub fn record_shadow(&self, gateway_denied: bool, service_denied: bool) {
        self.shadow[gateway_denied as usize][service_denied as usize].fetch_add(1, Relaxed);
    }

    /// Counts a decision outcome by its label (`unknown_key` has no limiter decision).
    pub fn count_outcome(&self, label: &str) {
        if let Some(i) = OUTCOMES.iter().position(|o| *o == label) {
            self.shard().decisions[i].fetch_add(1, Relaxed);
        }
    }

    pub fn fail_open_total(&self) -> u64 {
        self.sum(|s| &s.fail_open)
    }

    /// Counts a service's answer (or the gateway's error for it) and how long it took.
    pub fn record_upstream(&self, service: &Arc<str>, status: u16, took: Duration) {
        let count = |u: &Upstream| {
            let class = (status / 100).clamp(1, 5) as usize - 1;
            u.classes[class].fetch_add(1, Relaxed);
            let secs = took.as_secs_f64();
            if let Some(i) = UPSTREAM_BUCKETS.iter().position(|b| secs <= *b) {
                u.buckets[i].fetch_add(1, Relaxed);
            }
            u.count.fetch_add(1, Relaxed);
            u.sum_ns.fetch_add(took.as_nanos() as u64, Relaxed);
        };
        let upstream = &self.shard().upstream;
        if let Some(u) = upstream.get(&**service) {
            count(&u);
            return;
        }
        count(&upstream.entry(Arc::clone(service)).or_default());
    }

    /// Counts a service's report of a request's real cost.
    pub fn record_cost_report(&self, service: &Arc<str>, report: CostReport) {
        let reports = &self.shard().cost_reports;
        if let Some(c) = reports.get(&**service) {
            c[report as usize].fetch_add(1, Relaxed);
            return;
        }
        reports.entry(Arc::clone(service)).or_default()[report as usize].fetch_add(1, Relaxed);
    }

    /// The Prometheus text exposition of these counters alone (`/metrics` adds the rest).
    pub fn render(&self) -> String {
        let mut out = Exposition::new();
        self.write(&mut out);
        out.finish()
    }

    /// Writes every family these counters make.
    pub fn write(&self, out: &mut Exposition) {
        self.write_decisions(out);
        self.write_store(out);
        self.write_limiter_seconds(out);
        self.write_upstreams(out);
        self.write_cost_reports(out);
        self.reloads.write(out);
        self.websockets.write(out);
        self.usage.write(out);
    }

    fn write_decisions(&self, out: &mut Exposition) {
        let mut f = out.family(
            "tollgate_decisions_total",
            Kind::Counter,
            "Limiter decisions by outcome.",
        );
        for (i, o) in OUTCOMES.iter().enumerate() {
            f.sample(&[("outcome", o)], self.sum(|s| &s.decisions[i]));
        }
        out.family(
            "tollgate_fail_open_total",
            Kind::Counter,
            "Requests admitted without a store decision (failing open: the store did not answer in time, failed, or its breaker was open); the same count as tollgate_decisions_total{outcome=\"fail_open\"}.",
        )
        .sample(&[], self.fail_open_total());
        let mut f = out.family(
            "tollgate_fail_open_reasons_total",
            Kind::Counter,
            "Requests admitted without a store decision, by reason.",
        );
        for r in FailOpenReason::ALL {
            let n = &self.fail_open_reasons[r as usize];
            f.sample(&[("reason", r.label())], n.load(Relaxed));
        }
        let mut f = out.family(
            "tollgate_shed_total",
            Kind::Counter,
            "Requests an overloaded gateway refused with 503 rather than decide late or admit unchecked, by reason; the same count as tollgate_decisions_total{outcome=\"shed\"}.",
        );
        for (r, n) in SHED_REASONS.iter().zip(&self.shed) {
            f.sample(&[("reason", r)], n.load(Relaxed));
        }
    }

    fn write_store(&self, out: &mut Exposition) {
        let mut f = out.family(
            "tollgate_store_errors_total",
            Kind::Counter,
            "Store calls that failed, by kind.",
        );
        for (k, n) in ERROR_KINDS.iter().zip(&self.store_errors) {
            f.sample(&[("kind", k)], n.load(Relaxed));
        }
        let mut f = out.family(
            "tollgate_shadow_comparisons_total",
            Kind::Counter,
            "Shadow-mode decisions compared with the service's own answer.",
        );
        for (g, gateway) in ["allow", "deny"].iter().enumerate() {
            for (s, service) in ["allow", "deny"].iter().enumerate() {
                f.sample(
                    &[("gateway", gateway), ("service", service)],
                    self.shadow[g][s].load(Relaxed),
                );
            }
        }
    }

    fn write_limiter_seconds(&self, out: &mut Exposition) {
        let buckets: Vec<u64> = (0..BUCKETS.len())
            .map(|i| self.sum(|s| &s.limiter_buckets[i]))
            .collect();
        out.family(
            "tollgate_limiter_seconds",
            Kind::Histogram,
            "Time to decide one request.",
        )
        .histogram(
            &[],
            &BUCKETS,
            &buckets,
            self.sum(|s| &s.limiter_sum_ns) as f64 / 1e9,
            self.sum(|s| &s.limiter_count),
        );
    }

    /// Every service's responses, summed over the shards, by service name.
    fn upstreams(&self) -> BTreeMap<Arc<str>, UpstreamTotals> {
        let mut merged: BTreeMap<Arc<str>, UpstreamTotals> = BTreeMap::new();
        for shard in self.shards.iter() {
            for e in shard.upstream.iter() {
                let row = merged.entry(e.key().clone()).or_default();
                let u = e.value();
                for (total, c) in row.classes.iter_mut().zip(&u.classes) {
                    *total += c.load(Relaxed);
                }
                for (total, c) in row.buckets.iter_mut().zip(&u.buckets) {
                    *total += c.load(Relaxed);
                }
                row.count += u.count.load(Relaxed);
                row.sum_ns += u.sum_ns.load(Relaxed);
            }
        }
        merged
    }

    fn write_upstreams(&self, out: &mut Exposition) {
        let merged = self.upstreams();
        let mut f = out.family(
            "tollgate_upstream_requests_total",
            Kind::Counter,
            "Responses from upstream services.",
        );
        for (service, totals) in &merged {
            for (class, n) in STATUS_CLASSES.iter().zip(totals.classes) {
                if n > 0 {
                    f.sample(&[("service", service), ("status_class", class)], n);
                }
            }
        }
        let mut f = out.family(
            "tollgate_upstream_seconds",
            Kind::Histogram,
            "Time from a forwarded request's first try to its response head (or the gateway's error), every try included.",
        );
        for (service, totals) in &merged {
            f.histogram(
                &[("service", service)],
                &UPSTREAM_BUCKETS,
                &totals.buckets,
                totals.sum_ns as f64 / 1e9,
                totals.count,
            );
        }
    }

    fn write_cost_reports(&self, out: &mut Exposition) {
        let mut merged: BTreeMap<Arc<str>, [u64; COST_REPORTS.len()]> = BTreeMap::new();
        for shard in self.shards.iter() {
            for e in shard.cost_reports.iter() {
                let row = merged.entry(e.key().clone()).or_default();
                for (total, c) in row.iter_mut().zip(e.value()) {
                    *total += c.load(Relaxed);
                }
            }
        }
        let mut f = out.family(
            "tollgate_cost_reports_total",
            Kind::Counter,
            "Real costs reported by services (a route's cost_header), by what they came to.",
        );
        // Every outcome of a service that reported once, zeros included, so an alert on
        // `outcome="invalid"` has a series from the first report.
        for (service, counts) in &merged {
            for (outcome, n) in COST_REPORTS.iter().zip(counts) {
                f.sample(&[("service", service), ("outcome", outcome)], *n);
            }
        }
    }
}

/// One service's responses summed over the shards.
#[derive(Default)]
struct UpstreamTotals {
    classes: [u64; 5],
    buckets: [u64; UPSTREAM_BUCKETS.len()],
    count: u64,
    sum_ns: u64,
}

/// The `status_class` label of `tollgate_upstream_requests_total`, by class 1xx..5xx.
const STATUS_CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

/// Usage history (`limiter::UsageTally`): batches flushed to the store or not, the counts
/// held (unsent included), and those dropped because too many were held.
#[derive(Debug, Default)]
pub struct UsageMetrics {
    flushed: AtomicU64,
    failed: AtomicU64,
    checkpoints: [AtomicU64; 2],
    adopted: [AtomicU64; 2],
    held: AtomicU64,
    dropped: AtomicU64,
}

impl UsageMetrics {
    /// A batch was added to the store (`true`), or the attempt failed and it is kept.
    pub fn flush(&self, ok: bool) {
        let n = if ok { &self.flushed } else { &self.failed };
        n.fetch_add(1, Relaxed);
    }

    /// A checkpoint was written (`true`), or the attempt failed.
    pub fn checkpoint(&self, ok: bool) {
        self.checkpoints[usize::from(!ok)].fetch_add(1, Relaxed);
    }

    /// A silent gateway's checkpoint was added (`true`), or dropped as unreadable.
    pub fn adopted(&self, ok: bool) {
        self.adopted[usize::from(!ok)].fetch_add(1, Relaxed);
    }

    /// (client, limit, hour) counts held now, in batches unsent and summing.
    pub fn set_held(&self, entries: usize) {
        self.held.store(entries as u64, Relaxed);
    }

    /// Counts dropped: `entries` past `usage.max_entries`.
    pub fn dropped(&self, entries: u64) {
        self.dropped.fetch_add(entries, Relaxed);
    }

    fn write(&self, out: &mut Exposition) {
        out.family(
            "tollgate_usage_flushes_total",
            Kind::Counter,
            "Usage history batches added to the store at a fold: added (ok) or failed (kept and added again).",
        )
        .sample(&[("result", "ok")], self.flushed.load(Relaxed))
        .sample(&[("result", "failed")], self.failed.load(Relaxed));
        out.family(
            "tollgate_usage_checkpoints_total",
            Kind::Counter,
            "Usage history checkpoints (what the gateway holds, written to the store each usage.flush_ms): written (ok) or failed.",
        )
        .sample(&[("result", "ok")], self.checkpoints[0].load(Relaxed))
        .sample(&[("result", "failed")], self.checkpoints[1].load(Relaxed));
        out.family(
            "tollgate_usage_adopted_total",
            Kind::Counter,
            "Silent gateways' usage history checkpoints this gateway added on their behalf (ok), or dropped as unreadable (unreadable).",
        )
        .sample(&[("result", "ok")], self.adopted[0].load(Relaxed))
        .sample(&[("result", "unreadable")], self.adopted[1].load(Relaxed));
        out.family(
            "tollgate_usage_entries",
            Kind::Gauge,
            "Usage history counts (client, limit, hour) this gateway holds: summing, and not yet added.",
        )
        .sample(&[], self.held.load(Relaxed));
        out.family(
            "tollgate_usage_dropped_total",
            Kind::Counter,
            "Usage history counts dropped because usage.max_entries were held (the store unreachable for long).",
        )
        .sample(&[], self.dropped.load(Relaxed));
    }
}

/// Configuration reloads: how many were applied or refused, and when the configuration
/// served now was last loaded.
#[derive(Debug, Default)]
pub struct Reloads {
    ok: AtomicU64,
    rejected: AtomicU64,
    /// Unix ms of the last successful load (start-up's, until a reload succeeds).
    last_success_ms: AtomicU64,
}

impl Reloads {
    /// The configuration was loaded at `unix_ms` (at start: not counted as a reload).
    pub fn loaded(&self, unix_ms: u64) {
        self.last_success_ms.store(unix_ms, Relaxed);
    }

    /// A reload was applied at `unix_ms`.
    pub fn succeeded(&self, unix_ms: u64) {
        self.ok.fetch_add(1, Relaxed);
        self.loaded(unix_ms);
    }

    /// A reload was refused.
    pub fn rejected(&self) {
        self.rejected.fetch_add(1, Relaxed);
    }

    fn write(&self, out: &mut Exposition) {
        out.family(
            "tollgate_config_reloads_total",
            Kind::Counter,
            "Configuration reloads (SIGHUP): applied (ok) or refused because the configuration did not load (rejected).",
        )
        .sample(&[("result", "ok")], self.ok.load(Relaxed))
        .sample(&[("result", "rejected")], self.rejected.load(Relaxed));
        out.family(
            "tollgate_config_reload_last_success_timestamp_seconds",
            Kind::Gauge,
            "When the configuration served now was loaded (start-up, or the last reload applied), Unix seconds.",
        )
        .sample(&[], UnixMillis(self.last_success_ms.load(Relaxed)));
    }
}

/// How an upgrade request (WebSocket) that was admitted ended its handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpgradeResult {
    /// The service answered `101`: the connection is relayed.
    Upgraded,
    /// The service answered something else, passed on to the client.
    Declined,
    /// No replica could be reached, or none answered in time (`502`/`504`).
    Failed,
    /// Refused before its decision: the client had its plan's `max_connections` open.
    TooManyConnections,
}

/// The `result` label of `tollgate_websocket_upgrades_total`, in [`UpgradeResult`] order.
const UPGRADE_RESULTS: [&str; 4] = ["upgraded", "declined", "failed", "too_many_connections"];

/// Upgraded connections: open ones per service (a gauge) and handshakes by result. Written
/// once per connection, not per message: plain shared atomics.
#[derive(Default)]
pub struct WebSockets {
    open: DashMap<Arc<str>, AtomicU64, foldhash::fast::RandomState>,
    upgrades: [AtomicU64; UPGRADE_RESULTS.len()],
}

impl WebSockets {
    pub fn upgrade(&self, result: UpgradeResult) {
        self.upgrades[result as usize].fetch_add(1, Relaxed);
    }

    /// A connection of `service` was upgraded; [`WebSockets::closed`] when it ends.
    pub fn opened(&self, service: &Arc<str>) {
        if let Some(n) = self.open.get(&**service) {
            n.fetch_add(1, Relaxed);
            return;
        }
        self.open
            .entry(Arc::clone(service))
            .or_default()
            .fetch_add(1, Relaxed);
    }

    pub fn closed(&self, service: &str) {
        if let Some(n) = self.open.get(service) {
            n.fetch_sub(1, Relaxed);
        }
    }

    /// Open upgraded connections of `service`.
    pub fn open(&self, service: &str) -> u64 {
        self.open.get(service).map_or(0, |n| n.load(Relaxed))
    }

    fn write(&self, out: &mut Exposition) {
        let open: BTreeMap<Arc<str>, u64> = self
            .open
            .iter()
            .map(|e| (Arc::clone(e.key()), e.value().load(Relaxed)))
            .collect();
        let mut f = out.family(
            "tollgate_websocket_connections",
            Kind::Gauge,
            "Upgraded (WebSocket) connections open now, by service.",
        );
        for (service, n) in &open {
            f.sample(&[("service", service)], *n);
        }
        let mut f = out.family(
            "tollgate_websocket_upgrades_total",
            Kind::Counter,
            "WebSocket upgrade requests by result: upgraded (101, relayed), declined (the service answered something else, passed on), failed (no replica answered: 502/504), too_many_connections (429 before the decision: the plan's max_connections).",
        );
        for (r, n) in UPGRADE_RESULTS.iter().zip(&self.upgrades) {
            f.sample(&[("result", r)], n.load(Relaxed));
        }
    }
}

/// The Prometheus text exposition (format 0.0.4), the one writer of `/metrics`: each family
/// its `# HELP` and `# TYPE` lines, then its samples, label values escaped as the format
/// says (`\`, `"` and newlines) and numbers written as Prometheus reads them.
#[derive(Debug, Default)]
pub struct Exposition {
    out: String,
}

/// A metric family's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// A sample's value as the exposition writes it.
pub trait SampleValue {
    fn write_to(&self, out: &mut String);
}

macro_rules! integer_sample {
    ($($t:ty),*) => {$(
        impl SampleValue for $t {
            fn write_to(&self, out: &mut String) {
                out.push_str(itoa::Buffer::new().format(*self));
            }
        }
    )*};
}
integer_sample!(u8, u32, u64, usize);

impl SampleValue for f64 {
    fn write_to(&self, out: &mut String) {
        if self.is_nan() {
            out.push_str("NaN");
        } else if self.is_infinite() {
            out.push_str(if *self > 0.0 { "+Inf" } else { "-Inf" });
        } else {
            let _ = write!(out, "{self}");
        }
    }
}

/// A Unix time in milliseconds, written as seconds with three decimals.
#[derive(Debug, Clone, Copy)]
pub struct UnixMillis(pub u64);

impl SampleValue for UnixMillis {
    fn write_to(&self, out: &mut String) {
        let _ = write!(out, "{}.{:03}", self.0 / 1000, self.0 % 1000);
    }
}

impl Exposition {
    pub fn new() -> Exposition {
        Exposition {
            out: String::with_capacity(8192),
        }
    }

    /// Starts the family `name`: its `# HELP` and `# TYPE` lines. Its samples follow.
    pub fn family(&mut self, name: &'static str, kind: Kind, help: &str) -> Family<'_> {
        self.out.push_str("# HELP ");
        self.out.push_str(name);
        self.out.push(' ');
        for c in help.chars() {
            match c {
                '\\' => self.out.push_str("\\\\"),
                '\n' => self.out.push_str("\\n"),
                c => self.out.push(c),
            }
        }
        let _ = writeln!(self.out, "\n# TYPE {name} {}", kind.as_str());
        Family {
            out: &mut self.out,
            name,
        }
    }

    /// The text, to be served as `text/plain; version=0.0.4`.
    pub fn finish(self) -> String {
        self.out
    }
}

/// The samples of one family.
pub struct Family<'a> {
    out: &'a mut String,
    name: &'static str,
}

impl Family<'_> {
    /// One sample: `name{labels} value`.
    pub fn sample(&mut self, labels: &[(&str, &str)], value: impl SampleValue) -> &mut Self {
        self.line("", labels, None, &value);
        self
    }

    /// A histogram's series for one set of `labels`: a cumulative `_bucket` per upper
    /// bound and `+Inf`, `_sum` and `_count`. `counts` are per bucket, not cumulative.
    pub fn histogram(
        &mut self,
        labels: &[(&str, &str)],
        bounds: &[f64],
        counts: &[u64],
        sum: f64,
        count: u64,
    ) -> &mut Self {
        let mut cumulative = 0;
        for (bound, n) in bounds.iter().zip(counts) {
            cumulative += n;
            self.line("_bucket", labels, Some(&format!("{bound}")), &cumulative);
        }
        self.line("_bucket", labels, Some("+Inf"), &count);
        self.line("_sum", labels, None, &sum);
        self.line("_count", labels, None, &count);
        self
    }

    fn line(
        &mut self,
        suffix: &str,
        labels: &[(&str, &str)],
        le: Option<&str>,
        value: &dyn SampleValue,
    ) {
        let out = &mut *self.out;
        out.push_str(self.name);
        out.push_str(suffix);
        let le = le.map(|le| ("le", le));
        let mut all = labels.iter().copied().chain(le).peekable();
        if all.peek().is_some() {
            out.push('{');
            for (i, (name, value)) in all.enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(name);
                out.push_str("=\"");
                escape_label_value(out, value);
                out.push('"');
            }
            out.push('}');
        }
        out.push(' ');
        value.write_to(out);
        out.push('\n');
    }
}

/// A label value as the text format quotes it.
fn escape_label_value(out: &mut String, value: &str) {
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_index_their_own_labels() {
        for o in [
            Outcome::Allowed,
            Outcome::Denied,
            Outcome::ShadowDenied,
            Outcome::FailOpen,
            Outcome::SafetyDenied,
            Outcome::Shed,
        ] {
            assert_eq!(OUTCOMES[o as usize], o.label());
        }
    }

    #[test]
    fn cost_reports_are_counted_per_service_and_outcome() {
        let m = Metrics::default();
        let llm: Arc<str> = Arc::from("llm");
        for r in [CostReport::Debit, CostReport::Debit, CostReport::Invalid] {
            m.record_cost_report(&llm, r);
        }
        let text = m.render();
        for line in [
            "tollgate_cost_reports_total{service=\"llm\",outcome=\"debit\"} 2\n",
            "tollgate_cost_reports_total{service=\"llm\",outcome=\"refund\"} 0\n",
            "tollgate_cost_reports_total{service=\"llm\",outcome=\"same\"} 0\n",
            "tollgate_cost_reports_total{service=\"llm\",outcome=\"invalid\"} 1\n",
        ] {
            assert!(text.contains(line), "{line} not in {text}");
        }
    }

    /// Every family `Metrics` writes, with counts in each, exactly as scrapers have read it
    /// so far.
    #[test]
    fn the_exposition_is_written_as_before() {
        let m = Metrics::default();
        let orders: Arc<str> = Arc::from("orders");
        let llm: Arc<str> = Arc::from("llm");
        m.record_decision(Outcome::Allowed, Duration::from_micros(80));
        m.record_decision(Outcome::Denied, Duration::from_micros(700));
        m.record_decision(Outcome::FailOpen, Duration::from_millis(6));
        m.fail_open(FailOpenReason::Timeout);
        m.shed(ShedReason::DecisionWait);
        m.count_outcome("unknown_key");
        m.store_error(StoreErrorKind::Pool);
        m.record_shadow(true, false);
        m.record_upstream(&orders, 200, Duration::from_micros(1500));
        m.record_upstream(&orders, 503, Duration::from_secs(2));
        m.record_upstream(&llm, 429, Duration::from_millis(30));
        m.record_cost_report(&llm, CostReport::Refund);
        m.reloads.succeeded(1_712_345_678_042);
        m.reloads.rejected();
        m.websockets.opened(&orders);
        m.websockets.opened(&orders);
        m.websockets.closed("orders");
        m.websockets.upgrade(UpgradeResult::Upgraded);
        m.websockets.upgrade(UpgradeResult::TooManyConnections);
        m.usage.flush(true);
        m.usage.flush(true);
        m.usage.flush(false);
        m.usage.checkpoint(true);
        m.usage.checkpoint(false);
        m.usage.adopted(true);
        m.usage.set_held(42);
        m.usage.dropped(3);
        let text = m.render();
        let expected = include_str!("../tests/golden/metrics.txt");
        assert_eq!(text, expected);
    }

    #[test]
    fn label_values_and_help_are_escaped_and_odd_numbers_written_as_prometheus_reads_them() {
        let mut out = Exposition::new();
        out.family("t_gauge", Kind::Gauge, "Help with \\ and a\nnewline.")
            .sample(&[("path", "C:\\x \"quoted\"\nnext")], f64::INFINITY)
            .sample(&[("a", "1"), ("b", "2")], f64::NAN)
            .sample(&[], f64::NEG_INFINITY)
            .sample(&[], 0.25)
            .sample(&[], UnixMillis(1_700_000_000_005));
        assert_eq!(
            out.finish(),
            "# HELP t_gauge Help with \\\\ and a\\nnewline.\n\
             # TYPE t_gauge gauge\n\
             t_gauge{path=\"C:\\\\x \\\"quoted\\\"\\nnext\"} +Inf\n\
             t_gauge{a=\"1\",b=\"2\"} NaN\n\
             t_gauge -Inf\n\
             t_gauge 0.25\n\
             t_gauge 1700000000.005\n"
        );
    }

    #[test]
    fn a_histogram_is_cumulative_with_inf_sum_and_count() {
        let mut out = Exposition::new();
        out.family("t_seconds", Kind::Histogram, "Times.")
            .histogram(&[("service", "a")], &[0.5, 1.0], &[2, 1], 1.75, 4);
        assert_eq!(
            out.finish(),
            "# HELP t_seconds Times.\n# TYPE t_seconds histogram\n\
             t_seconds_bucket{service=\"a\",le=\"0.5\"} 2\n\
             t_seconds_bucket{service=\"a\",le=\"1\"} 3\n\
             t_seconds_bucket{service=\"a\",le=\"+Inf\"} 4\n\
             t_seconds_sum{service=\"a\"} 1.75\n\
             t_seconds_count{service=\"a\"} 4\n"
        );
    }

    #[test]
    fn counts_from_every_thread_add_up() {
        let m = Arc::new(Metrics::default());
        let service: Arc<str> = Arc::from("orders");
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..100 {
                        m.record_decision(Outcome::FailOpen, Duration::from_micros(300));
                        m.record_upstream(&service, 200, Duration::from_millis(1));
                    }
                });
            }
        });
        let text = m.render();
        assert_eq!(m.fail_open_total(), 400);
        assert!(text.contains("tollgate_decisions_total{outcome=\"fail_open\"} 400\n"));
        assert!(
            text.contains("tollgate_limiter_seconds_count 400\n"),
            "{text}"
        );
        assert!(text.contains(
            "tollgate_upstream_requests_total{service=\"orders\",status_class=\"2xx\"} 400\n"
        ));
    }
}
