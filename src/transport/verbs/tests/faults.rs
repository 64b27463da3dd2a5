//! Faults on the fake fabric: sends larger than their receive, failed work requests, peers
//! that close, links that never answer (the work watchdog and its probes), links that flap,
//! fatal events, devices of another link layer.

use super::*;

#[test]
fn a_send_larger_than_its_receive_fails_on_both_sides() {
    let c = connect(params());
    let mut dst = c.buf(false, 64, 0);
    let mut src = c.buf(true, 65, 1);
    let r = c.irecv(&mut [&mut dst], &[3]);
    let e = c.isend(src.whole(), src.mh, 3).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidUsage);
    assert!(e.to_string().contains("65 bytes"), "{e}");
    let e = wait_error(Duration::from_secs(5), || c.test_recv(r));
    assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{e}");
    // The comm stays failed: a later send is an error, not a wait.
    assert!(c.send.isend(src.whole(), 3, src.mh).is_err());
}

#[test]
fn a_truncated_first_send_of_a_group_fails_the_receive_while_the_sender_lives() {
    let c = connect(params());
    let mut a = c.buf(false, 64, 0);
    let mut b = c.buf(false, 64, 0);
    let r = c.irecv(&mut [&mut a, &mut b], &[1, 2]);
    let mut big = c.buf(true, 128, 1);
    let e = c.isend(big.whole(), big.mh, 1).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidUsage);
    // The second send never comes (the comm failed); the receive must fail, not wait.
    let e = wait_error(Duration::from_secs(5), || c.test_recv(r));
    assert!(e.to_string().contains("more bytes than the receive"), "{e}");
}

#[test]
fn a_truncated_last_send_of_a_group_fails_the_receive_and_the_first_completes() {
    let c = connect(params());
    let mut a = c.buf(false, 64, 0);
    let mut b = c.buf(false, 64, 0);
    let r = c.irecv(&mut [&mut a, &mut b], &[1, 2]);
    let mut ok = c.buf(true, 64, 1);
    let mut big = c.buf(true, 65, 2);
    let first = c.send_buf(&mut ok, 2);
    assert!(c.isend(big.whole(), big.mh, 1).is_err());
    assert_eq!(wait(|| c.test_send(first)).unwrap(), Completion::single(64));
    let e = wait_error(Duration::from_secs(5), || c.test_recv(r));
    assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{e}");
}

#[test]
fn a_failing_cq_poll_fails_a_waiting_receive_with_its_error_and_the_comm_stays_failed() {
    let c = connect(params());
    let mut dst = c.buf(false, 64, 0);
    let r = c.irecv(&mut [&mut dst], &[0]);
    // Tests of the waiting receive, answered without the lock, until the polls fail: then
    // one of them (by the gate's poll or the locked one) reports the poll's error.
    for _ in 0..3 {
        assert_eq!(c.test_recv(r).unwrap(), None);
    }
    c.fabric.fail_polls(Some(libc::EIO));
    let e = wait_error(Duration::from_secs(5), || c.test_recv(r));
    assert!(e.to_string().contains("ibv_poll_cq"), "{e}");
    c.fabric.fail_polls(None);
    // Failed for good: the next receive is refused, not posted.
    let mut again = c.buf(false, 64, 0);
    assert!(c.recv.irecv(&[again.whole()], &[0], &[again.mh]).is_err());
}

#[test]
fn a_failed_write_is_an_error_naming_peer_operation_and_status() {
    let c = connect(params());
    let qpn = c.send.qpns()[0];
    c.fabric.fail_next(qpn, REMOTE_ACCESS_ERROR);
    let mut dst = c.buf(false, 64, 0);
    let mut src = c.buf(true, 64, 1);
    c.irecv(&mut [&mut dst], &[0]);
    let s = c.send_buf(&mut src, 0);
    let e = wait_error(Duration::from_secs(5), || c.test_send(s));
    assert_eq!(e.kind(), ErrorKind::Remote);
    let msg = e.to_string();
    for part in [
        "data RDMA write",
        "127.0.0.1",
        "fake1",
        "fake0",
        "remote access error",
    ] {
        assert!(msg.contains(part), "{part:?} missing in: {msg}");
    }
    // The comm stays failed.
    assert!(c.send.isend(src.whole(), 0, src.mh).is_err());
}

#[test]
fn a_failed_write_behind_completed_ones_in_one_poll_is_the_one_named() {
    let c = connect(params());
    let mut dst: Vec<Buf> = (0..3).map(|_| c.buf(false, 64, 0)).collect();
    for (tag, d) in dst.iter_mut().enumerate() {
        c.irecv(&mut [d], &[tag as i32]);
    }
    let mut src: Vec<Buf> = (0..3).map(|i| c.buf(true, 64, i + 1)).collect();
    // Nothing polls the sender's CQ until the test: the three completions, the last failed,
    // come in one batch.
    let ok = [c.send_buf(&mut src[0], 0), c.send_buf(&mut src[1], 1)];
    c.fabric.fail_next(c.send.qpns()[0], REMOTE_ACCESS_ERROR);
    let failed = c.send_buf(&mut src[2], 2);
    let e = c.test_send(failed).unwrap_err();
    assert!(e.to_string().contains("remote access error"), "{e}");
    // The two before it were handed out before the drain stopped.
    for s in ok {
        assert_eq!(c.test_send(s).unwrap(), Some(Completion::single(64)));
    }
}

#[test]
fn a_receiver_whose_clear_to_send_fails_gets_an_error() {
    let c = connect(params());
    let mut dst = c.buf(false, 64, 0);
    // The receiver's QP towards the sender: its clear-to-send writes fail.
    c.fabric.cut(&c.rx_nics[0], Some(Cut::Fail(RETRY_EXCEEDED)));
    let r = c.irecv(&mut [&mut dst], &[0]);
    let e = wait_error(Duration::from_secs(5), || c.test_recv(r));
    assert!(e.to_string().contains("clear-to-send RDMA write"), "{e}");
    assert!(e.to_string().contains("retry exceeded"), "{e}");
}

#[test]
fn a_write_over_a_lossy_link_lands_and_fails_once_its_retries_run_out() {
    let c = connect(params());
    let mut dst = c.buf(false, 64, 0);
    let mut src = c.buf(true, 64, 7);
    c.fabric.retries_run_out(Duration::from_millis(50));
    let r = c.irecv(&mut [&mut dst], &[0]);
    // The receiver's NIC drops what it sends: the write lands, its acknowledgement does not.
    c.fabric.cut(&c.rx_nics[0], Some(Cut::Egress));
    let t0 = Instant::now();
    let s = c.send_buf(&mut src, 0);
    assert_eq!(wait(|| c.test_recv(r)).unwrap(), Completion::single(64));
    assert_eq!(dst.mem.bytes(), &TestMem::pattern(64, 7)[..]);
    let e = wait_error(Duration::from_secs(5), || c.test_send(s));
    assert!(t0.elapsed() >= Duration::from_millis(50));
    assert!(e.to_string().contains("retry exceeded"), "{e}");
}

#[test]
fn a_peer_that_closes_fails_the_waiting_side() {
    // Receiver waits, sender closes.
    let c = connect(params());
    let mut dst = c.buf(false, 64, 0);
    let r = c.irecv(&mut [&mut dst], &[0]);
    drop(c.send);
    let e = wait_error(Duration::from_secs(10), || test_recv(&c.recv, r));
    assert_eq!(e.kind(), ErrorKind::Remote);
    assert!(e.to_string().contains("closed its connection"), "{e}");
    // Sender waits for a clear-to-send, receiver closes.
    let c = connect(params());
    let mut src = c.buf(true, 64, 0);
    drop(c.recv);
    let deadline = Instant::now() + Duration::from_secs(10);
    let e = loop {
        match c.send.isend(src.whole(), 0, src.mh) {
            Err(e) => break e,
            Ok(None) => assert!(Instant::now() < deadline, "no error"),
            Ok(Some(_)) => panic!("posted to a closed peer"),
        }
    };
    assert!(e.to_string().contains("closed its connection"), "{e}");
}

fn watchdog_params() -> ConnParams {
    ConnParams {
        work_timeout: Some(Duration::from_millis(300)),
        ..params()
    }
}

#[test]
fn a_cut_link_that_never_answers_fails_a_posted_send_within_the_work_timeout() {
    let c = connect(watchdog_params());
    let mut dst = c.buf(false, 64, 0);
    let mut src = c.buf(true, 64, 1);
    c.irecv(&mut [&mut dst], &[0]);
    c.fabric.cut(&c.tx_nics[0], Some(Cut::Silent));
    let t0 = Instant::now();
    let s = c.send_buf(&mut src, 0);
    let e = wait_error(Duration::from_secs(10), || c.test_send(s));
    let took = t0.elapsed();
    assert!(took >= Duration::from_millis(300), "{took:?}");
    let msg = e.to_string();
    assert!(
        msg.contains("NCCL_ERDMA_WORK_TIMEOUT_S") && msg.contains("fake0"),
        "{msg}"
    );
    assert!(msg.contains("127.0.0.1"), "names the peer: {msg}");
}

#[test]
fn a_receiver_waiting_on_a_dead_link_probes_and_fails() {
    let c = connect(watchdog_params());
    let mut dst = c.buf(false, 64, 0);
    c.fabric.cut(&c.rx_nics[0], Some(Cut::Silent));
    let r = c.irecv(&mut [&mut dst], &[0]);
    let t0 = Instant::now();
    let e = wait_error(Duration::from_secs(10), || c.test_recv(r));
    assert!(t0.elapsed() >= Duration::from_millis(300));
    assert!(e.to_string().contains("has not completed"), "{e}");
}

#[test]
fn a_sender_waiting_for_a_clear_to_send_on_a_dead_link_probes_and_fails() {
    let c = connect(watchdog_params());
    // The receiver has announced a receive: it is up, and its paths are probed.
    super::failover::through(&c, 64, 1);
    c.fabric.cut(&c.tx_nics[0], Some(Cut::Silent));
    let mut src = c.buf(true, 64, 0);
    let deadline = Instant::now() + Duration::from_secs(10);
    let e = loop {
        match c.send.isend(src.whole(), 0, src.mh) {
            Err(e) => break e,
            Ok(None) => assert!(Instant::now() < deadline, "no error"),
            Ok(Some(_)) => panic!("nothing was announced"),
        }
    };
    assert!(e.to_string().contains("has not completed"), "{e}");
}

#[test]
fn a_waiting_comm_on_a_live_link_never_trips_the_watchdog() {
    let c = connect(watchdog_params());
    let mut dst = c.buf(false, 64, 0);
    let r = c.irecv(&mut [&mut dst], &[0]);
    // The peer sends nothing for 4 work timeouts: probes complete, no error.
    let until = Instant::now() + Duration::from_millis(1200);
    while Instant::now() < until {
        assert_eq!(c.test_recv(r).unwrap(), None);
    }
    let mut src = c.buf(true, 64, 6);
    let s = c.send_buf(&mut src, 0);
    wait(|| c.test_send(s)).unwrap();
    wait(|| c.test_recv(r)).unwrap();
    assert_eq!(dst.mem.bytes(), TestMem::pattern(64, 6));
}

#[test]
fn a_link_that_flaps_inside_the_work_timeout_loses_nothing() {
    let c = connect(ConnParams {
        work_timeout: Some(Duration::from_secs(5)),
        ..params()
    });
    let mut dst = c.buf(false, 4096, 0);
    let mut src = c.buf(true, 4096, 12);
    let r = c.irecv(&mut [&mut dst], &[0]);
    c.fabric.cut(&c.tx_nics[0], Some(Cut::Silent));
    let s = c.send_buf(&mut src, 0);
    for _ in 0..5000 {
        assert_eq!(c.test_send(s).unwrap(), None);
    }
    c.fabric.cut(&c.tx_nics[0], None);
    wait(|| c.test_send(s)).unwrap();
    wait(|| c.test_recv(r)).unwrap();
    assert_eq!(dst.mem.bytes(), TestMem::pattern(4096, 12));
}

#[test]
fn a_fatal_asynchronous_event_fails_the_comm() {
    let c = connect(params());
    let mut dst = c.buf(false, 64, 0);
    let r = c.irecv(&mut [&mut dst], &[0]);
    c.fabric.fatal_event(&c.rx_nics[0], None, "device fatal");
    let e = wait_error(Duration::from_secs(5), || c.test_recv(r));
    assert!(
        e.to_string()
            .contains("fatal asynchronous event: fake1: device fatal"),
        "{e}"
    );
}

#[test]
fn a_connect_to_a_device_of_another_link_layer_is_refused_with_both_names() {
    let fabric = Fabric::new();
    let tx = fabric.nic("fake0");
    let rx = fabric.nic_with_link_layer("ib0", crate::verbs::device::LINK_LAYER_IB);
    let e = match Conn::join(fabric, (vec![tx], vec![rx]), (1, 1), (params(), params())) {
        Err(e) => e,
        Ok(_) => panic!("connected across link layers"),
    };
    let msg = e.to_string();
    assert!(msg.contains("link layer mismatch"), "{msg}");
    assert!(msg.contains("NCCL_IB_HCA"), "{msg}");
}

#[test]
fn a_bad_handle_fails_only_its_call_and_a_send_meets_it_once_matched() {
    let c = connect(params());
    let mut dst = c.buf(false, 64, 0);
    let mut src = c.buf(true, 64, 5);
    // A handle that covers 8 bytes of a 64-byte buffer: every lookup of it fails.
    let bad = [c.register(dst.mem.addr(), 8, dst.keys)];
    // A receive with a bad handle posts nothing.
    let e = c.recv.irecv(&[dst.whole()], &[2], &bad).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Internal);
    // A send looks its handle up once a receive matches it (as NCCL's IB transport uses it):
    // before, it waits; after, the error, and the receive is left for the next send.
    let bad = [c.register(src.mem.addr(), 8, src.keys)];
    assert_eq!(c.send.isend(src.whole(), 2, bad[0]).unwrap(), None);
    let r = c.irecv(&mut [&mut dst], &[2]);
    let e = (0..POLLS)
        .find_map(|_| c.send.isend(src.whole(), 2, bad[0]).err())
        .expect("an error once the send is matched");
    assert_eq!(e.kind(), ErrorKind::Internal);
    let s = c.send_buf(&mut src, 2);
    assert_eq!(wait(|| c.test_send(s)).unwrap(), Completion::single(64));
    assert_eq!(wait(|| c.test_recv(r)).unwrap(), Completion::single(64));
    assert_eq!(dst.mem.bytes(), TestMem::pattern(64, 5));
}

/// Asserts that `first` comes back, code and message, from every later call `again` makes.
fn keeps_failing(first: &Error, mut again: impl FnMut() -> Result<Option<Completion>>) {
    for _ in 0..3 {
        let e = again().expect_err("a failed comm answers with its failure");
        assert_eq!((e.code(), e.to_string()), (first.code(), first.to_string()));
    }
}

#[test]
fn a_truncation_a_dead_peer_and_a_fatal_event_each_keep_their_code_on_every_later_call() {
    use crate::ffi::ncclResult_t::{ncclInvalidUsage, ncclRemoteError, ncclSystemError};
    let irecv_again = |c: &Conn| {
        let mut d = c.buf(false, 64, 0);
        let b = d.whole();
        c.recv.irecv(&[b], &[0], &[d.mh]).map(|_| None)
    };
    // A truncation fails both ends with ncclInvalidUsage.
    let c = connect(params());
    let mut dst = c.buf(false, 64, 0);
    let mut src = c.buf(true, 65, 1);
    let r = c.irecv(&mut [&mut dst], &[3]);
    let e = c.isend(src.whole(), src.mh, 3).unwrap_err();
    assert_eq!(e.code(), ncclInvalidUsage);
    keeps_failing(&e, || c.send.isend(src.whole(), 3, src.mh).map(|_| None));
    let e = wait_error(Duration::from_secs(5), || c.test_recv(r));
    assert_eq!(e.code(), ncclInvalidUsage);
    keeps_failing(&e, || irecv_again(&c));
    // A peer that closed: ncclRemoteError, on the waiting receive and every later call.
    let c = connect(params());
    let mut dst = c.buf(false, 64, 0);
    let mut again = c.buf(false, 8, 0);
    let r = c.irecv(&mut [&mut dst], &[0]);
    let Conn { send, recv, .. } = c;
    drop(send);
    let e = wait_error(Duration::from_secs(10), || test_recv(&recv, r));
    assert_eq!(e.code(), ncclRemoteError);
    keeps_failing(&e, || test_recv(&recv, r));
    keeps_failing(&e, || {
        recv.irecv(&[again.whole()], &[0], &[again.mh])
            .map(|_| None)
    });
    // A fatal event on the device: ncclSystemError, on every later call.
    let c = connect(params());
    let mut dst = c.buf(false, 64, 0);
    let r = c.irecv(&mut [&mut dst], &[0]);
    c.fabric.fatal_event(&c.rx_nics[0], None, "device fatal");
    let e = wait_error(Duration::from_secs(5), || c.test_recv(r));
    assert_eq!(e.code(), ncclSystemError, "{e}");
    keeps_failing(&e, || c.test_recv(r));
    keeps_failing(&e, || irecv_again(&c));
}

#[test]
fn a_path_that_answers_probes_keeps_its_slow_work_and_one_that_does_not_fails() {
    // The data QP's work waits (a lossy link retransmitting a large write for a long time)
    // while the probe QP of the same path answers: slow, not dead, for many work timeouts.
    let c = connect(watchdog_params());
    let mut dst = c.buf(false, 4096, 0);
    let mut src = c.buf(true, 4096, 31);
    let r = c.irecv(&mut [&mut dst], &[0]);
    let data_qp = c.send.qpns()[0];
    c.fabric.slow_qp(data_qp, true);
    let s = c.send_buf(&mut src, 0);
    let until = Instant::now() + Duration::from_millis(1500);
    while Instant::now() < until {
        assert_eq!(c.test_send(s).unwrap(), None, "slow work is not an error");
        assert_eq!(c.test_recv(r).unwrap(), None, "nor for the receiver");
    }
    c.fabric.slow_qp(data_qp, false);
    assert_eq!(wait(|| c.test_send(s)).unwrap(), Completion::single(4096));
    assert_eq!(wait(|| c.test_recv(r)).unwrap(), Completion::single(4096));
    assert_eq!(dst.mem.bytes(), TestMem::pattern(4096, 31));
    // The same, with the probes lost too: the path is shown dead, within the bound.
    let c = connect(watchdog_params());
    let mut dst = c.buf(false, 4096, 0);
    let mut src = c.buf(true, 4096, 32);
    c.irecv(&mut [&mut dst], &[0]);
    c.fabric.slow_qp(c.send.qpns()[0], true);
    for qpn in c.send.probe_qpns() {
        c.fabric.slow_qp(qpn, true);
    }
    let t0 = Instant::now();
    let s = c.send_buf(&mut src, 0);
    let e = wait_error(Duration::from_secs(5), || c.test_send(s));
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(300),
        "before the limit: {took:?}"
    );
    // The probe's verdict, not the work's ceiling (ten work timeouts), whatever the load on
    // the machine running the test made of the time between them.
    assert!(e.to_string().contains("liveness probe"), "{e}");
}

fn timed(threshold_ms: u64, work_timeout: Option<Duration>) -> ConnParams {
    ConnParams {
        wqe_latency: Some((Duration::from_millis(threshold_ms), true)),
        work_timeout,
        ..params()
    }
}

#[test]
fn work_slower_than_the_latency_threshold_is_counted_and_one_held_for_good_stalls_first() {
    // Held 20 ms past a threshold of 5: one slow completion, a WARN with its fields.
    let c = connect(timed(5, None));
    let mut dst = c.buf(false, 64, 0);
    let mut src = c.buf(true, 64, 41);
    let r = c.irecv(&mut [&mut dst], &[0]);
    let ((), warned) = crate::log::warnings_of(|| {
        c.fabric.hold(true);
        let s = c.send_buf(&mut src, 0);
        std::thread::sleep(Duration::from_millis(25));
        c.fabric.hold(false);
        wait(|| c.test_send(s)).unwrap();
        wait(|| c.test_recv(r)).unwrap();
    });
    assert_eq!(c.send.wqe_counts().0, 1, "one slow completion");
    let qpn = c.send.qpns()[0];
    let slow: Vec<_> = warned.iter().filter(|w| w.contains("WQE slow")).collect();
    assert_eq!(slow.len(), 1, "{warned:?}");
    for part in [
        "data RDMA write".to_string(),
        format!("on {} QP {qpn} to peer ", c.tx_nics[0].local().name),
        "completed after".to_string(),
        "NCCL_IB_WQE_LATENCY_THRESHOLD_NS 5000000".to_string(),
    ] {
        assert!(slow[0].contains(&part), "{part}: {}", slow[0]);
    }
    let took: f64 = slow[0]
        .split("completed after ")
        .nth(1)
        .and_then(|t| t.split(' ').next()?.parse().ok())
        .unwrap();
    assert!(took >= 20_000.0, "held 25 ms: {took} us");
    // Fast ones are not.
    one_message(&c, 64, 42);
    assert_eq!(c.send.wqe_counts().0, 1);
    // Held for good on a dead link: the stall is said before the watchdog fails the comm.
    let c = connect(timed(5, Some(Duration::from_millis(300))));
    let mut dst = c.buf(false, 64, 0);
    let mut src = c.buf(true, 64, 43);
    c.irecv(&mut [&mut dst], &[0]);
    c.fabric.cut(&c.tx_nics[0], Some(Cut::Silent));
    let s = c.send_buf(&mut src, 0);
    let deadline = Instant::now() + Duration::from_secs(5);
    let (e, warned) = crate::log::warnings_of(|| loop {
        match c.test_send(s) {
            Err(e) => break e,
            Ok(None) => assert!(Instant::now() < deadline, "no error"),
            Ok(Some(_)) => panic!("completed on a cut link"),
        }
    });
    assert!(e.to_string().contains("liveness probe"), "{e}");
    let stall = warned
        .iter()
        .position(|w| w.contains("WQE stall (no CQE): data RDMA write") && w.contains("QP "))
        .unwrap_or_else(|| panic!("no stall WARN: {warned:?}"));
    let failure = warned
        .iter()
        .position(|w| w.contains("liveness probe"))
        .unwrap_or(warned.len());
    assert!(
        stall < failure,
        "said before the watchdog's error: {warned:?}"
    );
    assert!(c.send.wqe_counts().1 > 0);
}
