//! Which local address the out-of-band bootstrap listens on, chosen as NCCL chooses for its
//! own sockets: `NCCL_SOCKET_IFNAME` (prefix list, `^` exclude, `=` exact) and
//! `NCCL_SOCKET_FAMILY` when set; otherwise interfaces named `ib*` first, then anything but
//! `docker*` and `lo`, then `docker*`, then `lo`. IPv6 link-local addresses are never used,
//! because a handle cannot carry a scope.

use std::net::IpAddr;

use crate::config::{AddrFamily, NameFilter};
use crate::error::{Error, Result};

/// A local interface address usable for the bootstrap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LocalAddr {
    /// Interface name (`eth0`).
    pub(crate) ifname: String,
    /// Its address.
    pub(crate) ip: IpAddr,
}

fn usable(ip: &IpAddr, family: Option<AddrFamily>) -> bool {
    let family_ok = match family {
        Some(AddrFamily::Inet) => ip.is_ipv4(),
        Some(AddrFamily::Inet6) => ip.is_ipv6(),
        None => true,
    };
    let link_local_v6 = matches!(ip, IpAddr::V6(v6) if (v6.segments()[0] & 0xffc0) == 0xfe80);
    family_ok && !link_local_v6 && !ip.is_unspecified()
}

/// Picks the bootstrap address from `candidates` (interface name, address) in system order.
pub(crate) fn pick_from(
    candidates: &[(String, IpAddr)],
    filter: Option<&NameFilter>,
    family: Option<AddrFamily>,
) -> Result<LocalAddr> {
    let mut usable: Vec<&(String, IpAddr)> = candidates
        .iter()
        .filter(|(_, ip)| usable(ip, family))
        .collect();
    // IPv4 first when no family was asked for, as getifaddrs usually lists it.
    usable.sort_by_key(|(_, ip)| ip.is_ipv6());
    let found = match filter {
        Some(f) => usable.into_iter().find(|(name, _)| f.accepts(name, None)),
        None => {
            let is_lo = |n: &str| n == "lo" || n.starts_with("lo:");
            let tiers: [&dyn Fn(&str) -> bool; 4] = [
                &|n| n.starts_with("ib"),
                &|n| !n.starts_with("docker") && !is_lo(n),
                &|n| n.starts_with("docker"),
                &is_lo,
            ];
            tiers
                .iter()
                .find_map(|tier| usable.iter().find(|(name, _)| tier(name)).copied())
        }
    };
    found
        .map(|(ifname, ip)| LocalAddr {
            ifname: ifname.clone(),
            ip: *ip,
        })
        .ok_or_else(|| {
            let names: Vec<&str> = candidates.iter().map(|(n, _)| n.as_str()).collect();
            Error::no_device(format!(
                "no network interface matches NCCL_SOCKET_IFNAME/NCCL_SOCKET_FAMILY \
                 (interfaces here: {})",
                names.join(", ")
            ))
        })
}

/// Picks the bootstrap address from this host's interfaces.
pub(crate) fn pick(filter: Option<&NameFilter>, family: Option<AddrFamily>) -> Result<LocalAddr> {
    let ifaces = if_addrs::get_if_addrs().map_err(|e| Error::io("listing interfaces", e))?;
    let candidates: Vec<(String, IpAddr)> = ifaces
        .into_iter()
        .map(|i| (i.name.clone(), i.ip()))
        .collect();
    pick_from(&candidates, filter, family)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(list: &[(&str, &str)]) -> Vec<(String, IpAddr)> {
        list.iter()
            .map(|(n, a)| (n.to_string(), a.parse().unwrap()))
            .collect()
    }

    #[test]
    fn default_order_is_ib_then_other_then_docker_then_lo() {
        let all = c(&[
            ("lo", "127.0.0.1"),
            ("docker0", "172.17.0.1"),
            ("eth0", "192.0.2.2"),
            ("ib0", "10.0.0.1"),
        ]);
        assert_eq!(pick_from(&all, None, None).unwrap().ifname, "ib0");
        assert_eq!(pick_from(&all[..3], None, None).unwrap().ifname, "eth0");
        assert_eq!(pick_from(&all[..2], None, None).unwrap().ifname, "docker0");
        assert_eq!(pick_from(&all[..1], None, None).unwrap().ifname, "lo");
    }

    #[test]
    fn filter_and_family_apply() {
        let all = c(&[
            ("eth0", "fe80::1"),
            ("eth0", "fd00::2"),
            ("eth0", "192.0.2.2"),
            ("lo", "::1"),
            ("lo", "127.0.0.1"),
        ]);
        let lo = NameFilter::parse("NCCL_SOCKET_IFNAME", "lo", false).unwrap();
        let got = pick_from(&all, Some(&lo), None).unwrap();
        assert_eq!(got.ip, "127.0.0.1".parse::<IpAddr>().unwrap());
        let got = pick_from(&all, Some(&lo), Some(AddrFamily::Inet6)).unwrap();
        assert_eq!(got.ip, "::1".parse::<IpAddr>().unwrap());
        let got = pick_from(&all, None, Some(AddrFamily::Inet6)).unwrap();
        assert_eq!(
            got.ip,
            "fd00::2".parse::<IpAddr>().unwrap(),
            "link-local skipped"
        );
        let none = NameFilter::parse("NCCL_SOCKET_IFNAME", "=bond", false).unwrap();
        let err = pick_from(&all, Some(&none), None).unwrap_err();
        assert!(err.to_string().contains("eth0"));
    }
}
