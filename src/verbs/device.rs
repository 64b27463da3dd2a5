//! Device discovery as NCCL's IB transport does it: `ibv_get_device_list` filtered by
//! `NCCL_IB_HCA`, active ports with an IB or Ethernet link layer only, sorted by PCI path so
//! every node numbers its devices alike; per port the GID index NCCL would choose, the speed,
//! MTU and the GPUDirect capabilities (peer memory, DMA-BUF).

use std::{
    ffi::{c_int, CStr},
    mem::MaybeUninit,
    net::IpAddr,
    sync::Arc,
};

use rdma_sys::*;

use super::dma::ACCESS_RDMA;
use super::library::VerbsLib;
use super::limits::{DeviceLimits, Held};
use super::nic::{LocalPort, MovesHere, Nic, PortWatch};
use super::qp::{Qp, QpPath, RemoteQp};
use super::resources::{Context, Cq, Mr, Pd};
use crate::config::{parse_cidr, AddrFamily, Config};
use crate::error::{Error, Result};
use crate::sysfs::read as sysfs;

/// PCI vendor id of Alibaba's eRDMA devices.
pub(crate) const ERDMA_VENDOR_ID: u32 = 0x1ded;
/// Vendor id the kernel's Soft-RoCE driver (rxe) reports.
pub(crate) const RXE_VENDOR_ID: u32 = 0xff_ffff;
/// Vendor id the kernel's Soft-iWARP driver (siw) reports ("bmt").
pub(crate) const SIW_VENDOR_ID: u32 = 0x62_6d74;

/// `IBV_LINK_LAYER_INFINIBAND`.
pub(crate) const LINK_LAYER_IB: u8 = 1;
/// `IBV_LINK_LAYER_ETHERNET`.
pub(crate) const LINK_LAYER_ETHERNET: u8 = 2;

/// One (device, port), usable or not.
pub(crate) struct VerbsDevice {
    /// Name, port, link layer, MTU, LID and the GID a connection uses.
    pub(crate) local: LocalPort,
    /// Device name in libibverbs.
    pub(crate) ibv_name: String,
    /// Port state (`ibv_port_state`; 4 = active).
    pub(crate) state: u32,
    /// Whether `NCCL_IB_HCA` selects this port.
    pub(crate) selected: bool,
    /// Partition key index QPs use (`NCCL_IB_PKEY`).
    pub(crate) pkey_index: u16,
    /// The whole GID table as the selection saw it.
    pub(crate) gids: Vec<GidEntry>,
    /// Network interface behind the chosen GID (RoCE).
    pub(crate) netdev: Option<String>,
    /// Its MTU.
    pub(crate) netdev_mtu: Option<u32>,
    /// Realpath of the PCI device.
    pub(crate) pci_path: Option<String>,
    /// Kernel driver.
    pub(crate) driver: Option<String>,
    /// NUMA node of the PCI device.
    pub(crate) numa_node: Option<i32>,
    /// `sys_image_guid`.
    pub(crate) guid: u64,
    /// Speed in Mbps (port, or `NCCL_ERDMA_SPEED_MBPS`).
    pub(crate) speed_mbps: i32,
    /// Speed the port itself reports.
    pub(crate) port_speed_mbps: i32,
    /// The device's resource limits.
    pub(crate) limits: DeviceLimits,
    /// PCI vendor id.
    pub(crate) vendor_id: u32,
    /// Peer memory (nvidia_peermem) present: CUDA pointers can be registered.
    pub(crate) peermem: bool,
    /// `ibv_reg_dmabuf_mr` works.
    pub(crate) dmabuf: bool,
    /// The device context.
    pub(crate) ctx: Arc<Context>,
    /// The one protection domain of the device.
    pub(crate) pd: Arc<Pd>,
    /// Whether connections may still move here (see `Nic::takes_moves`).
    pub(crate) moves_here: MovesHere,
    /// The port's state as last read (see `Nic::port_active`).
    pub(crate) port_watch: PortWatch,
}

/// What kind of device a port is, for the settings that depend on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DeviceClass {
    /// Alibaba Cloud eRDMA.
    Erdma,
    /// Soft-RoCE or Soft-iWARP: each post is a system call running the packet path.
    Software,
    /// Any other (hardware) device.
    Hardware,
}

impl VerbsDevice {
    /// What kind of device this is.
    pub(crate) fn class(&self) -> DeviceClass {
        if self.is_erdma() {
            DeviceClass::Erdma
        } else if self.is_software() {
            DeviceClass::Software
        } else {
            DeviceClass::Hardware
        }
    }

    /// Whether this is an Alibaba eRDMA device.
    pub(crate) fn is_erdma(&self) -> bool {
        self.vendor_id == ERDMA_VENDOR_ID || self.driver.as_deref() == Some("erdma")
    }

    /// Whether this is a software RDMA device (Soft-RoCE, Soft-iWARP): each post is a
    /// system call that runs the packet path in the kernel, not a doorbell.
    pub(crate) fn is_software(&self) -> bool {
        self.vendor_id == RXE_VENDOR_ID || self.vendor_id == SIW_VENDOR_ID
    }

    /// The name NCCL sees.
    pub(crate) fn name(&self) -> &str {
        &self.local.name
    }

    /// Whether the port is active.
    pub(crate) fn active(&self) -> bool {
        self.state == ibv_port_state::IBV_PORT_ACTIVE
    }

    /// Whether the port runs RoCE (Ethernet link layer), as eRDMA does.
    pub(crate) fn is_roce(&self) -> bool {
        self.local.link_layer == LINK_LAYER_ETHERNET
    }

    /// Whether the plugin would use this port.
    pub(crate) fn usable(&self) -> bool {
        self.selected && self.active() && (self.local.link_layer == LINK_LAYER_IB || self.is_roce())
    }

    /// The chosen GID as an address (IPv4 for IPv4-mapped GIDs).
    pub(crate) fn gid_ip(&self) -> IpAddr {
        gid_ip(&self.local.gid)
    }

    /// RoCE version of the chosen GID, when sysfs says.
    pub(crate) fn gid_roce_version(&self) -> Option<u32> {
        self.gids
            .iter()
            .find(|g| g.index == self.local.gid_index)
            .and_then(|g| g.roce_version)
    }

    /// Active MTU in bytes.
    /// The port's nonzero hardware counters (`/sys/class/infiniband/DEV/ports/N/hw_counters`,
    /// and `counters`), `name=value ...` sorted by name, where the driver exposes any.
    pub(crate) fn counters(&self) -> Option<String> {
        let base = format!(
            "/sys/class/infiniband/{}/ports/{}",
            self.ibv_name, self.local.port
        );
        let mut found: Vec<String> = ["hw_counters", "counters"]
            .iter()
            .filter_map(|dir| std::fs::read_dir(format!("{base}/{dir}")).ok())
            .flatten()
            .filter_map(|e| {
                let e = e.ok()?;
                let name = e.file_name().to_string_lossy().into_owned();
                let value: u64 = sysfs(&e.path().to_string_lossy())?.parse().ok()?;
                (value != 0).then(|| format!("{name}={value}"))
            })
            .collect();
        found.sort();
        (!found.is_empty()).then(|| found.join(" "))
    }

    pub(crate) fn active_mtu_bytes(&self) -> u32 {
        mtu_bytes(self.local.active_mtu)
    }
}

/// An `ibv_mtu` value in bytes (1 = 256 ... 5 = 4096).
pub(crate) fn mtu_bytes(mtu: u32) -> u32 {
    128u32 << mtu.clamp(1, 5)
}

/// NCCL's `ncclIbSpeed` × `ncclIbWidth`, in Mbps.
pub(crate) fn port_speed_mbps(active_speed: u8, active_width: u8) -> i32 {
    let speed = match active_speed {
        1 => 2500,
        2 => 5000,
        4 | 8 => 10000,
        16 => 14000,
        32 => 25000,
        64 => 50000,
        128 => 100000,
        _ => 25000,
    };
    let width = match active_width {
        1 => 1,
        2 => 4,
        4 => 8,
        8 => 12,
        16 => 2,
        _ => 1,
    };
    speed * width
}

/// Whether peer memory for CUDA is available (the files NCCL checks).
pub(crate) fn peermem_present() -> bool {
    [
        "/sys/kernel/mm/memory_peers/nv_mem/version",
        "/sys/kernel/mm/memory_peers/nv_mem_nc/version",
        "/sys/module/nvidia_peermem/version",
    ]
    .iter()
    .any(|p| std::path::Path::new(p).exists())
}

/// One GID table entry as seen by the selection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GidEntry {
    /// Index in the table.
    pub(crate) index: u8,
    /// Raw GID.
    pub(crate) gid: [u8; 16],
    /// RoCE version from sysfs (1 or 2), `None` when unreadable (containers).
    pub(crate) roce_version: Option<u32>,
}

fn gid_family(gid: &[u8; 16]) -> AddrFamily {
    if gid[..10].iter().all(|b| *b == 0) && gid[10] == 0xff && gid[11] == 0xff {
        AddrFamily::Inet
    } else {
        AddrFamily::Inet6
    }
}

fn gid_valid(gid: &[u8; 16]) -> bool {
    let zero = gid.iter().all(|b| *b == 0);
    let link_local = gid[0] == 0xfe && (gid[1] & 0xc0) == 0x80;
    !zero && !link_local
}

fn gid_ip(gid: &[u8; 16]) -> IpAddr {
    match gid_family(gid) {
        AddrFamily::Inet => IpAddr::from([gid[12], gid[13], gid[14], gid[15]]),
        AddrFamily::Inet6 => IpAddr::from(*gid),
    }
}

fn in_range(ip: IpAddr, range: &(IpAddr, u8)) -> bool {
    let (net, len) = *range;
    match (ip, net) {
        (IpAddr::V4(a), IpAddr::V4(b)) => {
            let mask = if len == 0 {
                0
            } else {
                u32::MAX << (32 - u32::from(len))
            };
            u32::from(a) & mask == u32::from(b) & mask
        }
        (IpAddr::V6(a), IpAddr::V6(b)) => {
            let mask = if len == 0 {
                0
            } else {
                u128::MAX << (128 - u32::from(len))
            };
            u128::from(a) & mask == u128::from(b) & mask
        }
        _ => false,
    }
}

/// Chooses a RoCE GID index by NCCL's rules: a valid (non-zero, not link-local) GID of the
/// wanted family, inside the wanted range, preferring the wanted RoCE version; unreadable
/// entries are skipped. Falls back to index 0.
pub(crate) fn choose_gid(
    entries: &[GidEntry],
    family: AddrFamily,
    range: Option<&(IpAddr, u8)>,
    roce_version: u32,
) -> u8 {
    let mut best: Option<&GidEntry> = None;
    for e in entries {
        if !gid_valid(&e.gid) || gid_family(&e.gid) != family {
            continue;
        }
        if range.is_some_and(|r| !in_range(gid_ip(&e.gid), r)) {
            continue;
        }
        let better = match best {
            None => true,
            Some(b) => b.roce_version != Some(roce_version) && e.roce_version == Some(roce_version),
        };
        if better {
            best = Some(e);
        }
    }
    best.map_or(0, |e| e.index)
}

fn roce_version(dev: &str, port: u8, index: usize) -> Option<u32> {
    let t = sysfs(&format!(
        "/sys/class/infiniband/{dev}/ports/{port}/gid_attrs/types/{index}"
    ))?;
    if t.contains("v2") {
        Some(2)
    } else if t.contains("v1") || t.contains("IB/RoCE") {
        Some(1)
    } else {
        None
    }
}

/// Every port of every device libibverbs sees, usable or not, with what the plugin would
/// make of it (for `discover` and for the diagnostics command).
pub(crate) fn survey(lib: &'static VerbsLib, config: &Config) -> Result<Vec<VerbsDevice>> {
    let list = DeviceList::get(lib)?;
    if list.is_empty() {
        return Err(Error::no_device("no RDMA devices found".into()));
    }
    let hca = config.ib_hca.value.as_ref();
    let range = match &config.ib_addr_range.value {
        Some(r) => Some(parse_cidr(r)?),
        None => None,
    };
    let peermem = peermem_present();
    let mut found = Vec::new();
    for i in 0..list.len() {
        let ibv_name = list.name(i);
        let ctx = match list.open(i) {
            Ok(c) => Arc::new(c),
            Err(e) => {
                tracing::warn!("skipping RDMA device {ibv_name}: {e}");
                continue;
            }
        };
        let dev_attr = match ctx.query_device() {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!("skipping RDMA device {ibv_name}: {e}");
                continue;
            }
        };
        let sys = format!("/sys/class/infiniband/{ibv_name}/device");
        let pci_path = std::fs::canonicalize(&sys)
            .ok()
            .map(|p| p.to_string_lossy().into_owned());
        let driver = std::fs::read_link(format!("{sys}/driver"))
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()));
        let numa_node = sysfs(&format!("{sys}/numa_node")).and_then(|n| n.parse().ok());
        let pd = Pd::new(&ctx)?;
        let dmabuf = pd.dmabuf_supported();
        for port in 1..=dev_attr.phys_port_cnt {
            let attr = match ctx.query_port(port) {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!("skipping {ibv_name}:{port}: {e}");
                    continue;
                }
            };
            let mut gids = Vec::new();
            for idx in 0..attr.gid_tbl_len.clamp(0, 256) as usize {
                if let Ok(gid) = ctx.query_gid(port, idx as i32) {
                    gids.push(GidEntry {
                        index: idx as u8,
                        gid,
                        roce_version: roce_version(&ibv_name, port, idx),
                    });
                }
            }
            let gid_index = if config.gid_index.value >= 0 {
                config.gid_index.value as u8
            } else if attr.link_layer == LINK_LAYER_ETHERNET {
                choose_gid(
                    &gids,
                    config.ib_addr_family.value,
                    range.as_ref(),
                    config.roce_version.value,
                )
            } else {
                0
            };
            let gid = ctx.query_gid(port, i32::from(gid_index)).unwrap_or([0; 16]);
            let netdev = sysfs(&format!(
                "/sys/class/infiniband/{ibv_name}/ports/{port}/gid_attrs/ndevs/{gid_index}"
            ));
            let netdev_mtu = netdev
                .as_ref()
                .and_then(|n| sysfs(&format!("/sys/class/net/{n}/mtu")))
                .and_then(|m| m.parse().ok());
            let port_speed = port_speed_mbps(attr.active_speed, attr.active_width);
            let speed = config.speed_mbps.value.map_or(port_speed, |s| s as i32);
            let name = if dev_attr.phys_port_cnt > 1 {
                format!("{ibv_name}:{port}")
            } else {
                ibv_name.clone()
            };
            found.push(VerbsDevice {
                local: LocalPort {
                    name,
                    port,
                    link_layer: attr.link_layer,
                    active_mtu: attr.active_mtu,
                    lid: attr.lid,
                    gid_index,
                    gid,
                },
                ibv_name: ibv_name.clone(),
                state: attr.state,
                selected: hca.is_none_or(|f| f.accepts(&ibv_name, Some(u32::from(port)))),
                pkey_index: config.ib_pkey.value as u16,
                gids,
                netdev,
                netdev_mtu,
                pci_path: pci_path.clone(),
                driver: driver.clone(),
                numa_node,
                guid: u64::from_be(dev_attr.sys_image_guid),
                speed_mbps: speed,
                port_speed_mbps: port_speed,
                limits: DeviceLimits::from_attr(&dev_attr),
                vendor_id: dev_attr.vendor_id,
                peermem,
                dmabuf,
                ctx: Arc::clone(&ctx),
                pd: Arc::clone(&pd),
                moves_here: Default::default(),
                port_watch: Default::default(),
            });
        }
    }
    Ok(found)
}

/// The usable ports of a survey (selected by `NCCL_IB_HCA`, active, IB or Ethernet), in the order
/// NCCL would number them: by PCI path.
pub(crate) fn usable(all: Vec<VerbsDevice>, config: &Config) -> Result<Vec<VerbsDevice>> {
    let seen: Vec<String> = all.iter().map(|d| d.name().to_string()).collect();
    let mut found: Vec<VerbsDevice> = all.into_iter().filter(VerbsDevice::usable).collect();
    if found.is_empty() {
        let why = match config.ib_hca.value {
            Some(_) => format!(
                "no active port matches NCCL_IB_HCA={} (ports here: {})",
                config.ib_hca_text(),
                seen.join(", ")
            ),
            None => format!("no active port on RDMA devices {}", seen.join(", ")),
        };
        return Err(Error::no_device(why));
    }
    found.sort_by(|a, b| (&a.pci_path, a.name()).cmp(&(&b.pci_path, b.name())));
    Ok(found)
}

// SAFETY: `Cq::poll` returns what the provider wrote, failing a count beyond the room given.
unsafe impl Nic for VerbsDevice {
    type Qp = Qp;
    type Cq = std::sync::Arc<Cq>;
    type Mr = Mr;

    fn local(&self) -> &LocalPort {
        &self.local
    }

    fn limits(&self) -> DeviceLimits {
        self.limits
    }

    fn held(&self) -> Held {
        self.ctx.usage.held()
    }

    fn create_cq(&self, entries: usize) -> Result<Self::Cq> {
        Cq::new(&self.ctx, entries.min(i32::MAX as usize) as i32)
    }

    fn create_qp(
        &self,
        cq: &Self::Cq,
        send_wr: u32,
        recv_wr: u32,
        max_inline: u32,
    ) -> Result<Self::Qp> {
        let qp = Qp::new(&self.pd, cq, send_wr, recv_wr, max_inline)?;
        qp.to_init(self.local.port, self.pkey_index, ACCESS_RDMA)?;
        Ok(qp)
    }

    fn connect_qp(&self, qp: &Self::Qp, path: &QpPath, remote: &RemoteQp) -> Result<()> {
        qp.to_rtr(path, remote)?;
        qp.to_rts(path)
    }

    fn fail_qp(&self, qp: &Self::Qp) -> Result<()> {
        qp.to_error()
    }

    fn register(&self, addr: usize, len: usize) -> Result<Self::Mr> {
        self.pd.reg_mr(addr, len, ACCESS_RDMA)
    }

    #[inline(always)]
    fn post_send(&self, qp: &Self::Qp, wr: &mut ibv_send_wr) -> Result<()> {
        qp.post_send(wr)
    }

    #[inline(always)]
    fn post_recv(&self, qp: &Self::Qp, wr_id: u64) -> Result<()> {
        qp.post_recv(wr_id)
    }

    #[inline(always)]
    fn poll_cq(&self, cq: &Self::Cq, wcs: &mut [MaybeUninit<ibv_wc>]) -> Result<usize> {
        cq.poll(wcs)
    }

    #[inline(always)]
    fn try_poll_cq(&self, cq: &Self::Cq, wcs: &mut [MaybeUninit<ibv_wc>]) -> Option<usize> {
        cq.try_poll(wcs)
    }

    fn drain_async_events(&self) -> u64 {
        self.ctx.drain_async_events()
    }

    fn fatal_for(&self, cq: &Self::Cq, qpns: &[u32]) -> Option<String> {
        self.ctx.fatal_for(cq, qpns)
    }

    fn status_str(&self, status: u32) -> String {
        self.ctx.lib().status_str(status)
    }

    fn counters(&self) -> Option<String> {
        VerbsDevice::counters(self)
    }

    fn port_active(&self) -> bool {
        self.port_watch.active(|| {
            self.ctx
                .query_port(self.local.port)
                .is_ok_and(|a| a.state == ibv_port_state::IBV_PORT_ACTIVE)
        })
    }

    fn moves_here(&self) -> &MovesHere {
        &self.moves_here
    }
}

/// The result of `ibv_get_device_list`, freed on drop.
pub(crate) struct DeviceList {
    lib: &'static VerbsLib,
    list: *mut *mut ibv_device,
    len: usize,
}

impl DeviceList {
    /// The devices `lib` sees, with their raw handles (valid until the list is freed by its
    /// drop).
    pub(crate) fn get(lib: &'static VerbsLib) -> Result<DeviceList> {
        let mut n: c_int = 0;
        // SAFETY: n is a valid out-pointer; the list is freed by DeviceList's drop.
        let list = unsafe { (lib.get_device_list)(&mut n) };
        if list.is_null() {
            let err = std::io::Error::last_os_error();
            let why = if err.raw_os_error() == Some(libc::ENOSYS) {
                "the kernel has no RDMA support".to_string()
            } else {
                err.to_string()
            };
            return Err(Error::no_device(format!(
                "ibv_get_device_list failed: {why}"
            )));
        }
        Ok(DeviceList {
            lib,
            list,
            len: n.max(0) as usize,
        })
    }

    /// Number of devices.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// True when libibverbs sees no device.
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Name of device `i`.
    pub(crate) fn name(&self, i: usize) -> String {
        if i >= self.len {
            return String::new();
        }
        // SAFETY: i < len, so the entry is a live device of the list.
        let name = unsafe { (self.lib.get_device_name)(*self.list.add(i)) };
        if name.is_null() {
            return format!("device{i}");
        }
        // SAFETY: non-NULL, NUL-terminated, valid while the list is.
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned()
    }

    /// Opens device `i`.
    pub(crate) fn open(&self, i: usize) -> Result<Context> {
        if i >= self.len {
            return Err(Error::misuse(format!("no device {i}")));
        }
        let name = self.name(i);
        // SAFETY: i < len, so the entry is a live device of the list.
        let raw = unsafe { (self.lib.open_device)(*self.list.add(i)) };
        if raw.is_null() {
            return Err(Error::last_os(format!("ibv_open_device({name})")));
        }
        Ok(Context::new(self.lib, raw, name))
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the list came from ibv_get_device_list and is freed exactly once; opened
        // contexts stay valid after the list is freed (libibverbs contract).
        unsafe { (self.lib.free_device_list)(self.list) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(a: [u8; 4]) -> [u8; 16] {
        let mut g = [0u8; 16];
        g[10] = 0xff;
        g[11] = 0xff;
        g[12..].copy_from_slice(&a);
        g
    }

    #[test]
    fn gid_choice_follows_nccl_rules() {
        let mut ll = [0u8; 16];
        ll[0] = 0xfe;
        ll[1] = 0x80;
        ll[15] = 1;
        let mut v6 = [0u8; 16];
        v6[0] = 0xfd;
        v6[15] = 2;
        let table = [
            GidEntry {
                index: 0,
                gid: ll,
                roce_version: Some(1),
            },
            GidEntry {
                index: 1,
                gid: ll,
                roce_version: Some(2),
            },
            GidEntry {
                index: 2,
                gid: v4([10, 0, 0, 5]),
                roce_version: Some(1),
            },
            GidEntry {
                index: 3,
                gid: v4([10, 0, 0, 5]),
                roce_version: Some(2),
            },
            GidEntry {
                index: 4,
                gid: v6,
                roce_version: Some(2),
            },
            GidEntry {
                index: 5,
                gid: v4([198, 18, 0, 1]),
                roce_version: None,
            },
        ];
        assert_eq!(choose_gid(&table, AddrFamily::Inet, None, 2), 3);
        assert_eq!(choose_gid(&table, AddrFamily::Inet, None, 1), 2);
        assert_eq!(choose_gid(&table, AddrFamily::Inet6, None, 2), 4);
        let r = parse_cidr("198.18.0.0/15").unwrap();
        assert_eq!(
            choose_gid(&table, AddrFamily::Inet, Some(&r), 2),
            5,
            "unreadable type is usable"
        );
        let none = parse_cidr("192.168.0.0/16").unwrap();
        assert_eq!(
            choose_gid(&table, AddrFamily::Inet, Some(&none), 2),
            0,
            "fallback 0"
        );
        assert_eq!(
            choose_gid(&table[..2], AddrFamily::Inet, None, 2),
            0,
            "link-local skipped"
        );
    }

    #[test]
    fn speeds_match_nccl_tables() {
        assert_eq!(
            port_speed_mbps(32, 2),
            100_000,
            "EDR 4x, what eRDMA reports"
        );
        assert_eq!(port_speed_mbps(64, 2), 200_000);
        assert_eq!(port_speed_mbps(1, 1), 2500);
    }
}
