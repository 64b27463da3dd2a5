//! Connection setup over `oob`. The connector creates its QPs, clear-to-send FIFO and size
//! records and sends them in its hello; the listener creates as many QPs, brings them to RTS
//! against the connector's and answers (with the split setting in effect: the receiver's);
//! the connector brings its QPs up and sends `Ready`, and only then does `accept` return, so
//! the receiver never writes into a QP that is not ready. Nothing here blocks.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use super::cq::CqPoller;
use super::recv::{RecvState, VerbsRecvComm};
use super::send::{SendState, VerbsSendComm, PROBE_AT};
use super::wire::{ConnInfo, CtsEntry, MAX_INLINE, SLOTS};
use crate::error::{Error, Result};
use crate::oob::{Channel, Handle, Hello, Listener, MsgKind, Timeouts, TransportKind};
use crate::transport::{Connecting, Listening, RecvEndpoint, SendEndpoint, MAX_RECVS};
use crate::verbs::device::{mtu_bytes, LINK_LAYER_ETHERNET};
use crate::verbs::dma::DmaBuffer;
use crate::verbs::nic::{MemoryRegion, Nic, QueuePair};
use crate::verbs::resources::{QpPath, RemoteQp};

/// What a connection is set up with (settings, resolved per device).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConnParams {
    /// `NCCL_IB_QPS_PER_CONNECTION` (the connector's is used).
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
    /// Create the loopback flush QP (GPUDirect in use, or forced).
    pub(crate) flush: bool,
    /// Bounds on reaching the peer's listener and on a silent peer.
    pub(crate) timeouts: Timeouts,
    /// `NCCL_ERDMA_CTS_BATCH`: clear-to-send entries the receiver may hold back.
    pub(crate) cts_batch: u32,
    /// `NCCL_ERDMA_WORK_TIMEOUT_S`: posted work without completion for this long fails the
    /// comm (None: never).
    pub(crate) work_timeout: Option<Duration>,
}

/// A DMA buffer of `len` elements registered on `nic`.
fn dma<T: Copy, N: Nic>(nic: &N, len: usize) -> Result<DmaBuffer<T, N::Mr>> {
    DmaBuffer::new(len, |addr, bytes| {
        let mr = nic.register(addr, bytes)?;
        let (lkey, rkey) = (mr.lkey(), mr.rkey());
        Ok((mr, lkey, rkey))
    })
}

fn local_info<N: Nic>(nic: &N, qps: &[N::Qp], addr: u64, rkey: u32, p: &ConnParams) -> ConnInfo {
    let l = nic.local();
    ConnInfo {
        link_layer: l.link_layer,
        mtu: l.active_mtu as u8,
        port: l.port,
        gid_index: l.gid_index,
        lid: l.lid,
        gid: l.gid,
        addr,
        rkey,
        device: l.name.clone(),
        tc: p.traffic_class,
        sl: p.sl,
        split: p.split_data,
        qps: qps.iter().map(|q| (q.qpn(), q.psn())).collect(),
    }
}

/// The path towards `remote`: the smaller of the two ports' MTUs (so peers with different
/// MTUs talk at the smaller one), `tc`/`sl` as agreed.
fn path<N: Nic>(nic: &N, remote: &ConnInfo, p: &ConnParams, tc: u8, sl: u8) -> QpPath {
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

fn check_link<N: Nic>(nic: &N, remote: &ConnInfo, peer: SocketAddr) -> Result<()> {
    let l = nic.local();
    if remote.link_layer != l.link_layer {
        let name = |layer: u8| {
            if layer == LINK_LAYER_ETHERNET {
                "Ethernet (RoCE)"
            } else {
                "InfiniBand"
            }
        };
        return Err(Error::Usage(format!(
            "link layer mismatch: local device {} is {}, peer {peer} device {} is {}; pick \
             devices of one kind on every node with NCCL_IB_HCA",
            l.name,
            name(l.link_layer),
            remote.device,
            name(remote.link_layer)
        )));
    }
    let (ours, theirs) = (l.active_mtu, u32::from(remote.mtu));
    if ours != theirs {
        tracing::info!(
            "{} (MTU {}) and peer {peer} {} (MTU {}) differ: the connection uses {} bytes",
            l.name,
            mtu_bytes(ours),
            remote.device,
            mtu_bytes(theirs),
            mtu_bytes(ours.min(theirs))
        );
    }
    Ok(())
}

fn connect_qps<N: Nic>(nic: &N, qps: &[N::Qp], remote: &ConnInfo, path: &QpPath) -> Result<()> {
    for (qp, (qpn, psn)) in qps.iter().zip(&remote.qps) {
        let r = RemoteQp {
            qpn: *qpn,
            psn: *psn,
            gid: remote.gid,
            lid: remote.lid,
        };
        nic.connect_qp(qp, path, &r)?;
    }
    Ok(())
}

fn create_qps<N: Nic>(
    nic: &N,
    cq: &N::Cq,
    n: usize,
    send_wr: u32,
    recv_wr: u32,
) -> Result<Vec<N::Qp>> {
    (0..n)
        .map(|_| nic.create_qp(cq, send_wr, recv_wr, MAX_INLINE))
        .collect()
}

/// What the connector made before the listener answered.
struct Unconnected<N: Nic> {
    qps: Vec<N::Qp>,
    fifo: DmaBuffer<CtsEntry, N::Mr>,
    sizes_local: DmaBuffer<u32, N::Mr>,
    cq: N::Cq,
}

/// The connecting side, between NCCL's repeated `connect` calls.
pub(crate) struct VerbsConnecting<N: Nic> {
    chan: Channel,
    nic: Arc<N>,
    made: Option<Unconnected<N>>,
    sender: Option<SendState<N>>,
    params: ConnParams,
}

impl<N: Nic> VerbsConnecting<N> {
    /// Creates the sender's QPs and FIFO and starts the handshake with the listener.
    pub(crate) fn start(nic: &Arc<N>, handle: &Handle, params: ConnParams) -> Result<Self> {
        let nqps = params.qps_per_connection as usize;
        // Per QP: data writes (and probes) signaled once per slot.
        let cq = nic.create_cq(SLOTS * nqps * 2 + 16)?;
        let qps = create_qps(&**nic, &cq, nqps, (SLOTS * (MAX_RECVS + 2)) as u32, 1)?;
        let fifo = dma::<CtsEntry, N>(nic, SLOTS * MAX_RECVS)?;
        let sizes_local = dma::<u32, N>(nic, PROBE_AT + 2)?;
        let info = local_info(&**nic, &qps, fifo.addr(0), fifo.rkey(), &params);
        let mut chan = Channel::connect(handle.addr, params.timeouts)?;
        let hello = Hello {
            nonce: handle.nonce,
            transport: TransportKind::Verbs,
            payload: info.encode(),
        };
        chan.queue(MsgKind::Hello, &hello.encode());
        Ok(VerbsConnecting {
            chan,
            nic: Arc::clone(nic),
            made: Some(Unconnected {
                qps,
                fifo,
                sizes_local,
                cq,
            }),
            sender: None,
            params,
        })
    }

    /// One non-blocking step; the send comm once the listener is ready.
    pub(crate) fn step(&mut self) -> Result<Option<VerbsSendComm<N>>> {
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
            s.cq.watch(stream);
        }
        Ok(Some(VerbsSendComm::new(s)))
    }

    /// Brings the QPs up against the listener's answer.
    fn accepted(&mut self, m: crate::oob::Message) -> Result<SendState<N>> {
        let peer = self.chan.peer();
        match m.kind {
            MsgKind::Accept => {}
            MsgKind::Reject => {
                return Err(Error::Remote(format!(
                    "{peer} refused the connection: {}",
                    String::from_utf8_lossy(&m.payload)
                )))
            }
            k => {
                return Err(Error::Remote(format!(
                    "{peer} answered the hello with message type {k:?}"
                )))
            }
        }
        let remote = ConnInfo::decode(&m.payload)?;
        let nic = &*self.nic;
        check_link(nic, &remote, peer)?;
        let made = self.made.take().ok_or_else(|| {
            Error::Misuse(format!("connect to {peer} polled again after it failed"))
        })?;
        if remote.qps.len() != made.qps.len() {
            return Err(Error::Remote(format!(
                "{peer} answered with {} QPs for our {}",
                remote.qps.len(),
                made.qps.len()
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
        let p = path(
            nic,
            &remote,
            &self.params,
            self.params.traffic_class,
            self.params.sl,
        );
        connect_qps(nic, &made.qps, &remote, &p)?;
        Ok(SendState::new(
            made.qps,
            made.fifo,
            made.sizes_local,
            CqPoller::new(made.cq, self.params.work_timeout),
            Arc::clone(&self.nic),
            (remote.addr, remote.rkey),
            remote.split,
            format!("{peer} ({})", remote.device),
        ))
    }
}

impl<N: Nic> Connecting for VerbsConnecting<N> {
    fn poll(&mut self) -> Result<Option<Box<dyn SendEndpoint>>> {
        Ok(self.step()?.map(|c| Box::new(c) as Box<dyn SendEndpoint>))
    }
}

/// The listening side of one connection.
pub(crate) struct VerbsListen<N: Nic> {
    listener: Listener,
    nic: Arc<N>,
    params: ConnParams,
    accepting: Option<(Channel, RecvState<N>)>,
}

impl<N: Nic> VerbsListen<N> {
    /// Binds the bootstrap listener for `nic`.
    pub(crate) fn bind(ip: std::net::IpAddr, nic: &Arc<N>, params: ConnParams) -> Result<Self> {
        Ok(VerbsListen {
            listener: Listener::bind(ip, TransportKind::Verbs, params.timeouts)?,
            nic: Arc::clone(nic),
            params,
            accepting: None,
        })
    }

    /// One non-blocking step of `accept`.
    pub(crate) fn step(&mut self) -> Result<Option<VerbsRecvComm<N>>> {
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
            let info = local_info(
                &*self.nic,
                &state.qps,
                state.sizes_record.addr(0),
                state.sizes_record.rkey(),
                &answer,
            );
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
                state.cq.watch(chan.into_stream());
                Ok(Some(VerbsRecvComm::new(state)))
            }
            Some(m) => Err(Error::Remote(format!(
                "{} sent message type {:?} instead of ready",
                chan.peer(),
                m.kind
            ))),
        }
    }

    fn setup_receiver(&self, remote: &ConnInfo, peer: SocketAddr) -> Result<RecvState<N>> {
        let nic = &*self.nic;
        check_link(nic, remote, peer)?;
        let nqps = remote.qps.len();
        // Per QP: a receive per slot; and the signaled clear-to-sends, flushes and probes.
        let cq = nic.create_cq(SLOTS * (nqps + 2) + 16)?;
        let qps = create_qps(nic, &cq, nqps, (SLOTS * 2) as u32, SLOTS as u32 + 1)?;
        // The receiver uses the sender's traffic class and service level, as NCCL does.
        let p = path(nic, remote, &self.params, remote.tc, remote.sl);
        connect_qps(nic, &qps, remote, &p)?;
        let flush_qp = if self.params.flush {
            let qp = create_qps(nic, &cq, 1, SLOTS as u32, 1)?.remove(0);
            let l = nic.local();
            let own = RemoteQp {
                qpn: qp.qpn(),
                psn: qp.psn(),
                gid: l.gid,
                lid: l.lid,
            };
            let mut own_path = p;
            own_path.mtu = l.active_mtu;
            nic.connect_qp(&qp, &own_path, &own)?;
            Some(qp)
        } else {
            None
        };
        if remote.split != self.params.split_data {
            tracing::info!(
                "NCCL_IB_SPLIT_DATA_ON_QPS is {} here and {} at the sender {peer}: the \
                 connection uses this receiver's",
                u8::from(self.params.split_data),
                u8::from(remote.split)
            );
        }
        Ok(RecvState::new(
            qps,
            flush_qp,
            dma(nic, SLOTS * MAX_RECVS)?,
            dma(nic, SLOTS * MAX_RECVS)?,
            dma(nic, 2)?,
            CqPoller::new(cq, self.params.work_timeout),
            Arc::clone(&self.nic),
            (remote.addr, remote.rkey),
            self.params.split_data,
            self.params.cts_batch,
            format!("{peer} ({})", remote.device),
        ))
    }
}

impl<N: Nic> Listening for VerbsListen<N> {
    fn handle(&self) -> &Handle {
        self.listener.handle()
    }

    fn poll_accept(&mut self) -> Result<Option<Box<dyn RecvEndpoint>>> {
        Ok(self.step()?.map(|c| Box::new(c) as Box<dyn RecvEndpoint>))
    }
}
