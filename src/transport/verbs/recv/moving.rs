//! The receiver's half of a move (the protocol is in `failover`): it stops its QPs and takes
//! what its CQs still hold as final; on the sender's offer it builds its rails again, posts
//! again the receives still waiting and answers with their clear-to-send entries; on the
//! sender's `Resume` it probes and announces again as before.

use std::time::{Duration, Instant};

use super::{FlushSlot, RecvGate, RecvState, SLOTS};
use crate::error::{Error, Result};
use crate::transport::verbs::failover::{self, encode_answer, MoveMsg, Phase, Step, Waiting};
use crate::transport::verbs::rail::locate;
use crate::transport::verbs::setup::{
    check_links, connect_probes, connect_qps, local_info, make_probes, make_rails, probe_qps,
    register_on, rkeys, time_work, End,
};
use crate::transport::verbs::wire::{cts_index, decode_qps, paths, ConnInfo, CtsEntry, WrKind};
use crate::verbs::dma::{Completion, FixedWrite, WcBatch, WC_RECV_RDMA_WITH_IMM, WC_SUCCESS};
use crate::verbs::nic::Nic;

/// How long the receiver waits for its stopped QPs' receives to complete as flushed.
const SALVAGE_BOUND: Duration = Duration::from_secs(2);
/// Or for this long without a completion: a receive completes within microseconds of its data
/// or not at all once its QP is stopped, and not every device flushes a stopped QP's receives
/// at once (Soft-RoCE with its link down may take seconds).
const SALVAGE_QUIET: Duration = Duration::from_millis(20);

/// What the receiver keeps between its answer and the sender's `Resume`: its probe QPs (per
/// path: rail, index), the paths, and the sender's rails.
pub(crate) struct Answered {
    probes: Vec<(usize, usize)>,
    paths: Vec<(usize, usize)>,
    remote: ConnInfo,
}

impl<N: Nic> RecvState<N> {
    /// Rail `r` failed with `e`, or the peer's message came (then `e` only says so), its last
    /// poll in `wc`: moves the connection where it can, else returns the error (the comm
    /// fails with it).
    #[cold]
    #[inline(never)]
    pub(super) fn rail_failed(
        &mut self,
        gate: &RecvGate<N>,
        (r, wc): (usize, &WcBatch),
        e: Error,
    ) -> Result<()> {
        // The drain stopped at the failed completion: those after it in the batch are still
        // to hand out, or a receive that arrived would be asked for again.
        if self.mobility.enabled() {
            let failed = wc.iter().position(|c| c.status() != WC_SUCCESS);
            for c in wc.iter().skip(failed.map_or(usize::MAX, |f| f + 1)) {
                self.salvage(gate, c);
            }
        }
        let mail = self.rails[0].cq.mail.take();
        if self.rails[0].cq.peer_gone || self.mobility.moving() {
            return Err(e);
        }
        match mail {
            Some(m) => {
                let m = MoveMsg::decode(&m.payload)?;
                if m.step != Step::Offer || !self.mobility.enabled() {
                    return Err(Error::remote(format!(
                        "peer {} moved the connection off a failed NIC, but failover is off \
                         here (NCCL_ERDMA_FAILOVER=0, or no other NIC) or it came out of turn",
                        self.peer
                    )));
                }
                let why = format!("peer {} lost a path of the connection", self.peer);
                self.stop(gate, m.epoch, m.lost, &why)?;
                self.accept_offer(gate, &m)
            }
            None if self.mobility.enabled() && failover::movable(self.rails[r].failed_status) => {
                let (nqps, peer_rails) = (self.plan.nqps, self.plan.rails);
                let [mine, theirs] = failover::lost_with(r, nqps, self.rails.len(), peer_rails);
                let epoch = self.mobility.epoch + 1;
                self.stop(gate, epoch, [theirs, mine], &e.to_string())?;
                self.mobility.send(Step::Down, Vec::new())
            }
            None => Err(e),
        }
    }

    /// Stops every QP and takes what the CQs still hold: a receive whose completion is there
    /// has arrived, any other is posted again after the move.
    fn stop(&mut self, gate: &RecvGate<N>, epoch: u32, lost: [u8; 2], why: &str) -> Result<()> {
        failover::stop(&self.rails);
        let Some(chan) = self.rails[0].cq.unwatch() else {
            return Err(Error::remote(why.to_string()));
        };
        self.mobility.begin(epoch, lost, chan, why);
        self.mobility.phase = Phase::Asked;
        self.gate_off = true;
        gate.lock_wanted(true);
        // Every receive still posted completes, as flushed or arrived.
        let mut posted: u32 = (0..SLOTS)
            .filter(|&s| self.slots[s].busy && gate.waits(s))
            .map(|s| self.slots[s].imm_pending)
            .sum();
        let start = Instant::now();
        let mut last = start;
        let mut wc = WcBatch::new();
        while posted > 0 && last.elapsed() < SALVAGE_QUIET && start.elapsed() < SALVAGE_BOUND {
            for r in 0..self.rails.len() {
                let rail = &self.rails[r];
                if wc.poll(&*rail.nic, &rail.cq.cq)? == 0 {
                    continue;
                }
                last = Instant::now();
                for c in wc.iter() {
                    if WrKind::of(c.wr_id()) == Some(WrKind::Recv) {
                        posted = posted.saturating_sub(1);
                    }
                    self.salvage(gate, c);
                }
            }
        }
        Ok(())
    }

    /// Takes completion `c` of a stopped QP: a receive whose data arrived has arrived.
    fn salvage(&mut self, gate: &RecvGate<N>, c: Completion<'_>) {
        let recv = WrKind::of(c.wr_id()) == Some(WrKind::Recv);
        if recv && c.status() == WC_SUCCESS && c.opcode() == WC_RECV_RDMA_WITH_IMM {
            let slot = WrKind::slot(c.wr_id());
            super::landed(&mut self.slots[slot], gate, slot, c.write_imm());
        }
    }

    /// Steps the move under way: true while it is.
    #[cold]
    #[inline(never)]
    pub(super) fn step_move(&mut self, gate: &RecvGate<N>) -> Result<bool> {
        if !self.mobility.moving() {
            return Ok(false);
        }
        self.mobility.check_bound(&self.peer)?;
        match self.mobility.poll(&self.peer)? {
            Some(m) if m.step == Step::Offer && self.mobility.phase == Phase::Asked => {
                self.accept_offer(gate, &m)?;
            }
            Some(m) if m.step == Step::Resume && self.mobility.phase == Phase::Answered => {
                self.resume(&m.body)?;
            }
            _ => {}
        }
        Ok(self.mobility.moving())
    }

    /// The sender offered its new rails (`m`): this end's are built and brought up against
    /// them, the receives still waiting posted on them, and the answer sent.
    fn accept_offer(&mut self, gate: &RecvGate<N>, m: &MoveMsg) -> Result<()> {
        let remote = ConnInfo::decode(&m.body)?;
        let lost = [
            self.mobility.lost[0] | m.lost[0],
            self.mobility.lost[1] | m.lost[1],
        ];
        self.mobility.lost = lost;
        let before = self.mobility.order;
        let rails_n = self.rails.len();
        let Some(nics) = self.mobility.pick(rails_n, lost[1]) else {
            return Err(Error::remote(format!(
                "no other NIC of this link layer is left to carry the connection to peer {}",
                self.peer
            )));
        };
        let (old, new) = self.mobility.describe(&before, rails_n, lost[1]);
        tracing::warn!(
            "{}; moving the connection to peer {} {}",
            self.mobility.why,
            self.peer,
            failover::moved(&old, &new)
        );
        let (cost, p) = (self.mobility.cost, self.mobility.rebuild_params());
        let mut rails = make_rails(&nics, &cost, &p)?;
        check_links(&rails, &remote, &self.peer)?;
        if remote.qps.len() != self.plan.nqps {
            return Err(Error::remote(format!(
                "{} offered {} QPs for the connection's {}",
                self.peer,
                remote.qps.len(),
                self.plan.nqps
            )));
        }
        connect_qps(&rails, &remote, &p, remote.tc, remote.sl)?;
        let paths = paths(self.plan.nqps, remote.rails.len(), rails.len());
        let probes = make_probes(&mut rails, &paths, End::Listener, &remote)?;
        time_work(&mut rails, &p, &self.peer);
        let register = register_on(&nics);
        let regs = (
            self.cts_local.register_again(rails_n, register)?,
            self.sizes_record.register_again(rails_n, register)?,
            self.flush_target.register_again(rails_n, register)?,
        );
        let old_rails = std::mem::replace(&mut self.rails, rails);
        let old_regs = (
            self.cts_local.adopt(regs.0),
            self.sizes_record.adopt(regs.1),
            self.flush_target.adopt(regs.2),
        );
        drop(old_rails);
        drop(old_regs);
        self.keys.reorder(self.mobility.order);
        self.remote_fifo = (remote.addr, rkeys(&remote));
        self.cts_write = FixedWrite::new(self.cts_local.lkey(0), self.remote_fifo.1[0]);
        self.cts_unsignaled = 0;
        let waiting = self.post_again(gate)?;
        // Every receive posted is announced by the answer.
        self.cts_posted = self.seq;
        let records = &self.sizes_record;
        let mut info = local_info(&self.rails, records.addr(0), |r| records.rkey(r), &p);
        info.probes = probe_qps(&self.rails, &probes);
        self.mobility
            .send(Step::Answer, encode_answer(&info.encode(), &waiting))?;
        self.mobility.phase = Phase::Answered;
        self.moving_probes = Some(Answered {
            probes,
            paths,
            remote,
        });
        Ok(())
    }

    /// Posts again, on the new QPs, every receive still waiting, its entries keyed for the new
    /// NICs; returns them, as the answer carries them.
    fn post_again(&mut self, gate: &RecvGate<N>) -> Result<Waiting> {
        let mut waiting = Waiting::new();
        // Oldest first, as the sender is best served.
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

    /// The sender is up (`body`: its probe QPs): this end's probes come up, the flushes
    /// pending go out again, and the connection works as before.
    fn resume(&mut self, body: &[u8]) -> Result<()> {
        let Some(a) = self.moving_probes.take() else {
            return Ok(());
        };
        let theirs = decode_qps(body, a.paths.len())?;
        let p = self.mobility.params;
        let tc_sl = (a.remote.tc, a.remote.sl);
        connect_probes(
            &self.rails,
            &a.probes,
            &a.paths,
            End::Listener,
            &theirs,
            &a.remote,
            &p,
            tc_sl,
        )?;
        self.flush_again()?;
        if let Some((chan, took)) = self.mobility.end() {
            self.rails[0].cq.watch(chan);
            tracing::info!(
                "connection to peer {} moved in {} ms",
                self.peer,
                took.as_millis()
            );
        }
        Ok(())
    }

    /// Posts again, on every rail, each flush not completed when the connection moved.
    fn flush_again(&mut self) -> Result<()> {
        for f in 0..SLOTS {
            if !matches!(self.flush_slots[f], FlushSlot::Pending(_)) {
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
}
