//! Moving verified data between the two hosts through the plugin's C ABI, as NCCL's proxy
//! does: connections both ways from handles swapped over the control link, and streams of
//! messages with a window of requests in flight, every byte of every message checked, every
//! size `test` reports compared. A stream ends in its numbers or in the error code a call
//! returned, with when that happened.

use std::time::{Duration, Instant};

use nccl_net_erdma::ffi::ncclResult_t;
pub use nccl_net_erdma_tools::client::pattern;
use nccl_net_erdma_tools::client::{self, handle_from_hex, handle_to_hex, Net, Opaque};

use super::peer::Peer;

/// `NCCL_PTR_HOST`.
const HOST: i32 = 1;

/// The plugin under test: `NCCL_ERDMA_PLUGIN_LIB` (the staged library), its v12 table.
pub fn open() -> Net {
    open_table(12)
}

/// The plugin through its `ncclNetPlugin_v<version>` table, initialised.
pub fn open_table(version: u32) -> Net {
    let lib = client::default_library();
    let mut net = Net::open(&lib, version).unwrap_or_else(|e| panic!("{e}"));
    net.init().expect("init");
    net
}

/// A send comm to the other host and a receive comm from it.
pub struct Comms {
    pub send: Opaque,
    pub recv: Opaque,
}

/// Connects both ways over the plugin's device 0, handles swapped through `peer`.
pub fn connect(net: &Net, peer: &mut Peer) -> Comms {
    connect_on(net, peer, 0)
}

/// Connects both ways over device `dev`.
pub fn connect_on(net: &Net, peer: &mut Peer, dev: i32) -> Comms {
    let mut ours = [0u8; 128];
    let listen = net.listen(dev, &mut ours).expect("listen");
    peer.send(&format!("handle {}", handle_to_hex(&ours)));
    let mut theirs = handle_from_hex(&peer.expect("handle")).expect("a handle");
    let (mut send, mut recv) = (Opaque::NULL, Opaque::NULL);
    let deadline = Instant::now() + Duration::from_secs(60);
    while send.is_null() || recv.is_null() {
        if send.is_null() {
            send = net.connect(dev, &mut theirs).expect("connect");
        }
        if recv.is_null() {
            recv = net.accept(listen).expect("accept");
        }
        assert!(
            Instant::now() < deadline,
            "connect/accept between the hosts did not complete"
        );
    }
    net.close_listen(listen).expect("closeListen");
    peer.step("connected");
    Comms { send, recv }
}

/// Connects both ways as NCCL 2.9 does (v4): each host calls `connect` once, then `accept`
/// once, on one thread; each must return its comm (neither waits for the other's call).
pub fn connect_once(net: &Net, peer: &mut Peer) -> Comms {
    let mut ours = [0u8; 128];
    let listen = net.listen(0, &mut ours).expect("listen");
    peer.send(&format!("handle {}", handle_to_hex(&ours)));
    let mut theirs = handle_from_hex(&peer.expect("handle")).expect("a handle");
    let send = net.connect(0, &mut theirs).expect("connect");
    assert!(!send.is_null(), "one connect returns the comm");
    let recv = net.accept(listen).expect("accept");
    assert!(!recv.is_null(), "one accept returns the comm");
    net.close_listen(listen).expect("closeListen");
    peer.step("connected");
    Comms { send, recv }
}

/// Closes both comms (each must succeed, whatever state the path is in).
pub fn close(net: &Net, c: Comms) {
    net.close_send(c.send).expect("closeSend");
    net.close_recv(c.recv).expect("closeRecv");
}

/// What a stream did.
#[derive(Debug)]
pub struct Done {
    /// Messages completed and (receiver) verified.
    pub messages: usize,
    /// Their bytes.
    pub bytes: u64,
    /// How long it took.
    pub elapsed: Duration,
    /// The longest wait between two completions (or from the start to the first): across a
    /// failover, the time traffic stood still; and when, from the start, it began.
    pub stall: Duration,
    pub stall_from: Duration,
}

impl Done {
    /// Throughput in MB/s.
    pub fn mbps(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64().max(1e-9) / 1e6
    }
}

/// How a stream ended early: the code a call returned, after what, and when.
#[derive(Debug)]
pub struct Failed {
    pub code: ncclResult_t,
    pub call: &'static str,
    pub done: Done,
    pub at: Instant,
}

/// One message of a stream: `sizes[i % len]` bytes, seed `seed + i`, tag `i % 7`.
#[derive(Clone, Copy)]
pub struct Stream<'a> {
    pub sizes: &'a [usize],
    pub count: usize,
    pub seed: u64,
    pub window: usize,
    /// The stream fails the case if it runs longer.
    pub limit: Duration,
}

impl Stream<'_> {
    fn size(&self, i: usize) -> usize {
        self.sizes[i % self.sizes.len()]
    }
    fn tag(i: usize) -> i32 {
        (i % 7) as i32
    }
}

struct Slot {
    buf: Vec<u8>,
    mh: Opaque,
    req: Opaque,
    msg: usize,
}

fn slots(net: &Net, comm: Opaque, s: &Stream) -> Vec<Slot> {
    let max = s.sizes.iter().copied().max().unwrap_or(0).max(1);
    (0..s.window)
        .map(|_| {
            let mut buf = vec![0u8; max];
            let mh = net
                .reg_mr(comm, buf.as_mut_ptr(), max, HOST)
                .expect("regMr");
            Slot {
                buf,
                mh,
                req: Opaque::NULL,
                msg: usize::MAX,
            }
        })
        .collect()
}

fn release(net: &Net, comm: Opaque, slots: Vec<Slot>) {
    for s in slots {
        let _ = net.dereg_mr(comm, s.mh);
    }
}

/// Sends `s` on `comm`: messages posted in order, `window` in flight, tested oldest first.
pub fn send(net: &Net, comm: Opaque, s: &Stream) -> Result<Done, Failed> {
    let mut slots = slots(net, comm, s);
    let t0 = Instant::now();
    let (mut posted, mut completed, mut bytes) = (0, 0, 0u64);
    let fail = |code, call, completed, bytes| Failed {
        code,
        call,
        done: Done {
            messages: completed,
            bytes,
            elapsed: t0.elapsed(),
            stall: Duration::ZERO,
            stall_from: Duration::ZERO,
        },
        at: Instant::now(),
    };
    let mut gaps = Gaps::new();
    let r = loop {
        if completed == s.count {
            break Ok(());
        }
        assert!(
            t0.elapsed() < s.limit,
            "sending did not finish within {:?}",
            s.limit
        );
        if posted < s.count && posted - completed < s.window {
            let slot = &mut slots[posted % s.window];
            let size = s.size(posted);
            if slot.msg != posted {
                slot.buf[..size].copy_from_slice(&pattern(s.seed + posted as u64, size));
                slot.msg = posted;
            }
            match net.isend(
                comm,
                slot.buf.as_mut_ptr(),
                size,
                Stream::tag(posted),
                slot.mh,
            ) {
                Ok(req) if !req.is_null() => {
                    slot.req = req;
                    posted += 1;
                }
                Ok(_) => {}
                Err(code) => break Err(fail(code, "isend", completed, bytes)),
            }
        }
        if completed < posted {
            let slot = &mut slots[completed % s.window];
            let mut size = [0i32; 8];
            match net.test(slot.req, Some(&mut size)) {
                Ok(true) => {
                    assert_eq!(
                        size[0] as usize,
                        s.size(completed),
                        "size of send {completed}"
                    );
                    bytes += size[0] as u64;
                    completed += 1;
                    gaps.completed();
                }
                Ok(false) => {}
                Err(code) => break Err(fail(code, "test (send)", completed, bytes)),
            }
        }
    };
    finish(net, comm, slots, r, (completed, bytes, gaps), t0)
}

/// The longest wait between completions of a stream, and when it began.
struct Gaps {
    start: Instant,
    last: Instant,
    longest: Duration,
    from: Duration,
}

impl Gaps {
    fn new() -> Self {
        let now = Instant::now();
        Gaps {
            start: now,
            last: now,
            longest: Duration::ZERO,
            from: Duration::ZERO,
        }
    }

    fn completed(&mut self) {
        let now = Instant::now();
        if now - self.last > self.longest {
            self.longest = now - self.last;
            self.from = self.last - self.start;
        }
        self.last = now;
    }
}

/// Ends a stream: a stream that completed releases its buffers; one that failed keeps them
/// registered (and allocated): the peer may still be writing into them until it finds the
/// fault itself, and a deregistered buffer would turn that into an error of its own.
fn finish(
    net: &Net,
    comm: Opaque,
    slots: Vec<Slot>,
    r: Result<(), Failed>,
    (completed, bytes, gaps): (usize, u64, Gaps),
    t0: Instant,
) -> Result<Done, Failed> {
    match r {
        Ok(()) => {
            release(net, comm, slots);
            Ok(Done {
                messages: completed,
                bytes,
                elapsed: t0.elapsed(),
                stall: gaps.longest,
                stall_from: gaps.from,
            })
        }
        Err(f) => {
            std::mem::forget(slots);
            Err(f)
        }
    }
}

/// Receives `s` on `comm` into buffers `slack` bytes larger than each message, checking
/// every byte and size.
pub fn recv(net: &Net, comm: Opaque, s: &Stream) -> Result<Done, Failed> {
    let mut slots = slots(net, comm, s);
    let t0 = Instant::now();
    let (mut posted, mut completed, mut bytes) = (0, 0, 0u64);
    let fail = |code, call, completed, bytes| Failed {
        code,
        call,
        done: Done {
            messages: completed,
            bytes,
            elapsed: t0.elapsed(),
            stall: Duration::ZERO,
            stall_from: Duration::ZERO,
        },
        at: Instant::now(),
    };
    let mut gaps = Gaps::new();
    let r = loop {
        if completed == s.count {
            break Ok(());
        }
        assert!(
            t0.elapsed() < s.limit,
            "receiving did not finish within {:?}",
            s.limit
        );
        if posted < s.count && posted - completed < s.window {
            let slot = &mut slots[posted % s.window];
            let len = slot.buf.len();
            match net.irecv(
                comm,
                &[(slot.buf.as_mut_ptr(), len)],
                &[Stream::tag(posted)],
                &[slot.mh],
                false,
            ) {
                Ok(req) if !req.is_null() => {
                    slot.req = req;
                    slot.msg = posted;
                    posted += 1;
                }
                Ok(_) => {}
                Err(code) => break Err(fail(code, "irecv", completed, bytes)),
            }
        }
        if completed < posted {
            let slot = &mut slots[completed % s.window];
            let mut size = [0i32; 8];
            match net.test(slot.req, Some(&mut size)) {
                Ok(true) => {
                    let want = s.size(completed);
                    assert_eq!(size[0] as usize, want, "size of message {completed}");
                    assert!(
                        slot.buf[..want] == pattern(s.seed + completed as u64, want)[..],
                        "message {completed} ({want} bytes) arrived corrupted"
                    );
                    bytes += want as u64;
                    completed += 1;
                    gaps.completed();
                }
                Ok(false) => {}
                Err(code) => break Err(fail(code, "test (receive)", completed, bytes)),
            }
        }
    };
    finish(net, comm, slots, r, (completed, bytes, gaps), t0)
}

/// The WARN lines the plugin logged so far.
pub fn warnings() -> Vec<String> {
    client::logged_lines()
        .into_iter()
        .filter(|l| l.level <= nccl_net_erdma::ffi::NCCL_LOG_WARN)
        .map(|l| l.text)
        .collect()
}

/// Every line the plugin logged so far, at any level.
pub fn logged() -> Vec<String> {
    client::logged_lines().into_iter().map(|l| l.text).collect()
}

/// The bytes each rail carried, from the plugin's close summary of the last `dir` ("tx" or
/// "rx") comm: `... (rails rxe0: B bytes in M messages, E errors; rxe1: ...)`.
pub fn rail_bytes(dir: &str) -> Vec<(String, u64)> {
    let line = client::logged_lines()
        .into_iter()
        .rev()
        .find(|l| l.text.contains(&format!("closed {dir} comm")))
        .unwrap_or_else(|| panic!("no {dir} close summary"))
        .text;
    let rails = line
        .split("(rails ")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .unwrap_or("");
    rails
        .split("; ")
        .filter_map(|r| {
            let (name, rest) = r.split_once(": ")?;
            let bytes = rest.split_whitespace().next()?.parse().ok()?;
            Some((name.to_string(), bytes))
        })
        .collect()
}
