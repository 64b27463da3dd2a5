//! The path a move back would take, tried before the move. A healed NIC's port says only
//! that its link is up, not that the peer is reached over it (loss on the wire, a switch
//! port, the peer's NIC). So before the sender moves a connection back, it brings up the
//! connection's QPs on its own NICs against the receiver's on theirs (`Trial`, answered by
//! `Tried`, both numbered: the bring-up of a move, without its data) and writes nothing
//! through each QP, so every path between the ends' rails is tried (a zero-length RDMA write:
//! the peer's NIC acknowledges it, no memory is touched). The move back begins once every
//! write is acknowledged; a write that fails, or goes unacknowledged for the failover suspect
//! time, or a QP that cannot be brought up, is a [`Verdict::Failed`]: the connection stays,
//! and the NICs of the rails away from home count as lost again (their settling time
//! doubles). The trial's rails are polled only from the slow checks; the receiver keeps its
//! own for [`kept_for`], longer than any trial waits.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::bringup::{Bringup, Role};
use super::budget::EndCost;
use super::cq::failed_completion;
use super::fault::{Cause, Fault};
use super::profile::ConnParams;
use super::rail::Rail;
use super::wire::{encode_trial, ConnInfo, MoveMsg, Step, WrKind};
use crate::error::{Error, Result};
use crate::transport::MAX_RAILS;
use crate::verbs::dma::{SendChain, WcBatch, WC_SUCCESS};
use crate::verbs::nic::Nic;

/// How long a trial may wait for the receiver's rails, and then for its writes' answers,
/// where failover sets no suspect time.
const ANSWER_WITHIN: Duration = Duration::from_secs(2);

/// Nothing of the trial's is read or written: it lands nowhere.
const NOWHERE: (u64, [u32; MAX_RAILS]) = (0, [0; MAX_RAILS]);

/// `rails` described for the peer: nothing of theirs is read or written, and the trial's
/// rails never move.
fn describe<N: Nic>(rails: &Bringup<N>) -> Vec<u8> {
    rails.describe(NOWHERE.0, |_| 0, false).encode()
}

/// How long a trial waits for the receiver's rails, and then for its writes, with
/// parameters `p`.
fn within(p: &ConnParams) -> Duration {
    p.failover.unwrap_or(ANSWER_WITHIN)
}

/// How long the receiver keeps its rails of a trial (with parameters `p`): past both of the
/// sender's waits.
pub(crate) fn kept_for(p: &ConnParams) -> Duration {
    within(p) * 2 + Duration::from_secs(1)
}

/// Where a trial stands.
pub(crate) enum Verdict {
    /// The receiver's rails, or the writes' answers, are awaited.
    Waiting,
    /// Every rail's write was acknowledged: the path carries the connection.
    Passed,
    /// The path does not reach the peer.
    Failed(Fault),
    /// The receiver did not answer in time (it makes no calls): nothing is known.
    Unanswered,
}

/// The sender's trial of its own NICs' paths.
pub(crate) struct Trial<N: Nic> {
    rails: Bringup<N>,
    /// Which trial of the move it is: the `Tried` of that one only is taken.
    pub(crate) number: u32,
    /// When it began, or its writes went, and how long the answer may take.
    since: Instant,
    within: Duration,
    /// Per rail, its writes not acknowledged yet, once the writes went.
    unanswered: Option<[usize; MAX_RAILS]>,
    /// What made it fail before any write went.
    failed: Option<Fault>,
}

impl<N: Nic> Trial<N> {
    /// Trial `number` of `nics` (rail `r`'s own NIC at `r`) in move epoch `epoch`: the rails
    /// made as `cost` and `p` say, and the `Trial` message that asks the receiver for its own.
    pub(crate) fn offer(
        nics: &[Arc<N>],
        cost: &EndCost,
        p: ConnParams,
        (epoch, number): (u32, u32),
    ) -> Result<(Self, MoveMsg)> {
        let rails = Bringup::make(nics, cost, p, Role::Offers)?;
        let msg = MoveMsg {
            step: Step::Trial,
            epoch,
            lost: [0; 2],
            body: encode_trial(number, &describe(&rails)),
        };
        let trial = Trial {
            rails,
            number,
            since: Instant::now(),
            within: within(&p),
            unanswered: None,
            failed: None,
        };
        Ok((trial, msg))
    }

    /// Until when what it found holds: the time a trial waits after its writes went (the
    /// receiver keeps its side longer).
    pub(crate) fn holds_until(&self) -> Instant {
        self.since + self.within
    }

    /// The receiver's `Tried`, `remote`: its rails (None: its own NICs could not be brought
    /// up towards this end's), which this end's join and then write through.
    pub(crate) fn tried(&mut self, remote: Option<ConnInfo>, peer: &str) {
        if self.unanswered.is_some() || self.failed.is_some() {
            // Answered already (a peer that says it twice): judged on the first.
            return;
        }
        let Some(remote) = remote else {
            let e = Error::remote(format!(
                "peer {peer} could not bring its own NICs up towards this end's"
            ));
            self.failed = Some(Fault::new(Cause::Unreachable, e));
            return;
        };
        if let Err(f) = self.rails.join(&remote, NOWHERE, peer) {
            self.failed = Some(f);
            return;
        }
        let mut unanswered = [0; MAX_RAILS];
        let mut chain = SendChain::new();
        for rail in self.rails.rails() {
            for qp in &rail.qps {
                chain.clear();
                chain.write(0, 0, 0, 0, 0);
                chain.finish(WrKind::Trial.id(rail.index), 0);
                if let Err(e) = chain.post(&*rail.nic, qp) {
                    self.failed = Some(Fault::new(Cause::Device, e).on_rail(rail.index));
                    return;
                }
                unanswered[rail.index] += 1;
            }
        }
        self.since = Instant::now();
        self.unanswered = Some(unanswered);
    }

    /// Where the trial stands at `now`: the writes' answers taken off the CQs.
    pub(crate) fn verdict(&mut self, now: Instant, peer: &str) -> Verdict {
        if let Some(f) = self.failed.take() {
            return Verdict::Failed(f);
        }
        let waited = now.duration_since(self.since) > self.within;
        let Some(mut unanswered) = self.unanswered else {
            return if waited {
                Verdict::Unanswered
            } else {
                Verdict::Waiting
            };
        };
        let mut wc = WcBatch::new();
        for rail in self.rails.rails() {
            let left = &mut unanswered[rail.index];
            while *left > 0 && matches!(wc.poll(&*rail.nic, &rail.cq.cq), Ok(1..)) {
                if wc.iter().any(|c| c.status() != WC_SUCCESS) {
                    return Verdict::Failed(failed_completion(&*rail.nic, peer, &wc));
                }
                *left = left.saturating_sub(wc.polled());
            }
        }
        self.unanswered = Some(unanswered);
        match unanswered.iter().position(|&left| left > 0) {
            None => Verdict::Passed,
            Some(r) if waited => {
                let e = Error::remote(format!(
                    "a write to peer {peer} on {} was not acknowledged in {:.1} s",
                    self.rails.rails()[r].name(),
                    self.within.as_secs_f64()
                ));
                Verdict::Failed(Fault::new(Cause::Unanswered, e).on_rail(r))
            }
            _ => Verdict::Waiting,
        }
    }

    /// The trial's rails, for the reaper.
    pub(crate) fn into_rails(self) -> Vec<Rail<N>> {
        self.rails.into_rails()
    }
}

/// The receiver's half of a trial: its own NICs' rails (`nics`, made as `cost` and `p` say),
/// joined to the sender's (`remote`), kept until the trial is over (the sender's writes
/// land there); and the rails of the `Tried`: their description, or nothing where they
/// cannot be brought up.
pub(crate) fn answer<N: Nic>(
    nics: &[Arc<N>],
    (cost, p): (&EndCost, ConnParams),
    remote: &ConnInfo,
    peer: &str,
) -> (Option<Bringup<N>>, Vec<u8>) {
    let mut rails = match Bringup::make(nics, cost, p, Role::Answers) {
        Ok(rails) => rails,
        Err(e) => {
            tracing::debug!("a trial of the path to peer {peer}: {e}");
            return (None, Vec::new());
        }
    };
    if let Err(f) = rails.join(remote, NOWHERE, peer) {
        tracing::debug!("a trial of the path to peer {peer}: {}", f.error);
        return (Some(rails), Vec::new());
    }
    let body = describe(&rails);
    (Some(rails), body)
}
