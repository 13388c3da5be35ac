//! `RateLimit-Policy` and `RateLimit` response fields, per the IETF httpapi draft
//! (draft-ietf-httpapi-ratelimit-headers): one policy per client plan, named after it.
//!
//! - quota `q` = the plan's capacity;
//! - window `w` = seconds for an empty bucket to fill;
//! - remaining `r` = whole tokens left;
//! - reset `t` = seconds until the bucket is full again.

use actix_web::http::header::{HeaderName, HeaderValue};

use super::decision::Decision;
use super::ids::PlanName;
use super::plan::Plan;

pub struct RateLimitHeaders {
    pub policy: HeaderValue,
    pub limit: Option<HeaderValue>,
}

pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// The `RateLimit-Policy` value for a plan (or a shard's portion of one).
pub fn policy_header(plan_name: &PlanName, plan: Plan) -> HeaderValue {
    let policy = format!(
        "\"{}\";q={};w={}",
        plan_name,
        plan.capacity().floor() as u64,
        plan.window_secs().ceil() as u64
    );
    // Plan names are of a header-safe charset, so this cannot fail.
    HeaderValue::from_str(&policy).unwrap_or(HeaderValue::from_static(""))
}

impl RateLimitHeaders {
    pub fn new(plan_name: &PlanName, decision: &Decision) -> RateLimitHeaders {
        RateLimitHeaders::with_policy(plan_name, decision, policy_header(plan_name, decision.plan))
    }

    /// With the policy value already built (the catalog keeps one per plan).
    pub fn with_policy(
        plan_name: &PlanName,
        decision: &Decision,
        policy: HeaderValue,
    ) -> RateLimitHeaders {
        let plan = decision.plan;
        let limit = decision.verdict.and_then(|v| {
            let remaining = v.tokens.max(0.0).floor() as u64;
            let reset = ((plan.capacity() - v.tokens).max(0.0) / plan.rate()).ceil() as u64;
            HeaderValue::from_str(&format!("\"{plan_name}\";r={remaining};t={reset}")).ok()
        });
        RateLimitHeaders { policy, limit }
    }

    pub fn apply(self, headers: &mut actix_web::http::header::HeaderMap) {
        headers.insert(RATELIMIT_POLICY.clone(), self.policy);
        if let Some(l) = self.limit {
            headers.insert(RATELIMIT.clone(), l);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{Outcome, Verdict};

    #[test]
    fn headers_follow_the_draft() {
        let d = Decision {
            outcome: Outcome::Allowed,
            plan: Plan::new(100.0, 50.0).unwrap(),
            verdict: Some(Verdict {
                allowed: true,
                tokens: 7.4,
                wait_us: Some(0),
            }),
            safety_wait_us: None,
        };
        let h = RateLimitHeaders::new(&PlanName::parse("gold").unwrap(), &d);
        assert_eq!(h.policy, "\"gold\";q=100;w=2");
        assert_eq!(h.limit.unwrap(), "\"gold\";r=7;t=2");
    }
}
