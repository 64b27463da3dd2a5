//! Case 11, hostile peers past the listen port: a man in the middle on loopback (`Middle`)
//! relays a real connection and changes what passes. Over verbs it rewrites the connector's
//! setup message (`ConnInfo`: absurd counts of QPs and rails, a QP number past 24 bits, a
//! truncated body), and during a
//! stream it slips move messages to either end: out of turn, of a stale or a future epoch,
//! truncated, of an unknown step, a `Healed` of unknown flags or unasked for, a `Trial` cut
//! short, a `Tried` unasked for, and a `Bye` of
//! the wrong size. Over tcp it slips frames into
//! the stream: a clear-to-send of too many buffers or for a receive out of order, data for a
//! receive that was never posted, larger than its buffer, or of an unknown type.
//!
//! Each ends in `ncclRemoteError` for the comm that read the bytes only, with a WARN naming
//! the field it could not take, within a bounded time; a stale message is ignored and the
//! stream carries on intact. Meanwhile another connection of the same process streams
//! verified data, and the receive buffers' guard bytes show nothing was written outside them.

use std::{
    io::{Read, Write},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream},
    sync::{Arc, Mutex},
    thread,
    time::Instant,
};

use crate::common::*;
use crate::support::*;
use nccl_net_erdma::protocol::{
    decode_header, encode_header, Handle, Hello, MsgKind, TransportKind, MSG_HEADER,
};

/// Which way bytes go through the middle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Toward {
    /// To the listener's end: the receiver.
    Receiver,
    /// To the connector's end: the sender.
    Sender,
}

/// A relay between a connector and the listener its handle named.
struct Middle {
    /// Where the connector connects (the address in its handle).
    addr: SocketAddr,
    /// The relay's sockets to each end, once the connector came; writes go under the lock so
    /// an injected message never splits a relayed one.
    ends: Arc<Mutex<Option<[TcpStream; 2]>>>,
}

impl Middle {
    /// Starts relaying the next connection to `listener`; the connector's first message (its
    /// hello) passes through `hello` first.
    fn start(listener: SocketAddr, hello: fn(Vec<u8>) -> Vec<u8>) -> Self {
        let sock = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = sock.local_addr().unwrap();
        let ends: Arc<Mutex<Option<[TcpStream; 2]>>> = Arc::default();
        let shared = Arc::clone(&ends);
        thread::spawn(move || {
            let (mut from_sender, _) = sock.accept().unwrap();
            let mut to_receiver = TcpStream::connect(listener).unwrap();
            // The hello, rewritten.
            let mut header = [0u8; MSG_HEADER];
            from_sender.read_exact(&mut header).unwrap();
            let (kind, len) = decode_header(&header).unwrap();
            let mut payload = vec![0u8; len];
            from_sender.read_exact(&mut payload).unwrap();
            let payload = hello(payload);
            to_receiver
                .write_all(&encode_header(kind, payload.len()))
                .unwrap();
            to_receiver.write_all(&payload).unwrap();
            *shared.lock().unwrap() = Some([
                to_receiver.try_clone().unwrap(),
                from_sender.try_clone().unwrap(),
            ]);
            let back = Arc::clone(&shared);
            let (r, s) = (
                to_receiver.try_clone().unwrap(),
                from_sender.try_clone().unwrap(),
            );
            thread::spawn(move || relay(r, back, Toward::Sender));
            relay(s, shared, Toward::Receiver);
        });
        Middle { addr, ends }
    }

    /// The peer the end `toward` sees: the middle.
    fn seen_by(&self, toward: Toward) -> SocketAddr {
        match toward {
            Toward::Sender => self.addr,
            Toward::Receiver => {
                let ends = self.ends.lock().unwrap();
                ends.as_ref().expect("the connector came")[0]
                    .local_addr()
                    .unwrap()
            }
        }
    }

    /// Writes `bytes` to one end, as if its peer had sent them.
    fn inject(&self, toward: Toward, bytes: &[u8]) {
        let mut ends = self.ends.lock().unwrap();
        let ends = ends.as_mut().expect("the connector came");
        ends[toward as usize].write_all(bytes).unwrap();
    }
}

/// Copies what `from` reads to the end `toward`, until either closes.
fn relay(mut from: TcpStream, ends: Arc<Mutex<Option<[TcpStream; 2]>>>, toward: Toward) {
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let mut ends = ends.lock().unwrap();
        let to = &mut ends.as_mut().expect("set before relaying")[toward as usize];
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    if let Some(ends) = ends.lock().unwrap().as_ref() {
        let _ = ends[toward as usize].shutdown(Shutdown::Write);
    }
}

/// A connect to a new listener through a [`Middle`] that rewrites the hello with `hello`:
/// the listen comm, the send comm and the middle.
fn connect_through(net: &Net, hello: fn(Vec<u8>) -> Vec<u8>) -> (Opaque, Opaque, Middle) {
    let mut handle = [0u8; NCCL_HANDLE];
    let listen = net.listen(0, &mut handle).unwrap();
    let mut h = Handle::decode(plugin_part(&mut handle)).unwrap();
    let middle = Middle::start(h.addr, hello);
    h.addr = middle.addr;
    h.encode(plugin_part(&mut handle));
    let send = connected(net, &mut handle).expect("connect through the middle");
    (listen, send, middle)
}

/// A pair whose connection goes through a [`Middle`] that relays it as it is.
fn pair_through(net: &Net) -> (Opaque, Opaque, Middle) {
    let (listen, send, middle) = connect_through(net, |hello| hello);
    let recv = poll_until("accept", || net.accept(listen).expect("accept"));
    net.close_listen(listen).unwrap();
    (send, recv, middle)
}

const GUARD: u8 = 0xc5;
const GUARDED: usize = 4096;

/// One message of `len` bytes each way it can go: `Ok` with every byte checked and the guard
/// bytes around the receive buffer intact, or the first error either end reported (then the
/// guard bytes are checked too).
fn message(net: &Net, s: Opaque, r: Opaque, len: usize, seed: u64) -> Result<(), ncclResult_t> {
    let mut src = reg(net, s, pattern(seed, len));
    let mut dst = reg(net, r, vec![GUARD; GUARDED + len + GUARDED]);
    let into = dst.buf[GUARDED..].as_mut_ptr();
    let outcome = (|| {
        let start = Instant::now();
        let mut rreq = Opaque::NULL;
        while rreq.is_null() {
            rreq = net.irecv(r, &[(into, len)], &[1], &[dst.mh], false)?;
            assert!(start.elapsed() < DEADLINE, "irecv never posted");
        }
        let (mut sent, mut received) = (false, false);
        let mut sizes = [0i32; 8];
        let mut sreq = Opaque::NULL;
        while sreq.is_null() {
            sreq = net.isend(s, src.buf.as_mut_ptr(), len, 1, src.mh)?;
            received = received || net.test(rreq, Some(&mut sizes))?;
            assert!(start.elapsed() < DEADLINE, "isend never posted");
        }
        while !(sent && received) {
            sent = sent || net.test(sreq, None)?;
            received = received || net.test(rreq, Some(&mut sizes))?;
            assert!(
                start.elapsed() < DEADLINE,
                "the message neither arrived nor failed"
            );
        }
        assert_eq!(sizes[0] as usize, len);
        Ok(())
    })();
    let (before, rest) = dst.buf.split_at(GUARDED);
    let (got, after) = rest.split_at(len);
    assert!(
        before.iter().chain(after).all(|b| *b == GUARD),
        "bytes written outside the receive buffer"
    );
    // A failed comm keeps its buffers registered until NCCL closes it.
    if outcome.is_ok() {
        assert!(got == pattern(seed, len), "{len} bytes differ");
        dereg(net, s, src);
        dereg(net, r, dst);
    }
    outcome
}

/// The first error of `comm` (its end of a pair with `other`), where bytes it cannot take
/// came: a message is tried until one fails.
fn first_error(net: &Net, s: Opaque, r: Opaque, what: &str) -> ncclResult_t {
    let start = Instant::now();
    for i in 0.. {
        if let Err(e) = message(net, s, r, 4096, 100 + i) {
            return e;
        }
        assert!(start.elapsed() < DEADLINE, "{what}: no error");
    }
    unreachable!()
}

/// A hostile message and what must come of it.
struct Hostile {
    what: &'static str,
    toward: Toward,
    bytes: Vec<u8>,
    /// The WARN's words naming what was wrong; `None`: the message is ignored.
    warn: Option<&'static str>,
}

/// A bootstrap message as the peer's socket would carry it.
fn framed(kind: MsgKind, payload: &[u8]) -> Vec<u8> {
    let mut v = encode_header(kind, payload.len()).to_vec();
    v.extend_from_slice(payload);
    v
}

/// A move message: step, epoch, lost rails, body.
fn move_msg(step: u8, epoch: u32, body: &[u8]) -> Vec<u8> {
    let mut p = vec![step];
    p.extend_from_slice(&epoch.to_le_bytes());
    p.extend_from_slice(&[0, 0]);
    p.extend_from_slice(body);
    framed(MsgKind::Move, &p)
}

fn verbs_cases() -> Vec<Hostile> {
    let case = |what, toward, bytes, warn| Hostile {
        what,
        toward,
        bytes,
        warn,
    };
    vec![
        case(
            "a Down of a stale epoch",
            Toward::Sender,
            move_msg(1, 0, &[]),
            None,
        ),
        case(
            "an Answer out of turn",
            Toward::Sender,
            move_msg(3, 0, &[]),
            Some("sent Answer of move 0"),
        ),
        case(
            "a Resume out of turn",
            Toward::Receiver,
            move_msg(4, 0, &[0, 0]),
            Some("sent Resume of move 0"),
        ),
        case(
            "an Offer of a future epoch with a truncated body",
            Toward::Receiver,
            move_msg(2, 9, &[1, 2, 3]),
            Some("this end cannot move it"),
        ),
        case(
            "a Down of a future epoch",
            Toward::Sender,
            move_msg(1, 7, &[]),
            Some("this end cannot move it"),
        ),
        case(
            "a move message of an unknown step",
            Toward::Sender,
            move_msg(9, 0, &[]),
            Some("field `step`"),
        ),
        case(
            "a Healed of unknown flags",
            Toward::Sender,
            move_msg(6, 0, &[0x80]),
            Some("field `flags`"),
        ),
        case(
            "a Healed unasked for (the connection is on its own NICs: nothing moves)",
            Toward::Sender,
            move_msg(6, 0, &[3]),
            None,
        ),
        case(
            "a Trial with a truncated body",
            Toward::Receiver,
            move_msg(7, 0, &[1]),
            Some("field `trial`"),
        ),
        case(
            "a Tried unasked for (no trial runs: nothing moves)",
            Toward::Sender,
            move_msg(8, 0, &[0, 0, 0, 9]),
            None,
        ),
        case(
            "a truncated move message",
            Toward::Receiver,
            framed(MsgKind::Move, &[2, 1, 0]),
            Some("field `epoch`"),
        ),
        case(
            "a Bye of the wrong size",
            Toward::Sender,
            framed(MsgKind::Bye, &[1, 2, 3]),
            Some("field `landed receives`"),
        ),
    ]
}

/// A tcp clear-to-send frame: type 1, `n` buffers, receive `seq`, each buffer 4096 bytes.
fn cts(n: u8, seq: u32) -> Vec<u8> {
    let mut v = vec![1, n, 0, 0];
    v.extend_from_slice(&seq.to_le_bytes());
    for _ in 0..n {
        v.extend_from_slice(&4096u64.to_le_bytes());
        v.extend_from_slice(&[0; 8]);
    }
    v
}

/// A tcp data frame header: `kind`, buffer 0, receive `seq`, `size` bytes.
fn data(kind: u8, seq: u32, size: u64) -> Vec<u8> {
    let mut v = vec![kind, 0, 0, 0];
    v.extend_from_slice(&seq.to_le_bytes());
    v.extend_from_slice(&size.to_le_bytes());
    v
}

fn tcp_cases() -> Vec<Hostile> {
    let case = |what, toward, bytes, warn| Hostile {
        what,
        toward,
        bytes,
        warn: Some(warn),
    };
    vec![
        case(
            "a clear-to-send of 200 buffers",
            Toward::Sender,
            cts(200, 0),
            "field `buffers`",
        ),
        case(
            "a clear-to-send for a receive out of order",
            Toward::Sender,
            cts(1, 77),
            "clear-to-send for receive 77",
        ),
        case(
            "data for a receive never posted",
            Toward::Receiver,
            data(2, 5, 8),
            "unexpected data frame",
        ),
        case(
            "data larger than the buffer it is for",
            Toward::Receiver,
            data(2, 1, 1 << 20),
            "bytes sent to a 4096-byte receive",
        ),
        case(
            "a data frame of an unknown type",
            Toward::Receiver,
            data(9, 0, 8),
            "field `type`",
        ),
    ]
}

/// A hello whose `ConnInfo` claims `qps` QPs over `rails` rails.
fn hello_claiming(payload: Vec<u8>, qps: u16, rails: u8) -> Vec<u8> {
    let mut hello = Hello::decode(&payload).unwrap();
    hello.payload[..2].copy_from_slice(&qps.to_le_bytes());
    hello.payload[2] = rails;
    hello.encode()
}

#[test]
fn hostile_peers_fail_only_their_comm_with_a_warn_naming_the_field() {
    report_child(&run_child(
        test_name!(child_hostile_peers),
        &[("NCCL_ERDMA_CONNECT_TIMEOUT_MS", "5000")],
        &[],
        true,
    ));
}

#[test]
#[ignore = "entry point of a child process (in its own network namespace)"]
fn child_hostile_peers() {
    if !is_child() {
        return;
    }
    let net = open(11);
    // The bystander: a connection of the same process that must not notice.
    let (bs, br) = connect_pair(&net);
    let cases = match our_transport() {
        TransportKind::Verbs => verbs_cases(),
        TransportKind::Tcp => tcp_cases(),
    };
    for (i, case) in cases.iter().enumerate() {
        let (s, r, middle) = pair_through(&net);
        message(&net, s, r, 70_000, i as u64).expect("a clean message first");
        let seen = warns().len();
        middle.inject(case.toward, &case.bytes);
        match case.warn {
            None => {
                for k in 0..3 {
                    message(&net, s, r, 4096 << k, k)
                        .unwrap_or_else(|e| panic!("{}: the stream broke ({e:?})", case.what));
                }
            }
            Some(words) => {
                let code = first_error(&net, s, r, case.what);
                assert_eq!(code, REMOTE, "{}", case.what);
                let peer = middle.seen_by(case.toward).to_string();
                let new = &warns()[seen..];
                assert!(
                    new.iter().any(|w| w.contains(words) && w.contains(&peer)),
                    "{}: no WARN naming {words:?} and the peer {peer} in {new:#?}",
                    case.what
                );
            }
        }
        message(&net, bs, br, 65_536, 1000 + i as u64).expect("the bystander streams on");
        net.close_send(s).unwrap();
        net.close_recv(r).unwrap();
    }
    if our_transport() == TransportKind::Verbs {
        for (what, hello, words) in [
            (
                "a ConnInfo claiming 65535 QPs",
                (|p| hello_claiming(p, 65535, 1)) as fn(Vec<u8>) -> Vec<u8>,
                "field `QPs`",
            ),
            (
                "a ConnInfo claiming 200 rails",
                |p| hello_claiming(p, 4, 200),
                "field `rails`",
            ),
            (
                "a ConnInfo of no rail",
                |p| hello_claiming(p, 1, 0),
                "field `rails`",
            ),
            (
                "a ConnInfo naming QP number 2^32-1",
                |p| {
                    let mut hello = Hello::decode(&p).unwrap();
                    let first_qp = 16 + 60 * usize::from(hello.payload[2]);
                    hello.payload[first_qp..first_qp + 4].fill(0xff);
                    hello.encode()
                },
                "field `QP number`",
            ),
            (
                "a truncated ConnInfo",
                |p| p[..p.len() - 5].to_vec(),
                "field",
            ),
        ] {
            let seen = warns().len();
            let (listen, s, middle) = connect_through(&net, hello);
            let start = Instant::now();
            let accepted = loop {
                match net.accept(listen) {
                    Ok(r) if r.is_null() => assert!(start.elapsed() < DEADLINE, "{what}"),
                    other => break other,
                }
            };
            assert_eq!(accepted, Err(REMOTE), "{what}: accept");
            let peer = middle.seen_by(Toward::Receiver).to_string();
            let new = &warns()[seen..];
            assert!(
                new.iter().any(|w| w.contains(words) && w.contains(&peer)),
                "{what}: no WARN naming {words:?} and the peer {peer} in {new:#?}"
            );
            // The connector is told why.
            assert_eq!(send_error(&net, s, what, Instant::now()), REMOTE, "{what}");
            net.close_listen(listen).unwrap();
            message(&net, bs, br, 65_536, 2000).expect("the bystander streams on");
        }
    }
    net.close_send(bs).unwrap();
    net.close_recv(br).unwrap();
}
