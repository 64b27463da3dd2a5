//! Handles that are not what they should be. Case 4: random, bit-flipped and named
//! corruptions of a handle are refused before any connection attempt. Case 9: the fuzzers'
//! committed seed corpus is what the current encoders produce, and its valid seeds decode.

use std::{io::ErrorKind, net::TcpListener, path::PathBuf};

use crate::common::*;
use crate::support::*;
use nccl_net_erdma::protocol::{
    self, handle as oob_handle, Handle, Hello, MsgKind, TransportKind, HANDLE_SIZE, MSG_HEADER,
};

// ---------------------------------------------------------------------------------------
// Case 4. Garbage handles: refused before any connection attempt

#[test]
fn garbage_handles_never_cause_a_connection_attempt() {
    run_child(
        test_name!(child_garbage_handle_fields),
        &[("NCCL_ERDMA_CONNECT_TIMEOUT_MS", "1000")],
        &[],
        true,
    );
}

/// Asserts nothing connected to `bait`.
fn assert_no_attempt(bait: &TcpListener, what: &str) {
    match bait.accept() {
        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
        Ok((_, from)) => panic!("{what}: the plugin connected to the handle's address ({from})"),
        Err(e) => panic!("{what}: {e}"),
    }
}

#[test]
#[ignore = "entry point of a child process (in its own network namespace)"]
fn child_garbage_handle_fields() {
    if !is_child() {
        return;
    }
    let (mut net, base) = open_warm(11);
    // Every handle below points at `bait`: a connection attempt would show there.
    let bait = TcpListener::bind("127.0.0.1:0").unwrap();
    bait.set_nonblocking(true).unwrap();
    let valid = Handle {
        addr: bait.local_addr().unwrap(),
        transport: our_transport(),
        nonce: 0x0123_4567_89ab_cdef,
    };
    let mut good = [0u8; HANDLE_SIZE];
    valid.encode(&mut good);

    random_handles(&net, &bait, &good);
    single_bit_flips(&net, &bait, &valid, &good);
    named_corruptions(&net, &bait, &valid, &good);

    // Control: the intact handle does reach the bait (so the checks above mean something);
    // when the bait hangs up, the comm connect returned fails.
    let mut h = nccl_handle(&good);
    let send = connected(&net, &mut h).expect("the hello went out");
    bait.set_nonblocking(false).unwrap();
    let (conn, _) = bait.accept().expect("the valid handle was used");
    drop((conn, bait));
    let err = send_error(&net, send, "bait hangs up", std::time::Instant::now());
    assert_eq!(err, REMOTE);
    assert_eq!(fd_count(), base, "fds after the garbage handles");
    net.finalize().unwrap();
}

/// Random bytes around the bait's address fields (family, port, address: bytes 10..32
/// of the layout in src/oob/handle.rs): the magic check refuses them first.
fn random_handles(net: &Net, bait: &TcpListener, good: &[u8; HANDLE_SIZE]) {
    let mut x = 0x853c_49e6_748f_ea9bu64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for i in 0..500 {
        let mut h = [0u8; NCCL_HANDLE];
        h.iter_mut().for_each(|b| *b = next() as u8);
        h[10..32].copy_from_slice(&good[10..32]);
        assert_eq!(
            net.connect(0, &mut h).unwrap_err(),
            INTERNAL,
            "random handle {i}"
        );
    }
    assert_no_attempt(bait, "random handles");
    assert!(
        warns()
            .iter()
            .any(|w| w.contains("connect:") && w.contains("magic")),
        "the WARN says why"
    );
}

/// Every single-bit corruption of a valid handle that the decoder refuses is refused by
/// connect too, with no connection attempt. (Flips the decoder accepts, e.g. in the
/// nonce or the reserved bytes, make valid handles and are skipped.)
fn single_bit_flips(net: &Net, bait: &TcpListener, valid: &Handle, good: &[u8; HANDLE_SIZE]) {
    let mut refused = 0;
    for bit in 0..HANDLE_SIZE * 8 {
        let mut h = *good;
        h[bit / 8] ^= 1 << (bit % 8);
        // What connect checks, in its order: the handle, the transport, the stage area.
        let want = match Handle::decode(&h) {
            Err(_) => INTERNAL,
            Ok(d) if d.transport != valid.transport => USAGE,
            Ok(_) if oob_handle::stage_id(&h).is_err() => INTERNAL,
            Ok(_) => continue, // still a valid handle (another nonce, port, ...): skipped
        };
        refused += 1;
        let code = net.connect(0, &mut nccl_handle(&h)).unwrap_err();
        assert_eq!(code, want, "bit {bit} flipped");
        assert_no_attempt(bait, &format!("bit {bit} flipped"));
    }
    assert!(refused >= 100, "{refused} corruptions refused");
    for (what, needle) in [("magic", "magic"), ("version", "protocol version")] {
        assert!(
            warns()
                .iter()
                .any(|w| w.contains("connect:") && w.contains(needle)),
            "a WARN names the {what}"
        );
    }
}

/// Named corruptions: the other transport, addresses nobody can connect to, and a stage
/// id that names no connect in progress.
fn named_corruptions(net: &Net, bait: &TcpListener, valid: &Handle, good: &[u8; HANDLE_SIZE]) {
    let other = match our_transport() {
        TransportKind::Tcp => TransportKind::Verbs,
        TransportKind::Verbs => TransportKind::Tcp,
    };
    let mut h = [0u8; HANDLE_SIZE];
    Handle {
        transport: other,
        ..*valid
    }
    .encode(&mut h);
    assert_eq!(
        net.connect(0, &mut nccl_handle(&h)).unwrap_err(),
        USAGE,
        "other transport"
    );
    assert!(
        warns().last().unwrap().contains("NCCL_ERDMA_TRANSPORT"),
        "the WARN names the setting"
    );
    for (what, addr) in [
        ("port 0", "127.0.0.1:0"),
        ("unspecified address", "0.0.0.0:4000"),
        ("multicast address", "224.0.0.1:4000"),
        ("unspecified v6 address", "[::]:4000"),
    ] {
        let mut h = [0u8; HANDLE_SIZE];
        Handle {
            addr: addr.parse().unwrap(),
            ..*valid
        }
        .encode(&mut h);
        let code = net.connect(0, &mut nccl_handle(&h)).unwrap_err();
        assert_eq!(code, INTERNAL, "{what}");
    }
    let mut h = *good;
    oob_handle::set_stage_id(&mut h, 0xdead_beef);
    assert_eq!(
        net.connect(0, &mut nccl_handle(&h)).unwrap_err(),
        INTERNAL,
        "a well-formed stage id that names no connect in progress"
    );
    assert_no_attempt(bait, "named corruptions");
}

// ---------------------------------------------------------------------------------------
// Case 9. The fuzzers' seed corpus

fn corpus_dir(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target)
}

/// Seeds for `fuzz/fuzz_targets/handle_decode.rs`: handles made by the encoder, and edges.
fn handle_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let enc = |h: Handle| {
        let mut b = [0u8; HANDLE_SIZE];
        h.encode(&mut b);
        b
    };
    let v4 = enc(Handle {
        addr: "127.0.0.1:43210".parse().unwrap(),
        transport: TransportKind::Tcp,
        nonce: 0x1122_3344_5566_7788,
    });
    let v6 = enc(Handle {
        addr: "[fe80::1]:5000".parse().unwrap(),
        transport: TransportKind::Verbs,
        nonce: 7,
    });
    let mut staged = v4;
    oob_handle::set_stage_id(&mut staged, 3);
    let mut bad_magic = v4;
    bad_magic[0] ^= 1;
    let mut bad_version = v4;
    bad_version[8] = 2;
    let mut bad_stage = staged;
    bad_stage[41] ^= 1;
    vec![
        ("valid-v4-tcp", v4.to_vec()),
        ("valid-v6-verbs", v6.to_vec()),
        ("valid-staged", staged.to_vec()),
        ("bad-magic", bad_magic.to_vec()),
        ("bad-version", bad_version.to_vec()),
        ("bad-stage", bad_stage.to_vec()),
        ("short", v4[..40].to_vec()),
        ("zeros", vec![0; HANDLE_SIZE]),
        ("ones", vec![0xff; HANDLE_SIZE]),
    ]
}

/// Seeds for `fuzz/fuzz_targets/handshake.rs`: framed messages made by the encoders.
fn handshake_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let msg = |kind: MsgKind, payload: &[u8]| {
        let mut v = protocol::encode_header(kind, payload.len()).to_vec();
        v.extend_from_slice(payload);
        v
    };
    let tcp = Hello {
        nonce: 0xfeed,
        transport: TransportKind::Tcp,
        payload: Vec::new(),
    }
    .encode();
    let verbs = Hello {
        nonce: 0xbeef,
        transport: TransportKind::Verbs,
        payload: (0..88u8).collect(),
    }
    .encode();
    let mut stream = msg(MsgKind::Hello, &verbs);
    stream.extend(msg(MsgKind::Move, &[1; 80]));
    stream.extend(msg(MsgKind::Bye, &7u64.to_le_bytes()));
    let mut bad_magic = msg(MsgKind::Hello, &tcp);
    bad_magic[1] ^= 0x40;
    let oversized = protocol::encode_header(MsgKind::Hello, protocol::MAX_PAYLOAD + 1).to_vec();
    let mut truncated = msg(MsgKind::Hello, &verbs);
    truncated.truncate(MSG_HEADER + 20);
    vec![
        ("valid-hello-tcp", msg(MsgKind::Hello, &tcp)),
        ("valid-hello-verbs", msg(MsgKind::Hello, &verbs)),
        (
            "valid-reject",
            msg(MsgKind::Reject, b"set the same NCCL_ERDMA_TRANSPORT"),
        ),
        ("valid-stream", stream),
        ("bad-magic", bad_magic),
        ("oversized", oversized),
        ("truncated", truncated),
        ("http", b"GET / HTTP/1.0\r\n\r\n".to_vec()),
    ]
}

/// The committed seed corpus is what the current encoders produce, and its `valid-*`
/// seeds decode. `RELIABILITY_WRITE_CORPUS=1` (re)writes it.
#[test]
fn fuzz_seed_corpus_decodes() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    if !root.is_dir() {
        // A staged test binary (the Soft-RoCE tier) has no source tree next to it.
        eprintln!("skipped: {} is not here", root.display());
        return;
    }
    let write = std::env::var_os("RELIABILITY_WRITE_CORPUS").is_some();
    for (target, seeds) in [
        ("handle_decode", handle_seeds()),
        ("handshake", handshake_seeds()),
    ] {
        let dir = corpus_dir(target);
        if write {
            std::fs::create_dir_all(&dir).unwrap();
        }
        for (name, bytes) in seeds {
            let path = dir.join(name);
            if write {
                std::fs::write(&path, &bytes).unwrap();
            }
            let committed = std::fs::read(&path).unwrap_or_else(|e| {
                panic!(
                    "{}: {e} (RELIABILITY_WRITE_CORPUS=1 writes it)",
                    path.display()
                )
            });
            assert_eq!(
                committed,
                bytes,
                "{} is stale (RELIABILITY_WRITE_CORPUS=1 rewrites it)",
                path.display()
            );
            if !name.starts_with("valid-") {
                continue;
            }
            match target {
                "handle_decode" => {
                    let mut b = [0u8; HANDLE_SIZE];
                    b.copy_from_slice(&bytes);
                    Handle::decode(&b).unwrap();
                    oob_handle::stage_id(&b).unwrap();
                }
                _ => {
                    let mut rest = &bytes[..];
                    while !rest.is_empty() {
                        let mut h = [0u8; MSG_HEADER];
                        h.copy_from_slice(&rest[..MSG_HEADER]);
                        let (kind, len) = protocol::decode_header(&h).unwrap();
                        let payload = &rest[MSG_HEADER..MSG_HEADER + len];
                        if kind == MsgKind::Hello {
                            assert_eq!(Hello::decode(payload).unwrap().encode(), payload);
                        }
                        rest = &rest[MSG_HEADER + len..];
                    }
                }
            }
        }
    }
}
