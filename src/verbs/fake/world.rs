//! The fake fabric's shared table: its NICs, QPs, CQs and registrations, and the work
//! requests it carries out (see the parent module for the semantics).

use std::collections::{HashMap, VecDeque};

use rdma_sys::*;

use crate::error::Error;

/// `IBV_WC_REM_ACCESS_ERR`.
pub(crate) const REMOTE_ACCESS_ERROR: u32 = ibv_wc_status::IBV_WC_REM_ACCESS_ERR;
/// `IBV_WC_RETRY_EXC_ERR`.
pub(crate) const RETRY_EXCEEDED: u32 = ibv_wc_status::IBV_WC_RETRY_EXC_ERR;
/// `IBV_WC_WR_FLUSH_ERR`.
pub(crate) const FLUSHED: u32 = ibv_wc_status::IBV_WC_WR_FLUSH_ERR;
pub(super) const LOCAL_PROTECTION_ERROR: u32 = ibv_wc_status::IBV_WC_LOC_PROT_ERR;

/// How a cut link behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cut {
    /// Work never completes: a device that retries for ever.
    Silent,
    /// Work fails with this `ibv_wc_status` (e.g. [`RETRY_EXCEEDED`]).
    Fail(u32),
    /// The link is down, as Soft-RoCE has it: work sent from the NIC fails with a local QP
    /// operation error, work sent to it runs out of retries, and a QP of the NIC cannot be
    /// brought up towards a peer (no route).
    Down,
    /// Every packet the NIC sends is dropped (`tc netem loss 100%` on its link, the port up):
    /// its own work never arrives; work sent to it lands, but its acknowledgements are lost,
    /// so that work never completes (the requester retries, and the NIC drops the
    /// duplicates). A read from it gets no response.
    Egress,
}

impl Cut {
    /// How the cut of the NIC that sends the work acts on it.
    fn here(self) -> Cut {
        match self {
            Cut::Down => Cut::Fail(ibv_wc_status::IBV_WC_LOC_QP_OP_ERR),
            Cut::Egress => Cut::Silent,
            c => c,
        }
    }

    /// How the cut of the NIC the work goes to acts on it.
    fn there(self) -> Cut {
        match self {
            Cut::Down => Cut::Fail(RETRY_EXCEEDED),
            c => c,
        }
    }
}

/// One posted send work request, as the fabric carries it out.
#[derive(Debug, Clone)]
pub(super) struct Op {
    pub(super) qpn: u32,
    pub(super) wr_id: u64,
    pub(super) opcode: u32,
    pub(super) signaled: bool,
    /// Local memory: (address, length, lkey).
    pub(super) local: (u64, u32, u32),
    /// Data copied at post time (IBV_SEND_INLINE).
    pub(super) inline: Option<Vec<u8>>,
    pub(super) remote: (u64, u32),
    /// Immediate, in network order as the work request carries it.
    pub(super) imm_be: u32,
    /// Bytes already placed by [`Fabric::place_partial`].
    pub(super) placed: usize,
    /// It landed at the responder, whose acknowledgement was lost ([`Cut::Egress`]): a
    /// retry places nothing again.
    pub(super) landed: bool,
    /// Since when the requester has retried it over a lossy link ([`Cut::Egress`]).
    pub(super) retried_since: Option<std::time::Instant>,
    /// Its place in its QP's send queue (see [`QpEntry::posted`]).
    pub(super) sq_seq: u64,
}

pub(super) struct QpEntry {
    pub(super) nic: usize,
    pub(super) cq: u32,
    pub(super) remote: Option<u32>,
    pub(super) recvs: VecDeque<u64>,
    pub(super) error: bool,
    /// The next work request fails with this status.
    pub(super) fail_next: Option<u32>,
    /// Send queue depth, and the send requests posted and retired so far: those in between
    /// occupy the queue.
    pub(super) send_depth: u64,
    pub(super) posted: u64,
    pub(super) retired: u64,
    /// Receive queue depth: `recvs` holds at most this many.
    pub(super) recv_depth: usize,
}

pub(super) struct MrEntry {
    pub(super) nic: usize,
    pub(super) addr: usize,
    pub(super) len: usize,
}

pub(super) struct NicEntry {
    pub(super) gid: [u8; 16],
    pub(super) cut: Option<Cut>,
    /// Work it sends is carried out but never completes: acknowledgements lost on the way
    /// back (the peer placed the data, the sender never learns it).
    pub(super) lose_acks: bool,
}

/// A completion queued on a CQ, with the send request it retires once polled: (QP, place
/// in its send queue).
pub(super) type Cqe = (ibv_wc, Option<(u32, u64)>);

/// A completion queue: what it holds, and how much it can.
pub(super) struct CqEntry {
    pub(super) queue: VecDeque<Cqe>,
    pub(super) capacity: usize,
    /// A completion found it full (and was lost).
    pub(super) overrun: bool,
}

#[derive(Default)]
pub(super) struct World {
    pub(super) nics: Vec<NicEntry>,
    pub(super) qps: HashMap<u32, QpEntry>,
    pub(super) mrs: HashMap<u32, MrEntry>,
    pub(super) cqs: HashMap<u32, CqEntry>,
    pub(super) queue: VecDeque<Op>,
    pub(super) hold: bool,
    pub(super) next_id: u32,
    /// Fatal asynchronous events: (NIC, QP or None for the whole device, description).
    pub(super) fatal: Vec<(usize, Option<u32>, String)>,
    /// Address ranges that are GPU memory.
    pub(super) device_memory: Vec<(usize, usize)>,
    /// The errno every CQ poll fails with, if any.
    pub(super) poll_errno: Option<i32>,
    /// QPs whose work waits (a lossy link retransmitting for a long time), while the rest of
    /// their NICs' work goes on.
    pub(super) slow: Vec<u32>,
    /// NICs whose QPs' destroy waits until released (Soft-RoCE waits up to 50 s for a QP's
    /// packets in flight on a link gone down).
    pub(super) destroys_held: Vec<usize>,
    /// Posts to a QP in the error state fail (`EIO`), as eRDMA's provider refuses them,
    /// instead of completing as flushed.
    pub(super) reject_posts_in_error: bool,
    /// NICs whose posts of send work wait (the caller's thread) until released, and how
    /// many posts have waited so far.
    pub(super) posts_paused: Vec<usize>,
    pub(super) posts_waited: u32,
    /// NICs whose receive completions wait in `late` until released.
    pub(super) late_nics: Vec<usize>,
    pub(super) late: Vec<(usize, u32, Cqe)>,
    /// How long a requester retries work over a lossy link ([`Cut::Egress`]) before it fails
    /// with a retry exceeded error; `None`: for ever.
    pub(super) retries_for: Option<std::time::Duration>,
    /// The NIC of each QP destroyed so far: a QP may still be brought up towards one (a
    /// real NIC does not ask the peer), and its work then finds nothing to answer it.
    pub(super) destroyed: HashMap<u32, usize>,
}

/// What happened to an op this pass.
pub(super) enum Outcome {
    Done,
    /// Cannot proceed yet (no receive posted, link silent): stays queued, blocks its QP.
    Wait,
}

impl World {
    pub(super) fn id(&mut self) -> u32 {
        self.next_id += 1;
        self.next_id
    }

    /// Queues `wc` on `cq`; `op`: the send request it completes, retired when it is polled.
    pub(super) fn complete(&mut self, cq: u32, wc: ibv_wc, op: Option<&Op>) {
        let nic = self.qps.get(&wc.qp_num).map(|q| q.nic);
        let is_recv = wc.opcode & ibv_wc_opcode::IBV_WC_RECV != 0;
        let cqe = (wc, op.map(|op| (op.qpn, op.sq_seq)));
        if let Some(nic) = nic.filter(|n| is_recv && self.late_nics.contains(n)) {
            self.late.push((nic, cq, cqe));
            return;
        }
        if let Some(q) = self.cqs.get_mut(&cq) {
            if q.queue.len() >= q.capacity {
                q.overrun = true;
            } else {
                q.queue.push_back(cqe);
            }
        }
    }

    pub(super) fn wc(wr_id: u64, status: u32, opcode: u32, qpn: u32) -> ibv_wc {
        // SAFETY: all-zero is a valid work completion.
        let mut wc: ibv_wc = unsafe { std::mem::zeroed() };
        wc.wr_id = wr_id;
        wc.status = status;
        wc.opcode = opcode;
        wc.qp_num = qpn;
        wc
    }

    pub(super) fn covers(&self, key: u32, nic: usize, addr: u64, len: usize) -> bool {
        len == 0
            || self.mrs.get(&key).is_some_and(|m| {
                m.nic == nic
                    && addr as usize >= m.addr
                    && (addr as usize).saturating_add(len) <= m.addr + m.len
            })
    }

    /// Fails `op` with `status`: its QP goes to the error state.
    pub(super) fn fail(&mut self, op: &Op, status: u32) {
        let Some(qp) = self.qps.get_mut(&op.qpn) else {
            return;
        };
        qp.error = true;
        let cq = qp.cq;
        let wc = Self::wc(op.wr_id, status, wc_opcode(op.opcode), op.qpn);
        self.complete(cq, wc, Some(op));
    }

    pub(super) fn execute(&mut self, op: &mut Op) -> Outcome {
        let Some(qp) = self.qps.get(&op.qpn) else {
            return Outcome::Done; // destroyed: its work is gone
        };
        let (nic, remote, error, fail_next) = (qp.nic, qp.remote, qp.error, qp.fail_next);
        if error {
            self.fail(op, FLUSHED);
            return Outcome::Done;
        }
        if let Some(status) = fail_next {
            self.qps.get_mut(&op.qpn).expect("present").fail_next = None;
            self.fail(op, status);
            return Outcome::Done;
        }
        if self.slow.contains(&op.qpn) {
            return Outcome::Wait;
        }
        let Some(rqpn) = remote else {
            self.fail(op, RETRY_EXCEEDED);
            return Outcome::Done;
        };
        let Some((rnic, responder_up)) = self.qps.get(&rqpn).map(|r| (r.nic, r.remote.is_some()))
        else {
            // The peer's QP is gone: nothing acknowledges, the retries run out.
            self.fail(op, RETRY_EXCEEDED);
            return Outcome::Done;
        };
        if !responder_up {
            // The peer's QP is not brought up yet: its NIC drops the packets, and the
            // requester retries until it is.
            return Outcome::Wait;
        }
        let lossy = [nic, rnic]
            .iter()
            .any(|&n| self.nics[n].cut == Some(Cut::Egress));
        if lossy && self.retries_ran_out(op) {
            self.fail(op, RETRY_EXCEEDED);
            return Outcome::Done;
        }
        let cut = self.nics[nic].cut.map(Cut::here);
        let unacknowledged = match cut.or(self.nics[rnic].cut.map(Cut::there)) {
            Some(Cut::Silent) => return Outcome::Wait,
            Some(Cut::Fail(status)) => {
                self.fail(op, status);
                return Outcome::Done;
            }
            Some(Cut::Egress) if op.opcode == ibv_wr_opcode::IBV_WR_RDMA_READ => {
                return Outcome::Wait
            }
            Some(Cut::Egress) => true,
            Some(Cut::Down) | None => false,
        };
        if op.landed {
            if unacknowledged {
                return Outcome::Wait;
            }
            return self.acknowledge(op, nic);
        }
        let len = op.local.1 as usize;
        let (laddr, lkey) = (op.local.0, op.local.2);
        if op.inline.is_none() && !self.covers(lkey, nic, laddr, len) {
            self.fail(op, LOCAL_PROTECTION_ERROR);
            return Outcome::Done;
        }
        if !self.covers(op.remote.1, rnic, op.remote.0, len) {
            self.fail(op, REMOTE_ACCESS_ERROR);
            return Outcome::Done;
        }
        let with_imm = op.opcode == ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
        if with_imm && self.qps[&rqpn].recvs.is_empty() {
            return Outcome::Wait;
        }
        if op.opcode == ibv_wr_opcode::IBV_WR_RDMA_READ {
            copy(
                op.remote.0 as usize + op.placed,
                laddr as usize + op.placed,
                len - op.placed,
            );
        } else {
            match &op.inline {
                Some(data) => copy_from(&data[op.placed..], op.remote.0 as usize + op.placed),
                None => copy(
                    laddr as usize + op.placed,
                    op.remote.0 as usize + op.placed,
                    len - op.placed,
                ),
            }
        }
        op.placed = len;
        if with_imm {
            let r = self.qps.get_mut(&rqpn).expect("checked above");
            let recv_id = r.recvs.pop_front().expect("checked above");
            let rcq = r.cq;
            let mut wc = Self::wc(recv_id, 0, ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM, rqpn);
            wc.wc_flags = ibv_wc_flags::IBV_WC_WITH_IMM.0;
            wc.imm_data_invalidated_rkey_union.imm_data = op.imm_be;
            wc.byte_len = len as u32;
            self.complete(rcq, wc, None);
        }
        if unacknowledged {
            op.landed = true;
            return Outcome::Wait;
        }
        self.acknowledge(op, nic)
    }

    /// Whether the requester of `op`, retrying it over a lossy link, has run out of retries
    /// ([`Self::retries_for`]); its retries are timed from the first call.
    fn retries_ran_out(&self, op: &mut Op) -> bool {
        let Some(bound) = self.retries_for else {
            return false;
        };
        let since = *op.retried_since.get_or_insert_with(std::time::Instant::now);
        since.elapsed() >= bound
    }

    /// `op`, of a QP of `nic`, was carried out: its completion, where it asks for one.
    fn acknowledge(&mut self, op: &Op, nic: usize) -> Outcome {
        if op.signaled && !self.nics[nic].lose_acks {
            let cq = self.qps[&op.qpn].cq;
            let wc = Self::wc(op.wr_id, 0, wc_opcode(op.opcode), op.qpn);
            self.complete(cq, wc, Some(op));
        }
        Outcome::Done
    }

    /// Carries out queued work in order, each QP's in its own order; returns how many ops
    /// ran. Stops early at `limit`.
    pub(super) fn deliver(&mut self, limit: usize) -> usize {
        let mut ran = 0;
        let mut blocked: Vec<u32> = Vec::new();
        let mut i = 0;
        while i < self.queue.len() && ran < limit {
            let qpn = self.queue[i].qpn;
            if blocked.contains(&qpn) {
                i += 1;
                continue;
            }
            let mut op = self.queue[i].clone();
            match self.execute(&mut op) {
                Outcome::Done => {
                    self.queue.remove(i);
                    ran += 1;
                }
                Outcome::Wait => {
                    self.queue[i] = op;
                    blocked.push(qpn);
                    i += 1;
                }
            }
        }
        ran
    }
}

pub(super) fn wc_opcode(wr_opcode: u32) -> u32 {
    if wr_opcode == ibv_wr_opcode::IBV_WR_RDMA_READ {
        ibv_wc_opcode::IBV_WC_RDMA_READ
    } else {
        ibv_wc_opcode::IBV_WC_RDMA_WRITE
    }
}

/// A post refused because the QP is in the error state (eRDMA's provider).
pub(super) fn in_error(call: &str, qpn: u32) -> Error {
    Error::io(
        format!("fake fabric: {call}(qp {qpn}): QP in error"),
        std::io::Error::from_raw_os_error(libc::EIO),
    )
}

pub(super) fn copy(from: usize, to: usize, len: usize) {
    if len > 0 {
        // SAFETY: both ranges were checked against live registrations, whose owners keep the
        // memory valid while registered (the contract of a real NIC too); ranges of one
        // registration may overlap, hence `copy` rather than `copy_nonoverlapping`.
        unsafe { std::ptr::copy(from as *const u8, to as *mut u8, len) };
    }
}

pub(super) fn copy_from(data: &[u8], to: usize) {
    // SAFETY: the target range was checked against a live registration.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), to as *mut u8, data.len()) };
}
