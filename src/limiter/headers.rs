//! `RateLimit-Policy` and `RateLimit` response fields, per the IETF httpapi draft
//! (draft-ietf-httpapi-ratelimit-headers): one policy per client plan, named after it.
//!
//! - quota `q` = the plan's capacity;
//! - window `w` = seconds for an empty bucket to fill;
//! - remaining `r` = whole tokens left;
//! - reset `t` = seconds until the bucket is full again.

use actix_web::http::header::{HeaderName, HeaderValue};

use super::Decision;
use crate::domain::PlanName;

pub struct RateLimitHeaders {
    pub policy: HeaderValue,
    pub limit: Option<HeaderValue>,
}

pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

impl RateLimitHeaders {
    pub fn new(plan_name: &PlanName, decision: &Decision) -> RateLimitHeaders {
        let plan = decision.plan;
        let policy = format!(
            "\"{}\";q={};w={}",
            plan_name,
            plan.capacity().floor() as u64,
            plan.window_secs().ceil() as u64
        );
        let limit = decision.verdict.map(|v| {
            let remaining = v.tokens.max(0.0).floor() as u64;
            let reset = ((plan.capacity() - v.tokens).max(0.0) / plan.rate()).ceil() as u64;
            format!("\"{plan_name}\";r={remaining};t={reset}")
        });
        RateLimitHeaders {
            // Plan names are of a header-safe charset, so these cannot fail.
            policy: HeaderValue::from_str(&policy).unwrap_or(HeaderValue::from_static("")),
            limit: limit.and_then(|l| HeaderValue::from_str(&l).ok()),
        }
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
    use crate::domain::Plan;
    use crate::limiter::{Outcome, Verdict};

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
