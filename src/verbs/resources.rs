//! RAII verbs objects. Children hold `Arc`s to their parents, so teardown always runs QPs,
//! MRs, CQs, PDs, then the context, whatever order the owners drop in. Drop never panics: a
//! failed destroy is logged and the process goes on.

use std::{
    ffi::c_void,
    mem::MaybeUninit,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
};

use rdma_sys::*;

use super::library::VerbsLib;
use super::limits::{Resource, Usage};
use crate::error::{Error, Result};

/// An open device context.
pub(crate) struct Context {
    pub(super) lib: &'static VerbsLib,
    raw: *mut ibv_context,
    pub(super) name: String,
    /// Fatal asynchronous events seen so far.
    fatal: parking_lot::Mutex<FatalEvents>,
    /// How many there are: read without the lock, so pollers see news cheaply.
    fatal_epoch: AtomicU64,
    /// The QPs, CQs and registrations this process holds on the device.
    pub(crate) usage: Usage,
}

// SAFETY: libibverbs contexts may be used from any thread; all mutation goes through
// libibverbs calls, which are thread-safe.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Context {
    pub(super) fn new(lib: &'static VerbsLib, raw: *mut ibv_context, name: String) -> Self {
        // Async events are read without blocking from the data path (no background thread,
        // because NCCL may unload the plugin).
        // SAFETY: raw is a live context; async_fd is its event file descriptor.
        let fd = unsafe { (*raw).async_fd };
        // SAFETY: fcntl on a valid fd owned by the context.
        unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            if flags >= 0 {
                libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
            }
        }
        Context {
            lib,
            raw,
            name,
            fatal: parking_lot::Mutex::new(FatalEvents::default()),
            fatal_epoch: AtomicU64::new(0),
            usage: Usage::default(),
        }
    }

    /// The library this context came from.
    pub(crate) fn lib(&self) -> &'static VerbsLib {
        self.lib
    }

    /// `ibv_query_device`.
    pub(crate) fn query_device(&self) -> Result<ibv_device_attr> {
        // SAFETY: all-zero is a valid bit pattern for this plain C struct.
        let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: raw is live; attr is writable.
        let rc = unsafe { (self.lib.query_device)(self.raw, &mut attr) };
        errno_rc(rc, || format!("ibv_query_device({})", self.name))?;
        Ok(attr)
    }

    /// `ibv_query_port`.
    pub(crate) fn query_port(&self, port: u8) -> Result<ibv_port_attr> {
        // SAFETY: all-zero is a valid bit pattern for this plain C struct.
        let mut attr: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: raw is live; attr is writable and at least as large as the compat struct
        // the exported symbol fills.
        let rc = unsafe { (self.lib.query_port)(self.raw, port, &mut attr) };
        errno_rc(rc, || format!("ibv_query_port({}, {port})", self.name))?;
        Ok(attr)
    }

    /// `ibv_query_gid`: the 16 raw bytes of GID `index`.
    pub(crate) fn query_gid(&self, port: u8, index: i32) -> Result<[u8; 16]> {
        // SAFETY: all-zero is a valid GID.
        let mut gid: ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: raw is live; gid is writable.
        let rc = unsafe { (self.lib.query_gid)(self.raw, port, index, &mut gid) };
        errno_rc(rc, || {
            format!("ibv_query_gid({}, {port}, {index})", self.name)
        })?;
        // SAFETY: every bit pattern of the union is a valid byte array.
        Ok(unsafe { gid.raw })
    }

    /// Reads every pending asynchronous event (without blocking) and records the fatal
    /// ones; returns the fatal-event epoch (how many were recorded so far).
    pub(crate) fn drain_async_events(&self) -> u64 {
        while let Some((ty, element)) = self.poll_async_event() {
            let what = async_event::name(ty);
            if async_event::is_fatal(ty) {
                tracing::warn!("{}: asynchronous event {what} ({ty}){element}", self.name);
                self.fatal.lock().record(ty, element);
                self.fatal_epoch.fetch_add(1, Ordering::AcqRel);
            } else {
                tracing::info!("{}: asynchronous event {what} ({ty})", self.name);
            }
        }
        self.fatal_epoch()
    }

    /// How many fatal events were recorded so far.
    pub(crate) fn fatal_epoch(&self) -> u64 {
        self.fatal_epoch.load(Ordering::Acquire)
    }

    /// The fatal event that breaks a comm polling `cq` with QPs `qpns`, if any.
    pub(crate) fn fatal_for(&self, cq: &Cq, qpns: &[u32]) -> Option<String> {
        let events = self.fatal.lock();
        let ev = events.find(cq.events_before, cq.raw as usize, qpns)?;
        Some(format!(
            "{}: {}{}",
            self.name,
            async_event::name(ev.ty),
            ev.element
        ))
    }

    /// Reads one pending asynchronous event without blocking; `None` when there is none.
    /// Returns the event type (`ibv_event_type` as a number) and what it names.
    pub(crate) fn poll_async_event(&self) -> Option<(u32, EventElement)> {
        // SAFETY: all-zero is a valid bit pattern for the event struct (event type 0).
        let mut ev: ibv_async_event = unsafe { std::mem::zeroed() };
        // SAFETY: raw is live; the fd is non-blocking, so this returns -1 when empty.
        if unsafe { (self.lib.get_async_event)(self.raw, &mut ev) } != 0 {
            return None;
        }
        // Read the C enum as the integer it is: a value newer than our bindings must not
        // become an invalid Rust enum.
        // SAFETY: event_type is a 4-byte C enum field of ev.
        let ty = unsafe { std::ptr::read(std::ptr::addr_of!(ev.event_type) as *const u32) };
        let element = if async_event::is_qp_event(ty) {
            // SAFETY: for QP events the union holds the QP pointer, live until acked.
            let qp = unsafe { ev.element.qp };
            if qp.is_null() {
                EventElement::Device
            } else {
                // SAFETY: as above.
                EventElement::Qp(unsafe { (*qp).qp_num })
            }
        } else if ty == async_event::CQ_ERR {
            // SAFETY: for CQ events the union holds the CQ pointer; only its address is kept.
            EventElement::Cq(unsafe { ev.element.cq } as usize)
        } else {
            EventElement::Device
        };
        // SAFETY: ev was filled by ibv_get_async_event and is acked exactly once.
        unsafe { (self.lib.ack_async_event)(&mut ev) };
        Some((ty, element))
    }
}

/// What an asynchronous event names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EventElement {
    /// The device (or port) as a whole.
    Device,
    /// A QP, by number.
    Qp(u32),
    /// A CQ, by address.
    Cq(usize),
}

impl std::fmt::Display for EventElement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EventElement::Device => Ok(()),
            EventElement::Qp(q) => write!(f, " on QP {q}"),
            EventElement::Cq(_) => write!(f, " on a CQ"),
        }
    }
}

/// One fatal asynchronous event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FatalEvent {
    /// 1 for the first event recorded on the context, then 2, ...
    pub(crate) seq: u64,
    /// `ibv_event_type` as a number.
    pub(crate) ty: u32,
    /// What it names.
    pub(crate) element: EventElement,
}

/// The fatal asynchronous events of one context, and which comm each one breaks.
#[derive(Debug, Default)]
pub(crate) struct FatalEvents {
    list: Vec<FatalEvent>,
}

impl FatalEvents {
    /// Records an event.
    pub(crate) fn record(&mut self, ty: u32, element: EventElement) {
        let seq = self.list.len() as u64 + 1;
        self.list.push(FatalEvent { seq, ty, element });
    }

    /// The first event that breaks a comm whose CQ (address `cq`) was created when `since`
    /// events had been recorded, and whose QPs are `qpns`: one on the device whenever it
    /// came; one on its CQ or one of its QPs only if it came later. (An earlier one was
    /// about an object that no longer exists: a destroyed QP's number is handed out
    /// again, and a CQ's address may be.)
    pub(crate) fn find(&self, since: u64, cq: usize, qpns: &[u32]) -> Option<&FatalEvent> {
        self.list.iter().find(|ev| match ev.element {
            EventElement::Device => true,
            EventElement::Qp(q) => ev.seq > since && qpns.contains(&q),
            EventElement::Cq(c) => ev.seq > since && c == cq,
        })
    }
}

/// Asynchronous event numbers (`enum ibv_event_type`) and their meaning for a comm.
pub(crate) mod async_event {
    /// `IBV_EVENT_CQ_ERR`.
    pub(crate) const CQ_ERR: u32 = 0;
    /// `IBV_EVENT_QP_FATAL`.
    pub(crate) const QP_FATAL: u32 = 1;
    /// `IBV_EVENT_QP_REQ_ERR`.
    pub(crate) const QP_REQ_ERR: u32 = 2;
    /// `IBV_EVENT_QP_ACCESS_ERR`.
    pub(crate) const QP_ACCESS_ERR: u32 = 3;
    /// `IBV_EVENT_DEVICE_FATAL`.
    pub(crate) const DEVICE_FATAL: u32 = 8;

    /// Whether the event's element is a QP.
    pub(crate) fn is_qp_event(ty: u32) -> bool {
        matches!(ty, 1..=7 | 16)
    }

    /// Whether the event breaks the QP or device it names.
    pub(crate) fn is_fatal(ty: u32) -> bool {
        matches!(
            ty,
            CQ_ERR | QP_FATAL | QP_REQ_ERR | QP_ACCESS_ERR | DEVICE_FATAL
        )
    }

    /// A readable name.
    pub(crate) fn name(ty: u32) -> &'static str {
        match ty {
            CQ_ERR => "CQ error",
            QP_FATAL => "QP fatal",
            QP_REQ_ERR => "QP request error",
            QP_ACCESS_ERR => "QP access error",
            DEVICE_FATAL => "device fatal",
            9 => "port active",
            10 => "port error",
            11 => "LID change",
            12 => "PKey change",
            13 => "SM change",
            18 => "client reregister",
            19 => "GID change",
            _ => "other",
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: raw is live and closed exactly once; children keep an Arc to us, so none
        // is alive any more.
        let rc = unsafe { (self.lib.close_device)(self.raw) };
        if rc != 0 {
            tracing::warn!("ibv_close_device({}) failed: {rc}", self.name);
        }
    }
}

/// The error of a verbs call that returned `rc` (0 = success). Verbs report failure three
/// ways: -1 with errno set (libibverbs' own calls), the errno itself (mlx5 and most
/// providers' post and modify calls), or minus the errno without setting errno (eRDMA's
/// post_send/post_recv: -ENOMEM for a full queue, -EINVAL/-EIO for a QP in error), where
/// errno would be a stale, unrelated value.
pub(super) fn verbs_error(rc: i32) -> std::io::Error {
    match rc {
        -1 => std::io::Error::last_os_error(),
        rc if rc < -1 => std::io::Error::from_raw_os_error(-rc),
        rc => std::io::Error::from_raw_os_error(rc),
    }
}

pub(super) fn errno_rc(rc: i32, what: impl FnOnce() -> String) -> Result<()> {
    if rc == 0 {
        return Ok(());
    }
    Err(Error::io(what(), verbs_error(rc)))
}

/// A protection domain.
pub(crate) struct Pd {
    pub(super) ctx: Arc<Context>,
    pub(super) raw: *mut ibv_pd,
}

// SAFETY: PDs are thread-safe libibverbs objects.
unsafe impl Send for Pd {}
// SAFETY: as above.
unsafe impl Sync for Pd {}

impl Pd {
    /// `ibv_alloc_pd`.
    pub(crate) fn new(ctx: &Arc<Context>) -> Result<Arc<Self>> {
        // SAFETY: ctx.raw is live.
        let raw = unsafe { (ctx.lib.alloc_pd)(ctx.raw) };
        if raw.is_null() {
            return Err(Error::last_os(format!("ibv_alloc_pd({})", ctx.name)));
        }
        Ok(Arc::new(Pd {
            ctx: Arc::clone(ctx),
            raw,
        }))
    }

    /// `ibv_reg_mr` of `addr..addr+len` (the caller keeps the memory alive while the MR is).
    pub(crate) fn reg_mr(self: &Arc<Self>, addr: usize, len: usize, access: u32) -> Result<Mr> {
        // SAFETY: pd is live; the kernel pins and validates the range itself and fails
        // cleanly (EFAULT) for an unmapped one.
        let raw =
            unsafe { (self.ctx.lib.reg_mr)(self.raw, addr as *mut c_void, len, access as i32) };
        if raw.is_null() {
            return Err(Error::last_os(format!(
                "ibv_reg_mr({}, {addr:#x}+{len})",
                self.ctx.name
            )));
        }
        Ok(Mr::new(self, raw))
    }

    /// `ibv_reg_dmabuf_mr`; `Unsupported`-style error when the library lacks it.
    pub(crate) fn reg_dmabuf_mr(
        self: &Arc<Self>,
        offset: u64,
        len: usize,
        iova: u64,
        fd: i32,
        access: u32,
    ) -> Result<Mr> {
        let f = self.ctx.lib.reg_dmabuf_mr.ok_or_else(|| {
            Error::usage("this libibverbs has no ibv_reg_dmabuf_mr (rdma-core >= 34 needed)".into())
        })?;
        // SAFETY: pd is live; the kernel validates fd, offset and length.
        let raw = unsafe { f(self.raw, offset, len, iova, fd, access as i32) };
        if raw.is_null() {
            return Err(Error::last_os(format!(
                "ibv_reg_dmabuf_mr({}, fd {fd}, {len} bytes)",
                self.ctx.name
            )));
        }
        Ok(Mr::new(self, raw))
    }

    /// Whether DMA-BUF registration works on this device: NCCL's probe, an
    /// `ibv_reg_dmabuf_mr` with fd -1 that fails with EBADF rather than EOPNOTSUPP.
    pub(crate) fn dmabuf_supported(&self) -> bool {
        let Some(f) = self.ctx.lib.reg_dmabuf_mr else {
            return false;
        };
        // SAFETY: pd is live; fd -1 can never register anything.
        let raw = unsafe { f(self.raw, 0, 0, 0, -1, 0) };
        if !raw.is_null() {
            // SAFETY: unexpected success: release what was made.
            unsafe { (self.ctx.lib.dereg_mr)(raw) };
            return true;
        }
        let errno = std::io::Error::last_os_error().raw_os_error();
        !matches!(errno, Some(libc::EOPNOTSUPP) | Some(libc::EPROTONOSUPPORT))
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: raw is live, deallocated once; MRs and QPs hold an Arc to us.
        let rc = unsafe { (self.ctx.lib.dealloc_pd)(self.raw) };
        if rc != 0 {
            tracing::warn!("ibv_dealloc_pd({}) failed: {rc}", self.ctx.name);
        }
    }
}

/// A memory region.
pub(crate) struct Mr {
    pd: Arc<Pd>,
    raw: *mut ibv_mr,
}

// SAFETY: MRs are thread-safe libibverbs objects; lkey/rkey are read-only after creation.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Mr {
    fn new(pd: &Arc<Pd>, raw: *mut ibv_mr) -> Self {
        pd.ctx.usage.add(Resource::Mr);
        Mr {
            pd: Arc::clone(pd),
            raw,
        }
    }

    /// Local key.
    pub(crate) fn lkey(&self) -> u32 {
        // SAFETY: raw is live for self's lifetime.
        unsafe { (*self.raw).lkey }
    }
    /// Remote key.
    pub(crate) fn rkey(&self) -> u32 {
        // SAFETY: raw is live for self's lifetime.
        unsafe { (*self.raw).rkey }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: raw is live and deregistered exactly once.
        let rc = unsafe { (self.pd.ctx.lib.dereg_mr)(self.raw) };
        self.pd.ctx.usage.remove(Resource::Mr);
        if rc != 0 {
            tracing::warn!("ibv_dereg_mr({}) failed: {rc}", self.pd.ctx.name);
        }
    }
}

/// A completion queue, polled by its one owner.
pub(crate) struct Cq {
    ctx: Arc<Context>,
    pub(super) raw: *mut ibv_cq,
    /// The provider's `poll_cq`, read once: an idle poll is this one call.
    poll_fn: PollCqFn,
    /// Fatal events recorded on the context before this CQ existed (none is about it).
    events_before: u64,
}

/// The type of a provider's `poll_cq`.
type PollCqFn = unsafe extern "C" fn(*mut ibv_cq, i32, *mut ibv_wc) -> i32;

// SAFETY: CQs are libibverbs objects usable from any thread; each comm polls its own.
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

impl Cq {
    /// `ibv_create_cq` with room for `entries` completions.
    pub(crate) fn new(ctx: &Arc<Context>, entries: i32) -> Result<Arc<Self>> {
        let events_before = ctx.fatal_epoch();
        // SAFETY: ctx.raw is live; no channel, no context pointer.
        let raw = unsafe {
            (ctx.lib.create_cq)(
                ctx.raw,
                entries,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        if raw.is_null() {
            return Err(Error::last_os(format!(
                "ibv_create_cq({}, {entries})",
                ctx.name
            )));
        }
        // SAFETY: raw is live; the provider's ops table belongs to its context.
        let Some(poll_fn) = (unsafe { (*(*raw).context).ops.poll_cq }) else {
            // SAFETY: raw was just created, and is destroyed once.
            unsafe { (ctx.lib.destroy_cq)(raw) };
            return Err(no_op("poll_cq"));
        };
        ctx.usage.add(Resource::Cq);
        Ok(Arc::new(Cq {
            ctx: Arc::clone(ctx),
            raw,
            poll_fn,
            events_before,
        }))
    }

    /// Polls up to `wcs.len()` completions; returns how many were written, never more than
    /// that (as `Nic` promises). Inlined (an idle poll), its errors out of line.
    #[inline(always)]
    pub(crate) fn poll(&self, wcs: &mut [MaybeUninit<ibv_wc>]) -> Result<usize> {
        let (n, room) = self.poll_raw(wcs);
        // One comparison for both: an error (negative) and a count beyond the room.
        if n as u32 > room as u32 {
            return Err(self.poll_error(n, room));
        }
        Ok(n as usize)
    }

    /// [`Self::poll`], `None` where it fails: the next poll meets the error and reports it.
    #[inline(always)]
    pub(crate) fn try_poll(&self, wcs: &mut [MaybeUninit<ibv_wc>]) -> Option<usize> {
        let (n, room) = self.poll_raw(wcs);
        (n as u32 <= room as u32).then_some(n as usize)
    }

    /// The provider's `poll_cq` into `wcs` (room for `room` entries): what it returned.
    #[inline(always)]
    fn poll_raw(&self, wcs: &mut [MaybeUninit<ibv_wc>]) -> (i32, i32) {
        let room = wcs.len().min(i32::MAX as usize) as i32;
        // SAFETY: raw is live, poll_fn its provider's; wcs has room for `room` entries, which
        // the provider only writes.
        let n = unsafe { (self.poll_fn)(self.raw, room, wcs.as_mut_ptr().cast()) };
        (n, room)
    }

    #[cold]
    fn poll_error(&self, n: i32, room: i32) -> Error {
        if n > room {
            return Error::device(format!(
                "ibv_poll_cq({}) returned {n} completions, for room for {room}",
                self.ctx.name
            ));
        }
        Error::io(
            format!("ibv_poll_cq({})", self.ctx.name),
            std::io::Error::from_raw_os_error(-n),
        )
    }
}

#[cold]
pub(super) fn no_op(op: &str) -> Error {
    Error::misuse(format!("provider has no {op}"))
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: raw is live, destroyed once; QPs using it hold an Arc to us.
        let rc = unsafe { (self.ctx.lib.destroy_cq)(self.raw) };
        self.ctx.usage.remove(Resource::Cq);
        if rc != 0 {
            tracing::warn!("ibv_destroy_cq({}) failed: {rc}", self.ctx.name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::async_event::{CQ_ERR, DEVICE_FATAL, QP_FATAL};
    use super::{verbs_error, EventElement, FatalEvents};

    #[test]
    fn post_errors_name_the_returned_errno_not_a_stale_one() {
        // errno holds something unrelated, as after an earlier failed call.
        std::fs::File::open("/nonexistent/nccl-net-erdma").unwrap_err();
        assert_eq!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::ENOENT)
        );
        // eRDMA: minus the errno, errno untouched.
        assert_eq!(
            verbs_error(-libc::ENOMEM).raw_os_error(),
            Some(libc::ENOMEM)
        );
        assert_eq!(
            verbs_error(-libc::EINVAL).raw_os_error(),
            Some(libc::EINVAL)
        );
        assert_eq!(verbs_error(-libc::EIO).raw_os_error(), Some(libc::EIO));
        // mlx5 and others: the errno itself.
        assert_eq!(verbs_error(libc::ENOMEM).raw_os_error(), Some(libc::ENOMEM));
        // libibverbs' own calls: -1 with errno set.
        assert_eq!(verbs_error(-1).raw_os_error(), Some(libc::ENOENT));
    }

    #[test]
    fn fatal_events_break_only_the_comms_they_name() {
        let mut events = FatalEvents::default();
        events.record(QP_FATAL, EventElement::Qp(7));
        events.record(CQ_ERR, EventElement::Cq(0x1000));
        let first = |since, cq, qpns: &[u32]| events.find(since, cq, qpns).map(|e| e.seq);
        // Comms that existed before both events: the one with QP 7, the one with that CQ.
        assert_eq!(first(0, 0x2000, &[8, 7]), Some(1));
        assert_eq!(first(0, 0x1000, &[9]), Some(2));
        assert_eq!(first(0, 0x3000, &[10]), None, "a comm neither event names");
        // A comm created after both that was handed QP number 7 and the same CQ address.
        assert_eq!(
            first(2, 0x1000, &[7]),
            None,
            "numbers reused after a destroy"
        );
        // The device failing breaks every comm, even one created after it.
        events.record(DEVICE_FATAL, EventElement::Device);
        let ev = events.find(9, 0x3000, &[10]).expect("device fatal");
        assert_eq!((ev.seq, ev.ty), (3, DEVICE_FATAL));
    }
}
