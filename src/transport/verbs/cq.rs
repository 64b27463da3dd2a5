//! A connection's completion queue and everything that tells it the peer or the path is gone:
//! failed completions, fatal asynchronous events, the peer's bootstrap socket closing or
//! falling silent, and a watchdog for work that never completes.
//!
//! The watchdog exists because a device may retry for ever: Soft-RoCE (and some hardware)
//! treats `NCCL_IB_RETRY_CNT=7` as unbounded, so on a cut link posted work neither completes
//! nor fails, and a job would hang. It tells a dead path from a slow one, every few hundred
//! polls (so the data path pays one counter increment per completion and reads no clock):
//! - every path the connection's QPs take, each distinct (local rail, remote rail) pair, is
//!   probed while the comm has work or waits for its peer: a 1-byte RDMA READ of the peer's
//!   memory every quarter of the work timeout (`NCCL_ERDMA_WORK_TIMEOUT_S`), over a QP of the
//!   path's own, so that it never waits behind the data (RC orders a QP's work). A probe
//!   unanswered for the timeout shows the path dead, and the comm fails; so a dead path is
//!   found by both ends, even where one end's rail also meets live rails of the peer;
//! - data work without a completion for the timeout while every path answers is slow, not dead
//!   (a lossy or congested link, whose RC retransmissions can take minutes for a large write):
//!   a WARN says so, with the device's counters, and the comm waits on; only work that makes no
//!   progress for [`SLOW_CEILING`] times the timeout fails it (the bound that still holds).

use std::time::{Duration, Instant};

use super::latency::RailLatency;
use super::wire::WrKind;
use crate::error::{Error, Result};
use crate::oob::{self, Channel, Message};
use crate::verbs::dma::{Completion, WcBatch, WC_SUCCESS};
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

/// The work watchdog of one rail (see the module doc).
#[derive(Debug)]
pub(crate) struct Watchdog {
    limit: Option<Duration>,
    /// How long a probe may go unanswered: the limit, and at least several of the device's
    /// retransmission timers (a probe lost on a lossy link is sent again only after one);
    /// with failover, the time after which a path is suspected and the connection moves.
    probe_limit: Duration,
    /// How long after an answer the next probe goes out: a quarter of the limit, half the
    /// suspect time with failover.
    probe_every: Duration,
    /// The setting that bounds a probe (for the error).
    probe_setting: &'static str,
    /// Completions counted at the last check.
    progress: u64,
    /// Since when checks have seen no completion while the rail had work posted.
    idle_since: Option<Instant>,
    /// The slow work of this stretch was said.
    said_slow: bool,
}

impl Watchdog {
    /// A watchdog judging work by `limit` (None: off) and probes by `probe_limit` (at least
    /// `limit`).
    pub(crate) fn new(limit: Option<Duration>, probe_limit: Duration) -> Self {
        Watchdog {
            limit,
            probe_limit: limit.map_or(probe_limit, |l| probe_limit.max(l)),
            probe_every: limit.map_or(probe_limit, |l| l / 4),
            probe_setting: "NCCL_ERDMA_WORK_TIMEOUT_S",
            progress: 0,
            idle_since: None,
            said_slow: false,
        }
    }

    /// The watchdog of a connection that moves off a path whose probe goes unanswered for
    /// `after` (failover), probing every half of it while the comm is active.
    pub(crate) fn suspecting(mut self, after: Option<Duration>) -> Self {
        if let Some(after) = after {
            self.probe_limit = after;
            self.probe_every = after / 2;
            self.probe_setting = "NCCL_ERDMA_FAILOVER_AFTER_MS";
        }
        self
    }

    /// One check at `now`: `completions` seen on the rail so far, whether it has posted work
    /// not yet completed (`work`), whether the comm waits for the peer (`waiting`), and the
    /// rail's paths, whose probes are judged and, where due, marked to post.
    pub(crate) fn check(
        &mut self,
        now: Instant,
        completions: u64,
        (work, waiting): (bool, bool),
        pairs: &mut [PairProbe],
    ) -> Verdict {
        let Some(limit) = self.limit else {
            return Verdict::Fine(0);
        };
        let mut slow = None;
        if completions != self.progress || !work {
            // A completion means the rail works; a rail with nothing posted has nothing to lose.
            self.progress = completions;
            self.idle_since = None;
            self.said_slow = false;
        } else {
            let idle = now.saturating_duration_since(*self.idle_since.get_or_insert(now));
            if idle > limit * SLOW_CEILING || (idle > limit && pairs.is_empty()) {
                return Verdict::Stalled(idle);
            }
            if idle > limit && !self.said_slow {
                // Unless a probe below shows a path dead, which comes first.
                slow = Some(idle);
            }
        }
        let mut probe = 0;
        for (i, p) in pairs.iter_mut().enumerate() {
            if std::mem::take(&mut p.answered) {
                p.posted = None;
                p.next = Some(now + self.probe_every);
            }
            if let Some(posted) = p.posted {
                let age = now.saturating_duration_since(posted);
                if age > self.probe_limit {
                    return Verdict::Unanswered(i, age);
                }
                continue;
            }
            if !(work || waiting) {
                p.next = None;
                continue;
            }
            // Active: a probe a quarter of the limit (half the suspect time) after the comm
            // became so, or after the last answer; each gets the probe limit to come back.
            let next = *p.next.get_or_insert(now + self.probe_every);
            if now >= next {
                p.posted = Some(now);
                probe |= 1 << i;
            }
        }
        match slow {
            Some(idle) => {
                self.said_slow = true;
                Verdict::Slow(idle, probe)
            }
            None => Verdict::Fine(probe),
        }
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
    /// The bootstrap connection, as the peer watch and the way a move's messages come.
    oob: Option<Channel>,
    /// A message the peer sent (it moves the connection), for the comm to act on.
    pub(crate) mail: Option<Message>,
    pub(crate) peer_gone: bool,
    /// The peer's host stopped answering keepalive probes (rather than closing).
    peer_silent: bool,
    /// Completions seen (the watchdog's sign of life).
    completions: u64,
    watchdog: Watchdog,
    /// Post-to-completion latency of the signaled work (`NCCL_IB_WQE_LATENCY_THRESHOLD_NS`
    /// set), or None: then nothing reads a clock.
    pub(crate) latency: Option<Box<RailLatency>>,
}

impl<N: Nic> CqPoller<N> {
    /// A poller of `cq`, judging work by `work_timeout` (None: never) and probes by
    /// `probe_timeout` (at least the work timeout), or by `failover` where set.
    pub(crate) fn new(
        cq: N::Cq,
        work_timeout: Option<Duration>,
        probe_timeout: Duration,
        failover: Option<Duration>,
    ) -> Self {
        CqPoller {
            cq,
            epoch: 0,
            calls: 0,
            oob: None,
            mail: None,
            peer_gone: false,
            peer_silent: false,
            completions: 0,
            watchdog: Watchdog::new(work_timeout, probe_timeout).suspecting(failover),
            latency: None,
        }
    }

    /// Keeps the (non-blocking) bootstrap connection to watch for the peer's exit and its
    /// messages.
    pub(crate) fn watch(&mut self, chan: Channel) {
        self.oob = Some(chan);
    }

    /// Gives the bootstrap connection up (to a move, which watches it meanwhile).
    pub(crate) fn unwatch(&mut self) -> Option<Channel> {
        self.oob.take()
    }

    /// Reads what the peer's bootstrap connection has: a message (kept in `mail`), or its
    /// close (the peer's process exited or closed the comm).
    fn check_peer(&mut self) {
        if self.peer_gone || self.mail.is_some() {
            return;
        }
        let Some(chan) = &mut self.oob else {
            return;
        };
        match chan.recv_io() {
            Ok(Some(m)) => self.mail = Some(m),
            Ok(None) => {}
            Err(e) => {
                // ETIMEDOUT: the keepalive probes (NCCL_ERDMA_PEER_TIMEOUT_S) found no one
                // there.
                self.peer_silent = e.kind() == std::io::ErrorKind::TimedOut;
                self.peer_gone = true;
            }
        }
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
            self.time(wc);
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
    /// `work`/`waiting` say whether the rail has posted work in flight and whether the comm
    /// waits for the peer; the result: the pairs to probe (one bit each).
    #[cold]
    #[inline(never)]
    pub(crate) fn slow_checks(
        &mut self,
        nic: &N,
        (qps, pairs): (&[N::Qp], &mut [PairProbe]),
        peer: &str,
        work: bool,
        waiting: bool,
    ) -> Result<u8> {
        self.check_peer();
        if self.mail.is_some() {
            // The comm reads it (the peer moves the connection).
            return Err(Error::remote(format!("peer {peer} sent a message")));
        }
        if let Some(l) = &mut self.latency {
            l.warn_stalls();
        }
        let now = nic.drain_async_events();
        if now != self.epoch {
            self.epoch = now;
            let qpns: Vec<u32> = qps.iter().map(|q| q.qpn()).collect();
            if let Some(why) = nic.fatal_for(&self.cq, &qpns) {
                return Err(Error::device(format!("fatal asynchronous event: {why}")));
            }
        }
        let now = Instant::now();
        match self
            .watchdog
            .check(now, self.completions, (work, waiting), pairs)
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
            Verdict::Stalled(idle) => Err(stalled_error(nic, peer, idle, None, "")),
            Verdict::Unanswered(p, age) => {
                let setting = self.watchdog.probe_setting;
                Err(stalled_error(
                    nic,
                    peer,
                    age,
                    Some(&pairs[p].remote_name),
                    setting,
                ))
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
    fn watchdog_fails_work_that_never_completes_and_probes_every_path_of_an_active_comm() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let pair = |r| PairProbe::new(0, r, format!("peer{r}"));
        let mut w = Watchdog::new(Some(s(8)), s(1));
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
        let mut w = Watchdog::new(Some(s(8)), s(1));
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
        let mut w = Watchdog::new(Some(s(8)), s(1));
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
        let mut w = Watchdog::new(Some(s(8)), s(1));
        let mut one = [pair(0)];
        assert_eq!(w.check(t0, 0, (false, false), &mut one), Verdict::Fine(0));
        assert_eq!(
            w.check(t0 + s(100), 0, (false, false), &mut one),
            Verdict::Fine(0)
        );
        let mut off = Watchdog::new(None, s(1));
        assert_eq!(off.check(t0, 0, (true, true), &mut one), Verdict::Fine(0));
        assert_eq!(
            off.check(t0 + s(1000), 0, (true, true), &mut one),
            Verdict::Fine(0)
        );
    }
}
