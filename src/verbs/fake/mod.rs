//! An in-memory RDMA fabric for unit tests. Its NICs implement [`Nic`]: QPs, CQs and
//! registrations live in one shared table, and work requests are carried out by copying
//! bytes, with the semantics the verbs transport relies on:
//! - RDMA WRITE, WRITE WITH IMMEDIATE (which consumes a receive posted on the remote QP and
//!   completes it there with the immediate) and RDMA READ, checked against the local and
//!   remote keys and ranges as a NIC checks them;
//! - completions for signaled requests, and for every failed one; a failure moves the QP to
//!   the error state, and what follows on it is flushed;
//! - per-QP order: a WRITE WITH IMMEDIATE that finds no receive waits (receiver not ready,
//!   retried for ever as with `rnr_retry = 7`), and so does everything posted after it;
//! - a send queue of the depth the QP was created with: a request holds its place until a
//!   completion of it or of a later request of its QP is polled (unsignaled requests leave
//!   only that way), and a post that does not fit fails, as `ibv_post_send` does;
//! - a receive queue of the depth the QP was created with: a receive holds its place until
//!   a WRITE WITH IMMEDIATE consumes it, and a post that does not fit fails, as
//!   `ibv_post_recv` does.
//!
//! - a completion queue of the size it was created with: a completion that finds it full is
//!   lost and the CQ is overrun, which every later poll reports (as a device raises
//!   `IBV_EVENT_CQ_ERR`).
//!
//! and the faults of a real network: work held back and placed later, or only in part
//! ([`Fabric::hold`], [`Fabric::place_partial`]), a link cut that makes work never complete
//! (a device retrying for ever) or fail, a link down, or a link that drops every packet the
//! NIC sends ([`Fabric::cut`]; its requesters' retries may run out,
//! [`Fabric::retries_run_out`]), a QP that fails, a fatal asynchronous event, GPU memory the
//! CPU cannot read (inline data from it is a crash on real hardware, a panic here), and a
//! thread descheduled in the middle of a post ([`Fabric::pause_posts`]). Knobs model what
//! differs between devices:
//! eRDMA refusing a post to a QP in the error state ([`Fabric::reject_posts_in_error`]),
//! Soft-RoCE taking seconds to destroy a QP of a dead link ([`Fabric::hold_destroys`]), and a
//! receive's completion showing up after the sender saw its acknowledgement
//! ([`Fabric::delay_receive_completions`]).

mod world;

use std::{collections::VecDeque, mem::MaybeUninit, sync::Arc};

use parking_lot::Mutex;
use rdma_sys::*;

use super::limits::{DeviceLimits, Held, Resource, Usage};
use super::nic::{LocalPort, MemoryRegion, MovesHere, Nic, QueuePair};
use super::qp::{QpPath, RemoteQp};
use crate::error::{Error, Result};

use world::{copy, copy_from, in_error, CqEntry, MrEntry, NicEntry, Op, QpEntry, World};
pub(crate) use world::{Cut, FLUSHED, REMOTE_ACCESS_ERROR, RETRY_EXCEEDED};

/// A set of NICs that can reach each other.
#[derive(Clone, Default)]
pub(crate) struct Fabric {
    world: Arc<Mutex<World>>,
}

impl Fabric {
    /// An empty fabric; work is carried out as it is posted (as on Soft-RoCE).
    pub(crate) fn new() -> Self {
        Fabric::default()
    }

    /// A new RoCE NIC on the fabric, with its own GID.
    pub(crate) fn nic(&self, name: &str) -> Arc<FakeNic> {
        self.nic_with_link_layer(name, super::device::LINK_LAYER_ETHERNET)
    }

    /// A new NIC with link layer `link_layer` (IB or Ethernet).
    pub(crate) fn nic_with_link_layer(&self, name: &str, link_layer: u8) -> Arc<FakeNic> {
        self.make_nic(name, link_layer, DeviceLimits::UNLIMITED)
    }

    /// A new RoCE NIC whose QPs, CQs and registrations stop at `limits` (creating one more
    /// fails with ENOMEM, as a device does).
    pub(crate) fn nic_with_limits(&self, name: &str, limits: DeviceLimits) -> Arc<FakeNic> {
        self.make_nic(name, super::device::LINK_LAYER_ETHERNET, limits)
    }

    fn make_nic(&self, name: &str, link_layer: u8, limits: DeviceLimits) -> Arc<FakeNic> {
        let mut w = self.world.lock();
        let index = w.nics.len();
        let mut gid = [0u8; 16];
        gid[10] = 0xff;
        gid[11] = 0xff;
        gid[12..].copy_from_slice(&[198, 18, index as u8 + 1, 1]);
        w.nics.push(NicEntry {
            gid,
            cut: None,
            lose_acks: false,
        });
        Arc::new(FakeNic {
            world: Arc::clone(&self.world),
            index,
            limits,
            usage: Arc::default(),
            moves_here: Default::default(),
            local: LocalPort {
                name: name.to_string(),
                port: 1,
                link_layer,
                active_mtu: 3,
                lid: 0,
                gid_index: 1,
                gid,
            },
        })
    }

    /// Holds posted work back (true), or carries it out as it is posted (false, the
    /// default; held work runs at once).
    pub(crate) fn hold(&self, on: bool) {
        let mut w = self.world.lock();
        w.hold = on;
        if !on {
            w.deliver(usize::MAX);
        }
    }

    /// Places the first `bytes` of the oldest held write without completing it: a write
    /// whose later bytes the NIC has not placed yet.
    pub(crate) fn place_partial(&self, bytes: usize) {
        let mut w = self.world.lock();
        let Some(op) = w.queue.front_mut() else {
            return;
        };
        let len = (op.local.1 as usize).min(bytes);
        if len > op.placed {
            let at = op.placed;
            match &op.inline {
                Some(d) => copy_from(&d[at..len], op.remote.0 as usize + at),
                None => copy(
                    op.local.0 as usize + at,
                    op.remote.0 as usize + at,
                    len - at,
                ),
            }
            op.placed = len;
        }
    }

    /// Cuts `nic`'s link (`Some`), or mends it (`None`, and held-back work runs).
    pub(crate) fn cut(&self, nic: &FakeNic, how: Option<Cut>) {
        let mut w = self.world.lock();
        w.nics[nic.index].cut = how;
        if how.is_none() && !w.hold {
            w.deliver(usize::MAX);
        }
    }

    /// Makes the work `nic` sends from now on take effect at the peer without ever completing
    /// here (its acknowledgements lost).
    pub(crate) fn lose_acks(&self, nic: &FakeNic) {
        self.world.lock().nics[nic.index].lose_acks = true;
    }

    /// From now on a requester retrying work over a lossy link ([`Cut::Egress`]) gives up
    /// after `bound` and fails it with a retry exceeded error, as a real NIC does once its
    /// `retry_cnt` retransmissions have timed out (Soft-RoCE: `NCCL_IB_RETRY_CNT` + 1 times
    /// `NCCL_IB_TIMEOUT`'s interval), instead of retrying for ever.
    pub(crate) fn retries_run_out(&self, bound: std::time::Duration) {
        self.world.lock().retries_for = Some(bound);
    }

    /// From now on a post to a QP in the error state fails with `EIO`, as rdma-core's eRDMA
    /// provider does (`erdma_post_send`), instead of completing as flushed (Soft-RoCE, mlx5).
    pub(crate) fn reject_posts_in_error(&self) {
        self.world.lock().reject_posts_in_error = true;
    }

    /// Posting send work to a QP of `nic` waits (the caller's thread) while `paused` (and at
    /// most 30 s), as a thread descheduled in the middle of a call does (a VM of one vCPU):
    /// its peer may answer meanwhile.
    pub(crate) fn pause_posts(&self, nic: &FakeNic, paused: bool) {
        let mut w = self.world.lock();
        w.posts_paused.retain(|n| *n != nic.index);
        if paused {
            w.posts_paused.push(nic.index);
        }
    }

    /// How many posts have waited in [`Self::pause_posts`] so far.
    pub(crate) fn posts_waited(&self) -> u32 {
        self.world.lock().posts_waited
    }

    /// Destroying a QP of `nic` waits (the caller's thread) while `held` (and at most 30 s),
    /// as Soft-RoCE's `__rxe_cleanup` waits for the QP's packets on a link gone down.
    pub(crate) fn hold_destroys(&self, nic: &FakeNic, held: bool) {
        let mut w = self.world.lock();
        w.destroys_held.retain(|n| *n != nic.index);
        if held {
            w.destroys_held.push(nic.index);
        }
    }

    /// Holds the receive completions of `nic`'s QPs back (`true`): the data is placed and the
    /// sender acknowledged, but the receiver's CQ shows nothing yet; `false` queues them.
    pub(crate) fn delay_receive_completions(&self, nic: &FakeNic, on: bool) {
        let mut w = self.world.lock();
        w.late_nics.retain(|n| *n != nic.index);
        if on {
            w.late_nics.push(nic.index);
            return;
        }
        let (released, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut w.late)
            .into_iter()
            .partition(|l| l.0 == nic.index);
        w.late = kept;
        for (_, cq, cqe) in released {
            if let Some(q) = w.cqs.get_mut(&cq) {
                q.queue.push_back(cqe);
            }
        }
    }

    /// Whether any CQ of the fabric was overrun (a completion lost for want of room).
    pub(crate) fn overrun(&self) -> bool {
        self.world.lock().cqs.values().any(|q| q.overrun)
    }

    /// Makes the work of QP `qpn` wait (`true`), as a link that loses its packets over and over
    /// while others of the NIC's QPs go on, or go on again (`false`).
    pub(crate) fn slow_qp(&self, qpn: u32, slow: bool) {
        let mut w = self.world.lock();
        w.slow.retain(|q| *q != qpn);
        if slow {
            w.slow.push(qpn);
        } else if !w.hold {
            w.deliver(usize::MAX);
        }
    }

    /// Makes the next work request on QP `qpn` fail with `status`.
    pub(crate) fn fail_next(&self, qpn: u32, status: u32) {
        if let Some(q) = self.world.lock().qps.get_mut(&qpn) {
            q.fail_next = Some(status);
        }
    }

    /// Makes every CQ poll fail with `errno` (`Some`), or succeed again (`None`).
    pub(crate) fn fail_polls(&self, errno: Option<i32>) {
        self.world.lock().poll_errno = errno;
    }

    /// Raises a fatal asynchronous event on `nic` (on QP `qpn`, or the whole device).
    pub(crate) fn fatal_event(&self, nic: &FakeNic, qpn: Option<u32>, what: &str) {
        self.world
            .lock()
            .fatal
            .push((nic.index, qpn, what.to_string()));
    }

    /// Marks `addr..addr+len` as GPU memory: the CPU cannot read it.
    pub(crate) fn device_memory(&self, addr: usize, len: usize) {
        self.world.lock().device_memory.push((addr, len));
    }
}

/// A NIC of a [`Fabric`].
pub(crate) struct FakeNic {
    world: Arc<Mutex<World>>,
    index: usize,
    local: LocalPort,
    limits: DeviceLimits,
    usage: Arc<Usage>,
    moves_here: MovesHere,
}

impl FakeNic {
    /// Waits while posts to this NIC are paused ([`Fabric::pause_posts`]).
    fn wait_while_paused(&self) {
        let paused = |w: &world::World| w.posts_paused.contains(&self.index);
        if !paused(&self.world.lock()) {
            return;
        }
        self.world.lock().posts_waited += 1;
        let since = std::time::Instant::now();
        while paused(&self.world.lock()) && since.elapsed() < std::time::Duration::from_secs(30) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// Counts one more `r`, or fails as a device out of them does.
    fn take(&self, r: Resource, what: &str) -> Result<Arc<Usage>> {
        let (held, limit) = match r {
            Resource::Qp => (self.usage.held().qps, self.limits.max_qp),
            Resource::Cq => (self.usage.held().cqs, self.limits.max_cq),
            Resource::Mr => (self.usage.held().mrs, self.limits.max_mr),
        };
        if held >= limit {
            return Err(Error::io(
                format!("fake {what}({})", self.local.name),
                std::io::Error::from_raw_os_error(libc::ENOMEM),
            ));
        }
        self.usage.add(r);
        Ok(Arc::clone(&self.usage))
    }
}

/// A QP of a [`FakeNic`]; destroyed on drop.
pub(crate) struct FakeQp {
    world: Arc<Mutex<World>>,
    usage: Arc<Usage>,
    qpn: u32,
    max_inline: u32,
    max_send_wr: u32,
}

/// A CQ of a [`FakeNic`].
pub(crate) struct FakeCq {
    world: Arc<Mutex<World>>,
    usage: Arc<Usage>,
    id: u32,
}

/// A registration on a [`FakeNic`]; deregistered on drop.
pub(crate) struct FakeMr {
    world: Arc<Mutex<World>>,
    usage: Arc<Usage>,
    key: u32,
}

impl QueuePair for FakeQp {
    fn qpn(&self) -> u32 {
        self.qpn
    }
    fn psn(&self) -> u32 {
        self.qpn & 0xff_ffff
    }
    fn max_inline(&self) -> u32 {
        self.max_inline
    }
    fn max_send_wr(&self) -> u32 {
        self.max_send_wr
    }
}

impl MemoryRegion for FakeMr {
    fn lkey(&self) -> u32 {
        self.key
    }
    fn rkey(&self) -> u32 {
        self.key
    }
}

impl Drop for FakeQp {
    fn drop(&mut self) {
        self.usage.remove(Resource::Qp);
        let mut w = self.world.lock();
        let nic = w.qps.remove(&self.qpn).map(|q| q.nic);
        let qpn = self.qpn;
        if let Some(n) = nic {
            w.destroyed.insert(qpn, n);
        }
        w.queue.retain(|op| op.qpn != qpn);
        w.late.retain(|l| l.2 .0.qp_num != qpn);
        drop(w);
        let since = std::time::Instant::now();
        while nic.is_some_and(|n| self.world.lock().destroys_held.contains(&n))
            && since.elapsed() < std::time::Duration::from_secs(30)
        {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

impl Drop for FakeCq {
    fn drop(&mut self) {
        self.usage.remove(Resource::Cq);
        self.world.lock().cqs.remove(&self.id);
    }
}

impl Drop for FakeMr {
    fn drop(&mut self) {
        self.usage.remove(Resource::Mr);
        self.world.lock().mrs.remove(&self.key);
    }
}

// SAFETY: `poll_cq` writes and returns at most `wcs.len()` queued completions.
unsafe impl Nic for FakeNic {
    type Qp = FakeQp;
    type Cq = Arc<FakeCq>;
    type Mr = FakeMr;

    fn local(&self) -> &LocalPort {
        &self.local
    }

    fn limits(&self) -> DeviceLimits {
        self.limits
    }

    fn held(&self) -> Held {
        self.usage.held()
    }

    fn create_cq(&self, entries: usize) -> Result<Arc<FakeCq>> {
        if entries > self.limits.max_cqe as usize {
            return Err(Error::io(
                format!("fake ibv_create_cq({}, {entries})", self.local.name),
                std::io::Error::from_raw_os_error(libc::EINVAL),
            ));
        }
        let usage = self.take(Resource::Cq, "ibv_create_cq")?;
        let mut w = self.world.lock();
        let id = w.id();
        w.cqs.insert(
            id,
            CqEntry {
                queue: VecDeque::new(),
                capacity: entries,
                overrun: false,
            },
        );
        Ok(Arc::new(FakeCq {
            world: Arc::clone(&self.world),
            usage,
            id,
        }))
    }

    fn create_qp(&self, cq: &Arc<FakeCq>, send: u32, recv: u32, max_inline: u32) -> Result<FakeQp> {
        if send.max(recv) > self.limits.max_qp_wr {
            return Err(Error::io(
                format!(
                    "fake ibv_create_qp({}, send {send} recv {recv})",
                    self.local.name
                ),
                std::io::Error::from_raw_os_error(libc::EINVAL),
            ));
        }
        let usage = self.take(Resource::Qp, "ibv_create_qp")?;
        let mut w = self.world.lock();
        let qpn = w.id();
        w.qps.insert(
            qpn,
            QpEntry {
                nic: self.index,
                cq: cq.id,
                remote: None,
                recvs: VecDeque::new(),
                error: false,
                fail_next: None,
                send_depth: u64::from(send),
                posted: 0,
                retired: 0,
                recv_depth: recv as usize,
            },
        );
        Ok(FakeQp {
            world: Arc::clone(&self.world),
            usage,
            qpn,
            max_inline,
            max_send_wr: send,
        })
    }

    fn connect_qp(&self, qp: &FakeQp, _path: &QpPath, remote: &RemoteQp) -> Result<()> {
        let mut w = self.world.lock();
        if w.nics[self.index].cut == Some(Cut::Down) {
            let e = std::io::Error::from_raw_os_error(libc::ENETUNREACH);
            return Err(Error::io("ibv_modify_qp to RTR (fake fabric)", e));
        }
        // A QP the peer destroyed meanwhile still takes the join, as on a real NIC (bringing
        // a QP up asks nothing of the peer); a QP number never made there is a wiring error.
        let remote_nic = w
            .qps
            .get(&remote.qpn)
            .map(|r| r.nic)
            .or_else(|| w.destroyed.get(&remote.qpn).copied());
        let gid_ok = remote_nic.is_some_and(|n| w.nics[n].gid == remote.gid);
        if !gid_ok {
            return Err(Error::remote(format!(
                "fake fabric: no QP {} behind the GID given",
                remote.qpn
            )));
        }
        w.qps.get_mut(&qp.qpn).expect("live QP").remote = Some(remote.qpn);
        Ok(())
    }

    fn fail_qp(&self, qp: &FakeQp) -> Result<()> {
        let mut w = self.world.lock();
        let q = w.qps.get_mut(&qp.qpn).expect("live QP");
        q.error = true;
        let (cq, recvs) = (q.cq, std::mem::take(&mut q.recvs));
        for wr_id in recvs {
            let wc = World::wc(wr_id, FLUSHED, ibv_wc_opcode::IBV_WC_RECV, qp.qpn);
            w.complete(cq, wc, None);
        }
        // Its queued work is flushed now, even on a silent link.
        let qpn = qp.qpn;
        let queued: Vec<Op> = w.queue.iter().filter(|op| op.qpn == qpn).cloned().collect();
        w.queue.retain(|op| op.qpn != qpn);
        for op in queued {
            w.fail(&op, FLUSHED);
        }
        Ok(())
    }

    fn register(&self, addr: usize, len: usize) -> Result<FakeMr> {
        let usage = self.take(Resource::Mr, "ibv_reg_mr")?;
        let mut w = self.world.lock();
        let key = w.id();
        w.mrs.insert(
            key,
            MrEntry {
                nic: self.index,
                addr,
                len,
            },
        );
        Ok(FakeMr {
            world: Arc::clone(&self.world),
            usage,
            key,
        })
    }

    fn post_send(&self, qp: &FakeQp, wr: &mut ibv_send_wr) -> Result<()> {
        self.wait_while_paused();
        let mut w = self.world.lock();
        let mut chain = 0;
        let mut p: *const ibv_send_wr = wr;
        while !p.is_null() {
            chain += 1;
            // SAFETY: as below.
            p = unsafe { (*p).next };
        }
        let reject = w.reject_posts_in_error;
        let q = w.qps.get_mut(&qp.qpn).expect("live QP");
        if reject && q.error {
            return Err(in_error("ibv_post_send", qp.qpn));
        }
        if q.posted - q.retired + chain > q.send_depth {
            return Err(Error::io(
                format!("fake fabric: ibv_post_send(qp {}): send queue full", qp.qpn),
                std::io::Error::from_raw_os_error(libc::ENOMEM),
            ));
        }
        let mut sq_seq = q.posted;
        q.posted += chain;
        let mut p: *const ibv_send_wr = wr;
        while !p.is_null() {
            // SAFETY: `SendChain` hands us a chain of valid work requests linked by `next`.
            let wr = unsafe { &*p };
            let sge = if wr.num_sge > 0 {
                // SAFETY: a request with an SGE points at a valid one.
                let s = unsafe { &*wr.sg_list };
                (s.addr, s.length, s.lkey)
            } else {
                (0, 0, 0)
            };
            let inline = (wr.send_flags & ibv_send_flags::IBV_SEND_INLINE.0 != 0).then(|| {
                let (addr, len) = (sge.0 as usize, sge.1 as usize);
                assert!(
                    !w.device_memory
                        .iter()
                        .any(|&(a, l)| addr < a + l && a < addr + len),
                    "inline data from GPU memory: the CPU cannot read it (a crash on a real NIC)"
                );
                // SAFETY: inline data is read by the CPU at post time, from memory the
                // caller owns for the call.
                unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec()
            });
            w.queue.push_back(Op {
                qpn: qp.qpn,
                wr_id: wr.wr_id,
                opcode: wr.opcode,
                signaled: wr.send_flags & ibv_send_flags::IBV_SEND_SIGNALED.0 != 0,
                local: sge,
                inline,
                // SAFETY: RDMA opcodes use the `rdma` member of the union.
                remote: unsafe { (wr.wr.rdma.remote_addr, wr.wr.rdma.rkey) },
                // SAFETY: the immediate member is plain data.
                imm_be: unsafe { wr.imm_data_invalidated_rkey_union.imm_data },
                placed: 0,
                landed: false,
                retried_since: None,
                sq_seq,
            });
            sq_seq += 1;
            p = wr.next;
        }
        if !w.hold {
            w.deliver(usize::MAX);
        }
        Ok(())
    }

    fn post_recv(&self, qp: &FakeQp, wr_id: u64) -> Result<()> {
        let mut w = self.world.lock();
        let reject = w.reject_posts_in_error;
        let q = w.qps.get_mut(&qp.qpn).expect("live QP");
        if reject && q.error {
            return Err(in_error("ibv_post_recv", qp.qpn));
        }
        if q.error {
            let cq = q.cq;
            let wc = World::wc(wr_id, FLUSHED, ibv_wc_opcode::IBV_WC_RECV, qp.qpn);
            w.complete(cq, wc, None);
            return Ok(());
        }
        if q.recvs.len() >= q.recv_depth {
            return Err(Error::io(
                format!(
                    "fake fabric: ibv_post_recv(qp {}): receive queue full",
                    qp.qpn
                ),
                std::io::Error::from_raw_os_error(libc::ENOMEM),
            ));
        }
        q.recvs.push_back(wr_id);
        if !w.hold {
            w.deliver(usize::MAX);
        }
        Ok(())
    }

    fn poll_cq(&self, cq: &Arc<FakeCq>, wcs: &mut [MaybeUninit<ibv_wc>]) -> Result<usize> {
        let mut w = self.world.lock();
        if let Some(errno) = w.poll_errno {
            return Err(Error::io(
                format!("fake fabric: ibv_poll_cq({})", self.local.name),
                std::io::Error::from_raw_os_error(errno),
            ));
        }
        if w.retries_for.is_some() && !w.hold {
            // The requesters' retry timers run meanwhile: work over a lossy link may fail.
            w.deliver(usize::MAX);
        }
        let q = w.cqs.get_mut(&cq.id).expect("live CQ");
        if q.overrun {
            return Err(Error::io(
                format!(
                    "fake fabric: ibv_poll_cq({}): completion queue overrun",
                    self.local.name
                ),
                std::io::Error::from_raw_os_error(libc::EIO),
            ));
        }
        let n = wcs.len().min(q.queue.len());
        let polled: Vec<_> = q.queue.drain(..n).collect();
        for (to, (wc, retires)) in wcs.iter_mut().zip(polled) {
            to.write(wc);
            if let Some((qpn, seq)) = retires {
                if let Some(q) = w.qps.get_mut(&qpn) {
                    // It and every request of its QP before it leave the send queue.
                    q.retired = q.retired.max(seq + 1);
                }
            }
        }
        Ok(n)
    }

    fn drain_async_events(&self) -> u64 {
        self.world.lock().fatal.len() as u64
    }

    fn fatal_for(&self, _cq: &Arc<FakeCq>, qpns: &[u32]) -> Option<String> {
        let w = self.world.lock();
        w.fatal
            .iter()
            .find(|(nic, qpn, _)| *nic == self.index && qpn.is_none_or(|q| qpns.contains(&q)))
            .map(|(_, _, what)| format!("{}: {what}", self.local.name))
    }

    fn port_active(&self) -> bool {
        self.world.lock().nics[self.index].cut != Some(Cut::Down)
    }

    fn moves_here(&self) -> &MovesHere {
        &self.moves_here
    }

    fn status_str(&self, status: u32) -> String {
        match status {
            0 => "success",
            ibv_wc_status::IBV_WC_LOC_PROT_ERR => "local protection error",
            ibv_wc_status::IBV_WC_WR_FLUSH_ERR => "Work Request Flushed Error",
            ibv_wc_status::IBV_WC_REM_ACCESS_ERR => "remote access error",
            ibv_wc_status::IBV_WC_RETRY_EXC_ERR => "transport retry counter exceeded",
            _ => "other error",
        }
        .to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_receive_beyond_the_queue_depth_fails_as_ibv_post_recv_does() {
        let fabric = Fabric::new();
        let nic = fabric.nic("fake0");
        let cq = nic.create_cq(16).unwrap();
        let qp = nic.create_qp(&cq, 4, 2, 0).unwrap();
        nic.post_recv(&qp, 1).unwrap();
        nic.post_recv(&qp, 2).unwrap();
        let e = nic.post_recv(&qp, 3).unwrap_err();
        assert!(e.to_string().contains("receive queue full"), "{e}");
    }
}
