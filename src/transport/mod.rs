//! The transport contract: what the version-neutral core (`plugin`) needs from whatever
//! carries the data, as traits that name no transport. A [`Transport`] is the per-process
//! backend (its devices, memory registration, listen and connect); a connection goes
//! [`Connector`] or [`Listener`] -> [`Sender`] / [`Receiver`]. `tcp` (sockets) and `verbs`
//! (eRDMA, RoCE, IB) implement it; `either` is the one place that names both, and the plugin
//! holds whichever `either::open` picked.
//!
//! The request contract every transport honours, as NCCL expects it: `isend`/`irecv` return
//! `Ok(None)` (a NULL request) when they cannot post now, never block and never allocate; a
//! request id is small and dense (an index into the comm's fixed token table); `test` reports
//! each request done exactly once; a comm that failed stays failed (every later call returns
//! its first error); closing never waits for the peer.
//!
//! The data path's performance invariants, kept where the code is:
//! - an idle `test` of a receive (its data not there yet) takes no lock: one load of the
//!   receive gate and one CQ poll per rail (`verbs/gate.rs`);
//! - one load decides an idle `isend` (no clear-to-send yet): the sender's gate (`verbs/send.rs`);
//! - nothing allocates per message: requests are slots of fixed tables, work requests are
//!   built in place, completions are polled into a batch on the stack;
//! - the clock is read only by the slow checks, every few hundred polls (`verbs/cq.rs`).

mod bounds;
pub(crate) mod either;
pub(crate) mod facts;
pub(crate) mod registry;
pub(crate) mod tcp;
pub(crate) mod verbs;

use std::{ffi::CString, net::IpAddr, sync::Arc};

use crate::buffer::UserBuffer;
use crate::error::{Error, Result};
use crate::oob::{Handle, TransportKind};

pub(crate) use bounds::{
    MAX_P2P_BYTES, MAX_RAILS, MAX_RECVS, MAX_REQUESTS, MAX_SEND_REQUESTS, PTR_CUDA, PTR_DMABUF,
    PTR_HOST,
};
pub(crate) use facts::TransportFacts;
pub(crate) use registry::{CommKeys, Hold, MemKeys, Registry};

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
    /// v12 `railId`: -1 unless rails are configured, as NCCL's IB transport reports it.
    pub(crate) rail_id: i16,
}

impl DeviceProps {
    /// The name, for messages.
    pub(crate) fn name(&self) -> &str {
        self.name.to_str().unwrap_or("?")
    }

    /// Device `index` as the info command tells it: over the NICs `members`, which is `why`.
    pub(crate) fn facts(&self, index: usize, members: Vec<String>, why: &str) -> facts::Device {
        facts::Device {
            index,
            name: self.name().to_string(),
            speed_mbps: self.speed_mbps,
            ptr_support: self.ptr_support,
            pci_path: self
                .pci_path
                .as_ref()
                .map(|p| p.to_string_lossy().into_owned()),
            members,
            why: why.to_string(),
            spares: Vec::new(),
        }
    }
}

/// Where a receive's `test` writes the size of each message once it is done: NCCL's array,
/// written in place (nothing is written for a test that finds the receive not done). Sizes fit
/// in 32 bits (`maxP2pBytes` is 1 GiB).
pub(crate) trait SizeSink {
    /// The size of message `i`, below the request's count of messages.
    fn set(&mut self, i: usize, size: u32);
}

/// Sizes as the unit tests keep them.
#[cfg(test)]
impl SizeSink for [u32; MAX_RECVS] {
    fn set(&mut self, i: usize, size: u32) {
        self[i] = size;
    }
}

/// What testing a request found.
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
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Traffic {
    pub(crate) messages: u64,
    pub(crate) bytes: u64,
}

impl Traffic {
    /// `messages` more, of `bytes` in all.
    pub(crate) fn add(&mut self, messages: usize, bytes: u64) {
        self.messages += messages as u64;
        self.bytes += bytes;
    }
}

/// The per-process backend of a transport.
pub(crate) trait Transport: Send + Sync + Sized + 'static {
    /// A listener for one connection.
    type Listener: Listener<Receiver = Self::Receiver>;
    /// One connect in progress.
    type Connector: Connector<Sender = Self::Sender>;
    /// The sending end of a connection.
    type Sender: Sender;
    /// The receiving end of a connection.
    type Receiver: Receiver;

    /// Which transport this is (it travels in handles, so both ends must agree).
    fn kind(&self) -> TransportKind;
    /// What the transport found on this host and decided at `open`: devices, settings in
    /// effect and where each came from, fusion and why.
    fn facts(&self) -> TransportFacts;
    /// The registrations its ends look NCCL's memory handles up in.
    fn registry(&self) -> &Arc<Registry>;
    /// How many devices NCCL sees (physical ones, then virtual ones `make_vdevice` added).
    fn device_count(&self) -> usize;
    /// Device `dev` (checked).
    fn device(&self, dev: usize) -> Result<Arc<DeviceProps>>;
    /// NCCL's NIC fusion (`makeVDevice`): a virtual device over the physical devices `devs`,
    /// at most `max` of them; returns its index.
    fn make_vdevice(&self, devs: &[i32], max: usize) -> Result<usize>;
    /// Forgets the virtual devices `make_vdevice` made: NCCL is about to unload the plugin,
    /// and its next load counts every device offered as a physical NIC.
    fn drop_virtual_devices(&self);
    /// Binds a listener for one connection on device `dev` (checked), on `ip`.
    fn listen(&self, dev: usize, ip: IpAddr) -> Result<Self::Listener>;
    /// Starts connecting to the listener `handle` describes, from device `dev` (checked).
    /// `traffic_class` is the communicator's (v10+), used when `NCCL_IB_TC` is unset.
    fn connect(
        &self,
        dev: usize,
        handle: &Handle,
        traffic_class: Option<i32>,
    ) -> Result<Self::Connector>;
    /// Registers `addr..addr+len` (host memory, or GPU memory through peer memory) on device
    /// `dev` (checked): its keys, and what keeps the registration alive.
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

/// One listener, which accepts every connection made to its handle. Setup is one-way: no
/// end waits for the other's `connect` or `accept` (NCCL up to 2.18 runs its connects to
/// completion before its accepts, on one thread), and what is left of the handshake
/// finishes in the ends' first data calls, which answer "not yet" meanwhile.
pub(crate) trait Listener: Send {
    /// A connection's receiving end.
    type Receiver;
    /// The handle for the peers' `connect`.
    fn handle(&self) -> &Handle;
    /// One non-blocking step of `accept`: the receiving end of the next connector whose
    /// hello has come.
    fn poll_accept(&mut self) -> Result<Option<Self::Receiver>>;
}

/// One connect in progress; NCCL polls it until it returns the sending end.
pub(crate) trait Connector: Send {
    /// The connection's sending end.
    type Sender;
    /// One non-blocking step of `connect`: the sending end once its hello is out, whether
    /// or not the peer has called `accept`.
    fn poll(&mut self) -> Result<Option<Self::Sender>>;
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

/// The sending end of a connection. Each end looks NCCL's memory handles up itself (its
/// `CommKeys`, given when the transport made it), where it builds the request.
pub(crate) trait Sender: Endpoint {
    /// Posts a send of `buf` (at most `MAX_P2P_BYTES`, checked by the caller) registered as
    /// `mhandle`, which is looked up once the send is matched (an error there fails the call,
    /// not the comm); `Ok(None)` until the receiver has posted a matching receive (and, on a
    /// new connection, until its setup is done). Returns a request id below
    /// `MAX_SEND_REQUESTS`.
    fn isend(&self, buf: UserBuffer, tag: i32, mhandle: u64) -> Result<Option<usize>>;
    /// Tests send request `id`: once done, the bytes it sent.
    fn test(&self, id: usize) -> Tested;
}

/// The receiving end of a connection.
pub(crate) trait Receiver: Endpoint {
    /// Posts a grouped receive of `bufs` (1..=8) registered as `mhandles` (an error there
    /// fails the call, not the comm) with `tags`; `Ok(None)` when 32 are in flight (and, on a
    /// new connection, until its setup is done). Returns a request id below
    /// `2 * MAX_REQUESTS`.
    fn irecv(&self, bufs: &[UserBuffer], tags: &[i32], mhandles: &[u64]) -> Result<Option<usize>>;
    /// Posts a flush of received GPU data in `bufs` (registered as `mhandles`); `Ok(None)`
    /// when nothing needs one.
    fn iflush(&self, bufs: &[UserBuffer], mhandles: &[u64]) -> Result<Option<usize>>;
    /// Tests receive or flush request `id`: once done, how many messages it had (0 for a
    /// flush), their sizes written into `sizes`.
    fn test(&self, id: usize, sizes: &mut impl SizeSink) -> Tested;
}

/// The device `dev` of `devices`, or an error naming how many there are.
pub(crate) fn device<T>(devices: &[T], dev: usize) -> Result<&T> {
    devices.get(dev).ok_or_else(|| {
        Error::misuse(format!(
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

/// A comm's sticky failure: once set, every call that needs the peer returns it, with the
/// first failure's kind and message.
#[derive(Debug, Default)]
pub(crate) struct Failure(Option<Error>);

impl Failure {
    /// Remembers `e` as the comm's failure (logged once), unless it failed before.
    #[cold]
    pub(crate) fn note(&mut self, e: &Error) {
        if self.0.is_none() {
            tracing::warn!("{e}");
            self.0 = Some(e.clone());
        }
    }

    /// Remembers `e` as the comm's failure without a WARN (a peer that finished and closed
    /// is not an error until a call needs it), unless it failed before.
    #[cold]
    pub(crate) fn note_quietly(&mut self, e: Error) {
        self.0.get_or_insert(e);
    }

    /// `e`, remembered as the comm's failure.
    #[cold]
    pub(crate) fn fail(&mut self, e: Error) -> Error {
        self.note(&e);
        e
    }

    /// Passes `r` through, remembering its error as the comm's failure.
    #[inline]
    pub(crate) fn record<T>(&mut self, r: Result<T>) -> Result<T> {
        r.map_err(|e| self.fail(e))
    }

    /// Whether the comm has failed.
    #[inline]
    pub(crate) fn is_set(&self) -> bool {
        self.0.is_some()
    }

    /// The comm's failure, if it failed.
    #[inline]
    pub(crate) fn check(&self) -> Result<()> {
        match &self.0 {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_comm_keeps_its_first_failure_whole() {
        let mut f = Failure::default();
        assert!(f.check().is_ok() && !f.is_set());
        let _ = f.record::<()>(Err(Error::truncated("too big".into())));
        f.note(&Error::remote("later".into()));
        for _ in 0..3 {
            let e = f.check().unwrap_err();
            assert_eq!(e.code(), crate::ffi::ncclResult_t::ncclInvalidUsage);
            assert_eq!(e.to_string(), "too big");
        }
    }
}
