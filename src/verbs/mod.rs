//! libibverbs, loaded with `dlopen` so the plugin loads on any host; the only place that
//! calls `ibv_*`.
//!
//! This first layer answers one question for `init`: is there a usable RDMA device? The
//! verbs transport (device properties, QPs, MRs, the data path) builds on it.

use std::ffi::{c_char, c_int, c_void, CStr, CString};

use crate::error::{Error, Result};

/// Libraries tried when `NCCL_IBVERBS_LIB` is unset, as NCCL does.
const DEFAULT_LIBS: [&str; 2] = ["libibverbs.so", "libibverbs.so.1"];

type GetDeviceList = unsafe extern "C" fn(num_devices: *mut c_int) -> *mut *mut c_void;
type FreeDeviceList = unsafe extern "C" fn(list: *mut *mut c_void);
type GetDeviceName = unsafe extern "C" fn(device: *mut c_void) -> *const c_char;

/// An open libibverbs. Never closed: provider libraries it loads keep references into it,
/// and the plugin itself stays mapped for the life of the process.
pub struct VerbsLib {
    get_device_list: GetDeviceList,
    free_device_list: FreeDeviceList,
    get_device_name: GetDeviceName,
    /// The library name that was opened.
    pub name: String,
}

fn dl_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the next dl* call
    // on this thread; we copy it at once.
    let p = unsafe { libc::dlerror() };
    if p.is_null() {
        "unknown dlopen error".into()
    } else {
        // SAFETY: non-NULL, NUL-terminated (see above).
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

fn symbol(lib: *mut c_void, name: &CStr, version: &CStr) -> Result<*mut c_void> {
    // SAFETY: `lib` is a live handle from dlopen; name and version are NUL-terminated.
    let p = unsafe { libc::dlvsym(lib, name.as_ptr(), version.as_ptr()) };
    if p.is_null() {
        return Err(Error::NoDevice(format!(
            "libibverbs lacks {}@{}: {}",
            name.to_string_lossy(),
            version.to_string_lossy(),
            dl_error()
        )));
    }
    Ok(p)
}

impl VerbsLib {
    /// Opens libibverbs (`override_lib` first when given).
    pub fn open(override_lib: Option<&str>) -> Result<Self> {
        let candidates: Vec<&str> = match override_lib {
            Some(l) => vec![l],
            None => DEFAULT_LIBS.to_vec(),
        };
        let mut errors = Vec::new();
        for name in candidates {
            let c = CString::new(name).map_err(|_| {
                Error::InvalidArgument(format!("library name {name:?} contains a NUL byte"))
            })?;
            // SAFETY: c is a NUL-terminated path; RTLD_NOW surfaces missing symbols here.
            let lib = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
            if lib.is_null() {
                errors.push(dl_error());
                continue;
            }
            let v11 = c"IBVERBS_1.1";
            let get = symbol(lib, c"ibv_get_device_list", v11)?;
            let free = symbol(lib, c"ibv_free_device_list", v11)?;
            let dev_name = symbol(lib, c"ibv_get_device_name", v11)?;
            // SAFETY: the symbols were resolved by name and version from libibverbs, whose
            // IBVERBS_1.1 ABI has exactly these signatures.
            let (get_device_list, free_device_list, get_device_name) = unsafe {
                (
                    std::mem::transmute::<*mut c_void, GetDeviceList>(get),
                    std::mem::transmute::<*mut c_void, FreeDeviceList>(free),
                    std::mem::transmute::<*mut c_void, GetDeviceName>(dev_name),
                )
            };
            return Ok(VerbsLib {
                get_device_list,
                free_device_list,
                get_device_name,
                name: name.to_string(),
            });
        }
        Err(Error::NoDevice(format!(
            "cannot load libibverbs ({}); install rdma-core/libibverbs1 or set NCCL_IBVERBS_LIB",
            errors.join("; ")
        )))
    }

    /// Names of the RDMA devices libibverbs sees.
    pub fn device_names(&self) -> Result<Vec<String>> {
        let mut n: c_int = 0;
        // SAFETY: n is a valid out-pointer; the returned list is freed below.
        let list = unsafe { (self.get_device_list)(&mut n) };
        if list.is_null() {
            let err = std::io::Error::last_os_error();
            let why = if err.raw_os_error() == Some(libc::ENOSYS) {
                "the kernel has no RDMA support".to_string()
            } else {
                err.to_string()
            };
            return Err(Error::NoDevice(format!(
                "ibv_get_device_list failed: {why}"
            )));
        }
        let mut names = Vec::with_capacity(n.max(0) as usize);
        for i in 0..n.max(0) as usize {
            // SAFETY: list holds n valid device pointers (libibverbs contract).
            let dev = unsafe { *list.add(i) };
            // SAFETY: dev is a live device from the list; the name is NUL-terminated and
            // valid while the list is.
            let name = unsafe { (self.get_device_name)(dev) };
            if !name.is_null() {
                // SAFETY: non-NULL, NUL-terminated (see above).
                names.push(
                    unsafe { CStr::from_ptr(name) }
                        .to_string_lossy()
                        .into_owned(),
                );
            }
        }
        // SAFETY: list came from ibv_get_device_list and is freed exactly once.
        unsafe { (self.free_device_list)(list) };
        Ok(names)
    }
}
