//! Who sent a request: the client its key names, if it sent one, and its client address.
//! Shared by the guard (every proxied request) and a client's own view, so both refuse
//! an unknown or expired key and count it against its address the same way.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::Instant;

use actix_web::http::header::HeaderValue;
use actix_web::HttpRequest;

use super::headers::X_FORWARDED_FOR;
use super::keys::FoundKey;
use crate::catalog::ClientEntry;
use crate::domain::{address_group, client_addr, KeyHash};
use crate::error::ApiError;
use crate::state::AppState;

/// What the store answered about a key this gateway did not hold (cache mode).
pub(super) enum LookedUp {
    /// Nothing yet: a key not held is [`ApiError::NotHeld`], for the caller to look up.
    Not,
    /// The client it found (`None`: no client has the key). Checked as a held one is: it
    /// may not hold the key any more, or the key may have expired.
    Found(Option<Arc<ClientEntry>>),
}

/// The client whose key `found` is (`None`: the request sent none). A key that is sent
/// must be known, on a public route too (a guess that misses is not let through as a
/// request without a key): `401`, or `401` `key-expired`. Unknown keys are counted per
/// address; past its allowance an address waits (`429`), with a valid key too. A key
/// the gateway does not hold but may exist (cache mode) is [`ApiError::NotHeld`] until
/// it is `looked_up`.
pub(super) fn client_of(
    req: &HttpRequest,
    state: &AppState,
    found: Option<&FoundKey<'_>>,
    looked_up: &LookedUp,
) -> Result<Option<Arc<ClientEntry>>, ApiError> {
    let Some(found) = found else {
        return Ok(None);
    };
    let hash = KeyHash::of(&found.key);
    let held = state.catalog.by_key(&hash).or_else(|| match looked_up {
        LookedUp::Found(Some(client)) => client.active_key(&hash).then(|| Arc::clone(client)),
        _ => None,
    });
    // Neither held nor known to be unknown (cache mode): the store is to be asked.
    let to_ask = held.is_none()
        && matches!(looked_up, LookedUp::Not)
        && state.catalog.may_hold(&hash)
        && state.catalog.expired_at(&hash).is_none();
    if held.is_some() || to_ask {
        // An address held back for the unknown keys it sent waits, with a valid key too,
        // and before any store read: what one address costs the store is bounded by its
        // allowance.
        if let Some(wait_us) = state
            .failed_keys
            .as_ref()
            .and_then(|f| f.held(|| address_group_of(req, state)))
        {
            return Err(failed_keys_limited(state, wait_us));
        }
        return held.map(Some).ok_or(ApiError::NotHeld(hash));
    }
    let noted = state
        .failed_keys
        .as_ref()
        .and_then(|f| f.note(address_group_of(req, state), Instant::now()));
    if let Some(wait_us) = noted {
        return Err(failed_keys_limited(state, wait_us));
    }
    state.metrics.count_outcome("unknown_key");
    let expired = state.catalog.expired_at(&hash).or(match looked_up {
        LookedUp::Found(Some(client)) => client.expired_at(&hash),
        _ => None,
    });
    Err(match expired {
        Some(at) => ApiError::KeyExpired(at),
        None => state.key_sources.missing(),
    })
}

/// Cache mode: looks up a key [`client_of`] found not held (`NotHeld`), within the lookup
/// timeout; a store that cannot answer is `503` `catalog-unavailable` (the key cannot be
/// checked, so it is not let in; the clients held are served as ever).
pub(super) async fn look_up(state: &AppState, hash: KeyHash) -> Result<LookedUp, ApiError> {
    // An overloaded worker reads no more keys it does not hold: `503`, `Retry-After: 1`.
    let filtered = state.catalog.key_filter_in_place();
    let Some(_waiting) = state.limiter.admit_lookup(&hash, filtered) else {
        return Err(ApiError::Overloaded);
    };
    match state.catalog.look_up(&state.store, hash).await {
        Ok(client) => Ok(LookedUp::Found(client)),
        Err(e) => {
            // Counted by the catalog (`tollgate_catalog_lookups_total{result="failed"}`).
            tracing::debug!(error = %e, "a key not held could not be looked up");
            Err(ApiError::CatalogUnavailable(e.to_string()))
        }
    }
}

/// The address group of the request's client (as public routes group them); without an address,
/// the unspecified one.
fn address_group_of(req: &HttpRequest, state: &AppState) -> (IpAddr, u8) {
    match client_ip(req, state) {
        Some(ip) => address_group(ip, state.edge.ipv4_prefix, state.edge.ipv6_prefix),
        None => (Ipv4Addr::UNSPECIFIED.into(), 0),
    }
}

/// The request's client address, as it is forwarded (see [`client_addr`]).
pub(super) fn client_ip(req: &HttpRequest, state: &AppState) -> Option<IpAddr> {
    let lines = req
        .headers()
        .get_all(&X_FORWARDED_FOR)
        .map(HeaderValue::as_bytes);
    client_addr(
        lines,
        req.peer_addr().map(|a| a.ip()),
        &state.trusted_proxies,
    )
}

/// The answer to an address past its allowance of unknown keys, `wait_us` before it has
/// one again: counted, and no store call.
fn failed_keys_limited(state: &AppState, wait_us: u64) -> ApiError {
    state.metrics.count_outcome("failed_keys_limited");
    ApiError::TooManyFailedKeys(wait_us.div_ceil(1_000_000).max(1))
}
