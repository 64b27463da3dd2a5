//! Connections fitted to a device's limits: fewer QPs where `max_qp` is short (at either end),
//! shallower send queues where `max_qp_wr` is, and a refusal naming the limit when not even one
//! QP fits; every message still arrives whole.

use super::*;
use crate::verbs::limits::DeviceLimits;

/// QPs per connection asked for.
const WANT: u32 = 8;

fn eight_qps() -> ConnParams {
    ConnParams {
        qps_per_connection: WANT,
        ..params()
    }
}

/// A connection from `tx` to `rx` on `fabric`, or its error.
fn conn(fabric: &Fabric, tx: &Arc<FakeNic>, rx: &Arc<FakeNic>) -> Result<Conn> {
    conn_rails(fabric, &[Arc::clone(tx)], &[Arc::clone(rx)])
}

/// A connection from the rails `tx` to the rails `rx`, or its error.
fn conn_rails(fabric: &Fabric, tx: &[Arc<FakeNic>], rx: &[Arc<FakeNic>]) -> Result<Conn> {
    let nics = (tx.to_vec(), rx.to_vec());
    let rails = (tx.len(), rx.len());
    Conn::join(fabric.clone(), nics, rails, (eight_qps(), eight_qps()))
}

fn limited(max_qp: u32) -> DeviceLimits {
    DeviceLimits {
        max_qp,
        ..DeviceLimits::UNLIMITED
    }
}

/// Messages of several sizes (a striped one among them) carried and verified.
fn carries_traffic(c: &Conn) {
    for (len, seed) in [(8, 1), (4096, 2), (1 << 20, 3)] {
        one_message(c, len, seed);
    }
}

#[test]
fn a_sender_short_of_qps_gets_fewer_and_then_a_refusal_naming_the_limit() {
    let fabric = Fabric::new();
    // Room for one connection of 8 QPs and its probe, and 3 more QPs.
    let tx = fabric.nic_with_limits("fake0", limited(12));
    let rx = fabric.nic("fake1");
    let first = conn(&fabric, &tx, &rx).unwrap();
    assert_eq!(tx.held().qps, WANT + 1);
    carries_traffic(&first);
    // The second gets 2 data QPs and its probe, and the receiver as many.
    let second = conn(&fabric, &tx, &rx).unwrap();
    assert_eq!(tx.held().qps, 12);
    assert_eq!(rx.held().qps, (WANT + 1) + 3);
    carries_traffic(&second);
    // The third cannot have even one.
    let e = conn(&fabric, &tx, &rx)
        .err()
        .expect("a connection past max_qp");
    assert_eq!(e.kind(), ErrorKind::System, "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("max_qp = 12") && msg.contains("holds 12"),
        "{msg}"
    );
    assert_eq!(tx.held().qps, 12, "a refused connection keeps nothing");
    // Closing the first leaves room for all 8 again.
    drop(first);
    let again = conn(&fabric, &tx, &rx).unwrap();
    assert_eq!(tx.held().qps, 3 + WANT + 1);
    carries_traffic(&again);
    carries_traffic(&second);
}

#[test]
fn a_receiver_short_of_qps_answers_with_fewer_and_the_sender_uses_as_many() {
    let fabric = Fabric::new();
    let tx = fabric.nic("fake0");
    // 4 data QPs and the probe.
    let rx = fabric.nic_with_limits("fake1", limited(5));
    let c = conn(&fabric, &tx, &rx).unwrap();
    assert_eq!(rx.held().qps, 5);
    assert_eq!(
        tx.held().qps,
        5,
        "the sender keeps the QPs the receiver took, no more"
    );
    carries_traffic(&c);
    let e = conn(&fabric, &tx, &rx)
        .err()
        .expect("a connection past max_qp");
    assert!(e.to_string().contains("max_qp"), "{e}");
    drop(c);
    assert_eq!((tx.held().qps, rx.held().qps), (0, 0));
}

#[test]
fn fused_ends_short_of_qps_keep_the_same_qps_on_every_rail() {
    let fabric = Fabric::new();
    let tx: Vec<_> = (0..2).map(|i| fabric.nic(&format!("tx{i}"))).collect();
    // Each receiving NIC: room for 5 data QPs and its path's probe.
    let rx: Vec<_> = (0..2)
        .map(|i| fabric.nic_with_limits(&format!("rx{i}"), limited(6)))
        .collect();
    let c = conn_rails(&fabric, &tx, &rx).unwrap();
    for nic in tx.iter().chain(&rx) {
        assert_eq!(nic.held().qps, 6, "{}", nic.local().name);
    }
    carries_traffic(&c);
}

#[test]
fn a_shallow_device_queue_makes_shallower_send_queues_that_still_carry_everything() {
    let fabric = Fabric::new();
    let tx = fabric.nic_with_limits(
        "fake0",
        DeviceLimits {
            max_qp_wr: 12,
            ..DeviceLimits::UNLIMITED
        },
    );
    let rx = fabric.nic("fake1");
    let c = conn(&fabric, &tx, &rx).unwrap();
    // More sends in flight than the queue holds, and grouped receives.
    let n = 20;
    let mut dsts: Vec<Buf> = (0..n).map(|_| c.buf(false, 256, 0)).collect();
    let rids: Vec<usize> = dsts
        .iter_mut()
        .enumerate()
        .map(|(i, d)| c.irecv(&mut [d], &[i as i32]))
        .collect();
    let mut srcs: Vec<Buf> = (0..n).map(|i| c.buf(true, 100 + i, i as u64)).collect();
    let sids: Vec<usize> = srcs
        .iter_mut()
        .enumerate()
        .map(|(i, s)| c.send_buf(s, i as i32))
        .collect();
    for (i, (s, r)) in sids.into_iter().zip(rids).enumerate() {
        assert_eq!(
            wait(|| c.test_send(s)).unwrap(),
            Completion::single(100 + i)
        );
        assert_eq!(
            wait(|| c.test_recv(r)).unwrap(),
            Completion::single(100 + i)
        );
        assert_eq!(
            dsts[i].mem.bytes()[..100 + i],
            TestMem::pattern(100 + i, i as u64)[..]
        );
    }
    // Below one slot of an 8-buffer receive's writes (9) no sender can work: refused.
    let tiny = fabric.nic_with_limits(
        "fake2",
        DeviceLimits {
            max_qp_wr: 8,
            ..DeviceLimits::UNLIMITED
        },
    );
    let e = conn(&fabric, &tiny, &rx)
        .err()
        .expect("a send queue below 9");
    assert!(e.to_string().contains("max_qp_wr"), "{e}");
}
