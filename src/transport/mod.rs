//! The transport contract: what the version-neutral core (`plugin`) needs from whatever
//! carries the data, as traits. [`Transport`] is the per-process backend (its devices, memory
//! registration, listen and connect); a connection goes [`Connecting`] or [`Listening`] ->
//! [`SendEndpoint`] / [`RecvEndpoint`]. `tcp` (sockets) and `verbs` (eRDMA, RoCE, IB)
//! implement it; [`open`] picks one, and `plugin` never names either.
//!
//! The request contract both honour, as NCCL expects it: `isend`/`irecv` return `Ok(None)`
//! (a NULL request) when they cannot post yet, never block and never allocate; a request id
//! is small and dense (an index into the comm's fixed token table); `test` reports each
//! request done exactly once; a comm that failed stays failed (its later calls return the
//! error); closing never waits for the peer.

pub(crate) mod tcp;
pub(crate) mod verbs;

use std::{any::Any, ffi::CString, net::IpAddr, sync::Arc};

use crate::buffer::UserBuffer;
use crate::config::{Config, TransportChoice};
use crate::error::{Error, Result};
use crate::log::INIT;
use crate::oob::{iface::LocalAddr, Handle, TransportKind};

/// Largest `n` of a grouped receive (`maxRecvs`).
pub(crate) const MAX_RECVS: usize = 8;
/// Requests in flight per comm NCCL may rely on (`NCCL_NET_MAX_REQUESTS`).
pub(crate) const MAX_REQUESTS: usize = 32;
/// Sends in flight per send comm: one per entry of every in-flight grouped receive.
pub(crate) const MAX_SEND_REQUESTS: usize = MAX_REQUESTS * MAX_RECVS;
/// Largest message per request we advertise (`maxP2pBytes`): what `test` can report in an
/// `int`, rounded to 1 GiB as NCCL's shims do for older plugins.
pub(crate) const MAX_P2P_BYTES: usize = 1 << 30;

/// `NCCL_PTR_HOST`.
pub(crate) const PTR_HOST: i32 = 1;
/// `NCCL_PTR_CUDA`.
pub(crate) const PTR_CUDA: i32 = 2;
/// `NCCL_PTR_DMABUF`.
pub(crate) const PTR_DMABUF: i32 = 4;

/// One network device as NCCL sees it (`getProperties`).
#[derive(Debug)]
pub(crate) struct DeviceProps {
    pub(crate) name: CString,
    pub(crate) pci_path: Option<CString>,
    /// Devices with the same guid are one NIC.
    pub(crate) guid: u64,
    /// `NCCL_PTR_*` bits.
    pub(crate) ptr_support: i32,
    pub(crate) speed_mbps: i32,
    pub(crate) port: i32,
    pub(crate) max_comms: i32,
    pub(crate) force_flush: bool,
    /// `vProps`: the physical devices (NCCL's indexes) a virtual device fuses; itself for a
    /// physical one.
    pub(crate) vdevs: Vec<i32>,
    /// v12 `railId`: the device's position among the NICs of its kind, -1 where unknown (a
    /// virtual device spans several).
    pub(crate) rail_id: i16,
}

impl DeviceProps {
    /// The name, for messages.
    pub(crate) fn name(&self) -> &str {
        self.name.to_str().unwrap_or("?")
    }
}

/// Most NICs (rails) one device of the plugin spans: a virtual device of NCCL's v12 ABI.
pub(crate) const MAX_RAILS: usize = 8;

/// A registration as the data path uses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct MemKeys {
    /// Local key on each rail (NIC) of the device it was registered on (verbs; none for
    /// tcp).
    pub(crate) lkeys: [u32; MAX_RAILS],
    /// Remote key on each rail: as a clear-to-send entry carries them, copied whole.
    pub(crate) rkeys: [u32; MAX_RAILS],
    /// Rails with keys.
    pub(crate) rails: u8,
    /// Host memory (the CPU may read it), as opposed to GPU memory.
    pub(crate) host: bool,
}

impl MemKeys {
    /// Local key on rail `r`.
    #[inline(always)]
    pub(crate) fn lkey(&self, r: usize) -> u32 {
        self.lkeys[r]
    }

    /// Remote key on rail `r`.
    #[inline(always)]
    pub(crate) fn rkey(&self, r: usize) -> u32 {
        self.rkeys[r]
    }

    /// Sets rail `r`'s keys.
    pub(crate) fn set(&mut self, r: usize, (lkey, rkey): (u32, u32)) {
        self.lkeys[r] = lkey;
        self.rkeys[r] = rkey;
    }
}

/// Where a call finds the keys of its buffer `i`: looked up only when the transport needs
/// them, once per buffer. NCCL retries `isend` until the receiver's clear-to-send has come,
/// and a retry that finds none should cost no lookup; `irecv` looks up only the buffers it
/// has. (The plugin passes a lookup of NCCL's handles; tests pass the keys themselves.)
pub(crate) trait BufferKeys {
    /// The keys of buffer `i`, `buf`, or the error of a handle that does not cover it,
    /// through `cache`: the comm's last lookup, which the transport keeps under the comm's
    /// lock (a repeated handle is then two compares, and the keys are read in place).
    fn keys<'c>(&self, i: usize, buf: UserBuffer, cache: &'c mut KeyCache) -> Result<&'c MemKeys>;
}

/// The last registration handle one comm looked up, and what it found. Filled by the
/// plugin's registration table, which alone knows when a handle stops standing (see
/// `MrTable::keys`); the transport only keeps it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KeyCache {
    /// The handle looked up (0, which no registration has: none).
    pub(crate) handle: u64,
    /// The table's release count when the handle was read (`u64::MAX`: nothing cached).
    pub(crate) releases: u64,
    /// (start, end, device) of the registration.
    pub(crate) reg: (usize, usize, usize),
    pub(crate) keys: MemKeys,
}

impl Default for KeyCache {
    fn default() -> Self {
        KeyCache {
            handle: 0,
            releases: u64::MAX,
            reg: (0, 0, 0),
            keys: MemKeys::default(),
        }
    }
}

impl KeyCache {
    /// Holds `keys` given directly (not through a handle), remembering no handle.
    #[cfg(test)]
    fn hold(&mut self, keys: MemKeys) -> &MemKeys {
        *self = KeyCache {
            keys,
            ..KeyCache::default()
        };
        &self.keys
    }
}

#[cfg(test)]
impl BufferKeys for MemKeys {
    fn keys<'c>(&self, _: usize, _: UserBuffer, cache: &'c mut KeyCache) -> Result<&'c MemKeys> {
        Ok(cache.hold(*self))
    }
}

#[cfg(test)]
impl<const N: usize> BufferKeys for [MemKeys; N] {
    fn keys<'c>(&self, i: usize, _: UserBuffer, cache: &'c mut KeyCache) -> Result<&'c MemKeys> {
        Ok(cache.hold(self[i]))
    }
}

#[cfg(test)]
impl BufferKeys for Vec<MemKeys> {
    fn keys<'c>(&self, i: usize, _: UserBuffer, cache: &'c mut KeyCache) -> Result<&'c MemKeys> {
        Ok(cache.hold(self[i]))
    }
}

/// What keeps a registration alive; dropped at deregistration.
pub(crate) type Hold = Box<dyn Any + Send + Sync>;

/// Where a receive's `test` writes the size of each message once it is done: NCCL's array,
/// written in place (nothing is zeroed or copied for a test that finds the receive not
/// done), so what `test` returns stays two registers wide. Sizes fit in 32 bits
/// (`maxP2pBytes` is 1 GiB).
pub(crate) trait SizeSink {
    /// The size of message `i`, below the request's count of messages.
    fn set(&mut self, i: usize, size: u32);
}

/// Sizes as the tests keep them.
#[cfg(test)]
pub(crate) type Sizes = [u32; MAX_RECVS];

#[cfg(test)]
impl SizeSink for Sizes {
    fn set(&mut self, i: usize, size: u32) {
        self[i] = size;
    }
}

/// What testing a request found. An enum of its own rather than `Result<Option<usize>>`:
/// its two words travel in registers, where the nested type (an `Option` inside a `Result`)
/// is moved through the stack at every layer it crosses.
#[derive(Debug)]
pub(crate) enum Tested {
    /// Not done yet.
    Pending,
    /// Done: the bytes a send sent, or how many messages a receive got (0 for a flush).
    Done(usize),
    /// The request, or its comm, failed.
    Failed(Error),
}

impl From<Result<Option<usize>>> for Tested {
    #[inline(always)]
    fn from(r: Result<Option<usize>>) -> Self {
        match r {
            Ok(None) => Tested::Pending,
            Ok(Some(n)) => Tested::Done(n),
            Err(e) => Tested::Failed(e),
        }
    }
}

impl Tested {
    /// As a `Result`, for `?`.
    #[cfg(test)]
    pub(crate) fn into_result(self) -> Result<Option<usize>> {
        match self {
            Tested::Pending => Ok(None),
            Tested::Done(n) => Ok(Some(n)),
            Tested::Failed(e) => Err(e),
        }
    }
}

/// What a comm has moved: the messages and bytes of the requests `test` reported done.
/// Kept by the transport under the lock its `test` holds anyway, read for the plugin's rate
/// lines and close summary.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Traffic {
    pub(crate) messages: u64,
    pub(crate) bytes: u64,
}

impl Traffic {
    /// `messages` more, of `bytes` in all.
    #[inline(always)]
    pub(crate) fn add(&mut self, messages: usize, bytes: u64) {
        self.messages += messages as u64;
        self.bytes += bytes;
    }
}

/// The per-process backend of a transport.
pub(crate) trait Transport: Send + Sync {
    /// Which transport this is (it travels in handles, so both ends must agree).
    fn kind(&self) -> TransportKind;
    /// How many devices NCCL sees (physical ones, then virtual ones `make_vdevice` added).
    fn device_count(&self) -> usize;
    /// Device `dev` (checked).
    fn device(&self, dev: usize) -> Result<Arc<DeviceProps>>;
    /// NCCL's NIC fusion (`makeVDevice`): a virtual device over the physical devices `devs`,
    /// at most `max` of them; returns its index. Transports that cannot fuse refuse.
    fn make_vdevice(&self, devs: &[i32], max: usize) -> Result<usize> {
        let _ = max;
        Err(Error::usage(format!(
            "makeVDevice of devices {devs:?}: this transport has one device and cannot fuse"
        )))
    }
    /// Binds a listener for one connection on device `dev` (checked), on `ip`.
    fn listen(&self, dev: usize, ip: IpAddr) -> Result<Box<dyn Listening>>;
    /// Starts connecting to the listener `handle` describes, from device `dev` (checked).
    /// `traffic_class` is the communicator's (v10+), used when `NCCL_IB_TC` is unset.
    fn connect(
        &self,
        dev: usize,
        handle: &Handle,
        traffic_class: Option<i32>,
    ) -> Result<Box<dyn Connecting>>;
    /// Registers `addr..addr+len` (host memory, or GPU memory through peer memory) on device
    /// `dev` (checked): its keys, and what keeps the registration alive (none where nothing
    /// needs to).
    fn register(
        &self,
        dev: usize,
        addr: usize,
        len: usize,
        host: bool,
    ) -> Result<(MemKeys, Option<Hold>)>;
    /// Registers a DMA-BUF (`fd` at `offset`) mapped at `addr..addr+len` on device `dev`.
    fn register_dmabuf(
        &self,
        dev: usize,
        addr: usize,
        len: usize,
        offset: u64,
        fd: i32,
    ) -> Result<(MemKeys, Hold)>;
}

/// One listener; NCCL polls `accept` until a peer connected.
pub(crate) trait Listening: Send {
    /// The handle for the peer's `connect`.
    fn handle(&self) -> &Handle;
    /// One non-blocking step of `accept`.
    fn poll_accept(&mut self) -> Result<Option<RecvEnd>>;
}

/// One connect in progress; NCCL polls it until the connection is up.
pub(crate) trait Connecting: Send {
    /// One non-blocking step of `connect`.
    fn poll(&mut self) -> Result<Option<SendEnd>>;
}

/// What either end of a connection tells about it.
pub(crate) trait Endpoint: Send + Sync {
    /// The peer, for messages.
    fn peer(&self) -> String;
    /// The requests `test` has reported done.
    fn traffic(&self) -> Traffic;
    /// What the comm's close summary adds (e.g. clear-to-send batching, per-rail counters).
    fn summary(&self) -> String {
        String::new()
    }
}

/// The sending end of a connection.
pub(crate) trait SendEndpoint: Endpoint {
    /// Whether an `isend` now has anything to do. False: it would return `Ok(None)`, so the
    /// caller answers "not yet" without converting its arguments (NCCL retries `isend`
    /// until the receiver's clear-to-send has come, and most calls are such retries).
    /// Callers ask before every `isend`.
    fn may_send(&self) -> bool {
        true
    }
    /// Posts a send of `buf` (its keys asked of `keys` once the send is matched: an error
    /// there fails the call, not the comm); `Ok(None)` until the receiver has posted a
    /// matching receive. Returns a request id below `MAX_SEND_REQUESTS`.
    fn isend(&self, buf: UserBuffer, tag: i32, keys: &impl BufferKeys) -> Result<Option<usize>>;
    /// Tests send request `id`: once done, the bytes it sent.
    fn test(&self, id: usize) -> Tested;
}

/// The receiving end of a connection.
pub(crate) trait RecvEndpoint: Endpoint {
    /// Posts a grouped receive of `bufs` (1..=8, their keys asked of `keys`: an error there
    /// fails the call, not the comm) with `tags`; `Ok(None)` when 32 are in flight. Returns a
    /// request id below `2 * MAX_REQUESTS`.
    fn irecv(
        &self,
        bufs: &[UserBuffer],
        tags: &[i32],
        keys: &impl BufferKeys,
    ) -> Result<Option<usize>>;
    /// Posts a flush of received GPU data in `bufs` (keys as for `irecv`); `Ok(None)` when
    /// nothing needs one.
    fn iflush(&self, bufs: &[UserBuffer], keys: &impl BufferKeys) -> Result<Option<usize>>;
    /// Tests receive or flush request `id`: once done, how many messages it had (0 for a
    /// flush), their sizes written into `sizes`.
    fn test(&self, id: usize, sizes: &mut impl SizeSink) -> Tested;
}

/// A connection's sending end as the plugin holds it: the transports are a closed set, so
/// the plugin's calls dispatch on this enum rather than through a vtable, and the idle
/// checks inline into the exports (NCCL's proxy makes millions of them a second). Held
/// inside the boxed comm and never moved once connected, so the variants' sizes may differ.
#[allow(clippy::large_enum_variant)]
pub(crate) enum SendEnd {
    Verbs(verbs::VerbsSendEnd),
    Tcp(tcp::TcpSendComm),
}

/// A connection's receiving end as the plugin holds it (see [`SendEnd`]).
#[allow(clippy::large_enum_variant)]
pub(crate) enum RecvEnd {
    Verbs(verbs::VerbsRecvEnd),
    Tcp(tcp::TcpRecvComm),
}

pub(crate) use verbs::{Look, WcBatch};

impl RecvEnd {
    /// The proxy's idle test of receive `id`, without the comm's lock: a poll of its CQ into
    /// `wc` that finds nothing ([`Look::Idle`]), where the verbs transport's receive gate
    /// allows one; `None` where it does not (and always for tcp).
    #[inline(always)]
    pub(crate) fn poll_unlocked(&self, id: usize, wc: &mut WcBatch) -> Option<Look> {
        match self {
            RecvEnd::Verbs(c) => c.poll_unlocked(id, wc),
            RecvEnd::Tcp(_) => None,
        }
    }

    /// The rest of a `test` of request `id`, after [`Self::poll_unlocked`] found `polled`
    /// (its completions in `wc`).
    #[inline(always)]
    pub(crate) fn test_after(
        &self,
        id: usize,
        sizes: &mut impl SizeSink,
        polled: Option<Look>,
        wc: &mut WcBatch,
    ) -> Tested {
        match self {
            RecvEnd::Verbs(c) => c.test_after(id, sizes, polled, wc),
            RecvEnd::Tcp(c) => c.test(id, sizes),
        }
    }
}

impl SendEndpoint for SendEnd {
    #[inline(always)]
    fn may_send(&self) -> bool {
        match self {
            SendEnd::Verbs(c) => c.may_send(),
            SendEnd::Tcp(c) => c.may_send(),
        }
    }

    #[inline(always)]
    fn isend(&self, buf: UserBuffer, tag: i32, keys: &impl BufferKeys) -> Result<Option<usize>> {
        match self {
            SendEnd::Verbs(c) => c.isend(buf, tag, keys),
            SendEnd::Tcp(c) => c.isend(buf, tag, keys),
        }
    }

    #[inline(always)]
    fn test(&self, id: usize) -> Tested {
        match self {
            SendEnd::Verbs(c) => c.test(id),
            SendEnd::Tcp(c) => c.test(id),
        }
    }
}

/// `Endpoint` of an end that is either transport's: what that transport's end tells.
macro_rules! endpoint_of_either {
    ($end:ident) => {
        impl Endpoint for $end {
            fn peer(&self) -> String {
                match self {
                    $end::Verbs(c) => c.peer(),
                    $end::Tcp(c) => c.peer(),
                }
            }

            fn traffic(&self) -> Traffic {
                match self {
                    $end::Verbs(c) => c.traffic(),
                    $end::Tcp(c) => c.traffic(),
                }
            }

            fn summary(&self) -> String {
                match self {
                    $end::Verbs(c) => c.summary(),
                    $end::Tcp(c) => c.summary(),
                }
            }
        }
    };
}

endpoint_of_either!(SendEnd);
endpoint_of_either!(RecvEnd);

impl RecvEndpoint for RecvEnd {
    #[inline(always)]
    fn irecv(
        &self,
        bufs: &[UserBuffer],
        tags: &[i32],
        keys: &impl BufferKeys,
    ) -> Result<Option<usize>> {
        match self {
            RecvEnd::Verbs(c) => c.irecv(bufs, tags, keys),
            RecvEnd::Tcp(c) => c.irecv(bufs, tags, keys),
        }
    }

    fn iflush(&self, bufs: &[UserBuffer], keys: &impl BufferKeys) -> Result<Option<usize>> {
        match self {
            RecvEnd::Verbs(c) => c.iflush(bufs, keys),
            RecvEnd::Tcp(c) => c.iflush(bufs, keys),
        }
    }

    #[inline(always)]
    fn test(&self, id: usize, sizes: &mut impl SizeSink) -> Tested {
        match self {
            RecvEnd::Verbs(c) => c.test(id, sizes),
            RecvEnd::Tcp(c) => c.test(id, sizes),
        }
    }
}

/// Opens the transport `NCCL_ERDMA_TRANSPORT` asks for: verbs, tcp, or verbs where a device
/// is usable and tcp otherwise. `bootstrap` is the interface the tcp transport reports.
pub(crate) fn open(config: &Config, bootstrap: &LocalAddr) -> Result<Box<dyn Transport>> {
    match config.transport.value {
        TransportChoice::Tcp => Ok(Box::new(tcp::TcpTransport::new(config, bootstrap))),
        TransportChoice::Verbs => {
            let t = verbs::VerbsTransport::open(config).map_err(|e| {
                Error::no_device(format!(
                    "verbs transport unavailable: {e}. NCCL falls back to its own \
                     transports; set NCCL_ERDMA_TRANSPORT=tcp (or auto) to use this plugin \
                     over TCP"
                ))
            })?;
            Ok(Box::new(t))
        }
        TransportChoice::Auto => match verbs::VerbsTransport::open(config) {
            Ok(t) => Ok(Box::new(t)),
            Err(e) => {
                tracing::info!(target: INIT, "verbs transport unavailable ({e}); using tcp");
                Ok(Box::new(tcp::TcpTransport::new(config, bootstrap)))
            }
        },
    }
}

/// The device `dev` of `devices`, or an error naming how many there are.
pub(crate) fn device<T>(devices: &[T], dev: usize) -> Result<&T> {
    devices.get(dev).ok_or_else(|| {
        Error::invalid_argument(format!(
            "device {dev} does not exist ({} devices)",
            devices.len()
        ))
    })
}

/// The error for `test` on request `id` (a `what`: send, receive, flush) that is not in
/// flight: never posted, or already reported done.
#[cold]
pub(crate) fn not_in_flight(what: &str, id: usize) -> Error {
    Error::misuse(format!(
        "test on {what} request {id}, which is not in flight"
    ))
}

/// A sticky connection failure: once set, every call that needs the peer returns it.
#[derive(Debug, Default)]
pub(crate) struct Failure(pub(crate) Option<String>);

impl Failure {
    pub(crate) fn set(&mut self, msg: String) {
        if self.0.is_none() {
            tracing::warn!("{msg}");
            self.0 = Some(msg);
        }
    }

    /// Passes `r` through, remembering its error as the comm's failure.
    #[inline]
    pub(crate) fn record<T>(&mut self, r: Result<T>) -> Result<T> {
        if let Err(e) = &r {
            self.note(e);
        }
        r
    }

    /// `e`, remembered as the comm's failure. (Not `record(Err(e))`: a result made out of line
    /// would keep the caller's result in memory on its good path too.)
    #[cold]
    pub(crate) fn fail(&mut self, e: Error) -> Error {
        self.note(&e);
        e
    }

    /// Remembers `e` as the comm's failure.
    #[cold]
    pub(crate) fn note(&mut self, e: &Error) {
        self.set(e.to_string());
    }

    /// Whether the comm has failed.
    #[inline(always)]
    pub(crate) fn is_set(&self) -> bool {
        self.0.is_some()
    }

    #[inline]
    pub(crate) fn check(&self) -> Result<()> {
        match &self.0 {
            Some(m) => Err(Self::error(m)),
            None => Ok(()),
        }
    }

    #[cold]
    fn error(m: &str) -> Error {
        Error::remote(m.to_string())
    }
}
