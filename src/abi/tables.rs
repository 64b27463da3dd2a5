//! The exported `ncclNetPlugin_vN` tables and their thin per-version adapters.
//!
//! Each slot converts its version's C signature to one call of the version-neutral core
//! (`plugin`). Per-version rules honoured here: properties are zero-filled with
//! `netDeviceType` HOST; `maxP2pBytes` is in (0, 1 TiB]; v9+ `irecv` always overwrites
//! `*request` (NCCL may pass the optional-completion hint 0x1 in it); v11 has a
//! per-communicator context and a `finalize` that accepts NULL or a never-initialised
//! context; `getDeviceMr`, `irecvConsumed`, `makeVDevice` and `setNetAttr` are NULL.

use std::{
    collections::HashSet,
    ffi::{c_char, c_int, c_void},
    sync::Arc,
};

use parking_lot::Mutex;

use super::profiler::{self, NetEvent};
use super::{boundary, data_comm_owner, install_logging, non_null, recv_comm, send_comm};
use crate::buffer::UserBuffer;
use crate::error::{Error, Result};
use crate::ffi::*;
use crate::oob::HANDLE_SIZE;
use crate::plugin::{self, ListenComm, Plugin, RecvComm, SendComm, MAX_COLL_BYTES, NAME};
use crate::transport::{DeviceProps, MAX_P2P_BYTES, MAX_RECVS};

/// A vtable as exported. `#[repr(transparent)]` keeps the C layout.
#[repr(transparent)]
pub struct Table<T>(pub T);

// SAFETY: the tables are immutable after load; the only pointer they hold besides function
// pointers is the 'static name string.
unsafe impl<T> Sync for Table<T> {}

const NAME_C: &std::ffi::CStr = c"erdma";
const _: () = assert!(NAME_C.to_bytes().len() == NAME.len());

// ---------------------------------------------------------------------------------------
// Shared slot bodies

fn init_common(logger: ncclDebugLogger_t) -> Result<Arc<Plugin>> {
    install_logging(logger);
    plugin::init()
}

extern "C" fn devices(ndev: *mut c_int) -> ncclResult_t {
    boundary("devices", || {
        non_null(ndev, "ndev")?;
        let n = plugin::get().map(|p| p.device_count()).unwrap_or(0);
        // SAFETY: checked non-NULL; NCCL passes a writable int.
        unsafe { *ndev = n as c_int };
        Ok(())
    })
}

/// Fills the fields every properties version shares, on a zeroed struct.
macro_rules! fill_common {
    ($p:expr, $d:expr) => {{
        let d: &DeviceProps = $d;
        $p.name = d.name_ptr() as *mut c_char;
        $p.pciPath = d.pci_path_ptr() as *mut c_char;
        $p.guid = d.guid;
        $p.ptrSupport = d.ptr_support;
        $p.speed = d.speed_mbps;
        $p.port = d.port;
        $p.latency = 0.0;
        $p.maxComms = d.max_comms;
        $p.maxRecvs = MAX_RECVS as c_int;
    }};
}

/// Fills the fields of v7 and later (device offload: none).
macro_rules! fill_v7 {
    ($p:expr, $d:expr) => {{
        fill_common!($p, $d);
        $p.netDeviceType = NCCL_NET_DEVICE_HOST;
        $p.netDeviceVersion = NCCL_NET_DEVICE_INVALID_VERSION as c_int;
    }};
}

/// Fills the fields of v9 and later.
macro_rules! fill_v9 {
    ($p:expr, $d:expr, $dev:expr) => {{
        fill_v7!($p, $d);
        $p.regIsGlobal = 1;
        $p.forceFlush = c_int::from($d.force_flush);
        $p.vProps.ndevs = 1;
        $p.vProps.devs[0] = $dev;
        $p.maxP2pBytes = MAX_P2P_BYTES;
        $p.maxCollBytes = MAX_COLL_BYTES;
    }};
}

/// Runs `getProperties` for any version: zero-fill, then `fill`.
fn properties<P: Default>(
    dev: c_int,
    props: *mut P,
    fill: impl FnOnce(&mut P, &DeviceProps),
) -> ncclResult_t {
    boundary("getProperties", || {
        non_null(props, "props")?;
        let plugin = plugin::get()?;
        let device = plugin.device(dev)?;
        let mut p = P::default();
        fill(&mut p, device);
        // SAFETY: checked non-NULL; NCCL passes a writable struct of this version's layout.
        unsafe { props.write(p) };
        Ok(())
    })
}

fn handle_buf<'a>(handle: *mut c_void) -> Result<&'a mut [u8; HANDLE_SIZE]> {
    non_null(handle, "handle")?;
    // SAFETY: NCCL's handle is an NCCL_NET_HANDLE_MAXSIZE (128) byte buffer it owns and
    // keeps alive across the call; no other reference to it exists during the call.
    Ok(unsafe { &mut *(handle as *mut [u8; HANDLE_SIZE]) })
}

fn listen_with(
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

extern "C" fn listen(
    dev: c_int,
    handle: *mut c_void,
    listen_comm: *mut *mut c_void,
) -> ncclResult_t {
    listen_with(plugin::get(), dev, handle, listen_comm)
}

fn connect_with(
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

extern "C" fn connect_v6(
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
) -> ncclResult_t {
    connect_with(plugin::get(), dev, handle, send_comm, None)
}

extern "C" fn connect_v7(
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    _dev_comm: *mut *mut ncclNetDeviceHandle_v7_t,
) -> ncclResult_t {
    connect_with(plugin::get(), dev, handle, send_comm, None)
}

extern "C" fn connect_v10(
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

extern "C" fn accept_v6(listen_comm: *mut c_void, recv_comm: *mut *mut c_void) -> ncclResult_t {
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

extern "C" fn accept_v7(
    listen_comm: *mut c_void,
    recv_comm: *mut *mut c_void,
    _dev_comm: *mut *mut ncclNetDeviceHandle_v7_t,
) -> ncclResult_t {
    accept_v6(listen_comm, recv_comm)
}

fn reg_mr(
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

fn buffer_count(n: c_int, call: &str) -> Result<usize> {
    usize::try_from(n)
        .ok()
        .filter(|n| (1..=MAX_RECVS).contains(n))
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{call} of {n} buffers; 1 to {MAX_RECVS} are allowed"
            ))
        })
}

fn int_size(size: c_int) -> Result<usize> {
    usize::try_from(size).map_err(|_| Error::InvalidArgument(format!("negative size {size}")))
}

extern "C" fn reg_mr_int(
    comm: *mut c_void,
    data: *mut c_void,
    size: c_int,
    ptr_type: c_int,
    mhandle: *mut *mut c_void,
) -> ncclResult_t {
    reg_mr(comm, data, int_size(size), ptr_type, mhandle)
}

extern "C" fn reg_mr_size_t(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    ptr_type: c_int,
    mhandle: *mut *mut c_void,
) -> ncclResult_t {
    reg_mr(comm, data, Ok(size), ptr_type, mhandle)
}

extern "C" fn reg_mr_dmabuf(
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

extern "C" fn dereg_mr(comm: *mut c_void, mhandle: *mut c_void) -> ncclResult_t {
    boundary("deregMr", || {
        // SAFETY: NCCL passes back a comm we returned (checked by magic).
        let (plugin, _) = unsafe { data_comm_owner(comm)? };
        plugin.dereg_mr(mhandle as usize as u64)
    })
}

/// Wraps NCCL's pointer and size as a buffer.
fn user_buffer(data: *mut c_void, size: usize) -> Result<UserBuffer> {
    if data.is_null() && size > 0 {
        return Err(Error::InvalidArgument(format!(
            "NULL data pointer for {size} bytes"
        )));
    }
    // SAFETY: NCCL keeps `data` valid for `size` bytes until the request completes, and
    // does not write a receive buffer while the receive is in flight.
    Ok(unsafe { UserBuffer::new(data as *mut u8, size) })
}

fn isend(
    comm: *mut c_void,
    data: *mut c_void,
    size: Result<usize>,
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
        let buf = user_buffer(data, size?)?;
        if let Some(token) = comm.isend(buf, tag, mhandle as usize as u64)? {
            let event = NetEvent {
                kind: 0,
                n: 1,
                size: buf.len() as u64,
                tag,
            };
            profiler::start(token, phandle, event);
            // SAFETY: as above.
            unsafe { *request = token as *const _ as *mut c_void };
        }
        Ok(())
    })
}

extern "C" fn isend_int(
    comm: *mut c_void,
    data: *mut c_void,
    size: c_int,
    tag: c_int,
    mhandle: *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    isend(
        comm,
        data,
        int_size(size),
        tag,
        mhandle,
        std::ptr::null_mut(),
        request,
    )
}

extern "C" fn isend_size_t(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    mhandle: *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    isend(
        comm,
        data,
        Ok(size),
        tag,
        mhandle,
        std::ptr::null_mut(),
        request,
    )
}

extern "C" fn isend_v10(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    mhandle: *mut c_void,
    phandle: *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    isend(comm, data, Ok(size), tag, mhandle, phandle, request)
}

/// `irecv` for any version; `size_at(i)` reads the i-th size in the version's integer type.
#[allow(clippy::too_many_arguments)] // the C signature's arguments, plus the size reader
fn irecv(
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
        if let Some(token) = comm.irecv(&bufs[..n], &tag_v[..n], &mh_v[..n])? {
            if !phandles.is_null() {
                let event = NetEvent {
                    kind: 1,
                    n: n as u32,
                    size: bufs[..n].iter().map(|b| b.len() as u64).sum(),
                    tag: tag_v[0],
                };
                // SAFETY: NCCL's phandles array holds n (>= 1) parent handles.
                profiler::start(token, unsafe { *phandles }, event);
            }
            // SAFETY: as above.
            unsafe { *request = token as *const _ as *mut c_void };
        }
        Ok(())
    })
}

extern "C" fn irecv_int(
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

extern "C" fn irecv_size_t(
    comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut usize,
    tags: *mut c_int,
    mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    irecv_sizes(
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
fn irecv_sizes(
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

extern "C" fn irecv_v10(
    comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut usize,
    tags: *mut c_int,
    mhandles: *mut *mut c_void,
    phandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    irecv_sizes(comm, n, data, sizes, tags, mhandles, phandles, request)
}

extern "C" fn iflush(
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

extern "C" fn test(request: *mut c_void, done: *mut c_int, sizes: *mut c_int) -> ncclResult_t {
    // SAFETY: NCCL passes back a request we returned, a writable done flag and a sizes array
    // with room for every message of the request (or NULL).
    boundary("test", || unsafe {
        super::test_request(request, done, sizes)
    })
}

extern "C" fn close_send(comm: *mut c_void) -> ncclResult_t {
    boundary("closeSend", || {
        // SAFETY: NCCL passes back a send comm we returned (checked by magic).
        unsafe { send_comm(comm)? };
        // SAFETY: it is a live SendComm that we boxed; NCCL gives up the pointer here.
        let mut comm = unsafe { Box::from_raw(comm as *mut SendComm) };
        comm.retire();
        Ok(())
    })
}

extern "C" fn close_recv(comm: *mut c_void) -> ncclResult_t {
    boundary("closeRecv", || {
        // SAFETY: NCCL passes back a receive comm we returned (checked by magic).
        unsafe { recv_comm(comm)? };
        // SAFETY: it is a live RecvComm that we boxed; NCCL gives up the pointer here.
        let mut comm = unsafe { Box::from_raw(comm as *mut RecvComm) };
        comm.retire();
        Ok(())
    })
}

extern "C" fn close_listen(comm: *mut c_void) -> ncclResult_t {
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

// ---------------------------------------------------------------------------------------
// Per-version init and properties

extern "C" fn init_v6(logger: ncclDebugLogger_t) -> ncclResult_t {
    boundary("init", || init_common(logger).map(|_| ()))
}

extern "C" fn init_v10(
    logger: ncclDebugLogger_t,
    profiler_fn: ncclProfilerCallback_t,
) -> ncclResult_t {
    profiler::set(profiler_fn);
    boundary("init", || init_common(logger).map(|_| ()))
}

extern "C" fn get_properties_v6(dev: c_int, props: *mut ncclNetProperties_v6_t) -> ncclResult_t {
    properties(dev, props, |p, d| fill_common!(p, d))
}

extern "C" fn get_properties_v7(dev: c_int, props: *mut ncclNetProperties_v7_t) -> ncclResult_t {
    properties(dev, props, |p, d| fill_v7!(p, d))
}

extern "C" fn get_properties_v8(dev: c_int, props: *mut ncclNetProperties_v8_t) -> ncclResult_t {
    properties(dev, props, |p, d| {
        fill_v7!(p, d);
        p.regIsGlobal = 1;
    })
}

extern "C" fn get_properties_v9(dev: c_int, props: *mut ncclNetProperties_v9_t) -> ncclResult_t {
    properties(dev, props, |p, d| fill_v9!(p, d, dev))
}

extern "C" fn get_properties_v11(dev: c_int, props: *mut ncclNetProperties_v11_t) -> ncclResult_t {
    properties(dev, props, |p, d| {
        fill_v9!(p, d, dev);
        p.maxMultiRequestSize = 1;
    })
}

// ---------------------------------------------------------------------------------------
// v11: per-communicator contexts

/// What `init` hands NCCL as `ctx` in v11.
struct NetContext {
    plugin: Arc<Plugin>,
    traffic_class: i32,
}

/// Live contexts, so `finalize`/`listen`/`connect` can refuse a pointer that is not one.
static CONTEXTS: Mutex<Option<HashSet<usize>>> = Mutex::new(None);

fn context(ctx: *mut c_void) -> Result<Arc<Plugin>> {
    if ctx.is_null() {
        return plugin::get();
    }
    let live = CONTEXTS
        .lock()
        .as_ref()
        .is_some_and(|set| set.contains(&(ctx as usize)));
    if !live {
        return Err(Error::Misuse("unknown net context".into()));
    }
    // SAFETY: registered contexts are live boxed NetContexts (removed before being freed).
    Ok(Arc::clone(&unsafe { &*(ctx as *const NetContext) }.plugin))
}

fn context_traffic_class(ctx: *mut c_void) -> Option<i32> {
    if ctx.is_null() {
        return None;
    }
    // SAFETY: only called after `context` accepted ctx as a live registered NetContext.
    let tc = unsafe { (*(ctx as *const NetContext)).traffic_class };
    (tc >= 0).then_some(tc)
}

extern "C" fn init_v11(
    ctx: *mut *mut c_void,
    _comm_id: u64,
    config: *mut ncclNetCommConfig_v11_t,
    logger: ncclDebugLogger_t,
    profiler_fn: ncclProfilerCallback_t,
) -> ncclResult_t {
    profiler::set(profiler_fn);
    boundary("init", || {
        non_null(ctx, "ctx")?;
        let plugin = init_common(logger)?;
        let traffic_class = if config.is_null() {
            -1
        } else {
            // SAFETY: NCCL passes NULL or a valid config for the duration of the call.
            unsafe { (*config).trafficClass }
        };
        let raw = Box::into_raw(Box::new(NetContext {
            plugin,
            traffic_class,
        })) as *mut c_void;
        CONTEXTS
            .lock()
            .get_or_insert_with(HashSet::new)
            .insert(raw as usize);
        // SAFETY: checked non-NULL; NCCL passes a writable pointer slot.
        unsafe { *ctx = raw };
        Ok(())
    })
}

extern "C" fn finalize_v11(ctx: *mut c_void) -> ncclResult_t {
    boundary("finalize", || {
        // NCCL 2.28 calls finalize even after a failed init, with its ctx still NULL.
        if ctx.is_null() {
            return Ok(());
        }
        let removed = CONTEXTS
            .lock()
            .as_mut()
            .is_some_and(|set| set.remove(&(ctx as usize)));
        if !removed {
            return Err(Error::Misuse("finalize of an unknown net context".into()));
        }
        // SAFETY: it was registered, so it is a NetContext we boxed in init; it is now
        // unregistered, so nothing else can reach it.
        drop(unsafe { Box::from_raw(ctx as *mut NetContext) });
        Ok(())
    })
}

extern "C" fn listen_v11(
    ctx: *mut c_void,
    dev: c_int,
    handle: *mut c_void,
    listen_comm: *mut *mut c_void,
) -> ncclResult_t {
    listen_with(context(ctx), dev, handle, listen_comm)
}

extern "C" fn connect_v11(
    ctx: *mut c_void,
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    _dev_comm: *mut *mut ncclNetDeviceHandle_v11_t,
) -> ncclResult_t {
    let traffic_class = context(ctx).ok().and_then(|_| context_traffic_class(ctx));
    connect_with(context(ctx), dev, handle, send_comm, traffic_class)
}

// ---------------------------------------------------------------------------------------
// The tables

/// NCCL 2.13 - 2.18 (and later, as a fallback).
#[no_mangle]
pub static ncclNetPlugin_v6: Table<ncclNet_v6_t> = Table(ncclNet_v6_t {
    name: NAME_C.as_ptr(),
    init: Some(init_v6),
    devices: Some(devices),
    getProperties: Some(get_properties_v6),
    listen: Some(listen),
    connect: Some(connect_v6),
    accept: Some(accept_v6),
    regMr: Some(reg_mr_int),
    regMrDmaBuf: Some(reg_mr_dmabuf),
    deregMr: Some(dereg_mr),
    isend: Some(isend_int),
    irecv: Some(irecv_int),
    iflush: Some(iflush),
    test: Some(test),
    closeSend: Some(close_send),
    closeRecv: Some(close_recv),
    closeListen: Some(close_listen),
});

/// NCCL 2.19.
#[no_mangle]
pub static ncclNetPlugin_v7: Table<ncclNet_v7_t> = Table(ncclNet_v7_t {
    name: NAME_C.as_ptr(),
    init: Some(init_v6),
    devices: Some(devices),
    getProperties: Some(get_properties_v7),
    listen: Some(listen),
    connect: Some(connect_v7),
    accept: Some(accept_v7),
    regMr: Some(reg_mr_int),
    regMrDmaBuf: Some(reg_mr_dmabuf),
    deregMr: Some(dereg_mr),
    isend: Some(isend_int),
    irecv: Some(irecv_int),
    iflush: Some(iflush),
    test: Some(test),
    closeSend: Some(close_send),
    closeRecv: Some(close_recv),
    closeListen: Some(close_listen),
    getDeviceMr: None,
    irecvConsumed: None,
});

/// NCCL 2.20 - 2.23.
#[no_mangle]
pub static ncclNetPlugin_v8: Table<ncclNet_v8_t> = Table(ncclNet_v8_t {
    name: NAME_C.as_ptr(),
    init: Some(init_v6),
    devices: Some(devices),
    getProperties: Some(get_properties_v8),
    listen: Some(listen),
    connect: Some(connect_v7),
    accept: Some(accept_v7),
    regMr: Some(reg_mr_size_t),
    regMrDmaBuf: Some(reg_mr_dmabuf),
    deregMr: Some(dereg_mr),
    isend: Some(isend_int),
    irecv: Some(irecv_int),
    iflush: Some(iflush),
    test: Some(test),
    closeSend: Some(close_send),
    closeRecv: Some(close_recv),
    closeListen: Some(close_listen),
    getDeviceMr: None,
    irecvConsumed: None,
});

/// NCCL 2.24 - 2.25.
#[no_mangle]
pub static ncclNetPlugin_v9: Table<ncclNet_v9_t> = Table(ncclNet_v9_t {
    name: NAME_C.as_ptr(),
    init: Some(init_v6),
    devices: Some(devices),
    getProperties: Some(get_properties_v9),
    listen: Some(listen),
    connect: Some(connect_v7),
    accept: Some(accept_v7),
    regMr: Some(reg_mr_size_t),
    regMrDmaBuf: Some(reg_mr_dmabuf),
    deregMr: Some(dereg_mr),
    isend: Some(isend_size_t),
    irecv: Some(irecv_size_t),
    iflush: Some(iflush),
    test: Some(test),
    closeSend: Some(close_send),
    closeRecv: Some(close_recv),
    closeListen: Some(close_listen),
    getDeviceMr: None,
    irecvConsumed: None,
    makeVDevice: None,
});

/// NCCL 2.26 - 2.27.
#[no_mangle]
pub static ncclNetPlugin_v10: Table<ncclNet_v10_t> = Table(ncclNet_v10_t {
    name: NAME_C.as_ptr(),
    init: Some(init_v10),
    devices: Some(devices),
    getProperties: Some(get_properties_v9),
    listen: Some(listen),
    connect: Some(connect_v10),
    accept: Some(accept_v7),
    regMr: Some(reg_mr_size_t),
    regMrDmaBuf: Some(reg_mr_dmabuf),
    deregMr: Some(dereg_mr),
    isend: Some(isend_v10),
    irecv: Some(irecv_v10),
    iflush: Some(iflush),
    test: Some(test),
    closeSend: Some(close_send),
    closeRecv: Some(close_recv),
    closeListen: Some(close_listen),
    getDeviceMr: None,
    irecvConsumed: None,
    makeVDevice: None,
});

/// NCCL 2.28 and later (PyTorch 2.11 ships 2.28.9).
#[no_mangle]
pub static ncclNetPlugin_v11: Table<ncclNet_v11_t> = Table(ncclNet_v11_t {
    name: NAME_C.as_ptr(),
    init: Some(init_v11),
    devices: Some(devices),
    getProperties: Some(get_properties_v11),
    listen: Some(listen_v11),
    connect: Some(connect_v11),
    accept: Some(accept_v7),
    regMr: Some(reg_mr_size_t),
    regMrDmaBuf: Some(reg_mr_dmabuf),
    deregMr: Some(dereg_mr),
    isend: Some(isend_v10),
    irecv: Some(irecv_v10),
    iflush: Some(iflush),
    test: Some(test),
    closeSend: Some(close_send),
    closeRecv: Some(close_recv),
    closeListen: Some(close_listen),
    getDeviceMr: None,
    irecvConsumed: None,
    makeVDevice: None,
    finalize: Some(finalize_v11),
    setNetAttr: None,
});
