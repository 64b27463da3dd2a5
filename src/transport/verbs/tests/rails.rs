//! Connections over several rails on the fake fabric: large receives striped over every
//! rail, small ones taking turns, grouped receives, a send too large for a striped receive,
//! ends with different rail counts, flushes on every rail, and a rail that fails while the
//! others work.

use super::*;
use crate::transport::verbs::wire::STRIPE_MIN;

fn two_rails() -> ConnParams {
    ConnParams {
        qps_per_connection: 2,
        ..params()
    }
}

/// Sends `count` messages of `len` into receives of `posted` bytes, checking every byte.
fn stream(c: &Conn, count: usize, len: usize, posted: usize) {
    for i in 0..count {
        let mut dst = c.buf(false, posted, 0);
        let mut src = c.buf(true, len, 1000 + i as u64);
        let r = c.irecv(&mut [&mut dst], &[1]);
        let s = c.send_buf(&mut src, 1);
        assert_eq!(wait(|| c.test_send(s)).unwrap(), Completion::single(len));
        assert_eq!(wait(|| c.test_recv(r)).unwrap(), Completion::single(len));
        assert_eq!(
            &dst.mem.bytes()[..len],
            &TestMem::pattern(len, 1000 + i as u64)[..]
        );
    }
}

/// Each rail's share of the bytes, in percent.
fn shares(stats: &[crate::transport::verbs::rail::RailStats]) -> Vec<u64> {
    let total: u64 = stats.iter().map(|s| s.bytes).sum();
    stats.iter().map(|s| s.bytes * 100 / total.max(1)).collect()
}

#[test]
fn large_messages_are_striped_over_both_rails_evenly() {
    let c = connect_rails(2, 2, two_rails(), two_rails());
    stream(&c, 20, 256 << 10, 256 << 10);
    for (side, stats) in [
        ("sender", c.send.rail_stats()),
        ("receiver", c.recv.rail_stats()),
    ] {
        let pct = shares(&stats);
        assert!(
            pct.iter().all(|p| (40..=60).contains(p)),
            "{side}: {pct:?} of {stats:?}"
        );
        assert_eq!(
            stats.iter().map(|s| s.bytes).sum::<u64>(),
            20 * (256 << 10),
            "{side}"
        );
    }
    let summary = c.recv.summary();
    assert!(
        summary.contains("rx0: ") && summary.contains("rx1: "),
        "{summary}"
    );
}

#[test]
fn small_messages_take_turns_over_the_rails() {
    let c = connect_rails(2, 2, two_rails(), two_rails());
    stream(&c, 16, 100, 4096);
    let stats = c.send.rail_stats();
    assert_eq!(
        stats.iter().map(|s| s.messages).collect::<Vec<_>>(),
        [8, 8],
        "{stats:?}"
    );
    assert_eq!(shares(&c.recv.rail_stats()), [50, 50]);
}

#[test]
fn a_receive_whose_data_comes_on_the_second_rail_is_found_by_its_tests() {
    // Receive 0 goes over rail 0, receive 1 over rail 1. Tests of receive 1 first find
    // receive 0's completion on rail 0 (drained, and kept for receive 0), then its own on
    // rail 1; receive 0 then finishes from its slot.
    let c = connect_rails(2, 2, two_rails(), two_rails());
    let two = TwoLanded::new(&c, |[_, r1]| {
        for _ in 0..1000 {
            assert_eq!(c.test_recv(r1).unwrap(), None);
        }
    });
    let [r0, r1] = two.ids;
    // One test per rail with completions: the first drains rail 0's, the second finds rail 1's.
    let done = (0..2).find_map(|_| c.test_recv(r1).unwrap());
    assert_eq!(done, TwoLanded::done(1));
    assert_eq!(c.test_recv(r0).unwrap(), TwoLanded::done(0));
    two.check_bytes();
    let per_rail: Vec<u64> = c.recv.rail_stats().iter().map(|s| s.messages).collect();
    assert_eq!(per_rail, [1, 1]);
}

#[test]
fn a_small_send_into_a_large_receive_rotates_its_rail() {
    // Striped (the receive is large) but all bytes fit the first piece: it lands on each
    // rail in turn.
    let c = connect_rails(2, 2, two_rails(), two_rails());
    stream(&c, 10, 64, STRIPE_MIN);
    let stats = c.send.rail_stats();
    assert_eq!(
        stats.iter().map(|s| s.messages).collect::<Vec<_>>(),
        [5, 5],
        "{stats:?}"
    );
}

#[test]
fn grouped_receives_over_two_rails_split_and_striped() {
    for split in [false, true] {
        let p = ConnParams {
            split_data: split,
            ..two_rails()
        };
        let c = connect_rails(2, 2, p, p);
        for round in 0..6u64 {
            let lens = [STRIPE_MIN + 7, 300, 70_000];
            let mut dsts: Vec<Buf> = lens.iter().map(|&l| c.buf(false, l + 1, 0)).collect();
            let mut refs: Vec<&mut Buf> = dsts.iter_mut().collect();
            let r = c.irecv(&mut refs, &[1, 2, 3]);
            let mut srcs: Vec<Buf> = lens
                .iter()
                .enumerate()
                .map(|(i, &l)| c.buf(true, l, round * 10 + i as u64))
                .collect();
            let ids: Vec<usize> = [2, 0, 1]
                .iter()
                .map(|&i| {
                    let (b, k) = (srcs[i].whole(), srcs[i].mh);
                    c.isend(b, k, i as i32 + 1).unwrap()
                })
                .collect();
            for id in ids {
                wait(|| c.test_send(id)).unwrap();
            }
            assert_eq!(
                &wait(|| c.test_recv(r)).unwrap().sizes[..3],
                &[lens[0] as u32, 300, 70_000]
            );
            for (i, d) in dsts.iter().enumerate() {
                let want = TestMem::pattern(lens[i], round * 10 + i as u64);
                assert_eq!(
                    &d.mem.bytes()[..lens[i]],
                    &want[..],
                    "split {split} round {round} entry {i}"
                );
            }
        }
        let pct = shares(&c.recv.rail_stats());
        assert!(pct.iter().all(|p| *p > 0), "split {split}: {pct:?}");
    }
}

#[test]
fn ends_with_different_rail_counts_pair_every_qp() {
    for (tx, rx) in [(2, 1), (1, 2), (3, 2)] {
        let c = connect_rails(tx, rx, two_rails(), two_rails());
        stream(&c, 6, 100_000, 100_000);
        stream(&c, 6, 10, 100);
        let used = c.recv.rail_stats().iter().filter(|s| s.bytes > 0).count();
        assert_eq!(
            used,
            rx.min(tx * 2),
            "{tx} -> {rx} rails: receiver rails used"
        );
    }
}

#[test]
fn flushes_read_on_every_rail() {
    let p = ConnParams {
        flush: true,
        ..two_rails()
    };
    let c = connect_rails(2, 2, p, p);
    let mut dst = c.buf(false, 64, 0);
    let (b, k) = (dst.whole(), dst.mh);
    let id = c.recv.iflush(&[b], &[k]).unwrap().expect("a flush");
    assert_eq!(wait(|| c.test_recv(id)).unwrap(), Completion::EMPTY);
    // A flush whose read on one rail fails is an error naming that rail.
    c.fabric.cut(&c.rx_nics[1], Some(Cut::Fail(RETRY_EXCEEDED)));
    let id = c.recv.iflush(&[b], &[k]).unwrap().expect("a flush");
    let e = wait_error(Duration::from_secs(5), || c.test_recv(id));
    assert!(
        e.to_string().contains("flush RDMA read") && e.to_string().contains("on rx1"),
        "{e}"
    );
}

#[test]
fn a_rail_that_fails_fails_the_connection_naming_it() {
    let c = connect_rails(2, 2, two_rails(), two_rails());
    stream(&c, 2, 100_000, 100_000);
    c.fabric.cut(&c.tx_nics[1], Some(Cut::Fail(RETRY_EXCEEDED)));
    let mut dst = c.buf(false, 100_000, 0);
    let mut src = c.buf(true, 100_000, 5);
    c.irecv(&mut [&mut dst], &[1]);
    let s = c.send_buf(&mut src, 1);
    let e = wait_error(Duration::from_secs(5), || c.test_send(s));
    let msg = e.to_string();
    assert!(
        msg.contains("on tx1 failed") && msg.contains("retry exceeded"),
        "{msg}"
    );
    let summary = c.send.summary();
    assert!(
        summary.contains("tx1: ") && summary.contains(", 1 errors"),
        "{summary}"
    );
}

#[test]
fn a_rail_that_never_answers_is_found_by_its_own_watchdog() {
    // Rail 0 keeps completing work; rail 1's posted work never completes. Its watchdog
    // fires (the other rail's completions do not hide it) and names it.
    let p = ConnParams {
        work_timeout: Some(Duration::from_millis(300)),
        ..two_rails()
    };
    let c = connect_rails(2, 2, p, p);
    c.fabric.cut(&c.tx_nics[1], Some(Cut::Silent));
    let t0 = Instant::now();
    // Small messages take turns: the first goes on rail 0 and completes, the second on
    // rail 1, where it stays.
    let mut bufs = Vec::new();
    let mut sends = Vec::new();
    for i in 0..2u64 {
        let mut dst = c.buf(false, 100, 0);
        let mut src = c.buf(true, 100, i);
        c.irecv(&mut [&mut dst], &[1]);
        sends.push(c.send_buf(&mut src, 1));
        bufs.push((dst, src));
    }
    wait(|| c.test_send(sends[0])).unwrap();
    let e = wait_error(Duration::from_secs(10), || c.test_send(sends[1]));
    assert!(t0.elapsed() >= Duration::from_millis(300));
    let msg = e.to_string();
    assert!(
        msg.contains("on tx1 (to its rx1) has not completed"),
        "names the dead path: {msg}"
    );
}

#[test]
fn a_send_larger_than_its_striped_receive_fails_both_sides_and_sends_nothing() {
    // A receive large enough to be striped, and a send one byte too large: the sender posts
    // no piece on either rail (the receiver's buffer stays untouched) and both ends fail.
    let c = connect_rails(2, 2, two_rails(), two_rails());
    let posted = 4 * STRIPE_MIN;
    stream(&c, 2, posted, posted);
    let mut dst = c.buf(false, posted, 0);
    let mut big = c.buf(true, posted + 1, 9);
    let (before, untouched) = (c.send.rail_stats(), dst.mem.bytes());
    let r = c.irecv(&mut [&mut dst], &[1]);
    let e = c.isend(big.whole(), big.mh, 1).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{e}");
    let e = wait_error(Duration::from_secs(5), || c.test_recv(r));
    assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{e}");
    assert_eq!(dst.mem.bytes(), untouched, "no data written");
    let after = c.send.rail_stats();
    let sent =
        |s: &[crate::transport::verbs::rail::RailStats]| -> u64 { s.iter().map(|r| r.bytes).sum() };
    assert_eq!(sent(&after), sent(&before), "no bytes counted on any rail");
}

#[test]
fn a_dead_path_is_found_by_both_ends_whatever_their_rail_counts() {
    // (sender rails, receiver rails, QPs per sender rail, the NIC cut): each time one end's
    // rail also meets a live rail of the peer, so only probing every path finds the dead one.
    for (tx, rx, qps, cut_sender_rail) in [(2, 1, 1, 1), (1, 2, 2, 99), (3, 2, 1, 2)] {
        let p = ConnParams {
            qps_per_connection: qps,
            work_timeout: Some(Duration::from_millis(300)),
            ..params()
        };
        let c = connect_rails(tx, rx, p, p);
        let cut = if cut_sender_rail < tx {
            &c.tx_nics[cut_sender_rail]
        } else {
            &c.rx_nics[1]
        };
        c.fabric.cut(cut, Some(Cut::Silent));
        // The receiver waits for a receive; the sender waits for a clear-to-send of a tag no
        // receive has.
        let mut dst = c.buf(false, 64, 0);
        let mut src = c.buf(true, 64, 1);
        let r = c.irecv(&mut [&mut dst], &[1]);
        let t0 = Instant::now();
        let (mut rx_err, mut tx_err) = (None, None);
        // Each end finds it from its slow checks, which come with its calls: a loaded machine
        // makes fewer calls a second, so the bound is generous (it passes in well under 1 s).
        while (rx_err.is_none() || tx_err.is_none()) && t0.elapsed() < Duration::from_secs(30) {
            if rx_err.is_none() {
                rx_err = c.test_recv(r).err();
            }
            if tx_err.is_none() {
                tx_err = c.send.isend(src.whole(), 2, src.mh).err();
            }
        }
        let what = format!("{tx} -> {rx} rails, {} cut", cut.local().name);
        let (rx_err, tx_err) = (rx_err.expect(&what), tx_err.expect(&what));
        assert!(t0.elapsed() >= Duration::from_millis(300), "{what}");
        for e in [rx_err, tx_err] {
            assert_eq!(e.kind(), ErrorKind::Remote, "{what}: {e}");
            assert!(e.to_string().contains("has not completed"), "{what}: {e}");
        }
    }
}
