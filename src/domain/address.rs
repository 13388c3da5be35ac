//! A request's client address: the peer, or, behind trusted proxies, the nearest hop of
//! `X-Forwarded-For` they did not write themselves. One walk, used both for what is
//! forwarded (`Forwarded`, `X-Forwarded-For`) and for what is limited per address, so the
//! two can never disagree.

use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;

/// The client's address.
///
/// - An untrusted peer is the client, whatever it claims in `X-Forwarded-For`.
/// - A trusted peer's `X-Forwarded-For` is walked from the right (the nearest hop first).
///   The first address outside `trusted` is the client. A hop that is not an address
///   (`unknown`, an obfuscated name, garbage) stops the walk: everything to its left was
///   written by someone the gateway cannot vouch for, so the client is the hop to its
///   right, the last one a trusted proxy wrote. When every hop is trusted, the client is
///   the leftmost (as nginx's `real_ip_recursive`).
///
/// `xff` yields the `X-Forwarded-For` lines in the order they arrived; an `ip:port` or
/// `[v6]:port` hop is an address (some proxies write the port). Every address is
/// canonical: `::ffff:a.b.c.d` is `a.b.c.d`, so a dual-stack listener and a proxy that
/// writes mapped addresses name one IPv4 client one way.
pub fn client_addr<'a, I>(xff: I, peer: Option<IpAddr>, trusted: &[IpNet]) -> Option<IpAddr>
where
    I: DoubleEndedIterator<Item = &'a [u8]>,
{
    let peer = peer.map(|p| p.to_canonical());
    let is_trusted = |ip: &IpAddr| trusted.iter().any(|n| n.contains(ip));
    let Some(mut client) = peer.filter(is_trusted) else {
        return peer;
    };
    for line in xff.rev() {
        let Ok(line) = std::str::from_utf8(line) else {
            return Some(client);
        };
        for hop in line.rsplit(',').map(str::trim) {
            if hop.is_empty() {
                continue;
            }
            let Some(ip) = hop_addr(hop) else {
                return Some(client);
            };
            client = ip;
            if !is_trusted(&ip) {
                return Some(ip);
            }
        }
    }
    Some(client)
}

/// One `X-Forwarded-For` hop as an address: `a.b.c.d`, `v6`, `[v6]`, `a.b.c.d:port` or
/// `[v6]:port`, canonical. `None` for anything else.
pub fn hop_addr(hop: &str) -> Option<IpAddr> {
    let ip = match hop.parse::<IpAddr>() {
        Ok(ip) => ip,
        Err(_) => match hop.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
            Some(v6) => IpAddr::V6(v6.parse().ok()?),
            None => hop.parse::<SocketAddr>().ok()?.ip(),
        },
    };
    Some(ip.to_canonical())
}

/// The state tag of `plan`'s bucket for the client at `ip`, on a public route: the plan
/// and the address's group, its first `v4`/`v6` bits. `anonymous@203.0.113.7` (a whole
/// IPv4 address), `anonymous@203.0.113.0~24`, `anonymous@2001:db8:0:1::~64`, and
/// `anonymous@unknown` without an address.
///
/// A client's tag is its id, a shard's `id:region`: `@` is in neither, so an address can
/// never share a client's state. There is no `{`, `}` or `/` (the key's hash tag and the
/// state field's separator). The prefix length is part of the tag, so a reconfiguration
/// never reads one group's state as another's.
pub fn address_tag(plan: &str, ip: Option<IpAddr>, v4: u8, v6: u8) -> String {
    use std::fmt::Write;
    let mut tag = String::with_capacity(plan.len() + 32);
    tag.push_str(plan);
    tag.push('@');
    let Some(ip) = ip else {
        tag.push_str("unknown");
        return tag;
    };
    let (group, len) = address_group(ip, v4, v6);
    let _ = write!(tag, "{group}");
    if len < if group.is_ipv4() { 32 } else { 128 } {
        let _ = write!(tag, "~{len}");
    }
    tag
}

/// `ip`'s group: its first `v4` bits (IPv4) or `v6` bits (IPv6), the others cleared, and
/// that prefix length. A mapped IPv4 address is IPv4.
pub fn address_group(ip: IpAddr, v4: u8, v6: u8) -> (IpAddr, u8) {
    match ip.to_canonical() {
        IpAddr::V4(a) => {
            let len = v4.min(32);
            let mask = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
            (IpAddr::from((u32::from(a) & mask).to_be_bytes()), len)
        }
        IpAddr::V6(a) => {
            let len = v6.min(128);
            let mask = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
            (IpAddr::from((u128::from(a) & mask).to_be_bytes()), len)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn walk(lines: &[&str], peer: &str, trusted: &[&str]) -> Option<IpAddr> {
        let trusted: Vec<IpNet> = trusted.iter().map(|t| t.parse().unwrap()).collect();
        client_addr(lines.iter().map(|l| l.as_bytes()), Some(ip(peer)), &trusted)
    }

    #[test]
    fn an_untrusted_peer_is_the_client_whatever_it_claims() {
        assert_eq!(walk(&["6.6.6.6"], "10.0.0.9", &[]), Some(ip("10.0.0.9")));
        assert_eq!(
            walk(&["6.6.6.6"], "10.0.0.9", &["10.1.0.0/16"]),
            Some(ip("10.0.0.9"))
        );
        assert_eq!(client_addr([].into_iter(), None, &[]), None);
    }

    #[test]
    fn the_nearest_untrusted_hop_is_the_client() {
        let t = &["10.0.0.0/8"];
        assert_eq!(
            walk(&["1.2.3.4, 10.0.0.2"], "10.0.0.9", t),
            Some(ip("1.2.3.4"))
        );
        // The client may prepend anything: it is left of the first untrusted hop.
        assert_eq!(
            walk(&["9.9.9.9, 1.2.3.4"], "10.0.0.9", t),
            Some(ip("1.2.3.4"))
        );
        // Several header lines are one list, in order.
        assert_eq!(
            walk(&["9.9.9.9", "1.2.3.4, 10.0.0.2"], "10.0.0.9", t),
            Some(ip("1.2.3.4"))
        );
        assert_eq!(
            walk(&["1.2.3.4", "10.0.0.2"], "10.0.0.9", t),
            Some(ip("1.2.3.4"))
        );
        // Every hop trusted: the leftmost; no header: the peer.
        assert_eq!(
            walk(&["10.0.0.3, 10.0.0.2"], "10.0.0.9", t),
            Some(ip("10.0.0.3"))
        );
        assert_eq!(walk(&[], "10.0.0.9", t), Some(ip("10.0.0.9")));
        assert_eq!(walk(&[" , ,"], "10.0.0.9", t), Some(ip("10.0.0.9")));
    }

    #[test]
    fn a_hop_that_is_not_an_address_stops_the_walk() {
        let t = &["10.0.0.0/8"];
        // A spoofed address left of garbage is never believed.
        assert_eq!(
            walk(&["6.6.6.6, unknown"], "10.0.0.9", t),
            Some(ip("10.0.0.9"))
        );
        assert_eq!(
            walk(&["6.6.6.6, bogus, 10.0.0.2"], "10.0.0.9", t),
            Some(ip("10.0.0.2"))
        );
        assert_eq!(
            walk(&["6.6.6.6, 1.2.3.4:99999"], "10.0.0.9", t),
            Some(ip("10.0.0.9"))
        );
        assert_eq!(
            walk(&["6.6.6.6, _hidden"], "10.0.0.9", t),
            Some(ip("10.0.0.9"))
        );
    }

    #[test]
    fn a_hop_with_a_port_is_its_address() {
        let t = &["10.0.0.0/8"];
        assert_eq!(
            walk(&["6.6.6.6, 1.2.3.4:5678"], "10.0.0.9", t),
            Some(ip("1.2.3.4"))
        );
        assert_eq!(
            walk(&["6.6.6.6, [2001:db8::7]:443"], "10.0.0.9", t),
            Some(ip("2001:db8::7"))
        );
        assert_eq!(
            walk(&["[2001:db8::7]"], "10.0.0.9", t),
            Some(ip("2001:db8::7"))
        );
        assert_eq!(
            walk(&["2001:db8::7"], "10.0.0.9", t),
            Some(ip("2001:db8::7"))
        );
    }

    #[test]
    fn mapped_ipv4_addresses_are_ipv4() {
        assert_eq!(
            walk(&[], "::ffff:203.0.113.1", &[]),
            Some(ip("203.0.113.1"))
        );
        // A mapped peer is matched against IPv4 trusted networks.
        assert_eq!(
            walk(&["::ffff:1.2.3.4"], "::ffff:10.0.0.9", &["10.0.0.0/8"]),
            Some(ip("1.2.3.4"))
        );
        assert_eq!(hop_addr("[::ffff:1.2.3.4]:80"), Some(ip("1.2.3.4")));
        assert_eq!(hop_addr("::1"), Some(ip("::1")));
    }

    #[test]
    fn an_address_is_grouped_by_its_prefix() {
        let tag = |a: &str, v4, v6| address_tag("anonymous", Some(ip(a)), v4, v6);
        assert_eq!(tag("203.0.113.7", 32, 64), "anonymous@203.0.113.7");
        assert_eq!(tag("203.0.113.7", 24, 64), "anonymous@203.0.113.0~24");
        assert_eq!(tag("::ffff:203.0.113.7", 32, 64), "anonymous@203.0.113.7");
        assert_eq!(
            tag("2001:db8:0:1::1", 32, 64),
            "anonymous@2001:db8:0:1::~64"
        );
        assert_eq!(
            tag("2001:db8:0:1:ffff::2", 32, 64),
            "anonymous@2001:db8:0:1::~64"
        );
        assert_ne!(
            tag("2001:db8:0:2::1", 32, 64),
            tag("2001:db8:0:1::1", 32, 64)
        );
        assert_eq!(tag("2001:db8::1", 32, 128), "anonymous@2001:db8::1");
        assert_eq!(tag("2001:db8::1", 32, 1), "anonymous@::~1");
        assert_eq!(tag("203.0.113.7", 1, 64), "anonymous@128.0.0.0~1");
        assert_eq!(address_tag("p", None, 32, 64), "p@unknown");
        for t in [tag("2001:db8::1", 32, 48), tag("10.1.2.3", 8, 64)] {
            assert!(!t.contains(['{', '}', '/']), "{t}");
        }
    }
}
