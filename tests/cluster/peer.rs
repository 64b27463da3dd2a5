//! The two roles of a cluster case and how they keep in step: host 1 listens on a control
//! port, host 2 connects to it (over `mgmt`, or over rail B when a case cuts `mgmt`), and
//! the two exchange one line at a time: the case name, plugin handles, "ready"/"done" steps.
//! Every read has a deadline, so a case whose peer hangs or dies fails instead of waiting.

use std::{
    io::{BufRead, BufReader, Write},
    net::{TcpListener, TcpStream},
    process::Command,
    time::{Duration, Instant},
};

/// The control port (one case at a time per host pair).
const CONTROL_PORT: u16 = 18_600;

/// Which host this process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Host {
    /// 198.18.x.1: listens for the control connection.
    One,
    /// 198.18.x.2: connects to it.
    Two,
}

/// Which link carries the control connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    /// The bootstrap link (198.18.0.0/24).
    Mgmt,
    /// Rail B's link (198.18.2.0/24), for cases that cut `mgmt`.
    RailB,
}

/// The other host, in step.
pub struct Peer {
    pub host: Host,
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    case: String,
}

/// This host, from `CLUSTER_HOST_ID` (set by scripts/vm/cluster-vm.sh); None outside a cluster.
pub fn this_host() -> Option<Host> {
    match std::env::var("CLUSTER_HOST_ID").ok()?.as_str() {
        "1" => Some(Host::One),
        "2" => Some(Host::Two),
        _ => None,
    }
}

/// `cmd` through `sh -c`, which must succeed (fault injection: `tc`, `ip`).
pub fn sh(cmd: &str) {
    let out = Command::new("sh").args(["-c", cmd]).output().expect("sh");
    assert!(
        out.status.success(),
        "`{cmd}` failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `cmd` through `sh -c`, whatever it does (cleanup).
pub fn sh_quiet(cmd: &str) {
    let _ = Command::new("sh").args(["-c", cmd]).output();
}

/// A fault injected on this host: `inject` runs now, `restore` when the value goes, also
/// when the case fails (unwinding), so a failed case never leaves a link down for the next.
pub struct Fault(&'static str);

impl Fault {
    pub fn inject(inject: &str, restore: &'static str) -> Fault {
        sh(inject);
        Fault(restore)
    }
}

impl Drop for Fault {
    fn drop(&mut self) {
        sh_quiet(self.0);
    }
}

impl Peer {
    /// Meets the other host for `case` over `link` (within 60 s).
    pub fn meet(case: &str, link: Link) -> Peer {
        let host =
            this_host().expect("CLUSTER_HOST_ID is 1 or 2 (run by scripts/vm/cluster-vm.sh)");
        let net = match link {
            Link::Mgmt => 0,
            Link::RailB => 2,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        let stream = match host {
            Host::One => {
                let l = TcpListener::bind((format!("198.18.{net}.1"), CONTROL_PORT))
                    .expect("binding the control port");
                l.set_nonblocking(true).unwrap();
                loop {
                    match l.accept() {
                        Ok((s, _)) => break s,
                        Err(_) => {
                            assert!(Instant::now() < deadline, "host 2 never came for {case}");
                            std::thread::sleep(Duration::from_millis(20));
                        }
                    }
                }
            }
            Host::Two => loop {
                let addr = format!("198.18.{net}.1:{CONTROL_PORT}");
                match TcpStream::connect(&addr) {
                    Ok(s) => break s,
                    Err(_) => {
                        assert!(
                            Instant::now() < deadline,
                            "host 1 never listened for {case}"
                        );
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
            },
        };
        stream.set_nonblocking(false).unwrap();
        stream.set_nodelay(true).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(240)))
            .unwrap();
        let writer = stream.try_clone().unwrap();
        let mut p = Peer {
            host,
            reader: BufReader::new(stream),
            writer,
            case: case.to_string(),
        };
        p.send(&format!("case {case}"));
        let theirs = p.recv();
        assert_eq!(
            theirs,
            format!("case {case}"),
            "the hosts run different cases"
        );
        p
    }

    /// Sends one line.
    pub fn send(&mut self, line: &str) {
        writeln!(self.writer, "{line}").expect("control send");
    }

    /// Receives one line (the read deadline bounds it).
    pub fn recv(&mut self) -> String {
        let mut line = String::new();
        let n = self
            .reader
            .read_line(&mut line)
            .unwrap_or_else(|e| panic!("{}: the other host said nothing in time: {e}", self.case));
        assert!(
            n > 0,
            "{}: the other host closed the control connection",
            self.case
        );
        line.trim_end().to_string()
    }

    /// Receives a line `key value`, returning the value.
    pub fn expect(&mut self, key: &str) -> String {
        let line = self.recv();
        line.strip_prefix(key)
            .and_then(|v| v.strip_prefix(' '))
            .unwrap_or_else(|| panic!("{}: expected `{key} ...`, got `{line}`", self.case))
            .to_string()
    }

    /// Both hosts reach `step` before either goes on.
    pub fn step(&mut self, step: &str) {
        self.send(&format!("step {step}"));
        assert_eq!(self.expect("step"), step, "{}: out of step", self.case);
    }
}
