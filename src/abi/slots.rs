//! The slots every table version shares, and the per-version argument conversions of the
//! data path: each converts its version's C signature to one call of the version-neutral
//! core (`plugin`). Per-version rules honoured here: v9+ `irecv` always overwrites `*request`
//! (NCCL may pass the optional-completion hint 0x1 in it); sizes are checked before use; a
//! NULL where NCCL never passes one is `ncclInvalidArgument`, not a crash.

use std::{
    ffi::{c_int, c_void},
    sync::Arc,
};

use super::profiler::{self, NetEvent};
use super::{boundary, boundary_value, data_comm_owner, non_null, recv_comm, send_comm, Owner};
use crate::buffer::UserBuffer;
use crate::error::{Error, Result};
use crate::ffi::*;
use crate::oob::HANDLE_SIZE;
use crate::plugin::{self, ListenComm, Plugin, RecvComm, SendComm};
use crate::transport::{Look, WcBatch, MAX_RECVS};

pub(super) extern "C" fn devices(ndev: *mut c_int) -> ncclResult_t {
    boundary("devices", || {
        non_null(ndev, "ndev")?;
        let n = plugin::get().map(|p| p.device_count()).unwrap_or(0);
        // SAFETY: checked non-NULL; NCCL passes a writable int.
        unsafe { *ndev = n as c_int };
        Ok(())
    })
}

pub(super) fn handle_buf<'a>(handle: *mut c_void) -> Result<&'a mut [u8; HANDLE_SIZE]> {
    non_null(handle, "handle")?;
    // SAFETY: NCCL's handle is an NCCL_NET_HANDLE_MAXSIZE (128) byte buffer it owns and
    // keeps alive across the call; no other reference to it exists during the call.
    Ok(unsafe { &mut *(handle as *mut [u8; HANDLE_SIZE]) })
}

pub(super) fn listen_with(
    plugin: Result<Arc<Plugin>>,
    dev: c_int,
    handle: *mut c_void,
    listen_comm: *mut *mut c_void,
) -> ncclResult_t {
    boundary("listen", || {
        non_null(listen_comm, "listenComm")?;
        let comm = plugin?.listen(dev, handle_buf(handle)?)?;
        // SAFETY: checked non-NULL; NCCL passes a writable pointer slot.
        unsafe { *listen_comm = Box::into_raw(comm) as *mut c_void };
        Ok(())
    })
}

pub(super) extern "C" fn listen(
    dev: c_int,
    handle: *mut c_void,
    listen_comm: *mut *mut c_void,
) -> ncclResult_t {
    listen_with(plugin::get(), dev, handle, listen_comm)
}

pub(super) fn connect_with(
    plugin: Result<Arc<Plugin>>,
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    traffic_class: Option<i32>,
) -> ncclResult_t {
    boundary("connect", || {
        non_null(send_comm, "sendComm")?;
        // SAFETY: checked non-NULL; writable pointer slot. NULL means "not yet".
        unsafe { *send_comm = std::ptr::null_mut() };
        if let Some(comm) = plugin?.connect(dev, handle_buf(handle)?, traffic_class)? {
            // SAFETY: as above.
            unsafe { *send_comm = Box::into_raw(comm) as *mut c_void };
        }
        Ok(())
    })
}

pub(super) extern "C" fn connect_v6(
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
) -> ncclResult_t {
    connect_with(plugin::get(), dev, handle, send_comm, None)
}

pub(super) extern "C" fn connect_v7(
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    _dev_comm: *mut *mut ncclNetDeviceHandle_v7_t,
) -> ncclResult_t {
    connect_with(plugin::get(), dev, handle, send_comm, None)
}

pub(super) extern "C" fn connect_v10(
    dev: c_int,
    config: *mut ncclNetCommConfig_v10_t,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    _dev_comm: *mut *mut ncclNetDeviceHandle_v10_t,
) -> ncclResult_t {
    // SAFETY: NCCL passes NULL or a valid config for the duration of the call.
    let tc = (!config.is_null()).then(|| unsafe { (*config).trafficClass });
    connect_with(plugin::get(), dev, handle, send_comm, tc)
}

pub(super) extern "C" fn accept_v6(
    listen_comm: *mut c_void,
    recv_comm: *mut *mut c_void,
) -> ncclResult_t {
    boundary("accept", || {
        non_null(listen_comm, "listenComm")?;
        non_null(recv_comm, "recvComm")?;
        // SAFETY: checked non-NULL; writable pointer slot. NULL means "not yet".
        unsafe { *recv_comm = std::ptr::null_mut() };
        // SAFETY: NCCL passes back a listen comm we returned; the magic check below rejects
        // anything else before it is used.
        let listen = unsafe { &mut *(listen_comm as *mut ListenComm) };
        listen.check()?;
        if let Some(comm) = plugin::get()?.accept(listen)? {
            // SAFETY: as above.
            unsafe { *recv_comm = Box::into_raw(comm) as *mut c_void };
        }
        Ok(())
    })
}

pub(super) extern "C" fn accept_v7(
    listen_comm: *mut c_void,
    recv_comm: *mut *mut c_void,
    _dev_comm: *mut *mut ncclNetDeviceHandle_v7_t,
) -> ncclResult_t {
    accept_v6(listen_comm, recv_comm)
}

pub(super) fn reg_mr(
    comm: *mut c_void,
    data: *mut c_void,
    size: Result<usize>,
    ptr_type: c_int,
    mhandle: *mut *mut c_void,
) -> ncclResult_t {
    boundary("regMr", || {
        non_null(mhandle, "mhandle")?;
        // SAFETY: NCCL passes back a comm we returned (checked by magic).
        let (plugin, dev) = unsafe { data_comm_owner(comm)? };
        let h = plugin.reg_mr(dev, data as usize, size?, ptr_type)?;
        // SAFETY: checked non-NULL; writable pointer slot.
        unsafe { *mhandle = h as usize as *mut c_void };
        Ok(())
    })
}

pub(super) fn buffer_count(n: c_int, call: &str) -> Result<usize> {
    match usize::try_from(n) {
        Ok(n @ 1..=MAX_RECVS) => Ok(n),
        _ => Err(bad_buffer_count(n, call)),
    }
}

#[cold]
fn bad_buffer_count(n: c_int, call: &str) -> Error {
    Error::invalid_argument(format!(
        "{call} of {n} buffers; 1 to {MAX_RECVS} are allowed"
    ))
}

pub(super) fn int_size(size: c_int) -> Result<usize> {
    usize::try_from(size).map_err(|_| Error::invalid_argument(format!("negative size {size}")))
}

pub(super) extern "C" fn reg_mr_int(
    comm: *mut c_void,
    data: *mut c_void,
    size: c_int,
    ptr_type: c_int,
    mhandle: *mut *mut c_void,
) -> ncclResult_t {
    reg_mr(comm, data, int_size(size), ptr_type, mhandle)
}

pub(super) extern "C" fn reg_mr_size_t(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    ptr_type: c_int,
    mhandle: *mut *mut c_void,
) -> ncclResult_t {
    reg_mr(comm, data, Ok(size), ptr_type, mhandle)
}

pub(super) extern "C" fn reg_mr_dmabuf(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    _ptr_type: c_int,
    offset: u64,
    fd: c_int,
    mhandle: *mut *mut c_void,
) -> ncclResult_t {
    boundary("regMrDmaBuf", || {
        non_null(mhandle, "mhandle")?;
        // SAFETY: NCCL passes back a comm we returned (checked by magic).
        let (plugin, dev) = unsafe { data_comm_owner(comm)? };
        let h = plugin.reg_mr_dmabuf(dev, data as usize, size, offset, fd)?;
        // SAFETY: checked non-NULL; writable pointer slot.
        unsafe { *mhandle = h as usize as *mut c_void };
        Ok(())
    })
}

pub(super) extern "C" fn dereg_mr(comm: *mut c_void, mhandle: *mut c_void) -> ncclResult_t {
    boundary("deregMr", || {
        // SAFETY: NCCL passes back a comm we returned (checked by magic).
        let (plugin, _) = unsafe { data_comm_owner(comm)? };
        plugin.dereg_mr(mhandle as usize as u64)
    })
}

/// Wraps NCCL's pointer and size as a buffer.
pub(super) fn user_buffer(data: *mut c_void, size: usize) -> Result<UserBuffer> {
    if data.is_null() && size > 0 {
        return Err(Error::invalid_argument(format!(
            "NULL data pointer for {size} bytes"
        )));
    }
    // SAFETY: NCCL keeps `data` valid for `size` bytes until the request completes, and
    // does not write a receive buffer while the receive is in flight.
    Ok(unsafe { UserBuffer::new(data as *mut u8, size) })
}

/// `isend` of v10+ (a `size_t` size and a profiler parent), which the older versions call
/// with their `size` widened: an `int` sign-extended (negative stays negative and is
/// refused), a `size_t` as is (one beyond `i64::MAX` reads negative, and is refused too: no
/// send is that large).
///
/// Most calls are NCCL's retries before the receiver's clear-to-send: they return NULL
/// here after a few loads, calling nothing; a send that may be posted goes on to
/// [`post_send`] in a tail call.
pub(super) extern "C" fn isend_v10(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    mhandle: *mut c_void,
    phandle: *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    let sendable = boundary_value("isend", || {
        non_null(request, "request")?;
        // SAFETY: checked non-NULL; writable pointer slot. NULL means "not now".
        unsafe { *request = std::ptr::null_mut() };
        // SAFETY: NCCL passes back a send comm we returned (checked by magic).
        let comm = unsafe { send_comm(comm)? };
        Ok(comm.may_send().then_some(comm))
    });
    match sendable {
        Ok(Some(comm)) => post_send(comm, data, size, tag, mhandle, phandle, request),
        Ok(None) => ncclResult_t::ncclSuccess,
        Err(code) => code,
    }
}

/// The rest of `isend`, once the comm may have a send to post (`request` checked non-NULL).
/// The export's C signature (the comm resolved), so the export jumps here with its frame
/// already gone.
#[inline(never)]
extern "C" fn post_send(
    comm: &SendComm,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    mhandle: *mut c_void,
    phandle: *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    boundary("isend", || {
        let buf = user_buffer(data, send_size(size)?)?;
        if let Some(token) = comm.isend(buf, tag, mhandle as usize as u64)? {
            let event = || NetEvent {
                kind: 0,
                n: 1,
                size: buf.len() as u64,
                tag,
            };
            profiler::start(token, phandle, event);
            // SAFETY: checked non-NULL by the caller; writable pointer slot.
            unsafe { *request = token as *const _ as *mut c_void };
        }
        Ok(())
    })
}

/// A send's size as NCCL passed it (a `size_t`, or an `int` sign-extended): at most
/// `i64::MAX`, so a negative `int` is refused.
fn send_size(size: usize) -> Result<usize> {
    if size > i64::MAX as usize {
        return Err(bad_send_size(size as i64));
    }
    Ok(size)
}

#[cold]
fn bad_send_size(size: i64) -> Error {
    Error::invalid_argument(format!(
        "send size {size} (as a signed 64-bit number) is negative or too large"
    ))
}

pub(super) extern "C" fn isend_int(
    comm: *mut c_void,
    data: *mut c_void,
    size: c_int,
    tag: c_int,
    mhandle: *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    isend_v10(
        comm,
        data,
        i64::from(size) as usize,
        tag,
        mhandle,
        std::ptr::null_mut(),
        request,
    )
}

pub(super) extern "C" fn isend_size_t(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    mhandle: *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    isend_v10(
        comm,
        data,
        size,
        tag,
        mhandle,
        std::ptr::null_mut(),
        request,
    )
}

/// `irecv` for any version; `size_at(i)` reads the i-th size in the version's integer type.
#[allow(clippy::too_many_arguments)] // the C signature's arguments, plus the size reader
pub(super) fn irecv(
    comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    size_at: impl Fn(usize) -> Result<usize>,
    tags: *mut c_int,
    mhandles: *mut *mut c_void,
    phandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    boundary("irecv", || {
        non_null(request, "request")?;
        // SAFETY: checked non-NULL; writable pointer slot. Always overwritten: v9+ NCCL may
        // leave the optional-completion hint (0x1) in it.
        unsafe { *request = std::ptr::null_mut() };
        // SAFETY: NCCL passes back a receive comm we returned (checked by magic).
        let comm = unsafe { recv_comm(comm)? };
        let n = buffer_count(n, "irecv")?;
        non_null(data, "data")?;
        non_null(tags, "tags")?;
        non_null(mhandles, "mhandles")?;
        if n == 1 {
            // NCCL's usual receive: one buffer, no arrays to clear.
            // SAFETY: NCCL's arrays hold n (here 1) elements each.
            let (d, t, m) = unsafe { (*data, *tags, *mhandles) };
            let buf = [user_buffer(d, size_at(0)?)?];
            return post_recv(comm, &buf, &[t], &[m as usize as u64], phandles, request);
        }
        let mut bufs = [UserBuffer::EMPTY; MAX_RECVS];
        let mut tag_v = [0i32; MAX_RECVS];
        let mut mh_v = [0u64; MAX_RECVS];
        for i in 0..n {
            // SAFETY: NCCL's arrays hold n (checked 1..=8) elements each.
            let (d, t, m) = unsafe { (*data.add(i), *tags.add(i), *mhandles.add(i)) };
            bufs[i] = user_buffer(d, size_at(i)?)?;
            tag_v[i] = t;
            mh_v[i] = m as usize as u64;
        }
        post_recv(comm, &bufs[..n], &tag_v[..n], &mh_v[..n], phandles, request)
    })
}

/// The rest of `irecv`, once its arguments are read: posts the receive and hands NCCL the
/// request.
#[inline(always)]
fn post_recv(
    comm: &RecvComm,
    bufs: &[UserBuffer],
    tags: &[i32],
    mhandles: &[u64],
    phandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> Result<()> {
    if let Some(token) = comm.irecv(bufs, tags, mhandles)? {
        if !phandles.is_null() {
            let event = || NetEvent {
                kind: 1,
                n: bufs.len() as u32,
                size: bufs.iter().map(|b| b.len() as u64).sum(),
                tag: tags[0],
            };
            // SAFETY: NCCL's phandles array holds n (>= 1) parent handles.
            profiler::start(token, unsafe { *phandles }, event);
        }
        // SAFETY: checked non-NULL by the caller; writable pointer slot.
        unsafe { *request = token as *const _ as *mut c_void };
    }
    Ok(())
}

pub(super) extern "C" fn irecv_int(
    comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut c_int,
    tags: *mut c_int,
    mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    irecv(
        comm,
        n,
        data,
        |i| {
            non_null(sizes, "sizes")?;
            // SAFETY: non-NULL; NCCL's sizes array holds n elements and i < n.
            int_size(unsafe { *sizes.add(i) })
        },
        tags,
        mhandles,
        std::ptr::null_mut(),
        request,
    )
}

pub(super) extern "C" fn irecv_size_t(
    comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut usize,
    tags: *mut c_int,
    mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    irecv_v10(
        comm,
        n,
        data,
        sizes,
        tags,
        mhandles,
        std::ptr::null_mut(),
        request,
    )
}

/// `irecv` with `size_t` sizes (v9+), under profiler parents `phandles` (v10+, may be NULL).
#[allow(clippy::too_many_arguments)] // the C signature's arguments
pub(super) extern "C" fn irecv_v10(
    comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut usize,
    tags: *mut c_int,
    mhandles: *mut *mut c_void,
    phandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    irecv(
        comm,
        n,
        data,
        |i| {
            non_null(sizes, "sizes")?;
            // SAFETY: non-NULL; NCCL's sizes array holds n elements and i < n.
            Ok(unsafe { *sizes.add(i) })
        },
        tags,
        mhandles,
        phandles,
        request,
    )
}

pub(super) extern "C" fn iflush(
    comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut c_int,
    mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    boundary("iflush", || {
        non_null(request, "request")?;
        // SAFETY: checked non-NULL; writable pointer slot. NULL = nothing to wait for.
        unsafe { *request = std::ptr::null_mut() };
        // SAFETY: NCCL passes back a receive comm we returned (checked by magic).
        let comm = unsafe { recv_comm(comm)? };
        let n = buffer_count(n, "iflush")?;
        non_null(data, "data")?;
        non_null(sizes, "sizes")?;
        non_null(mhandles, "mhandles")?;
        let mut bufs = [UserBuffer::EMPTY; MAX_RECVS];
        let mut mh_v = [0u64; MAX_RECVS];
        for i in 0..n {
            // SAFETY: NCCL's arrays hold n (checked 1..=8) elements each.
            let (d, s, m) = unsafe { (*data.add(i), *sizes.add(i), *mhandles.add(i)) };
            bufs[i] = user_buffer(d, int_size(s)?)?;
            mh_v[i] = m as usize as u64;
        }
        if let Some(token) = comm.iflush(&bufs[..n], &mh_v[..n])? {
            // SAFETY: as above.
            unsafe { *request = token as *const _ as *mut c_void };
        }
        Ok(())
    })
}

/// `test` is split by path, so that each pays only for the registers it needs, and the most
/// common by far, the proxy's idle test of a receive (one CQ poll that finds nothing), for
/// almost none: `test` checks the request and jumps to [`test_recv`] or [`test_send`]
/// (extern "C": they cannot unwind, so `test` need not stay around to catch a panic);
/// [`test_recv`] polls, keeping nothing but its arguments across the call, and calls
/// [`test_found`] or [`test_recv_locked`] for what the poll did not answer.
pub(super) extern "C" fn test(
    request: *mut c_void,
    done: *mut c_int,
    sizes: *mut c_int,
) -> ncclResult_t {
    let owner = boundary_value("test", || {
        // SAFETY: NCCL passes back a request we returned (or NULL).
        Ok(unsafe { super::look_at_request(request, done) })
    });
    match owner {
        Ok(Owner::Recv) => test_recv(request, done, sizes),
        Ok(Owner::Send) => test_send(request, done, sizes),
        Ok(Owner::Invalid) => test_invalid(request, done),
        Err(code) => code,
    }
}

/// A receive's `test`, behind `test`'s checks: the poll without the lock.
#[inline(never)]
extern "C" fn test_recv(request: *mut c_void, done: *mut c_int, sizes: *mut c_int) -> ncclResult_t {
    let mut wc = WcBatch::new();
    let polled = boundary_value("test", || {
        // SAFETY: `test` checked the request (a receive's) and `done`.
        Ok(unsafe { super::poll_request(request, done, &mut wc) })
    });
    match polled {
        Ok(Some(Look::Idle)) => ncclResult_t::ncclSuccess,
        Ok(Some(Look::Found)) => test_found(request, done, sizes, &mut wc),
        // No poll allowed (a jump: nothing on this stack is in use yet), or it failed: the
        // lock decides.
        Ok(None) => test_recv_locked(request, done, sizes),
        Ok(Some(_)) => test_recv_locked(request, done, sizes),
        Err(code) => code,
    }
}

/// The rest of a receive's `test` whose poll found completions, in `wc`.
#[inline(never)]
fn test_found(
    request: *mut c_void,
    done: *mut c_int,
    sizes: *mut c_int,
    wc: &mut WcBatch,
) -> ncclResult_t {
    boundary("test", || {
        // SAFETY: `test` checked the request (a receive's) and `done`; NCCL's sizes array has
        // room for every message of the request (or is NULL).
        unsafe { super::test_recv_request(request, done, sizes, Some(Look::Found), wc) }
    })
}

/// The rest of a receive's `test` that made no poll without the lock.
#[inline(never)]
extern "C" fn test_recv_locked(
    request: *mut c_void,
    done: *mut c_int,
    sizes: *mut c_int,
) -> ncclResult_t {
    let mut wc = WcBatch::new();
    boundary("test", || {
        // SAFETY: as for `test_found`.
        unsafe { super::test_recv_request(request, done, sizes, None, &mut wc) }
    })
}

/// A send's `test`, behind `test`'s checks.
#[inline(never)]
extern "C" fn test_send(request: *mut c_void, done: *mut c_int, sizes: *mut c_int) -> ncclResult_t {
    // SAFETY: `test` checked the request (a send's) and `done`; NCCL's sizes array has room
    // for the request's message (or is NULL).
    boundary("test", || unsafe {
        super::test_send_request(request, done, sizes)
    })
}

/// A `test` whose request or `done` `test`'s checks refused: the error that says why.
#[cold]
#[inline(never)]
extern "C" fn test_invalid(request: *mut c_void, done: *mut c_int) -> ncclResult_t {
    boundary("test", || {
        // SAFETY: as for `test`.
        Err(unsafe { super::request_error(request, done) })
    })
}

pub(super) extern "C" fn close_send(comm: *mut c_void) -> ncclResult_t {
    boundary("closeSend", || {
        // SAFETY: NCCL passes back a send comm we returned (checked by magic).
        unsafe { send_comm(comm)? };
        // SAFETY: it is a live SendComm that we boxed; NCCL gives up the pointer here.
        let mut comm = unsafe { Box::from_raw(comm as *mut SendComm) };
        comm.retire();
        Ok(())
    })
}

pub(super) extern "C" fn close_recv(comm: *mut c_void) -> ncclResult_t {
    boundary("closeRecv", || {
        // SAFETY: NCCL passes back a receive comm we returned (checked by magic).
        unsafe { recv_comm(comm)? };
        // SAFETY: it is a live RecvComm that we boxed; NCCL gives up the pointer here.
        let mut comm = unsafe { Box::from_raw(comm as *mut RecvComm) };
        comm.retire();
        Ok(())
    })
}

pub(super) extern "C" fn close_listen(comm: *mut c_void) -> ncclResult_t {
    boundary("closeListen", || {
        non_null(comm, "listenComm")?;
        // SAFETY: NCCL passes back a listen comm we returned; checked by magic before use.
        unsafe { &*(comm as *const ListenComm) }.check()?;
        // SAFETY: it is a live ListenComm that we boxed; NCCL gives up the pointer here.
        let mut comm = unsafe { Box::from_raw(comm as *mut ListenComm) };
        comm.retire();
        Ok(())
    })
}
