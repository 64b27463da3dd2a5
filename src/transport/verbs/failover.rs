//! Failover: a connection whose NIC or path fails moves to other NICs of the same link layer
//! (a fused device's other NICs, else the host's spares) and carries on, every request
//! completing exactly once. What both ends share is here; each end's half of the move is
//! in `send::moving` and `recv::moving`.
//!
//! The move, over the comm's link to its peer (`peer`), numbered by an epoch so that a late
//! message of an earlier move is never taken for this one, its rails built by the same
//! bring-up as a connection's (`bringup`):
//! 1. An end that sees a fault a move can mend ([`super::fault::Fault::movable`]) stops every
//!    QP of the connection: nothing more is sent or placed through them. A receiver then takes
//!    the completions its CQs already hold (a receive whose completion it has is final) and
//!    says `Down`; a sender goes straight to 2. An end told first stops too.
//! 2. The sender makes its rails again on its NICs, the lost ones replaced, with the
//!    connection's registrations valid there (every `regMr` registers on the spares too, ahead
//!    of time, so nothing is registered in the move but the comm's own buffers), and `Offer`s
//!    them.
//! 3. The receiver does the same, joins the offer, posts again the receives still waiting
//!    and `Answer`s with its rails and those receives' clear-to-send entries, keyed for the new
//!    NICs. A receive not named there has landed.
//! 4. The sender joins the answer, writes the entries into its FIFO, counts done every
//!    posted send the answer does not name, and sends again, oldest first and before any later
//!    send, those it names: whole where its own NIC never acknowledged them, and only their
//!    immediate where it did (the data landed; the receiver had not seen the completion).
//!    It says `Resume`; only then does the receiver poll its rails and announce again.
//!
//! A NIC that cannot be brought up towards the peer (its link went down since it was
//! picked) is lost as on the data path, by the end that finds it: the sender joining the
//! answer offers again, the receiver joining an offer or bringing its probes up at `Resume`
//! says `Down` for the next move. Setup being move 0, a NIC lost between `connect`/`accept`
//! and the first transfer moves the connection too.
//!
//! A NIC lost heals (`heal`): a later failover may move there again, and a connection off
//! its own NICs moves back with the same four steps, a move that loses no rail (each end
//! takes its own NICs where they are alive). An end tells the other (`Healed`) when a NIC
//! it lost has healed (it may be able to move again) and, once per move, when its own NICs
//! can carry the connection; the sender moves back once both ends' can, between messages.
//!
//! An end that cannot make the move the peer asks for, or runs out of NICs in one, `Refuse`s
//! it with the reason, and both ends fail at once; an end whose peer cannot move at all (it
//! said so at the last bring-up) fails a broken path as without failover. A move that cannot
//! complete (the peer gone or silent, past its bound) fails the comm. The dead NIC's QPs, CQs
//! and registrations go to the reaper, never torn down on the data path.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::budget::{self, EndCost};
use super::fault::{Cause, Fault};
use super::heal::{self, Healing, Moment};
use super::peer::PeerLink;
use super::profile::ConnParams;
use super::rail::Rail;
use super::wire::{locate, modulo, Healed, MoveMsg, Step};
use crate::error::{Error, Result};
use crate::transport::MAX_RAILS;
use crate::verbs::nic::{Nic, QueuePair};

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
    /// The epoch of the last move begun (0: none).
    pub(crate) epoch: u32,
    /// This end's connection, to build it again.
    pub(crate) cost: EndCost,
    pub(crate) params: ConnParams,
    /// The peer can move the connection too (it said so at the last bring-up).
    pub(crate) peer_mobile: bool,
    /// When the NICs lost heal (`heal`).
    healing: Healing,
    /// The last epoch in which this end said its own NICs can carry the connection.
    home_said: u32,
    /// The last epoch in which the peer said so (`Healed`).
    peer_home: u32,
    /// Since when the move back has waited for a moment between messages.
    back_since: Option<Instant>,
}

impl<N: Nic> Mobility<N> {
    /// An end whose rails are `nics[..rails]`, which may move to any of `nics` (when
    /// `params.failover` is set).
    pub(crate) fn new(nics: Vec<Arc<N>>, cost: EndCost, params: ConnParams) -> Self {
        Mobility {
            healing: Healing::new(nics.len(), params.failback.0),
            home_said: 0,
            peer_home: 0,
            back_since: None,
            nics,
            order: std::array::from_fn(|r| r as u8),
            dead: 0,
            epoch: 0,
            cost,
            params,
            peer_mobile: false,
        }
    }

    /// NICs not lost yet, and able to take the connection (its memory has keys there).
    fn alive(&self) -> usize {
        (0..self.nics.len())
            .filter(|&k| self.dead & (1 << k) == 0 && self.nics[k].takes_moves())
            .count()
    }

    /// Whether this end can move the connection off a failed NIC: failover on, and a NIC left
    /// to go to after one more is lost (what it tells the peer at each bring-up).
    pub(crate) fn able(&self) -> bool {
        self.params.failover.is_some() && self.alive() >= 2
    }

    /// Whether a fault a move can mend is moved off: both ends can move.
    pub(crate) fn enabled(&self) -> bool {
        self.able() && self.peer_mobile
    }

    /// Where fault `f` is mended by a move (a fault a move can mend, and both ends can move),
    /// the rails the move loses, this end's and the peer's (bits), and why it moves; else the
    /// error that fails the comm. `shape`: this end's QPs per connection, its rails and the
    /// peer's.
    #[cold]
    pub(crate) fn lost_to(
        &self,
        f: Fault,
        (nqps, rails, peer_rails): (usize, usize, usize),
        peer: &str,
    ) -> Result<([u8; 2], String)> {
        if !f.movable() {
            return Err(f.into_error());
        }
        if let Some(why) = self.why_unmoved() {
            let msg = format!("{}; {why} (peer {peer})", f.error);
            return Err(match f.cause {
                Cause::FatalEvent => Error::device(msg),
                _ => Error::remote(msg),
            });
        }
        if !self.enabled() {
            return Err(f.into_error());
        }
        let lost = lost_with(f.rail.unwrap_or(0), nqps, rails, peer_rails);
        Ok((lost, f.error.to_string()))
    }

    /// Why a fault a move could mend is not moved off, where failover is on here.
    fn why_unmoved(&self) -> Option<&'static str> {
        if self.params.failover.is_none() {
            None
        } else if self.alive() < 2 {
            Some("no other NIC of this link layer is left to carry the connection")
        } else if !self.peer_mobile {
            Some("the peer cannot move the connection (failover off there, or no other NIC)")
        } else {
            None
        }
    }

    /// The NICs rails `0..rails` move to: a rail of `lost` (bits) to the first NIC this comm
    /// has not lost, one no other rail uses first; the others stay. A move that loses no rail
    /// is a move back: each rail to its own NIC (rail `r`'s is `nics[r]`, where NCCL's device
    /// placed it) where that is alive. None: no NIC left.
    pub(crate) fn pick(&mut self, rails: usize, lost: u8) -> Option<Vec<Arc<N>>> {
        for r in (0..rails).filter(|r| lost & (1 << r) != 0) {
            let k = usize::from(self.order[r]);
            self.dead |= 1 << k;
            self.healing.lost(k);
        }
        let alive = |k: usize| self.dead & (1 << k) == 0 && self.nics[k].takes_moves();
        let mut order = self.order;
        if lost == 0 {
            for r in (0..rails).filter(|&r| alive(r)) {
                order[r] = r as u8;
            }
        }
        for r in (0..rails).filter(|r| lost & (1 << r) != 0) {
            let used = |k: usize| order[..rails].contains(&(k as u8));
            let k = (0..self.nics.len())
                .find(|&k| alive(k) && !used(k))
                .or_else(|| (0..self.nics.len()).find(|&k| alive(k)))?;
            order[r] = k as u8;
        }
        self.order = order;
        Some(
            (0..rails)
                .map(|r| Arc::clone(&self.nics[usize::from(order[r])]))
                .collect(),
        )
    }

    /// The parameters of the rails a move builds: where no NIC would be left after one more
    /// loss, a suspected path is not moved off (there is nowhere to go) but waited on, as
    /// without failover, until the work timeout says it is dead.
    pub(crate) fn rebuild_params(&self) -> ConnParams {
        ConnParams {
            failover: self.params.failover.filter(|_| self.alive() >= 2),
            ..self.params
        }
    }

    /// What a move to `nics` makes: this end's connection of `nqps` QPs, fitted to the NICs'
    /// limits (what this process holds there already counts) or an error naming the limit.
    pub(crate) fn fitted(&self, nics: &[Arc<N>], nqps: usize, peer: &str) -> Result<EndCost> {
        let cost = EndCost {
            qps: nqps,
            ..self.cost
        };
        // Not fewer QPs than the connection has: both ends keep its shape.
        budget::fit_to(nics, &cost, nqps, peer)?;
        Ok(cost)
    }

    /// The names of the NICs this move leaves (of rails `0..rails`, which ran on `before`)
    /// and of those it takes, for the log.
    pub(crate) fn describe(&self, before: &[u8], rails: usize) -> (String, String) {
        let moved: Vec<usize> = (0..rails).filter(|&r| before[r] != self.order[r]).collect();
        let names = |order: &dyn Fn(usize) -> usize| {
            moved
                .iter()
                .map(|&r| self.nics[order(r)].local().name.clone())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let old = names(&|r| usize::from(before[r]));
        let new = names(&|r| usize::from(self.order[r]));
        (old, new)
    }

    /// Whether this end's slow checks look at its NICs ([`Self::news`]): it lost some, runs
    /// off its own, or has not said since the last move that its own can carry the
    /// connection. A comm that never lost a NIC pays this test only.
    #[inline]
    pub(crate) fn watching(&self) -> bool {
        self.dead != 0 || self.away() || (self.params.failback.1 && self.epoch > self.home_said)
    }

    /// Whether a rail runs on another NIC than its own.
    fn away(&self) -> bool {
        (0..self.cost.rails).any(|r| usize::from(self.order[r]) != r)
    }

    /// Looks at the NICs this comm lost, where a look is due at `now`: those healed may
    /// carry the connection again (a failover may move there, and the connection back).
    /// What to tell the peer (`Healed`): where a NIC healed, whether this end can move and
    /// whether its own NICs can carry the connection; that these can, once per move.
    pub(crate) fn news(&mut self, now: Instant) -> Option<Healed> {
        let mut healed = 0;
        if self.dead != 0 {
            let nics = &self.nics;
            healed = self.healing.look(self.dead, now, |k| nics[k].port_active());
            for k in (0..nics.len()).filter(|k| healed & (1 << k) != 0) {
                tracing::debug!(
                    "{} has stayed usable for the settling time: it may carry connections again",
                    nics[k].local().name
                );
            }
            self.dead &= !healed;
        }
        let home = self.params.failback.1 && self.homes_alive();
        let first = home && self.epoch > self.home_said;
        if first {
            self.home_said = self.epoch;
        }
        (healed != 0 || first).then(|| Healed {
            mobile: self.able(),
            home,
        })
    }

    /// The peer's `Healed` of move `epoch`.
    pub(crate) fn heard(&mut self, h: Healed, epoch: u32) {
        self.peer_mobile = h.mobile;
        if h.home && epoch == self.epoch {
            self.peer_home = epoch;
        }
    }

    /// The NICs lost and not healed (bits of `nics`).
    #[cfg(test)]
    pub(crate) fn lost(&self) -> u16 {
        self.dead
    }

    /// What a trial of the way home makes its rails of: each rail's own NIC (where NCCL's
    /// device placed it), this end's connection of `nqps` QPs fitted to them, and the
    /// parameters a move would build with; or the error naming the limit.
    pub(crate) fn homes(
        &self,
        nqps: usize,
        peer: &str,
    ) -> Result<(Vec<Arc<N>>, EndCost, ConnParams)> {
        let homes = self.nics[..self.cost.rails].to_vec();
        let cost = self.fitted(&homes, nqps, peer)?;
        Ok((homes, cost, self.rebuild_params()))
    }

    /// A trial of the path over this end's own NICs failed: those of the rails away from home
    /// count as lost again (their settling time doubles; a NIC a rail runs on stays), and the
    /// connection stays where it is.
    pub(crate) fn homes_unreachable(&mut self) {
        for r in (0..self.cost.rails).filter(|&r| usize::from(self.order[r]) != r) {
            self.dead |= 1 << r;
            self.healing.lost(r);
        }
    }

    /// Whether a trial of the way home may begin at `now` (one a [`heal::TRIAL_EVERY`]).
    pub(crate) fn may_try(&mut self, now: Instant) -> bool {
        self.healing.may_try(now)
    }

    /// How many times this comm lost NIC `k` (a failed trial counts).
    #[cfg(test)]
    pub(crate) fn losses(&self, k: usize) -> u32 {
        self.healing.losses(k)
    }

    /// Whether every rail's own NIC can carry the connection.
    fn homes_alive(&self) -> bool {
        (0..self.cost.rails).all(|r| self.dead & (1 << r) == 0 && self.nics[r].takes_moves())
    }

    /// Whether the connection, off its own NICs, may move back: the move back is on here and
    /// at the receiver, which said in this epoch that its own NICs can carry it, both ends
    /// can move, and this end's own NICs can carry it.
    pub(crate) fn back_ready(&self) -> bool {
        self.params.failback.1
            && self.enabled()
            && self.peer_home == self.epoch
            && self.away()
            && self.homes_alive()
    }

    /// Whether the connection moves back at `now` (the sender asks): it may
    /// ([`Self::back_ready`]); the traffic's `moment` lets it (between messages; with sends in
    /// flight, once it has been due for [`heal::BUSY_WAIT`]: they complete first; never with
    /// nothing in flight and no receive waiting); and the minute's moves back are not spent.
    /// The sender then tries the path (`trial`) and counts the move back as it begins
    /// ([`Self::returning`]).
    pub(crate) fn back_due(&mut self, now: Instant, moment: Moment) -> bool {
        if !self.back_ready() {
            self.back_since = None;
            return false;
        }
        let due = match moment {
            Moment::Between => true,
            Moment::Busy => {
                let since = *self.back_since.get_or_insert(now);
                now.duration_since(since) >= heal::BUSY_WAIT
            }
            Moment::Idle => false,
        };
        due && self.healing.may_return(now)
    }

    /// The move back begins at `now` (it counts towards the minute's).
    pub(crate) fn returning(&mut self, now: Instant) {
        self.back_since = None;
        self.healing.returned(now);
    }
}

/// A move under way: its epoch, the rails found lost (the sender's, the receiver's: one bit
/// each), when it began, how long it may take, and why. Epoch 0 is the connection's setup.
#[derive(Debug, Clone)]
pub(crate) struct Moving {
    pub(crate) epoch: u32,
    pub(crate) lost: [u8; 2],
    since: Instant,
    bound: Option<Duration>,
    pub(crate) why: String,
    /// The NICs the move takes, once picked (for the log).
    pub(crate) to: String,
}

impl Moving {
    /// Move `epoch` losing `lost`, begun now for `why`, bounded as `p` says (the work
    /// timeout, or a minute).
    pub(crate) fn new(epoch: u32, lost: [u8; 2], why: String, p: &ConnParams) -> Self {
        Moving {
            epoch,
            lost,
            since: Instant::now(),
            bound: Some(p.work_timeout.unwrap_or(Duration::from_secs(60))),
            why,
            to: String::new(),
        }
    }

    /// The connection's setup, as move 0: the connector's hello offered its rails. Only the
    /// peer ends the wait for its answer (its process closing the bootstrap connection, or its
    /// host falling silent), never a clock: NCCL may call `accept` long after `connect`.
    pub(crate) fn setup() -> Self {
        Moving {
            epoch: 0,
            lost: [0; 2],
            since: Instant::now(),
            bound: None,
            why: String::new(),
            to: String::new(),
        }
    }

    /// Whether this is the connection's setup.
    pub(crate) fn is_setup(&self) -> bool {
        self.epoch == 0
    }

    /// Whether this is a move back to each end's own NICs (it loses no rail).
    pub(crate) fn is_back(&self) -> bool {
        self.epoch > 0 && self.lost == [0; 2]
    }

    /// Says (to the log) that the connection to `peer` moves from NICs `old` to `new`: a
    /// WARN for a failover, an INFO for a move back.
    pub(crate) fn announce(&mut self, peer: &str, (old, new): (String, String)) {
        if self.is_back() {
            tracing::info!(
                "{}; moving the connection to peer {peer} back from {old} to {new}",
                self.why
            );
        } else {
            tracing::warn!(
                "{}; moving the connection to peer {peer} {}",
                self.why,
                moved(&old, &new)
            );
        }
        self.to = if new.is_empty() {
            "the same NICs".to_string()
        } else {
            new
        };
    }

    /// How the log says the move ended: "moved in 35 ms, to rxe1", "moved back in 40 ms,
    /// to rxe0".
    pub(crate) fn ended(&self) -> String {
        let how = if self.is_back() {
            "moved back"
        } else {
            "moved"
        };
        let ms = self.took().as_millis();
        format!("{how} in {ms} ms, to {}", self.to)
    }

    /// How long it has taken so far.
    pub(crate) fn took(&self) -> Duration {
        self.since.elapsed()
    }

    /// Fails the move once it has run past its bound (checked after the peer's messages are
    /// read, so that an end polled late still takes the message that finishes it).
    pub(crate) fn check_bound(&self, peer: &str) -> Result<()> {
        let Some(bound) = self.bound else {
            return Ok(());
        };
        if self.since.elapsed() > bound {
            return Err(Error::remote(format!(
                "moving the connection to peer {peer} to another NIC did not complete in \
                 {:.1} s (the peer's host or every path to it is gone)",
                bound.as_secs_f64()
            )));
        }
        Ok(())
    }

    /// The message of step `step` of this move, with `body`.
    pub(crate) fn message(&self, step: Step, body: Vec<u8>) -> MoveMsg {
        MoveMsg {
            step,
            epoch: self.epoch,
            lost: self.lost,
            body,
        }
    }
}

/// Says to the peer over `link` that this end cannot make move `epoch`, why (`e`), and
/// returns `e` (the comm fails with it).
#[cold]
pub(crate) fn refuse(link: &mut PeerLink, epoch: u32, e: Error) -> Error {
    link.send(&MoveMsg::refusal(epoch, e.to_string().into_bytes()));
    e
}

/// The error of a move (or setup) the peer refused in `msg`, which says why.
#[cold]
pub(crate) fn refused(peer: &str, msg: &MoveMsg) -> Error {
    let why = String::from_utf8_lossy(&msg.body);
    if msg.epoch == 0 {
        return Error::remote(format!("peer {peer} refused the connection: {why}"));
    }
    Error::remote(format!(
        "peer {peer} could not move the connection off a failed NIC: {why}"
    ))
}

/// The error of a move message the peer sent out of turn.
#[cold]
pub(crate) fn out_of_turn(peer: &str, msg: &MoveMsg, state: &str) -> Error {
    Error::remote(format!(
        "peer {peer} sent {:?} of move {} while this end {state}: the ends disagree on the \
         connection's state",
        msg.step, msg.epoch
    ))
}

/// The error of a move the peer asked for that this end cannot make.
#[cold]
pub(crate) fn cannot_move(peer: &str) -> Error {
    Error::remote(format!(
        "peer {peer} moved the connection off a failed NIC, but this end cannot move it \
         (NCCL_ERDMA_FAILOVER=0, or no other NIC of this link layer left)"
    ))
}

/// The error of a move with no NIC left to go to.
#[cold]
pub(crate) fn no_nic_left(why: &str, peer: &str) -> Error {
    Error::remote(format!(
        "{why}; no other NIC of this link layer is left to carry the connection to peer {peer}"
    ))
}

/// "from NIC a to NIC b" for the WARN (or "on the same NICs" when only the peer's were lost).
fn moved(old: &str, new: &str) -> String {
    if old.is_empty() {
        "on the same NICs (the peer's NIC or path was lost)".to_string()
    } else {
        format!("from {old} to {new}")
    }
}

/// Stops every QP of `rails`: nothing more goes out or is placed through them, and what they
/// hold completes as flushed. `keep_flush`: a receiver's loopback flush QPs go on, to order
/// the dead NIC's writes ahead of later flushes (`recv::moving`).
pub(crate) fn stop<N: Nic>(rails: &[Rail<N>], keep_flush: bool) {
    for rail in rails {
        let flush = rail.flush_qp.iter().filter(|_| !keep_flush);
        for qp in rail.qps.iter().chain(&rail.probe_qps).chain(flush) {
            if let Err(e) = rail.nic.fail_qp(qp) {
                tracing::debug!("stopping QP {} on {}: {e}", qp.qpn(), rail.name());
            }
        }
    }
}

/// The rails lost when rail `r` of this end fails, this end's and the peer's (bits): the
/// peer's rails its QPs join, as each end moves the rails of a dead path.
fn lost_with(r: usize, nqps: usize, rails: usize, peer_rails: usize) -> [u8; 2] {
    let mut theirs = 0u8;
    for q in (0..nqps).filter(|&q| locate(q, rails).0 == r) {
        theirs |= 1 << modulo(q, peer_rails);
    }
    [1 << r, theirs]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::fake::Fabric;

    #[test]
    fn a_lost_rail_takes_an_unused_nic_first_and_none_is_left_after_all_are_lost() {
        let f = Fabric::new();
        let nics = vec![f.nic("a"), f.nic("b"), f.nic("c")];
        let cost = EndCost::sender(1, 2, 63);
        let p = ConnParams {
            failover: Some(Duration::from_millis(100)),
            ..super::super::tests::params()
        };
        let mut m = Mobility::new(nics, cost, p);
        assert!(
            m.able() && !m.enabled(),
            "the peer has not said it can move"
        );
        m.peer_mobile = true;
        assert!(m.enabled());
        // Rails on a, b; a lost: c (unused) rather than b.
        let picked = m.pick(2, 0b01).unwrap();
        assert_eq!(picked[0].local().name, "c");
        assert_eq!(picked[1].local().name, "b");
        // c lost too: b carries both rails, and cannot move again.
        let picked = m.pick(2, 0b01).unwrap();
        assert_eq!(picked[0].local().name, "b");
        assert_eq!(m.order[..2], [1, 1]);
        assert!(!m.able() && m.rebuild_params().failover.is_none());
        // b lost: nothing left.
        assert!(m.pick(2, 0b11).is_none());
        assert_eq!(lost_with(1, 4, 2, 2), [0b10, 0b10]);
        assert_eq!(lost_with(0, 2, 1, 2), [0b01, 0b11]);
    }

    #[test]
    fn no_move_goes_to_a_nic_that_refuses_moves() {
        let f = Fabric::new();
        let nics = vec![f.nic("a"), f.nic("b"), f.nic("c")];
        let cost = EndCost::sender(1, 1, 63);
        let p = ConnParams {
            failover: Some(Duration::from_millis(100)),
            ..super::super::tests::params()
        };
        let mut m = Mobility::new(nics.clone(), cost, p);
        // b failed a registration: a's rail goes to c.
        assert!(nics[1].refuse_moves() && !nics[1].refuse_moves());
        assert_eq!(m.pick(1, 0b1).unwrap()[0].local().name, "c");
        // c lost too: nothing is left that takes the connection.
        assert!(!m.able());
        assert!(m.pick(1, 0b1).is_none());
    }
}
