//! The cluster soak's rounds on the fake fabric, under schedules the VMs cannot choose: two
//! hosts of two NICs each, a connection each way over their first NICs, streams both ways
//! with every byte and size checked, each end closing its comm as soon as its part is done,
//! and host 2's first NIC cut at a seeded moment, from before the first call on (netem's
//! loss, with the retries running out or not; the link down; a silent link), while a seeded
//! schedule picks which of the four ends makes the next call, and lets each end go quiet
//! for a while. A failing seed names its schedule.

use std::collections::VecDeque;
use std::thread;

use super::failover::mobile;
use super::*;

/// Messages each way.
const MESSAGES: usize = 24;
/// Receives (and sends) each end keeps in flight.
const WINDOW: usize = 4;

/// A small seeded generator (xorshift64*): schedules repeat by seed.
struct Schedule(u64);

impl Schedule {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

/// Message `m` of a stream: its length and its bytes' seed.
fn message(way: usize, m: usize) -> (usize, u64) {
    (1 + (m * 7919 + way * 131) % 70_000, (way * 1000 + m) as u64)
}

/// One direction's stream over a connection: its messages' buffers, registered up front
/// (as NCCL's are), its two ends (each closed, as NCCL's ranks close theirs, as soon as its
/// own part of the stream is done), the sends and receives in flight (request, message), and
/// how far it got.
struct Way {
    index: usize,
    srcs: Vec<Buf>,
    dsts: Vec<Buf>,
    send: Option<VerbsSender<FakeNic>>,
    recv: Option<VerbsReceiver<FakeNic>>,
    posted: (usize, usize),
    sends: VecDeque<(usize, usize)>,
    recvs: VecDeque<(usize, usize)>,
    received: usize,
    /// Holds what the handles name.
    _registry: Arc<Registry>,
}

impl Way {
    /// The stream `index` over `c`.
    fn new(c: Conn, index: usize) -> Way {
        let srcs = (0..MESSAGES)
            .map(|m| {
                let (len, seed) = message(index, m);
                c.buf(true, len, seed)
            })
            .collect();
        let dsts = (0..MESSAGES).map(|_| c.buf(false, 70_000, 0)).collect();
        Way {
            index,
            srcs,
            dsts,
            send: Some(c.send),
            recv: Some(c.recv),
            posted: (0, 0),
            sends: VecDeque::new(),
            recvs: VecDeque::new(),
            received: 0,
            _registry: c.registry,
        }
    }

    fn done(&self) -> bool {
        self.send.is_none() && self.recv.is_none()
    }

    /// One call of the sender (`sender`) or the receiver: a post where the window has room,
    /// else a test of the oldest request; what it finds is checked. An end whose part is
    /// done closes its comm.
    fn step(&mut self, sender: bool, post: bool) -> Result<()> {
        if sender {
            let Some(send) = &self.send else {
                return Ok(());
            };
            if post && self.sends.len() < WINDOW && self.posted.0 < MESSAGES {
                let m = self.posted.0;
                let src = &mut self.srcs[m];
                if let Some(id) = send.isend(src.whole(), 1, src.mh)? {
                    self.sends.push_back((id, m));
                    self.posted.0 += 1;
                }
            } else if let Some(&(id, m)) = self.sends.front() {
                if let Some(size) = send.test(id).into_result()? {
                    assert_eq!(size, message(self.index, m).0, "message {m}");
                    self.sends.pop_front();
                }
            }
            if self.posted.0 == MESSAGES && self.sends.is_empty() {
                self.send = None;
            }
            return Ok(());
        }
        let Some(recv) = &self.recv else {
            return Ok(());
        };
        if post && self.recvs.len() < WINDOW && self.posted.1 < MESSAGES {
            let m = self.posted.1;
            let dst = &mut self.dsts[m];
            if let Some(id) = recv.irecv(&[dst.whole()], &[1], &[dst.mh])? {
                self.recvs.push_back((id, m));
                self.posted.1 += 1;
            }
        } else if let Some(&(id, m)) = self.recvs.front() {
            if let Some(done) = test_recv(recv, id)? {
                let (len, seed) = message(self.index, m);
                assert_eq!(done, Completion::single(len), "message {m}");
                self.recvs.pop_front();
                let dst = &self.dsts[m];
                assert_eq!(dst.mem.bytes()[..len], TestMem::pattern(len, seed)[..]);
                self.received += 1;
            }
        }
        if self.received == MESSAGES {
            self.recv = None;
        }
        Ok(())
    }
}

/// One round of `seed`, host 2's first NIC cut `cut`: what failed, where it did.
fn round(seed: u64, cut: Cut) -> std::result::Result<(), String> {
    let fabric = Fabric::new();
    let host = |h: usize| -> Vec<_> { (0..2).map(|i| fabric.nic(&format!("h{h}n{i}"))).collect() };
    let (h1, h2) = (host(1), host(2));
    let p = mobile();
    let open = |tx: &[Arc<FakeNic>], rx: &[Arc<FakeNic>]| {
        Conn::open(fabric.clone(), (tx.to_vec(), rx.to_vec()), (1, 1), (p, p)).unwrap()
    };
    // Half the lossy rounds run out of retries, as a real NIC does, the others retry for
    // ever: at a bound around the failover suspect time (100 ms), or either side of it.
    let retries = (cut == Cut::Egress && (seed / 3) % 2 == 1)
        .then(|| Duration::from_millis(20 + (seed * 37) % 230));
    if let Some(bound) = retries {
        fabric.retries_run_out(bound);
    }
    // Way 0: host 2 sends; way 1: host 1 does.
    let mut ways = [Way::new(open(&h2, &h1), 0), Way::new(open(&h1, &h2), 1)];
    let mut s = Schedule(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let cut_at = match s.below(3) {
        0 => 0,
        _ => s.below(200),
    };
    let mut quiet: [Option<Instant>; 4] = [None; 4];
    let deadline = Instant::now() + Duration::from_secs(20);
    // How far each way got: (sends posted, receives posted, received, sends open).
    let progress = |ways: &[Way; 2]| -> String {
        let p: Vec<_> = ways
            .iter()
            .map(|w| (w.posted.0, w.posted.1, w.received, w.sends.len()))
            .collect();
        format!(
            "cut at call {cut_at}, retries for {retries:?}; (sent, posted, received, sends \
             open) {p:?}"
        )
    };
    for call in 0.. {
        if call == cut_at {
            fabric.cut(&h2[0], Some(cut));
        }
        if ways.iter().all(Way::done) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("not done in 20 s: {}", progress(&ways)));
        }
        // An end: host 2's sender, host 1's receiver, host 1's sender, host 2's receiver.
        let end = s.below(4) as usize;
        let now = Instant::now();
        if quiet[end].is_some_and(|until| now < until) {
            thread::yield_now();
            continue;
        }
        if s.below(50_000) == 0 {
            // This end makes no call for a while (its thread busy elsewhere).
            let ms = s.below(250);
            quiet[end] = Some(now + Duration::from_millis(ms));
            continue;
        }
        let post = s.below(2) == 0;
        let (w, sender) = (end / 2, end % 2 == 0);
        if let Err(e) = ways[w].step(sender, post) {
            let who = if sender { "sender" } else { "receiver" };
            return Err(format!(
                "way {w}'s {who}, call {call}: {e}; {}",
                progress(&ways)
            ));
        }
    }
    unreachable!()
}

/// `SCHEDULE_ROUNDS` rounds (24) from seed `SCHEDULE_SEED` (0); the cuts rotate.
#[test]
fn a_nic_cut_at_any_moment_of_a_stream_both_ways_loses_nothing() {
    let rounds: u64 = std::env::var("SCHEDULE_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(24);
    let first: u64 = std::env::var("SCHEDULE_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut failed = Vec::new();
    for seed in first..first + rounds {
        let cut = [Cut::Egress, Cut::Down, Cut::Silent][seed as usize % 3];
        let (r, warns) = crate::log::warnings_of(|| round(seed, cut));
        if let Err(e) = r {
            failed.push(format!(
                "seed {seed} ({cut:?}): {e}\n  WARN: {}",
                warns.join("\n  WARN: ")
            ));
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}
