//! Every setting the plugin reads, parsed once at `init`, validated and logged at INFO.
//!
//! `NCCL_IB_*` and `NCCL_SOCKET_*` variables mean what they mean for NCCL's own IB transport
//! and sockets; plugin-specific ones use the `NCCL_ERDMA_` prefix. A bad value makes `init`
//! fail with `ncclInvalidUsage` and a WARN naming the variable, the value and what is accepted.

use std::fmt;

use crate::error::{Error, Result};

/// Which transport carries the data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TransportChoice {
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

/// Whether the plugin offers several NICs as one fused device (`NCCL_ERDMA_FUSE_NICS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FuseNics {
    /// Offer each NIC as its own device, as NCCL's IB transport does.
    Off,
    /// Fuse the NICs of each NUMA node and link layer.
    On,
    /// Fuse the NICs of each link layer, whatever their NUMA nodes.
    Force,
}

impl fmt::Display for FuseNics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FuseNics::Off => "0",
            FuseNics::On => "1",
            FuseNics::Force => "force",
        })
    }
}

/// Address family preference (`AF_INET` / `AF_INET6`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AddrFamily {
    /// IPv4.
    Inet,
    /// IPv6.
    Inet6,
}

/// One entry of an `NCCL_IB_HCA` / `NCCL_SOCKET_IFNAME` style list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NameEntry {
    /// Device or interface name (or prefix).
    pub(crate) name: String,
    /// Port restriction (`mlx5_0:1`), only meaningful for `NCCL_IB_HCA`.
    pub(crate) port: Option<u32>,
}

/// A device/interface filter in NCCL's syntax: a comma-separated list of name prefixes;
/// a leading `^` excludes the listed names instead, a leading `=` (after any `^`) asks for
/// exact names instead of prefixes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct NameFilter {
    /// Entries of the list.
    pub(crate) entries: Vec<NameEntry>,
    /// `^`: the list names what to exclude.
    pub(crate) exclude: bool,
    /// `=`: names must match exactly.
    pub(crate) exact: bool,
}

impl NameFilter {
    /// Parses NCCL's list syntax; `with_ports` accepts `name:port` entries.
    pub(crate) fn parse(var: &'static str, raw: &str, with_ports: bool) -> Result<Self> {
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
    pub(crate) fn accepts(&self, name: &str, port: Option<u32>) -> bool {
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
pub(crate) struct Setting<T> {
    /// The value in effect.
    pub(crate) value: T,
    /// True when the environment set it; false for the built-in default.
    pub(crate) from_env: bool,
}

impl<T> Setting<T> {
    /// Parses `raw` (the variable's value, if set) with `parse`, else takes `default`.
    fn read(
        var: &'static str,
        raw: Option<String>,
        default: T,
        parse: impl FnOnce(&'static str, &str) -> Result<T>,
    ) -> Result<Self> {
        Ok(match raw {
            Some(raw) => Setting {
                value: parse(var, &raw)?,
                from_env: true,
            },
            None => Setting {
                value: default,
                from_env: false,
            },
        })
    }

    /// `env` or `default`.
    pub(crate) fn source(&self) -> &'static str {
        if self.from_env {
            "env"
        } else {
            "default"
        }
    }
}

/// Declares every setting once: its field, type, default, variable, parser and description.
/// Generates [`Config`], its parsing ([`Config::from_lookup`]), the lines the log and the info
/// command print ([`Config::entries`]) and the list of all settings ([`SETTINGS`]). `unset`
/// names what an unset optional setting means.
macro_rules! settings {
    ($(
        $(#[doc = $doc:literal])+
        $field:ident: $ty:ty = $default:expr, $var:literal, $parse:expr $(, unset = $unset:literal)?;
    )*) => {
        /// Everything the plugin reads from its environment.
        #[derive(Debug, Clone)]
        pub(crate) struct Config {
            $( $(#[doc = $doc])+ pub(crate) $field: Setting<$ty>, )*
        }

        impl Config {
            /// Reads settings through `get` (the environment, or a map in tests). Empty values
            /// count as unset, as NCCL's own `ncclGetEnv` users treat them.
            pub(crate) fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
                let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
                Ok(Config {
                    $( $field: Setting::read($var, get($var), $default, $parse)?, )*
                })
            }

            /// Every setting: (variable, value as the user would write it, `env` or
            /// `default`).
            pub(crate) fn entries(&self) -> Vec<(&'static str, String, &'static str)> {
                vec![$(
                    (
                        $var,
                        match (self.$field.from_env, None::<&str> $(.or(Some($unset)))?) {
                            (false, Some(unset)) => unset.to_string(),
                            _ => self.$field.value.show(),
                        },
                        self.$field.source(),
                    ),
                )*]
            }
        }

        /// Every setting the plugin reads: (variable, what it does).
        pub(crate) const SETTINGS: &[(&str, &str)] = &[$( ($var, concat!($($doc),+)), )*];
    };
}

settings! {
    /// Transport: verbs, tcp, or auto (verbs when a device is usable, else tcp).
    transport: TransportChoice = TransportChoice::Verbs, "NCCL_ERDMA_TRANSPORT", parse_transport;
    /// Interfaces for the out-of-band bootstrap and the tcp transport, in NCCL's syntax.
    socket_ifname: Option<NameFilter> = None, "NCCL_SOCKET_IFNAME", |var, raw| {
        NameFilter::parse(var, raw, false).map(Some)
    };
    /// Address family of those interfaces (AF_INET or AF_INET6).
    socket_family: Option<AddrFamily> = None, "NCCL_SOCKET_FAMILY", |var, raw| {
        family(var, raw).map(Some)
    };
    /// RDMA devices to use, in NCCL's syntax (prefixes, ^ excludes, = exact, :port).
    ib_hca: Option<NameFilter> = None, "NCCL_IB_HCA", |var, raw| {
        NameFilter::parse(var, raw, true).map(Some)
    };
    /// RC QPs per connection (1..128; unset: 8 on eRDMA, 1 elsewhere).
    qps_per_connection: Option<u32> = None, "NCCL_IB_QPS_PER_CONNECTION", |var, raw| {
        int_in(var, raw, 1, 128).map(Some)
    }, unset = "per device";
    /// Split every message over all QPs (1) or let messages take turns (0).
    split_data_on_qps: bool = false, "NCCL_IB_SPLIT_DATA_ON_QPS", flag;
    /// Fixed RoCE GID index, or -1 for the automatic choice per device.
    gid_index: i32 = -1, "NCCL_IB_GID_INDEX", |var, raw| int_in(var, raw, -1, 255);
    /// Address family the automatic GID choice prefers.
    ib_addr_family: AddrFamily = AddrFamily::Inet, "NCCL_IB_ADDR_FAMILY", family;
    /// Address range (CIDR) the automatically chosen GID must be in.
    ib_addr_range: Option<String> = None, "NCCL_IB_ADDR_RANGE", |_, raw| {
        parse_cidr(raw).map(|_| Some(raw.trim().to_string()))
    };
    /// RoCE version the automatic GID choice prefers.
    roce_version: u32 = 2, "NCCL_IB_ROCE_VERSION_NUM", |var, raw| int_in(var, raw, 1, 2);
    /// QP local ACK timeout exponent (4.096 us * 2^n per retry).
    ib_timeout: u32 = 20, "NCCL_IB_TIMEOUT", |var, raw| int_in(var, raw, 1, 31);
    /// QP retry count.
    ib_retry_cnt: u32 = 7, "NCCL_IB_RETRY_CNT", |var, raw| int_in(var, raw, 0, 7);
    /// Traffic class, -1 = unset (the communicator's, else 0).
    ib_tc: i32 = -1, "NCCL_IB_TC", |var, raw| int_in(var, raw, -1, 255);
    /// Service level, -1 = unset (0).
    ib_sl: i32 = -1, "NCCL_IB_SL", |var, raw| int_in(var, raw, -1, 15);
    /// Partition key index.
    ib_pkey: u32 = 0, "NCCL_IB_PKEY", |var, raw| int_in(var, raw, 0, 65535);
    /// libibverbs to load instead of the default.
    ibverbs_lib: Option<String> = None, "NCCL_IBVERBS_LIB", |_, raw| Ok(Some(raw.trim().to_string()));
    /// Link speed reported to NCCL, in Mbps (the port's when unset).
    speed_mbps: Option<u32> = None, "NCCL_ERDMA_SPEED_MBPS", |var, raw| {
        int_in(var, raw, 1, i64::from(i32::MAX)).map(Some)
    };
    /// How long connect may take to reach the peer's listener, in ms.
    connect_timeout_ms: u64 = 120_000, "NCCL_ERDMA_CONNECT_TIMEOUT_MS", |var, raw| {
        int_in(var, raw, 1, 86_400_000)
    };
    /// Seconds after which comms with a peer whose host stopped answering fail (0 = never).
    peer_timeout_s: u64 = 60, "NCCL_ERDMA_PEER_TIMEOUT_S", |var, raw| int_in(var, raw, 0, 86_400);
    /// Seconds posted RDMA work may go without a completion before its comm fails (0 =
    /// never; unset: from NCCL_IB_TIMEOUT and NCCL_IB_RETRY_CNT, at least 60).
    work_timeout_s: Option<u64> = None, "NCCL_ERDMA_WORK_TIMEOUT_S", |var, raw| {
        int_in(var, raw, 0, 86_400).map(Some)
    }, unset = "auto";
    /// Seconds between traffic statistics lines per comm (0 = only the summary at close).
    stats_interval_s: u64 = 0, "NCCL_ERDMA_STATS_INTERVAL", |var, raw| int_in(var, raw, 0, 86_400);
    /// Always create the flush QP and report forceFlush (diagnostics).
    force_flush: bool = false, "NCCL_ERDMA_FORCE_FLUSH", flag;
    /// Offer NICs as one device striping over all of them: 0 (each NIC its own device, as
    /// NCCL IB), 1 (the NICs of each NUMA node and link layer), force (of each link layer,
    /// across NUMA nodes); auto is 0.
    fuse_nics: FuseNics = FuseNics::Off, "NCCL_ERDMA_FUSE_NICS", |var, raw| {
        match raw.trim().to_ascii_lowercase().as_str() {
            "0" | "off" | "no" | "auto" => Ok(FuseNics::Off),
            "1" | "on" | "yes" => Ok(FuseNics::On),
            "force" => Ok(FuseNics::Force),
            _ => Err(Error::config(var, raw, "0, 1 or force")),
        }
    };
    /// Move a connection whose NIC or path fails to another NIC of the same link layer (a
    /// fused device's other NICs, else the host's others) instead of failing it: unset or
    /// auto is on wherever such a NIC exists, 1 the same, 0 off.
    failover: Option<bool> = None, "NCCL_ERDMA_FAILOVER", |var, raw| {
        match raw.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(None),
            "1" | "on" | "yes" => Ok(Some(true)),
            "0" | "off" | "no" => Ok(Some(false)),
            _ => Err(Error::config(var, raw, "auto, 1 or 0")),
        }
    }, unset = "auto";
    /// With failover: milliseconds a path's liveness probe may go unanswered, while work
    /// waits on it, before the connection moves (at least two retransmission timers of
    /// NCCL_IB_TIMEOUT, so a lost probe is sent again first).
    failover_after_ms: u64 = 2_000, "NCCL_ERDMA_FAILOVER_AFTER_MS", |var, raw| {
        int_in(var, raw, 10, 3_600_000)
    };
    /// With failover: move a connection back to the NIC NCCL placed it on once that NIC has
    /// healed (1), or keep it where it moved (0; a healed NIC still takes later moves).
    failback: bool = true, "NCCL_ERDMA_FAILBACK", flag;
    /// With failover: milliseconds a lost NIC must stay usable (its port active) before it
    /// counts as healed; doubled each time the same connection loses it again (at most 32x).
    failback_after_ms: u64 = 10_000, "NCCL_ERDMA_FAILBACK_AFTER_MS", |var, raw| {
        int_in(var, raw, 0, 86_400_000)
    };
    /// Whether NCCL's NIC fusion (makeVDevice) may fuse devices (1), as for NCCL IB.
    merge_nics: bool = true, "NCCL_IB_MERGE_NICS", flag;
    /// Clear-to-send entries a receiver may hold back and post in one RDMA write (1..16;
    /// unset: 8 on software RDMA devices, 1 on hardware).
    cts_batch: Option<u32> = None, "NCCL_ERDMA_CTS_BATCH", |var, raw| {
        int_in(var, raw, 1, 16).map(Some)
    }, unset = "per device";
    /// Nanoseconds after which a signaled work request's completion (or its absence) is a
    /// WARN, "WQE slow" / "WQE stall (no CQE)", as for NCCL IB (0 = off: no clock is read).
    wqe_latency_threshold_ns: u64 = 0, "NCCL_IB_WQE_LATENCY_THRESHOLD_NS", |var, raw| {
        int_in(var, raw, 0, 3_600_000_000_000)
    };
    /// With a threshold set: one INFO line per QP at comm close with its post-to-completion
    /// latency (count, p50, p90, p99, p99.9, max), as for NCCL IB.
    wqe_latency_report: bool = true, "NCCL_IB_WQE_LATENCY_REPORT", flag;
    /// NCCL's log level; before NCCL hands over its logger (and in the tools), the plugin's
    /// own lines go to stderr at WARN unless it says INFO or TRACE.
    nccl_debug: Option<String> = None, "NCCL_DEBUG", text;
    /// NCCL's GPUDirect RDMA distance limit; the info command advises it inside a VM.
    net_gdr_level: Option<String> = None, "NCCL_NET_GDR_LEVEL", text;
    /// NCCL's forced NIC fusion: while set, the plugin fuses no NICs itself.
    net_force_merge: Option<String> = None, "NCCL_NET_FORCE_MERGE", text;
    /// NCCL's NIC fusion distance: while set, the plugin fuses no NICs itself.
    net_merge_level: Option<String> = None, "NCCL_NET_MERGE_LEVEL", text;
    /// NCCL's: whether NCCL keeps the plugin loaded after its last communicator; unset or 0,
    /// NCCL unloads it, and the plugin forgets the virtual devices NCCL made (makeVDevice) at
    /// the last finalize, so that the next load offers the physical devices only.
    net_plugin_ref_count: Option<String> = None, "NCCL_NET_PLUGIN_REF_COUNT", text;
}

/// A free-form value (NCCL's own settings, which NCCL itself checks).
fn text(_: &'static str, raw: &str) -> Result<Option<String>> {
    Ok(Some(raw.trim().to_string()))
}

/// The environment's value of `var`; empty counts as unset, as NCCL's own `ncclGetEnv` users
/// treat it. Every setting is read through here.
fn env_value(var: &str) -> Option<String> {
    std::env::var(var).ok().filter(|v| !v.trim().is_empty())
}

/// `NCCL_DEBUG` alone, for the logger, which starts before the rest is read.
pub(crate) fn nccl_debug() -> Option<String> {
    env_value("NCCL_DEBUG")
}

fn parse_transport(var: &'static str, raw: &str) -> Result<TransportChoice> {
    match raw.trim().to_ascii_lowercase().as_str() {
        "verbs" | "ib" | "rdma" => Ok(TransportChoice::Verbs),
        "tcp" | "socket" => Ok(TransportChoice::Tcp),
        "auto" => Ok(TransportChoice::Auto),
        _ => Err(Error::config(var, raw, "verbs, tcp or auto")),
    }
}

fn flag(var: &'static str, raw: &str) -> Result<bool> {
    int_in::<u8>(var, raw, 0, 1).map(|v| v == 1)
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
    pub(crate) fn from_env() -> Result<Self> {
        Self::from_lookup(env_value)
    }

    /// Whether NCCL unloads the plugin after its last communicator
    /// (`NCCL_NET_PLUGIN_REF_COUNT` unset or 0).
    pub(crate) fn nccl_unloads(&self) -> bool {
        self.net_plugin_ref_count
            .value
            .as_deref()
            .is_none_or(|v| v.parse::<i64>().is_ok_and(|n| n <= 0))
    }

    /// Whether the user asked NCCL to fuse NICs itself (`NCCL_NET_FORCE_MERGE` or
    /// `NCCL_NET_MERGE_LEVEL` set).
    pub(crate) fn nccl_merges(&self) -> bool {
        self.net_force_merge.value.is_some() || self.net_merge_level.value.is_some()
    }

    /// `NCCL_IB_HCA` as the user wrote it, empty when unset (for messages).
    pub(crate) fn ib_hca_text(&self) -> String {
        self.ib_hca
            .value
            .as_ref()
            .map(|f| f.to_string())
            .unwrap_or_default()
    }

    /// One line per setting, `NAME = value (env|default)`, for the INFO log.
    pub(crate) fn describe(&self) -> Vec<String> {
        self.entries()
            .into_iter()
            .map(|(var, value, source)| format!("{var} = {value} ({source})"))
            .collect()
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
show_display!(u32, i32, u64, String, TransportChoice, NameFilter, FuseNics);

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
pub(crate) fn parse_cidr(raw: &str) -> Result<(std::net::IpAddr, u8)> {
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
        // Unset: the verbs transport picks the QPs per connection per device.
        assert_eq!(c.qps_per_connection.value, None);
        assert!(c
            .describe()
            .iter()
            .any(|l| l == "NCCL_IB_QPS_PER_CONNECTION = per device (default)"));
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
            ("NCCL_ERDMA_FUSE_NICS", "2", "0, 1 or force"),
            ("NCCL_ERDMA_WORK_TIMEOUT_S", "x", "from 0 to 86400"),
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
        assert_eq!(c.qps_per_connection.value, Some(8));
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
