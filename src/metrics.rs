//! Prometheus metrics: plain atomics on the request path, rendered as text on scrape.
//! No label carries a client id or an API key.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;

use crate::domain::Outcome;

/// Upper bounds (seconds) of the decision-time histogram.
const BUCKETS: [f64; 10] = [
    0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.1, 1.0,
];

const OUTCOMES: [&str; 7] = [
    "allowed",
    "denied",
    "shadow_denied",
    "fail_open",
    "safety_denied",
    "shed",
    "unknown_key",
];

/// Why a request failed open.
#[derive(Debug, Clone, Copy)]
pub enum FailOpenReason {
    /// The store did not answer within `redis.timeout_ms`.
    Timeout,
    /// The store answered with an error (or the connection failed).
    Error,
    /// The circuit breaker is open: the store was not asked.
    BreakerOpen,
}

const REASONS: [&str; 3] = ["timeout", "error", "breaker_open"];

impl FailOpenReason {
    /// The `reason` label of `tollgate_fail_open_reasons_total`.
    pub fn label(self) -> &'static str {
        REASONS[self as usize]
    }
}

/// Why a request was shed (answered `503` by an overloaded gateway, see
/// `limiter::overload`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShedReason {
    /// The worker was overloaded when the request arrived.
    Overloaded,
    /// Its decision took longer than `overload.max_wait_ms`.
    DecisionWait,
}

const SHED_REASONS: [&str; 2] = ["overloaded", "decision_wait"];

impl ShedReason {
    /// The `reason` label of `tollgate_shed_total`.
    pub fn label(self) -> &'static str {
        SHED_REASONS[self as usize]
    }
}

/// The `kind` label of `tollgate_store_errors_total`, in [`StoreErrorKind`] order.
const ERROR_KINDS: [&str; 5] = ["timeout", "connection", "script", "reply", "pool"];

/// What kind of store failure a call met (the store classifies its own errors).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreErrorKind {
    Timeout,
    Connection,
    Script,
    Reply,
    Pool,
}

impl StoreErrorKind {
    /// The `kind` label of `tollgate_store_errors_total`.
    pub fn label(self) -> &'static str {
        ERROR_KINDS[self as usize]
    }
}

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

/// Writes a metric family's `# HELP` and `# TYPE` lines.
pub fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

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
    fail_open_reasons: [AtomicU64; REASONS.len()],
    shed: [AtomicU64; SHED_REASONS.len()],
    store_errors: [AtomicU64; ERROR_KINDS.len()],
    /// [gateway deny][service deny]
    shadow: [[AtomicU64; 2]; 2],
    shards: Box<[Shard]>,
    /// Configuration reloads (`SIGHUP`).
    pub reloads: Reloads,
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

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(4096);
        family(
            &mut out,
            "tollgate_decisions_total",
            "counter",
            "Limiter decisions by outcome.",
        );
        for (i, o) in OUTCOMES.iter().enumerate() {
            let _ = writeln!(
                out,
                "tollgate_decisions_total{{outcome=\"{o}\"}} {}",
                self.sum(|s| &s.decisions[i])
            );
        }
        family(
            &mut out,
            "tollgate_fail_open_total",
            "counter",
            "Requests admitted without a store decision (failing open: the store did not answer in time, failed, or its breaker was open); the same count as tollgate_decisions_total{outcome=\"fail_open\"}.",
        );
        let _ = writeln!(out, "tollgate_fail_open_total {}", self.fail_open_total());
        family(
            &mut out,
            "tollgate_fail_open_reasons_total",
            "counter",
            "Requests admitted without a store decision, by reason.",
        );
        for (i, r) in REASONS.iter().enumerate() {
            let _ = writeln!(
                out,
                "tollgate_fail_open_reasons_total{{reason=\"{r}\"}} {}",
                self.fail_open_reasons[i].load(Relaxed)
            );
        }
        family(
            &mut out,
            "tollgate_shed_total",
            "counter",
            "Requests an overloaded gateway refused with 503 rather than decide late or admit unchecked, by reason; the same count as tollgate_decisions_total{outcome=\"shed\"}.",
        );
        for (i, r) in SHED_REASONS.iter().enumerate() {
            let _ = writeln!(
                out,
                "tollgate_shed_total{{reason=\"{r}\"}} {}",
                self.shed[i].load(Relaxed)
            );
        }
        family(
            &mut out,
            "tollgate_store_errors_total",
            "counter",
            "Store calls that failed, by kind.",
        );
        for (i, k) in ERROR_KINDS.iter().enumerate() {
            let _ = writeln!(
                out,
                "tollgate_store_errors_total{{kind=\"{k}\"}} {}",
                self.store_errors[i].load(Relaxed)
            );
        }
        family(
            &mut out,
            "tollgate_shadow_comparisons_total",
            "counter",
            "Shadow-mode decisions compared with the service's own answer.",
        );
        for (g, gl) in ["allow", "deny"].iter().enumerate() {
            for (s, sl) in ["allow", "deny"].iter().enumerate() {
                let _ = writeln!(
                    out,
                    "tollgate_shadow_comparisons_total{{gateway=\"{gl}\",service=\"{sl}\"}} {}",
                    self.shadow[g][s].load(Relaxed)
                );
            }
        }
        family(
            &mut out,
            "tollgate_limiter_seconds",
            "histogram",
            "Time to decide one request.",
        );
        let mut cumulative = 0;
        for (i, b) in BUCKETS.iter().enumerate() {
            cumulative += self.sum(|s| &s.limiter_buckets[i]);
            let _ = writeln!(
                out,
                "tollgate_limiter_seconds_bucket{{le=\"{b}\"}} {cumulative}"
            );
        }
        let count = self.sum(|s| &s.limiter_count);
        let _ = writeln!(
            out,
            "tollgate_limiter_seconds_bucket{{le=\"+Inf\"}} {count}"
        );
        let _ = writeln!(
            out,
            "tollgate_limiter_seconds_sum {}",
            self.sum(|s| &s.limiter_sum_ns) as f64 / 1e9
        );
        let _ = writeln!(out, "tollgate_limiter_seconds_count {count}");
        family(
            &mut out,
            "tollgate_upstream_requests_total",
            "counter",
            "Responses from upstream services.",
        );
        // service → (classes, buckets, count, sum_ns)
        type Merged = ([u64; 5], [u64; UPSTREAM_BUCKETS.len()], u64, u64);
        let mut merged: std::collections::BTreeMap<Arc<str>, Merged> = Default::default();
        for shard in self.shards.iter() {
            for e in shard.upstream.iter() {
                let row = merged.entry(e.key().clone()).or_default();
                let u = e.value();
                for (total, c) in row.0.iter_mut().zip(&u.classes) {
                    *total += c.load(Relaxed);
                }
                for (total, c) in row.1.iter_mut().zip(&u.buckets) {
                    *total += c.load(Relaxed);
                }
                row.2 += u.count.load(Relaxed);
                row.3 += u.sum_ns.load(Relaxed);
            }
        }
        for (service, (counts, _, _, _)) in &merged {
            for (i, n) in counts.iter().enumerate().filter(|(_, n)| **n > 0) {
                let _ = writeln!(
                    out,
                    "tollgate_upstream_requests_total{{service=\"{service}\",status_class=\"{}xx\"}} {n}",
                    i + 1
                );
            }
        }
        family(
            &mut out,
            "tollgate_upstream_seconds",
            "histogram",
            "Time from a forwarded request's first try to its response head (or the gateway's error), every try included.",
        );
        for (service, (_, buckets, count, sum_ns)) in &merged {
            let mut cumulative = 0;
            for (b, n) in UPSTREAM_BUCKETS.iter().zip(buckets) {
                cumulative += n;
                let _ = writeln!(
                    out,
                    "tollgate_upstream_seconds_bucket{{service=\"{service}\",le=\"{b}\"}} {cumulative}"
                );
            }
            let _ = writeln!(
                out,
                "tollgate_upstream_seconds_bucket{{service=\"{service}\",le=\"+Inf\"}} {count}\ntollgate_upstream_seconds_sum{{service=\"{service}\"}} {}\ntollgate_upstream_seconds_count{{service=\"{service}\"}} {count}",
                *sum_ns as f64 / 1e9
            );
        }
        family(
            &mut out,
            "tollgate_cost_reports_total",
            "counter",
            "Real costs reported by services (a route's cost_header), by what they came to.",
        );
        let mut merged: std::collections::BTreeMap<Arc<str>, [u64; COST_REPORTS.len()]> =
            Default::default();
        for shard in self.shards.iter() {
            for e in shard.cost_reports.iter() {
                let row = merged.entry(e.key().clone()).or_default();
                for (total, c) in row.iter_mut().zip(e.value()) {
                    *total += c.load(Relaxed);
                }
            }
        }
        // Every outcome of a service that reported once, zeros included, so an alert on
        // `outcome="invalid"` has a series from the first report.
        for (service, counts) in merged {
            for (label, n) in COST_REPORTS.iter().zip(counts) {
                let _ = writeln!(
                    out,
                    "tollgate_cost_reports_total{{service=\"{service}\",outcome=\"{label}\"}} {n}"
                );
            }
        }
        self.reloads.render(&mut out);
        out
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

    fn render(&self, out: &mut String) {
        family(
            out,
            "tollgate_config_reloads_total",
            "counter",
            "Configuration reloads (SIGHUP): applied (ok) or refused because the configuration did not load (rejected).",
        );
        for (result, n) in [("ok", &self.ok), ("rejected", &self.rejected)] {
            let _ = writeln!(
                out,
                "tollgate_config_reloads_total{{result=\"{result}\"}} {}",
                n.load(Relaxed)
            );
        }
        family(
            out,
            "tollgate_config_reload_last_success_timestamp_seconds",
            "gauge",
            "When the configuration served now was loaded (start-up, or the last reload applied), Unix seconds.",
        );
        let ms = self.last_success_ms.load(Relaxed);
        let _ = writeln!(
            out,
            "tollgate_config_reload_last_success_timestamp_seconds {}.{:03}",
            ms / 1000,
            ms % 1000
        );
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
        let text = m.render();
        let expected = include_str!("../tests/golden/metrics.txt");
        assert_eq!(text, expected);
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
