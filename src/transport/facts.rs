//! What a transport found on this host and decided when it opened, as plain data: the one
//! source of what `init` logs and what the info command (`nccl-net-erdma-info`) shows, so
//! nothing is discovered twice. Public through `report`, which adds the settings.

/// One problem and what to do about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Warning {
    /// What is wrong.
    pub what: String,
    /// How to fix it.
    pub fix: String,
}

impl Warning {
    /// `what`, fixed by `fix`.
    pub(crate) fn new(what: impl Into<String>, fix: impl Into<String>) -> Self {
        Warning {
            what: what.into(),
            fix: fix.into(),
        }
    }
}

/// A value in effect and where it came from (`env`, `default`, or what the device chose).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sourced<T> {
    /// The value.
    pub value: T,
    /// Where it came from.
    pub source: String,
}

/// One RDMA port as the plugin sees it, used or not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Port {
    /// The name NCCL would see (`rxe0`, `mlx5_0:2`).
    pub name: String,
    /// The verbs device it belongs to (`mlx5_0`).
    pub device: String,
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
    /// The GID index chosen.
    pub gid_index: u8,
    /// The chosen GID as an address.
    pub gid: String,
    /// `automatic` or `NCCL_IB_GID_INDEX`.
    pub gid_source: String,
    /// Speed reported to NCCL (Mbps), and where it came from.
    pub speed_mbps: Sourced<i32>,
    /// Speed the port reports (Mbps).
    pub port_speed_mbps: i32,
    /// PCI path.
    pub pci_path: Option<String>,
    /// NUMA node of the PCI device.
    pub numa_node: Option<i32>,
    /// The device's resource limits.
    pub limits: DeviceLimits,
    /// What one connection takes of it.
    pub connection: ConnectionCost,
    /// QPs per connection in effect.
    pub qps_per_connection: Sourced<u32>,
    /// Clear-to-send batch in effect.
    pub cts_batch: Sourced<u32>,
    /// Whether the plugin uses this port; if not, why.
    pub used: Result<(), String>,
}

pub use crate::verbs::limits::DeviceLimits;

/// What one connection takes of a device at each end (sending, receiving), with the settings
/// in effect; a rank of an all-to-all holds both ends of every pair.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConnectionCost {
    /// QPs: the data QPs and a probe QP (at a GPUDirect receiver also a flush QP).
    pub qps: (u32, u32),
    /// Completion queues, and the completions each holds.
    pub cqs: (u32, u32),
    pub cqes: (u32, u32),
    /// Memory registrations.
    pub mrs: (u32, u32),
    /// Send queue depth of a sender's data QP; receive queue depth of a receiver's.
    pub send_wr: u32,
    pub recv_wr: u32,
    /// Connection pairs (both ends) the device's `max_qp`, `max_cq` and `max_mr` leave room
    /// for in one process.
    pub pairs: u32,
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

/// Whether the plugin fuses NICs into one device, and why.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fusion {
    /// The NICs fused into one device (empty: each NIC is its own device).
    pub members: Vec<String>,
    /// Why (or why not).
    pub reason: String,
}

/// One device as NCCL gets it (`getProperties`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    /// Its index.
    pub index: usize,
    /// `name`.
    pub name: String,
    /// `speed` (Mbps).
    pub speed_mbps: i32,
    /// `ptrSupport`.
    pub ptr_support: i32,
    /// `pciPath`.
    pub pci_path: Option<String>,
    /// The NICs it spans (one for a physical device).
    pub members: Vec<String>,
    /// What it is: its own NIC, fused by the plugin and why, or made by NCCL.
    pub why: String,
    /// The NICs its connections move to when one of theirs dies (`NCCL_ERDMA_FAILOVER`):
    /// its other members, then these spares; empty where failover is off or impossible.
    pub spares: Vec<String>,
}

/// Everything one transport found and decided.
#[derive(Debug, Clone, Default)]
pub struct TransportFacts {
    /// `tcp` or `verbs`.
    pub transport: String,
    /// The libibverbs loaded (verbs).
    pub libibverbs: Option<String>,
    /// Every RDMA port seen (verbs), used or not.
    pub ports: Vec<Port>,
    /// NIC fusion.
    pub fusion: Fusion,
    /// GPUDirect RDMA readiness.
    pub gpudirect: GpuDirect,
    /// The devices NCCL gets.
    pub devices: Vec<Device>,
    /// Problems found, each with its fix.
    pub warnings: Vec<Warning>,
}
