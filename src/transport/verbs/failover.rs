//! Failover: a connection whose NIC or path fails moves to other NICs of the same link layer
//! (a fused device's other NICs, else the host's spares) and carries on, every request
//! completing exactly once. What both ends share is here; each end's half of the move is
//! in `send::moving` and `recv::moving`.
//!
//! The move, over the comm's bootstrap connection (kept open as its peer watch), numbered
//! by an epoch so that a late message of an earlier move is never taken for this one:
//! 1. An end that sees a rail fail (a failed completion that is no programming error of
//!    ours, a probe unanswered for `NCCL_ERDMA_FAILOVER_AFTER_MS`, a fatal event) stops every
//!    QP of the connection: nothing more is sent or placed through them. A receiver then
//!    takes the completions its NIC still holds (a receive whose completion it sees is
//!    final) and says `Down`; a sender goes straight to 2. An end told first stops too.
//! 2. The sender builds its rails again on its NICs, the lost ones replaced, with the
//!    connection's registrations valid there (every `regMr` registers on the spares too,
//!    ahead of time, so nothing is registered in the move but the comm's own buffers), and
//!    `Offer`s them.
//! 3. The receiver does the same, brings its QPs up against the offer, posts again the
//!    receives still waiting, and `Answer`s with its rails and those receives' clear-to-send
//!    entries, keyed for the new NICs. A receive not named there has arrived.
//! 4. The sender brings its QPs up, writes the entries into its FIFO, counts done every
//!    posted send the answer does not name, sends again the others (whole slots, in order),
//!    and says `Resume`; only then does the receiver post clear-to-sends again.
//!
//! A move that cannot complete (no NIC left, the peer gone or silent, a move past its
//! bound) fails the comm as before.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::budget::EndCost;
use super::rail::{locate, Rail};
use super::setup::ConnParams;
use super::wire::{modulo, CtsEntry, CTS_BYTES};
use crate::error::{Error, Result};
use crate::oob::{Channel, MsgKind};
use crate::transport::MAX_RAILS;
use crate::verbs::nic::{Nic, QueuePair};

/// The steps of a move (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    Down = 1,
    Offer = 2,
    Answer = 3,
    Resume = 4,
}

/// One message of a move: its step, the move's epoch, the rails found lost (the sender's,
/// the receiver's: one bit each) and what the step carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MoveMsg {
    pub(crate) step: Step,
    pub(crate) epoch: u32,
    pub(crate) lost: [u8; 2],
    pub(crate) body: Vec<u8>,
}

impl MoveMsg {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(7 + self.body.len());
        v.push(self.step as u8);
        v.extend_from_slice(&self.epoch.to_le_bytes());
        v.extend_from_slice(&self.lost);
        v.extend_from_slice(&self.body);
        v
    }

    pub(crate) fn decode(p: &[u8]) -> Result<Self> {
        let bad = || Error::remote(format!("invalid failover message of {} bytes", p.len()));
        if p.len() < 7 {
            return Err(bad());
        }
        let step = match p[0] {
            1 => Step::Down,
            2 => Step::Offer,
            3 => Step::Answer,
            4 => Step::Resume,
            _ => return Err(bad()),
        };
        Ok(MoveMsg {
            step,
            epoch: u32::from_le_bytes([p[1], p[2], p[3], p[4]]),
            lost: [p[5], p[6]],
            body: p[7..].to_vec(),
        })
    }

    /// Queues it on `chan` (sent by the next flush).
    pub(crate) fn queue(&self, chan: &mut Channel) {
        chan.queue(MsgKind::Failover, &self.encode());
    }
}

/// The receives still waiting, as an answer carries them: (slot, its clear-to-send entries).
pub(crate) type Waiting = Vec<(usize, Vec<CtsEntry>)>;

/// An answer's body: the receiver's rails (an encoded `ConnInfo`), then the waiting receives.
pub(crate) fn encode_answer(info: &[u8], waiting: &Waiting) -> Vec<u8> {
    let mut v = Vec::with_capacity(8 + info.len() + waiting.len() * 8 * CTS_BYTES);
    v.extend_from_slice(&(info.len() as u32).to_le_bytes());
    v.extend_from_slice(info);
    v.extend_from_slice(&(waiting.len() as u16).to_le_bytes());
    for (slot, entries) in waiting {
        v.push(*slot as u8);
        v.push(entries.len() as u8);
        for e in entries {
            v.extend_from_slice(&e.to_bytes());
        }
    }
    v
}

/// [`encode_answer`] back: the `ConnInfo` bytes and the waiting receives.
pub(crate) fn decode_answer(p: &[u8]) -> Result<(&[u8], Waiting)> {
    let bad = || Error::remote(format!("invalid failover answer of {} bytes", p.len()));
    let len = p.get(..4).ok_or_else(bad)?;
    let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
    let info = p.get(4..4 + len).ok_or_else(bad)?;
    let mut at = 4 + len;
    let n = p.get(at..at + 2).ok_or_else(bad)?;
    let n = u16::from_le_bytes([n[0], n[1]]) as usize;
    at += 2;
    let mut waiting = Vec::with_capacity(n);
    for _ in 0..n {
        let head = p.get(at..at + 2).ok_or_else(bad)?;
        let (slot, k) = (head[0] as usize, head[1] as usize);
        at += 2;
        let mut entries = Vec::with_capacity(k);
        for _ in 0..k {
            let raw = p.get(at..at + CTS_BYTES).ok_or_else(bad)?;
            entries.push(CtsEntry::from_bytes(raw));
            at += CTS_BYTES;
        }
        waiting.push((slot, entries));
    }
    if at != p.len() {
        return Err(bad());
    }
    Ok((info, waiting))
}

/// What a move is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// No move under way.
    Still,
    /// A receiver said `Down` and waits for the offer; a sender offered and waits for the
    /// answer.
    Asked,
    /// A receiver answered and waits for `Resume`.
    Answered,
}

/// One end's means to move its connection: the NICs it may use and the shape to build again.
pub(crate) struct Mobility<N: Nic> {
    /// The NICs this end may use, in the order its registrations hold keys: the device's
    /// own, then its spares.
    nics: Vec<Arc<N>>,
    /// Per rail, the NIC (index into `nics`) it runs on now; also the registrations' key
    /// order of the comm.
    pub(crate) order: [u8; MAX_RAILS],
    /// NICs this comm lost (bits of `nics`).
    dead: u16,
    pub(crate) epoch: u32,
    pub(crate) phase: Phase,
    /// When the move under way began (it is bounded by the work timeout).
    since: Option<Instant>,
    /// Rails lost in the move under way: this end's (bits), and the peer's.
    pub(crate) lost: [u8; 2],
    /// Moves made: the receiver's gate stops polling the first rails' CQs after one.
    pub(crate) moves: u32,
    /// This end's connection, to build it again.
    pub(crate) cost: EndCost,
    pub(crate) params: ConnParams,
    /// The bootstrap connection while a move is under way (the peer watch otherwise).
    pub(crate) chan: Option<Channel>,
    /// What started the move under way, for its WARN.
    pub(crate) why: String,
}

/// How long a move may take before the comm fails.
fn move_bound(p: &ConnParams) -> Duration {
    p.work_timeout.unwrap_or(Duration::from_secs(60))
}

impl<N: Nic> Mobility<N> {
    /// An end whose rails are `nics[..rails]`, which may move to any of `nics` (when
    /// `params.failover` is set).
    pub(crate) fn new(nics: Vec<Arc<N>>, cost: EndCost, params: ConnParams) -> Self {
        Mobility {
            nics,
            order: std::array::from_fn(|r| r as u8),
            dead: 0,
            epoch: 0,
            phase: Phase::Still,
            since: None,
            lost: [0; 2],
            moves: 0,
            cost,
            params,
            chan: None,
            why: String::new(),
        }
    }

    /// Whether this end moves a failed connection at all.
    pub(crate) fn enabled(&self) -> bool {
        self.params.failover.is_some() && self.nics.len() > 1
    }

    /// Whether a move is under way.
    #[inline]
    pub(crate) fn moving(&self) -> bool {
        self.phase != Phase::Still
    }

    /// Starts move `epoch` losing `lost` (the sender's rails, the receiver's) over `chan`,
    /// for `why`.
    pub(crate) fn begin(&mut self, epoch: u32, lost: [u8; 2], chan: Channel, why: &str) {
        self.why = why.to_string();
        self.epoch = epoch;
        self.lost = lost;
        self.since = Some(Instant::now());
        self.chan = Some(chan);
    }

    /// The move is over: the channel goes back to the peer watch.
    pub(crate) fn end(&mut self) -> Option<(Channel, Duration)> {
        self.phase = Phase::Still;
        self.moves += 1;
        let took = self.since.take().map_or(Duration::ZERO, |t| t.elapsed());
        self.chan.take().map(|c| (c, took))
    }

    /// The NICs rails `0..rails` move to: a rail of `lost` (bits) to the first NIC this comm
    /// has not lost, one no other rail uses first; the others stay. None: no NIC left.
    pub(crate) fn pick(&mut self, rails: usize, lost: u8) -> Option<Vec<Arc<N>>> {
        for r in (0..rails).filter(|r| lost & (1 << r) != 0) {
            self.dead |= 1 << self.order[r];
        }
        let alive = |k: usize| self.dead & (1 << k) == 0;
        let mut order = self.order;
        for r in (0..rails).filter(|r| lost & (1 << r) != 0) {
            let used = |k: usize| order[..rails].contains(&(k as u8));
            let k = (0..self.nics.len())
                .find(|&k| alive(k) && !used(k))
                .or_else(|| (0..self.nics.len()).find(|&k| alive(k)))?;
            order[r] = k as u8;
        }
        self.order = order;
        Some((0..rails).map(|r| self.nic(r)).collect())
    }

    /// The parameters of the rails a move builds: where no NIC would be left after one more
    /// loss, a suspected path is not moved off (there is nowhere to go) but waited on, as
    /// without failover, until the work timeout says it is dead.
    pub(crate) fn rebuild_params(&self) -> ConnParams {
        let alive = (0..self.nics.len())
            .filter(|&k| self.dead & (1 << k) == 0)
            .count();
        ConnParams {
            failover: self.params.failover.filter(|_| alive >= 2),
            ..self.params
        }
    }

    /// The NIC rail `r` runs on.
    pub(crate) fn nic(&self, r: usize) -> Arc<N> {
        Arc::clone(&self.nics[usize::from(self.order[r])])
    }

    /// The names of the NICs lost in this move and of those taken, for the WARN.
    pub(crate) fn describe(&self, before: &[u8], rails: usize, mine: u8) -> (String, String) {
        let lost = (0..rails).filter(|r| mine & (1 << r) != 0);
        let names = |rs: Vec<usize>, order: &dyn Fn(usize) -> usize| {
            rs.iter()
                .map(|&r| self.nics[order(r)].local().name.clone())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let rs: Vec<usize> = lost.collect();
        let old = names(rs.clone(), &|r| usize::from(before[r]));
        let new = names(rs, &|r| usize::from(self.order[r]));
        (old, new)
    }

    /// Fails the move once it has run past its bound.
    pub(crate) fn check_bound(&self, peer: &str) -> Result<()> {
        let bound = move_bound(&self.params);
        match self.since {
            Some(t) if t.elapsed() > bound => Err(Error::remote(format!(
                "moving the connection to peer {peer} to another NIC did not complete in \
                 {:.1} s (the peer's host or every path to it is gone)",
                bound.as_secs_f64()
            ))),
            _ => Ok(()),
        }
    }

    /// The next message of this move from the peer, if one came: messages of other moves are
    /// dropped; the peer closing the connection is an error.
    pub(crate) fn poll(&mut self, peer: &str) -> Result<Option<MoveMsg>> {
        let Some(chan) = self.chan.as_mut() else {
            return Ok(None);
        };
        chan.flush()?;
        loop {
            let Some(m) = chan.recv_io().map_err(|e| gone_while_moving(peer, &e))? else {
                return Ok(None);
            };
            if m.kind != MsgKind::Failover {
                return Err(Error::remote(format!(
                    "peer {peer} sent message type {:?} while the connection moved",
                    m.kind
                )));
            }
            let m = MoveMsg::decode(&m.payload)?;
            if m.epoch == self.epoch {
                return Ok(Some(m));
            }
        }
    }

    /// Queues `msg` of this move and sends what it can.
    pub(crate) fn send(&mut self, step: Step, body: Vec<u8>) -> Result<()> {
        let msg = MoveMsg {
            step,
            epoch: self.epoch,
            lost: self.lost,
            body,
        };
        if let Some(chan) = self.chan.as_mut() {
            msg.queue(chan);
            chan.flush()?;
        }
        Ok(())
    }
}

#[cold]
fn gone_while_moving(peer: &str, e: &std::io::Error) -> Error {
    Error::remote(format!(
        "peer {peer} closed its connection (or stopped answering: {e}) while the connection \
         moved to another NIC"
    ))
}

/// "from NIC a to NIC b" for the WARN (or "on the same NICs" when only the peer's were lost).
pub(crate) fn moved(old: &str, new: &str) -> String {
    if old.is_empty() {
        "on the same NICs (the peer's NIC or path was lost)".to_string()
    } else {
        format!("from {old} to {new}")
    }
}

/// Stops every QP of `rails`: nothing more goes out or is placed through them, and what they
/// hold completes as flushed.
pub(crate) fn stop<N: Nic>(rails: &[Rail<N>]) {
    for rail in rails {
        let qps = rail.qps.iter().chain(&rail.probe_qps).chain(&rail.flush_qp);
        for qp in qps {
            if let Err(e) = rail.nic.fail_qp(qp) {
                tracing::debug!("stopping QP {} on {}: {e}", qp.qpn(), rail.name());
            }
        }
    }
}

/// The rails lost when rail `r` of this end fails, this end's and the peer's (bits): the
/// peer's rails its QPs join, as each end moves the rails of a dead path.
pub(crate) fn lost_with(r: usize, nqps: usize, rails: usize, peer_rails: usize) -> [u8; 2] {
    let mut theirs = 0u8;
    for q in (0..nqps).filter(|&q| locate(q, rails).0 == r) {
        theirs |= 1 << modulo(q, peer_rails);
    }
    [1 << r, theirs]
}

/// Whether a rail's error can be mended by moving: anything but a failed completion that says
/// our own request was wrong (a bad key, length or access), which a move would repeat. A
/// local QP operation error is movable: Soft-RoCE reports a link gone down so.
pub(crate) fn movable(status: Option<u32>) -> bool {
    // IBV_WC_LOC_LEN_ERR, LOC_PROT_ERR, MW_BIND_ERR, LOC_ACCESS_ERR, REM_INV_REQ_ERR,
    // REM_ACCESS_ERR, REM_OP_ERR.
    !matches!(status, Some(1 | 4 | 6 | 8 | 9 | 10 | 11))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::fake::Fabric;

    #[test]
    fn messages_and_answers_round_trip() {
        let m = MoveMsg {
            step: Step::Answer,
            epoch: 7,
            lost: [1, 2],
            body: vec![9, 8, 7],
        };
        assert_eq!(MoveMsg::decode(&m.encode()).unwrap(), m);
        assert!(MoveMsg::decode(&[9, 0, 0, 0, 0, 0, 0]).is_err());
        let e = CtsEntry::new(0x1000, 4096, [5; MAX_RAILS], 3, 2, 41);
        let waiting = vec![(3, vec![e, e]), (4, vec![e])];
        let body = encode_answer(b"info", &waiting);
        let (info, back) = decode_answer(&body).unwrap();
        assert_eq!(info, b"info");
        assert_eq!(back.len(), 2);
        assert_eq!(back[0].1[1].to_bytes(), e.to_bytes());
        assert!(decode_answer(&body[..body.len() - 1]).is_err());
    }

    #[test]
    fn a_lost_rail_takes_an_unused_nic_first_and_none_is_left_after_all_are_lost() {
        let f = Fabric::new();
        let nics = vec![f.nic("a"), f.nic("b"), f.nic("c")];
        let cost = EndCost::sender(1, 2, 63);
        let p = super::super::tests::params();
        let mut m = Mobility::new(nics, cost, p);
        // Rails on a, b; a lost: c (unused) rather than b.
        let picked = m.pick(2, 0b01).unwrap();
        assert_eq!(picked[0].local().name, "c");
        assert_eq!(picked[1].local().name, "b");
        // c lost too: b carries both rails.
        let picked = m.pick(2, 0b01).unwrap();
        assert_eq!(picked[0].local().name, "b");
        assert_eq!(m.order[..2], [1, 1]);
        // b lost: nothing left.
        assert!(m.pick(2, 0b11).is_none());
        assert_eq!(lost_with(1, 4, 2, 2), [0b10, 0b10]);
        assert_eq!(lost_with(0, 2, 1, 2), [0b01, 0b11]);
        assert!(movable(Some(12)) && movable(Some(2)) && movable(None) && !movable(Some(10)));
    }
}
