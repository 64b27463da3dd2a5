//! How NCCL finds a net plugin, release by release, and what a plugin library file offers it:
//! which `ncclNetPlugin_vN` tables it exports (looked up with `dlsym`, as NCCL does) and which
//! file the dynamic loader gives for a library name (`libnccl-net.so`, as NCCL 2.9 - 2.10 open
//! it). The release facts are from NVIDIA/nccl's tags (`src/init.cc` up to 2.11, `src/net.cc`
//! and `src/plugin/` after).

use std::ffi::{c_char, c_void, CStr, CString};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// An NCCL release, (2, minor).
pub type Release = (u32, u32);

/// Releases from the first to the last (`None`: up to the newest).
pub type Releases = (Release, Option<Release>);

/// NCCL releases that look for the same tables, in the same order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Generation {
    /// The first release, (2, minor).
    pub first: (u32, u32),
    /// The last release; `None`: up to the newest.
    pub last: Option<(u32, u32)>,
    /// The `ncclNetPlugin_vN` tables it looks for, in its order: the first one the library
    /// exports is the one it uses.
    pub tables: &'static [u32],
}

/// Every NCCL release that loads net plugins, oldest first. (2.8 loads `ncclNetPlugin_v4`
/// too, but the plugin was never tried with it.)
pub const GENERATIONS: &[Generation] = &[
    gen((2, 9), Some((2, 11)), &[4]),
    gen((2, 12), Some((2, 12)), &[5, 4]),
    gen((2, 13), Some((2, 18)), &[6, 5, 4]),
    gen((2, 19), Some((2, 19)), &[7, 6, 5]),
    gen((2, 20), Some((2, 23)), &[8, 7, 6, 5]),
    gen((2, 24), Some((2, 25)), &[9, 8, 7, 6, 5]),
    gen((2, 26), Some((2, 27)), &[10, 9, 8, 7, 6]),
    gen((2, 28), Some((2, 29)), &[11, 10, 9, 8, 7, 6]),
    gen((2, 30), None, &[12, 11, 10, 9, 8, 7, 6]),
];

const fn gen(first: (u32, u32), last: Option<(u32, u32)>, tables: &'static [u32]) -> Generation {
    Generation {
        first,
        last,
        tables,
    }
}

/// The table versions some NCCL release looks for.
pub const KNOWN_TABLES: std::ops::RangeInclusive<u32> = 4..=12;

/// The releases from `first` to `last` as text: `NCCL 2.12`, `NCCL 2.9 - 2.11`,
/// `NCCL 2.30 and newer`.
pub fn releases(first: (u32, u32), last: Option<(u32, u32)>) -> String {
    match last {
        Some(l) if l == first => format!("NCCL {}.{}", first.0, first.1),
        Some(l) => format!("NCCL {}.{} - {}.{}", first.0, first.1, l.0, l.1),
        None => format!("NCCL {}.{} and newer", first.0, first.1),
    }
}

/// One table of a library, and the releases that use it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Served {
    /// The table's version (`ncclNetPlugin_v<version>`).
    pub version: u32,
    /// The first release that uses it.
    pub first: (u32, u32),
    /// The last (`None`: up to the newest).
    pub last: Option<(u32, u32)>,
}

impl Served {
    /// `NCCL 2.13 - 2.18`.
    pub fn releases(&self) -> String {
        releases(self.first, self.last)
    }

    /// How those releases find the file, where it is not simply `NCCL_NET_PLUGIN`: NCCL 2.9 and
    /// 2.10 open only `libnccl-net.so`, and 2.11 (the first to read `NCCL_NET_PLUGIN`) also
    /// `libnccl-net-<NCCL_NET_PLUGIN>.so`.
    pub fn file_names(&self) -> Option<&'static str> {
        if self.first > (2, 10) {
            None
        } else if self.last == Some((2, 11)) {
            Some("loaded as libnccl-net.so; 2.11 also as libnccl-net-erdma.so")
        } else {
            Some("loaded as libnccl-net.so; 2.11 and newer also as libnccl-net-erdma.so")
        }
    }
}

/// Which table each release takes from a library exporting `exported`, grouped: one entry per
/// table some release uses (oldest releases first), and the release ranges that find none.
pub fn served(exported: &[u32]) -> (Vec<Served>, Vec<Releases>) {
    let mut used: Vec<Served> = Vec::new();
    let mut unserved: Vec<Releases> = Vec::new();
    let mut previous: Option<Option<u32>> = None;
    for g in GENERATIONS {
        let table = g.tables.iter().copied().find(|t| exported.contains(t));
        if previous == Some(table) {
            // The same outcome as the releases before: they grow by this generation.
            match table {
                Some(_) => used.last_mut().expect("pushed before").last = g.last,
                None => unserved.last_mut().expect("pushed before").1 = g.last,
            }
        } else {
            match table {
                Some(version) => used.push(Served {
                    version,
                    first: g.first,
                    last: g.last,
                }),
                None => unserved.push((g.first, g.last)),
            }
        }
        previous = Some(table);
    }
    (used, unserved)
}

/// The message of the last failed `dl*` call.
fn dl_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the next dl* call.
    let p = unsafe { libc::dlerror() };
    if p.is_null() {
        "unknown error".into()
    } else {
        // SAFETY: checked non-NULL above; NUL-terminated.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// A library opened as NCCL opens a plugin (`RTLD_NOW | RTLD_LOCAL`), closed when dropped.
struct Opened(*mut c_void);

impl Opened {
    /// `dlopen(name)`: a path, or a name the dynamic loader looks up (`LD_LIBRARY_PATH`, the
    /// loader cache, the default directories).
    fn open(name: &str) -> Result<Opened, String> {
        let c = CString::new(name).map_err(|e| e.to_string())?;
        // SAFETY: c is NUL-terminated.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if h.is_null() {
            Err(dl_error())
        } else {
            Ok(Opened(h))
        }
    }

    fn has(&self, symbol: &str) -> bool {
        let c = CString::new(symbol).expect("no NUL in a symbol name");
        // SAFETY: self.0 is a live handle; c is NUL-terminated.
        !unsafe { libc::dlsym(self.0, c.as_ptr()) }.is_null()
    }

    /// The path the loader opened.
    fn path(&self) -> Option<PathBuf> {
        /// The start of glibc's public `struct link_map` (`<link.h>`).
        #[repr(C)]
        struct LinkMap {
            l_addr: usize,
            l_name: *const c_char,
        }
        let mut map: *const LinkMap = std::ptr::null();
        // SAFETY: RTLD_DI_LINKMAP stores a `struct link_map *` at the pointer given.
        let r = unsafe {
            libc::dlinfo(
                self.0,
                libc::RTLD_DI_LINKMAP,
                (&mut map as *mut *const LinkMap).cast(),
            )
        };
        if r != 0 || map.is_null() {
            return None;
        }
        // SAFETY: the link map lives while the handle is open; l_name is NUL-terminated.
        let name = unsafe { (*map).l_name };
        if name.is_null() {
            return None;
        }
        // SAFETY: as above.
        let s = unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned();
        (!s.is_empty()).then(|| PathBuf::from(s))
    }
}

impl Drop for Opened {
    fn drop(&mut self) {
        // SAFETY: the handle came from dlopen and is closed once, here.
        unsafe { libc::dlclose(self.0) };
    }
}

/// The `ncclNetPlugin_vN` tables (of [`KNOWN_TABLES`]) the library at `path` exports, looked
/// up as NCCL looks them up; or why it cannot be opened.
pub fn exported_tables(path: &Path) -> Result<Vec<u32>, String> {
    let lib = Opened::open(&path.to_string_lossy())?;
    Ok(KNOWN_TABLES
        .filter(|v| lib.has(&format!("ncclNetPlugin_v{v}")))
        .collect())
}

/// Where the dynamic loader finds `name` (a file name without `/`) in this process's
/// environment, as NCCL's `dlopen(name)` would: `Ok(None)` when it finds none, `Err` when it
/// finds one that does not load.
pub fn resolve(name: &str) -> Result<Option<PathBuf>, String> {
    match Opened::open(name) {
        Ok(lib) => Ok(lib.path()),
        Err(e) if e.contains("No such file or directory") => Ok(None),
        Err(e) => Err(e),
    }
}

/// Whether `a` and `b` are the same library: one file (a link, or the same inode), or copies
/// with the same bytes.
pub fn same_library(a: &Path, b: &Path) -> bool {
    let (Ok(ma), Ok(mb)) = (std::fs::metadata(a), std::fs::metadata(b)) else {
        return false;
    };
    if (ma.dev(), ma.ino()) == (mb.dev(), mb.ino()) {
        return true;
    }
    ma.len() == mb.len() && matches!((std::fs::read(a), std::fs::read(b)), (Ok(x), Ok(y)) if x == y)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(exported: &[u32]) -> (Vec<String>, Vec<String>) {
        let (used, unserved) = served(exported);
        (
            used.iter()
                .map(|s| format!("v{} {}", s.version, s.releases()))
                .collect(),
            unserved.iter().map(|&(f, l)| releases(f, l)).collect(),
        )
    }

    #[test]
    fn every_table_serves_its_own_releases() {
        let (used, unserved) = lines(&[4, 5, 6, 7, 8, 9, 10, 11, 12]);
        assert_eq!(
            used,
            [
                "v4 NCCL 2.9 - 2.11",
                "v5 NCCL 2.12",
                "v6 NCCL 2.13 - 2.18",
                "v7 NCCL 2.19",
                "v8 NCCL 2.20 - 2.23",
                "v9 NCCL 2.24 - 2.25",
                "v10 NCCL 2.26 - 2.27",
                "v11 NCCL 2.28 - 2.29",
                "v12 NCCL 2.30 and newer",
            ]
        );
        assert!(unserved.is_empty());
        let (first, _) = served(&[4, 5, 6]);
        assert_eq!(
            first[0].file_names(),
            Some("loaded as libnccl-net.so; 2.11 also as libnccl-net-erdma.so")
        );
        assert_eq!(first[1].file_names(), None);
    }

    #[test]
    fn without_v4_and_v5_nccl_2_9_to_2_12_find_nothing() {
        let (used, unserved) = lines(&[6, 7, 8, 9, 10, 11, 12]);
        assert_eq!(used[0], "v6 NCCL 2.13 - 2.18");
        assert_eq!(used.len(), 7);
        assert_eq!(unserved, ["NCCL 2.9 - 2.12"]);
    }

    #[test]
    fn an_older_table_serves_the_newer_releases_that_still_look_for_it() {
        // A v8-only plugin (the tests' toy): 2.20 and every newer release take v8.
        assert_eq!(
            lines(&[8]),
            (
                vec!["v8 NCCL 2.20 and newer".to_string()],
                vec!["NCCL 2.9 - 2.19".to_string()]
            )
        );
        // v4 only: up to 2.18; 2.19 dropped v4.
        let (used, unserved) = served(&[4]);
        assert_eq!((used[0].first, used[0].last), ((2, 9), Some((2, 18))));
        assert_eq!(
            used[0].file_names(),
            Some("loaded as libnccl-net.so; 2.11 and newer also as libnccl-net-erdma.so")
        );
        assert_eq!(unserved, [((2, 19), None)]);
        // v5 and v12: 2.19 - 2.25 take v5, 2.26 - 2.29 nothing (v5 dropped, v12 unknown).
        assert_eq!(
            lines(&[5, 12]),
            (
                vec![
                    "v5 NCCL 2.12 - 2.25".to_string(),
                    "v12 NCCL 2.30 and newer".to_string()
                ],
                vec![
                    "NCCL 2.9 - 2.11".to_string(),
                    "NCCL 2.26 - 2.29".to_string()
                ]
            )
        );
    }

    #[test]
    fn a_missing_name_is_none_and_a_file_is_the_same_as_itself() {
        assert_eq!(resolve("libnccl-net-no-such-plugin.so"), Ok(None));
        let me = std::env::current_exe().unwrap();
        assert!(same_library(&me, &me));
        assert!(!same_library(&me, Path::new("/nonexistent")));
        assert!(exported_tables(Path::new("/nonexistent/libx.so")).is_err());
    }
}
