//! The rails of a connection: one per NIC of its device (one for a physical device, up to 8
//! for a virtual one). Each rail has its own QPs and completion queue (a CQ belongs to one
//! NIC), its own work watchdog and probes of each path its QPs take to the peer (so a rail or
//! path that dies is found and named even while others still complete work) and its own
//! traffic counters. QP `q` of a connection lives on rail `q % rails` of each end
//! ([`super::wire::locate`]). What goes wrong on a rail comes out as a [`Fault`] of it.

use std::sync::Arc;

use super::cq::{self, CqPoller, PairProbe};
use super::fault::{Cause, Fault};
use super::latency::RailLatency;
use super::wire::WrKind;
use crate::transport::MAX_RAILS;
use crate::verbs::dma::{Completion, SendChain, WcBatch};
use crate::verbs::nic::{Nic, QueuePair};

/// What one rail carried.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct RailStats {
    pub(crate) bytes: u64,
    pub(crate) messages: u64,
    pub(crate) errors: u64,
}

/// What a probe reads: a byte of the peer's memory (`remote`, with its key on each of the
/// peer's rails) into a byte of this end's (`local`: address, and its key on this rail).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ProbeTarget {
    pub(crate) local: (u64, u32),
    pub(crate) remote: u64,
    pub(crate) rkeys: [u32; MAX_RAILS],
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
    /// Which rail of the connection this is.
    pub(crate) index: usize,
    /// Signaled work requests posted on this rail and not completed yet. Signed, so taking
    /// completions off needs no saturation: exact bookkeeping never goes below zero, and a
    /// count that did would read as nothing in flight.
    pub(crate) in_flight: i32,
    pub(crate) stats: RailStats,
    /// The paths its QPs take to the peer's rails, each probed by the watchdog.
    pub(crate) pairs: Vec<PairProbe>,
    /// What the probes read.
    pub(crate) probe: ProbeTarget,
}

impl<N: Nic> Rail<N> {
    pub(crate) fn new(
        index: usize,
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
            index,
            in_flight: 0,
            stats: RailStats::default(),
            pairs: Vec::new(),
            probe: ProbeTarget::default(),
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
    /// has anything to do.
    #[inline]
    pub(crate) fn poll(&mut self, wc: &mut WcBatch) -> Result<bool, Fault> {
        let r = self.cq.poll(&self.nic, wc);
        r.map_err(|e| self.fault(Fault::new(Cause::Device, e)))
    }

    /// `f`, counted as this rail's.
    #[cold]
    fn fault(&mut self, f: Fault) -> Fault {
        self.stats.errors += 1;
        f.on_rail(self.index)
    }

    /// Hands what a poll put in `wc` to `on` (see [`CqPoller::hand_out`]), which says
    /// whether a completion retires signaled work of this side (then it leaves `in_flight`,
    /// and is the rail's progress); a probe's completion is the rail's own. Then runs the
    /// slow checks when due, `waiting`: whether the comm waits for its peer, and posts the
    /// probes due. Whether the slow checks ran (the comm's own slow checks ride on rail 0's).
    #[inline(always)]
    pub(crate) fn drain(
        &mut self,
        wc: &mut WcBatch,
        peer: &str,
        waiting: bool,
        mut on: impl FnMut(Completion<'_>) -> bool,
    ) -> Result<bool, Fault> {
        let mut done = 0;
        let pairs = &mut self.pairs;
        let handed = self.cq.hand_out(&self.nic, wc, |c| {
            if WrKind::of(c.wr_id()) == Some(WrKind::Probe) {
                if let Some(p) = pairs.get_mut(WrKind::slot(c.wr_id())) {
                    p.answered();
                }
                // Signaled work of the rail's, but the path's progress, not the work's.
                done += 1;
                false
            } else {
                let retires = on(c);
                done += i32::from(retires);
                retires
            }
        });
        self.in_flight -= done;
        match handed {
            Ok(true) => {}
            Ok(false) => {
                let f = cq::failed_completion(&*self.nic, peer, wc);
                return Err(self.fault(f));
            }
            Err(e) => return Err(self.fault(Fault::new(Cause::Device, e))),
        }
        if !self.cq.checks_due() {
            return Ok(false);
        }
        self.slow_checks(peer, waiting).map(|()| true)
    }

    /// The slow checks of the rail, and the probes they find due.
    #[cold]
    fn slow_checks(&mut self, peer: &str, waiting: bool) -> Result<(), Fault> {
        let work = self.in_flight > 0;
        let checked =
            self.cq
                .slow_checks(&self.nic, (&self.qps, &mut self.pairs), peer, work, waiting);
        match checked {
            Ok(0) => Ok(()),
            Ok(due) => self.post_probes(due),
            Err(f) => Err(self.fault(f)),
        }
    }

    /// 1-byte reads of the peer's memory over the paths `which` (bits of [`Self::pairs`]):
    /// work that completes at once on a live path, for the watchdog.
    #[cold]
    fn post_probes(&mut self, which: u8) -> Result<(), Fault> {
        let mut chain = SendChain::new();
        let t = self.probe;
        for p in (0..self.pairs.len()).filter(|p| which & (1 << p) != 0) {
            let (qp, remote_rail) = (self.pairs[p].qp, self.pairs[p].remote_rail);
            chain.clear();
            chain.read(t.local.0, 1, t.local.1, t.remote, t.rkeys[remote_rail]);
            chain.finish(WrKind::Probe.id(p), 0);
            if let Err(e) = chain.post(&*self.nic, &self.probe_qps[qp]) {
                return Err(self.fault(Fault::new(Cause::Device, e)));
            }
            let qpn = self.probe_qps[qp].qpn();
            self.signaled(qpn, WrKind::Probe.id(p));
        }
        Ok(())
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
