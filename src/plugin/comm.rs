//! Comms and requests as NCCL holds them. Each comm starts with a magic number, so the
//! boundary can tell a send comm from a receive comm (`regMr` gets either) and reject a
//! pointer of the wrong kind; a request is a slot of its comm's fixed token table, so the
//! data path never allocates.

use std::sync::{
    atomic::{AtomicUsize, Ordering::Relaxed},
    Arc,
};

use crate::abi::buffer::UserBuffer;
use crate::error::{Error, Result};
use crate::oob::Handle;
use crate::transport::tcp::{TcpListen, TcpRecvComm, TcpSendComm};
use crate::transport::verbs::{VerbsListen, VerbsRecvComm, VerbsSendComm};
use crate::transport::{Completion, MAX_RECVS, MAX_REQUESTS, MAX_SEND_REQUESTS};

use super::stats::{CommStats, Direction};
use super::{Plugin, MAX_P2P_BYTES, PTR_HOST};

/// Magic of a [`ListenComm`].
pub const LISTEN_MAGIC: u64 = 0x4c49_5354_454e_4552;
/// Magic of a [`SendComm`].
pub const SEND_MAGIC: u64 = 0x5345_4e44_434f_4d4d;
/// Magic of a [`RecvComm`].
pub const RECV_MAGIC: u64 = 0x5245_4356_434f_4d4d;
/// Magic of a [`RequestToken`].
pub const REQUEST_MAGIC: u64 = 0x5245_5155_4553_5421;

/// Errors unless a comm's or request's magic `have` is `want` (`what` names the kind).
#[inline]
pub(crate) fn check_magic(have: u64, want: u64, what: &str) -> Result<()> {
    if have == want {
        Ok(())
    } else {
        Err(not_a(what))
    }
}

#[cold]
fn not_a(what: &str) -> Error {
    Error::Misuse(format!("the pointer passed as a {what} is not one"))
}

// Each lives inside a boxed comm made once per connection: size differences cost nothing.
#[allow(clippy::large_enum_variant)]
pub(super) enum Listen {
    Tcp(TcpListen),
    Verbs(VerbsListen),
}

impl Listen {
    pub(super) fn handle(&self) -> &Handle {
        match self {
            Listen::Tcp(t) => t.handle(),
            Listen::Verbs(v) => v.handle(),
        }
    }
}

/// The listening side of one future connection.
#[repr(C)]
pub struct ListenComm {
    magic: u64,
    pub(super) dev: usize,
    pub(super) inner: Listen,
}

impl ListenComm {
    pub(super) fn new(inner: Listen, dev: usize) -> Box<Self> {
        Box::new(ListenComm {
            magic: LISTEN_MAGIC,
            dev,
            inner,
        })
    }

    /// Errors unless this is a live listen comm.
    pub fn check(&self) -> Result<()> {
        check_magic(self.magic, LISTEN_MAGIC, "listen comm")
    }

    /// Marks the comm dead before it is dropped.
    pub fn retire(&mut self) {
        self.magic = 0;
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
    /// Request id in the comm.
    pub slot: usize,
    /// NCCL profiler event of the request in flight (0 = none).
    profiler_event: AtomicUsize,
}

impl RequestToken {
    /// Records the profiler event started for the request.
    pub fn set_profiler_event(&self, handle: usize) {
        self.profiler_event.store(handle, Relaxed);
    }

    /// Whether a profiler event is open for the request (one load, no write).
    #[inline]
    pub fn has_profiler_event(&self) -> bool {
        self.profiler_event.load(Relaxed) != 0
    }

    /// Takes the request's profiler event (0 when none).
    pub fn take_profiler_event(&self) -> usize {
        self.profiler_event.swap(0, Relaxed)
    }

    /// Errors unless this is a request token.
    pub fn check(&self) -> Result<()> {
        check_magic(self.magic, REQUEST_MAGIC, "request")
    }
}

fn tokens(owner: RequestOwner, n: usize) -> Box<[RequestToken]> {
    (0..n)
        .map(|slot| RequestToken {
            magic: REQUEST_MAGIC,
            owner,
            slot,
            profiler_event: AtomicUsize::new(0),
        })
        .collect()
}

// Each lives inside a boxed comm made once per connection: size differences cost nothing.
#[allow(clippy::large_enum_variant)]
pub(super) enum Send {
    Tcp(TcpSendComm),
    Verbs(VerbsSendComm),
}

/// A connected send comm.
#[repr(C)]
pub struct SendComm {
    magic: u64,
    dev: usize,
    plugin: Arc<Plugin>,
    inner: Send,
    tokens: Box<[RequestToken]>,
    stats: CommStats,
}

impl SendComm {
    pub(super) fn new(plugin: Arc<Plugin>, inner: Send, dev: usize) -> Box<Self> {
        let peer = match &inner {
            Send::Tcp(t) => t.peer(),
            Send::Verbs(v) => v.peer(),
        };
        let stats = plugin.comm_stats(Direction::Tx, dev, &peer);
        let mut comm = Box::new(SendComm {
            magic: SEND_MAGIC,
            dev,
            plugin,
            inner,
            tokens: Box::new([]),
            stats,
        });
        let addr = &*comm as *const SendComm as usize;
        comm.tokens = tokens(RequestOwner::Send(addr), MAX_SEND_REQUESTS);
        comm
    }

    /// Errors unless this is a live send comm.
    pub fn check(&self) -> Result<()> {
        check_magic(self.magic, SEND_MAGIC, "send comm")
    }

    /// The plugin and device this comm belongs to.
    pub fn owner(&self) -> (&Arc<Plugin>, usize) {
        (&self.plugin, self.dev)
    }

    /// `isend`: `Ok(None)` when it cannot be posted yet.
    #[inline(always)] // into the boundary: one call layer less per message
    pub fn isend(&self, buf: UserBuffer, tag: i32, mhandle: u64) -> Result<Option<&RequestToken>> {
        if buf.len() > MAX_P2P_BYTES {
            return Err(Error::InvalidArgument(format!(
                "send of {} bytes exceeds maxP2pBytes ({MAX_P2P_BYTES})",
                buf.len()
            )));
        }
        let reg = self
            .plugin
            .registration(mhandle, self.dev, buf.addr(), buf.len())?;
        let id = match &self.inner {
            Send::Tcp(t) => t.isend(buf, tag),
            Send::Verbs(v) => v.isend(buf, tag, reg.lkey, reg.ptr_type == PTR_HOST),
        };
        match id {
            Ok(None) => self.stats.waited(),
            Err(_) => self.stats.failed(),
            Ok(Some(_)) => {}
        }
        Ok(id?.map(|id| &self.tokens[id]))
    }

    /// `test` of one of this comm's requests.
    #[inline(always)] // into the boundary: one call layer less per message
    pub fn test(&self, id: usize) -> Result<Option<Completion>> {
        let r = match &self.inner {
            Send::Tcp(t) => t.test(id),
            Send::Verbs(v) => v.test(id),
        };
        self.stats.record(&r, || self.plugin.totals(self.dev));
        r
    }

    /// Marks the comm dead before it is dropped, so a stale pointer fails the magic check.
    pub fn retire(&mut self) {
        self.magic = 0;
    }
}

// Each lives inside a boxed comm made once per connection: size differences cost nothing.
#[allow(clippy::large_enum_variant)]
pub(super) enum Recv {
    Tcp(TcpRecvComm),
    Verbs(VerbsRecvComm),
}

/// A connected receive comm.
#[repr(C)]
pub struct RecvComm {
    magic: u64,
    dev: usize,
    plugin: Arc<Plugin>,
    inner: Recv,
    tokens: Box<[RequestToken]>,
    stats: CommStats,
}

impl RecvComm {
    pub(super) fn new(plugin: Arc<Plugin>, inner: Recv, dev: usize) -> Box<Self> {
        let peer = match &inner {
            Recv::Tcp(t) => t.peer(),
            Recv::Verbs(v) => v.peer(),
        };
        let stats = plugin.comm_stats(Direction::Rx, dev, &peer);
        let mut comm = Box::new(RecvComm {
            magic: RECV_MAGIC,
            dev,
            plugin,
            inner,
            tokens: Box::new([]),
            stats,
        });
        let addr = &*comm as *const RecvComm as usize;
        // Receives, then flushes.
        comm.tokens = tokens(RequestOwner::Recv(addr), 2 * MAX_REQUESTS);
        comm
    }

    /// Errors unless this is a live receive comm.
    pub fn check(&self) -> Result<()> {
        check_magic(self.magic, RECV_MAGIC, "receive comm")
    }

    /// The plugin and device this comm belongs to.
    pub fn owner(&self) -> (&Arc<Plugin>, usize) {
        (&self.plugin, self.dev)
    }

    /// Fills `rkeys` with the remote key of each buffer's registration.
    #[inline(always)]
    fn rkeys(&self, bufs: &[UserBuffer], mhandles: &[u64], rkeys: &mut [u32]) -> Result<()> {
        for ((buf, mh), rkey) in bufs.iter().zip(mhandles).zip(rkeys) {
            *rkey = self
                .plugin
                .registration(*mh, self.dev, buf.addr(), buf.len())?
                .rkey;
        }
        Ok(())
    }

    /// `irecv` of `bufs.len()` (1..=8) buffers: `Ok(None)` when 32 receives are in flight.
    #[inline(always)] // into the boundary: one call layer less per message
    pub fn irecv(
        &self,
        bufs: &[UserBuffer],
        tags: &[i32],
        mhandles: &[u64],
    ) -> Result<Option<&RequestToken>> {
        check_count(bufs.len(), "irecv")?;
        let mut rkeys = [0u32; MAX_RECVS];
        let rkeys = &mut rkeys[..bufs.len()];
        self.rkeys(bufs, mhandles, rkeys)?;
        let id = match &self.inner {
            Recv::Tcp(t) => t.irecv(bufs, tags),
            Recv::Verbs(v) => v.irecv(bufs, tags, rkeys),
        };
        if id.is_err() {
            self.stats.failed();
        }
        Ok(id?.map(|id| &self.tokens[id]))
    }

    /// `iflush`: a request only when the verbs transport has something to flush.
    pub fn iflush(&self, bufs: &[UserBuffer], mhandles: &[u64]) -> Result<Option<&RequestToken>> {
        check_count(bufs.len(), "iflush")?;
        let id = match &self.inner {
            Recv::Tcp(_) => None,
            Recv::Verbs(v) => {
                let mut rkeys = [0u32; MAX_RECVS];
                let rkeys = &mut rkeys[..bufs.len()];
                self.rkeys(bufs, mhandles, rkeys)?;
                v.iflush(bufs, rkeys)?
            }
        };
        Ok(id.map(|id| &self.tokens[id]))
    }

    /// `test` of one of this comm's requests.
    #[inline(always)] // into the boundary: one call layer less per message
    pub fn test(&self, id: usize) -> Result<Option<Completion>> {
        let r = match &self.inner {
            Recv::Tcp(t) => t.test(id),
            Recv::Verbs(v) => v.test(id),
        };
        self.stats.record(&r, || self.plugin.totals(self.dev));
        r
    }

    /// Marks the comm dead before it is dropped, so a stale pointer fails the magic check.
    pub fn retire(&mut self) {
        self.magic = 0;
    }
}

fn check_count(n: usize, call: &str) -> Result<()> {
    if n == 0 || n > MAX_RECVS {
        return Err(Error::InvalidArgument(format!(
            "{call} of {n} buffers; 1 to {MAX_RECVS} are allowed"
        )));
    }
    Ok(())
}

impl Drop for SendComm {
    fn drop(&mut self) {
        self.stats.close(self.plugin.totals(self.dev), "");
    }
}

impl Drop for RecvComm {
    fn drop(&mut self) {
        // How well clear-to-sends were batched (NCCL_ERDMA_CTS_BATCH).
        let detail = match &self.inner {
            Recv::Tcp(_) => String::new(),
            Recv::Verbs(v) => {
                let (writes, entries) = v.clear_to_send_counts();
                format!(" ({writes} clear-to-send writes for {entries} receives)")
            }
        };
        self.stats.close(self.plugin.totals(self.dev), &detail);
    }
}
