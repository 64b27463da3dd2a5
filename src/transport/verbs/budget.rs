//! What one end of a connection takes of its NICs (QPs, a CQ, registrations, queue depths),
//! the depths themselves, and how many data QPs it may have where a device's limits are
//! short. A CQ has room for every work request its QPs can hold: when a move stops the QPs,
//! all of them complete (as flushed), signaled or not. Fitted before anything
//! is made: a connection that would exceed `max_qp`, `max_cq`, `max_mr`, `max_qp_wr` or
//! `max_cqe` (counting what this process already holds) gets fewer QPs, down to one per rail,
//! with one WARN for the process naming the limit; only when even that cannot fit does it fail,
//! naming the limit and what the process holds. The listener may answer a connector with fewer
//! QPs than it offered (never fewer than the connector's rails), and the connector then uses
//! as many.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::wire::{locate, paths, MAX_QPS, SLOTS};
use crate::error::{Error, Result};
use crate::transport::facts::ConnectionCost;
use crate::transport::MAX_RECVS;
use crate::verbs::limits::{DeviceLimits, Held};
use crate::verbs::nic::Nic;

/// The send queue depth of a sender's QPs: room for a single-buffer send in nearly every slot
/// twice over (one write each), or for seven sends of 8-buffer receives (9 writes each). A
/// send the queue has no room for now is "not now" (NCCL tries it again), so the depth
/// bounds memory, not what NCCL may have in flight. One below a power of two: providers make
/// a queue's ring a power of two, rxe after adding one, so 64 would take a ring of 128.
pub(crate) const SENDER_SEND_DEPTH: u32 = 2 * SLOTS as u32 - 1;

/// The shallowest send queue a sender can use: one slot of an 8-buffer receive's sends.
pub(crate) const MIN_SEND_DEPTH: u32 = slot_wrs(MAX_RECVS);

/// Work requests the writes of a slot of `n` sends may take on one QP: one per send, and
/// the write of the sizes of a grouped receive. A send queue shallower than this for
/// `MAX_RECVS` could never post an 8-buffer receive's slot.
pub(crate) const fn slot_wrs(n: usize) -> u32 {
    (n + 1) as u32
}

/// Send queue depth of a receiver's first QP, the one its clear-to-sends go out on: up to
/// `SLOTS` receives announced and not finished, each by its own write at worst, plus the
/// unsignaled writes since the last signaled one, with room to spare. One below a power of
/// two (see [`SENDER_SEND_DEPTH`]). Its other QPs send nothing.
pub(crate) const RECEIVER_SEND_DEPTH: u32 = 2 * SLOTS as u32 - 1;

/// A receiver's receive queue depth per data QP: one receive per slot, and one spare.
pub(crate) const RECEIVER_RECV_DEPTH: u32 = SLOTS as u32 + 1;

/// A probe QP's queues: one read in flight at a time, and no receive is ever consumed.
pub(crate) const PROBE_QUEUES: (u32, u32) = (4, 1);

/// A receiver's loopback flush QP's queues: a read per flush slot.
pub(crate) const FLUSH_QUEUES: (u32, u32) = (SLOTS as u32, 1);

/// What one end of a connection makes, for `qps` data QPs dealt over `rails` rails (QP `q` on
/// rail `q % rails`), each rail with its own CQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct EndCost {
    /// Data QPs of the connection.
    pub(crate) qps: usize,
    /// This end's rails, and the peer's (the paths, each with a probe QP, pair them).
    pub(crate) rails: usize,
    pub(crate) peer_rails: usize,
    /// A loopback flush QP per rail.
    pub(crate) flush: bool,
    /// Registrations per rail.
    pub(crate) mrs: u32,
    /// Send queue depth of the first data QP (a receiver's carries the clear-to-sends) and of
    /// the others; receive queue depth of each.
    pub(crate) first_send_wr: u32,
    pub(crate) send_wr: u32,
    pub(crate) recv_wr: u32,
}

impl EndCost {
    /// The sending end of `qps` data QPs over `rails` rails: per QP room for `send_wr` data
    /// writes (a send waits for more; never below one slot of an 8-buffer receive's sends),
    /// one signaled per slot; the FIFO and the size records registered.
    pub(crate) fn sender(qps: usize, rails: usize, send_wr: u32) -> Self {
        let send_wr = send_wr.max(MIN_SEND_DEPTH);
        EndCost {
            qps,
            rails,
            peer_rails: rails,
            flush: false,
            mrs: 2,
            first_send_wr: send_wr,
            send_wr,
            recv_wr: 1,
        }
    }

    /// The receiving end of `qps` data QPs over `rails` rails, towards `peer_rails`: a
    /// receive per slot on each data QP; the clear-to-sends on the first QP only (the others
    /// send nothing); the flush QP where `flush`; the probes; three registered buffers.
    pub(crate) fn receiver(qps: usize, rails: usize, peer_rails: usize, flush: bool) -> Self {
        EndCost {
            qps,
            rails,
            peer_rails,
            flush,
            mrs: 3,
            first_send_wr: RECEIVER_SEND_DEPTH,
            send_wr: 1,
            recv_wr: RECEIVER_RECV_DEPTH,
        }
    }

    /// Data QPs on rail `r`.
    pub(crate) fn qps_on(&self, r: usize) -> usize {
        (0..self.qps)
            .filter(|&q| locate(q, self.rails).0 == r)
            .count()
    }

    /// The send queue depth of data QP `q`.
    pub(crate) fn send_wr_of(&self, q: usize) -> u32 {
        if q == 0 {
            self.first_send_wr
        } else {
            self.send_wr
        }
    }

    /// Probe QPs on rail `r`: one per path of the connection that starts there.
    fn probes_on(&self, r: usize) -> usize {
        paths(self.qps, self.rails, self.peer_rails)
            .iter()
            .filter(|p| p.0 == r)
            .count()
    }

    /// QPs of every kind on rail `r`: its data QPs, a probe per path and the flush QP.
    fn all_qps_on(&self, r: usize) -> usize {
        self.qps_on(r) + self.probes_on(r) + usize::from(self.flush)
    }

    /// The CQ size of rail `r`: room for every work request its QPs' queues hold, which is
    /// what completes when a move stops them (see the module doc).
    pub(crate) fn cqes_on(&self, r: usize) -> usize {
        let data: u32 = (0..self.qps)
            .filter(|&q| locate(q, self.rails).0 == r)
            .map(|q| self.send_wr_of(q) + self.recv_wr)
            .sum();
        let queues = |(send, recv): (u32, u32)| (send + recv) as usize;
        data as usize
            + self.probes_on(r) * queues(PROBE_QUEUES)
            + usize::from(self.flush) * queues(FLUSH_QUEUES)
    }

    /// Every QP of both kinds, CQs and registrations over all rails.
    pub(crate) fn totals(&self) -> Held {
        let sum = |f: &dyn Fn(usize) -> usize| (0..self.rails).map(f).sum::<usize>() as u32;
        Held {
            qps: sum(&|r| self.all_qps_on(r)),
            cqs: self.rails as u32,
            mrs: self.mrs * self.rails as u32,
        }
    }
}

/// The first limit a connection's end does not fit on one of its NICs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Short {
    /// The rail whose NIC is short.
    pub(crate) rail: usize,
    /// The limit's `ibv_device_attr` name and value.
    pub(crate) limit: &'static str,
    pub(crate) value: u32,
    /// What the process holds of it (0 for a queue depth), and what the end needs.
    pub(crate) held: u32,
    pub(crate) need: u64,
}

/// Whether `cost` fits NICs with these limits and holdings (one per rail); the first limit
/// it does not fit where not.
fn check(cost: &EndCost, nics: &[(DeviceLimits, Held)]) -> std::result::Result<(), Short> {
    for (rail, (l, h)) in nics.iter().enumerate().take(cost.rails) {
        let short = |limit, value, held, need: u64| Short {
            rail,
            limit,
            value,
            held,
            need,
        };
        let wrs = cost.first_send_wr.max(cost.send_wr).max(cost.recv_wr);
        let counts = [
            ("max_qp", l.max_qp, h.qps, cost.all_qps_on(rail) as u64),
            ("max_cq", l.max_cq, h.cqs, 1),
            ("max_mr", l.max_mr, h.mrs, u64::from(cost.mrs)),
            ("max_qp_wr", l.max_qp_wr, 0, u64::from(wrs)),
            ("max_cqe", l.max_cqe, 0, cost.cqes_on(rail) as u64),
        ];
        for (limit, value, held, need) in counts {
            if u64::from(held) + need > u64::from(value) {
                return Err(short(limit, value, held, need));
            }
        }
    }
    Ok(())
}

/// The most data QPs, from `cost.qps` down to `least`, with which `cost` fits; the limit that
/// `cost.qps` itself does not fit alongside (None: it fits). `Err`: not even `least` fits.
pub(crate) fn fit(
    cost: &EndCost,
    least: usize,
    nics: &[(DeviceLimits, Held)],
) -> std::result::Result<(usize, Option<Short>), Short> {
    let first = match check(cost, nics) {
        Ok(()) => return Ok((cost.qps, None)),
        Err(s) => s,
    };
    let mut last = first;
    for qps in (least.min(cost.qps)..cost.qps).rev() {
        match check(&EndCost { qps, ..*cost }, nics) {
            Ok(()) => return Ok((qps, Some(first))),
            Err(s) => last = s,
        }
    }
    Err(last)
}

/// Whether a connection of this process was given fewer QPs already (said once as a WARN).
static CUT_BACK: AtomicBool = AtomicBool::new(false);

/// How many data QPs this end of a connection with `peer` makes on `nics` (the rails of
/// `cost`), fitted to their limits as [`fit`] does; the first connection cut back is a WARN,
/// later ones INFO. An error when not even `least` fits.
pub(crate) fn fit_to<N: Nic>(
    nics: &[Arc<N>],
    cost: &EndCost,
    least: usize,
    peer: &str,
) -> Result<usize> {
    let state: Vec<(DeviceLimits, Held)> = nics.iter().map(|n| (n.limits(), n.held())).collect();
    let name = |s: &Short| nics[s.rail].local().name.clone();
    match fit(cost, least, &state) {
        Ok((qps, None)) => Ok(qps),
        Ok((qps, Some(s))) => {
            let what = format!(
                "{}: {} is {} and this process holds {}: the connection with {peer} gets {qps} \
                 QPs instead of {} (NCCL_IB_QPS_PER_CONNECTION)",
                name(&s),
                s.limit,
                s.value,
                s.held,
                cost.qps
            );
            if CUT_BACK.swap(true, Ordering::Relaxed) {
                tracing::info!("{what}");
            } else {
                tracing::warn!("{what}; later connections cut back are logged at INFO");
            }
            Ok(qps)
        }
        Err(s) => Err(Error::device(format!(
            "cannot make the connection with {peer}: {} allows {} ({} = {}) and this process \
             holds {}, but the connection needs {} more even with {least} QP(s); fewer \
             connections (NCCL_MAX_NCHANNELS, NCCL_IB_QPS_PER_CONNECTION=1) or fewer ranks per \
             NIC",
            name(&s),
            s.value,
            s.limit,
            s.value,
            s.held,
            s.need
        ))),
    }
}

/// What one connection of `qps_per_connection` QPs costs on a single NIC with `limits` (a
/// sender with the default send depth, a receiver without GPUDirect flushes), for the info
/// command.
pub(crate) fn connection_cost(limits: &DeviceLimits, qps_per_connection: u32) -> ConnectionCost {
    let qps = (qps_per_connection as usize).clamp(1, MAX_QPS);
    let send = EndCost::sender(qps, 1, SENDER_SEND_DEPTH.min(limits.max_qp_wr));
    let recv = EndCost::receiver(qps, 1, 1, false);
    let (s, r) = (send.totals(), recv.totals());
    let per_pair = |limit: u32, a: u32, b: u32| limit / (a + b).max(1);
    ConnectionCost {
        qps: (s.qps, r.qps),
        cqs: (s.cqs, r.cqs),
        cqes: (send.cqes_on(0) as u32, recv.cqes_on(0) as u32),
        mrs: (s.mrs, r.mrs),
        send_wr: send.send_wr,
        recv_wr: recv.recv_wr,
        pairs: per_pair(limits.max_qp, s.qps, r.qps)
            .min(per_pair(limits.max_cq, s.cqs, r.cqs))
            .min(per_pair(limits.max_mr, s.mrs, r.mrs)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sender(qps: usize) -> EndCost {
        EndCost::sender(qps, 1, 63)
    }

    fn nic(max_qp: u32, qps: u32) -> (DeviceLimits, Held) {
        (
            DeviceLimits {
                max_qp,
                ..DeviceLimits::UNLIMITED
            },
            Held {
                qps,
                ..Held::default()
            },
        )
    }

    #[test]
    fn a_connection_that_fits_keeps_every_qp_it_asked_for() {
        assert_eq!(fit(&sender(8), 1, &[nic(1024, 0)]), Ok((8, None)));
        // 8 data QPs and one probe: exactly the last nine QPs of the device.
        assert_eq!(fit(&sender(8), 1, &[nic(1024, 1015)]), Ok((8, None)));
    }

    #[test]
    fn a_connection_short_of_qps_gets_as_many_as_fit_and_names_the_limit() {
        let (qps, short) = fit(&sender(8), 1, &[nic(1024, 1020)]).unwrap();
        // 1020 held: 4 left, one of them the probe's.
        assert_eq!(qps, 3);
        let s = short.unwrap();
        assert_eq!(
            (s.limit, s.value, s.held, s.need),
            ("max_qp", 1024, 1020, 9)
        );
    }

    #[test]
    fn not_even_one_qp_is_an_error_naming_the_limit() {
        let s = fit(&sender(8), 1, &[nic(1024, 1023)]).unwrap_err();
        // One data QP and its probe do not fit one free QP.
        assert_eq!(
            (s.limit, s.value, s.held, s.need),
            ("max_qp", 1024, 1023, 2)
        );
    }

    #[test]
    fn every_rail_of_a_fused_device_keeps_one_qp_at_least() {
        let cost = EndCost {
            rails: 2,
            peer_rails: 2,
            ..sender(16)
        };
        // Rail 1's NIC is nearly full: rail 1 holds QPs 1, 3, ...; the connection shrinks
        // until rail 1 fits (QPs 1 and 3 and its probe in 3 free), to 5 QPs.
        let (qps, _) = fit(&cost, 2, &[nic(1024, 0), nic(1024, 1021)]).unwrap();
        assert_eq!(qps, 5);
        assert!(fit(&cost, 2, &[nic(1024, 0), nic(1024, 1023)]).is_err());
    }

    #[test]
    fn queue_depths_and_cq_sizes_are_held_to_the_device() {
        let shallow = (
            DeviceLimits {
                max_qp_wr: 32,
                ..DeviceLimits::UNLIMITED
            },
            Held::default(),
        );
        let s = fit(&sender(1), 1, &[shallow]).unwrap_err();
        assert_eq!((s.limit, s.value), ("max_qp_wr", 32));
        // A sender's CQ holds 63 + 1 per data QP and 4 + 1 for its probe: 8 QPs need 517, 4
        // QPs 261.
        assert_eq!(sender(8).cqes_on(0), 517);
        let small_cq = (
            DeviceLimits {
                max_cqe: 300,
                ..DeviceLimits::UNLIMITED
            },
            Held::default(),
        );
        let (qps, s) = fit(&sender(8), 1, &[small_cq]).unwrap();
        assert_eq!(qps, 4);
        assert_eq!(s.unwrap().limit, "max_cqe");
    }

    #[test]
    fn cq_and_registration_limits_count_what_the_process_holds() {
        let full = |max_cq, cqs, max_mr, mrs| {
            (
                DeviceLimits {
                    max_cq,
                    max_mr,
                    ..DeviceLimits::UNLIMITED
                },
                Held { qps: 0, cqs, mrs },
            )
        };
        assert_eq!(fit(&sender(1), 1, &[full(10, 9, 10, 8)]), Ok((1, None)));
        assert_eq!(
            fit(&sender(1), 1, &[full(10, 10, 10, 0)])
                .unwrap_err()
                .limit,
            "max_cq"
        );
        assert_eq!(
            fit(&sender(1), 1, &[full(10, 0, 10, 9)]).unwrap_err().limit,
            "max_mr"
        );
    }

    #[test]
    fn a_receivers_cq_holds_everything_its_queues_can_flush() {
        // QP 0: 63 clear-to-sends and 33 receives; another QP: 1 and 33; the probe 4 + 1;
        // the flush QP 32 + 1.
        let one = EndCost::receiver(1, 1, 1, true);
        assert_eq!(one.cqes_on(0), 63 + 33 + 5 + 33);
        let two = EndCost::receiver(2, 1, 1, false);
        assert_eq!(two.cqes_on(0), 63 + 33 + 1 + 33 + 5);
    }

    #[test]
    fn totals_count_data_probe_and_flush_qps_on_every_rail() {
        let cost = EndCost {
            rails: 2,
            peer_rails: 2,
            flush: true,
            ..sender(4)
        };
        // 4 data QPs, 2 probe paths (0,0) and (1,1), 2 flush QPs; a CQ and 2 MRs per rail.
        assert_eq!(
            cost.totals(),
            Held {
                qps: 8,
                cqs: 2,
                mrs: 4
            }
        );
    }
}
