//! Setup on the fake fabric as every NCCL generation drives it: `connect` returns without the
//! peer's `accept` (NCCL up to 2.18 connects to completion before it accepts, on one thread)
//! and the ends' first data calls finish the setup; a listen comm accepts every connection
//! made to its handle; a refused setup, or an end closed during it, fails the other end with
//! the reason instead of leaving it waiting.

use super::failover::{through, wait_both};
use super::*;
use crate::verbs::device::LINK_LAYER_IB;

/// A listener on `rx` (the receiving end's NIC) and the registry both ends use.
struct Rig {
    fabric: Fabric,
    tx: Arc<FakeNic>,
    rx: Arc<FakeNic>,
    registry: Arc<Registry>,
    listen: VerbsListener<FakeNic>,
    params: ConnParams,
    /// What `register` made, kept while the rig lives.
    mrs: std::cell::RefCell<Vec<FakeMr>>,
}

fn rig_over(fabric: Fabric, tx: Arc<FakeNic>, rx: Arc<FakeNic>) -> Rig {
    rig_with(fabric, (tx, rx), params())
}

/// A rig whose ends both run with `p`.
fn rig_with(fabric: Fabric, (tx, rx): (Arc<FakeNic>, Arc<FakeNic>), p: ConnParams) -> Rig {
    let registry: Arc<Registry> = Arc::default();
    let keys = CommKeys::new(Arc::clone(&registry), 0);
    let rails = (&[Arc::clone(&rx)][..], &[][..]);
    let listen = VerbsListener::bind("127.0.0.1".parse().unwrap(), rails, p, keys).expect("listen");
    Rig {
        fabric,
        tx,
        rx,
        registry,
        listen,
        params: p,
        mrs: Default::default(),
    }
}

fn rig() -> Rig {
    let fabric = Fabric::new();
    let (tx, rx) = (fabric.nic("fake0"), fabric.nic("fake1"));
    rig_over(fabric, tx, rx)
}

/// Polls `step` until it yields, for at most 10 s.
fn until<T>(what: &str, mut step: impl FnMut() -> Result<Option<T>>) -> Result<T> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(t) = step()? {
            return Ok(t);
        }
        assert!(Instant::now() < deadline, "{what} did not complete");
    }
}

impl Rig {
    /// A connect to the listener, polled to completion (no `accept` is called meanwhile).
    fn connect(&self) -> VerbsSender<FakeNic> {
        let keys = CommKeys::new(Arc::clone(&self.registry), 0);
        let rails = (&[Arc::clone(&self.tx)][..], &[][..]);
        let handle = *self.listen.handle();
        let mut connecting = VerbsConnector::start(rails, &handle, self.params, keys).unwrap();
        until("connect", || connecting.poll()).expect("connect")
    }

    fn accept(&mut self) -> Result<VerbsReceiver<FakeNic>> {
        until("accept", || self.listen.poll_accept())
    }

    /// Registers `mem` on `nic` as the plugin's `regMr` does; its handle.
    fn register(&self, nic: &FakeNic, mem: &TestMem) -> u64 {
        let mr = nic.register(mem.addr(), mem.len()).unwrap();
        let mut keys = MemKeys {
            rails: 1,
            host: true,
            ..MemKeys::default()
        };
        keys.set(0, (mr.lkey(), mr.rkey()));
        self.mrs.borrow_mut().push(mr);
        let reg = Registration::new(mem.addr(), mem.len(), 0, keys);
        self.registry.insert(reg, None).unwrap()
    }

    /// The two ends as a connection the other tests' helpers drive, once its setup is done.
    fn conn(&self, send: VerbsSender<FakeNic>, recv: VerbsReceiver<FakeNic>) -> Conn {
        until("the setup", || {
            let up = (send.step_setup()?, recv.step_setup()?);
            Ok((up == (true, true)).then_some(()))
        })
        .unwrap();
        Conn {
            fabric: self.fabric.clone(),
            tx_nics: vec![Arc::clone(&self.tx)],
            rx_nics: vec![Arc::clone(&self.rx)],
            send,
            recv,
            registry: Arc::clone(&self.registry),
        }
    }
}

#[test]
fn connect_returns_before_accept_and_the_first_data_calls_finish_the_setup() {
    let mut rig = rig();
    // NCCL 2.9: every connect of a rank returns before its first accept.
    let send = rig.connect();
    let idle = send.isend(UserBuffer::EMPTY, 1, 0).expect("an idle isend");
    assert_eq!(idle, None, "a send posted before the receiver answered");
    let recv = rig.accept().expect("accept");
    let mut dst = TestMem::new(4096, 0);
    let mut src = TestMem::new(4096, 9);
    let dst_mh = rig.register(&rig.rx, &dst);
    let src_mh = rig.register(&rig.tx, &src);
    // The receiver's rank posts before the sender made any call (one thread may drive both
    // ends, so this must not wait for the sender); its clear-to-send waits until the sender
    // is up (the fake drops a write to a QP not brought up: the data would never come).
    let r = recv
        .irecv(&[dst.buffer()], &[1], &[dst_mh])
        .unwrap()
        .expect("a receive taken before the sender is up");
    let s = until("the send", || {
        let s = send.isend(src.buffer(), 1, src_mh)?;
        if s.is_none() {
            assert!(
                matches!(test_recv(&recv, r), Ok(None)),
                "done before it was sent"
            );
        }
        Ok(s)
    })
    .unwrap();
    let c = rig.conn(send, recv);
    let done = wait_both(&c, s, r).unwrap();
    assert_eq!(done, (Completion::single(4096), Completion::single(4096)));
    assert_eq!(dst.bytes(), TestMem::pattern(4096, 9));
    through(&c, 64 << 10, 2);
}

#[test]
fn a_receiver_slow_to_make_its_first_call_is_not_probed_before_it_is_up() {
    // Probes every 75 ms, each answered within 300 ms or the path is dead.
    let p = ConnParams {
        work_timeout: Some(Duration::from_millis(300)),
        ..params()
    };
    let fabric = Fabric::new();
    let nics = (fabric.nic("fake0"), fabric.nic("fake1"));
    let mut rig = rig_with(fabric, nics, p);
    let send = rig.connect();
    let recv = rig.accept().expect("accept");
    // The sender's proxy keeps trying to send; the receiver's rank is busy elsewhere for a
    // second (its probe QPs come up only as its first call reads the sender's `Resume`).
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(1) {
        let idle = send.isend(UserBuffer::EMPTY, 1, 0).expect("not failed");
        assert_eq!(idle, None);
    }
    let c = rig.conn(send, recv);
    through(&c, 4096, 5);
    // Up, idle and waiting for a receive, the sender probes: the receiver answers.
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(800) {
        assert_eq!(
            c.send.isend(UserBuffer::EMPTY, 1, 0).expect("not failed"),
            None
        );
    }
    through(&c, 64, 6);
}

#[test]
fn a_listen_comm_accepts_every_connection_made_to_its_handle() {
    let mut rig = rig();
    let sends = [rig.connect(), rig.connect()];
    let recvs = [rig.accept().unwrap(), rig.accept().unwrap()];
    let conns: Vec<Conn> = sends
        .into_iter()
        .zip(recvs)
        .map(|(s, r)| rig.conn(s, r))
        .collect();
    // Each pair carries its own stream; the bytes tell them apart.
    for (seed, c) in (10..).zip(&conns) {
        through(c, 8192, seed);
    }
    for (seed, c) in (20..).zip(conns.iter().rev()) {
        through(c, 100, seed);
    }
}

#[test]
fn the_sender_learns_why_the_listener_refused_the_connection() {
    let fabric = Fabric::new();
    let (tx, rx) = (
        fabric.nic("fake0"),
        fabric.nic_with_link_layer("ib0", LINK_LAYER_IB),
    );
    let mut rig = rig_over(fabric, tx, rx);
    let send = rig.connect();
    let e = rig.accept().err().expect("accept refused");
    assert!(e.to_string().contains("link layer mismatch"), "{e}");
    let e =
        until("the refusal", || send.isend(UserBuffer::EMPTY, 1, 0)).expect_err("the sender fails");
    assert_eq!(e.kind(), ErrorKind::Remote);
    let msg = e.to_string();
    assert!(msg.contains("refused the connection"), "{msg}");
    assert!(msg.contains("link layer mismatch"), "{msg}");
}

/// `e` says the peer is gone: its process closed the connection.
fn peer_gone(e: &Error) {
    assert_eq!(e.kind(), ErrorKind::Remote, "{e}");
    let msg = e.to_string();
    assert!(msg.contains("closed its connection"), "{msg}");
}

#[test]
fn a_sender_closed_before_the_accept_fails_the_accept_or_the_receivers_first_calls() {
    let mut rig = rig();
    drop(rig.connect());
    let recv = match rig.accept() {
        Ok(recv) => recv,
        Err(e) => return peer_gone(&e),
    };
    let mut dst = TestMem::new(64, 0);
    let mh = rig.register(&rig.rx, &dst);
    // The receive may be posted (the sender's QPs take a join, as a real NIC's would); it
    // fails then, with the sender's leaving.
    let e = match until("the receive", || recv.irecv(&[dst.buffer()], &[1], &[mh])) {
        Err(e) => e,
        Ok(r) => until("the receive's test", || test_recv(&recv, r)).expect_err("it fails"),
    };
    peer_gone(&e);
}

#[test]
fn a_receiver_closed_right_after_its_accept_fails_the_senders_first_calls() {
    let mut rig = rig();
    let send = rig.connect();
    drop(rig.accept().unwrap());
    let e = until("the sender's failure", || {
        send.isend(UserBuffer::EMPTY, 1, 0)
    })
    .expect_err("the sender fails");
    peer_gone(&e);
}
