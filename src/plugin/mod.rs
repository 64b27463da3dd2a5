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

pub mod mr;

use std::{
    collections::HashMap,
    ffi::{c_char, CString},
    net::IpAddr,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use parking_lot::Mutex;

use crate::abi::buffer::UserBuffer;
use crate::config::{Config, TransportChoice};
use crate::error::{Error, Result};
use crate::log::INIT;
use crate::oob::{handle, iface, Handle, TransportKind, HANDLE_SIZE};
use crate::transport::tcp::{TcpConnecting, TcpListen, TcpRecvComm, TcpSendComm};
use crate::transport::{Completion, MAX_RECVS, MAX_REQUESTS, MAX_SEND_REQUESTS};
use crate::verbs::VerbsLib;

pub use mr::{MrTable, Registration};

/// The plugin's name in every table (`NCCL_NET=erdma` selects it).
pub const NAME: &str = "erdma";
/// `NCCL_PTR_HOST`.
pub const PTR_HOST: i32 = 1;
/// `NCCL_PTR_CUDA`.
pub const PTR_CUDA: i32 = 2;
/// Largest message per request we advertise (`maxP2pBytes`): what `test` can report in an
/// `int`, rounded to 1 GiB as NCCL's shims do for older plugins.
pub const MAX_P2P_BYTES: usize = 1 << 30;
/// `maxCollBytes`: NCCL's CollNet default.
pub const MAX_COLL_BYTES: usize = 512 << 20;

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
}

impl Device {
    /// Unique device name; the string lives as long as the plugin.
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

/// The initialised plugin: configuration, devices and registrations.
pub struct Plugin {
    /// Settings read at `init`.
    pub config: Config,
    /// Transport carrying the data.
    pub transport: TransportKind,
    /// Where bootstrap listeners bind.
    pub bootstrap_ip: IpAddr,
    devices: Vec<Device>,
    /// Live memory registrations.
    pub mrs: MrTable,
    connecting: Mutex<HashMap<u64, TcpConnecting>>,
    next_stage: AtomicU64,
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

impl Plugin {
    /// Builds the plugin from a validated configuration.
    pub fn from_config(config: Config) -> Result<Self> {
        for line in config.describe() {
            tracing::info!(target: INIT, "{line}");
        }
        let bootstrap = iface::pick(
            config.socket_ifname.value.as_ref(),
            config.socket_family.value,
        )?;
        tracing::info!(
            target: INIT,
            "bootstrap interface {} address {}",
            bootstrap.ifname,
            bootstrap.ip
        );
        let transport = match config.transport.value {
            TransportChoice::Tcp => TransportKind::Tcp,
            TransportChoice::Verbs => {
                let why = verbs_unavailable(&config);
                return Err(Error::NoDevice(format!(
                    "verbs transport unavailable: {why}. NCCL falls back to its own \
                     transports; set NCCL_ERDMA_TRANSPORT=tcp (or auto) to use this plugin \
                     over TCP"
                )));
            }
            TransportChoice::Auto => {
                let why = verbs_unavailable(&config);
                tracing::info!(target: INIT, "verbs transport unavailable ({why}); using tcp");
                TransportKind::Tcp
            }
        };
        let devices = vec![tcp_device(&bootstrap.ifname, &config)];
        for (i, d) in devices.iter().enumerate() {
            tracing::info!(
                target: INIT,
                "device {i}: {} transport {} speed {} Mbps pci {:?}",
                d.name(),
                transport.name(),
                d.speed_mbps,
                d.pci_path
            );
        }
        Ok(Plugin {
            config,
            transport,
            bootstrap_ip: bootstrap.ip,
            devices,
            mrs: MrTable::default(),
            connecting: Mutex::new(HashMap::new()),
            next_stage: AtomicU64::new(1),
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

    fn timeout(&self) -> Duration {
        Duration::from_millis(self.config.connect_timeout_ms.value)
    }

    /// `listen`: binds a bootstrap listener and writes the handle for the peer.
    pub fn listen(&self, dev: i32, out: &mut [u8; HANDLE_SIZE]) -> Result<Box<ListenComm>> {
        self.device(dev)?;
        let listen = TcpListen::bind(self.bootstrap_ip, self.timeout())?;
        listen.handle().encode(out);
        Ok(Box::new(ListenComm {
            magic: LISTEN_MAGIC,
            inner: listen,
        }))
    }

    /// `connect`: one non-blocking step; `Ok(None)` until the connection is up. The stage is
    /// kept in a registry keyed by an id stored in the handle NCCL passes back each time.
    pub fn connect(
        self: &Arc<Self>,
        dev: i32,
        buf: &mut [u8; HANDLE_SIZE],
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
                let id = self.next_stage.fetch_add(1, Ordering::Relaxed);
                connecting.insert(id, TcpConnecting::start(&handle, self.timeout())?);
                handle::set_stage_id(buf, id);
                id
            }
        };
        let stage = connecting.get_mut(&id).ok_or_else(|| {
            Error::Misuse(format!(
                "connect called again with a handle whose connection {id} already finished \
                 or failed"
            ))
        })?;
        match stage.poll() {
            Ok(None) => Ok(None),
            Ok(Some(())) => {
                let stage = connecting.remove(&id).expect("present above");
                Ok(Some(SendComm::new(Arc::clone(self), stage.finish()?)))
            }
            Err(e) => {
                connecting.remove(&id);
                Err(e)
            }
        }
    }

    /// `accept`: one non-blocking step; `Ok(None)` until the peer has connected.
    pub fn accept(self: &Arc<Self>, listen: &mut ListenComm) -> Result<Option<Box<RecvComm>>> {
        Ok(listen
            .inner
            .poll_accept()?
            .map(|comm| RecvComm::new(Arc::clone(self), comm)))
    }

    /// `regMr`: records a host registration (the tcp transport needs no pinning).
    pub fn reg_mr(&self, addr: usize, len: usize, ptr_type: i32) -> Result<u64> {
        if ptr_type != PTR_HOST {
            return Err(Error::InvalidArgument(format!(
                "memory type {ptr_type} is not supported by the {} transport (host memory \
                 only)",
                self.transport.name()
            )));
        }
        if addr == 0 && len > 0 {
            return Err(Error::InvalidArgument(
                "regMr of a NULL address".to_string(),
            ));
        }
        Ok(self.mrs.insert(Registration {
            addr,
            len,
            ptr_type,
        }))
    }

    /// `regMrDmaBuf`: needs the verbs transport.
    pub fn reg_mr_dmabuf(&self) -> Result<u64> {
        Err(Error::Usage(format!(
            "DMA-BUF registration needs the verbs transport; this process uses {}",
            self.transport.name()
        )))
    }

    /// `deregMr`; a NULL handle (0) is accepted, as NCCL may pass one.
    pub fn dereg_mr(&self, handle: u64) -> Result<()> {
        if handle == 0 {
            return Ok(());
        }
        self.mrs.remove(handle).map(|_| ())
    }

    fn check_buffer(&self, mhandle: u64, buf: &UserBuffer) -> Result<()> {
        let reg = self.mrs.get(mhandle)?;
        if !reg.covers(buf.addr(), buf.len()) {
            return Err(Error::InvalidArgument(format!(
                "buffer {:#x}+{} lies outside its registration {:#x}+{}",
                buf.addr(),
                buf.len(),
                reg.addr,
                reg.len
            )));
        }
        Ok(())
    }
}

fn verbs_unavailable(config: &Config) -> String {
    match VerbsLib::open(config.ibverbs_lib.value.as_deref()).and_then(|l| l.device_names()) {
        Err(e) => e.to_string(),
        Ok(names) if names.is_empty() => "no RDMA devices found".into(),
        Ok(names) => format!(
            "found RDMA device(s) {} but this build's verbs transport is not implemented yet",
            names.join(", ")
        ),
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
    }
}

// ---------------------------------------------------------------------------------------
// Comms and requests. Each starts with a magic number so the boundary can tell a send comm
// from a receive comm (regMr gets either) and reject a pointer of the wrong kind.

/// Magic of a [`ListenComm`].
pub const LISTEN_MAGIC: u64 = 0x4c49_5354_454e_4552;
/// Magic of a [`SendComm`].
pub const SEND_MAGIC: u64 = 0x5345_4e44_434f_4d4d;
/// Magic of a [`RecvComm`].
pub const RECV_MAGIC: u64 = 0x5245_4356_434f_4d4d;
/// Magic of a [`RequestToken`].
pub const REQUEST_MAGIC: u64 = 0x5245_5155_4553_5421;

/// The listening side of one future connection.
#[repr(C)]
pub struct ListenComm {
    magic: u64,
    inner: TcpListen,
}

impl ListenComm {
    /// Errors unless this is a live listen comm.
    pub fn check(&self) -> Result<()> {
        check_magic(self.magic, LISTEN_MAGIC, "listen")
    }
}

fn check_magic(have: u64, want: u64, what: &str) -> Result<()> {
    if have == want {
        Ok(())
    } else {
        Err(Error::Misuse(format!(
            "the pointer passed as a {what} comm is not one"
        )))
    }
}

/// Which comm a request belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestOwner {
    /// A [`SendComm`] at this address.
    Send(usize),
    /// A [`RecvComm`] at this address.
    Recv(usize),
}

/// What NCCL holds as a request: a slot of its comm's fixed request table.
#[repr(C)]
#[derive(Debug)]
pub struct RequestToken {
    magic: u64,
    /// The comm that owns the request.
    pub owner: RequestOwner,
    /// Slot in the comm's table.
    pub slot: usize,
}

impl RequestToken {
    /// Errors unless this is a request token.
    pub fn check(&self) -> Result<()> {
        check_magic(self.magic, REQUEST_MAGIC, "request")
            .map_err(|_| Error::Misuse("the pointer passed as a request is not one".into()))
    }
}

fn tokens(owner: impl Fn() -> RequestOwner, n: usize) -> Box<[RequestToken]> {
    (0..n)
        .map(|slot| RequestToken {
            magic: REQUEST_MAGIC,
            owner: owner(),
            slot,
        })
        .collect()
}

/// A connected send comm.
#[repr(C)]
pub struct SendComm {
    magic: u64,
    plugin: Arc<Plugin>,
    inner: TcpSendComm,
    tokens: Box<[RequestToken]>,
}

impl SendComm {
    fn new(plugin: Arc<Plugin>, inner: TcpSendComm) -> Box<Self> {
        let mut comm = Box::new(SendComm {
            magic: SEND_MAGIC,
            plugin,
            inner,
            tokens: Box::new([]),
        });
        let addr = &*comm as *const SendComm as usize;
        comm.tokens = tokens(|| RequestOwner::Send(addr), MAX_SEND_REQUESTS);
        comm
    }

    /// Errors unless this is a live send comm.
    pub fn check(&self) -> Result<()> {
        check_magic(self.magic, SEND_MAGIC, "send")
    }

    /// The plugin this comm belongs to.
    pub fn plugin(&self) -> &Arc<Plugin> {
        &self.plugin
    }

    /// `isend`: `Ok(None)` when it cannot be posted yet.
    pub fn isend(&self, buf: UserBuffer, tag: i32, mhandle: u64) -> Result<Option<&RequestToken>> {
        if buf.len() > MAX_P2P_BYTES {
            return Err(Error::InvalidArgument(format!(
                "send of {} bytes exceeds maxP2pBytes ({MAX_P2P_BYTES})",
                buf.len()
            )));
        }
        self.plugin.check_buffer(mhandle, &buf)?;
        Ok(self.inner.isend(buf, tag)?.map(|slot| &self.tokens[slot]))
    }

    /// `test` of one of this comm's requests.
    pub fn test(&self, slot: usize) -> Result<Option<Completion>> {
        self.inner.test(slot)
    }

    /// Marks the comm dead before it is dropped, so a stale pointer fails the magic check.
    pub fn retire(&mut self) {
        self.magic = 0;
    }
}

/// A connected receive comm.
#[repr(C)]
pub struct RecvComm {
    magic: u64,
    plugin: Arc<Plugin>,
    inner: TcpRecvComm,
    tokens: Box<[RequestToken]>,
}

impl RecvComm {
    fn new(plugin: Arc<Plugin>, inner: TcpRecvComm) -> Box<Self> {
        let mut comm = Box::new(RecvComm {
            magic: RECV_MAGIC,
            plugin,
            inner,
            tokens: Box::new([]),
        });
        let addr = &*comm as *const RecvComm as usize;
        comm.tokens = tokens(|| RequestOwner::Recv(addr), MAX_REQUESTS);
        comm
    }

    /// Errors unless this is a live receive comm.
    pub fn check(&self) -> Result<()> {
        check_magic(self.magic, RECV_MAGIC, "receive")
    }

    /// The plugin this comm belongs to.
    pub fn plugin(&self) -> &Arc<Plugin> {
        &self.plugin
    }

    /// `irecv` of `bufs.len()` (1..=8) buffers: `Ok(None)` when 32 receives are in flight.
    pub fn irecv(
        &self,
        bufs: &[UserBuffer],
        tags: &[i32],
        mhandles: &[u64],
    ) -> Result<Option<&RequestToken>> {
        if bufs.is_empty() || bufs.len() > MAX_RECVS {
            return Err(Error::InvalidArgument(format!(
                "irecv of {} buffers; 1 to {MAX_RECVS} are allowed",
                bufs.len()
            )));
        }
        for (buf, mh) in bufs.iter().zip(mhandles) {
            self.plugin.check_buffer(*mh, buf)?;
        }
        Ok(self.inner.irecv(bufs, tags)?.map(|slot| &self.tokens[slot]))
    }

    /// `iflush`: nothing to flush for host memory, so never a request.
    pub fn iflush(&self, n: usize) -> Result<Option<&RequestToken>> {
        if n == 0 || n > MAX_RECVS {
            return Err(Error::InvalidArgument(format!(
                "iflush of {n} buffers; 1 to {MAX_RECVS} are allowed"
            )));
        }
        Ok(None)
    }

    /// `test` of one of this comm's requests.
    pub fn test(&self, slot: usize) -> Result<Option<Completion>> {
        self.inner.test(slot)
    }

    /// Marks the comm dead before it is dropped, so a stale pointer fails the magic check.
    pub fn retire(&mut self) {
        self.magic = 0;
    }
}

impl ListenComm {
    /// Marks the comm dead before it is dropped.
    pub fn retire(&mut self) {
        self.magic = 0;
    }
}
