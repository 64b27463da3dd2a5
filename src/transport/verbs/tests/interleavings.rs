//! Interleavings of a move that a correctness read of failover found wrong (2026-12-03),
//! each staged on the fake fabric as it happens between two hosts: a later send overtaking a
//! replay, a post onto a stopped QP, the dead NIC torn down on the data path, probes taken
//! for progress, probes off without a work timeout, a peer that cannot move, a move failed
//! by a late poll, a receive completion later than the stop, a CQ too small for the stop,
//! and a peer that closes as soon as its data landed.

use super::failover::{
    connect_mobile, connect_mobile_with, isend_while, mobile, through, wait_both,
};
use super::*;
use crate::transport::Tested;

/// Receives `n` buffers of `len` bytes each in one grouped receive with tags `0..n`.
fn group(c: &Conn, n: usize, len: usize) -> (Vec<Buf>, usize) {
    let mut dsts: Vec<Buf> = (0..n).map(|_| c.buf(false, len, 0)).collect();
    let tags: Vec<i32> = (0..n as i32).collect();
    let r = {
        let mut refs: Vec<&mut Buf> = dsts.iter_mut().collect();
        c.irecv(&mut refs, &tags)
    };
    (dsts, r)
}

/// D1: a send queue filled while the path was silent leaves the replay short of room after
/// the move; a later single send must not be posted before it, or its WRITE_WITH_IMM takes
/// the older receive's re-posted WQE (that receive reported done, with the wrong size,
/// before its data landed). `groups` 8-buffer receives (the last with an empty send) and one
/// single fill the queue of `depth` work requests exactly.
fn a_later_send_waits_for_the_replays(depth: u32, groups: usize) {
    let p = ConnParams {
        send_depth: depth,
        ..mobile()
    };
    let c = connect_mobile(1, 1, p);
    through(&c, 64, 1);
    let gs: Vec<(Vec<Buf>, usize)> = (0..groups).map(|_| group(&c, 8, 64)).collect();
    let mut d2 = c.buf(false, 64, 0);
    let r2 = c.irecv(&mut [&mut d2], &[8]);
    let mut d3 = c.buf(false, 64, 0);
    let r3 = c.irecv(&mut [&mut d3], &[9]);
    c.fabric.cut(&c.tx_nics[0], Some(Cut::Silent));
    let mut srcs = Vec::new();
    let mut sends = Vec::new();
    for g in 0..groups {
        for t in 0..8 {
            let len = if g == groups - 1 && t == 7 { 0 } else { 64 };
            let mut b = c.buf(true, len, 100 + (g * 8 + t) as u64);
            sends.push(c.send_buf(&mut b, t as i32));
            srcs.push(b);
        }
    }
    let mut s2b = c.buf(true, 64, 50);
    sends.push(c.send_buf(&mut s2b, 8));
    // The queue is full: R3's send waits while both ends drive the move.
    let mut s3b = c.buf(true, 32, 60);
    let mut gdone = vec![None; groups];
    let test_groups = |gdone: &mut Vec<Option<Completion>>| {
        for (k, (_, r)) in gs.iter().enumerate() {
            if gdone[k].is_none() {
                gdone[k] = c.test_recv(*r).expect("group");
            }
        }
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let s3 = loop {
        if let Some(id) = c.send.isend(s3b.whole(), 9, s3b.mh).expect("isend") {
            break id;
        }
        test_groups(&mut gdone);
        assert!(Instant::now() < deadline, "R3's send never posted");
    };
    sends.push(s3);
    // NCCL takes R2's buffer as soon as `test` says it is done.
    let mut got2 = None;
    let mut got3 = None;
    while got2.is_none() || got3.is_none() || gdone.iter().any(Option::is_none) {
        test_groups(&mut gdone);
        if got2.is_none() {
            got2 = c.test_recv(r2).expect("R2").map(|g| (g, d2.mem.bytes()));
        }
        if got3.is_none() {
            got3 = c.test_recv(r3).expect("R3");
        }
        for &s in &sends {
            let _ = c.test_send(s);
        }
        assert!(Instant::now() < deadline, "receives not done");
    }
    let (got2, bytes2) = got2.unwrap();
    assert_eq!(got2, Completion::single(64), "R2's size");
    assert_eq!(bytes2, TestMem::pattern(64, 50), "R2's data had landed");
    assert_eq!(got3.unwrap(), Completion::single(32));
    assert_eq!(d3.mem.bytes()[..32], TestMem::pattern(32, 60)[..]);
    for (g, (dsts, _)) in gs.iter().enumerate() {
        let want = gdone[g].unwrap();
        assert_eq!(want.n, 8);
        for (t, d) in dsts.iter().enumerate() {
            let len = if g == groups - 1 && t == 7 { 0 } else { 64 };
            assert_eq!(want.sizes[t] as usize, len, "group {g} buffer {t}");
            let seed = 100 + (g * 8 + t) as u64;
            assert_eq!(d.mem.bytes()[..len], TestMem::pattern(len, seed)[..]);
        }
    }
}

#[test]
fn a_later_send_never_overtakes_a_replay_waiting_for_room() {
    // A queue of 9 (one 8-buffer slot): the group's 8 requests and R2's 1 fill it.
    a_later_send_waits_for_the_replays(9, 1);
}

#[test]
fn a_later_send_never_overtakes_a_replay_at_the_default_send_depth() {
    assert_eq!(mobile().send_depth, 63);
    // Six 8-buffer slots (9 each), one with an empty send (8) and one single: 63.
    a_later_send_waits_for_the_replays(63, 7);
}

/// D7: a move begun inside a send's `test` must hold every later `isend` (eRDMA's provider
/// refuses a post onto the QP the move stopped: the comm would fail with a system error).
#[test]
fn no_send_is_posted_onto_a_stopped_qp_during_a_move() {
    let c = connect_mobile(1, 1, mobile());
    c.fabric.reject_posts_in_error();
    through(&c, 64, 1);
    let mut d1 = c.buf(false, 64, 0);
    let mut d2 = c.buf(false, 64, 0);
    let r1 = c.irecv(&mut [&mut d1], &[1]);
    let r2 = c.irecv(&mut [&mut d2], &[2]);
    c.fabric.cut(&c.tx_nics[0], Some(Cut::Fail(RETRY_EXCEEDED)));
    let mut s1b = c.buf(true, 64, 11);
    let s1 = c.send_buf(&mut s1b, 1);
    // The failed write starts the move inside this test.
    assert_eq!(c.test_send(s1).unwrap(), None);
    // R2's clear-to-send landed before the cut: the next send finds it.
    let mut s2b = c.buf(true, 64, 12);
    let s2 = match c.send.isend(s2b.whole(), 2, s2b.mh) {
        Ok(Some(id)) => id,
        Ok(None) => isend_while(&c, &mut s2b, 2, r2),
        Err(e) => panic!("isend during the move failed the comm: {e}"),
    };
    wait_both(&c, s1, r1).unwrap();
    wait_both(&c, s2, r2).unwrap();
    assert_eq!(d1.mem.bytes(), TestMem::pattern(64, 11));
    assert_eq!(d2.mem.bytes(), TestMem::pattern(64, 12));
}

/// Sends each of `srcs` (64 bytes, tag `i`) to the posted receive `rs[i]` (into `dsts[i]`),
/// each end's calls in turn, until all are done: `dsts[i]` holds `seed + i`'s pattern.
fn all_through(c: &Conn, srcs: &mut [Buf], rs: &[usize], dsts: &[Buf], seed: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut sent = vec![None; rs.len()];
    let mut got = vec![None; rs.len()];
    while got.iter().any(Option::is_none) || sent.iter().any(Option::is_none) {
        for i in 0..rs.len() {
            if sent[i].is_none() {
                let b = &mut srcs[i];
                sent[i] = c.send.isend(b.whole(), i as i32, b.mh).expect("isend");
            }
            if got[i].is_none() {
                got[i] = c.test_recv(rs[i]).expect("the receiver failed");
            }
        }
        for s in sent.iter().flatten() {
            let _ = c.test_send(*s);
        }
        assert!(Instant::now() < deadline, "sent {sent:?} got {got:?}");
    }
    for (i, d) in dsts.iter().enumerate() {
        assert_eq!(d.mem.bytes(), TestMem::pattern(64, seed + i as u64));
    }
}

/// A connection that may move, batching clear-to-sends (up to 8), on NICs that refuse a
/// post to a QP in the error state (eRDMA), after one message.
fn batching_on_erdma() -> Conn {
    let p = ConnParams {
        cts_batch: 8,
        ..mobile()
    };
    let c = connect_mobile(1, 1, p);
    c.fabric.reject_posts_in_error();
    through(&c, 64, 1);
    c
}

/// D7 at the receiver: with clear-to-send batching, nothing is announced onto the QP a move
/// stopped.
#[test]
fn with_batching_no_clear_to_send_is_posted_onto_a_stopped_qp() {
    let c = batching_on_erdma();
    let mut dsts: Vec<Buf> = (0..6).map(|_| c.buf(false, 64, 0)).collect();
    let rs: Vec<usize> = dsts
        .iter_mut()
        .enumerate()
        .map(|(i, d)| c.irecv(&mut [d], &[i as i32]))
        .collect();
    // The receiver's NIC fails: its next write (a clear-to-send) fails, and it moves.
    c.fabric.cut(&c.rx_nics[0], Some(Cut::Fail(RETRY_EXCEEDED)));
    let mut srcs: Vec<Buf> = (0..6).map(|i| c.buf(true, 64, 70 + i)).collect();
    all_through(&c, &mut srcs, &rs, &dsts, 70);
}

/// A fault of the new rails while the sender sends again what the move left (its first
/// write there fails, and eRDMA's provider refuses the next post) moves the connection on,
/// rather than being taken for one of the rails the move left.
#[test]
fn a_fault_while_the_sender_sends_again_after_a_move_moves_it_again() {
    let c = connect_mobile(1, 2, mobile());
    c.fabric.reject_posts_in_error();
    through(&c, 64, 1);
    let mut dsts = [c.buf(false, 4096, 0), c.buf(false, 4096, 0)];
    let mut srcs = [c.buf(true, 4096, 90), c.buf(true, 4096, 91)];
    let [d0, d1] = &mut dsts;
    let rs = [c.irecv(&mut [d0], &[0]), c.irecv(&mut [d1], &[1])];
    c.fabric.cut(&c.tx_nics[0], Some(Cut::Silent));
    let ss: Vec<usize> = (0..2)
        .map(|i| isend_while(&c, &mut srcs[i], i as i32, rs[i]))
        .collect();
    // Both sends wait on the silent path until the sender moves; the first write on the
    // new NIC's data QP fails.
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.send.epoch() == 0 {
        assert_eq!(c.test_send(ss[0]).unwrap(), None);
        assert!(Instant::now() < deadline, "the sender never moved");
    }
    for q in c.send.offered_qpns() {
        c.fabric.fail_next(q, RETRY_EXCEEDED);
    }
    for i in 0..2 {
        let (sent, received) = wait_both(&c, ss[i], rs[i]).unwrap();
        assert_eq!(
            (sent, received),
            (Completion::single(4096), Completion::single(4096))
        );
        assert_eq!(dsts[i].mem.bytes(), TestMem::pattern(4096, 90 + i as u64));
    }
    assert_eq!(c.send.rail_nics(), ["tx2"]);
    through(&c, 64, 2);
}

/// A receiver whose clear-to-send is held back (batching) when it stops its QPs for a move
/// must not post it onto them when that receive is tested (eRDMA's provider refuses it: the
/// comm would fail): the answer announces it.
#[test]
fn with_batching_a_clear_to_send_held_when_the_receiver_moves_goes_with_its_answer() {
    let c = batching_on_erdma();
    let mut dsts: Vec<Buf> = (0..3).map(|_| c.buf(false, 64, 0)).collect();
    let mut srcs: Vec<Buf> = (0..3).map(|i| c.buf(true, 64, 80 + i)).collect();
    let [d0, d1, d2] = &mut dsts[..] else {
        unreachable!()
    };
    // Two announced at once (the sender holds fewer than two), then one held back: the
    // caller tests its receives, and the sender holds two.
    let r0 = c.irecv(&mut [d0], &[0]);
    let r1 = c.irecv(&mut [d1], &[1]);
    assert_eq!(c.test_recv(r0).unwrap(), None);
    let r2 = c.irecv(&mut [d2], &[2]);
    // Announced: the first message's receive, r0's and r1's; r2's is held back.
    assert_eq!(c.recv.cts_counts().1, 3);
    // The receiver's NIC fails: its probe finds it, and it stops its QPs and says `Down`.
    c.fabric.cut(&c.rx_nics[0], Some(Cut::Fail(RETRY_EXCEEDED)));
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.recv.epoch() == 0 {
        assert_eq!(c.test_recv(r0).unwrap(), None);
        assert!(Instant::now() < deadline, "the receiver never moved");
    }
    // The held receive is tested before the sender has heard of the move.
    assert_eq!(c.test_recv(r2).unwrap(), None);
    all_through(&c, &mut srcs, &[r0, r1, r2], &dsts, 80);
}

/// D3: the dead NIC's QPs, CQs and registrations may take seconds to destroy (Soft-RoCE waits
/// for a QP's packets on a link gone down). Here their destroys wait for as long as the
/// transfer through the move takes: each end, driven by a thread of its own as on two hosts,
/// must finish it (within 10 s) while they wait. A call that destroyed on the data path would
/// wait with them (up to the fake's 30 s), and the transfer would miss its deadline.
fn move_while_teardown_waits(dying: &Arc<FakeNic>, c: &Conn) {
    c.fabric.hold_destroys(dying, true);
    c.fabric.cut(dying, Some(Cut::Fail(RETRY_EXCEEDED)));
    let deadline = Instant::now() + Duration::from_secs(10);
    std::thread::scope(|scope| {
        let receiver = scope.spawn(|| {
            let mut dst = c.buf(false, 64, 0);
            let r = c.irecv(&mut [&mut dst], &[3]);
            while c.test_recv(r).expect("receive").is_none() {
                assert!(
                    Instant::now() < deadline,
                    "receive not done while destroys wait"
                );
            }
            assert_eq!(dst.mem.bytes(), TestMem::pattern(64, 2));
        });
        let mut src = c.buf(true, 64, 2);
        let s = loop {
            if let Some(s) = c.send.isend(src.whole(), 3, src.mh).expect("isend") {
                break s;
            }
            assert!(
                Instant::now() < deadline,
                "isend not posted while destroys wait"
            );
        };
        while c.test_send(s).expect("send").is_none() {
            assert!(
                Instant::now() < deadline,
                "send not done while destroys wait"
            );
        }
        receiver.join().expect("receiver thread");
    });
    c.fabric.hold_destroys(dying, false);
}

#[test]
fn the_sender_never_waits_for_the_dead_nic_teardown() {
    let c = connect_mobile(1, 1, mobile());
    through(&c, 64, 1);
    move_while_teardown_waits(&c.tx_nics[0], &c);
    through(&c, 64, 4);
}

#[test]
fn the_receiver_answers_before_the_dead_nic_is_torn_down() {
    let c = connect_mobile(1, 1, mobile());
    through(&c, 64, 1);
    move_while_teardown_waits(&c.rx_nics[0], &c);
    through(&c, 64, 4);
}

/// D2: data stuck on a QP whose path still answers probes (a QP that stopped retransmitting)
/// is said slow and then fails within the ceiling: the probes' own completions are no
/// progress of the data.
#[test]
fn stuck_data_fails_within_the_ceiling_although_the_probes_answer() {
    let p = ConnParams {
        work_timeout: Some(Duration::from_millis(100)),
        ..params()
    };
    let c = connect(p);
    let mut dst = c.buf(false, 4096, 0);
    let mut src = c.buf(true, 4096, 31);
    let r = c.irecv(&mut [&mut dst], &[0]);
    c.fabric.slow_qp(c.send.qpns()[0], true);
    let s = c.send_buf(&mut src, 0);
    let bound = Duration::from_millis(100) * crate::transport::verbs::cq::SLOW_CEILING;
    let t0 = Instant::now();
    let (outcome, warned) = crate::log::warnings_of(|| loop {
        match c.test_send(s) {
            Err(e) => break Some(e),
            Ok(Some(_)) => panic!("completed on a stuck QP"),
            Ok(None) => {}
        }
        let _ = c.test_recv(r);
        if t0.elapsed() > 3 * bound {
            break None;
        }
    });
    let took = t0.elapsed();
    let e = outcome.unwrap_or_else(|| panic!("still pending after {took:?} (bound {bound:?})"));
    assert_eq!(e.kind(), ErrorKind::Remote, "{e}");
    assert!(
        warned.iter().any(|w| w.contains("not dead")),
        "said slow first: {warned:?}"
    );
    assert!(took >= bound, "failed after {took:?}, before the ceiling");
}

/// D6: without a work timeout (`NCCL_ERDMA_WORK_TIMEOUT_S=0`) failover still probes, so a
/// silent cut is found and moved off.
#[test]
fn failover_probes_without_a_work_timeout() {
    let p = ConnParams {
        work_timeout: None,
        ..mobile()
    };
    let c = connect_mobile(1, 1, p);
    through(&c, 64, 1);
    let mut dst = c.buf(false, 4096, 0);
    let mut src = c.buf(true, 4096, 2);
    let r = c.irecv(&mut [&mut dst], &[3]);
    c.fabric.cut(&c.tx_nics[0], Some(Cut::Silent));
    let s = c.send_buf(&mut src, 3);
    let t0 = Instant::now();
    let (mut sent, mut got) = (None, None);
    while (sent.is_none() || got.is_none()) && t0.elapsed() < Duration::from_secs(3) {
        if sent.is_none() {
            sent = c.test_send(s).unwrap();
        }
        if got.is_none() {
            got = c.test_recv(r).unwrap();
        }
    }
    assert!(
        sent.is_some() && got.is_some(),
        "nothing moved in {:?} (failover after 100 ms): send {sent:?}, receive {got:?}",
        t0.elapsed()
    );
    assert_eq!(dst.mem.bytes(), TestMem::pattern(4096, 2));
}

/// D5: an end whose peer cannot move (failover off there) fails at once with the cause, as
/// without failover, instead of stopping its QPs and waiting out the move's bound.
#[test]
fn a_peer_that_cannot_move_fails_the_other_end_at_once() {
    let off = ConnParams {
        failover: None,
        ..mobile()
    };
    let c = connect_mobile_with(1, 1, (mobile(), off));
    through(&c, 64, 1);
    let mut dst = c.buf(false, 64, 0);
    let mut src = c.buf(true, 64, 2);
    let r = c.irecv(&mut [&mut dst], &[1]);
    c.fabric.cut(&c.tx_nics[0], Some(Cut::Fail(RETRY_EXCEEDED)));
    let s = c.send_buf(&mut src, 1);
    let t0 = Instant::now();
    let e = loop {
        if let Err(e) = c.test_send(s) {
            break e;
        }
        let _ = c.test_recv(r);
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the sender never failed"
        );
    };
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(1), "failed after {took:?}: {e}");
    assert_eq!(e.kind(), ErrorKind::Remote);
    let msg = e.to_string();
    assert!(msg.contains("retry"), "the cause is named: {msg}");
    assert!(
        msg.contains("the peer cannot move"),
        "and why it stays: {msg}"
    );
}

/// D4: an end that polls late (its thread busy elsewhere past the move's bound) finds the
/// peer's last message of the move in its socket: the move completes.
#[test]
fn a_move_the_peer_finished_is_not_failed_by_a_late_poll() {
    let c = connect_mobile(1, 1, mobile());
    through(&c, 64, 1);
    let mut dst = c.buf(false, 64, 0);
    let mut src = c.buf(true, 64, 2);
    let r = c.irecv(&mut [&mut dst], &[3]);
    c.fabric.cut(&c.tx_nics[0], Some(Cut::Fail(RETRY_EXCEEDED)));
    let s = c.send_buf(&mut src, 3);
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.test_send(s).unwrap().is_none() {
        assert!(c.test_recv(r).unwrap().is_none());
        assert!(Instant::now() < deadline, "the send never completed");
    }
    // Past the 5 s bound of the move.
    std::thread::sleep(Duration::from_millis(5500));
    assert_eq!(wait(|| c.test_recv(r)).unwrap(), Completion::single(64));
    assert_eq!(dst.mem.bytes(), TestMem::pattern(64, 2));
}

/// S1: a receive whose data landed (the sender saw its acknowledgement and NCCL reused the
/// send buffer) but whose completion the receiver had not seen when the move stopped its QPs
/// is reported done once, with its size and its data, never written again from the reused
/// buffer.
#[test]
fn a_receive_completion_later_than_the_stop_is_reported_once_with_its_data() {
    let c = connect_mobile(1, 1, mobile());
    through(&c, 64, 1);
    c.fabric.delay_receive_completions(&c.rx_nics[0], true);
    let mut d1 = c.buf(false, 256, 0);
    let r1 = c.irecv(&mut [&mut d1], &[1]);
    let mut s1b = c.buf(true, 256, 41);
    let s1 = c.send_buf(&mut s1b, 1);
    assert_eq!(wait(|| c.test_send(s1)).unwrap(), Completion::single(256));
    // NCCL reuses the send buffer at once.
    s1b.whole().bytes_mut(0, 256).fill(0xee);
    assert_eq!(c.test_recv(r1).unwrap(), None, "its completion is late");
    // Then the path fails under the next send, and the connection moves.
    let mut d2 = c.buf(false, 64, 0);
    let r2 = c.irecv(&mut [&mut d2], &[2]);
    c.fabric.cut(&c.tx_nics[0], Some(Cut::Fail(RETRY_EXCEEDED)));
    let mut s2b = c.buf(true, 64, 42);
    let s2 = isend_while(&c, &mut s2b, 2, r1);
    let got1 = wait_both(&c, s2, r1).map(|(_, g)| g);
    assert_eq!(got1.unwrap(), Completion::single(256));
    assert_eq!(d1.mem.bytes(), TestMem::pattern(256, 41), "written once");
    assert_eq!(wait(|| c.test_recv(r2)).unwrap(), Completion::single(64));
    assert_eq!(d2.mem.bytes(), TestMem::pattern(64, 42));
}

/// S3: stopping a receiver flushes every request its QPs hold (receives, unsignaled
/// clear-to-sends, GPUDirect flushes, probes): its CQ has room for all of them.
#[test]
fn stopping_a_receiver_with_every_queue_full_overruns_no_completion_queue() {
    let p = ConnParams {
        flush: true,
        ..mobile()
    };
    let c = connect_mobile(1, 1, p);
    through(&c, 64, 1);
    // Nothing the receiver posts runs: 32 receives, their clear-to-sends and 32 flushes wait.
    c.fabric.hold(true);
    let mut dsts: Vec<Buf> = (0..SLOTS).map(|_| c.buf(false, 64, 0)).collect();
    let rs: Vec<usize> = dsts
        .iter_mut()
        .enumerate()
        .map(|(i, d)| c.irecv(&mut [d], &[i as i32]))
        .collect();
    let flushes: Vec<usize> = dsts
        .iter_mut()
        .map(|d| {
            c.recv
                .iflush(&[d.whole()], &[d.mh])
                .unwrap()
                .expect("a flush")
        })
        .collect();
    c.fabric
        .fatal_event(&c.rx_nics[0], None, "port error (link down)");
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(300) {
        let _ = c.test_recv(rs[0]).expect("the receiver failed");
        let _ = c.send.isend(dsts[0].whole(), 99, dsts[0].mh);
    }
    assert!(!c.fabric.overrun(), "a completion queue was overrun");
    c.fabric.hold(false);
    let mut srcs: Vec<Buf> = (0..SLOTS)
        .map(|i| c.buf(true, 64, 200 + i as u64))
        .collect();
    let mut sent = vec![None; SLOTS];
    let mut got = vec![None; SLOTS];
    let deadline = Instant::now() + Duration::from_secs(20);
    while got.iter().any(Option::is_none) {
        for i in 0..SLOTS {
            if sent[i].is_none() {
                let b = &mut srcs[i];
                sent[i] = c.send.isend(b.whole(), i as i32, b.mh).expect("isend");
            }
            if got[i].is_none() {
                got[i] = c.test_recv(rs[i]).expect("receive");
            }
            if let Some(s) = sent[i] {
                let _ = c.test_send(s);
            }
        }
        assert!(Instant::now() < deadline, "got {got:?}");
    }
    for f in flushes {
        assert_eq!(wait(|| c.test_recv(f)).unwrap(), Completion::EMPTY);
    }
    for (i, d) in dsts.iter().enumerate() {
        assert_eq!(d.mem.bytes(), TestMem::pattern(64, 200 + i as u64));
    }
    assert!(!c.fabric.overrun(), "a completion queue was overrun");
}

/// A send whose data landed completes even when the receiver closes its comm at once (NCCL's
/// ranks destroy their comms at different moments), though its acknowledgement never came.
fn a_landed_send_completes_when_the_receiver_closes(moved: bool) {
    let p = ConnParams {
        work_timeout: Some(Duration::from_secs(5)),
        ..params()
    };
    let c = connect_mobile(1, 1, if moved { mobile() } else { p });
    through(&c, 64, 1);
    if moved {
        c.fabric.cut(&c.tx_nics[0], Some(Cut::Fail(RETRY_EXCEEDED)));
        through(&c, 64, 2);
    }
    let nic = if moved { &c.tx_nics[1] } else { &c.tx_nics[0] };
    c.fabric.lose_acks(nic);
    let mut dst = c.buf(false, 4096, 0);
    let mut src = c.buf(true, 4096, 7);
    let r = c.irecv(&mut [&mut dst], &[5]);
    let s = c.send_buf(&mut src, 5);
    assert_eq!(wait(|| c.test_recv(r)).unwrap(), Completion::single(4096));
    assert_eq!(dst.mem.bytes(), TestMem::pattern(4096, 7));
    // The receiver is done and closes its comm; the sender tests its send.
    let Conn { send, recv, .. } = c;
    drop(recv);
    let t0 = Instant::now();
    loop {
        match send.test(s) {
            Tested::Done(n) => {
                assert_eq!(n, 4096);
                break;
            }
            Tested::Pending => {}
            Tested::Failed(e) => panic!("the landed send failed: {e}"),
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the send never completed"
        );
    }
}

#[test]
fn a_landed_send_completes_when_the_receiver_closes_at_once() {
    a_landed_send_completes_when_the_receiver_closes(false);
}

#[test]
fn a_landed_send_completes_when_the_receiver_closes_at_once_after_a_move() {
    a_landed_send_completes_when_the_receiver_closes(true);
}

#[test]
fn a_landed_receive_completes_when_the_sender_offers_a_move_and_closes_at_once() {
    // The sender's last send landed and was acknowledged; the sender then finds its path
    // dead and offers a move, and closes its comm, its sends done, as NCCL's rank does. The
    // receiver, whose completion is in its CQ, reads the offer in the same look and brings
    // its QPs up towards the offered ones, gone with the sender: a real NIC cannot tell (it
    // asks nothing of the peer), and neither may the receiver take it for its own NIC lost.
    // The receive that landed completes.
    let c = connect_mobile(1, 1, mobile());
    through(&c, 64, 1);
    let mut dst = c.buf(false, 4096, 0);
    let mut src = c.buf(true, 4096, 7);
    let r = c.irecv(&mut [&mut dst], &[5]);
    let s = c.send_buf(&mut src, 5);
    assert_eq!(wait(|| c.test_send(s)).unwrap(), Completion::single(4096));
    c.fabric.cut(&c.tx_nics[0], Some(Cut::Fail(RETRY_EXCEEDED)));
    let deadline = Instant::now() + Duration::from_secs(5);
    while c.send.offered_qpns().is_empty() {
        c.send.step_setup().expect("the sender's look");
        assert!(Instant::now() < deadline, "the sender offered no move");
    }
    let Conn { send, recv, .. } = c;
    drop(send);
    // NCCL's proxy polls; the receive's completion and the offer are taken in one call.
    for _ in 0..1000 {
        recv.poll_once().expect("the receiver's call");
    }
    let received = wait(|| test_recv(&recv, r)).expect("the landed receive");
    assert_eq!(received, Completion::single(4096));
    assert_eq!(dst.mem.bytes(), TestMem::pattern(4096, 7));
}
