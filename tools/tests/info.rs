//! `nccl-net-erdma-info`: its report and exit status, on a host without RDMA and (in the
//! Soft-RoCE tier) on rxe0, including the warnings it must raise; the tables the library file
//! exports with the NCCL releases that load each, and the files NCCL finds by name.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The RDMA device the Soft-RoCE tier names (`NCCL_ERDMA_TEST_DEVICE`), if any.
fn verbs_device() -> Option<String> {
    std::env::var("NCCL_ERDMA_TEST_DEVICE")
        .ok()
        .filter(|d| !d.is_empty())
}

/// Panics with the reason when a verbs test cannot run here (run by the Soft-RoCE tier).
fn require_verbs() -> String {
    verbs_device().expect(
        "this test needs an RDMA device: set NCCL_ERDMA_TEST_DEVICE (the Soft-RoCE tier does)",
    )
}

fn info(env: &[(&str, &str)], unset: &[&str]) -> (i32, String) {
    info_args(&[], env, unset)
}

fn info_args(args: &[&str], env: &[(&str, &str)], unset: &[&str]) -> (i32, String) {
    // NCCL_ERDMA_INFO_BIN: where the binary is when the tests run elsewhere (the VM tier).
    let bin = std::env::var("NCCL_ERDMA_INFO_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_nccl-net-erdma-info").to_string());
    let mut cmd = Command::new(bin);
    cmd.args(args).env("NCCL_SOCKET_IFNAME", "lo");
    for k in unset {
        cmd.env_remove(k);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let Output { status, stdout, .. } = cmd.output().expect("running nccl-net-erdma-info");
    let text = String::from_utf8_lossy(&stdout).into_owned();
    eprintln!("{text}");
    (status.code().unwrap_or(-1), text)
}

fn host_without_rdma() -> bool {
    verbs_device().is_none() && !std::path::Path::new("/sys/class/infiniband").exists()
}

#[test]
fn without_rdma_it_says_why_and_fails() {
    if !host_without_rdma() {
        eprintln!("skipped: this host has RDMA devices");
        return;
    }
    let (code, text) = info(&[], &["NCCL_ERDMA_TRANSPORT", "NCCL_IB_HCA"]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("the kernel has no RDMA support") || text.contains("cannot load libibverbs"),
        "{text}"
    );
    assert!(
        text.contains("== result: the plugin cannot run here"),
        "{text}"
    );
    assert!(
        text.contains("NCCL_ERDMA_TRANSPORT = verbs (default)"),
        "{text}"
    );
}

#[test]
fn json_is_one_document_with_devices_settings_and_warnings() {
    let bin = std::env::var("NCCL_ERDMA_INFO_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_nccl-net-erdma-info").to_string());
    let out = Command::new(&bin)
        .arg("--json")
        .env("NCCL_SOCKET_IFNAME", "lo")
        .env("NCCL_ERDMA_TRANSPORT", "auto")
        .env("NCCL_IB_QPS_PER_CONNECTION", "4")
        .output()
        .expect("running nccl-net-erdma-info --json");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON document");
    assert_eq!(v["plugin_runs"], true, "{v:#}");
    assert_eq!(out.status.code(), Some(0));
    let settings = v["settings"].as_array().expect("settings");
    let qps = settings
        .iter()
        .find(|s| s["name"] == "NCCL_IB_QPS_PER_CONNECTION")
        .expect("the QPs setting");
    assert_eq!(
        (&qps["value"], &qps["source"]),
        (&"4".into(), &"env".into())
    );
    assert!(qps["doc"]
        .as_str()
        .is_some_and(|d| d.contains("QPs per connection")));
    assert!(v["warnings"].is_array() && v["devices"].is_array(), "{v:#}");
    let nccl = &v["nccl"]["devices"][0]["name"];
    assert!(nccl.as_str().is_some_and(|n| !n.is_empty()), "{v:#}");
    // The tables, from the library file: v12 is the newest NCCL's.
    let tables = v["nccl_loading"]["tables"].as_array().expect("tables");
    let v12 = tables.last().expect("a table");
    assert_eq!(
        (&v12["symbol"], &v12["nccl"]),
        (&"ncclNetPlugin_v12".into(), &"NCCL 2.30 and newer".into()),
        "{v:#}"
    );
    assert!(
        v["abi"].as_str().is_some_and(|a| a.ends_with(" .. v12")),
        "{v:#}"
    );
    // --help says what it does.
    let help = Command::new(&bin).arg("--help").output().unwrap();
    assert!(String::from_utf8_lossy(&help.stdout).contains("--json"));
}

#[test]
fn auto_transport_runs_over_tcp() {
    if !host_without_rdma() {
        eprintln!("skipped: this host has RDMA devices");
        return;
    }
    let (code, text) = info(&[("NCCL_ERDMA_TRANSPORT", "auto")], &["NCCL_IB_HCA"]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("transport: tcp"), "{text}");
    assert!(text.contains("device 0: erdma-tcp-lo"), "{text}");
    assert!(text.contains("NCCL_ERDMA_TRANSPORT = auto (env)"), "{text}");
    assert!(text.contains("NCCL_SOCKET_IFNAME = lo (env)"), "{text}");
}

#[test]
fn a_bad_setting_is_named_and_fails() {
    let (code, text) = info(&[("NCCL_IB_QPS_PER_CONNECTION", "abc")], &[]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("NCCL_IB_QPS_PER_CONNECTION=abc is not valid: an integer from 1 to 128"),
        "{text}"
    );
}

#[test]
#[ignore = "needs an RDMA device: NCCL_ERDMA_TEST_DEVICE (run by the Soft-RoCE tier)"]
fn verbs_device_report() {
    let dev = require_verbs();
    let hca = format!("={dev}");
    let (code, text) = info(
        &[("NCCL_IB_HCA", &hca)],
        &["NCCL_ERDMA_TRANSPORT", "NCCL_ERDMA_CTS_BATCH"],
    );
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains(&format!("{dev} port 1: ACTIVE Ethernet (RoCE v2)")),
        "{text}"
    );
    assert!(text.contains("used by the plugin"), "{text}");
    // Soft-RoCE is recognised as a software device: clear-to-sends are batched there.
    if dev.starts_with("rxe") {
        assert!(text.contains("clear-to-send batch 8 ("), "{text}");
    }
    let (_, text) = info(
        &[("NCCL_IB_HCA", &hca), ("NCCL_ERDMA_CTS_BATCH", "3")],
        &["NCCL_ERDMA_TRANSPORT"],
    );
    assert!(text.contains("clear-to-send batch 3 ("), "{text}");
    // No fusion by default, and the report says why, per device too.
    assert!(text.contains("== NIC fusion"), "{text}");
    assert!(text.contains("each NIC is its own device"), "{text}");
    assert!(text.contains("transport: verbs"), "{text}");
    assert!(text.contains(&format!("device 0: {dev}")), "{text}");
    assert!(text.contains("(its own NIC)"), "{text}");
    // One NIC of its link layer: nothing to fail over to.
    assert!(text.contains("(its own NIC); failover: none"), "{text}");
    // Asked to fuse one NIC: nothing to fuse.
    let (_, text) = info(
        &[("NCCL_IB_HCA", &hca), ("NCCL_ERDMA_FUSE_NICS", "1")],
        &["NCCL_ERDMA_TRANSPORT"],
    );
    assert!(text.contains("nothing to fuse"), "{text}");
    // A stale NCCL_IB_HCA is named, and the plugin cannot run with it.
    let (code, text) = info(&[("NCCL_IB_HCA", "mlx5_9")], &["NCCL_ERDMA_TRANSPORT"]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("NCCL_IB_HCA=mlx5_9 matches none of the ports here"),
        "{text}"
    );
}

#[test]
#[ignore = "needs an RDMA device: NCCL_ERDMA_TEST_DEVICE (run by the Soft-RoCE tier)"]
fn verbs_odd_mtu_is_warned_about() {
    let dev = require_verbs();
    let netdev = std::fs::read_to_string(format!(
        "/sys/class/infiniband/{dev}/ports/1/gid_attrs/ndevs/1"
    ))
    .expect("the netdev behind GID 1")
    .trim()
    .to_string();
    let set_mtu = |mtu: &str| {
        let ok = Command::new("ip")
            .args(["link", "set", &netdev, "mtu", mtu])
            .status()
            .expect("ip link")
            .success();
        assert!(ok, "ip link set {netdev} mtu {mtu}");
    };
    set_mtu("1234");
    let (code, text) = info(
        &[("NCCL_IB_HCA", &format!("={dev}"))],
        &["NCCL_ERDMA_TRANSPORT"],
    );
    set_mtu("1500");
    assert_eq!(code, 0, "an odd MTU is a warning, not a failure: {text}");
    assert!(
        text.contains(&format!("netdev {netdev} has MTU 1234")),
        "{text}"
    );
    assert!(text.contains("fix: use MTU 1500"), "{text}");
}

/// The library file the info command inspected (its `library:` line).
fn inspected(text: &str) -> PathBuf {
    let line = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("library: "))
        .unwrap_or_else(|| panic!("no library line: {text}"));
    let path = PathBuf::from(line);
    assert!(path.is_file(), "{line} is not a file: {text}");
    path
}

/// Whether `lib` exports `symbol` (dlsym, as NCCL looks it up).
fn exports(lib: &Path, symbol: &str) -> bool {
    let c = CString::new(lib.as_os_str().as_bytes()).unwrap();
    // SAFETY: c is a NUL-terminated path.
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!h.is_null(), "dlopen {}", lib.display());
    let s = CString::new(symbol).unwrap();
    // SAFETY: h is a live handle; s is NUL-terminated.
    let found = !unsafe { libc::dlsym(h, s.as_ptr()) }.is_null();
    // SAFETY: h came from dlopen above and is closed once.
    unsafe { libc::dlclose(h) };
    found
}

fn trimmed(text: &str) -> Vec<&str> {
    text.lines().map(str::trim).collect()
}

#[test]
fn it_names_each_table_the_library_exports_with_the_nccl_releases_that_load_it() {
    let (_, text) = info(&[("NCCL_ERDMA_TRANSPORT", "tcp")], &[]);
    let lib = inspected(&text);
    let lines = trimmed(&text);
    assert!(lines.contains(&"== NCCL releases that load it"), "{text}");
    assert!(
        lines.contains(&"ABI: ncclNetPlugin_v4 .. v12")
            || lines.contains(&"ABI: ncclNetPlugin_v6 .. v12"),
        "{text}"
    );
    let mut want = vec![
        "ncclNetPlugin_v6   NCCL 2.13 - 2.18",
        "ncclNetPlugin_v7   NCCL 2.19",
        "ncclNetPlugin_v8   NCCL 2.20 - 2.23",
        "ncclNetPlugin_v9   NCCL 2.24 - 2.25",
        "ncclNetPlugin_v10  NCCL 2.26 - 2.27",
        "ncclNetPlugin_v11  NCCL 2.28 - 2.29",
        "ncclNetPlugin_v12  NCCL 2.30 and newer",
    ];
    // v4 and v5 (NCCL 2.9 - 2.12) come together; without them those releases find nothing.
    match (
        exports(&lib, "ncclNetPlugin_v4"),
        exports(&lib, "ncclNetPlugin_v5"),
    ) {
        (true, true) => {
            want.insert(
                0,
                "ncclNetPlugin_v4   NCCL 2.9 - 2.11 (loaded as libnccl-net.so; 2.11 also as \
                 libnccl-net-erdma.so)",
            );
            want.insert(1, "ncclNetPlugin_v5   NCCL 2.12");
            assert!(!text.contains("no table for"), "{text}");
        }
        (false, false) => want.push(
            "no table for NCCL 2.9 - 2.12: the library exports no ncclNetPlugin_v4, v5 (those \
             releases use their own IB or Socket transport)",
        ),
        other => panic!("v4 and v5 exported {other:?}: expected both or neither"),
    }
    for w in &want {
        assert!(lines.contains(w), "missing '{w}' in:\n{text}");
    }
    let got: Vec<_> = lines
        .iter()
        .filter(|l| l.starts_with("ncclNetPlugin_v"))
        .collect();
    assert_eq!(
        got.len(),
        want.iter()
            .filter(|w| w.starts_with("ncclNetPlugin_v"))
            .count(),
        "{text}"
    );
}

/// A directory of its own for one test, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let d =
            std::env::temp_dir().join(format!("nccl-net-erdma-info-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn it_says_which_file_nccl_finds_by_name_on_the_loader_path() {
    let (_, text) = info(&[("NCCL_ERDMA_TRANSPORT", "tcp")], &[]);
    let lib = inspected(&text);
    // The wheel's layout: the library and its copy as libnccl-net.so in one directory.
    let dir = TempDir::new("by-name");
    let d = dir.0.display().to_string();
    std::fs::copy(&lib, dir.0.join("libnccl-net-erdma.so")).unwrap();
    std::fs::copy(&lib, dir.0.join("libnccl-net.so")).unwrap();
    let erdma = format!("{d}/libnccl-net-erdma.so");
    let empty = TempDir::new("empty");
    let (_, text) = info_args(
        &["--lib", &erdma],
        &[
            ("NCCL_ERDMA_TRANSPORT", "tcp"),
            ("LD_LIBRARY_PATH", &empty.0.display().to_string()),
        ],
        &[],
    );
    let lines = trimmed(&text);
    for want in [
        format!("library: {erdma}"),
        format!("libnccl-net.so beside it (the one name NCCL 2.9 - 2.10 open): {d}/libnccl-net.so, the same library"),
        format!(
            "libnccl-net.so on the loader path here: not found: NCCL 2.9 - 2.10, and newer ones \
             with NCCL_NET_PLUGIN unset, load no plugin; LD_LIBRARY_PATH={d}:$LD_LIBRARY_PATH \
             puts this library there"
        ),
        format!(
            "libnccl-net-erdma.so on the loader path here: not found: NCCL 2.11 and newer with \
             NCCL_NET_PLUGIN=erdma load no plugin; LD_LIBRARY_PATH={d}:$LD_LIBRARY_PATH puts \
             this library there; NCCL 2.21 and newer also take its full path, \
             NCCL_NET_PLUGIN={erdma}"
        ),
    ] {
        assert!(lines.contains(&want.as_str()), "missing '{want}' in:\n{text}");
    }
    // With the directory on LD_LIBRARY_PATH, both names are this library.
    let (_, text) = info_args(
        &["--lib", &erdma],
        &[("NCCL_ERDMA_TRANSPORT", "tcp"), ("LD_LIBRARY_PATH", &d)],
        &[],
    );
    let lines = trimmed(&text);
    for want in [
        format!(
            "libnccl-net.so on the loader path here: {d}/libnccl-net.so, this library: NCCL 2.9 \
             - 2.10, and newer ones with NCCL_NET_PLUGIN unset, load it"
        ),
        format!(
            "libnccl-net-erdma.so on the loader path here: {erdma}, this library: NCCL 2.11 and \
             newer with NCCL_NET_PLUGIN=erdma load it"
        ),
    ] {
        assert!(
            lines.contains(&want.as_str()),
            "missing '{want}' in:\n{text}"
        );
    }
    // A stale libnccl-net.so beside it is not taken for the same library.
    std::fs::write(dir.0.join("libnccl-net.so"), b"not the library").unwrap();
    let (_, text) = info_args(&["--lib", &erdma], &[("NCCL_ERDMA_TRANSPORT", "tcp")], &[]);
    assert!(
        text.contains(&format!(
            "{d}/libnccl-net.so, NOT the same library (a stale copy? reinstall)"
        )),
        "{text}"
    );
    // A file that is not a library: its tables cannot be listed, and the command says why.
    let (code, text) = info_args(
        &["--lib", &format!("{d}/libnccl-net.so")],
        &[("NCCL_ERDMA_TRANSPORT", "tcp")],
        &[],
    );
    assert_eq!(
        code, 0,
        "the report itself does not depend on --lib: {text}"
    );
    assert!(
        text.contains(&format!("library: {d}/libnccl-net.so: cannot be opened: ")),
        "{text}"
    );
}
