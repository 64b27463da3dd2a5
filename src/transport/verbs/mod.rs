//! Verbs transport: NCCL's p2p contract over RC QPs on eRDMA, RoCE or IB, receiver-driven as
//! NCCL's IB transport is. This module is the backend: the devices (found as NCCL IB finds
//! them), their registration caches, `ibv_fork_init`, DMA-BUF registration and the eRDMA
//! profile. The rest, by lifecycle:
//! - [`wire`]: what the two ends agree on (setup message, clear-to-send entries, ids);
//! - [`setup`]: connect and accept over `oob`, QPs brought up;
//! - [`send`] and [`recv`]: the data path state machines;
//! - [`cq`]: completions, the peer watch and the work watchdog;
//! - [`profile`]: the settings a device changes, and each connection's parameters.
//!
//! Everything below `setup` works on any [`Nic`], so the unit tests (`tests`) run the whole
//! protocol on the in-memory fabric of `verbs::fake`. eRDMA limits are honoured: RC only, no
//! SRQ, one SGE, inline <= 96 bytes, legacy verbs.

mod cq;
mod mr_cache;
pub(crate) mod profile;
mod rail;
mod recv;
mod send;
mod setup;
#[cfg(test)]
mod tests;
mod wire;

use std::{ffi::CString, net::IpAddr, sync::Arc};

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

/// One device the transport uses.
struct Device {
    verbs: Arc<VerbsDevice>,
    cache: Arc<MrCache<VerbsDevice>>,
}

/// The verbs backend of the plugin.
pub(crate) struct VerbsTransport {
    config: Config,
    devices: Vec<Device>,
    props: Vec<DeviceProps>,
}

/// Finds the usable verbs devices, or says why there are none.
pub(crate) fn discover(config: &Config) -> Result<Vec<VerbsDevice>> {
    let lib = VerbsLib::get(config.ibverbs_lib.value.as_deref())?;
    vdev::discover(lib, config)
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
        let mut devices = Vec::with_capacity(found.len());
        let mut props = Vec::with_capacity(found.len());
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
            props.push(device_props(&d, config));
            let verbs = Arc::new(d);
            devices.push(Device {
                cache: MrCache::new(Arc::clone(&verbs)),
                verbs,
            });
        }
        Ok(VerbsTransport {
            config: config.clone(),
            devices,
            props,
        })
    }
}

fn device_props(d: &VerbsDevice, config: &Config) -> DeviceProps {
    let mut ptr_support = PTR_HOST;
    if d.peermem {
        ptr_support |= PTR_CUDA;
    }
    if d.dmabuf {
        ptr_support |= PTR_DMABUF;
    }
    DeviceProps {
        name: CString::new(d.name()).unwrap_or_default(),
        pci_path: d
            .pci_path
            .as_ref()
            .and_then(|p| CString::new(p.clone()).ok()),
        guid: d.guid,
        ptr_support,
        speed_mbps: d.speed_mbps,
        port: i32::from(d.local.port),
        max_comms: d.max_qp.max(1),
        force_flush: config.force_flush.value,
    }
}

impl Transport for VerbsTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Verbs
    }

    fn devices(&self) -> &[DeviceProps] {
        &self.props
    }

    fn listen(&self, dev: usize, ip: IpAddr) -> Result<Box<dyn Listening>> {
        let d = &device(&self.devices, dev)?.verbs;
        let params = profile::conn_params(&self.config, d, None);
        Ok(Box::new(VerbsListen::bind(
            ip,
            std::slice::from_ref(d),
            params,
        )?))
    }

    fn connect(
        &self,
        dev: usize,
        handle: &Handle,
        traffic_class: Option<i32>,
    ) -> Result<Box<dyn Connecting>> {
        let d = &device(&self.devices, dev)?.verbs;
        let params = profile::conn_params(&self.config, d, traffic_class);
        Ok(Box::new(VerbsConnecting::start(
            std::slice::from_ref(d),
            handle,
            params,
        )?))
    }

    fn register(
        &self,
        dev: usize,
        addr: usize,
        len: usize,
        host: bool,
    ) -> Result<(MemKeys, Option<Hold>)> {
        let cache = &device(&self.devices, dev)?.cache;
        let (held, hit) = cache.register(addr, len)?;
        tracing::debug!(
            "regMr {addr:#x}+{len} on device {dev}: cache {} (hits {}, misses {}, MRs {})",
            if hit { "hit" } else { "miss" },
            cache.hits.load(std::sync::atomic::Ordering::Relaxed),
            cache.misses.load(std::sync::atomic::Ordering::Relaxed),
            cache.len()
        );
        let mut keys = MemKeys {
            rails: 1,
            host,
            ..MemKeys::default()
        };
        keys.keys[0] = (held.lkey(), held.rkey());
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
        let d = &device(&self.devices, dev)?.verbs;
        if !d.dmabuf {
            return Err(Error::Usage(format!(
                "DMA-BUF registration is not supported on {}; NCCL should not have asked",
                d.name()
            )));
        }
        let mr =
            d.pd.reg_dmabuf_mr(offset, len, addr as u64, fd, ACCESS_RDMA)?;
        let mut keys = MemKeys {
            rails: 1,
            host: false,
            ..MemKeys::default()
        };
        keys.keys[0] = (mr.lkey(), mr.rkey());
        Ok((keys, Box::new(mr)))
    }
}
