//! NCCL's profiler hook (v10 and v11 tables): a Start event when `isend`/`irecv` posts a
//! request under a profiler parent handle, a Stop event when `test` reports it done.

use std::{
    ffi::{c_int, c_void},
    sync::atomic::{AtomicUsize, Ordering},
};

use crate::ffi::{ncclProfilerCallback_t, ncclProfilerNetEventStart, ncclProfilerNetEventStop};
use crate::plugin::RequestToken;

/// Our event type in the high 16 bits (NCCL's own: IB 1, Socket 2), descriptor version 1 in
/// the low 16 bits.
pub(crate) const PLUGIN_ID: i64 = (0x45 << 16) | 1;

/// What a Start event describes (`extData`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct NetEvent {
    /// 0 = send, 1 = receive.
    pub(crate) kind: u32,
    /// Messages in the request (grouped receives).
    pub(crate) n: u32,
    /// Bytes posted (the sum over the group).
    pub(crate) size: u64,
    /// Tag of the (first) message.
    pub(crate) tag: i32,
}

type Callback = unsafe extern "C" fn(
    *mut *mut c_void,
    c_int,
    *mut c_void,
    i64,
    *mut c_void,
) -> crate::ffi::ncclResult_t;

static CALLBACK: AtomicUsize = AtomicUsize::new(0);

/// Remembers the profiler NCCL gave `init` (NULL turns events off).
pub(crate) fn set(cb: ncclProfilerCallback_t) {
    CALLBACK.store(cb.map_or(0, |f| f as usize), Ordering::Release);
}

fn callback() -> Option<Callback> {
    match CALLBACK.load(Ordering::Acquire) {
        0 => None,
        // SAFETY: only `set` stores a non-zero value, and it stores a function pointer of
        // exactly this type.
        f => Some(unsafe { std::mem::transmute::<usize, Callback>(f) }),
    }
}

/// Starts an event, described by `event()`, for a request just posted under `phandle`.
#[inline]
pub(crate) fn start(token: &RequestToken, phandle: *mut c_void, event: impl FnOnce() -> NetEvent) {
    // The data path's common case, profiler off, is one load; the event is built only for
    // a profiler.
    if !phandle.is_null() && CALLBACK.load(Ordering::Relaxed) != 0 {
        start_event(token, phandle, event());
    }
}

#[inline(never)]
fn start_event(token: &RequestToken, phandle: *mut c_void, mut event: NetEvent) {
    let Some(cb) = callback() else {
        return;
    };
    let mut handle: *mut c_void = std::ptr::null_mut();
    // SAFETY: NCCL's callback with its own parent handle; handle and event live across the
    // call, and NCCL copies what it keeps.
    unsafe {
        cb(
            &mut handle,
            ncclProfilerNetEventStart as c_int,
            phandle,
            PLUGIN_ID,
            &mut event as *mut NetEvent as *mut c_void,
        )
    };
    token.set_profiler_event(handle as usize);
}

/// Stops the request's event, if it has one.
#[inline]
pub(crate) fn stop(token: &RequestToken) {
    if token.has_profiler_event() {
        stop_event(token);
    }
}

#[inline(never)]
fn stop_event(token: &RequestToken) {
    let handle = token.take_profiler_event();
    let Some(cb) = callback().filter(|_| handle != 0) else {
        return;
    };
    let mut handle = handle as *mut c_void;
    // SAFETY: the handle NCCL returned at Start, passed back once.
    unsafe {
        cb(
            &mut handle,
            ncclProfilerNetEventStop as c_int,
            std::ptr::null_mut(),
            PLUGIN_ID,
            std::ptr::null_mut(),
        )
    };
}
