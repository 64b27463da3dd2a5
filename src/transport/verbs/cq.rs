//! A connection's completion queue and everything that tells it the peer or the path is gone:
//! failed completions, fatal asynchronous events, the peer's bootstrap socket closing or
//! falling silent, and a watchdog for work that never completes.
//!
//! The watchdog exists because a device may retry for ever: Soft-RoCE (and some hardware)
//! treats `NCCL_IB_RETRY_CNT=7` as unbounded, so on a cut link posted work neither completes
//! nor fails, and a job would hang. A comm whose posted work has gone without any completion
//! for the work timeout (`NCCL_ERDMA_WORK_TIMEOUT_S`) fails. A side that only waits for the
//! peer (a receive whose data has not come, a send whose clear-to-send has not) has no work
//! of its own in flight, so after a quarter of the timeout it posts a probe (a 1-byte RDMA
//! READ of the peer's memory): on a live path it completes at once, on a dead one it is work
//! that never completes. All of this runs every 256 polls that found the comm not done, so
//! the data path pays one counter increment per completion and no clock reads.

use std::{
    io::Read,
    net::TcpStream,
    time::{Duration, Instant},
};

use super::wire::WrKind;
use crate::error::{Error, Result};
use crate::oob;
use crate::verbs::dma::{Completion, WcBatch, WC_SUCCESS};
use crate::verbs::nic::{Nic, QueuePair};

/// How often (in polls) the slow checks run.
const CHECK_EVERY: u32 = 256;
/// An idle call (an `isend` with nothing to post, a `test` of a receive still waiting) that
/// is answered without the comm's lock takes it once in this many calls, to look around
/// (poll the CQs, and so run the slow checks in their turn): NCCL retries in a tight loop,
/// so that is still every few microseconds.
pub(crate) const IDLE_LOOK_EVERY: u32 = 64;

/// What the watchdog concluded at a check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Nothing to do.
    Fine,
    /// Post a probe: the comm only waits for the peer, and has for a while.
    Probe,
    /// Posted work has gone without a completion for this long: the path is dead.
    Stalled(Duration),
}

/// The work watchdog of one comm (see the module doc).
#[derive(Debug)]
pub(crate) struct Watchdog {
    limit: Option<Duration>,
    /// Completions counted at the last check.
    progress: u64,
    /// Since when checks have seen no completion while the comm was busy.
    idle_since: Option<Instant>,
}

impl Watchdog {
    /// A watchdog failing work after `limit` (None: off).
    pub(crate) fn new(limit: Option<Duration>) -> Self {
        Watchdog {
            limit,
            progress: 0,
            idle_since: None,
        }
    }

    /// One check at `now`: `completions` seen so far, whether the comm has posted work not
    /// yet completed (`work`), and whether it waits for the peer (`waiting`).
    pub(crate) fn check(
        &mut self,
        now: Instant,
        completions: u64,
        work: bool,
        waiting: bool,
    ) -> Verdict {
        let Some(limit) = self.limit else {
            return Verdict::Fine;
        };
        if completions != self.progress || !(work || waiting) {
            // A completion means the path works; an idle comm has nothing to lose.
            self.progress = completions;
            self.idle_since = None;
            return Verdict::Fine;
        }
        let since = *self.idle_since.get_or_insert(now);
        let idle = now.saturating_duration_since(since);
        if work {
            return if idle > limit {
                Verdict::Stalled(idle)
            } else {
                Verdict::Fine
            };
        }
        if idle > limit / 4 {
            // The probe gets the whole limit to complete.
            self.idle_since = Some(now);
            return Verdict::Probe;
        }
        Verdict::Fine
    }
}

/// A comm's completion queue and what polling it needs (see the module doc). The bootstrap
/// socket stays open as a liveness signal: when the peer process dies its kernel closes the
/// socket, which RDMA alone would only notice as a retry timeout on the sending side (and
/// never on an idle receiving side).
pub(crate) struct CqPoller<N: Nic> {
    pub(crate) cq: N::Cq,
    epoch: u64,
    calls: u32,
    oob: Option<TcpStream>,
    pub(crate) peer_gone: bool,
    /// The peer's host stopped answering keepalive probes (rather than closing).
    peer_silent: bool,
    /// Completions seen (the watchdog's sign of life).
    completions: u64,
    watchdog: Watchdog,
}

impl<N: Nic> CqPoller<N> {
    pub(crate) fn new(cq: N::Cq, work_timeout: Option<Duration>) -> Self {
        CqPoller {
            cq,
            epoch: 0,
            calls: 0,
            oob: None,
            peer_gone: false,
            peer_silent: false,
            completions: 0,
            watchdog: Watchdog::new(work_timeout),
        }
    }

    /// Keeps the (non-blocking) bootstrap socket to watch for the peer's exit.
    pub(crate) fn watch(&mut self, stream: TcpStream) {
        self.oob = Some(stream);
    }

    /// Whether the peer's bootstrap socket has closed (its process exited or closed the comm).
    fn check_peer(&mut self) -> bool {
        if !self.peer_gone {
            if let Some(s) = &mut self.oob {
                let mut b = [0u8; 16];
                self.peer_gone = match s.read(&mut b) {
                    Ok(0) => true,
                    Ok(_) => false,
                    Err(e) => {
                        // ETIMEDOUT: the keepalive probes (NCCL_ERDMA_PEER_TIMEOUT_S) found
                        // no one there.
                        self.peer_silent = e.kind() == std::io::ErrorKind::TimedOut;
                        !matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                        )
                    }
                };
            }
        }
        self.peer_gone
    }

    /// The error for work that can no longer complete because the peer is gone.
    #[cold]
    pub(crate) fn gone_error(&self, peer: &str) -> Error {
        if self.peer_silent {
            return Error::remote(format!(
                "peer {peer} stopped answering with requests still in flight{}",
                oob::PEER_SILENT
            ));
        }
        Error::remote(format!(
            "peer {peer} closed its connection (its process exited or closed the comm) with \
             requests still in flight"
        ))
    }

    /// Polls the CQ once into `wc` (the caller's, on its stack); returns whether there is
    /// anything for [`Self::hand_out`] and the slow checks to do: completions arrived, or the
    /// slow checks are due.
    #[inline(always)]
    pub(crate) fn poll(&mut self, nic: &N, wc: &mut WcBatch) -> Result<bool> {
        self.calls = self.calls.wrapping_add(1);
        let n = wc.poll(nic, &self.cq)?;
        Ok(n > 0 || self.calls % CHECK_EVERY == 0)
    }

    /// Counts a poll made without the comm's lock, which found completions (now in the
    /// caller's batch, for [`Self::hand_out`]).
    #[inline(always)]
    pub(crate) fn polled_unlocked(&mut self) {
        self.calls = self.calls.wrapping_add(1);
    }

    /// After a poll found something: hands every successful completion in `wc` to `on`,
    /// polling again while batches come full. `Ok(false)`: it stopped at a failed
    /// completion, which stays in `wc` for [`failed_completion`] to describe (built there, out
    /// of the loop).
    #[inline(always)]
    pub(crate) fn hand_out(
        &mut self,
        nic: &N,
        wc: &mut WcBatch,
        mut on: impl FnMut(Completion<'_>),
    ) -> Result<bool> {
        loop {
            let n = wc.polled();
            for c in wc.iter() {
                if c.status() != WC_SUCCESS {
                    return Ok(false);
                }
                on(c);
            }
            self.completions += n as u64;
            if n < WcBatch::CAPACITY {
                return Ok(true);
            }
            wc.poll(nic, &self.cq)?;
        }
    }

    /// Whether the slow checks (peer, asynchronous events, watchdog) are due after this
    /// poll: every [`CHECK_EVERY`] polls.
    #[inline(always)]
    pub(crate) fn checks_due(&self) -> bool {
        self.calls % CHECK_EVERY == 0
    }

    /// The slow checks, after the completions (so the watchdog counts those of this poll):
    /// a fatal event on the device or one of `qps`, or a stall, is the comm's error.
    /// `work`/`waiting` say whether the comm has posted work in flight and whether it waits
    /// for the peer; the result says whether to post a probe.
    #[cold]
    #[inline(never)]
    pub(crate) fn slow_checks(
        &mut self,
        nic: &N,
        qps: &[N::Qp],
        peer: &str,
        work: bool,
        waiting: bool,
    ) -> Result<bool> {
        self.check_peer();
        let now = nic.drain_async_events();
        if now != self.epoch {
            self.epoch = now;
            let qpns: Vec<u32> = qps.iter().map(|q| q.qpn()).collect();
            if let Some(why) = nic.fatal_for(&self.cq, &qpns) {
                return Err(Error::device(format!("fatal asynchronous event: {why}")));
            }
        }
        match self
            .watchdog
            .check(Instant::now(), self.completions, work, waiting)
        {
            Verdict::Fine => Ok(false),
            Verdict::Probe => Ok(true),
            Verdict::Stalled(idle) => Err(stalled_error(nic, peer, idle)),
        }
    }
}

#[cold]
fn stalled_error<N: Nic>(nic: &N, peer: &str, idle: Duration) -> Error {
    Error::remote(format!(
        "work posted to peer {peer} on {} has not completed in {:.1} s \
         (NCCL_ERDMA_WORK_TIMEOUT_S): the RDMA path to the peer is down (link, switch, or the \
         peer's NIC) while the device keeps retrying",
        nic.local().name,
        idle.as_secs_f64()
    ))
}

/// The error of the first failed completion in `wc`, where [`CqPoller::hand_out`] stopped.
#[cold]
#[inline(never)]
pub(crate) fn failed_completion<N: Nic>(nic: &N, peer: &str, wc: &WcBatch) -> Error {
    match wc.iter().find(|c| c.status() != WC_SUCCESS) {
        Some(c) => cqe_error(nic, peer, c),
        // Not reached: the drain stops only at a failed completion.
        None => Error::device(format!("a completion to peer {peer} failed")),
    }
}

#[cold]
fn cqe_error<N: Nic>(nic: &N, peer: &str, c: Completion<'_>) -> Error {
    let hint = match c.status() {
        12 => {
            " (retry exceeded: the peer is gone or unreachable; check the GID index, \
               routing and NCCL_IB_TIMEOUT)"
        }
        4 => {
            " (local protection error: memory not registered or ACS/IOMMU blocking \
              peer-to-peer)"
        }
        5 => " (flushed: an earlier error broke this QP)",
        10 | 11 => " (remote access/operation error: the peer's buffer or key is invalid)",
        13 => " (receiver not ready)",
        _ => "",
    };
    Error::remote(format!(
        "{} to peer {peer} on {} failed: {} (status {}, vendor error {:#x}, QP {}){hint}",
        WrKind::describe(c.wr_id()),
        nic.local().name,
        nic.status_str(c.status()),
        c.status(),
        c.vendor_err(),
        c.qp_num()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watchdog_fails_work_that_never_completes_and_probes_a_waiting_comm() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut w = Watchdog::new(Some(s(8)));
        // Work in flight, completions coming: fine however long it runs.
        for i in 0..20 {
            assert_eq!(w.check(t0 + s(i), i, true, false), Verdict::Fine);
        }
        // Then no completion: fails once the limit has passed since the first idle check.
        assert_eq!(w.check(t0 + s(30), 19, true, false), Verdict::Fine);
        assert_eq!(w.check(t0 + s(38), 19, true, false), Verdict::Fine);
        assert_eq!(w.check(t0 + s(39), 19, true, false), Verdict::Stalled(s(9)));
        // A comm that only waits for its peer probes after a quarter of the limit, and the
        // probe then has the whole limit.
        let mut w = Watchdog::new(Some(s(8)));
        assert_eq!(w.check(t0, 0, false, true), Verdict::Fine);
        assert_eq!(w.check(t0 + s(3), 0, false, true), Verdict::Probe);
        assert_eq!(w.check(t0 + s(10), 0, true, true), Verdict::Fine);
        assert_eq!(w.check(t0 + s(12), 0, true, true), Verdict::Stalled(s(9)));
        // The probe completing resets it.
        let mut w = Watchdog::new(Some(s(8)));
        w.check(t0, 0, false, true);
        assert_eq!(w.check(t0 + s(3), 0, false, true), Verdict::Probe);
        assert_eq!(w.check(t0 + s(4), 1, false, true), Verdict::Fine);
        assert_eq!(w.check(t0 + s(6), 1, false, true), Verdict::Fine);
        // Idle comms, and a watchdog turned off, never trip.
        assert_eq!(w.check(t0 + s(100), 1, false, false), Verdict::Fine);
        let mut off = Watchdog::new(None);
        assert_eq!(off.check(t0, 0, true, true), Verdict::Fine);
        assert_eq!(off.check(t0 + s(1000), 0, true, true), Verdict::Fine);
    }
}
