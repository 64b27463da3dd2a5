//! `nccl-net-erdma-info`: what the plugin sees on this host, as the plugin would use it, with
//! a fix for every problem found. Exit status 0 when the plugin can run here, 1 otherwise.
//! The library runs its `init` once and hands over the facts (`report::collect`); this
//! program only renders them, as text or JSON. Besides, it opens the library file installed
//! with it (or `--lib`) as NCCL does and names the `ncclNetPlugin_vN` tables it exports and the
//! NCCL releases that load each, and what the dynamic loader finds here under the names NCCL
//! opens (`libnccl-net.so`, `libnccl-net-erdma.so`).

use std::{
    fmt::Write as _,
    io::Write,
    path::{Path, PathBuf},
    process::ExitCode,
};

use clap::Parser;
use nccl_net_erdma::report::{self, Port, Report};
use nccl_net_erdma_tools::loader::{self, KNOWN_TABLES};
use serde_json::{json, Value};

/// What nccl-net-erdma sees on this host: RDMA devices and ports as the plugin would use
/// them (GID, MTU, speed, QPs per connection, NUMA node), GPUDirect RDMA readiness, NIC
/// fusion, every setting and where it came from, what NCCL would get, and warnings with their
/// fixes; the ncclNetPlugin_vN tables the library file exports and which NCCL releases load
/// each. Run it with the same environment as the job. Exit status 0 when the plugin can run
/// here, 1 otherwise.
#[derive(Parser)]
#[command(name = "nccl-net-erdma-info", version)]
struct Args {
    /// Print one JSON document instead of text (for scripts and support tickets).
    #[arg(long)]
    json: bool,
    /// The plugin library file whose tables to list (default: the one installed with this
    /// command: beside it, or in ../lib/ as the wheel and the .deb place it).
    #[arg(long, value_name = "PATH")]
    lib: Option<PathBuf>,
}

/// The library this command was installed with, and where it looked: beside it (a build
/// directory, the test tiers' stage), cargo's `deps/`, `../lib/` (the wheel) and
/// `../lib/<arch>-linux-gnu/` (the .deb).
fn installed_library() -> (Option<PathBuf>, Vec<PathBuf>) {
    let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
    else {
        return (None, Vec::new());
    };
    let multiarch = format!("{}-linux-gnu", std::env::consts::ARCH);
    let candidates = vec![
        dir.join("libnccl-net-erdma.so"),
        dir.join("libnccl_net_erdma.so"),
        dir.join("deps/libnccl_net_erdma.so"),
        dir.join("../lib/libnccl-net-erdma.so"),
        dir.join("../lib")
            .join(multiarch)
            .join("libnccl-net-erdma.so"),
    ];
    let found = candidates
        .iter()
        .find(|p| p.is_file())
        .map(|p| p.canonicalize().unwrap_or_else(|_| p.clone()));
    (found, candidates)
}

/// What an NCCL release gets from the library file, and what the loader finds by name here.
struct Loading {
    /// The library inspected.
    library: Option<PathBuf>,
    /// Where it was looked for (when not given).
    searched: Vec<PathBuf>,
    /// Its `ncclNetPlugin_vN` tables, or why it does not open.
    tables: Result<Vec<u32>, String>,
    /// The same library as `libnccl-net.so` where the packages put it (beside it: the wheel;
    /// in `nccl-net-erdma/`: the .deb), and whether it is the same library.
    default_name: Option<(PathBuf, bool)>,
    /// `libnccl-net.so` and `libnccl-net-erdma.so` looked up by name as NCCL opens them.
    by_name: Vec<(&'static str, Result<Option<PathBuf>, String>)>,
}

impl Loading {
    fn inspect(lib: Option<PathBuf>) -> Loading {
        let (library, searched) = match lib {
            Some(p) => (Some(p), Vec::new()),
            None => installed_library(),
        };
        let tables = match &library {
            Some(p) => loader::exported_tables(p),
            None => Err("not found".into()),
        };
        let default_name = library.as_ref().and_then(|lib| {
            let dir = lib.parent()?;
            [
                dir.join("libnccl-net.so"),
                dir.join("nccl-net-erdma/libnccl-net.so"),
            ]
            .into_iter()
            .find(|p| p.is_file() && p != lib)
            .map(|p| {
                let same = loader::same_library(&p, lib);
                (p, same)
            })
        });
        let by_name = ["libnccl-net.so", "libnccl-net-erdma.so"]
            .into_iter()
            .map(|name| (name, loader::resolve(name)))
            .collect();
        Loading {
            library,
            searched,
            tables,
            default_name,
            by_name,
        }
    }

    /// `ncclNetPlugin_v6 .. v12`, from the file; else what the plugin was compiled with.
    fn abi(&self, r: &Report) -> String {
        match &self.tables {
            Ok(t) if !t.is_empty() => {
                let contiguous = t.windows(2).all(|w| w[1] == w[0] + 1);
                if contiguous && t.len() > 1 {
                    format!("ncclNetPlugin_v{} .. v{}", t[0], t[t.len() - 1])
                } else {
                    let v: Vec<_> = t.iter().map(|v| format!("v{v}")).collect();
                    format!("ncclNetPlugin_{}", v.join(", "))
                }
            }
            Ok(_) => "none: the library exports no ncclNetPlugin_vN table".into(),
            Err(_) => format!(
                "{} (compiled in; the library file was not inspected)",
                r.abi
            ),
        }
    }

    /// The library's directory as text.
    fn dir(&self) -> String {
        self.library
            .as_ref()
            .and_then(|p| p.parent())
            .map_or("<its directory>".into(), |d| d.display().to_string())
    }

    /// The directory of its `libnccl-net.so` as text.
    fn default_name_dir(&self) -> String {
        match &self.default_name {
            Some((p, _)) => p.parent().map_or(self.dir(), |d| d.display().to_string()),
            None => self.dir(),
        }
    }

    /// The text section: a line per table, then the file names NCCL opens.
    fn lines(&self) -> Vec<String> {
        let mut lines = Vec::new();
        let exported = match (&self.library, &self.tables) {
            (Some(lib), Ok(t)) => {
                lines.push(format!("library: {}", lib.display()));
                t.clone()
            }
            (Some(lib), Err(e)) => {
                lines.push(format!("library: {}: cannot be opened: {e}", lib.display()));
                return lines;
            }
            (None, _) => {
                let looked: Vec<_> = self
                    .searched
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect();
                lines.push(format!(
                    "library: not found beside this command (looked for {}); name it with \
                     --lib PATH",
                    looked.join(", ")
                ));
                return lines;
            }
        };
        let (used, unserved) = loader::served(&exported);
        for s in &used {
            let mut line = format!(
                "{:<18} {}",
                format!("ncclNetPlugin_v{}", s.version),
                s.releases()
            );
            if let Some(names) = s.file_names() {
                let _ = write!(line, " ({names})");
            }
            lines.push(line);
        }
        if !unserved.is_empty() {
            let missing: Vec<_> = KNOWN_TABLES
                .filter(|v| !exported.contains(v))
                .map(|v| format!("v{v}"))
                .collect();
            let releases: Vec<_> = unserved
                .iter()
                .map(|&(f, l)| loader::releases(f, l))
                .collect();
            lines.push(format!(
                "no table for {}: the library exports no ncclNetPlugin_{} (those releases use \
                 their own IB or Socket transport)",
                releases.join(", "),
                missing.join(", ")
            ));
        }
        const BESIDE: &str = "libnccl-net.so beside it (the one name NCCL 2.9 - 2.10 open)";
        lines.push(match &self.default_name {
            Some((p, true)) => format!("{BESIDE}: {}, the same library", p.display()),
            Some((p, false)) => format!(
                "{BESIDE}: {}, NOT the same library (a stale copy? reinstall)",
                p.display()
            ),
            None => format!("{BESIDE}: none (the wheel and the .deb ship one)"),
        });
        let library = self.library.as_deref().unwrap_or(Path::new(""));
        for (name, found) in &self.by_name {
            let default = *name == "libnccl-net.so";
            let who = if default {
                "NCCL 2.9 - 2.10, and newer ones with NCCL_NET_PLUGIN unset,"
            } else {
                "NCCL 2.11 and newer with NCCL_NET_PLUGIN=erdma"
            };
            let what = match found {
                Ok(Some(p)) if self.is_ours(p) => {
                    format!("{}, this library: {who} load it", p.display())
                }
                Ok(Some(p)) => format!(
                    "{}, another library: {who} load that one, not this plugin",
                    p.display()
                ),
                Err(e) => format!("found, but it does not load ({e}): {who} load no plugin"),
                Ok(None) if default => {
                    let mut s = format!("not found: {who} load no plugin");
                    if self.default_name.is_some() {
                        let _ = write!(
                            s,
                            "; LD_LIBRARY_PATH={}:$LD_LIBRARY_PATH puts this library there",
                            self.default_name_dir()
                        );
                    }
                    s
                }
                Ok(None) => {
                    let mut s = format!("not found: {who} load no plugin;");
                    if library.file_name().is_some_and(|n| n == *name) {
                        let _ = write!(
                            s,
                            " LD_LIBRARY_PATH={}:$LD_LIBRARY_PATH puts this library there;",
                            self.dir()
                        );
                    }
                    let _ = write!(
                        s,
                        " NCCL 2.21 and newer also take its full path, NCCL_NET_PLUGIN={}",
                        library.display()
                    );
                    s
                }
            };
            lines.push(format!("{name} on the loader path here: {what}"));
        }
        lines
    }

    fn is_ours(&self, p: &Path) -> bool {
        self.library
            .as_ref()
            .is_some_and(|lib| loader::same_library(p, lib))
    }

    fn to_json(&self) -> Value {
        let exported = self.tables.as_ref().ok();
        let (used, unserved) = loader::served(exported.map_or(&[][..], |t| &t[..]));
        json!({
            "library": self.library,
            "error": self.tables.as_ref().err(),
            "tables": used.iter().map(|s| json!({
                "symbol": format!("ncclNetPlugin_v{}", s.version),
                "version": s.version,
                "nccl": s.releases(),
                "files": s.file_names(),
            })).collect::<Vec<_>>(),
            "no_table_for": unserved.iter().map(|&(f, l)| loader::releases(f, l)).collect::<Vec<_>>(),
            "libnccl_net_so": self.default_name.as_ref().map(|(p, same)| json!({
                "path": p, "same_library": same,
            })),
            "by_name": self.by_name.iter().map(|(name, found)| {
                let (path, error) = match found {
                    Ok(p) => (p.clone(), None),
                    Err(e) => (None, Some(e)),
                };
                let ours = path.as_deref().is_some_and(|p| self.is_ours(p));
                (name.to_string(), json!({"path": path, "this_library": ours, "error": error}))
            }).collect::<serde_json::Map<_, _>>(),
        })
    }
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
fn render(r: &Report, loading: &Loading) -> String {
    let f = &r.facts;
    let mut sections: Vec<(&str, Vec<String>)> = vec![
        (
            "plugin",
            vec![
                format!("nccl-net-erdma {}", r.version),
                format!("ABI: {}", loading.abi(r)),
            ],
        ),
        ("NCCL releases that load it", loading.lines()),
    ];
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
        let setting = |name: &str| {
            r.settings
                .iter()
                .find(|s| s.name == name)
                .map_or(String::new(), |s| s.value.clone())
        };
        let back = if setting("NCCL_ERDMA_FAILBACK") == "0" {
            "; a moved connection stays (NCCL_ERDMA_FAILBACK=0)".to_string()
        } else {
            format!(
                "; back once its NIC has stayed up {} ms (NCCL_ERDMA_FAILBACK_AFTER_MS)",
                setting("NCCL_ERDMA_FAILBACK_AFTER_MS")
            )
        };
        let mut lines = vec![format!("transport: {}", f.transport)];
        lines.extend(f.devices.iter().map(|d| {
            let failover = if d.spares.is_empty() && d.members.len() < 2 {
                "failover: none (no other NIC of its link layer, or NCCL_ERDMA_FAILOVER=0)"
                    .to_string()
            } else if d.spares.is_empty() {
                format!("failover: to its other NICs (unless NCCL_ERDMA_FAILOVER=0){back}")
            } else {
                format!("failover: to {}{back}", d.spares.join(", "))
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

fn to_json(r: &Report, loading: &Loading) -> Value {
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
        "abi": loading.abi(r),
        "nccl_loading": loading.to_json(),
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
    let loading = Loading::inspect(args.lib);
    let text = if args.json {
        format!("{:#}\n", to_json(&report, &loading))
    } else {
        render(&report, &loading)
    };
    // A closed pipe (`| head`) is not an error worth a panic.
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
    if report.plugin_runs {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
