//! The C boundary: the exported `ncclNetPlugin_v4` .. `_v12` tables, and nothing but
//! pointer checks, argument conversion, the panic boundary and the one error mapping.
//!
//! Every export runs inside [`boundary`], which catches panics (reported through NCCL's
//! logger by the hook installed at `init`) and turns our [`Error`] into an `ncclResult_t`
//! with [`Error::code`] (the table in `error.rs`), logging one WARN that names the call.

mod profiler;
mod slots;
mod tables;
mod versions;

use std::{
    ffi::{c_int, c_ulong, c_void, CString},
    panic::{catch_unwind, AssertUnwindSafe},
    sync::{Arc, Once},
};

use crate::error::{Error, Result};
use crate::ffi::{self, ncclResult_t};
use crate::log::{LogLevel, LogLine, Subsys};
use crate::plugin::{
    comm::check_magic, ListenComm, Plugin, RecvComm, RequestToken, SendComm, SizeSink,
    LISTEN_MAGIC, MAX_RECVS, RECV_MAGIC, SEND_MAGIC,
};

/// Runs one export: panics and errors become result codes, each logged once.
#[inline]
pub(crate) fn boundary(call: &'static str, f: impl FnOnce() -> Result<()>) -> ncclResult_t {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => ncclResult_t::ncclSuccess,
        Ok(Err(e)) => failed(call, &e),
        Err(_) => panicked(call),
    }
}

// Out of line, so the success path of every export stays small.
#[cold]
#[inline(never)]
fn failed(call: &str, e: &Error) -> ncclResult_t {
    tracing::warn!("{call}: {e}");
    e.code()
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
    Error::misuse(format!("{what} is NULL"))
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

/// The listen comm behind NCCL's pointer.
///
/// # Safety
/// As [`send_comm`]; NCCL uses a listen comm from one thread at a time.
pub(crate) unsafe fn listen_comm<'a>(comm: *mut c_void) -> Result<&'a mut ListenComm> {
    non_null(comm, "listenComm")?;
    // SAFETY: forwarded contract.
    check_magic(unsafe { comm_magic(comm)? }, LISTEN_MAGIC, "listen comm")?;
    // SAFETY: the magic says it is a live ListenComm allocated by us; no other reference to
    // it exists during the call.
    Ok(unsafe { &mut *(comm as *mut ListenComm) })
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

/// The request token behind NCCL's pointer.
///
/// # Safety
/// `request` must be NULL or a request this plugin returned whose comm NCCL has not closed.
pub(crate) unsafe fn request_token<'a>(request: *mut c_void) -> Result<&'a RequestToken> {
    non_null(request, "request")?;
    // SAFETY: non-NULL and, by contract, one of the tokens inside a live comm, which start
    // with their magic (checked before anything else is read).
    let token = unsafe { &*(request as *const RequestToken) };
    token.check()?;
    Ok(token)
}

/// NCCL's `sizes` argument of `test`, which a finished request's sizes are written into as
/// `int`s (saturated): one per message of the request, or NULL (then nothing is written).
struct NcclSizes(*mut c_int);

impl NcclSizes {
    /// # Safety
    /// `sizes` is NULL or has room for every message of the request being tested (NCCL
    /// passes an array of 64).
    unsafe fn new(sizes: *mut c_int) -> Self {
        NcclSizes(sizes)
    }
}

impl SizeSink for NcclSizes {
    #[inline]
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

    #[test]
    fn a_panic_in_an_export_is_an_internal_error_not_an_unwind_into_c() {
        assert_eq!(
            boundary("test", || panic!("planted")),
            ncclResult_t::ncclInternalError
        );
        assert_eq!(
            boundary("test", || Err(Error::remote("gone".into()))),
            ncclResult_t::ncclRemoteError
        );
        assert_eq!(boundary("test", || Ok(())), ncclResult_t::ncclSuccess);
    }
}
