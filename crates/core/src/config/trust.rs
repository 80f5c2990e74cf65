//! The keys of `[server]` that name callers behind a proxy (`trust_proxy`, `trusted_proxies`,
//! `ipv6_prefix`): the limits read them to tell one unverified caller from another, so they
//! belong to the limits' configuration, though they sit in the server's section.

use std::net::IpAddr;

use ipnet::IpNet;
use serde::Deserialize;

use super::{ConfigError, invalid};

/// Whose `X-Forwarded-For` names the caller, and how addresses are grouped: the part of
/// `[server]` the limits read ([`LimitsConfig::proxies`](super::LimitsConfig::proxies)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyTrust {
    /// Whether `X-Forwarded-For` from a trusted proxy names the caller.
    pub trust_proxy: bool,
    /// Proxies whose `X-Forwarded-For` is believed.
    pub trusted_proxies: Vec<IpNet>,
    /// The prefix length that groups IPv6 addresses into one address (`server.ipv6_prefix`): one
    /// host is routinely given a whole /64, so its addresses cost nothing to rotate.
    pub ipv6_prefix: u8,
}

impl Default for ProxyTrust {
    fn default() -> Self {
        Self { trust_proxy: false, trusted_proxies: Vec::new(), ipv6_prefix: DEFAULT_IPV6_PREFIX }
    }
}

/// `server.ipv6_prefix` unless set: the /64 an ISP or a cloud gives one host.
pub(super) const DEFAULT_IPV6_PREFIX: u8 = 64;

/// The three keys as written (the rest of `[server]` is the server's to read and check).
#[derive(Debug, Deserialize)]
pub(super) struct RawTrust {
    trust_proxy: bool,
    trusted_proxies: Vec<String>,
    ipv6_prefix: i64,
}

impl RawTrust {
    /// The keys, checked: every fault named at its key.
    pub(super) fn validate(self) -> Result<ProxyTrust, ConfigError> {
        let ipv6_prefix = u8::try_from(self.ipv6_prefix).ok().filter(|p| (1..=128).contains(p)).ok_or_else(|| {
            invalid(
                "server.ipv6_prefix",
                format!("must be a prefix length from 1 to 128 (64 groups a host's /64; got {})", self.ipv6_prefix),
            )
        })?;
        let mut trusted_proxies = Vec::with_capacity(self.trusted_proxies.len());
        for (i, proxy) in self.trusted_proxies.iter().enumerate() {
            let net = proxy.parse::<IpNet>().or_else(|_| proxy.parse::<IpAddr>().map(IpNet::from)).map_err(|_| {
                invalid(format!("server.trusted_proxies[{i}]"), format!("`{proxy}` is not an IP or CIDR"))
            })?;
            trusted_proxies.push(net);
        }
        Ok(ProxyTrust { trust_proxy: self.trust_proxy, trusted_proxies, ipv6_prefix })
    }
}
