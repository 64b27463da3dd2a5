//! Case 5, bad arguments on every entry point of every version: NULL pointers, out-of-range
//! devices, sizes and counts, unknown or released handles, comms of the wrong kind. Each
//! call returns the right error code and logs a WARN naming the call, and the comms still
//! work afterwards. One function checks each entry point (or group of slots); `requests`
//! holds those of the data path, `raw` the table calls for the NULL pointers the safe
//! client cannot pass.

mod raw;
mod requests;

use std::ffi::c_void;

use crate::common::*;
use crate::support::*;
use raw::*;

#[test]
fn bad_arguments_on_every_entry_point_of_every_version() {
    run_child(test_name!(child_bad_arguments), &[], &[], false);
}

#[test]
#[ignore = "entry point of a child process"]
fn child_bad_arguments() {
    if !is_child() {
        return;
    }
    for v in VERSIONS {
        bad_arguments(v);
    }
}

/// Checks a call's code, and that it logged a WARN naming the call.
struct Expect {
    v: u32,
    seen: usize,
}

impl Expect {
    fn new(v: u32) -> Self {
        Expect {
            v,
            seen: warns().len(),
        }
    }

    fn code(&mut self, what: &str, call: &str, got: ncclResult_t, want: ncclResult_t) {
        assert_eq!(got, want, "v{}: {what}", self.v);
        // NCCL's plugin README: plugins should not use it; NCCL's misuse is an internal error.
        assert_ne!(
            got,
            ncclResult_t::ncclInvalidArgument,
            "v{}: {what}",
            self.v
        );
        let w = warns();
        assert!(
            w[self.seen..]
                .iter()
                .any(|l| l.contains(&format!("{call}: "))),
            "v{}: {what}: no WARN naming {call}: {:?}",
            self.v,
            &w[self.seen..]
        );
        self.seen = w.len();
    }

    fn err<T: std::fmt::Debug>(
        &mut self,
        what: &str,
        call: &str,
        got: Result<T, ncclResult_t>,
        want: ncclResult_t,
    ) {
        let code = got.err().unwrap_or(ncclResult_t::ncclSuccess);
        self.code(what, call, code, want);
    }
}

/// What the checks of one version share, set up in this order: a connected pair, a buffer
/// registered on the send comm, a handle registered on the recv comm and released again, one
/// that never existed, and (v11) a context of our own.
struct Bench {
    v: u32,
    net: Net,
    e: Expect,
    s: Opaque,
    r: Opaque,
    /// 4096 bytes, registered on `s` as `mh`; `p` points to them.
    buf: Vec<u8>,
    p: *mut u8,
    mh: Opaque,
    /// 64 bytes, registered on `r` as `released`, then deregistered.
    other: Vec<u8>,
    released: Opaque,
    unknown: Opaque,
    max_recvs: i32,
    ctx: *mut c_void,
}

impl Bench {
    fn new(v: u32) -> Self {
        let net = open(v);
        let e = Expect::new(v);
        let (s, r) = connect_pair(&net);
        let mut buf = vec![0u8; 4096];
        let p = buf.as_mut_ptr();
        let mh = net.reg_mr(s, p, 4096, HOST).unwrap();
        let mut other = vec![0u8; 64];
        let released = net.reg_mr(r, other.as_mut_ptr(), 64, HOST).unwrap();
        net.dereg_mr(r, released).unwrap();
        let unknown = Opaque(0x7777_0000_0042usize as *mut c_void);
        let max_recvs = net.properties(0).unwrap().max_recvs;
        // v11 calls take a context: a fresh one of our own (the client keeps its own private).
        let ctx = raw_init_v11(&net);
        Bench {
            v,
            net,
            e,
            s,
            r,
            buf,
            p,
            mh,
            other,
            released,
            unknown,
            max_recvs,
            ctx,
        }
    }
}

/// Every check on version `v`, in this order, then a transfer to show the comms still work.
fn bad_arguments(v: u32) {
    let mut b = Bench::new(v);
    init_devices_get_properties(&mut b);
    let listen = listen_connect(&mut b);
    accept_close_listen(&mut b, listen);
    reg_mr_dmabuf_dereg(&mut b);
    requests::isend(&mut b);
    let rmh = b.net.reg_mr(b.r, b.p, 4096, HOST).unwrap();
    requests::isend_matched(&mut b, rmh);
    let data = [b.p; 16];
    let sizes = [64i64; 16];
    let tags = [0i32; 16];
    let mhs = [rmh; 16];
    let ok = Arrays {
        n: 1,
        data: Some(&data),
        sizes: Some(&sizes),
        tags: Some(&tags),
        mhandles: Some(&mhs),
        request: true,
    };
    requests::irecv_arrays(&mut b, ok);
    requests::irecv_comms(&mut b, ok);
    requests::iflush(&mut b, ok);
    requests::test_requests(&mut b);
    requests::close_comms(&mut b);

    // Nothing above broke the comms.
    let Bench {
        v,
        mut net,
        s,
        r,
        buf,
        mh,
        ctx,
        ..
    } = b;
    transfer(&net, s, r, 3000, 4096, u64::from(v));
    net.dereg_mr(s, mh).unwrap();
    net.dereg_mr(r, rmh).unwrap();
    net.close_send(s).unwrap();
    net.close_recv(r).unwrap();
    raw_finalize_v11(&net, ctx);
    net.finalize().unwrap();
    drop(buf);
}

/// init (v11: a NULL context slot), devices and getProperties with NULL out pointers.
fn init_devices_get_properties(b: &mut Bench) {
    let v = b.v;
    let (net, e) = (&b.net, &mut b.e);
    if v >= 11 {
        e.code(
            "v11 init with a NULL ctx slot",
            "init",
            raw_init_v11_null_ctx(net),
            INTERNAL,
        );
    }
    e.code("devices(NULL)", "devices", raw_devices_null(net), INTERNAL);
    e.code(
        "getProperties(0, NULL)",
        "getProperties",
        raw_properties_null(net),
        INTERNAL,
    );
}

/// listen and connect: NULL handles and out slots, bad devices, (v11) an unknown context.
/// Returns a listener for [`accept_close_listen`].
fn listen_connect(b: &mut Bench) -> Opaque {
    let (v, ctx) = (b.v, b.ctx);
    let (net, e) = (&b.net, &mut b.e);
    let mut out: *mut c_void = null();
    let mut handle = [0u8; NCCL_HANDLE];
    let h = handle.as_mut_ptr() as *mut c_void;
    e.code(
        "listen with a NULL handle",
        "listen",
        raw_listen(net, ctx, null(), &mut out),
        INTERNAL,
    );
    e.code(
        "listen with a NULL listenComm",
        "listen",
        raw_listen(net, ctx, h, null()),
        INTERNAL,
    );
    e.err(
        "listen on device -1",
        "listen",
        net.listen(-1, &mut handle),
        INTERNAL,
    );
    e.err(
        "listen on device 99",
        "listen",
        net.listen(99, &mut handle),
        INTERNAL,
    );
    let listen = net.listen(0, &mut handle).unwrap();
    e.code(
        "connect with a NULL handle",
        "connect",
        raw_connect(net, ctx, null(), &mut out),
        INTERNAL,
    );
    e.code(
        "connect with a NULL sendComm",
        "connect",
        raw_connect(net, ctx, h, null()),
        INTERNAL,
    );
    e.err(
        "connect on device -1",
        "connect",
        net.connect(-1, &mut handle),
        INTERNAL,
    );
    if v >= 11 {
        let mut fake = [0u64; 4];
        let ctx = fake.as_mut_ptr() as *mut c_void;
        e.code(
            "listen with an unknown ctx",
            "listen",
            raw_listen(net, ctx, h, &mut out),
            INTERNAL,
        );
        e.code(
            "connect with an unknown ctx",
            "connect",
            raw_connect(net, ctx, h, &mut out),
            INTERNAL,
        );
    }
    listen
}

/// accept and closeListen: NULL and wrong-kind comms; then closes `listen`.
fn accept_close_listen(b: &mut Bench, listen: Opaque) {
    let s = b.s;
    let (net, e) = (&b.net, &mut b.e);
    e.err("accept(NULL)", "accept", net.accept(Opaque::NULL), INTERNAL);
    e.code(
        "accept with a NULL recvComm",
        "accept",
        raw_accept(net, listen, null()),
        INTERNAL,
    );
    e.err("accept of a send comm", "accept", net.accept(s), INTERNAL);
    e.err(
        "closeListen(NULL)",
        "closeListen",
        net.close_listen(Opaque::NULL),
        INTERNAL,
    );
    e.err(
        "closeListen of a send comm",
        "closeListen",
        net.close_listen(s),
        INTERNAL,
    );
    net.close_listen(listen).unwrap();
}

/// regMr, regMrDmaBuf and deregMr: NULL slots, comms and addresses, bad sizes and memory
/// types, unknown and released handles.
fn reg_mr_dmabuf_dereg(b: &mut Bench) {
    let (v, s, r, p, mh, released, unknown) = (b.v, b.s, b.r, b.p, b.mh, b.released, b.unknown);
    let (net, e) = (&b.net, &mut b.e);
    let mut out: *mut c_void = null();
    e.code(
        "regMr with a NULL mhandle slot",
        "regMr",
        raw_reg_mr(net, s, p, 64, null()),
        INTERNAL,
    );
    e.code(
        "regMr on a NULL comm",
        "regMr",
        raw_reg_mr(net, Opaque::NULL, p, 64, &mut out),
        INTERNAL,
    );
    e.code(
        "regMr of a NULL address",
        "regMr",
        raw_reg_mr(net, s, null(), 64, &mut out),
        INTERNAL,
    );
    if v <= 7 {
        e.code(
            "regMr of size -1 (int)",
            "regMr",
            raw_reg_mr(net, s, p, -1, &mut out),
            INTERNAL,
        );
    }
    e.err(
        "regMr of memory type 0",
        "regMr",
        net.reg_mr(s, p, 64, 0),
        INTERNAL,
    );
    e.err(
        "regMr of memory type 8",
        "regMr",
        net.reg_mr(s, p, 64, 8),
        INTERNAL,
    );
    // Asked where ptrSupport says no: NCCL's misuse.
    let dmabuf_want = if net.properties(0).unwrap().ptr_support & 4 == 0 {
        INTERNAL
    } else {
        ncclResult_t::ncclSystemError
    };
    e.code(
        "regMrDmaBuf where DMA-BUF is unsupported (or fd -1)",
        "regMrDmaBuf",
        raw_reg_dmabuf(net, s, p, &mut out),
        dmabuf_want,
    );
    e.code(
        "regMrDmaBuf with a NULL mhandle slot",
        "regMrDmaBuf",
        raw_reg_dmabuf(net, s, p, null()),
        INTERNAL,
    );
    e.err(
        "deregMr of an unknown handle",
        "deregMr",
        net.dereg_mr(s, unknown),
        INTERNAL,
    );
    e.err(
        "deregMr of a released handle",
        "deregMr",
        net.dereg_mr(r, released),
        INTERNAL,
    );
    e.err(
        "deregMr on a NULL comm",
        "deregMr",
        net.dereg_mr(Opaque::NULL, mh),
        INTERNAL,
    );
}

#[test]
fn v11_listen_and_connect_take_a_null_context_without_crashing() {
    run_child(test_name!(child_v11_null_context), &[], &[], false);
}

#[test]
#[ignore = "entry point of a child process"]
fn child_v11_null_context() {
    if !is_child() {
        return;
    }
    let mut net = open(11);
    let mut out: *mut c_void = null();
    let mut handle = [0u8; NCCL_HANDLE];
    let h = handle.as_mut_ptr() as *mut c_void;
    // listen treats a NULL context as "the plugin's own"; connect must at least not crash.
    assert_eq!(
        raw_listen(&net, null(), h, &mut out),
        ncclResult_t::ncclSuccess
    );
    let listen = Opaque(out);
    assert_eq!(
        raw_connect(&net, null(), null(), &mut out),
        INTERNAL,
        "NULL ctx, NULL handle"
    );
    out = null();
    let code = raw_connect(&net, null(), h, &mut out);
    assert_eq!(
        code,
        ncclResult_t::ncclSuccess,
        "NULL ctx, valid handle (as listen)"
    );
    // Setup is one-way: the comm comes as soon as the hello is out, which on loopback may
    // already be this first call. NCCL closes what it was given.
    if !out.is_null() {
        net.close_send(Opaque(out)).unwrap();
    }
    net.close_listen(listen).unwrap();
    net.finalize().unwrap();
}
