//! What the unit tests read of a receive comm and the steps they take on it, beside the data path.

use super::*;

impl<N: Nic> VerbsReceiver<N> {
    /// Steps the setup (as an `irecv` does before it posts): whether the connection is up.
    pub(crate) fn step_setup(&self) -> Result<bool> {
        let mut s = self.state.lock();
        let r = if s.still() {
            Ok(false)
        } else {
            s.step_move(&self.gate)
        };
        self.gate.lock_wanted(s.needs_lock());
        r.map(|moving| !moving && s.still())
    }

    /// One locked poll of the rails, as a `test` makes (its slow checks in their turn).
    pub(crate) fn poll_once(&self) -> Result<()> {
        let mut s = self.state.lock();
        let r = s.progress(&self.gate);
        self.gate.lock_wanted(s.needs_lock());
        r
    }

    /// Numbers the next receive `seq` (the sender must do the same). Only while nothing is
    /// in flight: tests cross the 32-bit boundary without 2^32 messages.
    pub(crate) fn skip_to(&self, seq: u64) {
        let mut s = self.state.lock();
        assert!(s.slots.iter().all(|st| !st.busy) && s.cts_posted == s.seq);
        (s.seq, s.cts_posted, s.finished) = (seq, seq, seq);
    }

    /// Clear-to-send writes posted, and the receives they announced.
    pub(crate) fn cts_counts(&self) -> (u64, u64) {
        let s = self.state.lock();
        (s.cts_writes, s.cts_posted)
    }

    /// What each rail carried.
    pub(crate) fn rail_stats(&self) -> Vec<rail::RailStats> {
        self.state.lock().rails.iter().map(|r| r.stats).collect()
    }

    /// The epoch of the last move begun (0: none).
    pub(crate) fn epoch(&self) -> u32 {
        self.state.lock().mobility.epoch
    }

    /// The NICs this end lost and has not seen healed (bits, in its key order).
    pub(crate) fn lost_nics(&self) -> u16 {
        self.state.lock().mobility.lost()
    }

    /// Whether this end keeps its rails of a trial of the way home (it answered one).
    pub(crate) fn holds_trial(&self) -> bool {
        self.state.lock().trial.is_some()
    }

    /// The NIC each rail is on now.
    pub(crate) fn rail_nics(&self) -> Vec<String> {
        let s = self.state.lock();
        s.rails.iter().map(|r| r.name().to_string()).collect()
    }

    /// The QP numbers of the rails' loopback flush QPs.
    pub(crate) fn flush_qpns(&self) -> Vec<u32> {
        let s = self.state.lock();
        s.rails
            .iter()
            .flat_map(|r| r.flush_qp.as_ref().map(|q| q.qpn()))
            .collect()
    }

    /// Runs `f` while holding the comm's lock (calls that need it wait meanwhile).
    pub(crate) fn with_lock_held(&self, f: impl FnOnce()) {
        let _s = self.state.lock();
        f();
    }

    /// Idle tests the gate counted so far: every `IDLE_LOOK_EVERY`th locks.
    pub(crate) fn idle_looks(&self) -> u32 {
        self.gate.looks()
    }
}
