//! Verbs transport: NCCL's p2p contract over RC QPs on eRDMA, RoCE or IB, receiver-driven as
//! NCCL's IB transport is. This module is the backend: the ports (found as NCCL IB finds
//! them), their registration caches, `ibv_fork_init`, DMA-BUF registration, the eRDMA
//! profile, and what it all came to ([`TransportFacts`]). The rest, by lifecycle:
//! - [`wire`]: what the two ends agree on (setup and move messages, clear-to-send entries,
//!   ids);
//! - [`setup`]: connect and accept over `oob`; [`bringup`]: an end's rails made, described,
//!   joined to the peer's and probed, for setup and for a move alike;
//! - [`send`] and [`recv`]: the data path, each end in its own room, with the gates an idle
//!   call reads instead of the lock ([`gate`]);
//! - [`peer`]: each end's link to its peer (move messages, its exit);
//! - [`rail`]: the NICs of a connection; [`cq`]: a rail's completions and work watchdog;
//!   [`fault`]: what breaks a rail, as a value, and whether a move mends it;
//! - [`failover`]: a connection moving off a failed NIC to another of the same link layer;
//!   [`reaper`]: the dead NIC's resources freed off the data path;
//! - [`profile`]: the settings a device changes, and each connection's parameters;
//!   [`budget`]: what a connection takes of its NICs, fitted to their limits;
//! - [`fusion`]: devices over several NICs; [`survey`]: what the ports tell, used or not.
//!
//! Everything below `setup` works on any [`Nic`](crate::verbs::nic::Nic), so the unit tests
//! (`tests`) run the whole protocol on the in-memory fabric of `verbs::fake`. eRDMA limits are
//! honoured: RC only, no SRQ, one SGE, inline <= 96 bytes, legacy verbs.

mod bringup;
mod budget;
mod cq;
mod failover;
mod fault;
pub(crate) mod fusion;
mod gate;
mod heal;
mod latency;
mod mr_cache;
mod peer;
pub(crate) mod profile;
mod rail;
mod reaper;
mod recv;
mod send;
mod setup;
mod survey;
#[cfg(test)]
mod tests;
mod trial;
pub(crate) mod wire;

use std::{net::IpAddr, sync::Arc};

use parking_lot::RwLock;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::oob::{Handle, TransportKind};
use crate::transport::facts::{self, TransportFacts};
use crate::transport::{
    device, CommKeys, DeviceProps, Hold, MemKeys, Registry, Transport, PTR_CUDA, PTR_DMABUF,
    PTR_HOST,
};
use crate::verbs::device::{self as vdev, VerbsDevice};
use crate::verbs::dma::ACCESS_RDMA;
use crate::verbs::VerbsLib;

use mr_cache::{register_across, MrCache};

pub(crate) use recv::VerbsReceiver;
pub(crate) use send::VerbsSender;
pub(crate) use setup::{VerbsConnector, VerbsListener};

/// NICs of a device, as its connections take them.
type Nics = Vec<Arc<VerbsDevice>>;

/// One port the transport uses, with its registration cache.
struct OpenPort {
    verbs: Arc<VerbsDevice>,
    cache: Arc<MrCache<VerbsDevice>>,
}

/// One device as NCCL numbers them: one port, or several fused.
struct Device {
    /// Indexes into `VerbsTransport::ports`: the rails of its connections.
    members: Vec<usize>,
    /// The other ports its connections may move to when one of theirs fails (failover): of
    /// the same link layer and memory support; registrations are made there too.
    spares: Vec<usize>,
    props: Arc<DeviceProps>,
    /// What it is, for the info command: its own NIC, fused and why, or made by NCCL.
    why: String,
}

/// The verbs backend of the plugin.
pub(crate) struct VerbsTransport {
    config: Config,
    ports: Vec<OpenPort>,
    /// The ports described for fusion.
    infos: Vec<fusion::NicInfo>,
    /// How many of `devices` are NCCL's physical devices (fused automatically or not); the
    /// rest are virtual ones NCCL made (`makeVDevice`).
    physical: usize,
    devices: RwLock<Vec<Device>>,
    /// What `open` found and decided (the devices are read from `devices` when asked).
    facts: TransportFacts,
    registry: Arc<Registry>,
}

/// A registration's keys, (lkey, rkey) on each NIC in order; `host`: host memory.
fn mem_keys(keys: &[(u32, u32)], host: bool) -> MemKeys {
    let mut out = MemKeys {
        rails: keys.len() as u8,
        host,
        ..MemKeys::default()
    };
    for (r, k) in keys.iter().enumerate() {
        out.set(r, *k);
    }
    out
}

/// What fusion needs to know of `d`.
fn nic_info(d: &VerbsDevice) -> fusion::NicInfo {
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
        numa_node: d.numa_node,
        guid: d.guid,
        port: d.local.port,
        max_comms: d.limits.max_qp.clamp(1, i32::MAX as u32) as i32,
    }
}

/// The ports a device over `members` may move its connections to (see [`Device::spares`]):
/// none with `NCCL_ERDMA_FAILOVER=0`; a registration holds keys for the members and these,
/// so at most `MAX_RAILS` in all.
fn spares(config: &Config, infos: &[fusion::NicInfo], members: &[usize]) -> Vec<usize> {
    if config.failover.value == Some(false) {
        return Vec::new();
    }
    let first = &infos[members[0]];
    (0..infos.len())
        .filter(|i| !members.contains(i))
        .filter(|&i| {
            infos[i].link_layer == first.link_layer && infos[i].ptr_support == first.ptr_support
        })
        .take(crate::transport::MAX_RAILS.saturating_sub(members.len()))
        .collect()
}

/// What the verbs transport would see on this host: for a report of why it cannot open.
pub(crate) fn survey_facts(config: &Config) -> TransportFacts {
    let mut facts = TransportFacts {
        transport: TransportKind::Verbs.name().to_string(),
        ..TransportFacts::default()
    };
    let Ok(lib) = VerbsLib::get(config.ibverbs_lib.value.as_deref()) else {
        return facts;
    };
    facts.libibverbs = Some(lib.name.clone());
    if let Ok(all) = vdev::survey(lib, config) {
        facts.ports = all.iter().map(|d| survey::port(d, config)).collect();
        facts.warnings = survey::warnings(&all, config);
        facts.gpudirect = survey::gpudirect(&all, config, &mut facts.warnings);
    }
    facts
}

impl VerbsTransport {
    /// Opens every usable port, or fails saying why there is none. Its ends look NCCL's
    /// handles up in `registry`.
    pub(crate) fn open(config: &Config, registry: Arc<Registry>) -> Result<Self> {
        let lib = VerbsLib::get(config.ibverbs_lib.value.as_deref())?;
        let all = vdev::survey(lib, config)?;
        let mut facts = TransportFacts {
            transport: TransportKind::Verbs.name().to_string(),
            libibverbs: Some(lib.name.clone()),
            ports: all.iter().map(|d| survey::port(d, config)).collect(),
            warnings: survey::warnings(&all, config),
            ..TransportFacts::default()
        };
        facts.gpudirect = survey::gpudirect(&all, config, &mut facts.warnings);
        let found = vdev::usable(all, config)?;
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
        let ports: Vec<OpenPort> = found
            .into_iter()
            .map(|d| {
                let verbs = Arc::new(d);
                OpenPort {
                    cache: MrCache::new(Arc::clone(&verbs)),
                    verbs,
                }
            })
            .collect();
        let plan = fusion::plan(config.fuse_nics.value, &infos, config.nccl_merges());
        if let Some(w) = &plan.warning {
            tracing::warn!("{w}");
        }
        let force_flush = config.force_flush.value;
        facts.fusion = facts::Fusion {
            members: plan
                .devices
                .iter()
                .filter(|d| d.members.len() > 1)
                .flat_map(|d| d.members.iter().map(|&i| infos[i].name.clone()))
                .collect(),
            reason: plan.reason,
        };
        let devices: Vec<Device> = plan
            .devices
            .into_iter()
            .enumerate()
            .map(|(index, d)| Device {
                props: Arc::new(fusion::props(
                    &infos,
                    &d.members,
                    vec![index as i32],
                    force_flush,
                )),
                spares: spares(config, &infos, &d.members),
                members: d.members,
                why: d.why,
            })
            .collect();
        Ok(VerbsTransport {
            config: config.clone(),
            ports,
            infos,
            physical: devices.len(),
            devices: RwLock::new(devices),
            facts,
            registry,
        })
    }

    /// Lookups of NCCL's handles for a comm on device `dev`.
    fn keys(&self, dev: usize) -> CommKeys {
        CommKeys::new(Arc::clone(&self.registry), dev)
    }

    /// The ports registrations for device `dev` (checked) are made on: how many are its own,
    /// and its own followed by its spares (indexes into `ports`, and their NICs).
    fn members(&self, dev: usize) -> Result<(usize, Vec<usize>, Nics)> {
        let devices = self.devices.read();
        let d = device(&devices, dev)?;
        let ports: Vec<usize> = d.members.iter().chain(&d.spares).copied().collect();
        let nics = ports.iter().map(|&i| Arc::clone(&self.ports[i].verbs));
        Ok((d.members.len(), ports.clone(), nics.collect()))
    }

    /// The verbs devices behind device `dev`: its rails, and the spares they may move to.
    fn rails(&self, dev: usize) -> Result<(Nics, Nics)> {
        let devices = self.devices.read();
        let d = device(&devices, dev)?;
        let verbs = |i: &usize| Arc::clone(&self.ports[*i].verbs);
        Ok((
            d.members.iter().map(verbs).collect(),
            d.spares.iter().map(verbs).collect(),
        ))
    }

    /// The parameters of a connection on device `dev` (rails `rails`, spares `spares`):
    /// failover where a spare or a second rail can carry it.
    fn params(
        &self,
        rails: &[Arc<VerbsDevice>],
        spares: &[Arc<VerbsDevice>],
        traffic_class: Option<i32>,
    ) -> profile::ConnParams {
        let mut p = profile::conn_params(&self.config, &rails[0], traffic_class);
        let others = rails.len() + spares.len() > 1;
        if others && self.config.failover.value != Some(false) {
            p.failover = Some(profile::failover_after(&self.config));
        }
        p
    }
}

impl Transport for VerbsTransport {
    type Listener = VerbsListener;
    type Connector = VerbsConnector;
    type Sender = VerbsSender;
    type Receiver = VerbsReceiver;

    fn kind(&self) -> TransportKind {
        TransportKind::Verbs
    }

    fn facts(&self) -> TransportFacts {
        let mut facts = self.facts.clone();
        facts.devices = self
            .devices
            .read()
            .iter()
            .enumerate()
            .map(|(index, d)| {
                let members = d.members.iter().map(|&i| self.infos[i].name.clone());
                let mut f = d.props.facts(index, members.collect(), &d.why);
                f.spares = d
                    .spares
                    .iter()
                    .map(|&i| self.infos[i].name.clone())
                    .collect();
                f
            })
            .collect();
        facts
    }

    fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    fn device_count(&self) -> usize {
        self.devices.read().len()
    }

    fn device(&self, dev: usize) -> Result<Arc<DeviceProps>> {
        Ok(Arc::clone(&device(&self.devices.read(), dev)?.props))
    }

    fn make_vdevice(&self, devs: &[i32], max: usize) -> Result<usize> {
        let mut devices = self.devices.write();
        let physical: Vec<&[usize]> = devices[..self.physical]
            .iter()
            .map(|d| &d.members[..])
            .collect();
        let picked = fusion::check_vdevice(
            devs,
            max,
            &physical,
            &self.infos,
            self.config.merge_nics.value,
        )?;
        let force_flush = self.config.force_flush.value;
        let props = fusion::props(&self.infos, &picked, devs.to_vec(), force_flush);
        let d = devices.len();
        tracing::info!(
            target: crate::log::INIT,
            "made virtual device {d}: {} speed {} Mbps over devices {devs:?}",
            props.name(),
            props.speed_mbps
        );
        devices.push(Device {
            spares: spares(&self.config, &self.infos, &picked),
            members: picked,
            props: Arc::new(props),
            why: format!("made by NCCL (makeVDevice of devices {devs:?})"),
        });
        Ok(d)
    }

    fn drop_virtual_devices(&self) {
        self.devices.write().truncate(self.physical);
    }

    fn listen(&self, dev: usize, ip: IpAddr) -> Result<VerbsListener> {
        let (rails, spares) = self.rails(dev)?;
        let params = self.params(&rails, &spares, None);
        VerbsListener::bind(ip, (&rails, &spares), params, self.keys(dev))
    }

    fn connect(
        &self,
        dev: usize,
        handle: &Handle,
        traffic_class: Option<i32>,
    ) -> Result<VerbsConnector> {
        let (rails, spares) = self.rails(dev)?;
        let params = self.params(&rails, &spares, traffic_class);
        VerbsConnector::start((&rails, &spares), handle, params, self.keys(dev))
    }

    fn register(
        &self,
        dev: usize,
        addr: usize,
        len: usize,
        host: bool,
    ) -> Result<(MemKeys, Option<Hold>)> {
        let (members, ports, nics) = self.members(dev)?;
        let (keys, held) = register_across(&nics, members, |r| {
            let i = ports[r];
            let cache = &self.ports[i].cache;
            let (mr, hit) = cache.register(addr, len)?;
            tracing::debug!(
                "regMr {addr:#x}+{len} on device {dev} NIC {}: cache {} (hits {}, misses {}, \
                 MRs {})",
                self.infos[i].name,
                if hit { "hit" } else { "miss" },
                cache.hits.load(std::sync::atomic::Ordering::Relaxed),
                cache.misses.load(std::sync::atomic::Ordering::Relaxed),
                cache.len()
            );
            let (lkey, rkey) = (mr.lkey(), mr.rkey());
            Ok((mr, lkey, rkey))
        })?;
        Ok((mem_keys(&keys, host), Some(Box::new(held))))
    }

    fn register_dmabuf(
        &self,
        dev: usize,
        addr: usize,
        len: usize,
        offset: u64,
        fd: i32,
    ) -> Result<(MemKeys, Hold)> {
        let (members, _, nics) = self.members(dev)?;
        let (keys, held) = register_across(&nics, members, |r| {
            let d = &nics[r];
            if !d.dmabuf {
                return Err(Error::misuse(format!(
                    "DMA-BUF registration is not supported on {}; NCCL should not have asked",
                    d.name()
                )));
            }
            let mr =
                d.pd.reg_dmabuf_mr(offset, len, addr as u64, fd, ACCESS_RDMA)?;
            let (lkey, rkey) = (mr.lkey(), mr.rkey());
            Ok((mr, lkey, rkey))
        })?;
        Ok((mem_keys(&keys, false), Box::new(held)))
    }
}
