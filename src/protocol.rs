//! Every wire format a peer sends the plugin, for fuzzers and hostile-peer tests: the handle
//! and the bootstrap's messages (re-exported as they are), and one check per decoder of
//! peer bytes, which decodes what it is given the way the plugin does and then holds the
//! decoder to its contract: bytes that decode re-encode to a message that decodes the same
//! (byte for byte where no field is ignored), and nothing panics or reads out of bounds.
//! A check's `Err` is the error the plugin would report for those bytes; a broken contract
//! is a panic, which a fuzzer reports as a crash.

pub use crate::error::{Error, ErrorKind};
pub use crate::oob::handle;
pub use crate::oob::{
    decode_header, encode_header, Handle, Hello, MsgKind, TransportKind, HANDLE_SIZE, MAX_PAYLOAD,
    MSG_HEADER,
};

use crate::error::Result;
pub use crate::transport::either::wire::{TCP_RECEIVER_READS, TCP_SENDER_READS};

use crate::transport::either::wire::{
    decode_answer, decode_bye, decode_qps, decode_trial, encode_answer, encode_bye, encode_qps,
    ConnInfo, CtsFrame, DataHeader, Healed, MoveMsg, Step, CTS_MAX, DATA_HEADER,
};

/// The verbs setup message (in a hello, an offer and an answer).
pub fn conn_info(bytes: &[u8]) -> Result<()> {
    let info = ConnInfo::decode(bytes)?;
    let again = info.encode();
    assert_eq!(
        again.len(),
        bytes.len(),
        "a decoded ConnInfo re-encodes to its length"
    );
    assert_eq!(ConnInfo::decode(&again).expect("re-encoded ConnInfo"), info);
    Ok(())
}

/// A move message, and its body as the step it names carries it: an offer's and an answer's
/// rails, a resume's probe QPs (as many as its count says), a refusal's reason, a trial's
/// rails (and its answer's, where it has any).
pub fn move_message(bytes: &[u8]) -> Result<()> {
    let msg = MoveMsg::decode(bytes)?;
    assert_eq!(
        msg.encode(),
        bytes,
        "a move message re-encodes byte for byte"
    );
    match msg.step {
        Step::Offer => conn_info(&msg.body),
        Step::Trial | Step::Tried => {
            let (_, rails) = decode_trial(&msg.body)?;
            match msg.step {
                Step::Tried if rails.is_empty() => Ok(()),
                _ => conn_info(rails),
            }
        }
        Step::Answer => answer(&msg.body),
        Step::Resume => probe_qps(&msg.body),
        Step::Refuse => {
            let _ = String::from_utf8_lossy(&msg.body);
            Ok(())
        }
        Step::Healed => Healed::decode(&msg.body).map(|_| ()),
        Step::Down => Ok(()),
    }
}

/// A move's answer: the receiver's rails and the receives it still waits for.
pub fn answer(bytes: &[u8]) -> Result<()> {
    let (info, waiting) = decode_answer(bytes)?;
    let again = encode_answer(info, &waiting);
    assert_eq!(
        again.len(),
        bytes.len(),
        "a decoded answer re-encodes to its length"
    );
    let (info_again, waiting_again) = decode_answer(&again).expect("re-encoded answer");
    assert_eq!((info_again, &waiting_again), (info, &waiting));
    conn_info(info)
}

/// A resume's probe QP list, read for as many paths as its count names.
pub fn probe_qps(bytes: &[u8]) -> Result<()> {
    let want = bytes
        .get(..2)
        .map_or(0, |b| usize::from(u16::from_le_bytes([b[0], b[1]])));
    let qps = decode_qps(bytes, want)?;
    assert_eq!(
        encode_qps(&qps),
        bytes,
        "a probe list re-encodes byte for byte"
    );
    Ok(())
}

/// A `Bye`'s body.
pub fn bye(bytes: &[u8]) -> Result<()> {
    let landed = decode_bye(bytes)?;
    assert_eq!(encode_bye(landed), bytes, "a bye re-encodes byte for byte");
    Ok(())
}

/// What a tcp end reads after setup, after a byte that says which end
/// ([`TCP_SENDER_READS`], [`TCP_RECEIVER_READS`]): a sender's clear-to-send frames, one after
/// another as they fill its buffer (a partial one at the end waits for more), or a
/// receiver's data frame headers (16 bytes each; payloads are the user's bytes).
pub fn tcp_frames(bytes: &[u8]) -> Result<()> {
    let Some((&end, mut rest)) = bytes.split_first() else {
        return Ok(());
    };
    if end & 1 == TCP_RECEIVER_READS {
        for h in rest.chunks_exact(DATA_HEADER) {
            let h: &[u8; DATA_HEADER] = h.try_into().expect("chunks of the header's size");
            let header = DataHeader::decode(h)?;
            let again = DataHeader::decode(&header.encode()).expect("re-encoded header");
            assert_eq!(again, header);
        }
        return Ok(());
    }
    while let Some((frame, len)) = CtsFrame::decode(rest)? {
        assert!(len <= rest.len());
        let mut out = [0u8; CTS_MAX];
        assert_eq!(frame.encode(&mut out), len);
        let again = CtsFrame::decode(&out[..len]).expect("re-encoded frame");
        assert_eq!(again, Some((frame, len)));
        rest = &rest[len..];
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
    use std::path::Path;

    use proptest::prelude::*;

    use super::*;
    use crate::transport::either::wire::{
        CtsEntry, RailInfo, Waiting, MAX_QPS, MAX_RAILS, MAX_RECVS, SLOTS,
    };

    type Check = fn(&[u8]) -> Result<()>;

    /// Each fuzz target's check, by the name of its corpus.
    const TARGETS: [(&str, Check); 6] = [
        ("conn_info", conn_info),
        ("move_message", move_message),
        ("answer", answer),
        ("probe_qps", probe_qps),
        ("bye", bye),
        ("tcp_frames", tcp_frames),
    ];

    #[test]
    fn every_captured_seed_decodes_as_the_plugin_reads_it() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
        for (target, check) in TARGETS {
            let mut seeds = 0;
            for f in std::fs::read_dir(root.join(target)).unwrap() {
                let f = f.unwrap().path();
                if f.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with("captured-")
                {
                    let bytes = std::fs::read(&f).unwrap();
                    check(&bytes).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
                    seeds += 1;
                }
            }
            assert!(seeds > 0, "no captured seed for {target}");
        }
    }

    #[test]
    fn short_and_trailing_bytes_name_the_field() {
        let info = conn_info_sample();
        let bytes = info.encode();
        let e = ConnInfo::decode(&bytes[..bytes.len() - 3]).unwrap_err();
        assert!(e.to_string().contains("field `PSN`"), "{e}");
        let mut long = bytes.clone();
        long.push(0);
        let e = ConnInfo::decode(&long).unwrap_err();
        assert!(e.to_string().contains("1 bytes follow"), "{e}");
        assert_eq!(e.kind(), ErrorKind::Remote);
        let mut many = bytes;
        many[2] = MAX_RAILS as u8 + 1;
        let e = ConnInfo::decode(&many).unwrap_err();
        assert!(e.to_string().contains("field `rails`"), "{e}");
    }

    fn conn_info_sample() -> ConnInfo {
        ConnInfo {
            addr: 1,
            tc: 2,
            sl: 3,
            split: false,
            mobile: true,
            rails: vec![RailInfo {
                link_layer: 2,
                mtu: 5,
                port: 1,
                gid_index: 1,
                lid: 0,
                gid: [9; 16],
                rkey: 77,
                device: "erdma_0".into(),
            }],
            qps: vec![(1, 2), (3, 4)],
            probes: vec![(5, 6)],
        }
    }

    /// (QP number, PSN): 24 bits each.
    fn qp_pairs() -> impl Strategy<Value = (u32, u32)> {
        (0..1u32 << 24, 0..1u32 << 24)
    }

    fn rail() -> impl Strategy<Value = RailInfo> {
        (
            any::<[u8; 4]>(),
            any::<u16>(),
            any::<[u8; 16]>(),
            any::<u32>(),
            "[a-z0-9_]{0,32}",
        )
            .prop_map(|(b, lid, gid, rkey, device)| RailInfo {
                link_layer: b[0],
                mtu: b[1],
                port: b[2],
                gid_index: b[3],
                lid,
                gid,
                rkey,
                device,
            })
    }

    fn conn_infos() -> impl Strategy<Value = ConnInfo> {
        let pairs = |n| prop::collection::vec(qp_pairs(), n);
        (1..=MAX_RAILS, 1..=MAX_QPS)
            .prop_flat_map(move |(rails, qps)| {
                let qps = qps.max(rails);
                (
                    prop::collection::vec(rail(), rails),
                    pairs(qps..=qps),
                    pairs(0..=qps),
                    any::<(u64, u8, u8, bool, bool)>(),
                )
            })
            .prop_map(
                |(rails, qps, probes, (addr, tc, sl, split, mobile))| ConnInfo {
                    addr,
                    tc,
                    sl,
                    split,
                    mobile,
                    rails,
                    qps,
                    probes,
                },
            )
    }

    fn cts_entries() -> impl Strategy<Value = CtsEntry> {
        (
            any::<(u64, i32, u32, u32, u64)>(),
            any::<[u32; MAX_RAILS]>(),
        )
            .prop_map(|((addr, tag, size, nreqs, seq), rkeys)| {
                let mut e = CtsEntry::default();
                (e.addr, e.tag, e.size, e.nreqs, e.seq, e.rkeys) =
                    (addr, tag, size, nreqs, seq, rkeys);
                e
            })
    }

    fn waiting() -> impl Strategy<Value = Waiting> {
        prop::collection::vec(
            (
                0..SLOTS,
                prop::collection::vec(cts_entries(), 1..=MAX_RECVS),
            ),
            0..=SLOTS,
        )
    }

    fn steps() -> impl Strategy<Value = Step> {
        prop_oneof![
            Just(Step::Down),
            Just(Step::Offer),
            Just(Step::Answer),
            Just(Step::Resume),
            Just(Step::Refuse),
            Just(Step::Healed),
        ]
    }

    fn handles() -> impl Strategy<Value = Handle> {
        let ip = prop_oneof![
            any::<[u8; 4]>().prop_map(|o| IpAddr::V4(Ipv4Addr::from(o))),
            any::<[u8; 16]>().prop_map(|o| IpAddr::V6(Ipv6Addr::from(o))),
        ]
        .prop_filter("a usable address", |ip| {
            !ip.is_unspecified() && !ip.is_multicast()
        });
        let transport = prop_oneof![Just(TransportKind::Tcp), Just(TransportKind::Verbs)];
        (ip, 1..=u16::MAX, transport, any::<u64>()).prop_map(|(ip, port, transport, nonce)| {
            Handle {
                addr: SocketAddr::new(ip, port),
                transport,
                nonce,
            }
        })
    }

    fn cts_frames() -> impl Strategy<Value = CtsFrame> {
        (
            1..=MAX_RECVS,
            any::<u32>(),
            any::<[(u64, i32); MAX_RECVS]>(),
        )
            .prop_map(|(n, seq, entries)| {
                let mut f = CtsFrame {
                    seq,
                    n,
                    sizes: [0; MAX_RECVS],
                    tags: [0; MAX_RECVS],
                };
                for (i, (size, tag)) in entries.into_iter().take(n).enumerate() {
                    f.sizes[i] = size;
                    f.tags[i] = tag;
                }
                f
            })
    }

    proptest! {
        #[test]
        fn conn_info_round_trips(info in conn_infos()) {
            prop_assert_eq!(ConnInfo::decode(&info.encode()).unwrap(), info);
        }

        #[test]
        fn move_messages_round_trip(
            step in steps(),
            epoch: u32,
            lost: [u8; 2],
            body in prop::collection::vec(any::<u8>(), 0..300),
        ) {
            let m = MoveMsg { step, epoch, lost, body };
            prop_assert_eq!(MoveMsg::decode(&m.encode()).unwrap(), m);
        }

        #[test]
        fn answers_round_trip(
            info in prop::collection::vec(any::<u8>(), 0..300),
            waiting in waiting(),
        ) {
            let bytes = encode_answer(&info, &waiting);
            let (info_back, waiting_back) = decode_answer(&bytes).unwrap();
            prop_assert_eq!(info_back, &info[..]);
            prop_assert_eq!(waiting_back, waiting);
        }

        #[test]
        fn probe_lists_and_byes_round_trip(
            qps in prop::collection::vec(qp_pairs(), 0..=MAX_QPS),
            landed: Option<u64>,
        ) {
            prop_assert_eq!(decode_qps(&encode_qps(&qps), qps.len()).unwrap(), qps);
            prop_assert_eq!(decode_bye(&encode_bye(landed)).unwrap(), landed);
        }

        #[test]
        fn handles_headers_and_hellos_round_trip(
            handle in handles(),
            len in 0..=MAX_PAYLOAD,
            payload in prop::collection::vec(any::<u8>(), 0..100),
        ) {
            let mut buf = [0xa5u8; HANDLE_SIZE];
            handle.encode(&mut buf);
            prop_assert_eq!(Handle::decode(&buf).unwrap(), handle);
            prop_assert_eq!(handle::stage_id(&buf).unwrap(), None);
            for kind in [MsgKind::Hello, MsgKind::Reject, MsgKind::Move, MsgKind::Bye] {
                prop_assert_eq!(decode_header(&encode_header(kind, len)).unwrap(), (kind, len));
            }
            let hello = Hello { nonce: handle.nonce, transport: handle.transport, payload };
            prop_assert_eq!(Hello::decode(&hello.encode()).unwrap(), hello);
        }

        #[test]
        fn tcp_frames_round_trip(
            frame in cts_frames(),
            (entry, truncated, seq, size) in any::<(u8, bool, u32, u64)>(),
        ) {
            let mut out = [0u8; CTS_MAX];
            let len = frame.encode(&mut out);
            prop_assert_eq!(CtsFrame::decode(&out[..len]).unwrap(), Some((frame, len)));
            prop_assert_eq!(CtsFrame::decode(&out[..len - 1]).unwrap(), None);
            let header = DataHeader { entry, truncated, seq, size };
            prop_assert_eq!(DataHeader::decode(&header.encode()).unwrap(), header);
        }
    }
}
