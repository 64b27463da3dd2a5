//! Connection setup over `oob`, one-way: a connector never waits for the listener's
//! `accept` (NCCL up to 2.18 runs its connects to completion before its accepts, on one
//! thread). The connector (the sender) makes its rails, clear-to-send FIFO and size records
//! and offers them in its hello; its comm is returned once the hello is out. The listener's
//! `accept` returns once a hello came: it makes its rails, joins them to the offer and
//! answers (with the split setting in effect: the receiver's). The rest is move 0 of the
//! connection (`failover`), stepped by the comms' own calls, which answer "not yet"
//! meanwhile: the sender joins the answer and says `Resume` with its probe QPs; the receiver
//! announces nothing before that `Resume`, so it never writes into a QP that is not ready.
//! The bootstrap connection is then each end's link to its peer (`peer`). Nothing here
//! blocks.

use std::sync::Arc;

use super::bringup::{dma, rkeys, Bringup, Probes, Role};
use super::budget::{self, EndCost};
use super::failover::{self, Mobility, Moving};
use super::fault::Fault;
use super::peer::PeerLink;
use super::profile::ConnParams;
use super::rail::Rail;
use super::recv::{RecvState, VerbsReceiver};
use super::send::{SendState, VerbsSender, PROBE_AT};
use super::wire::{encode_answer, ConnInfo, CtsEntry, QpPlan, Step, Waiting, MAX_QPS, SLOTS};
use crate::error::{Error, Result};
use crate::oob::{self, Channel, Handle, Hello, MsgKind, TransportKind};
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

/// What the connector made before its hello went out.
struct Offered<N: Nic> {
    bringup: Bringup<N>,
    fifo: DmaBuffer<CtsEntry, N::Mr>,
    sizes_local: DmaBuffer<u32, N::Mr>,
    keys: CommKeys,
    mobility: Mobility<N>,
}

/// The connecting side, between NCCL's repeated `connect` calls: until its hello is out.
pub(crate) struct VerbsConnector<N: Nic = VerbsDevice> {
    chan: Option<Channel>,
    made: Option<Offered<N>>,
}

impl<N: Nic> VerbsConnector<N> {
    /// Creates the sender's QPs (over the rails `nics`, which may move to `spares`) and FIFO
    /// and queues the hello that offers them to the listener.
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
        let mobility = Mobility::new(all, cost, params);
        let info = bringup.describe(fifo.addr(0), |r| fifo.rkey(r), mobility.able());
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
                fifo,
                sizes_local,
                keys,
                mobility,
            }),
        })
    }

    /// One non-blocking step; the sending end once the hello is out. The rest of the setup
    /// is the sending end's: it joins the listener's answer in its first calls.
    fn step(&mut self) -> Result<Option<VerbsSender<N>>> {
        let Some(chan) = self.chan.as_mut() else {
            return Err(Error::misuse(
                "connect polled again after it made its connection".into(),
            ));
        };
        if !chan.flush()? {
            return Ok(None);
        }
        let (Some(chan), Some(made)) = (self.chan.take(), self.made.take()) else {
            return Ok(None);
        };
        let link = PeerLink::new(chan);
        let state = SendState::offering(
            made.bringup,
            made.fifo,
            made.sizes_local,
            link,
            made.keys,
            made.mobility,
        );
        Ok(Some(VerbsSender::new(state)))
    }
}

impl<N: Nic> Connector for VerbsConnector<N> {
    type Sender = VerbsSender<N>;

    fn poll(&mut self) -> Result<Option<VerbsSender<N>>> {
        self.step()
    }
}

/// The listening side: every connection made to its handle.
pub(crate) struct VerbsListener<N: Nic = VerbsDevice> {
    listener: oob::Listener,
    nics: Vec<Arc<N>>,
    /// The NICs its connections may move to besides `nics`.
    spares: Vec<Arc<N>>,
    params: ConnParams,
    /// Where its connections' receiving ends look handles up (each its own copy).
    keys: CommKeys,
}

/// What the listener made in answering: the receiving end, but for its probes' bring-up.
struct Answered<N: Nic> {
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
            keys,
        })
    }

    /// One non-blocking step of `accept`: the receiving end of the next connector whose
    /// hello came, its rails joined to the hello's and answered. It carries data once the
    /// connector's `Resume` comes (read by its own calls): nothing here waits for the peer.
    fn step(&mut self) -> Result<Option<VerbsReceiver<N>>> {
        let Some((chan, hello)) = self.listener.poll_hello()? else {
            return Ok(None);
        };
        let mut link = PeerLink::new(chan);
        let answered = link
            .read(ConnInfo::decode(&hello.payload))
            .and_then(|remote| {
                link.name_devices(&remote.devices());
                self.answer(&remote, link.peer())
            });
        let (info, a) = match answered {
            Ok(answered) => answered,
            // The connector waits for the answer: it is told.
            Err(e) => return Err(failover::refuse(&mut link, 0, e)),
        };
        let answer = encode_answer(&info.encode(), &Waiting::new());
        link.send(&Moving::setup().message(Step::Answer, answer));
        let p = a.parts;
        let mut state = RecvState::new(
            a.rails,
            p.cts_local,
            p.sizes_record,
            p.flush_target,
            p.remote_fifo,
            p.plan,
            self.params.cts_batch,
            link,
            self.keys.fresh(),
            p.mobility,
        );
        state.answered_setup(a.probes);
        Ok(Some(VerbsReceiver::new(state)))
    }

    /// The receiving end against the connector's offer `remote` (from `peer`): its rails made
    /// and joined, and the answer that describes them.
    fn answer(&mut self, remote: &ConnInfo, peer: &str) -> Result<(ConnInfo, Answered<N>)> {
        let mut cost = receiver_cost(&self.nics, remote, &self.params);
        // Fewer QPs where the device is short (the connector then uses as many), never fewer
        // than the connector's rails.
        let least = remote.rails.len();
        cost.qps = budget::fit_to(&self.nics, &cost, least, peer)?;
        cost.rails = self.nics.len().min(cost.qps);
        let nqps = cost.qps;
        // Every rail used carries at least one QP.
        let nics = &self.nics[..cost.rails];
        let mut bringup = Bringup::make(nics, &cost, self.params, Role::Answers)?;
        let flush_target = dma(nics, 2)?;
        let landing = (flush_target.addr(1), lkeys(&flush_target, cost.rails));
        bringup
            .join(remote, landing, peer)
            .map_err(Fault::into_error)?;
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
        let parts = Parts {
            cts_local: dma(nics, SLOTS * MAX_RECVS)?,
            sizes_record,
            flush_target,
            remote_fifo: (remote.addr, rkeys(remote)),
            plan,
            mobility,
        };
        Ok((
            info,
            Answered {
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
