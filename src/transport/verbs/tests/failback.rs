//! Fail-back on the fake fabric: a connection moved off a lost NIC moves back once that NIC
//! (and the peer's) has stayed usable for the settling time, between messages, every
//! request completing once with its bytes and size; a flap inside the settling time moves
//! nothing back; a healed NIC takes a later failover; a move back onto a path still broken
//! falls back to the failover path.

use super::failover::{connect_mobile, deliver, mobile, through, Group};
use super::*;
use crate::transport::verbs::heal;

/// How long a lost NIC must stay usable here.
const SETTLE: Duration = Duration::from_millis(60);

fn homing() -> ConnParams {
    ConnParams {
        failback: (SETTLE, true),
        ..mobile()
    }
}

/// Both ends' NICs, sender's then receiver's.
fn nics_of(c: &Conn) -> (Vec<String>, Vec<String>) {
    (c.send.rail_nics(), c.recv.rail_nics())
}

/// Idles the connection as NCCL does between messages (the sender asks for a send whose
/// receive is not posted yet; the receiver tests a receive posted early) until `done`, or
/// panics after `within`; then that receive's send goes, its bytes checked.
pub(super) fn idle_until(c: &Conn, within: Duration, done: impl Fn() -> bool) {
    let mut dst = c.buf(false, 3000, 0);
    let mut src = c.buf(true, 3000, 77);
    let r = c.irecv(&mut [&mut dst], &[77]);
    let t0 = Instant::now();
    while !done() {
        c.send.step_setup().expect("the sender's idle call");
        assert!(c.test_recv(r).expect("the receiver's test").is_none());
        assert!(
            t0.elapsed() < within,
            "not done in {within:?}: {:?}",
            nics_of(c)
        );
    }
    deliver(c, (&mut src, 77), (r, &dst), (3000, 77));
}

/// A connection moved off `tx0` (cut `how`), both ends on their spares.
fn moved_off(p: ConnParams, how: Cut) -> Conn {
    let c = connect_mobile(1, 1, p);
    through(&c, 4096, 1);
    c.fabric.cut(&c.tx_nics[0], Some(how));
    through(&c, 5000, 2);
    assert_eq!(nics_of(&c), (vec!["tx1".into()], vec!["rx1".into()]));
    c
}

/// A connection moved off `tx0` (its link down), `tx0` mended, and the receiver has looked
/// around until it told the sender that its own NIC healed.
fn healed_and_told(p: ConnParams) -> Conn {
    let c = moved_off(p, Cut::Down);
    c.fabric.cut(&c.tx_nics[0], None);
    let t0 = Instant::now();
    while t0.elapsed() < SETTLE + Duration::from_millis(300) {
        c.recv.poll_once().expect("the receiver's look");
    }
    c
}

pub(super) fn home(c: &Conn) -> bool {
    c.send.rail_nics() == ["tx0"] && c.recv.rail_nics() == ["rx0"]
}

#[test]
fn a_healed_nic_takes_its_connection_back_and_nothing_is_lost() {
    let c = moved_off(homing(), Cut::Down);
    let healed = Instant::now();
    c.fabric.cut(&c.tx_nics[0], None);
    idle_until(&c, Duration::from_secs(5), || home(&c));
    let took = healed.elapsed();
    assert!(took >= SETTLE, "moved back {took:?} after the heal");
    let before = c.send.rail_stats()[0].messages;
    for i in 3..8 {
        through(&c, 4096 * i as usize, i);
    }
    // The home NIC carries the traffic again.
    assert_eq!(c.send.rail_stats()[0].messages, before + 5);
    assert!(home(&c));
}

#[test]
fn grouped_and_striped_receives_survive_the_move_back_with_every_size() {
    // Two rails each and a spare: rail 0 moves to the spare and back; a grouped receive
    // whose buffers are large enough to stripe over both rails waits across the move back.
    let c = connect_mobile(2, 1, homing());
    through(&c, 300_000, 1);
    c.fabric.cut(&c.tx_nics[0], Some(Cut::Down));
    through(&c, 300_000, 2);
    assert_eq!(c.send.rail_nics(), ["tx2", "tx1"]);
    let lens = [200_000, 10, 0, 150_000, 4096, 1, 300_000, 77];
    let mut g = Group::post(&c, &lens, 300_000, 40);
    // Half the group is matched before the move back (nothing is posted before the rest).
    for i in 0..4 {
        g.send(&c, i);
    }
    c.fabric.cut(&c.tx_nics[0], None);
    let deadline = Instant::now() + Duration::from_secs(5);
    while c.send.rail_nics() != ["tx0", "tx1"] {
        c.send.step_setup().unwrap();
        assert!(c.test_recv(g.r).unwrap().is_none());
        assert!(Instant::now() < deadline, "never moved back");
    }
    for i in 4..8 {
        g.send(&c, i);
    }
    g.check(&c);
    assert_eq!(c.recv.rail_nics(), ["rx0", "rx1"]);
}

#[test]
fn a_flap_inside_the_settling_time_moves_nothing_back() {
    let settle = Duration::from_millis(300);
    let p = ConnParams {
        failback: (settle, true),
        ..mobile()
    };
    let c = moved_off(p, Cut::Down);
    // Up 100 ms, down again (long enough for several looks), then up for good: the
    // settling time counts from the last heal.
    c.fabric.cut(&c.tx_nics[0], None);
    idle_for(&c, Duration::from_millis(100));
    c.fabric.cut(&c.tx_nics[0], Some(Cut::Down));
    idle_for(&c, settle);
    assert_eq!(c.send.rail_nics(), ["tx1"], "moved back inside the flap");
    let healed = Instant::now();
    c.fabric.cut(&c.tx_nics[0], None);
    idle_until(&c, Duration::from_secs(5), || home(&c));
    let took = healed.elapsed();
    assert!(took >= settle, "moved back {took:?} after the last heal");
    through(&c, 9000, 3);
}

/// Idles the connection (as [`idle_until`]) for `d`, checking it stays where it is.
fn idle_for(c: &Conn, d: Duration) {
    let was = nics_of(c);
    let t0 = Instant::now();
    idle_until(c, d * 2, || {
        assert_eq!(nics_of(c), was);
        t0.elapsed() >= d
    });
}

#[test]
fn a_healed_nic_takes_a_later_failover_with_or_without_the_move_back() {
    for failback in [false, true] {
        let p = ConnParams {
            failback: (SETTLE, failback),
            ..mobile()
        };
        let c = moved_off(p, Cut::Down);
        c.fabric.cut(&c.tx_nics[0], None);
        if failback {
            idle_until(&c, Duration::from_secs(5), || home(&c));
            // The other NIC lost now only costs the connection its spare.
            c.fabric.cut(&c.tx_nics[1], Some(Cut::Fail(RETRY_EXCEEDED)));
        } else {
            // Both ends see their NIC healed (the receiver's was lost with the path).
            idle_until(&c, Duration::from_secs(5), || {
                c.send.lost_nics() == 0 && c.recv.lost_nics() == 0
            });
            idle_for(&c, SETTLE);
            assert_eq!(
                c.send.rail_nics(),
                ["tx1"],
                "NCCL_ERDMA_FAILBACK=0 moved back"
            );
            // The NIC it runs on is lost: the healed one takes it.
            c.fabric.cut(&c.tx_nics[1], Some(Cut::Fail(RETRY_EXCEEDED)));
        }
        for i in 3..6 {
            through(&c, 7000 + i as usize, i);
        }
        assert!(home(&c), "failback {failback}: {:?}", nics_of(&c));
    }
}

#[test]
fn a_nic_that_fails_during_the_move_back_falls_back_to_the_failover_path() {
    // The path was tried and carried; the move back begins, and the NIC fails during it
    // (its port up, every write running out of retries): the first write fails and the
    // connection moves off again.
    let c = moved_off(homing(), Cut::Down);
    assert_eq!(c.send.epoch(), 1);
    c.fabric.cut(&c.tx_nics[0], None);
    idle_until(&c, Duration::from_secs(5), || {
        let back = c.send.epoch() == 2;
        if back {
            c.fabric.cut(&c.tx_nics[0], Some(Cut::Fail(RETRY_EXCEEDED)));
        }
        back
    });
    let lost_again = Instant::now();
    assert_eq!(c.send.epoch(), 3);
    assert_eq!(nics_of(&c), (vec!["tx1".into()], vec!["rx1".into()]));
    // Lost twice, the NIC settles twice as long (its port never went down: from the loss);
    // mended, it takes the connection back.
    c.fabric.cut(&c.tx_nics[0], None);
    idle_until(&c, Duration::from_secs(5), || home(&c));
    let took = lost_again.elapsed();
    assert!(
        took >= SETTLE * 2,
        "moved back {took:?} after the second loss"
    );
    through(&c, 7000, 5);
}

#[test]
fn a_connection_never_idle_moves_back_once_the_move_has_waited_long_enough() {
    let c = moved_off(homing(), Cut::Down);
    let healed = Instant::now();
    c.fabric.cut(&c.tx_nics[0], None);
    // Pipelined as NCCL's steps are: the receiver posts ahead of the sender, and the next
    // send is asked for before the last is tested, so one is always in flight while the next
    // receive waits. The move back lets the one in flight complete (NCCL's proxy tests it
    // while the next `isend` says "not yet"), then begins: nothing is sent again.
    let post = |seed: u64| {
        let mut dst = c.buf(false, 1000 + seed as usize, 0);
        let r = c.irecv(&mut [&mut dst], &[1]);
        (dst, r)
    };
    let mut last: Option<Pipelined> = None;
    let mut seed = 10;
    let mut ahead = post(seed);
    // `isend`s answered "not yet" while the move back waited for the send in flight.
    let mut held = 0;
    while !home(&c) {
        assert!(
            healed.elapsed() < Duration::from_secs(10),
            "never moved back"
        );
        // NCCL's proxy polls both ends many times a message.
        for _ in 0..300 {
            c.send.step_setup().unwrap();
            c.recv.poll_once().unwrap();
        }
        let (dst, r) = std::mem::replace(&mut ahead, post(seed + 1));
        let mut src = c.buf(true, 1000 + seed as usize, seed);
        let deadline = Instant::now() + Duration::from_secs(10);
        let s = loop {
            if let Some(id) = c.send.isend(src.whole(), 1, src.mh).expect("isend") {
                break id;
            }
            held += usize::from(c.send.draining());
            if let Some(l) = &mut last {
                l.test(&c);
            }
            assert!(c.test_recv(r).expect("receive").is_none());
            assert!(Instant::now() < deadline, "isend of {seed} never posted");
        };
        let next = Pipelined {
            dst,
            _src: src,
            ids: (s, r),
            seed,
            done: (None, None),
        };
        if let Some(l) = last.replace(next) {
            l.check(&c);
        }
        seed += 1;
    }
    assert!(
        healed.elapsed() >= SETTLE + crate::transport::verbs::heal::BUSY_WAIT,
        "moved back {:?} after the heal, with sends in flight",
        healed.elapsed()
    );
    assert!(held > 0, "the move back began with a send in flight");
    last.take().unwrap().check(&c);
    let (dst, r) = ahead;
    let mut src = c.buf(true, 1000 + seed as usize, seed);
    deliver(&c, (&mut src, 1), (r, &dst), (1000 + seed as usize, seed));
    through(&c, 5000, 99);
}

/// A pipelined message (`1000 + seed` bytes): its buffers, its send's and receive's ids,
/// and what each reported so far.
struct Pipelined {
    dst: Buf,
    _src: Buf,
    ids: (usize, usize),
    seed: u64,
    done: (Option<Completion>, Option<Completion>),
}

impl Pipelined {
    /// Tests the send and the receive once each, where not done yet.
    fn test(&mut self, c: &Conn) {
        if self.done.0.is_none() {
            self.done.0 = c.test_send(self.ids.0).expect("the send's test");
        }
        if self.done.1.is_none() {
            self.done.1 = c.test_recv(self.ids.1).expect("the receive's test");
        }
    }

    /// Tests both until done, and checks their sizes and the bytes.
    fn check(mut self, c: &Conn) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.done.0.is_none() || self.done.1.is_none() {
            self.test(c);
            assert!(Instant::now() < deadline, "not done: {:?}", self.done);
        }
        let len = 1000 + self.seed as usize;
        let one = Some(Completion::single(len));
        assert_eq!(self.done, (one, one));
        assert_eq!(
            self.dst.mem.bytes(),
            TestMem::pattern(len, self.seed),
            "message {}",
            self.seed
        );
    }
}

#[test]
fn a_move_back_waits_for_a_receive_that_waits_for_data() {
    // The trial passed while the only receive posted had its data in flight: a move begun
    // then can find the receiver done with it and gone (the end of a stream, NCCL calling
    // nothing on a comm with nothing posted) before it reads the offer, and the sender's last
    // send would wait for an answer past the move's bound. The move waits for a receive that
    // waits for data not sent yet, which the receiver tests until the move is over.
    let p = ConnParams {
        // Longer than this test leaves the receiver's acknowledgements lost: the path is
        // slow, not suspected.
        failover: Some(Duration::from_secs(2)),
        work_timeout: Some(Duration::from_millis(500)),
        ..homing()
    };
    let c = healed_and_told(p);
    let mut dst = c.buf(false, 3000, 0);
    let r = c.irecv(&mut [&mut dst], &[5]);
    // The sender finds the receive waiting and tries the way home; the receiver answers.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !c.send.trying() {
        c.send.step_setup().expect("the sender's idle call");
        assert!(Instant::now() < deadline, "no trial");
    }
    while !c.recv.holds_trial() {
        assert!(c.test_recv(r).expect("the receiver's test").is_none());
        assert!(Instant::now() < deadline, "the trial unanswered");
    }
    // The send lands, its acknowledgement lost for now (loss on the receiver's link): the
    // receiver is done and calls no more.
    c.fabric.cut(&c.rx_nics[1], Some(Cut::Egress));
    let mut src = c.buf(true, 3000, 5);
    let s = c
        .send
        .isend(src.whole(), 5, src.mh)
        .unwrap()
        .expect("posted");
    let received = wait(|| c.test_recv(r)).expect("the receiver's test");
    assert_eq!(received, Completion::single(3000));
    // The trial passes meanwhile: the move back waits for the send in flight.
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(300) {
        assert_eq!(c.test_send(s).expect("the send's test"), None);
    }
    assert!(c.send.draining(), "the trial has not passed");
    let unmoved = "a move back began with no receive waiting";
    assert_eq!(c.send.epoch(), 1, "{unmoved}");
    c.fabric.cut(&c.rx_nics[1], None);
    let sent = wait(|| c.test_send(s)).expect("the send's test");
    assert_eq!(sent, Completion::single(3000));
    assert_eq!(dst.mem.bytes(), TestMem::pattern(3000, 5));
    // The receiver posts nothing: once the trial no longer holds, the sender carries on
    // where it is, unmoved.
    let deadline = Instant::now() + Duration::from_secs(5);
    while c.send.draining() {
        c.send.step_setup().expect("the sender's idle call");
        assert!(Instant::now() < deadline, "the move back never gave up");
    }
    assert_eq!(c.send.epoch(), 1, "{unmoved}");
    // The next receive posted waits: the connection moves back.
    idle_until(&c, Duration::from_secs(5), || home(&c));
}

#[test]
fn a_receiver_with_nothing_posted_is_not_moved_back_under() {
    // Its rank is elsewhere (a checkpoint) and calls nothing on the comm: a move back begun
    // now would wait for its answer past the move's bound and fail a healthy connection. The
    // sender, asked for a send meanwhile, waits until the receiver posts.
    let p = ConnParams {
        work_timeout: Some(Duration::from_millis(400)),
        ..homing()
    };
    let c = healed_and_told(p);
    let mut src = c.buf(true, 3000, 78);
    let t0 = Instant::now();
    while t0.elapsed() < SETTLE + Duration::from_secs(1) {
        let posted = c
            .send
            .isend(src.whole(), 78, src.mh)
            .expect("an idle isend");
        assert_eq!(posted, None);
    }
    assert_eq!(c.send.rail_nics(), ["tx1"]);
    // The receiver posts and tests: the connection moves back, and the send goes.
    idle_until(&c, Duration::from_secs(5), || home(&c));
}

#[test]
fn a_home_path_that_still_drops_everything_is_tried_and_not_taken() {
    // Its port is up (loss on the wire): the port alone would call it healed. The trial's
    // writes go unanswered, the connection stays on the spare without a stall, the NIC
    // counts as lost again (tried again ever more rarely), and once the path carries, the
    // connection moves back.
    let c = moved_off(homing(), Cut::Down);
    c.fabric.cut(&c.tx_nics[0], Some(Cut::Egress));
    // A trial comes once the move back has waited for a moment between messages (at most
    // `BUSY_WAIT`) and fails within the failover suspect time; the NIC is lost again, and
    // after twice the settling time tried again.
    idle_until(&c, Duration::from_secs(10), || {
        assert_eq!(nics_of(&c), (vec!["tx1".into()], vec!["rx1".into()]));
        c.send.losses(0) >= 3
    });
    c.fabric.cut(&c.tx_nics[0], None);
    idle_until(&c, Duration::from_secs(5), || home(&c));
    through(&c, 7000, 10);
}

#[test]
fn a_late_answer_to_a_trial_given_up_is_not_taken_for_the_next() {
    // The receiver posted a receive, then made no call for longer than a trial waits: the
    // sender gives the first trial up and, a second later, begins another. The receiver then
    // answers both, in turn: the first answer must not be joined to the second trial (its
    // rails are being torn down), which would fail a healthy path.
    let c = healed_and_told(homing());
    let mut dst = c.buf(false, 3000, 0);
    let r = c.irecv(&mut [&mut dst], &[79]);
    // The receiver is away; the sender finds its clear-to-send and waits for the send.
    let away = Instant::now();
    while away.elapsed() < heal::TRIAL_EVERY + Duration::from_millis(300) {
        c.send.step_setup().expect("the sender's idle call");
    }
    assert_eq!(c.send.rail_nics(), ["tx1"]);
    // Back: both answers arrive; the second trial passes and the connection moves back.
    let mut src = c.buf(true, 3000, 79);
    deliver(&c, (&mut src, 79), (r, &dst), (3000, 79));
    idle_until(&c, Duration::from_secs(5), || home(&c));
    assert_eq!(c.send.losses(0), 1, "a trial failed");
}
