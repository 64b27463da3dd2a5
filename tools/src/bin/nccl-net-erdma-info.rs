//! `nccl-net-erdma-info`: what the plugin sees on this host, as the plugin would use it, with
//! a fix for every problem found. Exit status 0 when the plugin can run here, 1 otherwise.

use std::{io::Write, process::ExitCode};

use clap::Parser;
use nccl_net_erdma::report::{self, Report};
use serde_json::{json, Value};

/// What nccl-net-erdma sees on this host: RDMA devices and ports as the plugin would use
/// them (GID, MTU, speed, QPs per connection), GPUDirect RDMA readiness, every setting and
/// where it came from, what NCCL would get, and warnings with their fixes. Run it with the
/// same environment as the job. Exit status 0 when the plugin can run here, 1 otherwise.
#[derive(Parser)]
#[command(name = "nccl-net-erdma-info", version)]
struct Args {
    /// Print one JSON document instead of text (for scripts and support tickets).
    #[arg(long)]
    json: bool,
}

fn to_json(r: &Report) -> Value {
    let ports: Vec<Value> = r
        .ports
        .iter()
        .map(|p| {
            json!({
                "name": p.name,
                "port": p.port,
                "state": p.state,
                "link_layer": p.link_layer,
                "driver": p.driver,
                "vendor_id": format!("{:#06x}", p.vendor_id),
                "active_mtu": p.active_mtu,
                "netdev": p.netdev.as_ref().map(|(n, _)| n),
                "netdev_mtu": p.netdev.as_ref().and_then(|(_, m)| *m),
                "gid_index": p.gid_index,
                "gid": p.gid,
                "gid_source": p.gid_source,
                "speed_mbps": p.speed_mbps,
                "port_speed_mbps": p.port_speed_mbps,
                "pci_path": p.pci_path,
                "numa_node": p.numa_node,
                "max_qp": p.max_qp,
                "qps_per_connection": {"value": p.qps_per_connection.0, "source": p.qps_per_connection.1},
                "cts_batch": {"value": p.cts_batch.0, "source": p.cts_batch.1},
                "used": p.used.is_ok(),
                "unused_because": p.used.as_ref().err(),
            })
        })
        .collect();
    json!({
        "version": r.version,
        "abi": r.abi,
        "bootstrap": r.bootstrap,
        "libibverbs": r.libibverbs,
        "devices": ports,
        "fusion": {
            "fused": !r.fusion.members.is_empty(),
            "members": r.fusion.members,
            "reason": r.fusion.reason,
        },
        "gpudirect": {
            "nvidia_gpu": r.gpudirect.gpu,
            "peer_memory": r.gpudirect.peermem,
            "dmabuf": r.gpudirect.dmabuf,
        },
        "settings": r.settings.iter().map(|s| json!({
            "name": s.name, "value": s.value, "source": s.source, "doc": s.doc,
        })).collect::<Vec<_>>(),
        "nccl": {
            "transport": r.transport,
            "devices": r.nccl_devices.iter().map(|d| json!({
                "index": d.index,
                "name": d.name,
                "speed_mbps": d.speed_mbps,
                "ptr_support": format!("{:#x}", d.ptr_support),
            })).collect::<Vec<_>>(),
        },
        "warnings": r.warnings.iter().map(|w| json!({"what": w.what, "fix": w.fix})).collect::<Vec<_>>(),
        "plugin_runs": r.plugin_runs,
        "failure": r.failure,
    })
}

fn main() -> ExitCode {
    let args = Args::parse();
    let report = report::collect();
    let text = if args.json {
        format!("{:#}\n", to_json(&report))
    } else {
        report.render()
    };
    // A closed pipe (`| head`) is not an error worth a panic.
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
    if report.plugin_runs {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
