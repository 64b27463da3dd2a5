//! Failover on the fake fabric: a connection whose NIC is cut moves to a spare (or a fused
//! device's other NIC) and every request completes once, with its bytes and size; where no
//! NIC is left, both ends fail within the bound. Each test names the interleaving it stages.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::transport::verbs::cq::IDLE_LOOK_EVERY;
use crate::transport::verbs::wire::Step;

use super::*;

/// Failover on, a path suspected after 100 ms without an answer.
pub(super) fn mobile() -> ConnParams {
    ConnParams {
        failover: Some(Duration::from_millis(100)),
        work_timeout: Some(Duration::from_secs(5)),
        ..params()
    }
}

/// A connection over `rails` NICs at each end (`tx0`.., `rx0`..), which may move to `spares`
/// more at each end; buffers (`Conn::buf`) are registered on all of them, as `regMr` does.
pub(super) fn connect_mobile(rails: usize, spares: usize, p: ConnParams) -> Conn {
    connect_mobile_with(rails, spares, (p, p))
}

/// [`connect_mobile`] with the sender's parameters and the receiver's.
pub(super) fn connect_mobile_with(
    rails: usize,
    spares: usize,
    params: (ConnParams, ConnParams),
) -> Conn {
    let (fabric, nics) = mobile_nics(rails + spares);
    Conn::join(fabric, nics, (rails, rails), params).unwrap()
}

/// The sender's NICs and the receiver's.
type BothEnds = (Vec<Arc<FakeNic>>, Vec<Arc<FakeNic>>);

/// A fabric of `n` NICs at each end: `tx0`.., `rx0`...
fn mobile_nics(n: usize) -> (Fabric, BothEnds) {
    let fabric = Fabric::new();
    let nics =
        |side: &str| -> Vec<_> { (0..n).map(|i| fabric.nic(&format!("{side}{i}"))).collect() };
    let nics = (nics("tx"), nics("rx"));
    (fabric, nics)
}

/// Tests send `s` and receive `r` in turn (each end's progress drives its half of a move)
/// until both are done; returns what each reported.
pub(super) fn wait_both(c: &Conn, s: usize, r: usize) -> Result<(Completion, Completion)> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let (mut sent, mut received) = (None, None);
    while sent.is_none() || received.is_none() {
        if sent.is_none() {
            sent = c.test_send(s)?;
        }
        if received.is_none() {
            received = c.test_recv(r)?;
        }
        assert!(
            Instant::now() < deadline,
            "not done: send {sent:?}, receive {received:?}"
        );
    }
    Ok((sent.unwrap(), received.unwrap()))
}

/// Polls `isend` of `buf` while testing receive `r` (the receiver's half of a move goes on
/// meanwhile) until it posts.
pub(super) fn isend_while(c: &Conn, b: &mut Buf, tag: i32, r: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(id) = c.send.isend(b.whole(), tag, b.mh).expect("isend") {
            return id;
        }
        let _ = c.test_recv(r).expect("receive");
        assert!(Instant::now() < deadline, "isend of tag {tag} never posted");
    }
}

/// One message of `len` bytes (seed `seed`) through the connection, bytes and sizes checked.
pub(super) fn through(c: &Conn, len: usize, seed: u64) {
    let mut dst = c.buf(false, len, 0);
    let mut src = c.buf(true, len, seed);
    let r = c.irecv(&mut [&mut dst], &[3]);
    deliver(c, (&mut src, 3), (r, &dst), (len, seed));
}

/// Sends `src` with tag `tag` to receive `r`, posted into `dst`, until both are done: each
/// end reports `len` bytes, and `dst` holds `seed`'s pattern.
pub(super) fn deliver(
    c: &Conn,
    (src, tag): (&mut Buf, i32),
    (r, dst): (usize, &Buf),
    (len, seed): (usize, u64),
) {
    let s = isend_while(c, src, tag, r);
    let (sent, received) = wait_both(c, s, r).unwrap();
    assert_eq!(
        (sent, received),
        (Completion::single(len), Completion::single(len))
    );
    assert_eq!(dst.mem.bytes(), TestMem::pattern(len, seed), "{len} bytes");
}

#[test]
fn a_stream_survives_its_nic_cut_for_good_and_runs_on_the_spare() {
    let c = connect_mobile(1, 1, mobile());
    for i in 0..5 {
        through(&c, 4096, i);
    }
    c.fabric.cut(&c.tx_nics[0], Some(Cut::Fail(RETRY_EXCEEDED)));
    for i in 5..40 {
        through(&c, 4096 + i as usize, i);
    }
    // The later messages went on the spare NICs.
    let stats = c.send.rail_stats();
    assert_eq!(stats.len(), 1);
    assert!(stats[0].messages >= 30, "{stats:?}");
    assert_eq!(c.send.rail_nics(), ["tx1"]);
    assert_eq!(c.recv.rail_nics(), ["rx1"]);
}

#[test]
fn a_cut_before_the_data_moves_and_the_send_arrives_once() {
    let c = connect_mobile(1, 1, mobile());
    through(&c, 64, 1);
    c.fabric.cut(&c.rx_nics[0], Some(Cut::Fail(RETRY_EXCEEDED)));
    // The receiver's clear-to-send fails on its NIC: it moves first (the sender is told), and
    // the clear-to-send that never arrived comes with the answer.
    through(&c, 100_000, 2);
    through(&c, 8, 3);
}

#[test]
fn a_silent_cut_is_found_by_the_probes_and_moved_off() {
    let c = connect_mobile(1, 1, mobile());
    through(&c, 64, 1);
    c.fabric.cut(&c.tx_nics[0], Some(Cut::Silent));
    let t0 = Instant::now();
    through(&c, 70_000, 2);
    let took = t0.elapsed();
    // The probe goes out after half the suspect time and is given the whole of it.
    assert!(took >= Duration::from_millis(100), "{took:?}");
    through(&c, 64, 3);
}

/// [`connect_mobile`] up to the comms `connect` and `accept` return: the sender joins the
/// listener's answer, and the receiver brings its probes up, in their first calls.
fn open_mobile(rails: usize, spares: usize, p: ConnParams) -> Conn {
    let (fabric, nics) = mobile_nics(rails + spares);
    Conn::open(fabric, nics, (rails, rails), (p, p)).unwrap()
}

/// The first message of a connection whose setup `cut` interrupts once the receive is
/// posted (its clear-to-send held until the sender is up), then more: bytes and sizes
/// checked.
fn first_messages_across(c: &Conn, cut: impl FnOnce()) {
    let mut dst = c.buf(false, 70_000, 0);
    let mut src = c.buf(true, 70_000, 1);
    let r = c.irecv(&mut [&mut dst], &[1]);
    cut();
    deliver(c, (&mut src, 1), (r, &dst), (70_000, 1));
    for i in 2..6 {
        through(c, 4096 + i as usize, i);
    }
}

#[test]
fn a_nic_down_before_the_first_transfer_moves_the_connection() {
    // The sender's NIC: its QPs cannot come up towards the answer, and it moves before it
    // says `Resume`. The receiver's: its probes cannot come up at the `Resume`, and the
    // sender's first write runs out of retries; whichever end sees it first moves, and both
    // agree.
    for sender in [true, false] {
        let c = open_mobile(1, 1, mobile());
        let nic = if sender { &c.tx_nics[0] } else { &c.rx_nics[0] };
        first_messages_across(&c, || c.fabric.cut(nic, Some(Cut::Down)));
        assert_eq!(c.send.rail_nics(), ["tx1"], "sender's NIC: {sender}");
        assert_eq!(c.recv.rail_nics(), ["rx1"], "sender's NIC: {sender}");
    }
}

#[test]
fn a_move_whose_new_nic_is_down_too_moves_again() {
    // The spare taken first cannot be brought up: the end that finds it (the sender joining
    // the answer, the receiver joining the offer) begins the next move, which takes the last.
    for sender in [true, false] {
        let c = connect_mobile(1, 2, mobile());
        through(&c, 64, 1);
        let nics = if sender { &c.tx_nics } else { &c.rx_nics };
        c.fabric.cut(&nics[0], Some(Cut::Down));
        c.fabric.cut(&nics[1], Some(Cut::Down));
        for i in 2..6 {
            through(&c, 20_000 + i as usize, i);
        }
        let on = if sender {
            c.send.rail_nics()
        } else {
            c.recv.rail_nics()
        };
        assert_eq!(
            on,
            [nics[2].local().name.clone()],
            "sender's spares: {sender}"
        );
    }
}

#[test]
fn with_failover_off_a_nic_down_before_the_first_transfer_fails_both_ends_at_once() {
    let p = ConnParams {
        failover: None,
        ..mobile()
    };
    let c = open_mobile(1, 1, p);
    let mut dst = c.buf(false, 64, 0);
    let mut src = c.buf(true, 64, 1);
    let r = c.irecv(&mut [&mut dst], &[1]);
    c.fabric.cut(&c.tx_nics[0], Some(Cut::Down));
    let e = c.send.isend(src.whole(), 1, src.mh).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Remote);
    assert!(e.to_string().contains("could not be brought up"), "{e}");
    // The receiver is told why, rather than waiting for a sender that never comes.
    let e = wait_error(Duration::from_secs(1), || c.test_recv(r));
    assert!(e.to_string().contains("refused the connection"), "{e}");
}

#[test]
fn a_receive_that_landed_before_the_cut_is_never_written_again() {
    let c = connect_mobile(1, 1, mobile());
    through(&c, 64, 1);
    // The receiver places the data and completes the receive; the sender never hears back.
    c.fabric.lose_acks(&c.tx_nics[0]);
    let mut dst = c.buf(false, 256, 0);
    let mut src = c.buf(true, 256, 9);
    let r = c.irecv(&mut [&mut dst], &[4]);
    let s = c.send_buf(&mut src, 4);
    assert_eq!(wait(|| c.test_recv(r)).unwrap(), Completion::single(256));
    assert_eq!(dst.mem.bytes(), TestMem::pattern(256, 9));
    // NCCL reuses the buffer at once: a send written again would overwrite this.
    let mut reused = dst.whole();
    reused.bytes_mut(0, 256).fill(0xee);
    // The send is seen done only through the move (the probes go unanswered too), which the
    // receiver's own traffic drives.
    let mut next = c.buf(false, 32, 0);
    let r2 = c.irecv(&mut [&mut next], &[5]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.test_send(s).unwrap().is_none() {
        let _ = c.test_recv(r2).unwrap();
        assert!(Instant::now() < deadline, "the send never completed");
    }
    let mut src2 = c.buf(true, 32, 10);
    let s2 = isend_while(&c, &mut src2, 5, r2);
    wait_both(&c, s2, r2).unwrap();
    assert_eq!(next.mem.bytes(), TestMem::pattern(32, 10));
    assert!(dst.mem.bytes().iter().all(|&b| b == 0xee), "written twice");
}

#[test]
fn a_write_cut_between_its_data_and_its_immediate_is_sent_again_whole() {
    let c = connect_mobile(1, 1, mobile());
    through(&c, 64, 1);
    let mut dst = c.buf(false, 8192, 0);
    let mut src = c.buf(true, 8192, 6);
    let r = c.irecv(&mut [&mut dst], &[1]);
    c.fabric.hold(true);
    let s = isend_while(&c, &mut src, 1, r);
    // Half the data placed, then the link fails before the immediate.
    c.fabric.place_partial(4096);
    c.fabric.cut(&c.tx_nics[0], Some(Cut::Fail(RETRY_EXCEEDED)));
    c.fabric.hold(false);
    let (sent, received) = wait_both(&c, s, r).unwrap();
    assert_eq!(
        (sent, received),
        (Completion::single(8192), Completion::single(8192))
    );
    assert_eq!(dst.mem.bytes(), TestMem::pattern(8192, 6));
}

/// A grouped receive posted on a connection: buffers of `room` bytes with tags `0..`, and
/// the sends for it (`lens[i]` bytes of seed `seed + i`).
pub(super) struct Group {
    lens: Vec<usize>,
    dsts: Vec<Buf>,
    srcs: Vec<Buf>,
    seed: u64,
    pub(super) r: usize,
    ids: Vec<usize>,
}

impl Group {
    pub(super) fn post(c: &Conn, lens: &[usize], room: usize, seed: u64) -> Group {
        let mut dsts: Vec<Buf> = lens.iter().map(|_| c.buf(false, room, 0)).collect();
        let tags: Vec<i32> = (0..lens.len() as i32).collect();
        let r = {
            let mut refs: Vec<&mut Buf> = dsts.iter_mut().collect();
            c.irecv(&mut refs, &tags)
        };
        let srcs = lens
            .iter()
            .enumerate()
            .map(|(i, &l)| c.buf(true, l, seed + i as u64))
            .collect();
        Group {
            lens: lens.to_vec(),
            dsts,
            srcs,
            seed,
            r,
            ids: Vec::new(),
        }
    }

    /// Sends buffer `i` (testing the receive meanwhile, as a move may be under way).
    pub(super) fn send(&mut self, c: &Conn, i: usize) {
        let id = isend_while(c, &mut self.srcs[i], i as i32, self.r);
        self.ids.push(id);
    }

    /// Waits for the receive and every send, then checks each size and byte.
    pub(super) fn check(&self, c: &Conn) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut done = vec![false; self.ids.len()];
        let mut got = None;
        while got.is_none() || done.iter().any(|d| !d) {
            for (i, &s) in self.ids.iter().enumerate() {
                if !done[i] {
                    done[i] = c.test_send(s).unwrap().is_some();
                }
            }
            if got.is_none() {
                got = c.test_recv(self.r).unwrap();
            }
            assert!(
                Instant::now() < deadline,
                "group not done: {done:?} {got:?}"
            );
        }
        let got = got.unwrap();
        assert_eq!(got.n, self.lens.len());
        for (i, &l) in self.lens.iter().enumerate() {
            assert_eq!(got.sizes[i] as usize, l);
            assert_eq!(
                self.dsts[i].mem.bytes()[..l],
                TestMem::pattern(l, self.seed + i as u64)[..],
                "buffer {i}"
            );
        }
    }
}

#[test]
fn grouped_receives_survive_the_move_with_every_size() {
    let c = connect_mobile(1, 1, mobile());
    let mut g = Group::post(&c, &[10, 2000, 0, 64, 4096, 1, 300, 77], 4096, 20);
    // Four sends go out before the cut, the rest after it.
    for i in 0..8 {
        if i == 4 {
            c.fabric.cut(&c.tx_nics[0], Some(Cut::Fail(RETRY_EXCEEDED)));
        }
        g.send(&c, i);
    }
    g.check(&c);
}

#[test]
fn a_fused_device_losing_one_rail_carries_on_over_the_other() {
    let p = ConnParams {
        qps_per_connection: 2,
        ..mobile()
    };
    let c = connect_mobile(2, 0, p);
    // Striped over both rails.
    through(&c, 256 << 10, 1);
    c.fabric.cut(&c.tx_nics[1], Some(Cut::Fail(RETRY_EXCEEDED)));
    for i in 2..10 {
        through(&c, (256 << 10) + i as usize, i);
        through(&c, 100, i + 50);
    }
}

#[test]
fn a_spare_that_fails_too_ends_in_a_bounded_error_at_both_ends() {
    let c = connect_mobile(1, 1, mobile());
    through(&c, 64, 1);
    let mut dst = c.buf(false, 64, 0);
    let mut src = c.buf(true, 64, 2);
    let r = c.irecv(&mut [&mut dst], &[1]);
    // After the clear-to-send landed: the send's write is the first to fail.
    c.fabric.cut(&c.tx_nics[0], Some(Cut::Fail(RETRY_EXCEEDED)));
    c.fabric.cut(&c.tx_nics[1], Some(Cut::Fail(RETRY_EXCEEDED)));
    let s = c.send_buf(&mut src, 1);
    let t0 = Instant::now();
    let (mut send_err, mut recv_err) = (None, None);
    while send_err.is_none() || recv_err.is_none() {
        if send_err.is_none() {
            send_err = c.test_send(s).err();
        }
        if recv_err.is_none() {
            recv_err = c.test_recv(r).err();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{send_err:?} {recv_err:?}"
        );
    }
    let e = send_err.unwrap();
    assert_eq!(e.kind(), ErrorKind::Remote, "{e}");
    assert!(e.to_string().contains("no other NIC"), "{e}");
    assert_eq!(recv_err.unwrap().kind(), ErrorKind::Remote);
}

#[test]
fn with_failover_off_a_cut_fails_the_comm_as_before() {
    let p = ConnParams {
        failover: None,
        ..mobile()
    };
    let c = connect_mobile(1, 1, p);
    through(&c, 64, 1);
    let mut dst = c.buf(false, 64, 0);
    let mut src = c.buf(true, 64, 2);
    c.irecv(&mut [&mut dst], &[1]);
    c.fabric.cut(&c.tx_nics[0], Some(Cut::Fail(RETRY_EXCEEDED)));
    let s = c.send_buf(&mut src, 1);
    let e = wait_error(Duration::from_secs(5), || c.test_send(s));
    assert!(e.to_string().contains("retry"), "{e}");
}

#[test]
fn a_connection_that_moved_moves_again_and_then_runs_out_of_nics() {
    let c = connect_mobile(1, 2, mobile());
    through(&c, 64, 1);
    c.fabric.cut(&c.tx_nics[0], Some(Cut::Fail(RETRY_EXCEEDED)));
    through(&c, 64, 2);
    c.fabric.cut(&c.tx_nics[1], Some(Cut::Fail(RETRY_EXCEEDED)));
    through(&c, 5000, 3);
    through(&c, 64, 4);
}

#[test]
fn both_ends_seeing_the_cut_at_once_agree_on_one_move() {
    let c = connect_mobile(1, 1, mobile());
    through(&c, 64, 1);
    let mut dsts = [c.buf(false, 512, 0), c.buf(false, 512, 0)];
    let mut srcs = [c.buf(true, 512, 30), c.buf(true, 512, 31)];
    let r0 = c.irecv(&mut [&mut dsts[0]], &[1]);
    c.fabric.cut(&c.tx_nics[0], Some(Cut::Fail(RETRY_EXCEEDED)));
    // The sender's write fails on its side, the receiver's next clear-to-send on its own:
    // each end starts the move, and the offer and the `Down` cross.
    let s0 = c.send_buf(&mut srcs[0], 1);
    let r1 = c.irecv(&mut [&mut dsts[1]], &[2]);
    let s1 = isend_while(&c, &mut srcs[1], 2, r1);
    wait_both(&c, s0, r0).unwrap();
    wait_both(&c, s1, r1).unwrap();
    for (i, d) in dsts.iter().enumerate() {
        assert_eq!(d.mem.bytes(), TestMem::pattern(512, 30 + i as u64));
    }
    through(&c, 64, 2);
}

#[test]
fn a_fault_of_the_rails_a_move_replaced_while_the_receiver_read_it_is_no_fault() {
    // The receiver's flush QPs take a read through the old NIC as it answers the move.
    let p = ConnParams {
        flush: true,
        ..mobile()
    };
    let c = connect_mobile(1, 1, p);
    through(&c, 64, 1);
    c.fabric.cut(&c.tx_nics[0], Some(Cut::Fail(RETRY_EXCEEDED)));
    // The receiver's clear-to-send fails on the cut path; its failed completion waits in
    // its CQ while the sender, waiting for it, finds the path dead too and offers a move.
    let mut dst = c.buf(false, 4096, 0);
    let mut src = c.buf(true, 4096, 7);
    let r = c.irecv(&mut [&mut dst], &[1]);
    let mut idle = c.buf(true, 8, 0);
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.send.epoch() == 0 {
        assert_eq!(c.send.isend(idle.whole(), 9, idle.mh).unwrap(), None);
        assert!(Instant::now() < deadline, "the sender never moved");
    }
    // The receiver reads its fault, then the offer, and answers it; its thread stops right
    // after (descheduled), while the sender joins the answer and resumes: then it reads the
    // `Resume` in the same look at the link as the offer, and the move has ended by the
    // time it comes back to the fault it read before it.
    c.fabric.pause_posts(&c.rx_nics[0], true);
    let tested = std::thread::scope(|scope| {
        let receiver = scope.spawn(|| loop {
            let tested = c.test_recv(r);
            if tested.is_err() || c.fabric.posts_waited() > 0 {
                return tested;
            }
            assert!(
                Instant::now() < deadline,
                "the receiver never read its fault"
            );
        });
        while c.fabric.posts_waited() == 0 {
            assert!(Instant::now() < deadline, "the receiver never answered");
            std::thread::yield_now();
        }
        while c.send.rail_nics() != ["tx1"] {
            assert_eq!(c.send.isend(idle.whole(), 9, idle.mh).unwrap(), None);
            assert!(Instant::now() < deadline, "the sender never resumed");
        }
        c.fabric.pause_posts(&c.rx_nics[0], false);
        receiver.join().unwrap()
    });
    assert_eq!(tested.unwrap(), None, "the receive has not come yet");
    deliver(&c, (&mut src, 1), (r, &dst), (4096, 7));
    assert_eq!(c.recv.rail_nics(), ["rx1"]);
    through(&c, 64, 2);
}

#[test]
fn a_sender_moving_at_the_receivers_word_leaves_its_answer_to_the_move() {
    let c = connect_mobile(1, 1, mobile());
    through(&c, 64, 1);
    // The receiver's clear-to-send fails: it stops its QPs and says `Down` first.
    c.fabric.cut(&c.rx_nics[0], Some(Cut::Fail(RETRY_EXCEEDED)));
    let mut dst = c.buf(false, 4096, 0);
    let mut src = c.buf(true, 4096, 8);
    let r = c.irecv(&mut [&mut dst], &[1]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.recv.epoch() == 0 {
        assert_eq!(c.test_recv(r).unwrap(), None);
        assert!(Instant::now() < deadline, "the receiver never moved");
    }
    // The sender reads the `Down` and offers its new rails; its thread stops right after
    // (descheduled) while the receiver answers: the answer is there when the sender looks at
    // the link again, in the same look that read the `Down`.
    let pause = c.send.pause_link_after(Step::Offer);
    let mut idle = c.buf(true, 8, 0);
    let looked = std::thread::scope(|scope| {
        let sender = scope.spawn(|| loop {
            let looked = c.send.isend(idle.whole(), 9, idle.mh);
            if looked.is_err() || pause.waited() > 0 {
                return looked;
            }
            assert!(
                Instant::now() < deadline,
                "the sender never read the `Down`"
            );
        });
        while pause.waited() == 0 {
            assert!(Instant::now() < deadline, "the sender never offered");
            std::thread::yield_now();
        }
        while c.recv.rail_nics() != ["rx1"] {
            assert_eq!(c.test_recv(r).unwrap(), None);
            assert!(Instant::now() < deadline, "the receiver never answered");
        }
        pause.release();
        sender.join().unwrap()
    });
    assert_eq!(looked.unwrap(), None);
    deliver(&c, (&mut src, 1), (r, &dst), (4096, 8));
    assert_eq!(c.send.rail_nics(), ["tx1"]);
    through(&c, 64, 2);
}

/// A connection with parameters `p` over one rail and a spare at each end, and the buffer its
/// first receive (4096 bytes) landed in, through rail 0.
fn landed_once(p: ConnParams) -> (Conn, Buf) {
    let c = connect_mobile(1, 1, p);
    through(&c, 64, 1);
    let mut dst = c.buf(false, 4096, 0);
    let mut src = c.buf(true, 4096, 2);
    let r = c.irecv(&mut [&mut dst], &[1]);
    let s = isend_while(&c, &mut src, 1, r);
    wait_both(&c, s, r).unwrap();
    (c, dst)
}

#[test]
fn a_flush_in_flight_when_the_nic_dies_completes_after_the_move() {
    let p = ConnParams {
        flush: true,
        ..mobile()
    };
    let (c, mut dst) = landed_once(p);
    // The flush's read is held back, then the receiver's NIC fails under it.
    c.fabric.hold(true);
    let f = c
        .recv
        .iflush(&[dst.whole()], &[dst.mh])
        .unwrap()
        .expect("a flush");
    c.fabric.cut(&c.rx_nics[0], Some(Cut::Fail(RETRY_EXCEEDED)));
    c.fabric.hold(false);
    let mut idle = c.buf(true, 8, 3);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(done) = c.test_recv(f).unwrap() {
            assert_eq!(done, Completion::EMPTY);
            break;
        }
        // The sender's idle isends look around, which answers the receiver's move.
        assert_eq!(c.send.isend(idle.whole(), 9, idle.mh).unwrap(), None);
        assert!(Instant::now() < deadline, "the flush never completed");
    }
    through(&c, 64, 4);
}

/// Whether idle `calls` pass the comm's lock while another thread holds it (taken by `hold`):
/// every call between two of the periodic ones that look around under the lock (`count`: the
/// idle calls counted so far; every `IDLE_LOOK_EVERY`th locks). The holder keeps the lock until
/// they are done, or 10 s passed: then one waited for it.
fn calls_pass_a_held_lock(
    hold: impl FnOnce(&dyn Fn()) + Send,
    calls: impl Fn(),
    count: impl Fn() -> u32,
) -> bool {
    // The next call is the first after one that looked around.
    while count() % IDLE_LOOK_EVERY != 0 {
        calls();
    }
    let held = std::sync::Barrier::new(2);
    let (done, finished) = std::sync::mpsc::channel::<()>();
    let finished = parking_lot::Mutex::new(finished);
    let waited = AtomicBool::new(false);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            hold(&|| {
                held.wait();
                let r = finished.lock().recv_timeout(Duration::from_secs(10));
                waited.store(r.is_err(), Ordering::Relaxed);
            })
        });
        held.wait();
        for _ in 1..IDLE_LOOK_EVERY {
            calls();
        }
        let _ = done.send(());
    });
    !waited.load(Ordering::Relaxed)
}

#[test]
fn a_moved_connection_answers_idle_calls_without_its_lock_and_frees_the_dead_nic() {
    let c = connect_mobile(1, 1, mobile());
    through(&c, 64, 1);
    c.fabric.cut(&c.tx_nics[0], Some(Cut::Fail(RETRY_EXCEEDED)));
    through(&c, 64, 2);
    assert_eq!(c.send.rail_nics(), ["tx1"]);
    assert_eq!(c.recv.rail_nics(), ["rx1"]);
    // What the connection held on the NICs it left is freed (off the data path).
    super::super::reaper::settle();
    for nic in [&c.tx_nics[0], &c.rx_nics[0]] {
        let held = nic.held();
        assert_eq!(
            (held.qps, held.cqs),
            (0, 0),
            "{} still holds {held:?}",
            nic.local().name
        );
    }
    // A receive waiting for its data: its tests are answered by the gate, on the new CQs.
    let mut dst = c.buf(false, 64, 0);
    let r = c.irecv(&mut [&mut dst], &[5]);
    let lock_free = calls_pass_a_held_lock(
        |f| c.recv.with_lock_held(f),
        || assert_eq!(c.test_recv(r).unwrap(), None),
        || c.recv.idle_looks(),
    );
    assert!(lock_free, "an idle test waited for the comm's lock");
    let mut src = c.buf(true, 64, 3);
    let s = c.send_buf(&mut src, 5);
    wait_both(&c, s, r).unwrap();
    assert_eq!(dst.mem.bytes(), TestMem::pattern(64, 3));
    // A send whose clear-to-send has not come: the gate answers, without the lock.
    let mut idle = c.buf(true, 8, 4);
    let (buf, mh) = (idle.whole(), idle.mh);
    let lock_free = calls_pass_a_held_lock(
        |f| c.send.with_lock_held(f),
        || assert_eq!(c.send.isend(buf, 9, mh).unwrap(), None),
        || c.send.idle_calls(),
    );
    assert!(lock_free, "an idle isend waited for the comm's lock");
}

#[test]
fn a_flush_after_a_move_waits_for_the_read_that_orders_the_dead_nics_writes() {
    // A long suspect time: only the read's completion may end the wait here.
    let p = ConnParams {
        flush: true,
        failover: Some(Duration::from_secs(5)),
        ..mobile()
    };
    let (c, mut dst) = landed_once(p);
    // The receive landed through rx0. Its flush QP answers late from now on.
    let old_flush = c.recv.flush_qpns()[0];
    c.fabric.slow_qp(old_flush, true);
    c.fabric.cut(&c.tx_nics[0], Some(Cut::Fail(RETRY_EXCEEDED)));
    through(&c, 64, 3);
    assert_eq!(c.recv.rail_nics(), ["rx1"]);
    // NCCL flushes the receive that landed before the move: through rx1, but done only
    // once rx0's read, which orders rx0's writes, is in.
    let f = c
        .recv
        .iflush(&[dst.whole()], &[dst.mh])
        .unwrap()
        .expect("a flush");
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(200) {
        assert_eq!(
            c.test_recv(f).unwrap(),
            None,
            "done before rx0's ordering read"
        );
    }
    c.fabric.slow_qp(old_flush, false);
    assert_eq!(wait(|| c.test_recv(f)).unwrap(), Completion::EMPTY);
    // Then the dead NIC's QPs go.
    through(&c, 64, 4);
    super::super::reaper::settle();
    assert_eq!(c.rx_nics[0].held().qps, 0, "rx0's flush QP was freed");
}

/// Idle calls per batch of [`idle_calls_before_and_after_a_move`].
const IDLE_CALLS: usize = 4096;

/// `IDLE_CALLS` tests of receive `r`, which waits (a batch of its own for callgrind).
#[inline(never)]
fn idle_tests_unmoved(c: &Conn, r: usize) {
    for _ in 0..IDLE_CALLS {
        assert_eq!(c.test_recv(r).unwrap(), None);
    }
}

/// As [`idle_tests_unmoved`], on the moved connection.
#[inline(never)]
fn idle_tests_moved(c: &Conn, r: usize) {
    for _ in 0..IDLE_CALLS {
        assert_eq!(c.test_recv(r).unwrap(), None);
    }
}

/// `IDLE_CALLS` isends of `buf` (registered as `mh`) whose clear-to-send has not come.
#[inline(never)]
fn idle_isends_unmoved(c: &Conn, buf: UserBuffer, mh: u64) {
    for _ in 0..IDLE_CALLS {
        assert_eq!(c.send.isend(buf, 9, mh).unwrap(), None);
    }
}

/// As [`idle_isends_unmoved`], on the moved connection.
#[inline(never)]
fn idle_isends_moved(c: &Conn, buf: UserBuffer, mh: u64) {
    for _ in 0..IDLE_CALLS {
        assert_eq!(c.send.isend(buf, 9, mh).unwrap(), None);
    }
}

/// The idle calls NCCL's proxy makes, before and after the connection moved, each batch in
/// its own function: `scripts/perf/moved-idle-cost.sh` counts their instructions under
/// callgrind and prints the moved figures against the unmoved ones.
#[test]
#[ignore = "measured by scripts/perf/moved-idle-cost.sh under callgrind"]
fn idle_calls_before_and_after_a_move() {
    let c = connect_mobile(1, 1, mobile());
    through(&c, 64, 1);
    let mut idle = c.buf(true, 8, 4);
    let (buf, mh) = (idle.whole(), idle.mh);
    let mut dst = c.buf(false, 64, 0);
    let r = c.irecv(&mut [&mut dst], &[5]);
    idle_tests_unmoved(&c, r);
    let mut src = c.buf(true, 64, 3);
    let s = isend_while(&c, &mut src, 5, r);
    wait_both(&c, s, r).unwrap();
    idle_isends_unmoved(&c, buf, mh);
    c.fabric.cut(&c.tx_nics[0], Some(Cut::Fail(RETRY_EXCEEDED)));
    through(&c, 64, 2);
    assert_eq!(c.recv.rail_nics(), ["rx1"]);
    let r = c.irecv(&mut [&mut dst], &[5]);
    idle_tests_moved(&c, r);
    let s = isend_while(&c, &mut src, 5, r);
    wait_both(&c, s, r).unwrap();
    idle_isends_moved(&c, buf, mh);
}
