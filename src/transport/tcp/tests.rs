//! The tcp transport end to end on loopback: grouped receives of every size with their
//! bytes checked, and the seed corpus of the `tcp_frames` fuzz target captured from such a
//! run (`cargo test --lib capture_the_tcp_frames_corpus -- --ignored` rewrites
//! `fuzz/corpus/tcp_frames/captured-*`).

use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::buffer::TestMem;
use crate::codec::tap;
use crate::config::Config;
use crate::oob::iface::LocalAddr;
use crate::transport::registry::{Registration, Registry};
use crate::transport::{Connector, Listener, Receiver, Sender, Tested, Transport, MAX_RECVS};

use super::frame::{TCP_RECEIVER_READS, TCP_SENDER_READS};
use super::{TcpReceiver, TcpSender, TcpTransport};

fn pair() -> (TcpTransport, TcpSender, TcpReceiver) {
    let ip: IpAddr = "127.0.0.1".parse().unwrap();
    let config = Config::from_env().unwrap();
    let bootstrap = LocalAddr {
        ifname: "lo".into(),
        ip,
    };
    let t = TcpTransport::new(&config, &bootstrap, Arc::new(Registry::default()));
    let mut listener = t.listen(0, ip).unwrap();
    let mut connector = t.connect(0, listener.handle(), None).unwrap();
    let (mut send, mut recv) = (None, None);
    let deadline = Instant::now() + Duration::from_secs(10);
    while send.is_none() || recv.is_none() {
        if send.is_none() {
            send = connector.poll().unwrap();
        }
        if recv.is_none() {
            recv = listener.poll_accept().unwrap();
        }
        assert!(Instant::now() < deadline, "no connection");
    }
    (t, send.unwrap(), recv.unwrap())
}

fn register(t: &TcpTransport, mem: &TestMem) -> u64 {
    let (keys, hold) = t.register(0, mem.addr(), mem.len(), true).unwrap();
    let reg = Registration::new(mem.addr(), mem.len(), 0, keys);
    t.registry().insert(reg, hold).unwrap()
}

/// A grouped receive of `lens.len()` buffers, one send each, bytes and sizes checked.
fn group(t: &TcpTransport, send: &TcpSender, recv: &TcpReceiver, lens: &[usize], seed: u64) {
    let mut dsts: Vec<TestMem> = lens.iter().map(|&l| TestMem::new(l, 0)).collect();
    let dst_keys: Vec<u64> = dsts.iter().map(|m| register(t, m)).collect();
    let bufs: Vec<_> = dsts.iter_mut().map(|m| m.buffer()).collect();
    let tags: Vec<i32> = (0..lens.len() as i32).collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    let r = loop {
        if let Some(r) = recv.irecv(&bufs, &tags, &dst_keys).unwrap() {
            break r;
        }
        assert!(Instant::now() < deadline);
    };
    let mut srcs: Vec<TestMem> = lens
        .iter()
        .enumerate()
        .map(|(i, &l)| TestMem::new(l, seed + i as u64))
        .collect();
    let mut sends = Vec::new();
    for (i, src) in srcs.iter_mut().enumerate() {
        let mh = register(t, src);
        let s = loop {
            if let Some(s) = send.isend(src.buffer(), i as i32, mh).unwrap() {
                break s;
            }
            assert!(Instant::now() < deadline, "isend {i}");
        };
        sends.push(s);
    }
    let mut sizes = [0u32; MAX_RECVS];
    let mut done = vec![false; sends.len()];
    let mut received = false;
    while !received || done.iter().any(|d| !d) {
        for (d, &s) in done.iter_mut().zip(&sends) {
            *d = *d || matches!(send.test(s), Tested::Done(_));
        }
        received = received
            || match recv.test(r, &mut sizes) {
                Tested::Done(_) => true,
                Tested::Pending => false,
                Tested::Failed(e) => panic!("{e}"),
            };
        assert!(Instant::now() < deadline, "group {lens:?} not done");
    }
    for (i, &l) in lens.iter().enumerate() {
        assert_eq!(sizes[i] as usize, l);
        assert_eq!(dsts[i].bytes(), TestMem::pattern(l, seed + i as u64));
    }
}

const GROUPS: [&[usize]; 4] = [&[0], &[1, 4096], &[70_000, 3, 0, 128], &[1 << 20]];

#[test]
fn grouped_receives_of_every_size_arrive_whole() {
    let (t, send, recv) = pair();
    for (i, lens) in GROUPS.iter().enumerate() {
        group(&t, &send, &recv, lens, 10 * i as u64);
    }
}

#[test]
#[ignore = "writes fuzz/corpus: run by hand when a wire format changes"]
fn capture_the_tcp_frames_corpus() {
    tap::listen();
    let (t, send, recv) = pair();
    for (i, lens) in GROUPS.iter().enumerate() {
        group(&t, &send, &recv, lens, 10 * i as u64);
    }
    let heard = tap::heard();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/tcp_frames");
    std::fs::create_dir_all(&dir).unwrap();
    let mut n = 0;
    let mut kept = std::collections::BTreeSet::new();
    for (message, bytes) in heard {
        let end = match message {
            "tcp clear-to-send frame" => TCP_SENDER_READS,
            "tcp data frame header" => TCP_RECEIVER_READS,
            _ => continue,
        };
        let seed: Vec<u8> = std::iter::once(end).chain(bytes).collect();
        if kept.insert(seed.clone()) {
            n += 1;
            std::fs::write(dir.join(format!("captured-{n}")), seed).unwrap();
        }
    }
    assert!(n >= 4, "clear-to-send frames and data headers: {n}");
}
