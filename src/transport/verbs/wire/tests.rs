//! The verbs wire formats and the arithmetic of QPs, pieces and rails.

use super::*;

#[test]
fn move_messages_and_answers_round_trip_and_refuse_bad_bytes() {
    let m = MoveMsg {
        step: Step::Refuse,
        epoch: 7,
        lost: [1, 2],
        body: b"why".to_vec(),
    };
    assert_eq!(MoveMsg::decode(&m.encode()).unwrap(), m);
    assert!(MoveMsg::decode(&[9, 0, 0, 0, 0, 0, 0]).is_err());
    let e = CtsEntry::new(0x1000, 4096, [5; MAX_RAILS], 3, 2, 41);
    let waiting = vec![(3, vec![e, e]), (4, vec![e])];
    let body = encode_answer(b"info", &waiting);
    let (info, back) = decode_answer(&body).unwrap();
    assert_eq!(info, b"info");
    assert_eq!(back.len(), 2);
    assert_eq!(back, waiting);
    assert!(decode_answer(&body[..body.len() - 1]).is_err());
    let far = encode_answer(b"", &vec![(SLOTS, vec![e])]);
    assert!(decode_answer(&far).is_err(), "a slot the connection lacks");
    let empty = encode_answer(b"", &vec![(1, vec![])]);
    assert!(decode_answer(&empty).is_err(), "a receive of no buffer");
}

#[test]
fn qps_are_dealt_over_the_rails() {
    assert_eq!(locate(0, 1), (0, 0));
    assert_eq!(locate(5, 1), (0, 5));
    let two: Vec<(usize, usize)> = (0..4).map(|q| locate(q, 2)).collect();
    assert_eq!(two, [(0, 0), (1, 0), (0, 1), (1, 1)]);
    assert_eq!(locate(7, 3), (1, 2));
    let four: Vec<(usize, usize)> = (6..10).map(|q| locate(q, 4)).collect();
    assert_eq!(four, [(2, 1), (3, 1), (0, 2), (1, 2)]);
}

#[test]
fn modulo_masks_powers_of_two_and_divides_the_rest() {
    for n in 1..=9 {
        for x in [0, 1, 7, 8, 9, 63, 64, 65, usize::MAX] {
            assert_eq!(modulo(x, n), x % n, "{x} % {n}");
        }
    }
}

#[test]
fn pieces_cover_every_byte_once_aligned() {
    for size in [
        0,
        1,
        127,
        128,
        129,
        1000,
        4096,
        65_537,
        1 << 20,
        (1 << 20) + 3,
    ] {
        for used in [1, 2, 3, 4, 8, 128] {
            let mut next = 0;
            for k in 0..used {
                let (off, len) = piece(size, k, used);
                if len > 0 {
                    assert_eq!(off, next, "size {size} used {used} piece {k}");
                    assert!(used == 1 || off % SPLIT_ALIGN == 0);
                }
                next = off + len;
            }
            assert_eq!(next, size, "size {size} over {used}");
        }
    }
    // Small messages land in the first piece; the rest are empty.
    assert_eq!(piece(100, 0, 4), (0, 100));
    assert_eq!(piece(100, 1, 4), (100, 0));
}

#[test]
fn requests_take_turns_over_qps_unless_split_or_striped() {
    let one = QpPlan {
        nqps: 4,
        rails: 1,
        split: false,
    };
    assert_eq!(one.qps(0, 1 << 20), (0, 1));
    assert_eq!(one.qps(5, 8), (1, 1));
    assert_eq!(one.qps(u64::from(u32::MAX) + 1, 8), (0, 1));
    let split = QpPlan { split: true, ..one };
    assert_eq!(split.qps(7, 8), (0, 4));
    // Two rails, two QPs each: large receives take one QP of each rail (QP q is on
    // rail q % 2), groups taking turns; small ones one QP, over both rails in turn.
    let two = QpPlan {
        nqps: 4,
        rails: 2,
        split: false,
    };
    assert_eq!(two.qps(0, STRIPE_MIN), (0, 2));
    assert_eq!(two.qps(1, 1 << 20), (2, 2));
    assert_eq!(two.qps(2, 1 << 20), (0, 2));
    let small: Vec<usize> = (0..4).map(|s| two.qps(s, STRIPE_MIN - 1).0 % 2).collect();
    assert_eq!(small, [0, 1, 0, 1], "small receives alternate rails");
    // The first piece rotates over the rails of the stripe.
    let firsts: Vec<usize> = (0..4u64).map(|s| two.qp_of_piece(s, 0, 2, 0) % 2).collect();
    assert_eq!(firsts, [0, 1, 0, 1]);
    for seq in 0..5 {
        let mut seen: Vec<usize> = (0..2).map(|k| two.qp_of_piece(seq, 2, 2, k)).collect();
        seen.sort();
        assert_eq!(seen, [2, 3], "each QP of the stripe gets one piece");
    }
}

#[test]
fn wr_ids_carry_kind_and_slot() {
    for kind in [
        WrKind::Recv,
        WrKind::Cts,
        WrKind::Send,
        WrKind::Flush,
        WrKind::Probe,
        WrKind::Landed,
        WrKind::Order,
    ] {
        for slot in [0, 1, SLOTS - 1] {
            let id = kind.id(slot);
            assert_eq!(WrKind::of(id), Some(kind));
            assert_eq!(WrKind::slot(id), slot);
        }
    }
    assert_eq!(WrKind::of(0), None);
    assert_eq!(WrKind::describe(9 << 32), "work request");
}

#[test]
fn cts_entries_saturate_sizes_and_number_receives_from_one() {
    let e = CtsEntry::new(
        0x1000,
        5 << 30,
        [7, 8, 0, 0, 0, 0, 0, 0],
        -3,
        2,
        u64::from(u32::MAX),
    );
    assert_eq!(e.size, u32::MAX);
    assert_eq!(e.seq, 1 << 32, "no wrap at 2^32");
    assert_eq!((e.addr, e.rkeys[1], e.tag, e.nreqs), (0x1000, 8, -3, 2));
    assert_eq!(cts_index(3, 2), 26);
}

fn rail(name: &str, rkey: u32) -> RailInfo {
    RailInfo {
        link_layer: 2,
        mtu: 3,
        port: 1,
        gid_index: 1,
        lid: 9,
        gid: [7; 16],
        rkey,
        device: name.into(),
    }
}

#[test]
fn paths_are_each_rail_pair_the_qps_join_numbered_alike_at_both_ends() {
    assert_eq!(paths(1, 1, 1), [(0, 0)]);
    assert_eq!(paths(8, 1, 1), [(0, 0)]);
    assert_eq!(paths(2, 2, 1), [(0, 0), (1, 0)]);
    assert_eq!(paths(2, 1, 2), [(0, 0), (0, 1)]);
    assert_eq!(paths(3, 3, 2), [(0, 0), (1, 1), (2, 0)]);
    assert_eq!(paths(4, 2, 2), [(0, 0), (1, 1)]);
    let qps = [(5, 6), (7, 8)];
    assert_eq!(decode_qps(&encode_qps(&qps), 2).unwrap(), qps);
    assert!(decode_qps(&encode_qps(&qps), 3).is_err());
    assert!(decode_qps(&encode_qps(&qps)[..9], 2).is_err());
}

#[test]
fn conn_info_round_trips_and_rejects_bad_lengths() {
    let info = ConnInfo {
        addr: 0xdead_beef_0000,
        tc: 106,
        sl: 3,
        split: true,
        mobile: true,
        rails: vec![rail("rxe0", 42), rail("rxe1", 43)],
        qps: vec![(17, 100), (18, 200), (19, 300), (20, 400)],
        probes: vec![(31, 7), (32, 8)],
    };
    let bytes = info.encode();
    assert_eq!(ConnInfo::decode(&bytes).unwrap(), info);
    assert_eq!(info.devices(), "rxe0+rxe1");
    let off = ConnInfo {
        split: false,
        mobile: false,
        ..info.clone()
    };
    let back = ConnInfo::decode(&off.encode()).unwrap();
    assert!(!back.split && !back.mobile);
    assert!(ConnInfo::decode(&bytes[..CONN_FIXED]).is_err());
    assert!(ConnInfo::decode(&bytes[..bytes.len() - 1]).is_err());
    let mut zero = bytes.clone();
    zero[2] = 0;
    assert!(ConnInfo::decode(&zero).is_err(), "no rail");
    let mut more = bytes.clone();
    more[2] = 9;
    assert!(
        ConnInfo::decode(&more).is_err(),
        "more rails than a vNIC holds"
    );
}
