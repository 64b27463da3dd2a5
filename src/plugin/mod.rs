//! The version-neutral core behind every exported `ncclNet_vN` table: `init`, devices and
//! properties, the listen/connect/accept stage machines, isend/irecv/test/iflush and memory
//! registration. `abi` converts C arguments to these calls and results back; nothing here
//! knows which ABI version is in use, nor which transport carries the data: the core is
//! generic over the transport contract, and the process's plugin holds `either`'s.
//!
//! Threads (as NCCL drives a plugin): `init`/`devices`/`getProperties` on application
//! threads; `listen`/`connect`/`accept`/`regMr`/`deregMr`/`close*` on proxy service threads;
//! the data path on proxy progress threads, one per comm at a time, possibly concurrent with
//! registration. Globals are behind locks; each comm's data path state is behind its own
//! (uncontended) lock, in the transport.

pub(crate) mod comm;
mod stages;
mod stats;
#[cfg(test)]
mod tests;

use std::{
    ffi::c_char,
    net::IpAddr,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Instant,
};

use parking_lot::Mutex;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::log::INIT;
use crate::oob::{handle, iface, Handle};
use crate::transport::either::{self, AnyTransport};
use crate::transport::registry::Registration;
use crate::transport::{
    Connector, Listener, Registry, Transport, TransportFacts, PTR_CUDA, PTR_HOST,
};
use stages::Stages;

pub(crate) use crate::oob::HANDLE_SIZE;
pub(crate) use crate::transport::{DeviceProps, SizeSink, MAX_P2P_BYTES, MAX_RECVS};
pub(crate) use comm::{
    ListenComm, RecvComm, RequestOwner, RequestToken, SendComm, LISTEN_MAGIC, RECV_MAGIC,
    SEND_MAGIC,
};

/// The plugin's name in every table (`NCCL_NET=erdma` selects it).
pub(crate) const NAME: &str = "erdma";
/// `maxCollBytes`: NCCL's CollNet default.
pub(crate) const MAX_COLL_BYTES: usize = 512 << 20;
/// Most devices (physical and virtual) a plugin reports.
const MAX_DEVICES: usize = 256;

impl DeviceProps {
    /// `name` for C; valid for the life of the process (the plugin is never torn down).
    pub(crate) fn name_ptr(&self) -> *const c_char {
        self.name.as_ptr()
    }
    /// `pciPath` for C, or NULL when the device has none.
    pub(crate) fn pci_path_ptr(&self) -> *const c_char {
        self.pci_path
            .as_ref()
            .map_or(std::ptr::null(), |p| p.as_ptr())
    }
}

/// The initialised plugin over transport `T`: configuration, transport and registrations.
pub(crate) struct Plugin<T: Transport = AnyTransport> {
    /// Settings read at `init`.
    pub(crate) config: Config,
    transport: T,
    /// Where bootstrap listeners bind.
    bootstrap_ip: IpAddr,
    /// Traffic totals per device index.
    totals: Box<[stats::DeviceTotals]>,
    next_comm: AtomicU64,
    connecting: Mutex<Stages<T::Connector>>,
}

static PLUGIN: Mutex<Option<Arc<Plugin>>> = Mutex::new(None);

/// Initialises the plugin once per process; later calls return the same instance. A failed
/// `init` leaves nothing behind, so it can be retried with a corrected environment.
pub(crate) fn init() -> Result<Arc<Plugin>> {
    let mut global = PLUGIN.lock();
    if let Some(p) = global.as_ref() {
        return Ok(Arc::clone(p));
    }
    let plugin = Arc::new(Plugin::open(Config::from_env()?)?);
    *global = Some(Arc::clone(&plugin));
    Ok(plugin)
}

/// The initialised plugin, or an error when `init` has not succeeded.
pub(crate) fn get() -> Result<Arc<Plugin>> {
    PLUGIN
        .lock()
        .as_ref()
        .map(Arc::clone)
        .ok_or_else(|| Error::misuse("the plugin is used before a successful init".into()))
}

/// The listener a connection handle names, for messages ("an unreadable handle" when it is
/// not one this plugin's `listen` wrote).
pub(crate) fn handle_peer(buf: &[u8; HANDLE_SIZE]) -> String {
    Handle::decode(buf).map_or_else(|_| "an unreadable handle".into(), |h| h.addr.to_string())
}

impl Plugin {
    /// Opens the transport `config` asks for, on the bootstrap interface it names, and logs
    /// the settings and what the transport found and decided.
    pub(crate) fn open(config: Config) -> Result<Self> {
        Self::open_for_report(config).0.map_err(|(e, _)| e)
    }

    /// [`Self::open`], with the bootstrap interface as the info command shows it, and, where
    /// it fails, what the transport saw of the host.
    pub(crate) fn open_for_report(
        config: Config,
    ) -> (
        std::result::Result<Self, (Error, TransportFacts)>,
        Option<String>,
    ) {
        for line in config.describe() {
            tracing::info!(target: INIT, "{line}");
        }
        let bootstrap = match iface::pick(
            config.socket_ifname.value.as_ref(),
            config.socket_family.value,
        ) {
            Ok(b) => b,
            Err(e) => return (Err((e, either::survey(&config))), None),
        };
        let shown = format!("interface {} address {}", bootstrap.ifname, bootstrap.ip);
        tracing::info!(target: INIT, "bootstrap {shown}");
        match either::open(&config, &bootstrap, Arc::default()) {
            Ok(transport) => {
                let plugin = Plugin::new(config, transport, bootstrap.ip);
                plugin.log_facts();
                (Ok(plugin), Some(shown))
            }
            Err(e) => (Err((e, either::survey(&config))), Some(shown)),
        }
    }
}

impl<T: Transport> Plugin<T> {
    /// The plugin over `transport`, its listeners bound on `bootstrap_ip`.
    pub(crate) fn new(config: Config, transport: T, bootstrap_ip: IpAddr) -> Self {
        Plugin {
            config,
            transport,
            bootstrap_ip,
            totals: (0..MAX_DEVICES)
                .map(|_| stats::DeviceTotals::default())
                .collect(),
            next_comm: AtomicU64::new(1),
            connecting: Mutex::new(Stages::default()),
        }
    }

    /// What the transport found and decided at `init`.
    pub(crate) fn facts(&self) -> TransportFacts {
        self.transport.facts()
    }

    /// Logs what the transport found and decided.
    fn log_facts(&self) {
        let facts = self.facts();
        for p in facts.ports.iter().filter(|p| p.used.is_ok()) {
            tracing::info!(
                target: INIT,
                "{}: port {} {} GID index {} MTU {} NUMA node {} PCI {}; \
                 NCCL_IB_QPS_PER_CONNECTION {} ({}), NCCL_ERDMA_CTS_BATCH {} ({})",
                p.name,
                p.port,
                p.link_layer,
                p.gid_index,
                p.active_mtu,
                p.numa_node.map_or("?".into(), |n| n.to_string()),
                p.pci_path.as_deref().unwrap_or("none"),
                p.qps_per_connection.value,
                p.qps_per_connection.source,
                p.cts_batch.value,
                p.cts_batch.source,
            );
        }
        if !facts.fusion.reason.is_empty() {
            tracing::info!(target: INIT, "NIC fusion: {}", facts.fusion.reason);
        }
        for d in &facts.devices {
            tracing::info!(
                target: INIT,
                "device {}: {} transport {} speed {} Mbps ptrSupport {:#x} pci {}",
                d.index,
                d.name,
                facts.transport,
                d.speed_mbps,
                d.ptr_support,
                d.pci_path.as_deref().unwrap_or("none")
            );
        }
        for w in &facts.warnings {
            tracing::info!(target: INIT, "{} ({})", w.what, w.fix);
        }
    }

    /// Number of devices.
    pub(crate) fn device_count(&self) -> usize {
        self.transport.device_count()
    }

    /// Device `dev`, checked.
    pub(crate) fn device(&self, dev: i32) -> Result<Arc<DeviceProps>> {
        let index = usize::try_from(dev).unwrap_or(usize::MAX);
        self.transport.device(index).map_err(|_| {
            Error::misuse(format!(
                "device {dev} does not exist ({} devices)",
                self.device_count()
            ))
        })
    }

    /// `makeVDevice`: a virtual device fusing the physical devices `devs` (at most `max`,
    /// the ABI version's limit); its index.
    pub(crate) fn make_vdevice(&self, devs: &[i32], max: usize) -> Result<usize> {
        if self.device_count() >= MAX_DEVICES {
            return Err(Error::usage(format!(
                "makeVDevice of devices {devs:?}: {MAX_DEVICES} devices already, NCCL's limit"
            )));
        }
        self.transport.make_vdevice(devs, max)
    }

    /// NCCL finalized its last communicator's context: where it unloads the plugin now
    /// (`NCCL_NET_PLUGIN_REF_COUNT` unset or 0), the virtual devices it made go, so that its
    /// next load, which takes every device offered as a physical NIC, sees only those.
    pub(crate) fn last_context_finalized(&self) {
        if self.config.nccl_unloads() && self.device_count() > 0 {
            self.transport.drop_virtual_devices();
        }
    }

    /// Traffic totals of device `dev`.
    fn totals(&self, dev: usize) -> &stats::DeviceTotals {
        &self.totals[dev.min(self.totals.len() - 1)]
    }

    /// Counters for a new comm on `dev` talking to `peer`.
    fn comm_stats(&self, dir: stats::Direction, dev: usize, peer: &str) -> stats::CommStats {
        let id = self.next_comm.fetch_add(1, Ordering::Relaxed);
        let name = self
            .device(dev as i32)
            .map_or_else(|_| "?".to_string(), |d| d.name().to_string());
        stats::CommStats::new(
            dir,
            format!("#{id} on {name} with {peer}"),
            self.config.stats_interval_s.value,
        )
    }

    /// `listen`: binds a bootstrap listener and writes the handle for the peer.
    pub(crate) fn listen(
        &self,
        dev: i32,
        out: &mut [u8; HANDLE_SIZE],
    ) -> Result<Box<ListenComm<T>>> {
        self.device(dev)?;
        let listen = self.transport.listen(dev as usize, self.bootstrap_ip)?;
        listen.handle().encode(out);
        Ok(ListenComm::new(listen, dev as usize))
    }

    /// `connect`: one non-blocking step; `Ok(None)` until the connection is up. The stage is
    /// kept in a registry keyed by an id stored in the handle NCCL passes back each time.
    /// `traffic_class` is the communicator's (v10+), used when `NCCL_IB_TC` is unset.
    pub(crate) fn connect(
        self: &Arc<Self>,
        dev: i32,
        buf: &mut [u8; HANDLE_SIZE],
        traffic_class: Option<i32>,
    ) -> Result<Option<Box<SendComm<T>>>> {
        self.device(dev)?;
        let handle = Handle::decode(buf)?;
        let ours = self.transport.kind();
        if handle.transport != ours {
            return Err(Error::usage(format!(
                "the peer listens with transport {}, this process uses {}: set the same \
                 NCCL_ERDMA_TRANSPORT on every node",
                handle.transport.name(),
                ours.name()
            )));
        }
        let mut connecting = self.connecting.lock();
        let id = match handle::stage_id(buf)? {
            Some(id) => id,
            None => {
                let stage = self
                    .transport
                    .connect(dev as usize, &handle, traffic_class)?;
                let (id, dropped) = connecting.insert(stage, Instant::now());
                if dropped > 0 {
                    tracing::info!(
                        "dropped {dropped} connect(s) NCCL stopped polling {} s ago (an \
                         aborted communicator)",
                        stages::ABANDONED_AFTER.as_secs()
                    );
                }
                handle::set_stage_id(buf, id);
                id
            }
        };
        let stage = connecting.poll(id, Instant::now()).ok_or_else(|| {
            Error::misuse(format!(
                "connect called again with a handle whose connection {id} already finished, \
                 failed, or went unpolled for {} s",
                stages::ABANDONED_AFTER.as_secs()
            ))
        })?;
        let step = stage.poll();
        if !matches!(step, Ok(None)) {
            // Finished or failed: the stage is done either way.
            connecting.remove(id);
        }
        drop(connecting);
        Ok(step?.map(|end| SendComm::new(Arc::clone(self), end, dev as usize)))
    }

    /// `accept`: one non-blocking step; `Ok(None)` until the peer has connected.
    pub(crate) fn accept(
        self: &Arc<Self>,
        listen: &mut ListenComm<T>,
    ) -> Result<Option<Box<RecvComm<T>>>> {
        let dev = listen.dev;
        let end = listen.inner.poll_accept()?;
        Ok(end.map(|end| RecvComm::new(Arc::clone(self), end, dev)))
    }

    /// `regMr` on device `dev`.
    pub(crate) fn reg_mr(&self, dev: usize, addr: usize, len: usize, ptr_type: i32) -> Result<u64> {
        if addr == 0 && len > 0 {
            return Err(Error::misuse("regMr of a NULL address".to_string()));
        }
        let supported = self.device(dev as i32).map_or(0, |d| d.ptr_support);
        if ptr_type != PTR_HOST && (ptr_type != PTR_CUDA || supported & PTR_CUDA == 0) {
            return Err(Error::misuse(format!(
                "memory type {ptr_type} is not supported by the {} transport on this host \
                 (ptrSupport {supported:#x})",
                self.transport.kind().name()
            )));
        }
        let (keys, hold) = self
            .transport
            .register(dev, addr, len, ptr_type == PTR_HOST)?;
        self.registry()
            .insert(Registration::new(addr, len, dev, keys), hold)
    }

    /// `regMrDmaBuf` on device `dev` (verbs devices that support DMA-BUF).
    pub(crate) fn reg_mr_dmabuf(
        &self,
        dev: usize,
        addr: usize,
        len: usize,
        offset: u64,
        fd: i32,
    ) -> Result<u64> {
        let (keys, hold) = self.transport.register_dmabuf(dev, addr, len, offset, fd)?;
        self.registry()
            .insert(Registration::new(addr, len, dev, keys), Some(hold))
    }

    /// `deregMr`; a NULL handle (0) is accepted, as NCCL may pass one.
    pub(crate) fn dereg_mr(&self, handle: u64) -> Result<()> {
        if handle == 0 {
            return Ok(());
        }
        self.registry().remove(handle).map(|_| ())
    }

    /// The live memory registrations, which the transport's ends look up.
    fn registry(&self) -> &Registry {
        self.transport.registry()
    }
}
