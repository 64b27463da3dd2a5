//! Post-to-completion latency of a rail's signaled work requests, as NCCL 2.32's IB transport
//! reports it (`NCCL_IB_WQE_LATENCY_THRESHOLD_NS`, `NCCL_IB_WQE_LATENCY_REPORT`): per QP, the
//! time from post to completion of each signaled request (clear-to-sends, a message's last
//! write, probes, flushes), a WARN for one slower than the threshold ("WQE slow") or still
//! without a completion past it ("WQE stall (no CQE)"), at most one per QP per second, and at
//! close one INFO line per QP with the count and p50 / p90 / p99 / p99.9 / max.
//!
//! Off (threshold 0, the default) nothing here exists and the data path reads no clock. On,
//! every QP keeps a ring of its outstanding requests' post times (RC completes a QP's send
//! queue in order) and a fixed histogram: nothing is allocated per message.

use std::time::{Duration, Instant};

use super::wire::WrKind;
use crate::verbs::dma::{WcBatch, WC_SUCCESS};

/// Histogram buckets: 16 per power of two of nanoseconds (at most 6.25% wide), to 2^40 ns
/// (18 minutes; longer lands in the last).
const SUB_BITS: usize = 4;
const SUB: usize = 1 << SUB_BITS;
const BUCKETS: usize = (41 - SUB_BITS) * SUB;

/// A fixed-size histogram of latencies in nanoseconds, log-linear (every bucket at most
/// 6.25% wide), from which percentiles are read.
#[derive(Debug, Clone)]
pub(crate) struct Histogram {
    counts: Box<[u64; BUCKETS]>,
    total: u64,
    max: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: Box::new([0; BUCKETS]),
            total: 0,
            max: 0,
        }
    }
}

impl Histogram {
    /// The bucket of `ns`.
    fn bucket(ns: u64) -> usize {
        if ns < SUB as u64 {
            return ns as usize;
        }
        let exp = 63 - ns.leading_zeros() as usize; // >= SUB_BITS
        let mantissa = ((ns >> (exp - SUB_BITS)) & (SUB as u64 - 1)) as usize;
        ((exp - SUB_BITS + 1) * SUB + mantissa).min(BUCKETS - 1)
    }

    /// The smallest value of bucket `b`.
    fn floor(b: usize) -> u64 {
        if b < SUB {
            return b as u64;
        }
        let exp = b / SUB + SUB_BITS - 1;
        ((SUB + b % SUB) as u64) << (exp - SUB_BITS)
    }

    /// Records one latency.
    pub(crate) fn record(&mut self, ns: u64) {
        self.counts[Self::bucket(ns)] += 1;
        self.total += 1;
        self.max = self.max.max(ns);
    }

    /// Latencies recorded.
    pub(crate) fn count(&self) -> u64 {
        self.total
    }

    /// The latency below which a fraction `q` (0..1) of them lie: the middle of its bucket
    /// (within 3.2% of every value in it), at most the largest recorded.
    pub(crate) fn quantile(&self, q: f64) -> u64 {
        let rank = ((self.total as f64 * q).ceil() as u64).max(1);
        let mut seen = 0;
        for (b, n) in self.counts.iter().enumerate() {
            seen += n;
            if seen >= rank {
                let (lo, hi) = (Self::floor(b), Self::floor(b + 1));
                return (lo + (hi - lo) / 2).min(self.max);
            }
        }
        self.max
    }

    /// The largest recorded.
    pub(crate) fn max(&self) -> u64 {
        self.max
    }
}

/// Most signaled requests one QP has outstanding (its send queue's depth bounds it).
const RING: usize = 512;

/// One QP's outstanding requests and latencies.
#[derive(Debug)]
struct QpLatency {
    qpn: u32,
    /// Post times and kinds of the outstanding signaled requests, oldest first.
    ring: Box<[(Instant, u64); RING]>,
    head: usize,
    len: usize,
    hist: Histogram,
    /// When this QP last WARNed (at most one per second).
    warned: Option<Instant>,
}

/// What a QP had to say (a WARN's fields).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Slow {
    pub(crate) qpn: u32,
    /// What the request was (`WrKind::describe`).
    pub(crate) what: &'static str,
    pub(crate) took: Duration,
    /// No completion yet: a stall, rather than a slow completion.
    pub(crate) stalled: bool,
}

/// The latency of a rail's signaled work (see the module doc).
#[derive(Debug)]
pub(crate) struct RailLatency {
    threshold: Duration,
    report: bool,
    /// The rail's device and the peer, for the WARNs.
    device: String,
    peer: String,
    qps: Vec<QpLatency>,
    /// Completions slower than the threshold, and stalls said.
    pub(crate) slow: u64,
    pub(crate) stalls: u64,
}

impl RailLatency {
    /// Latency of the work of `device` towards `peer`, a WARN where slower than
    /// `threshold`, reported at close where `report`.
    pub(crate) fn new(threshold: Duration, report: bool, device: &str, peer: &str) -> Self {
        RailLatency {
            threshold,
            report,
            device: device.to_string(),
            peer: peer.to_string(),
            qps: Vec::new(),
            slow: 0,
            stalls: 0,
        }
    }

    /// Tracks QP `qpn` from now on (made at setup, so that a post allocates nothing).
    pub(crate) fn track(&mut self, qpn: u32) {
        if self.qps.iter().all(|q| q.qpn != qpn) {
            self.qps.push(QpLatency {
                qpn,
                ring: Box::new([(Instant::now(), 0); RING]),
                head: 0,
                len: 0,
                hist: Histogram::default(),
                warned: None,
            });
        }
    }

    /// A signaled request `wr_id` was posted on QP `qpn` (a tracked one) at `now`.
    pub(crate) fn posted(&mut self, qpn: u32, wr_id: u64, now: Instant) {
        let Some(q) = self.qps.iter_mut().find(|q| q.qpn == qpn) else {
            return;
        };
        if q.len < RING {
            let at = (q.head + q.len) % RING;
            q.ring[at] = (now, wr_id);
            q.len += 1;
        }
    }

    /// The oldest outstanding request of QP `qpn` completed at `now`: its latency, and a WARN's
    /// fields where it was over the threshold and the QP may WARN again.
    pub(crate) fn completed(&mut self, qpn: u32, now: Instant) -> Option<Slow> {
        let threshold = self.threshold;
        let q = self.qps.iter_mut().find(|q| q.qpn == qpn)?;
        if q.len == 0 {
            return None;
        }
        let (posted, wr_id) = q.ring[q.head];
        q.head = (q.head + 1) % RING;
        q.len -= 1;
        let took = now.saturating_duration_since(posted);
        q.hist
            .record(took.as_nanos().min(u128::from(u64::MAX)) as u64);
        self.slow += u64::from(took > threshold);
        (took > threshold && may_warn(&mut q.warned, now)).then(|| Slow {
            qpn,
            what: WrKind::describe(wr_id),
            took,
            stalled: false,
        })
    }

    /// [`Self::posted`] now: out of line, so that the data path carries only the check
    /// whether work is timed.
    #[inline(never)]
    pub(crate) fn posted_now(&mut self, qpn: u32, wr_id: u64) {
        self.posted(qpn, wr_id, Instant::now());
    }

    /// [`Self::completed`] now for every successful send-queue completion of `wc` (a QP
    /// completes its signaled requests in order), with the WARNs; once per batch and out of
    /// line, so that a poll carries only the check whether work is timed.
    #[inline(never)]
    pub(crate) fn completed_batch(&mut self, wc: &WcBatch) {
        let now = Instant::now();
        for c in wc.iter() {
            if c.status() != WC_SUCCESS {
                break;
            }
            if !c.of_send_queue() {
                continue;
            }
            if let Some(slow) = self.completed(c.qp_num(), now) {
                self.warn(&slow);
            }
        }
    }

    /// WARNs of the requests outstanding past the threshold now.
    pub(crate) fn warn_stalls(&mut self) {
        for slow in self.stalls(Instant::now()) {
            self.warn(&slow);
        }
    }

    fn warn(&self, slow: &Slow) {
        let line = warning(slow, &self.device, &self.peer, self.threshold);
        tracing::warn!("{line}");
    }

    /// The requests outstanding past the threshold at `now`, one per QP that may WARN again.
    pub(crate) fn stalls(&mut self, now: Instant) -> Vec<Slow> {
        let threshold = self.threshold;
        let mut out = Vec::new();
        for q in &mut self.qps {
            if q.len == 0 {
                continue;
            }
            let (posted, wr_id) = q.ring[q.head];
            let age = now.saturating_duration_since(posted);
            if age > threshold && may_warn(&mut q.warned, now) {
                out.push(Slow {
                    qpn: q.qpn,
                    what: WrKind::describe(wr_id),
                    took: age,
                    stalled: true,
                });
            }
        }
        self.stalls += out.len() as u64;
        out
    }

    /// The close report: one line per QP with requests (`None` where not asked for).
    pub(crate) fn report(&self) -> Option<Vec<String>> {
        if !self.report {
            return None;
        }
        let us = |ns: u64| ns as f64 / 1e3;
        Some(
            self.qps
                .iter()
                .filter(|q| q.hist.count() > 0)
                .map(|q| {
                    let h = &q.hist;
                    format!(
                        "QP {}: {} requests, post to completion p50 {:.1} us p90 {:.1} us p99 \
                         {:.1} us p99.9 {:.1} us max {:.1} us",
                        q.qpn,
                        h.count(),
                        us(h.quantile(0.5)),
                        us(h.quantile(0.9)),
                        us(h.quantile(0.99)),
                        us(h.quantile(0.999)),
                        us(h.max())
                    )
                })
                .collect(),
        )
    }
}

impl Drop for RailLatency {
    /// The close report (the comm's rails go when it closes): one INFO line per QP, where
    /// asked for.
    fn drop(&mut self) {
        for line in self.report().into_iter().flatten() {
            tracing::info!(
                "WQE latency on {} to peer {}: {line}",
                self.device,
                self.peer
            );
        }
    }
}

/// Whether a QP that last WARNed at `last` may WARN at `now` (once a second); if so, it has.
fn may_warn(last: &mut Option<Instant>, now: Instant) -> bool {
    if last.is_some_and(|t| now.saturating_duration_since(t) < Duration::from_secs(1)) {
        return false;
    }
    *last = Some(now);
    true
}

/// The WARN of `slow` on `device` towards `peer`, as NCCL's IB transport words it.
pub(crate) fn warning(slow: &Slow, device: &str, peer: &str, threshold: Duration) -> String {
    let (kind, verb) = if slow.stalled {
        ("WQE stall (no CQE)", "outstanding for")
    } else {
        ("WQE slow", "completed after")
    };
    format!(
        "{kind}: {} on {device} QP {} to peer {peer} {verb} {:.1} us \
         (NCCL_IB_WQE_LATENCY_THRESHOLD_NS {})",
        slow.what,
        slow.qpn,
        slow.took.as_secs_f64() * 1e6,
        threshold.as_nanos()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_a_known_distribution_are_within_a_bucket() {
        let mut h = Histogram::default();
        // 1..=1000 us, each once.
        for us in 1..=1000u64 {
            h.record(us * 1000);
        }
        assert_eq!(h.count(), 1000);
        for (q, want_us) in [(0.5, 500.0), (0.9, 900.0), (0.99, 990.0), (0.999, 999.0)] {
            let got = h.quantile(q) as f64 / 1e3;
            assert!(
                (got - want_us).abs() <= want_us * 0.032,
                "p{q}: {got} us, want about {want_us}"
            );
        }
        assert_eq!(h.max(), 1_000_000);
        // Every bucket holds what falls into it.
        for ns in [0, 1, 7, 8, 9, 1023, 1024, 123_456_789] {
            let b = Histogram::bucket(ns);
            assert!(Histogram::floor(b) <= ns, "{ns}");
            assert!(b + 1 == BUCKETS || Histogram::floor(b + 1) > ns, "{ns}");
        }
    }

    #[test]
    fn slow_and_stalled_work_warns_at_most_once_a_second_per_qp() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut l = RailLatency::new(ms(1), true, "rxe0", "peer");
        l.track(7);
        l.posted(7, WrKind::Send.id(0), t0);
        l.posted(7, WrKind::Send.id(1), t0);
        l.posted(7, WrKind::Cts.id(2), t0 + ms(1));
        // In order: the first completes late (a WARN), the second too (within the second: no
        // WARN), the third on time.
        let slow = l.completed(7, t0 + ms(5)).expect("a WARN");
        assert_eq!(
            (slow.qpn, slow.what, slow.took, slow.stalled),
            (7, "data RDMA write", ms(5), false)
        );
        assert_eq!(l.completed(7, t0 + ms(6)), None);
        assert_eq!(l.completed(7, t0 + ms(1) + ms(1) / 2), None);
        assert_eq!(l.completed(7, t0 + ms(7)), None, "nothing outstanding");
        // One never completes: a stall, once the second has passed.
        l.posted(7, WrKind::Probe.id(0), t0 + ms(10));
        assert!(
            l.stalls(t0 + ms(500)).is_empty(),
            "warned within the second"
        );
        let stalls = l.stalls(t0 + ms(1010));
        assert_eq!(stalls.len(), 1);
        assert!(stalls[0].stalled && stalls[0].took == ms(1000));
        let line = warning(&stalls[0], "rxe0", "10.0.0.2:1 (rxe1)", ms(1));
        for part in [
            "WQE stall (no CQE)",
            "liveness probe",
            "rxe0",
            "QP 7",
            "10.0.0.2:1",
            "1000000.0 us",
        ] {
            assert!(line.contains(part), "{part}: {line}");
        }
        let report = l.report().unwrap();
        assert_eq!(report.len(), 1);
        assert!(report[0].starts_with("QP 7: 3 requests"), "{}", report[0]);
        assert!(RailLatency::new(ms(1), false, "rxe0", "peer")
            .report()
            .is_none());
    }
}
