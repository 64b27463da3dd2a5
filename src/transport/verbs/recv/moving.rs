//! The receiver's half of a move (the protocol is in `failover`): a fault it saw, or the
//! sender's offer, stops its QPs, and what its CQs already hold is final; on the offer it
//! makes its rails again, joins the sender's, posts again the receives still waiting and
//! answers with their clear-to-send entries; on `Resume` it brings its probes up and carries
//! data again. None of it waits: each step is taken by a later call. A NIC that cannot be
//! brought up towards the sender (its link went down) is lost as on the data path: where
//! this end finds it (joining an offer, its probes at `Resume`) it says `Down` for the next
//! move; where the sender does, its next offer comes in place of the `Resume`.
//!
//! A receiver using GPUDirect keeps the dead NIC's loopback flush QPs going after the stop:
//! the flushes posted there complete there, and one more read through each orders every write
//! that NIC placed in GPU memory before any later flush, which goes through the new NIC (a
//! read through another PCIe function does not order them), is reported done.

use std::time::Instant;

use super::slot::{flushed, landed, FlushSlot};
use super::{Draining, Movement, OldRegs, RecvGate, RecvState, SLOTS};
use crate::error::{Error, Result};
use crate::transport::verbs::bringup::{register_on, rkeys, Bringup, Probes, Role};
use crate::transport::verbs::failover::{self, Moving};
use crate::transport::verbs::fault::Fault;
use crate::transport::verbs::rail::Rail;
use crate::transport::verbs::reaper;
use crate::transport::verbs::trial;
use crate::transport::verbs::wire::{
    cts_index, decode_qps, decode_trial, encode_answer, encode_trial, locate, ConnInfo, CtsEntry,
    Healed, MoveMsg, Step, Waiting, WrKind,
};
use crate::transport::MAX_RAILS;
use crate::verbs::dma::{FixedWrite, SendChain, WcBatch, WC_RECV_RDMA_WITH_IMM, WC_SUCCESS};
use crate::verbs::nic::{MemoryRegion, Nic};

/// What the CQs of stopped `rails` hold now (polled until empty): each completion's work
/// request id, and the immediate of a receive that landed.
fn old_completions<N: Nic>(rails: &[Rail<N>]) -> Vec<(u64, Option<u32>)> {
    let mut out = Vec::new();
    let mut wc = WcBatch::new();
    for rail in rails {
        while let Ok(n @ 1..) = wc.poll(&*rail.nic, &rail.cq.cq) {
            out.extend(wc.iter().map(|c| {
                let landed = c.status() == WC_SUCCESS && c.opcode() == WC_RECV_RDMA_WITH_IMM;
                (c.wr_id(), landed.then(|| c.write_imm()))
            }));
            if n < WcBatch::CAPACITY {
                break;
            }
        }
    }
    out
}

impl<N: Nic> RecvState<N> {
    /// A rail met `f`: the connection moves where a move can mend it and both ends can move;
    /// else `f` fails the comm. The peer is heard first: it may have moved already (then `f`
    /// was of rails the move replaced, even where the move has ended by now), or left.
    #[cold]
    #[inline(never)]
    pub(super) fn on_fault(&mut self, gate: &RecvGate<N>, f: Fault) -> Result<()> {
        self.broken = true;
        let seen_in = self.mobility.epoch;
        self.listen(gate)?;
        if self.mobility.epoch != seen_in || !self.still() || self.link.ended().is_some() {
            // A move the peer began; or the peer left (`test` fails what did not land).
            return Ok(());
        }
        self.move_off(gate, f)
    }

    /// Moves the connection off what `f` broke (this end's rails carrying data, or just up):
    /// its QPs stop and the sender is told `Down`; else `f` fails the comm.
    fn move_off(&mut self, gate: &RecvGate<N>, f: Fault) -> Result<()> {
        let shape = (self.plan.nqps, self.rails.len(), self.plan.rails);
        let ([mine, theirs], why) = self.mobility.lost_to(f, shape, self.link.peer())?;
        let epoch = self.mobility.epoch + 1;
        let moving = Moving::new(epoch, [theirs, mine], why, &self.mobility.params);
        self.mobility.epoch = moving.epoch;
        self.stop(gate);
        self.link.send(&moving.message(Step::Down, Vec::new()));
        self.movement = Movement::Down(moving);
        Ok(())
    }

    /// Reads what the peer sent: a move it begins.
    #[cold]
    pub(super) fn listen(&mut self, gate: &RecvGate<N>) -> Result<()> {
        while let Some(msg) = self.link.poll() {
            self.heard(gate, msg)?;
        }
        self.link.trusted()?;
        self.drain_old();
        Ok(())
    }

    /// Rail 0's slow checks ran: the peer is heard and, where this end watches its NICs,
    /// they are looked at, and the sender told of those healed, and once this end's own NICs
    /// can carry the connection again (it moves the connection back).
    #[cold]
    pub(super) fn checked(&mut self, gate: &RecvGate<N>) -> Result<()> {
        self.listen(gate)?;
        if self
            .trial
            .as_ref()
            .is_some_and(|(_, until)| Instant::now() > *until)
        {
            self.bury_trial();
        }
        if self.mobility.watching() {
            if let Some(h) = self.mobility.news(Instant::now()) {
                self.link.send(&h.message(self.mobility.epoch));
            }
        }
        Ok(())
    }

    /// Move message `msg` came.
    fn heard(&mut self, gate: &RecvGate<N>, msg: MoveMsg) -> Result<()> {
        let epoch = msg.epoch;
        match self.take_step(gate, msg) {
            // The sender waits for an answer, or goes on as if moved: it is told.
            Err(e) if epoch >= self.mobility.epoch => {
                Err(failover::refuse(&mut self.link, epoch, e))
            }
            r => r,
        }
    }

    /// Takes move message `msg`: the step it asks for, where it is this end's turn.
    fn take_step(&mut self, gate: &RecvGate<N>, msg: MoveMsg) -> Result<()> {
        let peer = self.link.peer();
        let epoch = self.mobility.epoch;
        match (&self.movement, msg.step) {
            // Carrying data; or answered, and the sender could not join the answer.
            (Movement::Still | Movement::Answered(..), Step::Offer)
                if msg.epoch > epoch && self.mobility.able() =>
            {
                self.mobility.epoch = msg.epoch;
                let why = if msg.lost == [0; 2] {
                    format!("peer {peer} moves the connection back, its NICs healed")
                } else {
                    format!("peer {peer} lost a path of the connection")
                };
                let moving = Moving::new(msg.epoch, msg.lost, why, &self.mobility.params);
                self.stop(gate);
                self.accept_offer(gate, moving, &msg)
            }
            (Movement::Still | Movement::Answered(..), Step::Offer) if msg.epoch > epoch => {
                let e = failover::cannot_move(peer);
                Err(failover::refuse(&mut self.link, msg.epoch, e))
            }
            (Movement::Down(m), Step::Offer) if msg.epoch == m.epoch => {
                let moving = m.clone();
                self.accept_offer(gate, moving, &msg)
            }
            (Movement::Answered(m, _), Step::Resume) if msg.epoch == m.epoch => {
                self.resume(gate, &msg.body)
            }
            (_, Step::Healed) => {
                let h = self.link.read(Healed::decode(&msg.body))?;
                self.mobility.heard(h, msg.epoch);
                Ok(())
            }
            (Movement::Still, Step::Trial) if msg.epoch == epoch => {
                let (number, rails) = self.link.read(decode_trial(&msg.body))?;
                let remote = self.link.read(ConnInfo::decode(rails))?;
                self.answer_trial(&remote, (epoch, number));
                Ok(())
            }
            // Of this move or an earlier one: the peer fails its comm with it.
            (_, Step::Refuse) => Err(failover::refused(peer, &msg)),
            // A message of an older move.
            _ if msg.epoch < epoch => Ok(()),
            (Movement::Still, _) => Err(failover::out_of_turn(peer, &msg, "carried data")),
            _ => Err(failover::out_of_turn(peer, &msg, "was moving")),
        }
    }

    /// The sender tries the path a move back would take (`remote`: its rails on its own
    /// NICs), in trial `number` of move `epoch`: this end's own NICs' rails are joined to
    /// them, kept for its writes, and described in the `Tried` (no rails where they cannot be
    /// brought up).
    fn answer_trial(&mut self, remote: &ConnInfo, (epoch, number): (u32, u32)) {
        self.bury_trial();
        let peer = self.link.peer();
        let rails = match self.mobility.homes(self.plan.nqps, peer) {
            Ok((homes, cost, p)) => {
                let (made, rails) = trial::answer(&homes, (&cost, p), remote, peer);
                let until = Instant::now() + trial::kept_for(&p);
                self.trial = made.map(|made| (made, until));
                rails
            }
            Err(e) => {
                tracing::debug!("a trial of the path to peer {peer}: {e}");
                Vec::new()
            }
        };
        self.link.send(&MoveMsg {
            step: Step::Tried,
            epoch,
            lost: [0; 2],
            body: encode_trial(number, &rails),
        });
    }

    /// The rails of the sender's trial, once it is over (or kept long enough): to the reaper.
    fn bury_trial(&mut self) {
        if let Some((trial, _)) = self.trial.take() {
            reaper::bury(trial);
        }
    }

    /// Steps the move under way: true while the rails are not to be polled (until the sender
    /// resumes).
    #[cold]
    #[inline(never)]
    pub(super) fn step_move(&mut self, gate: &RecvGate<N>) -> Result<bool> {
        // The peer's messages first: one polled late still finishes the move.
        self.listen(gate)?;
        let moving = match &self.movement {
            Movement::Still => return Ok(false),
            Movement::Down(m) | Movement::Answered(m, _) => m,
        };
        if self.link.ended().is_some() {
            // `test` fails what did not land, with the peer's leaving.
            return Ok(true);
        }
        moving.check_bound(self.link.peer())?;
        Ok(true)
    }

    /// Stops every QP (but the flush QPs) and takes what the CQs already hold: a receive
    /// whose completion is there has landed; any other is posted again after the move. A
    /// completion that comes later is not taken: the sender sends its immediate again.
    fn stop(&mut self, gate: &RecvGate<N>) {
        self.broken = true;
        failover::stop(&self.rails, true);
        for (wr_id, arrived) in old_completions(&self.rails) {
            let slot = WrKind::slot(wr_id);
            match (WrKind::of(wr_id), arrived) {
                (Some(WrKind::Recv), Some(imm)) => {
                    landed(&mut self.slots[slot], gate, slot, imm);
                }
                (Some(WrKind::Flush), _) => flushed(&mut self.flush_slots[slot]),
                _ => {}
            }
        }
    }

    /// The sender offered its new rails (`m`) for move `moving`: this end's are made and
    /// joined to them, the receives still waiting posted on them, and the answer sent. The
    /// old rails go to the reaper once their flush reads are in.
    fn accept_offer(&mut self, gate: &RecvGate<N>, mut moving: Moving, m: &MoveMsg) -> Result<()> {
        self.bury_trial();
        let remote = self.link.read(ConnInfo::decode(&m.body))?;
        moving.lost = [moving.lost[0] | m.lost[0], moving.lost[1] | m.lost[1]];
        let before = self.mobility.order;
        let rails_n = self.rails.len();
        let Some(nics) = self.mobility.pick(rails_n, moving.lost[1]) else {
            let e = failover::no_nic_left(&moving.why, self.link.peer());
            return Err(failover::refuse(&mut self.link, moving.epoch, e));
        };
        moving.announce(self.link.peer(), self.mobility.describe(&before, rails_n));
        if remote.qps.len() != self.plan.nqps {
            let e = Error::remote(format!(
                "{} offered {} QPs for the connection's {}",
                self.link.peer(),
                remote.qps.len(),
                self.plan.nqps
            ));
            return Err(failover::refuse(&mut self.link, moving.epoch, e));
        }
        let made = (|| {
            let p = self.mobility.rebuild_params();
            let cost = self
                .mobility
                .fitted(&nics, self.plan.nqps, self.link.peer())?;
            let new = Bringup::make(&nics, &cost, p, Role::Answers)?;
            let register = register_on(&nics);
            let regs = (
                self.cts_local.register_again(rails_n, register)?,
                self.sizes_record.register_again(rails_n, register)?,
                self.flush_target.register_again(rails_n, register)?,
            );
            Ok((new, regs))
        })();
        let (mut new, regs) = match made {
            Ok(made) => made,
            Err(e) => return Err(failover::refuse(&mut self.link, moving.epoch, e)),
        };
        let mut lkeys = [0; MAX_RAILS];
        for (k, reg) in lkeys.iter_mut().zip(&regs.2) {
            *k = reg.1;
        }
        let landing = (self.flush_target.addr(1), lkeys);
        if let Err(f) = new.join(&remote, landing, self.link.peer()) {
            // A NIC taken cannot reach the sender: lost too, in the next move.
            reaper::bury((new, regs));
            self.mobility.peer_mobile = remote.mobile;
            return self.move_off(gate, f);
        }
        let records = self.sizes_record.addr(0);
        let info = new.describe(records, |r| regs.1[r].2, self.mobility.able());
        let (rails, probes) = new.into_parts()?;
        // Read before the waiting receives' entries are keyed for the new NICs.
        let target = self.order_target();
        let old_rails = std::mem::replace(&mut self.rails, rails);
        let old_regs = OldRegs {
            flush: self.flush_target.adopt(regs.2),
            _others: [
                self.cts_local.adopt(regs.0),
                self.sizes_record.adopt(regs.1),
            ],
        };
        if let Some(cqs) = gate.follow(&self.rails) {
            reaper::bury(cqs);
        }
        self.keys.reorder(self.mobility.order);
        self.mobility.peer_mobile = remote.mobile;
        self.remote_fifo = (remote.addr, rkeys(&remote));
        self.cts_write = FixedWrite::new(self.cts_local.lkey(0), self.remote_fifo.1[0]);
        self.cts_unsignaled = 0;
        let waiting = self.post_again(gate)?;
        // Every receive posted is announced by the answer.
        self.cts_posted = self.seq;
        self.link
            .send(&moving.message(Step::Answer, encode_answer(&info.encode(), &waiting)));
        self.leave(old_rails, old_regs, target);
        self.movement = Movement::Answered(moving, Box::new(probes));
        Ok(())
    }

    /// Posts again, on the new QPs, every receive still waiting, its entries keyed for the new
    /// NICs; returns them, as the answer carries them.
    fn post_again(&mut self, gate: &RecvGate<N>) -> Result<Waiting> {
        let mut waiting = Waiting::new();
        // Oldest first: the sender writes them again in this order, each QP's receives
        // consumed in the order they are posted.
        for seq in self.seq.saturating_sub(SLOTS as u64)..self.seq {
            let slot = (seq % SLOTS as u64) as usize;
            let st = self.slots[slot];
            if !st.busy || !gate.waits(slot) || st.span.2 != seq {
                continue;
            }
            let mut entries = Vec::with_capacity(st.n);
            for i in 0..st.n {
                let e = self.cts_local.get(cts_index(slot, i));
                let len = e.size as usize;
                let mem = self.keys.keys_at(st.mhandles[i], e.addr, len)?;
                let entry = CtsEntry::new(e.addr, len, mem.rkeys, e.tag, st.n, seq);
                self.cts_local.set(cts_index(slot, i), entry);
                entries.push(entry);
            }
            let (first, used, _) = st.span;
            for q in first..first + used {
                let (r, i) = locate(q, self.rails.len());
                let rail = &self.rails[r];
                rail.nic.post_recv(&rail.qps[i], WrKind::Recv.id(slot))?;
            }
            self.slots[slot].imm_pending = used as u32;
            waiting.push((slot, entries));
        }
        Ok(waiting)
    }

    /// The old `rails` (and `regs`, the comm's buffers' registrations on their NICs) after a
    /// move: to the reaper, once the reads through their flush QPs are in. One more read
    /// through each, of `target` (a byte of the last receive's buffer, which the NIC wrote),
    /// orders the NIC's writes ahead of any later flush.
    fn leave(
        &mut self,
        rails: Vec<Rail<N>>,
        regs: OldRegs<N>,
        target: Option<(u64, [u32; MAX_RAILS])>,
    ) {
        if let Some(old) = self.draining.take() {
            reaper::bury(old);
        }
        let mut reads = 0;
        let mut chain = SendChain::new();
        for (r, rail) in rails.iter().enumerate() {
            let (Some(qp), Some((addr, rkeys)), Some(mr)) =
                (&rail.flush_qp, target, regs.flush.get(r))
            else {
                continue;
            };
            chain.clear();
            chain.read(self.flush_target.addr(0), 1, mr.lkey(), addr, rkeys[r]);
            chain.finish(WrKind::Order.id(0), 0);
            match chain.post(&*rail.nic, qp) {
                Ok(()) => reads += 1,
                Err(e) => tracing::debug!("ordering read on {}: {e}", rail.name()),
            }
        }
        let flushing = (0..SLOTS)
            .filter(|&f| matches!(self.flush_slots[f], FlushSlot::Pending(n) if n > 0))
            .fold(0u32, |m, f| m | 1 << f);
        if reads == 0 && flushing == 0 {
            reaper::bury((rails, regs));
            return;
        }
        let wait = self
            .mobility
            .params
            .failover
            .unwrap_or(std::time::Duration::from_secs(1));
        self.draining = Some(Draining {
            rails,
            _regs: regs,
            reads,
            flushing,
            until: Instant::now() + wait,
        });
    }

    /// A byte the dead NIC wrote: the first buffer of the last receive posted (its address,
    /// and its keys by rail), where it is not empty.
    fn order_target(&self) -> Option<(u64, [u32; MAX_RAILS])> {
        let last = self.seq.checked_sub(1)?;
        let e = self
            .cts_local
            .get(cts_index((last % SLOTS as u64) as usize, 0));
        (e.size > 0).then_some((e.addr, e.rkeys))
    }

    /// Polls the rails a move left for their flush reads; once they are in (or waited for
    /// long enough: a NIC that answers nothing writes nothing more, and its flushes are
    /// taken as done), they go to the reaper.
    pub(super) fn drain_old(&mut self) {
        let Some(mut d) = self.draining.take() else {
            return;
        };
        for (wr_id, _) in old_completions(&d.rails) {
            let f = WrKind::slot(wr_id);
            match WrKind::of(wr_id) {
                Some(WrKind::Flush) if d.flushing & (1 << f) != 0 => {
                    flushed(&mut self.flush_slots[f]);
                    if self.flush_slots[f] == FlushSlot::Done {
                        d.flushing &= !(1 << f);
                    }
                }
                Some(WrKind::Order) => d.reads = d.reads.saturating_sub(1),
                _ => {}
            }
        }
        let waited = Instant::now() > d.until;
        if d.reads == 0 && d.flushing == 0 || waited {
            for f in (0..SLOTS).filter(|f| d.flushing & (1 << f) != 0) {
                self.flush_slots[f] = FlushSlot::Done;
            }
            reaper::bury(d);
        } else {
            self.draining = Some(d);
        }
    }

    /// The connection's setup, as move 0: this end's rails, made and joined to the connector's
    /// offer (its hello), were answered; the connector's `Resume`, with the probe QPs `probes`
    /// come up against, is awaited. Nothing is announced before it: the connector's QPs come
    /// up as it reads the answer.
    pub(crate) fn answered_setup(&mut self, probes: Probes) {
        self.movement = Movement::Answered(Moving::setup(), Box::new(probes));
    }

    /// The sender is up (`body`: its probe QPs): this end's probes come up, the flushes asked
    /// for meanwhile go out, and the connection carries data again.
    fn resume(&mut self, gate: &RecvGate<N>, body: &[u8]) -> Result<()> {
        let Movement::Answered(moving, probes) =
            std::mem::replace(&mut self.movement, Movement::Still)
        else {
            return Ok(());
        };
        let theirs = self.link.read(decode_qps(body, probes.paths()))?;
        if let Err(f) = probes.connect(&self.rails, &theirs, self.link.peer()) {
            // A NIC whose link went down since the answer: lost as on the data path.
            return self.move_off(gate, f);
        }
        self.flush_again()?;
        let (peer, ms) = (self.link.peer(), moving.took().as_millis());
        if moving.is_setup() {
            tracing::debug!("connected to peer {peer} in {ms} ms");
        } else {
            tracing::info!("connection to peer {peer} {}", moving.ended());
        }
        Ok(())
    }

    /// Posts, on every rail, each flush asked for while the connection moved.
    fn flush_again(&mut self) -> Result<()> {
        for f in 0..SLOTS {
            if self.flush_slots[f] != FlushSlot::Pending(0) {
                continue;
            }
            let (addr, mhandle) = self.flush_of[f];
            let mem = self.keys.keys_at(mhandle, addr, 1)?;
            let posted = self.post_flush(f, addr, &mem)?;
            self.flush_slots[f] = if posted == 0 {
                FlushSlot::Done
            } else {
                FlushSlot::Pending(posted)
            };
        }
        Ok(())
    }

    /// The receives numbered below this had all landed (what the sender is told at close).
    pub(super) fn landed_below(&self, gate: &RecvGate<N>) -> u64 {
        (self.seq.saturating_sub(SLOTS as u64)..self.seq)
            .find(|&seq| {
                let slot = (seq % SLOTS as u64) as usize;
                let st = &self.slots[slot];
                st.busy && st.span.2 == seq && gate.waits(slot)
            })
            .unwrap_or(self.seq)
    }
}
