//! What differs between table versions: `init` (v4-v9: a logger; v10: and a profiler; v11+:
//! a per-communicator context, with `finalize`, which accepts NULL or a never-initialised
//! context), v4's `connect`/`accept` (one call each must yield the comm), the contexts of
//! v11 `listen`/`connect`, and `getProperties` (each version's struct, zero-filled with
//! `netDeviceType` HOST and `maxP2pBytes` in (0, 1 TiB]; no DMA-BUF bit before v6).

use std::{
    collections::HashSet,
    ffi::{c_char, c_int, c_void},
    sync::Arc,
};

use parking_lot::Mutex;

use super::slots::{accept_with, connect_with, listen_with, Steps};
use super::{boundary, install_logging, non_null, profiler};
use crate::error::{Error, Result};
use crate::ffi::*;
use crate::plugin::{self, DeviceProps, Plugin, MAX_COLL_BYTES, MAX_P2P_BYTES, MAX_RECVS};

pub(super) fn init_common(logger: ncclDebugLogger_t) -> Result<Arc<Plugin>> {
    install_logging(logger);
    plugin::init()
}

/// Fills the fields every properties version shares (v4's), on a zeroed struct.
macro_rules! fill_v4 {
    ($p:expr, $d:expr) => {{
        let d: &DeviceProps = $d;
        $p.name = d.name_ptr() as *mut c_char;
        $p.pciPath = d.pci_path_ptr() as *mut c_char;
        $p.guid = d.guid;
        $p.ptrSupport = d.ptr_support;
        $p.speed = d.speed_mbps;
        $p.port = d.port;
        $p.maxComms = d.max_comms;
    }};
}

/// Fills the fields of v5 and later.
macro_rules! fill_common {
    ($p:expr, $d:expr) => {{
        fill_v4!($p, $d);
        $p.latency = 0.0;
        $p.maxRecvs = MAX_RECVS as c_int;
    }};
}

/// `ptrSupport` for NCCLs without DMA-BUF (v4, v5): they never call `regMrDmaBuf` (their
/// tables have no such slot), so the bit would only mislead them.
fn without_dmabuf(ptr_support: c_int) -> c_int {
    ptr_support & !(NCCL_PTR_DMABUF as c_int)
}

/// Fills the fields of v7 and later (device offload: none).
macro_rules! fill_v7 {
    ($p:expr, $d:expr) => {{
        fill_common!($p, $d);
        $p.netDeviceType = NCCL_NET_DEVICE_HOST;
        $p.netDeviceVersion = NCCL_NET_DEVICE_INVALID_VERSION as c_int;
    }};
}

/// Fills the fields of v9 and later; `vProps` lists the physical devices a virtual device
/// fuses, or the device itself.
macro_rules! fill_v9 {
    ($p:expr, $d:expr) => {{
        fill_v7!($p, $d);
        $p.regIsGlobal = 1;
        $p.forceFlush = c_int::from($d.force_flush);
        let n = $d.vdevs.len().min($p.vProps.devs.len());
        $p.vProps.ndevs = n as c_int;
        $p.vProps.devs[..n].copy_from_slice(&$d.vdevs[..n]);
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
        fill(&mut p, &device);
        // SAFETY: checked non-NULL; NCCL passes a writable struct of this version's layout.
        unsafe { props.write(p) };
        Ok(())
    })
}

pub(super) extern "C" fn init_v6(logger: ncclDebugLogger_t) -> ncclResult_t {
    boundary("init", || init_common(logger).map(|_| ()))
}

pub(super) extern "C" fn init_v10(
    logger: ncclDebugLogger_t,
    profiler_fn: ncclProfilerCallback_t,
) -> ncclResult_t {
    profiler::set(profiler_fn);
    boundary("init", || init_common(logger).map(|_| ()))
}

pub(super) extern "C" fn get_properties_v4(
    dev: c_int,
    props: *mut ncclNetProperties_v4_t,
) -> ncclResult_t {
    properties(dev, props, |p, d| {
        fill_v4!(p, d);
        p.ptrSupport = without_dmabuf(p.ptrSupport);
    })
}

pub(super) extern "C" fn get_properties_v5(
    dev: c_int,
    props: *mut ncclNetProperties_v5_t,
) -> ncclResult_t {
    properties(dev, props, |p, d| {
        fill_common!(p, d);
        p.ptrSupport = without_dmabuf(p.ptrSupport);
    })
}

pub(super) extern "C" fn get_properties_v6(
    dev: c_int,
    props: *mut ncclNetProperties_v6_t,
) -> ncclResult_t {
    properties(dev, props, |p, d| fill_common!(p, d))
}

pub(super) extern "C" fn get_properties_v7(
    dev: c_int,
    props: *mut ncclNetProperties_v7_t,
) -> ncclResult_t {
    properties(dev, props, |p, d| fill_v7!(p, d))
}

pub(super) extern "C" fn get_properties_v8(
    dev: c_int,
    props: *mut ncclNetProperties_v8_t,
) -> ncclResult_t {
    properties(dev, props, |p, d| {
        fill_v7!(p, d);
        p.regIsGlobal = 1;
    })
}

pub(super) extern "C" fn get_properties_v9(
    dev: c_int,
    props: *mut ncclNetProperties_v9_t,
) -> ncclResult_t {
    properties(dev, props, |p, d| fill_v9!(p, d))
}

pub(super) extern "C" fn get_properties_v11(
    dev: c_int,
    props: *mut ncclNetProperties_v11_t,
) -> ncclResult_t {
    properties(dev, props, |p, d| {
        fill_v9!(p, d);
        p.maxMultiRequestSize = 1;
    })
}

pub(super) extern "C" fn get_properties_v12(
    dev: c_int,
    props: *mut ncclNetProperties_v12_t,
) -> ncclResult_t {
    properties(dev, props, |p, d| {
        fill_v9!(p, d);
        p.maxMultiRequestSize = 1;
        p.railId = d.rail_id;
        p.planeId = NCCL_NET_ID_UNDEF as i16;
    })
}

// ---------------------------------------------------------------------------------------
// v4: connect and accept that return the comm

pub(super) extern "C" fn connect_v4(
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
) -> ncclResult_t {
    let steps = Steps::ToCompletion;
    connect_with(plugin::get(), dev, handle, send_comm, None, steps)
}

pub(super) extern "C" fn accept_v4(
    listen_comm: *mut c_void,
    recv_comm: *mut *mut c_void,
) -> ncclResult_t {
    accept_with(listen_comm, recv_comm, Steps::ToCompletion)
}

/// `makeVDevice` for any version: `ndevs` devices from `devs`, at most `max`.
fn make_vdevice(d: *mut c_int, ndevs: c_int, devs: &[c_int], max: usize) -> ncclResult_t {
    boundary("makeVDevice", || {
        non_null(d, "d")?;
        let n = usize::try_from(ndevs)
            .unwrap_or(usize::MAX)
            .min(devs.len() + 1);
        let picked = devs.get(..n).ok_or_else(|| {
            Error::usage(format!(
                "makeVDevice of {ndevs} devices; 1 to {max} can be fused"
            ))
        })?;
        let index = plugin::get()?.make_vdevice(picked, max)?;
        // SAFETY: checked non-NULL; NCCL passes a writable int.
        unsafe { *d = index as c_int };
        Ok(())
    })
}

pub(super) extern "C" fn make_vdevice_v9(
    d: *mut c_int,
    props: *mut ncclNetVDeviceProps_v9_t,
) -> ncclResult_t {
    if props.is_null() {
        return make_vdevice(d, -1, &[], NCCL_NET_MAX_DEVS_PER_NIC_V9 as usize);
    }
    // SAFETY: non-NULL; NCCL passes a valid struct for the duration of the call.
    let p = unsafe { &*props };
    make_vdevice(d, p.ndevs, &p.devs, NCCL_NET_MAX_DEVS_PER_NIC_V9 as usize)
}

pub(super) extern "C" fn make_vdevice_v12(
    d: *mut c_int,
    props: *mut ncclNetVDeviceProps_v12_t,
) -> ncclResult_t {
    if props.is_null() {
        return make_vdevice(d, -1, &[], NCCL_NET_MAX_DEVS_PER_NIC_V12 as usize);
    }
    // SAFETY: non-NULL; NCCL passes a valid struct for the duration of the call.
    let p = unsafe { &*props };
    make_vdevice(d, p.ndevs, &p.devs, NCCL_NET_MAX_DEVS_PER_NIC_V12 as usize)
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

pub(super) fn context(ctx: *mut c_void) -> Result<Arc<Plugin>> {
    if ctx.is_null() {
        return plugin::get();
    }
    let live = CONTEXTS
        .lock()
        .as_ref()
        .is_some_and(|set| set.contains(&(ctx as usize)));
    if !live {
        return Err(Error::misuse("unknown net context".into()));
    }
    // SAFETY: registered contexts are live boxed NetContexts (removed before being freed).
    Ok(Arc::clone(&unsafe { &*(ctx as *const NetContext) }.plugin))
}

pub(super) fn context_traffic_class(ctx: *mut c_void) -> Option<i32> {
    if ctx.is_null() {
        return None;
    }
    // SAFETY: only called after `context` accepted ctx as a live registered NetContext.
    let tc = unsafe { (*(ctx as *const NetContext)).traffic_class };
    (tc >= 0).then_some(tc)
}

pub(super) extern "C" fn init_v11(
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

pub(super) extern "C" fn finalize_v11(ctx: *mut c_void) -> ncclResult_t {
    boundary("finalize", || {
        // NCCL 2.28 calls finalize even after a failed init, with its ctx still NULL.
        if ctx.is_null() {
            return Ok(());
        }
        let (removed, last) = match CONTEXTS.lock().as_mut() {
            Some(set) => (set.remove(&(ctx as usize)), set.is_empty()),
            None => (false, false),
        };
        if !removed {
            return Err(Error::misuse("finalize of an unknown net context".into()));
        }
        // SAFETY: it was registered, so it is a NetContext we boxed in init; it is now
        // unregistered, so nothing else can reach it.
        let context = unsafe { Box::from_raw(ctx as *mut NetContext) };
        if last {
            context.plugin.last_context_finalized();
        }
        Ok(())
    })
}

pub(super) extern "C" fn listen_v11(
    ctx: *mut c_void,
    dev: c_int,
    handle: *mut c_void,
    listen_comm: *mut *mut c_void,
) -> ncclResult_t {
    listen_with(context(ctx), dev, handle, listen_comm)
}

pub(super) extern "C" fn connect_v11(
    ctx: *mut c_void,
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    _dev_comm: *mut *mut ncclNetDeviceHandle_v11_t,
) -> ncclResult_t {
    let traffic_class = context(ctx).ok().and_then(|_| context_traffic_class(ctx));
    connect_with(
        context(ctx),
        dev,
        handle,
        send_comm,
        traffic_class,
        Steps::One,
    )
}
