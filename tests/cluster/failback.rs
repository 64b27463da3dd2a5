//! Fail-back between the hosts: device 0's connections (rxe0 on rail A, rxe1 on rail B its
//! spare) stream 64 KiB messages both ways, every byte verified, in phases the two hosts
//! take in step, while host 2's rails fail and heal. A healed rail A takes its connections
//! back (an INFO line "moved back in ... ms, to rxe0", rxe0's packet counter climbing again), and a
//! later loss of rail B costs nothing; with `NCCL_ERDMA_FAILBACK=0` the connections stay on
//! rail B, and losing it moves them to the healed rail A; a rail A that flaps moves nothing
//! back until it has stayed up for the settling time; a rail A that drops every packet with
//! its port up is tried (and not taken) until it carries again.

use std::thread;

use nccl_net_erdma_tools::client::Net;

use super::failover::{both_rails, both_ways};
use super::*;
use traffic::logged;

/// The settling time of these cases (ms).
const SETTLE_MS: u64 = 3000;

const A_DOWN: (&str, &str) = ("ip link set raila down", "ip link set raila up");
const B_DOWN: (&str, &str) = ("ip link set railb down", "ip link set railb up");
const A_LOSS: (&str, &str) = (
    "tc qdisc add dev raila root netem loss 100%",
    "tc qdisc del dev raila root",
);

/// Packets `dev` has sent (its hardware counter).
fn sent_pkts(dev: &str) -> u64 {
    let path = format!("/sys/class/infiniband/{dev}/ports/1/hw_counters/sent_pkts");
    std::fs::read_to_string(&path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| panic!("{path} unreadable"))
}

/// The INFO lines of moves back ("moved back in ...") logged so far.
fn moves_back() -> Vec<String> {
    logged()
        .into_iter()
        .filter(|l| l.contains(" moved back in "))
        .collect()
}

/// Waits until rail A's NIC says its port is active again.
fn rail_a_active() {
    sh("for i in $(seq 100); do grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state && exit 0; sleep 0.1; done; exit 1");
}

/// What a phase did: bytes verified (both ways), this host's receive rate (MB/s), and the
/// fault host 2 injected (undone when dropped).
struct Phase {
    bytes: u64,
    mbps: f64,
    /// The longest time this host's traffic stood still (either way).
    stall: Duration,
    fault: Option<Fault>,
}

/// One phase: `count` messages both ways from `seed`, while host 2 runs `fault` one second
/// in.
fn phase(
    net: &Net,
    c: &Comms,
    p: &mut Peer,
    (name, seed, count): (&str, u64, usize),
    fault: Option<(&'static str, &'static str)>,
) -> Phase {
    p.step(name);
    let injector = fault.filter(|_| p.host == Host::Two).map(|(on, off)| {
        thread::spawn(move || {
            thread::sleep(Duration::from_secs(1));
            Fault::inject(on, off)
        })
    });
    let s = Stream {
        sizes: &[65_536],
        count,
        seed,
        window: 8,
        limit: Duration::from_secs(240),
    };
    let (sent, received) = both_ways(net, c, &s);
    Phase {
        bytes: sent.bytes + received.bytes,
        mbps: received.mbps(),
        stall: sent.stall.max(received.stall),
        fault: injector.map(|t| t.join().expect("fault thread")),
    }
}

/// Whether `mine` holds here and the other host's holds there (said over the control
/// connection as `what`): both hosts get the same answer.
fn both(p: &mut Peer, what: &str, mine: bool) -> bool {
    p.send(&format!("{what} {mine}"));
    let theirs = p.expect(what) == "true";
    mine && theirs
}

/// Streams phases named `name` (seeds from `seed`) until both hosts have streamed for
/// longer than `long`; the bytes verified and the longest stall.
fn phases_for(
    net: &Net,
    c: &Comms,
    p: &mut Peer,
    (name, seed): (&str, u64),
    long: Duration,
) -> (u64, Duration) {
    let t0 = Instant::now();
    let (mut bytes, mut stall) = (0, Duration::ZERO);
    for round in 0.. {
        let streamed = phase(net, c, p, (name, seed + round, 60), None);
        (bytes, stall) = (bytes + streamed.bytes, stall.max(streamed.stall));
        if both(p, name, t0.elapsed() > long) {
            break;
        }
    }
    (bytes, stall)
}

/// Streams phases until this host logged `want` moves back (both hosts stop together), at
/// most `within`; the bytes verified.
fn until_moved_back(net: &Net, c: &Comms, p: &mut Peer, want: usize, within: Duration) -> u64 {
    let t0 = Instant::now();
    let mut bytes = 0;
    for round in 0.. {
        let waiting = ("waiting for the move back", 300 + round, 60);
        bytes += phase(net, c, p, waiting, None).bytes;
        if both(p, "moved-back", moves_back().len() >= want) {
            break;
        }
        assert!(
            t0.elapsed() < within,
            "no move back on both hosts within {within:?} (here: {:?})",
            moves_back()
        );
    }
    bytes
}

#[test]
#[ignore = "cluster tier: run by scripts/tiers/cluster-tier.sh on two hosts"]
fn failback_rail_a_healed_takes_its_connections_back_then_rail_b_lost_costs_nothing() {
    let case = "failback::failback_rail_a_healed_takes_its_connections_back_then_rail_b_lost_costs_nothing";
    both_rails();
    set(&[("NCCL_ERDMA_FAILBACK_AFTER_MS", &SETTLE_MS.to_string())]);
    let mut p = Peer::meet(case, Link::Mgmt);
    let net = open();
    let c = connect(&net, &mut p);
    let before = phase(&net, &c, &mut p, ("before", 1, 150), None);
    // Rail A lost: the connections move to rail B.
    let cut = phase(&net, &c, &mut p, ("rail A cut", 11, 300), Some(A_DOWN));
    p.step("moved");
    let on_b = phase(&net, &c, &mut p, ("on rail B", 200, 150), None);
    let mut bytes = before.bytes + cut.bytes + on_b.bytes;
    let healed = Instant::now();
    drop(cut.fault);
    if p.host == Host::Two {
        rail_a_active();
    }
    p.step("rail A healed");
    // Each host's two connections (one sending, one receiving) move back.
    bytes += until_moved_back(&net, &c, &mut p, 2, Duration::from_secs(60));
    let back_after = healed.elapsed();
    let a_before = sent_pkts("rxe0");
    // Rail B lost for good: nothing runs there any more.
    let after = phase(&net, &c, &mut p, ("rail B cut", 500, 300), Some(B_DOWN));
    bytes += after.bytes;
    let a_sent = sent_pkts("rxe0") - a_before;
    p.step("streamed");
    close(&net, c);
    drop(after.fault);
    p.step("closed");
    let back = moves_back();
    assert!(
        a_sent > 1000,
        "rail A carries the traffic again: rxe0 sent {a_sent} packets"
    );
    result(
        case,
        p.host,
        &format!(
            "outcome=completed bytes_verified={bytes} back_after_heal_ms={} \
             rxe0_pkts_after_back={a_sent} mbps_before={:.1} mbps_with_the_cut={:.1} \
             mbps_on_rail_b={:.1} mbps_back_on_rail_a={:.1} back={:?} warns={:?}",
            back_after.as_millis(),
            before.mbps,
            cut.mbps,
            on_b.mbps,
            after.mbps,
            back,
            warnings()
                .iter()
                .map(|w| w.chars().take(160).collect::<String>())
                .collect::<Vec<_>>()
        ),
    );
}

#[test]
#[ignore = "cluster tier: run by scripts/tiers/cluster-tier.sh on two hosts"]
fn failback_off_keeps_the_move_and_rail_b_lost_moves_to_the_healed_rail_a() {
    let case = "failback::failback_off_keeps_the_move_and_rail_b_lost_moves_to_the_healed_rail_a";
    both_rails();
    set(&[
        ("NCCL_ERDMA_FAILBACK_AFTER_MS", &SETTLE_MS.to_string()),
        ("NCCL_ERDMA_FAILBACK", "0"),
    ]);
    let mut p = Peer::meet(case, Link::Mgmt);
    let net = open();
    let c = connect(&net, &mut p);
    let cut = phase(&net, &c, &mut p, ("rail A cut", 21, 300), Some(A_DOWN));
    let mut bytes = cut.bytes;
    p.step("moved");
    drop(cut.fault);
    if p.host == Host::Two {
        rail_a_active();
    }
    p.step("rail A healed");
    // Longer than the settling time, with the comms busy (their checks watch rail A).
    let settling = Duration::from_millis(2 * SETTLE_MS);
    bytes += phases_for(&net, &c, &mut p, ("settling", 600), settling).0;
    assert!(moves_back().is_empty(), "moved back: {:?}", moves_back());
    // Rail B lost: the connections move to the healed rail A.
    let cut_b = phase(&net, &c, &mut p, ("rail B cut", 700, 300), Some(B_DOWN));
    bytes += cut_b.bytes;
    p.step("streamed");
    close(&net, c);
    drop(cut_b.fault);
    p.step("closed");
    let to_a: Vec<String> = warnings()
        .into_iter()
        .filter(|w| w.contains("moving the connection") && w.contains("from rxe1 to rxe0"))
        .collect();
    assert!(
        !to_a.is_empty(),
        "moved to the healed rxe0: {:?}",
        warnings()
    );
    result(
        case,
        p.host,
        &format!("outcome=completed bytes_verified={bytes} to_a={to_a:?}"),
    );
}

#[test]
#[ignore = "cluster tier: run by scripts/tiers/cluster-tier.sh on two hosts"]
fn failback_waits_while_rail_a_flaps_and_moves_back_once_it_settles() {
    let case = "failback::failback_waits_while_rail_a_flaps_and_moves_back_once_it_settles";
    both_rails();
    set(&[("NCCL_ERDMA_FAILBACK_AFTER_MS", &SETTLE_MS.to_string())]);
    let mut p = Peer::meet(case, Link::Mgmt);
    let net = open();
    let c = connect(&net, &mut p);
    p.step("flapping");
    // Rail A down 1.5 s, up 1.5 s, for 30 s: never up for the settling time.
    let flapper = (p.host == Host::Two).then(|| {
        thread::spawn(|| {
            for _ in 0..10 {
                let down = Fault::inject(A_DOWN.0, A_DOWN.1);
                thread::sleep(Duration::from_millis(1500));
                drop(down);
                thread::sleep(Duration::from_millis(1500));
            }
        })
    });
    let flaps = Duration::from_secs(30);
    let mut bytes = phases_for(&net, &c, &mut p, ("while it flaps", 800), flaps).0;
    if let Some(f) = flapper {
        f.join().expect("flapping thread");
        rail_a_active();
    }
    p.step("settled");
    let during = moves_back();
    let settled = Instant::now();
    bytes += until_moved_back(&net, &c, &mut p, 2, Duration::from_secs(60));
    let back_after = settled.elapsed();
    close(&net, c);
    p.step("closed");
    assert!(
        during.is_empty(),
        "moved back while rail A flapped: {during:?}"
    );
    result(
        case,
        p.host,
        &format!(
            "outcome=completed bytes_verified={bytes} back_after_settled_ms={} moves={}",
            back_after.as_millis(),
            warnings()
                .iter()
                .filter(|w| w.contains("moving the connection"))
                .count()
        ),
    );
}

#[test]
#[ignore = "cluster tier: run by scripts/tiers/cluster-tier.sh on two hosts"]
fn failback_tries_a_rail_a_that_drops_everything_and_moves_back_once_it_carries() {
    let case =
        "failback::failback_tries_a_rail_a_that_drops_everything_and_moves_back_once_it_carries";
    both_rails();
    set(&[("NCCL_ERDMA_FAILBACK_AFTER_MS", &SETTLE_MS.to_string())]);
    let mut p = Peer::meet(case, Link::Mgmt);
    let net = open();
    let c = connect(&net, &mut p);
    // Rail A drops every packet, its ports up: the connections move to rail B.
    let cut = phase(
        &net,
        &c,
        &mut p,
        ("rail A loses everything", 31, 300),
        Some(A_LOSS),
    );
    let mut bytes = cut.bytes;
    p.step("moved");
    // Its port says healed after the settling time; the trials of the path say not yet.
    let trying = Duration::from_millis(3 * SETTLE_MS);
    let (still, stall) = phases_for(&net, &c, &mut p, ("still lossy", 900), trying);
    bytes += still;
    let tried: Vec<String> = logged()
        .into_iter()
        .filter(|l| l.contains("do not reach it yet"))
        .collect();
    let moves_while_lossy = warnings()
        .iter()
        .filter(|w| w.contains("moving the connection"))
        .count();
    let during = moves_back();
    let mended = Instant::now();
    drop(cut.fault);
    p.step("rail A mended");
    bytes += until_moved_back(&net, &c, &mut p, 2, Duration::from_secs(60));
    let back_after = mended.elapsed();
    close(&net, c);
    p.step("closed");
    assert!(
        during.is_empty(),
        "moved back onto the lossy rail A: {during:?}"
    );
    assert_eq!(
        moves_while_lossy,
        2,
        "only the first move of each connection: {:?}",
        warnings()
    );
    // Host 1's sender finds its writes unacknowledged (host 2 drops the answers), host 2's
    // finds its own dropped: each host tries, and fails.
    assert!(!tried.is_empty(), "no trial failed here");
    result(
        case,
        p.host,
        &format!(
            "outcome=completed bytes_verified={bytes} trials_failed={} \
             longest_stall_while_lossy_ms={} back_after_mended_ms={}",
            tried.len(),
            stall.as_millis(),
            back_after.as_millis()
        ),
    );
}
