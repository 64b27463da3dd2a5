//! The version-neutral core behind every exported `ncclNet_vN` table: `init`, devices and
//! properties, the listen/connect/accept stage machines, isend/irecv/test/iflush and memory
//! registration. `abi` converts C arguments to these calls and results back; nothing here
//! knows which ABI version is in use.
//!
//! Threads (as NCCL drives a plugin): `init`/`devices`/`getProperties` on application
//! threads; `listen`/`connect`/`accept`/`regMr`/`deregMr`/`close*` on proxy service threads;
//! the data path on proxy progress threads, one per comm at a time, possibly concurrent with
//! registration. Globals are behind locks; each comm's data path state is behind its own
//! (uncontended) lock.

pub mod comm;
pub mod mr;
pub mod stages;
pub mod stats;

use std::{
    ffi::{c_char, CString},
    net::IpAddr,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use parking_lot::Mutex;

use crate::config::{Config, Setting, TransportChoice};
use crate::error::{Error, Result};
use crate::log::INIT;
use crate::oob::{handle, iface, Handle, Timeouts, TransportKind, HANDLE_SIZE};
use crate::transport::tcp::{TcpConnecting, TcpListen};
use crate::transport::verbs::{self, MrCache, VerbsConnecting, VerbsListen, VerbsParams};
use crate::transport::MAX_RECVS;
use crate::verbs::device::{self as vdev, VerbsDevice};
use crate::verbs::VerbsLib;
use stages::Stages;

pub use comm::{
    ListenComm, RecvComm, RequestOwner, RequestToken, SendComm, LISTEN_MAGIC, RECV_MAGIC,
    REQUEST_MAGIC, SEND_MAGIC,
};
pub use mr::{MrTable, Registration};

/// The plugin's name in every table (`NCCL_NET=erdma` selects it).
pub const NAME: &str = "erdma";
/// `NCCL_PTR_HOST`.
pub const PTR_HOST: i32 = 1;
/// `NCCL_PTR_CUDA`.
pub const PTR_CUDA: i32 = 2;
/// `NCCL_PTR_DMABUF`.
pub const PTR_DMABUF: i32 = 4;
/// Largest message per request we advertise (`maxP2pBytes`): what `test` can report in an
/// `int`, rounded to 1 GiB as NCCL's shims do for older plugins.
pub const MAX_P2P_BYTES: usize = 1 << 30;
/// `maxCollBytes`: NCCL's CollNet default.
pub const MAX_COLL_BYTES: usize = 512 << 20;
/// QPs per connection on eRDMA when the user set none: Alibaba's published preset for
/// NCCL on eRDMA (PAI "eRDMA" guide: `NCCL_IB_QPS_PER_CONNECTION=8`).
pub const ERDMA_DEFAULT_QPS: u32 = 8;

/// One network device as NCCL sees it.
#[derive(Debug)]
pub struct Device {
    name: CString,
    pci_path: Option<CString>,
    /// `guid`: devices with the same guid are one NIC.
    pub guid: u64,
    /// `ptrSupport` bits.
    pub ptr_support: i32,
    /// `speed` in Mbps.
    pub speed_mbps: i32,
    /// `port`.
    pub port: i32,
    /// `maxComms`.
    pub max_comms: i32,
    /// `maxRecvs`.
    pub max_recvs: i32,
    /// `forceFlush` (v9+).
    pub force_flush: bool,
}

impl Device {
    /// Unique device name.
    pub fn name(&self) -> &str {
        self.name.to_str().unwrap_or("?")
    }
    /// `name` for C; valid for the life of the process (the plugin is never torn down).
    pub fn name_ptr(&self) -> *const c_char {
        self.name.as_ptr()
    }
    /// `pciPath` for C, or NULL when the device has none.
    pub fn pci_path_ptr(&self) -> *const c_char {
        self.pci_path
            .as_ref()
            .map_or(std::ptr::null(), |p| p.as_ptr())
    }
}

/// What carries the data, with its per-device state.
enum Backend {
    Tcp,
    Verbs {
        devices: Vec<Arc<VerbsDevice>>,
        caches: Vec<Arc<MrCache>>,
    },
}

/// A connect in progress.
// Each lives inside a boxed comm made once per connection: size differences cost nothing.
#[allow(clippy::large_enum_variant)]
enum Connecting {
    Tcp(TcpConnecting),
    Verbs(VerbsConnecting),
}

/// The initialised plugin: configuration, devices and registrations.
pub struct Plugin {
    /// Settings read at `init` (with the eRDMA profile applied).
    pub config: Config,
    /// Transport carrying the data.
    pub transport: TransportKind,
    /// Where bootstrap listeners bind.
    pub bootstrap_ip: IpAddr,
    devices: Vec<Device>,
    backend: Backend,
    /// Live memory registrations.
    pub mrs: MrTable,
    totals: Vec<stats::DeviceTotals>,
    next_comm: AtomicU64,
    connecting: Mutex<Stages<Connecting>>,
}

static PLUGIN: Mutex<Option<Arc<Plugin>>> = Mutex::new(None);

/// Initialises the plugin once per process; later calls return the same instance. A failed
/// `init` leaves nothing behind, so it can be retried with a corrected environment.
pub fn init() -> Result<Arc<Plugin>> {
    let mut global = PLUGIN.lock();
    if let Some(p) = global.as_ref() {
        return Ok(Arc::clone(p));
    }
    let plugin = Arc::new(Plugin::from_config(Config::from_env()?)?);
    *global = Some(Arc::clone(&plugin));
    Ok(plugin)
}

/// The initialised plugin, or an error when `init` has not succeeded.
pub fn get() -> Result<Arc<Plugin>> {
    PLUGIN
        .lock()
        .as_ref()
        .map(Arc::clone)
        .ok_or_else(|| Error::Misuse("the plugin is used before a successful init".into()))
}

fn sysfs_string(path: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}

/// Finds the verbs devices, or says why there are none.
pub fn discover_verbs(config: &Config) -> Result<Vec<VerbsDevice>> {
    let lib = VerbsLib::get(config.ibverbs_lib.value.as_deref())?;
    vdev::discover(lib, config)
}

impl Plugin {
    /// Builds the plugin from a validated configuration.
    pub fn from_config(mut config: Config) -> Result<Self> {
        let bootstrap = iface::pick(
            config.socket_ifname.value.as_ref(),
            config.socket_family.value,
        )?;
        let verbs = match config.transport.value {
            TransportChoice::Tcp => None,
            TransportChoice::Verbs => Some(discover_verbs(&config).map_err(|e| {
                Error::NoDevice(format!(
                    "verbs transport unavailable: {e}. NCCL falls back to its own \
                     transports; set NCCL_ERDMA_TRANSPORT=tcp (or auto) to use this plugin \
                     over TCP"
                ))
            })?),
            TransportChoice::Auto => match discover_verbs(&config) {
                Ok(d) => Some(d),
                Err(e) => {
                    tracing::info!(target: INIT, "verbs transport unavailable ({e}); using tcp");
                    None
                }
            },
        };
        if let Some(devs) = &verbs {
            if devs.iter().any(VerbsDevice::is_erdma) && !config.qps_per_connection.from_env {
                config.qps_per_connection = Setting {
                    value: ERDMA_DEFAULT_QPS,
                    from_env: false,
                };
                tracing::info!(
                    target: INIT,
                    "eRDMA device found: NCCL_IB_QPS_PER_CONNECTION defaults to \
                     {ERDMA_DEFAULT_QPS} (Alibaba Cloud's eRDMA preset)"
                );
            }
        }
        for line in config.describe() {
            tracing::info!(target: INIT, "{line}");
        }
        tracing::info!(
            target: INIT,
            "bootstrap interface {} address {}",
            bootstrap.ifname,
            bootstrap.ip
        );
        let (transport, devices, backend) = match verbs {
            None => (
                TransportKind::Tcp,
                vec![tcp_device(&bootstrap.ifname, &config)],
                Backend::Tcp,
            ),
            Some(devs) => {
                let lib = VerbsLib::get(config.ibverbs_lib.value.as_deref())?;
                // Before the first registration, or it fails (rdma-core makes it a no-op on
                // kernels with copy-on-fork for pinned memory).
                if let Err(e) = lib.fork_init() {
                    tracing::info!(target: INIT, "ibv_fork_init: {e}");
                }
                let devices = devs.iter().map(|d| verbs_device(d, &config)).collect();
                let devs: Vec<Arc<VerbsDevice>> = devs.into_iter().map(Arc::new).collect();
                let caches = devs
                    .iter()
                    .map(|d| MrCache::new(Arc::clone(&d.pd)))
                    .collect();
                (
                    TransportKind::Verbs,
                    devices,
                    Backend::Verbs {
                        devices: devs,
                        caches,
                    },
                )
            }
        };
        for (i, d) in devices.iter().enumerate() {
            tracing::info!(
                target: INIT,
                "device {i}: {} transport {} speed {} Mbps ptrSupport {:#x} pci {:?}",
                d.name(),
                transport.name(),
                d.speed_mbps,
                d.ptr_support,
                d.pci_path
            );
        }
        if let Backend::Verbs { devices: devs, .. } = &backend {
            for d in devs {
                tracing::info!(
                    target: INIT,
                    "{}: port {} {} GID index {} MTU {} vendor {:#x} peermem {} dmabuf {}",
                    d.name,
                    d.port,
                    if d.link_layer == vdev::LINK_LAYER_ETHERNET { "RoCE" } else { "IB" },
                    d.gid_index,
                    128u32 << d.active_mtu.min(5),
                    d.vendor_id,
                    d.peermem,
                    d.dmabuf
                );
            }
        }
        Ok(Plugin {
            config,
            transport,
            bootstrap_ip: bootstrap.ip,
            totals: devices
                .iter()
                .map(|_| stats::DeviceTotals::default())
                .collect(),
            devices,
            backend,
            mrs: MrTable::default(),
            next_comm: AtomicU64::new(1),
            connecting: Mutex::new(Stages::default()),
        })
    }

    /// Number of devices.
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// Device `dev`, checked.
    pub fn device(&self, dev: i32) -> Result<&Device> {
        usize::try_from(dev)
            .ok()
            .and_then(|d| self.devices.get(d))
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "device {dev} does not exist ({} devices)",
                    self.devices.len()
                ))
            })
    }

    /// Traffic totals of device `dev`.
    pub fn totals(&self, dev: usize) -> &stats::DeviceTotals {
        &self.totals[dev.min(self.totals.len() - 1)]
    }

    /// Counters for a new comm on `dev` talking to `peer`.
    fn comm_stats(&self, dir: stats::Direction, dev: usize, peer: &str) -> stats::CommStats {
        let id = self.next_comm.fetch_add(1, Ordering::Relaxed);
        let name = self.devices.get(dev).map_or("?", Device::name);
        stats::CommStats::new(
            dir,
            format!("#{id} on {name} with {peer}"),
            self.config.stats_interval_s.value,
        )
    }

    /// Registration cache statistics per device: (hits, misses, live MRs).
    pub fn mr_cache_stats(&self) -> Vec<(u64, u64, usize)> {
        match &self.backend {
            Backend::Tcp => Vec::new(),
            Backend::Verbs { caches, .. } => caches
                .iter()
                .map(|c| {
                    (
                        c.hits.load(Ordering::Relaxed),
                        c.misses.load(Ordering::Relaxed),
                        c.len(),
                    )
                })
                .collect(),
        }
    }

    fn timeouts(&self) -> Timeouts {
        let peer = self.config.peer_timeout_s.value;
        Timeouts {
            connect: Duration::from_millis(self.config.connect_timeout_ms.value),
            peer: (peer > 0).then(|| Duration::from_secs(peer)),
        }
    }

    fn verbs_params(&self, dev: &VerbsDevice, traffic_class: Option<i32>) -> VerbsParams {
        let c = &self.config;
        let tc = if c.ib_tc.value >= 0 {
            c.ib_tc.value
        } else {
            traffic_class.filter(|t| *t >= 0).unwrap_or(0)
        };
        let sl = if c.ib_sl.value >= 0 { c.ib_sl.value } else { 0 };
        VerbsParams {
            qps_per_connection: c.qps_per_connection.value,
            split_data: c.split_data_on_qps.value,
            timeout: c.ib_timeout.value as u8,
            retry_cnt: c.ib_retry_cnt.value as u8,
            traffic_class: tc.clamp(0, 255) as u8,
            sl: sl.clamp(0, 15) as u8,
            pkey_index: c.ib_pkey.value as u16,
            flush: c.force_flush.value || dev.peermem || dev.dmabuf,
            timeouts: self.timeouts(),
            cts_batch: verbs::cts_batch(c.cts_batch.value, dev),
        }
    }

    fn verbs_device(&self, dev: usize) -> Result<(&Arc<VerbsDevice>, &Arc<MrCache>)> {
        match &self.backend {
            Backend::Verbs { devices, caches } => devices
                .get(dev)
                .zip(caches.get(dev))
                .ok_or_else(|| Error::InvalidArgument(format!("device {dev} does not exist"))),
            Backend::Tcp => Err(Error::Misuse("not a verbs device".into())),
        }
    }

    /// `listen`: binds a bootstrap listener and writes the handle for the peer.
    pub fn listen(&self, dev: i32, out: &mut [u8; HANDLE_SIZE]) -> Result<Box<ListenComm>> {
        self.device(dev)?;
        let listen = match &self.backend {
            Backend::Tcp => comm::Listen::Tcp(TcpListen::bind(self.bootstrap_ip, self.timeouts())?),
            Backend::Verbs { .. } => {
                let (d, _) = self.verbs_device(dev as usize)?;
                let params = self.verbs_params(d, None);
                comm::Listen::Verbs(VerbsListen::bind(self.bootstrap_ip, d, params)?)
            }
        };
        listen.handle().encode(out);
        Ok(ListenComm::new(listen, dev as usize))
    }

    /// `connect`: one non-blocking step; `Ok(None)` until the connection is up. The stage is
    /// kept in a registry keyed by an id stored in the handle NCCL passes back each time.
    /// `traffic_class` is the communicator's (v10+), used when `NCCL_IB_TC` is unset.
    pub fn connect(
        self: &Arc<Self>,
        dev: i32,
        buf: &mut [u8; HANDLE_SIZE],
        traffic_class: Option<i32>,
    ) -> Result<Option<Box<SendComm>>> {
        self.device(dev)?;
        let handle = Handle::decode(buf)?;
        if handle.transport != self.transport {
            return Err(Error::Usage(format!(
                "the peer listens with transport {}, this process uses {}: set the same \
                 NCCL_ERDMA_TRANSPORT on every node",
                handle.transport.name(),
                self.transport.name()
            )));
        }
        let mut connecting = self.connecting.lock();
        let id = match handle::stage_id(buf)? {
            Some(id) => id,
            None => {
                let stage = match &self.backend {
                    Backend::Tcp => {
                        Connecting::Tcp(TcpConnecting::start(&handle, self.timeouts())?)
                    }
                    Backend::Verbs { .. } => {
                        let (d, _) = self.verbs_device(dev as usize)?;
                        let params = self.verbs_params(d, traffic_class);
                        Connecting::Verbs(VerbsConnecting::start(d, &handle, params)?)
                    }
                };
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
            Error::Misuse(format!(
                "connect called again with a handle whose connection {id} already finished, \
                 failed, or went unpolled for {} s",
                stages::ABANDONED_AFTER.as_secs()
            ))
        })?;
        let step = match stage {
            Connecting::Tcp(t) => t.poll().map(|done| done.map(|()| None)),
            Connecting::Verbs(v) => v.poll().map(|done| done.map(Some)),
        };
        let comm = match step {
            Ok(None) => return Ok(None),
            Ok(Some(verbs)) => {
                let stage = connecting.remove(id).expect("present above");
                match (stage, verbs) {
                    (Connecting::Tcp(t), _) => comm::Send::Tcp(t.finish()?),
                    (Connecting::Verbs(_), Some(v)) => comm::Send::Verbs(v),
                    (Connecting::Verbs(_), None) => unreachable!("verbs stages finish with a comm"),
                }
            }
            Err(e) => {
                connecting.remove(id);
                return Err(e);
            }
        };
        Ok(Some(SendComm::new(Arc::clone(self), comm, dev as usize)))
    }

    /// `accept`: one non-blocking step; `Ok(None)` until the peer has connected.
    pub fn accept(self: &Arc<Self>, listen: &mut ListenComm) -> Result<Option<Box<RecvComm>>> {
        let dev = listen.dev;
        let comm = match &mut listen.inner {
            comm::Listen::Tcp(t) => t.poll_accept()?.map(comm::Recv::Tcp),
            comm::Listen::Verbs(v) => v.poll_accept()?.map(comm::Recv::Verbs),
        };
        Ok(comm.map(|c| RecvComm::new(Arc::clone(self), c, dev)))
    }

    /// `regMr` on device `dev`.
    pub fn reg_mr(&self, dev: usize, addr: usize, len: usize, ptr_type: i32) -> Result<u64> {
        if addr == 0 && len > 0 {
            return Err(Error::InvalidArgument(
                "regMr of a NULL address".to_string(),
            ));
        }
        let supported = self.devices.get(dev).map_or(0, |d| d.ptr_support);
        if ptr_type != PTR_HOST && (ptr_type != PTR_CUDA || supported & PTR_CUDA == 0) {
            return Err(Error::InvalidArgument(format!(
                "memory type {ptr_type} is not supported by the {} transport on this host \
                 (ptrSupport {supported:#x})",
                self.transport.name()
            )));
        }
        let mut reg = Registration {
            addr,
            len,
            ptr_type,
            dev,
            lkey: 0,
            rkey: 0,
        };
        let hold: Option<mr::Hold> = match &self.backend {
            Backend::Tcp => None,
            Backend::Verbs { .. } => {
                let (_, cache) = self.verbs_device(dev)?;
                let (held, hit) = cache.register(addr, len)?;
                tracing::debug!(
                    "regMr {addr:#x}+{len} on device {dev}: cache {} (hits {}, misses {}, MRs {})",
                    if hit { "hit" } else { "miss" },
                    cache.hits.load(Ordering::Relaxed),
                    cache.misses.load(Ordering::Relaxed),
                    cache.len()
                );
                reg.lkey = held.lkey();
                reg.rkey = held.rkey();
                Some(Box::new(held))
            }
        };
        self.mrs.insert(reg, hold)
    }

    /// `regMrDmaBuf` on device `dev` (verbs devices that support DMA-BUF).
    pub fn reg_mr_dmabuf(
        &self,
        dev: usize,
        addr: usize,
        len: usize,
        ptr_type: i32,
        offset: u64,
        fd: i32,
    ) -> Result<u64> {
        if self.devices.get(dev).map_or(0, |d| d.ptr_support) & PTR_DMABUF == 0 {
            return Err(Error::Usage(format!(
                "DMA-BUF registration is not supported here (transport {}); NCCL should not \
                 have asked",
                self.transport.name()
            )));
        }
        let (d, _) = self.verbs_device(dev)?;
        let mr =
            d.pd.reg_dmabuf_mr(offset, len, addr as u64, fd, crate::verbs::dma::ACCESS_RDMA)?;
        let reg = Registration {
            addr,
            len,
            ptr_type,
            dev,
            lkey: mr.lkey(),
            rkey: mr.rkey(),
        };
        self.mrs.insert(reg, Some(Box::new(mr)))
    }

    /// `deregMr`; a NULL handle (0) is accepted, as NCCL may pass one.
    pub fn dereg_mr(&self, handle: u64) -> Result<()> {
        if handle == 0 {
            return Ok(());
        }
        self.mrs.remove(handle).map(|_| ())
    }

    /// The registration behind `mhandle`, checked to cover `addr..addr+len` on `dev`. The
    /// data path calls it on every `isend`/`irecv`: inlined, with its errors out of line.
    #[inline(always)]
    pub fn registration(
        &self,
        mhandle: u64,
        dev: usize,
        addr: usize,
        len: usize,
    ) -> Result<Registration> {
        let reg = self.mrs.get(mhandle)?;
        if !reg.covers(addr, len) {
            return Err(outside_registration(addr, len, &reg));
        }
        if reg.dev != dev && self.transport == TransportKind::Verbs {
            return Err(wrong_device(&reg, dev));
        }
        Ok(reg)
    }
}

#[cold]
fn outside_registration(addr: usize, len: usize, reg: &Registration) -> Error {
    Error::InvalidArgument(format!(
        "buffer {addr:#x}+{len} lies outside its registration {:#x}+{}",
        reg.addr, reg.len
    ))
}

#[cold]
fn wrong_device(reg: &Registration, dev: usize) -> Error {
    Error::InvalidArgument(format!(
        "buffer registered on device {} used on device {dev}",
        reg.dev
    ))
}

fn verbs_device(d: &VerbsDevice, config: &Config) -> Device {
    let mut ptr_support = PTR_HOST;
    if d.peermem {
        ptr_support |= PTR_CUDA;
    }
    if d.dmabuf {
        ptr_support |= PTR_DMABUF;
    }
    Device {
        name: CString::new(d.name.clone()).unwrap_or_default(),
        pci_path: d
            .pci_path
            .as_ref()
            .and_then(|p| CString::new(p.clone()).ok()),
        guid: d.guid,
        ptr_support,
        speed_mbps: d.speed_mbps,
        port: i32::from(d.port),
        max_comms: d.max_qp.max(1),
        max_recvs: MAX_RECVS as i32,
        force_flush: config.force_flush.value,
    }
}

fn tcp_device(ifname: &str, config: &Config) -> Device {
    let sys = format!("/sys/class/net/{ifname}");
    let speed = config
        .speed_mbps
        .value
        .map(|s| s as i32)
        .or_else(|| {
            sysfs_string(&format!("{sys}/speed"))
                .and_then(|s| s.parse::<i32>().ok())
                .filter(|s| *s > 0)
        })
        .unwrap_or(10_000);
    let pci_path = std::fs::canonicalize(format!("{sys}/device"))
        .ok()
        .and_then(|p| CString::new(p.to_string_lossy().into_owned()).ok());
    Device {
        name: CString::new(format!("erdma-tcp-{ifname}")).unwrap_or_default(),
        pci_path,
        guid: 0,
        ptr_support: PTR_HOST,
        speed_mbps: speed,
        port: 1,
        max_comms: 65536,
        max_recvs: MAX_RECVS as i32,
        force_flush: false,
    }
}
