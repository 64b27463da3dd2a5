//! An RC queue pair: created on a PD with its CQ, taken through INIT, RTR and RTS to its
//! peer, and posted to through the provider's own `post_send`/`post_recv` (read once).
//! Destroyed when dropped, after whatever it posted: it holds its PD and CQ.

use std::sync::{
    atomic::{AtomicU64, Ordering},
    Arc,
};

use rdma_sys::*;

use super::limits::Resource;
use super::resources::{errno_rc, no_op, verbs_error, Cq, Pd};
use crate::error::{Error, Result};

/// The type of a provider's `post_send`.
type PostSendFn = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> i32;
/// The type of a provider's `post_recv`.
type PostRecvFn = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> i32;

static NEXT_PSN: AtomicU64 = AtomicU64::new(0);

/// What a QP needs to know about its remote end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RemoteQp {
    /// Remote QP number.
    pub(crate) qpn: u32,
    /// Remote initial packet sequence number.
    pub(crate) psn: u32,
    /// Remote GID.
    pub(crate) gid: [u8; 16],
    /// Remote LID (IB).
    pub(crate) lid: u16,
}

/// Local settings for RTR/RTS.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QpPath {
    /// Port number.
    pub(crate) port: u8,
    /// True for Ethernet (RoCE/eRDMA): GRH routing with GIDs.
    pub(crate) roce: bool,
    /// Local GID index.
    pub(crate) gid_index: u8,
    /// Path MTU (`ibv_mtu` value).
    pub(crate) mtu: u32,
    /// Traffic class.
    pub(crate) traffic_class: u8,
    /// Service level.
    pub(crate) sl: u8,
    /// Local ACK timeout exponent.
    pub(crate) timeout: u8,
    /// Retry count.
    pub(crate) retry_cnt: u8,
}

/// An RC queue pair.
pub(crate) struct Qp {
    raw: *mut ibv_qp,
    /// The provider's `post_send` and `post_recv`, read once: each post is one call.
    post_send_fn: PostSendFn,
    post_recv_fn: PostRecvFn,
    pd: Arc<Pd>,
    _cq: Arc<Cq>,
    /// Initial send PSN.
    pub(crate) psn: u32,
    /// Inline data limit actually granted.
    pub(crate) max_inline: u32,
    /// Send queue depth actually granted (at least what was asked for).
    pub(crate) max_send_wr: u32,
}

// SAFETY: QPs are libibverbs objects; posting is done by the one thread driving the comm
// (and libibverbs serialises per-QP posting internally anyway).
unsafe impl Send for Qp {}
// SAFETY: as above.
unsafe impl Sync for Qp {}

impl Qp {
    /// Creates an RC QP on `pd` using `cq` for both queues; asks for `max_inline` bytes of
    /// inline data and falls back to none when the device refuses.
    pub(crate) fn new(
        pd: &Arc<Pd>,
        cq: &Arc<Cq>,
        max_send_wr: u32,
        max_recv_wr: u32,
        max_inline: u32,
    ) -> Result<Self> {
        let mut last = None;
        for inline in [max_inline, 0] {
            // SAFETY: all-zero is a valid init attr.
            let mut attr: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
            attr.send_cq = cq.raw;
            attr.recv_cq = cq.raw;
            attr.qp_type = ibv_qp_type::IBV_QPT_RC;
            attr.cap.max_send_wr = max_send_wr;
            attr.cap.max_recv_wr = max_recv_wr;
            attr.cap.max_send_sge = 1;
            attr.cap.max_recv_sge = 1;
            attr.cap.max_inline_data = inline;
            // SAFETY: pd and cq are live; attr is fully initialised.
            let raw = unsafe { (pd.ctx.lib.create_qp)(pd.raw, &mut attr) };
            if raw.is_null() {
                last = Some(Error::last_os(format!(
                    "ibv_create_qp({}, send {max_send_wr} recv {max_recv_wr} inline {inline})",
                    pd.ctx.name
                )));
                continue;
            }
            // SAFETY: raw is live; the provider's ops table belongs to its context.
            let ops = unsafe { &(*(*raw).context).ops };
            let (Some(post_send_fn), Some(post_recv_fn)) = (ops.post_send, ops.post_recv) else {
                // SAFETY: raw was just created, and is destroyed once.
                unsafe { (pd.ctx.lib.destroy_qp)(raw) };
                return Err(no_op("post_send or post_recv"));
            };
            let psn = (NEXT_PSN.fetch_add(0x9e37, Ordering::Relaxed) as u32
                ^ crate::random::random_u64() as u32)
                & 0xff_ffff;
            pd.ctx.usage.add(Resource::Qp);
            return Ok(Qp {
                raw,
                post_send_fn,
                post_recv_fn,
                pd: Arc::clone(pd),
                _cq: Arc::clone(cq),
                psn,
                max_inline: attr.cap.max_inline_data.min(inline),
                max_send_wr: attr.cap.max_send_wr.max(max_send_wr),
            });
        }
        Err(last.expect("at least one attempt"))
    }

    /// QP number.
    pub(crate) fn qpn(&self) -> u32 {
        // SAFETY: raw is live.
        unsafe { (*self.raw).qp_num }
    }

    fn modify(&self, attr: &mut ibv_qp_attr, mask: ibv_qp_attr_mask, what: &str) -> Result<()> {
        // SAFETY: raw is live; attr is initialised for every bit in mask.
        let rc = unsafe { (self.pd.ctx.lib.modify_qp)(self.raw, attr, mask.0 as i32) };
        errno_rc(rc, || {
            format!(
                "ibv_modify_qp({} qp {} to {what})",
                self.pd.ctx.name,
                self.qpn()
            )
        })
    }

    /// RESET -> INIT on `port` with partition key index `pkey_index` and `access` for remote
    /// operations.
    pub(crate) fn to_init(&self, port: u8, pkey_index: u16, access: u32) -> Result<()> {
        // SAFETY: all-zero is a valid attr.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = pkey_index;
        a.port_num = port;
        a.qp_access_flags = access;
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
            | ibv_qp_attr_mask::IBV_QP_PORT
            | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
        self.modify(&mut a, mask, "INIT")
    }

    /// INIT -> RTR towards `remote`.
    pub(crate) fn to_rtr(&self, path: &QpPath, remote: &RemoteQp) -> Result<()> {
        // SAFETY: all-zero is a valid attr.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = path.mtu;
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn;
        a.max_dest_rd_atomic = 1;
        a.min_rnr_timer = 12;
        a.ah_attr.port_num = path.port;
        a.ah_attr.sl = path.sl;
        if path.roce {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid.raw = remote.gid;
            a.ah_attr.grh.flow_label = 0;
            a.ah_attr.grh.sgid_index = path.gid_index;
            a.ah_attr.grh.hop_limit = 255;
            a.ah_attr.grh.traffic_class = path.traffic_class;
        } else {
            a.ah_attr.dlid = remote.lid;
        }
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_AV
            | ibv_qp_attr_mask::IBV_QP_PATH_MTU
            | ibv_qp_attr_mask::IBV_QP_DEST_QPN
            | ibv_qp_attr_mask::IBV_QP_RQ_PSN
            | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
            | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
        self.modify(&mut a, mask, "RTR").map_err(|mut e| {
            if let Some((context, source)) = e.os_context_mut() {
                if source.raw_os_error() == Some(libc::EINVAL) {
                    context.push_str(
                        " (EINVAL usually means an unusable GID index: check NCCL_IB_GID_INDEX \
                         / NCCL_IB_ADDR_FAMILY)",
                    );
                }
            }
            e
        })
    }

    /// RTR -> RTS.
    pub(crate) fn to_rts(&self, path: &QpPath) -> Result<()> {
        // SAFETY: all-zero is a valid attr.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTS;
        a.timeout = path.timeout;
        a.retry_cnt = path.retry_cnt;
        a.rnr_retry = 7;
        a.sq_psn = self.psn;
        a.max_rd_atomic = 1;
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_TIMEOUT
            | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
            | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
            | ibv_qp_attr_mask::IBV_QP_SQ_PSN
            | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC;
        self.modify(&mut a, mask, "RTS")
    }

    /// Any state -> ERROR: the QP stops sending and receiving, and its outstanding work
    /// requests complete as flushed (a connection moving off a failed path).
    pub(crate) fn to_error(&self) -> Result<()> {
        // SAFETY: all-zero is a valid attr.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_ERR;
        self.modify(&mut a, ibv_qp_attr_mask::IBV_QP_STATE, "ERROR")
    }

    /// Posts a chain of send work requests.
    #[inline(always)]
    pub(crate) fn post_send(&self, wr: &mut ibv_send_wr) -> Result<()> {
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: raw is live, post_send_fn its provider's; wr heads a valid chain whose
        // SGEs point at registered memory that the caller keeps alive until completion.
        // Inline data is copied by the CPU at post, so callers set IBV_SEND_INLINE only on
        // host memory (never a GPU address).
        let rc = unsafe { (self.post_send_fn)(self.raw, wr, &mut bad) };
        if rc != 0 {
            return Err(self.post_error("ibv_post_send", rc));
        }
        Ok(())
    }

    /// Posts one zero-SGE receive (WRITE_WITH_IMM consumes one per message).
    #[inline(always)]
    pub(crate) fn post_recv(&self, wr_id: u64) -> Result<()> {
        // SAFETY: all-zero is a valid receive WR (no SGE, no next).
        let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: raw is live, post_recv_fn its provider's; wr is a single valid WR.
        let rc = unsafe { (self.post_recv_fn)(self.raw, &mut wr, &mut bad) };
        if rc != 0 {
            return Err(self.post_error("ibv_post_recv", rc));
        }
        Ok(())
    }

    #[cold]
    #[inline(never)]
    fn post_error(&self, call: &str, rc: i32) -> Error {
        // errno first: building the message may change it.
        let e = verbs_error(rc);
        Error::io(format!("{call}({} qp {})", self.pd.ctx.name, self.qpn()), e)
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: raw is live and destroyed once; in-flight WRs are flushed by the device.
        let rc = unsafe { (self.pd.ctx.lib.destroy_qp)(self.raw) };
        self.pd.ctx.usage.remove(Resource::Qp);
        if rc != 0 {
            tracing::warn!("ibv_destroy_qp({}) failed: {rc}", self.pd.ctx.name);
        }
    }
}
