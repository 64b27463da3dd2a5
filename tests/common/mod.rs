//! Shared helpers of the conformance suite: load the built plugin through its C ABI (as
//! NCCL does), connect loopback pairs by polling connect/accept alternately, move verified
//! data, and re-run single tests in child processes (fresh plugin state, own environment,
//! optionally an own network namespace).

#![allow(dead_code, unused_imports)]

use std::{
    path::PathBuf,
    process::{Command, Output},
    sync::Once,
    time::{Duration, Instant},
};

pub use nccl_net_erdma::ffi::ncclResult_t;
pub use nccl_net_erdma_tools::client::{
    self, pattern, Net, Opaque, ALL_VERSIONS, OLD_VERSIONS, VERSIONS,
};

/// `NCCL_PTR_HOST`.
pub const HOST: i32 = 1;
/// `NCCL_PTR_CUDA`.
pub const CUDA: i32 = 2;
/// `NCCL_PTR_DMABUF`.
pub const DMABUF: i32 = 4;
/// Generous bound for anything that should complete at once on loopback.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// The RDMA device the verbs tests use (`NCCL_ERDMA_TEST_DEVICE`, e.g. `rxe0` in the
/// Soft-RoCE tier); `None` runs the suite over tcp.
pub fn verbs_device() -> Option<String> {
    std::env::var("NCCL_ERDMA_TEST_DEVICE")
        .ok()
        .filter(|d| !d.is_empty())
}

/// Environment every test runs with: the verbs transport on the test device when one is
/// named, else tcp; bootstrap on loopback only.
pub fn setup() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        match verbs_device() {
            Some(dev) => {
                std::env::set_var("NCCL_ERDMA_TRANSPORT", "verbs");
                std::env::set_var("NCCL_IB_HCA", format!("={dev}"));
            }
            None => std::env::set_var("NCCL_ERDMA_TRANSPORT", "tcp"),
        }
        std::env::set_var("NCCL_SOCKET_IFNAME", "lo");
    });
}

/// The device name `getProperties` should report.
pub fn expected_device_name() -> String {
    verbs_device().unwrap_or_else(|| "erdma-tcp-lo".to_string())
}

/// Panics with the reason when the verbs tests cannot run here (they are `#[ignore]`d and
/// run by the Soft-RoCE tier with `--include-ignored`).
pub fn require_verbs() -> String {
    verbs_device().expect(
        "this test needs an RDMA device: set NCCL_ERDMA_TEST_DEVICE (the Soft-RoCE tier does)",
    )
}

/// The plugin under test.
pub fn lib() -> PathBuf {
    client::default_library()
}

/// Opens and initialises version `v`.
pub fn open(v: u32) -> Net {
    setup();
    let mut net = Net::open(&lib(), v).unwrap_or_else(|e| panic!("{e}"));
    net.init().expect("init");
    net
}

/// Polls `f` until it returns a non-NULL pointer or the deadline passes.
pub fn poll_until(what: &str, mut f: impl FnMut() -> Opaque) -> Opaque {
    let start = Instant::now();
    loop {
        let p = f();
        if !p.is_null() {
            return p;
        }
        assert!(start.elapsed() < DEADLINE, "{what} did not complete");
        std::hint::spin_loop();
    }
}

/// A connected loopback pair on device 0: (send comm, recv comm).
pub fn connect_pair(net: &Net) -> (Opaque, Opaque) {
    connect_pair_on(net, 0)
}

/// Polls `isend` until it posts, testing receive `rreq` (the one this send is for) between
/// tries, as NCCL's proxy progresses every request it holds on each pass. Setup is one-way:
/// a receive posted before its sender was up announces its buffers once one of the
/// receiver's own calls has heard the sender (NCCL's IB transport has `irecv` wait for that
/// too), so a driver that only retried the send would wait forever. The receive cannot
/// finish before this send is posted.
pub fn isend_testing(net: &Net, rreq: Opaque, mut isend: impl FnMut() -> Opaque) -> Opaque {
    poll_until("isend", || {
        let sreq = isend();
        if sreq.is_null() {
            let done = net.test(rreq, None).expect("test of the receive");
            assert!(!done, "a receive finished before its send was posted");
        }
        sreq
    })
}

/// A connected loopback pair on device `dev`: (send comm, recv comm).
pub fn connect_pair_on(net: &Net, dev: i32) -> (Opaque, Opaque) {
    let mut handle = [0u8; 128];
    let listen = net.listen(dev, &mut handle).expect("listen");
    let (mut send, mut recv) = (Opaque::NULL, Opaque::NULL);
    let start = Instant::now();
    // NCCL polls connect and accept from one thread: neither may block.
    while send.is_null() || recv.is_null() {
        if send.is_null() {
            send = net.connect(dev, &mut handle).expect("connect");
        }
        if recv.is_null() {
            recv = net.accept(listen).expect("accept");
        }
        assert!(
            start.elapsed() < DEADLINE,
            "connect/accept did not complete"
        );
    }
    net.close_listen(listen).expect("closeListen");
    (send, recv)
}

/// Closes a pair from [`connect_pair`] and finalizes the client's context (v11), asserting
/// each call succeeds.
pub fn close_pair(net: &mut Net, s: Opaque, r: Opaque) {
    net.close_send(s).expect("closeSend");
    net.close_recv(r).expect("closeRecv");
    net.finalize().expect("finalize");
}

/// A buffer registered on `comm`.
pub struct Reg {
    pub buf: Vec<u8>,
    pub mh: Opaque,
}

pub fn reg(net: &Net, comm: Opaque, buf: Vec<u8>) -> Reg {
    let mut buf = buf;
    // Registering 0 bytes is fine, but give the buffer an address.
    buf.reserve(1);
    let mh = net
        .reg_mr(comm, buf.as_mut_ptr(), buf.len(), HOST)
        .expect("regMr");
    Reg { buf, mh }
}

pub fn dereg(net: &Net, comm: Opaque, r: Reg) {
    net.dereg_mr(comm, r.mh).expect("deregMr");
}

/// Tests `req` until done; returns the sizes it reports (`n` of them).
pub fn wait(net: &Net, req: Opaque, n: usize) -> Vec<i32> {
    let mut sizes = [-7i32; 64];
    let start = Instant::now();
    while !net.test(req, Some(&mut sizes)).expect("test") {
        assert!(start.elapsed() < DEADLINE, "request did not complete");
    }
    sizes[..n].to_vec()
}

/// Sends `send_len` bytes into a receive of `recv_len` and checks every byte and both
/// reported sizes.
pub fn transfer(net: &Net, s: Opaque, r: Opaque, send_len: usize, recv_len: usize, seed: u64) {
    let mut src = reg(net, s, pattern(seed, send_len));
    let mut dst = reg(net, r, vec![0u8; recv_len]);
    let rreq = poll_until("irecv", || {
        net.irecv(
            r,
            &[(dst.buf.as_mut_ptr(), recv_len)],
            &[seed as i32],
            &[dst.mh],
            false,
        )
        .expect("irecv")
    });
    let sreq = isend_testing(net, rreq, || {
        net.isend(s, src.buf.as_mut_ptr(), send_len, seed as i32, src.mh)
            .expect("isend")
    });
    let (mut sdone, mut rdone) = (false, false);
    let (mut ssize, mut rsize) = ([0i32; 1], [0i32; 64]);
    let start = Instant::now();
    while !(sdone && rdone) {
        if !sdone {
            sdone = net.test(sreq, Some(&mut ssize)).expect("test send");
        }
        if !rdone {
            rdone = net.test(rreq, Some(&mut rsize)).expect("test recv");
        }
        assert!(
            start.elapsed() < DEADLINE,
            "transfer of {send_len} bytes hung"
        );
    }
    assert_eq!(ssize[0] as usize, send_len, "send size");
    assert_eq!(
        rsize[0] as usize, send_len,
        "received size is the real size"
    );
    assert!(
        dst.buf[..send_len] == src.buf[..],
        "payload of {send_len} bytes differs"
    );
    assert!(
        dst.buf[send_len..].iter().all(|b| *b == 0),
        "bytes past the message touched"
    );
    dereg(net, s, src);
    dereg(net, r, dst);
}

/// Sends `pattern(i, sizes[i])` with tag 7 for each `i`, each checked complete with its size.
pub fn send_patterns(net: &Net, s: Opaque, sizes: &[usize]) {
    for (i, &size) in sizes.iter().enumerate() {
        let mut src = reg(net, s, pattern(i as u64, size));
        let req = poll_until("isend", || {
            net.isend(s, src.buf.as_mut_ptr(), size, 7, src.mh).unwrap()
        });
        assert_eq!(wait(net, req, 1), vec![size as i32], "send {i}");
        dereg(net, s, src);
    }
}

/// Receives what [`send_patterns`] sends, into buffers `slack` bytes larger, checking every
/// reported size and every byte.
pub fn recv_patterns(net: &Net, r: Opaque, sizes: &[usize], slack: usize) {
    for (i, &size) in sizes.iter().enumerate() {
        let mut dst = reg(net, r, vec![0u8; size + slack]);
        let req = poll_until("irecv", || {
            net.irecv(
                r,
                &[(dst.buf.as_mut_ptr(), size + slack)],
                &[7],
                &[dst.mh],
                false,
            )
            .unwrap()
        });
        assert_eq!(wait(net, req, 1), vec![size as i32], "receive {i}");
        assert!(
            dst.buf[..size] == pattern(i as u64, size)[..],
            "message {i}"
        );
        dereg(net, r, dst);
    }
}

/// True in a child started by [`run_child`] or [`child_command`].
pub fn is_child() -> bool {
    std::env::var_os("CONFORMANCE_CHILD").is_some()
}

/// The libtest name of test function `$f`, which must be defined in the calling module: the
/// module path below the crate root, then the name (`peers::child_victim_sends` in a module
/// `peers`, plain `child_sender` at the root). Names a child test for [`run_child`] and
/// [`child_command`], which match it exactly; it does not compile unless `$f` is a function
/// in scope.
macro_rules! test_name {
    ($f:ident) => {{
        let _: fn() = $f;
        let path: &'static str = concat!(module_path!(), "::", stringify!($f));
        // module_path!() starts with the test target's crate name, which libtest leaves out.
        path.split_once("::").map_or(path, |(_, name)| name)
    }};
}
pub(crate) use test_name;

/// Arguments that make this test binary run test `name` (its full name, see [`test_name!`])
/// and nothing else, though it is `#[ignore]`d, with its output shown.
fn child_args(name: &str) -> [&str; 5] {
    [
        name,
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ]
}

/// Marks a child of this test binary as one ([`is_child`]) and points it at the same plugin.
fn child_env(cmd: &mut Command) -> &mut Command {
    cmd.env("CONFORMANCE_CHILD", "1")
        .env("NCCL_ERDMA_PLUGIN_LIB", lib())
}

/// This test binary, set up to run test `name` (its full name, see [`test_name!`]) alone as
/// a child; the caller adds its own environment, pipes, and waits for it.
pub fn child_command(name: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().expect("current_exe"));
    cmd.args(child_args(name));
    child_env(&mut cmd);
    cmd
}

/// Runs test `name` of this binary (its full name, see [`test_name!`]) in a fresh process
/// with `env` (and `unset` removed); `netns`: in a private network namespace.
pub fn run_child(name: &str, env: &[(&str, &str)], unset: &[&str], netns: bool) -> Output {
    let sandbox = if netns { Sandbox::NetNs } else { Sandbox::None };
    run_child_in(sandbox, name, env, unset)
}

/// Where a child test runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sandbox {
    /// As this process does.
    None,
    /// In a private network namespace whose only interface is loopback: garbage handles and
    /// addresses never reach a real network.
    NetNs,
    /// In a private mount namespace where the file that says "CUDA peer memory is loaded"
    /// exists (a tmpfs over /sys/kernel/mm): the plugin then offers GPUDirect, so host
    /// memory can be registered as CUDA memory. Needs root (the Soft-RoCE VM).
    PeerMemory,
}

/// [`run_child`] in `sandbox`.
pub fn run_child_in(sandbox: Sandbox, name: &str, env: &[(&str, &str)], unset: &[&str]) -> Output {
    setup();
    let exe = std::env::current_exe().expect("current_exe");
    let wrap = |unshare: &str, script: &str| {
        let mut c = Command::new("unshare");
        c.args([unshare, "sh", "-c", script])
            .arg(&exe)
            .args(child_args(name));
        c
    };
    let mut cmd = match sandbox {
        Sandbox::None => {
            let mut c = Command::new(&exe);
            c.args(child_args(name));
            c
        }
        Sandbox::NetNs => wrap("-n", "ip link set lo up && exec \"$0\" \"$@\""),
        Sandbox::PeerMemory => wrap(
            "-m",
            "mount -t tmpfs none /sys/kernel/mm && \
             mkdir -p /sys/kernel/mm/memory_peers/nv_mem && \
             echo 1.0 > /sys/kernel/mm/memory_peers/nv_mem/version && exec \"$0\" \"$@\"",
        ),
    };
    child_env(&mut cmd).env("NCCL_SOCKET_IFNAME", "lo");
    for k in unset {
        cmd.env_remove(k);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("spawning the child test");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("1 passed"),
        "child {name} did not pass ({}):\n{}\n{}",
        out.status,
        text,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}
