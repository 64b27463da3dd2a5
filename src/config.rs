//! Every setting the plugin reads, parsed once at `init`, validated and logged at INFO.
//!
//! `NCCL_IB_*` and `NCCL_SOCKET_*` variables mean what they mean for NCCL's own IB transport
//! and sockets; plugin-specific ones use the `NCCL_ERDMA_` prefix. A bad value makes `init`
//! fail with `ncclInvalidUsage` and a WARN naming the variable, the value and what is accepted.

use std::fmt;

use crate::error::{Error, Result};

/// `NCCL_ERDMA_CTS_BATCH` when unset, on a software RDMA device (rxe, siw); 1 on hardware.
pub const CTS_BATCH_SOFTWARE: u32 = 8;

/// Which transport carries the data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportChoice {
    /// RDMA verbs (eRDMA, RoCE, IB); `init` fails where no device is usable.
    Verbs,
    /// TCP sockets, for hosts without RDMA and for tests.
    Tcp,
    /// Verbs when a device is usable, TCP otherwise.
    Auto,
}

impl fmt::Display for TransportChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TransportChoice::Verbs => "verbs",
            TransportChoice::Tcp => "tcp",
            TransportChoice::Auto => "auto",
        })
    }
}

/// Address family preference (`AF_INET` / `AF_INET6`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddrFamily {
    /// IPv4.
    Inet,
    /// IPv6.
    Inet6,
}

/// One entry of an `NCCL_IB_HCA` / `NCCL_SOCKET_IFNAME` style list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NameEntry {
    /// Device or interface name (or prefix).
    pub name: String,
    /// Port restriction (`mlx5_0:1`), only meaningful for `NCCL_IB_HCA`.
    pub port: Option<u32>,
}

/// A device/interface filter in NCCL's syntax: a comma-separated list of name prefixes;
/// a leading `^` excludes the listed names instead, a leading `=` (after any `^`) asks for
/// exact names instead of prefixes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NameFilter {
    /// Entries of the list.
    pub entries: Vec<NameEntry>,
    /// `^`: the list names what to exclude.
    pub exclude: bool,
    /// `=`: names must match exactly.
    pub exact: bool,
}

impl NameFilter {
    /// Parses NCCL's list syntax; `with_ports` accepts `name:port` entries.
    pub fn parse(var: &'static str, raw: &str, with_ports: bool) -> Result<Self> {
        let mut rest = raw.trim();
        let exclude = rest.starts_with('^');
        if exclude {
            rest = &rest[1..];
        }
        let exact = rest.starts_with('=');
        if exact {
            rest = &rest[1..];
        }
        let mut entries = Vec::new();
        for item in rest.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (name, port) = match item.split_once(':') {
                Some((name, port)) if with_ports => {
                    let port = port.parse::<u32>().ok().filter(|p| *p > 0).ok_or_else(|| {
                        Error::config(
                            var,
                            raw,
                            "a list of device[:port] names, port a positive number",
                        )
                    })?;
                    (name, Some(port))
                }
                _ => (item, None),
            };
            if name.is_empty() {
                return Err(Error::config(
                    var,
                    raw,
                    "a comma-separated list of names, optionally starting with ^ and/or =",
                ));
            }
            entries.push(NameEntry {
                name: name.to_string(),
                port,
            });
        }
        Ok(NameFilter {
            entries,
            exclude,
            exact,
        })
    }

    /// Whether `name` (on `port`, when ports matter) passes the filter. An empty filter
    /// accepts everything.
    pub fn accepts(&self, name: &str, port: Option<u32>) -> bool {
        if self.entries.is_empty() {
            return true;
        }
        let listed = self.entries.iter().any(|e| {
            let name_ok = if self.exact {
                e.name == name
            } else {
                name.starts_with(&e.name)
            };
            let port_ok = match (e.port, port) {
                (Some(want), Some(have)) => want == have,
                _ => true,
            };
            name_ok && port_ok
        });
        listed != self.exclude
    }
}

/// A value together with where it came from, for the INFO log and diagnostics.
#[derive(Debug, Clone, PartialEq)]
pub struct Setting<T> {
    /// The value in effect.
    pub value: T,
    /// True when the environment set it; false for the built-in default.
    pub from_env: bool,
}

impl<T> Setting<T> {
    fn default(value: T) -> Self {
        Setting {
            value,
            from_env: false,
        }
    }
    fn env(value: T) -> Self {
        Setting {
            value,
            from_env: true,
        }
    }
}

/// Everything the plugin reads from its environment.
#[derive(Debug, Clone)]
pub struct Config {
    /// `NCCL_ERDMA_TRANSPORT`: verbs | tcp | auto.
    pub transport: Setting<TransportChoice>,
    /// `NCCL_SOCKET_IFNAME`: interfaces for the out-of-band bootstrap and the tcp transport.
    pub socket_ifname: Setting<Option<NameFilter>>,
    /// `NCCL_SOCKET_FAMILY`: address family of those interfaces.
    pub socket_family: Setting<Option<AddrFamily>>,
    /// `NCCL_IB_HCA`: verbs devices to use.
    pub ib_hca: Setting<Option<NameFilter>>,
    /// `NCCL_IB_QPS_PER_CONNECTION`: RC QPs per connection.
    pub qps_per_connection: Setting<u32>,
    /// `NCCL_IB_SPLIT_DATA_ON_QPS`: split every message over all QPs.
    pub split_data_on_qps: Setting<bool>,
    /// `NCCL_IB_GID_INDEX`: fixed GID index, or -1 for automatic choice.
    pub gid_index: Setting<i32>,
    /// `NCCL_IB_ADDR_FAMILY`: family preferred by the GID choice.
    pub ib_addr_family: Setting<AddrFamily>,
    /// `NCCL_IB_ADDR_RANGE`: CIDR the chosen GID must be in.
    pub ib_addr_range: Setting<Option<String>>,
    /// `NCCL_IB_ROCE_VERSION_NUM`: RoCE version preferred by the GID choice.
    pub roce_version: Setting<u32>,
    /// `NCCL_IB_TIMEOUT`: QP local ACK timeout exponent.
    pub ib_timeout: Setting<u32>,
    /// `NCCL_IB_RETRY_CNT`: QP retry count.
    pub ib_retry_cnt: Setting<u32>,
    /// `NCCL_IB_TC`: traffic class, -1 = unset.
    pub ib_tc: Setting<i32>,
    /// `NCCL_IB_SL`: service level, -1 = unset.
    pub ib_sl: Setting<i32>,
    /// `NCCL_IB_PKEY`: partition key index.
    pub ib_pkey: Setting<u32>,
    /// `NCCL_IBVERBS_LIB`: libibverbs to load instead of the default.
    pub ibverbs_lib: Setting<Option<String>>,
    /// `NCCL_ERDMA_SPEED_MBPS`: reported link speed override.
    pub speed_mbps: Setting<Option<u32>>,
    /// `NCCL_ERDMA_CONNECT_TIMEOUT_MS`: how long `connect` may take to reach the peer's
    /// listener (and the listener waits for a connection's hello) before failing.
    pub connect_timeout_ms: Setting<u64>,
    /// `NCCL_ERDMA_PEER_TIMEOUT_S`: seconds after which a peer whose host stopped
    /// answering (TCP keepalive on the bootstrap connection) fails its comms; 0 = never.
    pub peer_timeout_s: Setting<u64>,
    /// `NCCL_ERDMA_STATS_INTERVAL`: seconds between traffic statistics lines, 0 = off.
    pub stats_interval_s: Setting<u64>,
    /// `NCCL_ERDMA_FORCE_FLUSH`: create the flush QP and flush after every receive that
    /// NCCL asks to flush, even without GPUDirect (diagnostics and tests).
    pub force_flush: Setting<bool>,
    /// `NCCL_ERDMA_CTS_BATCH`: clear-to-send entries a receiver may hold back and post in
    /// one RDMA write while the sender still holds at least two; 1 = post each at once, as
    /// NCCL's IB transport does. Unset: chosen per device by the verbs transport.
    pub cts_batch: Setting<Option<u32>>,
}

fn int_in<T>(var: &'static str, raw: &str, min: i64, max: i64) -> Result<T>
where
    T: TryFrom<i64>,
{
    raw.trim()
        .parse::<i64>()
        .ok()
        .filter(|v| (min..=max).contains(v))
        .and_then(|v| T::try_from(v).ok())
        .ok_or_else(|| Error::config(var, raw, format!("an integer from {min} to {max}")))
}

fn family(var: &'static str, raw: &str) -> Result<AddrFamily> {
    match raw.trim() {
        "AF_INET" | "inet" | "ipv4" => Ok(AddrFamily::Inet),
        "AF_INET6" | "inet6" | "ipv6" => Ok(AddrFamily::Inet6),
        _ => Err(Error::config(var, raw, "AF_INET or AF_INET6")),
    }
}

impl Config {
    /// Reads the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads settings through `get` (the environment, or a map in tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        // Empty values count as unset, as NCCL's own ncclGetEnv users treat them.
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        fn read<T>(
            v: Option<String>,
            default: T,
            parse: impl FnOnce(&str) -> Result<T>,
        ) -> Result<Setting<T>> {
            match v {
                Some(raw) => Ok(Setting::env(parse(&raw)?)),
                None => Ok(Setting::default(default)),
            }
        }
        const TRANSPORT: &str = "NCCL_ERDMA_TRANSPORT";
        Ok(Config {
            transport: read(get(TRANSPORT), TransportChoice::Verbs, |raw| {
                match raw.trim().to_ascii_lowercase().as_str() {
                    "verbs" | "ib" | "rdma" => Ok(TransportChoice::Verbs),
                    "tcp" | "socket" => Ok(TransportChoice::Tcp),
                    "auto" => Ok(TransportChoice::Auto),
                    _ => Err(Error::config(TRANSPORT, raw, "verbs, tcp or auto")),
                }
            })?,
            socket_ifname: read(get("NCCL_SOCKET_IFNAME"), None, |raw| {
                NameFilter::parse("NCCL_SOCKET_IFNAME", raw, false).map(Some)
            })?,
            socket_family: read(get("NCCL_SOCKET_FAMILY"), None, |raw| {
                family("NCCL_SOCKET_FAMILY", raw).map(Some)
            })?,
            ib_hca: read(get("NCCL_IB_HCA"), None, |raw| {
                NameFilter::parse("NCCL_IB_HCA", raw, true).map(Some)
            })?,
            qps_per_connection: read(get("NCCL_IB_QPS_PER_CONNECTION"), 1, |raw| {
                int_in("NCCL_IB_QPS_PER_CONNECTION", raw, 1, 128)
            })?,
            split_data_on_qps: read(get("NCCL_IB_SPLIT_DATA_ON_QPS"), false, |raw| {
                int_in::<u8>("NCCL_IB_SPLIT_DATA_ON_QPS", raw, 0, 1).map(|v| v == 1)
            })?,
            gid_index: read(get("NCCL_IB_GID_INDEX"), -1, |raw| {
                int_in("NCCL_IB_GID_INDEX", raw, -1, 255)
            })?,
            ib_addr_family: read(get("NCCL_IB_ADDR_FAMILY"), AddrFamily::Inet, |raw| {
                family("NCCL_IB_ADDR_FAMILY", raw)
            })?,
            ib_addr_range: read(get("NCCL_IB_ADDR_RANGE"), None, |raw| {
                parse_cidr(raw).map(|_| Some(raw.trim().to_string()))
            })?,
            roce_version: read(get("NCCL_IB_ROCE_VERSION_NUM"), 2, |raw| {
                int_in("NCCL_IB_ROCE_VERSION_NUM", raw, 1, 2)
            })?,
            ib_timeout: read(get("NCCL_IB_TIMEOUT"), 20, |raw| {
                int_in("NCCL_IB_TIMEOUT", raw, 1, 31)
            })?,
            ib_retry_cnt: read(get("NCCL_IB_RETRY_CNT"), 7, |raw| {
                int_in("NCCL_IB_RETRY_CNT", raw, 0, 7)
            })?,
            ib_tc: read(get("NCCL_IB_TC"), -1, |raw| {
                int_in("NCCL_IB_TC", raw, -1, 255)
            })?,
            ib_sl: read(get("NCCL_IB_SL"), -1, |raw| {
                int_in("NCCL_IB_SL", raw, -1, 15)
            })?,
            ib_pkey: read(get("NCCL_IB_PKEY"), 0, |raw| {
                int_in("NCCL_IB_PKEY", raw, 0, 65535)
            })?,
            ibverbs_lib: read(get("NCCL_IBVERBS_LIB"), None, |raw| {
                Ok(Some(raw.trim().to_string()))
            })?,
            speed_mbps: read(get("NCCL_ERDMA_SPEED_MBPS"), None, |raw| {
                int_in("NCCL_ERDMA_SPEED_MBPS", raw, 1, i64::from(i32::MAX)).map(Some)
            })?,
            connect_timeout_ms: read(get("NCCL_ERDMA_CONNECT_TIMEOUT_MS"), 120_000, |raw| {
                int_in("NCCL_ERDMA_CONNECT_TIMEOUT_MS", raw, 1, 86_400_000)
            })?,
            peer_timeout_s: read(get("NCCL_ERDMA_PEER_TIMEOUT_S"), 60, |raw| {
                int_in("NCCL_ERDMA_PEER_TIMEOUT_S", raw, 0, 86_400)
            })?,
            stats_interval_s: read(get("NCCL_ERDMA_STATS_INTERVAL"), 0, |raw| {
                int_in("NCCL_ERDMA_STATS_INTERVAL", raw, 0, 86_400)
            })?,
            force_flush: read(get("NCCL_ERDMA_FORCE_FLUSH"), false, |raw| {
                int_in::<u8>("NCCL_ERDMA_FORCE_FLUSH", raw, 0, 1).map(|v| v == 1)
            })?,
            cts_batch: read(get("NCCL_ERDMA_CTS_BATCH"), None, |raw| {
                int_in("NCCL_ERDMA_CTS_BATCH", raw, 1, 16).map(Some)
            })?,
        })
    }

    /// `NCCL_IB_HCA` as the user wrote it, empty when unset (for messages).
    pub fn ib_hca_text(&self) -> String {
        self.ib_hca
            .value
            .as_ref()
            .map(|f| f.to_string())
            .unwrap_or_default()
    }

    /// One line per setting, `NAME = value (env|default)`, for the INFO log and diagnostics.
    pub fn describe(&self) -> Vec<String> {
        fn line<T: Show>(name: &str, s: &Setting<T>) -> String {
            let src = if s.from_env { "env" } else { "default" };
            format!("{name} = {} ({src})", s.value.show())
        }
        vec![
            line("NCCL_ERDMA_TRANSPORT", &self.transport),
            line("NCCL_SOCKET_IFNAME", &self.socket_ifname),
            line("NCCL_SOCKET_FAMILY", &self.socket_family),
            line("NCCL_IB_HCA", &self.ib_hca),
            line("NCCL_IB_QPS_PER_CONNECTION", &self.qps_per_connection),
            line("NCCL_IB_SPLIT_DATA_ON_QPS", &self.split_data_on_qps),
            line("NCCL_IB_GID_INDEX", &self.gid_index),
            line("NCCL_IB_ADDR_FAMILY", &self.ib_addr_family),
            line("NCCL_IB_ADDR_RANGE", &self.ib_addr_range),
            line("NCCL_IB_ROCE_VERSION_NUM", &self.roce_version),
            line("NCCL_IB_TIMEOUT", &self.ib_timeout),
            line("NCCL_IB_RETRY_CNT", &self.ib_retry_cnt),
            line("NCCL_IB_TC", &self.ib_tc),
            line("NCCL_IB_SL", &self.ib_sl),
            line("NCCL_IB_PKEY", &self.ib_pkey),
            line("NCCL_IBVERBS_LIB", &self.ibverbs_lib),
            line("NCCL_ERDMA_SPEED_MBPS", &self.speed_mbps),
            line("NCCL_ERDMA_CONNECT_TIMEOUT_MS", &self.connect_timeout_ms),
            line("NCCL_ERDMA_PEER_TIMEOUT_S", &self.peer_timeout_s),
            line("NCCL_ERDMA_STATS_INTERVAL", &self.stats_interval_s),
            line("NCCL_ERDMA_FORCE_FLUSH", &self.force_flush),
            match self.cts_batch.value {
                Some(_) => line("NCCL_ERDMA_CTS_BATCH", &self.cts_batch),
                None => format!(
                    "NCCL_ERDMA_CTS_BATCH = per device: {CTS_BATCH_SOFTWARE} on software RDMA \
                     (rxe, siw), 1 on hardware (default)"
                ),
            },
        ]
    }
}

/// A setting's value as the user would write it.
trait Show {
    fn show(&self) -> String;
}

macro_rules! show_display {
    ($($t:ty),*) => {$(
        impl Show for $t {
            fn show(&self) -> String {
                self.to_string()
            }
        }
    )*};
}
show_display!(u32, i32, u64, String, TransportChoice, NameFilter);

impl Show for bool {
    fn show(&self) -> String {
        u8::from(*self).to_string()
    }
}

impl Show for AddrFamily {
    fn show(&self) -> String {
        match self {
            AddrFamily::Inet => "AF_INET".into(),
            AddrFamily::Inet6 => "AF_INET6".into(),
        }
    }
}

/// The filter in NCCL's syntax, as the user would write it.
impl fmt::Display for NameFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.exclude { "^" } else { "" })?;
        f.write_str(if self.exact { "=" } else { "" })?;
        for (i, e) in self.entries.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            f.write_str(&e.name)?;
            if let Some(p) = e.port {
                write!(f, ":{p}")?;
            }
        }
        Ok(())
    }
}

impl<T: Show> Show for Option<T> {
    fn show(&self) -> String {
        self.as_ref().map_or_else(|| "unset".into(), Show::show)
    }
}

/// Parses `a.b.c.d/len` or `x:y::z/len` into (address, prefix length).
pub fn parse_cidr(raw: &str) -> Result<(std::net::IpAddr, u8)> {
    let bad = || {
        Error::config(
            "NCCL_IB_ADDR_RANGE",
            raw,
            "an address range in CIDR form, e.g. 10.0.0.0/24 or fd00::/64",
        )
    };
    let (addr, len) = raw.trim().split_once('/').ok_or_else(bad)?;
    let addr: std::net::IpAddr = addr.parse().map_err(|_| bad())?;
    let len: u8 = len.parse().map_err(|_| bad())?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    if len > max {
        return Err(bad());
    }
    Ok((addr, len))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(pairs: &[(&str, &str)]) -> Result<Config> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn defaults_match_nccl_ib() {
        let c = cfg(&[]).unwrap();
        assert_eq!(c.transport.value, TransportChoice::Verbs);
        assert!(!c.transport.from_env);
        assert_eq!(c.qps_per_connection.value, 1);
        assert_eq!(c.gid_index.value, -1);
        assert_eq!(c.ib_timeout.value, 20);
        assert_eq!(c.ib_retry_cnt.value, 7);
        assert_eq!(c.roce_version.value, 2);
        assert_eq!(c.ib_addr_family.value, AddrFamily::Inet);
        assert!(!c.split_data_on_qps.value);
        assert_eq!(c.peer_timeout_s.value, 60);
        // Unset: the verbs transport picks the clear-to-send batch per device.
        assert_eq!(c.cts_batch.value, None);
        assert!(c
            .describe()
            .iter()
            .any(|l| l.contains("CTS_BATCH = per device")));
        let c = cfg(&[("NCCL_ERDMA_CTS_BATCH", "4")]).unwrap();
        assert_eq!(c.cts_batch.value, Some(4));
        assert!(c
            .describe()
            .iter()
            .any(|l| l == "NCCL_ERDMA_CTS_BATCH = 4 (env)"));
    }

    #[test]
    fn bad_values_name_variable_value_and_accepted() {
        for (var, value, accepted) in [
            ("NCCL_ERDMA_TRANSPORT", "foo", "verbs, tcp or auto"),
            ("NCCL_IB_QPS_PER_CONNECTION", "0", "from 1 to 128"),
            ("NCCL_IB_QPS_PER_CONNECTION", "abc", "from 1 to 128"),
            ("NCCL_IB_RETRY_CNT", "10", "from 0 to 7"),
            ("NCCL_ERDMA_CTS_BATCH", "17", "from 1 to 16"),
            ("NCCL_ERDMA_PEER_TIMEOUT_S", "-1", "from 0 to 86400"),
            ("NCCL_SOCKET_FAMILY", "AF_UNIX", "AF_INET or AF_INET6"),
            ("NCCL_IB_ADDR_RANGE", "10.0.0.0/33", "CIDR"),
            ("NCCL_IB_HCA", "mlx5_0:x", "device[:port]"),
        ] {
            let err = cfg(&[(var, value)]).unwrap_err();
            let msg = err.to_string();
            assert!(msg.contains(var), "{msg}");
            assert!(msg.contains(value), "{msg}");
            assert!(msg.contains(accepted), "{msg}");
            assert_eq!(err.kind(), crate::error::ErrorKind::InvalidUsage);
        }
    }

    #[test]
    fn env_values_are_parsed_and_marked() {
        let c = cfg(&[
            ("NCCL_ERDMA_TRANSPORT", "TCP"),
            ("NCCL_IB_QPS_PER_CONNECTION", " 8 "),
            ("NCCL_IB_GID_INDEX", "3"),
            ("NCCL_IB_ADDR_RANGE", "198.18.0.0/15"),
        ])
        .unwrap();
        assert_eq!(c.transport.value, TransportChoice::Tcp);
        assert!(c.transport.from_env);
        assert_eq!(c.qps_per_connection.value, 8);
        assert_eq!(c.gid_index.value, 3);
        assert!(c
            .describe()
            .iter()
            .any(|l| l == "NCCL_IB_QPS_PER_CONNECTION = 8 (env)"));
    }

    #[test]
    fn name_filters_follow_nccl_syntax() {
        let f = NameFilter::parse("NCCL_IB_HCA", "mlx5_0:1,erdma", true).unwrap();
        assert!(f.accepts("mlx5_0", Some(1)));
        assert!(!f.accepts("mlx5_0", Some(2)));
        assert!(f.accepts("erdma_1", Some(1)));
        assert!(!f.accepts("rxe0", Some(1)));
        let ex = NameFilter::parse("NCCL_SOCKET_IFNAME", "^docker,lo", false).unwrap();
        assert!(!ex.accepts("docker0", None));
        assert!(!ex.accepts("lo", None));
        assert!(ex.accepts("eth0", None));
        let exact = NameFilter::parse("NCCL_SOCKET_IFNAME", "=eth", false).unwrap();
        assert!(exact.accepts("eth", None));
        assert!(!exact.accepts("eth0", None));
        let both = NameFilter::parse("NCCL_IB_HCA", "^=rxe0", true).unwrap();
        assert!(!both.accepts("rxe0", Some(1)));
        assert!(both.accepts("rxe01", Some(1)));
    }
}
