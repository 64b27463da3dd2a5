//! Conformance suite: dlopens the built plugin (RTLD_NOW | RTLD_LOCAL), resolves each
//! exported `ncclNetPlugin_vN` and drives it the way NCCL's proxy threads do, asserting real
//! outcomes: bytes compared, sizes reported, error codes returned.
//!
//! In-process tests use the tcp transport on loopback. Tests that need a fresh plugin (a
//! different environment, a failing init) run themselves again in a child process.

mod common;

use std::{
    collections::HashSet,
    io::{BufRead, BufReader, Write},
    process::{Command, Stdio},
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc,
    },
    thread,
    time::{Duration, Instant},
};

use common::*;

#[test]
fn every_version_is_exported_with_name_and_null_optional_slots() {
    for v in ALL_VERSIONS {
        let net = Net::open(&lib(), v).unwrap();
        assert_eq!(net.name(), "erdma", "v{v}");
        assert!(
            net.optional_slots_null(),
            "v{v}: optional slots NULL, makeVDevice (v9+) and finalize (v11+) set"
        );
    }
    assert!(Net::open(&lib(), 13).is_err(), "v13 does not exist");
    assert!(Net::open(&lib(), 3).is_err(), "no v3 (NCCL 2.7 and older)");
}

#[test]
fn properties_follow_each_version_rules() {
    let v6 = open(6).properties(0).unwrap();
    for v in ALL_VERSIONS {
        let mut net = open(v);
        let n = net.devices().unwrap();
        assert!(n >= 1, "v{v}: devices {n}");
        // v4: the client reads the 40-byte struct with guard bytes behind it and fails with
        // ncclInternalError when the plugin wrote past it.
        let p = net.properties(0).unwrap();
        assert!(
            p.name.starts_with(&expected_device_name()),
            "v{v}: name {}",
            p.name
        );
        assert_eq!(p.ptr_support & HOST, HOST, "v{v}");
        assert!(p.speed > 0 && p.port >= 1 && p.max_comms > 0, "v{v}: {p:?}");
        // v4 has no maxRecvs (the client reports 1) and no latency (0).
        assert_eq!(p.max_recvs, if v == 4 { 1 } else { 8 }, "v{v}");
        assert_eq!(p.latency, 0.0, "v{v}");
        if v <= 5 {
            // NCCL 2.8 - 2.12 know no DMA-BUF; the rest is v6's.
            assert_eq!(
                p.ptr_support,
                v6.ptr_support & !DMABUF,
                "v{v}: no DMA-BUF bit"
            );
            assert_eq!(
                (&p.name, &p.pci_path, p.guid, p.speed, p.port, p.max_comms),
                (
                    &v6.name,
                    &v6.pci_path,
                    v6.guid,
                    v6.speed,
                    v6.port,
                    v6.max_comms
                ),
                "v{v}: the fields v4/v5 share with v6"
            );
        }
        if v >= 7 {
            assert_eq!(
                p.net_device,
                Some((0, 0)),
                "v{v}: netDeviceType HOST, version 0"
            );
        }
        if v >= 8 {
            assert_eq!(p.reg_is_global, Some(1), "v{v}");
        }
        if v >= 9 {
            assert_eq!(p.force_flush, Some(0), "v{v}");
            assert_eq!(p.vprops, Some((1, vec![0])), "v{v}");
            let (p2p, coll) = p.max_bytes.unwrap();
            assert!(p2p > 0 && p2p <= 1 << 40, "v{v}: maxP2pBytes {p2p}");
            assert!(coll > 0 && coll <= 1 << 40, "v{v}: maxCollBytes {coll}");
        }
        if v >= 11 {
            assert_eq!(p.max_multi_request_size, Some(1));
        }
        if v >= 12 {
            let (rail, plane) = p.rail_plane.unwrap();
            assert!(
                rail >= -1 && plane == -1,
                "v{v}: railId {rail} planeId {plane}"
            );
        }
        assert_eq!(
            net.properties(n).unwrap_err(),
            ncclResult_t::ncclInternalError
        );
        assert_eq!(
            net.properties(-1).unwrap_err(),
            ncclResult_t::ncclInternalError
        );
        net.finalize().unwrap();
    }
}

#[test]
fn logger_gets_percent_s_and_a_warn_names_the_problem() {
    let mut net = open(8);
    assert!(net.properties(77).is_err());
    let lines = client::logged_lines();
    assert!(!lines.is_empty());
    assert!(lines.iter().all(|l| l.fmt == "%s"), "format is always %s");
    assert!(lines.iter().all(|l| l.text.starts_with("NET/erdma ")));
    assert!(
        lines
            .iter()
            .any(|l| l.level == 2 && l.text.contains("getProperties") && l.text.contains("77")),
        "a WARN (level 2) names the call and the device: {lines:?}"
    );
    net.finalize().unwrap();
}

#[test]
fn loopback_one_thread_all_sizes_every_version() {
    for v in ALL_VERSIONS {
        let mut net = open(v);
        let (s, r) = connect_pair(&net);
        for (i, &size) in [0usize, 1, 7, 4093, 65536, 4 << 20, (5 << 20) + 3]
            .iter()
            .enumerate()
        {
            transfer(&net, s, r, size, size, i as u64);
        }
        // A receive larger than the send reports the real size.
        transfer(&net, s, r, 1000, 8192, 99);
        transfer(&net, s, r, 0, 64, 100);
        close_pair(&mut net, s, r);
    }
}

/// A listen comm serves every connection made to its handle, as NCCL's IB transport's
/// listening socket does (aws-ofi-nccl's `reuse_listen_comm`: ten connections in turn over
/// one listen comm, each from a fresh copy of the handle, each carrying data).
#[test]
fn a_listen_comm_accepts_ten_connections_in_turn_every_version() {
    for v in ALL_VERSIONS {
        let mut net = open(v);
        let mut handle = [0u8; 128];
        let listen = net.listen(0, &mut handle).expect("listen");
        for i in 0..10u64 {
            let mut copy = handle;
            let (mut s, mut r) = (Opaque::NULL, Opaque::NULL);
            let start = Instant::now();
            while s.is_null() || r.is_null() {
                if s.is_null() {
                    s = net.connect(0, &mut copy).expect("connect");
                }
                if r.is_null() {
                    r = net.accept(listen).expect("accept");
                }
                assert!(
                    start.elapsed() < DEADLINE,
                    "v{v}: connection {i} never came"
                );
            }
            transfer(&net, s, r, 70_000, 70_000, i);
            net.close_send(s).expect("closeSend");
            net.close_recv(r).expect("closeRecv");
        }
        // Two connections at once over it, then data on each.
        let mut copies = [handle; 2];
        let sends = copies
            .each_mut()
            .map(|h| poll_until("connect", || net.connect(0, h).expect("connect")));
        let recvs = [0, 1].map(|_| poll_until("accept", || net.accept(listen).expect("accept")));
        net.close_listen(listen).expect("closeListen");
        // Which accept got which connect is the order the hellos came in: one message each
        // way round, each told by its bytes.
        crossed_pair(&net, sends, recvs);
        for (s, r) in sends.into_iter().zip(recvs) {
            net.close_send(s).expect("closeSend");
            net.close_recv(r).expect("closeRecv");
        }
        net.finalize().expect("finalize");
    }
}

/// A message of 4 KiB from each of `sends` (seeds 50, 51), one receive posted on each of
/// `recvs`: the two arrive, every byte, each at the comm its connection was accepted as.
fn crossed_pair(net: &Net, sends: [Opaque; 2], recvs: [Opaque; 2]) {
    let mut dsts = recvs.map(|r| reg(net, r, vec![0u8; 4096]));
    let mut srcs = [0, 1].map(|i| reg(net, sends[i], pattern(50 + i as u64, 4096)));
    let rreqs = [0, 1].map(|i| {
        let (p, mh) = (dsts[i].buf.as_mut_ptr(), dsts[i].mh);
        poll_until("irecv", || {
            net.irecv(recvs[i], &[(p, 4096)], &[1], &[mh], false)
                .expect("irecv")
        })
    });
    let sreqs = [0, 1].map(|i| {
        let (p, mh) = (srcs[i].buf.as_mut_ptr(), srcs[i].mh);
        isend_testing(net, rreqs[i], || {
            net.isend(sends[i], p, 4096, 1, mh).expect("isend")
        })
    });
    for req in sreqs.into_iter().chain(rreqs) {
        assert_eq!(wait(net, req, 1), vec![4096]);
    }
    let mut got: Vec<Vec<u8>> = dsts.iter().map(|d| d.buf.clone()).collect();
    got.sort();
    let mut want = vec![pattern(50, 4096), pattern(51, 4096)];
    want.sort();
    assert!(got == want, "each connection's message arrived whole");
    for (r, d) in recvs.into_iter().zip(dsts) {
        dereg(net, r, d);
    }
    for (s, src) in sends.into_iter().zip(srcs) {
        dereg(net, s, src);
    }
}

// ---------------------------------------------------------------------------------------
// NCCL 2.8 - 2.12 (v4, v5): v4 with one buffer per call and no tags (the orders each
// generation calls connect and accept in: tests/generations.rs).

#[test]
fn v4_messages_without_tags_match_in_posting_order() {
    let mut net = open(4);
    let (s, r) = connect_pair(&net);
    let sizes = [300usize, 1, 5000, 0, 77, 4096, 12, 65536];
    // Every receive posted first, each larger than any send; then the sends, in order.
    let mut dst: Vec<Reg> = sizes
        .iter()
        .map(|_| reg(&net, r, vec![0u8; 65536 + 64]))
        .collect();
    let rreqs: Vec<Opaque> = dst
        .iter_mut()
        .map(|d| {
            let b = [(d.buf.as_mut_ptr(), d.buf.len())];
            poll_until("irecv", || net.irecv(r, &b, &[0], &[d.mh], false).unwrap())
        })
        .collect();
    let mut srcs: Vec<Reg> = sizes
        .iter()
        .enumerate()
        .map(|(i, &len)| reg(&net, s, pattern(40 + i as u64, len)))
        .collect();
    let sreqs: Vec<Opaque> = srcs
        .iter_mut()
        .zip(sizes)
        .zip(&rreqs)
        .map(|((src, len), &rreq)| {
            isend_testing(&net, rreq, || {
                net.isend(s, src.buf.as_mut_ptr(), len, 0, src.mh).unwrap()
            })
        })
        .collect();
    for (i, (&sreq, &rreq)) in sreqs.iter().zip(&rreqs).enumerate() {
        assert_eq!(wait(&net, sreq, 1), vec![sizes[i] as i32], "send {i}");
        assert_eq!(wait(&net, rreq, 1), vec![sizes[i] as i32], "receive {i}");
        assert!(dst[i].buf[..sizes[i]] == srcs[i].buf[..], "message {i}");
    }
    // v4's iflush takes one buffer; host memory needs no flush.
    let d = &mut dst[0];
    let req = net
        .iflush(r, &[(d.buf.as_mut_ptr(), 300)], &[d.mh])
        .unwrap();
    assert!(req.is_null(), "host memory needs no flush");
    for src in srcs {
        dereg(&net, s, src);
    }
    for d in dst {
        dereg(&net, r, d);
    }
    close_pair(&mut net, s, r);
}

#[test]
fn v4_negative_sizes_are_internal_errors() {
    let mut net = open(4);
    let (s, r) = connect_pair(&net);
    let mut dst = reg(&net, r, vec![0u8; 64]);
    let mut src = reg(&net, s, pattern(1, 64));
    let internal = ncclResult_t::ncclInternalError;
    let (d, sp) = (dst.buf.as_mut_ptr(), src.buf.as_mut_ptr());
    assert_eq!(
        net.irecv_signed(r, &[(d, -1)], &[0], &[dst.mh], false)
            .unwrap_err(),
        internal,
        "irecv of -1 bytes"
    );
    // The client's isend and iflush take a usize: the negative int goes through the table.
    // SAFETY: table_ptr is the loaded library's ncclNetPlugin_v4, which stays loaded while
    // `net` lives; every pointer passed points to live storage for the call.
    let t = unsafe { &*(net.table_ptr() as *const nccl_net_erdma::ffi::ncclNet_v4_t) };
    let mut req = std::ptr::null_mut();
    // SAFETY: as above.
    let code = unsafe { t.isend.unwrap()(s.0, sp.cast(), -1, src.mh.0, &mut req) };
    assert_eq!(
        (code, req),
        (internal, std::ptr::null_mut()),
        "isend of -1 bytes"
    );
    // SAFETY: as above.
    let code = unsafe { t.iflush.unwrap()(r.0, d.cast(), -5, dst.mh.0, &mut req) };
    assert_eq!(
        (code, req),
        (internal, std::ptr::null_mut()),
        "iflush of -5 bytes"
    );
    // The comms still work.
    transfer(&net, s, r, 64, 64, 2);
    dereg(&net, r, dst);
    dereg(&net, s, src);
    close_pair(&mut net, s, r);
}

#[test]
fn v4_listen_and_connect_stay_within_the_64_byte_handle() {
    const GUARD: u8 = 0x5a;
    let mut net = open(4);
    // NCCL <= 2.11 passes a 64-byte stack buffer: whatever lies behind it is not ours.
    let mut handle = [GUARD; 128];
    let listen = net.listen(0, &mut handle).expect("listen");
    assert!(
        handle[64..].iter().all(|b| *b == GUARD),
        "listen wrote past byte 64: {:02x?}",
        &handle[64..]
    );
    // As NCCL 2.9 does: connect, then accept, once each, on one thread.
    let s = net.connect(0, &mut handle).expect("connect");
    let r = net.accept(listen).expect("accept");
    assert!(
        !s.is_null() && !r.is_null(),
        "one call each returns the comm"
    );
    assert!(
        handle[64..].iter().all(|b| *b == GUARD),
        "connect wrote past byte 64: {:02x?}",
        &handle[64..]
    );
    net.close_listen(listen).unwrap();
    transfer(&net, s, r, 4096, 4096, 5);
    close_pair(&mut net, s, r);
}

#[test]
fn v4_connect_and_accept_fail_in_bounded_time() {
    run_child(
        test_name!(child_v4_bounded_waits),
        &[("NCCL_ERDMA_CONNECT_TIMEOUT_MS", "300")],
        &[],
        false,
    );
}

#[test]
#[ignore = "entry point of a child process"]
fn child_v4_bounded_waits() {
    if !is_child() {
        return;
    }
    let mut net = open(4);
    // An accept nobody connects to gives up after NCCL_ERDMA_CONNECT_TIMEOUT_MS.
    let mut handle = [0u8; 128];
    let l = net.listen(0, &mut handle).unwrap();
    let start = Instant::now();
    assert_eq!(
        net.accept(l).unwrap_err(),
        ncclResult_t::ncclRemoteError,
        "accept without a peer"
    );
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(10),
        "accept gave up after {took:?}"
    );
    let warn = client::logged_lines()
        .into_iter()
        .rev()
        .find(|l| l.level == 2)
        .expect("a WARN line");
    assert!(
        warn.text.contains("accept") && warn.text.contains("NCCL_ERDMA_CONNECT_TIMEOUT_MS"),
        "{warn:?}"
    );
    // A connect to a listener that is gone fails in one call, it does not hang.
    net.close_listen(l).unwrap();
    let start = Instant::now();
    assert_eq!(
        net.connect(0, &mut handle).unwrap_err(),
        ncclResult_t::ncclRemoteError,
        "connect to a closed listener"
    );
    assert!(start.elapsed() < Duration::from_secs(10), "connect hung");
    net.finalize().unwrap();
}

#[test]
fn grouped_receive_with_mixed_tags_fills_every_size() {
    for v in [6, 8, 11] {
        let mut net = open(v);
        let (s, r) = connect_pair(&net);
        let n = 8;
        let recv_len = 3000;
        let mut dst: Vec<Reg> = (0..n).map(|_| reg(&net, r, vec![0u8; recv_len])).collect();
        let tags: Vec<i32> = (0..n as i32).map(|i| 100 + (i * 5) % 8).collect();
        let bufs: Vec<(*mut u8, usize)> = dst
            .iter_mut()
            .map(|d| (d.buf.as_mut_ptr(), recv_len))
            .collect();
        let mhs: Vec<Opaque> = dst.iter().map(|d| d.mh).collect();
        let rreq = poll_until("irecv", || net.irecv(r, &bufs, &tags, &mhs, false).unwrap());
        // Send in another tag order, each message a different size.
        let order = [3usize, 0, 7, 5, 1, 6, 2, 4];
        let mut srcs = Vec::new();
        let mut sreqs = Vec::new();
        for &i in &order {
            let len = 100 * i + 1;
            let mut src = reg(&net, s, pattern(i as u64, len));
            let req = isend_testing(&net, rreq, || {
                net.isend(s, src.buf.as_mut_ptr(), len, tags[i], src.mh)
                    .unwrap()
            });
            sreqs.push(req);
            srcs.push((i, src));
        }
        let sizes = wait(&net, rreq, n);
        for req in sreqs {
            wait(&net, req, 1);
        }
        for (i, src) in srcs {
            let len = 100 * i + 1;
            assert_eq!(
                sizes[i] as usize, len,
                "v{v}: size of entry {i} (tag {})",
                tags[i]
            );
            assert!(dst[i].buf[..len] == src.buf[..], "v{v}: entry {i} payload");
            dereg(&net, s, src);
        }
        for d in dst {
            dereg(&net, r, d);
        }
        close_pair(&mut net, s, r);
    }
}

#[test]
fn requests_are_null_when_they_cannot_be_posted_and_32_by_8_fit() {
    let mut net = open(9);
    let (s, r) = connect_pair(&net);
    let mut src = reg(&net, s, pattern(1, 64));
    // No receive posted: isend cannot be posted now.
    for _ in 0..100 {
        let req = net.isend(s, src.buf.as_mut_ptr(), 64, 1, src.mh).unwrap();
        assert!(
            req.is_null(),
            "isend without a matching receive must return NULL"
        );
    }
    // 32 grouped receives of 8 fit; the 33rd is NULL.
    let mut dst: Vec<Reg> = (0..8).map(|_| reg(&net, r, vec![0u8; 64])).collect();
    let bufs: Vec<(*mut u8, usize)> = dst.iter_mut().map(|d| (d.buf.as_mut_ptr(), 64)).collect();
    let mhs: Vec<Opaque> = dst.iter().map(|d| d.mh).collect();
    let tags = [1i32; 8];
    let mut rreqs = Vec::new();
    for _ in 0..32 {
        let req = net.irecv(r, &bufs, &tags, &mhs, false).unwrap();
        assert!(!req.is_null(), "32 receives in flight must be accepted");
        rreqs.push(req);
    }
    assert!(net.irecv(r, &bufs, &tags, &mhs, false).unwrap().is_null());
    // 32 x 8 = 256 sends in flight on the send comm.
    let mut sreqs = Vec::new();
    for m in 0..256 {
        sreqs.push(isend_testing(&net, rreqs[m / 8], || {
            net.isend(s, src.buf.as_mut_ptr(), 64, 1, src.mh).unwrap()
        }));
    }
    assert_eq!(
        sreqs.iter().collect::<HashSet<_>>().len(),
        256,
        "distinct requests"
    );
    for req in sreqs {
        assert_eq!(wait(&net, req, 1), vec![64]);
    }
    for req in rreqs {
        assert_eq!(wait(&net, req, 8), vec![64; 8]);
    }
    assert!(dst[7].buf == src.buf);
    src.buf.clear();
    dereg(&net, s, src);
    for d in dst {
        dereg(&net, r, d);
    }
    close_pair(&mut net, s, r);
}

#[test]
fn send_larger_than_receive_is_an_error_on_both_sides() {
    let mut net = open(11);
    let (s, r) = connect_pair(&net);
    let mut src = reg(&net, s, pattern(3, 100));
    let mut dst = reg(&net, r, vec![0u8; 50]);
    let rreq = poll_until("irecv", || {
        net.irecv(r, &[(dst.buf.as_mut_ptr(), 50)], &[5], &[dst.mh], false)
            .unwrap()
    });
    let start = Instant::now();
    let err = loop {
        match net.isend(s, src.buf.as_mut_ptr(), 100, 5, src.mh) {
            Ok(req) if req.is_null() => {
                // As NCCL's proxy: the receive is progressed too (see `isend_testing`).
                let _ = net.test(rreq, None);
                assert!(start.elapsed() < DEADLINE)
            }
            Ok(_) => panic!("a send larger than its receive was accepted"),
            Err(e) => break e,
        }
    };
    assert_eq!(err, ncclResult_t::ncclInvalidUsage);
    let start = Instant::now();
    let err = loop {
        match net.test(rreq, None) {
            Ok(false) => assert!(start.elapsed() < DEADLINE, "receiver never saw the error"),
            Ok(true) => panic!("the truncated receive completed"),
            Err(e) => break e,
        }
    };
    assert_eq!(err, ncclResult_t::ncclInvalidUsage);
    assert!(dst.buf.iter().all(|b| *b == 0), "nothing was written");
    // Both comms stay failed with the truncation's code: later calls fail the same way
    // instead of waiting for what can never come.
    for _ in 0..3 {
        let again = net.isend(s, src.buf.as_mut_ptr(), 10, 5, src.mh);
        assert_eq!(
            again.err(),
            Some(ncclResult_t::ncclInvalidUsage),
            "send after it"
        );
        let again = net.irecv(r, &[(dst.buf.as_mut_ptr(), 50)], &[5], &[dst.mh], false);
        assert_eq!(
            again.err(),
            Some(ncclResult_t::ncclInvalidUsage),
            "receive after it"
        );
    }
    src.buf.truncate(0);
    dst.buf.truncate(0);
    close_pair(&mut net, s, r);
}

#[test]
fn optional_receive_hint_is_always_overwritten() {
    for v in [9, 10, 11] {
        let mut net = open(v);
        let (s, r) = connect_pair(&net);
        let mut dst = reg(&net, r, vec![0u8; 16]);
        let mut src = reg(&net, s, pattern(9, 16));
        let req = net
            .irecv(r, &[(dst.buf.as_mut_ptr(), 16)], &[0], &[dst.mh], true)
            .unwrap();
        assert_ne!(req.0 as usize, 1, "v{v}: the 0x1 hint was left in *request");
        assert!(!req.is_null());
        let sreq = isend_testing(&net, req, || {
            net.isend(s, src.buf.as_mut_ptr(), 16, 0, src.mh).unwrap()
        });
        assert_eq!(wait(&net, req, 1), vec![16]);
        wait(&net, sreq, 1);
        assert_eq!(dst.buf, src.buf);
        dereg(&net, r, dst);
        dereg(&net, s, src);
        close_pair(&mut net, s, r);
    }
}

#[test]
fn iflush_returns_no_request_and_dereg_accepts_null() {
    let mut net = open(8);
    let (s, r) = connect_pair(&net);
    let mut dst = reg(&net, r, vec![0u8; 64]);
    let req = net
        .iflush(r, &[(dst.buf.as_mut_ptr(), 64)], &[dst.mh])
        .unwrap();
    assert!(req.is_null(), "host memory needs no flush");
    net.dereg_mr(r, Opaque::NULL).unwrap();
    let mh = dst.mh;
    dereg(&net, r, dst);
    assert_eq!(
        net.dereg_mr(r, mh).unwrap_err(),
        ncclResult_t::ncclInternalError,
        "double deregistration is reported"
    );
    close_pair(&mut net, s, r);
}

#[test]
fn bad_arguments_are_error_codes() {
    let mut net = open(8);
    let (s, r) = connect_pair(&net);
    let mut buf = vec![0u8; 64];
    let p = buf.as_mut_ptr();
    let mh = net.reg_mr(s, p, 64, HOST).unwrap();
    let internal = ncclResult_t::ncclInternalError;
    assert_eq!(net.isend(Opaque::NULL, p, 8, 0, mh).unwrap_err(), internal);
    assert_eq!(
        net.isend(r, p, 8, 0, mh).unwrap_err(),
        internal,
        "a recv comm as send comm"
    );
    // A send's handle is looked up once the send is matched to a receive (NCCL's IB
    // transport uses it no sooner), so these meet a posted receive, which each failed send
    // leaves to the good one after them.
    let mut dst = reg(&net, r, vec![0u8; 128]);
    let rreq = poll_until("irecv", || {
        net.irecv(r, &[(dst.buf.as_mut_ptr(), 128)], &[0], &[dst.mh], false)
            .expect("irecv")
    });
    let send_error = |mh, len| {
        let start = Instant::now();
        loop {
            match net.isend(s, p, len, 0, mh) {
                Err(e) => return e,
                Ok(req) => assert!(req.is_null(), "a bad send was accepted"),
            }
            // As NCCL's proxy: the receive is progressed too (see `isend_testing`).
            assert!(!net.test(rreq, None).unwrap(), "received before sent");
            assert!(start.elapsed() < DEADLINE, "isend never answered");
        }
    };
    assert_eq!(send_error(Opaque(0xdead as _), 8), internal);
    assert_eq!(send_error(mh, 65), internal, "outside the registration");
    let sreq = isend_testing(&net, rreq, || net.isend(s, p, 8, 0, mh).expect("isend"));
    wait(&net, sreq, 1);
    assert_eq!(
        wait(&net, rreq, 1),
        [8],
        "the receive the failed sends left"
    );
    dereg(&net, r, dst);
    assert_eq!(
        net.irecv(r, &[], &[], &[], false).unwrap_err(),
        internal,
        "n = 0"
    );
    let nine = vec![(p, 1usize); 9];
    assert_eq!(
        net.irecv(r, &nine, &[0; 9], &[mh; 9], false).unwrap_err(),
        internal,
        "n = 9 > maxRecvs"
    );
    let neg = net.irecv_signed(r, &[(p, -5)], &[0], &[mh], false);
    assert_eq!(neg.unwrap_err(), internal, "negative size");
    let mut done = 0;
    assert_eq!(net.test_code(Opaque::NULL, Some(&mut done)), internal);
    assert_eq!(net.test_code(s, None), internal, "done NULL");
    assert_eq!(
        net.test_code(s, Some(&mut done)),
        internal,
        "a send comm as request"
    );
    assert_eq!(
        net.reg_mr(s, p, 64, 2).unwrap_err(),
        internal,
        "CUDA memory without GPUDirect support"
    );
    assert_eq!(net.close_send(Opaque::NULL).unwrap_err(), internal);
    assert_eq!(
        net.close_recv(s).unwrap_err(),
        internal,
        "a send comm as recv comm"
    );
    net.dereg_mr(s, mh).unwrap();
    close_pair(&mut net, s, r);
}

#[test]
fn sixty_four_comms_at_once() {
    let mut net = open(11);
    let pairs: Vec<(Opaque, Opaque)> = (0..64).map(|_| connect_pair(&net)).collect();
    for (i, (s, r)) in pairs.iter().enumerate() {
        transfer(&net, *s, *r, 1000 + i, 2048, i as u64);
    }
    for (s, r) in pairs {
        net.close_send(s).unwrap();
        net.close_recv(r).unwrap();
    }
    net.finalize().unwrap();
}

#[test]
fn close_listen_never_accepted_and_connect_to_it_fails_in_bounded_time() {
    let mut net = open(10);
    // A listener nobody connects to (NCCL's shared-comm case).
    let mut handle = [0u8; 128];
    let l = net.listen(0, &mut handle).unwrap();
    net.close_listen(l).unwrap();
    // Connecting to a closed listener fails, it does not hang.
    let start = Instant::now();
    let err = loop {
        match net.connect(0, &mut handle) {
            Ok(c) if c.is_null() => assert!(start.elapsed() < DEADLINE, "connect hung"),
            Ok(_) => panic!("connected to a closed listener"),
            Err(e) => break e,
        }
    };
    assert_eq!(err, ncclResult_t::ncclRemoteError);
    net.finalize().unwrap();
}

#[test]
fn init_twice_and_v11_contexts() {
    let mut a = open(11);
    let mut b = open(11);
    a.init().unwrap();
    a.finalize().unwrap();
    b.finalize().unwrap();
    b.finalize_ctx(Opaque::NULL).unwrap();
    assert_eq!(
        b.finalize_ctx(Opaque(0x1234 as _)).unwrap_err(),
        ncclResult_t::ncclInternalError
    );
    let mut c = open(6);
    c.init().unwrap();
}

#[test]
fn service_thread_and_progress_thread_run_together() {
    let net = Arc::new(open(11));
    let (s, r) = connect_pair(&net);
    let stop = Arc::new(AtomicBool::new(false));
    let setups = Arc::new(AtomicUsize::new(0));
    let service = {
        let (net, stop, setups) = (Arc::clone(&net), Arc::clone(&stop), Arc::clone(&setups));
        thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let (s2, r2) = connect_pair(&net);
                let mut b = vec![0u8; 4096];
                let mh = net.reg_mr(s2, b.as_mut_ptr(), b.len(), HOST).unwrap();
                net.dereg_mr(r2, mh).unwrap();
                net.close_send(s2).unwrap();
                net.close_recv(r2).unwrap();
                setups.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let start = Instant::now();
    let mut moved = 0;
    while start.elapsed() < Duration::from_millis(1500) || setups.load(Ordering::Relaxed) < 3 {
        transfer(&net, s, r, 777 + moved % 5000, 8192, moved as u64);
        moved += 1;
        assert!(start.elapsed() < DEADLINE);
    }
    stop.store(true, Ordering::Relaxed);
    service.join().unwrap();
    assert!(moved > 10, "progress thread moved {moved} messages");
    net.close_send(s).unwrap();
    net.close_recv(r).unwrap();
}

#[test]
fn dlclose_dlopen_cycles_with_traffic() {
    setup();
    for cycle in 0..20 {
        let v = VERSIONS[cycle % VERSIONS.len()];
        let mut net = open(v);
        let (s, r) = connect_pair(&net);
        transfer(&net, s, r, 4096 + cycle, 8192, cycle as u64);
        close_pair(&mut net, s, r);
        net.close();
    }
}

#[test]
fn library_needs_no_rdma_libraries_and_exports_only_the_tables() {
    let so = lib();
    let out = Command::new("readelf").arg("-d").arg(&so).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("NEEDED"), "{text}");
    assert!(
        !text.contains("libibverbs") && !text.contains("librdmacm"),
        "{text}"
    );
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(&so)
        .output()
        .unwrap();
    let syms: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2).map(str::to_string))
        .collect();
    let want: Vec<String> = ALL_VERSIONS
        .iter()
        .map(|v| format!("ncclNetPlugin_v{v}"))
        .collect();
    let mut got = syms.clone();
    got.sort();
    let mut want_sorted = want.clone();
    want_sorted.sort();
    assert_eq!(got, want_sorted, "exported symbols");
}

// ---------------------------------------------------------------------------------------
// Tests that need their own process (fresh plugin state and environment).

#[test]
fn bad_settings_fail_init_with_a_warn_naming_them() {
    for (var, value) in [
        ("NCCL_ERDMA_TRANSPORT", "foo"),
        ("NCCL_IB_QPS_PER_CONNECTION", "0"),
        ("NCCL_IB_QPS_PER_CONNECTION", "abc"),
        ("NCCL_ERDMA_CTS_BATCH", "0"),
    ] {
        run_child(
            test_name!(child_init_fails_invalid_usage),
            &[("CHILD_VAR", var), ("CHILD_VALUE", value), (var, value)],
            &[],
            false,
        );
    }
}

#[test]
#[ignore = "entry point of a child process"]
fn child_init_fails_invalid_usage() {
    if !is_child() {
        return;
    }
    let (var, value) = (
        std::env::var("CHILD_VAR").unwrap(),
        std::env::var("CHILD_VALUE").unwrap(),
    );
    for v in [8, 11] {
        let mut net = Net::open(&lib(), v).unwrap();
        assert_eq!(net.init().unwrap_err(), ncclResult_t::ncclInvalidUsage);
        net.finalize().unwrap();
    }
    let warn = client::logged_lines()
        .into_iter()
        .find(|l| l.level == 2)
        .expect("a WARN line");
    assert!(
        warn.text.contains(&var) && warn.text.contains(&value) && warn.text.contains("not valid"),
        "{warn:?}"
    );
}

#[test]
fn default_verbs_fails_init_cleanly_without_rdma_and_auto_falls_back_to_tcp() {
    if std::path::Path::new("/sys/class/infiniband").exists() || verbs_device().is_some() {
        eprintln!("skipped: this host has RDMA devices (runs on hosts without RDMA)");
        return;
    }
    run_child(
        test_name!(child_default_transport_fails),
        &[],
        &["NCCL_ERDMA_TRANSPORT"],
        false,
    );
    run_child(
        test_name!(child_auto_transport_uses_tcp),
        &[("NCCL_ERDMA_TRANSPORT", "auto")],
        &[],
        false,
    );
}

#[test]
#[ignore = "entry point of a child process"]
fn child_default_transport_fails() {
    if !is_child() {
        return;
    }
    let mut net = Net::open(&lib(), 11).unwrap();
    assert_eq!(net.init().unwrap_err(), ncclResult_t::ncclSystemError);
    // NCCL 2.28 calls finalize after a failed init with a NULL context.
    net.finalize().unwrap();
    assert_eq!(
        net.devices().unwrap(),
        0,
        "devices() after a failed init reports 0"
    );
    let warns: Vec<_> = client::logged_lines()
        .into_iter()
        .filter(|l| l.level == 2)
        .collect();
    assert_eq!(warns.len(), 1, "exactly one WARN line: {warns:?}");
    assert!(
        warns[0].text.contains("verbs transport unavailable"),
        "{warns:?}"
    );
}

#[test]
#[ignore = "entry point of a child process"]
fn child_auto_transport_uses_tcp() {
    if !is_child() {
        return;
    }
    let mut net = Net::open(&lib(), 11).unwrap();
    net.init().unwrap();
    assert!(net.properties(0).unwrap().name.starts_with("erdma-tcp-"));
    let (s, r) = connect_pair(&net);
    transfer(&net, s, r, 12345, 12345, 1);
    close_pair(&mut net, s, r);
}

#[test]
fn garbage_handles_are_rejected_without_connecting() {
    run_child(test_name!(child_garbage_handles), &[], &[], true);
}

#[test]
#[ignore = "entry point of a child process (in its own network namespace)"]
fn child_garbage_handles() {
    if !is_child() {
        return;
    }
    let mut net = open(11);
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..200 {
        let mut handle = [0u8; 128];
        for b in handle.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        assert_eq!(
            net.connect(0, &mut handle).unwrap_err(),
            ncclResult_t::ncclInternalError
        );
    }
    // A valid-looking handle with a corrupted stage area is refused, not dereferenced.
    let mut handle = [0u8; 128];
    let l = net.listen(0, &mut handle).unwrap();
    handle[40] = 0x42;
    assert_eq!(
        net.connect(0, &mut handle).unwrap_err(),
        ncclResult_t::ncclInternalError
    );
    net.close_listen(l).unwrap();
    net.finalize().unwrap();
}

#[test]
fn two_processes_every_version() {
    setup();
    for v in VERSIONS {
        let mut net = open(v);
        let mut handle = [0u8; 128];
        let listen = net.listen(0, &mut handle).unwrap();
        let mut child = child_command(test_name!(child_sender))
            .env("CHILD_VERSION", v.to_string())
            .env("CHILD_HANDLE", client::handle_to_hex(&handle))
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let r = poll_until("accept", || net.accept(listen).unwrap());
        net.close_listen(listen).unwrap();
        let sizes = [0usize, 1, 4099, 1 << 20, (4 << 20) + 1];
        recv_patterns(&net, r, &sizes, 16);
        let mut out = String::new();
        for line in BufReader::new(child.stdout.take().unwrap()).lines() {
            out.push_str(&line.unwrap());
            out.push('\n');
        }
        assert!(child.wait().unwrap().success(), "v{v} child failed:\n{out}");
        assert!(out.contains("1 passed"), "{out}");
        net.close_recv(r).unwrap();
        net.finalize().unwrap();
    }
}

#[test]
#[ignore = "entry point of a child process"]
fn child_sender() {
    if !is_child() {
        return;
    }
    let v: u32 = std::env::var("CHILD_VERSION").unwrap().parse().unwrap();
    let mut handle =
        client::handle_from_hex(&std::env::var("CHILD_HANDLE").unwrap()).expect("a hex handle");
    let mut net = open(v);
    let s = poll_until("connect", || net.connect(0, &mut handle).unwrap());
    let sizes = [0usize, 1, 4099, 1 << 20, (4 << 20) + 1];
    send_patterns(&net, s, &sizes);
    net.close_send(s).unwrap();
    net.finalize().unwrap();
    std::io::stdout().flush().unwrap();
}

// ---------------------------------------------------------------------------------------
// Verbs only (the Soft-RoCE tier runs these with NCCL_ERDMA_TEST_DEVICE=rxe0).

#[test]
#[ignore = "needs an RDMA device: NCCL_ERDMA_TEST_DEVICE (run by the Soft-RoCE tier)"]
fn verbs_qps_per_connection_1_2_8_and_split() {
    require_verbs();
    // The device's clear-to-send batch (8 on Soft-RoCE), then NCCL IB's one at a time.
    for (qps, split, batch) in [
        ("1", "0", None),
        ("2", "0", None),
        ("8", "0", None),
        ("2", "1", None),
        ("8", "1", None),
        ("1", "0", Some("1")),
    ] {
        let mut env = vec![
            ("NCCL_IB_QPS_PER_CONNECTION", qps),
            ("NCCL_IB_SPLIT_DATA_ON_QPS", split),
        ];
        env.extend(batch.map(|b| ("NCCL_ERDMA_CTS_BATCH", b)));
        run_child(test_name!(child_verbs_traffic), &env, &[], false);
    }
}

#[test]
#[ignore = "entry point of a child process"]
fn child_verbs_traffic() {
    if !is_child() {
        return;
    }
    let mut net = open(11);
    assert_eq!(net.properties(0).unwrap().name, expected_device_name());
    let (s, r) = connect_pair(&net);
    for (i, &size) in [0usize, 1, 127, 129, 4093, 65536, (1 << 20) + 5]
        .iter()
        .enumerate()
    {
        transfer(&net, s, r, size, size + 64, i as u64);
    }
    // A grouped receive of 8 with mixed tags and sizes over the same QPs.
    let recv_len = 5000;
    let mut dst: Vec<Reg> = (0..8).map(|_| reg(&net, r, vec![0u8; recv_len])).collect();
    let tags: Vec<i32> = (0..8).map(|i| 7 - i).collect();
    let bufs: Vec<(*mut u8, usize)> = dst
        .iter_mut()
        .map(|d| (d.buf.as_mut_ptr(), recv_len))
        .collect();
    let mhs: Vec<Opaque> = dst.iter().map(|d| d.mh).collect();
    let rreq = poll_until("irecv", || net.irecv(r, &bufs, &tags, &mhs, false).unwrap());
    let mut srcs = Vec::new();
    for i in [2usize, 7, 0, 5, 3, 1, 6, 4] {
        let len = 600 * i;
        let mut src = reg(&net, s, pattern(50 + i as u64, len));
        let req = isend_testing(&net, rreq, || {
            net.isend(s, src.buf.as_mut_ptr(), len, tags[i], src.mh)
                .unwrap()
        });
        srcs.push((i, src, req));
    }
    let sizes = wait(&net, rreq, 8);
    for (i, src, req) in srcs {
        assert_eq!(wait(&net, req, 1), vec![(600 * i) as i32]);
        assert_eq!(sizes[i] as usize, 600 * i, "entry {i}");
        assert!(dst[i].buf[..600 * i] == src.buf[..], "entry {i} payload");
        dereg(&net, s, src);
    }
    for d in dst {
        dereg(&net, r, d);
    }
    // A full window: 32 receives in flight, then their sends.
    let mut dsts: Vec<Reg> = (0..32).map(|_| reg(&net, r, vec![0u8; 2048])).collect();
    let mut rreqs = Vec::new();
    for d in dsts.iter_mut() {
        let p = d.buf.as_mut_ptr();
        rreqs.push(poll_until("irecv", || {
            net.irecv(r, &[(p, 2048)], &[1], &[d.mh], false).unwrap()
        }));
    }
    let mut srcs: Vec<Reg> = (0..32)
        .map(|i| reg(&net, s, pattern(900 + i, 2000)))
        .collect();
    let mut sreqs = Vec::new();
    for (src, &rreq) in srcs.iter_mut().zip(&rreqs) {
        let p = src.buf.as_mut_ptr();
        sreqs.push(isend_testing(&net, rreq, || {
            net.isend(s, p, 2000, 1, src.mh).unwrap()
        }));
    }
    for (i, (rq, sq)) in rreqs.into_iter().zip(sreqs).enumerate() {
        assert_eq!(wait(&net, rq, 1), vec![2000]);
        wait(&net, sq, 1);
        assert!(dsts[i].buf[..2000] == srcs[i].buf[..], "window message {i}");
    }
    for d in dsts {
        dereg(&net, r, d);
    }
    for src in srcs {
        dereg(&net, s, src);
    }
    close_pair(&mut net, s, r);
}

#[test]
#[ignore = "needs an RDMA device: NCCL_ERDMA_TEST_DEVICE (run by the Soft-RoCE tier)"]
fn verbs_batched_clear_to_send_under_a_proxy_loop() {
    require_verbs();
    for (batch, group) in [("8", "1"), ("16", "1"), ("4", "3"), ("1", "1")] {
        run_child(
            test_name!(child_verbs_cts_batch),
            &[("NCCL_ERDMA_CTS_BATCH", batch), ("CHILD_GROUP", group)],
            &[],
            false,
        );
    }
}

/// NCCL_ERDMA_CTS_BATCH > 1 holds clear-to-send entries back; driven the way NCCL's proxy
/// drives a comm (one thread; each pass posts a receive while fewer than 8 are in flight,
/// posts the next send, tests the oldest receive and the oldest send), with the receiver
/// ahead of the sender as in a latency-bound exchange (a message is sent once the receives
/// up to 7 beyond its own are posted), every message must arrive intact, across FIFO
/// wrap-around (200 messages, 32 slots), and the clear-to-sends must have been batched.
#[test]
#[ignore = "entry point of a child process"]
fn child_verbs_cts_batch() {
    if !is_child() {
        return;
    }
    let group: usize = std::env::var("CHILD_GROUP").unwrap().parse().unwrap();
    let mut net = open(11);
    let (s, r) = connect_pair(&net);
    const MSGS: usize = 200;
    const WINDOW: usize = 8;
    const LEN: usize = 3000;
    let mut dst = reg(&net, r, vec![0u8; MSGS * LEN]);
    let src_data: Vec<u8> = (0..MSGS)
        .flat_map(|m| pattern(4000 + m as u64, LEN))
        .collect();
    let mut src = reg(&net, s, src_data);
    let size_of = |m: usize| 1 + (m * 37) % LEN;
    let groups = MSGS / group;
    let (mut posted, mut received, mut sent, mut send_done) = (0usize, 0usize, 0usize, 0usize);
    let mut rreqs = std::collections::VecDeque::new();
    let mut sreqs = std::collections::VecDeque::new();
    let start = Instant::now();
    while received < groups || send_done < groups * group {
        assert!(
            start.elapsed() < DEADLINE,
            "stalled: {received} received, {sent} sent"
        );
        if posted < groups && posted - received < WINDOW {
            let base = dst.buf.as_mut_ptr();
            let bufs: Vec<(*mut u8, usize)> = (0..group)
                .map(|e| (base.wrapping_add((posted * group + e) * LEN), LEN))
                .collect();
            let tags: Vec<i32> = (0..group as i32).collect();
            let mhs = vec![dst.mh; group];
            let q = net.irecv(r, &bufs, &tags, &mhs, false).unwrap();
            if !q.is_null() {
                rreqs.push_back(q);
                posted += 1;
            }
        }
        let ahead = posted >= (sent / group + WINDOW - 1).min(groups);
        if sent < groups * group && ahead {
            let p = src.buf.as_mut_ptr().wrapping_add(sent * LEN);
            let q = net
                .isend(s, p, size_of(sent), (sent % group) as i32, src.mh)
                .unwrap();
            if !q.is_null() {
                sreqs.push_back(q);
                sent += 1;
            }
        }
        if let Some(&q) = rreqs.front() {
            let mut sizes = [0i32; 64];
            if net.test(q, Some(&mut sizes[..])).unwrap() {
                for (e, size) in sizes[..group].iter().enumerate() {
                    assert_eq!(*size as usize, size_of(received * group + e), "sizes");
                }
                rreqs.pop_front();
                received += 1;
            }
        }
        if let Some(&q) = sreqs.front() {
            if net.test(q, None).unwrap() {
                sreqs.pop_front();
                send_done += 1;
            }
        }
    }
    for m in 0..groups * group {
        let n = size_of(m);
        assert!(
            dst.buf[m * LEN..m * LEN + n] == src.buf[m * LEN..m * LEN + n],
            "message {m} payload"
        );
    }
    dereg(&net, r, dst);
    dereg(&net, s, src);
    close_pair(&mut net, s, r);
    // The receive comm's summary: "(W clear-to-send writes for R receives)". One write per
    // receive without batching (the first few aside); batched, several receives per write
    // on average.
    let batch: u64 = std::env::var("NCCL_ERDMA_CTS_BATCH")
        .unwrap()
        .parse()
        .unwrap();
    let lines = client::logged_lines();
    let summary = lines
        .iter()
        .find(|l| l.text.contains("closed rx comm"))
        .unwrap_or_else(|| panic!("no rx summary: {lines:#?}"));
    let (before, after) = summary
        .text
        .split_once(" clear-to-send writes for ")
        .unwrap_or_else(|| panic!("no clear-to-send counts in {:?}", summary.text));
    let writes: u64 = before.rsplit('(').next().unwrap().parse().unwrap();
    let receives: u64 = after.split_whitespace().next().unwrap().parse().unwrap();
    eprintln!(
        "batch {batch}, group {group}: {writes} clear-to-send writes for {receives} receives"
    );
    assert_eq!(receives, groups as u64, "{}", summary.text);
    if batch == 1 {
        // One write per receive, but for those posted before the sender was up (at most
        // the window), whose entries wait for it and then go out in one write.
        let held = (WINDOW as u64).min(receives);
        assert!(
            writes <= receives && writes + held > receives,
            "{}",
            summary.text
        );
    } else {
        assert!(writes * 2 <= receives, "{}", summary.text);
    }
}

#[test]
#[ignore = "needs an RDMA device: NCCL_ERDMA_TEST_DEVICE (run by the Soft-RoCE tier)"]
fn verbs_flush_path_on_host_memory() {
    require_verbs();
    run_child(
        test_name!(child_verbs_flush),
        &[("NCCL_ERDMA_FORCE_FLUSH", "1")],
        &[],
        false,
    );
}

#[test]
#[ignore = "entry point of a child process"]
fn child_verbs_flush() {
    if !is_child() {
        return;
    }
    let mut net = open(11);
    assert_eq!(net.properties(0).unwrap().force_flush, Some(1));
    let (s, r) = connect_pair(&net);
    let mut dst = reg(&net, r, vec![0u8; 4096]);
    let mut src = reg(&net, s, pattern(77, 3000));
    let rreq = poll_until("irecv", || {
        net.irecv(r, &[(dst.buf.as_mut_ptr(), 4096)], &[3], &[dst.mh], false)
            .unwrap()
    });
    let sreq = isend_testing(&net, rreq, || {
        net.isend(s, src.buf.as_mut_ptr(), 3000, 3, src.mh).unwrap()
    });
    assert_eq!(wait(&net, rreq, 1), vec![3000]);
    wait(&net, sreq, 1);
    for _ in 0..40 {
        let freq = net
            .iflush(r, &[(dst.buf.as_mut_ptr(), 3000)], &[dst.mh])
            .unwrap();
        assert!(!freq.is_null(), "a forced flush returns a request");
        let start = Instant::now();
        while !net.test(freq, None).unwrap() {
            assert!(start.elapsed() < DEADLINE, "flush never completed");
        }
    }
    let (d, dmh) = (dst.buf.as_mut_ptr(), dst.mh);
    let flush = |net: &Net| net.iflush(r, &[(d, 3000)], &[dmh]);
    let finish = |net: &Net, freq: Opaque| {
        let start = Instant::now();
        while !net.test(freq, None).unwrap() {
            assert!(start.elapsed() < DEADLINE, "flush never completed");
        }
    };
    // One flush left untested (another sub's, on a shared comm) while 40 more go round all
    // the slots: every one still returns a request, since NULL would mean "no flush
    // needed" and NCCL would read the data unflushed.
    let held = flush(&net).unwrap();
    assert!(!held.is_null());
    for i in 0..40 {
        let freq = flush(&net).unwrap();
        assert!(
            !freq.is_null(),
            "flush {i} after an untested one was skipped"
        );
        finish(&net, freq);
    }
    finish(&net, held);
    // 32 in flight is NCCL's limit; a 33rd is NCCL's misuse, not a skipped flush.
    let pending: Vec<Opaque> = (0..32).map(|_| flush(&net).unwrap()).collect();
    assert!(pending.iter().all(|f| !f.is_null()));
    assert_eq!(
        flush(&net).unwrap_err(),
        ncclResult_t::ncclInternalError,
        "a 33rd flush in flight"
    );
    for f in pending {
        finish(&net, f);
    }
    // Nothing to flush: no request.
    let none = net
        .iflush(r, &[(dst.buf.as_mut_ptr(), 0)], &[dst.mh])
        .unwrap();
    assert!(none.is_null());
    assert!(dst.buf[..3000] == src.buf[..]);
    dereg(&net, r, dst);
    dereg(&net, s, src);
    close_pair(&mut net, s, r);
}

#[test]
#[ignore = "needs an RDMA device: NCCL_ERDMA_TEST_DEVICE (run by the Soft-RoCE tier)"]
fn verbs_small_sends_from_gpu_memory_are_never_inlined() {
    require_verbs();
    run_child_in(
        Sandbox::PeerMemory,
        test_name!(child_verbs_gpu_memory_not_inlined),
        &[],
        &[],
    );
}

/// Sends inline-sized messages from a buffer registered as CUDA memory whose page the CPU
/// may not read (PROT_NONE: what a GPU address is to the CPU) while the NIC still reads it
/// through the registration. A send posted inline has the CPU copy the data at post time:
/// SIGSEGV, and the child fails.
#[test]
#[ignore = "entry point of a child process"]
fn child_verbs_gpu_memory_not_inlined() {
    if !is_child() {
        return;
    }
    const PAGE: usize = 4096;
    let mut net = open(11);
    let props = net.properties(0).unwrap();
    assert_ne!(props.ptr_support & CUDA, 0, "GPUDirect offered: {props:?}");
    let (s, r) = connect_pair(&net);
    // SAFETY: a fresh anonymous private mapping of one page.
    let page = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(page, libc::MAP_FAILED);
    let gpu = page as *mut u8;
    let data = pattern(91, 64);
    // SAFETY: the page is ours and writable; 64 bytes fit in it.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), gpu, data.len()) };
    let mh = net.reg_mr(s, gpu, PAGE, CUDA).unwrap();
    // SAFETY: our own page; the NIC reads it through the pinned registration.
    assert_eq!(unsafe { libc::mprotect(page, PAGE, libc::PROT_NONE) }, 0);

    let mut dst = reg(&net, r, vec![0u8; 64]);
    let d = dst.buf.as_mut_ptr();
    // One message: the single-write path.
    let rreq = poll_until("irecv", || {
        net.irecv(r, &[(d, 8)], &[1], &[dst.mh], false).unwrap()
    });
    let sreq = isend_testing(&net, rreq, || net.isend(s, gpu, 8, 1, mh).unwrap());
    assert_eq!(wait(&net, rreq, 1), vec![8]);
    wait(&net, sreq, 1);
    // A group of two: the chained path.
    let rreq = poll_until("irecv", || {
        net.irecv(
            r,
            &[(d.wrapping_add(16), 16), (d.wrapping_add(40), 16)],
            &[2, 3],
            &[dst.mh, dst.mh],
            false,
        )
        .unwrap()
    });
    let s2 = isend_testing(&net, rreq, || {
        net.isend(s, gpu.wrapping_add(8), 16, 2, mh).unwrap()
    });
    let s3 = isend_testing(&net, rreq, || {
        net.isend(s, gpu.wrapping_add(24), 16, 3, mh).unwrap()
    });
    assert_eq!(wait(&net, rreq, 2), vec![16, 16]);
    wait(&net, s2, 1);
    wait(&net, s3, 1);
    assert_eq!(dst.buf[..8], data[..8]);
    assert_eq!(dst.buf[16..32], data[8..24]);
    assert_eq!(dst.buf[40..56], data[24..40]);

    // SAFETY: our own page again, readable before it is deregistered and unmapped.
    assert_eq!(
        unsafe { libc::mprotect(page, PAGE, libc::PROT_READ | libc::PROT_WRITE) },
        0
    );
    net.dereg_mr(s, mh).unwrap();
    // SAFETY: mapped above, no longer registered or used.
    assert_eq!(unsafe { libc::munmap(page, PAGE) }, 0);
    dereg(&net, r, dst);
    close_pair(&mut net, s, r);
}

#[test]
#[ignore = "needs an RDMA device: NCCL_ERDMA_TEST_DEVICE (run by the Soft-RoCE tier)"]
fn verbs_registration_cache_hits_and_misses() {
    require_verbs();
    run_child(test_name!(child_verbs_mr_cache), &[], &[], false);
}

#[test]
#[ignore = "entry point of a child process"]
fn child_verbs_mr_cache() {
    if !is_child() {
        return;
    }
    let net = open(8);
    let (s, r) = connect_pair(&net);
    let count = |what: &str| {
        client::logged_lines()
            .iter()
            .filter(|l| l.text.contains("regMr") && l.text.contains(what))
            .count()
    };
    let (hits0, misses0) = (count("cache hit"), count("cache miss"));
    let mut big = vec![0u8; 1 << 20];
    let a = net.reg_mr(s, big.as_mut_ptr(), big.len(), HOST).unwrap();
    // A sub-range of the same allocation, registered through the other comm.
    let inner = big[4096..8192].as_mut_ptr();
    let b = net.reg_mr(r, inner, 4096, HOST).unwrap();
    let mut other = vec![0u8; 64 << 10];
    let c = net
        .reg_mr(s, other.as_mut_ptr(), other.len(), HOST)
        .unwrap();
    assert_eq!(
        count("cache miss") - misses0,
        2,
        "two distinct ranges registered"
    );
    assert_eq!(
        count("cache hit") - hits0,
        1,
        "the sub-range reused the covering MR"
    );
    // The sub-range handle works for traffic while the covering one is still held.
    net.dereg_mr(s, a).unwrap();
    net.dereg_mr(r, b).unwrap();
    net.dereg_mr(s, c).unwrap();
    assert_eq!(
        net.dereg_mr(s, c).unwrap_err(),
        ncclResult_t::ncclInternalError
    );
    net.close_send(s).unwrap();
    net.close_recv(r).unwrap();
}

#[test]
#[ignore = "needs an RDMA device: NCCL_ERDMA_TEST_DEVICE (run by the Soft-RoCE tier)"]
fn verbs_default_transport_uses_the_device() {
    let dev = require_verbs();
    run_child(
        test_name!(child_default_transport_verbs),
        &[("CHILD_DEVICE", dev.as_str())],
        &["NCCL_ERDMA_TRANSPORT"],
        false,
    );
}

#[test]
#[ignore = "entry point of a child process"]
fn child_default_transport_verbs() {
    if !is_child() {
        return;
    }
    let mut net = Net::open(&lib(), 11).unwrap();
    net.init().unwrap();
    assert_eq!(
        net.properties(0).unwrap().name,
        std::env::var("CHILD_DEVICE").unwrap()
    );
    let (s, r) = connect_pair(&net);
    transfer(&net, s, r, 100_000, 100_000, 5);
    close_pair(&mut net, s, r);
}

#[test]
fn make_vdevice_refuses_what_cannot_be_fused() {
    let usage = ncclResult_t::ncclInvalidUsage;
    for v in [9, 10, 11, 12] {
        let net = open(v);
        let n = net.devices().unwrap();
        let too_many: Vec<i32> = vec![0; if v >= 12 { 9 } else { 5 }];
        for devs in [
            &[0, 0][..],
            &[0, n + 7][..],
            &[-1][..],
            &[][..],
            &too_many[..],
        ] {
            assert_eq!(net.make_vdevice(devs).unwrap_err(), usage, "v{v}: {devs:?}");
        }
        if verbs_device().is_none() {
            // One tcp device: nothing to fuse it with.
            assert_eq!(net.make_vdevice(&[0, 1]).unwrap_err(), usage, "v{v} tcp");
        }
        assert_eq!(
            net.devices().unwrap(),
            n,
            "v{v}: refused requests add no device"
        );
    }
    let warn = client::logged_lines()
        .into_iter()
        .any(|l| l.level == 2 && l.text.contains("makeVDevice of devices [0, 0]"));
    assert!(warn, "a WARN names the refused request");
    // No makeVDevice before v9.
    assert!(open(8).make_vdevice(&[0]).is_err());
}

#[test]
#[ignore = "needs an RDMA device: NCCL_ERDMA_TEST_DEVICE (run by the Soft-RoCE tier)"]
fn verbs_make_vdevice_adds_a_device_that_carries_data() {
    require_verbs();
    run_child(test_name!(child_verbs_vdevice), &[], &[], false);
}

#[test]
#[ignore = "entry point of a child process"]
fn child_verbs_vdevice() {
    if !is_child() {
        return;
    }
    let mut net = open(12);
    let n = net.devices().unwrap();
    let physical = net.properties(0).unwrap();
    let d = net.make_vdevice(&[0]).unwrap();
    assert_eq!(
        (d, net.devices().unwrap()),
        (n, n + 1),
        "appended after the physical ones"
    );
    let p = net.properties(d).unwrap();
    assert_eq!(p.name, physical.name);
    assert_eq!(p.vprops, Some((1, vec![0])));
    assert_eq!(p.speed, physical.speed);
    assert_eq!(
        p.rail_plane,
        Some((-1, -1)),
        "a virtual device has no rail of its own"
    );
    let (s, r) = connect_pair_on(&net, d);
    for (i, size) in [0, 8, 100_000, 1 << 20].into_iter().enumerate() {
        transfer(&net, s, r, size, size + 64, i as u64);
    }
    close_pair(&mut net, s, r);
}

#[test]
fn virtual_devices_go_when_nccl_unloads_the_plugin_and_stay_when_it_does_not() {
    // NCCL (2.28 and later) unloads the plugin after its last communicator unless
    // NCCL_NET_PLUGIN_REF_COUNT keeps it, and its next load counts every device as physical.
    run_child(
        test_name!(child_vdevice_reload),
        &[],
        &["NCCL_NET_PLUGIN_REF_COUNT"],
        false,
    );
    run_child(
        test_name!(child_vdevice_reload),
        &[("NCCL_NET_PLUGIN_REF_COUNT", "1"), ("CHILD_KEEPS", "1")],
        &[],
        false,
    );
}

#[test]
#[ignore = "entry point of a child process"]
fn child_vdevice_reload() {
    if !is_child() {
        return;
    }
    let mut net = open(12);
    let n = net.devices().unwrap();
    assert_eq!(net.make_vdevice(&[0]).unwrap(), n);
    assert_eq!(net.devices().unwrap(), n + 1);
    net.finalize().unwrap();
    drop(net);
    let mut net = open(12);
    let want = if std::env::var_os("CHILD_KEEPS").is_some() {
        n + 1
    } else {
        n
    };
    assert_eq!(net.devices().unwrap(), want, "devices after a reload");
    net.finalize().unwrap();
}

#[test]
fn stats_lines_count_every_byte() {
    run_child(
        test_name!(child_stats_lines),
        &[("NCCL_ERDMA_STATS_INTERVAL", "1")],
        &[],
        false,
    );
}

#[test]
#[ignore = "entry point of a child process"]
fn child_stats_lines() {
    if !is_child() {
        return;
    }
    let mut net = open(11);
    let (s, r) = connect_pair(&net);
    // Long enough for at least one interval line, with a known byte count per message.
    let start = Instant::now();
    let mut sent = 0u64;
    while start.elapsed() < Duration::from_millis(1300) {
        transfer(&net, s, r, 1000, 4096, sent);
        sent += 1;
    }
    close_pair(&mut net, s, r);
    let lines = client::logged_lines();
    for dir in ["tx", "rx"] {
        let summary = format!("closed {dir} comm #");
        let want = format!(": {} bytes in {sent} messages", 1000 * sent);
        assert!(
            lines
                .iter()
                .any(|l| l.text.contains(&summary) && l.text.contains(&want)),
            "no {dir} summary with {want}: {lines:#?}"
        );
        let rate = lines
            .iter()
            .find(|l| l.text.contains(&format!("stats {dir} #")))
            .unwrap_or_else(|| panic!("no {dir} rate line"));
        // "total N bytes in M messages": every message was 1000 bytes.
        let total: Vec<u64> = rate
            .text
            .split("total ")
            .nth(1)
            .unwrap()
            .split_whitespace()
            .filter_map(|w| w.parse().ok())
            .take(2)
            .collect();
        assert_eq!(total[0], 1000 * total[1], "{}", rate.text);
        assert!(total[1] > 0 && total[1] <= sent, "{}", rate.text);
        assert!(
            rate.text.contains("MB/s") && rate.text.contains("msg/s"),
            "{}",
            rate.text
        );
        if std::env::var("NCCL_ERDMA_TRANSPORT").as_deref() == Ok("verbs") {
            // Each rail's counters ride along, as in the close summary.
            assert!(
                rate.text.contains("(rails ") && rate.text.contains(" errors)"),
                "{}",
                rate.text
            );
        }
    }
}

#[test]
fn profiler_gets_a_start_and_a_stop_per_request() {
    run_child(test_name!(child_profiler_events), &[], &[], false);
}

#[test]
#[ignore = "entry point of a child process"]
fn child_profiler_events() {
    if !is_child() {
        return;
    }
    for v in [10, 11] {
        setup();
        let mut net = Net::open(&lib(), v).unwrap();
        net.init_profiled(0xabc0).unwrap();
        let (s, r) = connect_pair(&net);
        let before = client::profiler_events().len();
        for (i, size) in [10usize, 2000, 0].into_iter().enumerate() {
            transfer(&net, s, r, size, 4096, 40 + i as u64);
        }
        let events = &client::profiler_events()[before..];
        let starts: Vec<_> = events.iter().filter(|e| e.start).collect();
        assert_eq!(starts.len(), 6, "v{v}: 3 sends and 3 receives: {events:#?}");
        for st in &starts {
            assert_eq!(st.parent, 0xabc0, "v{v}: parent handle passed through");
            assert_eq!(st.plugin_id, (0x45 << 16) | 1);
            let stops = events
                .iter()
                .filter(|e| !e.start && e.handle == st.handle)
                .count();
            assert_eq!(stops, 1, "v{v}: exactly one Stop for {st:?}");
        }
        let sends: Vec<u64> = starts
            .iter()
            .filter_map(|e| e.descr.filter(|d| d.0 == 0).map(|d| d.2))
            .collect();
        assert_eq!(sends, vec![10, 2000, 0], "v{v}: send sizes");
        let recvs: Vec<(u32, u64)> = starts
            .iter()
            .filter_map(|e| e.descr.filter(|d| d.0 == 1).map(|d| (d.1, d.2)))
            .collect();
        assert_eq!(recvs, vec![(1, 4096); 3], "v{v}: posted receive sizes");
        close_pair(&mut net, s, r);
    }
}
