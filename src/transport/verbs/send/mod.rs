//! The sending side of a verbs connection: `isend` matches a send against the clear-to-send
//! entries the receiver wrote into this comm's FIFO and, once every buffer of a receive
//! slot has its send, posts the RDMA WRITEs; `test` reports a send done when the slot's
//! writes have completed.
//!
//! A slot's writes: on each QP the receive uses (one; or one per rail, striped, for a large
//! receive on a multi-rail connection; or all with `NCCL_IB_SPLIT_DATA_ON_QPS`), a piece of
//! every message ending in a WRITE_WITH_IMM, which carries the size for a single receive;
//! for a grouped receive it writes all sizes into the receiver's size record. A send larger
//! than its buffer is not sent: its size is marked `TRUNCATED` (and so are the sends of the
//! slot that never came, so the receiver learns of it whichever send was too large), the
//! slot is posted at once and the comm fails from then on.
//!
//! A fault on a rail a move can mend moves the connection (`moving`, see `failover`):
//! meanwhile nothing is posted, and afterwards the slots the receiver still waits for are
//! sent again before anything else. A peer that closes after its receives landed (its
//! `Bye` says how many) completes the sends it got.

#[cfg(test)]
mod inspect;
mod moving;
mod slot;

use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use super::bringup::Bringup;
use super::budget::slot_wrs;
use super::failover::{Mobility, Moving};
use super::fault::{Cause, Fault};
use super::gate::{cts_landed, SendGate, NOT_AWAITED};
use super::peer::PeerLink;
use super::rail::{self, Rail};
use super::trial::Trial;
use super::wire::{cts_index, locate, modulo, piece, CtsEntry, QpPlan, WrKind, SLOTS, TRUNCATED};
use crate::buffer::UserBuffer;
use crate::error::{Error, Result};
use crate::transport::{
    not_in_flight, CommKeys, Endpoint, Failure, Sender, Tested, Traffic, MAX_RAILS, MAX_RECVS,
};
use crate::verbs::device::VerbsDevice;
use crate::verbs::dma::{DmaBuffer, SendChain, WcBatch, WriteImm};
use crate::verbs::nic::{Nic, QueuePair};

use slot::{Replay, SendSlot};

/// Where in `sizes_local` a probe's byte lands (after the size records).
pub(crate) const PROBE_AT: usize = SLOTS * MAX_RECVS;

/// The receiver's size records: address, key on each of its rails, how many rails.
pub(crate) type RemoteRecords = (u64, [u32; MAX_RAILS], usize);

/// Registrations of a buffer on the NICs a move takes: (registration, lkey, rkey) per rail.
type Regs<N> = Vec<(<N as Nic>::Mr, u32, u32)>;

/// The size records' and the FIFO's registrations on the NICs a move takes.
struct MovedRegs<N: Nic> {
    sizes: Regs<N>,
    fifo: Regs<N>,
}

/// Where the sender is in a move (`moving`; the protocol is in `failover`). Setup is move
/// 0: the connector's hello offered its rails, and the comm starts `Offered`. A tag of its
/// own (not a niche of the deadline's): `still()`, on every call, is one byte's compare.
#[repr(u8)]
enum Movement<N: Nic> {
    /// Carrying data on its rails.
    Still,
    /// A move back is due, its path tried and found to hold until the instant given: nothing
    /// new is posted until the sends in flight have completed on the rails they went out on
    /// (which work); the move then begins once a receive waits for a send, or the connection
    /// carries on where it is if none does by that instant (`moving::drained`).
    Draining(Instant),
    /// Its rails are made (again, on the NICs left, with its QPs stopped) and offered; the
    /// receiver's answer is awaited.
    Offered(Box<Offered<N>>),
    /// Moved: the slots the receiver still waited for are sent again, oldest first, before
    /// any later send.
    Replaying(Replay),
}

/// What a move has made, until the receiver answers.
struct Offered<N: Nic> {
    moving: Moving,
    new: Bringup<N>,
    /// The comm's buffers' registrations on the new NICs; none at setup, whose NICs hold
    /// the buffers' own.
    regs: Option<MovedRegs<N>>,
}

/// Everything a send comm owns.
pub(crate) struct SendState<N: Nic> {
    // Field order is teardown order: QPs (in the rails) before the memory they use.
    pub(crate) rails: Vec<Rail<N>>,
    /// Shared with the comm's [`SendGate`], which outlives this state (and so the QPs).
    fifo: Arc<DmaBuffer<CtsEntry, N::Mr>>,
    /// Size records of grouped receives as sent, and the probe's landing byte.
    sizes_local: DmaBuffer<u32, N::Mr>,
    remote_sizes: RemoteRecords,
    plan: QpPlan,
    /// Sequence number of the next receive slot to fill.
    seq: u64,
    slots: [SendSlot; SLOTS],
    chain: SendChain,
    /// The write of a single message's send.
    single: WriteImm,
    /// Where NCCL's handles are looked up.
    keys: CommKeys,
    /// Per connection QP: the work requests its send queue has room for (indexed by the
    /// QP's byte of a send's work request id, so a completion needs no bounds check).
    sq_room: [u32; 256],
    failure: Failure,
    traffic: Traffic,
    /// The bootstrap connection: the peer's moves, its `Bye`, its exit.
    link: PeerLink,
    /// Where the connection may move.
    mobility: Mobility<N>,
    movement: Movement<N>,
    /// The FIFO's registrations on the NICs a move took (its own are on the first ones).
    fifo_regs: Vec<N::Mr>,
    /// A rail failed under this comm: its QPs go to the reaper at close.
    broken: bool,
    /// The receiver announced a receive since the rails were last joined (setup, or a move):
    /// it has read the `Resume` and brought its probe QPs up, so an idle `isend` may probe
    /// the paths. Before, a probe would go unanswered by a receiver merely slow to make its
    /// first call; its host's silence is the bootstrap link's to find.
    receiver_up: bool,
    /// The trial of the path a move back would take, while it runs (`trial`), and how many
    /// trials this comm began (the next one's number).
    trial: Option<Trial<N>>,
    trials: u32,
}

impl<N: Nic> SendState<N> {
    /// A comm being set up: its rails (`offer`, made and described in the hello sent over
    /// `link`) join the listener's answer in a later call (move 0), and nothing is sent
    /// before they have.
    pub(crate) fn offering(
        offer: Bringup<N>,
        fifo: DmaBuffer<CtsEntry, N::Mr>,
        sizes_local: DmaBuffer<u32, N::Mr>,
        link: PeerLink,
        keys: CommKeys,
        mobility: Mobility<N>,
    ) -> Self {
        let plan = QpPlan {
            nqps: 0,
            rails: 0,
            split: mobility.params.split_data,
        };
        SendState {
            rails: Vec::new(),
            fifo: Arc::new(fifo),
            sizes_local,
            remote_sizes: (0, [0; MAX_RAILS], 0),
            plan,
            seq: 0,
            slots: [SendSlot::FREE; SLOTS],
            chain: SendChain::new(),
            single: WriteImm::default(),
            keys,
            sq_room: [0; 256],
            failure: Failure::default(),
            traffic: Traffic::default(),
            link,
            mobility,
            movement: Movement::Offered(Box::new(Offered {
                moving: Moving::setup(),
                new: offer,
                regs: None,
            })),
            fifo_regs: Vec::new(),
            broken: false,
            receiver_up: false,
            trial: None,
            trials: 0,
        }
    }

    /// Every QP's send queue empty: its whole depth is room.
    fn reset_room(&mut self) {
        for q in 0..self.plan.nqps {
            let (r, i) = locate(q, self.plan.rails);
            self.sq_room[q] = self.rails[r].qps[i].max_send_wr();
            debug_assert!(self.sq_room[q] >= slot_wrs(MAX_RECVS));
        }
    }

    /// Whether the connection carries data on its rails as NCCL asks (no move, nothing to
    /// send again, no move back holding new sends).
    #[inline]
    fn still(&self) -> bool {
        matches!(self.movement, Movement::Still)
    }

    /// What the gate is to say: the entry the next send waits for ([`NOT_AWAITED`] while
    /// the connection moves), and whether every `isend` looks around (failed, or moving).
    #[inline]
    fn gate_view(&self) -> (u64, bool) {
        if self.still() {
            (self.awaited(), self.failure.is_set())
        } else {
            (NOT_AWAITED, true)
        }
    }

    /// Whether `fits` holds once the CQs are drained: completions give send queue room back,
    /// and a send refused for room is asked for again, maybe with no `test` in between.
    #[cold]
    fn room_after_drain(&mut self, fits: impl Fn(&Self) -> bool) -> Result<bool> {
        let r = self.progress(false);
        self.failure.record(r)?;
        // A move begun by the drain stopped the QPs: nothing is posted until it is over.
        Ok(self.still() && fits(self))
    }

    /// Whether every QP the writes of the slot of `n` sends for receive `seq` take has room
    /// for them.
    fn room_for_slot(&self, seq: u64, n: usize, room: usize) -> bool {
        let (first_qp, used) = self.plan.qps(seq, room);
        (0..used).all(|k| {
            let q = self.plan.qp_of_piece(seq, first_qp, used, k);
            self.sq_room[q] >= slot_wrs(n)
        })
    }

    /// What the next slot's first clear-to-send entry holds once it has landed (its
    /// receive's sequence number + 1), or [`NOT_AWAITED`] while the slot's previous use is
    /// not tested.
    fn awaited(&self) -> u64 {
        let st = &self.slots[(self.seq % SLOTS as u64) as usize];
        if st.busy && st.posted {
            NOT_AWAITED
        } else {
            self.seq + 1
        }
    }

    /// `isend` once the gate saw the clear-to-send `awaited` land in the next slot (see the
    /// module doc); returns the request id `slot * 8 + entry`.
    #[inline(always)]
    fn isend(
        &mut self,
        awaited: u64,
        buf: UserBuffer,
        tag: i32,
        mhandle: u64,
    ) -> Result<Option<usize>> {
        self.failure.check()?;
        if !self.still() || awaited != self.awaited() {
            // Moving (nothing is posted before the move and what it sends again), or the
            // gate read what an earlier call left.
            return Ok(None);
        }
        self.receiver_up = true;
        let slot = (self.seq % SLOTS as u64) as usize;
        let want = self.seq + 1;
        let base = cts_index(slot, 0);
        // The first entry has landed (the gate saw its sequence number): only the fields
        // used are read.
        let (n, first_tag, first_size) =
            self.fifo.read(base, |e| (e.nreqs as usize, e.tag, e.size));
        if n == 0 || n > MAX_RECVS {
            return self.protocol_error(n);
        }
        if n == 1 && first_tag == tag && buf.len() as u64 <= u64::from(first_size) {
            // NCCL's usual receive, one buffer, which the send fits (the slot is free: a slot
            // of one buffer is posted as its send matches). On one QP: one write.
            let (qp, used) = self.plan.qps(self.seq, first_size as usize);
            if used == 1 {
                let remote_rail = modulo(qp, self.remote_sizes.2);
                let remote = self.fifo.read(base, |e| (e.addr, e.rkeys[remote_rail]));
                return self.post_single(slot, (remote, first_size), qp, buf, mhandle);
            }
        }
        let st = &mut self.slots[slot];
        if !st.busy {
            st.start(n);
            st.room = first_size as usize;
        }
        // The first unmatched entry with this tag; each entry is read only when reached, and
        // one that has not landed yet means "not yet".
        let mut found = None;
        for i in 0..n {
            if st.matched & (1 << i) != 0 {
                continue;
            }
            if i != 0 && cts_landed(&self.fifo, base + i) != want {
                return Ok(None);
            }
            let (entry_tag, size) = if i == 0 {
                (first_tag, first_size)
            } else {
                self.fifo.read(base + i, |e| (e.tag, e.size))
            };
            if entry_tag == tag {
                found = Some((i, size));
                break;
            }
        }
        let Some((e, room)) = found else {
            return Ok(None);
        };
        let truncated = buf.len() as u64 > u64::from(room);
        let (completes, slot_room) = (st.matched | 1 << e == st.all || truncated, st.room);
        if completes
            && !self.room_for_slot(self.seq, n, slot_room)
            && !self.room_after_drain(|s| s.room_for_slot(s.seq, n, slot_room))?
        {
            // The send that completes the slot waits until the send queues have room.
            return Ok(None);
        }
        let mem = self.keys.keys(mhandle, buf)?;
        let st = &mut self.slots[slot];
        st.matched |= 1 << e;
        st.sizes[e] = buf.len();
        st.addrs[e] = buf.addr() as u64;
        st.mhandles[e] = mhandle;
        for r in 0..self.plan.rails {
            st.lkeys[e][r] = mem.lkey(r);
        }
        st.device_mem |= u8::from(!mem.host) << e;
        if truncated {
            // The receive fails as a whole: every buffer of it whose send has not come
            // yet is marked too, and the slot goes out now, so the receiver learns of it
            // whichever of its sends this was.
            st.trunc |= (1 << e) | (st.all & !st.matched);
            st.matched = st.all;
        }
        if self.slots[slot].complete() {
            if let Err(e) = self.post_slot(slot, n) {
                // Matched, so the request goes back: the slot is posted after the move (or
                // the comm failed).
                let r = self.post_failed(e);
                self.failure.record(r)?;
            }
        }
        if truncated {
            // No request goes back, so this slot is never tested and never free again: the
            // comm fails from here on (every later call returns the error rather than
            // waiting on the slot).
            let e = truncation_error(buf.len(), tag, self.link.peer(), room);
            return Err(self.failure.fail(e));
        }
        Ok(Some(base + e))
    }

    /// Sends `buf` into the receive of one buffer announced in free `slot` (at `remote`:
    /// address and key on the QP's rail, holding `room` bytes), which it fits, over
    /// connection QP `qp`: one WRITE_WITH_IMM carrying the data and its size. Only what
    /// `test` reads of the slot is recorded.
    #[inline(always)]
    fn post_single(
        &mut self,
        slot: usize,
        (remote, room): ((u64, u32), u32),
        qp: usize,
        buf: UserBuffer,
        mhandle: u64,
    ) -> Result<Option<usize>> {
        if self.sq_room[qp] == 0 && !self.room_after_drain(|s| s.sq_room[qp] > 0)? {
            // Its send queue is full: not now.
            return Ok(None);
        }
        let mem = self.keys.keys(mhandle, buf)?;
        let (r, i) = locate(qp, self.plan.rails);
        let rail = &mut self.rails[r];
        let qp_r = &rail.qps[i];
        let len = buf.len() as u32;
        // Inline data is copied by the CPU at post: never from GPU memory.
        let max_inline = if mem.host { qp_r.max_inline() } else { 0 };
        let qpn = qp_r.qpn();
        let id = WrKind::Send.send_id(slot, qp, 1);
        let post = self.single.post(
            &*rail.nic,
            qp_r,
            ((buf.addr() as u64, len, mem.lkey(r)), remote),
            len,
            id,
            max_inline,
        );
        if let Err(e) = post {
            // Not posted: after the move (or the comm failed), NCCL asks again.
            let r = self.post_failed(e);
            self.failure.record(r)?;
            return Ok(None);
        }
        self.sq_room[qp] -= 1;
        rail.signaled(qpn, id);
        rail.stats.bytes += u64::from(len);
        rail.stats.messages += 1;
        let st = &mut self.slots[slot];
        st.start(1);
        st.room = room as usize;
        st.matched = 1;
        st.sizes[0] = buf.len();
        // What a move needs to send it again.
        st.addrs[0] = buf.addr() as u64;
        st.mhandles[0] = mhandle;
        self.posted(slot, 1);
        Ok(Some(cts_index(slot, 0)))
    }

    /// `test` of send request `id`.
    #[inline(always)]
    fn test(&mut self, id: usize) -> Tested {
        let (slot, e) = (id / MAX_RECVS, id % MAX_RECVS);
        if slot >= SLOTS || !self.slots[slot].busy || self.slots[slot].matched & (1 << e) == 0 {
            return Tested::Failed(not_in_flight("send", id));
        }
        // The CQ is polled only for a request not yet known to be done: a drain that
        // completed it also completed the ones behind it.
        if !self.slots[slot].done() {
            let r = self.progress(false);
            let _ = self.failure.record(r);
        }
        let st = &mut self.slots[slot];
        if st.done() {
            let size = st.sizes[e];
            st.tested |= 1 << e;
            // Every send of the receive tested (each was matched first).
            if st.tested == st.all {
                st.busy = false;
            }
            self.traffic.add(1, size as u64);
            return Tested::Done(size);
        }
        if let Err(e) = self.failure.check() {
            return Tested::Failed(e);
        }
        if let Some(gone) = self.link.ended() {
            let e = gone.error.clone();
            return Tested::Failed(self.failure.fail(e));
        }
        Tested::Pending
    }

    /// An idle isend's look around: drains the CQs (the watchdog and peer link ride along)
    /// and returns the comm's failure or a vanished peer as the error.
    fn look_around(&mut self) -> Result<()> {
        let r = self.progress(self.receiver_up);
        self.failure.record(r)?;
        self.failure.check()?;
        if let Some(gone) = self.link.ended() {
            let e = gone.error.clone();
            return Err(self.failure.fail(e));
        }
        Ok(())
    }

    #[cold]
    fn protocol_error(&mut self, n: usize) -> Result<Option<usize>> {
        let e = Error::remote(format!(
            "protocol error: clear-to-send from {} announces {n} buffers",
            self.link.peer()
        ));
        Err(self.failure.fail(e))
    }

    /// Polls every rail's CQ once and hands out what arrived (`waiting`: a send waits for
    /// its clear-to-send), and hears the peer when its turn comes. A fault moves the
    /// connection where it can; while it moves, this steps the move instead.
    #[inline(always)]
    fn progress(&mut self, waiting: bool) -> Result<()> {
        if !self.still() && self.step_move()? {
            // Moving: the QPs are stopped.
            return Ok(());
        }
        match self.poll_rails(waiting) {
            Ok(false) => Ok(()),
            Ok(true) => self.checked(),
            Err(f) => self.on_fault(f),
        }
    }

    /// Polls every rail's CQ once and hands out what arrived; whether rail 0's slow checks
    /// ran.
    #[inline(always)]
    fn poll_rails(&mut self, waiting: bool) -> std::result::Result<bool, Fault> {
        let mut wc = WcBatch::new();
        let mut checked = false;
        for r in 0..self.rails.len() {
            if self.rails[r].poll(&mut wc)? {
                checked |= self.drain_rail(r, &mut wc, waiting)? && r == 0;
            }
        }
        Ok(checked)
    }

    /// Hands what rail `r`'s poll put in `wc` to the slots it completes (and their room back
    /// to the send queues).
    #[inline(always)]
    fn drain_rail(
        &mut self,
        r: usize,
        wc: &mut WcBatch,
        waiting: bool,
    ) -> std::result::Result<bool, Fault> {
        let (slots, sq_room) = (&mut self.slots, &mut self.sq_room);
        let peer = self.link.peer();
        self.rails[r].drain(wc, peer, waiting, |c| match WrKind::of(c.wr_id()) {
            Some(WrKind::Send) => {
                let st = &mut slots[WrKind::slot(c.wr_id())];
                st.cqe_pending = st.cqe_pending.saturating_sub(1);
                let (q, wrs) = WrKind::send_retires(c.wr_id());
                sq_room[usize::from(q)] += wrs;
                true
            }
            Some(WrKind::Landed) => {
                // A slot done before the move: only the room comes back.
                let (q, wrs) = WrKind::send_retires(c.wr_id());
                sq_room[usize::from(q)] += wrs;
                true
            }
            _ => false,
        })
    }

    /// A post failed with `e`: where a rail's CQ says why (its path failed), that fault; else
    /// the device's error. Either goes where faults go.
    #[cold]
    fn post_failed(&mut self, e: Error) -> Result<()> {
        let f = match self.poll_rails(false) {
            Err(f) => f,
            Ok(_) => Fault::new(Cause::Device, e),
        };
        self.on_fault(f)
    }

    /// Posts the writes of a fully matched slot of `n` messages.
    fn post_slot(&mut self, slot: usize, n: usize) -> Result<()> {
        let used = self.write_slot(slot, n, self.seq, WrKind::Send)?;
        self.posted(slot, used);
        Ok(())
    }

    /// Posts the writes of fully matched `slot` of `n` messages, for the receive numbered
    /// `seq`; returns how many are signaled. `kind`: `Send`, or `Landed` for a slot whose
    /// data landed before a move, of which only the immediates (and size record) go again.
    fn write_slot(&mut self, slot: usize, n: usize, seq: u64, kind: WrKind) -> Result<usize> {
        let plan = self.plan;
        let (first_qp, used) = plan.qps(seq, self.slots[slot].room);
        let base = cts_index(slot, 0);
        let st = &self.slots[slot];
        let remote_rails = self.remote_sizes.2;
        let data = kind == WrKind::Send;
        if n > 1 {
            for i in 0..n {
                let v = if st.trunc & (1 << i) != 0 {
                    TRUNCATED
                } else {
                    st.sizes[i] as u32
                };
                self.sizes_local.set(base + i, v);
            }
        }
        for k in 0..used {
            let q = plan.qp_of_piece(seq, first_qp, used, k);
            let (r, qi) = locate(q, plan.rails);
            let remote_rail = modulo(q, remote_rails);
            let rail = &mut self.rails[r];
            let chain = &mut self.chain;
            chain.clear();
            let mut bytes = 0;
            for i in (0..n).filter(|i| data && st.trunc & (1 << i) == 0) {
                // Matched entries have landed and stay put until this slot completes.
                let (addr, rkey) = self.fifo.read(base + i, |e| (e.addr, e.rkeys[remote_rail]));
                let (off, len) = piece(st.sizes[i], k, used);
                if len > 0 {
                    chain.write(
                        st.addrs[i] + off as u64,
                        len as u32,
                        st.lkeys[i][r],
                        addr + off as u64,
                        rkey,
                    );
                    bytes += len as u64;
                }
            }
            if n == 1 {
                let imm = if st.trunc & 1 != 0 {
                    TRUNCATED
                } else {
                    st.sizes[0] as u32
                };
                if chain.is_empty() {
                    let (addr, rkey) = self.fifo.read(base, |e| (e.addr, e.rkeys[remote_rail]));
                    chain.write_imm(0, 0, 0, addr, rkey, imm);
                } else {
                    chain.last_with_imm(imm);
                }
            } else {
                chain.write_imm(
                    self.sizes_local.addr(base),
                    (4 * n) as u32,
                    self.sizes_local.lkey(r),
                    self.remote_sizes.0 + (base * 4) as u64,
                    self.remote_sizes.1[remote_rail],
                    slot as u32,
                );
            }
            let qp = &rail.qps[qi];
            let id = kind.send_id(slot, q, chain.len());
            chain.finish(id, st.max_inline(qp.max_inline()));
            chain.post(&*rail.nic, qp)?;
            self.sq_room[q] -= chain.len() as u32;
            rail.signaled(qp.qpn(), id);
            rail.stats.bytes += bytes;
            rail.stats.messages += u64::from(bytes > 0);
        }
        Ok(used)
    }

    /// Records that `slot`'s writes are posted, `cqes` of them signaled.
    #[inline(always)]
    fn posted(&mut self, slot: usize, cqes: usize) {
        let st = &mut self.slots[slot];
        st.cqe_pending = cqes as u32;
        st.posted = true;
        self.seq += 1;
    }

    /// Where the peer said, closing, that its receives below `landed` had landed: every slot
    /// posted for one of them is done, whether or not its acknowledgement came.
    #[cold]
    fn landed_below(&mut self, landed: u64) {
        for slot in 0..SLOTS {
            let seq = self.seq_of(slot);
            let st = &mut self.slots[slot];
            if st.posted && st.cqe_pending > 0 && seq < landed {
                st.cqe_pending = 0;
            }
        }
    }

    /// The receive number of posted `slot`: the last one before `seq` to use it.
    fn seq_of(&self, slot: usize) -> u64 {
        let back = (self.seq as usize + 2 * SLOTS - 1 - slot) % SLOTS;
        self.seq.wrapping_sub(1 + back as u64)
    }
}

#[cold]
fn truncation_error(len: usize, tag: i32, peer: &str, room: u32) -> Error {
    Error::truncated(format!(
        "send of {len} bytes (tag {tag}) to {peer} is larger than the {room}-byte receive \
         posted for it"
    ))
}

/// The sending end of a verbs connection: its state behind the comm's lock, and the gate an
/// idle `isend` reads instead.
pub(crate) struct VerbsSender<N: Nic = VerbsDevice> {
    // Field order is teardown order: the QPs (in the state) before the FIFO.
    state: Mutex<SendState<N>>,
    gate: SendGate<N::Mr>,
}

impl<N: Nic> VerbsSender<N> {
    pub(crate) fn new(state: SendState<N>) -> Self {
        let gate = SendGate::new(Arc::clone(&state.fifo), state.awaited());
        let sender = VerbsSender {
            state: Mutex::new(state),
            gate,
        };
        // Set up (move 0) in the first calls: each looks around until then.
        sender.publish(&sender.state.lock());
        sender
    }

    /// Records in the gate what the locked call on `s` left.
    #[inline]
    fn publish(&self, s: &SendState<N>) {
        let (awaited, look) = s.gate_view();
        self.gate.publish(awaited, look);
    }

    /// An `isend` with nothing to post: "not yet", after a look around when one is due.
    #[inline]
    fn not_yet(&self) -> Result<Option<usize>> {
        if self.gate.idle_call_looks() {
            self.look_around()
        } else {
            Ok(None)
        }
    }

    /// [`SendState::look_around`], under the lock. Out of line: one idle `isend` in
    /// [`super::cq::IDLE_LOOK_EVERY`] comes here.
    #[cold]
    #[inline(never)]
    fn look_around(&self) -> Result<Option<usize>> {
        let mut s = self.state.lock();
        let r = s.look_around();
        self.publish(&s);
        r.map(|()| None)
    }
}

impl<N: Nic> Endpoint for VerbsSender<N> {
    fn peer(&self) -> String {
        self.state.lock().link.peer().to_string()
    }

    fn traffic(&self) -> Traffic {
        self.state.lock().traffic
    }

    fn summary(&self) -> String {
        rail::summary(&self.state.lock().rails)
    }
}

impl<N: Nic> VerbsSender<N> {
    /// [`Sender::isend`] once the gate saw the clear-to-send `awaited` land: under the lock.
    /// Out of line, so that the idle `isend` is the gate's load and nothing else.
    #[inline(never)]
    fn isend_landed(
        &self,
        awaited: u64,
        buf: UserBuffer,
        tag: i32,
        mhandle: u64,
    ) -> Result<Option<usize>> {
        let mut s = self.state.lock();
        let r = s.isend(awaited, buf, tag, mhandle);
        self.publish(&s);
        drop(s);
        match r {
            // Landed, but not for this send yet (another tag, an entry of a group to come,
            // a move under way).
            Ok(None) => self.not_yet(),
            r => r,
        }
    }
}

impl<N: Nic> Sender for VerbsSender<N> {
    /// The gate answers an `isend` whose clear-to-send has not landed (most calls); the rest
    /// is decided under the lock.
    #[inline]
    fn isend(&self, buf: UserBuffer, tag: i32, mhandle: u64) -> Result<Option<usize>> {
        match self.gate.landed() {
            Some(awaited) => self.isend_landed(awaited, buf, tag, mhandle),
            None => self.not_yet(),
        }
    }

    /// Under the lock (a send has no idle test: NCCL tests a send once it was posted). The
    /// gate learns what the call left where it changed: a slot freed, the comm failed, a move
    /// under way. (A move that ended here leaves the gate saying "look": the next `isend`
    /// looks, and publishes.)
    #[inline(never)]
    fn test(&self, id: usize) -> Tested {
        let mut s = self.state.lock();
        let r = s.test(id);
        if !matches!(r, Tested::Pending) || !s.still() {
            self.publish(&s);
        }
        r
    }
}

impl<N: Nic> Drop for VerbsSender<N> {
    fn drop(&mut self) {
        let s = self.state.get_mut();
        s.link.bye(None);
        if let Some(trial) = s.trial.take() {
            super::reaper::bury(trial.into_rails());
        }
        if s.broken {
            // A failed NIC's QPs may take long to destroy: not in NCCL's close.
            super::failover::stop(&s.rails, false);
            super::reaper::bury(std::mem::take(&mut s.rails));
        }
    }
}
