//! The generated ABI types (bindgen over include/nccl_net.h) have the sizes and offsets NCCL's
//! own headers produce on x86_64, as recorded in the reference.

use std::mem::{offset_of, size_of};

use nccl_net_erdma::ffi::*;

#[test]
fn function_tables_have_nccl_sizes() {
    assert_eq!(size_of::<ncclNet_v6_t>(), 136);
    assert_eq!(size_of::<ncclNet_v7_t>(), 152);
    assert_eq!(size_of::<ncclNet_v8_t>(), 152);
    assert_eq!(size_of::<ncclNet_v9_t>(), 160);
    assert_eq!(size_of::<ncclNet_v10_t>(), 160);
    assert_eq!(size_of::<ncclNet_v11_t>(), 176);
    assert_eq!(size_of::<ncclNet_v12_t>(), 176);
    assert_eq!(offset_of!(ncclNet_v12_t, makeVDevice), 152);
    assert_eq!(offset_of!(ncclNet_v12_t, finalize), 160);
}

#[test]
fn property_structs_have_nccl_sizes_and_offsets() {
    assert_eq!(size_of::<ncclNetProperties_v6_t>(), 48);
    assert_eq!(size_of::<ncclNetProperties_v7_t>(), 56);
    assert_eq!(size_of::<ncclNetProperties_v8_t>(), 64);
    assert_eq!(size_of::<ncclNetProperties_v9_t>(), 104);
    assert_eq!(size_of::<ncclNetProperties_v10_t>(), 104);
    assert_eq!(size_of::<ncclNetProperties_v11_t>(), 112);
    assert_eq!(size_of::<ncclNetVDeviceProps_v9_t>(), 20);
    assert_eq!(size_of::<ncclNetAttr_v11_t>(), 44);
    // ncclNetProperties_v8_t, measured by compiling NCCL's header.
    assert_eq!(offset_of!(ncclNetProperties_v8_t, pciPath), 8);
    assert_eq!(offset_of!(ncclNetProperties_v8_t, guid), 16);
    assert_eq!(offset_of!(ncclNetProperties_v8_t, ptrSupport), 24);
    assert_eq!(offset_of!(ncclNetProperties_v8_t, regIsGlobal), 28);
    assert_eq!(offset_of!(ncclNetProperties_v8_t, speed), 32);
    assert_eq!(offset_of!(ncclNetProperties_v8_t, port), 36);
    assert_eq!(offset_of!(ncclNetProperties_v8_t, latency), 40);
    assert_eq!(offset_of!(ncclNetProperties_v8_t, maxComms), 44);
    assert_eq!(offset_of!(ncclNetProperties_v8_t, maxRecvs), 48);
    assert_eq!(offset_of!(ncclNetProperties_v8_t, netDeviceType), 52);
    assert_eq!(offset_of!(ncclNetProperties_v8_t, netDeviceVersion), 56);
    assert_eq!(offset_of!(ncclNetProperties_v9_t, vProps), 64);
    assert_eq!(offset_of!(ncclNetProperties_v9_t, maxP2pBytes), 88);
    assert_eq!(offset_of!(ncclNetProperties_v9_t, maxCollBytes), 96);
    assert_eq!(
        offset_of!(ncclNetProperties_v11_t, maxMultiRequestSize),
        104
    );
    // v12 (NCCL 2.30): vNICs of up to 8 devices, railId/planeId.
    assert_eq!(size_of::<ncclNetProperties_v12_t>(), 128);
    assert_eq!(size_of::<ncclNetVDeviceProps_v12_t>(), 36);
    assert_eq!(offset_of!(ncclNetProperties_v12_t, vProps), 64);
    assert_eq!(offset_of!(ncclNetProperties_v12_t, maxP2pBytes), 104);
    assert_eq!(offset_of!(ncclNetProperties_v12_t, maxCollBytes), 112);
    assert_eq!(
        offset_of!(ncclNetProperties_v12_t, maxMultiRequestSize),
        120
    );
    assert_eq!(offset_of!(ncclNetProperties_v12_t, railId), 124);
    assert_eq!(offset_of!(ncclNetProperties_v12_t, planeId), 126);
}

#[test]
fn constants_match_nccl() {
    assert_eq!(NCCL_NET_HANDLE_MAXSIZE, 128);
    assert_eq!(NCCL_PTR_HOST, 1);
    assert_eq!(NCCL_PTR_CUDA, 2);
    assert_eq!(NCCL_PTR_DMABUF, 4);
    assert_eq!(NCCL_NET_MAX_REQUESTS, 32);
    assert_eq!(NCCL_NET_OPTIONAL_RECV_COMPLETION, 1);
    assert_eq!(NCCL_LOG_WARN, 2);
    assert_eq!(NCCL_LOG_INFO, 3);
    assert_eq!(NCCL_LOG_TRACE, 5);
    assert_eq!(NCCL_INIT, 1);
    assert_eq!(NCCL_NET, 16);
    assert_eq!(ncclResult_t::ncclRemoteError as u32, 6);
    assert_eq!(NCCL_NET_DEVICE_HOST, 0);
    assert_eq!(NCCL_NET_MAX_DEVS_PER_NIC_V9, 4);
    assert_eq!(NCCL_NET_MAX_DEVS_PER_NIC_V12, 8);
    assert_eq!(NCCL_NET_ID_UNDEF, -1);
}
