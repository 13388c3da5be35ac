//! What the limiter decides about one request, and what the response needs from it.
//!
//! Two nouns name an answer in tollgate, each defined once: a [`Ruling`] is what the
//! limits answer (may this cost be taken from all of them, and what each has left; the
//! stores answer with one), and a [`Decision`] is what the limiter answers (what happens
//! to the request, its [`Outcome`], and what the response needs). One bucket's arithmetic
//! answers with a wait (`bucket::TAKEN` when the cost was taken), not a type of its own.

use super::limits::{Applied, Ruling};

/// What the gateway does with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Forward it.
    Allowed,
    /// Answer 429.
    Denied,
    /// Over the limit, but the client is in shadow mode: forward it.
    ShadowDenied,
    /// The store did not answer in time: forward it.
    FailOpen,
    /// Past the coarse per-service safety limit: answer 429.
    SafetyDenied,
    /// The gateway is overloaded: answer 503, not decided (see `limiter::overload`).
    Shed,
}

impl Outcome {
    /// Whether the request goes on to the service.
    pub fn forwards(self) -> bool {
        !matches!(
            self,
            Outcome::Denied | Outcome::SafetyDenied | Outcome::Shed
        )
    }

    /// The `outcome` label of `tollgate_decisions_total`.
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Allowed => "allowed",
            Outcome::Denied => "denied",
            Outcome::ShadowDenied => "shadow_denied",
            Outcome::FailOpen => "fail_open",
            Outcome::SafetyDenied => "safety_denied",
            Outcome::Shed => "shed",
        }
    }
}

/// Why a request failed open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailOpenReason {
    /// The store did not answer within `redis.timeout_ms`.
    Timeout,
    /// The store answered with an error (or the connection failed).
    Error,
    /// The circuit breaker is open: the store was not asked.
    BreakerOpen,
}

impl FailOpenReason {
    /// Every reason, in the order of their labels.
    pub const ALL: [FailOpenReason; 3] = [
        FailOpenReason::Timeout,
        FailOpenReason::Error,
        FailOpenReason::BreakerOpen,
    ];

    /// Its name in metrics (`reason` of `tollgate_fail_open_reasons_total`) and spans.
    pub fn label(self) -> &'static str {
        match self {
            FailOpenReason::Timeout => "timeout",
            FailOpenReason::Error => "error",
            FailOpenReason::BreakerOpen => "breaker_open",
        }
    }
}

/// A decision and what the response headers need from it.
#[derive(Debug, Clone)]
pub struct Decision {
    pub outcome: Outcome,
    /// The limits the request was decided against, as it saw them.
    pub applied: Vec<Applied>,
    /// The store's answer; `None` when the store did not answer.
    pub ruling: Option<Ruling>,
    /// Whether `applied` are the plan's own limits for every service, unchanged (no
    /// service's own limit, override or regional portion): the plan's policy header fits.
    pub as_planned: bool,
    /// What was taken up front from each limit.
    pub cost: f64,
    /// Whether its buckets were decided in a regional shard (its quotas then globally,
    /// after the fact).
    pub sharded: bool,
    /// For `SafetyDenied`: the wait until the safety bucket has the tokens.
    pub safety_wait_us: Option<u64>,
    /// For `FailOpen`: why, for the decision's span.
    pub fail_open_reason: Option<FailOpenReason>,
}
