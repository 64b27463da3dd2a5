//! Verbs transport: NCCL's p2p contract over RC QPs on eRDMA, RoCE or IB, receiver-driven as
//! NCCL's IB transport is. This module is the backend: the devices (found as NCCL IB finds
//! them), their registration caches, `ibv_fork_init`, DMA-BUF registration and the eRDMA
//! profile. The rest, by lifecycle:
//! - [`wire`]: what the two ends agree on (setup message, clear-to-send entries, ids);
//! - [`setup`]: connect and accept over `oob`, QPs brought up;
//! - [`send`] and [`recv`]: the data path state machines;
//! - [`cq`]: completions, the peer watch and the work watchdog;
//! - [`profile`]: the settings a device changes, and each connection's parameters;
//! - [`rail`]: the NICs of a connection; [`fusion`]: devices over several NICs.
//!
//! Everything below `setup` works on any [`Nic`], so the unit tests (`tests`) run the whole
//! protocol on the in-memory fabric of `verbs::fake`. eRDMA limits are honoured: RC only, no
//! SRQ, one SGE, inline <= 96 bytes, legacy verbs.

mod cq;
pub(crate) mod fusion;
mod gate;
mod mr_cache;
pub(crate) mod profile;
mod rail;
mod recv;
mod send;
mod setup;
#[cfg(test)]
mod tests;
mod wire;

use std::{net::IpAddr, sync::Arc};

use parking_lot::RwLock;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::log::INIT;
use crate::oob::{Handle, TransportKind};
use crate::transport::{
    device, Connecting, DeviceProps, Hold, Listening, MemKeys, Transport, PTR_CUDA, PTR_DMABUF,
    PTR_HOST,
};
use crate::verbs::device::{self as vdev, mtu_bytes, VerbsDevice};
use crate::verbs::dma::ACCESS_RDMA;
use crate::verbs::VerbsLib;

use mr_cache::MrCache;
use setup::{VerbsConnecting, VerbsListen};

pub(crate) use crate::verbs::dma::WcBatch;
pub(crate) use gate::Look;

/// The sending end of a connection over real devices.
pub(crate) type VerbsSendEnd = send::VerbsSendComm<VerbsDevice>;
/// The receiving end of a connection over real devices.
pub(crate) type VerbsRecvEnd = recv::VerbsRecvComm<VerbsDevice>;

/// One NIC (port) the transport uses.
struct Nic {
    verbs: Arc<VerbsDevice>,
    cache: Arc<MrCache<VerbsDevice>>,
}

/// One device as NCCL numbers them: one NIC, or several fused.
struct Device {
    /// Indexes into `VerbsTransport::nics`: the rails of its connections.
    members: Vec<usize>,
    props: Arc<DeviceProps>,
}

/// The verbs backend of the plugin.
pub(crate) struct VerbsTransport {
    config: Config,
    nics: Vec<Nic>,
    /// NICs described for fusion.
    infos: Vec<fusion::NicInfo>,
    /// How many of `devices` are NCCL's physical devices (fused automatically or not); the
    /// rest are virtual ones NCCL made (`makeVDevice`).
    physical: usize,
    devices: RwLock<Vec<Device>>,
}

/// Finds the usable verbs devices, or says why there are none.
pub(crate) fn discover(config: &Config) -> Result<Vec<VerbsDevice>> {
    let lib = VerbsLib::get(config.ibverbs_lib.value.as_deref())?;
    vdev::discover(lib, config)
}

/// What fusion needs to know of `d`.
pub(crate) fn nic_info(d: &VerbsDevice) -> fusion::NicInfo {
    let mut ptr_support = PTR_HOST;
    if d.peermem {
        ptr_support |= PTR_CUDA;
    }
    if d.dmabuf {
        ptr_support |= PTR_DMABUF;
    }
    fusion::NicInfo {
        name: d.name().to_string(),
        class: d.class(),
        link_layer: d.local.link_layer,
        speed_mbps: d.speed_mbps,
        ptr_support,
        pci_path: d.pci_path.clone(),
        guid: d.guid,
        port: d.local.port,
        max_comms: d.max_qp.max(1),
    }
}

/// Whether the user asked NCCL to fuse NICs itself (then automatic fusion stays off).
pub(crate) fn nccl_merges() -> bool {
    ["NCCL_NET_FORCE_MERGE", "NCCL_NET_MERGE_LEVEL"]
        .iter()
        .any(|v| std::env::var(v).is_ok_and(|s| !s.trim().is_empty()))
}

/// The automatic fusion decision for the usable `devs`.
pub(crate) fn auto_fusion(config: &Config, devs: &[fusion::NicInfo]) -> fusion::Fusion {
    fusion::auto_fuse(config.fuse_nics.value, devs, nccl_merges())
}

impl VerbsTransport {
    /// Opens every usable device, or fails saying why there is none.
    pub(crate) fn open(config: &Config) -> Result<Self> {
        let found = discover(config)?;
        let lib = VerbsLib::get(config.ibverbs_lib.value.as_deref())?;
        // Before the first registration, or it fails (rdma-core makes it a no-op on kernels
        // with copy-on-fork for pinned memory).
        if let Err(e) = lib.fork_init() {
            tracing::warn!(
                "ibv_fork_init failed ({e}): registered memory is not protected from fork; on \
                 a kernel without copy-on-fork for pinned pages (before Linux 5.13), a child \
                 process forked after registration (a PyTorch DataLoader worker) can corrupt \
                 RDMA transfers or crash. Set RDMAV_FORK_SAFE=1, or start workers before the \
                 communicator"
            );
        }
        let infos: Vec<fusion::NicInfo> = found.iter().map(nic_info).collect();
        let mut nics = Vec::with_capacity(found.len());
        for d in found {
            let t = profile::tuning(config, d.class());
            tracing::info!(
                target: INIT,
                "{}: port {} {} GID index {} MTU {} vendor {:#x} peermem {} dmabuf {}; \
                 NCCL_IB_QPS_PER_CONNECTION {} ({}), NCCL_ERDMA_CTS_BATCH {} ({})",
                d.name(),
                d.local.port,
                if d.is_roce() { "RoCE" } else { "IB" },
                d.local.gid_index,
                mtu_bytes(d.local.active_mtu),
                d.vendor_id,
                d.peermem,
                d.dmabuf,
                t.qps_per_connection.value,
                t.qps_per_connection.source,
                t.cts_batch.value,
                t.cts_batch.source,
            );
            let verbs = Arc::new(d);
            nics.push(Nic {
                cache: MrCache::new(Arc::clone(&verbs)),
                verbs,
            });
        }
        let fused = auto_fusion(config, &infos);
        tracing::info!(target: INIT, "NIC fusion: {}", fused.reason);
        let force_flush = config.force_flush.value;
        let devices: Vec<Device> = match fused.members {
            Some(members) => vec![Device {
                props: Arc::new(fusion::props(&infos, &members, vec![0], -1, force_flush)),
                members,
            }],
            None => {
                let rails = fusion::rail_ids(&infos);
                (0..infos.len())
                    .map(|i| Device {
                        props: Arc::new(fusion::props(
                            &infos,
                            &[i],
                            vec![i as i32],
                            rails[i],
                            force_flush,
                        )),
                        members: vec![i],
                    })
                    .collect()
            }
        };
        Ok(VerbsTransport {
            config: config.clone(),
            nics,
            infos,
            physical: devices.len(),
            devices: RwLock::new(devices),
        })
    }

    /// The NICs of device `dev` (checked).
    fn members(&self, dev: usize) -> Result<Vec<usize>> {
        Ok(device(&self.devices.read(), dev)?.members.clone())
    }

    /// The verbs devices behind device `dev`: its rails.
    fn rails(&self, dev: usize) -> Result<Vec<Arc<VerbsDevice>>> {
        Ok(self
            .members(dev)?
            .iter()
            .map(|&i| Arc::clone(&self.nics[i].verbs))
            .collect())
    }
}

impl Transport for VerbsTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Verbs
    }

    fn device_count(&self) -> usize {
        self.devices.read().len()
    }

    fn device(&self, dev: usize) -> Result<Arc<DeviceProps>> {
        Ok(Arc::clone(&device(&self.devices.read(), dev)?.props))
    }

    fn make_vdevice(&self, devs: &[i32], max: usize) -> Result<usize> {
        // Only NCCL's physical devices can be fused, and not once they were fused
        // automatically (that would name their NICs twice).
        let unfused = if self.physical == self.infos.len() {
            &self.infos[..]
        } else {
            &[]
        };
        let picked = fusion::check_vdevice(devs, max, unfused, self.config.merge_nics.value)?;
        let force_flush = self.config.force_flush.value;
        let props = fusion::props(&self.infos, &picked, devs.to_vec(), -1, force_flush);
        let mut devices = self.devices.write();
        let d = devices.len();
        tracing::info!(
            target: INIT,
            "made virtual device {d}: {} speed {} Mbps over devices {devs:?}",
            props.name(),
            props.speed_mbps
        );
        devices.push(Device {
            members: picked,
            props: Arc::new(props),
        });
        Ok(d)
    }

    fn listen(&self, dev: usize, ip: IpAddr) -> Result<Box<dyn Listening>> {
        let rails = self.rails(dev)?;
        let params = profile::conn_params(&self.config, &rails[0], None);
        Ok(Box::new(VerbsListen::bind(ip, &rails, params)?))
    }

    fn connect(
        &self,
        dev: usize,
        handle: &Handle,
        traffic_class: Option<i32>,
    ) -> Result<Box<dyn Connecting>> {
        let rails = self.rails(dev)?;
        let params = profile::conn_params(&self.config, &rails[0], traffic_class);
        Ok(Box::new(VerbsConnecting::start(&rails, handle, params)?))
    }

    fn register(
        &self,
        dev: usize,
        addr: usize,
        len: usize,
        host: bool,
    ) -> Result<(MemKeys, Option<Hold>)> {
        let members = self.members(dev)?;
        let mut keys = MemKeys {
            rails: members.len() as u8,
            host,
            ..MemKeys::default()
        };
        let mut held = Vec::with_capacity(members.len());
        for (r, &i) in members.iter().enumerate() {
            let cache = &self.nics[i].cache;
            let (mr, hit) = cache.register(addr, len)?;
            tracing::debug!(
                "regMr {addr:#x}+{len} on device {dev} rail {}: cache {} (hits {}, misses {}, \
                 MRs {})",
                self.infos[i].name,
                if hit { "hit" } else { "miss" },
                cache.hits.load(std::sync::atomic::Ordering::Relaxed),
                cache.misses.load(std::sync::atomic::Ordering::Relaxed),
                cache.len()
            );
            keys.set(r, (mr.lkey(), mr.rkey()));
            held.push(mr);
        }
        Ok((keys, Some(Box::new(held))))
    }

    fn register_dmabuf(
        &self,
        dev: usize,
        addr: usize,
        len: usize,
        offset: u64,
        fd: i32,
    ) -> Result<(MemKeys, Hold)> {
        let rails = self.rails(dev)?;
        let mut keys = MemKeys {
            rails: rails.len() as u8,
            host: false,
            ..MemKeys::default()
        };
        let mut held = Vec::with_capacity(rails.len());
        for (r, d) in rails.iter().enumerate() {
            if !d.dmabuf {
                return Err(Error::usage(format!(
                    "DMA-BUF registration is not supported on {}; NCCL should not have asked",
                    d.name()
                )));
            }
            let mr =
                d.pd.reg_dmabuf_mr(offset, len, addr as u64, fd, ACCESS_RDMA)?;
            keys.set(r, (mr.lkey(), mr.rkey()));
            held.push(mr);
        }
        Ok((keys, Box::new(held)))
    }
}
