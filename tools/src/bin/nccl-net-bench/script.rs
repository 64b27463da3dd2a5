//! `--script R`: the scripted run behind scripts/perf/cpu-cost.sh, in which every plugin call's
//! outcome is known before it is made, so that callgrind can count the instructions of each
//! kind of call without estimating how many idle polls a run happened to make.
//!
//! One process holds both ends of one connection (it listens, connects to itself and
//! accepts) and repeats one round. A round moves `W` (`--window`) messages of the first
//! `--sizes` size (default 8 bytes), with `K` (`--script-idle`) idle calls per message:
//!
//! 1. sender: K x W `isend`s of the round's first message before any receive is posted,
//!    each returning NULL (bin `isend_idle`);
//! 2. receiver: W `irecv`s, each accepted (bin `irecv`);
//! 3. a wait outside the plugin (`--script-wait` us): the clear-to-sends land;
//! 4. receiver: K `test`s of each receive, none done, nothing being sent yet
//!    (bin `test_recv_idle`);
//! 5. sender: W `isend`s, each accepted (bin `isend`);
//! 6. a wait outside the plugin: the data lands and both ends' completions arrive;
//! 7. sender: one `test` of each send, each done (bin `test_send`);
//! 8. receiver: one `test` of each receive, each done, size and data checked
//!    (bin `test_recv`).
//!
//! After [`WARMUP_ROUNDS`] rounds counted nowhere come the phases, one per bin, R rounds
//! each. In the phase of bin `b` the calls of `b` go through its counting function
//! (`count_<b>` below; callgrind's `--toggle-collect` names them, so it collects
//! instructions only inside them) and every other call goes straight to the plugin; then
//! [`phase_end`] (callgrind's `--dump-after`) closes the phase's profile (the warm-up gets one
//! too, with nothing collected). So every phase makes the same calls, and each profile holds
//! exactly the calls of one bin, whose number and outcome its `script-phase` line states.
//!
//! A call due to succeed that finds the network slower than the wait (a *miss*: an `isend`
//! whose clear-to-send has not landed, a `test` whose completion has not arrived; only verbs
//! can miss, tcp over loopback delivers within the sending call) is repeated after a longer
//! wait through the same path, and a phase whose counted bin missed is run again (up to
//! [`MAX_ATTEMPTS`] times; its `script-phase` line says `kept=no`), so a kept phase counted
//! exactly the calls it names. Plugin work done every n-th call (n a power of two up to 256:
//! a signaled clear-to-send write every 8, a CQ poll every 64 idle isends, slow checks every
//! 256 polls) falls alike into every phase when R is a multiple of 256.

use std::{
    ffi::c_int,
    hint::black_box,
    io::Write,
    time::{Duration, Instant},
};

use nccl_net_erdma::ffi::NCCL_PTR_HOST;
use nccl_net_erdma_tools::client::{Code, Net, Opaque};

use crate::{
    args::{Options, Role},
    conn::irecv_group,
    data::{check_pattern, fill, seed, Arena, Layout},
    plan::MAX_GROUP,
    plugin::{open_plugin, set_env, PluginResult},
    poll::Watchdog,
    Res,
};

/// Rounds before the first phase, counted nowhere (first-call costs, the rings' first lap).
pub const WARMUP_ROUNDS: usize = 64;
/// Most attempts of one phase.
pub const MAX_ATTEMPTS: u32 = 5;
/// Default wait on verbs (microseconds); tcp over loopback needs none.
pub const VERBS_WAIT_US: u64 = 1000;
/// How long one call due to succeed may go on missing.
const MISS_TIMEOUT: Duration = Duration::from_secs(30);
/// Pattern stream of the scripted messages (see [`crate::data`]).
const STREAM_SCRIPT: u64 = 4;

/// A kind of call: entry point and outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bin {
    Isend,
    Irecv,
    TestSend,
    TestRecv,
    IsendIdle,
    TestRecvIdle,
}

impl Bin {
    /// The phases, in order.
    pub const ALL: [Bin; 6] = [
        Bin::Isend,
        Bin::Irecv,
        Bin::TestSend,
        Bin::TestRecv,
        Bin::IsendIdle,
        Bin::TestRecvIdle,
    ];

    /// The name on `script-phase` lines (scripts/perf/cost-report.awk reads it).
    pub fn name(self) -> &'static str {
        match self {
            Bin::Isend => "isend",
            Bin::Irecv => "irecv",
            Bin::TestSend => "test_send",
            Bin::TestRecv => "test_recv",
            Bin::IsendIdle => "isend_idle",
            Bin::TestRecvIdle => "test_recv_idle",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

// ---------------------------------------------------------------------------------------
// The counting functions. scripts/perf/cost-runs.sh names them in callgrind's
// --toggle-collect (`nccl_net_bench::script::count_*`) and `phase_end` in --dump-after: they
// keep these names, are never inlined, and each differs from the others (the black_box of
// its own constant), so that no two are merged into one symbol.

#[inline(never)]
pub fn count_isend(
    net: &Net,
    comm: Opaque,
    data: *mut u8,
    size: usize,
    mh: Opaque,
) -> Result<Opaque, Code> {
    black_box(Bin::Isend as u8);
    net.isend(comm, data, size, 0, mh)
}

#[inline(never)]
pub fn count_isend_idle(
    net: &Net,
    comm: Opaque,
    data: *mut u8,
    size: usize,
    mh: Opaque,
) -> Result<Opaque, Code> {
    black_box(Bin::IsendIdle as u8);
    net.isend(comm, data, size, 0, mh)
}

#[inline(never)]
pub fn count_irecv(
    net: &Net,
    comm: Opaque,
    bufs: &[*mut u8; MAX_GROUP],
    size: usize,
    mh: Opaque,
) -> Result<Opaque, Code> {
    black_box(Bin::Irecv as u8);
    irecv_group(net, comm, bufs, 1, size, mh)
}

#[inline(never)]
pub fn count_test_send(net: &Net, req: Opaque, sizes: &mut [c_int]) -> Result<bool, Code> {
    black_box(Bin::TestSend as u8);
    net.test(req, Some(sizes))
}

#[inline(never)]
pub fn count_test_recv(net: &Net, req: Opaque, sizes: &mut [c_int]) -> Result<bool, Code> {
    black_box(Bin::TestRecv as u8);
    net.test(req, Some(sizes))
}

#[inline(never)]
pub fn count_test_recv_idle(net: &Net, req: Opaque, sizes: &mut [c_int]) -> Result<bool, Code> {
    black_box(Bin::TestRecvIdle as u8);
    net.test(req, Some(sizes))
}

/// The end of the `n`-th profile (1: the warm-up, then one per phase attempt): callgrind
/// dumps its profile on leaving this.
#[inline(never)]
pub fn phase_end(n: usize) {
    black_box(n);
}

// ---------------------------------------------------------------------------------------

/// The run's settings, from the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScriptPlan {
    pub rounds: usize,
    pub window: usize,
    pub idle: usize,
    pub size: usize,
    /// None: by transport.
    pub wait_us: Option<u64>,
}

impl ScriptPlan {
    pub fn from_options(o: &Options) -> Res<Self> {
        let Some(rounds) = o.script else {
            return Err("not a scripted run".into());
        };
        if o.role != Role::Local {
            return Err("--script runs both ends in this process: no --listen/--connect".into());
        }
        if o.group != 1 || o.conns != 1 {
            return Err(
                "--script runs one connection with single receives (--group 1, --conns 1)".into(),
            );
        }
        // The first size; the default list starts at 8 bytes.
        let size = o.sizes[0];
        Ok(ScriptPlan {
            rounds,
            window: o.window,
            idle: o.script_idle,
            size,
            wait_us: o.script_wait_us,
        })
    }

    /// Calls of `bin` per round.
    pub fn calls_per_round(&self, bin: Bin) -> usize {
        match bin {
            Bin::IsendIdle | Bin::TestRecvIdle => self.window * self.idle,
            _ => self.window,
        }
    }
}

/// Both ends of the connection and the state of the rounds.
struct Script<'a> {
    net: &'a Net,
    send: Opaque,
    recv: Opaque,
    tx: Arena,
    rx: Arena,
    layout: Layout,
    plan: ScriptPlan,
    wait: Duration,
    /// The bin whose calls go through its counting function now.
    counted: Option<Bin>,
    /// Per bin, in this phase attempt: calls made (counted or not) and misses.
    calls: [u64; 6],
    misses: [u64; 6],
    send_reqs: Vec<Opaque>,
    recv_reqs: Vec<Opaque>,
    sizes: [c_int; 64],
    /// Messages sent so far (the data patterns' index).
    sent: usize,
}

impl Script<'_> {
    fn counting(&self, bin: Bin) -> bool {
        self.counted == Some(bin)
    }

    fn isend(&mut self, bin: Bin, j: usize) -> Res<Opaque> {
        let (net, comm, size, mh) = (self.net, self.send, self.plan.size, self.tx.mh);
        let ptr = self.tx.slot_ptr(&self.layout, j);
        self.calls[bin.index()] += 1;
        let r = if self.counting(bin) {
            match bin {
                Bin::IsendIdle => count_isend_idle(net, comm, ptr, size, mh),
                _ => count_isend(net, comm, ptr, size, mh),
            }
        } else {
            net.isend(comm, ptr, size, 0, mh)
        };
        r.call(|| format!("isend ({}, message {j} of the round)", bin.name()))
    }

    fn irecv(&mut self, j: usize) -> Res<Opaque> {
        let (net, comm, size, mh) = (self.net, self.recv, self.plan.size, self.rx.mh);
        let mut bufs = [std::ptr::null_mut::<u8>(); MAX_GROUP];
        bufs[0] = self.rx.slot_ptr(&self.layout, j);
        self.calls[Bin::Irecv.index()] += 1;
        let r = if self.counting(Bin::Irecv) {
            count_irecv(net, comm, &bufs, size, mh)
        } else {
            irecv_group(net, comm, &bufs, 1, size, mh)
        };
        r.call(|| format!("irecv (message {j} of the round)"))
    }

    /// A `test` of `req`; with `Some(size)` it must report that size when done.
    fn test(&mut self, bin: Bin, req: Opaque, want: Option<usize>) -> Res<bool> {
        let net = self.net;
        self.calls[bin.index()] += 1;
        self.sizes[0] = -1;
        let n = if bin == Bin::TestSend {
            1
        } else {
            self.sizes.len()
        };
        let counting = self.counting(bin);
        let sizes = &mut self.sizes[..n];
        let r = if counting {
            match bin {
                Bin::TestSend => count_test_send(net, req, sizes),
                Bin::TestRecv => count_test_recv(net, req, sizes),
                _ => count_test_recv_idle(net, req, sizes),
            }
        } else {
            net.test(req, Some(sizes))
        };
        let done = r.call(|| format!("test ({})", bin.name()))?;
        if let (true, Some(size)) = (done, want) {
            if self.sizes[0] as usize != size {
                return Err(format!(
                    "test ({}) reported size {}, expected {size}",
                    bin.name(),
                    self.sizes[0]
                ));
            }
        }
        Ok(done)
    }

    /// One miss of a call of `bin` due to succeed, `k` misses into it since `since`: waits
    /// longer each time, and gives up after [`MISS_TIMEOUT`].
    fn missed(&mut self, bin: Bin, k: u32, since: Instant) -> Res<()> {
        self.misses[bin.index()] += 1;
        if since.elapsed() > MISS_TIMEOUT {
            return Err(format!(
                "scripted run: a {} call due to succeed still does not after {} s",
                bin.name(),
                MISS_TIMEOUT.as_secs()
            ));
        }
        let base = self.wait.max(Duration::from_micros(100));
        std::thread::sleep(base * (1 << k.min(6)));
        Ok(())
    }

    fn pause(&self) {
        if !self.wait.is_zero() {
            std::thread::sleep(self.wait);
        }
    }

    /// One round (see the module doc).
    fn round(&mut self) -> Res<()> {
        let (w, idle) = (self.plan.window, self.plan.idle);
        for _ in 0..w * idle {
            if !self.isend(Bin::IsendIdle, 0)?.is_null() {
                return Err(
                    "scripted run: an isend before any receive was posted was accepted".into(),
                );
            }
        }
        for j in 0..w {
            let r = self.irecv(j)?;
            if r.is_null() {
                return Err(format!(
                    "scripted run: irecv {j} of {w} returned NULL with nothing else in flight"
                ));
            }
            self.recv_reqs[j] = r;
            self.rx.slot(&self.layout, j).fill(0x5a);
        }
        self.pause();
        for j in 0..w {
            for _ in 0..idle {
                if self.test(Bin::TestRecvIdle, self.recv_reqs[j], None)? {
                    return Err("scripted run: a receive completed before anything was sent".into());
                }
            }
        }
        for j in 0..w {
            let seed = self.seed(j);
            fill(self.tx.slot(&self.layout, j), seed);
            let (mut k, since) = (0, Instant::now());
            self.send_reqs[j] = loop {
                let r = self.isend(Bin::Isend, j)?;
                if !r.is_null() {
                    break r;
                }
                self.missed(Bin::Isend, k, since)?;
                k += 1;
            };
        }
        self.pause();
        let size = self.plan.size;
        for j in 0..w {
            let (mut k, since) = (0, Instant::now());
            while !self.test(Bin::TestSend, self.send_reqs[j], Some(size))? {
                self.missed(Bin::TestSend, k, since)?;
                k += 1;
            }
        }
        for j in 0..w {
            let (mut k, since) = (0, Instant::now());
            while !self.test(Bin::TestRecv, self.recv_reqs[j], Some(size))? {
                self.missed(Bin::TestRecv, k, since)?;
                k += 1;
            }
            let (seed, sent) = (self.seed(j), self.sent + j);
            check_pattern(self.rx.slot(&self.layout, j), seed, || {
                format!("scripted message {sent}")
            })?;
        }
        self.sent += w;
        Ok(())
    }

    fn seed(&self, j: usize) -> u64 {
        seed(self.plan.size, STREAM_SCRIPT, 0, self.sent + j)
    }
}

/// Listens, connects to itself and accepts, polling both as NCCL's service thread does.
pub fn connect_self(net: &Net) -> Res<(Opaque, Opaque)> {
    let mut h = [0u8; 128];
    let l = net.listen(0, &mut h).call(|| "listen".into())?;
    let (mut send, mut recv) = (Opaque::NULL, Opaque::NULL);
    let mut dog = Watchdog::new();
    while send.is_null() || recv.is_null() {
        let mut progressed = false;
        if send.is_null() {
            send = net.connect(0, &mut h).call(|| "connect".into())?;
            progressed |= !send.is_null();
        }
        if recv.is_null() {
            recv = net.accept(l).call(|| "accept".into())?;
            progressed |= !recv.is_null();
        }
        if progressed {
            dog.progressed();
        } else {
            dog.idle(|| "connect/accept to this process did not complete".into())?;
        }
    }
    net.close_listen(l).call(|| "closeListen".into())?;
    Ok((send, recv))
}

fn say(line: &str) {
    println!("{line}");
    let _ = std::io::stdout().flush();
}

/// The scripted run (see the module doc); prints `script` lines for cpu-cost.sh.
pub fn run(o: &Options) -> Res<()> {
    let plan = ScriptPlan::from_options(o)?;
    if std::env::var_os("NCCL_SOCKET_IFNAME").is_none() {
        set_env("NCCL_SOCKET_IFNAME", "lo");
    }
    let mut p = open_plugin(o, None)?;
    let net = &p.net;
    // Our tcp transport completes on loopback at once; anything else may be RDMA.
    let wait_us = plan.wait_us.unwrap_or(if p.transport == "tcp" {
        0
    } else {
        VERBS_WAIT_US
    });
    // Idle pairs held open for the whole run, made first: the measured pair is the newest.
    let idle_pairs = (0..o.script_comms)
        .map(|_| connect_self(net))
        .collect::<Res<Vec<_>>>()?;
    let (send, recv) = connect_self(net)?;
    let layout = Layout::new(plan.size, plan.window, plan.window);
    let len = plan.window * layout.stride;
    let mut tx = Arena::new(len);
    let mut rx = Arena::new(len);
    let host = NCCL_PTR_HOST as i32;
    let (ptr, n) = (tx.buf.as_mut_ptr(), tx.buf.len());
    tx.mh = net
        .reg_mr(send, ptr, n, host)
        .call(|| format!("regMr of {n} bytes on the send comm"))?;
    let (ptr, n) = (rx.buf.as_mut_ptr(), rx.buf.len());
    rx.mh = net
        .reg_mr(recv, ptr, n, host)
        .call(|| format!("regMr of {n} bytes on the receive comm"))?;
    let mut s = Script {
        net,
        send,
        recv,
        tx,
        rx,
        layout,
        plan,
        wait: Duration::from_micros(wait_us),
        counted: None,
        calls: [0; 6],
        misses: [0; 6],
        send_reqs: vec![Opaque::NULL; plan.window],
        recv_reqs: vec![Opaque::NULL; plan.window],
        sizes: [0; 64],
        sent: 0,
    };
    say(&format!(
        "script transport={} device={} abi={} size={} window={} idle={} rounds={} warmup={} \
         wait_us={wait_us} idle_comms={}",
        p.transport,
        p.props.name.replace(char::is_whitespace, "_"),
        p.net.version(),
        plan.size,
        plan.window,
        plan.idle,
        plan.rounds,
        WARMUP_ROUNDS,
        idle_pairs.len()
    ));
    for _ in 0..WARMUP_ROUNDS {
        s.round()?;
    }
    // Its own profile, so that the first phase's holds only the first phase's calls.
    let mut n = 1;
    phase_end(n);
    say(&format!(
        "script-warmup n={n} rounds={WARMUP_ROUNDS} misses={}",
        s.misses.iter().sum::<u64>()
    ));
    for bin in Bin::ALL {
        for attempt in 1..=MAX_ATTEMPTS {
            s.calls = [0; 6];
            s.misses = [0; 6];
            s.counted = Some(bin);
            for _ in 0..plan.rounds {
                s.round()?;
            }
            s.counted = None;
            n += 1;
            phase_end(n);
            let (calls, misses) = (s.calls[bin.index()], s.misses[bin.index()]);
            let want = (plan.rounds * plan.calls_per_round(bin)) as u64;
            if calls != want + misses {
                return Err(format!(
                    "scripted run: phase {} made {calls} calls, expected {want} + {misses} \
                     misses",
                    bin.name()
                ));
            }
            let kept = misses == 0 || attempt == MAX_ATTEMPTS;
            say(&format!(
                "script-phase n={n} bin={} attempt={attempt} calls={calls} outcome_calls={want} \
                 misses={misses} other_misses={} kept={}",
                bin.name(),
                s.misses.iter().sum::<u64>() - misses,
                if kept { "yes" } else { "no" }
            ));
            if kept {
                break;
            }
        }
    }
    net.dereg_mr(send, s.tx.mh)
        .call(|| "deregMr (send comm)".into())?;
    net.dereg_mr(recv, s.rx.mh)
        .call(|| "deregMr (receive comm)".into())?;
    net.close_send(send).call(|| "closeSend".into())?;
    net.close_recv(recv).call(|| "closeRecv".into())?;
    for (send, recv) in idle_pairs {
        net.close_send(send)
            .call(|| "closeSend (idle pair)".into())?;
        net.close_recv(recv)
            .call(|| "closeRecv (idle pair)".into())?;
    }
    say(&format!("script-done messages={}", s.sent));
    p.finalize()
}
