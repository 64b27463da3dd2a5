//! Peers that die or vanish. Case 2: the peer is SIGKILLed mid-transfer (receiving,
//! sending, or while the sender waits for its receive), and a verbs completion error with
//! the peer alive. Case 3's silent host: the peer's host stops answering altogether. Each
//! ends in `ncclRemoteError` within a bounded time.

use std::{
    io::Write,
    process::Command,
    thread,
    time::{Duration, Instant},
};

use crate::common::*;
use crate::support::*;

// ---------------------------------------------------------------------------------------
// Case 2. The peer is SIGKILLed mid-transfer

/// The survivor's QP ack timeout and retry count, so a verbs survivor's retry-exceeded error
/// comes quickly: 4.096 us * 2^14 = 67 ms per try, 3 tries (rxe honours both; no effect on
/// tcp). The peer keeps the defaults: under the Soft-RoCE VM's CPU emulation a shorter
/// timeout on the side that writes the bulk data can expire on healthy traffic.
const KILL_ENV: [(&str, &str); 2] = [("NCCL_IB_TIMEOUT", "14"), ("NCCL_IB_RETRY_CNT", "2")];

const KILL_SIZES: [usize; 5] = [0, 1, 4099, 1 << 20, (3 << 20) + 5];
const HALF: usize = 1 << 20;

#[test]
fn peer_killed_mid_transfer_receiver_gets_an_error() {
    report_child(&run_child(
        test_name!(child_survivor_receives),
        &KILL_ENV,
        &[],
        false,
    ));
}

#[test]
#[ignore = "entry point of a child process"]
fn child_survivor_receives() {
    if !is_child() {
        return;
    }
    let (mut net, base) = open_warm(11);
    let mut handle = [0u8; NCCL_HANDLE];
    let listen = net.listen(0, &mut handle).unwrap();
    let mut victim = Victim::spawn(
        test_name!(child_victim_sends),
        &[("CHILD_HANDLE", &client::handle_to_hex(&handle))],
    );
    let r = poll_until("accept", || net.accept(listen).unwrap());
    net.close_listen(listen).unwrap();
    // Verified traffic first.
    recv_patterns(&net, r, &KILL_SIZES, 8);
    // A grouped receive of two messages; the peer sends the first and is killed.
    let mut a = reg(&net, r, vec![0u8; HALF]);
    let mut b = reg(&net, r, vec![0u8; HALF]);
    let bufs = [(a.buf.as_mut_ptr(), HALF), (b.buf.as_mut_ptr(), HALF)];
    let rreq = poll_until("irecv", || {
        net.irecv(r, &bufs, &[1, 2], &[a.mh, b.mh], false).unwrap()
    });
    victim.expect("PARTIAL");
    victim.kill();
    let start = Instant::now();
    let err = loop {
        match net.test(rreq, None) {
            Ok(false) => assert!(
                start.elapsed() < DEADLINE,
                "no error within {DEADLINE:?} after the peer was killed: the receive hangs"
            ),
            Ok(true) => panic!("a receive from a killed peer completed"),
            Err(e) => break e,
        }
    };
    let took = start.elapsed();
    println!(
        "reliability: time to error (survivor receives, {}): {} ms, {err:?}",
        our_transport().name(),
        took.as_millis()
    );
    assert_eq!(err, REMOTE);
    let w = warns();
    assert!(
        w.iter().any(|l| l.contains("test:") && l.contains("peer")),
        "a WARN names the failed call and the peer: {w:?}"
    );
    // Deregistering its buffers and closing the comm succeed.
    dereg(&net, r, a);
    dereg(&net, r, b);
    net.close_recv(r).unwrap();
    drop(victim);
    assert_eq!(fd_count(), base, "fds after the peer was killed");
    net.finalize().unwrap();
}

#[test]
#[ignore = "entry point of a child process"]
fn child_victim_sends() {
    if !is_child() {
        return;
    }
    let mut handle =
        client::handle_from_hex(&std::env::var("CHILD_HANDLE").unwrap()).expect("a hex handle");
    let net = open(11);
    let s = poll_until("connect", || net.connect(0, &mut handle).unwrap());
    send_patterns(&net, s, &KILL_SIZES);
    // The first message of the group only.
    let mut src = reg(&net, s, pattern(50, HALF));
    poll_until("isend", || {
        net.isend(s, src.buf.as_mut_ptr(), HALF, 1, src.mh).unwrap()
    });
    println!("VICTIM PARTIAL");
    park();
}

#[test]
fn peer_killed_mid_transfer_sender_gets_an_error() {
    report_child(&run_child(
        test_name!(child_survivor_sends),
        &KILL_ENV,
        &[],
        false,
    ));
}

#[test]
#[ignore = "entry point of a child process"]
fn child_survivor_sends() {
    if !is_child() {
        return;
    }
    let (mut net, base) = open_warm(11);
    let mut victim = Victim::spawn(test_name!(child_victim_receives), &[]);
    let mut handle = client::handle_from_hex(&victim.expect("HANDLE")).expect("a hex handle");
    let s = poll_until("connect", || net.connect(0, &mut handle).unwrap());
    send_patterns(&net, s, &KILL_SIZES);
    victim.expect("POSTED");
    // The peer posted a grouped receive of two: the first send matches its clear-to-send
    // (on verbs nothing is written until both have matched).
    let mut a = reg(&net, s, pattern(60, HALF));
    let mut b = reg(&net, s, pattern(61, HALF));
    let req1 = poll_until("isend", || {
        net.isend(s, a.buf.as_mut_ptr(), HALF, 1, a.mh).unwrap()
    });
    victim.kill();
    let start = Instant::now();
    let mut req2 = Opaque::NULL;
    let (mut done1, mut done2) = (false, false);
    let err = 'outer: loop {
        assert!(
            start.elapsed() < DEADLINE,
            "no error within {DEADLINE:?} after the peer was killed: the send hangs"
        );
        if req2.is_null() {
            match net.isend(s, b.buf.as_mut_ptr(), HALF, 2, b.mh) {
                Ok(q) => req2 = q,
                Err(e) => break e,
            }
        }
        for (req, done) in [(req1, &mut done1), (req2, &mut done2)] {
            if !req.is_null() && !*done {
                match net.test(req, None) {
                    Ok(d) => *done = d,
                    Err(e) => break 'outer e,
                }
            }
        }
        if done1 && done2 {
            // Both sends left this process before the peer's death was seen (possible on
            // tcp); the next call that needs the peer must fail.
            if let Err(e) = net.isend(s, b.buf.as_mut_ptr(), 1, 3, b.mh) {
                break e;
            }
        }
    };
    let took = start.elapsed();
    println!(
        "reliability: time to error (survivor sends, {}): {} ms, {err:?}",
        our_transport().name(),
        took.as_millis()
    );
    assert_eq!(err, REMOTE);
    let w = warns();
    assert!(
        w.iter().any(|l| l.contains("peer")),
        "a WARN names the peer: {w:?}"
    );
    dereg(&net, s, a);
    dereg(&net, s, b);
    net.close_send(s).unwrap();
    drop(victim);
    assert_eq!(fd_count(), base, "fds after the peer was killed");
    net.finalize().unwrap();
}

#[test]
#[ignore = "entry point of a child process"]
fn child_victim_receives() {
    if !is_child() {
        return;
    }
    let net = open(11);
    let mut handle = [0u8; NCCL_HANDLE];
    let listen = net.listen(0, &mut handle).unwrap();
    println!("VICTIM HANDLE {}", client::handle_to_hex(&handle));
    std::io::stdout().flush().unwrap();
    let r = poll_until("accept", || net.accept(listen).unwrap());
    net.close_listen(listen).unwrap();
    recv_patterns(&net, r, &KILL_SIZES, 8);
    if std::env::var_os("VICTIM_IDLE").is_some() {
        // Posts nothing more: the survivor's next send waits for a receive.
        println!("VICTIM IDLE");
        park();
    }
    let mut a = reg(&net, r, vec![0u8; HALF]);
    let mut b = reg(&net, r, vec![0u8; HALF]);
    let bufs = [(a.buf.as_mut_ptr(), HALF), (b.buf.as_mut_ptr(), HALF)];
    poll_until("irecv", || {
        net.irecv(r, &bufs, &[1, 2], &[a.mh, b.mh], false).unwrap()
    });
    println!("VICTIM POSTED");
    park();
}

#[test]
fn peer_killed_while_the_sender_waits_for_its_receive_is_an_error() {
    report_child(&run_child(
        test_name!(child_survivor_waits),
        &KILL_ENV,
        &[],
        false,
    ));
}

#[test]
#[ignore = "entry point of a child process"]
fn child_survivor_waits() {
    if !is_child() {
        return;
    }
    let (mut net, base) = open_warm(11);
    let mut victim = Victim::spawn(test_name!(child_victim_receives), &[("VICTIM_IDLE", "1")]);
    let mut handle = client::handle_from_hex(&victim.expect("HANDLE")).expect("a hex handle");
    let s = poll_until("connect", || net.connect(0, &mut handle).unwrap());
    send_patterns(&net, s, &KILL_SIZES);
    victim.expect("IDLE");
    victim.kill();
    // NCCL's proxy calls isend again and again while it returns no request: that loop must
    // end in an error, not spin forever waiting for a receive that cannot come.
    let mut a = reg(&net, s, pattern(70, 4096));
    let start = Instant::now();
    let err = loop {
        match net.isend(s, a.buf.as_mut_ptr(), 4096, 7, a.mh) {
            Ok(q) if q.is_null() => assert!(
                start.elapsed() < DEADLINE,
                "no error within {DEADLINE:?} after the peer was killed: isend waits forever"
            ),
            Ok(_) => panic!("a send to a killed peer was matched to a receive"),
            Err(e) => break e,
        }
    };
    let took = start.elapsed();
    println!(
        "reliability: time to error (survivor waits to send, {}): {} ms, {err:?}",
        our_transport().name(),
        took.as_millis()
    );
    assert_eq!(err, REMOTE);
    dereg(&net, s, a);
    net.close_send(s).unwrap();
    drop(victim);
    assert_eq!(fd_count(), base, "fds after the peer was killed");
    net.finalize().unwrap();
}

/// A completion error on verbs, with the peer alive (so its bootstrap socket does not
/// report it first): the receiver deregisters its buffer after posting the receive, so the
/// sender's RDMA write meets an invalid rkey.
#[test]
#[ignore = "needs an RDMA device: NCCL_ERDMA_TEST_DEVICE (run by the Soft-RoCE tier)"]
fn verbs_completion_error_is_an_error_code_with_a_warn_naming_peer_opcode_and_status() {
    require_verbs();
    report_child(&run_child(
        test_name!(child_verbs_cq_error),
        &KILL_ENV,
        &[],
        false,
    ));
}

#[test]
#[ignore = "entry point of a child process"]
fn child_verbs_cq_error() {
    if !is_child() {
        return;
    }
    let mut net = open(11);
    let (s, r) = connect_pair(&net);
    transfer(&net, s, r, 5000, 5000, 1);
    // 1 MiB allocations: page-aligned, sharing no page (and no cached MR) with anything.
    let mut dst = reg(&net, r, vec![0u8; HALF]);
    let mut src = reg(&net, s, pattern(2, HALF));
    let rreq = poll_until("irecv", || {
        net.irecv(r, &[(dst.buf.as_mut_ptr(), HALF)], &[4], &[dst.mh], false)
            .unwrap()
    });
    net.dereg_mr(r, dst.mh).unwrap();
    let start = Instant::now();
    let sreq = isend_testing(&net, rreq, || {
        net.isend(s, src.buf.as_mut_ptr(), HALF, 4, src.mh).unwrap()
    });
    let err = loop {
        match net.test(sreq, None) {
            Ok(false) => assert!(
                start.elapsed() < DEADLINE,
                "no completion error within {DEADLINE:?}"
            ),
            Ok(true) => panic!("an RDMA write to a deregistered buffer completed"),
            Err(e) => break e,
        }
    };
    println!(
        "reliability: time to error (verbs completion error, peer alive): {} ms, {err:?}",
        start.elapsed().as_millis()
    );
    assert_eq!(err, REMOTE);
    let w = warns();
    let warn = w
        .iter()
        .find(|l| l.contains("data RDMA write") && l.contains("status"))
        .unwrap_or_else(|| panic!("a WARN names the operation and the status: {w:?}"));
    assert!(
        warn.contains("peer") && warn.contains("127.0.0.1"),
        "{warn}"
    );
    println!("reliability: completion error WARN: {warn}");
    // The receive never reports success; whatever it reports, closing works.
    assert_ne!(
        net.test(rreq, None),
        Ok(true),
        "the receive into a deregistered buffer completed"
    );
    assert!(
        dst.buf.iter().all(|b| *b == 0),
        "the deregistered buffer was written"
    );
    dereg(&net, s, src);
    dst.buf.clear();
    close_pair(&mut net, s, r);
}

// ---------------------------------------------------------------------------------------
// Case 3. The peer's host stops answering

/// A peer whose host dies or drops off the network never closes its connections, so
/// nothing would tell a receiver that waits on it. Simulated by taking loopback down in a
/// private network namespace once both comms are up: packets vanish, as they do when a host
/// loses power.
#[test]
fn peer_host_that_stops_answering_fails_a_waiting_receive_within_the_peer_timeout() {
    report_child(&run_child(
        test_name!(child_peer_host_stops_answering),
        &[("NCCL_ERDMA_PEER_TIMEOUT_S", "2")],
        &[],
        true,
    ));
}

#[test]
#[ignore = "entry point of a child process (in its own network namespace)"]
fn child_peer_host_stops_answering() {
    if !is_child() {
        return;
    }
    let mut net = open(11);
    let (s, r) = connect_pair(&net);
    transfer(&net, s, r, 3000, 3000, 5);
    // The receiver waits for a message (tag 1); the sender has one the receiver never asked
    // for (tag 2), so it waits too.
    let mut dst = reg(&net, r, vec![0u8; 64]);
    let mut src = reg(&net, s, vec![7u8; 64]);
    let rreq = poll_until("irecv", || {
        net.irecv(r, &[(dst.buf.as_mut_ptr(), 64)], &[1], &[dst.mh], false)
            .unwrap()
    });
    let down = Command::new("ip")
        .args(["link", "set", "lo", "down"])
        .status()
        .expect("running ip");
    assert!(down.success(), "ip link set lo down: {down}");
    let start = Instant::now();
    let (mut recv_err, mut send_err) = (None, None);
    while recv_err.is_none() || send_err.is_none() {
        assert!(
            start.elapsed() < DEADLINE,
            "still waiting on a silent peer after {DEADLINE:?}: receive {recv_err:?}, send \
             {send_err:?}"
        );
        if recv_err.is_none() {
            match net.test(rreq, None) {
                Ok(false) => {}
                Ok(true) => panic!("a receive nobody sent completed"),
                Err(e) => recv_err = Some((e, start.elapsed())),
            }
        }
        if send_err.is_none() {
            match net.isend(s, src.buf.as_mut_ptr(), 8, 2, src.mh) {
                Ok(req) if req.is_null() => {}
                Ok(_) => panic!("a send nobody asked for was posted"),
                Err(e) => send_err = Some((e, start.elapsed())),
            }
        }
        thread::sleep(Duration::from_millis(1));
    }
    for (side, (err, took)) in [
        ("receiver", recv_err.unwrap()),
        ("sender", send_err.unwrap()),
    ] {
        println!(
            "reliability: time to error ({side}, peer host silent, NCCL_ERDMA_PEER_TIMEOUT_S=2, \
             {}): {} ms, {err:?}",
            our_transport().name(),
            took.as_millis()
        );
        assert_eq!(err, REMOTE, "{side}");
        // Keepalive: quiet for 1 s, then one unanswered probe 1 s later.
        assert!(
            took >= Duration::from_millis(1500),
            "{side} failed before the peer timeout: {took:?}"
        );
    }
    let w = warns();
    assert!(
        w.iter().any(|l| l.contains("NCCL_ERDMA_PEER_TIMEOUT_S")),
        "the WARN names the setting that bounds it: {w:?}"
    );
    close_pair(&mut net, s, r);
    dst.buf.truncate(0);
    src.buf.truncate(0);
}
