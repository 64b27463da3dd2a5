//! The seam between the verbs transport's state machines and an RDMA device: the few things
//! a connection does with a NIC (create a CQ and QPs, bring QPs up, register memory, post
//! work requests, poll completions, learn of fatal asynchronous events). `VerbsDevice`
//! implements it with libibverbs (`super::device`); unit tests use the in-memory fabric of [`super::fake`], so
//! the transport's send and receive logic runs on any host.

use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rdma_sys::{ibv_send_wr, ibv_wc};

use super::limits::{DeviceLimits, Held};
use super::qp::{Qp, QpPath, RemoteQp};
use super::resources::Mr;
use crate::error::Result;

/// What a connection needs to know about the local port it runs on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LocalPort {
    /// `name` reported to NCCL (`rxe0`, `erdma_0`; `:port` appended for ports > 1).
    pub(crate) name: String,
    /// Port number.
    pub(crate) port: u8,
    /// Link layer (`LINK_LAYER_IB` or `LINK_LAYER_ETHERNET`).
    pub(crate) link_layer: u8,
    /// Active MTU (`ibv_mtu`).
    pub(crate) active_mtu: u32,
    /// LID (IB).
    pub(crate) lid: u16,
    /// GID index used for RoCE.
    pub(crate) gid_index: u8,
    /// That GID.
    pub(crate) gid: [u8; 16],
}

/// A queue pair as the transport sees it.
pub(crate) trait QueuePair {
    /// QP number.
    fn qpn(&self) -> u32;
    /// Initial send packet sequence number.
    fn psn(&self) -> u32;
    /// Inline data limit actually granted.
    fn max_inline(&self) -> u32;
    /// Send queue depth actually granted.
    fn max_send_wr(&self) -> u32;
}

/// A memory registration as the transport sees it.
pub(crate) trait MemoryRegion {
    /// Local key.
    fn lkey(&self) -> u32;
    /// Remote key.
    fn rkey(&self) -> u32;
}

/// An RDMA device as the verbs transport uses it.
///
/// # Safety
/// `poll_cq` returns at most `wcs.len()`, having written that many entries from the first:
/// [`super::dma::WcBatch`] reads them without checking again.
pub(crate) unsafe trait Nic: Send + Sync + 'static {
    /// Its queue pairs.
    type Qp: QueuePair + Send + Sync + 'static;
    /// Its completion queues.
    type Cq: Clone + Send + Sync + 'static;
    /// Its memory registrations (deregistered on drop).
    type Mr: MemoryRegion + Send + Sync + 'static;

    /// The port connections run on.
    fn local(&self) -> &LocalPort;
    /// The device's resource limits.
    fn limits(&self) -> DeviceLimits;
    /// What this process holds on the device now.
    fn held(&self) -> Held;
    /// A CQ with room for `entries` completions.
    fn create_cq(&self, entries: usize) -> Result<Self::Cq>;
    /// An RC QP on `cq`, in the INIT state with remote read and write allowed.
    fn create_qp(
        &self,
        cq: &Self::Cq,
        send_wr: u32,
        recv_wr: u32,
        max_inline: u32,
    ) -> Result<Self::Qp>;
    /// INIT -> RTR -> RTS towards `remote`.
    fn connect_qp(&self, qp: &Self::Qp, path: &QpPath, remote: &RemoteQp) -> Result<()>;
    /// Moves `qp` to the error state: nothing more is sent or placed through it, and its
    /// outstanding work requests complete as flushed.
    fn fail_qp(&self, qp: &Self::Qp) -> Result<()>;
    /// Registers `addr..addr+len` for local and remote read and write.
    fn register(&self, addr: usize, len: usize) -> Result<Self::Mr>;
    /// Posts a chain of send work requests (built by `SendChain`).
    fn post_send(&self, qp: &Self::Qp, wr: &mut ibv_send_wr) -> Result<()>;
    /// Posts one zero-SGE receive (a WRITE_WITH_IMM consumes one).
    fn post_recv(&self, qp: &Self::Qp, wr_id: u64) -> Result<()>;
    /// Polls up to `wcs.len()` completions; returns how many were written.
    fn poll_cq(&self, cq: &Self::Cq, wcs: &mut [MaybeUninit<ibv_wc>]) -> Result<usize>;
    /// [`Self::poll_cq`], `None` where it fails, without saying why: for a poll whose error
    /// the next `poll_cq` meets again and reports.
    fn try_poll_cq(&self, cq: &Self::Cq, wcs: &mut [MaybeUninit<ibv_wc>]) -> Option<usize> {
        self.poll_cq(cq, wcs).ok()
    }
    /// Reads pending asynchronous events; returns how many fatal ones were seen so far.
    fn drain_async_events(&self) -> u64;
    /// The fatal asynchronous event that breaks a comm polling `cq` with QPs `qpns`.
    fn fatal_for(&self, cq: &Self::Cq, qpns: &[u32]) -> Option<String>;
    /// `ibv_wc_status_str`.
    fn status_str(&self, status: u32) -> String;
    /// The port's nonzero hardware counters (`name=value ...`), where the device has any.
    fn counters(&self) -> Option<String> {
        None
    }
    /// Whether the port is active now (its link up), as last read at most
    /// [`PortWatch::EVERY`] ago: what tells a lost NIC healed.
    fn port_active(&self) -> bool;
    /// Whether connections may still move to this NIC.
    fn moves_here(&self) -> &MovesHere;
    /// Whether a connection may move to this NIC: no longer once a registration made for the
    /// connections that may move here failed here (the NIC is broken or out of registrations),
    /// so that no connection moves where its memory has no keys.
    fn takes_moves(&self) -> bool {
        !self.moves_here().refused.load(Ordering::Relaxed)
    }
    /// A registration for connections that may move here failed here: none moves here any
    /// more. Whether that is news.
    fn refuse_moves(&self) -> bool {
        !self.moves_here().refused.swap(true, Ordering::Relaxed)
    }
}

/// A port's state as last read: read again at most every [`PortWatch::EVERY`], so that every
/// comm that lost the NIC may ask at its own pace while the device is asked once per interval.
#[derive(Debug)]
pub(crate) struct PortWatch {
    since: Instant,
    /// Milliseconds after `since` of the last read, shifted left by one, with the state read
    /// in bit 0 (0: never read).
    last: AtomicU64,
}

impl Default for PortWatch {
    fn default() -> Self {
        PortWatch {
            since: Instant::now(),
            last: AtomicU64::new(0),
        }
    }
}

impl PortWatch {
    /// How stale a read may be.
    pub(crate) const EVERY: Duration = Duration::from_millis(50);

    /// Whether the port is active: as last read where that is recent, else as `read` says.
    pub(crate) fn active(&self, read: impl FnOnce() -> bool) -> bool {
        let now = self.since.elapsed().as_millis() as u64 + 1;
        let last = self.last.load(Ordering::Relaxed);
        if last != 0 && now.saturating_sub(last >> 1) < Self::EVERY.as_millis() as u64 {
            return last & 1 == 1;
        }
        let active = read();
        self.last
            .store(now << 1 | u64::from(active), Ordering::Relaxed);
        active
    }
}

/// Whether connections may move to a NIC: each NIC's one flag behind `Nic::takes_moves`.
#[derive(Debug, Default)]
pub(crate) struct MovesHere {
    refused: AtomicBool,
}

impl QueuePair for Qp {
    fn qpn(&self) -> u32 {
        Qp::qpn(self)
    }
    fn psn(&self) -> u32 {
        self.psn
    }
    fn max_inline(&self) -> u32 {
        self.max_inline
    }
    fn max_send_wr(&self) -> u32 {
        self.max_send_wr
    }
}

impl MemoryRegion for Mr {
    fn lkey(&self) -> u32 {
        Mr::lkey(self)
    }
    fn rkey(&self) -> u32 {
        Mr::rkey(self)
    }
}
