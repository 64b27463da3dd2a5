//! The generated ABI types (bindgen over include/nccl_net.h) have the sizes and offsets NCCL's
//! own headers produce on x86_64, as recorded in the reference.

use std::mem::{offset_of, size_of};

use nccl_net_erdma::ffi::*;

#[test]
fn function_tables_have_nccl_sizes() {
    assert_eq!(size_of::<ncclNet_v4_t>(), 128);
    assert_eq!(size_of::<ncclNet_v5_t>(), 128);
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
fn v4_and_v5_tables_have_nccl_slot_order() {
    // net_v4.h: no regMrDmaBuf; isend/irecv/iflush of one buffer, no tags.
    let v4 = [
        offset_of!(ncclNet_v4_t, name),
        offset_of!(ncclNet_v4_t, init),
        offset_of!(ncclNet_v4_t, devices),
        offset_of!(ncclNet_v4_t, getProperties),
        offset_of!(ncclNet_v4_t, listen),
        offset_of!(ncclNet_v4_t, connect),
        offset_of!(ncclNet_v4_t, accept),
        offset_of!(ncclNet_v4_t, regMr),
        offset_of!(ncclNet_v4_t, deregMr),
        offset_of!(ncclNet_v4_t, isend),
        offset_of!(ncclNet_v4_t, irecv),
        offset_of!(ncclNet_v4_t, iflush),
        offset_of!(ncclNet_v4_t, test),
        offset_of!(ncclNet_v4_t, closeSend),
        offset_of!(ncclNet_v4_t, closeRecv),
        offset_of!(ncclNet_v4_t, closeListen),
    ];
    // net_v5.h: the same order (v6 inserts regMrDmaBuf after regMr).
    let v5 = [
        offset_of!(ncclNet_v5_t, name),
        offset_of!(ncclNet_v5_t, init),
        offset_of!(ncclNet_v5_t, devices),
        offset_of!(ncclNet_v5_t, getProperties),
        offset_of!(ncclNet_v5_t, listen),
        offset_of!(ncclNet_v5_t, connect),
        offset_of!(ncclNet_v5_t, accept),
        offset_of!(ncclNet_v5_t, regMr),
        offset_of!(ncclNet_v5_t, deregMr),
        offset_of!(ncclNet_v5_t, isend),
        offset_of!(ncclNet_v5_t, irecv),
        offset_of!(ncclNet_v5_t, iflush),
        offset_of!(ncclNet_v5_t, test),
        offset_of!(ncclNet_v5_t, closeSend),
        offset_of!(ncclNet_v5_t, closeRecv),
        offset_of!(ncclNet_v5_t, closeListen),
    ];
    let slots: Vec<usize> = (0..16).map(|i| i * 8).collect();
    assert_eq!(
        v4.to_vec(),
        slots,
        "v4: 16 slots of 8 bytes, in net_v4.h's order"
    );
    assert_eq!(
        v5.to_vec(),
        slots,
        "v5: 16 slots of 8 bytes, in net_v5.h's order"
    );
    assert_eq!(offset_of!(ncclNet_v6_t, regMrDmaBuf), 64);
    assert_eq!(offset_of!(ncclNet_v6_t, deregMr), 72);
}

#[test]
fn property_structs_have_nccl_sizes_and_offsets() {
    // v4 (NCCL 2.8 - 2.11): no latency, no maxRecvs.
    assert_eq!(size_of::<ncclNetProperties_v4_t>(), 40);
    assert_eq!(offset_of!(ncclNetProperties_v4_t, pciPath), 8);
    assert_eq!(offset_of!(ncclNetProperties_v4_t, guid), 16);
    assert_eq!(offset_of!(ncclNetProperties_v4_t, ptrSupport), 24);
    assert_eq!(offset_of!(ncclNetProperties_v4_t, speed), 28);
    assert_eq!(offset_of!(ncclNetProperties_v4_t, port), 32);
    assert_eq!(offset_of!(ncclNetProperties_v4_t, maxComms), 36);
    // v5 (NCCL 2.12): latency between port and maxComms, maxRecvs at the end; v6's layout.
    assert_eq!(size_of::<ncclNetProperties_v5_t>(), 48);
    assert_eq!(offset_of!(ncclNetProperties_v5_t, port), 32);
    assert_eq!(offset_of!(ncclNetProperties_v5_t, latency), 36);
    assert_eq!(offset_of!(ncclNetProperties_v5_t, maxComms), 40);
    assert_eq!(offset_of!(ncclNetProperties_v5_t, maxRecvs), 44);
    assert_eq!(offset_of!(ncclNetProperties_v6_t, latency), 36);
    assert_eq!(offset_of!(ncclNetProperties_v6_t, maxRecvs), 44);
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
    assert_eq!(NCCL_NET_HANDLE_MAXSIZE_V4, 64);
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
