//! The boundary seen from NCCL's side: loads a built plugin with `dlopen` (RTLD_NOW |
//! RTLD_LOCAL, as NCCL does), resolves one exported `ncclNetPlugin_vN` table and calls it with
//! that version's exact C signatures. The conformance suite and `nccl-net-bench` drive the
//! plugin only through this, the way NCCL's proxy threads do.

use std::{
    ffi::{c_char, c_int, c_ulong, c_void, CStr, CString},
    path::{Path, PathBuf},
    sync::{Mutex, OnceLock},
};

use nccl_net_erdma::ffi::*;

/// Most buffers one `irecv` through this client may name (more than `maxRecvs`, so tests
/// can pass too many).
pub const MAX_CLIENT_RECVS: usize = 16;

/// ABI versions the plugin exports for NCCL 2.13 and later, whose `connect` and `accept` are
/// polled steps.
pub const VERSIONS: [u32; 7] = [6, 7, 8, 9, 10, 11, 12];

/// ABI versions the plugin exports for NCCL 2.8 - 2.12 (v4: one buffer per call, no tags,
/// `connect` and `accept` return the comm from one call).
pub const OLD_VERSIONS: [u32; 2] = [4, 5];

/// Every ABI version the plugin exports.
pub const ALL_VERSIONS: [u32; 9] = [4, 5, 6, 7, 8, 9, 10, 11, 12];

/// NCCL's result code, as an error.
pub type Code = ncclResult_t;

/// An opaque pointer the plugin returned (comm, request or memory handle).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Opaque(pub *mut c_void);

// SAFETY: these are plugin objects whose thread-safety the plugin's contract defines (comms
// are used from NCCL's service and progress threads); the client only passes them back.
unsafe impl Send for Opaque {}
// SAFETY: as above; the client never dereferences them.
unsafe impl Sync for Opaque {}

impl Opaque {
    /// The NULL pointer.
    pub const NULL: Opaque = Opaque(std::ptr::null_mut());
    /// Whether it is NULL.
    pub fn is_null(&self) -> bool {
        self.0.is_null()
    }
}

/// Version-neutral view of a device's properties.
#[derive(Debug, Clone, PartialEq)]
pub struct Properties {
    /// `name`.
    pub name: String,
    /// `pciPath`, if any.
    pub pci_path: Option<String>,
    /// `guid`.
    pub guid: u64,
    /// `ptrSupport`.
    pub ptr_support: i32,
    /// `regIsGlobal` (v8+).
    pub reg_is_global: Option<i32>,
    /// `forceFlush` (v9+).
    pub force_flush: Option<i32>,
    /// `speed` (Mbps).
    pub speed: i32,
    /// `port`.
    pub port: i32,
    /// `latency` (v4 has none: 0).
    pub latency: f32,
    /// `maxComms`.
    pub max_comms: i32,
    /// `maxRecvs` (v4 has none: 1, its receives take one buffer).
    pub max_recvs: i32,
    /// `netDeviceType` and `netDeviceVersion` (v7+).
    pub net_device: Option<(u32, i32)>,
    /// `vProps` (v9+): ndevs and the first `ndevs` devices.
    pub vprops: Option<(i32, Vec<i32>)>,
    /// `maxP2pBytes` and `maxCollBytes` (v9+).
    pub max_bytes: Option<(usize, usize)>,
    /// `maxMultiRequestSize` (v11+).
    pub max_multi_request_size: Option<i32>,
    /// `railId` and `planeId` (v12).
    pub rail_plane: Option<(i16, i16)>,
}

/// One line the plugin sent to the test logger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoggedLine {
    /// `ncclDebugLogLevel`.
    pub level: u32,
    /// Subsystem flags.
    pub flags: c_ulong,
    /// The format string the plugin passed.
    pub fmt: String,
    /// The formatted text.
    pub text: String,
}

static LOGGED: Mutex<Vec<LoggedLine>> = Mutex::new(Vec::new());

/// Lines logged through [`Net::init`]'s logger so far (tests assert on them).
pub fn logged_lines() -> Vec<LoggedLine> {
    LOGGED.lock().map(|l| l.clone()).unwrap_or_default()
}

/// Where the C logger (csrc/logger.c) sends each line it formatted.
extern "C" fn logged(
    level: ncclDebugLogLevel,
    flags: c_ulong,
    _file: *const c_char,
    _line: c_int,
    fmt: *const c_char,
    text: *const c_char,
) {
    let read = |p: *const c_char| {
        if p.is_null() {
            String::new()
        } else {
            // SAFETY: the C logger passes NUL-terminated strings alive for the call.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    let (fmt, text) = (read(fmt), read(text));
    if std::env::var_os("NCCL_NET_CLIENT_QUIET").is_none() && level <= NCCL_LOG_WARN {
        eprintln!("[plugin WARN] {text}");
    }
    if let Ok(mut l) = LOGGED.lock() {
        l.push(LoggedLine {
            level,
            flags,
            fmt,
            text,
        });
    }
}

type LogSink =
    extern "C" fn(ncclDebugLogLevel, c_ulong, *const c_char, c_int, *const c_char, *const c_char);

extern "C" {
    /// NCCL's logger, in C: formats the plugin's printf-style call and hands the line to the
    /// sink.
    fn nccl_net_tools_logger(
        level: ncclDebugLogLevel,
        flags: c_ulong,
        file: *const c_char,
        line: c_int,
        fmt: *const c_char,
        ...
    );
    fn nccl_net_tools_set_log_sink(sink: LogSink);
}

/// One call the plugin made to the recording profiler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProfilerEvent {
    /// True for Start, false for Stop.
    pub start: bool,
    /// The event handle (given out at Start, passed back at Stop).
    pub handle: usize,
    /// Parent handle (Start).
    pub parent: usize,
    /// `pluginId`.
    pub plugin_id: i64,
    /// The descriptor (Start): kind, n, size, tag.
    pub descr: Option<(u32, u32, u64, i32)>,
}

/// The descriptor the plugin passes as `extData` with a Start event (README: `{u32 kind
/// (0 send, 1 recv), u32 n, u64 bytes, i32 tag}`), as a profiler plugin would declare it.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct NetEventDescr {
    kind: u32,
    n: u32,
    size: u64,
    tag: i32,
}

static PROFILED: Mutex<Vec<ProfilerEvent>> = Mutex::new(Vec::new());

/// Events the plugin reported to [`Net::init_profiled`]'s profiler so far.
pub fn profiler_events() -> Vec<ProfilerEvent> {
    PROFILED.lock().map(|l| l.clone()).unwrap_or_default()
}

extern "C" fn test_profiler(
    handle: *mut *mut c_void,
    ty: c_int,
    parent: *mut c_void,
    plugin_id: i64,
    ext: *mut c_void,
) -> ncclResult_t {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0x1000);
    if handle.is_null() {
        return ncclResult_t::ncclInvalidArgument;
    }
    let start = ty == ncclProfilerNetEventStart as c_int;
    let descr = (start && !ext.is_null()).then(|| {
        // SAFETY: the plugin passes its descriptor (this layout), alive for the call.
        let e = unsafe { *(ext as *const NetEventDescr) };
        (e.kind, e.n, e.size, e.tag)
    });
    let h = if start {
        let h = NEXT.fetch_add(1, Ordering::Relaxed);
        // SAFETY: checked non-NULL; the plugin passes a writable handle slot.
        unsafe { *handle = h as *mut c_void };
        h
    } else {
        // SAFETY: checked non-NULL; holds the handle given out at Start.
        unsafe { *handle as usize }
    };
    if let Ok(mut l) = PROFILED.lock() {
        l.push(ProfilerEvent {
            start,
            handle: h,
            parent: parent as usize,
            plugin_id,
            descr,
        });
    }
    ncclResult_t::ncclSuccess
}

/// The logger to hand to a plugin's `init`, its lines going to [`logged_lines`].
fn logger() -> ncclDebugLogger_t {
    // SAFETY: sets a function pointer the C logger reads atomically; `logged` lives for the
    // whole program.
    unsafe { nccl_net_tools_set_log_sink(logged) };
    Some(nccl_net_tools_logger)
}

#[derive(Clone, Copy)]
enum Table {
    V4(*const ncclNet_v4_t),
    V5(*const ncclNet_v5_t),
    V6(*const ncclNet_v6_t),
    V7(*const ncclNet_v7_t),
    V8(*const ncclNet_v8_t),
    V9(*const ncclNet_v9_t),
    V10(*const ncclNet_v10_t),
    V11(*const ncclNet_v11_t),
    V12(*const ncclNet_v12_t),
}

/// A loaded plugin library and one of its tables.
pub struct Net {
    lib: *mut c_void,
    table: Table,
    version: u32,
    ctx: *mut c_void,
    /// Profiler parent handle passed to v10+ `isend`/`irecv` (NULL: none).
    phandle: *mut c_void,
    /// The library's path.
    pub path: PathBuf,
}

// SAFETY: the library handle and table are process-global and immutable; the plugin's
// entry points are callable from any thread (NCCL calls them from several).
unsafe impl Send for Net {}
// SAFETY: as above.
unsafe impl Sync for Net {}

fn check(r: ncclResult_t) -> Result<(), Code> {
    if r == ncclResult_t::ncclSuccess {
        Ok(())
    } else {
        Err(r)
    }
}

/// Calls `$f` of whichever table is loaded, with per-version arguments.
macro_rules! call {
    ($self:expr, $t:ident => $body:expr) => {{
        // SAFETY: the table pointer came from dlsym of the matching symbol in a library that
        // stays loaded while `self` lives; its slots have this version's signatures.
        unsafe {
            match $self.table {
                Table::V4(p) => {
                    let $t = &*p;
                    $body
                }
                Table::V5(p) => {
                    let $t = &*p;
                    $body
                }
                Table::V6(p) => {
                    let $t = &*p;
                    $body
                }
                Table::V7(p) => {
                    let $t = &*p;
                    $body
                }
                Table::V8(p) => {
                    let $t = &*p;
                    $body
                }
                Table::V9(p) => {
                    let $t = &*p;
                    $body
                }
                Table::V10(p) => {
                    let $t = &*p;
                    $body
                }
                Table::V11(p) => {
                    let $t = &*p;
                    $body
                }
                Table::V12(p) => {
                    let $t = &*p;
                    $body
                }
            }
        }
    }};
}

/// Reads a C string the plugin owns.
fn owned(p: *const c_char) -> Option<String> {
    if p.is_null() {
        None
    } else {
        // SAFETY: the plugin returns NUL-terminated strings that live as long as it does.
        Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    }
}

impl Net {
    /// `dlopen`s `path` and resolves the highest `ncclNetPlugin_vN` it exports (4..12), as
    /// NCCL looks for its own version first and then older ones.
    pub fn open_highest(path: &Path) -> Result<Net, String> {
        let mut last = String::new();
        for &v in ALL_VERSIONS.iter().rev() {
            match Net::open(path, v) {
                Ok(net) => return Ok(net),
                Err(e) if e.contains(" exports no ") => last = e,
                Err(e) => return Err(e),
            }
        }
        Err(format!(
            "{last}, nor any of ncclNetPlugin_v4 .. v12: not an NCCL net plugin"
        ))
    }

    /// `dlopen`s `path` and resolves `ncclNetPlugin_v<version>`.
    pub fn open(path: &Path, version: u32) -> Result<Net, String> {
        let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|e| e.to_string())?;
        // SAFETY: c is a NUL-terminated path.
        let lib = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if lib.is_null() {
            // SAFETY: dlerror returns a NUL-terminated string after a failed dlopen.
            let err = owned(unsafe { libc::dlerror() }).unwrap_or_default();
            return Err(format!("dlopen {}: {err}", path.display()));
        }
        let sym = CString::new(format!("ncclNetPlugin_v{version}")).expect("no NUL");
        // SAFETY: lib is a live handle; sym is NUL-terminated.
        let p = unsafe { libc::dlsym(lib, sym.as_ptr()) };
        if p.is_null() {
            // SAFETY: lib came from dlopen above and is closed once.
            unsafe { libc::dlclose(lib) };
            return Err(format!(
                "{} exports no {}",
                path.display(),
                sym.to_string_lossy()
            ));
        }
        let table = match version {
            4 => Table::V4(p as _),
            5 => Table::V5(p as _),
            6 => Table::V6(p as _),
            7 => Table::V7(p as _),
            8 => Table::V8(p as _),
            9 => Table::V9(p as _),
            10 => Table::V10(p as _),
            11 => Table::V11(p as _),
            12 => Table::V12(p as _),
            v => return Err(format!("unsupported version {v}")),
        };
        Ok(Net {
            lib,
            table,
            version,
            ctx: std::ptr::null_mut(),
            phandle: std::ptr::null_mut(),
            path: path.to_path_buf(),
        })
    }

    /// The ABI version in use.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The table's `name`.
    pub fn name(&self) -> String {
        call!(self, t => owned(t.name)).unwrap_or_default()
    }

    /// Raw table pointer (for layout checks).
    pub fn table_ptr(&self) -> *const c_void {
        match self.table {
            Table::V4(p) => p as _,
            Table::V5(p) => p as _,
            Table::V6(p) => p as _,
            Table::V7(p) => p as _,
            Table::V8(p) => p as _,
            Table::V9(p) => p as _,
            Table::V10(p) => p as _,
            Table::V11(p) => p as _,
            Table::V12(p) => p as _,
        }
    }

    /// `init` with the recording logger (v11: creates the per-communicator context).
    pub fn init(&mut self) -> Result<(), Code> {
        self.init_with(None)
    }

    /// `init` handing v10+ tables the recording profiler (see [`profiler_events`]), and
    /// passing `phandle` as the parent of every later `isend`/`irecv`.
    pub fn init_profiled(&mut self, phandle: usize) -> Result<(), Code> {
        self.phandle = phandle as *mut c_void;
        self.init_with(Some(test_profiler))
    }

    fn init_with(&mut self, prof: ncclProfilerCallback_t) -> Result<(), Code> {
        let log = logger();
        let mut ctx = std::ptr::null_mut();
        let mut config = ncclNetCommConfig_v11_t { trafficClass: -1 };
        // SAFETY: as in `call!`.
        let r = unsafe {
            match self.table {
                Table::V4(p) => (*p).init.unwrap()(log),
                Table::V5(p) => (*p).init.unwrap()(log),
                Table::V6(p) => (*p).init.unwrap()(log),
                Table::V7(p) => (*p).init.unwrap()(log),
                Table::V8(p) => (*p).init.unwrap()(log),
                Table::V9(p) => (*p).init.unwrap()(log),
                Table::V10(p) => (*p).init.unwrap()(log, prof),
                Table::V11(p) => (*p).init.unwrap()(&mut ctx, 42, &mut config, log, prof),
                Table::V12(p) => (*p).init.unwrap()(&mut ctx, 42, &mut config, log, prof),
            }
        };
        if !ctx.is_null() {
            self.ctx = ctx;
        }
        check(r)
    }

    /// v11 `finalize` of this client's context (a no-op before v11).
    pub fn finalize(&mut self) -> Result<(), Code> {
        self.finalize_ctx(Opaque(self.ctx))?;
        self.ctx = std::ptr::null_mut();
        Ok(())
    }

    /// v11 `finalize` of an arbitrary context pointer.
    pub fn finalize_ctx(&self, ctx: Opaque) -> Result<(), Code> {
        match self.table {
            // SAFETY: as in `call!`; ctx is passed through untouched.
            Table::V11(p) => check(unsafe { (*p).finalize.unwrap()(ctx.0) }),
            // SAFETY: as in `call!`; ctx is passed through untouched.
            Table::V12(p) => check(unsafe { (*p).finalize.unwrap()(ctx.0) }),
            _ => Ok(()),
        }
    }

    /// `devices`.
    pub fn devices(&self) -> Result<i32, Code> {
        let mut n = 0;
        check(call!(self, t => t.devices.unwrap()(&mut n)))?;
        Ok(n)
    }

    /// `getProperties`, normalised.
    pub fn properties(&self, dev: i32) -> Result<Properties, Code> {
        macro_rules! base {
            ($p:expr) => {
                Properties {
                    name: owned($p.name).unwrap_or_default(),
                    pci_path: owned($p.pciPath),
                    guid: $p.guid,
                    ptr_support: $p.ptrSupport,
                    reg_is_global: None,
                    force_flush: None,
                    speed: $p.speed,
                    port: $p.port,
                    latency: $p.latency,
                    max_comms: $p.maxComms,
                    max_recvs: $p.maxRecvs,
                    net_device: None,
                    vprops: None,
                    max_bytes: None,
                    max_multi_request_size: None,
                    rail_plane: None,
                }
            };
        }
        // Garbage-fill first, so a field the plugin forgets shows up.
        const GUARD: u8 = 0xa5;
        macro_rules! get {
            ($p:expr, $ty:ty) => {{
                let mut v = std::mem::MaybeUninit::<$ty>::uninit();
                // SAFETY: writing bytes into our own uninitialised storage.
                unsafe { std::ptr::write_bytes(v.as_mut_ptr(), GUARD, 1) };
                // SAFETY: as in `call!`; v is writable storage of this version's layout.
                check(unsafe { (*$p).getProperties.unwrap()(dev, v.as_mut_ptr()) })?;
                // SAFETY: the plugin wrote the whole struct (it returned success).
                unsafe { v.assume_init() }
            }};
            // The properties in field `$f` of storage `$ty`, the rest of which stays garbage.
            ($p:expr, $ty:ty, $f:ident) => {{
                let mut v = std::mem::MaybeUninit::<$ty>::uninit();
                // SAFETY: writing bytes into our own uninitialised storage.
                unsafe { std::ptr::write_bytes(v.as_mut_ptr(), GUARD, 1) };
                // SAFETY: as in `call!`; the field is writable storage of this version's
                // layout.
                let props = unsafe { std::ptr::addr_of_mut!((*v.as_mut_ptr()).$f) };
                // SAFETY: as in `call!`.
                check(unsafe { (*$p).getProperties.unwrap()(dev, props) })?;
                // SAFETY: every byte is initialised (garbage-filled, then the plugin's), and
                // the fields are integers and raw pointers, valid for any bytes.
                unsafe { v.assume_init() }
            }};
        }
        Ok(match self.table {
            Table::V4(p) => {
                // Guard bytes behind the 40-byte struct: a plugin that writes a larger one
                // (v5's, with latency and maxRecvs) overruns NCCL 2.11's stack.
                #[repr(C)]
                struct Guarded {
                    props: ncclNetProperties_v4_t,
                    guard: [u8; 24],
                }
                let g = get!(p, Guarded, props);
                if g.guard.iter().any(|b| *b != GUARD) {
                    return Err(ncclResult_t::ncclInternalError);
                }
                let v = g.props;
                Properties {
                    name: owned(v.name).unwrap_or_default(),
                    pci_path: owned(v.pciPath),
                    guid: v.guid,
                    ptr_support: v.ptrSupport,
                    reg_is_global: None,
                    force_flush: None,
                    speed: v.speed,
                    port: v.port,
                    latency: 0.0,
                    max_comms: v.maxComms,
                    max_recvs: 1,
                    net_device: None,
                    vprops: None,
                    max_bytes: None,
                    max_multi_request_size: None,
                    rail_plane: None,
                }
            }
            Table::V5(p) => base!(get!(p, ncclNetProperties_v5_t)),
            Table::V6(p) => base!(get!(p, ncclNetProperties_v6_t)),
            Table::V7(p) => {
                let v = get!(p, ncclNetProperties_v7_t);
                Properties {
                    net_device: Some((v.netDeviceType, v.netDeviceVersion)),
                    ..base!(v)
                }
            }
            Table::V8(p) => {
                let v = get!(p, ncclNetProperties_v8_t);
                Properties {
                    reg_is_global: Some(v.regIsGlobal),
                    net_device: Some((v.netDeviceType, v.netDeviceVersion)),
                    ..base!(v)
                }
            }
            Table::V9(p) => v9_props(get!(p, ncclNetProperties_v9_t)),
            Table::V10(p) => v9_props(get!(p, ncclNetProperties_v10_t)),
            Table::V11(p) => {
                let v = get!(p, ncclNetProperties_v11_t);
                Properties {
                    reg_is_global: Some(v.regIsGlobal),
                    force_flush: Some(v.forceFlush),
                    net_device: Some((v.netDeviceType, v.netDeviceVersion)),
                    vprops: Some(vprops(v.vProps.ndevs, &v.vProps.devs)),
                    max_bytes: Some((v.maxP2pBytes, v.maxCollBytes)),
                    max_multi_request_size: Some(v.maxMultiRequestSize),
                    ..base!(v)
                }
            }
            Table::V12(p) => {
                let v = get!(p, ncclNetProperties_v12_t);
                Properties {
                    reg_is_global: Some(v.regIsGlobal),
                    force_flush: Some(v.forceFlush),
                    net_device: Some((v.netDeviceType, v.netDeviceVersion)),
                    vprops: Some(vprops(v.vProps.ndevs, &v.vProps.devs)),
                    max_bytes: Some((v.maxP2pBytes, v.maxCollBytes)),
                    max_multi_request_size: Some(v.maxMultiRequestSize),
                    rail_plane: Some((v.railId, v.planeId)),
                    ..base!(v)
                }
            }
        })
    }

    /// `listen` into `handle`.
    pub fn listen(&self, dev: i32, handle: &mut [u8; 128]) -> Result<Opaque, Code> {
        let mut comm = std::ptr::null_mut();
        let h = handle.as_mut_ptr() as *mut c_void;
        let r = match self.table {
            // SAFETY: as in `call!`.
            Table::V11(p) => unsafe { (*p).listen.unwrap()(self.ctx, dev, h, &mut comm) },
            // SAFETY: as in `call!`.
            Table::V12(p) => unsafe { (*p).listen.unwrap()(self.ctx, dev, h, &mut comm) },
            _ => call!(self, t => listen_slot(t)(dev, h, &mut comm)),
        };
        check(r)?;
        Ok(Opaque(comm))
    }

    /// One `connect` step with `handle` (NCCL passes the same buffer every time).
    pub fn connect(&self, dev: i32, handle: &mut [u8; 128]) -> Result<Opaque, Code> {
        let mut comm = std::ptr::null_mut();
        let mut dev_comm = std::ptr::null_mut();
        let h = handle.as_mut_ptr() as *mut c_void;
        // SAFETY: as in `call!`.
        let r = unsafe {
            match self.table {
                Table::V4(p) => (*p).connect.unwrap()(dev, h, &mut comm),
                Table::V5(p) => (*p).connect.unwrap()(dev, h, &mut comm),
                Table::V6(p) => (*p).connect.unwrap()(dev, h, &mut comm),
                Table::V7(p) => (*p).connect.unwrap()(dev, h, &mut comm, &mut dev_comm),
                Table::V8(p) => (*p).connect.unwrap()(dev, h, &mut comm, &mut dev_comm),
                Table::V9(p) => (*p).connect.unwrap()(dev, h, &mut comm, &mut dev_comm),
                Table::V10(p) => {
                    let mut config = ncclNetCommConfig_v10_t { trafficClass: -1 };
                    (*p).connect.unwrap()(dev, &mut config, h, &mut comm, &mut dev_comm)
                }
                Table::V11(p) => (*p).connect.unwrap()(self.ctx, dev, h, &mut comm, &mut dev_comm),
                Table::V12(p) => (*p).connect.unwrap()(self.ctx, dev, h, &mut comm, &mut dev_comm),
            }
        };
        check(r)?;
        Ok(Opaque(comm))
    }

    /// One `accept` step.
    pub fn accept(&self, listen: Opaque) -> Result<Opaque, Code> {
        let mut comm = std::ptr::null_mut();
        let mut dev_comm = std::ptr::null_mut();
        // SAFETY: as in `call!`.
        let r = unsafe {
            match self.table {
                Table::V4(p) => (*p).accept.unwrap()(listen.0, &mut comm),
                Table::V5(p) => (*p).accept.unwrap()(listen.0, &mut comm),
                Table::V6(p) => (*p).accept.unwrap()(listen.0, &mut comm),
                Table::V7(p) => (*p).accept.unwrap()(listen.0, &mut comm, &mut dev_comm),
                Table::V8(p) => (*p).accept.unwrap()(listen.0, &mut comm, &mut dev_comm),
                Table::V9(p) => (*p).accept.unwrap()(listen.0, &mut comm, &mut dev_comm),
                Table::V10(p) => (*p).accept.unwrap()(listen.0, &mut comm, &mut dev_comm),
                Table::V11(p) => (*p).accept.unwrap()(listen.0, &mut comm, &mut dev_comm),
                Table::V12(p) => (*p).accept.unwrap()(listen.0, &mut comm, &mut dev_comm),
            }
        };
        check(r)?;
        Ok(Opaque(comm))
    }

    /// `regMr` (v4 - v7 take an `int` size; larger sizes are refused here).
    pub fn reg_mr(
        &self,
        comm: Opaque,
        data: *mut u8,
        size: usize,
        ptr_type: i32,
    ) -> Result<Opaque, Code> {
        let mut mh = std::ptr::null_mut();
        let d = data as *mut c_void;
        let int = || i32::try_from(size).map_err(|_| ncclResult_t::ncclInvalidArgument);
        // SAFETY: as in `call!`.
        let r = unsafe {
            match self.table {
                Table::V4(p) => (*p).regMr.unwrap()(comm.0, d, int()?, ptr_type, &mut mh),
                Table::V5(p) => (*p).regMr.unwrap()(comm.0, d, int()?, ptr_type, &mut mh),
                Table::V6(p) => (*p).regMr.unwrap()(comm.0, d, int()?, ptr_type, &mut mh),
                Table::V7(p) => (*p).regMr.unwrap()(comm.0, d, int()?, ptr_type, &mut mh),
                Table::V8(p) => (*p).regMr.unwrap()(comm.0, d, size, ptr_type, &mut mh),
                Table::V9(p) => (*p).regMr.unwrap()(comm.0, d, size, ptr_type, &mut mh),
                Table::V10(p) => (*p).regMr.unwrap()(comm.0, d, size, ptr_type, &mut mh),
                Table::V11(p) => (*p).regMr.unwrap()(comm.0, d, size, ptr_type, &mut mh),
                Table::V12(p) => (*p).regMr.unwrap()(comm.0, d, size, ptr_type, &mut mh),
            }
        };
        check(r)?;
        Ok(Opaque(mh))
    }

    /// `deregMr`.
    pub fn dereg_mr(&self, comm: Opaque, mhandle: Opaque) -> Result<(), Code> {
        check(call!(self, t => t.deregMr.unwrap()(comm.0, mhandle.0)))
    }

    /// `isend`; `Ok(NULL)` means "not now". v4 has no tag: `tag` is not passed.
    pub fn isend(
        &self,
        comm: Opaque,
        data: *mut u8,
        size: usize,
        tag: i32,
        mhandle: Opaque,
    ) -> Result<Opaque, Code> {
        let mut req = std::ptr::null_mut();
        let d = data as *mut c_void;
        let int = || i32::try_from(size).map_err(|_| ncclResult_t::ncclInvalidArgument);
        let null = self.phandle;
        // SAFETY: as in `call!`.
        let r = unsafe {
            match self.table {
                Table::V4(p) => (*p).isend.unwrap()(comm.0, d, int()?, mhandle.0, &mut req),
                Table::V5(p) => (*p).isend.unwrap()(comm.0, d, int()?, tag, mhandle.0, &mut req),
                Table::V6(p) => (*p).isend.unwrap()(comm.0, d, int()?, tag, mhandle.0, &mut req),
                Table::V7(p) => (*p).isend.unwrap()(comm.0, d, int()?, tag, mhandle.0, &mut req),
                Table::V8(p) => (*p).isend.unwrap()(comm.0, d, int()?, tag, mhandle.0, &mut req),
                Table::V9(p) => (*p).isend.unwrap()(comm.0, d, size, tag, mhandle.0, &mut req),
                Table::V10(p) => {
                    (*p).isend.unwrap()(comm.0, d, size, tag, mhandle.0, null, &mut req)
                }
                Table::V11(p) => {
                    (*p).isend.unwrap()(comm.0, d, size, tag, mhandle.0, null, &mut req)
                }
                Table::V12(p) => {
                    (*p).isend.unwrap()(comm.0, d, size, tag, mhandle.0, null, &mut req)
                }
            }
        };
        check(r)?;
        Ok(Opaque(req))
    }

    /// `irecv` of `bufs` (pointer, size); `Ok(NULL)` means "not now". For v9+ the request
    /// slot is preset to NCCL's optional-completion hint (0x1) when `optional_hint` is set.
    pub fn irecv(
        &self,
        comm: Opaque,
        bufs: &[(*mut u8, usize)],
        tags: &[i32],
        mhandles: &[Opaque],
        optional_hint: bool,
    ) -> Result<Opaque, Code> {
        let mut signed = Vec::with_capacity(bufs.len());
        for (p, size) in bufs {
            signed.push((
                *p,
                i64::try_from(*size).map_err(|_| ncclResult_t::ncclInvalidArgument)?,
            ));
        }
        self.irecv_signed(comm, &signed, tags, mhandles, optional_hint)
    }

    /// `irecv` with signed sizes, so tests can pass the negative sizes an `int` ABI allows.
    /// `n` is `bufs.len()`; `tags` and `mhandles` must be at least as long. v4 takes exactly
    /// one buffer and no tag (`ncclInvalidArgument` for any other count, before any call).
    pub fn irecv_signed(
        &self,
        comm: Opaque,
        bufs: &[(*mut u8, i64)],
        tags: &[i32],
        mhandles: &[Opaque],
        optional_hint: bool,
    ) -> Result<Opaque, Code> {
        let n = bufs.len();
        if tags.len() < n || mhandles.len() < n || n > MAX_CLIENT_RECVS {
            return Err(ncclResult_t::ncclInvalidArgument);
        }
        if matches!(self.table, Table::V4(_)) && n != 1 {
            return Err(ncclResult_t::ncclInvalidArgument);
        }
        // Stack arrays: the benchmark's data path must not allocate.
        let mut data = [std::ptr::null_mut::<c_void>(); MAX_CLIENT_RECVS];
        let mut sizes_z = [0usize; MAX_CLIENT_RECVS];
        let mut sizes_i = [0 as c_int; MAX_CLIENT_RECVS];
        let mut tags_c = [0 as c_int; MAX_CLIENT_RECVS];
        let mut mh = [std::ptr::null_mut::<c_void>(); MAX_CLIENT_RECVS];
        for i in 0..n {
            data[i] = bufs[i].0 as *mut c_void;
            sizes_z[i] = bufs[i].1 as usize;
            sizes_i[i] = bufs[i].1 as c_int;
            tags_c[i] = tags[i];
            mh[i] = mhandles[i].0;
        }
        let tags = &mut tags_c;
        let (d, si, sz, t, m) = (
            data.as_mut_ptr(),
            sizes_i.as_mut_ptr(),
            sizes_z.as_mut_ptr(),
            tags.as_mut_ptr(),
            mh.as_mut_ptr(),
        );
        let n = n as c_int;
        let mut req: *mut c_void = if optional_hint && self.version >= 9 {
            NCCL_NET_OPTIONAL_RECV_COMPLETION as usize as *mut c_void
        } else {
            std::ptr::null_mut()
        };
        let mut parents = [self.phandle; MAX_CLIENT_RECVS];
        let null = if self.phandle.is_null() {
            std::ptr::null_mut()
        } else {
            parents.as_mut_ptr()
        };
        // SAFETY: as in `call!`; every array holds n elements and lives across the call.
        let r = unsafe {
            match self.table {
                Table::V4(p) => (*p).irecv.unwrap()(comm.0, *d, *si, *m, &mut req),
                Table::V5(p) => (*p).irecv.unwrap()(comm.0, n, d, si, t, m, &mut req),
                Table::V6(p) => (*p).irecv.unwrap()(comm.0, n, d, si, t, m, &mut req),
                Table::V7(p) => (*p).irecv.unwrap()(comm.0, n, d, si, t, m, &mut req),
                Table::V8(p) => (*p).irecv.unwrap()(comm.0, n, d, si, t, m, &mut req),
                Table::V9(p) => (*p).irecv.unwrap()(comm.0, n, d, sz, t, m, &mut req),
                Table::V10(p) => (*p).irecv.unwrap()(comm.0, n, d, sz, t, m, null, &mut req),
                Table::V11(p) => (*p).irecv.unwrap()(comm.0, n, d, sz, t, m, null, &mut req),
                Table::V12(p) => (*p).irecv.unwrap()(comm.0, n, d, sz, t, m, null, &mut req),
            }
        };
        check(r)?;
        Ok(Opaque(req))
    }

    /// `iflush` of `bufs`; `Ok(NULL)` means nothing to wait for. v4 flushes exactly one
    /// buffer (`ncclInvalidArgument` for any other count, before any call).
    pub fn iflush(
        &self,
        comm: Opaque,
        bufs: &[(*mut u8, usize)],
        mhandles: &[Opaque],
    ) -> Result<Opaque, Code> {
        let mut data: Vec<*mut c_void> = bufs.iter().map(|b| b.0 as *mut c_void).collect();
        let mut sizes: Vec<c_int> = bufs.iter().map(|b| b.1 as c_int).collect();
        let mut mh: Vec<*mut c_void> = mhandles.iter().map(|m| m.0).collect();
        let mut req = std::ptr::null_mut();
        let n = bufs.len() as c_int;
        if matches!(self.table, Table::V4(_)) && (bufs.len() != 1 || mhandles.is_empty()) {
            return Err(ncclResult_t::ncclInvalidArgument);
        }
        let (d, s, m) = (data.as_mut_ptr(), sizes.as_mut_ptr(), mh.as_mut_ptr());
        // SAFETY: as in `call!`; every array holds n elements (v4: one) and lives across the
        // call.
        let r = unsafe {
            match self.table {
                Table::V4(p) => (*p).iflush.unwrap()(comm.0, *d, *s, *m, &mut req),
                Table::V5(p) => (*p).iflush.unwrap()(comm.0, n, d, s, m, &mut req),
                Table::V6(p) => (*p).iflush.unwrap()(comm.0, n, d, s, m, &mut req),
                Table::V7(p) => (*p).iflush.unwrap()(comm.0, n, d, s, m, &mut req),
                Table::V8(p) => (*p).iflush.unwrap()(comm.0, n, d, s, m, &mut req),
                Table::V9(p) => (*p).iflush.unwrap()(comm.0, n, d, s, m, &mut req),
                Table::V10(p) => (*p).iflush.unwrap()(comm.0, n, d, s, m, &mut req),
                Table::V11(p) => (*p).iflush.unwrap()(comm.0, n, d, s, m, &mut req),
                Table::V12(p) => (*p).iflush.unwrap()(comm.0, n, d, s, m, &mut req),
            }
        };
        check(r)?;
        Ok(Opaque(req))
    }

    /// `test`: `Ok(true)` when done, with `sizes` filled.
    pub fn test(&self, request: Opaque, sizes: Option<&mut [i32]>) -> Result<bool, Code> {
        let mut done: c_int = 0;
        let s = sizes.map_or(std::ptr::null_mut(), |s| s.as_mut_ptr());
        check(call!(self, t => t.test.unwrap()(request.0, &mut done, s)))?;
        Ok(done != 0)
    }

    /// `test` with an optional `done` flag, for tests of bad arguments (NULL `done`).
    pub fn test_code(&self, request: Opaque, done: Option<&mut i32>) -> Code {
        let d = done.map_or(std::ptr::null_mut(), |d| d as *mut c_int);
        call!(self, t => t.test.unwrap()(request.0, d, std::ptr::null_mut()))
    }

    /// `closeSend`.
    pub fn close_send(&self, comm: Opaque) -> Result<(), Code> {
        check(call!(self, t => t.closeSend.unwrap()(comm.0)))
    }

    /// `closeRecv`.
    pub fn close_recv(&self, comm: Opaque) -> Result<(), Code> {
        check(call!(self, t => t.closeRecv.unwrap()(comm.0)))
    }

    /// `closeListen`.
    pub fn close_listen(&self, comm: Opaque) -> Result<(), Code> {
        check(call!(self, t => t.closeListen.unwrap()(comm.0)))
    }

    /// Whether the optional slots NCCL checks for NULL and this plugin leaves out are NULL
    /// (getDeviceMr, irecvConsumed, setNetAttr where the version has them), and the ones it
    /// implements set (makeVDevice v9+, finalize v11+).
    pub fn optional_slots_null(&self) -> bool {
        // SAFETY: as in `call!`.
        unsafe {
            match self.table {
                Table::V4(_) | Table::V5(_) | Table::V6(_) => true,
                Table::V7(p) => (*p).getDeviceMr.is_none() && (*p).irecvConsumed.is_none(),
                Table::V8(p) => (*p).getDeviceMr.is_none() && (*p).irecvConsumed.is_none(),
                Table::V9(p) => {
                    (*p).getDeviceMr.is_none()
                        && (*p).irecvConsumed.is_none()
                        && (*p).makeVDevice.is_some()
                }
                Table::V10(p) => {
                    (*p).getDeviceMr.is_none()
                        && (*p).irecvConsumed.is_none()
                        && (*p).makeVDevice.is_some()
                }
                Table::V11(p) => {
                    (*p).getDeviceMr.is_none()
                        && (*p).irecvConsumed.is_none()
                        && (*p).makeVDevice.is_some()
                        && (*p).setNetAttr.is_none()
                        && (*p).finalize.is_some()
                }
                Table::V12(p) => {
                    (*p).getDeviceMr.is_none()
                        && (*p).irecvConsumed.is_none()
                        && (*p).makeVDevice.is_some()
                        && (*p).setNetAttr.is_none()
                        && (*p).finalize.is_some()
                }
            }
        }
    }

    /// `makeVDevice` (v9+; `ncclInvalidUsage` before) of the devices `devs` (NCCL may pass up to 4, v12 up to 8): the
    /// new device's index.
    pub fn make_vdevice(&self, devs: &[i32]) -> Result<i32, Code> {
        let mut d: c_int = -1;
        macro_rules! fuse {
            ($p:expr, $ty:ty) => {{
                let mut props = <$ty>::default();
                props.ndevs = devs.len() as c_int;
                for (to, from) in props.devs.iter_mut().zip(devs) {
                    *to = *from;
                }
                // SAFETY: as in `call!`; props lives across the call.
                unsafe { (*$p).makeVDevice.unwrap()(&mut d, &mut props) }
            }};
        }
        let r = match self.table {
            Table::V9(p) => fuse!(p, ncclNetVDeviceProps_v9_t),
            Table::V10(p) => fuse!(p, ncclNetVDeviceProps_v10_t),
            Table::V11(p) => fuse!(p, ncclNetVDeviceProps_v11_t),
            Table::V12(p) => fuse!(p, ncclNetVDeviceProps_v12_t),
            _ => return Err(ncclResult_t::ncclInvalidUsage),
        };
        check(r)?;
        Ok(d)
    }

    /// Unloads the library (`dlclose`), as NCCL 2.28+ does after its last communicator.
    pub fn close(self) {
        drop(self)
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // SAFETY: lib came from dlopen in `open` and is closed exactly once, here.
        unsafe { libc::dlclose(self.lib) };
    }
}

fn v9_props(v: ncclNetProperties_v9_t) -> Properties {
    Properties {
        name: owned(v.name).unwrap_or_default(),
        pci_path: owned(v.pciPath),
        guid: v.guid,
        ptr_support: v.ptrSupport,
        reg_is_global: Some(v.regIsGlobal),
        force_flush: Some(v.forceFlush),
        speed: v.speed,
        port: v.port,
        latency: v.latency,
        max_comms: v.maxComms,
        max_recvs: v.maxRecvs,
        net_device: Some((v.netDeviceType, v.netDeviceVersion)),
        vprops: Some(vprops(v.vProps.ndevs, &v.vProps.devs)),
        max_bytes: Some((v.maxP2pBytes, v.maxCollBytes)),
        max_multi_request_size: None,
        rail_plane: None,
    }
}

/// `vProps` as (ndevs, the first `ndevs` devices).
fn vprops(ndevs: i32, devs: &[i32]) -> (i32, Vec<i32>) {
    let n = usize::try_from(ndevs).unwrap_or(0).min(devs.len());
    (ndevs, devs[..n].to_vec())
}

/// `listen` of the tables without a context (v4..v10).
///
/// # Safety
/// Only for those tables (all have the same `listen` signature).
fn listen_slot<T: ListenSlot>(
    t: &T,
) -> unsafe extern "C" fn(c_int, *mut c_void, *mut *mut c_void) -> ncclResult_t {
    t.listen_fn()
}

trait ListenSlot {
    fn listen_fn(
        &self,
    ) -> unsafe extern "C" fn(c_int, *mut c_void, *mut *mut c_void) -> ncclResult_t;
}

macro_rules! listen_slot {
    ($($t:ty),*) => {$(
        impl ListenSlot for $t {
            fn listen_fn(&self) -> unsafe extern "C" fn(c_int, *mut c_void, *mut *mut c_void) -> ncclResult_t {
                self.listen.expect("listen is set")
            }
        }
    )*};
}
listen_slot!(
    ncclNet_v4_t,
    ncclNet_v5_t,
    ncclNet_v6_t,
    ncclNet_v7_t,
    ncclNet_v8_t,
    ncclNet_v9_t,
    ncclNet_v10_t
);

impl ListenSlot for ncclNet_v12_t {
    fn listen_fn(
        &self,
    ) -> unsafe extern "C" fn(c_int, *mut c_void, *mut *mut c_void) -> ncclResult_t {
        unreachable!("v12 listen takes a context and is called directly")
    }
}

impl ListenSlot for ncclNet_v11_t {
    fn listen_fn(
        &self,
    ) -> unsafe extern "C" fn(c_int, *mut c_void, *mut *mut c_void) -> ncclResult_t {
        unreachable!("v11 listen takes a context and is called directly")
    }
}

/// Where the built plugin is: `$NCCL_ERDMA_PLUGIN_LIB`, else next to the running executable's
/// target directory (`target/<profile>/libnccl_net_erdma.so`).
pub fn default_library() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        if let Some(p) = std::env::var_os("NCCL_ERDMA_PLUGIN_LIB") {
            return PathBuf::from(p);
        }
        let exe = std::env::current_exe().unwrap_or_default();
        let mut dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
        for _ in 0..3 {
            for name in ["libnccl-net-erdma.so", "libnccl_net_erdma.so"] {
                let cand = dir.join(name);
                if cand.exists() {
                    return cand;
                }
            }
            if !dir.pop() {
                break;
            }
        }
        PathBuf::from("libnccl-net-erdma.so")
    })
    .clone()
}

/// A connection handle as text (lower-case hex), to pass it between processes (an
/// environment variable, a control line), as NCCL passes it through its bootstrap.
pub fn handle_to_hex(handle: &[u8; 128]) -> String {
    handle.iter().map(|b| format!("{b:02x}")).collect()
}

/// The handle [`handle_to_hex`] wrote, or why `text` is not one.
pub fn handle_from_hex(text: &str) -> Result<[u8; 128], String> {
    let text = text.trim();
    if text.len() != 256 || !text.is_ascii() {
        return Err(format!(
            "a handle is 256 hex digits, got {} characters",
            text.len()
        ));
    }
    let mut out = [0u8; 128];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&text[2 * i..2 * i + 2], 16)
            .map_err(|_| format!("not hex at {}: {:?}", 2 * i, &text[2 * i..2 * i + 2]))?;
    }
    Ok(out)
}

/// Deterministic bytes for message `seed` (the same in every process and on every host), for
/// transfers whose every byte is checked.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_survive_hex_and_bad_text_is_an_error() {
        let mut h = [0u8; 128];
        for (i, b) in h.iter_mut().enumerate() {
            *b = (i * 37) as u8;
        }
        assert_eq!(handle_from_hex(&handle_to_hex(&h)).unwrap(), h);
        assert!(handle_from_hex("00").is_err());
        assert!(handle_from_hex(&"zz".repeat(128)).is_err());
    }

    #[test]
    fn the_logger_formats_printf_calls_of_any_plugin() {
        logger();
        let long = "y".repeat(5000);
        let long = CString::new(long).unwrap();
        // SAFETY: a call as a plugin makes it, the arguments matching the format.
        unsafe {
            nccl_net_tools_logger(
                NCCL_LOG_INFO,
                NCCL_NET as c_ulong,
                c"toy.c".as_ptr(),
                7,
                c"client-test n=%d s=%s p=%p %5.2f%%".as_ptr(),
                -42 as c_int,
                c"abc".as_ptr(),
                0x1234usize as *const c_void,
                99.5f64,
            );
            nccl_net_tools_logger(
                NCCL_LOG_WARN,
                0,
                std::ptr::null(),
                0,
                c"client-test long %s".as_ptr(),
                long.as_ptr(),
            );
        }
        let lines: Vec<_> = logged_lines()
            .into_iter()
            .filter(|l| l.text.starts_with("client-test"))
            .collect();
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert_eq!(lines[0].text, "client-test n=-42 s=abc p=0x1234 99.50%");
        assert_eq!(
            (lines[0].level, lines[0].flags),
            (NCCL_LOG_INFO, NCCL_NET as c_ulong)
        );
        assert_eq!(lines[0].fmt, "client-test n=%d s=%s p=%p %5.2f%%");
        // Cut at the buffer, NUL-terminated.
        assert_eq!(lines[1].text.len(), 4095);
        assert!(lines[1].text.starts_with("client-test long yyy"));
    }
}
