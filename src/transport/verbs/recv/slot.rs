//! What a receive comm keeps of each receive slot and each flush: the receive posted, the
//! writes still to land in it; a flush's reads still to complete.

use crate::transport::verbs::gate::RecvGate;
use crate::transport::MAX_RECVS;
use crate::verbs::nic::Nic;

/// A receive's QPs: (first, how many), and its sequence number (which rotates its pieces).
pub(super) type QpSpan = (usize, usize, u64);

#[derive(Debug, Clone, Copy)]
pub(super) struct RecvSlot {
    /// Posted and not yet reported done.
    pub(super) busy: bool,
    pub(super) n: usize,
    /// WRITE_WITH_IMMs still to come (one per QP the receive uses): when the last arrives,
    /// the gate learns the receive no longer waits.
    pub(super) imm_pending: u32,
    /// The size of a single receive, from its immediate.
    pub(super) size0: u32,
    /// The QPs it uses (for the rails' counters, and to post it again after a move).
    pub(super) span: QpSpan,
    /// Each buffer's registration handle: its keys are looked up again after a move.
    pub(super) mhandles: [u64; MAX_RECVS],
}

impl RecvSlot {
    pub(super) const FREE: RecvSlot = RecvSlot {
        busy: false,
        n: 0,
        imm_pending: 0,
        size0: 0,
        span: (0, 0, 0),
        mhandles: [0; MAX_RECVS],
    };
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FlushSlot {
    Free,
    /// Reads (one per rail) still to complete.
    Pending(u32),
    Done,
}

/// One of a flush's reads completed.
pub(super) fn flushed(f: &mut FlushSlot) {
    *f = match *f {
        FlushSlot::Pending(n) if n > 1 => FlushSlot::Pending(n - 1),
        _ => FlushSlot::Done,
    };
}

/// A sender's WRITE_WITH_IMM (immediate `imm`) landed in receive `slot`, `st`.
#[inline(always)]
pub(super) fn landed<N: Nic>(st: &mut RecvSlot, gate: &RecvGate<N>, slot: usize, imm: u32) {
    if st.n == 1 {
        st.size0 = imm;
    }
    if st.imm_pending > 1 {
        st.imm_pending -= 1;
    } else {
        st.imm_pending = 0;
        gate.arrived(slot);
    }
}
