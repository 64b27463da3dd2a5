//! The libibverbs entry points, loaded with `dlopen` and resolved by symbol version
//! (`IBVERBS_1.1`, optional ones by their own versions, turned into capability flags), exactly
//! as NCCL does.

use std::ffi::{c_char, c_int, c_void, CStr, CString};

use once_cell::sync::OnceCell;
use rdma_sys::*;

use crate::error::{Error, Result};

/// Libraries tried when `NCCL_IBVERBS_LIB` is unset, as NCCL does.
const DEFAULT_LIBS: [&str; 2] = ["libibverbs.so", "libibverbs.so.1"];

/// The libibverbs entry points the plugin uses.
#[allow(missing_docs)]
pub(crate) struct VerbsLib {
    /// The library that was opened.
    pub(crate) name: String,
    pub(crate) get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut *mut ibv_device,
    pub(crate) free_device_list: unsafe extern "C" fn(*mut *mut ibv_device),
    pub(crate) get_device_name: unsafe extern "C" fn(*mut ibv_device) -> *const c_char,
    pub(crate) open_device: unsafe extern "C" fn(*mut ibv_device) -> *mut ibv_context,
    pub(crate) close_device: unsafe extern "C" fn(*mut ibv_context) -> c_int,
    pub(crate) query_device: unsafe extern "C" fn(*mut ibv_context, *mut ibv_device_attr) -> c_int,
    pub(crate) query_port: unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int,
    pub(crate) query_gid: unsafe extern "C" fn(*mut ibv_context, u8, c_int, *mut ibv_gid) -> c_int,
    pub(crate) alloc_pd: unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_pd,
    pub(crate) dealloc_pd: unsafe extern "C" fn(*mut ibv_pd) -> c_int,
    pub(crate) reg_mr: unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr,
    pub(crate) dereg_mr: unsafe extern "C" fn(*mut ibv_mr) -> c_int,
    pub(crate) create_cq: unsafe extern "C" fn(
        *mut ibv_context,
        c_int,
        *mut c_void,
        *mut ibv_comp_channel,
        c_int,
    ) -> *mut ibv_cq,
    pub(crate) destroy_cq: unsafe extern "C" fn(*mut ibv_cq) -> c_int,
    pub(crate) create_qp: unsafe extern "C" fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp,
    pub(crate) modify_qp: unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int,
    pub(crate) destroy_qp: unsafe extern "C" fn(*mut ibv_qp) -> c_int,
    pub(crate) fork_init: unsafe extern "C" fn() -> c_int,
    pub(crate) get_async_event:
        unsafe extern "C" fn(*mut ibv_context, *mut ibv_async_event) -> c_int,
    pub(crate) ack_async_event: unsafe extern "C" fn(*mut ibv_async_event),
    pub(crate) wc_status_str: unsafe extern "C" fn(ibv_wc_status::Type) -> *const c_char,
    /// `ibv_reg_dmabuf_mr` (IBVERBS_1.12), when the library has it.
    pub(crate) reg_dmabuf_mr:
        Option<unsafe extern "C" fn(*mut ibv_pd, u64, usize, u64, c_int, c_int) -> *mut ibv_mr>,
}

fn dl_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the next dl* call
    // on this thread; it is copied at once.
    let p = unsafe { libc::dlerror() };
    if p.is_null() {
        "unknown dlopen error".into()
    } else {
        // SAFETY: non-NULL and NUL-terminated (see above).
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

fn lookup(lib: *mut c_void, name: &str, version: &CStr) -> Option<*mut c_void> {
    let cname = CString::new(name).ok()?;
    // SAFETY: lib is a live dlopen handle; both strings are NUL-terminated.
    let p = unsafe { libc::dlvsym(lib, cname.as_ptr(), version.as_ptr()) };
    (!p.is_null()).then_some(p)
}

/// Casts a resolved symbol to the function pointer type `F`.
///
/// # Safety
/// `p` must be a function whose C signature is `F`.
unsafe fn fn_ptr<F: Copy>(p: *mut c_void) -> F {
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: same size (checked), and the caller guarantees the signature.
    unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) }
}

/// Resolves a required symbol and casts it to the field's function type.
macro_rules! required {
    ($lib:expr, $name:literal) => {{
        let p = lookup($lib, $name, c"IBVERBS_1.1").ok_or_else(|| {
            Error::no_device(format!(
                "libibverbs lacks {}@IBVERBS_1.1: {}",
                $name,
                dl_error()
            ))
        })?;
        // SAFETY: the symbol was resolved by name and ABI version from libibverbs; the
        // field's type is that function's C signature for IBVERBS_1.1.
        unsafe { fn_ptr(p) }
    }};
}

static LIB: OnceCell<VerbsLib> = OnceCell::new();

impl VerbsLib {
    /// The process's libibverbs, opened on first use (`override_lib` first when given).
    pub(crate) fn get(override_lib: Option<&str>) -> Result<&'static VerbsLib> {
        LIB.get_or_try_init(|| Self::open(override_lib))
    }

    fn open(override_lib: Option<&str>) -> Result<Self> {
        let candidates: Vec<&str> = match override_lib {
            Some(l) => vec![l],
            None => DEFAULT_LIBS.to_vec(),
        };
        let mut errors = Vec::new();
        for name in candidates {
            let c = CString::new(name).map_err(|_| {
                Error::config("NCCL_IBVERBS_LIB", name, "a library name without NUL bytes")
            })?;
            // SAFETY: c is NUL-terminated; RTLD_NOW surfaces missing dependencies here. The
            // handle is never closed: provider libraries keep references into libibverbs.
            let lib = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
            if lib.is_null() {
                errors.push(dl_error());
                continue;
            }
            let reg_dmabuf_mr = lookup(lib, "ibv_reg_dmabuf_mr", c"IBVERBS_1.12").map(|p| {
                // SAFETY: resolved by name and version (IBVERBS_1.12), whose signature this is.
                unsafe { fn_ptr(p) }
            });
            return Ok(VerbsLib {
                name: name.to_string(),
                get_device_list: required!(lib, "ibv_get_device_list"),
                free_device_list: required!(lib, "ibv_free_device_list"),
                get_device_name: required!(lib, "ibv_get_device_name"),
                open_device: required!(lib, "ibv_open_device"),
                close_device: required!(lib, "ibv_close_device"),
                query_device: required!(lib, "ibv_query_device"),
                query_port: required!(lib, "ibv_query_port"),
                query_gid: required!(lib, "ibv_query_gid"),
                alloc_pd: required!(lib, "ibv_alloc_pd"),
                dealloc_pd: required!(lib, "ibv_dealloc_pd"),
                reg_mr: required!(lib, "ibv_reg_mr"),
                dereg_mr: required!(lib, "ibv_dereg_mr"),
                create_cq: required!(lib, "ibv_create_cq"),
                destroy_cq: required!(lib, "ibv_destroy_cq"),
                create_qp: required!(lib, "ibv_create_qp"),
                modify_qp: required!(lib, "ibv_modify_qp"),
                destroy_qp: required!(lib, "ibv_destroy_qp"),
                fork_init: required!(lib, "ibv_fork_init"),
                get_async_event: required!(lib, "ibv_get_async_event"),
                ack_async_event: required!(lib, "ibv_ack_async_event"),
                wc_status_str: required!(lib, "ibv_wc_status_str"),
                reg_dmabuf_mr,
            });
        }
        Err(Error::no_device(format!(
            "cannot load libibverbs ({}); install rdma-core (libibverbs1 and the provider \
             for your NIC) or set NCCL_IBVERBS_LIB",
            errors.join("; ")
        )))
    }

    /// `ibv_wc_status_str`.
    pub(crate) fn status_str(&self, status: ibv_wc_status::Type) -> String {
        // SAFETY: returns a static NUL-terminated string for any status value.
        let p = unsafe { (self.wc_status_str)(status) };
        if p.is_null() {
            format!("status {status}")
        } else {
            // SAFETY: non-NULL static string.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    }

    /// `ibv_fork_init`, which must run before the first registration. On kernels with
    /// copy-on-fork for pinned pages rdma-core makes it a no-op.
    pub(crate) fn fork_init(&self) -> Result<()> {
        // SAFETY: no arguments; safe to call before any MR exists.
        let rc = unsafe { (self.fork_init)() };
        if rc != 0 {
            return Err(Error::io(
                "ibv_fork_init",
                std::io::Error::from_raw_os_error(rc.abs()),
            ));
        }
        Ok(())
    }
}
