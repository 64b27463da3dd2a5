//! `nccl-net-bench` end to end, as the scripts run it: its command line, a local run over
//! the tcp transport on loopback (side A here, side B its child, talking over the control
//! channel), the table, CSV and SVG it writes, and `--plot` of that CSV against itself.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

/// Runs the bench with `args`; returns (exit code, stdout, stderr).
fn bench(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_nccl-net-bench"))
        .args(args)
        .env("NCCL_ERDMA_TRANSPORT", "tcp")
        .env("NCCL_SOCKET_IFNAME", "lo")
        .output()
        .expect("running nccl-net-bench");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    eprintln!("{stdout}{stderr}");
    (out.status.code().unwrap_or(-1), stdout, stderr)
}

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("nccl-net-bench-{}-{name}", std::process::id()))
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn help_and_usage_errors() {
    // vm-tier.sh decides whether to run the bench, and with --csv, from --help.
    let (code, help, _) = bench(&["--help"]);
    assert_eq!(code, 0);
    assert!(help.contains("Usage: nccl-net-bench [options]"), "{help}");
    assert!(
        help.contains("--sizes <LIST>") && help.contains("--csv <FILE>"),
        "{help}"
    );
    // ... and tells an unknown flag by this message.
    let (code, _, err) = bench(&["--bogus"]);
    assert_eq!(code, 2);
    assert!(err.contains("unexpected argument '--bogus'"), "{err}");
    let (code, _, err) = bench(&["--window", "33"]);
    assert_eq!(code, 2);
    assert!(err.contains("must be in 1..=32, got 33"), "{err}");
}

#[test]
fn local_run_over_tcp_writes_table_csv_and_svg() {
    // The library the plugin's build put next to this test.
    let lib = nccl_net_erdma_tools::client::default_library();
    assert!(lib.exists(), "no plugin library at {}", lib.display());
    let (csv, svg, plot) = (temp("run.csv"), temp("run.svg"), temp("plot.svg"));
    let (code, out, _) = bench(&[
        "--lib",
        path(&lib),
        "--sizes",
        "8,4K",
        "--iters",
        "5",
        "--stats",
        "--csv",
        path(&csv),
        "--svg",
        path(&svg),
    ]);
    assert_eq!(code, 0);
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines.contains(&"transport: tcp"), "{out}");
    assert!(lines.contains(&"window 8, group 1, conns 1, iterations 5 per size"));
    let head = lines
        .iter()
        .position(|l| *l == "      size        GB/s      lat us");
    let rows = &lines[head.expect("the table's head") + 1..][..2];
    assert!(rows[0].starts_with("       8 B ") && rows[1].starts_with("     4 KiB "));
    assert_eq!(
        lines
            .iter()
            .filter(|l| l.starts_with("stats size="))
            .count(),
        4
    );
    assert!(lines.contains(&format!("csv: {}", csv.display()).as_str()));
    let text = std::fs::read_to_string(&csv).unwrap();
    assert_eq!(text.lines().count(), 3, "{text}");
    let mut csv_lines = text.lines();
    assert_eq!(
        csv_lines.next(),
        Some("size_bytes,bandwidth_gbps,latency_us")
    );
    for (line, size) in csv_lines.zip(["8", "4096"]) {
        let f: Vec<&str> = line.split(',').collect();
        assert_eq!(f[0], size, "{text}");
        // 8 bytes in a slow run may print as 0.000000 GB/s; a latency never rounds to 0.
        let value = |i: usize| f[i].parse::<f64>().unwrap();
        assert!(value(1) >= 0.0 && value(2) > 0.0, "{text}");
    }
    let drawn = std::fs::read_to_string(&svg).unwrap();
    assert!(drawn.starts_with("<svg ") && drawn.contains(">\nerdma plugin (tcp)\n</text>"));
    // The scripts' --plot: this run against itself.
    let again = format!("{}=again", csv.display());
    let args = [
        "--plot",
        path(&csv),
        "--compare",
        &again,
        "--svg",
        path(&plot),
    ];
    let (code, out, _) = bench(&args);
    assert_eq!(
        (code, out.trim()),
        (0, format!("svg: {}", plot.display()).as_str())
    );
    let drawn = std::fs::read_to_string(&plot).unwrap();
    assert!(drawn.contains(">\nagain\n</text>") && drawn.trim_end().ends_with("</svg>"));
    for f in [csv, svg, plot] {
        let _ = std::fs::remove_file(f);
    }
}

#[test]
fn scripted_run_over_tcp_states_every_phase() {
    // scripts/perf/cpu-cost.sh's run, without callgrind: both ends in one process, one phase per
    // kind of call after the warm-up, each with the calls it made and no misses (loopback
    // delivers within the sending call).
    let lib = nccl_net_erdma_tools::client::default_library();
    let (code, out, _) = bench(&[
        "--lib",
        path(&lib),
        "--script",
        "4",
        "--window",
        "2",
        "--script-idle",
        "3",
    ]);
    assert_eq!(code, 0);
    let lines: Vec<&str> = out.lines().collect();
    assert!(
        lines[0].starts_with("script transport=tcp device=erdma-tcp-lo abi=12 size=8 window=2 idle=3 rounds=4 warmup=64 wait_us=0"),
        "{out}"
    );
    assert_eq!(lines[1], "script-warmup n=1 rounds=64 misses=0");
    let phases: Vec<&str> = lines
        .iter()
        .copied()
        .filter(|l| l.starts_with("script-phase "))
        .collect();
    let want = [
        ("isend", 8),
        ("irecv", 8),
        ("test_send", 8),
        ("test_recv", 8),
        ("isend_idle", 24),
        ("test_recv_idle", 24),
    ];
    assert_eq!(phases.len(), want.len(), "{out}");
    for (i, (line, (bin, calls))) in phases.iter().zip(want).enumerate() {
        assert_eq!(
            *line,
            format!(
                "script-phase n={} bin={bin} attempt=1 calls={calls} outcome_calls={calls} \
                 misses=0 other_misses=0 kept=yes",
                i + 2
            )
        );
    }
    assert_eq!(lines.last(), Some(&"script-done messages=176"));
    // Not with the normal run's roles.
    let (code, _, err) = bench(&["--script", "4", "--listen"]);
    assert_eq!(code, 2);
    assert!(err.contains("cannot be used with"), "{err}");
}

/// The toy plugin (tests/toy-plugin/toy_net.c: ncclNet_v8 over TCP on loopback, logging with
/// printf formats): a plugin that is not ours. Compiled for the test (and removed after it),
/// or where there is no compiler (the Soft-RoCE VM) the one `NCCL_NET_TOY_PLUGIN` names.
struct Toy {
    path: PathBuf,
    compiled: bool,
}

impl Toy {
    fn get(test: &str) -> Toy {
        if let Some(p) = std::env::var_os("NCCL_NET_TOY_PLUGIN") {
            return Toy {
                path: p.into(),
                compiled: false,
            };
        }
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
        let path = temp(&format!("libtoy-{test}.so"));
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let status = Command::new(&cc)
            .args([
                "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror", "-I",
            ])
            .arg(dir.join("../include"))
            .arg(dir.join("tests/toy-plugin/toy_net.c"))
            .arg("-o")
            .arg(&path)
            .status()
            .unwrap_or_else(|e| panic!("running {cc}: {e}"));
        assert!(status.success(), "{cc} failed on toy_net.c");
        Toy {
            path,
            compiled: true,
        }
    }
}

impl Drop for Toy {
    fn drop(&mut self) {
        if self.compiled {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[test]
fn a_plugin_that_is_not_ours_runs_in_the_bench_and_the_scripted_run() {
    let toy = Toy::get("bench");
    let lib = &toy.path;
    let (code, out, err) = bench(&["--lib", path(lib), "--sizes", "8,4K,64K", "--iters", "10"]);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    let named = format!(
        "library:   {} (ncclNetPlugin_v8, plugin \"toy\")",
        lib.display()
    );
    assert!(
        lines.contains(&named.as_str()),
        "the highest table it has: {out}"
    );
    assert!(
        lines.contains(&"transport: toy (the plugin's own)"),
        "{out}"
    );
    let head = lines
        .iter()
        .position(|l| *l == "      size        GB/s      lat us")
        .expect("the table's head");
    let rows = &lines[head + 1..][..3];
    for (row, size) in rows
        .iter()
        .zip(["       8 B ", "     4 KiB ", "    64 KiB "])
    {
        assert!(row.starts_with(size), "{out}");
    }
    // Its printf-style WARN, formatted (%d, %p, %s), from each side's process.
    let warns: Vec<&str> = err
        .lines()
        .filter_map(|l| l.strip_prefix("[plugin WARN] toy: a test plugin (pid "))
        .collect();
    assert_eq!(warns.len(), 2, "{err}");
    for w in warns {
        let (pid, rest) = w.split_once(", logger 0x").expect("pid and logger");
        assert!(pid.parse::<u32>().is_ok(), "{w}");
        assert!(
            rest.ends_with("): not for production, loopback only"),
            "{w}"
        );
    }
    // The scripted run behind scripts/perf/cpu-cost.sh: every phase made its calls.
    let (code, out, _) = bench(&[
        "--lib",
        path(lib),
        "--script",
        "4",
        "--window",
        "2",
        "--script-idle",
        "3",
        "--script-wait",
        "200",
    ]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.starts_with("script transport=toy device=toy0 abi=8 "),
        "{out}"
    );
    let kept = out
        .lines()
        .filter(|l| l.starts_with("script-phase ") && l.ends_with(" kept=yes"))
        .count();
    assert_eq!(kept, 6, "{out}");
    assert!(out.contains("script-done messages=176"), "{out}");
    // A table it does not have is named.
    let (code, _, err) = bench(&["--lib", path(lib), "--abi", "11"]);
    assert_ne!(code, 0);
    assert!(err.contains("exports no ncclNetPlugin_v11"), "{err}");
}

#[test]
fn the_client_formats_another_plugins_log_lines() {
    use nccl_net_erdma_tools::client::{logged_lines, Net};
    let toy = Toy::get("client");
    let lib = &toy.path;
    let mut net = Net::open_highest(lib).unwrap();
    assert_eq!((net.version(), net.name().as_str()), (8, "toy"));
    net.init().unwrap();
    let mut handle = [0u8; 128];
    let listen = net.listen(0, &mut handle).unwrap();
    let port = u16::from_be_bytes([handle[2], handle[3]]);
    let line = logged_lines()
        .into_iter()
        .find(|l| l.text.starts_with("toy: listening on port "))
        .expect("the listen line");
    assert_eq!(line.fmt, "toy: listening on port %u (fd %d, comm %p)");
    let want = format!("toy: listening on port {port} (fd ");
    assert!(line.text.starts_with(&want), "{}", line.text);
    assert!(line.text.contains(", comm 0x") && line.text.ends_with(')'));
    net.close_listen(listen).unwrap();
}

#[test]
fn scale_run_over_tcp_counts_what_each_pair_holds_and_leaves_nothing() {
    let lib = nccl_net_erdma_tools::client::default_library();
    let (code, out, err) = bench(&["--lib", path(&lib), "--scale", "4,8"]);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("scale: "), "{out}");
    assert!(lines[1].trim_start().starts_with("pairs "), "{out}");
    for (row, n) in lines[2..].iter().zip(["4", "8"]) {
        let cols: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(cols.len(), 10, "{row}");
        assert_eq!(cols[0], n);
        // Over tcp each end of a pair is one socket, and closing gives them all back.
        assert_eq!((cols[2], cols[9]), ("2.0", "0"), "{row}");
        assert!(cols[7].parse::<f64>().unwrap() > 0.0, "{row}");
    }
    assert_eq!(lines.len(), 4, "{out}");
}
