//! The C boundary: the exported `ncclNetPlugin_v6` .. `_v12` tables, and nothing but
//! pointer checks, argument conversion, the panic boundary and one error mapping.
//!
//! Every export runs inside [`boundary`], which catches panics (reported through NCCL's
//! logger by the hook installed at `init`) and turns our [`Error`] into an `ncclResult_t` with
//! [`to_nccl`], logging one WARN that names the call.

mod profiler;
mod slots;
mod tables;
mod versions;

use std::{
    ffi::{c_int, c_ulong, c_void, CString},
    panic::{catch_unwind, AssertUnwindSafe},
    sync::{Arc, Once},
};

use crate::error::{Error, ErrorKind, Result};
use crate::ffi::{self, ncclResult_t};
use crate::log::{LogLevel, LogLine, Subsys};
use crate::plugin::{
    comm::check_magic, Plugin, RecvComm, RequestOwner, RequestToken, SendComm, RECV_MAGIC,
    SEND_MAGIC,
};
use crate::transport::{Look, SizeSink, Tested, WcBatch, MAX_RECVS};

/// The one mapping from our errors to NCCL's result codes, following NCCL's plugin README
/// (`ncclSystemError` for kernel, library or hardware failures, `ncclInternalError` when NCCL
/// misuses the plugin, `ncclInvalidUsage` for user or configuration errors,
/// `ncclRemoteError` for a peer or remote failure; never `ncclInProgress`) and `nccl.h`
/// (`ncclInvalidArgument` for an invalid argument such as a NULL pointer):
///
/// | our error | NCCL code | raised for |
/// |---|---|---|
/// | `Config` | `ncclInvalidUsage` | a setting with a value the plugin cannot use (`init` fails) |
/// | `Usage` | `ncclInvalidUsage` | a setup that cannot work as configured: transports or link layers that differ between peers, more flushes in flight than NCCL allows |
/// | `Truncated` | `ncclInvalidUsage` | a message larger than the receive posted for it (both sides) |
/// | `InvalidArgument` | `ncclInvalidArgument` | NULL where a pointer is required, a count or size out of range, an unknown device, a buffer outside its registration, a foreign or corrupted handle |
/// | `Misuse` | `ncclInternalError` | NCCL broke the contract: an unknown memory handle, a request not in flight, a comm of the wrong kind, a call before `init` |
/// | `NoDevice` | `ncclSystemError` | no usable RDMA device or libibverbs (`init` fails and NCCL falls back to its own transports) |
/// | `Device` | `ncclSystemError` | a fatal asynchronous event on the device |
/// | `Os` | `ncclSystemError`, or `ncclRemoteError` when the errno means the peer is gone (reset, refused, timed out, unreachable) | a failed system or verbs call |
/// | `Remote` | `ncclRemoteError` | the peer failed: a failed completion, a closed or silent peer, work that never completes, a protocol error |
pub(crate) fn to_nccl(e: &Error) -> ncclResult_t {
    match e.kind() {
        ErrorKind::System => ncclResult_t::ncclSystemError,
        ErrorKind::Internal => ncclResult_t::ncclInternalError,
        ErrorKind::InvalidArgument => ncclResult_t::ncclInvalidArgument,
        ErrorKind::InvalidUsage => ncclResult_t::ncclInvalidUsage,
        ErrorKind::Remote => ncclResult_t::ncclRemoteError,
    }
}

/// Runs one export: panics and errors become result codes, each logged once.
#[inline]
pub(crate) fn boundary(call: &'static str, f: impl FnOnce() -> Result<()>) -> ncclResult_t {
    match boundary_value(call, f) {
        Ok(()) => ncclResult_t::ncclSuccess,
        Err(code) => code,
    }
}

/// [`boundary`] of the first step of an export: what it yields, or the result code to
/// return (a panic or an error, logged once).
#[inline]
pub(crate) fn boundary_value<T>(
    call: &'static str,
    f: impl FnOnce() -> Result<T>,
) -> std::result::Result<T, ncclResult_t> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(failed(call, &e)),
        Err(_) => Err(panicked(call)),
    }
}

// Out of line, so the success path of every export stays small.
#[cold]
#[inline(never)]
fn failed(call: &str, e: &Error) -> ncclResult_t {
    tracing::warn!("{call}: {e}");
    to_nccl(e)
}

#[cold]
#[inline(never)]
fn panicked(call: &str) -> ncclResult_t {
    tracing::warn!("{call}: internal error (a panic, reported above)");
    ncclResult_t::ncclInternalError
}

/// Routes logging to NCCL's logger (when given) and installs the panic hook, once.
pub(crate) fn install_logging(logger: ffi::ncclDebugLogger_t) {
    static HOOK: Once = Once::new();
    crate::log::install();
    HOOK.call_once(|| {
        std::panic::set_hook(Box::new(|info| {
            tracing::warn!("panic in the plugin: {info}");
        }));
    });
    if let Some(log_fn) = logger {
        crate::log::set_sink(Arc::new(move |line: &LogLine<'_>| {
            let (level, flags, site) = match line.level {
                LogLevel::Warn => (ffi::NCCL_LOG_WARN, ffi::NCCL_ALL as c_ulong, line.file),
                LogLevel::Info => (
                    ffi::NCCL_LOG_INFO,
                    match line.subsys {
                        Subsys::Init => ffi::NCCL_INIT as c_ulong,
                        Subsys::Net => ffi::NCCL_NET as c_ulong,
                    },
                    line.module,
                ),
                LogLevel::Trace => (ffi::NCCL_LOG_TRACE, ffi::NCCL_NET as c_ulong, line.module),
            };
            let text = CString::new(line.text.replace('\0', " ")).unwrap_or_default();
            let site = CString::new(site.replace('\0', " ")).unwrap_or_default();
            // SAFETY: NCCL's logger is a printf-style variadic function; the format is the
            // literal "%s" and the one variadic argument a NUL-terminated string that lives
            // across the call, so no message text is ever interpreted as a format.
            unsafe {
                log_fn(
                    level,
                    flags,
                    site.as_ptr(),
                    line.line as c_int,
                    c"%s".as_ptr(),
                    text.as_ptr(),
                )
            };
        }));
    }
}

/// Errors unless `p` is non-NULL.
#[inline]
pub(crate) fn non_null<T>(p: *const T, what: &str) -> Result<()> {
    if p.is_null() {
        Err(null_argument(what))
    } else {
        Ok(())
    }
}

#[cold]
fn null_argument(what: &str) -> Error {
    Error::invalid_argument(format!("{what} is NULL"))
}

/// Reads the magic number every comm starts with.
///
/// # Safety
/// `comm` must be NULL or point to at least 8 readable bytes; NCCL only passes back comms
/// this plugin returned.
unsafe fn comm_magic(comm: *const c_void) -> Result<u64> {
    non_null(comm, "comm")?;
    // SAFETY: non-NULL, and by the caller's contract one of our comms, all of which are
    // #[repr(C)] with a u64 magic first.
    Ok(unsafe { std::ptr::read(comm as *const u64) })
}

/// The send comm behind NCCL's pointer.
///
/// # Safety
/// `comm` must be NULL or a pointer this plugin returned and NCCL has not closed.
pub(crate) unsafe fn send_comm<'a>(comm: *mut c_void) -> Result<&'a SendComm> {
    // SAFETY: forwarded contract.
    check_magic(unsafe { comm_magic(comm)? }, SEND_MAGIC, "send comm")?;
    // SAFETY: the magic says it is a live SendComm allocated by us.
    Ok(unsafe { &*(comm as *const SendComm) })
}

/// The receive comm behind NCCL's pointer.
///
/// # Safety
/// As [`send_comm`].
pub(crate) unsafe fn recv_comm<'a>(comm: *mut c_void) -> Result<&'a RecvComm> {
    // SAFETY: forwarded contract.
    check_magic(unsafe { comm_magic(comm)? }, RECV_MAGIC, "receive comm")?;
    // SAFETY: the magic says it is a live RecvComm allocated by us.
    Ok(unsafe { &*(comm as *const RecvComm) })
}

/// The plugin and device of either kind of data comm (`regMr` may get either).
///
/// # Safety
/// As [`send_comm`].
pub(crate) unsafe fn data_comm_owner(comm: *mut c_void) -> Result<(Arc<Plugin>, usize)> {
    // SAFETY: forwarded contract.
    match unsafe { comm_magic(comm)? } {
        // SAFETY: forwarded contract; the magic was just checked.
        SEND_MAGIC => unsafe { send_comm(comm) }.map(|c| {
            let (p, d) = c.owner();
            (Arc::clone(p), d)
        }),
        // SAFETY: as above.
        RECV_MAGIC => unsafe { recv_comm(comm) }.map(|c| {
            let (p, d) = c.owner();
            (Arc::clone(p), d)
        }),
        _ => Err(Error::misuse(
            "the pointer passed as a comm is neither a send nor a receive comm".into(),
        )),
    }
}

/// Whose request `test` was given, as [`look_at_request`] found.
pub(crate) enum Owner {
    /// A send comm's.
    Send,
    /// A receive comm's.
    Recv,
    /// None of ours, or `done` is NULL: [`request_error`] says which.
    Invalid,
}

/// The first step of `test`: checks the request and `done`, each with one branch (their
/// errors are made out of line, by [`request_error`]), and tells whose request it is.
///
/// # Safety
/// `request` must be NULL or a request this plugin returned, not yet reported done.
#[inline(always)]
pub(crate) unsafe fn look_at_request(request: *mut c_void, done: *mut c_int) -> Owner {
    if request.is_null() || done.is_null() {
        return Owner::Invalid;
    }
    // SAFETY: non-NULL and, by contract, one of the tokens inside a live comm.
    let token = unsafe { &*(request as *const RequestToken) };
    if !token.is_live() {
        return Owner::Invalid;
    }
    match token.owner {
        RequestOwner::Send(_) => Owner::Send,
        RequestOwner::Recv(_) => Owner::Recv,
    }
}

/// Why [`look_at_request`] found `request` or `done` invalid.
///
/// # Safety
/// As [`look_at_request`].
#[cold]
pub(crate) unsafe fn request_error(request: *mut c_void, done: *mut c_int) -> Error {
    let checked = non_null(request, "request").and_then(|()| non_null(done, "done"));
    // SAFETY: non-NULL, by contract one of our tokens (its magic says whether it is).
    let checked = checked.and_then(|()| unsafe { &*(request as *const RequestToken) }.check());
    checked
        .err()
        .unwrap_or_else(|| Error::misuse("the request was found invalid, then valid".into()))
}

/// The rest of `test` of a send request: writes NCCL's `done` and `sizes`.
///
/// # Safety
/// `request` and `done` passed [`look_at_request`], as a send request; `sizes` NULL or
/// writable for one int.
#[inline(always)]
pub(crate) unsafe fn test_send_request(
    request: *mut c_void,
    done: *mut c_int,
    sizes: *mut c_int,
) -> Result<()> {
    // SAFETY: checked by `look_at_request`.
    let token = unsafe { &*(request as *const RequestToken) };
    // SAFETY: a live token's comm is live (it holds the token); the SendComm, by contract.
    let comm = unsafe { &*(token.owner.addr() as *const SendComm) };
    let finished = match comm.test(token.slot) {
        Tested::Pending => false,
        Tested::Done(size) => {
            // SAFETY: room for the request's one message, or NULL, by contract.
            unsafe { NcclSizes::new(sizes) }.set(0, size as u32);
            true
        }
        Tested::Failed(e) => return Err(e),
    };
    // SAFETY: forwarded contract.
    unsafe { report(token, done, finished) };
    Ok(())
}

/// The token of a receive request and its comm.
///
/// # Safety
/// `request` passed [`look_at_request`], as a receive request.
#[inline(always)]
unsafe fn recv_request<'a>(request: *mut c_void) -> (&'a RequestToken, &'a RecvComm) {
    // SAFETY: checked by `look_at_request`.
    let token = unsafe { &*(request as *const RequestToken) };
    // SAFETY: as for `test_send_request`, the RecvComm.
    (token, unsafe { &*(token.owner.addr() as *const RecvComm) })
}

/// The step of `test` of a receive request that needs no lock: the poll of its CQ into `wc`,
/// where its comm's gate allows one (`None` where not). [`Look::Idle`] answers the proxy's
/// idle test (most calls): `*done` is 0, and the call is over.
///
/// # Safety
/// `request` and `done` passed [`look_at_request`], as a receive request.
#[inline(always)]
pub(crate) unsafe fn poll_request(
    request: *mut c_void,
    done: *mut c_int,
    wc: &mut WcBatch,
) -> Option<Look> {
    // SAFETY: forwarded contract.
    let (token, comm) = unsafe { recv_request(request) };
    let polled = comm.poll_unlocked(token.slot, wc);
    if let Some(Look::Idle) = polled {
        // SAFETY: checked non-NULL; writable by contract.
        unsafe { *done = 0 };
    }
    polled
}

/// The rest of `test` of a receive or flush request, after [`poll_request`] found `polled`
/// (its completions in `wc`): writes NCCL's `done` and `sizes`.
///
/// # Safety
/// `request` and `done` passed [`look_at_request`], as a receive request; `sizes` NULL or
/// writable for as many ints as the request has messages.
#[inline(always)]
pub(crate) unsafe fn test_recv_request(
    request: *mut c_void,
    done: *mut c_int,
    sizes: *mut c_int,
    polled: Option<Look>,
    wc: &mut WcBatch,
) -> Result<()> {
    // SAFETY: forwarded contract.
    let (token, comm) = unsafe { recv_request(request) };
    // SAFETY: room for every message of the request, or NULL, by contract.
    let mut out = unsafe { NcclSizes::new(sizes) };
    let finished = match comm.test_after(token.slot, &mut out, polled, wc) {
        Tested::Pending => false,
        Tested::Done(_) => true,
        Tested::Failed(e) => return Err(e),
    };
    // SAFETY: forwarded contract.
    unsafe { report(token, done, finished) };
    Ok(())
}

/// Writes `test`'s `done`, and ends a finished request's profiler event.
///
/// # Safety
/// `done` non-NULL and writable.
#[inline(always)]
unsafe fn report(token: &RequestToken, done: *mut c_int, finished: bool) {
    if finished {
        profiler::stop(token);
    }
    // SAFETY: by contract.
    unsafe { *done = c_int::from(finished) };
}

/// NCCL's `sizes` argument of `test`, which a finished request's sizes are written into as
/// `int`s (saturated): one per message of the request, or NULL (then nothing is written).
struct NcclSizes(*mut c_int);

impl NcclSizes {
    /// # Safety
    /// `sizes` is NULL or has room for every message of the request being tested (NCCL
    /// passes an array of 64).
    #[inline(always)]
    unsafe fn new(sizes: *mut c_int) -> Self {
        NcclSizes(sizes)
    }
}

impl SizeSink for NcclSizes {
    #[inline(always)]
    fn set(&mut self, i: usize, size: u32) {
        // A request has at most MAX_RECVS messages: an index beyond is a bug, never a write.
        if !self.0.is_null() && i < MAX_RECVS {
            // SAFETY: room for every message of the request, by `new`'s contract.
            unsafe { *self.0.add(i) = i32::try_from(size).unwrap_or(i32::MAX) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io;

    #[test]
    fn every_error_maps_to_the_code_its_table_row_names() {
        use ncclResult_t::*;
        let os = |k| Error::io("x", io::Error::from(k));
        for (e, want) in [
            (
                Error::config("NCCL_IB_TIMEOUT", "99", "1 to 31"),
                ncclInvalidUsage,
            ),
            (Error::usage("x".into()), ncclInvalidUsage),
            (Error::truncated("x".into()), ncclInvalidUsage),
            (Error::invalid_argument("x".into()), ncclInvalidArgument),
            (Error::misuse("x".into()), ncclInternalError),
            (Error::no_device("x".into()), ncclSystemError),
            (Error::device("x".into()), ncclSystemError),
            (os(io::ErrorKind::PermissionDenied), ncclSystemError),
            (os(io::ErrorKind::ConnectionReset), ncclRemoteError),
            (os(io::ErrorKind::TimedOut), ncclRemoteError),
            (Error::remote("x".into()), ncclRemoteError),
        ] {
            assert_eq!(to_nccl(&e), want, "{e:?}");
            assert_ne!(to_nccl(&e), ncclInProgress);
        }
    }
}
