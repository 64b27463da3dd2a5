//! Case 3, connect to a listener that is gone, slow, mute or unreachable: connect waits for
//! a listener that is reached but slow to accept, and fails with an error code and a WARN
//! once the listener's process is killed, the port hangs up, or nothing answers within
//! `NCCL_ERDMA_CONNECT_TIMEOUT_MS`. (The peer host that goes silent later is in `peers`.)

use std::{
    net::{TcpListener, TcpStream},
    thread,
    time::{Duration, Instant},
};

use crate::common::*;
use crate::support::*;
use nccl_net_erdma::protocol::Handle;

#[test]
fn connect_to_a_gone_or_silent_listener_fails_in_bounded_time() {
    report_child(&run_child(
        test_name!(child_gone_or_silent_listener),
        &[("NCCL_ERDMA_CONNECT_TIMEOUT_MS", "1000")],
        &[],
        true,
    ));
}

#[test]
#[ignore = "entry point of a child process (in its own network namespace)"]
fn child_gone_or_silent_listener() {
    if !is_child() {
        return;
    }
    let (mut net, base) = open_warm(10);

    listener_process_killed(&net);
    late_accept(&net);
    mute_port(&net);
    nothing_answers(&net);

    // The plugin still connects afterwards, and nothing was left open.
    let (s, r) = connect_pair(&net);
    transfer(&net, s, r, 3000, 3000, 3);
    net.close_send(s).unwrap();
    net.close_recv(r).unwrap();
    assert_eq!(fd_count(), base, "fds after the failed connects");
    net.finalize().unwrap();
}

/// a. The listener's process is SIGKILLed after connect returned, before it accepted: the
/// comm's first calls fail.
fn listener_process_killed(net: &Net) {
    let mut victim = Victim::spawn(test_name!(child_victim_listens), &[]);
    let mut handle = client::handle_from_hex(&victim.expect("HANDLE")).expect("a hex handle");
    let send = connected(net, &mut handle).expect("the hello went out");
    let start = Instant::now();
    victim.kill();
    let err = send_error(net, send, "listener process killed", start);
    let took = start.elapsed();
    println!(
        "reliability: time to error (connect, listener process killed): {} ms, {err:?}",
        took.as_millis()
    );
    assert_eq!(err, REMOTE);
    drop(victim);
}

/// b. The listener is reached but its owner calls accept only well after
/// NCCL_ERDMA_CONNECT_TIMEOUT_MS (a busy peer; NCCL >= 2.22 connects on first use): connect
/// returns, its comm answers "not yet" meanwhile, and carries data once accept has run.
fn late_accept(net: &Net) {
    let mut handle = [0u8; NCCL_HANDLE];
    let listen = net.listen(0, &mut handle).unwrap();
    let start = Instant::now();
    let s = connected(net, &mut handle).expect("connect");
    while start.elapsed() < Duration::from_millis(1500) {
        let req = net
            .isend(s, std::ptr::null_mut(), 0, 0, Opaque::NULL)
            .unwrap();
        assert!(req.is_null(), "sent before the peer accepted");
        thread::sleep(Duration::from_millis(5));
    }
    let mut r = Opaque::NULL;
    while r.is_null() {
        r = net.accept(listen).unwrap();
        assert!(
            start.elapsed() < DEADLINE,
            "the late accept never completed"
        );
    }
    println!(
        "reliability: connect to a listener that accepts after {} ms \
         (NCCL_ERDMA_CONNECT_TIMEOUT_MS=1000): connected",
        start.elapsed().as_millis()
    );
    transfer(net, s, r, 3000, 3000, 4);
    net.close_send(s).unwrap();
    net.close_recv(r).unwrap();
    net.close_listen(listen).unwrap();
}

/// c. A port that accepts TCP connections and never says anything: reached, so connect
/// returns and its comm waits as for a slow peer; when the port closes the connection, the
/// comm fails at once.
fn mute_port(net: &Net) {
    let mute = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut handle = [0u8; NCCL_HANDLE];
    Handle {
        addr: mute.local_addr().unwrap(),
        transport: our_transport(),
        nonce: 42,
    }
    .encode(plugin_part(&mut handle));
    let send = connected(net, &mut handle).expect("the hello went out");
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(1500) {
        let req = net
            .isend(send, std::ptr::null_mut(), 0, 0, Opaque::NULL)
            .unwrap();
        assert!(req.is_null(), "mute port");
        thread::sleep(Duration::from_millis(5));
    }
    let (conn, _) = mute.accept().unwrap();
    let mute_addr = mute.local_addr().unwrap().to_string();
    drop((conn, mute));
    let closed = Instant::now();
    let err = send_error(net, send, "mute port closed", closed);
    let took = closed.elapsed();
    println!(
        "reliability: time to error (connect, mute port closes after 1.5 s): {} ms, {err:?}",
        took.as_millis()
    );
    assert_eq!(err, REMOTE);
    let w = warns();
    assert!(
        w.iter()
            .any(|l| l.contains("isend:") && l.contains(&mute_addr)),
        "the WARN names the peer that hung up: {w:?}"
    );
}

/// d. Nothing answers the connection attempt (as when the listener's host is down): a
/// listener whose accept queue is full drops SYNs. Fails after the connect timeout.
fn nothing_answers(net: &Net) {
    let full = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    full.bind(
        &"127.0.0.1:0"
            .parse::<std::net::SocketAddr>()
            .unwrap()
            .into(),
    )
    .unwrap();
    full.listen(0).unwrap();
    let addr = full.local_addr().unwrap().as_socket().unwrap();
    let _filler = TcpStream::connect(addr).unwrap();
    let mut handle = [0u8; NCCL_HANDLE];
    Handle {
        addr,
        transport: our_transport(),
        nonce: 7,
    }
    .encode(plugin_part(&mut handle));
    let (err, took) = connect_error(net, &mut handle, "nothing answers");
    println!(
        "reliability: time to error (connect, nothing answers): {} ms, {err:?}",
        took.as_millis()
    );
    assert_eq!(err, REMOTE);
    assert!(
        took >= Duration::from_millis(900),
        "failed before the timeout: {took:?}"
    );
    let w = warns();
    assert!(
        w.iter().any(|l| l.contains("connect:")
            && l.contains("could not reach")
            && l.contains("NCCL_ERDMA_CONNECT_TIMEOUT_MS")),
        "the WARN names the setting that bounds it: {w:?}"
    );
    drop((_filler, full));
}

#[test]
#[ignore = "entry point of a child process"]
fn child_victim_listens() {
    if !is_child() {
        return;
    }
    let net = open(10);
    let mut handle = [0u8; NCCL_HANDLE];
    let _listen = net.listen(0, &mut handle).unwrap();
    println!("VICTIM HANDLE {}", client::handle_to_hex(&handle));
    park();
}
