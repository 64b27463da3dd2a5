//! A rail's completion queue and what tells that the rail's paths are dead: failed
//! completions, fatal asynchronous events, and a watchdog for work that never completes. (The
//! peer itself, gone or silent, is watched by the connection's link to it: `peer`.)
//!
//! The watchdog exists because a device may retry for ever: Soft-RoCE (and some hardware)
//! treats `NCCL_IB_RETRY_CNT=7` as unbounded, so on a cut link posted work neither completes
//! nor fails, and a job would hang. It tells a dead path from a slow one, every few hundred
//! polls (so the data path pays one counter increment per completion and reads no clock):
//! - every path the connection's QPs take, each distinct (local rail, remote rail) pair, is
//!   probed while the comm has work or waits for its peer: a 1-byte RDMA READ of the peer's
//!   memory, over a QP of the path's own so that it never waits behind the data (RC orders a
//!   QP's work), every quarter of the work timeout (`NCCL_ERDMA_WORK_TIMEOUT_S`), or with
//!   failover every half of `NCCL_ERDMA_FAILOVER_AFTER_MS`, whichever applies. A probe
//!   unanswered for its bound shows the path dead: the comm fails, or moves;
//! - data work without a completion of its own for the work timeout while every path
//!   answers is slow, not dead (a lossy or congested link, whose RC retransmissions can take
//!   minutes for a large write): a WARN says so, with the device's counters, and the comm
//!   waits on; only work that makes no progress for [`SLOW_CEILING`] times the timeout fails
//!   it. A probe's answer is the path's progress, never the data's.

use std::time::{Duration, Instant};

use super::fault::{Cause, Fault};
use super::latency::RailLatency;
use super::wire::WrKind;
use crate::error::{Error, Result};
use crate::verbs::dma::{Completion, WcBatch, WcStatus, WC_SUCCESS};
use crate::verbs::nic::{Nic, QueuePair};

/// How often (in polls) the slow checks run.
const CHECK_EVERY: u32 = 256;
/// An idle call (an `isend` with nothing to post, a `test` of a receive still waiting) that
/// is answered without the comm's lock takes it once in this many calls, to look around
/// (poll the CQs, and so run the slow checks in their turn): NCCL retries in a tight loop,
/// so that is still every few microseconds.
pub(crate) const IDLE_LOOK_EVERY: u32 = 64;

/// Work that makes no progress while its path answers probes fails after this many work
/// timeouts (11.4 minutes at the default of 68.7 s).
pub(crate) const SLOW_CEILING: u32 = 10;

/// What the watchdog concluded at a check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Nothing to do, or probes to post: one bit per pair of the rail ([`PairProbe`]).
    Fine(u8),
    /// As `Fine`, and the rail's posted work has gone this long without a completion while its
    /// paths answer: slow, not dead (said once per such stretch).
    Slow(Duration, u8),
    /// Posted work on the rail has gone this long without a completion: past the ceiling, or
    /// on a rail without paths to probe.
    Stalled(Duration),
    /// The probe of pair `.0` has gone unanswered for this long: that path is dead.
    Unanswered(usize, Duration),
}

/// One path of a connection: a rail of this end and a rail of the peer that one of its QPs
/// joins, probed over that QP (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PairProbe {
    /// The QP (index among the rail's) the probes take.
    pub(crate) qp: usize,
    /// The peer's rail, and its device name (for messages).
    pub(crate) remote_rail: usize,
    pub(crate) remote_name: String,
    /// When the probe in flight was posted.
    posted: Option<Instant>,
    /// Its completion arrived (taken at the next check, which reads the clock).
    answered: bool,
    /// When the next probe is due (while the comm is active).
    next: Option<Instant>,
}

impl PairProbe {
    /// The path over the rail's QP `qp` to the peer's rail `remote_rail` (named so).
    pub(crate) fn new(qp: usize, remote_rail: usize, remote_name: String) -> Self {
        PairProbe {
            qp,
            remote_rail,
            remote_name,
            posted: None,
            answered: false,
            next: None,
        }
    }

    /// Its probe completed.
    pub(crate) fn answered(&mut self) {
        self.answered = true;
    }
}

/// How the paths are probed: a probe goes out `every` while the comm is active and may go
/// unanswered for `limit`; `setting` is what bounds it, for the error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ProbeRule {
    limit: Duration,
    every: Duration,
    setting: &'static str,
}

/// The work watchdog of one rail (see the module doc).
#[derive(Debug)]
pub(crate) struct Watchdog {
    /// Posted work without progress for this long is slow (and fails at the ceiling); None:
    /// never (`NCCL_ERDMA_WORK_TIMEOUT_S=0`).
    work_limit: Option<Duration>,
    /// None: the paths are not probed (no work timeout, no failover).
    probes: Option<ProbeRule>,
    /// Progress counted at the last check.
    progress: u64,
    /// Since when checks have seen no progress while the rail had work posted.
    idle_since: Option<Instant>,
    /// The slow work of this stretch was said.
    said_slow: bool,
}

impl Watchdog {
    /// A watchdog judging work by `work_limit` (None: never), and its paths' probes: with
    /// failover (`failover`: the suspect time) a probe every half of it, unanswered for it
    /// moves the connection; else a probe every quarter of the work limit, unanswered for it
    /// (and at least `probe_floor`) fails the comm; neither: no probes.
    pub(crate) fn new(
        work_limit: Option<Duration>,
        probe_floor: Duration,
        failover: Option<Duration>,
    ) -> Self {
        let probes = match (failover, work_limit) {
            (Some(after), _) => Some(ProbeRule {
                limit: after,
                every: after / 2,
                setting: "NCCL_ERDMA_FAILOVER_AFTER_MS",
            }),
            (None, Some(limit)) => Some(ProbeRule {
                limit: limit.max(probe_floor),
                every: limit / 4,
                setting: "NCCL_ERDMA_WORK_TIMEOUT_S",
            }),
            (None, None) => None,
        };
        Watchdog {
            work_limit,
            probes,
            progress: 0,
            idle_since: None,
            said_slow: false,
        }
    }

    /// The setting that bounds a probe, for the error.
    fn probe_setting(&self) -> &'static str {
        self.probes.map_or("", |r| r.setting)
    }

    /// One check at `now`: `progress` made on the rail so far (its own work's completions),
    /// whether it has posted work not yet completed (`work`), whether the comm waits for the
    /// peer (`waiting`), and the rail's paths, whose probes are judged and, where due, marked
    /// to post.
    pub(crate) fn check(
        &mut self,
        now: Instant,
        progress: u64,
        (work, waiting): (bool, bool),
        pairs: &mut [PairProbe],
    ) -> Verdict {
        let mut slow = None;
        if progress != self.progress || !work {
            // Progress means the rail works; a rail with nothing posted has nothing to lose.
            self.progress = progress;
            self.idle_since = None;
            self.said_slow = false;
        } else if let Some(limit) = self.work_limit {
            let idle = now.saturating_duration_since(*self.idle_since.get_or_insert(now));
            let unprobed = pairs.is_empty() || self.probes.is_none();
            if idle > limit * SLOW_CEILING || (idle > limit && unprobed) {
                return Verdict::Stalled(idle);
            }
            if idle > limit && !self.said_slow {
                // Unless a probe below shows a path dead, which comes first.
                slow = Some(idle);
            }
        }
        let probe = match self.probes {
            Some(rule) => match probe_paths(rule, now, (work, waiting), pairs) {
                Ok(probe) => probe,
                Err(dead) => return dead,
            },
            None => 0,
        };
        match slow {
            Some(idle) => {
                self.said_slow = true;
                Verdict::Slow(idle, probe)
            }
            None => Verdict::Fine(probe),
        }
    }
}

/// Judges the probes of `pairs` by `rule` at `now`: the paths to probe now (one bit each), or
/// the verdict of the first one found dead.
fn probe_paths(
    rule: ProbeRule,
    now: Instant,
    (work, waiting): (bool, bool),
    pairs: &mut [PairProbe],
) -> std::result::Result<u8, Verdict> {
    let mut probe = 0;
    for (i, p) in pairs.iter_mut().enumerate() {
        if std::mem::take(&mut p.answered) {
            p.posted = None;
            p.next = Some(now + rule.every);
        }
        if let Some(posted) = p.posted {
            let age = now.saturating_duration_since(posted);
            if age > rule.limit {
                return Err(Verdict::Unanswered(i, age));
            }
            continue;
        }
        if !(work || waiting) {
            p.next = None;
            continue;
        }
        // Active: a probe one interval after the comm became so, or after the last answer;
        // each gets the rule's limit to come back.
        let next = *p.next.get_or_insert(now + rule.every);
        if now >= next {
            p.posted = Some(now);
            probe |= 1 << i;
        }
    }
    Ok(probe)
}

/// A rail's completion queue and what polling it needs (see the module doc).
pub(crate) struct CqPoller<N: Nic> {
    pub(crate) cq: N::Cq,
    epoch: u64,
    calls: u32,
    /// Completions of the rail's own work (the watchdog's sign of progress; probes are not).
    progress: u64,
    watchdog: Watchdog,
    /// Post-to-completion latency of the signaled work (`NCCL_IB_WQE_LATENCY_THRESHOLD_NS`
    /// set), or None: then nothing reads a clock.
    pub(crate) latency: Option<Box<RailLatency>>,
}

impl<N: Nic> CqPoller<N> {
    /// A poller of `cq`, judged by `watchdog`.
    pub(crate) fn new(cq: N::Cq, watchdog: Watchdog) -> Self {
        CqPoller {
            cq,
            epoch: 0,
            calls: 0,
            progress: 0,
            watchdog,
            latency: None,
        }
    }

    /// Polls the CQ once into `wc` (the caller's, on its stack); returns whether there is
    /// anything for [`Self::hand_out`] and the slow checks to do: completions arrived, or the
    /// slow checks are due.
    #[inline(always)]
    pub(crate) fn poll(&mut self, nic: &N, wc: &mut WcBatch) -> Result<bool> {
        self.calls = self.calls.wrapping_add(1);
        let n = wc.poll(nic, &self.cq)?;
        self.time(wc);
        Ok(n > 0 || self.calls % CHECK_EVERY == 0)
    }

    /// Counts a poll made without the comm's lock, which found completions (now in the
    /// caller's batch `wc`, for [`Self::hand_out`]).
    #[inline(always)]
    pub(crate) fn polled_unlocked(&mut self, wc: &WcBatch) {
        self.calls = self.calls.wrapping_add(1);
        self.time(wc);
    }

    /// Times the completions a poll put in `wc`, where work is timed: every poll passes
    /// here, so none is missed.
    #[inline(always)]
    fn time(&mut self, wc: &WcBatch) {
        if let Some(l) = &mut self.latency {
            if wc.polled() > 0 {
                l.completed_batch(wc);
            }
        }
    }

    /// After a poll found something: hands every successful completion in `wc` to `on`,
    /// which says whether it is progress of the rail's own work, polling again while batches
    /// come full. `Ok(false)`: it stopped at a failed completion, which stays in `wc` for
    /// [`failed_completion`] to describe (built there, out of the loop).
    #[inline(always)]
    pub(crate) fn hand_out(
        &mut self,
        nic: &N,
        wc: &mut WcBatch,
        mut on: impl FnMut(Completion<'_>) -> bool,
    ) -> Result<bool> {
        loop {
            let n = wc.polled();
            for c in wc.iter() {
                if c.status() != WC_SUCCESS {
                    return Ok(false);
                }
                self.progress += u64::from(on(c));
            }
            if n < WcBatch::CAPACITY {
                return Ok(true);
            }
            wc.poll(nic, &self.cq)?;
            self.time(wc);
        }
    }

    /// Whether the slow checks (asynchronous events, watchdog; the comm's peer link) are due
    /// after this poll: every [`CHECK_EVERY`] polls.
    #[inline(always)]
    pub(crate) fn checks_due(&self) -> bool {
        self.calls % CHECK_EVERY == 0
    }

    /// The slow checks, after the completions (so the watchdog counts those of this poll):
    /// a fatal event on the device or one of `qps`, a path dead or work stalled, is the
    /// rail's fault. `work`/`waiting` say whether the rail has posted work in flight and
    /// whether the comm waits for the peer; the result: the pairs to probe (one bit each).
    #[cold]
    #[inline(never)]
    pub(crate) fn slow_checks(
        &mut self,
        nic: &N,
        (qps, pairs): (&[N::Qp], &mut [PairProbe]),
        peer: &str,
        work: bool,
        waiting: bool,
    ) -> std::result::Result<u8, Fault> {
        if let Some(l) = &mut self.latency {
            l.warn_stalls();
        }
        let now = nic.drain_async_events();
        if now != self.epoch {
            self.epoch = now;
            let qpns: Vec<u32> = qps.iter().map(|q| q.qpn()).collect();
            if let Some(why) = nic.fatal_for(&self.cq, &qpns) {
                let e = Error::device(format!("fatal asynchronous event: {why}"));
                return Err(Fault::new(Cause::FatalEvent, e));
            }
        }
        let now = Instant::now();
        match self
            .watchdog
            .check(now, self.progress, (work, waiting), pairs)
        {
            Verdict::Fine(probe) => Ok(probe),
            Verdict::Slow(idle, probe) => {
                tracing::warn!(
                    "work posted to peer {peer} on {} has not completed in {:.1} s while every \
                     path to the peer answers liveness probes: the link is lossy or congested, \
                     not dead, and the comm waits on (it fails after {} times \
                     NCCL_ERDMA_WORK_TIMEOUT_S without progress){}",
                    nic.local().name,
                    idle.as_secs_f64(),
                    SLOW_CEILING,
                    counters(nic)
                );
                Ok(probe)
            }
            Verdict::Stalled(idle) => {
                let e = stalled_error(nic, peer, idle, None, "");
                Err(Fault::new(Cause::Stalled, e))
            }
            Verdict::Unanswered(p, age) => {
                let setting = self.watchdog.probe_setting();
                let to = Some(pairs[p].remote_name.as_str());
                let e = stalled_error(nic, peer, age, to, setting);
                Err(Fault::new(Cause::Unanswered, e))
            }
        }
    }
}

/// The device's counters, for a WARN: `; counters: name=value ...`, or nothing.
fn counters<N: Nic>(nic: &N) -> String {
    nic.counters().map_or(String::new(), |c| {
        format!("; counters of {}: {c}", nic.local().name)
    })
}

/// The error of a path shown dead: a probe `to` the peer's rail unanswered, or (`to` None)
/// work that made no progress for the ceiling or on a rail without paths.
#[cold]
fn stalled_error<N: Nic>(
    nic: &N,
    peer: &str,
    idle: Duration,
    to: Option<&str>,
    setting: &str,
) -> Error {
    let (what, why) = match to {
        Some(_) => (
            "a liveness probe sent",
            "the RDMA path to the peer is down (link, switch, or the peer's NIC) while the \
             device keeps retrying",
        ),
        None => (
            "work posted",
            "no progress for that long, although the path answers liveness probes (a lossy or \
             congested link that never recovered)",
        ),
    };
    let path = to.map_or(String::new(), |remote| format!(" (to its {remote})"));
    // Work is bounded by the work timeout; a probe by it, or by the failover suspect time.
    let setting = if setting.is_empty() {
        "NCCL_ERDMA_WORK_TIMEOUT_S"
    } else {
        setting
    };
    Error::remote(format!(
        "{what} to peer {peer} on {}{path} has not completed in {:.1} s ({setting}): {why}{}",
        nic.local().name,
        idle.as_secs_f64(),
        counters(nic)
    ))
}

/// The fault of the first failed completion in `wc`, where [`CqPoller::hand_out`] stopped.
#[cold]
#[inline(never)]
pub(crate) fn failed_completion<N: Nic>(nic: &N, peer: &str, wc: &WcBatch) -> Fault {
    match wc.iter().find(|c| c.status() != WC_SUCCESS) {
        Some(c) => Fault::new(Cause::Completion(c.wc_status()), cqe_error(nic, peer, c)),
        // Not reached: the drain stops only at a failed completion.
        None => Fault::new(
            Cause::Device,
            Error::device(format!("a completion to peer {peer} failed")),
        ),
    }
}

#[cold]
fn cqe_error<N: Nic>(nic: &N, peer: &str, c: Completion<'_>) -> Error {
    let hint = match c.wc_status() {
        WcStatus::RetryExceeded => {
            " (retry exceeded: the peer is gone or unreachable; check the GID index, \
               routing and NCCL_IB_TIMEOUT)"
        }
        WcStatus::LocalProtection => {
            " (local protection error: memory not registered or ACS/IOMMU blocking \
              peer-to-peer)"
        }
        WcStatus::LocalQpOperation => " (local QP operation error: the link went down?)",
        WcStatus::Flushed => " (flushed: an earlier error broke this QP)",
        WcStatus::RemoteAccess | WcStatus::RemoteOperation => {
            " (remote access/operation error: the peer's buffer or key is invalid)"
        }
        WcStatus::RemoteInvalidRequest => {
            " (remote invalid request: the peer's QP refused the request, e.g. a length or \
              MTU it does not accept)"
        }
        WcStatus::ReceiverNotReadyRetryExceeded => " (receiver not ready)",
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
    fn watchdog_fails_work_that_never_completes_and_probes_every_path_of_an_active_comm() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let pair = |r| PairProbe::new(0, r, format!("peer{r}"));
        let mut w = Watchdog::new(Some(s(8)), s(1), None);
        let mut pairs = [pair(0), pair(1)];
        // Work in flight, completions coming: no stall however long it runs; both paths are
        // probed a quarter of the limit after the comm became active.
        assert_eq!(w.check(t0, 0, (true, false), &mut pairs), Verdict::Fine(0));
        assert_eq!(
            w.check(t0 + s(1), 1, (true, false), &mut pairs),
            Verdict::Fine(0)
        );
        assert_eq!(
            w.check(t0 + s(3), 2, (true, false), &mut pairs),
            Verdict::Fine(0b11)
        );
        // Path 0 answers, path 1 does not: path 1 is dead once its probe is older than the
        // limit, whatever the rail's other completions say.
        pairs[0].answered();
        assert_eq!(
            w.check(t0 + s(4), 3, (true, false), &mut pairs),
            Verdict::Fine(0)
        );
        assert_eq!(
            w.check(t0 + s(11), 4, (true, false), &mut pairs),
            Verdict::Fine(0b01)
        );
        assert_eq!(
            w.check(t0 + s(12), 5, (true, false), &mut pairs),
            Verdict::Unanswered(1, s(9))
        );
        // No completion at all with work posted: the rail is dead after the limit.
        let mut w = Watchdog::new(Some(s(8)), s(1), None);
        let mut none: [PairProbe; 0] = [];
        assert_eq!(w.check(t0, 0, (true, false), &mut none), Verdict::Fine(0));
        assert_eq!(
            w.check(t0 + s(8), 0, (true, false), &mut none),
            Verdict::Fine(0)
        );
        assert_eq!(
            w.check(t0 + s(9), 0, (true, false), &mut none),
            Verdict::Stalled(s(9))
        );
        // A comm that only waits probes too, and an answered probe is followed by the next.
        let mut w = Watchdog::new(Some(s(8)), s(1), None);
        let mut one = [pair(0)];
        assert_eq!(w.check(t0, 0, (false, true), &mut one), Verdict::Fine(0));
        assert_eq!(
            w.check(t0 + s(2), 0, (false, true), &mut one),
            Verdict::Fine(1)
        );
        one[0].answered();
        assert_eq!(
            w.check(t0 + s(3), 1, (false, true), &mut one),
            Verdict::Fine(0)
        );
        assert_eq!(
            w.check(t0 + s(5), 1, (false, true), &mut one),
            Verdict::Fine(1)
        );
        // Idle comms, and a watchdog turned off, never probe nor trip.
        let mut w = Watchdog::new(Some(s(8)), s(1), None);
        let mut one = [pair(0)];
        assert_eq!(w.check(t0, 0, (false, false), &mut one), Verdict::Fine(0));
        assert_eq!(
            w.check(t0 + s(100), 0, (false, false), &mut one),
            Verdict::Fine(0)
        );
        let mut off = Watchdog::new(None, s(1), None);
        assert_eq!(off.check(t0, 0, (true, true), &mut one), Verdict::Fine(0));
        assert_eq!(
            off.check(t0 + s(1000), 0, (true, true), &mut one),
            Verdict::Fine(0)
        );
    }

    #[test]
    fn failover_probes_every_half_its_suspect_time_even_without_a_work_limit() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut w = Watchdog::new(None, ms(10), Some(ms(100)));
        let mut one = [PairProbe::new(0, 0, "peer0".into())];
        assert_eq!(w.check(t0, 0, (true, false), &mut one), Verdict::Fine(0));
        assert_eq!(
            w.check(t0 + ms(60), 0, (true, false), &mut one),
            Verdict::Fine(1)
        );
        // No work limit: work without progress is never stalled; the unanswered probe is.
        assert_eq!(
            w.check(t0 + ms(170), 0, (true, false), &mut one),
            Verdict::Unanswered(0, ms(110))
        );
    }

    #[test]
    fn answered_probes_are_not_progress_of_the_work() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut w = Watchdog::new(Some(s(1)), s(1), None);
        let mut one = [PairProbe::new(0, 0, "peer0".into())];
        let mut verdicts = Vec::new();
        // The path answers every probe; the work's own progress stays at 5.
        for t in 0..=12 {
            one[0].answered();
            verdicts.push(w.check(t0 + s(t), 5, (true, false), &mut one));
        }
        // Idle from the check at 1 s: slow past 1 s of it, stalled past ten.
        assert!(matches!(verdicts[3], Verdict::Slow(..)), "{verdicts:?}");
        assert_eq!(verdicts[12], Verdict::Stalled(s(11)), "{verdicts:?}");
    }
}
