//! Raw table access for case 5, for the NULL pointers the safe client cannot pass: each
//! slot of the loaded version called with its own C signature.

use std::ffi::{c_int, c_void};

use crate::common::*;
use nccl_net_erdma::ffi;

/// The loaded table, typed by its version.
enum Tbl<'a> {
    V6(&'a ffi::ncclNet_v6_t),
    V7(&'a ffi::ncclNet_v7_t),
    V8(&'a ffi::ncclNet_v8_t),
    V9(&'a ffi::ncclNet_v9_t),
    V10(&'a ffi::ncclNet_v10_t),
    V11(&'a ffi::ncclNet_v11_t),
    V12(&'a ffi::ncclNet_v12_t),
}

fn tbl(net: &Net) -> Tbl<'_> {
    let p = net.table_ptr();
    // SAFETY: `table_ptr` is the `ncclNetPlugin_v<version>` symbol of a library that stays
    // loaded while `net` lives, and it has that version's layout.
    unsafe {
        match net.version() {
            6 => Tbl::V6(&*(p as *const ffi::ncclNet_v6_t)),
            7 => Tbl::V7(&*(p as *const ffi::ncclNet_v7_t)),
            8 => Tbl::V8(&*(p as *const ffi::ncclNet_v8_t)),
            9 => Tbl::V9(&*(p as *const ffi::ncclNet_v9_t)),
            10 => Tbl::V10(&*(p as *const ffi::ncclNet_v10_t)),
            11 => Tbl::V11(&*(p as *const ffi::ncclNet_v11_t)),
            12 => Tbl::V12(&*(p as *const ffi::ncclNet_v12_t)),
            v => unreachable!("version {v}"),
        }
    }
}

/// `$body` for whichever table is loaded (for slots with the same arity in every version;
/// literals and `null_mut()` take each version's types).
macro_rules! each {
    ($net:expr, $t:ident => $body:expr) => {
        match tbl($net) {
            Tbl::V6($t) => $body,
            Tbl::V7($t) => $body,
            Tbl::V8($t) => $body,
            Tbl::V9($t) => $body,
            Tbl::V10($t) => $body,
            Tbl::V11($t) => $body,
            Tbl::V12($t) => $body,
        }
    };
}

pub(super) fn null<T>() -> *mut T {
    std::ptr::null_mut()
}

// Every raw call below passes the slot of the loaded version its own C signature; pointer
// arguments are NULL (the point of the test: the plugin must check them) or point to live
// storage of the right type and length for the duration of the call.

pub(super) fn raw_devices_null(net: &Net) -> ncclResult_t {
    // SAFETY: see the note on raw calls above.
    unsafe { each!(net, t => t.devices.unwrap()(null())) }
}

pub(super) fn raw_properties_null(net: &Net) -> ncclResult_t {
    // SAFETY: see the note on raw calls above.
    unsafe { each!(net, t => t.getProperties.unwrap()(0, null())) }
}

pub(super) fn raw_listen(
    net: &Net,
    ctx: *mut c_void,
    handle: *mut c_void,
    out: *mut *mut c_void,
) -> ncclResult_t {
    // SAFETY: see the note on raw calls above.
    unsafe {
        match tbl(net) {
            Tbl::V6(t) => t.listen.unwrap()(0, handle, out),
            Tbl::V7(t) => t.listen.unwrap()(0, handle, out),
            Tbl::V8(t) => t.listen.unwrap()(0, handle, out),
            Tbl::V9(t) => t.listen.unwrap()(0, handle, out),
            Tbl::V10(t) => t.listen.unwrap()(0, handle, out),
            Tbl::V11(t) => t.listen.unwrap()(ctx, 0, handle, out),
            Tbl::V12(t) => t.listen.unwrap()(ctx, 0, handle, out),
        }
    }
}

pub(super) fn raw_connect(
    net: &Net,
    ctx: *mut c_void,
    handle: *mut c_void,
    out: *mut *mut c_void,
) -> ncclResult_t {
    // SAFETY: see the note on raw calls above.
    unsafe {
        match tbl(net) {
            Tbl::V6(t) => t.connect.unwrap()(0, handle, out),
            Tbl::V7(t) => t.connect.unwrap()(0, handle, out, &mut null()),
            Tbl::V8(t) => t.connect.unwrap()(0, handle, out, &mut null()),
            Tbl::V9(t) => t.connect.unwrap()(0, handle, out, &mut null()),
            Tbl::V10(t) => t.connect.unwrap()(0, null(), handle, out, &mut null()),
            Tbl::V11(t) => t.connect.unwrap()(ctx, 0, handle, out, &mut null()),
            Tbl::V12(t) => t.connect.unwrap()(ctx, 0, handle, out, &mut null()),
        }
    }
}

pub(super) fn raw_accept(net: &Net, listen: Opaque, out: *mut *mut c_void) -> ncclResult_t {
    // SAFETY: see the note on raw calls above.
    unsafe {
        match tbl(net) {
            Tbl::V6(t) => t.accept.unwrap()(listen.0, out),
            Tbl::V7(t) => t.accept.unwrap()(listen.0, out, &mut null()),
            Tbl::V8(t) => t.accept.unwrap()(listen.0, out, &mut null()),
            Tbl::V9(t) => t.accept.unwrap()(listen.0, out, &mut null()),
            Tbl::V10(t) => t.accept.unwrap()(listen.0, out, &mut null()),
            Tbl::V11(t) => t.accept.unwrap()(listen.0, out, &mut null()),
            Tbl::V12(t) => t.accept.unwrap()(listen.0, out, &mut null()),
        }
    }
}

/// `regMr` with a signed size (an `int` in v6/v7) and an explicit out pointer.
pub(super) fn raw_reg_mr(
    net: &Net,
    comm: Opaque,
    data: *mut u8,
    size: i64,
    out: *mut *mut c_void,
) -> ncclResult_t {
    let d = data as *mut c_void;
    let (int, z) = (size as c_int, size as usize);
    // SAFETY: see the note on raw calls above.
    unsafe {
        match tbl(net) {
            Tbl::V6(t) => t.regMr.unwrap()(comm.0, d, int, HOST, out),
            Tbl::V7(t) => t.regMr.unwrap()(comm.0, d, int, HOST, out),
            Tbl::V8(t) => t.regMr.unwrap()(comm.0, d, z, HOST, out),
            Tbl::V9(t) => t.regMr.unwrap()(comm.0, d, z, HOST, out),
            Tbl::V10(t) => t.regMr.unwrap()(comm.0, d, z, HOST, out),
            Tbl::V11(t) => t.regMr.unwrap()(comm.0, d, z, HOST, out),
            Tbl::V12(t) => t.regMr.unwrap()(comm.0, d, z, HOST, out),
        }
    }
}

pub(super) fn raw_reg_dmabuf(
    net: &Net,
    comm: Opaque,
    data: *mut u8,
    out: *mut *mut c_void,
) -> ncclResult_t {
    // SAFETY: see the note on raw calls above (fd -1: refused, or EBADF from the kernel).
    unsafe {
        each!(net, t => t.regMrDmaBuf.unwrap()(comm.0, data as *mut c_void, 64, 4, 0, -1, out))
    }
}

/// `isend` with a signed size (an `int` up to v8) and an explicit request slot.
pub(super) fn raw_isend(
    net: &Net,
    comm: Opaque,
    data: *mut u8,
    size: i64,
    mh: Opaque,
    req: *mut *mut c_void,
) -> ncclResult_t {
    let d = data as *mut c_void;
    let (int, z) = (size as c_int, size as usize);
    // SAFETY: see the note on raw calls above.
    unsafe {
        match tbl(net) {
            Tbl::V6(t) => t.isend.unwrap()(comm.0, d, int, 0, mh.0, req),
            Tbl::V7(t) => t.isend.unwrap()(comm.0, d, int, 0, mh.0, req),
            Tbl::V8(t) => t.isend.unwrap()(comm.0, d, int, 0, mh.0, req),
            Tbl::V9(t) => t.isend.unwrap()(comm.0, d, z, 0, mh.0, req),
            Tbl::V10(t) => t.isend.unwrap()(comm.0, d, z, 0, mh.0, null(), req),
            Tbl::V11(t) => t.isend.unwrap()(comm.0, d, z, 0, mh.0, null(), req),
            Tbl::V12(t) => t.isend.unwrap()(comm.0, d, z, 0, mh.0, null(), req),
        }
    }
}

/// Arguments of a raw `irecv`/`iflush`: `None` passes NULL for that array or slot.
#[derive(Clone, Copy)]
pub(super) struct Arrays<'a> {
    pub(super) n: c_int,
    pub(super) data: Option<&'a [*mut u8]>,
    pub(super) sizes: Option<&'a [i64]>,
    pub(super) tags: Option<&'a [i32]>,
    pub(super) mhandles: Option<&'a [Opaque]>,
    pub(super) request: bool,
}

/// Room for the arrays of one raw call (more than `maxRecvs`).
struct ArrayStorage {
    data: [*mut c_void; 16],
    sizes_i: [c_int; 16],
    sizes_z: [usize; 16],
    tags: [c_int; 16],
    mh: [*mut c_void; 16],
}

impl ArrayStorage {
    fn from(a: &Arrays<'_>) -> Self {
        let mut s = ArrayStorage {
            data: [null(); 16],
            sizes_i: [0; 16],
            sizes_z: [0; 16],
            tags: [0; 16],
            mh: [null(); 16],
        };
        for (i, d) in a.data.unwrap_or_default().iter().enumerate() {
            s.data[i] = *d as *mut c_void;
        }
        for (i, z) in a.sizes.unwrap_or_default().iter().enumerate() {
            s.sizes_i[i] = *z as c_int;
            s.sizes_z[i] = *z as usize;
        }
        for (i, t) in a.tags.unwrap_or_default().iter().enumerate() {
            s.tags[i] = *t;
        }
        for (i, m) in a.mhandles.unwrap_or_default().iter().enumerate() {
            s.mh[i] = m.0;
        }
        s
    }
}

fn ptr_or_null<T>(present: bool, p: *mut T) -> *mut T {
    if present {
        p
    } else {
        null()
    }
}

pub(super) fn raw_irecv(net: &Net, comm: Opaque, a: Arrays<'_>) -> (ncclResult_t, Opaque) {
    let mut s = ArrayStorage::from(&a);
    let d = ptr_or_null(a.data.is_some(), s.data.as_mut_ptr());
    let si = ptr_or_null(a.sizes.is_some(), s.sizes_i.as_mut_ptr());
    let sz = ptr_or_null(a.sizes.is_some(), s.sizes_z.as_mut_ptr());
    let t = ptr_or_null(a.tags.is_some(), s.tags.as_mut_ptr());
    let m = ptr_or_null(a.mhandles.is_some(), s.mh.as_mut_ptr());
    let mut req: *mut c_void = null();
    let r = ptr_or_null(a.request, &mut req as *mut *mut c_void);
    let n = a.n;
    // SAFETY: see the note on raw calls above.
    let code = unsafe {
        match tbl(net) {
            Tbl::V6(x) => x.irecv.unwrap()(comm.0, n, d, si, t, m, r),
            Tbl::V7(x) => x.irecv.unwrap()(comm.0, n, d, si, t, m, r),
            Tbl::V8(x) => x.irecv.unwrap()(comm.0, n, d, si, t, m, r),
            Tbl::V9(x) => x.irecv.unwrap()(comm.0, n, d, sz, t, m, r),
            Tbl::V10(x) => x.irecv.unwrap()(comm.0, n, d, sz, t, m, null(), r),
            Tbl::V11(x) => x.irecv.unwrap()(comm.0, n, d, sz, t, m, null(), r),
            Tbl::V12(x) => x.irecv.unwrap()(comm.0, n, d, sz, t, m, null(), r),
        }
    };
    (code, Opaque(req))
}

pub(super) fn raw_iflush(net: &Net, comm: Opaque, a: Arrays<'_>) -> ncclResult_t {
    let mut s = ArrayStorage::from(&a);
    let d = ptr_or_null(a.data.is_some(), s.data.as_mut_ptr());
    let si = ptr_or_null(a.sizes.is_some(), s.sizes_i.as_mut_ptr());
    let m = ptr_or_null(a.mhandles.is_some(), s.mh.as_mut_ptr());
    let mut req: *mut c_void = null();
    let r = ptr_or_null(a.request, &mut req as *mut *mut c_void);
    // SAFETY: see the note on raw calls above.
    unsafe { each!(net, x => x.iflush.unwrap()(comm.0, a.n, d, si, m, r)) }
}

/// A v11 context from `init` (NULL before v11).
pub(super) fn raw_init_v11(net: &Net) -> *mut c_void {
    let mut ctx = null();
    // SAFETY: see the note on raw calls above.
    let code = unsafe {
        match tbl(net) {
            Tbl::V11(t) => t.init.unwrap()(&mut ctx, 7, null(), None, None),
            Tbl::V12(t) => t.init.unwrap()(&mut ctx, 7, null(), None, None),
            _ => return ctx,
        }
    };
    assert_eq!(code, ncclResult_t::ncclSuccess);
    assert!(!ctx.is_null());
    ctx
}

pub(super) fn raw_finalize_v11(net: &Net, ctx: *mut c_void) {
    // SAFETY: see the note on raw calls above; ctx came from `raw_init_v11`.
    let code = unsafe {
        match tbl(net) {
            Tbl::V11(t) => t.finalize.unwrap()(ctx),
            Tbl::V12(t) => t.finalize.unwrap()(ctx),
            _ => return,
        }
    };
    assert_eq!(code, ncclResult_t::ncclSuccess);
}

pub(super) fn raw_init_v11_null_ctx(net: &Net) -> ncclResult_t {
    match tbl(net) {
        // SAFETY: see the note on raw calls above.
        Tbl::V11(t) => unsafe { t.init.unwrap()(null(), 7, null(), None, None) },
        // SAFETY: see the note on raw calls above.
        Tbl::V12(t) => unsafe { t.init.unwrap()(null(), 7, null(), None, None) },
        _ => ncclResult_t::ncclSuccess,
    }
}
