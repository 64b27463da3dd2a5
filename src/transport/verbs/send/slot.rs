//! What a send comm keeps of each receive slot: the sends matched to it, posted, done; and
//! which slots a move sends again.

use crate::transport::{MAX_RAILS, MAX_RECVS};

/// The sends matched to one receive slot.
#[derive(Debug, Clone, Copy)]
pub(super) struct SendSlot {
    pub(super) busy: bool,
    /// One bit per buffer of the receive.
    pub(super) all: u8,
    pub(super) matched: u8,
    pub(super) tested: u8,
    pub(super) cqe_pending: u32,
    pub(super) posted: bool,
    pub(super) sizes: [usize; MAX_RECVS],
    pub(super) addrs: [u64; MAX_RECVS],
    /// Each send's registration handle: its keys are looked up again after a move.
    pub(super) mhandles: [u64; MAX_RECVS],
    /// Each send's local key on each rail of the connection.
    pub(super) lkeys: [[u32; MAX_RAILS]; MAX_RECVS],
    /// Bytes the receive's first buffer holds, which decides striping (both ends know it
    /// from the first entry).
    pub(super) room: usize,
    pub(super) trunc: u8,
    /// Entries whose buffer is not host memory (GPU memory registered for GPUDirect).
    pub(super) device_mem: u8,
}

impl SendSlot {
    pub(super) const FREE: SendSlot = SendSlot {
        busy: false,
        all: 0,
        matched: 0,
        tested: 0,
        cqe_pending: 0,
        posted: false,
        sizes: [0; MAX_RECVS],
        addrs: [0; MAX_RECVS],
        mhandles: [0; MAX_RECVS],
        lkeys: [[0; MAX_RAILS]; MAX_RECVS],
        room: 0,
        trunc: 0,
        device_mem: 0,
    };

    pub(super) fn start(&mut self, n: usize) {
        // Only the bookkeeping is reset: the per-message arrays are written as each send
        // matches, and only the first n are read.
        self.busy = true;
        self.all = ((1u16 << n) - 1) as u8;
        self.matched = 0;
        self.tested = 0;
        self.cqe_pending = 0;
        self.posted = false;
        self.trunc = 0;
        self.device_mem = 0;
    }

    /// Every buffer of the receive has its send.
    pub(super) fn complete(&self) -> bool {
        self.matched == self.all
    }

    /// The slot's writes are all done.
    pub(super) fn done(&self) -> bool {
        self.posted && self.cqe_pending == 0
    }

    /// Messages of the slot's receive.
    pub(super) fn n(&self) -> usize {
        self.all.count_ones() as usize
    }

    /// The most bytes a write of this slot may carry inline, given the QP's limit. Inline
    /// data is copied by the CPU at post time, so nothing is inlined when a buffer of the
    /// slot is GPU memory: the CPU cannot read a device address (NCCL's IB transport never
    /// inlines data either).
    pub(super) fn max_inline(&self, qp_limit: u32) -> u32 {
        if self.device_mem == 0 {
            qp_limit
        } else {
            0
        }
    }
}

/// Slots (bits) to send again after a move: whole, or only their immediate (and size
/// record), where this end saw the data acknowledged but the receiver had not seen it land.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Replay {
    pub(super) whole: u32,
    pub(super) landed: u32,
}

impl Replay {
    pub(super) fn is_empty(&self) -> bool {
        self.whole | self.landed == 0
    }
}
