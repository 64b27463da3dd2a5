//! The receiving side of a verbs connection: `irecv` posts one receive per QP the request
//! will use and announces its buffers to the sender with clear-to-send entries; `test`
//! reports the request done when every QP's WRITE_WITH_IMM has arrived, with each message's
//! size (from the immediate for a single receive, from the size record for a group).
//!
//! Clear-to-send batching (`NCCL_ERDMA_CTS_BATCH` > 1): while the caller keeps testing its
//! receives and the sender still holds at least [`CTS_HOLD_MIN`] announced ones, entries are
//! held back and go out together, up to the batch, in one RDMA write per run of slots. A
//! receive the caller tests while its entry is held sends everything held at once, so no
//! receive ever waits on batching.
//!
//! A `test` of a receive whose data has not come takes no lock: the comm's [`RecvGate`]
//! answers it (`gate.rs`), and it is also the one record of which receives wait.
//!
//! `iflush` (GPUDirect): on each rail, a 1-byte RDMA READ through a QP connected to itself,
//! which completes only after the NIC's earlier writes to GPU memory are visible.
//!
//! A fault on a rail a move can mend moves the connection (`moving`, see `failover`): the
//! receiver's completions decide what the sender sends again; meanwhile every call locks, and
//! afterwards the gate polls the new rails' CQs. Closing, the receiver tells the sender how
//! many of its receives had landed (`Bye`), so that sends whose data came complete there.

#[cfg(test)]
mod inspect;
mod moving;
mod slot;

use parking_lot::Mutex;

use super::bringup::{Bringup, Probes};
use super::budget::RECEIVER_SEND_DEPTH;
use super::failover::{Mobility, Moving};
use super::fault::{Cause, Fault};
use super::gate::{GatePoll, RecvGate};
use super::peer::PeerLink;
use super::rail::{self, Rail};
use super::wire::{
    cts_index, locate, modulo, piece, CtsEntry, QpPlan, WrKind, CTS_BYTES, SLOTS, TRUNCATED,
};
use crate::buffer::UserBuffer;
use crate::error::{Error, Result};
use crate::transport::{
    not_in_flight, CommKeys, Endpoint, Failure, MemKeys, Receiver, SizeSink, Tested, Traffic,
    MAX_RAILS, MAX_RECVS,
};
use crate::verbs::device::VerbsDevice;
use crate::verbs::dma::{DmaBuffer, FixedWrite, SendChain, WcBatch, WC_RECV_RDMA_WITH_IMM};
use crate::verbs::nic::{Nic, QueuePair};

use slot::{flushed, landed, FlushSlot, RecvSlot};

/// A rail whose CQ the gate polled, finding completions (of the gate's generation `.1`), and
/// the batch holding them.
type Found<'a> = Option<(usize, u32, &'a mut WcBatch)>;

/// Clear-to-send entries are held back (to be posted together) only while the sender holds
/// at least this many posted receives it can fill.
pub(crate) const CTS_HOLD_MIN: u64 = 2;
/// Every this many clear-to-send writes one is signaled, which retires the unsignaled ones
/// before it; errors complete regardless. Each signaled one costs a completion to poll and
/// hand out, in whichever `test` comes next.
const CTS_SIGNAL_EVERY: u32 = SLOTS as u32 / 2;
const _: () = assert!(CTS_SIGNAL_EVERY.is_power_of_two());
// The first QP's send queue holds every receive's clear-to-send and the unsignaled ones.
const _: () = assert!(RECEIVER_SEND_DEPTH >= SLOTS as u32 + CTS_SIGNAL_EVERY + 8);
/// Request ids of flushes start here (receives are 0..32).
pub(crate) const FLUSH_ID_BASE: usize = SLOTS;

/// Where the receiver is in a move (`moving`; the protocol is in `failover`).
enum Movement {
    /// Carrying data on its rails.
    Still,
    /// It stopped its QPs after a fault it saw, said `Down`, and waits for the offer.
    Down(Moving),
    /// It answered the offer with its new rails, which the sender may already write into;
    /// its `Resume` (with the probe QPs these come up against) is awaited.
    Answered(Moving, Box<Probes>),
}

/// The rails a move left, kept until the reads through their loopback flush QPs (flushes
/// posted before the move, and one that orders every write the dead NIC placed ahead of any
/// later flush) have completed, with the registrations those reads use.
struct Draining<N: Nic> {
    rails: Vec<Rail<N>>,
    /// Held until the rails go: the reads land there.
    _regs: OldRegs<N>,
    /// Ordering reads still to complete; flush slots (bits) whose reads were posted there;
    /// how long they are waited for.
    reads: u32,
    flushing: u32,
    until: std::time::Instant,
}

/// The comm's buffers' registrations on the NICs a move left: clear-to-send staging, size
/// records, flush target, one per old rail each.
struct OldRegs<N: Nic> {
    flush: Vec<N::Mr>,
    /// The clear-to-send staging's and the size records', held until the rails go.
    _others: [Vec<N::Mr>; 2],
}

/// Everything a receive comm owns.
pub(crate) struct RecvState<N: Nic> {
    // Field order is teardown order: QPs (in the rails) before the memory they use.
    pub(crate) rails: Vec<Rail<N>>,
    cts_local: DmaBuffer<CtsEntry, N::Mr>,
    pub(crate) sizes_record: DmaBuffer<u32, N::Mr>,
    /// Where flush and probe reads land.
    flush_target: DmaBuffer<u64, N::Mr>,
    /// The sender's clear-to-send FIFO: address and key on each of its rails.
    remote_fifo: (u64, [u32; MAX_RAILS]),
    plan: QpPlan,
    /// Sequence number of the next receive.
    pub(crate) seq: u64,
    slots: [RecvSlot; SLOTS],
    flush_slots: [FlushSlot; SLOTS],
    /// The flush slot tried first by the next `iflush`.
    flush_next: usize,
    /// Most clear-to-send entries held back before they are posted in one write.
    cts_batch: u64,
    /// Sequence number of the first receive whose clear-to-send is not posted yet.
    cts_posted: u64,
    /// Receives finished (reported done by `test`): of the receives posted, `seq - finished`
    /// are still waiting, and of those announced, `cts_posted - finished`.
    finished: u64,
    /// Clear-to-send writes posted unsignaled since the last signaled one.
    cts_unsignaled: u32,
    /// A receive was tested since the last `irecv`: the caller polls its receives (NCCL's
    /// proxy tests its oldest one on every pass), so entries held back now will be posted
    /// by a later `test`. Receives posted back to back are announced at once.
    polled: bool,
    /// The gate's count of tests it looked at, as the last `irecv` saw it: when it has moved
    /// since, the caller tested (without the lock), which counts as [`Self::polled`].
    looks_seen: u32,
    /// Clear-to-send writes posted, for the comm's summary (with the receives they
    /// announced, `cts_posted`).
    cts_writes: u64,
    chain: SendChain,
    /// Clear-to-send writes: from `cts_local` to the sender's FIFO over rail 0.
    cts_write: FixedWrite,
    /// Where NCCL's handles are looked up.
    keys: CommKeys,
    failure: Failure,
    traffic: Traffic,
    /// The bootstrap connection: the peer's moves, its exit.
    link: PeerLink,
    /// Where the connection may move.
    mobility: Mobility<N>,
    movement: Movement,
    /// Each flush's buffer (address, handle), to post it again after a move.
    flush_of: [(u64, u64); SLOTS],
    /// The rails the last move left, until their flush reads are done.
    draining: Option<Draining<N>>,
    /// A rail failed under this comm: its QPs go to the reaper at close.
    broken: bool,
    /// This end's rails of the sender's trial of the path a move back would take, and until
    /// when they are kept (`trial`).
    trial: Option<(Bringup<N>, std::time::Instant)>,
}

impl<N: Nic> RecvState<N> {
    /// A comm over connected `rails` (with flush QPs, when GPUDirect may be used).
    #[allow(clippy::too_many_arguments)] // what setup made, in teardown order
    pub(crate) fn new(
        rails: Vec<Rail<N>>,
        cts_local: DmaBuffer<CtsEntry, N::Mr>,
        sizes_record: DmaBuffer<u32, N::Mr>,
        flush_target: DmaBuffer<u64, N::Mr>,
        remote_fifo: (u64, [u32; MAX_RAILS]),
        plan: QpPlan,
        cts_batch: u32,
        link: PeerLink,
        keys: CommKeys,
        mobility: Mobility<N>,
    ) -> Self {
        let cts_write = FixedWrite::new(cts_local.lkey(0), remote_fifo.1[0]);
        RecvState {
            rails,
            cts_local,
            sizes_record,
            flush_target,
            remote_fifo,
            plan,
            seq: 0,
            slots: [RecvSlot::FREE; SLOTS],
            flush_slots: [FlushSlot::Free; SLOTS],
            flush_next: 0,
            cts_batch: u64::from(cts_batch.clamp(1, SLOTS as u32)),
            cts_posted: 0,
            finished: 0,
            cts_unsignaled: 0,
            polled: false,
            looks_seen: 0,
            cts_writes: 0,
            chain: SendChain::new(),
            cts_write,
            keys,
            failure: Failure::default(),
            traffic: Traffic::default(),
            link,
            mobility,
            movement: Movement::Still,
            flush_of: [(0, 0); SLOTS],
            draining: None,
            broken: false,
            trial: None,
        }
    }

    /// Whether the connection carries data on its rails (no move under way).
    #[inline]
    fn still(&self) -> bool {
        matches!(self.movement, Movement::Still)
    }

    /// Whether the comm has work only a locked call does: a clear-to-send held back, a
    /// failure (its own, or the peer gone) to report, a move to step. The gate answers no test
    /// then.
    fn needs_lock(&self) -> bool {
        self.cts_posted != self.seq || self.lost() || !self.still()
    }

    /// Whether this end is up and answered the setup, and the sender is not up yet (its
    /// `Resume` has not come): receives are posted on the rails, which are this end's for
    /// good, but their clear-to-send entries wait, as the sender's QPs may not take a write
    /// yet. A rank may post receives before its peer makes any call (NCCL's ranks, or one
    /// thread driving both ends, do), so waiting here for the sender would never end.
    fn awaits_sender_up(&self) -> bool {
        matches!(&self.movement, Movement::Answered(m, _) if m.is_setup())
    }

    /// Whether the comm has failed or its peer is gone: a receive still waiting never ends.
    fn lost(&self) -> bool {
        self.failure.is_set() || self.link.ended().is_some()
    }

    /// `irecv`: the request id is the slot.
    #[inline(always)]
    fn irecv(
        &mut self,
        gate: &RecvGate<N>,
        bufs: &[UserBuffer],
        tags: &[i32],
        mhandles: &[u64],
    ) -> Result<Option<usize>> {
        if gate.lock_is_wanted() {
            // Failed, the peer gone, moving (or only a clear-to-send held). No CQ poll here:
            // `test` polls, and a free slot depends only on `test`.
            self.failure.check()?;
            if let Some(gone) = self.link.ended() {
                let e = gone.error.clone();
                return Err(self.failure.fail(e));
            }
            // The peer's messages may end the move (or the setup): NCCL may call nothing
            // else before its receives are posted.
            if !self.still() {
                let moving = self.step_move(gate);
                if self.failure.record(moving)? && !self.awaits_sender_up() {
                    // Posted after the move, on the new rails.
                    return Ok(None);
                }
            }
        }
        let slot = (self.seq % SLOTS as u64) as usize;
        if self.slots[slot].busy {
            return Ok(None);
        }
        let looks = gate.looks();
        if looks != self.looks_seen {
            // Tested since the last irecv, without the lock.
            self.looks_seen = looks;
            self.polled = true;
        }
        // A handle that does not cover its buffer fails the call, not the comm: nothing is
        // posted before every key is known.
        self.announce(slot, bufs, tags, mhandles)?;
        let r = self.post_receive(gate, slot, bufs);
        self.polled = false;
        if let Err(e) = r {
            // Not posted (a move began, or the comm failed): NCCL asks again.
            let r = self.post_failed(gate, e);
            self.failure.record(r)?;
            return Ok(None);
        }
        Ok(Some(slot))
    }

    /// Writes free `slot`'s clear-to-send entries, one per buffer (into local memory: the
    /// sender sees them once posted), with the keys of their handles `mhandles`.
    #[inline(always)]
    fn announce(
        &mut self,
        slot: usize,
        bufs: &[UserBuffer],
        tags: &[i32],
        mhandles: &[u64],
    ) -> Result<()> {
        let n = bufs.len();
        for i in 0..n {
            let mem = self.keys.keys(mhandles[i], bufs[i])?;
            // All of them, as the registration holds them: the sender reads those of this
            // comm's rails.
            let (addr, len) = (bufs[i].addr() as u64, bufs[i].len());
            let entry = CtsEntry::new(addr, len, mem.rkeys, tags[i], n, self.seq);
            self.cts_local.set(cts_index(slot, i), entry);
            self.slots[slot].mhandles[i] = mhandles[i];
        }
        Ok(())
    }

    /// Posts receive `slot` (announced) on the QPs it uses, then its clear-to-send unless
    /// held back.
    #[inline(always)]
    fn post_receive(&mut self, gate: &RecvGate<N>, slot: usize, bufs: &[UserBuffer]) -> Result<()> {
        // The sender decides from the first entry's size, saturated as the entry holds it.
        let posted = bufs[0].len().min(u32::MAX as usize);
        let (first_qp, used) = self.plan.qps(self.seq, posted);
        let wr_id = WrKind::Recv.id(slot);
        for q in first_qp..first_qp + used {
            let (r, i) = locate(q, self.rails.len());
            let rail = &self.rails[r];
            rail.nic.post_recv(&rail.qps[i], wr_id)?;
        }
        let st = &mut self.slots[slot];
        st.busy = true;
        st.n = bufs.len();
        st.imm_pending = used as u32;
        st.size0 = 0;
        st.span = (first_qp, used, self.seq);
        gate.posted(slot);
        self.seq += 1;
        // Held back while the sender holds enough to work on and the caller polls its
        // receives, up to the batch size: one RDMA write (and, on Soft-RoCE, one system
        // call) then announces several receives.
        let pending = self.seq - self.cts_posted;
        if pending >= self.cts_batch || self.announced() < CTS_HOLD_MIN || !self.polled {
            if let Err(e) = self.post_pending_cts() {
                // The receive is posted; its clear-to-send goes after the move (or the comm
                // failed).
                let r = self.post_failed(gate, e);
                self.failure.record(r)?;
            }
        }
        Ok(())
    }

    /// `test` of receive or flush request `id`; `found`: the gate polled this rail's CQ into
    /// this batch, which holds completions.
    #[inline(always)]
    fn test(
        &mut self,
        gate: &RecvGate<N>,
        id: usize,
        sizes: &mut impl SizeSink,
        found: Found<'_>,
    ) -> Tested {
        let r = self.test_receive(gate, id, sizes, found);
        gate.lock_wanted(self.needs_lock());
        r
    }

    /// [`Self::test`], before the gate learns whether the comm needs the lock.
    #[inline(always)]
    fn test_receive(
        &mut self,
        gate: &RecvGate<N>,
        id: usize,
        sizes: &mut impl SizeSink,
        found: Found<'_>,
    ) -> Tested {
        // Drained whatever becomes of the request: the completions are off the CQ. (Polled
        // from rails a move has since replaced only where two threads drive one comm, which
        // NCCL never does: then they are the dead rails', and nothing of theirs counts.)
        let drained = found
            .filter(|&(_, generation, _)| generation == gate.generation())
            .map(|(rail, _, wc)| {
                self.rails[rail].cq.polled_unlocked(wc);
                match self.drain_rail(gate, rail, wc) {
                    Ok(false) => Ok(()),
                    Ok(true) if rail == 0 => self.checked(gate),
                    Ok(true) => Ok(()),
                    Err(f) => self.on_fault(gate, f),
                }
            });
        if !self.slots.get(id).is_some_and(|st| st.busy) {
            if let Some(r) = drained {
                let _ = self.failure.record(r);
            }
            return self.test_flush(gate, id).into();
        }
        self.polled = true;
        // The CQ is polled only for a receive still waiting.
        let r = match drained {
            Some(r) => r,
            None if gate.waits(id) => self.progress(gate),
            None => Ok(()),
        };
        let _ = self.failure.record(r);
        // A receive still waiting needs its clear-to-send at the sender, and the sender
        // should keep holding a few.
        if self.cts_posted != self.seq && (self.cts_held(id) || self.announced() < CTS_HOLD_MIN) {
            let r = self.post_pending_cts();
            if let Err(e) = self.failure.record(r) {
                return Tested::Failed(e);
            }
        }
        if !gate.waits(id) {
            return self.finish_receive(id, sizes);
        }
        if self.lost() {
            return self.receive_lost(gate, id, sizes);
        }
        Tested::Pending
    }

    /// Receive `id` has not finished and the comm failed or the peer is gone.
    #[cold]
    fn receive_lost(&mut self, gate: &RecvGate<N>, id: usize, sizes: &mut impl SizeSink) -> Tested {
        if let Err(e) = self.failure.check() {
            return Tested::Failed(e);
        }
        // Completions the peer caused before it left are already in the CQ: look once more
        // before calling the request lost.
        let r = self.progress(gate);
        let _ = self.failure.record(r);
        if gate.waits(id) {
            let e = match self.link.ended() {
                Some(gone) => gone.error.clone(),
                None => Error::remote(format!("peer {} is gone", self.link.peer())),
            };
            return Tested::Failed(self.failure.fail(e));
        }
        self.finish_receive(id, sizes)
    }

    /// Frees receive `id`, whose data has all arrived, and reports its sizes.
    #[inline(always)]
    fn finish_receive(&mut self, id: usize, sizes: &mut impl SizeSink) -> Tested {
        // Freed by its flag alone: `post_receive` writes the whole slot at its next use.
        let st = &mut self.slots[id];
        st.busy = false;
        let (n, size0, (first, used, _)) = (st.n, st.size0, st.span);
        self.finished += 1;
        let mut bytes = 0;
        for i in 0..n {
            // A single receive's size came in its immediate, a group's in the size record.
            let size = if n == 1 {
                size0
            } else {
                self.sizes_record.get(cts_index(id, i))
            };
            if size == TRUNCATED {
                // The sender's comm failed, so nothing more comes: this one fails too.
                let e = self.truncated();
                return Tested::Failed(self.failure.fail(e));
            }
            sizes.set(i, size);
            bytes += u64::from(size);
        }
        self.traffic.add(n, bytes);
        if used == 1 {
            let rail = modulo(first, self.rails.len());
            let stats = &mut self.rails[rail].stats;
            stats.bytes += bytes;
            stats.messages += u64::from(bytes > 0);
        } else {
            self.count_pieces(id);
        }
        Tested::Done(n)
    }

    /// The error of a receive the sender found too small for its message.
    #[cold]
    fn truncated(&self) -> Error {
        Error::truncated(format!(
            "{} sent more bytes than the receive posted for them",
            self.link.peer()
        ))
    }

    /// Adds receive `id`, striped or split over the QPs of its span, to the counters of the
    /// rails its pieces came on (the sender cut them as `post_slot` does).
    fn count_pieces(&mut self, id: usize) {
        let st = self.slots[id];
        let (first, used, seq) = st.span;
        let mut sizes = [st.size0; MAX_RECVS];
        if st.n > 1 {
            for (i, size) in sizes[..st.n].iter_mut().enumerate() {
                *size = self.sizes_record.get(cts_index(id, i));
            }
        }
        let sizes = &sizes[..st.n];
        let rails = self.rails.len();
        for k in 0..used {
            let q = self.plan.qp_of_piece(seq, first, used, k);
            let bytes: u64 = sizes
                .iter()
                .map(|s| piece(*s as usize, k, used).1 as u64)
                .sum();
            let stats = &mut self.rails[modulo(q, rails)].stats;
            stats.bytes += bytes;
            stats.messages += u64::from(bytes > 0);
        }
    }

    /// `iflush` of the last non-empty buffer, on every rail; `Ok(None)` when there is nothing
    /// to flush.
    fn iflush(&mut self, bufs: &[UserBuffer], mhandles: &[u64]) -> Result<Option<usize>> {
        self.failure.check()?;
        if self.rails[0].flush_qp.is_none() {
            return Ok(None);
        }
        let Some(last) = (0..bufs.len()).rev().find(|&i| !bufs[i].is_empty()) else {
            return Ok(None);
        };
        let mem = *self.keys.keys(mhandles[last], bufs[last])?;
        // NULL would tell NCCL "no flush needed" and it would not retry, so a busy slot
        // (a flush of another sub still untested) means taking the next free one. NCCL keeps
        // at most 32 requests in flight per comm, so one is free unless the caller broke that.
        let Some(fslot) = (0..SLOTS)
            .map(|k| (self.flush_next + k) % SLOTS)
            .find(|&f| self.flush_slots[f] == FlushSlot::Free)
        else {
            return Err(too_many_flushes());
        };
        let addr = bufs[last].addr() as u64;
        // While the connection moves its QPs are stopped: the flush is posted once it is over
        // (and a NULL here would tell NCCL none is needed).
        let posted = if self.still() {
            match self.post_flush(fslot, addr, &mem) {
                Ok(posted) => posted,
                Err(e) => {
                    self.failure.record(Err(e))?;
                    0
                }
            }
        } else {
            0
        };
        self.flush_slots[fslot] = FlushSlot::Pending(posted);
        self.flush_of[fslot] = (addr, mhandles[last]);
        self.flush_next = (fslot + 1) % SLOTS;
        Ok(Some(FLUSH_ID_BASE + fslot))
    }

    /// Posts flush `fslot` of the buffer at `addr` (keys `mem`) on every rail's flush QP;
    /// returns how many reads were posted.
    fn post_flush(&mut self, fslot: usize, addr: u64, mem: &MemKeys) -> Result<u32> {
        let mut posted = 0;
        for (r, rail) in self.rails.iter_mut().enumerate() {
            let Some(flush_qp) = &rail.flush_qp else {
                continue;
            };
            self.chain.clear();
            let target = (self.flush_target.addr(0), self.flush_target.lkey(r));
            self.chain.read(target.0, 1, target.1, addr, mem.rkey(r));
            self.chain.finish(WrKind::Flush.id(fslot), 0);
            self.chain.post(&*rail.nic, flush_qp)?;
            let qpn = flush_qp.qpn();
            rail.signaled(qpn, WrKind::Flush.id(fslot));
            posted += 1;
        }
        Ok(posted)
    }

    /// `test` of flush request `id` (a receive not in flight is NCCL's error).
    fn test_flush(&mut self, gate: &RecvGate<N>, id: usize) -> Result<Option<usize>> {
        let Some(f) = id.checked_sub(FLUSH_ID_BASE) else {
            return Err(not_in_flight("receive", id));
        };
        if matches!(self.flush_slots.get(f), Some(FlushSlot::Pending(_))) || self.draining.is_some()
        {
            let r = self.progress(gate);
            let _ = self.failure.record(r);
            self.drain_old();
        }
        match self.flush_slots.get(f) {
            // Reported done only once the reads that order a dead NIC's writes are in.
            Some(FlushSlot::Done) if self.draining.is_some() => Ok(None),
            Some(FlushSlot::Done) => {
                self.flush_slots[f] = FlushSlot::Free;
                Ok(Some(0))
            }
            Some(FlushSlot::Pending(_)) => self.failure.check().map(|()| None),
            _ => Err(not_in_flight("flush", f)),
        }
    }

    /// Receives whose clear-to-send is posted and that have not finished. (Data arrives only
    /// for a receive announced, so no receive finishes before its clear-to-send is posted.)
    fn announced(&self) -> u64 {
        self.cts_posted - self.finished
    }

    /// Whether busy receive `slot`'s clear-to-send is still held back: it is among the last
    /// `seq - cts_posted` receives posted.
    fn cts_held(&self, slot: usize) -> bool {
        let held = (self.seq - self.cts_posted) as usize;
        (slot + SLOTS - (self.cts_posted % SLOTS as u64) as usize) % SLOTS < held
    }

    /// Posts every clear-to-send held back, in FIFO order: one RDMA WRITE per contiguous run
    /// of slots (whole slots, then the last slot's entries; the sender reads only the entries
    /// a slot announces, each checked by its sequence number). Not while the connection
    /// moves: its QPs are stopped (eRDMA refuses a post there), and the answer announces
    /// every receive posted; nor before the sender is up.
    #[inline(always)]
    fn post_pending_cts(&mut self) -> Result<()> {
        if !self.still() {
            return Ok(());
        }
        let first = (self.cts_posted % SLOTS as u64) as usize;
        if self.seq - self.cts_posted == 1 {
            // The receive just posted (every receive, at the hardware default of no batching).
            return self.post_cts_run(first, 1);
        }
        while self.cts_posted != self.seq {
            let first = (self.cts_posted % SLOTS as u64) as usize;
            let pending = (self.seq - self.cts_posted) as usize;
            self.post_cts_run(first, pending.min(SLOTS - first))?;
        }
        Ok(())
    }

    /// Posts the clear-to-send entries of the `k` receives from slot `first` on, the next
    /// ones due, in one write.
    #[inline(always)]
    fn post_cts_run(&mut self, first: usize, k: usize) -> Result<()> {
        let bytes = ((k - 1) * MAX_RECVS + self.slots[first + k - 1].n) * CTS_BYTES;
        self.cts_unsignaled = (self.cts_unsignaled + 1) % CTS_SIGNAL_EVERY;
        let signaled = self.cts_unsignaled == 0;
        // The connection's QP 0: the receiver's rail 0 to the sender's rail 0.
        let rail = &mut self.rails[0];
        let qp = &rail.qps[0];
        self.cts_write.post(
            &*rail.nic,
            qp,
            (self.cts_local.addr(cts_index(first, 0)), bytes as u32),
            self.remote_fifo.0 + (cts_index(first, 0) * CTS_BYTES) as u64,
            WrKind::Cts.id(first),
            signaled,
            qp.max_inline(),
        )?;
        if signaled {
            let qpn = qp.qpn();
            rail.signaled(qpn, WrKind::Cts.id(first));
        }
        self.cts_posted += k as u64;
        self.cts_writes += 1;
        Ok(())
    }

    /// Polls every rail's CQ once and hands out what arrived, and hears the peer when its
    /// turn comes. A fault moves the connection where it can; while it moves, this steps the
    /// move instead.
    #[inline(always)]
    fn progress(&mut self, gate: &RecvGate<N>) -> Result<()> {
        if !self.still() && self.step_move(gate)? {
            // Moving: the rails are not polled until the sender resumes.
            return Ok(());
        }
        match self.poll_rails(gate) {
            Ok(false) => Ok(()),
            Ok(true) => self.checked(gate),
            Err(f) => self.on_fault(gate, f),
        }
    }

    /// Polls every rail's CQ once and hands out what arrived; whether rail 0's slow checks
    /// ran.
    #[inline(always)]
    fn poll_rails(&mut self, gate: &RecvGate<N>) -> std::result::Result<bool, Fault> {
        let mut wc = WcBatch::new();
        let mut checked = false;
        for r in 0..self.rails.len() {
            if self.rails[r].poll(&mut wc)? {
                checked |= self.drain_rail(gate, r, &mut wc)? && r == 0;
            }
        }
        Ok(checked)
    }

    /// A post failed with `e`: where a rail's CQ says why (its path failed), that fault; else
    /// the device's error. Either goes where faults go.
    #[cold]
    fn post_failed(&mut self, gate: &RecvGate<N>, e: Error) -> Result<()> {
        let f = match self.poll_rails(gate) {
            Err(f) => f,
            Ok(_) => Fault::new(Cause::Device, e),
        };
        self.on_fault(gate, f)
    }

    /// Hands what rail `r`'s poll put in `wc` to the receives and flushes it completes.
    #[inline(always)]
    fn drain_rail(
        &mut self,
        gate: &RecvGate<N>,
        r: usize,
        wc: &mut WcBatch,
    ) -> std::result::Result<bool, Fault> {
        let waiting = self.seq != self.finished;
        let (slots, flush_slots) = (&mut self.slots, &mut self.flush_slots);
        let peer = self.link.peer();
        self.rails[r].drain(wc, peer, waiting, |c| {
            let slot = WrKind::slot(c.wr_id());
            if c.opcode() == WC_RECV_RDMA_WITH_IMM {
                // A sender's write landed, consuming one of our receives (the only requests
                // that complete so). Not counted in flight: the sender's work completes them.
                landed(&mut slots[slot], gate, slot, c.write_imm());
                return false;
            }
            match WrKind::of(c.wr_id()) {
                Some(WrKind::Flush) => {
                    flushed(&mut flush_slots[slot]);
                    true
                }
                Some(WrKind::Cts) => true,
                _ => false,
            }
        })
    }
}

#[cold]
fn too_many_flushes() -> Error {
    Error::misuse(format!(
        "iflush: {SLOTS} flushes already in flight on this comm (NCCL allows {SLOTS} requests)"
    ))
}

/// The receiving end of a verbs connection: its state behind the comm's lock, and the gate
/// an idle `test` reads instead.
pub(crate) struct VerbsReceiver<N: Nic = VerbsDevice> {
    // Field order is teardown order: the QPs (in the state) before the CQs the gate holds.
    state: Mutex<RecvState<N>>,
    gate: RecvGate<N>,
}

impl<N: Nic> VerbsReceiver<N> {
    pub(crate) fn new(state: RecvState<N>) -> Self {
        let gate = RecvGate::new(&state.rails);
        // Every call locks until the setup (move 0) is done.
        gate.lock_wanted(state.needs_lock());
        VerbsReceiver {
            gate,
            state: Mutex::new(state),
        }
    }
}

impl<N: Nic> Drop for VerbsReceiver<N> {
    fn drop(&mut self) {
        let s = self.state.get_mut();
        // The sender completes the sends whose data landed here, though it closes now.
        let landed = s.landed_below(&self.gate);
        s.link.bye(Some(landed));
        if let Some((trial, _)) = s.trial.take() {
            super::reaper::bury(trial);
        }
        if s.broken {
            // A failed NIC's QPs may take long to destroy: not in NCCL's close.
            super::failover::stop(&s.rails, false);
            super::reaper::bury(std::mem::take(&mut s.rails));
        }
    }
}

impl<N: Nic> VerbsReceiver<N> {
    /// [`Receiver::test`] where the gate did not answer: under the lock, with what the gate
    /// polled. Out of line, so that the idle test is the gate's poll and nothing else.
    #[inline(never)]
    fn test_locked(&self, id: usize, sizes: &mut impl SizeSink, found: Found<'_>) -> Tested {
        self.state.lock().test(&self.gate, id, sizes, found)
    }
}

impl<N: Nic> Endpoint for VerbsReceiver<N> {
    fn peer(&self) -> String {
        self.state.lock().link.peer().to_string()
    }

    fn traffic(&self) -> Traffic {
        self.state.lock().traffic
    }

    fn summary(&self) -> String {
        // How well clear-to-sends were batched (NCCL_ERDMA_CTS_BATCH), and the rails.
        let s = self.state.lock();
        format!(
            " ({} clear-to-send writes for {} receives){}",
            s.cts_writes,
            s.cts_posted,
            rail::summary(&s.rails)
        )
    }
}

impl<N: Nic> Receiver for VerbsReceiver<N> {
    /// Under the lock (an `irecv` always has work to do).
    #[inline(never)]
    fn irecv(&self, bufs: &[UserBuffer], tags: &[i32], mhandles: &[u64]) -> Result<Option<usize>> {
        let mut s = self.state.lock();
        let r = s.irecv(&self.gate, bufs, tags, mhandles);
        self.gate.lock_wanted(s.needs_lock());
        r
    }

    fn iflush(&self, bufs: &[UserBuffer], mhandles: &[u64]) -> Result<Option<usize>> {
        let mut s = self.state.lock();
        let r = s.iflush(bufs, mhandles);
        self.gate.lock_wanted(s.needs_lock());
        r
    }

    /// The gate answers a test of a receive still waiting whose CQs hold nothing (most
    /// tests); everything else is decided under the lock, with what the gate polled.
    #[inline]
    fn test(&self, id: usize, sizes: &mut impl SizeSink) -> Tested {
        let mut wc = WcBatch::new();
        let found = match self.gate.poll(id, &mut wc) {
            GatePoll::Idle => return Tested::Pending,
            GatePoll::Found(rail, generation) => Some((rail, generation, &mut wc)),
            GatePoll::Lock => None,
        };
        self.test_locked(id, sizes, found)
    }
}
