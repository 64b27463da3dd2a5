//! Comms and requests as NCCL holds them. Each comm starts with a magic number, so the
//! boundary can tell a send comm from a receive comm (`regMr` gets either) and reject a
//! pointer of the wrong kind; a request is a slot of its comm's fixed token table, so the
//! data path never allocates.

use std::sync::{
    atomic::{AtomicUsize, Ordering::Relaxed},
    Arc,
};

use crate::buffer::UserBuffer;
use crate::error::{Error, Result};
use crate::transport::{
    BufferKeys, Endpoint, KeyCache, Listening, Look, MemKeys, RecvEnd, RecvEndpoint, SendEnd,
    SendEndpoint, SizeSink, Tested, WcBatch, MAX_P2P_BYTES, MAX_REQUESTS, MAX_SEND_REQUESTS,
};

use super::stats::{CommStats, Direction};
use super::Plugin;

/// Magic of a [`ListenComm`].
const LISTEN_MAGIC: u64 = 0x4c49_5354_454e_4552;
/// Magic of a [`SendComm`].
pub(crate) const SEND_MAGIC: u64 = 0x5345_4e44_434f_4d4d;
/// Magic of a [`RecvComm`].
pub(crate) const RECV_MAGIC: u64 = 0x5245_4356_434f_4d4d;
/// Magic of a [`RequestToken`].
const REQUEST_MAGIC: u64 = 0x5245_5155_4553_5421;

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
    Error::misuse(format!("the pointer passed as a {what} is not one"))
}

/// The listening side of one future connection.
#[repr(C)]
pub(crate) struct ListenComm {
    magic: u64,
    pub(super) dev: usize,
    pub(super) inner: Box<dyn Listening>,
}

impl ListenComm {
    pub(super) fn new(inner: Box<dyn Listening>, dev: usize) -> Box<Self> {
        Box::new(ListenComm {
            magic: LISTEN_MAGIC,
            dev,
            inner,
        })
    }

    /// Errors unless this is a live listen comm.
    pub(crate) fn check(&self) -> Result<()> {
        check_magic(self.magic, LISTEN_MAGIC, "listen comm")
    }

    /// Marks the comm dead before it is dropped.
    pub(crate) fn retire(&mut self) {
        self.magic = 0;
    }
}

/// Which comm a request belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RequestOwner {
    /// A [`SendComm`] at this address.
    Send(usize),
    /// A [`RecvComm`] at this address.
    Recv(usize),
}

impl RequestOwner {
    /// The comm's address.
    #[inline(always)]
    pub(crate) fn addr(self) -> usize {
        match self {
            RequestOwner::Send(a) | RequestOwner::Recv(a) => a,
        }
    }
}

/// What NCCL holds as a request: a slot of its comm's fixed request table.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct RequestToken {
    magic: u64,
    /// The comm that owns the request.
    pub(crate) owner: RequestOwner,
    /// Request id in the comm.
    pub(crate) slot: usize,
    /// NCCL profiler event of the request in flight (0 = none).
    profiler_event: AtomicUsize,
}

impl RequestToken {
    /// Records the profiler event started for the request.
    pub(crate) fn set_profiler_event(&self, handle: usize) {
        self.profiler_event.store(handle, Relaxed);
    }

    /// Whether a profiler event is open for the request (one load, no write).
    #[inline]
    pub(crate) fn has_profiler_event(&self) -> bool {
        self.profiler_event.load(Relaxed) != 0
    }

    /// Takes the request's profiler event (0 when none).
    pub(crate) fn take_profiler_event(&self) -> usize {
        self.profiler_event.swap(0, Relaxed)
    }

    /// Errors unless this is a request token.
    pub(crate) fn check(&self) -> Result<()> {
        check_magic(self.magic, REQUEST_MAGIC, "request")
    }

    /// Whether this is a request token ([`Self::check`] says why not).
    #[inline(always)]
    pub(crate) fn is_live(&self) -> bool {
        self.magic == REQUEST_MAGIC
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

/// The lookup of a call's buffers, registered as NCCL's `mhandles`, on device `dev`, which
/// the transport makes per buffer it needs (see `BufferKeys`).
struct HandleKeys<'a> {
    plugin: &'a Plugin,
    dev: usize,
    mhandles: &'a [u64],
}

impl BufferKeys for HandleKeys<'_> {
    #[inline(always)]
    fn keys<'c>(&self, i: usize, buf: UserBuffer, cache: &'c mut KeyCache) -> Result<&'c MemKeys> {
        self.plugin
            .buffer_keys(cache, self.mhandles[i], self.dev, buf)
    }
}

/// A connected send comm.
#[repr(C)]
pub(crate) struct SendComm {
    magic: u64,
    dev: usize,
    plugin: Arc<Plugin>,
    inner: SendEnd,
    tokens: Box<[RequestToken]>,
    stats: CommStats,
}

impl SendComm {
    pub(super) fn new(plugin: Arc<Plugin>, inner: SendEnd, dev: usize) -> Box<Self> {
        let stats = plugin.comm_stats(Direction::Tx, dev, &inner.peer());
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

    /// The plugin and device this comm belongs to.
    pub(crate) fn owner(&self) -> (&Arc<Plugin>, usize) {
        (&self.plugin, self.dev)
    }

    /// Whether an `isend` now has anything to do (see `SendEndpoint::may_send`); a "no" is
    /// counted as a clear-to-send wait.
    #[inline(always)]
    pub(crate) fn may_send(&self) -> bool {
        let yes = self.inner.may_send();
        if !yes {
            self.stats.waited();
        }
        yes
    }

    /// `isend`, after [`Self::may_send`]: `Ok(None)` when it cannot be posted yet.
    #[inline(always)] // into the boundary: one call layer less per message
    pub(crate) fn isend(
        &self,
        buf: UserBuffer,
        tag: i32,
        mhandle: u64,
    ) -> Result<Option<&RequestToken>> {
        if buf.len() > MAX_P2P_BYTES {
            return Err(Error::invalid_argument(format!(
                "send of {} bytes exceeds maxP2pBytes ({MAX_P2P_BYTES})",
                buf.len()
            )));
        }
        // Looked up only once the send is matched (see `BufferKeys`).
        let keys = HandleKeys {
            plugin: &self.plugin,
            dev: self.dev,
            mhandles: std::slice::from_ref(&mhandle),
        };
        let id = self.inner.isend(buf, tag, &keys);
        match id {
            Ok(None) => self.stats.waited(),
            Err(_) => self.stats.failed(),
            Ok(Some(_)) => {}
        }
        Ok(id?.map(|id| &self.tokens[id]))
    }

    /// `test` of one of this comm's requests: once done, the bytes it sent.
    #[inline(always)] // into the boundary: one call layer less per message
    pub(crate) fn test(&self, id: usize) -> Tested {
        let r = self.inner.test(id);
        self.stats
            .tested(&r, || self.plugin.totals(self.dev), &self.inner);
        r
    }

    /// Marks the comm dead before it is dropped, so a stale pointer fails the magic check.
    pub(crate) fn retire(&mut self) {
        self.magic = 0;
    }
}

/// A connected receive comm.
#[repr(C)]
pub(crate) struct RecvComm {
    magic: u64,
    dev: usize,
    plugin: Arc<Plugin>,
    inner: RecvEnd,
    tokens: Box<[RequestToken]>,
    stats: CommStats,
}

impl RecvComm {
    pub(super) fn new(plugin: Arc<Plugin>, inner: RecvEnd, dev: usize) -> Box<Self> {
        let stats = plugin.comm_stats(Direction::Rx, dev, &inner.peer());
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

    /// The plugin and device this comm belongs to.
    pub(crate) fn owner(&self) -> (&Arc<Plugin>, usize) {
        (&self.plugin, self.dev)
    }

    /// The lookup of the keys of buffers registered as `mhandles`.
    #[inline(always)]
    fn keys<'a>(&'a self, mhandles: &'a [u64]) -> HandleKeys<'a> {
        HandleKeys {
            plugin: &self.plugin,
            dev: self.dev,
            mhandles,
        }
    }

    /// `irecv` of `bufs.len()` (1..=8, checked by the boundary) buffers: `Ok(None)` when 32
    /// receives are in flight.
    #[inline(always)] // into the boundary: one call layer less per message
    pub(crate) fn irecv(
        &self,
        bufs: &[UserBuffer],
        tags: &[i32],
        mhandles: &[u64],
    ) -> Result<Option<&RequestToken>> {
        let keys = self.keys(mhandles);
        let id = self.inner.irecv(bufs, tags, &keys);
        if id.is_err() {
            self.stats.failed();
        }
        Ok(id?.map(|id| &self.tokens[id]))
    }

    /// `iflush`: a request only when the transport has something to flush.
    pub(crate) fn iflush(
        &self,
        bufs: &[UserBuffer],
        mhandles: &[u64],
    ) -> Result<Option<&RequestToken>> {
        let keys = self.keys(mhandles);
        let id = self.inner.iflush(bufs, &keys)?;
        Ok(id.map(|id| &self.tokens[id]))
    }

    /// The proxy's idle test of request `id`, without the comm's lock: a poll into `wc` that
    /// finds nothing ([`Look::Idle`]: not done, and nothing else to do); `None` where no such
    /// poll is allowed.
    #[inline(always)] // the proxy's idle tests are most calls
    pub(crate) fn poll_unlocked(&self, id: usize, wc: &mut WcBatch) -> Option<Look> {
        self.inner.poll_unlocked(id, wc)
    }

    /// The rest of a `test` of request `id`, after [`Self::poll_unlocked`] found `polled`:
    /// once done, how many messages it had (0 for a flush), their sizes written into `sizes`.
    #[inline(always)] // into the boundary: one call layer less per message
    pub(crate) fn test_after(
        &self,
        id: usize,
        sizes: &mut impl SizeSink,
        polled: Option<Look>,
        wc: &mut WcBatch,
    ) -> Tested {
        let r = self.inner.test_after(id, sizes, polled, wc);
        self.stats
            .tested(&r, || self.plugin.totals(self.dev), &self.inner);
        r
    }

    /// Marks the comm dead before it is dropped, so a stale pointer fails the magic check.
    pub(crate) fn retire(&mut self) {
        self.magic = 0;
    }
}

impl Drop for SendComm {
    fn drop(&mut self) {
        self.stats.close(self.plugin.totals(self.dev), &self.inner);
    }
}

impl Drop for RecvComm {
    fn drop(&mut self) {
        self.stats.close(self.plugin.totals(self.dev), &self.inner);
    }
}
