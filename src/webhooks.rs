//! Quota warnings delivered: each crossing the limiter finds (`limiter::warnings`) is
//! claimed in the store first (`Claims`: the first gateway to claim a client's limit,
//! window and percentage sends it; the others drop it), then POSTed to every configured
//! webhook, signed with the webhook's own secret, retried with a doubling back-off, and
//! its end written to the audit log and the metrics.
//!
//! The request: `POST <url>`, `Content-Type: application/json`, `Tollgate-Event-Id`, and
//! `Tollgate-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">` (the
//! timestamp in the signed text, so a captured request cannot be replayed later unseen).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hmac::{Hmac, Mac};
use http_body_util::Full;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use secrecy::{ExposeSecret, SecretString};
use sha2::Sha256;
use tokio::sync::mpsc;

use crate::configuration::WarningSettings;
use crate::limiter::{Crossing, Warnings};
use crate::metrics::{Exposition, Kind};
use crate::store::records::AuditEntry;
use crate::store::Store;
use crate::tasks::{Policy, Tasks};

/// The longest wait between two tries of a delivery.
const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// Tries in flight to one webhook at most: a webhook that is down, or slow, while many
/// warnings are due (the first of a month) holds this many connections, not one each.
const IN_FLIGHT: usize = 16;

/// How long after its window ends a warning's claim is kept (a clock apart between
/// gateways cannot make a late one claim it again).
const CLAIM_AFTER_WINDOW: Duration = Duration::from_secs(86_400);

/// What happened to the warnings, for `/metrics`.
#[derive(Default)]
pub struct WebhookStats {
    /// Claimed by this gateway: it sends them.
    claimed: AtomicU64,
    /// Claimed by another gateway first: it sends them.
    claimed_elsewhere: AtomicU64,
    /// Not claimed: the store did not answer (found again by a later decision).
    claim_failed: AtomicU64,
    delivered: AtomicU64,
    /// Given up after the last try.
    failed: AtomicU64,
    /// Tries after the first.
    retries: AtomicU64,
    warnings: Option<Arc<Warnings>>,
}

impl WebhookStats {
    /// `tollgate_quota_warnings_total{result}` and the warnings dropped (the queue full).
    pub fn write_metrics(&self, out: &mut Exposition) {
        let Some(w) = &self.warnings else {
            return;
        };
        let read = |c: &AtomicU64| c.load(Ordering::Relaxed);
        out.family(
            "tollgate_quota_warnings_total",
            Kind::Counter,
            "Quota warnings this gateway found, by what became of them: claimed (this gateway sends it), claimed_elsewhere (another does), claim_failed (the store did not answer; found again later), dropped (the queue was full).",
        )
        .sample(&[("result", "claimed")], read(&self.claimed))
        .sample(&[("result", "claimed_elsewhere")], read(&self.claimed_elsewhere))
        .sample(&[("result", "claim_failed")], read(&self.claim_failed))
        .sample(&[("result", "dropped")], w.dropped());
        out.family(
            "tollgate_quota_warning_deliveries_total",
            Kind::Counter,
            "Quota warnings sent to a webhook, by end: delivered (a 2xx), failed (given up after the last try).",
        )
        .sample(&[("result", "delivered")], read(&self.delivered))
        .sample(&[("result", "failed")], read(&self.failed));
        out.family(
            "tollgate_quota_warning_retries_total",
            Kind::Counter,
            "Tries of a quota warning's delivery after its first.",
        )
        .sample(&[], read(&self.retries));
    }
}

/// One webhook.
struct Endpoint {
    url: String,
    /// The URL as the log and the audit say it: no user, password or query.
    shown: String,
    secret: SecretString,
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    /// [`IN_FLIGHT`] permits: one per try.
    tries: tokio::sync::Semaphore,
}

/// The warnings' way out: the limiter's [`Warnings`] (`None` without a webhook) and what
/// became of them.
pub struct Started {
    pub warnings: Option<Arc<Warnings>>,
    pub stats: Arc<WebhookStats>,
}

/// With a webhook configured: the limiter's warnings, and task `quota-warnings`, which
/// claims and delivers them. `holder` names this gateway in its claims.
pub fn start(
    settings: &WarningSettings,
    store: &Store,
    holder: &str,
    tasks: &Tasks,
) -> anyhow::Result<Started> {
    if settings.webhooks.is_empty() {
        return Ok(Started {
            warnings: None,
            stats: Arc::new(WebhookStats::default()),
        });
    }
    let mut endpoints = Vec::new();
    for (i, w) in settings.webhooks.iter().enumerate() {
        endpoints.push(Arc::new(Endpoint {
            shown: shown(&w.url),
            url: w.url.clone(),
            secret: w.secret.clone(),
            client: crate::tls::https_client(
                w.ca_file.as_deref(),
                &format!("warnings.webhooks[{i}].ca_file"),
            )?,
            tries: tokio::sync::Semaphore::new(IN_FLIGHT),
        }));
    }
    let (tx, rx) = mpsc::channel(settings.queue);
    let warnings = Arc::new(Warnings::new(tx, settings.queue.saturating_mul(10)));
    let stats = Arc::new(WebhookStats {
        warnings: Some(Arc::clone(&warnings)),
        ..WebhookStats::default()
    });
    let rx = Arc::new(tokio::sync::Mutex::new(rx));
    let deliver = Deliver {
        endpoints: Arc::new(endpoints),
        store: store.clone(),
        holder: holder.to_string(),
        retries: settings.retries,
        backoff: settings.backoff,
        timeout: settings.timeout,
        stats: Arc::clone(&stats),
        warnings: Arc::clone(&warnings),
    };
    tasks.spawn("quota-warnings", Policy::Restart, move |stop| {
        let (deliver, rx) = (deliver.clone(), Arc::clone(&rx));
        async move {
            stop.run_until_cancelled(async move {
                let mut rx = rx.lock().await;
                let mut sweep = tokio::time::interval(Duration::from_secs(60));
                loop {
                    tokio::select! {
                        c = rx.recv() => match c {
                            Some(c) => deliver.claim(c).await,
                            None => return,
                        },
                        _ = sweep.tick() => deliver.warnings.forget_ended(now_us()),
                    }
                }
            })
            .await;
        }
    });
    Ok(Started {
        warnings: Some(warnings),
        stats,
    })
}

#[derive(Clone)]
struct Deliver {
    endpoints: Arc<Vec<Arc<Endpoint>>>,
    store: Store,
    holder: String,
    retries: u32,
    backoff: Duration,
    timeout: Duration,
    stats: Arc<WebhookStats>,
    warnings: Arc<Warnings>,
}

impl Deliver {
    /// Claims `c`; when this gateway holds it, sends it to every webhook (each on its own
    /// task, so a slow one holds up neither the others nor the next warning).
    async fn claim(&self, c: Crossing) {
        let ttl =
            Duration::from_micros(c.window_end_us.saturating_sub(now_us())) + CLAIM_AFTER_WINDOW;
        match self
            .store
            .claims
            .claim(&c.claim_name(), &self.holder, ttl)
            .await
        {
            Ok(true) => {
                self.stats.claimed.fetch_add(1, Ordering::Relaxed);
                let event = Arc::new(Event::of(&c));
                for e in self.endpoints.iter() {
                    let (this, e, event) = (self.clone(), Arc::clone(e), Arc::clone(&event));
                    tokio::spawn(async move { this.send(&e, &event).await });
                }
            }
            Ok(false) => {
                self.stats.claimed_elsewhere.fetch_add(1, Ordering::Relaxed);
            }
            Err(err) => {
                self.stats.claim_failed.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %err, client = %c.client, limit = %c.limit, percent = c.percent, "a quota warning could not be claimed; it is looked for again");
                self.warnings.retry_later(&c);
            }
        }
    }

    /// Tries `event` at `e` until a 2xx, a refusal that a retry cannot change (a 4xx but
    /// 408 and 429), or the last retry; then audits and counts the end.
    async fn send(&self, e: &Endpoint, event: &Event) {
        let mut wait = self.backoff;
        let mut tries = 0u32;
        let outcome = loop {
            tries += 1;
            let result = self.try_once(e, event).await;
            let again = match &result {
                Ok(status) if (200..300).contains(status) => false,
                Ok(status) => *status >= 500 || *status == 408 || *status == 429,
                Err(_) => true,
            };
            if !again || tries > self.retries {
                break result;
            }
            self.stats.retries.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(MAX_BACKOFF);
        };
        let delivered = matches!(outcome, Ok(s) if (200..300).contains(&s));
        let (counter, action) = if delivered {
            (&self.stats.delivered, "warning.delivered")
        } else {
            (&self.stats.failed, "warning.failed")
        };
        counter.fetch_add(1, Ordering::Relaxed);
        let status = match &outcome {
            Ok(s) => serde_json::json!(s),
            Err(err) => serde_json::json!(err),
        };
        if !delivered {
            tracing::warn!(url = %e.shown, client = %event.client, tries, status = %status, "a quota warning was not delivered");
        }
        let entry = AuditEntry {
            at_ms: now_us() / 1000,
            actor: "gateway".into(),
            action: action.into(),
            kind: "client".into(),
            id: event.client.clone(),
            rev: 0,
            before: None,
            after: Some(serde_json::json!({
                "event": event.id, "url": e.shown, "limit": event.limit,
                "percent": event.percent, "tries": tries, "status": status,
            })),
        };
        if let Err(err) = self.store.audit.record(entry).await {
            tracing::warn!(error = %err, "a quota warning's delivery could not be audited");
        }
    }

    /// One POST, once one of the webhook's [`IN_FLIGHT`] tries is free: its status, or why
    /// there was none.
    async fn try_once(&self, e: &Endpoint, event: &Event) -> Result<u16, String> {
        let _try = e.tries.acquire().await.map_err(|err| err.to_string())?;
        let t = now_us() / 1_000_000;
        let req = http::Request::post(&e.url)
            .header("content-type", "application/json")
            .header(
                "user-agent",
                concat!("tollgate/", env!("CARGO_PKG_VERSION")),
            )
            .header("tollgate-event-id", &event.id)
            .header("tollgate-signature", signature(&e.secret, t, &event.body))
            .body(Full::new(event.body.clone()))
            .map_err(|err| err.to_string())?;
        match tokio::time::timeout(self.timeout, e.client.request(req)).await {
            Ok(Ok(resp)) => Ok(resp.status().as_u16()),
            Ok(Err(err)) => Err(format!("no answer: {err}")),
            Err(_) => Err(format!("no answer within {:?}", self.timeout)),
        }
    }
}

/// A warning as sent: the same body and id to every webhook.
struct Event {
    id: String,
    client: String,
    limit: String,
    percent: u8,
    body: Bytes,
}

impl Event {
    fn of(c: &Crossing) -> Event {
        // The id is the claim's: the same warning always has the same id.
        let id = c.claim_name();
        let body = serde_json::json!({
            "type": "quota.warning",
            "id": id,
            "client": c.client.as_str(),
            "plan": c.plan.as_str(),
            "limit": &*c.limit,
            "percent": c.percent,
            "used": c.used,
            "quota": c.quota,
            "window_ends_at": rfc3339(c.window_end_us),
            "at": rfc3339(c.at_us),
        });
        Event {
            id,
            client: c.client.to_string(),
            limit: c.limit.to_string(),
            percent: c.percent,
            body: Bytes::from(body.to_string()),
        }
    }
}

/// `t=<t>,v1=<hex HMAC-SHA256 of "<t>.<body>" keyed by secret>`.
pub fn signature(secret: &SecretString, t: u64, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret.expose_secret().as_bytes())
        .expect("HMAC takes a key of any length");
    mac.update(t.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!("t={t},v1={}", hex::encode(mac.finalize().into_bytes()))
}

/// A URL without its user, password and query (they may hold secrets).
fn shown(url: &str) -> String {
    match url.parse::<http::Uri>() {
        Ok(u) => {
            format!(
                "{}://{}{}",
                u.scheme_str().unwrap_or("http"),
                u.host().unwrap_or(""),
                u.port().map(|p| format!(":{p}")).unwrap_or_default()
            ) + u.path()
        }
        Err(_) => "(unreadable URL)".into(),
    }
}

fn rfc3339(unix_us: u64) -> String {
    jiff::Timestamp::from_microsecond(i64::try_from(unix_us).unwrap_or(i64::MAX))
        .map(|t| t.to_string())
        .unwrap_or_default()
}

fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signature_is_the_hmac_of_the_timestamp_and_the_body() {
        // HMAC-SHA256, key "key", message "1700000000.{}" (computed with openssl:
        // printf '1700000000.{}' | openssl dgst -sha256 -hmac key).
        let s = signature(&SecretString::from("key"), 1_700_000_000, b"{}");
        assert_eq!(
            s,
            "t=1700000000,v1=9d713ed406bb7076d4123f0dc2c39d2df5c654ed4b0cd56b52c8b4c940bd63ae"
        );
    }

    #[test]
    fn a_url_is_shown_without_its_user_password_or_query() {
        assert_eq!(
            shown("https://u:p@hooks.example:8443/t/x?token=s"),
            "https://hooks.example:8443/t/x"
        );
    }
}
