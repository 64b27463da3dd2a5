//! `nccl-net-bench`: drives the built plugin through its C ABI (`dlopen` + one
//! `ncclNetPlugin_vN` table, exactly as NCCL's proxy does, via
//! [`nccl_net_erdma_tools::client`]) between two processes, and prints per message size the
//! bandwidth (GB/s) and the latency (us).
//!
//! Roles. One side *listens* (`--listen [PORT]`, side A) and one *connects*
//! (`--connect HOST:PORT`, side B); with neither flag the program runs both on this host: it
//! listens on 127.0.0.1 and spawns itself as the connecting child. The two sides talk over a
//! small text control channel ([`control`]) to agree on the run ([`plan`]), swap the
//! plugin's 128-byte handles and step through the sizes ([`session`]). Side A decides the
//! run (sizes, iterations, window, group, connections, transport).
//!
//! Each side listens on the plugin and connects to the peer's handles, polling `connect` and
//! `accept` alternately until every connection is up ([`conn`]), so each side has `conns`
//! send comms to the peer and `conns` receive comms from it.
//!
//! Per size: the bandwidth phase ([`bandwidth`]), the ping-pong latency phase ([`latency`]),
//! and a data check of the first and the last message of each ([`data`]); a mismatch, or a
//! size reported by `test` that differs from the size sent, fails the run. Buffers are
//! allocated and registered (`regMr`) once per connection for the whole run; the timed loops
//! allocate nothing of their own.
//!
//! The results go to a table on stdout, `--csv` and `--svg` ([`report`], [`plot`]).
//!
//! `--script R` is another mode: the scripted single-process run whose instructions
//! scripts/perf/cpu-cost.sh counts per kind of call ([`script`]); `--scale N,...` another:
//! what N connections cost ([`scale`]).
//!
//! This file: the process roles (local, listening, connecting), `main`, and the functions
//! of the bandwidth phase and the idle probe that callgrind can measure by name.

mod args;
mod bandwidth;
mod conn;
mod control;
mod data;
mod idle;
mod latency;
mod plan;
mod plot;
mod plugin;
mod poll;
mod report;
mod scale;
mod script;
mod session;

use std::{
    io::Write,
    net::TcpListener,
    process::{Child, Command, ExitCode},
    time::{Duration, Instant},
};

use nccl_net_erdma_tools::client::{Net, Opaque};

use crate::{
    args::{Options, Role},
    bandwidth::Calls,
    conn::{Conn, Scratch},
    control::{accept_control, connect_control, CONTROL_TIMEOUT, LISTEN_TIMEOUT},
    plan::{Params, SizePlan},
    plugin::{open_plugin, set_env},
    report::Report,
};

/// Result type of this program: errors are messages for the user.
type Res<T> = Result<T, String>;

// ---------------------------------------------------------------------------------------
// The measurable functions of the normal run: callgrind can count instructions only while
// `nccl_net_bench::bw_send` / `bw_recv` / `probe_idle_send` / `probe_idle_recv` run
// (`--toggle-collect` by symbol name), so these four keep those names at the crate root and
// are never inlined; the loops, in their modules, are always inlined into them. (What
// scripts/perf/cpu-cost.sh counts are the scripted run's functions, in [`script`].)

/// Side A of the bandwidth phase of `plan` ([`bandwidth::send`]).
#[inline(never)]
fn bw_send(
    net: &Net,
    conns: &mut [Conn],
    s: &mut Scratch,
    params: &Params,
    plan: &SizePlan,
) -> Res<()> {
    bandwidth::send(net, conns, s, params, plan)
}

/// Side B of the bandwidth phase of `plan` ([`bandwidth::recv`]): its receive time.
#[inline(never)]
fn bw_recv(
    net: &Net,
    conns: &mut [Conn],
    s: &mut Scratch,
    params: &Params,
    plan: &SizePlan,
) -> Res<Duration> {
    bandwidth::recv(net, conns, s, params, plan)
}

/// `--idle-probe`, side A: `k` idle `isend`s ([`idle::idle_sends`]).
#[inline(never)]
fn probe_idle_send(net: &Net, c: &Conn, k: usize, calls: &mut Calls) -> Res<()> {
    idle::idle_sends(net, c, k, calls)
}

/// `--idle-probe`, side B: `k` idle `test`s of `req` ([`idle::idle_tests`]).
#[inline(never)]
fn probe_idle_recv(net: &Net, req: Opaque, k: usize, calls: &mut Calls) -> Res<()> {
    idle::idle_tests(net, req, k, calls)
}

// ---------------------------------------------------------------------------------------
// Process roles

/// Kills the local child on every path that does not wait for it.
struct ChildGuard(Option<Child>);

impl ChildGuard {
    /// Waits up to `timeout` for a clean exit.
    fn wait(&mut self, timeout: Duration) -> Res<()> {
        let Some(child) = self.0.as_mut() else {
            return Ok(());
        };
        let until = Instant::now() + timeout;
        loop {
            match child.try_wait() {
                Ok(Some(st)) => {
                    self.0 = None;
                    return if st.success() {
                        Ok(())
                    } else {
                        Err(format!("the connecting child process failed ({st})"))
                    };
                }
                Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(10)),
                Ok(None) => return Err("the connecting child process does not exit".into()),
                Err(e) => return Err(format!("waiting for the child process: {e}")),
            }
        }
    }

    /// Why the child can no longer connect: it has already exited, with this status.
    fn exited(&mut self) -> Option<String> {
        let child = self.0.as_mut()?;
        match child.try_wait() {
            Ok(Some(st)) => {
                self.0 = None;
                Some(format!("the connecting child process exited early ({st})"))
            }
            _ => None,
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn run_listen(o: &Options, port: u16) -> Res<Report> {
    let mut p = open_plugin(o, None)?;
    let l = TcpListener::bind(("0.0.0.0", port))
        .map_err(|e| format!("binding control port {port}: {e}"))?;
    let port = l.local_addr().map_err(|e| e.to_string())?.port();
    // Always printed (even with --quiet): the peer needs it.
    println!("listening on control port {port}");
    let _ = std::io::stdout().flush();
    let mut ctl = accept_control(&l, LISTEN_TIMEOUT, || None)?;
    let r = session::run_a(o, &p, &mut ctl);
    let r = ctl.notify(r)?;
    p.finalize()?;
    Ok(r)
}

fn run_local(o: &Options) -> Res<Report> {
    if std::env::var_os("NCCL_SOCKET_IFNAME").is_none() {
        set_env("NCCL_SOCKET_IFNAME", "lo");
    }
    // Opened first, so a tcp fallback is in the environment the child inherits.
    let mut p = open_plugin(o, None)?;
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("control listener: {e}"))?;
    let port = l.local_addr().map_err(|e| e.to_string())?.port();
    let exe = std::env::current_exe().map_err(|e| format!("finding this executable: {e}"))?;
    let mut cmd = match o.cpus {
        Some((_, Some(b))) => {
            let mut c = Command::new("taskset");
            c.arg("-c").arg(b.to_string()).arg(&exe);
            c
        }
        _ => Command::new(&exe),
    };
    // A profile of the child is told by `--connect` in its command line.
    let child = cmd
        .arg("--connect")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--lib")
        .arg(&o.lib)
        .arg("--abi")
        .arg(p.net.version().to_string())
        .arg("--quiet")
        .spawn()
        .map_err(|e| format!("starting {}: {e}", exe.display()))?;
    let mut guard = ChildGuard(Some(child));
    let mut ctl = accept_control(&l, CONTROL_TIMEOUT, || guard.exited())?;
    let r = session::run_a(o, &p, &mut ctl);
    let r = ctl.notify(r)?;
    p.finalize()?;
    guard.wait(CONTROL_TIMEOUT)?;
    Ok(r)
}

/// Pins this process to `cpu` with `taskset` (std has no affinity call, and this program
/// has no `unsafe`).
fn pin_self(cpu: usize) -> Res<()> {
    let pid = std::process::id().to_string();
    let st = Command::new("taskset")
        .args(["-p", "-c", &cpu.to_string(), &pid])
        .stdout(std::process::Stdio::null())
        .status()
        .map_err(|e| format!("--cpus needs taskset (util-linux): {e}"))?;
    if st.success() {
        Ok(())
    } else {
        Err(format!(
            "taskset could not pin this process to CPU {cpu} ({st})"
        ))
    }
}

fn run(o: &Options) -> Res<Report> {
    if let Some(csv) = &o.plot {
        return Report::from_csv(csv);
    }
    if let Some((a, _)) = o.cpus {
        pin_self(a)?;
    }
    match &o.role {
        Role::Local => run_local(o),
        Role::Listen(port) => run_listen(o, *port),
        Role::Connect(addr) => {
            let mut ctl = connect_control(addr)?;
            let r = session::run_b(o, &mut ctl);
            ctl.notify(r)
        }
    }
}

/// Writes the `--svg` and `--csv` files the user asked for, each announced on stdout.
fn write_outputs(o: &Options, report: &Report) -> Res<()> {
    if let Some(path) = &o.svg {
        plot::write_svg(report, &o.compare, path)?;
        if !o.quiet {
            println!("svg: {}", path.display());
        }
    }
    if let Some(path) = &o.csv {
        report::write_csv(report, path)?;
        if !o.quiet {
            println!("csv: {}", path.display());
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    // Checked before anything runs: the poll loops read it later, where an error could not
    // be reported.
    if let Err(e) = poll::parse_idle(std::env::var(poll::IDLE_ENV).ok().as_deref()) {
        eprintln!("nccl-net-bench: {e}");
        return ExitCode::from(2);
    }
    let o = Options::from_env();
    if let Some(counts) = &o.scale {
        return match scale::run(&o, counts) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("nccl-net-bench: error: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if o.script.is_some() {
        let r = match o.cpus {
            Some((a, _)) => pin_self(a),
            None => Ok(()),
        };
        return match r.and_then(|()| script::run(&o)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("nccl-net-bench: error: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let who = match o.role {
        Role::Connect(_) => "nccl-net-bench (connecting side)",
        _ => "nccl-net-bench",
    };
    let result = run(&o).and_then(|mut report| {
        if let Some(t) = &o.title {
            report.title.clone_from(t);
        }
        if let Some(l) = &o.label {
            report.label.clone_from(l);
        }
        if !o.notes.is_empty() {
            report.notes.clone_from(&o.notes);
        }
        write_outputs(&o, &report)
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{who}: error: {e}");
            ExitCode::FAILURE
        }
    }
}
