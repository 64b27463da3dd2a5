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
//! `iflush` (GPUDirect): a 1-byte RDMA READ through a QP connected to itself, which completes
//! only after the NIC's earlier writes to GPU memory are visible.

use std::sync::Arc;

use parking_lot::Mutex;

use super::cq::CqPoller;
use super::wire::{cts_index, qps_for, CtsEntry, WrKind, CTS_BYTES, SLOTS, TRUNCATED};
use crate::buffer::UserBuffer;
use crate::error::{Error, Result};
use crate::transport::{not_in_flight, Completion, Failure, MemKeys, RecvEndpoint, MAX_RECVS};
use crate::verbs::dma::{DmaBuffer, SendChain, WC_RECV_RDMA_WITH_IMM};
use crate::verbs::nic::{Nic, QueuePair};

/// Clear-to-send entries are held back (to be posted together) only while the sender holds
/// at least this many posted receives it can fill.
pub(crate) const CTS_HOLD_MIN: u64 = 2;
/// Every this many clear-to-send writes one is signaled, which retires the unsignaled ones
/// before it (at most `SLOTS + 8` in the send queue); errors complete regardless.
const CTS_SIGNAL_EVERY: u32 = 8;
/// Request ids of flushes start here (receives are 0..32).
pub(crate) const FLUSH_ID_BASE: usize = SLOTS;

#[derive(Debug, Clone, Copy)]
struct RecvSlot {
    busy: bool,
    n: usize,
    /// WRITE_WITH_IMMs still to arrive (one per QP the receive uses).
    imm_pending: u32,
    /// The size of a single receive, from its immediate.
    size0: u32,
}

impl RecvSlot {
    const FREE: RecvSlot = RecvSlot {
        busy: false,
        n: 0,
        imm_pending: 0,
        size0: 0,
    };
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FlushSlot {
    Free,
    Pending,
    Done,
}

/// Everything a receive comm owns.
pub(crate) struct RecvState<N: Nic> {
    // Field order is teardown order: QPs before the memory they use, the CQ last.
    pub(crate) qps: Vec<N::Qp>,
    pub(crate) flush_qp: Option<N::Qp>,
    pub(crate) cts_local: DmaBuffer<CtsEntry, N::Mr>,
    pub(crate) sizes_record: DmaBuffer<u32, N::Mr>,
    /// Where flush and probe reads land.
    pub(crate) flush_target: DmaBuffer<u64, N::Mr>,
    pub(crate) cq: CqPoller<N>,
    pub(crate) nic: Arc<N>,
    /// The sender's clear-to-send FIFO (address, rkey).
    pub(crate) remote_fifo: (u64, u32),
    pub(crate) split: bool,
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
    /// Receives whose clear-to-send is posted and that have not finished.
    announced: u64,
    /// Clear-to-send writes posted unsignaled since the last signaled one.
    cts_unsignaled: u32,
    /// A receive was tested since the last `irecv`: the caller polls its receives (NCCL's
    /// proxy tests its oldest one on every pass), so entries held back now will be posted
    /// by a later `test`. Receives posted back to back are announced at once.
    polled: bool,
    /// Clear-to-send writes posted, and the entries they carried (one per receive), for the
    /// comm's summary.
    cts_writes: u64,
    cts_entries: u64,
    /// Signaled work requests posted and not yet completed (clear-to-sends, flushes, probes).
    in_flight: u32,
    /// Receives posted and not finished.
    waiting: u32,
    chain: SendChain,
    failure: Failure,
    pub(crate) peer: String,
}

impl<N: Nic> RecvState<N> {
    /// A comm over connected `qps` (and the flush QP, when GPUDirect may be used).
    #[allow(clippy::too_many_arguments)] // what setup made, in teardown order
    pub(crate) fn new(
        qps: Vec<N::Qp>,
        flush_qp: Option<N::Qp>,
        cts_local: DmaBuffer<CtsEntry, N::Mr>,
        sizes_record: DmaBuffer<u32, N::Mr>,
        flush_target: DmaBuffer<u64, N::Mr>,
        cq: CqPoller<N>,
        nic: Arc<N>,
        remote_fifo: (u64, u32),
        split: bool,
        cts_batch: u32,
        peer: String,
    ) -> Self {
        RecvState {
            qps,
            flush_qp,
            cts_local,
            sizes_record,
            flush_target,
            cq,
            nic,
            remote_fifo,
            split,
            seq: 0,
            slots: [RecvSlot::FREE; SLOTS],
            flush_slots: [FlushSlot::Free; SLOTS],
            flush_next: 0,
            cts_batch: u64::from(cts_batch.clamp(1, SLOTS as u32)),
            cts_posted: 0,
            announced: 0,
            cts_unsignaled: 0,
            polled: false,
            cts_writes: 0,
            cts_entries: 0,
            in_flight: 0,
            waiting: 0,
            chain: SendChain::new(),
            failure: Failure::default(),
            peer,
        }
    }

    /// `irecv`: the request id is the slot.
    #[inline(always)]
    fn irecv(
        &mut self,
        bufs: &[UserBuffer],
        tags: &[i32],
        mem: &[MemKeys],
    ) -> Result<Option<usize>> {
        self.failure.check()?;
        // No CQ poll here: `test` polls, and a free slot depends only on `test`.
        if self.cq.peer_gone {
            let e = self.cq.gone_error(&self.peer);
            return self.failure.record(Err(e));
        }
        let slot = (self.seq % SLOTS as u64) as usize;
        if self.slots[slot].busy {
            return Ok(None);
        }
        let r = self.post_receive(slot, bufs, tags, mem);
        self.polled = false;
        self.failure.record(r)?;
        Ok(Some(slot))
    }

    /// `iflush` of the last non-empty buffer; `Ok(None)` when there is nothing to flush.
    fn iflush(&mut self, bufs: &[UserBuffer], mem: &[MemKeys]) -> Result<Option<usize>> {
        self.failure.check()?;
        let Some(flush_qp) = &self.flush_qp else {
            return Ok(None);
        };
        let Some(last) = (0..bufs.len()).rev().find(|&i| !bufs[i].is_empty()) else {
            return Ok(None);
        };
        // NULL would tell NCCL "no flush needed" and it would not retry, so a busy slot
        // (a flush of another sub still untested) means taking the next free one. NCCL keeps
        // at most 32 requests in flight per comm, so one is free unless the caller broke that.
        let Some(fslot) = (0..SLOTS)
            .map(|k| (self.flush_next + k) % SLOTS)
            .find(|&f| self.flush_slots[f] == FlushSlot::Free)
        else {
            return Err(too_many_flushes());
        };
        self.chain.clear();
        self.chain.read(
            self.flush_target.addr(0),
            1,
            self.flush_target.lkey(),
            bufs[last].addr() as u64,
            mem[last].rkey,
        );
        self.chain.finish(WrKind::Flush.id(fslot), 0);
        let r = self.chain.post(&*self.nic, flush_qp);
        self.failure.record(r)?;
        self.in_flight += 1;
        self.flush_slots[fslot] = FlushSlot::Pending;
        self.flush_next = (fslot + 1) % SLOTS;
        Ok(Some(FLUSH_ID_BASE + fslot))
    }

    /// `test` of receive or flush request `id`.
    fn test(&mut self, id: usize) -> Result<Option<Completion>> {
        if id >= FLUSH_ID_BASE {
            return self.test_flush(id - FLUSH_ID_BASE);
        }
        if !self.slots.get(id).is_some_and(|st| st.busy) {
            return Err(not_in_flight("receive", id));
        }
        self.polled = true;
        // As for sends, the CQ is polled only for a receive not yet known to be done.
        if self.slots[id].imm_pending > 0 {
            let r = self.progress();
            let _ = self.failure.record(r);
            // A receive still waiting needs its clear-to-send at the sender, and the sender
            // should keep holding a few.
            if self.cts_held(id) || self.announced < CTS_HOLD_MIN {
                let r = self.post_pending_cts();
                self.failure.record(r)?;
            }
        }
        if self.slots[id].imm_pending > 0 {
            self.failure.check()?;
            if !self.cq.peer_gone {
                return Ok(None);
            }
            // Completions the peer caused before it left are already in the CQ: look once
            // more before calling the request lost.
            let r = self.progress();
            let _ = self.failure.record(r);
            if self.slots[id].imm_pending > 0 {
                let e = self.cq.gone_error(&self.peer);
                return self.failure.record(Err(e));
            }
        }
        self.finish_receive(id)
    }

    fn test_flush(&mut self, f: usize) -> Result<Option<Completion>> {
        if self.flush_slots.get(f) == Some(&FlushSlot::Pending) {
            let r = self.progress();
            let _ = self.failure.record(r);
        }
        match self.flush_slots.get(f) {
            Some(FlushSlot::Done) => {
                self.flush_slots[f] = FlushSlot::Free;
                Ok(Some(Completion::EMPTY))
            }
            Some(FlushSlot::Pending) => self.failure.check().map(|()| None),
            _ => Err(not_in_flight("flush", f)),
        }
    }

    /// Frees receive `id`, whose data has all arrived, and reports its sizes.
    fn finish_receive(&mut self, id: usize) -> Result<Option<Completion>> {
        let st = std::mem::replace(&mut self.slots[id], RecvSlot::FREE);
        // Data arrived, so its clear-to-send had been posted.
        self.announced = self.announced.saturating_sub(1);
        self.waiting = self.waiting.saturating_sub(1);
        let mut c = Completion {
            n: st.n,
            sizes: [0; MAX_RECVS],
        };
        let mut truncated = false;
        for i in 0..st.n {
            let v = if st.n == 1 {
                st.size0
            } else {
                self.sizes_record.get(cts_index(id, i))
            };
            truncated |= v == TRUNCATED;
            c.sizes[i] = v;
        }
        if truncated {
            return Err(Error::Truncated(format!(
                "{} sent more bytes than the receive posted for them",
                self.peer
            )));
        }
        Ok(Some(c))
    }

    fn post_receive(
        &mut self,
        slot: usize,
        bufs: &[UserBuffer],
        tags: &[i32],
        mem: &[MemKeys],
    ) -> Result<()> {
        let n = bufs.len();
        let nqps = self.qps.len();
        let (first_qp, used) = qps_for(self.seq, nqps, self.split);
        for k in 0..used {
            let qp = &self.qps[(first_qp + k) % nqps];
            self.nic.post_recv(qp, WrKind::Recv.id(slot))?;
        }
        for (i, b) in bufs.iter().enumerate() {
            let entry = CtsEntry::new(b.addr() as u64, b.len(), mem[i].rkey, tags[i], n, self.seq);
            self.cts_local.set(cts_index(slot, i), entry);
        }
        self.slots[slot] = RecvSlot {
            busy: true,
            n,
            imm_pending: used as u32,
            size0: 0,
        };
        self.seq += 1;
        self.waiting += 1;
        // Held back while the sender holds enough to work on and the caller polls its
        // receives, up to the batch size: one RDMA write (and, on Soft-RoCE, one system
        // call) then announces several receives.
        let pending = self.seq - self.cts_posted;
        if pending >= self.cts_batch || self.announced < CTS_HOLD_MIN || !self.polled {
            self.post_pending_cts()?;
        }
        Ok(())
    }

    /// Whether busy receive `slot`'s clear-to-send is still held back: it is among the last
    /// `seq - cts_posted` receives posted.
    fn cts_held(&self, slot: usize) -> bool {
        let held = (self.seq - self.cts_posted) as usize;
        (slot + SLOTS - (self.cts_posted % SLOTS as u64) as usize) % SLOTS < held
    }

    /// Posts every clear-to-send held back, in FIFO order: one RDMA WRITE per contiguous run
    /// of slots (whole slots, then the last slot's entries; the sender reads only the entries
    /// a slot announces, each checked by its sequence number).
    #[inline(always)] // into post_receive: once per receive at the default batch of 1
    fn post_pending_cts(&mut self) -> Result<()> {
        while self.cts_posted != self.seq {
            let first = (self.cts_posted % SLOTS as u64) as usize;
            let pending = (self.seq - self.cts_posted) as usize;
            let k = pending.min(SLOTS - first);
            let last = first + k - 1;
            let bytes = ((k - 1) * MAX_RECVS + self.slots[last].n) * CTS_BYTES;
            self.cts_unsignaled += 1;
            let signaled = self.cts_unsignaled >= CTS_SIGNAL_EVERY;
            if signaled {
                self.cts_unsignaled = 0;
            }
            let qp = &self.qps[0];
            self.chain.post_one(
                &*self.nic,
                qp,
                (
                    self.cts_local.addr(cts_index(first, 0)),
                    bytes as u32,
                    self.cts_local.lkey(),
                ),
                (
                    self.remote_fifo.0 + (cts_index(first, 0) * CTS_BYTES) as u64,
                    self.remote_fifo.1,
                ),
                None,
                WrKind::Cts.id(first),
                signaled,
                qp.max_inline(),
            )?;
            self.in_flight += u32::from(signaled);
            self.cts_posted += k as u64;
            self.announced += k as u64;
            self.cts_writes += 1;
            self.cts_entries += k as u64;
        }
        Ok(())
    }

    fn progress(&mut self) -> Result<()> {
        let (slots, flush_slots, in_flight) =
            (&mut self.slots, &mut self.flush_slots, &mut self.in_flight);
        let busy = (*in_flight > 0, self.waiting > 0);
        let probe = self.cq.drain(&self.nic, &self.qps, &self.peer, busy, |c| {
            let slot = WrKind::slot(c.wr_id);
            match WrKind::of(c.wr_id) {
                Some(WrKind::Recv) if c.opcode == WC_RECV_RDMA_WITH_IMM => {
                    let st = &mut slots[slot];
                    if st.n == 1 {
                        st.size0 = c.imm;
                    }
                    st.imm_pending = st.imm_pending.saturating_sub(1);
                    return;
                }
                Some(WrKind::Flush) => flush_slots[slot] = FlushSlot::Done,
                Some(WrKind::Cts | WrKind::Probe) => {}
                _ => return,
            }
            *in_flight = in_flight.saturating_sub(1);
        })?;
        if probe {
            self.post_probe()?;
        }
        Ok(())
    }

    /// A 1-byte read of the sender's FIFO: work that completes at once on a live path, for
    /// the watchdog. Behind any clear-to-send stuck in the same queue.
    #[cold]
    fn post_probe(&mut self) -> Result<()> {
        self.chain.clear();
        self.chain.read(
            self.flush_target.addr(1),
            1,
            self.flush_target.lkey(),
            self.remote_fifo.0,
            self.remote_fifo.1,
        );
        self.chain.finish(WrKind::Probe.id(0), 0);
        self.chain.post(&*self.nic, &self.qps[0])?;
        self.in_flight += 1;
        Ok(())
    }

    /// Clear-to-send writes posted so far, and the receives they announced.
    fn clear_to_send_counts(&self) -> (u64, u64) {
        (self.cts_writes, self.cts_entries)
    }
}

#[cold]
fn too_many_flushes() -> Error {
    Error::Usage(format!(
        "iflush: {SLOTS} flushes already in flight on this comm (NCCL allows {SLOTS} requests)"
    ))
}

/// A receive comm over verbs.
pub(crate) struct VerbsRecvComm<N: Nic> {
    inner: Mutex<RecvState<N>>,
}

impl<N: Nic> VerbsRecvComm<N> {
    pub(crate) fn new(state: RecvState<N>) -> Self {
        VerbsRecvComm {
            inner: Mutex::new(state),
        }
    }

    /// Numbers the next receive `seq` (the sender must do the same). Only while nothing is
    /// in flight: tests cross the 32-bit boundary without 2^32 messages.
    #[cfg(test)]
    pub(crate) fn skip_to(&self, seq: u64) {
        let mut s = self.inner.lock();
        assert!(s.slots.iter().all(|st| !st.busy) && s.cts_posted == s.seq);
        (s.seq, s.cts_posted) = (seq, seq);
    }

    /// Clear-to-send writes posted, and the receives they announced.
    #[cfg(test)]
    pub(crate) fn cts_counts(&self) -> (u64, u64) {
        self.inner.lock().clear_to_send_counts()
    }
}

impl<N: Nic> RecvEndpoint for VerbsRecvComm<N> {
    fn peer(&self) -> String {
        self.inner.lock().peer.clone()
    }

    fn irecv(&self, bufs: &[UserBuffer], tags: &[i32], mem: &[MemKeys]) -> Result<Option<usize>> {
        self.inner.lock().irecv(bufs, tags, mem)
    }

    fn iflush(&self, bufs: &[UserBuffer], mem: &[MemKeys]) -> Result<Option<usize>> {
        self.inner.lock().iflush(bufs, mem)
    }

    fn test(&self, id: usize) -> Result<Option<Completion>> {
        self.inner.lock().test(id)
    }

    fn summary(&self) -> String {
        // How well clear-to-sends were batched (NCCL_ERDMA_CTS_BATCH).
        let (writes, entries) = self.inner.lock().clear_to_send_counts();
        format!(" ({writes} clear-to-send writes for {entries} receives)")
    }
}
