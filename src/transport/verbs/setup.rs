//! Connection setup over `oob`, in the bring-up's three steps (`bringup`): the connector
//! (the sender) makes its rails, clear-to-send FIFO and size records and offers them in its
//! hello; the listener makes its rails, joins them to the connector's and answers (with the
//! split setting in effect: the receiver's); the connector joins the answer, sends `Ready`
//! with its probe QPs, and only then does `accept` return, so the receiver never writes into
//! a QP that is not ready. The bootstrap connection then becomes each end's link to its peer
//! (`peer`). Nothing here blocks.

use std::{net::SocketAddr, sync::Arc};

use super::bringup::{dma, rkeys, Bringup, Probes, Role};
use super::budget::{self, EndCost};
use super::failover::Mobility;
use super::peer::PeerLink;
use super::profile::ConnParams;
use super::rail::Rail;
use super::recv::{RecvState, VerbsReceiver};
use super::send::{SendState, VerbsSender, PROBE_AT};
use super::wire::{decode_qps, encode_qps, ConnInfo, CtsEntry, QpPlan, MAX_QPS, SLOTS};
use crate::error::{Error, Result};
use crate::oob::{self, Channel, Handle, Hello, Message, MsgKind, TransportKind};
use crate::transport::{CommKeys, Connector, Listener, MAX_RAILS, MAX_RECVS};
use crate::verbs::device::VerbsDevice;
use crate::verbs::dma::DmaBuffer;
use crate::verbs::nic::Nic;

/// The local keys of `buf` on each rail.
fn lkeys<T: Copy, R>(buf: &DmaBuffer<T, R>, rails: usize) -> [u32; MAX_RAILS] {
    std::array::from_fn(|r| if r < rails { buf.lkey(r) } else { 0 })
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

/// What the connector made before the listener answered.
struct Offered<N: Nic> {
    bringup: Bringup<N>,
    /// What the rails were made as, and every NIC they may move to.
    cost: EndCost,
    nics: Vec<Arc<N>>,
    fifo: DmaBuffer<CtsEntry, N::Mr>,
    sizes_local: DmaBuffer<u32, N::Mr>,
    keys: CommKeys,
}

/// The connecting side, between NCCL's repeated `connect` calls.
pub(crate) struct VerbsConnector<N: Nic = VerbsDevice> {
    chan: Option<Channel>,
    made: Option<Offered<N>>,
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
        let bringup = Bringup::make(nics, &cost, params, Role::Offers)?;
        let fifo = dma::<CtsEntry, N>(nics, SLOTS * MAX_RECVS)?;
        let sizes_local = dma::<u32, N>(nics, PROBE_AT + 2)?;
        let all: Vec<Arc<N>> = nics.iter().chain(spares).cloned().collect();
        let mobile = Mobility::new(all.clone(), cost, params).able();
        let info = bringup.describe(fifo.addr(0), |r| fifo.rkey(r), mobile);
        let mut chan = Channel::connect(handle.addr, params.timeouts)?;
        let hello = Hello {
            nonce: handle.nonce,
            transport: TransportKind::Verbs,
            payload: info.encode(),
        };
        chan.queue(MsgKind::Hello, &hello.encode());
        Ok(VerbsConnector {
            chan: Some(chan),
            made: Some(Offered {
                bringup,
                cost,
                nics: all,
                fifo,
                sizes_local,
                keys,
            }),
            params,
        })
    }

    /// One non-blocking step; the sending end once the listener answered.
    fn step(&mut self) -> Result<Option<VerbsSender<N>>> {
        let Some(chan) = self.chan.as_mut() else {
            return Err(Error::misuse(
                "connect polled again after it made its connection".into(),
            ));
        };
        if !chan.flush()? {
            return Ok(None);
        }
        let Some(m) = chan.poll_recv()? else {
            return Ok(None);
        };
        let Some(chan) = self.chan.take() else {
            return Ok(None);
        };
        self.accepted(chan, m).map(Some)
    }

    /// Joins the rails to the listener's answer `m`, and says `Ready` with this end's probe
    /// QPs over `chan`, which becomes the sending end's link to its peer.
    fn accepted(&mut self, mut chan: Channel, m: Message) -> Result<VerbsSender<N>> {
        let addr = chan.peer();
        match m.kind {
            MsgKind::Accept => {}
            MsgKind::Reject => {
                return Err(Error::remote(format!(
                    "{addr} refused the connection: {}",
                    String::from_utf8_lossy(&m.payload)
                )))
            }
            k => {
                return Err(Error::remote(format!(
                    "{addr} answered the hello with message type {k:?}"
                )))
            }
        }
        let remote = ConnInfo::decode(&m.payload)?;
        let mut made = self.made.take().ok_or_else(|| {
            Error::misuse(format!("connect to {addr} polled again after it failed"))
        })?;
        let offered: usize = made.bringup.rails().iter().map(|r| r.qps.len()).sum();
        let (rails, nqps) = (made.bringup.rails().len(), remote.qps.len());
        // The listener may take fewer (its device's limits), never fewer than our rails.
        if nqps > offered || nqps < rails {
            return Err(Error::remote(format!(
                "{addr} answered with {nqps} QPs for our {offered}",
            )));
        }
        made.bringup.keep_qps(nqps);
        if remote.split != self.params.split_data {
            tracing::info!(
                "NCCL_IB_SPLIT_DATA_ON_QPS is {} here and {} at the receiver {addr}: the \
                 connection uses the receiver's",
                u8::from(self.params.split_data),
                u8::from(remote.split)
            );
        }
        let peer = format!("{addr} ({})", remote.devices());
        let landing = (
            made.sizes_local.addr(PROBE_AT),
            lkeys(&made.sizes_local, rails),
        );
        made.bringup.join(&remote, landing, &peer)?;
        chan.queue(MsgKind::Ready, &encode_qps(&made.bringup.probe_qps()));
        // What the socket does not take now, the link sends at its next poll.
        chan.flush()?;
        let plan = QpPlan {
            nqps,
            rails,
            split: remote.split,
        };
        // What this end is now: the listener's QPs, dealt over our rails.
        let cost = EndCost {
            qps: nqps,
            peer_rails: remote.rails.len(),
            ..made.cost
        };
        let mut mobility = Mobility::new(made.nics, cost, self.params);
        mobility.peer_mobile = remote.mobile;
        let state = SendState::new(
            made.bringup.into_rails(),
            Arc::new(made.fifo),
            made.sizes_local,
            (remote.addr, rkeys(&remote), remote.rails.len()),
            plan,
            PeerLink::new(chan, peer),
            made.keys,
            mobility,
        );
        Ok(VerbsSender::new(state))
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
    answered: Answered<N>,
}

/// What the listener made in answering: the receiving end, but for its probes' bring-up.
struct Answered<N: Nic> {
    peer: String,
    rails: Vec<Rail<N>>,
    probes: Probes,
    /// What the receiving end is made of besides its rails.
    parts: Parts<N>,
}

/// The receiving end's memory and plan, made with its rails.
struct Parts<N: Nic> {
    cts_local: DmaBuffer<CtsEntry, N::Mr>,
    sizes_record: DmaBuffer<u32, N::Mr>,
    flush_target: DmaBuffer<u64, N::Mr>,
    remote_fifo: (u64, [u32; MAX_RAILS]),
    plan: QpPlan,
    keys: CommKeys,
    mobility: Mobility<N>,
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
            let addr = chan.peer();
            let remote = ConnInfo::decode(&hello.payload)?;
            let answered = match self.answer(&remote, addr) {
                Ok((info, answered)) => {
                    chan.queue(MsgKind::Accept, &info.encode());
                    answered
                }
                Err(e) => {
                    chan.queue(MsgKind::Reject, e.to_string().as_bytes());
                    let _ = chan.flush();
                    return Err(e);
                }
            };
            self.accepting = Some(Accepting { chan, answered });
        }
        let Some(a) = self.accepting.as_mut() else {
            return Ok(None);
        };
        if !a.chan.flush()? {
            return Ok(None);
        }
        let Some(m) = a.chan.poll_recv()? else {
            return Ok(None);
        };
        let Some(Accepting { chan, answered: a }) = self.accepting.take() else {
            return Ok(None);
        };
        if m.kind != MsgKind::Ready {
            return Err(Error::remote(format!(
                "{} sent message type {:?} instead of ready",
                chan.peer(),
                m.kind
            )));
        }
        // The connector's probe QPs: this end's come up against them.
        let theirs = decode_qps(&m.payload, a.probes.paths())?;
        a.probes.connect(&a.rails, &theirs)?;
        let p = a.parts;
        let state = RecvState::new(
            a.rails,
            p.cts_local,
            p.sizes_record,
            p.flush_target,
            p.remote_fifo,
            p.plan,
            self.params.cts_batch,
            PeerLink::new(chan, a.peer),
            p.keys,
            p.mobility,
        );
        Ok(Some(VerbsReceiver::new(state)))
    }

    /// The receiving end against the connector's offer `remote` (from `addr`): its rails made
    /// and joined, and the answer that describes them.
    fn answer(&mut self, remote: &ConnInfo, addr: SocketAddr) -> Result<(ConnInfo, Answered<N>)> {
        let mut cost = receiver_cost(&self.nics, remote, &self.params);
        // Fewer QPs where the device is short (the connector then uses as many), never fewer
        // than the connector's rails.
        let least = remote.rails.len();
        cost.qps = budget::fit_to(&self.nics, &cost, least, &addr.to_string())?;
        cost.rails = self.nics.len().min(cost.qps);
        let nqps = cost.qps;
        // Every rail used carries at least one QP.
        let nics = &self.nics[..cost.rails];
        let mut bringup = Bringup::make(nics, &cost, self.params, Role::Answers)?;
        let flush_target = dma(nics, 2)?;
        let peer = format!("{addr} ({})", remote.devices());
        let landing = (flush_target.addr(1), lkeys(&flush_target, cost.rails));
        bringup.join(remote, landing, &peer)?;
        if remote.split != self.params.split_data {
            tracing::info!(
                "NCCL_IB_SPLIT_DATA_ON_QPS is {} here and {} at the sender {addr}: the \
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
        let all = self.nics.iter().chain(&self.spares).cloned().collect();
        let mut mobility = Mobility::new(all, cost, self.params);
        mobility.peer_mobile = remote.mobile;
        let sizes_record = dma(nics, SLOTS * MAX_RECVS)?;
        let info = bringup.describe(
            sizes_record.addr(0),
            |r| sizes_record.rkey(r),
            mobility.able(),
        );
        let (rails, probes) = bringup.into_parts()?;
        let keys = self.keys.take().ok_or_else(|| {
            Error::misuse("accept polled again after it made its connection".into())
        })?;
        let parts = Parts {
            cts_local: dma(nics, SLOTS * MAX_RECVS)?,
            sizes_record,
            flush_target,
            remote_fifo: (remote.addr, rkeys(remote)),
            plan,
            keys,
            mobility,
        };
        Ok((
            info,
            Answered {
                peer,
                rails,
                probes,
                parts,
            },
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
