//! Memory the plugin itself registers for RDMA (the clear-to-send FIFO, size records,
//! staging areas), the work-request chains posted on the data path and completion batches.
//! Everything the NIC reads or writes behind the CPU's back is accessed here, with volatile
//! reads and fences, so the transports stay free of `unsafe`.

use std::{
    alloc::{self, Layout},
    marker::PhantomData,
    mem::MaybeUninit,
    sync::atomic,
};

use rdma_sys::*;

use super::nic::Nic;
use crate::error::{Error, Result};

/// `IBV_ACCESS_LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ`.
pub(crate) const ACCESS_RDMA: u32 = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
    | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
    | ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;

/// The size of a memory page (`sysconf(_SC_PAGESIZE)`), which registration pins and, where
/// `ibv_fork_init` is active on a kernel without copy-on-fork for pinned memory, marks
/// `MADV_DONTFORK` as a whole.
pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size)
        .ok()
        .filter(|s| s.is_power_of_two())
        .unwrap_or(4096)
}

/// The layout of a registered array of `len` elements of `T`: whole pages, page-aligned, so
/// it shares no page with other heap memory. (Were it to share one, a registration under
/// `ibv_fork_init` would mark a page DONTFORK that ordinary allocations also live in, and a
/// forked child touching one of those would crash.)
pub(crate) fn page_layout<T>(len: usize) -> Option<Layout> {
    let page = page_size();
    let bytes = std::mem::size_of::<T>().checked_mul(len.max(1))?;
    Layout::from_size_align(bytes.checked_next_multiple_of(page)?, page).ok()
}

/// Most registrations (one per NIC of a connection) a [`DmaBuffer`] holds.
pub(crate) const MAX_REGISTRATIONS: usize = 8;

/// A zeroed array of `T` in whole pages of its own, registered by the caller's function on
/// each NIC (rail) that reads or writes it. The peer may write it at any time, so reads are
/// volatile.
pub(crate) struct DmaBuffer<T: Copy, R> {
    regs: Vec<R>,
    /// (lkey, rkey) of each registration.
    keys: [(u32, u32); MAX_REGISTRATIONS],
    ptr: *mut T,
    len: usize,
    layout: Layout,
    _t: PhantomData<T>,
}

// SAFETY: the buffer is plain memory owned by this value; concurrent NIC writes are the
// reason every access is volatile. The owning comm serialises CPU access.
unsafe impl<T: Copy + Send, R: Send> Send for DmaBuffer<T, R> {}
// SAFETY: as above.
unsafe impl<T: Copy + Send, R: Sync> Sync for DmaBuffer<T, R> {}

impl<T: Copy, R> DmaBuffer<T, R> {
    /// Allocates `len` zeroed elements and registers them `regs` times (1 to
    /// [`MAX_REGISTRATIONS`]) with `register(i, addr, bytes)`, which returns registration `i`
    /// and its (lkey, rkey).
    pub(crate) fn new(
        len: usize,
        regs: usize,
        mut register: impl FnMut(usize, usize, usize) -> Result<(R, u32, u32)>,
    ) -> Result<Self> {
        assert!((1..=MAX_REGISTRATIONS).contains(&regs));
        let layout = page_layout::<T>(len)
            .filter(|l| l.align() >= std::mem::align_of::<T>())
            .ok_or_else(|| Error::misuse(format!("buffer of {len} elements")))?;
        // SAFETY: the layout has non-zero size; T: Copy is plain data for which all-zero
        // bytes are the initial value the protocol expects.
        let ptr = unsafe { alloc::alloc_zeroed(layout) } as *mut T;
        if ptr.is_null() {
            return Err(Error::io(
                "allocating a registered buffer",
                std::io::Error::from(std::io::ErrorKind::OutOfMemory),
            ));
        }
        let mut buf = DmaBuffer {
            regs: Vec::with_capacity(regs),
            keys: [(0, 0); MAX_REGISTRATIONS],
            ptr,
            len,
            layout,
            _t: PhantomData,
        };
        for i in 0..regs {
            let (mr, lkey, rkey) = register(i, ptr as usize, layout.size())?;
            buf.regs.push(mr);
            buf.keys[i] = (lkey, rkey);
        }
        Ok(buf)
    }

    /// Registers the buffer's pages `regs` more times with `register(i, addr, bytes)`, without
    /// keeping the registrations: for a connection moving to other NICs, which
    /// [`Self::adopt`] them (or keeps them itself, for a buffer it shares).
    pub(crate) fn register_again(
        &self,
        regs: usize,
        mut register: impl FnMut(usize, usize, usize) -> Result<(R, u32, u32)>,
    ) -> Result<Vec<(R, u32, u32)>> {
        (0..regs)
            .map(|i| register(i, self.ptr as usize, self.layout.size()))
            .collect()
    }

    /// Uses `regs` (from [`Self::register_again`]) from now on; returns the registrations
    /// they replace, to be dropped once no work request names them.
    pub(crate) fn adopt(&mut self, regs: Vec<(R, u32, u32)>) -> Vec<R> {
        assert!((1..=MAX_REGISTRATIONS).contains(&regs.len()));
        let mut fresh = Vec::with_capacity(regs.len());
        for (i, (mr, lkey, rkey)) in regs.into_iter().enumerate() {
            fresh.push(mr);
            self.keys[i] = (lkey, rkey);
        }
        std::mem::replace(&mut self.regs, fresh)
    }

    /// Bytes allocated (whole pages).
    #[cfg(test)]
    fn allocated(&self) -> usize {
        self.layout.size()
    }

    /// Reads element `i`, which the NIC has finished writing (a peer's write announced by the
    /// sequence number [`Self::get_u64`] read, or one whose completion was polled).
    #[inline(always)]
    pub(crate) fn get(&self, i: usize) -> T {
        self.read(i, |e| *e)
    }

    /// What `f` reads of element `i`, which the NIC has finished writing (as for
    /// [`Self::get`]), without copying the rest of the element.
    #[inline(always)]
    pub(crate) fn read<U>(&self, i: usize, f: impl FnOnce(&T) -> U) -> U {
        assert!(i < self.len);
        // Nothing here may move before the read that said the element has landed.
        atomic::fence(atomic::Ordering::Acquire);
        // SAFETY: i < len inside our allocation, and nothing writes the element while the
        // reference lives. Plain reads: they let the compiler load only the fields used.
        f(unsafe { &*self.ptr.add(i) })
    }

    /// Reads the `u64` at byte `offset` of element `i` as the NIC last wrote it, before any
    /// later read: the sequence number a peer's write places in the last bytes of an element,
    /// checked before the rest of it is read. (A read of the whole element is several loads in
    /// no set order, so it could pair a new sequence number with fields the write had not yet
    /// placed.) An aligned 8-byte word is placed by one PCIe write, never torn.
    #[inline(always)]
    pub(crate) fn get_u64(&self, i: usize, offset: usize) -> u64 {
        assert!(i < self.len && offset + 8 <= std::mem::size_of::<T>() && offset % 8 == 0);
        assert!(std::mem::align_of::<T>() >= 8);
        // SAFETY: the u64 lies inside element i of our allocation (checked above), and is
        // 8-aligned: elements are at least 8-aligned and the offset is a multiple of 8.
        let v = unsafe {
            std::ptr::read_volatile((self.ptr.add(i) as *const u8).add(offset) as *const u64)
        };
        atomic::fence(atomic::Ordering::Acquire);
        v
    }

    /// Writes element `i`, for the NIC to read once a work request naming it is posted.
    #[inline(always)]
    pub(crate) fn set(&self, i: usize, v: T) {
        assert!(i < self.len);
        // SAFETY: i < len inside our allocation. A plain write: the NIC reads it only after
        // the post, a call into the provider that no write can be moved across.
        unsafe { std::ptr::write(self.ptr.add(i), v) };
    }

    /// Address of element `i`, for work requests.
    pub(crate) fn addr(&self, i: usize) -> u64 {
        self.ptr as u64 + (i * std::mem::size_of::<T>()) as u64
    }

    /// Local key of registration (rail) `i`.
    #[inline(always)]
    pub(crate) fn lkey(&self, i: usize) -> u32 {
        self.keys[i].0
    }

    /// Remote key of registration (rail) `i`.
    #[inline(always)]
    pub(crate) fn rkey(&self, i: usize) -> u32 {
        self.keys[i].1
    }
}

impl<T: Copy, R> Drop for DmaBuffer<T, R> {
    fn drop(&mut self) {
        // Deregister before freeing the memory.
        self.regs.clear();
        // SAFETY: ptr was allocated with this layout in new and is freed once.
        unsafe { alloc::dealloc(self.ptr as *mut u8, self.layout) };
    }
}

/// Most work requests one chain carries: 8 data writes and the completion write.
pub(crate) const MAX_CHAIN: usize = 10;

/// A chain of send work requests built without allocation and posted on one QP.
pub(crate) struct SendChain {
    wrs: [ibv_send_wr; MAX_CHAIN],
    sges: [ibv_sge; MAX_CHAIN],
    len: usize,
}

// SAFETY: the chain holds only plain data and pointers into itself, which are rebuilt at
// every post.
unsafe impl Send for SendChain {}

impl Default for SendChain {
    fn default() -> Self {
        Self::new()
    }
}

impl SendChain {
    /// An empty chain.
    pub(crate) fn new() -> Self {
        SendChain {
            // SAFETY: all-zero is a valid (empty) work request and SGE.
            wrs: unsafe { std::mem::zeroed() },
            // SAFETY: as above.
            sges: unsafe { std::mem::zeroed() },
            len: 0,
        }
    }

    /// Empties the chain.
    pub(crate) fn clear(&mut self) {
        self.len = 0;
    }

    /// True when empty.
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Work requests in the chain.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn push(&mut self, opcode: ibv_wr_opcode::Type, local: (u64, u32, u32), remote: (u64, u32)) {
        assert!(self.len < MAX_CHAIN, "work request chain overflow");
        let i = self.len;
        self.sges[i] = ibv_sge {
            addr: local.0,
            length: local.1,
            lkey: local.2,
        };
        let wr = &mut self.wrs[i];
        wr.wr_id = 0;
        wr.next = std::ptr::null_mut();
        wr.num_sge = i32::from(local.1 > 0);
        wr.opcode = opcode;
        wr.send_flags = 0;
        wr.imm_data_invalidated_rkey_union.imm_data = 0;
        wr.wr.rdma = rdma_t {
            remote_addr: remote.0,
            rkey: remote.1,
        };
        self.len += 1;
    }

    /// Appends an RDMA WRITE of `len` bytes from `local` (lkey) to `remote` (rkey).
    pub(crate) fn write(&mut self, local: u64, len: u32, lkey: u32, remote: u64, rkey: u32) {
        self.push(
            ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            (local, len, lkey),
            (remote, rkey),
        );
    }

    /// Appends an RDMA WRITE WITH IMMEDIATE (`imm` in host order).
    pub(crate) fn write_imm(
        &mut self,
        local: u64,
        len: u32,
        lkey: u32,
        remote: u64,
        rkey: u32,
        imm: u32,
    ) {
        self.push(
            ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
            (local, len, lkey),
            (remote, rkey),
        );
        self.wrs[self.len - 1]
            .imm_data_invalidated_rkey_union
            .imm_data = imm.to_be();
    }

    /// Turns the last RDMA WRITE into a WRITE WITH IMMEDIATE.
    pub(crate) fn last_with_imm(&mut self, imm: u32) {
        let wr = &mut self.wrs[self.len - 1];
        wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
        wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
    }

    /// Appends an RDMA READ of `len` bytes from `remote` into `local`.
    pub(crate) fn read(&mut self, local: u64, len: u32, lkey: u32, remote: u64, rkey: u32) {
        self.push(
            ibv_wr_opcode::IBV_WR_RDMA_READ,
            (local, len, lkey),
            (remote, rkey),
        );
    }

    /// Signals the last request with `wr_id`; marks small writes inline (`max_inline`: 0
    /// when any source is GPU memory, which the CPU cannot copy at post).
    pub(crate) fn finish(&mut self, wr_id: u64, max_inline: u32) {
        for i in 0..self.len {
            self.wrs[i].send_flags |=
                inline_flag(self.wrs[i].opcode, self.sges[i].length, max_inline);
        }
        let last = &mut self.wrs[self.len - 1];
        last.wr_id = wr_id;
        last.send_flags |= ibv_send_flags::IBV_SEND_SIGNALED.0;
    }

    /// Posts the chain on `qp` of `nic`.
    pub(crate) fn post<N: Nic>(&mut self, nic: &N, qp: &N::Qp) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        let base = self.wrs.as_mut_ptr();
        for i in 0..self.len {
            let sge = &mut self.sges[i] as *mut ibv_sge;
            let wr = &mut self.wrs[i];
            wr.sg_list = sge;
            wr.next = if i + 1 < self.len {
                // SAFETY: i + 1 < len <= MAX_CHAIN, inside the array.
                unsafe { base.add(i + 1) }
            } else {
                std::ptr::null_mut()
            };
        }
        nic.post_send(qp, &mut self.wrs[0])
    }
}

/// One RDMA WRITE from fixed local memory to fixed remote memory (a registration each, as
/// the receiver's clear-to-send FIFO and its copy at the sender), built once: a post sets
/// only what changes (addresses, length, id, flags), not the whole work request.
pub(crate) struct FixedWrite {
    wr: ibv_send_wr,
    sge: ibv_sge,
}

// SAFETY: plain data; the one pointer (to its own SGE) is set again at every post.
unsafe impl Send for FixedWrite {}

impl FixedWrite {
    /// A write from memory of local key `lkey` to remote memory of key `rkey`.
    pub(crate) fn new(lkey: u32, rkey: u32) -> Self {
        // SAFETY: all-zero is a valid (empty) work request and SGE.
        let mut w: FixedWrite = unsafe { std::mem::zeroed() };
        w.sge.lkey = lkey;
        w.wr.num_sge = 1;
        w.wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE;
        w.wr.wr.rdma.rkey = rkey;
        w
    }

    /// Posts the write of `len` (> 0) bytes at `local` to `remote` on `qp` of `nic`, with
    /// `wr_id`, signaled or not, inline when at most `max_inline` bytes (host memory only).
    #[allow(clippy::too_many_arguments)] // the fields that change
    #[inline(always)]
    pub(crate) fn post<N: Nic>(
        &mut self,
        nic: &N,
        qp: &N::Qp,
        (local, len): (u64, u32),
        remote: u64,
        wr_id: u64,
        signaled: bool,
        max_inline: u32,
    ) -> Result<()> {
        self.sge.addr = local;
        self.sge.length = len;
        // The value may have moved since the last post.
        self.wr.sg_list = &mut self.sge;
        self.wr.wr.rdma.remote_addr = remote;
        self.wr.wr_id = wr_id;
        let mut flags = if len <= max_inline {
            ibv_send_flags::IBV_SEND_INLINE.0
        } else {
            0
        };
        if signaled {
            flags |= ibv_send_flags::IBV_SEND_SIGNALED.0;
        }
        self.wr.send_flags = flags;
        nic.post_send(qp, &mut self.wr)
    }
}

/// One signaled RDMA WRITE WITH IMMEDIATE, built once: a post sets only what changes
/// (addresses, keys, length, immediate, id, flags). A single message's send, without the
/// chain's per-request bookkeeping.
pub(crate) struct WriteImm {
    wr: ibv_send_wr,
    sge: ibv_sge,
}

// SAFETY: plain data; the one pointer (to its own SGE) is set again at every post.
unsafe impl Send for WriteImm {}

impl Default for WriteImm {
    fn default() -> Self {
        // SAFETY: all-zero is a valid (empty) work request and SGE.
        let mut w: WriteImm = unsafe { std::mem::zeroed() };
        w.wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
        w
    }
}

impl WriteImm {
    /// Posts the write of `local` (address, length, lkey) to `remote` (address, rkey) on
    /// `qp` of `nic`, carrying `imm` (host order), with `wr_id`; inline when a non-empty
    /// write of at most `max_inline` bytes (0 for GPU memory, which the CPU cannot copy at
    /// post).
    #[inline(always)]
    pub(crate) fn post<N: Nic>(
        &mut self,
        nic: &N,
        qp: &N::Qp,
        (local, remote): ((u64, u32, u32), (u64, u32)),
        imm: u32,
        wr_id: u64,
        max_inline: u32,
    ) -> Result<()> {
        self.sge = ibv_sge {
            addr: local.0,
            length: local.1,
            lkey: local.2,
        };
        // The value may have moved since the last post.
        self.wr.sg_list = &mut self.sge;
        self.wr.num_sge = i32::from(local.1 > 0);
        self.wr.wr.rdma = rdma_t {
            remote_addr: remote.0,
            rkey: remote.1,
        };
        self.wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
        self.wr.wr_id = wr_id;
        self.wr.send_flags = inline_flag(
            ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
            local.1,
            max_inline,
        ) | ibv_send_flags::IBV_SEND_SIGNALED.0;
        nic.post_send(qp, &mut self.wr)
    }
}

/// `IBV_SEND_INLINE` for a non-empty write of at most `max_inline` bytes, else 0.
#[inline]
fn inline_flag(opcode: ibv_wr_opcode::Type, length: u32, max_inline: u32) -> u32 {
    let is_write = opcode != ibv_wr_opcode::IBV_WR_RDMA_READ;
    if is_write && length > 0 && length <= max_inline {
        ibv_send_flags::IBV_SEND_INLINE.0
    } else {
        0
    }
}

/// Up to [`WcBatch::CAPACITY`] work completions from one poll. A batch lives on the stack of
/// the call that polls: its entries start unwritten (making one stores only the count), and
/// only what a poll wrote is ever read.
pub(crate) struct WcBatch {
    wcs: [MaybeUninit<ibv_wc>; WcBatch::CAPACITY],
    /// The first `n` entries hold what the last poll returned.
    n: usize,
}

/// One work completion of a [`WcBatch`], read in place: the data path reads two or three
/// of its fields, the error path the rest.
#[derive(Clone, Copy)]
pub(crate) struct Completion<'a>(&'a ibv_wc);

impl Completion<'_> {
    /// Work request id.
    #[inline(always)]
    pub(crate) fn wr_id(&self) -> u64 {
        self.0.wr_id
    }

    /// `ibv_wc_status`.
    #[inline(always)]
    pub(crate) fn status(&self) -> u32 {
        self.0.status
    }

    /// The status, named (for a failed completion).
    pub(crate) fn wc_status(&self) -> WcStatus {
        WcStatus::of(self.0.status)
    }

    /// `ibv_wc_opcode`.
    #[inline(always)]
    pub(crate) fn opcode(&self) -> u32 {
        self.0.opcode
    }

    /// Whether it completes a request of the send queue (this side's signaled work) rather
    /// than a receive: verbs numbers the receive opcodes from `IBV_WC_RECV` (128) up.
    #[inline(always)]
    pub(crate) fn of_send_queue(&self) -> bool {
        self.0.opcode & ibv_wc_opcode::IBV_WC_RECV == 0
    }

    /// Vendor error.
    pub(crate) fn vendor_err(&self) -> u32 {
        self.0.vendor_err
    }

    /// Local QP number.
    pub(crate) fn qp_num(&self) -> u32 {
        self.0.qp_num
    }

    /// The immediate data (host order) of a receive consumed by a WRITE_WITH_IMM
    /// (`IBV_WC_RECV_RDMA_WITH_IMM`), which always carries one: no flag to test.
    #[inline(always)]
    pub(crate) fn write_imm(&self) -> u32 {
        debug_assert_eq!(self.0.opcode, WC_RECV_RDMA_WITH_IMM);
        // SAFETY: a plain u32 in a union of u32s; any bits are a valid value.
        u32::from_be(unsafe { self.0.imm_data_invalidated_rkey_union.imm_data })
    }
}

impl Default for WcBatch {
    fn default() -> Self {
        Self::new()
    }
}

impl WcBatch {
    /// Completions one poll may return.
    pub(crate) const CAPACITY: usize = 16;

    /// An empty batch.
    #[inline(always)]
    pub(crate) fn new() -> Self {
        WcBatch {
            wcs: [const { MaybeUninit::uninit() }; WcBatch::CAPACITY],
            n: 0,
        }
    }

    /// Polls `cq` of `nic` into the batch; returns how many completions arrived.
    #[inline(always)]
    pub(crate) fn poll<N: Nic>(&mut self, nic: &N, cq: &N::Cq) -> Result<usize> {
        let polled = nic.poll_cq(cq, &mut self.wcs);
        // Empty should the poll fail: nothing of an earlier poll is handed out twice.
        self.n = *polled.as_ref().unwrap_or(&0);
        polled
    }

    /// [`Self::poll`], `None` where it fails, without saying why (the next poll meets the
    /// error again and reports it).
    #[inline(always)]
    pub(crate) fn try_poll<N: Nic>(&mut self, nic: &N, cq: &N::Cq) -> Option<usize> {
        let polled = nic.try_poll_cq(cq, &mut self.wcs);
        self.n = polled.unwrap_or(0);
        polled
    }

    /// How many completions the last poll returned.
    #[inline(always)]
    pub(crate) fn polled(&self) -> usize {
        self.n
    }

    /// The completions of the last poll.
    #[inline(always)]
    fn written(&self) -> &[ibv_wc] {
        // SAFETY: `n` is 0 until a poll succeeds, and then how many entries `poll_cq` wrote,
        // from the first: at most the capacity, as `Nic` promises.
        unsafe { std::slice::from_raw_parts(self.wcs.as_ptr().cast::<ibv_wc>(), self.n) }
    }

    /// The completions of the last poll, in order.
    #[inline(always)]
    pub(crate) fn iter(&self) -> impl Iterator<Item = Completion<'_>> {
        self.written().iter().map(Completion)
    }
}

/// `IBV_WC_SUCCESS`.
pub(crate) const WC_SUCCESS: u32 = ibv_wc_status::IBV_WC_SUCCESS;

/// A failed completion's `ibv_wc_status`, named (what a status means for the connection is
/// decided by the transport, on these names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WcStatus {
    Success,
    LocalLength,
    /// A local QP operation error: Soft-RoCE reports a link gone down so.
    LocalQpOperation,
    LocalProtection,
    /// Flushed: the QP was already broken (by an earlier error, or moved to the error state).
    Flushed,
    MemoryWindowBind,
    BadResponse,
    LocalAccess,
    RemoteInvalidRequest,
    RemoteAccess,
    RemoteOperation,
    /// The transport's retries ran out: the peer did not acknowledge.
    RetryExceeded,
    ReceiverNotReadyRetryExceeded,
    RemoteAbort,
    Fatal,
    ResponseTimeout,
    General,
    /// Any other value (reliable datagram, tag matching).
    Other(u32),
}

impl WcStatus {
    /// The name of `status`.
    pub(crate) fn of(status: u32) -> Self {
        use ibv_wc_status::*;
        match status {
            IBV_WC_SUCCESS => WcStatus::Success,
            IBV_WC_LOC_LEN_ERR => WcStatus::LocalLength,
            IBV_WC_LOC_QP_OP_ERR => WcStatus::LocalQpOperation,
            IBV_WC_LOC_PROT_ERR => WcStatus::LocalProtection,
            IBV_WC_WR_FLUSH_ERR => WcStatus::Flushed,
            IBV_WC_MW_BIND_ERR => WcStatus::MemoryWindowBind,
            IBV_WC_BAD_RESP_ERR => WcStatus::BadResponse,
            IBV_WC_LOC_ACCESS_ERR => WcStatus::LocalAccess,
            IBV_WC_REM_INV_REQ_ERR => WcStatus::RemoteInvalidRequest,
            IBV_WC_REM_ACCESS_ERR => WcStatus::RemoteAccess,
            IBV_WC_REM_OP_ERR => WcStatus::RemoteOperation,
            IBV_WC_RETRY_EXC_ERR => WcStatus::RetryExceeded,
            IBV_WC_RNR_RETRY_EXC_ERR => WcStatus::ReceiverNotReadyRetryExceeded,
            IBV_WC_REM_ABORT_ERR => WcStatus::RemoteAbort,
            IBV_WC_FATAL_ERR => WcStatus::Fatal,
            IBV_WC_RESP_TIMEOUT_ERR => WcStatus::ResponseTimeout,
            IBV_WC_GENERAL_ERR => WcStatus::General,
            other => WcStatus::Other(other),
        }
    }
}
/// `IBV_WC_RECV_RDMA_WITH_IMM`.
pub(crate) const WC_RECV_RDMA_WITH_IMM: u32 = ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registered_buffers_own_whole_pages() {
        // A registration under ibv_fork_init marks its pages DONTFORK: a buffer sharing a
        // page with ordinary heap chunks would take them along.
        let page = page_size();
        assert!(page >= 4096 && page.is_power_of_two());
        for len in [1usize, 16, 257, 1024, 1025] {
            let mut seen = None;
            let b = DmaBuffer::<u32, ()>::new(len, 2, |i, addr, bytes| {
                seen = Some((addr, bytes));
                Ok(((), 11 + i as u32, 22 + i as u32))
            })
            .unwrap();
            let (addr, bytes) = seen.unwrap();
            assert_eq!(addr % page, 0, "{len} elements: page-aligned");
            assert_eq!(bytes % page, 0, "{len} elements: whole pages registered");
            assert!(bytes >= len * 4);
            assert_eq!(
                b.allocated(),
                bytes,
                "the registration covers the allocation"
            );
            assert_eq!((b.lkey(0), b.rkey(0), b.addr(0)), (11, 22, addr as u64));
            assert_eq!(
                (b.lkey(1), b.rkey(1)),
                (12, 23),
                "one registration per rail"
            );
            assert_eq!(b.get(len - 1), 0, "zeroed");
            b.set(len - 1, 7);
            assert_eq!(b.get(len - 1), 7);
        }
    }

    #[test]
    fn an_element_is_read_only_once_its_sequence_number_has_landed() {
        #[derive(Clone, Copy)]
        #[repr(C, align(8))]
        struct Entry {
            size: u32,
            tag: i32,
            seq: u64,
        }
        let b = DmaBuffer::<Entry, ()>::new(4, 1, |_, _, _| Ok(((), 1, 2))).unwrap();
        let at = std::mem::offset_of!(Entry, seq);
        let landed = |i, want| (b.get_u64(i, at) == want).then(|| b.read(i, |e| (e.size, e.tag)));
        // Zeroed: no entry has landed, so nothing is read.
        assert_eq!(landed(2, 1), None);
        b.set(
            2,
            Entry {
                size: 64,
                tag: 5,
                seq: 1,
            },
        );
        assert_eq!(landed(2, 1), Some((64, 5)));
        // An entry left over from an earlier round does not pass for the next.
        assert_eq!(landed(2, 2), None);
        assert_eq!(b.read(2, |e| e.tag), 5);
        assert_eq!(landed(3, 1), None);
    }
}
