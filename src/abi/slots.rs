//! The slots every table version shares, and the per-version argument conversions of the
//! data path: each converts its version's C signature to one call of the version-neutral
//! core (`plugin`). Per-version rules honoured here: v4 sends and receives one buffer with
//! no tag (tag 0 at both ends); v9+ `irecv` always overwrites `*request` (NCCL may pass the
//! optional-completion hint 0x1 in it); sizes are checked once, before use; a NULL where
//! NCCL never passes one is `ncclInternalError` (NCCL's misuse), not a crash.

use std::{
    ffi::{c_int, c_void},
    sync::Arc,
    time::{Duration, Instant},
};

use super::profiler::{self, NetEvent};
use super::{
    boundary, data_comm_owner, listen_comm, non_null, recv_comm, request_token, send_comm,
    NcclSizes,
};
use crate::buffer::UserBuffer;
use crate::error::{Error, Result};
use crate::ffi::*;
use crate::plugin::{
    self, Plugin, RecvComm, RequestOwner, SendComm, HANDLE_SIZE, MAX_P2P_BYTES, MAX_RECVS,
};

pub(super) extern "C" fn devices(ndev: *mut c_int) -> ncclResult_t {
    boundary("devices", || {
        non_null(ndev, "ndev")?;
        let n = plugin::get().map(|p| p.device_count()).unwrap_or(0);
        // SAFETY: checked non-NULL; NCCL passes a writable int.
        unsafe { *ndev = n as c_int };
        Ok(())
    })
}

// The handle we write and read must fit the smallest buffer NCCL passes (NCCL 2.9's).
const _: () = assert!(HANDLE_SIZE <= NCCL_NET_HANDLE_MAXSIZE_V4 as usize);

/// NCCL's handle buffer, as the first `HANDLE_SIZE` bytes the plugin reads and writes.
pub(super) fn handle_buf<'a>(handle: *mut c_void) -> Result<&'a mut [u8; HANDLE_SIZE]> {
    non_null(handle, "handle")?;
    // SAFETY: NCCL's handle is a buffer it owns and keeps alive across the call, 64 bytes
    // (NCCL_NET_HANDLE_MAXSIZE_V4) for v4 and 128 (NCCL_NET_HANDLE_MAXSIZE) for v5+; only its
    // first HANDLE_SIZE = 64 bytes are touched, which both hold. No other reference to it
    // exists during the call.
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

/// How a version's `connect` and `accept` return.
#[derive(Debug, Clone, Copy)]
pub(super) enum Steps {
    /// After one non-blocking step, with NULL for "not yet" (v5 and later).
    One,
    /// With the comm, stepped to completion (v4: [`until_comm`]).
    ToCompletion,
}

/// Steps `step` (one non-blocking connect or accept step, as the v5+ slots take) until it
/// yields a comm or fails; past `NCCL_ERDMA_CONNECT_TIMEOUT_MS` it fails with
/// `ncclRemoteError`, `what` naming the call and the peer.
///
/// The one place the plugin waits on NCCL's thread: NCCL <= 2.11 calls `connect` and
/// `accept` once each and hands the comm to `regMr` at once, so the v4 contract itself asks
/// for a usable comm from one call (NVIDIA's own example shims for v4 and older loop the
/// same way). The handshake is one-way, so the wait is only for the hello to go out (connect)
/// or to come (accept), never for the peer's other call.
fn until_comm<C>(what: &str, mut step: impl FnMut() -> Result<Option<C>>) -> Result<C> {
    let timeout = Duration::from_millis(plugin::get()?.config.connect_timeout_ms.value);
    let start = Instant::now();
    // Short naps first, so a setup that is nearly done is not held back; then 1 ms, so a
    // long wait (the peer's rank still starting) costs little CPU.
    let mut nap = Duration::from_micros(50);
    loop {
        if let Some(comm) = step()? {
            return Ok(comm);
        }
        if start.elapsed() >= timeout {
            return Err(Error::remote(format!(
                "{what} did not complete within {} ms (NCCL_ERDMA_CONNECT_TIMEOUT_MS)",
                timeout.as_millis()
            )));
        }
        std::thread::sleep(nap);
        nap = (nap * 2).min(Duration::from_millis(1));
    }
}

pub(super) fn connect_with(
    plugin: Result<Arc<Plugin>>,
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    traffic_class: Option<i32>,
    steps: Steps,
) -> ncclResult_t {
    boundary("connect", || {
        non_null(send_comm, "sendComm")?;
        // SAFETY: checked non-NULL; writable pointer slot. NULL means "not yet".
        unsafe { *send_comm = std::ptr::null_mut() };
        let (plugin, buf) = (plugin?, handle_buf(handle)?);
        let comm = match steps {
            Steps::One => plugin.connect(dev, buf, traffic_class)?,
            Steps::ToCompletion => {
                let what = format!("connect to {}", plugin::handle_peer(buf));
                Some(until_comm(&what, || {
                    plugin.connect(dev, buf, traffic_class)
                })?)
            }
        };
        if let Some(comm) = comm {
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
    connect_with(plugin::get(), dev, handle, send_comm, None, Steps::One)
}

pub(super) extern "C" fn connect_v7(
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    _dev_comm: *mut *mut ncclNetDeviceHandle_v7_t,
) -> ncclResult_t {
    connect_with(plugin::get(), dev, handle, send_comm, None, Steps::One)
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
    connect_with(plugin::get(), dev, handle, send_comm, tc, Steps::One)
}

pub(super) fn accept_with(
    listen_comm: *mut c_void,
    recv_comm: *mut *mut c_void,
    steps: Steps,
) -> ncclResult_t {
    boundary("accept", || {
        non_null(recv_comm, "recvComm")?;
        // SAFETY: checked non-NULL; writable pointer slot. NULL means "not yet".
        unsafe { *recv_comm = std::ptr::null_mut() };
        // SAFETY: NCCL passes back a listen comm we returned (checked by magic).
        let listen = unsafe { super::listen_comm(listen_comm)? };
        let plugin = plugin::get()?;
        let comm = match steps {
            Steps::One => plugin.accept(listen)?,
            Steps::ToCompletion => {
                let what = "accept of a peer's connection";
                Some(until_comm(what, || plugin.accept(listen))?)
            }
        };
        if let Some(comm) = comm {
            // SAFETY: as above.
            unsafe { *recv_comm = Box::into_raw(comm) as *mut c_void };
        }
        Ok(())
    })
}

pub(super) extern "C" fn accept_v6(
    listen_comm: *mut c_void,
    recv_comm: *mut *mut c_void,
) -> ncclResult_t {
    accept_with(listen_comm, recv_comm, Steps::One)
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
    Error::misuse(format!(
        "{call} of {n} buffers; 1 to {MAX_RECVS} are allowed"
    ))
}

pub(super) fn int_size(size: c_int) -> Result<usize> {
    usize::try_from(size).map_err(|_| Error::misuse(format!("negative size {size}")))
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
        return Err(Error::misuse(format!("NULL data pointer for {size} bytes")));
    }
    // SAFETY: NCCL keeps `data` valid for `size` bytes until the request completes, and
    // does not write a receive buffer while the receive is in flight.
    Ok(unsafe { UserBuffer::new(data as *mut u8, size) })
}

/// `isend` of v10+ (a `size_t` size and a profiler parent), which the older versions call
/// with their `size` widened: an `int` sign-extended (a negative one reads beyond
/// `maxP2pBytes` and is refused), a `size_t` as is.
pub(super) extern "C" fn isend_v10(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    mhandle: *mut c_void,
    phandle: *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    boundary("isend", || {
        non_null(request, "request")?;
        // SAFETY: checked non-NULL; writable pointer slot. NULL means "not now".
        unsafe { *request = std::ptr::null_mut() };
        // SAFETY: NCCL passes back a send comm we returned (checked by magic).
        let comm = unsafe { send_comm(comm)? };
        let buf = user_buffer(data, send_size(size)?)?;
        if let Some(token) = comm.isend(buf, tag, mhandle as usize as u64)? {
            let event = || NetEvent {
                kind: 0,
                n: 1,
                size: buf.len() as u64,
                tag,
            };
            profiler::start(token, phandle, event);
            // SAFETY: checked non-NULL; writable pointer slot.
            unsafe { *request = token as *const _ as *mut c_void };
        }
        Ok(())
    })
}

/// A send's size as NCCL passed it (a `size_t`, or an `int` sign-extended), checked against
/// `maxP2pBytes`: the one check of a send's size before the transport compares it with the
/// receive.
#[inline]
fn send_size(size: usize) -> Result<usize> {
    if size > MAX_P2P_BYTES {
        return Err(bad_send_size(size));
    }
    Ok(size)
}

#[cold]
fn bad_send_size(size: usize) -> Error {
    Error::misuse(format!(
        "send of {} bytes is negative or exceeds maxP2pBytes ({MAX_P2P_BYTES})",
        size as i64
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

/// The tag of every v4 send and receive. v4 has no tags, and the transport matches a send to
/// a receive by tag, so both ends use the same one (messages then match in posting order).
const V4_TAG: c_int = 0;

/// v4 `isend`: no tag.
pub(super) extern "C" fn isend_v4(
    comm: *mut c_void,
    data: *mut c_void,
    size: c_int,
    mhandle: *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    isend_int(comm, data, size, V4_TAG, mhandle, request)
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

/// v4 `irecv`: one buffer, no tag.
pub(super) extern "C" fn irecv_v4(
    comm: *mut c_void,
    data: *mut c_void,
    size: c_int,
    mhandle: *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    let (mut data, mut tag, mut mhandle) = (data, V4_TAG, mhandle);
    irecv(
        comm,
        1,
        &mut data,
        |_| int_size(size),
        &mut tag,
        &mut mhandle,
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

/// v4 `iflush`: one buffer.
pub(super) extern "C" fn iflush_v4(
    comm: *mut c_void,
    data: *mut c_void,
    size: c_int,
    mhandle: *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    let (mut data, mut size, mut mhandle) = (data, size, mhandle);
    iflush(comm, 1, &mut data, &mut size, &mut mhandle, request)
}

/// `test` of any request: the comm that owns it tests it, and `done` (and, once done, the
/// sizes) are written for NCCL. Only a request's own messages' sizes are written, so v4's one
/// `int` (its requests are all of one message) is never overrun.
pub(super) extern "C" fn test(
    request: *mut c_void,
    done: *mut c_int,
    sizes: *mut c_int,
) -> ncclResult_t {
    boundary("test", || {
        // SAFETY: NCCL passes back a request we returned (or NULL), whose comm is open.
        let token = unsafe { request_token(request)? };
        non_null(done, "done")?;
        // SAFETY: NCCL's sizes array has room for every message of the request (or is NULL).
        let mut sizes = unsafe { NcclSizes::new(sizes) };
        let finished = match token.owner {
            RequestOwner::Send(comm) => {
                // SAFETY: a live token's comm is live (it holds the token), of the kind named.
                let comm = unsafe { &*(comm as *const SendComm) };
                comm.test(token.slot, &mut sizes)?
            }
            RequestOwner::Recv(comm) => {
                // SAFETY: as above.
                let comm = unsafe { &*(comm as *const RecvComm) };
                comm.test(token.slot, &mut sizes)?
            }
        };
        if finished {
            profiler::stop(token);
        }
        // SAFETY: checked non-NULL; writable by contract.
        unsafe { *done = c_int::from(finished) };
        Ok(())
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
        // SAFETY: NCCL passes back a listen comm we returned (checked by magic).
        let listen = unsafe { listen_comm(comm)? };
        listen.retire();
        // SAFETY: it is a live ListenComm that we boxed; NCCL gives up the pointer here.
        drop(unsafe { Box::from_raw(listen) });
        Ok(())
    })
}
