//! `--scale N[,N...]`: what connections cost at scale. For each N, one process opens N
//! connection pairs to itself (both ends, on device 0), moves one 64 KiB message over each
//! (from and into the same two buffers), verified, and reports per pair what the process then holds more than before: resident
//! memory, file descriptors, threads, and on RDMA devices the QPs, CQs and memory regions
//! the kernel counts (`rdma resource show`), with the connect time per pair (the first and
//! the last quarter of the pairs apart, to show whether it grows with N). Then it closes
//! them all and says what is left.

use std::{
    io::Write,
    process::Command,
    time::{Duration, Instant},
};

use nccl_net_erdma::ffi::NCCL_PTR_HOST;
use nccl_net_erdma_tools::client::{Net, Opaque};

use crate::{
    args::Options,
    data::{check_pattern, fill},
    plugin::{open_plugin, set_env, PluginResult},
    poll::Watchdog,
    script::connect_self,
    Res,
};

/// The message each pair carries.
const MESSAGE: usize = 64 << 10;

/// What the process holds at one moment.
#[derive(Debug, Clone, Copy, Default)]
struct Held {
    rss_kib: i64,
    fds: i64,
    threads: i64,
    /// QPs, CQs and MRs on all RDMA devices (None: no `rdma` tool or no device).
    rdma: Option<(i64, i64, i64)>,
}

fn status_field(status: &str, key: &str) -> i64 {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// The counts of `rdma resource show`'s summary lines (`0: rxe0: pd 3 cq 10 qp 12 ... mr 5`),
/// summed over the devices.
fn rdma_counts() -> Option<(i64, i64, i64)> {
    let out = Command::new("rdma")
        .args(["resource", "show"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut sum = (0, 0, 0);
    let mut seen = false;
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let count = |key: &str| {
            words
                .windows(2)
                .find(|w| w[0] == key)
                .and_then(|w| w[1].parse::<i64>().ok())
        };
        if let (Some(qp), Some(cq), Some(mr)) = (count("qp"), count("cq"), count("mr")) {
            sum = (sum.0 + qp, sum.1 + cq, sum.2 + mr);
            seen = true;
        }
    }
    seen.then_some(sum)
}

fn held() -> Held {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    Held {
        rss_kib: status_field(&status, "VmRSS:"),
        fds: std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as i64),
        threads: status_field(&status, "Threads:"),
        rdma: rdma_counts(),
    }
}

/// One pair: both ends of a connection of this process to itself.
struct Pair {
    send: Opaque,
    recv: Opaque,
}

/// The message's buffers, one pair for all the pairs (made and touched before the first
/// figure is read, so that they count in none).
struct Buffers {
    tx: Vec<u8>,
    rx: Vec<u8>,
}

/// Moves one message over `p`, its buffers registered for the call, and checks it.
fn carry(net: &Net, p: &Pair, b: &mut Buffers, seed: u64) -> Res<()> {
    fill(&mut b.tx, seed);
    b.rx.fill(0);
    let tx_mh = net
        .reg_mr(p.send, b.tx.as_mut_ptr(), MESSAGE, NCCL_PTR_HOST as i32)
        .call(|| "regMr (send)".into())?;
    let rx_mh = net
        .reg_mr(p.recv, b.rx.as_mut_ptr(), MESSAGE, NCCL_PTR_HOST as i32)
        .call(|| "regMr (receive)".into())?;
    let rreq = net
        .irecv(
            p.recv,
            &[(b.rx.as_mut_ptr(), MESSAGE)],
            &[7],
            &[rx_mh],
            false,
        )
        .call(|| "irecv".into())?;
    if rreq.is_null() {
        return Err("irecv of the pair's one receive returned no request".into());
    }
    let mut dog = Watchdog::new();
    let mut sreq = Opaque::NULL;
    while sreq.is_null() {
        sreq = net
            .isend(p.send, b.tx.as_mut_ptr(), MESSAGE, 7, tx_mh)
            .call(|| "isend".into())?;
        if sreq.is_null() {
            // As NCCL's proxy, the receive is progressed too: it announces its buffer once
            // it has heard the sender is up (it cannot finish before the send is posted).
            net.test(rreq, None).call(|| "test (receive)".into())?;
        }
        dog.idle(|| "isend not accepted".into())?;
    }
    let (mut sent, mut got) = (false, false);
    let mut size = [0i32; 1];
    while !(sent && got) {
        if !sent {
            sent = net.test(sreq, None).call(|| "test (send)".into())?;
        }
        if !got {
            got = net
                .test(rreq, Some(&mut size))
                .call(|| "test (receive)".into())?;
        }
        dog.idle(|| "the pair's message did not arrive".into())?;
    }
    if size[0] as usize != MESSAGE {
        return Err(format!(
            "a pair's message of {MESSAGE} bytes arrived as {}",
            size[0]
        ));
    }
    check_pattern(&b.rx, seed, || format!("pair {seed}'s message"))?;
    net.dereg_mr(p.send, tx_mh).call(|| "deregMr".into())?;
    net.dereg_mr(p.recv, rx_mh).call(|| "deregMr".into())?;
    Ok(())
}

fn per_pair(after: i64, before: i64, n: usize) -> String {
    format!("{:.1}", (after - before) as f64 / n as f64)
}

fn ms(d: Duration, n: usize) -> String {
    format!("{:.2}", d.as_secs_f64() * 1e3 / n.max(1) as f64)
}

/// The scale run (see the module doc).
pub fn run(o: &Options, counts: &[usize]) -> Res<()> {
    if std::env::var_os("NCCL_SOCKET_IFNAME").is_none() {
        set_env("NCCL_SOCKET_IFNAME", "lo");
    }
    let mut p = open_plugin(o, None)?;
    let net = &p.net;
    println!(
        "scale: {} (ncclNetPlugin_v{}, plugin \"{}\"), transport {}, device {}; one {} KiB \
         message verified per pair",
        net.path.display(),
        net.version(),
        net.name(),
        p.transport,
        p.props.name,
        MESSAGE >> 10
    );
    println!(
        "{:>6} {:>12} {:>9} {:>9} {:>8} {:>8} {:>8} {:>13} {:>13} {:>10}",
        "pairs",
        "KiB/pair",
        "fds/pair",
        "threads",
        "QPs/pair",
        "CQs/pair",
        "MRs/pair",
        "ms/pair first",
        "ms/pair last",
        "left fds"
    );
    let mut buffers = Buffers {
        tx: vec![1; MESSAGE],
        rx: vec![1; MESSAGE],
    };
    for &n in counts {
        let before = held();
        let mut pairs = Vec::with_capacity(n);
        let quarter = (n / 4).max(1);
        let (mut first, mut last) = (Duration::ZERO, Duration::ZERO);
        for i in 0..n {
            let t = Instant::now();
            let (send, recv) = connect_self(net)?;
            let took = t.elapsed();
            if i < quarter {
                first += took;
            }
            if i >= n - quarter {
                last += took;
            }
            pairs.push(Pair { send, recv });
        }
        for (i, pair) in pairs.iter().enumerate() {
            carry(net, pair, &mut buffers, i as u64 + 1)?;
        }
        let after = held();
        for pair in &pairs {
            net.close_send(pair.send).call(|| "closeSend".into())?;
            net.close_recv(pair.recv).call(|| "closeRecv".into())?;
        }
        drop(pairs);
        let closed = held();
        let rdma = |f: fn((i64, i64, i64)) -> i64| match (after.rdma, before.rdma) {
            (Some(a), Some(b)) => per_pair(f(a), f(b), n),
            _ => "-".into(),
        };
        println!(
            "{:>6} {:>12} {:>9} {:>9} {:>8} {:>8} {:>8} {:>13} {:>13} {:>10}",
            n,
            per_pair(after.rss_kib, before.rss_kib, n),
            per_pair(after.fds, before.fds, n),
            after.threads - before.threads,
            rdma(|c| c.0),
            rdma(|c| c.1),
            rdma(|c| c.2),
            ms(first, quarter),
            ms(last, quarter),
            closed.fds - before.fds
        );
        let _ = std::io::stdout().flush();
    }
    p.finalize()
}
