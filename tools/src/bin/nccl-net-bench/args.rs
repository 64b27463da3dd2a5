//! The command line: clap's derive parser for every flag the scripts and people use, and
//! the resolved [`Options`] the rest of the program reads.
//!
//! Flags, value syntax and ranges are an interface: scripts/bench.sh, vm-tier.sh,
//! perf-vm.sh, perf/perf-vm-inner.sh, cpu-cost.sh and perf/cost-runs.sh pass them, and
//! vm-tier.sh greps `--help` for `--sizes` and `--csv`.

use std::path::{Path, PathBuf};

use clap::Parser;
use nccl_net_erdma_tools::client;

use crate::plan::{Phases, MAX_CONNS, MAX_GROUP, MAX_PROBE, MAX_SIZE, MAX_WINDOW};

/// Default requests in flight per connection.
pub const DEFAULT_WINDOW: usize = 8;
/// Default TCP port of `--listen` without a port (perftest's).
pub const DEFAULT_LISTEN_PORT: u16 = 18515;
/// Most `--iters`.
const MAX_ITERS: usize = 100_000_000;
/// Most `--script` rounds per phase.
const MAX_SCRIPT_ROUNDS: usize = 1_000_000;
/// Most connection pairs `--scale` opens at once (each holds file descriptors: mind
/// `ulimit -n`).
const MAX_SCALE_PAIRS: usize = 16_384;

const USAGE: &str = "\
nccl-net-bench [options]                  both sides on this host (loopback)
       nccl-net-bench --listen [PORT] [options]  side A: wait for the peer, decide the run
       nccl-net-bench --connect HOST:PORT        side B: run what side A decides";

const ENVIRONMENT: &str = "\
environment: NCCL_ERDMA_TRANSPORT (unset: try the default, fall back to tcp without an RDMA
device), NCCL_SOCKET_IFNAME (set to lo for the local run when unset), NCCL_NET_BENCH_IDLE
(what a poll loop does once idle for 256 polls: yield (default), spin or sleep), and every
other setting the plugin reads.";

/// Which part of the run this process plays.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// Both sides on this host: side A here, side B a spawned child.
    Local,
    /// Side A, listening on this control port.
    Listen(u16),
    /// Side B, connecting to this control address.
    Connect(String),
}

/// The parsed command line, defaults applied.
#[derive(Debug, Clone)]
pub struct Options {
    pub lib: PathBuf,
    /// The table to use; None: the highest the library exports.
    pub abi: Option<u32>,
    pub sizes: Vec<usize>,
    pub iters: Option<usize>,
    pub window: usize,
    pub group: usize,
    pub conns: usize,
    pub csv: Option<PathBuf>,
    pub role: Role,
    pub quiet: bool,
    /// `--cpus`: CPU of this process, and of the local child.
    pub cpus: Option<(usize, Option<usize>)>,
    /// Run options given explicitly (ignored with a note on side B).
    pub run_options_given: bool,
    pub phases: Phases,
    /// `--bytes`: per-size payload that scaled iterations aim at.
    pub bytes: Option<usize>,
    pub svg: Option<PathBuf>,
    /// `--compare`: reference series for the plot, (CSV file, legend label).
    pub compare: Vec<(PathBuf, String)>,
    /// `--plot`: draw this CSV instead of running.
    pub plot: Option<PathBuf>,
    pub title: Option<String>,
    pub label: Option<String>,
    pub notes: Vec<String>,
    pub stats: bool,
    /// `--idle-probe`: idle calls per side (0: none).
    pub probe: usize,
    /// `--script`: rounds per phase of the scripted run (None: the normal run).
    pub script: Option<usize>,
    /// `--scale`: the numbers of connection pairs to open.
    pub scale: Option<Vec<usize>>,
    /// `--script-idle`: idle isends and idle tests per message of the scripted run.
    pub script_idle: usize,
    /// `--script-wait`: the scripted run's wait for the network (None: by transport).
    pub script_wait_us: Option<u64>,
    /// `--script-comms`: idle connection pairs the scripted run holds open besides its own.
    pub script_comms: usize,
}

/// `--sizes`: a newtype, because clap reads a bare `Vec` as "the flag takes many values"
/// while this flag takes one comma-separated value.
#[derive(Debug, Clone)]
struct SizeList(Vec<usize>);

/// `--scale`'s counts of pairs.
#[derive(Debug, Clone)]
struct ScaleList(Vec<usize>);

fn scale_list(s: &str) -> Result<ScaleList, String> {
    s.split(',')
        .map(|v| count::<1, MAX_SCALE_PAIRS>(v.trim()))
        .collect::<Result<Vec<_>, _>>()
        .map(ScaleList)
}

/// The flags as clap sees them. Run options are `Option`s so that [`Options`] can tell which
/// were given (side B ignores them, with a note). Each help text keeps its line breaks
/// (`verbatim_doc_comment`): clap wraps nothing without its `wrap_help` feature, so the
/// texts are broken by hand to fit 100 columns after the flag column.
#[derive(Parser, Debug)]
#[command(
    name = "nccl-net-bench",
    about = "nccl-net-bench: bandwidth and latency of an NCCL net plugin, driven through its C ABI",
    override_usage = USAGE,
    after_help = ENVIRONMENT,
    // A repeated flag's last value wins, so a script can append an override.
    args_override_self = true
)]
struct Cli {
    /// plugin library (default: the built libnccl-net-erdma.so)
    #[arg(long, value_name = "PATH", verbatim_doc_comment)]
    lib: Option<PathBuf>,

    /// ncclNetPlugin_vN table to use, 4..12 (default: the highest the library exports)
    #[arg(long, value_name = "N", value_parser = abi, verbatim_doc_comment)]
    abi: Option<u32>,

    /// message sizes, e.g. 8,1K,64K,1M,64M (K/M/G = KiB/MiB/GiB);
    /// default powers of 4 from 8 B, and 64 MiB
    #[arg(long, value_name = "LIST", value_parser = size_list, verbatim_doc_comment)]
    sizes: Option<SizeList>,

    /// per size: receives per connection (bandwidth) and round trips
    /// (latency); default scales with the size, so each size moves a
    /// bounded amount of data in a bounded number of messages
    #[arg(long, value_name = "N", value_parser = count::<1, MAX_ITERS>, verbatim_doc_comment)]
    iters: Option<usize>,

    /// receives in flight per connection, 1..32 (default 8); the sender
    /// keeps W x group sends in flight
    #[arg(long, value_name = "W", value_parser = count::<1, MAX_WINDOW>, verbatim_doc_comment)]
    window: Option<usize>,

    /// messages per grouped receive, 1..8 (default 1)
    #[arg(long, value_name = "N", value_parser = count::<1, MAX_GROUP>, verbatim_doc_comment)]
    group: Option<usize>,

    /// connections used at once for bandwidth, 1..64 (default 1)
    #[arg(long, value_name = "K", value_parser = count::<1, MAX_CONNS>, verbatim_doc_comment)]
    conns: Option<usize>,

    /// what to measure per size: bw, lat or bw,lat (default bw,lat)
    #[arg(long, value_name = "LIST", value_parser = Phases::parse, verbatim_doc_comment)]
    phases: Option<Phases>,

    /// with scaled iterations: about N payload bytes per size for
    /// bandwidth (default 512M) and N/4 per direction for latency
    /// (default 64M)
    #[arg(long, value_name = "N", value_parser = bytes, verbatim_doc_comment)]
    bytes: Option<usize>,

    /// also write size_bytes,bandwidth_gbps,latency_us to FILE (an
    /// empty field for a phase not run)
    #[arg(long, value_name = "FILE", verbatim_doc_comment)]
    csv: Option<PathBuf>,

    /// also draw bandwidth and latency against size into FILE (SVG)
    #[arg(long, value_name = "FILE", verbatim_doc_comment)]
    svg: Option<PathBuf>,

    /// add the rows of CSV (the --csv format) to the plot as a
    /// reference series named LABEL (default: the file name); may be
    /// repeated
    #[arg(long, value_name = "CSV[=LABEL]", value_parser = compare, allow_hyphen_values = true, verbatim_doc_comment)]
    compare: Vec<(PathBuf, String)>,

    /// run nothing: draw CSV (the --csv format) into the --svg file
    #[arg(long, value_name = "CSV", requires = "svg", verbatim_doc_comment)]
    plot: Option<PathBuf>,

    /// the plot's title (default: transport, device, window, conns)
    #[arg(
        long,
        value_name = "TEXT",
        allow_hyphen_values = true,
        verbatim_doc_comment
    )]
    title: Option<String>,

    /// the legend name of this run's series (default: the plugin's
    /// name)
    #[arg(
        long,
        value_name = "TEXT",
        allow_hyphen_values = true,
        verbatim_doc_comment
    )]
    label: Option<String>,

    /// a line under the plot's title (replaces the default ones); may
    /// be repeated
    #[arg(
        long = "note",
        value_name = "TEXT",
        allow_hyphen_values = true,
        verbatim_doc_comment
    )]
    notes: Vec<String>,

    /// print the plugin calls per message of each side (bandwidth
    /// phase)
    #[arg(long, verbatim_doc_comment)]
    stats: bool,

    /// before the sizes, K isend calls that must return NULL (side A)
    /// and then K test calls of a receive not yet sent to (side B): the
    /// cost of idle calls, for instruction counts (see also --script)
    #[arg(long = "idle-probe", value_name = "K", value_parser = count::<0, MAX_PROBE>, verbatim_doc_comment)]
    probe: Option<usize>,

    /// the scripted run for instruction counts (scripts/perf/cpu-cost.sh):
    /// both ends of one connection in this process, a fixed sequence
    /// of calls whose every outcome is known in advance, R rounds of
    /// --window messages (the first of --sizes) per phase, one phase
    /// per kind of call; prints `script` lines, no table
    #[arg(
        long,
        value_name = "R",
        value_parser = count::<1, MAX_SCRIPT_ROUNDS>,
        conflicts_with_all = ["listen", "connect", "plot", "probe", "csv", "svg"],
        verbatim_doc_comment
    )]
    script: Option<usize>,

    /// what connections cost: for each N of LIST (e.g. 16,64,256), N
    /// connection pairs opened in this process, one 64 KiB message
    /// verified over each, and per pair the memory, file descriptors,
    /// QPs, CQs, MRs and connect time it holds; prints a table
    #[arg(
        long,
        value_name = "LIST",
        value_parser = scale_list,
        conflicts_with_all = ["listen", "connect", "plot", "probe", "csv", "svg", "script"],
        verbatim_doc_comment
    )]
    scale: Option<ScaleList>,

    /// with --script: idle isends and idle tests per message, 0..64
    /// (default 1)
    #[arg(long = "script-idle", value_name = "K", value_parser = count::<0, 64>, requires = "script", verbatim_doc_comment)]
    script_idle: Option<usize>,

    /// with --script: microseconds to wait, outside the plugin, for
    /// the network before calls due to succeed (default 1000 on verbs,
    /// 0 on tcp)
    #[arg(long = "script-wait", value_name = "US", value_parser = count::<0, 1_000_000>, requires = "script", verbatim_doc_comment)]
    script_wait: Option<usize>,

    /// with --script: connection pairs to open and leave idle beside
    /// the measured one, 0..4096 (default 0): does holding many
    /// connections make a message dearer?
    #[arg(long = "script-comms", value_name = "N", value_parser = count::<0, 4096>, requires = "script", verbatim_doc_comment)]
    script_comms: Option<usize>,

    /// be side A on control port PORT (default 18515; 0 = any, printed)
    #[arg(long, value_name = "PORT", value_parser = port, overrides_with = "connect", verbatim_doc_comment)]
    listen: Option<Option<u16>>,

    /// be side B; its run options come from side A
    #[arg(
        long,
        value_name = "H:P",
        overrides_with = "listen",
        verbatim_doc_comment
    )]
    connect: Option<String>,

    /// pin this process to CPU A and, in the local run, the child to
    /// CPU B (with taskset; helps on small VMs where both may share one
    /// CPU)
    #[arg(long, value_name = "A[,B]", value_parser = cpus, verbatim_doc_comment)]
    cpus: Option<(usize, Option<usize>)>,

    /// print nothing but errors
    #[arg(long, verbatim_doc_comment)]
    quiet: bool,
}

impl Options {
    /// This process's command line; on an error or `--help`, clap prints and exits (status
    /// 2 for an error, as scripts expect of a usage error).
    pub fn from_env() -> Self {
        Cli::parse().into()
    }

    /// Parses `args` (the program name first).
    #[cfg(test)]
    pub fn try_parse_from<I, T>(args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        Cli::try_parse_from(args).map(Self::from)
    }

    /// Parses a command line given as one string of space-separated words.
    #[cfg(test)]
    pub fn try_parse_line(line: &str) -> Result<Self, clap::Error> {
        Self::try_parse_from(std::iter::once("nccl-net-bench").chain(line.split_whitespace()))
    }
}

impl From<Cli> for Options {
    fn from(c: Cli) -> Self {
        let run_options_given = c.sizes.is_some()
            || c.iters.is_some()
            || c.window.is_some()
            || c.group.is_some()
            || c.conns.is_some()
            || c.phases.is_some()
            || c.bytes.is_some()
            || c.probe.is_some();
        let role = match (c.listen, c.connect) {
            (Some(port), _) => Role::Listen(port.unwrap_or(DEFAULT_LISTEN_PORT)),
            (None, Some(addr)) => Role::Connect(addr),
            (None, None) => Role::Local,
        };
        Options {
            lib: c.lib.unwrap_or_else(client::default_library),
            abi: c.abi,
            sizes: c.sizes.map_or_else(default_sizes, |s| s.0),
            iters: c.iters,
            window: c.window.unwrap_or(DEFAULT_WINDOW),
            group: c.group.unwrap_or(1),
            conns: c.conns.unwrap_or(1),
            csv: c.csv,
            role,
            quiet: c.quiet,
            cpus: c.cpus,
            run_options_given,
            phases: c.phases.unwrap_or(Phases::BOTH),
            bytes: c.bytes,
            svg: c.svg,
            compare: c.compare,
            plot: c.plot,
            title: c.title,
            label: c.label,
            notes: c.notes,
            stats: c.stats,
            probe: c.probe.unwrap_or(0),
            script: c.script,
            scale: c.scale.map(|l| l.0),
            script_idle: c.script_idle.unwrap_or(1),
            script_wait_us: c.script_wait.map(|v| v as u64),
            script_comms: c.script_comms.unwrap_or(0),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Value parsers. clap prefixes their messages with the flag and the value
// ("invalid value '9' for '--group <N>': ...").

/// Parses `8`, `64K`, `1M`, `2G`, `16KiB`, `4kb` (binary units).
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let lower = t.to_ascii_lowercase();
    let body = lower
        .strip_suffix("ib")
        .or_else(|| lower.strip_suffix('b'))
        .unwrap_or(&lower);
    let (digits, shift) = match body.chars().last() {
        Some('k') => (&body[..body.len() - 1], 10),
        Some('m') => (&body[..body.len() - 1], 20),
        Some('g') => (&body[..body.len() - 1], 30),
        _ => (body, 0),
    };
    let n: usize = digits
        .parse()
        .map_err(|_| format!("bad size {t:?} (examples: 8, 64K, 1M, 1G)"))?;
    n.checked_mul(1 << shift)
        .filter(|v| *v <= MAX_SIZE)
        .ok_or_else(|| format!("size {t:?} is larger than {MAX_SIZE} bytes (maxP2pBytes)"))
}

/// Parses a comma-separated size list.
pub fn parse_sizes(s: &str) -> Result<Vec<usize>, String> {
    let v = s
        .split(',')
        .filter(|p| !p.trim().is_empty())
        .map(parse_size)
        .collect::<Result<Vec<_>, _>>()?;
    if v.is_empty() {
        return Err("needs at least one size".into());
    }
    Ok(v)
}

fn size_list(s: &str) -> Result<SizeList, String> {
    parse_sizes(s).map(SizeList)
}

/// 8 B, 32 B, ... (x4) up to 32 MiB, then 64 MiB.
pub fn default_sizes() -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = 8usize;
    while s < 64 << 20 {
        v.push(s);
        s *= 4;
    }
    v.push(64 << 20);
    v
}

fn number<T: std::str::FromStr>(v: &str) -> Result<T, String> {
    v.parse()
        .map_err(|_| format!("{v:?} is not a valid number"))
}

fn in_range(v: usize, lo: usize, hi: usize) -> Result<usize, String> {
    if (lo..=hi).contains(&v) {
        Ok(v)
    } else {
        Err(format!("must be in {lo}..={hi}, got {v}"))
    }
}

/// A count within `LO..=HI`.
fn count<const LO: usize, const HI: usize>(v: &str) -> Result<usize, String> {
    in_range(number(v)?, LO, HI)
}

fn abi(v: &str) -> Result<u32, String> {
    let n = number(v)?;
    if client::ALL_VERSIONS.contains(&n) {
        Ok(n)
    } else {
        Err(format!("must be one of {:?}", client::ALL_VERSIONS))
    }
}

fn bytes(v: &str) -> Result<usize, String> {
    in_range(parse_size(v)?, 1, MAX_SIZE)
}

fn port(v: &str) -> Result<u16, String> {
    v.parse().map_err(|_| format!("bad port {v:?}"))
}

/// `CSV[=LABEL]`; the label defaults to the file name without its extension.
fn compare(v: &str) -> Result<(PathBuf, String), String> {
    Ok(match v.split_once('=') {
        Some((file, label)) => (PathBuf::from(file), label.to_string()),
        None => {
            let name = Path::new(v)
                .file_stem()
                .map_or_else(|| v.to_string(), |n| n.to_string_lossy().into_owned());
            (PathBuf::from(v), name)
        }
    })
}

/// `A` or `A,B`.
fn cpus(v: &str) -> Result<(usize, Option<usize>), String> {
    let cpu = |c: &str| {
        c.trim()
            .parse::<usize>()
            .map_err(|_| format!("bad CPU number {c:?}"))
    };
    Ok(match v.split_once(',') {
        Some((a, b)) => (cpu(a)?, Some(cpu(b)?)),
        None => (cpu(v)?, None),
    })
}

#[cfg(test)]
mod tests {
    use clap::error::ErrorKind;

    use super::*;

    fn args(s: &str) -> Result<Options, clap::Error> {
        Options::try_parse_line(s)
    }

    /// The message clap prints for a rejected command line.
    fn error(s: &str) -> String {
        args(s).unwrap_err().to_string()
    }

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(
            parse_sizes("8,1K,64k,1M,64MiB,1G").unwrap(),
            vec![8, 1024, 65536, 1 << 20, 64 << 20, 1 << 30]
        );
        assert_eq!(parse_size("0").unwrap(), 0);
        assert!(parse_size("2G").is_err());
        assert!(parse_size("x").is_err());
        assert!(parse_sizes(",").is_err());
        assert_eq!(
            args("--sizes 8,4K,64K,1M").unwrap().sizes,
            vec![8, 4096, 65536, 1 << 20]
        );
        assert!(error("--sizes 2G").contains("larger than 1073741824 bytes"));
    }

    #[test]
    fn default_sizes_span_8_bytes_to_64_mib() {
        let s = default_sizes();
        assert_eq!(s.first(), Some(&8));
        assert_eq!(s.last(), Some(&(64 << 20)));
        assert!(s.windows(2).all(|w| w[0] < w[1]));
        let o = args("").unwrap();
        assert_eq!(o.sizes, s);
        assert_eq!((o.abi, o.window, o.group, o.conns), (None, 8, 1, 1));
        assert_eq!((o.role, o.phases, o.probe), (Role::Local, Phases::BOTH, 0));
        assert!(!o.run_options_given && !o.quiet && !o.stats);
        assert_eq!(o.lib, client::default_library());
    }

    #[test]
    fn script_options_parse() {
        let o = args("--script 256 --window 1 --sizes 8").unwrap();
        assert_eq!(
            (o.script, o.script_idle, o.script_wait_us),
            (Some(256), 1, None)
        );
        let o = args("--script 4 --script-idle 0 --script-wait 500 --script-comms 1024").unwrap();
        assert_eq!(
            (o.script, o.script_idle, o.script_wait_us, o.script_comms),
            (Some(4), 0, Some(500), 1024)
        );
        assert_eq!(args("").unwrap().script, None);
        assert!(error("--script 0").contains("must be in 1..=1000000"));
        assert!(
            error("--script-idle 2").contains("--script"),
            "needs --script"
        );
        for other in ["--listen", "--connect h:1", "--idle-probe 5", "--csv x.csv"] {
            assert_eq!(
                args(&format!("--script 8 {other}")).unwrap_err().kind(),
                ErrorKind::ArgumentConflict,
                "{other}"
            );
        }
    }

    #[test]
    fn options_parse() {
        let o = args("--listen 0 --sizes 8,1M --group 4 --conns 2 --window=4").unwrap();
        assert_eq!(o.role, Role::Listen(0));
        assert_eq!((o.group, o.conns, o.window), (4, 2, 4));
        assert_eq!(o.sizes, vec![8, 1 << 20]);
        assert!(o.run_options_given);
        let o = args("--listen --quiet").unwrap();
        assert_eq!(o.role, Role::Listen(DEFAULT_LISTEN_PORT));
        assert!(o.quiet);
        assert_eq!(
            args("--listen").unwrap().role,
            Role::Listen(DEFAULT_LISTEN_PORT)
        );
        assert_eq!(
            args("--connect h:1").unwrap().role,
            Role::Connect("h:1".into())
        );
        // The last of --listen and --connect wins, as each one sets the role.
        assert_eq!(
            args("--connect h:1 --listen 7").unwrap().role,
            Role::Listen(7)
        );
        assert_eq!(args("--iters 5 --iters 6").unwrap().iters, Some(6));
        assert_eq!(args("--help").unwrap_err().kind(), ErrorKind::DisplayHelp);
        assert_eq!(args("-h").unwrap_err().kind(), ErrorKind::DisplayHelp);
        assert!(error("--group 9").contains("must be in 1..=8, got 9"));
        assert!(error("--window 0").contains("must be in 1..=32, got 0"));
        assert!(error("--conns 65").contains("must be in 1..=64, got 65"));
        assert!(error("--iters 0").contains("must be in 1..=100000000, got 0"));
        assert!(error("--iters x").contains("\"x\" is not a valid number"));
        assert!(error("--abi 3").contains("must be one of [4, 5, 6, 7, 8, 9, 10, 11, 12]"));
        assert!(error("--abi 13").contains("must be one of [4, 5, 6, 7, 8, 9, 10, 11, 12]"));
        assert_eq!(args("--abi 4").unwrap().abi, Some(4));
        assert_eq!(args("--abi 5").unwrap().abi, Some(5));
        assert!(error("--idle-probe 10000001").contains("must be in 0..=10000000"));
        assert!(error("--bytes 0").contains("must be in 1..=1073741824, got 0"));
        assert!(error("--listen=x").contains("bad port \"x\""));
        assert_eq!(
            args("--bogus").unwrap_err().kind(),
            ErrorKind::UnknownArgument
        );
        // vm-tier.sh tells an old binary by this message.
        assert!(error("--bogus").contains("unexpected argument"));
        assert_eq!(args("--cpus 0,1").unwrap().cpus, Some((0, Some(1))));
        assert_eq!(args("--cpus=3").unwrap().cpus, Some((3, None)));
        assert!(error("--cpus x").contains("bad CPU number \"x\""));
        assert_eq!(
            args("--stats --idle-probe 40").unwrap().probe,
            40,
            "the idle probe with the stats"
        );
    }

    #[test]
    fn phases_and_plot_options_parse() {
        let o = args("--phases lat --bytes 24M").unwrap();
        assert_eq!(
            o.phases,
            Phases {
                bw: false,
                lat: true
            }
        );
        assert_eq!(o.bytes, Some(24 << 20));
        assert!(error("--phases x").contains("unknown phase \"x\""));
        assert_eq!(
            args("--plot x.csv").unwrap_err().kind(),
            ErrorKind::MissingRequiredArgument,
            "--plot needs --svg"
        );
        let o = args("--compare a/perftest.csv --compare b.csv=ib_write_bw --svg p.svg").unwrap();
        assert_eq!(
            o.compare,
            vec![
                (PathBuf::from("a/perftest.csv"), "perftest".to_string()),
                (PathBuf::from("b.csv"), "ib_write_bw".to_string())
            ]
        );
        // perf-vm.sh's plot command: labels and notes with spaces and leading dashes.
        let o = Options::try_parse_from([
            "nccl-net-bench",
            "--plot",
            "plugin.csv",
            "--compare",
            "perftest.csv=perftest (ib_write_bw -t 128 / ib_write_lat)",
            "--label",
            "erdma plugin, verbs (window 8)",
            "--svg",
            "perf-vm.svg",
            "--quiet",
            "--title",
            "-- a title",
            "--note",
            "one",
            "--note",
            "two",
        ])
        .unwrap();
        assert_eq!(o.plot, Some(PathBuf::from("plugin.csv")));
        assert_eq!(
            o.compare[0].1,
            "perftest (ib_write_bw -t 128 / ib_write_lat)"
        );
        assert_eq!(o.label.as_deref(), Some("erdma plugin, verbs (window 8)"));
        assert_eq!(o.title.as_deref(), Some("-- a title"));
        assert_eq!(o.notes, vec!["one", "two"]);
        assert!(!o.run_options_given);
    }

    #[test]
    fn help_lists_every_flag() {
        let help = args("--help").unwrap_err().to_string();
        assert!(help.contains("Usage: nccl-net-bench [options]"));
        for flag in [
            "--lib",
            "--abi",
            "--sizes",
            "--iters",
            "--window",
            "--group",
            "--conns",
            "--phases",
            "--bytes",
            "--csv",
            "--svg",
            "--compare",
            "--plot",
            "--title",
            "--label",
            "--note",
            "--stats",
            "--idle-probe",
            "--script",
            "--script-idle",
            "--script-wait",
            "--listen",
            "--connect",
            "--cpus",
            "--quiet",
            "--help",
            "NCCL_NET_BENCH_IDLE",
        ] {
            assert!(help.contains(flag), "--help lacks {flag}");
        }
    }
}
