//! Case 1, strangers on a listen port: a port scanner, an HTTP client or a peer speaking
//! another protocol version is rejected with a WARN saying why, its connection is closed, and
//! the real peer still connects on the same listener with its data intact.

use std::{
    io::{ErrorKind, Read, Write},
    net::{Shutdown, TcpStream},
    thread,
    time::{Duration, Instant},
};

use crate::common::*;
use crate::support::*;
use nccl_net_erdma::protocol::{self, Handle, MsgKind};

struct Stranger {
    name: &'static str,
    bytes: Vec<u8>,
    /// Close the stranger's socket right after sending.
    close: bool,
    /// What the WARN about it must say.
    warn: &'static str,
}

fn frame(kind_raw: [u8; 2], magic_xor: u8, version: u16, len: u32, payload: &[u8]) -> Vec<u8> {
    let mut h = protocol::encode_header(MsgKind::Hello, 0).to_vec();
    h[0] ^= magic_xor;
    h[4..6].copy_from_slice(&version.to_le_bytes());
    h[6..8].copy_from_slice(&kind_raw);
    h[8..12].copy_from_slice(&len.to_le_bytes());
    h.extend_from_slice(payload);
    h
}

fn strangers(nonce: u64) -> Vec<Stranger> {
    let hello_kind = (MsgKind::Hello as u16).to_le_bytes();
    let version = protocol::handle::PROTOCOL_VERSION;
    let hello = |nonce: u64, transport: u8| {
        let mut p = nonce.to_le_bytes().to_vec();
        p.push(transport);
        p
    };
    let ours = our_transport() as u8;
    let good = hello(nonce, ours);
    let s = |name, bytes, close, warn| Stranger {
        name,
        bytes,
        close,
        warn,
    };
    vec![
        s(
            "garbage (an HTTP request)",
            b"GET / HTTP/1.0\r\nHost: x\r\n\r\n".to_vec(),
            false,
            "magic",
        ),
        s(
            "wrong magic",
            frame(hello_kind, 0xff, version, 9, &good),
            false,
            "magic",
        ),
        s(
            "wrong version",
            frame(hello_kind, 0, version + 1, 9, &good),
            false,
            "protocol version",
        ),
        s(
            "unknown message type",
            frame([99, 0], 0, version, 9, &good),
            false,
            "unknown handshake message type 99",
        ),
        s(
            "oversized message",
            frame(
                hello_kind,
                0,
                version,
                (protocol::MAX_PAYLOAD + 1) as u32,
                &good,
            ),
            false,
            "exceeds",
        ),
        s(
            "truncated message, then close",
            frame(hello_kind, 0, version, 100, &good),
            true,
            "closed the connection",
        ),
        s(
            "truncated header, then close",
            frame(hello_kind, 0, version, 9, &[])[..5].to_vec(),
            true,
            "closed the connection",
        ),
        s("closes at once", Vec::new(), true, "closed the connection"),
        s(
            "hello for another listener (wrong nonce)",
            frame(hello_kind, 0, version, 9, &hello(nonce ^ 1, ours)),
            false,
            "another listener",
        ),
        s(
            "hello too short",
            frame(hello_kind, 0, version, 4, &good[..4]),
            false,
            "field `nonce` needs 8 bytes",
        ),
        s(
            "hello naming an unknown transport",
            frame(hello_kind, 0, version, 9, &hello(nonce, 77)),
            false,
            "unknown transport 77",
        ),
        s(
            "a move message instead of a hello",
            frame((MsgKind::Move as u16).to_le_bytes(), 0, version, 0, &[]),
            false,
            "expected a hello",
        ),
        s(
            "silent until the timeout",
            Vec::new(),
            false,
            "no hello within",
        ),
    ]
}

/// Connects a pair over an existing listener by polling connect and accept alternately.
fn pair_on(net: &Net, listen: Opaque, handle: &mut [u8; NCCL_HANDLE]) -> (Opaque, Opaque) {
    let (mut send, mut recv) = (Opaque::NULL, Opaque::NULL);
    let start = Instant::now();
    while send.is_null() || recv.is_null() {
        if send.is_null() {
            send = net.connect(0, handle).expect("connect of the real peer");
        }
        if recv.is_null() {
            recv = net.accept(listen).expect("accept of the real peer");
        }
        assert!(start.elapsed() < DEADLINE, "the real peer did not connect");
    }
    (send, recv)
}

/// Asserts the stranger's socket was closed by the plugin (EOF or reset).
fn assert_closed_by_plugin(sock: &mut TcpStream, what: &str) {
    sock.set_read_timeout(Some(DEADLINE)).unwrap();
    let mut b = [0u8; 64];
    loop {
        match sock.read(&mut b) {
            Ok(0) => return,
            Ok(_) => continue, // a Reject message, if any: read on to the end
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return,
            Err(e) => panic!("{what}: the plugin kept the stranger's connection open ({e})"),
        }
    }
}

#[test]
fn strangers_are_rejected_with_a_warn_and_the_peer_still_connects() {
    // The silent stranger is dropped after NCCL_ERDMA_CONNECT_TIMEOUT_MS.
    report_child(&run_child(
        test_name!(child_strangers),
        &[("NCCL_ERDMA_CONNECT_TIMEOUT_MS", "1000")],
        &[],
        false,
    ));
}

#[test]
#[ignore = "entry point of a child process"]
fn child_strangers() {
    if !is_child() {
        return;
    }
    let (mut net, base) = open_warm(11);
    let mut handle = [0u8; NCCL_HANDLE];
    for (i, stranger) in strangers(0).iter().enumerate() {
        let listen = net.listen(0, &mut handle).unwrap();
        let h = Handle::decode(plugin_part(&mut handle)).unwrap();
        // Rebuild the stranger's bytes with this listener's nonce where it matters.
        let st = &strangers(h.nonce)[i];
        // Only WARNs from now on: the kernel may give a later stranger an earlier one's port.
        let seen = warns().len();
        let mut sock = TcpStream::connect(h.addr).expect("stranger connects");
        let me = sock.local_addr().unwrap();
        if !st.bytes.is_empty() {
            sock.write_all(&st.bytes).unwrap();
        }
        if st.close {
            sock.shutdown(Shutdown::Both).unwrap();
        }
        let needle = format!("rejected bootstrap connection from {me}");
        let start = Instant::now();
        let warn = loop {
            let comm = net
                .accept(listen)
                .expect("a stranger is no error of accept");
            assert!(comm.is_null(), "{}: a stranger was accepted", st.name);
            if let Some(w) = warns().into_iter().skip(seen).find(|w| w.contains(&needle)) {
                break w;
            }
            assert!(
                start.elapsed() < DEADLINE,
                "{}: no WARN about the stranger",
                st.name
            );
            thread::sleep(Duration::from_millis(1));
        };
        assert!(warn.contains(st.warn), "{}: {warn}", st.name);
        println!(
            "reliability: stranger '{}': rejected in {} ms: {warn}",
            stranger.name,
            start.elapsed().as_millis()
        );
        if !st.close {
            assert_closed_by_plugin(&mut sock, st.name);
        }
        // The real peer still gets in on the same listener, and its data is intact.
        let (s, r) = pair_on(&net, listen, &mut handle);
        transfer(&net, s, r, 4099, 8192, i as u64);
        net.close_send(s).unwrap();
        net.close_recv(r).unwrap();
        net.close_listen(listen).unwrap();
        drop(sock);
        assert_eq!(fd_count(), base, "{}: fds after the stranger", st.name);
    }

    // A silent stranger and the real peer at the same time: the peer is not held up, and
    // closing the listener closes the stranger's connection too.
    let listen = net.listen(0, &mut handle).unwrap();
    let addr = Handle::decode(plugin_part(&mut handle)).unwrap().addr;
    let mut silent = TcpStream::connect(addr).unwrap();
    let (s, r) = pair_on(&net, listen, &mut handle);
    transfer(&net, s, r, 100, 100, 99);
    net.close_listen(listen).unwrap();
    assert_closed_by_plugin(&mut silent, "silent stranger at closeListen");
    net.close_send(s).unwrap();
    net.close_recv(r).unwrap();
    drop(silent);
    assert_eq!(fd_count(), base, "fds after the silent stranger");
    net.finalize().unwrap();
}

#[test]
fn a_flood_of_silent_strangers_does_not_lock_out_the_peer() {
    run_child(test_name!(child_stranger_flood), &[], &[], false);
}

#[test]
#[ignore = "entry point of a child process"]
fn child_stranger_flood() {
    if !is_child() {
        return;
    }
    let (mut net, base) = open_warm(11);
    let mut handle = [0u8; NCCL_HANDLE];
    let listen = net.listen(0, &mut handle).unwrap();
    let addr = Handle::decode(plugin_part(&mut handle)).unwrap().addr;
    // The real peer starts first (connect returns once its hello is in the listener's
    // socket), then 40 port scanners connect and say nothing, before the listener's owner
    // gets to run accept.
    let mut peer_handle = handle;
    let send = connected(&net, &mut peer_handle).expect("connect");
    let flood: Vec<TcpStream> = (0..40)
        .map(|_| TcpStream::connect(addr).expect("stranger connects"))
        .collect();
    let mut recv = Opaque::NULL;
    let start = Instant::now();
    while recv.is_null() {
        recv = net.accept(listen).expect("accept");
        assert!(
            start.elapsed() < DEADLINE,
            "the real peer was locked out by the flood"
        );
    }
    transfer(&net, send, recv, 5000, 5000, 1);
    net.close_send(send).unwrap();
    net.close_recv(recv).unwrap();
    net.close_listen(listen).unwrap();
    drop(flood);
    assert_eq!(fd_count(), base, "fds after the flood");
    net.finalize().unwrap();
}
