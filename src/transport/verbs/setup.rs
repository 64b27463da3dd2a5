//! Connection setup over `oob`. The connector creates its QPs (`NCCL_IB_QPS_PER_CONNECTION`
//! per rail, dealt over its rails), clear-to-send FIFO and size records and sends them in its
//! hello; the listener creates as many QPs over its own rails, brings them to RTS against the
//! connector's and answers (with the split setting in effect: the receiver's); the connector
//! brings its QPs up and sends `Ready`, and only then does `accept` return, so the receiver
//! never writes into a QP that is not ready. QP `q` of each end is on rail `q % rails` of
//! that end, so ends with different rail counts still pair every QP. Nothing here blocks.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use super::cq::CqPoller;
use super::rail::{locate, Rail};
use super::recv::{RecvState, VerbsReceiver, RECEIVER_SEND_DEPTH};
use super::send::{SendState, VerbsSender, PROBE_AT};
use super::wire::{ConnInfo, CtsEntry, QpPlan, RailInfo, MAX_INLINE, MAX_QPS, SLOTS};
use crate::error::{Error, Result};
use crate::oob::{self, Channel, Handle, Hello, Message, MsgKind, Timeouts, TransportKind};
use crate::transport::{CommKeys, Connector, Listener, MAX_RAILS, MAX_RECVS};
use crate::verbs::device::{mtu_bytes, VerbsDevice, LINK_LAYER_ETHERNET};
use crate::verbs::dma::DmaBuffer;
use crate::verbs::nic::{LocalPort, MemoryRegion, Nic, QueuePair};
use crate::verbs::resources::{QpPath, RemoteQp};

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
}

/// A DMA buffer of `len` elements registered on every NIC of `nics`.
fn dma<T: Copy, N: Nic>(nics: &[Arc<N>], len: usize) -> Result<DmaBuffer<T, N::Mr>> {
    DmaBuffer::new(len, nics.len(), |i, addr, bytes| {
        let mr = nics[i].register(addr, bytes)?;
        let (lkey, rkey) = (mr.lkey(), mr.rkey());
        Ok((mr, lkey, rkey))
    })
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
fn local_info<N: Nic>(
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
fn check_links<N: Nic>(rails: &[Rail<N>], remote: &ConnInfo, peer: SocketAddr) -> Result<()> {
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
fn connect_qps<N: Nic>(
    rails: &[Rail<N>],
    remote: &ConnInfo,
    p: &ConnParams,
    tc: u8,
    sl: u8,
) -> Result<()> {
    for (q, (qpn, psn)) in remote.qps.iter().enumerate() {
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

/// The rails of a connection of `nqps` QPs over `nics`: per rail a CQ with room for
/// `cqes_per_qp` completions per QP (plus the flush QP's), its QPs, and a loopback flush QP
/// when `flush`.
fn make_rails<N: Nic>(
    nics: &[Arc<N>],
    nqps: usize,
    (send_wr, recv_wr, cqes_per_qp): (u32, u32, usize),
    flush: bool,
    p: &ConnParams,
) -> Result<Vec<Rail<N>>> {
    nics.iter()
        .enumerate()
        .map(|(r, nic)| {
            let mine = (0..nqps).filter(|q| q % nics.len() == r).count();
            let cq = nic.create_cq(cqes_per_qp * (mine + 1) + 16)?;
            let qps = (0..mine)
                .map(|_| nic.create_qp(&cq, send_wr, recv_wr, MAX_INLINE))
                .collect::<Result<Vec<_>>>()?;
            let flush_qp = if flush {
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
                CqPoller::new(cq, p.work_timeout),
                qps,
                flush_qp,
            ))
        })
        .collect()
}

/// Tells each of `rails` the paths its QPs take to the peer's rails (`remote`'s), for the
/// watchdog's probes.
fn learn_paths<N: Nic>(rails: &mut [Rail<N>], remote: &ConnInfo) {
    let names: Vec<String> = remote.rails.iter().map(|r| r.device.clone()).collect();
    let count = rails.len();
    for (i, rail) in rails.iter_mut().enumerate() {
        rail.learn_paths(i, count, &names);
    }
}

/// The remote keys of a `ConnInfo`'s memory, by rail.
fn rkeys(info: &ConnInfo) -> [u32; MAX_RAILS] {
    let mut keys = [0; MAX_RAILS];
    for (k, r) in keys.iter_mut().zip(&info.rails) {
        *k = r.rkey;
    }
    keys
}

/// What the connector made before the listener answered.
struct Unconnected<N: Nic> {
    rails: Vec<Rail<N>>,
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
    /// Creates the sender's QPs (over the rails `nics`) and FIFO and starts the handshake
    /// with the listener.
    pub(crate) fn start(
        nics: &[Arc<N>],
        handle: &Handle,
        params: ConnParams,
        keys: CommKeys,
    ) -> Result<Self> {
        let nqps = (params.qps_per_connection as usize * nics.len()).clamp(nics.len(), MAX_QPS);
        // Per QP: data writes (and probes), one signaled per slot.
        let sizing = ((SLOTS * (MAX_RECVS + 2)) as u32, 1, SLOTS * 2);
        let rails = make_rails(nics, nqps, sizing, false, &params)?;
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
            self.sender = Some(self.accepted(m)?);
            self.chan.queue(MsgKind::Ready, &[]);
            if !self.chan.flush()? {
                return Ok(None);
            }
        }
        let Some(mut s) = self.sender.take() else {
            return Ok(None);
        };
        if let Some(stream) = self.chan.try_clone_stream() {
            s.rails[0].cq.watch(stream);
        }
        Ok(Some(VerbsSender::new(s)))
    }

    /// Brings the QPs up against the listener's answer.
    fn accepted(&mut self, m: Message) -> Result<SendState<N>> {
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
        let nqps: usize = made.rails.iter().map(|r| r.qps.len()).sum();
        if remote.qps.len() != nqps {
            return Err(Error::remote(format!(
                "{peer} answered with {} QPs for our {nqps}",
                remote.qps.len(),
            )));
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
        learn_paths(&mut made.rails, &remote);
        let plan = QpPlan {
            nqps,
            rails: made.rails.len(),
            split: remote.split,
        };
        Ok(SendState::new(
            made.rails,
            Arc::new(made.fifo),
            made.sizes_local,
            (remote.addr, rkeys(&remote), remote.rails.len()),
            plan,
            format!("{peer} ({})", remote.devices()),
            made.keys,
        ))
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
    params: ConnParams,
    /// For the receiving end, once a peer connects.
    keys: Option<CommKeys>,
    accepting: Option<(Channel, RecvState<N>)>,
}

impl<N: Nic> VerbsListener<N> {
    /// Binds the bootstrap listener for a device over the rails `nics`.
    pub(crate) fn bind(
        ip: std::net::IpAddr,
        nics: &[Arc<N>],
        params: ConnParams,
        keys: CommKeys,
    ) -> Result<Self> {
        Ok(VerbsListener {
            listener: oob::Listener::bind(ip, TransportKind::Verbs, params.timeouts)?,
            nics: nics.to_vec(),
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
            let state = match self.setup_receiver(&remote, peer) {
                Ok(s) => s,
                Err(e) => {
                    chan.queue(MsgKind::Reject, e.to_string().as_bytes());
                    let _ = chan.flush();
                    return Err(e);
                }
            };
            // The answer carries the traffic class and service level the connector asked
            // for, and the split setting this side uses.
            let answer = ConnParams {
                traffic_class: remote.tc,
                sl: remote.sl,
                ..self.params
            };
            let records = &state.sizes_record;
            let info = local_info(&state.rails, records.addr(0), |r| records.rkey(r), &answer);
            chan.queue(MsgKind::Accept, &info.encode());
            self.accepting = Some((chan, state));
        }
        let Some((chan, _)) = self.accepting.as_mut() else {
            return Ok(None);
        };
        if !chan.flush()? {
            return Ok(None);
        }
        match chan.poll_recv()? {
            None => Ok(None),
            Some(m) if m.kind == MsgKind::Ready => {
                let Some((chan, mut state)) = self.accepting.take() else {
                    return Ok(None);
                };
                state.rails[0].cq.watch(chan.into_stream());
                Ok(Some(VerbsReceiver::new(state)))
            }
            Some(m) => Err(Error::remote(format!(
                "{} sent message type {:?} instead of ready",
                chan.peer(),
                m.kind
            ))),
        }
    }

    fn setup_receiver(&mut self, remote: &ConnInfo, peer: SocketAddr) -> Result<RecvState<N>> {
        let nqps = remote.qps.len();
        // Every rail used carries at least one QP.
        let nics = &self.nics[..self.nics.len().min(nqps)];
        // Per QP: a receive per slot; and the signaled clear-to-sends, flushes and probes.
        let sizing = (RECEIVER_SEND_DEPTH, SLOTS as u32 + 1, SLOTS + 2);
        let mut rails = make_rails(nics, nqps, sizing, self.params.flush, &self.params)?;
        check_links(&rails, remote, peer)?;
        learn_paths(&mut rails, remote);
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
        Ok(RecvState::new(
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
        ))
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
