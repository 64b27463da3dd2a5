//! Verbs transport: NCCL's p2p contract over RC QPs on eRDMA, RoCE or IB.
//!
//! Setup (over `oob`): the connector creates its QPs and CTS FIFO and sends them in its
//! hello; the listener creates its QPs, brings them to RTS against the connector's, and
//! answers; the connector brings its QPs up and sends `Ready`, and only then does `accept`
//! return, so the receiver never writes into a QP that is not ready.
//!
//! Data (receiver-driven, as NCCL's IB transport): `irecv` posts one receive per QP it will
//! use and RDMA-writes a clear-to-send entry per buffer (address, rkey, size, tag, count,
//! sequence) into the sender's FIFO slot, inline where it fits; `isend` returns NULL until
//! its slot's entries have landed, and once every send of the slot has matched a tag, posts
//! RDMA WRITEs ending in WRITE_WITH_IMM (the immediate is the size for a single receive; for
//! a grouped receive a final write carries all sizes into the receiver's size record).
//! With a clear-to-send batch above 1 (`NCCL_ERDMA_CTS_BATCH`, 8 on software devices) a
//! receiver that keeps testing its receives holds entries back while the sender still holds
//! two, and announces them in one write.
//! `NCCL_IB_QPS_PER_CONNECTION` QPs per connection: requests round-robin over them, or with
//! `NCCL_IB_SPLIT_DATA_ON_QPS=1` every message is split over all of them.
//! eRDMA limits are honoured: RC only, no SRQ, one SGE, inline <= 96 bytes, legacy verbs.

pub mod mr_cache;

use std::{
    io::Read,
    net::{SocketAddr, TcpStream},
    sync::Arc,
};

use parking_lot::Mutex;

use crate::abi::buffer::UserBuffer;
use crate::config::CTS_BATCH_SOFTWARE;
use crate::error::{Error, Result};
use crate::oob::{self, Channel, Handle, Hello, Listener, MsgKind, Timeouts, TransportKind};
use crate::transport::{not_in_flight, Completion, Failure, MAX_RECVS, MAX_REQUESTS};
use crate::verbs::device::{VerbsDevice, LINK_LAYER_ETHERNET};
use crate::verbs::dma::{
    DmaBuffer, SendChain, WcBatch, ACCESS_RDMA, WC_RECV_RDMA_WITH_IMM, WC_SUCCESS,
};
use crate::verbs::resources::{Cq, Qp, QpPath, RemoteQp};

pub use mr_cache::{CachedMr, MrCache};

const SLOTS: usize = MAX_REQUESTS;
/// Marks a send that was larger than its receive, in an immediate or a size record.
const TRUNCATED: u32 = u32::MAX;
/// Bytes per CTS entry; entries never straddle 32-byte boundaries.
const CTS_BYTES: usize = 32;
/// Alignment of the pieces a message is split into over several QPs (LL/LL128 lines).
const SPLIT_ALIGN: usize = 128;
/// eRDMA's inline limit, and enough for three CTS entries.
const MAX_INLINE: u32 = 96;

// wr_id kinds (high 32 bits); the low bits carry the slot.
const WR_RECV: u64 = 1 << 32;
const WR_CTS: u64 = 2 << 32;
const WR_SEND: u64 = 3 << 32;
const WR_FLUSH: u64 = 4 << 32;

/// One clear-to-send entry, as the receiver writes it into the sender's FIFO.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CtsEntry {
    addr: u64,
    size: u64,
    rkey: u32,
    tag: i32,
    nreqs: u32,
    /// Sequence number + 1 of the receive; 0 = never written.
    idx: u32,
}
const _: () = assert!(std::mem::size_of::<CtsEntry>() == CTS_BYTES);
/// Where `idx` lies in an entry: last, so the NIC places it after the fields it announces.
const CTS_IDX_OFFSET: usize = std::mem::offset_of!(CtsEntry, idx);
const _: () = assert!(CTS_IDX_OFFSET + 4 == CTS_BYTES);

/// Connection parameters taken from the configuration.
#[derive(Debug, Clone, Copy)]
pub struct VerbsParams {
    /// `NCCL_IB_QPS_PER_CONNECTION`.
    pub qps_per_connection: u32,
    /// `NCCL_IB_SPLIT_DATA_ON_QPS`.
    pub split_data: bool,
    /// `NCCL_IB_TIMEOUT`.
    pub timeout: u8,
    /// `NCCL_IB_RETRY_CNT`.
    pub retry_cnt: u8,
    /// `NCCL_IB_TC` (or the communicator's traffic class), 0 when unset.
    pub traffic_class: u8,
    /// `NCCL_IB_SL`, 0 when unset.
    pub sl: u8,
    /// `NCCL_IB_PKEY`.
    pub pkey_index: u16,
    /// Create the loopback flush QP (GPUDirect in use, or forced).
    pub flush: bool,
    /// Bounds on reaching the peer's listener and on a silent peer.
    pub timeouts: Timeouts,
    /// `NCCL_ERDMA_CTS_BATCH`: clear-to-send entries the receiver may hold back.
    pub cts_batch: u32,
}

/// The clear-to-send batch in effect on `dev`: `NCCL_ERDMA_CTS_BATCH` when set, else per
/// device. On a software device every post is a system call that runs the whole packet
/// path before it returns, so one write announcing several receives takes most
/// clear-to-sends out of a round trip (8-byte ping-pong on Soft-RoCE: ~2.1x -> ~1.2x
/// ib_write_lat). On hardware a post is a doorbell and the clear-to-send is off the
/// critical path, while holding entries back could leave the sender waiting: post each at
/// once, as NCCL's IB transport does.
pub fn cts_batch(setting: Option<u32>, dev: &VerbsDevice) -> u32 {
    setting.unwrap_or(if dev.is_software() {
        CTS_BATCH_SOFTWARE
    } else {
        1
    })
}

// ---------------------------------------------------------------------------------------
// Setup messages

/// What each side tells the other about its end of the connection.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ConnInfo {
    link_layer: u8,
    mtu: u8,
    port: u8,
    gid_index: u8,
    lid: u16,
    gid: [u8; 16],
    /// Sender: its CTS FIFO; receiver: its size records.
    addr: u64,
    rkey: u32,
    device: String,
    tc: u8,
    sl: u8,
    qps: Vec<(u32, u32)>,
}

const CONN_FIXED: usize = 72;

impl ConnInfo {
    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(CONN_FIXED + 8 * self.qps.len());
        v.extend_from_slice(&(self.qps.len() as u16).to_le_bytes());
        v.extend_from_slice(&[self.link_layer, self.mtu, self.port, self.gid_index]);
        v.extend_from_slice(&self.lid.to_le_bytes());
        v.extend_from_slice(&self.gid);
        v.extend_from_slice(&self.addr.to_le_bytes());
        v.extend_from_slice(&self.rkey.to_le_bytes());
        let mut name = [0u8; 32];
        let n = self.device.len().min(32);
        name[..n].copy_from_slice(&self.device.as_bytes()[..n]);
        v.extend_from_slice(&name);
        v.extend_from_slice(&[self.tc, self.sl, 0, 0]);
        for (qpn, psn) in &self.qps {
            v.extend_from_slice(&qpn.to_le_bytes());
            v.extend_from_slice(&psn.to_le_bytes());
        }
        v
    }

    fn decode(p: &[u8]) -> Result<Self> {
        let bad = |why: &str| Error::Remote(format!("invalid connection info: {why}"));
        if p.len() < CONN_FIXED {
            return Err(bad("too short"));
        }
        let nqps = u16::from_le_bytes([p[0], p[1]]) as usize;
        if nqps == 0 || nqps > 128 || p.len() != CONN_FIXED + 8 * nqps {
            return Err(bad(&format!("{nqps} QPs in {} bytes", p.len())));
        }
        let u32_at = |o: usize| u32::from_le_bytes([p[o], p[o + 1], p[o + 2], p[o + 3]]);
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&p[8..24]);
        let mut addr = [0u8; 8];
        addr.copy_from_slice(&p[24..32]);
        let name_end = p[36..68].iter().position(|b| *b == 0).unwrap_or(32);
        Ok(ConnInfo {
            link_layer: p[2],
            mtu: p[3],
            port: p[4],
            gid_index: p[5],
            lid: u16::from_le_bytes([p[6], p[7]]),
            gid,
            addr: u64::from_le_bytes(addr),
            rkey: u32_at(32),
            device: String::from_utf8_lossy(&p[36..36 + name_end]).into_owned(),
            tc: p[68],
            sl: p[69],
            qps: (0..nqps)
                .map(|i| (u32_at(CONN_FIXED + 8 * i), u32_at(CONN_FIXED + 8 * i + 4)))
                .collect(),
        })
    }
}

fn local_info(dev: &VerbsDevice, qps: &[Qp], addr: u64, rkey: u32, tc: u8, sl: u8) -> ConnInfo {
    ConnInfo {
        link_layer: dev.link_layer,
        mtu: dev.active_mtu as u8,
        port: dev.port,
        gid_index: dev.gid_index,
        lid: dev.lid,
        gid: dev.gid,
        addr,
        rkey,
        device: dev.name.clone(),
        tc,
        sl,
        qps: qps.iter().map(|q| (q.qpn(), q.psn)).collect(),
    }
}

fn path(dev: &VerbsDevice, remote: &ConnInfo, params: &VerbsParams, tc: u8, sl: u8) -> QpPath {
    QpPath {
        port: dev.port,
        roce: dev.link_layer == LINK_LAYER_ETHERNET,
        gid_index: dev.gid_index,
        mtu: u32::from(remote.mtu).min(dev.active_mtu),
        traffic_class: tc,
        sl,
        timeout: params.timeout,
        retry_cnt: params.retry_cnt,
        pkey_index: params.pkey_index,
    }
}

fn check_link(dev: &VerbsDevice, remote: &ConnInfo, peer: SocketAddr) -> Result<()> {
    if remote.link_layer != dev.link_layer {
        let name = |l: u8| {
            if l == LINK_LAYER_ETHERNET {
                "Ethernet (RoCE)"
            } else {
                "InfiniBand"
            }
        };
        return Err(Error::Usage(format!(
            "link layer mismatch: local device {} is {}, peer {peer} device {} is {}; pick \
             devices of one kind on every node with NCCL_IB_HCA",
            dev.name,
            name(dev.link_layer),
            remote.device,
            name(remote.link_layer)
        )));
    }
    Ok(())
}

fn connect_qps(qps: &[Qp], remote: &ConnInfo, path: &QpPath) -> Result<()> {
    for (qp, (qpn, psn)) in qps.iter().zip(&remote.qps) {
        let r = RemoteQp {
            qpn: *qpn,
            psn: *psn,
            gid: remote.gid,
            lid: remote.lid,
        };
        qp.to_rtr(path, &r)?;
        qp.to_rts(path)?;
    }
    Ok(())
}

fn create_qps(
    dev: &VerbsDevice,
    cq: &Arc<Cq>,
    n: usize,
    send_wr: u32,
    recv_wr: u32,
    params: &VerbsParams,
) -> Result<Vec<Qp>> {
    let qps = (0..n)
        .map(|_| Qp::new(&dev.pd, cq, send_wr, recv_wr, MAX_INLINE))
        .collect::<Result<Vec<_>>>()?;
    let init = QpPath {
        port: dev.port,
        roce: false,
        gid_index: 0,
        mtu: 0,
        traffic_class: 0,
        sl: 0,
        timeout: params.timeout,
        retry_cnt: params.retry_cnt,
        pkey_index: params.pkey_index,
    };
    for qp in &qps {
        qp.to_init(&init, ACCESS_RDMA)?;
    }
    Ok(qps)
}

// ---------------------------------------------------------------------------------------
// Connect (sender side)

/// The connecting side, between NCCL's repeated `connect` calls.
pub struct VerbsConnecting {
    chan: Channel,
    sender: Option<SendState>,
    accepted: bool,
    params: VerbsParams,
}

impl VerbsConnecting {
    /// Creates the sender's QPs and FIFO and starts the handshake with the listener.
    pub fn start(dev: &Arc<VerbsDevice>, handle: &Handle, params: VerbsParams) -> Result<Self> {
        let nqps = params.qps_per_connection as usize;
        let cq = Cq::new(&dev.ctx, (SLOTS * nqps * 2 + 16) as i32)?;
        let qps = create_qps(dev, &cq, nqps, (SLOTS * (MAX_RECVS + 2)) as u32, 1, &params)?;
        let fifo = DmaBuffer::<CtsEntry>::new(&dev.pd, SLOTS * MAX_RECVS, ACCESS_RDMA)?;
        let sizes_local = DmaBuffer::<u32>::new(&dev.pd, SLOTS * MAX_RECVS, ACCESS_RDMA)?;
        let info = local_info(
            dev,
            &qps,
            fifo.addr(0),
            fifo.rkey(),
            params.traffic_class,
            params.sl,
        );
        let mut chan = Channel::connect(handle.addr, params.timeouts)?;
        let hello = Hello {
            nonce: handle.nonce,
            transport: TransportKind::Verbs,
            payload: info.encode(),
        };
        chan.queue(MsgKind::Hello, &hello.encode());
        let peer = handle.addr;
        Ok(VerbsConnecting {
            chan,
            sender: Some(SendState {
                qps,
                fifo,
                sizes_local,
                cq: CqPoller::new(cq),
                dev: Arc::clone(dev),
                remote_sizes: (0, 0),
                split: params.split_data,
                seq: 0,
                slots: [SendSlot::FREE; SLOTS],
                chain: SendChain::new(),
                failure: Failure::default(),
                peer: peer.to_string(),
                idle_calls: 0,
            }),
            accepted: false,
            params,
        })
    }

    /// One non-blocking step; the finished send comm once the listener is ready.
    pub fn poll(&mut self) -> Result<Option<VerbsSendComm>> {
        if !self.chan.flush()? {
            return Ok(None);
        }
        if self.accepted {
            return Ok(Some(self.finish()));
        }
        let Some(m) = self.chan.poll_recv()? else {
            return Ok(None);
        };
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
        let s = self.sender.as_mut().expect("present until finished");
        check_link(&s.dev, &remote, peer)?;
        if remote.qps.len() != s.qps.len() {
            return Err(Error::Remote(format!(
                "{peer} answered with {} QPs for our {}",
                remote.qps.len(),
                s.qps.len()
            )));
        }
        let p = path(
            &s.dev,
            &remote,
            &self.params,
            self.params.traffic_class,
            self.params.sl,
        );
        connect_qps(&s.qps, &remote, &p)?;
        s.remote_sizes = (remote.addr, remote.rkey);
        s.peer = format!("{peer} ({})", remote.device);
        self.chan.queue(MsgKind::Ready, &[]);
        self.accepted = true;
        if !self.chan.flush()? {
            return Ok(None);
        }
        Ok(Some(self.finish()))
    }

    fn finish(&mut self) -> VerbsSendComm {
        let mut s = self.sender.take().expect("present until finished");
        if let Some(stream) = self.chan.try_clone_stream() {
            s.cq.watch(stream);
        }
        VerbsSendComm {
            inner: Mutex::new(s),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Listen / accept (receiver side)

/// The listening side of one connection.
pub struct VerbsListen {
    listener: Listener,
    dev: Arc<VerbsDevice>,
    params: VerbsParams,
    accepting: Option<(Channel, RecvState)>,
}

impl VerbsListen {
    /// Binds the bootstrap listener for device `dev`.
    pub fn bind(ip: std::net::IpAddr, dev: &Arc<VerbsDevice>, params: VerbsParams) -> Result<Self> {
        Ok(VerbsListen {
            listener: Listener::bind(ip, TransportKind::Verbs, params.timeouts)?,
            dev: Arc::clone(dev),
            params,
            accepting: None,
        })
    }

    /// The handle to publish.
    pub fn handle(&self) -> &Handle {
        self.listener.handle()
    }

    /// One non-blocking step of `accept`.
    pub fn poll_accept(&mut self) -> Result<Option<VerbsRecvComm>> {
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
            let info = local_info(
                &self.dev,
                &state.qps,
                state.sizes_record.addr(0),
                state.sizes_record.rkey(),
                remote.tc,
                remote.sl,
            );
            chan.queue(MsgKind::Accept, &info.encode());
            self.accepting = Some((chan, state));
        }
        let (chan, _) = self.accepting.as_mut().expect("set above");
        if !chan.flush()? {
            return Ok(None);
        }
        match chan.poll_recv()? {
            None => Ok(None),
            Some(m) if m.kind == MsgKind::Ready => {
                let (chan, mut state) = self.accepting.take().expect("set above");
                state.cq.watch(chan.into_stream());
                Ok(Some(VerbsRecvComm {
                    inner: Mutex::new(state),
                }))
            }
            Some(m) => Err(Error::Remote(format!(
                "{} sent message type {:?} instead of ready",
                chan.peer(),
                m.kind
            ))),
        }
    }

    fn setup_receiver(&self, remote: &ConnInfo, peer: SocketAddr) -> Result<RecvState> {
        let dev = &self.dev;
        check_link(dev, remote, peer)?;
        let nqps = remote.qps.len();
        let cq = Cq::new(&dev.ctx, (SLOTS * (nqps + 2) + 16) as i32)?;
        let qps = create_qps(
            dev,
            &cq,
            nqps,
            (SLOTS * 2) as u32,
            SLOTS as u32 + 1,
            &self.params,
        )?;
        // The receiver uses the sender's traffic class and service level, as NCCL does.
        let p = path(dev, remote, &self.params, remote.tc, remote.sl);
        connect_qps(&qps, remote, &p)?;
        let flush_qp = if self.params.flush {
            let qp = create_qps(dev, &cq, 1, SLOTS as u32, 1, &self.params)?.remove(0);
            let own = RemoteQp {
                qpn: qp.qpn(),
                psn: qp.psn,
                gid: dev.gid,
                lid: dev.lid,
            };
            let mut own_path = p;
            own_path.mtu = dev.active_mtu;
            qp.to_rtr(&own_path, &own)?;
            qp.to_rts(&own_path)?;
            Some(qp)
        } else {
            None
        };
        Ok(RecvState {
            qps,
            flush_qp,
            cts_local: DmaBuffer::new(&dev.pd, SLOTS * MAX_RECVS, ACCESS_RDMA)?,
            sizes_record: DmaBuffer::new(&dev.pd, SLOTS * MAX_RECVS, ACCESS_RDMA)?,
            flush_target: DmaBuffer::new(&dev.pd, 16, ACCESS_RDMA)?,
            cq: CqPoller::new(cq),
            dev: Arc::clone(dev),
            remote_fifo: (remote.addr, remote.rkey),
            split: self.params.split_data,
            seq: 0,
            slots: [RecvSlot::FREE; SLOTS],
            flush_slots: [FlushSlot::Free; SLOTS],
            flush_next: 0,
            cts_batch: self.params.cts_batch.clamp(1, SLOTS as u32),
            cts_posted: 0,
            announced: 0,
            cts_unsignaled: 0,
            polled: false,
            cts_writes: 0,
            cts_entries: 0,
            chain: SendChain::new(),
            failure: Failure::default(),
            peer: format!("{peer} ({})", remote.device),
        })
    }
}

// ---------------------------------------------------------------------------------------
// Shared completion handling

fn cqe_error(dev: &VerbsDevice, peer: &str, c: &crate::verbs::dma::Completion) -> Error {
    let lib = dev.ctx.lib();
    let op = match c.wr_id >> 32 {
        1 => "receive of RDMA write with immediate",
        2 => "clear-to-send RDMA write",
        3 => "data RDMA write",
        4 => "flush RDMA read",
        _ => "work request",
    };
    let hint = match c.status {
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
    Error::Remote(format!(
        "{op} to peer {peer} on {} failed: {} (status {}, vendor error {:#x}, QP {}){hint}",
        dev.name,
        lib.status_str(c.status),
        c.status,
        c.vendor_err,
        c.qp_num
    ))
}

/// A comm's completion queue and what polling it needs: a batch to poll into, and the
/// device's asynchronous events, read every so often (a syscall, so not on every call).
/// The bootstrap socket stays open as a liveness signal: when the peer process dies its
/// kernel closes the socket, which RDMA alone would only notice as a retry timeout on the
/// sending side (and never on an idle receiving side).
struct CqPoller {
    cq: Arc<Cq>,
    wc: WcBatch,
    epoch: u64,
    calls: u32,
    oob: Option<TcpStream>,
    peer_gone: bool,
    /// The peer's host stopped answering keepalive probes (rather than closing).
    peer_silent: bool,
}

impl CqPoller {
    fn new(cq: Arc<Cq>) -> Self {
        CqPoller {
            cq,
            wc: WcBatch::new(),
            epoch: 0,
            calls: 0,
            oob: None,
            peer_gone: false,
            peer_silent: false,
        }
    }

    /// Keeps the (non-blocking) bootstrap socket to watch for the peer's exit.
    fn watch(&mut self, stream: TcpStream) {
        self.oob = Some(stream);
    }

    /// Whether the peer's bootstrap socket has closed (its process exited or closed the comm).
    fn peer_gone(&mut self) -> bool {
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
    fn gone_error(&self, peer: &str) -> Error {
        if self.peer_silent {
            return Error::Remote(format!(
                "peer {peer} stopped answering with requests still in flight{}",
                oob::PEER_SILENT
            ));
        }
        Error::Remote(format!(
            "peer {peer} closed its connection (its process exited or closed the comm) with \
             requests still in flight"
        ))
    }

    /// Hands every successful completion to `on`; a failed one, or a fatal event on the
    /// device or one of `qps`, is the comm's error.
    fn drain(
        &mut self,
        dev: &VerbsDevice,
        qps: &[Qp],
        peer: &str,
        mut on: impl FnMut(&crate::verbs::dma::Completion),
    ) -> Result<()> {
        self.calls = self.calls.wrapping_add(1);
        if self.calls % 256 == 0 {
            self.peer_gone();
            let now = dev.ctx.drain_async_events();
            if now != self.epoch {
                self.epoch = now;
                let qpns: Vec<u32> = qps.iter().map(Qp::qpn).collect();
                if let Some(why) = dev.ctx.fatal_for(&self.cq, &qpns) {
                    return Err(Error::Device(format!("fatal asynchronous event: {why}")));
                }
            }
        }
        loop {
            let n = self.wc.poll(&self.cq)?;
            for i in 0..n {
                let c = self.wc.get(i);
                if c.status != WC_SUCCESS {
                    return Err(cqe_error(dev, peer, &c));
                }
                on(&c);
            }
            if n < 16 {
                return Ok(());
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Send side

#[derive(Debug, Clone, Copy)]
struct SendSlot {
    busy: bool,
    n: usize,
    matched: u8,
    tested: u8,
    cqe_pending: u32,
    posted: bool,
    sizes: [usize; MAX_RECVS],
    addrs: [u64; MAX_RECVS],
    lkeys: [u32; MAX_RECVS],
    trunc: u8,
    /// Entries whose buffer is not host memory (GPU memory registered for GPUDirect).
    device_mem: u8,
}

impl SendSlot {
    fn start(&mut self, n: usize) {
        self.busy = true;
        self.n = n;
        self.matched = 0;
        self.tested = 0;
        self.cqe_pending = 0;
        self.posted = false;
        self.trunc = 0;
        self.device_mem = 0;
    }

    /// The most bytes a write of this slot may carry inline, given the QP's limit. Inline
    /// data is copied by the CPU at post time, so nothing is inlined when a buffer of the
    /// slot is GPU memory: the CPU cannot read a device address (NCCL's IB transport never
    /// inlines data either).
    fn max_inline(&self, qp_limit: u32) -> u32 {
        if self.device_mem == 0 {
            qp_limit
        } else {
            0
        }
    }

    const FREE: SendSlot = SendSlot {
        busy: false,
        n: 0,
        matched: 0,
        tested: 0,
        cqe_pending: 0,
        posted: false,
        sizes: [0; MAX_RECVS],
        addrs: [0; MAX_RECVS],
        lkeys: [0; MAX_RECVS],
        trunc: 0,
        device_mem: 0,
    };
}

struct SendState {
    // Field order is teardown order: QPs before the memory they use, the CQ last.
    qps: Vec<Qp>,
    fifo: DmaBuffer<CtsEntry>,
    sizes_local: DmaBuffer<u32>,
    cq: CqPoller,
    dev: Arc<VerbsDevice>,
    remote_sizes: (u64, u32),
    split: bool,
    seq: u32,
    slots: [SendSlot; SLOTS],
    chain: SendChain,
    failure: Failure,
    peer: String,
    /// `isend` calls that found nothing to post.
    idle_calls: u32,
}

/// A send comm over verbs.
pub struct VerbsSendComm {
    inner: Mutex<SendState>,
}

impl VerbsSendComm {
    /// The peer (address and device).
    pub fn peer(&self) -> String {
        self.inner.lock().peer.clone()
    }

    /// Posts a send of `buf` (registered with `lkey`; `host`: host memory, not GPU memory);
    /// `Ok(None)` until the receiver has posted a matching receive. Returns a request id
    /// (slot * 8 + entry).
    pub fn isend(&self, buf: UserBuffer, tag: i32, lkey: u32, host: bool) -> Result<Option<usize>> {
        let mut guard = self.inner.lock();
        let s = &mut *guard;
        s.failure.check()?;
        let slot = s.seq as usize % SLOTS;
        let want = s.seq.wrapping_add(1);
        let base = slot * MAX_RECVS;
        // The previous use of this slot must be tested, and the receiver's clear-to-send
        // for this one must have landed: one load decides, as in NCCL's IB transport. The
        // entry's `idx` is read first and alone, the rest only once it matches.
        if (s.slots[slot].busy && s.slots[slot].posted) || cts_landed(&s.fifo, base) != want {
            return s.nothing_to_post();
        }
        let first = s.fifo.get(base);
        let n = first.nreqs as usize;
        if n == 0 || n > MAX_RECVS {
            return s.protocol_error(n);
        }
        let st = &mut s.slots[slot];
        if !st.busy {
            // Only the bookkeeping is reset: the per-message arrays are written as each
            // send matches, and only the first n are read.
            st.start(n);
        }
        // The first unmatched entry with this tag; each entry is read (32 bytes) only when
        // reached, and one that has not landed yet means "not yet".
        let mut found = None;
        for i in 0..n {
            if st.matched & (1 << i) != 0 {
                continue;
            }
            if i != 0 && cts_landed(&s.fifo, base + i) != want {
                return s.nothing_to_post();
            }
            let entry = if i == 0 { first } else { s.fifo.get(base + i) };
            if entry.tag == tag {
                found = Some((i, entry.size));
                break;
            }
        }
        let Some((e, room)) = found else {
            return s.nothing_to_post();
        };
        st.matched |= 1 << e;
        st.sizes[e] = buf.len();
        st.addrs[e] = buf.addr() as u64;
        st.lkeys[e] = lkey;
        st.device_mem |= u8::from(!host) << e;
        let truncated = buf.len() as u64 > room;
        if truncated {
            st.trunc |= 1 << e;
        }
        if st.matched.count_ones() as usize == n {
            let r = s.post_slot(slot, n);
            s.failure.record(r)?;
        }
        if truncated {
            // No request goes back, so none is ever tested and the slot could never be
            // reused: the comm fails from here on (every later call returns the error rather
            // than waiting on the slot). The receiver learns of it from the size marker.
            let e = truncation_error(buf.len(), tag, &s.peer, room);
            s.failure.note(&e);
            return Err(e);
        }
        Ok(Some(base + e))
    }

    /// Tests send request `id`.
    pub fn test(&self, id: usize) -> Result<Option<Completion>> {
        let mut s = self.inner.lock();
        let (slot, e) = (id / MAX_RECVS, id % MAX_RECVS);
        if slot >= SLOTS || !s.slots[slot].busy || s.slots[slot].matched & (1 << e) == 0 {
            return Err(not_in_flight("send", id));
        }
        // The CQ is polled only for a request not yet known to be done: a drain that
        // completed it also completed the ones behind it.
        let done = |st: &SendSlot| st.posted && st.cqe_pending == 0;
        if !done(&s.slots[slot]) {
            let r = s.progress();
            let _ = s.failure.record(r);
        }
        let st = &mut s.slots[slot];
        if done(st) {
            let size = st.sizes[e];
            st.tested |= 1 << e;
            if st.tested == st.matched && st.matched.count_ones() as usize == st.n {
                st.busy = false;
            }
            return Ok(Some(Completion::single(size)));
        }
        s.failure.check()?;
        if s.cq.peer_gone {
            let e = s.cq.gone_error(&s.peer);
            return s.failure.record(Err(e));
        }
        Ok(None)
    }
}

#[cold]
fn too_many_flushes() -> Error {
    Error::Usage(format!(
        "iflush: {SLOTS} flushes already in flight on this comm (NCCL allows {SLOTS} requests)"
    ))
}

#[cold]
fn truncation_error(len: usize, tag: i32, peer: &str, room: u64) -> Error {
    Error::Truncated(format!(
        "send of {len} bytes (tag {tag}) to {peer} is larger than the {room}-byte receive \
         posted for it"
    ))
}

/// The `idx` of clear-to-send entry `i` of `fifo`: the sequence number + 1 of the receive
/// it announces once the receiver's write has placed it (and the fields before it).
#[inline(always)]
fn cts_landed(fifo: &DmaBuffer<CtsEntry>, i: usize) -> u32 {
    fifo.get_u32(i, CTS_IDX_OFFSET)
}

impl SendState {
    /// `isend` found nothing to post. Keeps completions and the peer watch moving now and
    /// then, without paying for a CQ poll on every "not yet".
    #[inline(never)]
    fn nothing_to_post(&mut self) -> Result<Option<usize>> {
        self.idle_calls = self.idle_calls.wrapping_add(1);
        if self.idle_calls % 16 == 0 {
            let r = self.progress();
            self.failure.record(r)?;
        }
        if self.cq.peer_gone {
            let e = self.cq.gone_error(&self.peer);
            return self.failure.record(Err(e));
        }
        Ok(None)
    }

    #[cold]
    fn protocol_error(&mut self, n: usize) -> Result<Option<usize>> {
        let e = Error::Remote(format!(
            "protocol error: clear-to-send from {} announces {n} buffers",
            self.peer
        ));
        self.failure.record(Err(e))
    }

    fn progress(&mut self) -> Result<()> {
        let slots = &mut self.slots;
        self.cq.drain(&self.dev, &self.qps, &self.peer, |c| {
            if c.wr_id >> 32 == WR_SEND >> 32 {
                let st = &mut slots[(c.wr_id & 0xffff_ffff) as usize % SLOTS];
                st.cqe_pending = st.cqe_pending.saturating_sub(1);
            }
        })
    }

    /// Posts the writes of a fully matched slot of `n` messages.
    fn post_slot(&mut self, slot: usize, n: usize) -> Result<()> {
        let nqps = self.qps.len();
        let (first_qp, used) = if self.split {
            (0, nqps)
        } else {
            (self.seq as usize % nqps, 1)
        };
        let base = slot * MAX_RECVS;
        let st = &self.slots[slot];
        if n == 1 && used == 1 && st.trunc == 0 {
            // The common case: one WRITE_WITH_IMM carrying the data and its size.
            let e = self.fifo.get(base);
            let qp = &self.qps[first_qp];
            let len = st.sizes[0] as u32;
            self.chain.post_one(
                qp,
                (st.addrs[0], len, st.lkeys[0]),
                (e.addr, e.rkey),
                Some(len),
                WR_SEND | slot as u64,
                true,
                st.max_inline(qp.max_inline),
            )?;
            return self.posted(slot, 1);
        }
        if n > 1 {
            for (i, size) in st.sizes[..n].iter().enumerate() {
                let v = if st.trunc & (1 << i) != 0 {
                    TRUNCATED
                } else {
                    *size as u32
                };
                self.sizes_local.set(base + i, v);
            }
        }
        let chain = &mut self.chain;
        for k in 0..used {
            let qp = &self.qps[(first_qp + k) % nqps];
            chain.clear();
            for i in 0..n {
                if st.trunc & (1 << i) != 0 {
                    continue;
                }
                // Matched entries have landed and stay put until this slot completes.
                let e = self.fifo.get(base + i);
                let size = st.sizes[i];
                let chunk = if used > 1 {
                    size.div_ceil(used).div_ceil(SPLIT_ALIGN) * SPLIT_ALIGN
                } else {
                    size
                };
                let off = (k * chunk).min(size);
                let len = chunk.min(size - off);
                if len > 0 {
                    chain.write(
                        st.addrs[i] + off as u64,
                        len as u32,
                        st.lkeys[i],
                        e.addr + off as u64,
                        e.rkey,
                    );
                }
            }
            if n == 1 {
                let imm = if st.trunc & 1 != 0 {
                    TRUNCATED
                } else {
                    st.sizes[0] as u32
                };
                if chain.is_empty() {
                    let e = self.fifo.get(base);
                    chain.write_imm(0, 0, 0, e.addr, e.rkey, imm);
                } else {
                    chain.last_with_imm(imm);
                }
            } else {
                chain.write_imm(
                    self.sizes_local.addr(base),
                    (4 * n) as u32,
                    self.sizes_local.lkey(),
                    self.remote_sizes.0 + (base * 4) as u64,
                    self.remote_sizes.1,
                    slot as u32,
                );
            }
            chain.finish(WR_SEND | slot as u64, st.max_inline(qp.max_inline));
            chain.post(qp)?;
        }
        self.posted(slot, used)
    }

    /// Records that `slot`'s writes are posted, `cqes` of them signaled.
    fn posted(&mut self, slot: usize, cqes: usize) -> Result<()> {
        let st = &mut self.slots[slot];
        st.cqe_pending = cqes as u32;
        st.posted = true;
        self.seq = self.seq.wrapping_add(1);
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// Receive side

#[derive(Debug, Clone, Copy)]
struct RecvSlot {
    busy: bool,
    n: usize,
    imm_pending: u32,
    size0: u32,
}

impl RecvSlot {
    const FREE: RecvSlot = RecvSlot {
        busy: false,
        n: 0,
        imm_pending: 0,
        size0: 0,
    };
}

/// Clear-to-send entries are held back (to be posted together) only while the sender holds
/// at least this many posted receives it can fill.
const CTS_HOLD_MIN: u32 = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FlushSlot {
    Free,
    Pending,
    Done,
}

struct RecvState {
    // Field order is teardown order: QPs before the memory they use, the CQ last.
    qps: Vec<Qp>,
    flush_qp: Option<Qp>,
    cts_local: DmaBuffer<CtsEntry>,
    sizes_record: DmaBuffer<u32>,
    flush_target: DmaBuffer<u32>,
    cq: CqPoller,
    dev: Arc<VerbsDevice>,
    remote_fifo: (u64, u32),
    split: bool,
    seq: u32,
    slots: [RecvSlot; SLOTS],
    flush_slots: [FlushSlot; SLOTS],
    /// The flush slot tried first by the next `iflush`.
    flush_next: usize,
    /// Most clear-to-send entries held back before they are posted in one write.
    cts_batch: u32,
    /// Sequence number of the first receive whose clear-to-send is not posted yet.
    cts_posted: u32,
    /// Receives whose clear-to-send is posted and that have not finished.
    announced: u32,
    /// Clear-to-send writes posted unsignaled since the last signaled one.
    cts_unsignaled: u32,
    /// A receive was tested since the last `irecv`: the caller polls its receives (NCCL's
    /// proxy tests its oldest one on every pass), so entries held back now will be posted
    /// by a later `test`. Receives posted back to back are announced at once.
    polled: bool,
    /// Clear-to-send writes posted, and the entries they carried (one per receive), for the
    /// comm's summary.
    cts_writes: u64,
    cts_entries: u64,
    chain: SendChain,
    failure: Failure,
    peer: String,
}

/// A receive comm over verbs.
pub struct VerbsRecvComm {
    inner: Mutex<RecvState>,
}

/// Request ids of flushes start here (receives are 0..32).
pub const FLUSH_ID_BASE: usize = SLOTS;

impl VerbsRecvComm {
    /// The peer (address and device).
    pub fn peer(&self) -> String {
        self.inner.lock().peer.clone()
    }

    /// Clear-to-send writes posted so far, and the receives they announced.
    pub fn clear_to_send_counts(&self) -> (u64, u64) {
        let s = self.inner.lock();
        (s.cts_writes, s.cts_entries)
    }

    /// Posts a grouped receive of `bufs` with their remote keys; `Ok(None)` when 32 are in
    /// flight. Returns the request id (the slot).
    pub fn irecv(&self, bufs: &[UserBuffer], tags: &[i32], rkeys: &[u32]) -> Result<Option<usize>> {
        let mut s = self.inner.lock();
        s.failure.check()?;
        // No CQ poll here: `test` polls, and a free slot depends only on `test`.
        if s.cq.peer_gone {
            let e = s.cq.gone_error(&s.peer);
            return s.failure.record(Err(e));
        }
        let slot = s.seq as usize % SLOTS;
        if s.slots[slot].busy {
            return Ok(None);
        }
        let r = s.post_receive(slot, bufs, tags, rkeys);
        s.polled = false;
        s.failure.record(r)?;
        Ok(Some(slot))
    }

    /// Posts a flush (a 1-byte RDMA READ through the loopback QP) of the last non-empty
    /// buffer; `Ok(None)` when there is nothing to flush.
    pub fn iflush(&self, bufs: &[UserBuffer], rkeys: &[u32]) -> Result<Option<usize>> {
        let mut s = self.inner.lock();
        s.failure.check()?;
        if s.flush_qp.is_none() {
            return Ok(None);
        }
        let Some(last) = (0..bufs.len()).rev().find(|&i| !bufs[i].is_empty()) else {
            return Ok(None);
        };
        // NULL would tell NCCL "no flush needed" and it would not retry, so a busy slot
        // (a flush of another sub still untested) means taking the next free one. NCCL keeps
        // at most 32 requests in flight per comm, so one is free unless the caller broke that.
        let Some(fslot) = (0..SLOTS)
            .map(|k| (s.flush_next + k) % SLOTS)
            .find(|&f| s.flush_slots[f] == FlushSlot::Free)
        else {
            return Err(too_many_flushes());
        };
        let (target, lkey) = (s.flush_target.addr(0), s.flush_target.lkey());
        let s = &mut *s;
        s.chain.clear();
        s.chain
            .read(target, 1, lkey, bufs[last].addr() as u64, rkeys[last]);
        s.chain.finish(WR_FLUSH | fslot as u64, 0);
        let qp = s.flush_qp.as_ref().expect("checked above");
        let r = s.chain.post(qp);
        s.failure.record(r)?;
        s.flush_slots[fslot] = FlushSlot::Pending;
        s.flush_next = (fslot + 1) % SLOTS;
        Ok(Some(FLUSH_ID_BASE + fslot))
    }

    /// Tests receive or flush request `id`.
    pub fn test(&self, id: usize) -> Result<Option<Completion>> {
        let mut s = self.inner.lock();
        if id >= FLUSH_ID_BASE {
            let f = id - FLUSH_ID_BASE;
            if s.flush_slots.get(f) == Some(&FlushSlot::Pending) {
                let r = s.progress();
                let _ = s.failure.record(r);
            }
            return match s.flush_slots.get(f) {
                Some(FlushSlot::Done) => {
                    s.flush_slots[f] = FlushSlot::Free;
                    Ok(Some(Completion::EMPTY))
                }
                Some(FlushSlot::Pending) => s.failure.check().map(|()| None),
                _ => Err(not_in_flight("flush", f)),
            };
        }
        if !s.slots.get(id).is_some_and(|st| st.busy) {
            return Err(not_in_flight("receive", id));
        }
        s.polled = true;
        // As for sends, the CQ is polled only for a receive not yet known to be done.
        if s.slots[id].imm_pending > 0 {
            let r = s.progress();
            let _ = s.failure.record(r);
            // A receive still waiting needs its clear-to-send at the sender, and the sender
            // should keep holding a few.
            if s.cts_held(id) || s.announced < CTS_HOLD_MIN {
                let r = s.post_pending_cts();
                s.failure.record(r)?;
            }
        }
        if s.slots[id].imm_pending > 0 {
            s.failure.check()?;
            if !s.cq.peer_gone {
                return Ok(None);
            }
            // Completions the peer caused before it left are already in the CQ: look once
            // more before calling the request lost.
            let r = s.progress();
            let _ = s.failure.record(r);
            if s.slots[id].imm_pending > 0 {
                let e = s.cq.gone_error(&s.peer);
                return s.failure.record(Err(e));
            }
        }
        s.finish_receive(id)
    }
}

impl RecvState {
    /// Frees receive `id`, whose data has all arrived, and reports its sizes.
    fn finish_receive(&mut self, id: usize) -> Result<Option<Completion>> {
        let st = std::mem::replace(&mut self.slots[id], RecvSlot::FREE);
        // Data arrived, so its clear-to-send had been posted.
        self.announced = self.announced.saturating_sub(1);
        let mut c = Completion {
            n: st.n,
            sizes: [0; MAX_RECVS],
        };
        let mut truncated = false;
        for i in 0..st.n {
            let v = if st.n == 1 {
                st.size0
            } else {
                self.sizes_record.get(id * MAX_RECVS + i)
            };
            truncated |= v == TRUNCATED;
            c.sizes[i] = v;
        }
        if truncated {
            return Err(Error::Truncated(format!(
                "{} sent more bytes than the receive posted for them",
                self.peer
            )));
        }
        Ok(Some(c))
    }

    fn post_receive(
        &mut self,
        slot: usize,
        bufs: &[UserBuffer],
        tags: &[i32],
        rkeys: &[u32],
    ) -> Result<()> {
        let n = bufs.len();
        let nqps = self.qps.len();
        let (first_qp, used) = if self.split {
            (0, nqps)
        } else {
            (self.seq as usize % nqps, 1)
        };
        for k in 0..used {
            self.qps[(first_qp + k) % nqps].post_recv(WR_RECV | slot as u64)?;
        }
        let idx = self.seq.wrapping_add(1);
        for (i, b) in bufs.iter().enumerate() {
            self.cts_local.set(
                slot * MAX_RECVS + i,
                CtsEntry {
                    addr: b.addr() as u64,
                    size: b.len() as u64,
                    rkey: rkeys[i],
                    tag: tags[i],
                    nreqs: n as u32,
                    idx,
                },
            );
        }
        self.slots[slot] = RecvSlot {
            busy: true,
            n,
            imm_pending: used as u32,
            size0: 0,
        };
        self.seq = self.seq.wrapping_add(1);
        // Held back while the sender holds enough to work on and the caller polls its
        // receives, up to the batch size: one RDMA write (and, on Soft-RoCE, one system
        // call) then announces several receives.
        let pending = self.seq.wrapping_sub(self.cts_posted);
        if pending >= self.cts_batch || self.announced < CTS_HOLD_MIN || !self.polled {
            self.post_pending_cts()?;
        }
        Ok(())
    }

    /// Whether busy receive `slot`'s clear-to-send is still held back: it is among the last
    /// `seq - cts_posted` receives posted.
    fn cts_held(&self, slot: usize) -> bool {
        let held = self.seq.wrapping_sub(self.cts_posted) as usize;
        (slot + SLOTS - self.cts_posted as usize % SLOTS) % SLOTS < held
    }

    /// Posts every clear-to-send held back, in FIFO order: one RDMA WRITE per contiguous run
    /// of slots (whole 256-byte slots, then the last slot's entries; the sender reads only
    /// the entries a slot announces, each checked by its sequence number).
    #[inline(always)] // into post_receive: once per receive at the default batch of 1
    fn post_pending_cts(&mut self) -> Result<()> {
        while self.cts_posted != self.seq {
            let first = self.cts_posted as usize % SLOTS;
            let pending = self.seq.wrapping_sub(self.cts_posted) as usize;
            let k = pending.min(SLOTS - first);
            let last = first + k - 1;
            let bytes = ((k - 1) * MAX_RECVS + self.slots[last].n) * CTS_BYTES;
            // Only every 8th write is signaled, which also retires the unsignaled ones before
            // it (at most 32 + 8 in the send queue); errors complete regardless.
            self.cts_unsignaled += 1;
            let signaled = self.cts_unsignaled >= 8;
            if signaled {
                self.cts_unsignaled = 0;
            }
            let qp = &self.qps[0];
            self.chain.post_one(
                qp,
                (
                    self.cts_local.addr(first * MAX_RECVS),
                    bytes as u32,
                    self.cts_local.lkey(),
                ),
                (
                    self.remote_fifo.0 + (first * MAX_RECVS * CTS_BYTES) as u64,
                    self.remote_fifo.1,
                ),
                None,
                WR_CTS | first as u64,
                signaled,
                qp.max_inline,
            )?;
            self.cts_posted = self.cts_posted.wrapping_add(k as u32);
            self.announced += k as u32;
            self.cts_writes += 1;
            self.cts_entries += k as u64;
        }
        Ok(())
    }

    fn progress(&mut self) -> Result<()> {
        let (slots, flush_slots) = (&mut self.slots, &mut self.flush_slots);
        self.cq.drain(&self.dev, &self.qps, &self.peer, |c| {
            let slot = (c.wr_id & 0xffff_ffff) as usize % SLOTS;
            match c.wr_id >> 32 {
                k if k == WR_RECV >> 32 && c.opcode == WC_RECV_RDMA_WITH_IMM => {
                    let st = &mut slots[slot];
                    if st.n == 1 {
                        st.size0 = c.imm;
                    }
                    st.imm_pending = st.imm_pending.saturating_sub(1);
                }
                k if k == WR_FLUSH >> 32 => flush_slots[slot] = FlushSlot::Done,
                _ => {} // clear-to-send writes: nothing to track
            }
        })
    }
}
