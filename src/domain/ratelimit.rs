//! `RateLimit-Policy` and `RateLimit` response fields, per the IETF httpapi draft
//! (draft-ietf-httpapi-ratelimit-headers): one policy item per limit that applies to the
//! request. The plan's first limit is named after the plan (as the one bucket of a
//! single-limit plan always was); each other limit is `plan.limit`.
//!
//! - quota `q` = a bucket's capacity, or a quota's amount;
//! - window `w` = seconds for an empty bucket to fill, or a quota's nominal period;
//! - remaining `r` = whole tokens (or requests of the quota) left;
//! - reset `t` = seconds until the bucket is full again, or the quota's window ends.
//!
//! `RateLimit` reports the one limit closest to refusing (the one that refused, on a 429).

use std::fmt::Write;

use actix_web::http::header::{HeaderName, HeaderValue};

use super::decision::Decision;
use super::ids::PlanName;
use super::limits::{Applied, PolicyItem};

pub struct RateLimitHeaders {
    pub policy: HeaderValue,
    pub limit: Option<HeaderValue>,
}

pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// The policy name of an applied limit: the plan's for its first limit, else `plan.limit`.
pub fn policy_name(plan: &PlanName, applied: &Applied) -> String {
    if applied.index == 0 {
        plan.to_string()
    } else {
        format!("{plan}.{}", applied.name)
    }
}

/// The `RateLimit-Policy` value for the limits a request was decided against.
pub fn policy_header(plan: &PlanName, applied: &[Applied]) -> HeaderValue {
    let mut policy = String::new();
    for (i, a) in applied.iter().enumerate() {
        let item = PolicyItem::of(a);
        let sep = if i == 0 { "" } else { ", " };
        let _ = write!(
            policy,
            "{sep}\"{}\";q={};w={}",
            policy_name(plan, a),
            item.quota,
            item.window_secs
        );
    }
    // Plan and limit names are of a header-safe charset, so this cannot fail.
    HeaderValue::from_str(&policy).unwrap_or(HeaderValue::from_static(""))
}

/// `"name";r=remaining;t=reset`, written straight into the header's bytes: it is built on
/// every request, and the formatting machinery (two `String`s and `fmt::write`) cost
/// about as much as the rest of the decision.
fn limit_value(plan: &PlanName, a: &Applied, remaining: u64, reset: u64) -> Option<HeaderValue> {
    let (plan, limit) = (plan.as_str().as_bytes(), a.name.as_bytes());
    let mut v = Vec::with_capacity(plan.len() + limit.len() + 2 * 20 + 8);
    v.push(b'"');
    v.extend_from_slice(plan);
    if a.index != 0 {
        v.push(b'.');
        v.extend_from_slice(limit);
    }
    v.extend_from_slice(b"\";r=");
    push_decimal(&mut v, remaining);
    v.extend_from_slice(b";t=");
    push_decimal(&mut v, reset);
    HeaderValue::from_maybe_shared(bytes::Bytes::from(v)).ok()
}

/// Appends `n` in decimal.
fn push_decimal(out: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
}

impl RateLimitHeaders {
    pub fn new(plan: &PlanName, decision: &Decision) -> RateLimitHeaders {
        RateLimitHeaders::with_policy(plan, decision, policy_header(plan, &decision.applied))
    }

    /// With the policy value already built (the catalog keeps one per plan).
    pub fn with_policy(
        plan: &PlanName,
        decision: &Decision,
        policy: HeaderValue,
    ) -> RateLimitHeaders {
        let limit = decision.ruling.as_ref().and_then(|r| {
            let i = r.tightest(&decision.applied)?;
            let (a, level) = (&decision.applied[i], r.levels[i]);
            let remaining = level.remaining(&a.kind).max(0.0).floor() as u64;
            let reset = level.reset_us(&a.kind, r.now_us).div_ceil(1_000_000);
            limit_value(plan, a, remaining, reset)
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
    use crate::domain::limits::{Level, Limit, Ruling};
    use crate::domain::quota::{Period, QuotaClock, Reset};
    use crate::domain::{Bucket, LimitKind, LimitName, Outcome, Quota};

    fn decision(levels: Vec<Level>, refused_by: Option<usize>) -> Decision {
        let month = QuotaClock::new(Period::Month, Reset::Calendar, "UTC").unwrap();
        let limits = [
            Limit::default_bucket(Bucket::new(100.0, 50.0).unwrap()),
            Limit::new(
                LimitName::parse("monthly").unwrap(),
                None,
                LimitKind::Quota(Quota::new(1e6, month).unwrap()),
            ),
        ];
        Decision {
            outcome: Outcome::Allowed,
            applied: limits
                .iter()
                .enumerate()
                .map(|(i, l)| l.applied(i))
                .collect(),
            ruling: Some(Ruling {
                allowed: refused_by.is_none(),
                levels,
                wait_us: Some(0),
                refused_by,
                now_us: 0,
                batch: 0,
            }),
            safety_wait_us: None,
            fail_open_reason: None,
            as_planned: false,
            cost: 1.0,
            sharded: false,
        }
    }

    #[test]
    fn headers_follow_the_draft_with_one_item_per_limit() {
        let d = decision(
            vec![
                Level::Tokens(7.4),
                Level::Used {
                    used: 10.0,
                    end_us: 3_000_000,
                },
            ],
            None,
        );
        let h = RateLimitHeaders::new(&PlanName::parse("gold").unwrap(), &d);
        assert_eq!(
            h.policy,
            "\"gold\";q=100;w=2, \"gold.monthly\";q=1000000;w=2592000"
        );
        // The bucket, with 7 left, is closer to refusing than the quota.
        assert_eq!(h.limit.unwrap(), "\"gold\";r=7;t=2");
    }

    #[test]
    fn numbers_are_written_in_decimal_whole() {
        for n in [0, 7, 10, 99, 100, 1_000_000_007, u64::MAX] {
            let mut v = Vec::new();
            push_decimal(&mut v, n);
            assert_eq!(String::from_utf8(v).unwrap(), n.to_string());
        }
    }

    #[test]
    fn a_refusal_reports_the_limit_that_refused() {
        let d = decision(
            vec![
                Level::Tokens(0.0),
                Level::Used {
                    used: 1e6,
                    end_us: 3_000_000,
                },
            ],
            Some(1),
        );
        let h = RateLimitHeaders::new(&PlanName::parse("gold").unwrap(), &d);
        assert_eq!(h.limit.unwrap(), "\"gold.monthly\";r=0;t=3");
    }
}
