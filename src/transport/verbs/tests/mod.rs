//! The verbs transport's state machines on the in-memory fabric (`verbs::fake`): connections
//! set up over loopback `oob` between two fake NICs, then NCCL-style traffic with every byte
//! and size checked, and the faults the VM tiers cannot stage exactly (a write half placed, a
//! sequence number crossing 2^32, a link that never answers, a failed work request).

mod corpus;
mod failback;
mod failover;
mod faults;
mod interleavings;
mod limits;
mod rails;
mod schedules;
mod setup;
mod traffic;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use super::budget::SENDER_SEND_DEPTH;
use super::profile::ConnParams;
use super::recv::{VerbsReceiver, FLUSH_ID_BASE};
use super::send::VerbsSender;
use super::setup::{VerbsConnector, VerbsListener};
use super::wire::{SLOTS, SPLIT_ALIGN};
use crate::buffer::{TestMem, UserBuffer};
use crate::error::{Error, ErrorKind, Result};
use crate::oob::Timeouts;
use crate::transport::registry::Registration;
use crate::transport::{
    CommKeys, Connector, Endpoint, Listener, MemKeys, Receiver, Registry, Sender, MAX_RECVS,
};
use crate::verbs::fake::{Cut, Fabric, FakeMr, FakeNic, REMOTE_ACCESS_ERROR, RETRY_EXCEEDED};
use crate::verbs::nic::{MemoryRegion, Nic};

/// Sizes as the tests keep them.
type Sizes = [u32; MAX_RECVS];

/// How many polls a request that should complete at once may take (the fake carries work
/// out as it is posted; the peer and watchdog checks run every 256 polls).
const POLLS: usize = 100_000;

pub(super) fn params() -> ConnParams {
    ConnParams {
        qps_per_connection: 1,
        split_data: false,
        timeout: 14,
        retry_cnt: 7,
        traffic_class: 0,
        sl: 0,
        flush: false,
        timeouts: Timeouts {
            connect: Duration::from_secs(10),
            peer: None,
        },
        cts_batch: 1,
        work_timeout: None,
        wqe_latency: None,
        send_depth: SENDER_SEND_DEPTH,
        failover: None,
        failback: (Duration::from_secs(10), true),
    }
}

/// A connection between fake NICs: the sender's rails and the receiver's, and the
/// registrations of the memory both ends use (as the plugin's, on device 0).
struct Conn {
    fabric: Fabric,
    tx_nics: Vec<Arc<FakeNic>>,
    rx_nics: Vec<Arc<FakeNic>>,
    send: VerbsSender<FakeNic>,
    recv: VerbsReceiver<FakeNic>,
    registry: Arc<Registry>,
}

/// A connection from `tx_rails` NICs to `rx_rails` NICs (named `tx0`.. and `rx0`..; with one
/// rail each, `fake0` and `fake1`).
fn connect_rails(
    tx_rails: usize,
    rx_rails: usize,
    tx_params: ConnParams,
    rx_params: ConnParams,
) -> Conn {
    let fabric = Fabric::new();
    let name = |side: &str, i: usize, n: usize| match (side, n) {
        ("tx", 1) => "fake0".to_string(),
        ("rx", 1) => "fake1".to_string(),
        _ => format!("{side}{i}"),
    };
    let tx_nics: Vec<_> = (0..tx_rails)
        .map(|i| fabric.nic(&name("tx", i, tx_rails)))
        .collect();
    let rx_nics: Vec<_> = (0..rx_rails)
        .map(|i| fabric.nic(&name("rx", i, rx_rails)))
        .collect();
    Conn::join(
        fabric,
        (tx_nics, rx_nics),
        (tx_rails, rx_rails),
        (tx_params, rx_params),
    )
    .unwrap()
}

fn connect_with(tx_params: ConnParams, rx_params: ConnParams) -> Conn {
    connect_rails(1, 1, tx_params, rx_params)
}

fn connect(p: ConnParams) -> Conn {
    connect_with(p, p)
}

/// Test memory registered on fake NICs (the rails of one end), and its handle.
struct Buf {
    mem: TestMem,
    /// What holds the registrations.
    _mrs: Vec<FakeMr>,
    keys: MemKeys,
    /// The handle of its registration in the connection's registry.
    mh: u64,
}

impl Buf {
    fn whole(&mut self) -> UserBuffer {
        self.mem.buffer()
    }
}

impl Conn {
    /// Connects the sender's NICs to the receiver's on `fabric`: the first `rails` of each
    /// end's are the connection's rails, the rest spares it may move to.
    fn join(
        fabric: Fabric,
        nics: (Vec<Arc<FakeNic>>, Vec<Arc<FakeNic>>),
        rails: (usize, usize),
        params: (ConnParams, ConnParams),
    ) -> Result<Conn> {
        let c = Conn::open(fabric, nics, rails, params)?;
        // The ends' first calls finish the setup (move 0).
        let deadline = Instant::now() + Duration::from_secs(10);
        let (mut sender_up, mut receiver_up) = (false, false);
        while !sender_up || !receiver_up {
            sender_up = sender_up || c.send.step_setup()?;
            receiver_up = receiver_up || c.recv.step_setup()?;
            assert!(Instant::now() < deadline, "the setup did not complete");
        }
        Ok(c)
    }

    /// [`Conn::join`] up to the comms `connect` and `accept` return: the rest of the setup
    /// is the ends' first calls'.
    fn open(
        fabric: Fabric,
        (tx_nics, rx_nics): (Vec<Arc<FakeNic>>, Vec<Arc<FakeNic>>),
        rails: (usize, usize),
        (tx_params, rx_params): (ConnParams, ConnParams),
    ) -> Result<Conn> {
        let registry: Arc<Registry> = Arc::default();
        let keys = || CommKeys::new(Arc::clone(&registry), 0);
        let rx = rx_nics.split_at(rails.1);
        let mut listen = VerbsListener::bind("127.0.0.1".parse().unwrap(), rx, rx_params, keys())?;
        let handle = *listen.handle();
        let tx = tx_nics.split_at(rails.0);
        let mut connecting = VerbsConnector::start(tx, &handle, tx_params, keys())?;
        let (mut send, mut recv) = (None, None);
        let deadline = Instant::now() + Duration::from_secs(10);
        while send.is_none() || recv.is_none() {
            if send.is_none() {
                send = connecting.poll()?;
            }
            if recv.is_none() {
                recv = listen.poll_accept()?;
            }
            assert!(Instant::now() < deadline, "connect/accept did not complete");
        }
        let (send, recv) = (send.unwrap(), recv.unwrap());
        Ok(Conn {
            fabric,
            tx_nics,
            rx_nics,
            send,
            recv,
            registry,
        })
    }

    /// `len` bytes of `seed`'s pattern, registered on the sender's rails or the receiver's.
    fn buf(&self, sender: bool, len: usize, seed: u64) -> Buf {
        let nics = if sender { &self.tx_nics } else { &self.rx_nics };
        let mem = TestMem::new(len, seed);
        let mrs: Vec<FakeMr> = nics
            .iter()
            .map(|n| n.register(mem.addr(), len.max(1)).unwrap())
            .collect();
        let mut keys = MemKeys {
            rails: mrs.len() as u8,
            host: true,
            ..MemKeys::default()
        };
        for (r, mr) in mrs.iter().enumerate() {
            keys.set(r, (mr.lkey(), mr.rkey()));
        }
        let mh = self.register(mem.addr(), len, keys);
        Buf {
            mem,
            _mrs: mrs,
            keys,
            mh,
        }
    }

    /// A handle of `addr..addr+len` with `keys`, as the plugin's `regMr` makes one.
    fn register(&self, addr: usize, len: usize, keys: MemKeys) -> u64 {
        self.registry
            .insert(Registration::new(addr, len, 0, keys), None)
            .unwrap()
    }

    /// Posts a receive of `bufs` with `tags`, which must be accepted at once.
    fn irecv(&self, bufs: &mut [&mut Buf], tags: &[i32]) -> usize {
        let mhs: Vec<u64> = bufs.iter().map(|b| b.mh).collect();
        let ubufs: Vec<UserBuffer> = bufs.iter_mut().map(|b| b.whole()).collect();
        self.recv
            .irecv(&ubufs, tags, &mhs)
            .expect("irecv")
            .expect("a free receive slot")
    }

    /// Polls `isend` of `buf` (registered as `mh`) until it posts (the clear-to-send must
    /// arrive within `POLLS`).
    fn isend(&self, buf: UserBuffer, mh: u64, tag: i32) -> Result<usize> {
        for _ in 0..POLLS {
            if let Some(id) = self.send.isend(buf, tag, mh)? {
                return Ok(id);
            }
        }
        panic!("isend of tag {tag} never found its clear-to-send");
    }

    fn send_buf(&self, b: &mut Buf, tag: i32) -> usize {
        self.isend(b.whole(), b.mh, tag).expect("isend")
    }

    /// `test` of send request `id`.
    fn test_send(&self, id: usize) -> Result<Option<Completion>> {
        Ok(self.send.test(id).into_result()?.map(Completion::single))
    }

    /// `test` of receive or flush request `id`.
    fn test_recv(&self, id: usize) -> Result<Option<Completion>> {
        test_recv(&self.recv, id)
    }
}

/// `test` of receive or flush request `id` of `recv`.
fn test_recv(recv: &impl Receiver, id: usize) -> Result<Option<Completion>> {
    let mut sizes = [0; MAX_RECVS];
    Ok(recv
        .test(id, &mut sizes)
        .into_result()?
        .map(|n| Completion { n, sizes }))
}

/// What a finished request reported, as the tests compare it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Completion {
    /// Messages (1 for a send, 0 for a flush).
    n: usize,
    /// Their sizes (the first `n`).
    sizes: Sizes,
}

impl Completion {
    /// One message of `size` bytes.
    fn single(size: usize) -> Self {
        let mut sizes = [0; MAX_RECVS];
        sizes[0] = size as u32;
        Completion { n: 1, sizes }
    }

    /// A finished flush.
    const EMPTY: Completion = Completion {
        n: 0,
        sizes: [0; MAX_RECVS],
    };
}

/// Polls `test` until done or an error, within `POLLS`.
fn wait(test: impl Fn() -> Result<Option<Completion>>) -> Result<Completion> {
    for _ in 0..POLLS {
        if let Some(c) = test()? {
            return Ok(c);
        }
    }
    panic!("request not done after {POLLS} polls");
}

/// Polls `test` until it fails, for at most `within`.
fn wait_error(within: Duration, test: impl Fn() -> Result<Option<Completion>>) -> Error {
    let deadline = Instant::now() + within;
    loop {
        match test() {
            Err(e) => return e,
            Ok(Some(c)) => panic!("completed ({c:?}) where an error was expected"),
            Ok(None) => assert!(Instant::now() < deadline, "no error within {within:?}"),
        }
    }
}

/// Two receives (tags 1 and 2, 64 bytes each) and their sends (40 and 24 bytes), all posted;
/// `idle` runs between the receives and the sends (with the receives' ids), and the sends
/// are waited for: both receives' data has landed, neither is tested since.
struct TwoLanded {
    dsts: [Buf; 2],
    ids: [usize; 2],
}

impl TwoLanded {
    const SIZES: [usize; 2] = [40, 24];

    fn new(c: &Conn, idle: impl Fn([usize; 2])) -> Self {
        let mut dsts = [c.buf(false, 64, 0), c.buf(false, 64, 0)];
        let ids = [
            c.irecv(&mut [&mut dsts[0]], &[1]),
            c.irecv(&mut [&mut dsts[1]], &[2]),
        ];
        idle(ids);
        for (i, len) in Self::SIZES.into_iter().enumerate() {
            let mut src = c.buf(true, len, 5 + i as u64);
            let s = c.send_buf(&mut src, 1 + i as i32);
            wait(|| c.test_send(s)).unwrap();
        }
        TwoLanded { dsts, ids }
    }

    /// Receive `i` as `test` reports it done.
    fn done(i: usize) -> Option<Completion> {
        Some(Completion::single(Self::SIZES[i]))
    }

    /// Every byte of both receives.
    fn check_bytes(&self) {
        for (i, len) in Self::SIZES.into_iter().enumerate() {
            assert_eq!(
                self.dsts[i].mem.bytes()[..len],
                TestMem::pattern(len, 5 + i as u64)[..]
            );
        }
    }
}

fn one_message(c: &Conn, len: usize, seed: u64) {
    let mut dst = c.buf(false, len, 0);
    let mut src = c.buf(true, len, seed);
    let r = c.irecv(&mut [&mut dst], &[7]);
    let s = c.send_buf(&mut src, 7);
    assert_eq!(wait(|| c.test_send(s)).unwrap(), Completion::single(len));
    assert_eq!(wait(|| c.test_recv(r)).unwrap(), Completion::single(len));
    assert_eq!(dst.mem.bytes(), TestMem::pattern(len, seed), "{len} bytes");
}
