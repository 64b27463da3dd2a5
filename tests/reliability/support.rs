//! What the reliability cases share: counts of this process's fds, threads and resident
//! memory, the WARN lines the plugin logged, the error codes the cases expect, and a peer
//! in a child process of this binary that a case can SIGKILL (`Victim`).

use std::{
    io::{BufRead, BufReader, Write},
    process::{Child, ChildStdout, Stdio},
    thread,
    time::{Duration, Instant},
};

use crate::common::*;
use nccl_net_erdma::protocol::{TransportKind, HANDLE_SIZE};

/// NCCL's handle buffer (v5 and later): the plugin reads and writes its first `HANDLE_SIZE`
/// bytes.
pub const NCCL_HANDLE: usize = 128;

/// The bytes of NCCL's buffer `b` the plugin reads and writes.
pub fn plugin_part(b: &mut [u8; NCCL_HANDLE]) -> &mut [u8; HANDLE_SIZE] {
    (&mut b[..HANDLE_SIZE])
        .try_into()
        .expect("HANDLE_SIZE bytes")
}

/// The plugin's handle bytes `h` in NCCL's buffer.
pub fn nccl_handle(h: &[u8; HANDLE_SIZE]) -> [u8; NCCL_HANDLE] {
    let mut b = [0u8; NCCL_HANDLE];
    b[..HANDLE_SIZE].copy_from_slice(h);
    b
}

pub const INTERNAL: ncclResult_t = ncclResult_t::ncclInternalError;
pub const USAGE: ncclResult_t = ncclResult_t::ncclInvalidUsage;
pub const REMOTE: ncclResult_t = ncclResult_t::ncclRemoteError;

// ---------------------------------------------------------------------------------------
// Process resources and log helpers

/// Open file descriptors of this process.
pub fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .count()
}

/// Threads of this process.
pub fn thread_count() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .count()
}

/// Resident set size in KiB.
pub fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status")
}

/// Polls `f` until it returns `want` (a thread that was joined can linger in
/// /proc/self/task for a moment); returns the last value.
pub fn settles(want: usize, f: impl Fn() -> usize) -> usize {
    let start = Instant::now();
    loop {
        let v = f();
        if v == want || start.elapsed() > Duration::from_secs(5) {
            return v;
        }
        thread::sleep(Duration::from_millis(5));
    }
}

/// WARN lines (level 2) logged so far.
pub fn warns() -> Vec<String> {
    client::logged_lines()
        .into_iter()
        .filter(|l| l.level == 2)
        .map(|l| l.text)
        .collect()
}

/// The transport the plugin under test uses.
pub fn our_transport() -> TransportKind {
    if verbs_device().is_some() {
        TransportKind::Verbs
    } else {
        TransportKind::Tcp
    }
}

/// Opens and initialises version `v` and warms it up (a first listener and connection,
/// closed again), so that what is counted afterwards is what the case opens; returns it
/// with the count of open fds.
pub fn open_warm(v: u32) -> (Net, usize) {
    let net = open(v);
    let (s, r) = connect_pair(&net);
    net.close_send(s).unwrap();
    net.close_recv(r).unwrap();
    let fds = fd_count();
    (net, fds)
}

// ---------------------------------------------------------------------------------------
// Failing peers: waiting for the error, and a peer in a child process

/// Polls `connect` with `handle` until it returns the comm (its hello is out: a connect
/// never waits for the peer's accept) or fails.
pub fn connected(net: &Net, handle: &mut [u8; NCCL_HANDLE]) -> Result<Opaque, ncclResult_t> {
    let start = Instant::now();
    loop {
        match net.connect(0, handle) {
            Ok(c) if c.is_null() => assert!(
                start.elapsed() < DEADLINE,
                "connect neither returned nor failed within {DEADLINE:?}"
            ),
            r => return r,
        }
        thread::sleep(Duration::from_millis(1));
    }
}

/// Polls an idle `isend` on `send` (nothing is sent: no receive is posted) until it fails;
/// closes the comm and returns the error.
pub fn send_error(net: &Net, send: Opaque, what: &str, start: Instant) -> ncclResult_t {
    loop {
        match net.isend(send, std::ptr::null_mut(), 0, 0, Opaque::NULL) {
            Ok(r) if r.is_null() => assert!(
                start.elapsed() < DEADLINE,
                "{what}: isend did not fail within {DEADLINE:?}"
            ),
            Ok(_) => panic!("{what}: a send was posted"),
            Err(e) => {
                net.close_send(send).unwrap();
                return e;
            }
        }
        thread::sleep(Duration::from_millis(1));
    }
}

/// The error of a connection to `handle`: `connect`'s own (the listener unreachable), or
/// else the first error of the comm it returned (the peer gone before it answered). Returns
/// the code and the time it took.
pub fn connect_error(
    net: &Net,
    handle: &mut [u8; NCCL_HANDLE],
    what: &str,
) -> (ncclResult_t, Duration) {
    let start = Instant::now();
    match connected(net, handle) {
        Ok(send) => (send_error(net, send, what, start), start.elapsed()),
        Err(e) => (e, start.elapsed()),
    }
}

/// A child process of this binary acting as the peer; SIGKILLed on drop at the latest.
pub struct Victim {
    child: Child,
    out: BufReader<ChildStdout>,
    log: String,
}

impl Victim {
    pub fn spawn(name: &str, env: &[(&str, &str)]) -> Self {
        let mut child = child_command(name)
            .env_remove("NCCL_IB_TIMEOUT")
            .env_remove("NCCL_IB_RETRY_CNT")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawning the peer");
        let out = BufReader::new(child.stdout.take().unwrap());
        Victim {
            child,
            out,
            log: String::new(),
        }
    }

    /// Reads the peer's output up to its line `VICTIM <what> ...`; returns the rest.
    pub fn expect(&mut self, what: &str) -> String {
        let marker = format!("VICTIM {what}");
        loop {
            let mut line = String::new();
            let n = self.out.read_line(&mut line).unwrap();
            assert!(n > 0, "the peer exited before '{marker}':\n{}", self.log);
            self.log.push_str(&line);
            // libtest prints "test <name> ... " without a newline before the test's output.
            if let Some(at) = line.find(&marker) {
                return line[at + marker.len()..].trim().to_string();
            }
        }
    }

    pub fn kill(&mut self) {
        self.child.kill().expect("SIGKILL");
        let status = self.child.wait().unwrap();
        assert!(!status.success(), "the peer was killed");
    }
}

impl Drop for Victim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What the peer does after its last complete message: parks without progressing.
pub fn park() -> ! {
    std::io::stdout().flush().unwrap();
    thread::sleep(Duration::from_secs(60));
    panic!("the peer was not killed within 60 s");
}

/// Shows the `reliability:` lines (outcomes, times to error) a child printed.
pub fn report_child(out: &std::process::Output) {
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        // libtest prints "test <name> ... " without a newline before the test's output.
        if let Some(at) = line.find("reliability:") {
            eprintln!("{}", &line[at..]);
        }
    }
}
