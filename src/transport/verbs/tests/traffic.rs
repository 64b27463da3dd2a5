//! Traffic on the fake fabric: every size, grouped receives, the receive window, QPs split
//! and round-robin, clear-to-send batching, sequence numbers across 2^32, entries placed in
//! part, flushes, GPU memory.

use super::*;

#[test]
fn single_messages_of_every_size_arrive_intact_with_their_sizes() {
    let c = connect(params());
    // 0, inline boundary (96), split boundaries, and a large one.
    for (i, len) in [0, 1, 8, 95, 96, 97, 128, 4095, 4096, 65_537, 1 << 20]
        .into_iter()
        .enumerate()
    {
        one_message(&c, len, i as u64 + 1);
    }
}

#[test]
fn a_send_waits_for_its_clear_to_send() {
    let c = connect(params());
    let mut src = c.buf(true, 64, 3);
    let mut dst = c.buf(false, 64, 0);
    for _ in 0..1000 {
        assert_eq!(c.send.isend(src.whole(), 5, src.mh).unwrap(), None);
    }
    let r = c.irecv(&mut [&mut dst], &[5]);
    let s = c.send_buf(&mut src, 5);
    wait(|| c.test_send(s)).unwrap();
    assert_eq!(wait(|| c.test_recv(r)).unwrap().sizes[0], 64);
    assert_eq!(dst.mem.bytes(), TestMem::pattern(64, 3));
}

#[test]
fn a_send_with_another_tag_waits() {
    let c = connect(params());
    let mut src = c.buf(true, 16, 1);
    let mut dst = c.buf(false, 16, 0);
    let r = c.irecv(&mut [&mut dst], &[1]);
    assert_eq!(c.send.isend(src.whole(), 2, src.mh).unwrap(), None);
    let s = c.send_buf(&mut src, 1);
    wait(|| c.test_send(s)).unwrap();
    wait(|| c.test_recv(r)).unwrap();
}

#[test]
fn grouped_receive_matches_tags_in_any_order_and_fills_every_size() {
    let c = connect(params());
    let lens = [100, 0, 4096, 7];
    let tags = [10, 11, 12, 11];
    let mut dsts: Vec<Buf> = lens.iter().map(|&l| c.buf(false, l + 64, 0)).collect();
    let mut refs: Vec<&mut Buf> = dsts.iter_mut().collect();
    let r = c.irecv(&mut refs, &tags);
    // Sends in another order; the two with tag 11 go to the entries in order.
    let mut srcs: Vec<Buf> = lens
        .iter()
        .enumerate()
        .map(|(i, &l)| c.buf(true, l, 40 + i as u64))
        .collect();
    let mut ids = Vec::new();
    for i in [2, 1, 3, 0] {
        let (b, k) = (srcs[i].mem.slice(0, lens[i]), srcs[i].mh);
        ids.push((i, c.isend(b, k, tags[i]).unwrap()));
    }
    for (i, id) in ids {
        assert_eq!(
            wait(|| c.test_send(id)).unwrap(),
            Completion::single(lens[i])
        );
    }
    let done = wait(|| c.test_recv(r)).unwrap();
    assert_eq!(done.n, 4);
    assert_eq!(&done.sizes[..4], &[100, 0, 4096, 7]);
    for (i, d) in dsts.iter().enumerate() {
        assert_eq!(
            &d.mem.bytes()[..lens[i]],
            &TestMem::pattern(lens[i], 40 + i as u64)[..]
        );
    }
}

#[test]
fn receives_beyond_the_window_are_null_and_slots_come_back_when_tested() {
    let c = connect(params());
    let mut dsts: Vec<Buf> = (0..SLOTS + 1).map(|_| c.buf(false, 8, 0)).collect();
    let mut ids = Vec::new();
    for d in dsts.iter_mut().take(SLOTS) {
        ids.push(c.irecv(&mut [d], &[0]));
    }
    let (k, b) = (dsts[SLOTS].mh, dsts[SLOTS].whole());
    assert_eq!(
        c.recv.irecv(&[b], &[0], &[k]).unwrap(),
        None,
        "33rd receive"
    );
    let mut src = c.buf(true, 8, 9);
    let s = c.send_buf(&mut src, 0);
    wait(|| c.test_send(s)).unwrap();
    wait(|| c.test_recv(ids[0])).unwrap();
    assert!(
        c.recv.irecv(&[b], &[0], &[k]).unwrap().is_some(),
        "slot 0 free again"
    );
}

#[test]
fn receives_tested_out_of_order_each_report_their_own_size() {
    // The first test after the data came, of the later receive, finds both completions on the
    // CQ (without the comm's lock) and hands both to the locked drain; the earlier receive
    // must then finish from its slot, not wait on a CQ that is now empty.
    let c = connect(params());
    let two = TwoLanded::new(&c, |[r0, r1]| {
        // Idle tests, many times the number between two that take the lock.
        for _ in 0..1000 {
            assert_eq!(c.test_recv(r1).unwrap(), None);
            assert_eq!(c.test_recv(r0).unwrap(), None);
        }
    });
    let [r0, r1] = two.ids;
    assert_eq!(c.test_recv(r1).unwrap(), TwoLanded::done(1));
    assert_eq!(c.test_recv(r0).unwrap(), TwoLanded::done(0));
    two.check_bytes();
}

#[test]
fn the_sender_reuses_a_slot_only_after_its_sends_are_tested() {
    let c = connect(params());
    let mut src = c.buf(true, 8, 1);
    let mut dsts: Vec<Buf> = (0..SLOTS + 1).map(|_| c.buf(false, 8, 0)).collect();
    let mut rids = Vec::new();
    let mut sids = Vec::new();
    for d in dsts.iter_mut().take(SLOTS) {
        rids.push(c.irecv(&mut [d], &[0]));
        sids.push(c.send_buf(&mut src, 0));
    }
    wait(|| c.test_recv(rids[0])).unwrap();
    rids.remove(0);
    let last = dsts.last_mut().unwrap();
    rids.push(c.irecv(&mut [last], &[0]));
    // Slot 0 holds an untested send: the 33rd send must wait for it.
    for _ in 0..1000 {
        assert_eq!(c.send.isend(src.whole(), 0, src.mh).unwrap(), None);
    }
    wait(|| c.test_send(sids[0])).unwrap();
    let s = c.send_buf(&mut src, 0);
    wait(|| c.test_send(s)).unwrap();
}

#[test]
fn messages_split_over_qps_arrive_intact() {
    let c = connect(ConnParams {
        qps_per_connection: 4,
        split_data: true,
        ..params()
    });
    for (i, len) in [1, SPLIT_ALIGN * 4 - 1, SPLIT_ALIGN * 4 + 1, 100_003]
        .into_iter()
        .enumerate()
    {
        one_message(&c, len, i as u64 + 100);
    }
    // A split grouped receive.
    let mut d1 = c.buf(false, 5000, 0);
    let mut d2 = c.buf(false, 700, 0);
    let r = c.irecv(&mut [&mut d1, &mut d2], &[1, 2]);
    let mut s1 = c.buf(true, 5000, 1);
    let mut s2 = c.buf(true, 700, 2);
    let a = c.send_buf(&mut s2, 2);
    let b = c.send_buf(&mut s1, 1);
    wait(|| c.test_send(a)).unwrap();
    wait(|| c.test_send(b)).unwrap();
    assert_eq!(&wait(|| c.test_recv(r)).unwrap().sizes[..2], &[5000, 700]);
    assert_eq!(d1.mem.bytes(), TestMem::pattern(5000, 1));
    assert_eq!(d2.mem.bytes(), TestMem::pattern(700, 2));
}

#[test]
fn messages_take_turns_over_qps_without_split() {
    let c = connect(ConnParams {
        qps_per_connection: 3,
        ..params()
    });
    assert_eq!(c.send.qpns().len(), 3);
    for i in 0..10 {
        one_message(&c, 1000 + i, i as u64);
    }
}

#[test]
fn split_setting_mismatch_uses_the_receivers() {
    // Had the sender split while the receiver posted one receive per message, writes with
    // immediate would land on QPs with no receive (receiver not ready for ever).
    for (tx_split, rx_split) in [(true, false), (false, true)] {
        let tx = ConnParams {
            qps_per_connection: 4,
            split_data: tx_split,
            ..params()
        };
        let rx = ConnParams {
            split_data: rx_split,
            ..tx
        };
        let c = connect_with(tx, rx);
        for i in 0..6 {
            one_message(&c, 10_000 + i, i as u64 + 1);
        }
    }
}

#[test]
fn clear_to_sends_are_batched_while_the_receiver_polls() {
    let c = connect(ConnParams {
        cts_batch: 8,
        ..params()
    });
    let n = 200;
    let mut dsts: Vec<Buf> = (0..4).map(|_| c.buf(false, 32, 0)).collect();
    let mut src = c.buf(true, 32, 5);
    let mut posted = std::collections::VecDeque::new();
    let mut received = 0;
    let mut sent = 0;
    // A proxy loop: keep receives posted ahead, test the oldest, send when possible.
    while received < n {
        while posted.len() < 4 && received + posted.len() < n {
            let k = (received + posted.len()) % 4;
            let d = &mut dsts[k];
            let (b, keys) = (d.whole(), d.mh);
            let Some(id) = c.recv.irecv(&[b], &[0], &[keys]).unwrap() else {
                break;
            };
            posted.push_back(id);
        }
        if sent < n {
            if let Some(s) = c.send.isend(src.whole(), 0, src.mh).unwrap() {
                wait(|| c.test_send(s)).unwrap();
                sent += 1;
            }
        }
        if let Some(&oldest) = posted.front() {
            if let Some(done) = c.test_recv(oldest).unwrap() {
                assert_eq!(done.sizes[0], 32);
                posted.pop_front();
                received += 1;
            }
        }
    }
    let (writes, entries) = c.recv.cts_counts();
    assert_eq!(entries, n as u64);
    assert!(
        writes < entries,
        "batching engaged: {writes} writes for {entries} receives"
    );
    assert_eq!(dsts[0].mem.bytes(), TestMem::pattern(32, 5));
}

#[test]
fn clear_to_sends_go_one_per_receive_at_batch_1_and_back_to_back() {
    let c = connect(params());
    for i in 0..20 {
        one_message(&c, 16, i);
    }
    assert_eq!(c.recv.cts_counts(), (20, 20));
    // With a batch, receives posted back to back (not polled in between) go out at once.
    let c = connect(ConnParams {
        cts_batch: 8,
        ..params()
    });
    let mut d: Vec<Buf> = (0..3).map(|_| c.buf(false, 16, 0)).collect();
    for b in d.iter_mut() {
        c.irecv(&mut [b], &[0]);
    }
    assert_eq!(c.recv.cts_counts(), (3, 3));
}

#[test]
fn idle_tests_between_receives_let_clear_to_sends_be_held() {
    // The proxy's pattern: post a receive, test the oldest (answered without the lock while
    // its data has not come), post the next. Those tests count as polling, so with a batch the
    // later receives are held back once the sender holds two.
    let c = connect(ConnParams {
        cts_batch: 8,
        ..params()
    });
    let mut d: Vec<Buf> = (0..4).map(|_| c.buf(false, 16, 0)).collect();
    let r0 = c.irecv(&mut [&mut d[0]], &[0]);
    c.irecv(&mut [&mut d[1]], &[0]);
    let mut held = Vec::new();
    for b in d.iter_mut().skip(2) {
        assert_eq!(c.test_recv(r0).unwrap(), None);
        held.push(c.irecv(&mut [b], &[0]));
    }
    assert_eq!(c.recv.cts_counts(), (2, 2), "the last two held back");
    // Testing a held receive sends everything held, in one write.
    assert_eq!(c.test_recv(held[1]).unwrap(), None);
    assert_eq!(c.recv.cts_counts(), (3, 4));
}

#[test]
fn sequence_numbers_cross_2_pow_32_without_a_hitch() {
    let c = connect(ConnParams {
        qps_per_connection: 2,
        ..params()
    });
    let start = (1u64 << 32) - 40;
    c.send.skip_to(start);
    c.recv.skip_to(start);
    for i in 0..100u64 {
        if i % 3 == 0 {
            let mut a = c.buf(false, 40, 0);
            let mut b = c.buf(false, 50, 0);
            let r = c.irecv(&mut [&mut a, &mut b], &[1, 2]);
            let mut sa = c.buf(true, 40, i);
            let mut sb = c.buf(true, 50, i + 1000);
            let x = c.send_buf(&mut sb, 2);
            let y = c.send_buf(&mut sa, 1);
            wait(|| c.test_send(x)).unwrap();
            wait(|| c.test_send(y)).unwrap();
            assert_eq!(&wait(|| c.test_recv(r)).unwrap().sizes[..2], &[40, 50]);
            assert_eq!(a.mem.bytes(), TestMem::pattern(40, i));
            assert_eq!(b.mem.bytes(), TestMem::pattern(50, i + 1000));
        } else {
            one_message(&c, 24, i);
        }
    }
}

#[test]
fn a_stale_entry_from_2_pow_32_receives_ago_never_matches() {
    let c = connect(params());
    let s0 = 5u64;
    c.send.skip_to(s0);
    c.recv.skip_to(s0);
    // Receive s0: a group of two in slot s0 % 32, completed.
    let mut old_a = c.buf(false, 16, 0);
    let mut old_b = c.buf(false, 16, 0);
    let r = c.irecv(&mut [&mut old_a, &mut old_b], &[1, 2]);
    let mut src_a = c.buf(true, 16, 1);
    let mut src_b = c.buf(true, 16, 2);
    let ids = [c.send_buf(&mut src_a, 1), c.send_buf(&mut src_b, 2)];
    for s in ids {
        wait(|| c.test_send(s)).unwrap();
    }
    wait(|| c.test_recv(r)).unwrap();
    // 2^32 receives later the same slot announces a new group, whose write has placed its
    // first entry but not yet the second, which still holds receive s0's.
    let later = s0 + (1 << 32);
    c.send.skip_to(later);
    c.recv.skip_to(later);
    c.fabric.hold(true);
    let mut new_a = c.buf(false, 16, 0);
    let mut new_b = c.buf(false, 16, 0);
    let r = c.irecv(&mut [&mut new_a, &mut new_b], &[1, 2]);
    c.fabric.place_partial(super::super::wire::CTS_BYTES);
    let mut src = c.buf(true, 16, 3);
    let (b, k) = (src.whole(), src.mh);
    for _ in 0..1000 {
        assert_eq!(
            c.send.isend(b, 2, k).unwrap(),
            None,
            "the second entry has not landed: it must not match its stale predecessor"
        );
    }
    c.fabric.hold(false);
    let ids = [c.isend(b, k, 2).unwrap(), c.send_buf(&mut src_a, 1)];
    for s in ids {
        wait(|| c.test_send(s)).unwrap();
    }
    assert_eq!(&wait(|| c.test_recv(r)).unwrap().sizes[..2], &[16, 16]);
    assert_eq!(
        new_b.mem.bytes(),
        TestMem::pattern(16, 3),
        "the new buffer got the data"
    );
    assert_eq!(
        old_b.mem.bytes(),
        TestMem::pattern(16, 2),
        "the old one was not touched"
    );
}

#[test]
fn a_half_placed_clear_to_send_is_not_yet() {
    let c = connect(params());
    c.fabric.hold(true);
    let mut dst = c.buf(false, 64, 0);
    let r = c.irecv(&mut [&mut dst], &[4]);
    // Everything but the sequence number (the last 8 bytes of the entry).
    c.fabric.place_partial(super::super::wire::CTS_BYTES - 8);
    let mut src = c.buf(true, 64, 8);
    for _ in 0..100 {
        assert_eq!(c.send.isend(src.whole(), 4, src.mh).unwrap(), None);
    }
    c.fabric.hold(false);
    let s = c.send_buf(&mut src, 4);
    wait(|| c.test_send(s)).unwrap();
    wait(|| c.test_recv(r)).unwrap();
    assert_eq!(dst.mem.bytes(), TestMem::pattern(64, 8));
}

#[test]
fn flushes_complete_and_reuse_their_slots_and_a_33rd_is_refused() {
    let c = connect(ConnParams {
        flush: true,
        ..params()
    });
    let mut dst = c.buf(false, 64, 0);
    let keys = [dst.mh];
    let bufs = [dst.whole()];
    let mut held = Vec::new();
    for _ in 0..SLOTS {
        held.push(
            c.recv
                .iflush(&bufs, &keys)
                .unwrap()
                .expect("a flush request"),
        );
    }
    // More requests in flight than NCCL allows is NCCL's misuse of the plugin.
    let e = c.recv.iflush(&bufs, &keys).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Internal);
    assert!(held.iter().all(|&id| id >= FLUSH_ID_BASE));
    assert_eq!(wait(|| c.test_recv(held[3])).unwrap(), Completion::EMPTY);
    let again = c.recv.iflush(&bufs, &keys).unwrap().unwrap();
    assert_eq!(again, held[3], "the freed slot is taken");
    // Nothing to flush: no request.
    let empty = [UserBuffer::EMPTY];
    assert_eq!(c.recv.iflush(&empty, &keys).unwrap(), None);
    // Without GPUDirect there is no flush QP: no request either.
    let plain = connect(params());
    let plain_keys = [plain.register(dst.mem.addr(), 64, dst.keys)];
    assert_eq!(plain.recv.iflush(&bufs, &plain_keys).unwrap(), None);
}

#[test]
fn gpu_memory_is_never_inlined() {
    let c = connect(params());
    // 8 bytes (one write) and a group of two small ones (chained writes).
    let mut src = c.buf(true, 64, 21);
    c.fabric.device_memory(src.mem.addr(), 64);
    let gpu = c.register(
        src.mem.addr(),
        64,
        MemKeys {
            host: false,
            ..src.keys
        },
    );
    let mut d1 = c.buf(false, 8, 0);
    let r = c.irecv(&mut [&mut d1], &[0]);
    let s = c.isend(src.mem.slice(0, 8), gpu, 0).unwrap();
    wait(|| c.test_send(s)).unwrap();
    wait(|| c.test_recv(r)).unwrap();
    assert_eq!(d1.mem.bytes(), TestMem::pattern(64, 21)[..8].to_vec());
    let mut d2 = c.buf(false, 16, 0);
    let mut d3 = c.buf(false, 16, 0);
    let r = c.irecv(&mut [&mut d2, &mut d3], &[1, 2]);
    let a = c.isend(src.mem.slice(0, 16), gpu, 1).unwrap();
    let b = c.isend(src.mem.slice(16, 16), gpu, 2).unwrap();
    wait(|| c.test_send(a)).unwrap();
    wait(|| c.test_send(b)).unwrap();
    wait(|| c.test_recv(r)).unwrap();
    assert_eq!(d3.mem.bytes(), TestMem::pattern(64, 21)[16..32].to_vec());
}

#[test]
fn testing_a_request_that_is_not_in_flight_is_misuse() {
    let c = connect(params());
    for e in [
        c.test_send(0).unwrap_err(),
        c.test_send(SLOTS * MAX_RECVS + 5).unwrap_err(),
        c.test_recv(3).unwrap_err(),
        c.test_recv(FLUSH_ID_BASE + 1).unwrap_err(),
    ] {
        assert_eq!(e.kind(), ErrorKind::Internal, "{e}");
        assert!(e.to_string().contains("not in flight"), "{e}");
    }
    // A request reported done once is not in flight any more.
    one_message(&c, 8, 1);
    assert!(c.test_recv(0).is_err());
}

#[test]
fn a_full_send_queue_makes_isend_wait_and_every_message_still_arrives_in_order() {
    // The shallowest send queue an 8-buffer receive's writes fit (9): each single send
    // takes one write, so with the writes held back the tenth send has to wait.
    let depth = 9;
    let c = connect(ConnParams {
        send_depth: depth,
        ..params()
    });
    let n = depth as usize + 3;
    let mut dsts: Vec<Buf> = (0..n).map(|_| c.buf(false, 300, 0)).collect();
    let rids: Vec<usize> = dsts
        .iter_mut()
        .enumerate()
        .map(|(i, d)| c.irecv(&mut [d], &[i as i32]))
        .collect();
    let mut srcs: Vec<Buf> = (0..n)
        .map(|i| c.buf(true, 200 + i, 70 + i as u64))
        .collect();
    c.fabric.hold(true);
    let mut sids = Vec::new();
    for (i, src) in srcs.iter_mut().enumerate().take(depth as usize) {
        sids.push(c.isend(src.whole(), src.mh, i as i32).unwrap());
    }
    // Full: "not now", however often asked, while nothing completes.
    let tenth = depth as usize;
    for _ in 0..100 {
        let next = &mut srcs[tenth];
        let got = c.send.isend(next.whole(), tenth as i32, next.mh).unwrap();
        assert_eq!(got, None, "a send posted into a full send queue");
    }
    c.fabric.hold(false);
    for (i, src) in srcs.iter_mut().enumerate().skip(tenth) {
        sids.push(c.isend(src.whole(), src.mh, i as i32).unwrap());
    }
    for (i, (s, r)) in sids.iter().zip(&rids).enumerate() {
        assert_eq!(
            wait(|| c.test_send(*s)).unwrap(),
            Completion::single(200 + i)
        );
        assert_eq!(
            wait(|| c.test_recv(*r)).unwrap(),
            Completion::single(200 + i)
        );
        assert_eq!(
            dsts[i].mem.bytes()[..200 + i],
            TestMem::pattern(200 + i, 70 + i as u64)[..],
            "message {i}"
        );
    }
    // An 8-buffer receive needs the whole queue: it waits for the single send before it.
    let mut one = c.buf(false, 64, 0);
    let r1 = c.irecv(&mut [&mut one], &[1]);
    let mut group: Vec<Buf> = (0..MAX_RECVS).map(|_| c.buf(false, 64, 0)).collect();
    let mut refs: Vec<&mut Buf> = group.iter_mut().collect();
    let rg = c.irecv(&mut refs, &[2; MAX_RECVS]);
    c.fabric.hold(true);
    let mut first = c.buf(true, 10, 1);
    let s1 = c.send_buf(&mut first, 1);
    let mut parts: Vec<Buf> = (0..MAX_RECVS)
        .map(|i| c.buf(true, 20 + i, 90 + i as u64))
        .collect();
    let mut part_ids = Vec::new();
    for p in parts.iter_mut().take(MAX_RECVS - 1) {
        part_ids.push(c.isend(p.whole(), p.mh, 2).unwrap());
    }
    let last = &mut parts[MAX_RECVS - 1];
    assert_eq!(
        c.send.isend(last.whole(), 2, last.mh).unwrap(),
        None,
        "the slot's writes do not fit beside the one in flight"
    );
    c.fabric.hold(false);
    part_ids.push(c.isend(last.whole(), last.mh, 2).unwrap());
    assert_eq!(wait(|| c.test_send(s1)).unwrap(), Completion::single(10));
    assert_eq!(wait(|| c.test_recv(r1)).unwrap(), Completion::single(10));
    for (i, id) in part_ids.into_iter().enumerate() {
        assert_eq!(
            wait(|| c.test_send(id)).unwrap(),
            Completion::single(20 + i)
        );
    }
    let done = wait(|| c.test_recv(rg)).unwrap();
    assert_eq!(done.n, MAX_RECVS);
    for (i, d) in group.iter().enumerate() {
        assert_eq!(done.sizes[i] as usize, 20 + i);
        assert_eq!(
            d.mem.bytes()[..20 + i],
            TestMem::pattern(20 + i, 90 + i as u64)[..]
        );
    }
}
