//! Admission of connections by client address, decided before a byte of them is read: no
//! TLS handshake, no HTTP/2 preface, no buffer for a connection refused here.
//!
//! Two bounds per address group (`edge.ipv4_prefix` / `edge.ipv6_prefix`, as the per-IP
//! limits group them), like HAProxy's `src_conn_cur` and `src_conn_rate`, and Envoy's
//! connection limit filter:
//! - `server.max_connections_per_address` open at once (a client cannot hold the gateway's
//!   sockets and memory without a bound);
//! - `server.new_connections_per_address` opened a second, a token bucket holding a
//!   second's worth: a handshake flood, or HTTP/2 rapid reset reconnecting after every
//!   GOAWAY, costs the gateway that many handshakes a second and no more.
//!
//! A refused connection is reset at once (`SO_LINGER` 0: no TIME_WAIT kept for it) and
//! counted in `tollgate_connections_refused_total`. Peers in `server.trusted_proxies` are
//! load balancers carrying many clients: neither bound applies to them.
//!
//! The table holds an entry per address group with a connection open or a bucket not yet
//! full again; it is swept of the others when it has doubled since the last sweep, so it
//! is bounded by the open connections and the groups seen within the last second.

use std::collections::HashMap;
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

use ipnet::IpNet;
use parking_lot::Mutex;

use crate::domain::address_group;

/// The table is not swept below this many entries.
const SWEEP_FLOOR: usize = 4096;

/// Refused connections an address group may have held unread at once ([`Held`]); past
/// it, its refused connections are reset at once.
const HELD_PER_GROUP: u32 = 32;

/// What [`Admission`] is told to enforce.
#[derive(Debug, Clone)]
pub struct Bounds {
    /// Connections open at once per address group (`None`: no bound).
    pub open: Option<NonZeroU32>,
    /// New connections a second per address group (`None`: no bound).
    pub per_second: Option<NonZeroU32>,
    /// Peers neither bound applies to (`server.trusted_proxies`).
    pub exempt: Vec<IpNet>,
    /// `edge.ipv4_prefix` and `edge.ipv6_prefix`: how addresses are grouped.
    pub ipv4_prefix: u8,
    pub ipv6_prefix: u8,
}

/// A refused connection: why, and whether to hold it before its reset.
#[derive(Debug)]
pub struct Refused {
    pub reason: Refusal,
    /// `Some` while the group has fewer than [`HELD_PER_GROUP`] refused connections held:
    /// keep the connection, unread, until this is dropped.
    pub hold: Option<Held>,
}

/// Why a connection was refused: the `reason` label of the refusals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Its address group had `server.max_connections_per_address` open.
    Open,
    /// Its address group had opened `server.new_connections_per_address` in the last
    /// second.
    Rate,
}

/// One listener's admission: its bounds, the address groups it tracks, and its counts.
#[derive(Debug)]
pub struct Admission {
    /// `public` or `admin`: the `listener` label of the metrics.
    pub(super) listener: &'static str,
    bounds: Bounds,
    table: Mutex<Table>,
    pub(super) open: AtomicU64,
    pub(super) refused_open: AtomicU64,
    pub(super) refused_rate: AtomicU64,
}

#[derive(Debug, Default)]
struct Table {
    groups: HashMap<IpAddr, Group>,
    /// The table's size after its last sweep.
    swept_at: usize,
}

#[derive(Debug)]
struct Group {
    open: u32,
    /// Refused connections held unread now.
    held: u32,
    /// New connections it may open now (the bucket), as of `at`.
    tokens: f64,
    at: Instant,
}

/// A refused connection, counted held until it is dropped.
#[derive(Debug)]
pub struct Held {
    admission: Arc<Admission>,
    group: IpAddr,
}

/// An admitted connection: counted open until it is dropped.
#[derive(Debug)]
pub struct Permit {
    admission: Arc<Admission>,
    /// The address group it counts in; `None` for an exempt peer.
    group: Option<IpAddr>,
}

impl Admission {
    pub fn new(listener: &'static str, bounds: Bounds) -> Arc<Admission> {
        Arc::new(Admission {
            listener,
            bounds,
            table: Mutex::new(Table::default()),
            open: AtomicU64::new(0),
            refused_open: AtomicU64::new(0),
            refused_rate: AtomicU64::new(0),
        })
    }

    /// Admits a connection from `peer` (`None`: its address could not be read, so it is
    /// admitted untracked), or says why not.
    pub fn admit(self: &Arc<Self>, peer: Option<IpAddr>, now: Instant) -> Result<Permit, Refused> {
        let b = &self.bounds;
        let tracked = peer.filter(|ip| {
            (b.open.is_some() || b.per_second.is_some())
                && !b.exempt.iter().any(|n| n.contains(&ip.to_canonical()))
        });
        let Some(ip) = tracked else {
            return Ok(self.permit(None));
        };
        let (group, _) = address_group(ip, b.ipv4_prefix, b.ipv6_prefix);
        let mut table = self.table.lock();
        table.sweep(b, now);
        let burst = b.per_second.map_or(0.0, |r| f64::from(r.get()));
        let entry = table.groups.entry(group).or_insert(Group {
            open: 0,
            held: 0,
            tokens: burst,
            at: now,
        });
        let refused = if b.open.is_some_and(|max| entry.open >= max.get()) {
            Some((Refusal::Open, &self.refused_open))
        } else if let Some(rate) = b.per_second {
            entry.refill(f64::from(rate.get()), now);
            (entry.tokens < 1.0).then_some((Refusal::Rate, &self.refused_rate))
        } else {
            None
        };
        if let Some((reason, count)) = refused {
            count.fetch_add(1, Relaxed);
            let hold = (entry.held < HELD_PER_GROUP).then(|| {
                entry.held += 1;
                Held {
                    admission: Arc::clone(self),
                    group,
                }
            });
            return Err(Refused { reason, hold });
        }
        if b.per_second.is_some() {
            entry.tokens -= 1.0;
        }
        entry.open += 1;
        drop(table);
        Ok(self.permit(Some(group)))
    }

    fn permit(self: &Arc<Self>, group: Option<IpAddr>) -> Permit {
        self.open.fetch_add(1, Relaxed);
        Permit {
            admission: Arc::clone(self),
            group,
        }
    }

    /// Address groups tracked now (for the tests of the table's bound).
    pub fn tracked(&self) -> usize {
        self.table.lock().groups.len()
    }
}

impl Group {
    fn refill(&mut self, rate: f64, now: Instant) {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * rate).min(rate);
        self.at = now;
    }

    /// Whether forgetting it changes nothing: no connection open, and its bucket full.
    fn idle(&self, rate: Option<NonZeroU32>, now: Instant) -> bool {
        self.open == 0
            && self.held == 0
            && rate.is_none_or(|r| {
                let r = f64::from(r.get());
                self.tokens + now.saturating_duration_since(self.at).as_secs_f64() * r >= r
            })
    }
}

impl Table {
    /// Forgets the idle groups once the table has doubled since the last sweep: amortised
    /// constant time per connection.
    fn sweep(&mut self, b: &Bounds, now: Instant) {
        if self.groups.len() < SWEEP_FLOOR.max(2 * self.swept_at) {
            return;
        }
        self.groups.retain(|_, g| !g.idle(b.per_second, now));
        self.swept_at = self.groups.len();
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut table = self.admission.table.lock();
        if let Some(g) = table.groups.get_mut(&self.group) {
            g.held = g.held.saturating_sub(1);
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.admission.open.fetch_sub(1, Relaxed);
        let Some(group) = self.group else { return };
        let mut table = self.admission.table.lock();
        if let Some(g) = table.groups.get_mut(&group) {
            g.open = g.open.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn bounds(open: u32, per_second: u32) -> Bounds {
        Bounds {
            open: NonZeroU32::new(open),
            per_second: NonZeroU32::new(per_second),
            exempt: vec!["10.0.0.0/8".parse().unwrap()],
            ipv4_prefix: 32,
            ipv6_prefix: 64,
        }
    }

    fn ip(s: &str) -> Option<IpAddr> {
        Some(s.parse().unwrap())
    }

    #[test]
    fn an_address_holds_at_most_its_open_connections_and_gets_one_back_when_one_closes() {
        let a = Admission::new("public", bounds(2, 0));
        let now = Instant::now();
        let first = a.admit(ip("192.0.2.1"), now).unwrap();
        let _second = a.admit(ip("192.0.2.1"), now).unwrap();
        assert_eq!(
            a.admit(ip("192.0.2.1"), now).unwrap_err().reason,
            Refusal::Open
        );
        // Another address is not held back by this one.
        assert!(a.admit(ip("192.0.2.2"), now).is_ok());
        drop(first);
        assert!(a.admit(ip("192.0.2.1"), now).is_ok());
        assert_eq!(a.refused_open.load(Relaxed), 1);
    }

    #[test]
    fn new_connections_are_a_token_bucket_of_one_seconds_worth() {
        let a = Admission::new("public", bounds(0, 10));
        let t0 = Instant::now();
        for _ in 0..10 {
            drop(a.admit(ip("192.0.2.1"), t0).unwrap());
        }
        assert_eq!(
            a.admit(ip("192.0.2.1"), t0).unwrap_err().reason,
            Refusal::Rate
        );
        // A tenth of a second later, one more.
        let t1 = t0 + Duration::from_millis(100);
        assert!(a.admit(ip("192.0.2.1"), t1).is_ok());
        assert_eq!(
            a.admit(ip("192.0.2.1"), t1).unwrap_err().reason,
            Refusal::Rate
        );
        // Waiting longer does not save up more than a second's worth.
        let t2 = t1 + Duration::from_secs(60);
        for _ in 0..10 {
            assert!(a.admit(ip("192.0.2.1"), t2).is_ok());
        }
        assert!(a.admit(ip("192.0.2.1"), t2).is_err());
        assert_eq!(a.refused_rate.load(Relaxed), 3);
    }

    #[test]
    fn trusted_proxies_and_unreadable_peers_are_not_bounded_and_ipv6_counts_by_prefix() {
        let a = Admission::new("public", bounds(1, 0));
        let now = Instant::now();
        let held: Vec<_> = (0..5)
            .map(|_| a.admit(ip("10.1.2.3"), now).unwrap())
            .chain((0..5).map(|_| a.admit(None, now).unwrap()))
            .collect();
        assert_eq!(a.open.load(Relaxed), 10);
        let _v6 = a.admit(ip("2001:db8::1"), now).unwrap();
        // The same /64.
        assert_eq!(
            a.admit(ip("2001:db8::ffff:1"), now).unwrap_err().reason,
            Refusal::Open
        );
        // An IPv4-mapped address is its IPv4 address.
        let _v4 = a.admit(ip("192.0.2.9"), now).unwrap();
        assert!(a.admit(ip("::ffff:192.0.2.9"), now).is_err());
        drop(held);
        assert_eq!(a.open.load(Relaxed), 2);
    }

    #[test]
    fn a_group_has_at_most_its_share_of_refused_connections_held_and_the_rest_reset_at_once() {
        let a = Admission::new("public", bounds(1, 0));
        let now = Instant::now();
        let _open = a.admit(ip("192.0.2.1"), now).unwrap();
        let mut held: Vec<Held> = (0..HELD_PER_GROUP)
            .map(|_| a.admit(ip("192.0.2.1"), now).unwrap_err().hold.unwrap())
            .collect();
        assert!(a.admit(ip("192.0.2.1"), now).unwrap_err().hold.is_none());
        // Another group has its own share.
        let _other = a.admit(ip("192.0.2.2"), now).unwrap();
        assert!(a.admit(ip("192.0.2.2"), now).unwrap_err().hold.is_some());
        held.pop();
        assert!(a.admit(ip("192.0.2.1"), now).unwrap_err().hold.is_some());
    }

    #[test]
    fn the_table_forgets_idle_addresses_so_many_addresses_do_not_grow_it_for_ever() {
        let a = Admission::new("public", bounds(4, 100));
        let t0 = Instant::now();
        let kept = a.admit(ip("192.0.2.1"), t0).unwrap();
        for i in 0..20_000u32 {
            let addr = IpAddr::from((0xc633_0000u32 + i).to_be_bytes());
            drop(a.admit(Some(addr), t0).unwrap());
        }
        // Within the second, every bucket is still refilling: all are remembered.
        assert!(a.tracked() > 20_000);
        // Past it, the next sweep keeps only the address with a connection open.
        let t1 = t0 + Duration::from_secs(2);
        for i in 0..SWEEP_FLOOR.max(20_001) as u32 {
            let addr = IpAddr::from((0xc634_0000u32 + i).to_be_bytes());
            drop(a.admit(Some(addr), t1).unwrap());
            if a.tracked() < 20_000 {
                break;
            }
        }
        assert!(a.tracked() < 20_000, "tracked {}", a.tracked());
        // The open connection's count survived the sweep.
        for _ in 0..3 {
            std::mem::forget(a.admit(ip("192.0.2.1"), t1).unwrap());
        }
        assert_eq!(
            a.admit(ip("192.0.2.1"), t1).unwrap_err().reason,
            Refusal::Open
        );
        drop(kept);
    }
}
