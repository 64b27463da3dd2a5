//! The exported `ncclNetPlugin_vN` tables: each slot is a shared one (`slots`) or a
//! version's own (`versions`); `getDeviceMr`, `irecvConsumed` and `setNetAttr` are NULL.

use super::slots::*;
use super::versions::*;
use crate::ffi::*;
use crate::plugin::NAME;

/// A vtable as exported. `#[repr(transparent)]` keeps the C layout.
#[repr(transparent)]
pub struct Table<T>(pub T);

// SAFETY: the tables are immutable after load; the only pointer they hold besides function
// pointers is the 'static name string.
unsafe impl<T> Sync for Table<T> {}

const NAME_C: &std::ffi::CStr = c"erdma";
const _: () = assert!(NAME_C.to_bytes().len() == NAME.len());

// ---------------------------------------------------------------------------------------
// The tables

/// NCCL 2.8 - 2.11: one buffer per send and receive, no tags, a 64-byte handle, and
/// `connect`/`accept` called once each.
#[no_mangle]
pub static ncclNetPlugin_v4: Table<ncclNet_v4_t> = Table(ncclNet_v4_t {
    name: NAME_C.as_ptr(),
    init: Some(init_v6),
    devices: Some(devices),
    getProperties: Some(get_properties_v4),
    listen: Some(listen),
    connect: Some(connect_v4),
    accept: Some(accept_v4),
    regMr: Some(reg_mr_int),
    deregMr: Some(dereg_mr),
    isend: Some(isend_v4),
    irecv: Some(irecv_v4),
    iflush: Some(iflush_v4),
    test: Some(test),
    closeSend: Some(close_send),
    closeRecv: Some(close_recv),
    closeListen: Some(close_listen),
});

/// NCCL 2.12: v6 without `regMrDmaBuf`.
#[no_mangle]
pub static ncclNetPlugin_v5: Table<ncclNet_v5_t> = Table(ncclNet_v5_t {
    name: NAME_C.as_ptr(),
    init: Some(init_v6),
    devices: Some(devices),
    getProperties: Some(get_properties_v5),
    listen: Some(listen),
    connect: Some(connect_v6),
    accept: Some(accept_v6),
    regMr: Some(reg_mr_int),
    deregMr: Some(dereg_mr),
    isend: Some(isend_int),
    irecv: Some(irecv_int),
    iflush: Some(iflush),
    test: Some(test),
    closeSend: Some(close_send),
    closeRecv: Some(close_recv),
    closeListen: Some(close_listen),
});

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
    makeVDevice: Some(make_vdevice_v9),
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
    makeVDevice: Some(make_vdevice_v9),
});

/// NCCL 2.28 - 2.29 (PyTorch 2.11 ships 2.28.9).
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
    makeVDevice: Some(make_vdevice_v9),
    finalize: Some(finalize_v11),
    setNetAttr: None,
});

/// NCCL 2.30 and later: v11's slots with v12 properties (railId/planeId) and virtual
/// devices of up to 8 NICs.
#[no_mangle]
pub static ncclNetPlugin_v12: Table<ncclNet_v12_t> = Table(ncclNet_v12_t {
    name: NAME_C.as_ptr(),
    init: Some(init_v11),
    devices: Some(devices),
    getProperties: Some(get_properties_v12),
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
    makeVDevice: Some(make_vdevice_v12),
    finalize: Some(finalize_v11),
    setNetAttr: None,
});
