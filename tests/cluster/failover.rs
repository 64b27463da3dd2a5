//! Failover between the hosts: both rails open (rxe0 on rail A is device 0, rxe1 on rail B
//! its spare), 64 KiB messages streamed both ways at once, and host 2's rail A cut for good
//! mid-stream (link down, or every packet lost): both streams must complete on both hosts,
//! every byte verified, with one WARN per host naming the peer, rxe0 and rxe1. With both
//! rails cut the comm fails within the bound, as without failover; a rail flapping during
//! the switch loses nothing.

use std::thread;

use nccl_net_erdma_tools::client::Net;

use super::*;
use traffic::logged;

/// The settings of these cases: both NICs, short retransmission timers (67 ms) and
/// retries without end (rxe's 7), so only the probes find the cut.
pub(super) fn both_rails() {
    std::env::remove_var("NCCL_IB_HCA");
    set(&[
        ("NCCL_IB_TIMEOUT", "14"),
        ("NCCL_IB_RETRY_CNT", "7"),
        ("NCCL_ERDMA_WORK_TIMEOUT_S", "8"),
        ("NCCL_ERDMA_FAILOVER_AFTER_MS", "1000"),
    ]);
}

/// Streams `s` both ways at once over `c`: this host's sends on a thread of their own.
pub(super) fn both_ways(net: &Net, c: &Comms, s: &Stream) -> (traffic::Done, traffic::Done) {
    let (sent, received) = thread::scope(|scope| {
        let sending = scope.spawn(|| send(net, c.send, s));
        let received = recv(net, c.recv, s);
        (sending.join().expect("sending thread"), received)
    });
    let unwrap = |r: Result<traffic::Done, traffic::Failed>| {
        r.unwrap_or_else(|f| panic!("{} failed: {:?}; WARN: {:?}", f.call, f.code, warnings()))
    };
    (unwrap(sent), unwrap(received))
}

/// What one host measured of a move: the longest stall of each stream, the move itself as
/// the plugin timed it (the INFO line), and the bandwidth one way before and after.
fn moved_ms() -> Vec<u64> {
    logged()
        .iter()
        .filter_map(|l| l.split(" moved in ").nth(1))
        .filter_map(|t| t.split(" ms").next()?.parse().ok())
        .collect()
}

/// Cuts host 2's rail A for good with `cut` one second into a stream both ways (and runs
/// `during`, a second fault, half a second later): both streams complete, verified.
fn stream_survives(
    case: &str,
    cut: &'static str,
    restore: &'static str,
    during: Option<(&'static str, &'static str)>,
) {
    both_rails();
    let mut p = Peer::meet(case, Link::Mgmt);
    let net = open();
    assert_eq!(net.properties(0).expect("getProperties").name, "rxe0");
    let c = connect(&net, &mut p);
    let one = Stream {
        sizes: &[65_536],
        count: 400,
        seed: 3,
        window: 8,
        limit: Duration::from_secs(120),
    };
    let before = one_way(&net, &c, &mut p, &one, false);
    p.step("go");
    let go = Instant::now();
    let injector = (p.host == Host::Two).then(|| {
        thread::spawn(move || {
            thread::sleep(Duration::from_secs(1));
            let cut_at = go.elapsed();
            let fault = Fault::inject(cut, restore);
            if let Some((flap, back)) = during {
                thread::sleep(Duration::from_millis(1500));
                sh(flap);
                // Shorter than the suspect time: the new path is slow, not dead.
                thread::sleep(Duration::from_millis(500));
                sh(back);
            }
            (fault, cut_at)
        })
    });
    let s = Stream {
        sizes: &[65_536],
        count: 1500,
        seed: 11,
        window: 8,
        limit: Duration::from_secs(240),
    };
    let (sent, received) = both_ways(&net, &c, &s);
    p.step("streamed");
    let after = one_way(&net, &c, &mut p, &Stream { seed: 50, ..one }, false);
    p.step("measured");
    let warn = warnings().join(" | ");
    let peer_ip = if p.host == Host::One {
        "198.18.0.2"
    } else {
        "198.18.0.1"
    };
    let moving: Vec<String> = warnings()
        .into_iter()
        .filter(|w| w.contains("moving the connection") && w.contains(peer_ip))
        .collect();
    assert!(
        !moving.is_empty(),
        "a WARN says the connection moved: {warn}"
    );
    assert!(
        moving
            .iter()
            .any(|w| w.contains("rxe0") && w.contains("rxe1")),
        "the WARN names the NIC lost and the NIC taken: {moving:?}"
    );
    close(&net, c);
    p.step("closed");
    let mut cut_at = None;
    if let Some(t) = injector {
        let (fault, at) = t.join().expect("fault thread");
        cut_at = Some(at);
        drop(fault);
        sh("for i in $(seq 100); do grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state && exit 0; sleep 0.1; done; exit 1");
    }
    p.step("restored");
    let stall = if sent.stall > received.stall {
        &sent
    } else {
        &received
    };
    result(
        case,
        p.host,
        &format!(
            "outcome=completed stall_ms={} stall_from_ms={} cut_at_ms={:?} moved_ms={:?} \
             bytes_verified={} mbps_before={:.0} mbps_after={:.0} warn={:?} other_warns={:?}",
            stall.stall.as_millis(),
            stall.stall_from.as_millis(),
            cut_at.map(|c| c.as_millis()),
            moved_ms(),
            received.bytes + before.bytes + after.bytes,
            before.mbps(),
            after.mbps(),
            moving[0],
            warnings()
                .iter()
                .filter(|w| !w.contains("moving the connection") && !w.starts_with("NET/erdma test"))
                .map(|w| w.chars().take(160).collect::<String>())
                .collect::<Vec<_>>()
                .join(" | ")
        ),
    );
}

#[test]
#[ignore = "cluster tier: run by scripts/tiers/cluster-tier.sh on two hosts"]
fn failover_rail_a_down_for_good_streams_both_ways_move_to_rail_b() {
    stream_survives(
        "failover::failover_rail_a_down_for_good_streams_both_ways_move_to_rail_b",
        "ip link set raila down",
        "ip link set raila up",
        None,
    );
}

#[test]
#[ignore = "cluster tier: run by scripts/tiers/cluster-tier.sh on two hosts"]
fn failover_rail_a_lossy_100pct_streams_both_ways_move_to_rail_b() {
    stream_survives(
        "failover::failover_rail_a_lossy_100pct_streams_both_ways_move_to_rail_b",
        "tc qdisc add dev raila root netem loss 100%",
        "tc qdisc del dev raila root",
        None,
    );
}

#[test]
#[ignore = "cluster tier: run by scripts/tiers/cluster-tier.sh on two hosts"]
fn failover_rail_b_flapping_during_the_switch_loses_nothing() {
    stream_survives(
        "failover::failover_rail_b_flapping_during_the_switch_loses_nothing",
        "tc qdisc add dev raila root netem loss 100%",
        "tc qdisc del dev raila root",
        Some((
            "tc qdisc add dev railb root netem loss 100%",
            "tc qdisc del dev railb root",
        )),
    );
}

#[test]
#[ignore = "cluster tier: run by scripts/tiers/cluster-tier.sh on two hosts"]
fn failover_both_rails_down_fails_within_the_bound() {
    rail_cut(
        "failover::failover_both_rails_down_fails_within_the_bound",
        &[
            ("NCCL_IB_HCA", "rxe"),
            ("NCCL_IB_RETRY_CNT", "7"),
            ("NCCL_ERDMA_WORK_TIMEOUT_S", "8"),
            ("NCCL_ERDMA_FAILOVER_AFTER_MS", "1000"),
        ],
        "ip link set raila down; ip link set railb down",
        "ip link set raila up; ip link set railb up",
        Duration::from_secs(25),
    );
}
