//! The sender's half of a move (the protocol is in `failover`): it stops its QPs, builds its
//! rails again on the NICs left and offers them; on the receiver's answer it brings them up,
//! counts done every posted send the receiver does not wait for, and sends the others again.

use super::{SendState, SLOTS};
use crate::error::{Error, Result};
use crate::transport::verbs::failover::{self, decode_answer, Phase, Step};
use crate::transport::verbs::rail::{locate, Rail};
use crate::transport::verbs::setup::{
    check_links, connect_probes, connect_qps, local_info, make_probes, make_rails, probe_qps,
    register_on, rkeys, time_work, End,
};
use crate::transport::verbs::wire::{cts_index, encode_qps, paths, ConnInfo};
use crate::transport::MAX_RECVS;
use crate::verbs::nic::{Nic, QueuePair};

/// Registrations of a buffer on the NICs a move takes: (registration, lkey, rkey) per rail.
type Regs<N> = Vec<(<N as Nic>::Mr, u32, u32)>;

/// What a move has made, until the receiver answers.
pub(crate) struct NewPath<N: Nic> {
    rails: Vec<Rail<N>>,
    sizes_regs: Regs<N>,
    fifo_regs: Regs<N>,
}

impl<N: Nic> SendState<N> {
    /// Rail `r` failed with `e`, or the peer's message came (then `e` only says so): moves the
    /// connection where it can, else returns the error (the comm fails with it).
    #[cold]
    #[inline(never)]
    pub(super) fn rail_failed(&mut self, r: usize, e: Error) -> Result<()> {
        let mail = self.rails[0].cq.mail.take();
        if self.rails[0].cq.peer_gone || self.mobility.moving() {
            return Err(e);
        }
        let (epoch, lost, why) = match mail {
            Some(m) => {
                let m = failover::MoveMsg::decode(&m.payload)?;
                if m.step != Step::Down || !self.mobility.enabled() {
                    return Err(refused(&self.peer, self.mobility.enabled()));
                }
                let why = format!("peer {} lost a path of the connection", self.peer);
                (m.epoch, m.lost, why)
            }
            None if self.mobility.enabled() && failover::movable(self.rails[r].failed_status) => {
                let (nqps, peer_rails) = (self.plan.nqps, self.remote_sizes.2);
                let lost = failover::lost_with(r, nqps, self.rails.len(), peer_rails);
                (self.mobility.epoch + 1, lost, e.to_string())
            }
            None => return Err(e),
        };
        self.begin_move(epoch, lost, &why)
    }

    /// Stops the QPs, builds the rails again on the NICs left and offers them to the receiver.
    fn begin_move(&mut self, epoch: u32, lost: [u8; 2], why: &str) -> Result<()> {
        failover::stop(&self.rails);
        let Some(chan) = self.rails[0].cq.unwatch() else {
            return Err(Error::remote(why.to_string()));
        };
        let before = self.mobility.order;
        self.mobility.begin(epoch, lost, chan, why);
        self.mobility.phase = Phase::Asked;
        self.mobile_work = true;
        self.hold_sends = super::NOT_AWAITED;
        let rails = self.rails.len();
        let Some(nics) = self.mobility.pick(rails, lost[0]) else {
            return Err(no_nic_left(why, &self.peer));
        };
        let (old, new) = self.mobility.describe(&before, rails, lost[0]);
        tracing::warn!(
            "{why}; moving the connection to peer {} {}",
            self.peer,
            failover::moved(&old, &new)
        );
        let (cost, p) = (self.mobility.cost, self.mobility.rebuild_params());
        let new_rails = make_rails(&nics, &cost, &p)?;
        let register = register_on(&nics);
        let sizes_regs = self.sizes_local.register_again(rails, register)?;
        let fifo_regs = self.fifo.register_again(rails, register)?;
        let info = local_info(&new_rails, self.fifo.addr(0), |r| fifo_regs[r].2, &p);
        self.mobility.send(Step::Offer, info.encode())?;
        self.moving_to = Some(NewPath {
            rails: new_rails,
            sizes_regs,
            fifo_regs,
        });
        Ok(())
    }

    /// Steps the move under way (true while it is) and sends again what is due.
    #[cold]
    #[inline(never)]
    pub(super) fn step_move(&mut self) -> Result<bool> {
        if self.mobility.moving() {
            self.mobility.check_bound(&self.peer)?;
            match self.mobility.poll(&self.peer)? {
                Some(m) if m.step == Step::Answer => self.finish_move(&m.body)?,
                // A `Down` of this move that crossed the offer.
                Some(_) | None => return Ok(true),
            }
        }
        self.replay_due()?;
        self.mobile_work = self.replay != 0;
        Ok(false)
    }

    /// The receiver answered (`body`): the new rails come up against its, and the sends it
    /// waits for are due again.
    fn finish_move(&mut self, body: &[u8]) -> Result<()> {
        let Some(new) = self.moving_to.take() else {
            return Err(Error::remote(format!(
                "{}: failover answer out of turn",
                self.peer
            )));
        };
        let (info, waiting) = decode_answer(body)?;
        let remote = ConnInfo::decode(info)?;
        let mut rails = new.rails;
        let p = self.mobility.params;
        check_links(&rails, &remote, &self.peer)?;
        let nqps = self.plan.nqps;
        let paths = paths(nqps, rails.len(), remote.rails.len());
        if remote.qps.len() != nqps || remote.probes.len() != paths.len() {
            return Err(Error::remote(format!(
                "{} answered the move with {} QPs and {} probes for {nqps} and {}",
                self.peer,
                remote.qps.len(),
                remote.probes.len(),
                paths.len()
            )));
        }
        let tc_sl = (p.traffic_class, p.sl);
        connect_qps(&rails, &remote, &p, tc_sl.0, tc_sl.1)?;
        let probes = make_probes(&mut rails, &paths, End::Connector, &remote)?;
        time_work(&mut rails, &p, &self.peer);
        let theirs = &remote.probes;
        connect_probes(
            &rails,
            &probes,
            &paths,
            End::Connector,
            theirs,
            &remote,
            &p,
            tc_sl,
        )?;
        let ours = probe_qps(&rails, &probes);
        let old = std::mem::replace(&mut self.rails, rails);
        let old_regs = self.sizes_local.adopt(new.sizes_regs);
        self.fifo_regs = new.fifo_regs.into_iter().map(|(mr, _, _)| mr).collect();
        self.remote_sizes = (remote.addr, rkeys(&remote), remote.rails.len());
        self.keys.reorder(self.mobility.order);
        for q in 0..nqps {
            let (r, i) = locate(q, self.plan.rails);
            self.sq_room[q] = self.rails[r].qps[i].max_send_wr();
        }
        // The receives still waiting, keyed for the new NICs, as if their entries had landed.
        let mut waits = [None; SLOTS];
        for (slot, entries) in &waiting {
            let slot = *slot % SLOTS;
            for (i, e) in entries.iter().enumerate() {
                self.fifo.set(cts_index(slot, i), *e);
            }
            waits[slot] = entries.first().map(|e| e.seq.wrapping_sub(1));
        }
        self.settle(&waits)?;
        self.mobility.send(Step::Resume, encode_qps(&ours))?;
        self.hold_sends = 0;
        if let Some((chan, took)) = self.mobility.end() {
            self.rails[0].cq.watch(chan);
            tracing::info!(
                "connection to peer {} moved in {} ms; {} slots sent again",
                self.peer,
                took.as_millis(),
                self.replay.count_ones()
            );
        }
        drop(old);
        drop(old_regs);
        Ok(())
    }

    /// Counts done every posted send whose receive is not in `waits` (the receive numbers
    /// waiting, by slot), marks the others to send again, and looks every matched send's keys
    /// up again for the new NICs.
    fn settle(&mut self, waits: &[Option<u64>; SLOTS]) -> Result<()> {
        for (slot, waits) in waits.iter().enumerate() {
            let seq = self.seq_of(slot);
            let st = &mut self.slots[slot];
            if !st.busy {
                continue;
            }
            if st.posted && !st.done() {
                if *waits == Some(seq) {
                    self.replay |= 1 << slot;
                } else {
                    st.cqe_pending = 0;
                }
            }
            // Only sends still to be written need keys (NCCL may have released the others'
            // registrations).
            if st.posted && self.replay & (1 << slot) == 0 {
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
        Ok(())
    }

    /// The receive number of busy `slot`: the last one before `seq` to use it.
    fn seq_of(&self, slot: usize) -> u64 {
        let back = (self.seq as usize + 2 * SLOTS - 1 - slot) % SLOTS;
        self.seq.wrapping_sub(1 + back as u64)
    }

    /// Sends again, oldest first, the slots due whose QPs have room.
    fn replay_due(&mut self) -> Result<()> {
        while self.replay != 0 {
            let Some(slot) = (0..SLOTS)
                .filter(|s| self.replay & (1 << s) != 0)
                .min_by_key(|&s| self.seq_of(s))
            else {
                break;
            };
            let (seq, st) = (self.seq_of(slot), self.slots[slot]);
            let n = st.all.count_ones() as usize;
            if !self.room_for_slot(seq, n, st.room) {
                break;
            }
            let used = self.write_slot(slot, n, seq)?;
            self.slots[slot].cqe_pending = used as u32;
            self.replay &= !(1 << slot);
        }
        Ok(())
    }
}

#[cold]
fn no_nic_left(why: &str, peer: &str) -> Error {
    Error::remote(format!(
        "{why}; no other NIC of this link layer is left to carry the connection to peer {peer}"
    ))
}

#[cold]
fn refused(peer: &str, enabled: bool) -> Error {
    let why = if enabled {
        "out of turn"
    } else {
        "but failover is off here (NCCL_ERDMA_FAILOVER=0, or no other NIC)"
    };
    Error::remote(format!(
        "peer {peer} moved the connection off a failed NIC {why}"
    ))
}
