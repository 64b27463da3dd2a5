//! The seed corpora of the fuzz targets for what a verbs peer sends, captured from a run on
//! the fake fabric: connections of one and two rails set up, streams, moves with receives
//! waiting (the receiver's path cut first, then the sender's), a NIC healed and the move
//! back, a receiver closing first. Run by hand
//! when a wire format changes; it rewrites `fuzz/corpus/<target>/captured-*`:
//! `cargo test --lib capture_the_seed_corpora -- --ignored`.

use std::collections::BTreeSet;
use std::path::Path;

use crate::codec::tap;
use crate::transport::Tested;

use super::failback::{home, idle_until};
use super::failover::{connect_mobile, mobile, through};
use super::*;

/// The fuzz target that reads each message the plugin reads.
fn target(message: &str) -> Option<&'static str> {
    Some(match message {
        "connection info" => "conn_info",
        "move message" => "move_message",
        "move answer" => "answer",
        "probe QP list" => "probe_qps",
        "bye" => "bye",
        _ => return None,
    })
}

#[test]
#[ignore = "writes fuzz/corpus: run by hand when a wire format changes"]
fn capture_the_seed_corpora() {
    tap::listen();
    for rails in [1, 2] {
        let c = connect_mobile(rails, 1, mobile());
        through(&c, 64, 1);
        c.fabric.cut(&c.rx_nics[0], Some(Cut::Fail(RETRY_EXCEEDED)));
        through(&c, 100_000, 2);
        let c2 = connect_mobile(rails, 1, mobile());
        through(&c2, 4096, 3);
        c2.fabric
            .cut(&c2.tx_nics[0], Some(Cut::Fail(RETRY_EXCEEDED)));
        through(&c2, 8, 4);
    }
    // A NIC lost and healed: both ends' `Healed`, and the move back.
    let p = ConnParams {
        failback: (Duration::from_millis(20), true),
        ..mobile()
    };
    let c = connect_mobile(1, 1, p);
    through(&c, 64, 1);
    c.fabric.cut(&c.tx_nics[0], Some(Cut::Down));
    through(&c, 64, 2);
    c.fabric.cut(&c.tx_nics[0], None);
    idle_until(&c, Duration::from_secs(5), || home(&c));
    // A receiver that closes with a send landed but not yet acknowledged: its `Bye`.
    let c = connect_mobile(1, 1, mobile());
    through(&c, 64, 1);
    c.fabric.lose_acks(&c.tx_nics[0]);
    let mut dst = c.buf(false, 4096, 0);
    let mut src = c.buf(true, 4096, 7);
    let r = c.irecv(&mut [&mut dst], &[5]);
    let s = c.send_buf(&mut src, 5);
    assert_eq!(wait(|| c.test_recv(r)).unwrap(), Completion::single(4096));
    let Conn { send, recv, .. } = c;
    drop(recv);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !matches!(send.test(s), Tested::Done(4096)) {
        assert!(Instant::now() < deadline, "the landed send never completed");
    }
    let heard = tap::heard();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
    let mut kept: BTreeSet<(&str, Vec<u8>)> = BTreeSet::new();
    for (message, bytes) in heard {
        if let Some(t) = target(message) {
            kept.insert((t, bytes));
        }
    }
    let targets: BTreeSet<&str> = kept.iter().map(|(t, _)| *t).collect();
    assert!(
        targets.len() == 5,
        "the run reads ConnInfo, moves, answers, probe lists and a bye: {targets:?}"
    );
    for t in &targets {
        let dir = root.join(t);
        std::fs::create_dir_all(&dir).unwrap();
        for old in std::fs::read_dir(&dir).unwrap() {
            let old = old.unwrap().path();
            let name = old.file_name().unwrap().to_string_lossy().into_owned();
            if name.starts_with("captured-") {
                std::fs::remove_file(old).unwrap();
            }
        }
    }
    let mut n = std::collections::BTreeMap::<&str, usize>::new();
    for (t, bytes) in kept {
        let i = n.entry(t).or_default();
        *i += 1;
        std::fs::write(root.join(t).join(format!("captured-{i}")), bytes).unwrap();
    }
    eprintln!("seed corpora written: {n:?}");
}
