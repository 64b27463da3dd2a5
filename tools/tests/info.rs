//! `nccl-net-erdma-info`: its report and exit status, on a host without RDMA and (in the
//! Soft-RoCE tier) on rxe0, including the warnings it must raise.

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
    // NCCL_ERDMA_INFO_BIN: where the binary is when the tests run elsewhere (the VM tier).
    let bin = std::env::var("NCCL_ERDMA_INFO_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_nccl-net-erdma-info").to_string());
    let mut cmd = Command::new(bin);
    cmd.env("NCCL_SOCKET_IFNAME", "lo");
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
