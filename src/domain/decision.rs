//! What the limiter decides about one request, and what the response needs from it.

use super::bucket::Verdict;
use super::plan::Plan;

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
}

impl Outcome {
    /// Whether the request goes on to the service.
    pub fn forwards(self) -> bool {
        !matches!(self, Outcome::Denied | Outcome::SafetyDenied)
    }

    /// The `outcome` label of `tollgate_decisions_total`.
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Allowed => "allowed",
            Outcome::Denied => "denied",
            Outcome::ShadowDenied => "shadow_denied",
            Outcome::FailOpen => "fail_open",
            Outcome::SafetyDenied => "safety_denied",
        }
    }
}

/// A decision and what the response headers need from it.
#[derive(Debug, Clone, Copy)]
pub struct Decision {
    pub outcome: Outcome,
    pub plan: Plan,
    /// The client bucket's verdict; `None` when the store did not answer.
    pub verdict: Option<Verdict>,
    /// For `SafetyDenied`: the wait until the safety bucket has the tokens.
    pub safety_wait_us: Option<u64>,
}
