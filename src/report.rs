//! What `nccl-net-erdma-info` reports: the plugin's view of this host, as the plugin would
//! use it (devices, ports, GID choice, MTUs, speed, GPUDirect readiness, every setting and
//! where it came from, what NCCL would get), and warnings that each carry their fix. The
//! report is data ([`Report`]'s fields, for `--json`) and text ([`Report::render`]).

use std::fmt::Write as _;

use crate::config::{AddrFamily, Config, SETTINGS};
use crate::oob::iface;
use crate::plugin::Plugin;
use crate::transport::verbs::{self as verbs_transport, profile};
use crate::verbs::device::{self, VerbsDevice};
use crate::verbs::VerbsLib;

/// One problem and what to do about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Warning {
    /// What is wrong.
    pub what: String,
    /// How to fix it.
    pub fix: String,
}

/// One RDMA port as the plugin sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Port {
    /// The name NCCL would see (`rxe0`, `mlx5_0:2`).
    pub name: String,
    /// Port number.
    pub port: u8,
    /// `ACTIVE`, `DOWN`, ...
    pub state: String,
    /// `Ethernet (RoCE v2)`, `InfiniBand`, ...
    pub link_layer: String,
    /// Kernel driver, if known.
    pub driver: Option<String>,
    /// PCI vendor id.
    pub vendor_id: u32,
    /// Active MTU in bytes.
    pub active_mtu: u32,
    /// The network interface behind the chosen GID, and its MTU.
    pub netdev: Option<(String, Option<u32>)>,
    /// The GID index chosen, and the address it holds.
    pub gid_index: u8,
    /// The chosen GID as an address.
    pub gid: String,
    /// `automatic` or `NCCL_IB_GID_INDEX`.
    pub gid_source: String,
    /// Speed reported to NCCL, and what the port itself says (Mbps).
    pub speed_mbps: i32,
    /// Speed the port reports (Mbps).
    pub port_speed_mbps: i32,
    /// PCI path, NUMA node.
    pub pci_path: Option<String>,
    /// NUMA node of the PCI device.
    pub numa_node: Option<i32>,
    /// `max_qp`.
    pub max_qp: i32,
    /// QPs per connection in effect, and why.
    pub qps_per_connection: (u32, String),
    /// Clear-to-send batch in effect, and why.
    pub cts_batch: (u32, String),
    /// Whether the plugin uses this port; if not, why.
    pub used: Result<(), String>,
}

/// GPUDirect RDMA readiness.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GpuDirect {
    /// An NVIDIA GPU is present.
    pub gpu: bool,
    /// Peer memory (nvidia_peermem) is loaded.
    pub peermem: bool,
    /// DMA-BUF registration works on a used device.
    pub dmabuf: bool,
}

/// One setting: variable, value in effect, where it came from, what it does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettingEntry {
    /// The environment variable.
    pub name: String,
    /// Its value as the user would write it.
    pub value: String,
    /// `env` or `default`.
    pub source: String,
    /// What it does.
    pub doc: String,
}

/// One device as NCCL would get it (`getProperties`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclDevice {
    /// Its index.
    pub index: usize,
    /// `name`.
    pub name: String,
    /// `speed` (Mbps).
    pub speed_mbps: i32,
    /// `ptrSupport`.
    pub ptr_support: i32,
}

/// Whether the plugin fuses NICs into one device, and why.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fusion {
    /// The NICs fused into one device (empty: each NIC is its own device).
    pub members: Vec<String>,
    /// Why (or why not).
    pub reason: String,
}

/// The whole report.
#[derive(Debug, Default)]
pub struct Report {
    /// The plugin's version.
    pub version: String,
    /// The ABI versions the library exports.
    pub abi: String,
    /// Titled sections of lines (the text form).
    pub sections: Vec<(String, Vec<String>)>,
    /// The bootstrap interface and address, when one was found.
    pub bootstrap: Option<String>,
    /// The libibverbs loaded, when one was.
    pub libibverbs: Option<String>,
    /// Every RDMA port.
    pub ports: Vec<Port>,
    /// GPUDirect RDMA readiness.
    pub gpudirect: GpuDirect,
    /// NIC fusion (several NICs as one device whose connections use every rail).
    pub fusion: Fusion,
    /// Every setting.
    pub settings: Vec<SettingEntry>,
    /// The transport `init` would pick, when it succeeds.
    pub transport: Option<String>,
    /// The devices NCCL would get.
    pub nccl_devices: Vec<NcclDevice>,
    /// Problems found.
    pub warnings: Vec<Warning>,
    /// Whether the plugin's `init` succeeds with this environment.
    pub plugin_runs: bool,
    /// Why it does not, when it does not.
    pub failure: Option<String>,
}

impl Report {
    fn section(&mut self, title: &str, lines: Vec<String>) {
        self.sections.push((title.to_string(), lines));
    }
    fn warn(&mut self, what: impl Into<String>, fix: impl Into<String>) {
        self.warnings.push(Warning {
            what: what.into(),
            fix: fix.into(),
        });
    }

    /// The report as text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for (title, lines) in &self.sections {
            let _ = writeln!(out, "== {title}");
            for l in lines {
                let _ = writeln!(out, "  {l}");
            }
        }
        let _ = writeln!(out, "== warnings ({})", self.warnings.len());
        for w in &self.warnings {
            let _ = writeln!(out, "  WARNING: {}\n    fix: {}", w.what, w.fix);
        }
        match &self.failure {
            None => {
                let _ = writeln!(out, "== result: the plugin can run here");
            }
            Some(why) => {
                let _ = writeln!(out, "== result: the plugin cannot run here: {why}");
            }
        }
        out
    }
}

fn port_state(state: u32) -> &'static str {
    match state {
        1 => "DOWN",
        2 => "INIT",
        3 => "ARMED",
        4 => "ACTIVE",
        5 => "ACTIVE_DEFER",
        _ => "NOP",
    }
}

fn in_vm() -> bool {
    std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|c| c.contains(" hypervisor"))
}

fn has_nvidia_gpu() -> bool {
    std::path::Path::new("/dev/nvidia0").exists()
        || std::path::Path::new("/proc/driver/nvidia/version").exists()
}

/// MTUs that use the link fully: Alibaba requires 1400 or 8500 on eRDMA (LL128 can corrupt
/// data otherwise); on other RoCE links the standard and usual jumbo sizes.
fn mtu_ok(d: &VerbsDevice, mtu: u32) -> bool {
    if d.is_erdma() {
        matches!(mtu, 1400 | 8500)
    } else {
        matches!(mtu, 1500 | 4200 | 9000)
    }
}

fn port_report(d: &VerbsDevice, config: &Config) -> Port {
    let link_layer = if d.is_roce() {
        match d.gid_roce_version() {
            Some(v) => format!("Ethernet (RoCE v{v})"),
            None => "Ethernet (RoCE)".to_string(),
        }
    } else {
        "InfiniBand".to_string()
    };
    let tuning = profile::tuning(config, d.class());
    let used = if d.usable() {
        Ok(())
    } else if !d.selected {
        Err("not selected by NCCL_IB_HCA".to_string())
    } else {
        Err("not usable".to_string())
    };
    Port {
        name: d.name().to_string(),
        port: d.local.port,
        state: port_state(d.state).to_string(),
        link_layer,
        driver: d.driver.clone(),
        vendor_id: d.vendor_id,
        active_mtu: d.active_mtu_bytes(),
        netdev: d.netdev.clone().map(|n| (n, d.netdev_mtu)),
        gid_index: d.local.gid_index,
        gid: d.gid_ip().to_string(),
        gid_source: if config.gid_index.value >= 0 {
            "NCCL_IB_GID_INDEX"
        } else {
            "automatic"
        }
        .to_string(),
        speed_mbps: d.speed_mbps,
        port_speed_mbps: d.port_speed_mbps,
        pci_path: d.pci_path.clone(),
        numa_node: d.numa_node,
        max_qp: d.max_qp,
        qps_per_connection: (
            tuning.qps_per_connection.value,
            tuning.qps_per_connection.source.to_string(),
        ),
        cts_batch: (tuning.cts_batch.value, tuning.cts_batch.source.to_string()),
        used,
    }
}

fn describe_port(d: &VerbsDevice, p: &Port, config: &Config) -> String {
    let netdev = match &p.netdev {
        Some((n, Some(m))) => format!("netdev {n} MTU {m}"),
        Some((n, None)) => format!("netdev {n}"),
        None => "no netdev".into(),
    };
    let speed = match config.speed_mbps.value {
        Some(s) => format!(
            "{s} Mbps (NCCL_ERDMA_SPEED_MBPS; port says {})",
            p.port_speed_mbps
        ),
        None => format!("{} Mbps (from the port)", p.port_speed_mbps),
    };
    format!(
        "{} port {}: {} {}, driver {}, vendor {:#06x}\n    \
         active MTU {} ({netdev}), GID index {} {} ({}), speed {speed}\n    \
         PCI {}, NUMA node {}, max QPs {}, QPs per connection {} ({}), clear-to-send batch \
         {}, {}",
        d.ibv_name,
        p.port,
        p.state,
        p.link_layer,
        p.driver.as_deref().unwrap_or(if p.pci_path.is_none() {
            "none (a software device)"
        } else {
            "?"
        }),
        p.vendor_id,
        p.active_mtu,
        p.gid_index,
        p.gid,
        p.gid_source,
        p.pci_path.as_deref().unwrap_or("none"),
        p.numa_node.map_or("?".to_string(), |n| n.to_string()),
        p.max_qp,
        p.qps_per_connection.0,
        p.qps_per_connection.1,
        p.cts_batch.0,
        match &p.used {
            Ok(()) => "used by the plugin",
            Err(why) => why,
        }
    )
}

fn check_port(r: &mut Report, d: &VerbsDevice, config: &Config) {
    if !d.selected {
        return;
    }
    if !d.active() {
        r.warn(
            format!(
                "{} port {} is {}, not active",
                d.ibv_name,
                d.local.port,
                port_state(d.state)
            ),
            "check the cable/ERI and the driver (`ibv_devinfo`), or exclude it with NCCL_IB_HCA",
        );
        return;
    }
    if d.is_roce() {
        let v4_v2 = d.gids.iter().any(|g| {
            g.gid[..10].iter().all(|b| *b == 0)
                && g.gid[10] == 0xff
                && g.gid[11] == 0xff
                && g.roce_version != Some(1)
        });
        if !v4_v2 {
            r.warn(
                format!(
                    "{} port {} has no IPv4 RoCE v2 GID",
                    d.ibv_name, d.local.port
                ),
                "give the interface an IPv4 address (eRDMA: check the ERI's address), or set \
                 NCCL_IB_ADDR_FAMILY=AF_INET6 on every node",
            );
        }
        if let Some(mtu) = d.netdev_mtu {
            if !mtu_ok(d, mtu) {
                let fix = if d.is_erdma() {
                    "set the ERI's MTU to 8500 (jumbo frames) or 1400: Alibaba warns that other \
                     MTUs can corrupt data with NCCL's LL128 protocol"
                } else {
                    "use MTU 1500, or 4200/9000 with jumbo frames on the whole path"
                };
                r.warn(
                    format!(
                        "{} port {}: netdev {} has MTU {mtu} (RDMA path MTU {})",
                        d.ibv_name,
                        d.local.port,
                        d.netdev.as_deref().unwrap_or("?"),
                        d.active_mtu_bytes()
                    ),
                    fix,
                );
            }
        }
    }
    if config.gid_index.value < 0 && d.local.gid.iter().all(|b| *b == 0) {
        r.warn(
            format!("{} port {}: no usable GID found", d.ibv_name, d.local.port),
            "check `ibv_devinfo -v` for the GID table; set NCCL_IB_GID_INDEX if needed",
        );
    }
    if d.is_erdma() && config.speed_mbps.value.is_none() {
        r.warn(
            format!(
                "{} reports a fixed {} Mbps whatever the instance's real bandwidth",
                d.ibv_name, d.port_speed_mbps
            ),
            "set NCCL_ERDMA_SPEED_MBPS to the instance's ERI bandwidth so NCCL tunes for it",
        );
    }
}

fn gpudirect(r: &mut Report, devices: &[VerbsDevice]) {
    let peermem = device::peermem_present();
    let dmabuf = devices.iter().filter(|d| d.usable()).any(|d| d.dmabuf);
    let gpu = has_nvidia_gpu();
    r.gpudirect = GpuDirect {
        gpu,
        peermem,
        dmabuf,
    };
    r.section(
        "GPUDirect RDMA",
        vec![
            format!("NVIDIA GPU present: {}", if gpu { "yes" } else { "no" }),
            format!(
                "peer memory (nvidia_peermem): {}",
                if peermem { "present" } else { "absent" }
            ),
            format!(
                "DMA-BUF registration (ibv_reg_dmabuf_mr): {}",
                if dmabuf { "supported" } else { "not supported" }
            ),
        ],
    );
    if !gpu {
        return;
    }
    if !peermem && !dmabuf {
        r.warn(
            "GPUDirect RDMA is unavailable: NCCL will stage GPU data through host memory",
            "load nvidia_peermem (`modprobe nvidia_peermem`; ACK's eRDMA controller does it in \
             ofed mode), or use a driver stack with DMA-BUF support",
        );
    } else if in_vm() && std::env::var_os("NCCL_NET_GDR_LEVEL").is_none() {
        r.warn(
            "inside a VM NCCL sees the GPU-NIC distance as SYS and keeps GPUDirect RDMA off",
            "set NCCL_NET_GDR_LEVEL=SYS",
        );
    }
}

fn fusion(r: &mut Report, devices: &[VerbsDevice], config: &Config) {
    let usable: Vec<_> = devices
        .iter()
        .filter(|d| d.usable())
        .map(verbs_transport::nic_info)
        .collect();
    if usable.is_empty() {
        return;
    }
    let decided = verbs_transport::auto_fusion(config, &usable);
    let members: Vec<String> = decided
        .members
        .iter()
        .flatten()
        .map(|&i| usable[i].name.clone())
        .collect();
    let mut lines = vec![decided.reason.clone()];
    if !members.is_empty() {
        lines.push(format!(
            "NCCL sees one device {} over {} rails; large messages are striped over all of \
             them",
            members.join("+"),
            members.len()
        ));
    } else if usable.len() > 1 {
        lines.push(
            "NCCL sees each NIC as its own device and may fuse them itself (makeVDevice, \
             NCCL_NET_FORCE_MERGE)"
                .into(),
        );
    }
    r.section("NIC fusion", lines);
    r.fusion = Fusion {
        members,
        reason: decided.reason,
    };
}

/// Builds the report from this process's environment.
pub fn collect() -> Report {
    let mut r = Report {
        version: env!("CARGO_PKG_VERSION").to_string(),
        abi: "ncclNetPlugin_v6 .. v12 (NCCL 2.19 - 2.30)".to_string(),
        ..Report::default()
    };
    r.section(
        "plugin",
        vec![
            format!("nccl-net-erdma {}", r.version),
            format!("ABI: {}", r.abi),
        ],
    );
    let config = match Config::from_env() {
        Ok(c) => c,
        Err(e) => {
            r.warn(e.to_string(), "fix the variable named above");
            r.failure = Some(e.to_string());
            return r;
        }
    };
    match iface::pick(
        config.socket_ifname.value.as_ref(),
        config.socket_family.value,
    ) {
        Ok(a) => {
            let line = format!("interface {} address {}", a.ifname, a.ip);
            r.bootstrap = Some(line.clone());
            r.section("bootstrap", vec![line]);
        }
        Err(e) => r.warn(
            e.to_string(),
            "set NCCL_SOCKET_IFNAME to an interface with an address",
        ),
    }
    let devices = match VerbsLib::get(config.ibverbs_lib.value.as_deref()) {
        Err(e) => {
            r.section("RDMA devices", vec![format!("none: {e}")]);
            Vec::new()
        }
        Ok(lib) => match device::survey(lib, &config) {
            Err(e) => {
                r.section(
                    "RDMA devices",
                    vec![format!("libibverbs: {}", lib.name), format!("none: {e}")],
                );
                Vec::new()
            }
            Ok(devs) => {
                r.libibverbs = Some(lib.name.clone());
                let mut lines = vec![format!("libibverbs: {}", lib.name)];
                for d in &devs {
                    let port = port_report(d, &config);
                    lines.push(describe_port(d, &port, &config));
                    r.ports.push(port);
                }
                r.section("RDMA devices", lines);
                devs
            }
        },
    };
    if config.ib_hca.value.is_some() && !devices.is_empty() && !devices.iter().any(|d| d.selected) {
        let names: Vec<&str> = devices.iter().map(|d| d.name()).collect();
        r.warn(
            format!(
                "NCCL_IB_HCA={} matches none of the ports here ({})",
                config.ib_hca_text(),
                names.join(", ")
            ),
            "update NCCL_IB_HCA (eRDMA devices may be named erdma_N or rocepXsY), or unset it",
        );
    }
    for d in &devices {
        check_port(&mut r, d, &config);
    }
    if config.ib_addr_family.value == AddrFamily::Inet6 {
        r.section(
            "note",
            vec!["GIDs are chosen from IPv6 addresses (NCCL_IB_ADDR_FAMILY)".into()],
        );
    }
    fusion(&mut r, &devices, &config);
    gpudirect(&mut r, &devices);
    r.settings = config
        .entries()
        .into_iter()
        .map(|(name, value, source)| SettingEntry {
            name: name.to_string(),
            value,
            source: source.to_string(),
            doc: SETTINGS
                .iter()
                .find(|(n, _)| *n == name)
                .map_or("", |(_, doc)| *doc)
                .trim()
                .to_string(),
        })
        .collect();
    r.section("settings", config.describe());
    drop(devices);
    match Plugin::from_config(config) {
        Ok(p) => {
            let transport = p.transport_kind().name().to_string();
            let mut lines = vec![format!("transport: {transport}")];
            r.transport = Some(transport);
            for i in 0..p.device_count() {
                if let Ok(d) = p.device(i as i32) {
                    lines.push(format!(
                        "device {i}: {} speed {} Mbps ptrSupport {:#x}",
                        d.name(),
                        d.speed_mbps,
                        d.ptr_support
                    ));
                    r.nccl_devices.push(NcclDevice {
                        index: i,
                        name: d.name().to_string(),
                        speed_mbps: d.speed_mbps,
                        ptr_support: d.ptr_support,
                    });
                }
            }
            r.section("what NCCL would get", lines);
            r.plugin_runs = true;
        }
        Err(e) => {
            let why = e.to_string();
            r.warn(
                format!("the plugin's init fails here: {why}"),
                "NCCL falls back to its own transports; fix the cause above or set \
                 NCCL_ERDMA_TRANSPORT=auto to use TCP",
            );
            r.failure = Some(why);
        }
    }
    r
}
