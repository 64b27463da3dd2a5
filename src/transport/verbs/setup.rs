//! Connection setup over `oob`. The connector creates its QPs (`NCCL_IB_QPS_PER_CONNECTION`
//! per rail, dealt over its rails), clear-to-send FIFO and size records and sends them in its
//! hello; the listener creates as many QPs over its own rails, brings them to RTS against the
//! connector's and answers (with the split setting in effect: the receiver's); the connector
//! brings its QPs up and sends `Ready`, and only then does `accept` return, so the receiver
//! never writes into a QP that is not ready. QP `q` of each end is on rail `q % rails` of
//! that end, so ends with different rail counts still pair every QP. Nothing here blocks.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use super::budget::{self, EndCost};
use super::cq::CqPoller;
use super::failover::Mobility;
use super::rail::{locate, Rail};
use super::recv::{RecvState, VerbsReceiver};
use super::send::{SendState, VerbsSender, PROBE_AT};
use super::wire::{
    decode_qps, encode_qps, paths, ConnInfo, CtsEntry, QpPlan, RailInfo, MAX_INLINE, MAX_QPS, SLOTS,
};
use crate::error::{Error, Result};
use crate::oob::{self, Channel, Handle, Hello, Message, MsgKind, Timeouts, TransportKind};
use crate::transport::{CommKeys, Connector, Listener, MAX_RAILS, MAX_RECVS};
use crate::verbs::device::{mtu_bytes, VerbsDevice, LINK_LAYER_ETHERNET};
use crate::verbs::dma::DmaBuffer;
use crate::verbs::nic::{LocalPort, MemoryRegion, Nic, QueuePair};
use crate::verbs::qp::{QpPath, RemoteQp};

/// What a connection is set up with (settings, resolved per device).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConnParams {
    /// `NCCL_IB_QPS_PER_CONNECTION`, per rail (the connector's is used).
    pub(crate) qps_per_connection: u32,
    /// `NCCL_IB_SPLIT_DATA_ON_QPS` (the receiver's is used).
    pub(crate) split_data: bool,
    /// `NCCL_IB_TIMEOUT`.
    pub(crate) timeout: u8,
    /// `NCCL_IB_RETRY_CNT`.
    pub(crate) retry_cnt: u8,
    /// `NCCL_IB_TC` (or the communicator's traffic class), 0 when unset.
    pub(crate) traffic_class: u8,
    /// `NCCL_IB_SL`, 0 when unset.
    pub(crate) sl: u8,
    /// Create the loopback flush QPs (GPUDirect in use, or forced).
    pub(crate) flush: bool,
    /// Bounds on reaching the peer's listener and on a silent peer.
    pub(crate) timeouts: Timeouts,
    /// `NCCL_ERDMA_CTS_BATCH`: clear-to-send entries the receiver may hold back.
    pub(crate) cts_batch: u32,
    /// `NCCL_ERDMA_WORK_TIMEOUT_S`: posted work without completion for this long fails the
    /// comm (None: never).
    pub(crate) work_timeout: Option<Duration>,
    /// `NCCL_IB_WQE_LATENCY_THRESHOLD_NS` (None: 0, off) and `NCCL_IB_WQE_LATENCY_REPORT`.
    pub(crate) wqe_latency: Option<(Duration, bool)>,
    /// The send queue depth of a sender's QPs ([`super::send::SENDER_SEND_DEPTH`]; tests make it
    /// small):
    /// a send that does not fit waits for room ("not now").
    pub(crate) send_depth: u32,
    /// `NCCL_ERDMA_FAILOVER` in effect for this connection (another NIC can carry it): how
    /// long a path's probe may go unanswered before the connection moves; None: off.
    pub(crate) failover: Option<Duration>,
}

/// A DMA buffer of `len` elements registered on every NIC of `nics`.
pub(super) fn dma<T: Copy, N: Nic>(nics: &[Arc<N>], len: usize) -> Result<DmaBuffer<T, N::Mr>> {
    DmaBuffer::new(len, nics.len(), register_on(nics))
}

/// A DMA buffer's registration `i` of `addr..addr+bytes`: on `nics[i]`, with its keys.
pub(super) fn register_on<N: Nic>(
    nics: &[Arc<N>],
) -> impl Fn(usize, usize, usize) -> Result<(N::Mr, u32, u32)> + Copy + '_ {
    |i, addr, bytes| {
        let mr = nics[i].register(addr, bytes)?;
        let (lkey, rkey) = (mr.lkey(), mr.rkey());
        Ok((mr, lkey, rkey))
    }
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

/// This end of a connection as the other end needs it: `addr` and its key on each rail.
pub(super) fn local_info<N: Nic>(
    rails: &[Rail<N>],
    addr: u64,
    rkey: impl Fn(usize) -> u32,
    p: &ConnParams,
) -> ConnInfo {
    let info = rails
        .iter()
        .enumerate()
        .map(|(i, r)| rail_info(r.nic.local(), rkey(i)))
        .collect();
    let nqps: usize = rails.iter().map(|r| r.qps.len()).sum();
    let qps = (0..nqps)
        .map(|q| {
            let (r, i) = locate(q, rails.len());
            let qp = &rails[r].qps[i];
            (qp.qpn(), qp.psn())
        })
        .collect();
    ConnInfo {
        addr,
        tc: p.traffic_class,
        sl: p.sl,
        split: p.split_data,
        rails: info,
        qps,
        probes: Vec::new(),
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
pub(super) fn check_links<N: Nic>(
    rails: &[Rail<N>],
    remote: &ConnInfo,
    peer: impl std::fmt::Display,
) -> Result<()> {
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

/// Brings every QP of `rails` up against `remote` (QP `q` to the peer's QP `q`).
pub(super) fn connect_qps<N: Nic>(
    rails: &[Rail<N>],
    remote: &ConnInfo,
    p: &ConnParams,
    tc: u8,
    sl: u8,
) -> Result<()> {
    // A listener short of QPs makes fewer than the connector offered: its first ones.
    let ours: usize = rails.iter().map(|r| r.qps.len()).sum();
    for (q, (qpn, psn)) in remote.qps.iter().take(ours).enumerate() {
        let (r, i) = locate(q, rails.len());
        let rail = &rails[r];
        let theirs = &remote.rails[q % remote.rails.len()];
        let rq = RemoteQp {
            qpn: *qpn,
            psn: *psn,
            gid: theirs.gid,
            lid: theirs.lid,
        };
        rail.nic
            .connect_qp(&rail.qps[i], &path(&*rail.nic, theirs, p, tc, sl), &rq)?;
    }
    Ok(())
}

/// The rails of a connection's end over `nics` as `cost` describes it: per rail a CQ, its
/// data QPs and a loopback flush QP where `cost.flush` (probe QPs come later, per path).
pub(super) fn make_rails<N: Nic>(
    nics: &[Arc<N>],
    cost: &EndCost,
    p: &ConnParams,
) -> Result<Vec<Rail<N>>> {
    nics.iter()
        .enumerate()
        .map(|(r, nic)| {
            let cq = nic.create_cq(cost.cqes_on(r))?;
            let qps = (0..cost.qps_on(r))
                .map(|i| {
                    let send_wr = if r == 0 && i == 0 {
                        cost.first_send_wr
                    } else {
                        cost.send_wr
                    };
                    nic.create_qp(&cq, send_wr, cost.recv_wr, MAX_INLINE)
                })
                .collect::<Result<Vec<_>>>()?;
            let flush_qp = if cost.flush {
                let qp = nic.create_qp(&cq, SLOTS as u32, 1, MAX_INLINE)?;
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
            Ok(Rail::new(
                Arc::clone(nic),
                CqPoller::new(cq, p.work_timeout, probe_timeout(p.timeout), p.failover),
                qps,
                flush_qp,
            ))
        })
        .collect()
}

/// What the sending end of a connection of `qps` data QPs over `nics` makes, its send
/// queues as deep as `p` asks where the devices allow.
fn sender_cost<N: Nic>(nics: &[Arc<N>], qps: usize, p: &ConnParams) -> EndCost {
    let max_wr = nics
        .iter()
        .map(|n| n.limits().max_qp_wr)
        .min()
        .unwrap_or(u32::MAX);
    EndCost::sender(qps, nics.len(), p.send_depth.min(max_wr))
}

/// What the receiving end of the connection `remote` offers makes over (a prefix of) `nics`.
fn receiver_cost<N: Nic>(nics: &[Arc<N>], remote: &ConnInfo, p: &ConnParams) -> EndCost {
    let qps = remote.qps.len();
    EndCost::receiver(qps, nics.len().min(qps), remote.rails.len(), p.flush)
}

/// QP numbers and initial PSNs, one per QP.
type QpIds = Vec<(u32, u32)>;

/// The paths of a connection: (connector rail, listener rail) each.
type Paths = Vec<(usize, usize)>;

/// Which end of a connection this is, to read a path (connector rail, listener rail).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum End {
    Connector,
    Listener,
}

impl End {
    /// (this end's rail, the peer's rail) of `path`.
    fn sides(self, (connector, listener): (usize, usize)) -> (usize, usize) {
        match self {
            End::Connector => (connector, listener),
            End::Listener => (listener, connector),
        }
    }
}

/// Makes this end's probe QP of each of `paths` on its rail of the path, and tells the rail
/// the path (the peer's rail, named as `remote` names it). Returns, per path, (rail, the
/// path's index among the rail's), to connect them by.
pub(super) fn make_probes<N: Nic>(
    rails: &mut [Rail<N>],
    paths: &[(usize, usize)],
    end: End,
    remote: &ConnInfo,
) -> Result<Vec<(usize, usize)>> {
    paths
        .iter()
        .map(|&path| {
            let (mine, theirs) = end.sides(path);
            let rail = &mut rails[mine];
            // One probe in flight at a time, a read: no receive is ever consumed.
            let qp = rail.nic.create_qp(&rail.cq.cq, 4, 1, MAX_INLINE)?;
            let index = rail.add_path(qp, theirs, &remote.rails[theirs].device);
            Ok((mine, index))
        })
        .collect()
}

/// Times the signaled work of every QP of `rails` where `p` asks for it (once every QP,
/// probe QPs too, is made).
pub(super) fn time_work<N: Nic>(rails: &mut [Rail<N>], p: &ConnParams, peer: &str) {
    if let Some((threshold, report)) = p.wqe_latency {
        for rail in rails {
            rail.time_work(threshold, report, peer);
        }
    }
}

/// This end's probe QPs (`made`, per path), as the other end needs them.
pub(super) fn probe_qps<N: Nic>(rails: &[Rail<N>], made: &[(usize, usize)]) -> Vec<(u32, u32)> {
    made.iter()
        .map(|&(r, i)| {
            let qp = &rails[r].probe_qps[i];
            (qp.qpn(), qp.psn())
        })
        .collect()
}

/// Brings this end's probe QPs (`made`, per path) up against the peer's (`theirs`, per path).
#[allow(clippy::too_many_arguments)] // each QP's two ends, and the path's parameters
pub(super) fn connect_probes<N: Nic>(
    rails: &[Rail<N>],
    made: &[(usize, usize)],
    paths: &[(usize, usize)],
    end: End,
    theirs: &[(u32, u32)],
    remote: &ConnInfo,
    p: &ConnParams,
    (tc, sl): (u8, u8),
) -> Result<()> {
    for (k, &(r, i)) in made.iter().enumerate() {
        let rail = &rails[r];
        let their_rail = &remote.rails[end.sides(paths[k]).1];
        let (qpn, psn) = theirs[k];
        let rq = RemoteQp {
            qpn,
            psn,
            gid: their_rail.gid,
            lid: their_rail.lid,
        };
        let path = path(&*rail.nic, their_rail, p, tc, sl);
        rail.nic.connect_qp(&rail.probe_qps[i], &path, &rq)?;
    }
    Ok(())
}

/// How long a probe may go unanswered at least: eight of the device's retransmission timers
/// (`4.096 us * 2^NCCL_IB_TIMEOUT`), so that a probe whose packets a lossy link drops a few
/// times still comes back in time (the work timeout, where longer, bounds it otherwise).
fn probe_timeout(ib_timeout: u8) -> Duration {
    Duration::from_secs_f64(8.0 * 4.096e-6 * 2f64.powi(i32::from(ib_timeout)))
}

/// The remote keys of a `ConnInfo`'s memory, by rail.
pub(super) fn rkeys(info: &ConnInfo) -> [u32; MAX_RAILS] {
    let mut keys = [0; MAX_RAILS];
    for (k, r) in keys.iter_mut().zip(&info.rails) {
        *k = r.rkey;
    }
    keys
}

/// What the connector made before the listener answered.
struct Unconnected<N: Nic> {
    rails: Vec<Rail<N>>,
    /// What the rails were made as, and every NIC they may move to.
    cost: EndCost,
    nics: Vec<Arc<N>>,
    fifo: DmaBuffer<CtsEntry, N::Mr>,
    sizes_local: DmaBuffer<u32, N::Mr>,
    keys: CommKeys,
}

/// The connecting side, between NCCL's repeated `connect` calls.
pub(crate) struct VerbsConnector<N: Nic = VerbsDevice> {
    chan: Channel,
    made: Option<Unconnected<N>>,
    sender: Option<SendState<N>>,
    params: ConnParams,
}

impl<N: Nic> VerbsConnector<N> {
    /// Creates the sender's QPs (over the rails `nics`, which may move to `spares`) and FIFO
    /// and starts the handshake with the listener.
    pub(crate) fn start(
        (nics, spares): (&[Arc<N>], &[Arc<N>]),
        handle: &Handle,
        params: ConnParams,
        keys: CommKeys,
    ) -> Result<Self> {
        let want = (params.qps_per_connection as usize * nics.len()).clamp(nics.len(), MAX_QPS);
        let mut cost = sender_cost(nics, want, &params);
        // The peer's rails are not known yet: as many as ours, as NCCL pairs like devices.
        cost.qps = budget::fit_to(nics, &cost, nics.len(), &handle.addr.to_string())?;
        let rails = make_rails(nics, &cost, &params)?;
        let fifo = dma::<CtsEntry, N>(nics, SLOTS * MAX_RECVS)?;
        let sizes_local = dma::<u32, N>(nics, PROBE_AT + 2)?;
        let info = local_info(&rails, fifo.addr(0), |r| fifo.rkey(r), &params);
        let mut chan = Channel::connect(handle.addr, params.timeouts)?;
        let hello = Hello {
            nonce: handle.nonce,
            transport: TransportKind::Verbs,
            payload: info.encode(),
        };
        chan.queue(MsgKind::Hello, &hello.encode());
        Ok(VerbsConnector {
            chan,
            made: Some(Unconnected {
                rails,
                cost,
                nics: nics.iter().chain(spares).cloned().collect(),
                fifo,
                sizes_local,
                keys,
            }),
            sender: None,
            params,
        })
    }

    /// One non-blocking step; the sending end once the listener is ready.
    fn step(&mut self) -> Result<Option<VerbsSender<N>>> {
        if !self.chan.flush()? {
            return Ok(None);
        }
        if self.sender.is_none() {
            let Some(m) = self.chan.poll_recv()? else {
                return Ok(None);
            };
            let (sender, probes) = self.accepted(m)?;
            self.sender = Some(sender);
            self.chan.queue(MsgKind::Ready, &encode_qps(&probes));
            if !self.chan.flush()? {
                return Ok(None);
            }
        }
        let Some(mut s) = self.sender.take() else {
            return Ok(None);
        };
        if let Some(stream) = self.chan.try_clone_stream() {
            s.rails[0]
                .cq
                .watch(Channel::from_stream(stream, self.chan.peer()));
        }
        Ok(Some(VerbsSender::new(s)))
    }

    /// Brings the QPs up against the listener's answer; returns the sending end and this
    /// end's probe QPs, for the `Ready`.
    fn accepted(&mut self, m: Message) -> Result<(SendState<N>, QpIds)> {
        let peer = self.chan.peer();
        match m.kind {
            MsgKind::Accept => {}
            MsgKind::Reject => {
                return Err(Error::remote(format!(
                    "{peer} refused the connection: {}",
                    String::from_utf8_lossy(&m.payload)
                )))
            }
            k => {
                return Err(Error::remote(format!(
                    "{peer} answered the hello with message type {k:?}"
                )))
            }
        }
        let remote = ConnInfo::decode(&m.payload)?;
        let mut made = self.made.take().ok_or_else(|| {
            Error::misuse(format!("connect to {peer} polled again after it failed"))
        })?;
        check_links(&made.rails, &remote, peer)?;
        let offered: usize = made.rails.iter().map(|r| r.qps.len()).sum();
        let nqps = remote.qps.len();
        // The listener may take fewer (its device's limits), never fewer than our rails.
        if nqps > offered || nqps < made.rails.len() {
            return Err(Error::remote(format!(
                "{peer} answered with {nqps} QPs for our {offered}",
            )));
        }
        // What this end is now: the listener's QPs, dealt over our rails.
        let cost = EndCost {
            qps: nqps,
            peer_rails: remote.rails.len(),
            ..made.cost
        };
        for (r, rail) in made.rails.iter_mut().enumerate() {
            rail.qps.truncate(cost.qps_on(r));
        }
        if remote.split != self.params.split_data {
            tracing::info!(
                "NCCL_IB_SPLIT_DATA_ON_QPS is {} here and {} at the receiver {peer}: the \
                 connection uses the receiver's",
                u8::from(self.params.split_data),
                u8::from(remote.split)
            );
        }
        let p = &self.params;
        connect_qps(&made.rails, &remote, p, p.traffic_class, p.sl)?;
        let paths = paths(nqps, made.rails.len(), remote.rails.len());
        if remote.probes.len() != paths.len() {
            return Err(Error::remote(format!(
                "{peer} answered with {} probe QPs for {} paths",
                remote.probes.len(),
                paths.len()
            )));
        }
        let probes = make_probes(&mut made.rails, &paths, End::Connector, &remote)?;
        let peer = format!("{peer} ({})", remote.devices());
        time_work(&mut made.rails, p, &peer);
        let tc_sl = (p.traffic_class, p.sl);
        connect_probes(
            &made.rails,
            &probes,
            &paths,
            End::Connector,
            &remote.probes,
            &remote,
            p,
            tc_sl,
        )?;
        let ours = probe_qps(&made.rails, &probes);
        let plan = QpPlan {
            nqps,
            rails: made.rails.len(),
            split: remote.split,
        };
        let mobility = Mobility::new(made.nics, cost, *p);
        let state = SendState::new(
            made.rails,
            Arc::new(made.fifo),
            made.sizes_local,
            (remote.addr, rkeys(&remote), remote.rails.len()),
            plan,
            peer,
            made.keys,
            mobility,
        );
        Ok((state, ours))
    }
}

impl<N: Nic> Connector for VerbsConnector<N> {
    type Sender = VerbsSender<N>;

    fn poll(&mut self) -> Result<Option<VerbsSender<N>>> {
        self.step()
    }
}

/// The listening side of one connection.
pub(crate) struct VerbsListener<N: Nic = VerbsDevice> {
    listener: oob::Listener,
    nics: Vec<Arc<N>>,
    /// The NICs its connections may move to besides `nics`.
    spares: Vec<Arc<N>>,
    params: ConnParams,
    /// For the receiving end, once a peer connects.
    keys: Option<CommKeys>,
    accepting: Option<Accepting<N>>,
}

/// A listener's connection between its answer and the connector's `Ready`.
struct Accepting<N: Nic> {
    chan: Channel,
    state: RecvState<N>,
    /// The connector's setup, and the connection's paths with this end's probe QPs of each.
    remote: ConnInfo,
    paths: Vec<(usize, usize)>,
    probes: Vec<(usize, usize)>,
}

impl<N: Nic> VerbsListener<N> {
    /// Binds the bootstrap listener for a device over the rails `nics` (which may move to
    /// `spares`).
    pub(crate) fn bind(
        ip: std::net::IpAddr,
        (nics, spares): (&[Arc<N>], &[Arc<N>]),
        params: ConnParams,
        keys: CommKeys,
    ) -> Result<Self> {
        Ok(VerbsListener {
            listener: oob::Listener::bind(ip, TransportKind::Verbs, params.timeouts)?,
            nics: nics.to_vec(),
            spares: spares.to_vec(),
            params,
            keys: Some(keys),
            accepting: None,
        })
    }

    /// One non-blocking step of `accept`.
    fn step(&mut self) -> Result<Option<VerbsReceiver<N>>> {
        if self.accepting.is_none() {
            let Some((mut chan, hello)) = self.listener.poll_hello()? else {
                return Ok(None);
            };
            let peer = chan.peer();
            let remote = ConnInfo::decode(&hello.payload)?;
            let (mut state, paths) = match self.setup_receiver(&remote, peer) {
                Ok(s) => s,
                Err(e) => {
                    chan.queue(MsgKind::Reject, e.to_string().as_bytes());
                    let _ = chan.flush();
                    return Err(e);
                }
            };
            let probes = make_probes(&mut state.rails, &paths, End::Listener, &remote)?;
            time_work(&mut state.rails, &self.params, &state.peer);
            // The answer carries the traffic class and service level the connector asked
            // for, and the split setting this side uses.
            let answer = ConnParams {
                traffic_class: remote.tc,
                sl: remote.sl,
                ..self.params
            };
            let records = &state.sizes_record;
            let mut info = local_info(&state.rails, records.addr(0), |r| records.rkey(r), &answer);
            info.probes = probe_qps(&state.rails, &probes);
            chan.queue(MsgKind::Accept, &info.encode());
            self.accepting = Some(Accepting {
                chan,
                state,
                remote,
                paths,
                probes,
            });
        }
        let Some(a) = self.accepting.as_mut() else {
            return Ok(None);
        };
        if !a.chan.flush()? {
            return Ok(None);
        }
        match a.chan.poll_recv()? {
            None => Ok(None),
            Some(m) if m.kind == MsgKind::Ready => {
                let Some(mut a) = self.accepting.take() else {
                    return Ok(None);
                };
                // The connector's probe QPs: this end's come up against them.
                let theirs = decode_qps(&m.payload, a.paths.len())?;
                let tc_sl = (a.remote.tc, a.remote.sl);
                connect_probes(
                    &a.state.rails,
                    &a.probes,
                    &a.paths,
                    End::Listener,
                    &theirs,
                    &a.remote,
                    &self.params,
                    tc_sl,
                )?;
                a.state.rails[0].cq.watch(a.chan);
                Ok(Some(VerbsReceiver::new(a.state)))
            }
            Some(m) => Err(Error::remote(format!(
                "{} sent message type {:?} instead of ready",
                a.chan.peer(),
                m.kind
            ))),
        }
    }

    /// The receiving end against the connector's setup `remote`, and the connection's paths.
    fn setup_receiver(
        &mut self,
        remote: &ConnInfo,
        peer: SocketAddr,
    ) -> Result<(RecvState<N>, Paths)> {
        let mut cost = receiver_cost(&self.nics, remote, &self.params);
        // Fewer QPs where the device is short (the connector then uses as many), never fewer
        // than the connector's rails.
        let least = remote.rails.len();
        cost.qps = budget::fit_to(&self.nics, &cost, least, &peer.to_string())?;
        cost.rails = self.nics.len().min(cost.qps);
        let nqps = cost.qps;
        // Every rail used carries at least one QP.
        let nics = &self.nics[..cost.rails];
        let rails = make_rails(nics, &cost, &self.params)?;
        check_links(&rails, remote, peer)?;
        let paths = paths(nqps, remote.rails.len(), rails.len());
        // The receiver uses the sender's traffic class and service level, as NCCL does.
        connect_qps(&rails, remote, &self.params, remote.tc, remote.sl)?;
        if remote.split != self.params.split_data {
            tracing::info!(
                "NCCL_IB_SPLIT_DATA_ON_QPS is {} here and {} at the sender {peer}: the \
                 connection uses this receiver's",
                u8::from(self.params.split_data),
                u8::from(remote.split)
            );
        }
        let plan = QpPlan {
            nqps,
            rails: remote.rails.len(),
            split: self.params.split_data,
        };
        let nics_all = self.nics.iter().chain(&self.spares).cloned().collect();
        let mobility = Mobility::new(nics_all, cost, self.params);
        let state = RecvState::new(
            rails,
            dma(nics, SLOTS * MAX_RECVS)?,
            dma(nics, SLOTS * MAX_RECVS)?,
            dma(nics, 2)?,
            (remote.addr, rkeys(remote)),
            plan,
            self.params.cts_batch,
            format!("{peer} ({})", remote.devices()),
            self.keys.take().ok_or_else(|| {
                Error::misuse("accept polled again after it made its connection".into())
            })?,
            mobility,
        );
        Ok((state, paths))
    }
}

impl<N: Nic> Listener for VerbsListener<N> {
    type Receiver = VerbsReceiver<N>;

    fn handle(&self) -> &Handle {
        self.listener.handle()
    }

    fn poll_accept(&mut self) -> Result<Option<VerbsReceiver<N>>> {
        self.step()
    }
}
