//! Where a request comes from: its peer, or behind trusted proxies the right-most untrusted
//! `X-Forwarded-For` hop and the proxy's `X-Request-Start`; and the address (an IPv6 network)
//! unverified callers are counted by.

use std::net::IpAddr;

use http::HeaderMap;

use super::Identifier;
use crate::clock::Nanos;

impl Identifier {
    /// When a request that reached this server at `now` (on the guard's clock, which counts from
    /// the Unix epoch) arrived: `now`, or, with `trust_proxy` and a trusted peer, the earlier
    /// `X-Request-Start` that proxy stamped on it (`t=` seconds, milliseconds or microseconds
    /// since the epoch, as nginx, HAProxy and Heroku's router write it), so the time it queued in
    /// front of the server counts too. Never later than `now`; anyone else's stamp is ignored (it
    /// would let a caller say the server is behind).
    pub fn arrived(&self, headers: &HeaderMap, peer: Option<IpAddr>, now: Nanos) -> Nanos {
        let Some(peer) = peer.map(|p| p.to_canonical()) else { return now };
        if !self.trust_proxy || !self.trusted(peer) {
            return now;
        }
        headers
            .get("x-request-start")
            .and_then(|v| v.to_str().ok())
            .and_then(request_start)
            .map_or(now, |stamped| stamped.min(now))
    }

    /// Whether `ip` (canonical: an IPv4-mapped IPv6 address is its IPv4 one) is a trusted proxy,
    /// whether the proxy is written as IPv4 (`127.0.0.1/8`) or IPv4-mapped (`::ffff:10.0.0.0/104`).
    fn trusted(&self, ip: IpAddr) -> bool {
        let mapped = match ip {
            IpAddr::V4(v4) => Some(IpAddr::V6(v4.to_ipv6_mapped())),
            IpAddr::V6(_) => None,
        };
        self.trusted_proxies.iter().any(|net| net.contains(&ip) || mapped.is_some_and(|m| net.contains(&m)))
    }

    /// The peer, or with `trust_proxy` and a trusted peer, the right-most untrusted
    /// `X-Forwarded-For` hop. Addresses are canonical: on a dual-stack listener an IPv4 client
    /// arrives as `::ffff:a.b.c.d`, and it is `a.b.c.d` both to `server.trusted_proxies` and in
    /// the caller's `ip:` id.
    pub(super) fn client_ip(&self, headers: &HeaderMap, peer: Option<IpAddr>) -> Option<IpAddr> {
        let peer = peer?.to_canonical();
        if !self.trust_proxy || !self.trusted(peer) {
            return Some(peer);
        }
        let hops = headers
            .get_all("x-forwarded-for")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .collect::<Vec<_>>();
        let mut client = peer;
        for hop in hops.iter().rev() {
            let Some(ip) = parse_hop(hop).map(|ip| ip.to_canonical()) else { break };
            client = ip;
            if !self.trusted(ip) {
                break;
            }
        }
        Some(client)
    }
}

/// An `X-Request-Start` value in nanoseconds since the Unix epoch: `t=` (optional) and a number
/// of seconds (a fraction allowed), milliseconds or microseconds, told apart by size as the
/// monitoring tools that read it do.
fn request_start(value: &str) -> Option<Nanos> {
    let number = value.trim();
    let number = number.strip_prefix("t=").unwrap_or(number).trim();
    let reading: f64 = number.parse().ok().filter(|n: &f64| n.is_finite() && *n >= 0.0)?;
    let per_unit = if reading < 1e11 {
        1e9
    } else if reading < 1e14 {
        1e6
    } else if reading < 1e17 {
        1e3
    } else {
        1.0
    };
    let nanos = reading * per_unit;
    (nanos < u64::MAX as f64).then_some(Nanos::new(nanos as u64))
}

/// The address `ip` counts as wherever callers are counted per address: an IPv4 address as it
/// is (an IPv4-mapped IPv6 one as its IPv4 address), an IPv6 address as its network of
/// `ipv6_prefix` bits (host bits zero). A single host is routinely given a whole /64, so the
/// addresses inside a prefix cost nothing to rotate.
pub fn address_group(ip: IpAddr, ipv6_prefix: u8) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => {
            let bits = u32::from(ipv6_prefix.min(128));
            let mask = u128::MAX.checked_shl(128 - bits).unwrap_or(0);
            IpAddr::V6(std::net::Ipv6Addr::from(u128::from(v6) & mask))
        }
    }
}

/// The address an unverified caller is charged to: an IPv4 address, or an IPv6 network of
/// `ipv6_prefix` bits ([`address_group`]).
pub(super) fn address_of(ip: Option<IpAddr>, ipv6_prefix: u8) -> String {
    match ip.map(|ip| address_group(ip, ipv6_prefix)) {
        Some(IpAddr::V4(v4)) => format!("ip:{v4}"),
        Some(IpAddr::V6(net)) => format!("ip6:{net}/{ipv6_prefix}"),
        None => "ip:unknown".to_owned(),
    }
}

/// An address as [`address_of`] writes it (`ip:…`, `ip6:…/<ipv6_prefix>`, `ip:unknown`), in that
/// form; an `ip6:` network of another prefix length names no address this server counts.
pub(super) fn canonical_address(text: &str, ipv6_prefix: u8) -> Option<String> {
    if text == "ip:unknown" {
        return Some(text.to_owned());
    }
    if let Some(ip) = text.strip_prefix("ip:") {
        return Some(address_of(Some(ip.parse().ok()?), ipv6_prefix));
    }
    let (net, prefix) = text.strip_prefix("ip6:")?.rsplit_once('/')?;
    if prefix.parse::<u8>().ok()? != ipv6_prefix {
        return None;
    }
    let net = net.parse::<std::net::Ipv6Addr>().ok()?;
    Some(address_of(Some(IpAddr::V6(net)), ipv6_prefix))
}

/// One `X-Forwarded-For` entry: an address, possibly with a port or IPv6 brackets.
fn parse_hop(hop: &str) -> Option<IpAddr> {
    hop.parse::<IpAddr>()
        .ok()
        .or_else(|| hop.parse::<std::net::SocketAddr>().ok().map(|s| s.ip()))
        .or_else(|| hop.strip_prefix('[')?.strip_suffix(']')?.parse().ok())
}
