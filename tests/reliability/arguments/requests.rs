//! Case 5 on the data path: bad arguments to isend, irecv, iflush, test and the close calls.

use std::ffi::c_void;

use super::raw::*;
use super::Bench;
use crate::common::*;
use crate::support::*;

/// isend: NULL request slots and comms, comms of the wrong kind (buffers, sizes and
/// handles: [`isend_matched`]).
pub(super) fn isend(b: &mut Bench) {
    let (v, s, r, p, mh) = (b.v, b.s, b.r, b.p, b.mh);
    let (net, e) = (&b.net, &mut b.e);
    let mut req: *mut c_void = null();
    e.code(
        "isend with a NULL request slot",
        "isend",
        raw_isend(net, s, p, 8, mh, null()),
        INTERNAL,
    );
    e.code(
        "isend on a NULL comm",
        "isend",
        raw_isend(net, Opaque::NULL, p, 8, mh, &mut req),
        INTERNAL,
    );
    e.code(
        "isend on a recv comm",
        "isend",
        raw_isend(net, r, p, 8, mh, &mut req),
        INTERNAL,
    );
    assert!(req.is_null(), "v{v}: no request from a failed isend");
}

/// isend with NULL buffers, sizes out of range, unknown and released handles. An isend
/// looks at its buffer, size and handle once the receiver's clear-to-send has come (NCCL
/// retries it until then, and the retries must cost nothing), so a receive into `rmh`'s
/// buffer is posted first; each failed isend leaves it to the good one that ends the check.
pub(super) fn isend_matched(b: &mut Bench, rmh: Opaque) {
    let (v, s, r, p, mh, released, unknown) = (b.v, b.s, b.r, b.p, b.mh, b.released, b.unknown);
    let (net, e) = (&b.net, &mut b.e);
    let rreq = poll_until("irecv", || {
        net.irecv(r, &[(p, 4096)], &[0], &[rmh], false)
            .expect("irecv")
    });
    let mut req: *mut c_void = null();
    e.code(
        "isend of a NULL buffer",
        "isend",
        isend_answer(net, (s, rreq), null(), 8, mh, &mut req),
        INTERNAL,
    );
    if v <= 8 {
        e.code(
            "isend of size -1 (int)",
            "isend",
            isend_answer(net, (s, rreq), p, -1, mh, &mut req),
            INTERNAL,
        );
        e.code(
            "isend of size INT_MIN (int)",
            "isend",
            isend_answer(net, (s, rreq), p, i64::from(i32::MIN), mh, &mut req),
            INTERNAL,
        );
    } else {
        e.code(
            "isend beyond maxP2pBytes",
            "isend",
            isend_answer(net, (s, rreq), p, (1 << 30) + 1, mh, &mut req),
            INTERNAL,
        );
    }
    e.code(
        "isend with an unknown mhandle",
        "isend",
        isend_answer(net, (s, rreq), p, 8, unknown, &mut req),
        INTERNAL,
    );
    e.code(
        "isend with a released mhandle",
        "isend",
        isend_answer(net, (s, rreq), b.other.as_mut_ptr(), 8, released, &mut req),
        INTERNAL,
    );
    assert!(req.is_null(), "v{v}: no request from a failed isend");
    let sreq = isend_testing(net, rreq, || net.isend(s, p, 8, 0, mh).expect("isend"));
    wait(net, sreq, 1);
    assert_eq!(
        wait(net, rreq, 1),
        [8],
        "v{v}: the receive the failed sends left"
    );
}

/// Retries a raw isend of `len` bytes until it returns an error or a request (on verbs the
/// receiver's clear-to-send takes a moment to land), testing the receive `rreq` it is for
/// meanwhile, as NCCL's proxy does (see `isend_testing`).
fn isend_answer(
    net: &Net,
    (s, rreq): (Opaque, Opaque),
    p: *mut u8,
    len: i64,
    mh: Opaque,
    req: &mut *mut c_void,
) -> ncclResult_t {
    let start = std::time::Instant::now();
    loop {
        let code = raw_isend(net, s, p, len, mh, req);
        if code != ncclResult_t::ncclSuccess || !req.is_null() {
            return code;
        }
        assert!(!net.test(rreq, None).expect("test of the receive"));
        assert!(start.elapsed() < DEADLINE, "isend never answered");
    }
}

/// irecv with each array, count and request slot of `ok` made bad in turn.
pub(super) fn irecv_arrays(b: &mut Bench, ok: Arrays<'_>) {
    let (v, r, max_recvs, released, unknown) = (b.v, b.r, b.max_recvs, b.released, b.unknown);
    let (net, e) = (&b.net, &mut b.e);
    for (what, a, want) in [
        (
            "irecv with a NULL request slot",
            Arrays {
                request: false,
                ..ok
            },
            INTERNAL,
        ),
        ("irecv with n = 0", Arrays { n: 0, ..ok }, INTERNAL),
        ("irecv with n = -1", Arrays { n: -1, ..ok }, INTERNAL),
        (
            "irecv with n = maxRecvs + 1",
            Arrays {
                n: max_recvs + 1,
                ..ok
            },
            INTERNAL,
        ),
        (
            "irecv with n = INT_MAX",
            Arrays { n: i32::MAX, ..ok },
            INTERNAL,
        ),
        (
            "irecv with a NULL data array",
            Arrays { data: None, ..ok },
            INTERNAL,
        ),
        (
            "irecv with a NULL sizes array",
            Arrays { sizes: None, ..ok },
            INTERNAL,
        ),
        (
            "irecv with a NULL tags array",
            Arrays { tags: None, ..ok },
            INTERNAL,
        ),
        (
            "irecv with a NULL mhandles array",
            Arrays {
                mhandles: None,
                ..ok
            },
            INTERNAL,
        ),
        (
            "irecv of a NULL buffer",
            Arrays {
                data: Some(&[null(); 16]),
                ..ok
            },
            INTERNAL,
        ),
        (
            "irecv with an unknown mhandle",
            Arrays {
                mhandles: Some(&[unknown; 16]),
                ..ok
            },
            INTERNAL,
        ),
        (
            "irecv with a released mhandle",
            Arrays {
                data: Some(&[b.other.as_mut_ptr(); 16]),
                mhandles: Some(&[released; 16]),
                ..ok
            },
            INTERNAL,
        ),
    ] {
        let (code, req) = raw_irecv(net, r, a);
        e.code(what, "irecv", code, want);
        assert!(req.is_null(), "v{v}: {what}: no request");
    }
}

/// irecv on NULL and wrong-kind comms, and (up to v8) of a negative size.
pub(super) fn irecv_comms(b: &mut Bench, ok: Arrays<'_>) {
    let (v, s, r) = (b.v, b.s, b.r);
    let (net, e) = (&b.net, &mut b.e);
    let (code, _) = raw_irecv(net, Opaque::NULL, ok);
    e.code("irecv on a NULL comm", "irecv", code, INTERNAL);
    let (code, _) = raw_irecv(net, s, ok);
    e.code("irecv on a send comm", "irecv", code, INTERNAL);
    if v <= 8 {
        let (code, _) = raw_irecv(
            net,
            r,
            Arrays {
                sizes: Some(&[-5; 16]),
                ..ok
            },
        );
        e.code("irecv of size -5 (int)", "irecv", code, INTERNAL);
    }
}

/// iflush with each array, count and request slot of `ok` made bad in turn, and on NULL and
/// wrong-kind comms.
pub(super) fn iflush(b: &mut Bench, ok: Arrays<'_>) {
    let (s, r, max_recvs) = (b.s, b.r, b.max_recvs);
    let (net, e) = (&b.net, &mut b.e);
    for (what, a) in [
        (
            "iflush with a NULL request slot",
            Arrays {
                request: false,
                ..ok
            },
        ),
        ("iflush with n = 0", Arrays { n: 0, ..ok }),
        ("iflush with n = -1", Arrays { n: -1, ..ok }),
        (
            "iflush with n = maxRecvs + 1",
            Arrays {
                n: max_recvs + 1,
                ..ok
            },
        ),
        ("iflush with a NULL data array", Arrays { data: None, ..ok }),
        (
            "iflush with a NULL sizes array",
            Arrays { sizes: None, ..ok },
        ),
        (
            "iflush with a NULL mhandles array",
            Arrays {
                mhandles: None,
                ..ok
            },
        ),
        (
            "iflush of size -5",
            Arrays {
                sizes: Some(&[-5; 16]),
                ..ok
            },
        ),
    ] {
        e.code(what, "iflush", raw_iflush(net, r, a), INTERNAL);
    }
    e.code(
        "iflush on a NULL comm",
        "iflush",
        raw_iflush(net, Opaque::NULL, ok),
        INTERNAL,
    );
    e.code(
        "iflush on a send comm",
        "iflush",
        raw_iflush(net, s, ok),
        INTERNAL,
    );
}

/// test: NULL done leaves the request in flight; a comm is not a request; a finished
/// request cannot be tested again.
pub(super) fn test_requests(b: &mut Bench) {
    let (v, s, r) = (b.v, b.s, b.r);
    let (net, e) = (&b.net, &mut b.e);
    let mut src = reg(net, s, pattern(5, 100));
    let mut dst = reg(net, r, vec![0u8; 100]);
    let rreq = poll_until("irecv", || {
        net.irecv(r, &[(dst.buf.as_mut_ptr(), 100)], &[9], &[dst.mh], false)
            .unwrap()
    });
    let sreq = poll_until("isend", || {
        net.isend(s, src.buf.as_mut_ptr(), 100, 9, src.mh).unwrap()
    });
    e.code(
        "test with a NULL done",
        "test",
        net.test_code(rreq, None),
        INTERNAL,
    );
    e.code(
        "test(NULL)",
        "test",
        net.test_code(Opaque::NULL, Some(&mut 0)),
        INTERNAL,
    );
    e.code(
        "test of a comm",
        "test",
        net.test_code(s, Some(&mut 0)),
        INTERNAL,
    );
    assert_eq!(wait(net, rreq, 1), vec![100], "v{v}: the request survived");
    assert_eq!(wait(net, sreq, 1), vec![100]);
    assert!(dst.buf == src.buf);
    e.err(
        "test of a finished request",
        "test",
        net.test(rreq, None),
        INTERNAL,
    );
    dereg(net, s, src);
    dereg(net, r, dst);
}

/// closeSend and closeRecv: NULL and wrong-kind comms.
pub(super) fn close_comms(b: &mut Bench) {
    let (s, r) = (b.s, b.r);
    let (net, e) = (&b.net, &mut b.e);
    e.err(
        "closeSend(NULL)",
        "closeSend",
        net.close_send(Opaque::NULL),
        INTERNAL,
    );
    e.err(
        "closeRecv(NULL)",
        "closeRecv",
        net.close_recv(Opaque::NULL),
        INTERNAL,
    );
    e.err(
        "closeSend of a recv comm",
        "closeSend",
        net.close_send(r),
        INTERNAL,
    );
    e.err(
        "closeRecv of a send comm",
        "closeRecv",
        net.close_recv(s),
        INTERNAL,
    );
}
