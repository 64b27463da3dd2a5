//! What the verbs transport tells of the RDMA ports it found, used or not: each port as
//! plain data (`facts::Port`), GPUDirect readiness, and the problems it sees, each with its
//! fix. Made once, when the transport opens (or, where no port is usable, for the info
//! command's report of why).

use crate::config::{AddrFamily, Config};
use crate::transport::facts::{GpuDirect, Port, Sourced, Warning};
use crate::verbs::device::{self, VerbsDevice};

use super::{budget, profile};

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

fn sourced<T>(r: profile::Resolved<T>) -> Sourced<T> {
    Sourced {
        value: r.value,
        source: r.source.to_string(),
    }
}

/// Port `d` as the facts tell it.
pub(crate) fn port(d: &VerbsDevice, config: &Config) -> Port {
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
        Err(format!("port {}", port_state(d.state)))
    };
    Port {
        name: d.name().to_string(),
        device: d.ibv_name.clone(),
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
        speed_mbps: Sourced {
            value: d.speed_mbps,
            source: match config.speed_mbps.value {
                Some(_) => "NCCL_ERDMA_SPEED_MBPS".to_string(),
                None => "the port".to_string(),
            },
        },
        port_speed_mbps: d.port_speed_mbps,
        pci_path: d.pci_path.clone(),
        numa_node: d.numa_node,
        limits: d.limits,
        connection: budget::connection_cost(&d.limits, tuning.qps_per_connection.value),
        qps_per_connection: sourced(tuning.qps_per_connection),
        cts_batch: sourced(tuning.cts_batch),
        used,
    }
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

/// The problems of port `d`, each with its fix.
fn port_warnings(d: &VerbsDevice, config: &Config, out: &mut Vec<Warning>) {
    if !d.selected {
        return;
    }
    if !d.active() {
        out.push(Warning::new(
            format!(
                "{} port {} is {}, not active",
                d.ibv_name,
                d.local.port,
                port_state(d.state)
            ),
            "check the cable/ERI and the driver (`ibv_devinfo`), or exclude it with NCCL_IB_HCA",
        ));
        return;
    }
    if d.is_roce() {
        let v4_v2 = d.gids.iter().any(|g| {
            g.gid[..10].iter().all(|b| *b == 0)
                && g.gid[10] == 0xff
                && g.gid[11] == 0xff
                && g.roce_version != Some(1)
        });
        if !v4_v2 && config.ib_addr_family.value == AddrFamily::Inet {
            out.push(Warning::new(
                format!(
                    "{} port {} has no IPv4 RoCE v2 GID",
                    d.ibv_name, d.local.port
                ),
                "give the interface an IPv4 address (eRDMA: check the ERI's address), or set \
                 NCCL_IB_ADDR_FAMILY=AF_INET6 on every node",
            ));
        }
        if let Some(mtu) = d.netdev_mtu.filter(|m| !mtu_ok(d, *m)) {
            let fix = if d.is_erdma() {
                "set the ERI's MTU to 8500 (jumbo frames) or 1400: Alibaba warns that other \
                 MTUs can corrupt data with NCCL's LL128 protocol"
            } else {
                "use MTU 1500, or 4200/9000 with jumbo frames on the whole path"
            };
            out.push(Warning::new(
                format!(
                    "{} port {}: netdev {} has MTU {mtu} (RDMA path MTU {})",
                    d.ibv_name,
                    d.local.port,
                    d.netdev.as_deref().unwrap_or("?"),
                    d.active_mtu_bytes()
                ),
                fix,
            ));
        }
    }
    if config.gid_index.value < 0 && d.local.gid.iter().all(|b| *b == 0) {
        out.push(Warning::new(
            format!("{} port {}: no usable GID found", d.ibv_name, d.local.port),
            "check `ibv_devinfo -v` for the GID table; set NCCL_IB_GID_INDEX if needed",
        ));
    }
    if d.is_erdma() && config.speed_mbps.value.is_none() {
        out.push(Warning::new(
            format!(
                "{} reports a fixed {} Mbps whatever the instance's real bandwidth",
                d.ibv_name, d.port_speed_mbps
            ),
            "set NCCL_ERDMA_SPEED_MBPS to the instance's ERI bandwidth so NCCL tunes for it",
        ));
    }
}

fn in_vm() -> bool {
    std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|c| c.contains(" hypervisor"))
}

fn has_nvidia_gpu() -> bool {
    std::path::Path::new("/dev/nvidia0").exists()
        || std::path::Path::new("/proc/driver/nvidia/version").exists()
}

/// GPUDirect RDMA readiness over the usable ports of `devices`, and its problems.
pub(crate) fn gpudirect(
    devices: &[VerbsDevice],
    config: &Config,
    out: &mut Vec<Warning>,
) -> GpuDirect {
    let g = GpuDirect {
        gpu: has_nvidia_gpu(),
        peermem: device::peermem_present(),
        dmabuf: devices.iter().filter(|d| d.usable()).any(|d| d.dmabuf),
    };
    if g.gpu && !g.peermem && !g.dmabuf {
        out.push(Warning::new(
            "GPUDirect RDMA is unavailable: NCCL will stage GPU data through host memory",
            "load nvidia_peermem (`modprobe nvidia_peermem`; ACK's eRDMA controller does it in \
             ofed mode), or use a driver stack with DMA-BUF support",
        ));
    } else if g.gpu && in_vm() && config.net_gdr_level.value.is_none() {
        out.push(Warning::new(
            "inside a VM NCCL sees the GPU-NIC distance as SYS and keeps GPUDirect RDMA off",
            "set NCCL_NET_GDR_LEVEL=SYS",
        ));
    }
    g
}

/// The problems of every port of `devices` (and of `NCCL_IB_HCA` against them).
pub(crate) fn warnings(devices: &[VerbsDevice], config: &Config) -> Vec<Warning> {
    let mut out = Vec::new();
    if config.ib_hca.value.is_some() && !devices.is_empty() && !devices.iter().any(|d| d.selected) {
        let names: Vec<&str> = devices.iter().map(|d| d.name()).collect();
        out.push(Warning::new(
            format!(
                "NCCL_IB_HCA={} matches none of the ports here ({})",
                config.ib_hca_text(),
                names.join(", ")
            ),
            "update NCCL_IB_HCA (eRDMA devices may be named erdma_N or rocepXsY), or unset it",
        ));
    }
    for d in devices {
        port_warnings(d, config, &mut out);
    }
    out
}
