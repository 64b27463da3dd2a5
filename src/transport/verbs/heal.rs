//! Knowing that a NIC a connection lost has healed. A lost NIC counts as healed once its port
//! has stayed active for the settling time (`NCCL_ERDMA_FAILBACK_AFTER_MS`), doubled each
//! time the same comm loses it again (at most [`MAX_DOUBLINGS`] times): a link that flaps
//! moves nothing back and forth, and a path that fails with its port up (loss on the wire)
//! is tried again ever more rarely. Only a comm that lost a NIC looks, from its slow checks,
//! at most every [`LOOK_EVERY`]; the device reads the port for all of them at most every
//! `PortWatch::EVERY`. A healed NIC may carry the connection again: a later failover may move
//! there, and the connection moves back to its own NICs (`failover`), at a [`Moment`] the
//! receiver answers at once: between messages (after [`BUSY_WAIT`], made by letting the sends
//! in flight complete), while a receive waits for a send; at most [`RETURNS_PER_MINUTE`]
//! times a minute.

use std::time::{Duration, Instant};

/// How often a comm that lost a NIC looks at its port.
pub(crate) const LOOK_EVERY: Duration = Duration::from_millis(100);
/// Moves back a connection may make in a minute.
pub(crate) const RETURNS_PER_MINUTE: u32 = 2;
/// How often the settling time doubles for a NIC lost again and again.
pub(crate) const MAX_DOUBLINGS: u32 = 5;
/// How long a move back due waits for a moment between messages before it tries to make
/// one: the sends in flight complete, nothing new posted meanwhile, and the move begins if a
/// receive waits then (a connection NCCL keeps busy is never between messages for long).
pub(crate) const BUSY_WAIT: Duration = Duration::from_secs(1);

/// The connection's traffic as the sender sees it, which decides when a move back may begin.
/// The move waits for the receiver's answer, and a receiver answers only from its calls, so
/// it begins only while a receive waits for data this end has not sent yet, and nothing is
/// in flight: the receiver tests that receive until the move is over. NCCL calls nothing on
/// a comm with nothing posted, for as long as its rank is elsewhere (a checkpoint), longer
/// than a move may take; and a receive whose data is in flight may complete before the
/// receiver reads the offer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Moment {
    /// A receive waits for a send this end has not sent (its clear-to-send landed) and
    /// nothing is in flight: the move begins, and nothing is sent again.
    Between,
    /// Sends are in flight: the move back, due, first lets them complete, posting nothing
    /// new, and begins once a receive waits (for a while: the path tried may not hold).
    Busy,
    /// Nothing in flight and no receive waiting for a send (nothing posted, or all it posted
    /// has its data): the receiver may not call for minutes.
    Idle,
}

/// How often a comm may begin a trial of the way home (`trial`): one unanswered, or whose
/// moment passed, is not begun again at once.
pub(crate) const TRIAL_EVERY: Duration = Duration::from_secs(1);

/// One lost NIC's watch.
#[derive(Debug, Clone, Copy, Default)]
struct Watch {
    /// How many times this comm lost it.
    losses: u32,
    /// Since when its port has been seen active, without a look finding it down, since
    /// its last loss.
    usable_since: Option<Instant>,
}

/// The watches of one comm's NICs, and its moves back.
#[derive(Debug)]
pub(crate) struct Healing {
    settle: Duration,
    watch: Vec<Watch>,
    next_look: Option<Instant>,
    /// The minute's first move back, and how many began since.
    returns: Option<(Instant, u32)>,
    /// When the next trial of the way home may begin.
    next_trial: Option<Instant>,
}

impl Healing {
    /// Watches for `nics` NICs, each healed after `settle` of usable port (per loss).
    pub(crate) fn new(nics: usize, settle: Duration) -> Self {
        Healing {
            settle,
            watch: vec![Watch::default(); nics],
            next_look: None,
            returns: None,
            next_trial: None,
        }
    }

    /// NIC `k` was lost (again): its settling starts over, longer.
    pub(crate) fn lost(&mut self, k: usize) {
        let w = &mut self.watch[k];
        w.losses += 1;
        w.usable_since = None;
    }

    /// How many times this comm lost NIC `k`.
    #[cfg(test)]
    pub(crate) fn losses(&self, k: usize) -> u32 {
        self.watch[k].losses
    }

    /// How long NIC `k`'s port must stay active to count as healed.
    fn settle_of(&self, k: usize) -> Duration {
        let doublings = self.watch[k].losses.saturating_sub(1).min(MAX_DOUBLINGS);
        self.settle * 2u32.pow(doublings)
    }

    /// Looks at the lost NICs (`lost`, bits) whose ports `active` reads, where a look is due
    /// at `now`: the bits of those healed.
    pub(crate) fn look(&mut self, lost: u16, now: Instant, active: impl Fn(usize) -> bool) -> u16 {
        if self.next_look.is_some_and(|t| now < t) {
            return 0;
        }
        self.next_look = Some(now + LOOK_EVERY);
        let mut healed = 0;
        for k in (0..self.watch.len()).filter(|k| lost & (1 << k) != 0) {
            let settle = self.settle_of(k);
            let w = &mut self.watch[k];
            if !active(k) {
                w.usable_since = None;
                continue;
            }
            let since = *w.usable_since.get_or_insert(now);
            if now.duration_since(since) >= settle {
                healed |= 1 << k;
            }
        }
        healed
    }

    /// Whether a move back may begin at `now`: fewer than [`RETURNS_PER_MINUTE`] began this
    /// minute.
    pub(crate) fn may_return(&self, now: Instant) -> bool {
        match self.returns {
            Some((first, n)) if now.duration_since(first) < Duration::from_secs(60) => {
                n < RETURNS_PER_MINUTE
            }
            _ => true,
        }
    }

    /// Whether a trial of the way home may begin at `now`; counts it where it may.
    pub(crate) fn may_try(&mut self, now: Instant) -> bool {
        if self.next_trial.is_some_and(|t| now < t) {
            return false;
        }
        self.next_trial = Some(now + TRIAL_EVERY);
        true
    }

    /// A move back began at `now`.
    pub(crate) fn returned(&mut self, now: Instant) {
        match &mut self.returns {
            Some((first, n)) if now.duration_since(*first) < Duration::from_secs(60) => *n += 1,
            r => *r = Some((now, 1)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nic_heals_after_its_port_stays_active_for_the_settling_time_doubled_per_loss() {
        let settle = Duration::from_secs(10);
        let mut h = Healing::new(2, settle);
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        h.lost(1);
        // Down at first, then up from 5 s: healed at 15 s, not before.
        assert_eq!(h.look(0b10, at(0), |_| false), 0);
        assert_eq!(h.look(0b10, at(5), |_| true), 0);
        assert_eq!(h.look(0b10, at(14), |_| true), 0);
        assert_eq!(h.look(0b10, at(15), |_| true), 0b10);
        // A flap inside the settling time starts it over.
        h.lost(1);
        assert_eq!(h.look(0b10, at(20), |_| true), 0);
        assert_eq!(h.look(0b10, at(30), |_| false), 0);
        assert_eq!(h.look(0b10, at(31), |_| true), 0);
        // Lost twice: 20 s.
        assert_eq!(h.look(0b10, at(50), |_| true), 0);
        assert_eq!(h.look(0b10, at(51), |_| true), 0b10);
        // Looks come at most every LOOK_EVERY.
        assert_eq!(h.look(0b10, at(51) + LOOK_EVERY / 2, |_| true), 0);
        for _ in 0..10 {
            h.lost(0);
        }
        assert_eq!(h.settle_of(0), settle * 32);
    }

    #[test]
    fn moves_back_are_capped_per_minute() {
        let mut h = Healing::new(1, Duration::ZERO);
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert!(h.may_return(t0));
        h.returned(t0);
        // Asking counts nothing; only a move back begun does.
        assert!(h.may_return(at(1)) && h.may_return(at(1)));
        h.returned(at(1));
        assert!(!h.may_return(at(59)));
        assert!(h.may_return(at(61)));
    }
}
