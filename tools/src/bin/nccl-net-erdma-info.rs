//! `nccl-net-erdma-info`: what the plugin sees on this host, as the plugin would use it, with
//! a fix for every problem found. Exit status 0 when the plugin can run here, 1 otherwise.
//! The library runs its `init` once and hands over the facts (`report::collect`); this
//! program only renders them, as text or JSON.

use std::{fmt::Write as _, io::Write, process::ExitCode};

use clap::Parser;
use nccl_net_erdma::report::{self, Port, Report};
use serde_json::{json, Value};

/// What nccl-net-erdma sees on this host: RDMA devices and ports as the plugin would use
/// them (GID, MTU, speed, QPs per connection, NUMA node), GPUDirect RDMA readiness, NIC
/// fusion, every setting and where it came from, what NCCL would get, and warnings with their
/// fixes. Run it with the same environment as the job. Exit status 0 when the plugin can run
/// here, 1 otherwise.
#[derive(Parser)]
#[command(name = "nccl-net-erdma-info", version)]
struct Args {
    /// Print one JSON document instead of text (for scripts and support tickets).
    #[arg(long)]
    json: bool,
}

fn yes_no(b: bool, yes: &str, no: &str) -> String {
    (if b { yes } else { no }).to_string()
}

/// One port, as the text report shows it.
fn describe_port(p: &Port) -> String {
    let netdev = match &p.netdev {
        Some((n, Some(m))) => format!("netdev {n} MTU {m}"),
        Some((n, None)) => format!("netdev {n}"),
        None => "no netdev".into(),
    };
    let speed = if p.speed_mbps.source == "the port" {
        format!("{} Mbps (from the port)", p.port_speed_mbps)
    } else {
        format!(
            "{} Mbps ({}; port says {})",
            p.speed_mbps.value, p.speed_mbps.source, p.port_speed_mbps
        )
    };
    let driver = p.driver.as_deref().unwrap_or(if p.pci_path.is_none() {
        "none (a software device)"
    } else {
        "?"
    });
    let (l, c) = (&p.limits, &p.connection);
    format!(
        "{} port {}: {} {}, driver {driver}, vendor {:#06x}\n    \
         active MTU {} ({netdev}), GID index {} {} ({}), speed {speed}\n    \
         PCI {}, NUMA node {}, QPs per connection {} ({}), clear-to-send batch {} ({}), {}\n    \
         limits: max_qp {}, max_cq {}, max_mr {}, max_qp_wr {}, max_cqe {}\n    \
         a connection (sending end / receiving end): {} / {} QPs, {} / {} CQs of {} / {} \
         entries, {} / {} registrations, send queue {}, receive queue {}; room for {} pairs \
         in one process",
        p.device,
        p.port,
        p.state,
        p.link_layer,
        p.vendor_id,
        p.active_mtu,
        p.gid_index,
        p.gid,
        p.gid_source,
        p.pci_path.as_deref().unwrap_or("none"),
        p.numa_node.map_or("?".to_string(), |n| n.to_string()),
        p.qps_per_connection.value,
        p.qps_per_connection.source,
        p.cts_batch.value,
        p.cts_batch.source,
        match &p.used {
            Ok(()) => "used by the plugin",
            Err(why) => why,
        },
        l.max_qp,
        l.max_cq,
        l.max_mr,
        l.max_qp_wr,
        l.max_cqe,
        c.qps.0,
        c.qps.1,
        c.cqs.0,
        c.cqs.1,
        c.cqes.0,
        c.cqes.1,
        c.mrs.0,
        c.mrs.1,
        c.send_wr,
        c.recv_wr,
        c.pairs,
    )
}

/// The report as text: titled sections, then the warnings and the verdict.
fn render(r: &Report) -> String {
    let f = &r.facts;
    let mut sections: Vec<(&str, Vec<String>)> = vec![(
        "plugin",
        vec![
            format!("nccl-net-erdma {}", r.version),
            format!("ABI: {}", r.abi),
        ],
    )];
    if let Some(b) = &r.bootstrap {
        sections.push(("bootstrap", vec![b.clone()]));
    }
    if let Some(lib) = &f.libibverbs {
        let mut lines = vec![format!("libibverbs: {lib}")];
        lines.extend(f.ports.iter().map(describe_port));
        if f.ports.is_empty() {
            lines.push("none".into());
        }
        sections.push(("RDMA devices", lines));
    }
    if !f.fusion.reason.is_empty() {
        let mut lines = vec![f.fusion.reason.clone()];
        for d in f.devices.iter().filter(|d| d.members.len() > 1) {
            lines.push(format!(
                "device {} is {} over {} rails; receives of 16 KiB or more are striped over \
                 all of them",
                d.index,
                d.name,
                d.members.len()
            ));
        }
        if f.devices.len() > 1 && f.fusion.members.is_empty() {
            lines.push(
                "NCCL spreads its channels over the devices and may fuse them itself \
                 (makeVDevice, NCCL_NET_FORCE_MERGE)"
                    .into(),
            );
        }
        sections.push(("NIC fusion", lines));
    }
    if f.libibverbs.is_some() {
        let g = &f.gpudirect;
        sections.push((
            "GPUDirect RDMA",
            vec![
                format!("NVIDIA GPU present: {}", yes_no(g.gpu, "yes", "no")),
                format!(
                    "peer memory (nvidia_peermem): {}",
                    yes_no(g.peermem, "present", "absent")
                ),
                format!(
                    "DMA-BUF registration (ibv_reg_dmabuf_mr): {}",
                    yes_no(g.dmabuf, "supported", "not supported")
                ),
            ],
        ));
    }
    sections.push((
        "settings",
        r.settings
            .iter()
            .map(|s| format!("{} = {} ({})", s.name, s.value, s.source))
            .collect(),
    ));
    if r.plugin_runs {
        let mut lines = vec![format!("transport: {}", f.transport)];
        lines.extend(f.devices.iter().map(|d| {
            let failover = if d.spares.is_empty() && d.members.len() < 2 {
                "failover: none (no other NIC of its link layer, or NCCL_ERDMA_FAILOVER=0)"
                    .to_string()
            } else if d.spares.is_empty() {
                "failover: to its other NICs (unless NCCL_ERDMA_FAILOVER=0)".to_string()
            } else {
                format!("failover: to {}", d.spares.join(", "))
            };
            format!(
                "device {}: {} speed {} Mbps ptrSupport {:#x} PCI {} ({}); {failover}",
                d.index,
                d.name,
                d.speed_mbps,
                d.ptr_support,
                d.pci_path.as_deref().unwrap_or("none"),
                d.why
            )
        }));
        sections.push(("what NCCL would get", lines));
    }
    let mut out = String::new();
    for (title, lines) in sections {
        let _ = writeln!(out, "== {title}");
        for l in lines {
            let _ = writeln!(out, "  {l}");
        }
    }
    let warnings: Vec<_> = r.all_warnings().collect();
    let _ = writeln!(out, "== warnings ({})", warnings.len());
    for w in warnings {
        let _ = writeln!(out, "  WARNING: {}\n    fix: {}", w.what, w.fix);
    }
    match &r.failure {
        None => {
            let _ = writeln!(out, "== result: the plugin can run here");
        }
        Some(why) => {
            let _ = writeln!(out, "== result: the plugin cannot run here: {why}");
        }
    }
    out
}

fn to_json(r: &Report) -> Value {
    let f = &r.facts;
    let ports: Vec<Value> = f
        .ports
        .iter()
        .map(|p| {
            json!({
                "name": p.name,
                "device": p.device,
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
                "speed_mbps": p.speed_mbps.value,
                "speed_source": p.speed_mbps.source,
                "port_speed_mbps": p.port_speed_mbps,
                "pci_path": p.pci_path,
                "numa_node": p.numa_node,
                "limits": {
                    "max_qp": p.limits.max_qp,
                    "max_cq": p.limits.max_cq,
                    "max_mr": p.limits.max_mr,
                    "max_qp_wr": p.limits.max_qp_wr,
                    "max_cqe": p.limits.max_cqe,
                },
                "connection": {
                    "qps": [p.connection.qps.0, p.connection.qps.1],
                    "cqs": [p.connection.cqs.0, p.connection.cqs.1],
                    "cqes": [p.connection.cqes.0, p.connection.cqes.1],
                    "mrs": [p.connection.mrs.0, p.connection.mrs.1],
                    "send_wr": p.connection.send_wr,
                    "recv_wr": p.connection.recv_wr,
                    "pairs": p.connection.pairs,
                },
                "qps_per_connection": {"value": p.qps_per_connection.value, "source": p.qps_per_connection.source},
                "cts_batch": {"value": p.cts_batch.value, "source": p.cts_batch.source},
                "used": p.used.is_ok(),
                "unused_because": p.used.as_ref().err(),
            })
        })
        .collect();
    json!({
        "version": r.version,
        "abi": r.abi,
        "bootstrap": r.bootstrap,
        "libibverbs": f.libibverbs,
        "devices": ports,
        "fusion": {
            "fused": !f.fusion.members.is_empty(),
            "members": f.fusion.members,
            "reason": f.fusion.reason,
        },
        "gpudirect": {
            "nvidia_gpu": f.gpudirect.gpu,
            "peer_memory": f.gpudirect.peermem,
            "dmabuf": f.gpudirect.dmabuf,
        },
        "settings": r.settings.iter().map(|s| json!({
            "name": s.name, "value": s.value, "source": s.source, "doc": s.doc,
        })).collect::<Vec<_>>(),
        "nccl": {
            "transport": r.plugin_runs.then_some(&f.transport),
            "devices": f.devices.iter().map(|d| json!({
                "index": d.index,
                "name": d.name,
                "speed_mbps": d.speed_mbps,
                "ptr_support": format!("{:#x}", d.ptr_support),
                "pci_path": d.pci_path,
                "members": d.members,
                "fused": d.members.len() > 1,
                "why": d.why,
                "failover_spares": d.spares,
            })).collect::<Vec<_>>(),
        },
        "warnings": r.all_warnings().map(|w| json!({"what": w.what, "fix": w.fix})).collect::<Vec<_>>(),
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
        render(&report)
    };
    // A closed pipe (`| head`) is not an error worth a panic.
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
    if report.plugin_runs {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
