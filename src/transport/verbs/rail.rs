//! The rails of a connection: one per NIC of its device (one for a physical device, up to 8
//! for a virtual one). Each rail has its own QPs and completion queue (a CQ belongs to one
//! NIC), its own work watchdog and probes of each path its QPs take to the peer (so a rail or
//! path that dies is found and named even while others still complete work) and its own
//! traffic counters. QP `q` of a connection lives on rail `q % rails` of each end.

use std::sync::Arc;

use super::cq::{self, CqPoller, PairProbe};
use super::latency::RailLatency;
use super::wire::WrKind;
use crate::error::Result;
use crate::verbs::dma::{Completion, WcBatch, WC_SUCCESS};
use crate::verbs::nic::{Nic, QueuePair};

/// What one rail carried.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct RailStats {
    pub(crate) bytes: u64,
    pub(crate) messages: u64,
    pub(crate) errors: u64,
}

/// One NIC of a connection.
pub(crate) struct Rail<N: Nic> {
    // Field order is teardown order: QPs before the CQ they complete into.
    /// This rail's QPs, in connection order: local QP `i` is the connection's QP
    /// `i * rails + index`.
    pub(crate) qps: Vec<N::Qp>,
    /// The loopback QP of a receiver's flushes (GPUDirect), when it has one.
    pub(crate) flush_qp: Option<N::Qp>,
    /// The probe QP of each path of this rail (see [`Self::pairs`]): the watchdog's probes go
    /// there, never behind the data.
    pub(crate) probe_qps: Vec<N::Qp>,
    pub(crate) cq: CqPoller<N>,
    pub(crate) nic: Arc<N>,
    /// Signaled work requests posted on this rail and not completed yet. Signed, so taking
    /// completions off needs no saturation: exact bookkeeping never goes below zero, and a
    /// count that did would read as nothing in flight.
    pub(crate) in_flight: i32,
    pub(crate) stats: RailStats,
    /// The paths its QPs take to the peer's rails, each probed by the watchdog.
    pub(crate) pairs: Vec<PairProbe>,
    /// The status of the failed completion that broke the rail, if one did.
    pub(crate) failed_status: Option<u32>,
}

impl<N: Nic> Rail<N> {
    pub(crate) fn new(
        nic: Arc<N>,
        cq: CqPoller<N>,
        qps: Vec<N::Qp>,
        flush_qp: Option<N::Qp>,
    ) -> Self {
        Rail {
            qps,
            flush_qp,
            probe_qps: Vec::new(),
            cq,
            nic,
            in_flight: 0,
            stats: RailStats::default(),
            pairs: Vec::new(),
            failed_status: None,
        }
    }

    /// A signaled work request `wr_id` was posted on QP `qpn`: in flight until its completion
    /// (and timed, where work is).
    #[inline]
    pub(crate) fn signaled(&mut self, qpn: u32, wr_id: u64) {
        self.in_flight += 1;
        if let Some(l) = &mut self.cq.latency {
            l.posted_now(qpn, wr_id);
        }
    }

    /// Times the signaled work of every QP of the rail towards `peer` from now on: slower
    /// than `threshold` is a WARN, and `report` asks for the summary at close.
    pub(crate) fn time_work(&mut self, threshold: std::time::Duration, report: bool, peer: &str) {
        let mut l = RailLatency::new(threshold, report, self.name(), peer);
        let qps = self.qps.iter().chain(&self.probe_qps).chain(&self.flush_qp);
        for qp in qps {
            l.track(qp.qpn());
        }
        self.cq.latency = Some(Box::new(l));
    }

    /// Adds a path of this rail to the peer's rail `remote_rail` (its device `remote_name`),
    /// probed over `qp`, a QP of its own; returns its index among the rail's paths.
    pub(crate) fn add_path(&mut self, qp: N::Qp, remote_rail: usize, remote_name: &str) -> usize {
        self.probe_qps.push(qp);
        let i = self.pairs.len();
        self.pairs
            .push(PairProbe::new(i, remote_rail, remote_name.to_string()));
        i
    }

    /// The device name, for messages.
    pub(crate) fn name(&self) -> &str {
        &self.nic.local().name
    }

    /// Polls this rail's CQ once into `wc` (see [`CqPoller::poll`]): whether [`Self::drain`]
    /// has anything to do. A failed poll counts as the rail's error.
    #[inline]
    pub(crate) fn poll(&mut self, wc: &mut WcBatch) -> Result<bool> {
        let r = self.cq.poll(&self.nic, wc);
        self.count_error(r)
    }

    /// Passes `r` through, counting its error as the rail's.
    #[inline]
    fn count_error<T>(&mut self, r: Result<T>) -> Result<T> {
        if r.is_err() {
            self.stats.errors += 1;
        }
        r
    }

    /// Hands what a poll put in `wc` to `on` (see [`CqPoller::hand_out`]), which says
    /// whether a completion retires signaled work of this side (then it leaves `in_flight`);
    /// a probe's completion is the rail's own. Then runs the slow checks when due, `waiting`:
    /// whether the comm waits for its peer. Returns the paths to probe now (one bit each of
    /// [`Self::pairs`]). A failure counts as the rail's error.
    #[inline(always)]
    pub(crate) fn drain(
        &mut self,
        wc: &mut WcBatch,
        peer: &str,
        waiting: bool,
        mut on: impl FnMut(Completion<'_>) -> bool,
    ) -> Result<u8> {
        let mut done = 0;
        let pairs = &mut self.pairs;
        let handed = self.cq.hand_out(&self.nic, wc, |c| {
            if WrKind::of(c.wr_id()) == Some(WrKind::Probe) {
                if let Some(p) = pairs.get_mut(WrKind::slot(c.wr_id())) {
                    p.answered();
                }
                done += 1;
            } else {
                done += i32::from(on(c));
            }
        });
        self.in_flight -= done;
        if !matches!(handed, Ok(true)) {
            // Stopped at a failed completion (Ok(false)) or poll.
            let e = handed.and_then(|_| {
                self.failed_status = wc.iter().map(|c| c.status()).find(|&s| s != WC_SUCCESS);
                Err(cq::failed_completion(&*self.nic, peer, wc))
            });
            return self.count_error(e);
        }
        if !self.cq.checks_due() {
            return Ok(0);
        }
        let work = self.in_flight > 0;
        let r = self
            .cq
            .slow_checks(&self.nic, (&self.qps, &mut self.pairs), peer, work, waiting);
        self.count_error(r)
    }
}

/// The rails of `rails` with their counters, for a comm's summary: ` (rxe0: B bytes in M
/// messages, E errors; rxe1: ...)`.
pub(crate) fn summary<N: Nic>(rails: &[Rail<N>]) -> String {
    let parts: Vec<String> = rails
        .iter()
        .map(|r| {
            format!(
                "{}: {} bytes in {} messages, {} errors",
                r.name(),
                r.stats.bytes,
                r.stats.messages,
                r.stats.errors
            )
        })
        .collect();
    format!(" (rails {})", parts.join("; "))
}

/// The rail and rail-local index of connection QP `q` over `rails` rails.
#[inline(always)]
pub(crate) fn locate(q: usize, rails: usize) -> (usize, usize) {
    if rails == 1 {
        (0, q)
    } else if rails.is_power_of_two() {
        (q & (rails - 1), q >> rails.trailing_zeros())
    } else {
        (q % rails, q / rails)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qps_are_dealt_over_the_rails() {
        assert_eq!(locate(0, 1), (0, 0));
        assert_eq!(locate(5, 1), (0, 5));
        let two: Vec<(usize, usize)> = (0..4).map(|q| locate(q, 2)).collect();
        assert_eq!(two, [(0, 0), (1, 0), (0, 1), (1, 1)]);
        assert_eq!(locate(7, 3), (1, 2));
        let four: Vec<(usize, usize)> = (6..10).map(|q| locate(q, 4)).collect();
        assert_eq!(four, [(2, 1), (3, 1), (0, 2), (1, 2)]);
    }
}
