//! The rails of one end of a connection, from nothing to carrying data: made, described,
//! joined to the peer's, probed. Setup (connect, accept) and both halves of a move go through
//! the same three steps, the offering end (the sender, which connects) and the answering end
//! (the receiver) taking turns over the bootstrap connection:
//! 1. [`Bringup::make`]: on each NIC a CQ, the data QPs and, for a receiver using GPUDirect,
//!    a loopback flush QP; [`Bringup::describe`] says what the peer needs (QPs, the NICs,
//!    the end's memory and its key on each). The offering end sends that (hello, `Offer`).
//! 2. [`Bringup::join`]: the QPs come up against the peer's description (QP `q` to the peer's
//!    QP `q`, at the smaller MTU), and a probe QP is made for each path. The answering end
//!    joins the offer and answers with its own description, probe QPs included; the offering
//!    end joins the answer and brings its probes up against the peer's at once.
//! 3. [`Probes::connect`]: the answering end brings its probes up against the offering end's,
//!    which come in its last message (`Ready`, `Resume`).
//!
//! QP `q` of each end is on rail `q % rails` of that end, so ends with different rail counts
//! still pair every QP.

use std::sync::Arc;

use super::budget::{EndCost, FLUSH_QUEUES, PROBE_QUEUES};
use super::cq::{CqPoller, Watchdog};
use super::fault::{Cause, Fault};
use super::profile::{probe_floor, ConnParams};
use super::rail::{ProbeTarget, Rail};
use super::wire::{locate, paths, ConnInfo, RailInfo, MAX_INLINE};
use crate::error::{Error, Result};
use crate::transport::MAX_RAILS;
use crate::verbs::device::{mtu_bytes, LINK_LAYER_ETHERNET};
use crate::verbs::dma::DmaBuffer;
use crate::verbs::nic::{LocalPort, MemoryRegion, Nic, QueuePair};
use crate::verbs::qp::{QpPath, RemoteQp};

/// A DMA buffer of `len` elements registered on every NIC of `nics`.
pub(crate) fn dma<T: Copy, N: Nic>(nics: &[Arc<N>], len: usize) -> Result<DmaBuffer<T, N::Mr>> {
    DmaBuffer::new(len, nics.len(), register_on(nics))
}

/// A DMA buffer's registration `i` of `addr..addr+bytes`: on `nics[i]`, with its keys.
pub(crate) fn register_on<N: Nic>(
    nics: &[Arc<N>],
) -> impl Fn(usize, usize, usize) -> Result<(N::Mr, u32, u32)> + Copy + '_ {
    |i, addr, bytes| {
        let mr = nics[i].register(addr, bytes)?;
        let (lkey, rkey) = (mr.lkey(), mr.rkey());
        Ok((mr, lkey, rkey))
    }
}

/// The remote keys of a `ConnInfo`'s memory, by rail.
pub(crate) fn rkeys(info: &ConnInfo) -> [u32; MAX_RAILS] {
    let mut keys = [0; MAX_RAILS];
    for (k, r) in keys.iter_mut().zip(&info.rails) {
        *k = r.rkey;
    }
    keys
}

/// Which end of the bring-up this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// The sender (the end that connects): it describes its rails first.
    Offers,
    /// The receiver: it joins the offer and answers.
    Answers,
}

impl Role {
    /// (this end's rail, the peer's rail) of `path`, which is (sender rail, receiver rail).
    fn sides(self, (offering, answering): (usize, usize)) -> (usize, usize) {
        match self {
            Role::Offers => (offering, answering),
            Role::Answers => (answering, offering),
        }
    }
}

/// One end's rails in bring-up (see the module doc).
pub(crate) struct Bringup<N: Nic> {
    rails: Vec<Rail<N>>,
    role: Role,
    p: ConnParams,
    /// The paths and their probe QPs, once joined.
    probes: Option<Probes>,
}

/// What bringing an end's probes up against the peer's takes: the peer's description, the
/// connection's paths (sender rail, receiver rail), and this end's probe QP of each (rail,
/// index among the rail's probe QPs).
pub(crate) struct Probes {
    remote: ConnInfo,
    paths: Vec<(usize, usize)>,
    made: Vec<(usize, usize)>,
    role: Role,
    p: ConnParams,
}

impl Probes {
    /// How many paths the connection has (the probe QPs the peer sends).
    pub(crate) fn paths(&self) -> usize {
        self.paths.len()
    }

    /// Brings this end's probe QPs, on `rails`, up against the peer's (`theirs`, per path;
    /// of `peer`, for messages).
    pub(crate) fn connect<N: Nic>(
        &self,
        rails: &[Rail<N>],
        theirs: &[(u32, u32)],
        peer: &str,
    ) -> std::result::Result<(), Fault> {
        if theirs.len() != self.paths.len() {
            return Err(protocol(format!(
                "{} probe QPs for {} paths",
                theirs.len(),
                self.paths.len()
            )));
        }
        let (tc, sl) = tc_sl(self.role, &self.p, Some(&self.remote));
        for (k, &(r, i)) in self.made.iter().enumerate() {
            let rail = &rails[r];
            let their_rail = &self.remote.rails[self.role.sides(self.paths[k]).1];
            let (qpn, psn) = theirs[k];
            let rq = RemoteQp {
                qpn,
                psn,
                gid: their_rail.gid,
                lid: their_rail.lid,
            };
            let path = path(&*rail.nic, their_rail, &self.p, tc, sl);
            join_qp(rail, &rail.probe_qps[i], (&path, &rq), peer)?;
        }
        Ok(())
    }
}

/// A fault of the peer's description: it cannot be joined.
fn protocol(msg: String) -> Fault {
    Fault::protocol(Error::remote(msg))
}

/// Brings `qp` of `rail` up against `peer`'s QP `rq` over `path`; where the NIC cannot (its
/// link down, no route to the peer), a fault of the rail that a move may mend.
fn join_qp<N: Nic>(
    rail: &Rail<N>,
    qp: &N::Qp,
    (path, rq): (&QpPath, &RemoteQp),
    peer: &str,
) -> std::result::Result<(), Fault> {
    rail.nic.connect_qp(qp, path, rq).map_err(|e| {
        let e = Error::remote(format!(
            "QP {} on {} could not be brought up towards peer {peer}'s QP {}: {e}",
            qp.qpn(),
            rail.name(),
            rq.qpn
        ));
        Fault::new(Cause::Unreachable, e).on_rail(rail.index)
    })
}

/// The traffic class and service level of a connection: the sender's, as NCCL's IB transport
/// uses them (the receiver takes them from the offer, `remote`).
fn tc_sl(role: Role, p: &ConnParams, remote: Option<&ConnInfo>) -> (u8, u8) {
    match (remote, role) {
        (Some(r), Role::Answers) => (r.tc, r.sl),
        _ => (p.traffic_class, p.sl),
    }
}

impl<N: Nic> Bringup<N> {
    /// The rails of an end over `nics` (one each) as `cost` describes them.
    pub(crate) fn make(nics: &[Arc<N>], cost: &EndCost, p: ConnParams, role: Role) -> Result<Self> {
        let rails = nics
            .iter()
            .enumerate()
            .map(|(r, nic)| make_rail(r, nic, cost, &p))
            .collect::<Result<Vec<_>>>()?;
        Ok(Bringup {
            rails,
            role,
            p,
            probes: None,
        })
    }

    /// The rails as they stand.
    pub(crate) fn rails(&self) -> &[Rail<N>] {
        &self.rails
    }

    /// Keeps the first `nqps` data QPs of the connection (the answering end made fewer).
    pub(crate) fn keep_qps(&mut self, nqps: usize) {
        let rails = self.rails.len();
        for (r, rail) in self.rails.iter_mut().enumerate() {
            let on = (0..nqps).filter(|&q| locate(q, rails).0 == r).count();
            rail.qps.truncate(on);
        }
    }

    /// This end as the peer needs it: its memory at `addr` (key `rkey(r)` on rail `r`), its
    /// QPs and, once joined, its probe QPs; `mobile`: it can move the connection.
    pub(crate) fn describe(
        &self,
        addr: u64,
        rkey: impl Fn(usize) -> u32,
        mobile: bool,
    ) -> ConnInfo {
        let rails = self
            .rails
            .iter()
            .enumerate()
            .map(|(i, r)| rail_info(r.nic.local(), rkey(i)))
            .collect();
        let nqps: usize = self.rails.iter().map(|r| r.qps.len()).sum();
        let qps = (0..nqps)
            .map(|q| {
                let (r, i) = locate(q, self.rails.len());
                let qp = &self.rails[r].qps[i];
                (qp.qpn(), qp.psn())
            })
            .collect();
        let (tc, sl) = tc_sl(self.role, &self.p, self.probes.as_ref().map(|p| &p.remote));
        ConnInfo {
            addr,
            tc,
            sl,
            split: self.p.split_data,
            mobile,
            rails,
            qps,
            probes: self.probe_qps(),
        }
    }

    /// Brings the QPs up against the peer's description `remote` (of `peer`, for messages),
    /// makes a probe QP for each path, aimed at the peer's memory from `landing` (this end's
    /// byte, and its key on each rail), and times the work where asked; the offering end's
    /// probes come up against the peer's here.
    pub(crate) fn join(
        &mut self,
        remote: &ConnInfo,
        landing: (u64, [u32; MAX_RAILS]),
        peer: &str,
    ) -> std::result::Result<(), Fault> {
        check_links(&self.rails, remote, peer).map_err(Fault::protocol)?;
        let (tc, sl) = tc_sl(self.role, &self.p, Some(remote));
        let ours: usize = self.rails.iter().map(|r| r.qps.len()).sum();
        if remote.qps.len() < ours {
            return Err(protocol(format!(
                "{peer} has {} QPs for this end's {ours}",
                remote.qps.len()
            )));
        }
        for (q, (qpn, psn)) in remote.qps.iter().take(ours).enumerate() {
            let (r, i) = locate(q, self.rails.len());
            let rail = &self.rails[r];
            let theirs = &remote.rails[q % remote.rails.len()];
            let rq = RemoteQp {
                qpn: *qpn,
                psn: *psn,
                gid: theirs.gid,
                lid: theirs.lid,
            };
            let path = path(&*rail.nic, theirs, &self.p, tc, sl);
            join_qp(rail, &rail.qps[i], (&path, &rq), peer)?;
        }
        let paths = match self.role {
            Role::Offers => paths(ours, self.rails.len(), remote.rails.len()),
            Role::Answers => paths(ours, remote.rails.len(), self.rails.len()),
        };
        let rkeys = rkeys(remote);
        for rail in &mut self.rails {
            rail.probe = ProbeTarget {
                local: (landing.0, landing.1[rail.index]),
                remote: remote.addr,
                rkeys,
            };
        }
        let made = self
            .make_probes(&paths, remote)
            .map_err(|e| Fault::new(Cause::Device, e))?;
        if let Some((threshold, report)) = self.p.wqe_latency {
            for rail in &mut self.rails {
                rail.time_work(threshold, report, peer);
            }
        }
        let probes = Probes {
            remote: remote.clone(),
            paths,
            made,
            role: self.role,
            p: self.p,
        };
        if self.role == Role::Offers {
            if remote.probes.len() != probes.paths() {
                return Err(protocol(format!(
                    "{peer} answered with {} probe QPs for {} paths",
                    remote.probes.len(),
                    probes.paths()
                )));
            }
            probes.connect(&self.rails, &remote.probes, peer)?;
        }
        self.probes = Some(probes);
        Ok(())
    }

    /// This end's probe QP of each path, for the peer (none before the join).
    pub(crate) fn probe_qps(&self) -> Vec<(u32, u32)> {
        let Some(probes) = &self.probes else {
            return Vec::new();
        };
        probes
            .made
            .iter()
            .map(|&(r, i)| {
                let qp = &self.rails[r].probe_qps[i];
                (qp.qpn(), qp.psn())
            })
            .collect()
    }

    /// The rails, made and joined (the offering end's probes up too).
    pub(crate) fn into_rails(self) -> Vec<Rail<N>> {
        self.rails
    }

    /// The answering end's rails, joined, and what bringing its probes up takes once the
    /// offering end's come ([`Probes::connect`]).
    pub(crate) fn into_parts(self) -> Result<(Vec<Rail<N>>, Probes)> {
        let probes = self
            .probes
            .ok_or_else(|| Error::misuse("a bring-up split before its join".into()))?;
        Ok((self.rails, probes))
    }

    /// Makes this end's probe QP of each of `paths` on its rail of the path, and tells the
    /// rail the path (the peer's rail, named as `remote` names it): per path, (rail, the
    /// path's index among the rail's).
    fn make_probes(
        &mut self,
        paths: &[(usize, usize)],
        remote: &ConnInfo,
    ) -> Result<Vec<(usize, usize)>> {
        let role = self.role;
        paths
            .iter()
            .map(|&path| {
                let (mine, theirs) = role.sides(path);
                let rail = &mut self.rails[mine];
                let (send, recv) = PROBE_QUEUES;
                let qp = rail.nic.create_qp(&rail.cq.cq, send, recv, MAX_INLINE)?;
                let index = rail.add_path(qp, theirs, &remote.rails[theirs].device);
                Ok((mine, index))
            })
            .collect()
    }
}

/// Rail `r` of an end over `nic` as `cost` describes it: a CQ with room for everything its
/// QPs hold, its data QPs and a loopback flush QP where `cost.flush` (probe QPs come at the
/// join, per path).
fn make_rail<N: Nic>(r: usize, nic: &Arc<N>, cost: &EndCost, p: &ConnParams) -> Result<Rail<N>> {
    let cq = nic.create_cq(cost.cqes_on(r))?;
    let rails = cost.rails;
    let qps = (0..cost.qps)
        .filter(|&q| locate(q, rails).0 == r)
        .map(|q| nic.create_qp(&cq, cost.send_wr_of(q), cost.recv_wr, MAX_INLINE))
        .collect::<Result<Vec<_>>>()?;
    let flush_qp = if cost.flush {
        let (send, recv) = FLUSH_QUEUES;
        let qp = nic.create_qp(&cq, send, recv, MAX_INLINE)?;
        let l = nic.local();
        let own = RemoteQp {
            qpn: qp.qpn(),
            psn: qp.psn(),
            gid: l.gid,
            lid: l.lid,
        };
        let me = rail_info(l, 0);
        nic.connect_qp(&qp, &path(&**nic, &me, p, 0, 0), &own)?;
        Some(qp)
    } else {
        None
    };
    let watchdog = Watchdog::new(p.work_timeout, probe_floor(p.timeout), p.failover);
    Ok(Rail::new(
        r,
        Arc::clone(nic),
        CqPoller::new(cq, watchdog),
        qps,
        flush_qp,
    ))
}

/// The NIC behind `port` as the other end needs it, with `rkey` for the connection's memory.
fn rail_info(port: &LocalPort, rkey: u32) -> RailInfo {
    RailInfo {
        link_layer: port.link_layer,
        mtu: port.active_mtu as u8,
        port: port.port,
        gid_index: port.gid_index,
        lid: port.lid,
        gid: port.gid,
        rkey,
        device: port.name.clone(),
    }
}

/// The path from `nic` towards `remote`: the smaller of the two ports' MTUs (so peers with
/// different MTUs talk at the smaller one), `tc`/`sl` as agreed.
fn path<N: Nic>(nic: &N, remote: &RailInfo, p: &ConnParams, tc: u8, sl: u8) -> QpPath {
    let l = nic.local();
    QpPath {
        port: l.port,
        roce: l.link_layer == LINK_LAYER_ETHERNET,
        gid_index: l.gid_index,
        mtu: u32::from(remote.mtu).min(l.active_mtu),
        traffic_class: tc,
        sl,
        timeout: p.timeout,
        retry_cnt: p.retry_cnt,
    }
}

/// Checks that every rail pair the QPs join can talk: same link layer; a differing MTU is
/// fine (the smaller is used) and said once.
fn check_links<N: Nic>(rails: &[Rail<N>], remote: &ConnInfo, peer: &str) -> Result<()> {
    let name = |layer: u8| {
        if layer == LINK_LAYER_ETHERNET {
            "Ethernet (RoCE)"
        } else {
            "InfiniBand"
        }
    };
    for q in 0..remote.qps.len().max(rails.len()) {
        let l = rails[q % rails.len()].nic.local();
        let r = &remote.rails[q % remote.rails.len()];
        if r.link_layer != l.link_layer {
            return Err(Error::usage(format!(
                "link layer mismatch: local device {} is {}, peer {peer} device {} is {}; pick \
                 devices of one kind on every node with NCCL_IB_HCA",
                l.name,
                name(l.link_layer),
                r.device,
                name(r.link_layer)
            )));
        }
        let (ours, theirs) = (l.active_mtu, u32::from(r.mtu));
        if ours != theirs && q < rails.len() {
            tracing::info!(
                "{} (MTU {}) and peer {peer} {} (MTU {}) differ: the connection uses {} bytes",
                l.name,
                mtu_bytes(ours),
                r.device,
                mtu_bytes(theirs),
                mtu_bytes(ours.min(theirs))
            );
        }
    }
    Ok(())
}
