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
use crate::transport::either::AnyTransport;
use crate::transport::{
    Endpoint, Receiver, Sender, SizeSink, Tested, Transport, MAX_REQUESTS, MAX_SEND_REQUESTS,
};

use super::stats::{CommStats, Direction};
use super::Plugin;

/// Magic of a [`ListenComm`].
pub(crate) const LISTEN_MAGIC: u64 = 0x4c49_5354_454e_4552;
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
pub(crate) struct ListenComm<T: Transport = AnyTransport> {
    magic: u64,
    pub(super) dev: usize,
    pub(super) inner: T::Listener,
}

impl<T: Transport> ListenComm<T> {
    pub(super) fn new(inner: T::Listener, dev: usize) -> Box<Self> {
        Box::new(ListenComm {
            magic: LISTEN_MAGIC,
            dev,
            inner,
        })
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
    #[inline]
    pub(crate) fn check(&self) -> Result<()> {
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

/// A connected send comm.
#[repr(C)]
pub(crate) struct SendComm<T: Transport = AnyTransport> {
    magic: u64,
    dev: usize,
    plugin: Arc<Plugin<T>>,
    end: T::Sender,
    tokens: Box<[RequestToken]>,
    stats: CommStats,
}

impl<T: Transport> SendComm<T> {
    pub(super) fn new(plugin: Arc<Plugin<T>>, end: T::Sender, dev: usize) -> Box<Self> {
        let stats = plugin.comm_stats(Direction::Tx, dev, &end.peer());
        let mut comm = Box::new(SendComm {
            magic: SEND_MAGIC,
            dev,
            plugin,
            end,
            tokens: Box::new([]),
            stats,
        });
        let addr = &*comm as *const SendComm<T> as usize;
        comm.tokens = tokens(RequestOwner::Send(addr), MAX_SEND_REQUESTS);
        comm
    }

    /// The plugin and device this comm belongs to.
    pub(crate) fn owner(&self) -> (&Arc<Plugin<T>>, usize) {
        (&self.plugin, self.dev)
    }

    /// `isend` of `buf` (at most `MAX_P2P_BYTES`, checked by the boundary), registered as
    /// `mhandle`: `Ok(None)` when it cannot be posted yet (counted as a clear-to-send wait).
    #[inline]
    pub(crate) fn isend(
        &self,
        buf: UserBuffer,
        tag: i32,
        mhandle: u64,
    ) -> Result<Option<&RequestToken>> {
        match self.end.isend(buf, tag, mhandle) {
            Ok(Some(id)) => Ok(Some(&self.tokens[id])),
            Ok(None) => {
                self.stats.waited();
                Ok(None)
            }
            Err(e) => {
                self.stats.failed();
                Err(e)
            }
        }
    }

    /// `test` of request `id`: whether it is done, its size then written into `sizes`. Out
    /// of line: the boundary's `test` is mostly receives' idle tests, which keep it small.
    #[inline(never)]
    pub(crate) fn test(&self, id: usize, sizes: &mut impl SizeSink) -> Result<bool> {
        let r = self.end.test(id);
        self.stats
            .tested(&r, || self.plugin.totals(self.dev), &self.end);
        match r {
            Tested::Pending => Ok(false),
            Tested::Done(size) => {
                sizes.set(0, size as u32);
                Ok(true)
            }
            Tested::Failed(e) => Err(e),
        }
    }

    /// Marks the comm dead before it is dropped, so a stale pointer fails the magic check.
    pub(crate) fn retire(&mut self) {
        self.magic = 0;
    }

    /// The transport's end.
    #[cfg(test)]
    pub(super) fn end(&self) -> &T::Sender {
        &self.end
    }
}

/// A connected receive comm.
#[repr(C)]
pub(crate) struct RecvComm<T: Transport = AnyTransport> {
    magic: u64,
    dev: usize,
    plugin: Arc<Plugin<T>>,
    end: T::Receiver,
    tokens: Box<[RequestToken]>,
    stats: CommStats,
}

impl<T: Transport> RecvComm<T> {
    pub(super) fn new(plugin: Arc<Plugin<T>>, end: T::Receiver, dev: usize) -> Box<Self> {
        let stats = plugin.comm_stats(Direction::Rx, dev, &end.peer());
        let mut comm = Box::new(RecvComm {
            magic: RECV_MAGIC,
            dev,
            plugin,
            end,
            tokens: Box::new([]),
            stats,
        });
        let addr = &*comm as *const RecvComm<T> as usize;
        // Receives, then flushes.
        comm.tokens = tokens(RequestOwner::Recv(addr), 2 * MAX_REQUESTS);
        comm
    }

    /// The plugin and device this comm belongs to.
    pub(crate) fn owner(&self) -> (&Arc<Plugin<T>>, usize) {
        (&self.plugin, self.dev)
    }

    /// `irecv` of `bufs.len()` (1..=8, checked by the boundary) buffers: `Ok(None)` when 32
    /// receives are in flight.
    #[inline]
    pub(crate) fn irecv(
        &self,
        bufs: &[UserBuffer],
        tags: &[i32],
        mhandles: &[u64],
    ) -> Result<Option<&RequestToken>> {
        match self.end.irecv(bufs, tags, mhandles) {
            Ok(id) => Ok(id.map(|id| &self.tokens[id])),
            Err(e) => {
                self.stats.failed();
                Err(e)
            }
        }
    }

    /// `iflush`: a request only when the transport has something to flush.
    pub(crate) fn iflush(
        &self,
        bufs: &[UserBuffer],
        mhandles: &[u64],
    ) -> Result<Option<&RequestToken>> {
        let id = self.end.iflush(bufs, mhandles)?;
        Ok(id.map(|id| &self.tokens[id]))
    }

    /// `test` of request `id`: whether it is done, the sizes of its messages then written
    /// into `sizes`.
    #[inline]
    pub(crate) fn test(&self, id: usize, sizes: &mut impl SizeSink) -> Result<bool> {
        let r = self.end.test(id, sizes);
        self.stats
            .tested(&r, || self.plugin.totals(self.dev), &self.end);
        match r {
            Tested::Pending => Ok(false),
            Tested::Done(_) => Ok(true),
            Tested::Failed(e) => Err(e),
        }
    }

    /// Marks the comm dead before it is dropped, so a stale pointer fails the magic check.
    pub(crate) fn retire(&mut self) {
        self.magic = 0;
    }
}

impl<T: Transport> Drop for SendComm<T> {
    fn drop(&mut self) {
        self.stats.close(self.plugin.totals(self.dev), &self.end);
    }
}

impl<T: Transport> Drop for RecvComm<T> {
    fn drop(&mut self) {
        self.stats.close(self.plugin.totals(self.dev), &self.end);
    }
}
