//! The sender's half of a move (the protocol is in `failover`): a fault it saw, or the
//! receiver's `Down`, stops its QPs; it makes its rails again on the NICs left and offers
//! them; on the receiver's answer it joins the receiver's rails, counts done every posted send
//! the receiver does not wait for, and sends the others again before anything else. A NIC
//! that cannot join (its link went down since it was offered) is lost as any other: the next
//! move begins at once, and so it does where the receiver says `Down` for its offer. Setup is
//! move 0: the comm starts with its rails offered in the connector's hello, and the
//! listener's answer also gives the connection its shape (`shape_of`).

use std::time::Instant;

use super::slot::Replay;
use super::{MovedRegs, Movement, Offered, SendState, PROBE_AT, SLOTS};
use crate::error::{Error, Result};
use crate::transport::verbs::bringup::{register_on, rkeys, Bringup, Role};
use crate::transport::verbs::budget::EndCost;
use crate::transport::verbs::failover::{self, Moving};
use crate::transport::verbs::fault::Fault;
use crate::transport::verbs::gate::cts_of_landed;
use crate::transport::verbs::heal::Moment;
use crate::transport::verbs::reaper;
use crate::transport::verbs::trial::{Trial, Verdict};
use crate::transport::verbs::wire::{
    cts_index, decode_answer, decode_trial, encode_qps, ConnInfo, Healed, MoveMsg, QpPlan, Step,
    Waiting, WrKind,
};
use crate::transport::{MAX_RAILS, MAX_RECVS};
use crate::verbs::nic::Nic;

/// A move's rails, joined to the receiver's answer, which waits for `waiting`.
struct Joined<N: Nic> {
    moving: Moving,
    new: Bringup<N>,
    regs: Option<MovedRegs<N>>,
    waiting: Waiting,
}

impl<N: Nic> SendState<N> {
    /// A rail met `f`: the connection moves where a move can mend it and both ends can move;
    /// else `f` fails the comm. The peer is heard first: it may have moved already, or left
    /// (then the sends it said had landed complete, and the rest fail with its leaving).
    #[cold]
    #[inline(never)]
    pub(super) fn on_fault(&mut self, f: Fault) -> Result<()> {
        self.broken = true;
        let seen_in = self.mobility.epoch;
        self.listen()?;
        if self.mobility.epoch != seen_in || matches!(self.movement, Movement::Offered(_)) {
            // The peer's `Down` came: the move it asked for is under way, off the rails `f`
            // was of. (A fault while sending again after a move is of the new rails.)
            return Ok(());
        }
        if self.link.ended().is_some() {
            // A peer that closed after its data landed is no error of the sends it got:
            // `test` fails only the others, with its leaving.
            return Ok(());
        }
        let (lost, why) = self.mobility.lost_to(f, self.shape(), self.link.peer())?;
        self.begin_move(self.mobility.epoch + 1, lost, why)
    }

    /// This end's QPs, its rails and the peer's: what a fault's lost rails are read against.
    fn shape(&self) -> (usize, usize, usize) {
        (self.plan.nqps, self.rails.len(), self.remote_sizes.2)
    }

    /// Reads what the peer sent: a move it begins, its `Bye`, that its NICs healed. Once a
    /// move is offered, the rest is the move's (`step_move` reads it): the receiver may
    /// answer the offer before this look at the link is over.
    #[cold]
    pub(super) fn listen(&mut self) -> Result<()> {
        while !matches!(self.movement, Movement::Offered(_)) {
            let Some(msg) = self.link.poll() else {
                break;
            };
            self.heard(msg)?;
        }
        self.link.trusted()?;
        if let Some(landed) = self.link.landed() {
            self.landed_below(landed);
        }
        Ok(())
    }

    /// Rail 0's slow checks ran: the peer is heard and, where this end watches its NICs,
    /// they are looked at (the receiver told of those healed), and a connection off its own
    /// NICs moves back once they, and the receiver's, can carry it again, at a moment the
    /// receiver answers at once (`heal::Moment`).
    #[cold]
    pub(super) fn checked(&mut self) -> Result<()> {
        self.listen()?;
        if !self.mobility.watching() {
            return Ok(());
        }
        let now = Instant::now();
        if let Some(h) = self.mobility.news(now) {
            self.link.send(&h.message(self.mobility.epoch));
        }
        if !self.still() {
            return Ok(());
        }
        if self.trial.is_some() {
            return self.judge_trial(now);
        }
        if self.mobility.back_due(now, self.moment()) && self.mobility.may_try(now) {
            self.try_homes();
        }
        Ok(())
    }

    /// Tries the path over this end's own NICs to the receiver's (`trial`), which the move
    /// back waits for.
    fn try_homes(&mut self) {
        let peer = self.link.peer();
        self.trials = self.trials.wrapping_add(1);
        let number = (self.mobility.epoch, self.trials);
        let made = self
            .mobility
            .homes(self.plan.nqps, peer)
            .and_then(|(homes, cost, p)| Trial::offer(&homes, &cost, p, number));
        match made {
            Ok((trial, msg)) => {
                self.link.send(&msg);
                self.trial = Some(trial);
            }
            Err(e) => tracing::info!(
                "the path to peer {peer} over the NICs the connection was placed on cannot be \
                 tried ({e}); it stays where it is"
            ),
        }
    }

    /// Where the trial stands: passed, the connection moves back once the sends in flight
    /// have completed and a receive waits for a send (`drained`); failed, the NICs of the
    /// rails away from home count as lost again.
    fn judge_trial(&mut self, now: Instant) -> Result<()> {
        let Some(trial) = &mut self.trial else {
            return Ok(());
        };
        match trial.verdict(now, self.link.peer()) {
            Verdict::Waiting => Ok(()),
            Verdict::Passed => {
                // Nothing in flight there, on NICs that answer: gone at once, so that the
                // move back is sized without it.
                let holds_until = trial.holds_until();
                self.trial = None;
                self.movement = Movement::Draining(holds_until);
                self.drained()
            }
            Verdict::Failed(f) => {
                self.bury_trial();
                self.mobility.homes_unreachable();
                tracing::info!(
                    "the NICs the connection to peer {} was placed on do not reach it yet \
                     ({}); it stays where it is, and tries them again later",
                    self.link.peer(),
                    f.error
                );
                Ok(())
            }
            Verdict::Unanswered => {
                self.bury_trial();
                Ok(())
            }
        }
    }

    /// The trial, over: its rails to the reaper.
    fn bury_trial(&mut self) {
        if let Some(trial) = self.trial.take() {
            reaper::bury(trial.into_rails());
        }
    }

    /// The traffic, as a move back weighs it: sends in flight, or else a receive waiting for
    /// a send not sent yet.
    fn moment(&self) -> Moment {
        if self.in_flight() {
            Moment::Busy
        } else if self.receive_waits() {
            Moment::Between
        } else {
            Moment::Idle
        }
    }

    /// Whether sends are posted that NCCL has not yet seen done (`test`).
    fn in_flight(&self) -> bool {
        self.slots.iter().any(|st| st.busy && st.posted)
    }

    /// Whether a receive waits for a send not sent yet: its clear-to-send landed, unmatched
    /// or matched in part.
    fn receive_waits(&self) -> bool {
        cts_of_landed(&self.fifo, self.seq) || self.slots.iter().any(|st| st.busy && !st.posted)
    }

    /// A move back drains (`Movement::Draining`): once no send is in flight, it begins where
    /// a receive waits for a send, which the receiver tests until the move is over (and
    /// where the move back may still be made). Until then nothing could be sent anyway; a
    /// receiver done with all it posted may call nothing for minutes, so past the instant the
    /// trial holds until, the connection carries on where it is, and a later trial moves it
    /// back.
    fn drained(&mut self) -> Result<()> {
        let Movement::Draining(holds_until) = self.movement else {
            return Ok(());
        };
        if self.in_flight() {
            return Ok(());
        }
        let now = Instant::now();
        if !self.receive_waits() {
            if now >= holds_until {
                self.movement = Movement::Still;
            }
            return Ok(());
        }
        self.movement = Movement::Still;
        if !self.mobility.back_ready() {
            return Ok(());
        }
        self.mobility.returning(now);
        let why = "the NICs the connection was placed on healed".to_string();
        self.begin_move(self.mobility.epoch + 1, [0; 2], why)
    }

    /// A move message `msg` came (outside of a move's own steps).
    fn heard(&mut self, msg: MoveMsg) -> Result<()> {
        let peer = self.link.peer();
        match msg.step {
            Step::Down if msg.epoch > self.mobility.epoch && self.mobility.able() => {
                let why = format!("peer {peer} lost a path of the connection");
                self.begin_move(msg.epoch, msg.lost, why)
            }
            Step::Down if msg.epoch > self.mobility.epoch => {
                let e = failover::cannot_move(peer);
                Err(failover::refuse(&mut self.link, msg.epoch, e))
            }
            Step::Refuse => Err(failover::refused(peer, &msg)),
            // A `Down` that crossed the offer of its move, or older.
            Step::Down => Ok(()),
            Step::Healed => self.take_healed(&msg),
            Step::Tried => {
                let (number, rails) = self.link.read(decode_trial(&msg.body))?;
                let remote = match rails {
                    [] => None,
                    rails => Some(self.link.read(ConnInfo::decode(rails))?),
                };
                match &mut self.trial {
                    Some(trial) if msg.epoch == self.mobility.epoch && trial.number == number => {
                        trial.tried(remote, peer)
                    }
                    // Of a trial given up.
                    _ => {}
                }
                Ok(())
            }
            _ => Err(failover::out_of_turn(peer, &msg, "carried data")),
        }
    }

    /// The receiver's `Healed` (what its NICs can do), whenever it comes.
    fn take_healed(&mut self, msg: &MoveMsg) -> Result<()> {
        let h = self.link.read(Healed::decode(&msg.body))?;
        self.mobility.heard(h, msg.epoch);
        Ok(())
    }

    /// Stops the QPs, makes the rails again on the NICs left and offers them to the receiver.
    pub(super) fn begin_move(&mut self, epoch: u32, lost: [u8; 2], why: String) -> Result<()> {
        self.broken = true;
        self.bury_trial();
        failover::stop(&self.rails, false);
        self.mobility.epoch = epoch;
        let mut moving = Moving::new(epoch, lost, why, &self.mobility.params);
        let rails = self.rails.len();
        let before = self.mobility.order;
        let Some(nics) = self.mobility.pick(rails, lost[0]) else {
            let e = failover::no_nic_left(&moving.why, self.link.peer());
            return Err(failover::refuse(&mut self.link, epoch, e));
        };
        moving.announce(self.link.peer(), self.mobility.describe(&before, rails));
        let made = (|| {
            let p = self.mobility.rebuild_params();
            let cost = self
                .mobility
                .fitted(&nics, self.plan.nqps, self.link.peer())?;
            let new = Bringup::make(&nics, &cost, p, Role::Offers)?;
            let register = register_on(&nics);
            let sizes_regs = self.sizes_local.register_again(rails, register)?;
            let fifo_regs = self.fifo.register_again(rails, register)?;
            Ok((new, sizes_regs, fifo_regs))
        })();
        let (new, sizes, fifo) = match made {
            Ok(made) => made,
            Err(e) => return Err(failover::refuse(&mut self.link, epoch, e)),
        };
        let info = new.describe(self.fifo.addr(0), |r| fifo[r].2, self.mobility.able());
        let offer = moving.message(Step::Offer, info.encode());
        self.link.send(&offer);
        self.movement = Movement::Offered(Box::new(Offered {
            moving,
            new,
            regs: Some(MovedRegs { sizes, fifo }),
        }));
        Ok(())
    }

    /// Steps the move under way: true while the QPs are stopped (the answer awaited).
    #[cold]
    #[inline(never)]
    pub(super) fn step_move(&mut self) -> Result<bool> {
        if let Movement::Offered(o) = &self.movement {
            let epoch = o.moving.epoch;
            // The peer's messages first: one polled late still finishes the move.
            while let Some(msg) = self.link.poll() {
                let peer = self.link.peer();
                match msg.step {
                    Step::Answer if msg.epoch == epoch => {
                        // The receiver waits for a `Resume`: else a new offer, or a refusal.
                        let Movement::Offered(offered) =
                            std::mem::replace(&mut self.movement, Movement::Still)
                        else {
                            break;
                        };
                        let moved = match self.join_answer(*offered, &msg.body) {
                            Ok(joined) => self.finish_move(joined),
                            Err(f) => self.move_again(f),
                        };
                        if let Err(e) = moved {
                            return Err(failover::refuse(&mut self.link, epoch, e));
                        }
                        break;
                    }
                    // Of this move, or of an earlier one the peer could not finish.
                    Step::Refuse => return Err(failover::refused(peer, &msg)),
                    // The receiver could not bring its rails up against the offer.
                    Step::Down if msg.epoch > epoch => {
                        if let Movement::Offered(o) =
                            std::mem::replace(&mut self.movement, Movement::Still)
                        {
                            reaper::bury((o.new, o.regs));
                        }
                        let why = format!("peer {peer} could not join the move's rails");
                        self.begin_move(msg.epoch, msg.lost, why)?;
                        return Ok(true);
                    }
                    // What the receiver's NICs can do, whenever it comes.
                    Step::Healed => self
                        .take_healed(&msg)
                        .map_err(|e| failover::refuse(&mut self.link, epoch, e))?,
                    // A `Down` that crossed the offer, or a message of an older move.
                    Step::Down if msg.epoch <= epoch => {}
                    _ if msg.epoch < epoch => {}
                    _ => return Err(failover::out_of_turn(peer, &msg, "offered a move")),
                }
            }
            if let Movement::Offered(o) = &self.movement {
                if self.link.ended().is_some() {
                    // The peer closed: what it said had landed is done; `test` fails the
                    // rest with its leaving.
                    if let Some(landed) = self.link.landed() {
                        self.landed_below(landed);
                    }
                    return Ok(true);
                }
                o.moving.check_bound(self.link.peer())?;
                return Ok(true);
            }
        }
        self.replay_due()?;
        self.drained()?;
        Ok(matches!(self.movement, Movement::Offered(_)))
    }

    /// The receiver answered (`body`) the move `offered`: its rails come up against the
    /// receiver's. At setup, the answer also gives the connection its shape. Where a rail
    /// cannot be brought up, the rails made are the connection's (stopped), for the next move
    /// to replace the lost one.
    fn join_answer(
        &mut self,
        offered: Offered<N>,
        body: &[u8],
    ) -> std::result::Result<Joined<N>, Fault> {
        let Offered {
            moving,
            mut new,
            regs,
        } = offered;
        let (info, waiting) = self
            .link
            .read(decode_answer(body))
            .map_err(Fault::protocol)?;
        let remote = self
            .link
            .read(ConnInfo::decode(info))
            .map_err(Fault::protocol)?;
        if moving.is_setup() {
            let (plan, cost) = self.shape_of(&mut new, &remote).map_err(Fault::protocol)?;
            (self.plan, self.mobility.cost) = (plan, cost);
        } else if remote.qps.len() != self.plan.nqps {
            return Err(Fault::protocol(Error::remote(format!(
                "{} answered the move with {} QPs for {}",
                self.link.peer(),
                remote.qps.len(),
                self.plan.nqps
            ))));
        }
        self.remote_sizes = (remote.addr, rkeys(&remote), remote.rails.len());
        self.mobility.peer_mobile = remote.mobile;
        // The receiver's probes read the byte after the size records, keyed on the new NICs.
        let mut lkeys = [0; MAX_RAILS];
        for (r, k) in lkeys.iter_mut().enumerate().take(new.rails().len()) {
            *k = match &regs {
                Some(regs) => regs.sizes[r].1,
                None => self.sizes_local.lkey(r),
            };
        }
        let landing = (self.sizes_local.addr(PROBE_AT), lkeys);
        if let Err(f) = new.join(&remote, landing, self.link.peer()) {
            let old = std::mem::replace(&mut self.rails, new.into_rails());
            failover::stop(&self.rails, false);
            reaper::bury((old, regs));
            return Err(f);
        }
        Ok(Joined {
            moving,
            new,
            regs,
            waiting,
        })
    }

    /// The move's rails could not be joined to the receiver's (`f`): where a move mends
    /// that, the next one begins; else the comm fails with `f`.
    fn move_again(&mut self, f: Fault) -> Result<()> {
        let (lost, why) = self.mobility.lost_to(f, self.shape(), self.link.peer())?;
        self.begin_move(self.mobility.epoch + 1, lost, why)
    }

    /// The move's rails are up (`joined`): they are the connection's, the old go to the
    /// reaper, and the sends the receiver waits for are due again.
    fn finish_move(&mut self, joined: Joined<N>) -> Result<()> {
        let Joined {
            moving,
            new,
            regs,
            waiting,
        } = joined;
        let ours = new.probe_qps();
        let old_rails = std::mem::replace(&mut self.rails, new.into_rails());
        if let Some(MovedRegs { sizes, fifo }) = regs {
            let old_sizes = self.sizes_local.adopt(sizes);
            let fresh = fifo.into_iter().map(|(mr, _, _)| mr).collect();
            let old_fifo = std::mem::replace(&mut self.fifo_regs, fresh);
            reaper::bury((old_rails, old_sizes, old_fifo));
        }
        // Its probe QPs come up as it reads the `Resume`.
        self.receiver_up = false;
        self.keys.reorder(self.mobility.order);
        self.reset_room();
        // The receives still waiting, keyed for the new NICs, as if their entries had landed.
        let mut waits = [None; SLOTS];
        for (slot, entries) in &waiting {
            for (i, e) in entries.iter().enumerate() {
                self.fifo.set(cts_index(*slot, i), *e);
            }
            waits[*slot] = entries.first().map(|e| e.seq.wrapping_sub(1));
        }
        let replay = self.settle(&waits)?;
        self.link
            .send(&moving.message(Step::Resume, encode_qps(&ours)));
        if moving.is_setup() {
            tracing::debug!(
                "connected to peer {} in {} ms",
                self.link.peer(),
                moving.took().as_millis()
            );
        } else {
            tracing::info!(
                "connection to peer {} {}; {} slots sent again whole, {} their immediate only",
                self.link.peer(),
                moving.ended(),
                replay.whole.count_ones(),
                replay.landed.count_ones()
            );
        }
        self.movement = Movement::Replaying(replay);
        Ok(())
    }

    /// The connection's shape, from the listener's answer `remote` to the setup's `offer`
    /// (which keeps the QPs taken): the listener may take fewer QPs than offered (its
    /// device's limits), never fewer than this end's rails; the split setting is the
    /// receiver's. The plan and the cost the rails are made as, for once they are joined.
    fn shape_of(&mut self, offer: &mut Bringup<N>, remote: &ConnInfo) -> Result<(QpPlan, EndCost)> {
        let offered: usize = offer.rails().iter().map(|r| r.qps.len()).sum();
        let (rails, nqps) = (offer.rails().len(), remote.qps.len());
        if nqps > offered || nqps < rails {
            return Err(Error::remote(format!(
                "{} answered with {nqps} QPs for our {offered}",
                self.link.peer()
            )));
        }
        offer.keep_qps(nqps);
        if remote.split != self.plan.split {
            tracing::info!(
                "NCCL_IB_SPLIT_DATA_ON_QPS is {} here and {} at the receiver {}: the \
                 connection uses the receiver's",
                u8::from(self.plan.split),
                u8::from(remote.split),
                self.link.peer()
            );
        }
        self.link.name_devices(&remote.devices());
        let plan = QpPlan {
            nqps,
            rails,
            split: remote.split,
        };
        let cost = EndCost {
            qps: nqps,
            peer_rails: remote.rails.len(),
            ..self.mobility.cost
        };
        Ok((plan, cost))
    }

    /// What the receiver's answer means for each slot posted (`waits`: the receive numbers
    /// it still waits for, by slot): a send it does not wait for has landed (done); one it
    /// waits for is sent again, whole where no acknowledgement came, else only its immediate
    /// (the data is there, the receiver did not see it land). The sends still to be written
    /// are keyed again for the new NICs.
    fn settle(&mut self, waits: &[Option<u64>; SLOTS]) -> Result<Replay> {
        let mut replay = Replay::default();
        for (slot, waits) in waits.iter().enumerate() {
            let seq = self.seq_of(slot);
            let st = &mut self.slots[slot];
            let named = *waits == Some(seq);
            if st.posted && named && st.done() {
                replay.landed |= 1 << slot;
            } else if st.posted && named {
                replay.whole |= 1 << slot;
            } else if st.posted {
                st.cqe_pending = 0;
            }
            // Only sends still to be written need keys (NCCL may have released the others'
            // registrations).
            let writes = st.busy && (!st.posted || replay.whole & (1 << slot) != 0);
            if !writes {
                continue;
            }
            let st = *st;
            for e in (0..MAX_RECVS).filter(|e| st.matched & !st.trunc & (1 << e) != 0) {
                let mem = self
                    .keys
                    .keys_at(st.mhandles[e], st.addrs[e], st.sizes[e])?;
                let st = &mut self.slots[slot];
                for r in 0..self.plan.rails {
                    st.lkeys[e][r] = mem.lkey(r);
                }
                st.device_mem = st.device_mem & !(1 << e) | u8::from(!mem.host) << e;
            }
        }
        Ok(replay)
    }

    /// Sends again, oldest first, the slots due whose QPs have room; once none is left, the
    /// slot a failed post left matched but unposted goes out, and the connection carries
    /// data again.
    fn replay_due(&mut self) -> Result<()> {
        let Movement::Replaying(mut replay) = self.movement else {
            return Ok(());
        };
        while let Some(slot) = (0..SLOTS)
            .filter(|s| (replay.whole | replay.landed) & (1 << s) != 0)
            .min_by_key(|&s| self.seq_of(s))
        {
            let (seq, st) = (self.seq_of(slot), self.slots[slot]);
            if !self.room_for_slot(seq, st.n(), st.room) {
                break;
            }
            let whole = replay.whole & (1 << slot) != 0;
            let kind = if whole { WrKind::Send } else { WrKind::Landed };
            let used = match self.write_slot(slot, st.n(), seq, kind) {
                Ok(used) => used,
                Err(e) => {
                    self.movement = Movement::Replaying(replay);
                    return self.post_failed(e);
                }
            };
            if whole {
                self.slots[slot].cqe_pending = used as u32;
            }
            replay.whole &= !(1 << slot);
            replay.landed &= !(1 << slot);
        }
        if !replay.is_empty() {
            self.movement = Movement::Replaying(replay);
            return Ok(());
        }
        self.movement = Movement::Still;
        let slot = (self.seq % SLOTS as u64) as usize;
        let st = self.slots[slot];
        if st.busy && st.complete() && !st.posted {
            if let Err(e) = self.post_slot(slot, st.n()) {
                return self.post_failed(e);
            }
        }
        Ok(())
    }
}
