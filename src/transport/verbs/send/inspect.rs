//! What the unit tests read of a send comm and the steps they take on it, beside the data path.

use super::*;
use crate::transport::verbs::peer::Pause;
use crate::transport::verbs::wire::Step;

impl<N: Nic> VerbsSender<N> {
    /// Steps the setup (as an idle `isend` does): whether the connection is up.
    pub(crate) fn step_setup(&self) -> Result<bool> {
        let mut s = self.state.lock();
        let r = s.look_around();
        self.publish(&s);
        r.map(|()| s.still())
    }

    /// Makes the next slot the one of receive `seq` (the receiver must do the same). Only
    /// while nothing is in flight: tests cross the 32-bit boundary without 2^32 messages.
    pub(crate) fn skip_to(&self, seq: u64) {
        let mut s = self.state.lock();
        assert!(s.slots.iter().all(|st| !st.busy) && s.rails.iter().all(|r| r.in_flight == 0));
        s.seq = seq;
        self.publish(&s);
    }

    /// The QP numbers of the connection, in connection order.
    pub(crate) fn qpns(&self) -> Vec<u32> {
        let s = self.state.lock();
        (0..s.plan.nqps)
            .map(|q| {
                let (r, i) = locate(q, s.rails.len());
                s.rails[r].qps[i].qpn()
            })
            .collect()
    }

    /// What each rail carried.
    pub(crate) fn rail_stats(&self) -> Vec<rail::RailStats> {
        self.state.lock().rails.iter().map(|r| r.stats).collect()
    }

    /// The epoch of the last move begun (0: none).
    pub(crate) fn epoch(&self) -> u32 {
        self.state.lock().mobility.epoch
    }

    /// The QP numbers of the rails a move under way offered (none while no move is offered).
    pub(crate) fn offered_qpns(&self) -> Vec<u32> {
        match &self.state.lock().movement {
            Movement::Offered(o) => o
                .new
                .rails()
                .iter()
                .flat_map(|r| r.qps.iter().map(|q| q.qpn()))
                .collect(),
            _ => Vec::new(),
        }
    }

    /// From now on the calling thread stops right after this end sends a move message of
    /// `step`, until the pause returned is released.
    pub(crate) fn pause_link_after(&self, step: Step) -> Pause {
        self.state.lock().link.pause_after(step)
    }

    /// Whether a move back holds new sends until those in flight complete (its trial passed).
    pub(crate) fn draining(&self) -> bool {
        matches!(self.state.lock().movement, Movement::Draining(_))
    }

    /// Whether a trial of the way home is under way.
    pub(crate) fn trying(&self) -> bool {
        self.state.lock().trial.is_some()
    }

    /// The NICs this end lost and has not seen healed (bits, in its key order).
    pub(crate) fn lost_nics(&self) -> u16 {
        self.state.lock().mobility.lost()
    }

    /// How many times this end lost NIC `k` (in its key order; a failed trial counts).
    pub(crate) fn losses(&self, k: usize) -> u32 {
        self.state.lock().mobility.losses(k)
    }

    /// The NIC each rail is on now.
    pub(crate) fn rail_nics(&self) -> Vec<String> {
        let s = self.state.lock();
        s.rails.iter().map(|r| r.name().to_string()).collect()
    }

    /// Runs `f` while holding the comm's lock (calls that need it wait meanwhile).
    pub(crate) fn with_lock_held(&self, f: impl FnOnce()) {
        let _s = self.state.lock();
        f();
    }

    /// Slow completions and stalls the latency of each rail counted.
    pub(crate) fn wqe_counts(&self) -> (u64, u64) {
        let s = self.state.lock();
        s.rails
            .iter()
            .filter_map(|r| r.cq.latency.as_ref())
            .fold((0, 0), |(a, b), l| (a + l.slow, b + l.stalls))
    }

    /// The QP numbers of the probe QPs, rail after rail.
    pub(crate) fn probe_qpns(&self) -> Vec<u32> {
        let s = self.state.lock();
        s.rails
            .iter()
            .flat_map(|r| r.probe_qps.iter().map(|q| q.qpn()))
            .collect()
    }

    /// Idle `isend`s counted so far: every `IDLE_LOOK_EVERY`th looks around, under the lock.
    pub(crate) fn idle_calls(&self) -> u32 {
        self.gate.idle_calls()
    }
}
