//! `nccl-net-bench`: drives the built plugin through its C ABI (`dlopen` + one
//! `ncclNetPlugin_vN` table, exactly as NCCL's proxy does, via [`client`]) between two
//! processes, and prints per message size the bandwidth (GB/s) and the latency (us).
//!
//! Roles. One side *listens* (`--listen [PORT]`, side A) and one *connects*
//! (`--connect HOST:PORT`, side B); with neither flag the program runs both on this host: it
//! listens on 127.0.0.1 and spawns itself as the connecting child. The two sides talk over a
//! small text control channel (std TCP, one line per message, every read under a timeout) to
//! agree on the run, swap the plugin's 128-byte handles and step through the sizes. Side A
//! decides the run (sizes, iterations, window, group, connections, transport).
//!
//! Each side listens on the plugin and connects to the peer's handles, polling `connect` and
//! `accept` alternately until every connection is up (never blocking in one), so each side has
//! `conns` send comms to the peer and `conns` receive comms from it.
//!
//! Per size:
//! * bandwidth: A sends, B receives, on every connection at once from one thread (as NCCL's
//!   progress thread does), `window` grouped receives in flight per connection on B (each of
//!   `group` messages) and `window * group` sends in flight per connection on A. Requests are
//!   tested oldest first. B times from its first `irecv` to its last completion; GB/s counts
//!   the payload of all connections (`bytes / 1e9 / s`).
//! * latency: ping-pong on connection 0 (A `isend`, B `irecv` then `isend`, A `irecv`), with
//!   receives posted `window` round trips ahead and each reply sent before the consumed
//!   receive is re-posted, as NCCL's proxy keeps its steps posted; the reported value is the
//!   median round trip (start to start, re-posting included) over two, after a few warm-up
//!   round trips.
//! * data check: the first and the last message of each size and phase carry a pattern that
//!   depends on (size, connection, message) and are checked by the receiver; a mismatch, or a
//!   size reported by `test` that differs from the size sent, fails the run.
//!
//! Buffers are allocated and registered (`regMr`) once per connection for the whole run; the
//! timed loops allocate nothing of their own.

use std::{
    ffi::c_int,
    fmt::Write as _,
    io::{BufRead, BufReader, ErrorKind, Write},
    net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs},
    path::{Path, PathBuf},
    process::{Child, Command, ExitCode},
    time::{Duration, Instant},
};

use nccl_net_erdma::ffi::NCCL_PTR_HOST;
use nccl_net_erdma_tools::client::{self, Code, Net, Opaque, Properties};

/// Result type of this program: errors are messages for the user.
type Res<T> = Result<T, String>;

// ---------------------------------------------------------------------------------------
// Constants

/// Control-channel protocol version (first line from A).
const PROTOCOL: &str = "nccl-net-bench/1";
/// Default ABI version of the table to load.
const DEFAULT_ABI: u32 = 11;
/// Default requests in flight per connection.
const DEFAULT_WINDOW: usize = 8;
/// Default TCP port of `--listen` without a port (perftest's).
const DEFAULT_LISTEN_PORT: u16 = 18515;
/// `NCCL_NET_MAX_REQUESTS`: the most receives a comm must hold in flight.
const MAX_WINDOW: usize = 32;
/// `maxRecvs` of NCCL IB and of this plugin: the largest grouped receive.
const MAX_GROUP: usize = 8;
/// The most connections one run opens.
const MAX_CONNS: usize = 64;
/// Largest message (the plugin's `maxP2pBytes`).
const MAX_SIZE: usize = 1 << 30;
/// How long a control-channel read or write may take.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(60);
/// How long `--listen` waits for its peer to connect.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a data loop (or connection setup) may go without progress.
const STALL_TIMEOUT: Duration = Duration::from_secs(60);
/// Idle polls in a row after which every further idle poll yields the CPU.
const YIELD_AFTER: u32 = 256;
/// Default bandwidth iterations: about this many payload bytes per size (all connections) ...
const BW_BYTES: usize = 512 << 20;
/// ... but at least this many (two windows) ...
const BW_MIN_ITERS: usize = 16;
/// ... and at most this many messages over all connections (small sizes).
const BW_MAX_MSGS: usize = 20_000;
/// Default latency round trips: about this many bytes per direction and size, clamped.
const LAT_BYTES: usize = 64 << 20;
/// Fewest default latency round trips.
const LAT_MIN_ITERS: usize = 10;
/// Most default latency round trips.
const LAT_MAX_ITERS: usize = 2_000;
/// Receive buffers in flight get their own memory up to this many bytes per process (all
/// connections); beyond it in-flight receives share buffers (the checked ones stay private).
const POOL_BYTES: usize = 512 << 20;
/// Most idle calls per side of `--idle-probe`.
const MAX_PROBE: usize = 10_000_000;
/// Pattern streams (part of the seed), so no two phases' patterns coincide.
const STREAM_BW: u64 = 1;
const STREAM_PING: u64 = 2;
const STREAM_PONG: u64 = 3;

const HELP: &str = "\
nccl-net-bench: bandwidth and latency of an NCCL net plugin, driven through its C ABI

usage: nccl-net-bench [options]                  both sides on this host (loopback)
       nccl-net-bench --listen [PORT] [options]  side A: wait for the peer, decide the run
       nccl-net-bench --connect HOST:PORT        side B: run what side A decides

options:
  --lib PATH        plugin library (default: the built libnccl-net-erdma.so)
  --abi N           ncclNetPlugin_vN table to use, 6..11 (default 11)
  --sizes LIST      message sizes, e.g. 8,1K,64K,1M,64M (K/M/G = KiB/MiB/GiB);
                    default powers of 4 from 8 B, and 64 MiB
  --iters N         per size: receives per connection (bandwidth) and round trips
                    (latency); default scales with the size, so each size moves a
                    bounded amount of data in a bounded number of messages
  --window W        receives in flight per connection, 1..32 (default 8); the sender
                    keeps W x group sends in flight
  --group N         messages per grouped receive, 1..8 (default 1)
  --conns K         connections used at once for bandwidth, 1..64 (default 1)
  --phases LIST     what to measure per size: bw, lat or bw,lat (default bw,lat)
  --bytes N         with scaled iterations: about N payload bytes per size for bandwidth
                    (default 512M) and N/4 per direction for latency (default 64M)
  --csv FILE        also write size_bytes,bandwidth_gbps,latency_us to FILE (an empty
                    field for a phase not run)
  --svg FILE        also draw bandwidth and latency against size into FILE (SVG)
  --compare CSV[=LABEL]  add the rows of CSV (the --csv format) to the plot as a reference
                    series named LABEL (default: the file name); may be repeated
  --plot CSV        run nothing: draw CSV (the --csv format) into the --svg file
  --title TEXT      the plot's title (default: transport, device, window, conns)
  --label TEXT      the legend name of this run's series (default: the plugin's name)
  --note TEXT       a line under the plot's title (replaces the default ones); may be
                    repeated
  --stats           print the plugin calls per message of each side (bandwidth phase)
  --idle-probe K    before the sizes, K isend calls that must return NULL (side A) and
                    then K test calls of a receive not yet sent to (side B): the cost of
                    idle calls, for instruction counts (scripts/cpu-cost.sh)
  --listen [PORT]   be side A on control port PORT (default 18515; 0 = any, printed)
  --connect H:P     be side B; its run options come from side A
  --cpus A[,B]      pin this process to CPU A and, in the local run, the child to CPU B
                    (with taskset; helps on small VMs where both may share one CPU)
  --quiet           print nothing but errors
  --help            this text

environment: NCCL_ERDMA_TRANSPORT (unset: try the default, fall back to tcp without an RDMA
device), NCCL_SOCKET_IFNAME (set to lo for the local run when unset), NCCL_NET_BENCH_IDLE
(what a poll loop does once idle for 256 polls: yield (default), spin or sleep), and every
other setting the plugin reads.
";

// ---------------------------------------------------------------------------------------
// Command line

/// Which part of the run this process plays.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Role {
    /// Both sides on this host: side A here, side B a spawned child.
    Local,
    /// Side A, listening on this control port.
    Listen(u16),
    /// Side B, connecting to this control address.
    Connect(String),
}

/// The parsed command line.
#[derive(Debug, Clone)]
struct Options {
    lib: PathBuf,
    abi: u32,
    sizes: Vec<usize>,
    iters: Option<usize>,
    window: usize,
    group: usize,
    conns: usize,
    csv: Option<PathBuf>,
    role: Role,
    quiet: bool,
    /// `--cpus`: CPU of this process, and of the local child.
    cpus: Option<(usize, Option<usize>)>,
    /// Run options given explicitly (ignored with a note on side B).
    run_options_given: bool,
    /// `--phases`.
    phases: Phases,
    /// `--bytes`: per-size payload that scaled iterations aim at.
    bytes: Option<usize>,
    /// `--svg`.
    svg: Option<PathBuf>,
    /// `--compare`: reference series for the plot.
    compare: Vec<(PathBuf, String)>,
    /// `--plot`: draw this CSV instead of running.
    plot: Option<PathBuf>,
    /// `--title`.
    title: Option<String>,
    /// `--label`.
    label: Option<String>,
    /// `--note`s.
    notes: Vec<String>,
    /// `--stats`.
    stats: bool,
    /// `--idle-probe`.
    probe: usize,
}

/// Which measurements run per size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Phases {
    bw: bool,
    lat: bool,
}

impl Phases {
    const BOTH: Phases = Phases {
        bw: true,
        lat: true,
    };

    fn parse(s: &str) -> Res<Self> {
        let mut p = Phases {
            bw: false,
            lat: false,
        };
        for w in s.split(',').map(str::trim).filter(|w| !w.is_empty()) {
            match w {
                "bw" | "bandwidth" => p.bw = true,
                "lat" | "latency" => p.lat = true,
                _ => return Err(format!("--phases: unknown phase {w:?} (bw, lat)")),
            }
        }
        if !(p.bw || p.lat) {
            return Err("--phases needs bw, lat or both".into());
        }
        Ok(p)
    }

    fn encode(&self) -> &'static str {
        match (self.bw, self.lat) {
            (true, true) => "bw,lat",
            (true, false) => "bw",
            _ => "lat",
        }
    }
}

/// Parses `8`, `64K`, `1M`, `2G`, `16KiB`, `4kb` (binary units).
fn parse_size(s: &str) -> Res<usize> {
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
    let v = n
        .checked_mul(1 << shift)
        .filter(|v| *v <= MAX_SIZE)
        .ok_or_else(|| format!("size {t:?} is larger than {MAX_SIZE} bytes (maxP2pBytes)"))?;
    Ok(v)
}

/// Parses a comma-separated size list.
fn parse_sizes(s: &str) -> Res<Vec<usize>> {
    let v = s
        .split(',')
        .filter(|p| !p.trim().is_empty())
        .map(parse_size)
        .collect::<Res<Vec<_>>>()?;
    if v.is_empty() {
        return Err("--sizes needs at least one size".into());
    }
    Ok(v)
}

/// 8 B, 32 B, ... (x4) up to 32 MiB, then 64 MiB.
fn default_sizes() -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = 8usize;
    while s < 64 << 20 {
        v.push(s);
        s *= 4;
    }
    v.push(64 << 20);
    v
}

fn parse_num<T: std::str::FromStr>(flag: &str, v: Option<String>) -> Res<T> {
    let v = v.ok_or_else(|| format!("{flag} needs a value"))?;
    v.parse()
        .map_err(|_| format!("{flag}: {v:?} is not a valid number"))
}

fn in_range(flag: &str, v: usize, lo: usize, hi: usize) -> Res<usize> {
    if (lo..=hi).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{flag} must be in {lo}..={hi}, got {v}"))
    }
}

/// Parses the arguments after the program name; `Ok(None)` for `--help`.
fn parse_args(args: impl IntoIterator<Item = String>) -> Res<Option<Options>> {
    let mut o = Options {
        lib: PathBuf::new(),
        abi: DEFAULT_ABI,
        sizes: default_sizes(),
        iters: None,
        window: DEFAULT_WINDOW,
        group: 1,
        conns: 1,
        csv: None,
        role: Role::Local,
        quiet: false,
        cpus: None,
        run_options_given: false,
        phases: Phases::BOTH,
        bytes: None,
        svg: None,
        compare: Vec::new(),
        plot: None,
        title: None,
        label: None,
        notes: Vec::new(),
        stats: false,
        probe: 0,
    };
    let mut lib = None;
    let mut it = args.into_iter().peekable();
    while let Some(a) = it.next() {
        let (flag, inline) = match a.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (a.clone(), None),
        };
        let value = |it: &mut std::iter::Peekable<_>| inline.clone().or_else(|| it.next());
        match flag.as_str() {
            "--help" | "-h" => return Ok(None),
            "--lib" => lib = Some(PathBuf::from(value(&mut it).ok_or("--lib needs a path")?)),
            "--abi" => {
                o.abi = parse_num("--abi", value(&mut it))?;
                if !client::VERSIONS.contains(&o.abi) {
                    return Err(format!("--abi must be one of {:?}", client::VERSIONS));
                }
            }
            "--sizes" => {
                o.sizes = parse_sizes(&value(&mut it).ok_or("--sizes needs a list")?)?;
                o.run_options_given = true;
            }
            "--iters" => {
                let n = parse_num("--iters", value(&mut it))?;
                o.iters = Some(in_range("--iters", n, 1, 100_000_000)?);
                o.run_options_given = true;
            }
            "--window" => {
                let n = parse_num("--window", value(&mut it))?;
                o.window = in_range("--window", n, 1, MAX_WINDOW)?;
                o.run_options_given = true;
            }
            "--group" => {
                let n = parse_num("--group", value(&mut it))?;
                o.group = in_range("--group", n, 1, MAX_GROUP)?;
                o.run_options_given = true;
            }
            "--conns" => {
                let n = parse_num("--conns", value(&mut it))?;
                o.conns = in_range("--conns", n, 1, MAX_CONNS)?;
                o.run_options_given = true;
            }
            "--csv" => o.csv = Some(PathBuf::from(value(&mut it).ok_or("--csv needs a file")?)),
            "--phases" => {
                o.phases = Phases::parse(&value(&mut it).ok_or("--phases needs a list")?)?;
                o.run_options_given = true;
            }
            "--bytes" => {
                let b = parse_size(&value(&mut it).ok_or("--bytes needs a size")?)?;
                o.bytes = Some(in_range("--bytes", b, 1, MAX_SIZE)?);
                o.run_options_given = true;
            }
            "--svg" => o.svg = Some(PathBuf::from(value(&mut it).ok_or("--svg needs a file")?)),
            "--compare" => {
                let v = value(&mut it).ok_or("--compare needs CSV[=LABEL]")?;
                let (file, label) = match v.split_once('=') {
                    Some((f, l)) => (f.to_string(), l.to_string()),
                    None => {
                        let name = Path::new(&v)
                            .file_stem()
                            .map_or_else(|| v.clone(), |n| n.to_string_lossy().into_owned());
                        (v.clone(), name)
                    }
                };
                o.compare.push((PathBuf::from(file), label));
            }
            "--plot" => o.plot = Some(PathBuf::from(value(&mut it).ok_or("--plot needs a CSV")?)),
            "--title" => o.title = Some(value(&mut it).ok_or("--title needs a text")?),
            "--label" => o.label = Some(value(&mut it).ok_or("--label needs a text")?),
            "--note" => o.notes.push(value(&mut it).ok_or("--note needs a text")?),
            "--stats" => o.stats = true,
            "--idle-probe" => {
                let n = parse_num("--idle-probe", value(&mut it))?;
                o.probe = in_range("--idle-probe", n, 0, MAX_PROBE)?;
                o.run_options_given = true;
            }
            "--listen" => {
                let port = match inline.clone() {
                    Some(p) => Some(p),
                    None if it.peek().is_some_and(|p| p.parse::<u16>().is_ok()) => it.next(),
                    None => None,
                };
                o.role = Role::Listen(match port {
                    Some(p) => p.parse().map_err(|_| format!("--listen: bad port {p:?}"))?,
                    None => DEFAULT_LISTEN_PORT,
                });
            }
            "--connect" => {
                o.role = Role::Connect(value(&mut it).ok_or("--connect needs HOST:PORT")?);
            }
            "--quiet" => o.quiet = true,
            "--cpus" => {
                let v = value(&mut it).ok_or("--cpus needs A or A,B")?;
                let cpu = |c: &str| {
                    c.trim()
                        .parse::<usize>()
                        .map_err(|_| format!("--cpus: bad CPU number {c:?}"))
                };
                o.cpus = Some(match v.split_once(',') {
                    Some((a, b)) => (cpu(a)?, Some(cpu(b)?)),
                    None => (cpu(&v)?, None),
                });
            }
            _ => return Err(format!("unknown argument {a:?} (see --help)")),
        }
    }
    o.lib = lib.unwrap_or_else(client::default_library);
    if o.plot.is_some() && o.svg.is_none() {
        return Err("--plot needs --svg FILE (where to draw)".into());
    }
    Ok(Some(o))
}

/// Bandwidth iterations (grouped receives per connection) for `size`: by default about
/// `bytes` ([`BW_BYTES`]) and at most [`BW_MAX_MSGS`] messages over all connections, at
/// least [`BW_MIN_ITERS`].
fn bw_iters(
    size: usize,
    group: usize,
    conns: usize,
    iters: Option<usize>,
    bytes: Option<usize>,
) -> usize {
    iters.unwrap_or_else(|| {
        let per_iter = group * conns;
        let most = (BW_MAX_MSGS / per_iter).max(BW_MIN_ITERS);
        (bytes.unwrap_or(BW_BYTES) / (size * per_iter).max(1)).clamp(BW_MIN_ITERS, most)
    })
}

/// Latency round trips for `size` (warm-up not included): about `bytes / 4`
/// ([`LAT_BYTES`]) per direction, clamped.
fn lat_iters(size: usize, iters: Option<usize>, bytes: Option<usize>) -> usize {
    iters.unwrap_or_else(|| {
        let bytes = bytes.map_or(LAT_BYTES, |b| b / 4);
        (bytes / size.max(1)).clamp(LAT_MIN_ITERS, LAT_MAX_ITERS)
    })
}

/// Untimed round trips before the timed ones.
fn lat_warmup(iters: usize) -> usize {
    (iters / 10).clamp(1, 50)
}

// ---------------------------------------------------------------------------------------
// The run as both sides agree on it

/// One size of the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SizePlan {
    size: usize,
    bw_iters: usize,
    lat_iters: usize,
}

/// What side A decides and sends to side B.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Params {
    window: usize,
    group: usize,
    conns: usize,
    /// `--iters` of side A, if given (else iterations scale with the size).
    iters: Option<usize>,
    /// What runs per size.
    phases: Phases,
    /// `--idle-probe`: idle calls per side before the sizes (0: none).
    probe: usize,
    transport: String,
    plan: Vec<SizePlan>,
}

impl Params {
    fn from_options(o: &Options, transport: &str) -> Self {
        Params {
            window: o.window,
            group: o.group,
            conns: o.conns,
            iters: o.iters,
            phases: o.phases,
            probe: o.probe,
            transport: transport.to_string(),
            plan: o
                .sizes
                .iter()
                .map(|&size| SizePlan {
                    size,
                    bw_iters: bw_iters(size, o.group, o.conns, o.iters, o.bytes),
                    lat_iters: lat_iters(size, o.iters, o.bytes),
                })
                .collect(),
        }
    }

    /// Receive slots per connection for `size`: one per receive in flight, within
    /// [`POOL_BYTES`] over all connections.
    fn pool(&self, size: usize) -> usize {
        let in_flight = self.window * self.group;
        (POOL_BYTES / self.conns / Layout::stride(size)).clamp(1, in_flight)
    }

    /// Where the bandwidth phase of `size` puts its messages.
    fn layout(&self, plan: &SizePlan) -> Layout {
        Layout::new(plan.size, self.pool(plan.size), plan.bw_iters * self.group)
    }

    /// Bytes of the (send, receive) buffers of one connection: enough for every size.
    fn arena_bytes(&self) -> (usize, usize) {
        self.plan.iter().fold((64, 64), |(tx, rx), s| {
            let l = self.layout(s);
            (tx.max(l.send_bytes()), rx.max(l.recv_bytes()))
        })
    }

    /// Errors when `processes` processes of this run would not fit in this host's memory.
    fn check_memory(&self, processes: usize) -> Res<()> {
        let (tx, rx) = self.arena_bytes();
        let need = self.conns * (tx + rx) * processes;
        let avail = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
            let line = m.lines().find(|l| l.starts_with("MemAvailable:"))?;
            let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib << 10)
        });
        match avail {
            Some(avail) if need > avail / 4 * 3 => Err(format!(
                "the buffers of this run need {} MiB ({} connection(s) x {} MiB, {processes} \
                 process(es)) but only {} MiB of memory is available: use fewer --conns or a \
                 smaller largest size",
                need >> 20,
                self.conns,
                (tx + rx) >> 20,
                avail >> 20
            )),
            _ => Ok(()),
        }
    }

    fn encode(&self) -> String {
        let plan: Vec<String> = self
            .plan
            .iter()
            .map(|p| format!("{}:{}:{}", p.size, p.bw_iters, p.lat_iters))
            .collect();
        format!(
            "params window={} group={} conns={} iters={} phases={} probe={} transport={} plan={}",
            self.window,
            self.group,
            self.conns,
            self.iters.map_or("scaled".into(), |n| n.to_string()),
            self.phases.encode(),
            self.probe,
            self.transport,
            plan.join(",")
        )
    }

    fn decode(line: &str) -> Res<Self> {
        let bad = || format!("bad params line from the peer: {line:?}");
        let mut p = Params {
            window: 0,
            group: 0,
            conns: 0,
            iters: None,
            phases: Phases::BOTH,
            probe: 0,
            transport: String::new(),
            plan: Vec::new(),
        };
        let mut words = line.split_whitespace();
        if words.next() != Some("params") {
            return Err(bad());
        }
        for w in words {
            let (k, v) = w.split_once('=').ok_or_else(bad)?;
            match k {
                "window" => p.window = v.parse().map_err(|_| bad())?,
                "group" => p.group = v.parse().map_err(|_| bad())?,
                "conns" => p.conns = v.parse().map_err(|_| bad())?,
                "iters" if v == "scaled" => p.iters = None,
                "iters" => p.iters = Some(v.parse().map_err(|_| bad())?),
                "phases" => p.phases = Phases::parse(v).map_err(|_| bad())?,
                "probe" => p.probe = v.parse().map_err(|_| bad())?,
                "transport" => p.transport = v.to_string(),
                "plan" => {
                    for e in v.split(',') {
                        let n: Vec<usize> = e
                            .split(':')
                            .map(|x| x.parse().map_err(|_| bad()))
                            .collect::<Res<_>>()?;
                        let [size, bw_iters, lat_iters] = n[..] else {
                            return Err(bad());
                        };
                        p.plan.push(SizePlan {
                            size,
                            bw_iters,
                            lat_iters,
                        });
                    }
                }
                _ => {}
            }
        }
        let ok = p.probe <= MAX_PROBE
            && (1..=MAX_WINDOW).contains(&p.window)
            && (1..=MAX_GROUP).contains(&p.group)
            && (1..=MAX_CONNS).contains(&p.conns)
            && !p.transport.is_empty()
            && !p.plan.is_empty()
            && p.plan
                .iter()
                .all(|s| s.size <= MAX_SIZE && s.bw_iters >= 1 && s.lat_iters >= 1);
        if ok {
            Ok(p)
        } else {
            Err(bad())
        }
    }
}

// ---------------------------------------------------------------------------------------
// Control channel

/// The line-based control connection to the peer.
struct Control {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    line: String,
}

impl Control {
    fn new(stream: TcpStream) -> Res<Self> {
        let setup = |s: &TcpStream| -> std::io::Result<()> {
            s.set_nonblocking(false)?;
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(CONTROL_TIMEOUT))?;
            s.set_write_timeout(Some(CONTROL_TIMEOUT))
        };
        setup(&stream).map_err(|e| format!("control connection: {e}"))?;
        let writer = stream
            .try_clone()
            .map_err(|e| format!("control connection: {e}"))?;
        Ok(Control {
            reader: BufReader::new(stream),
            writer,
            line: String::new(),
        })
    }

    fn send(&mut self, line: &str) -> Res<()> {
        let mut buf = String::with_capacity(line.len() + 1);
        buf.push_str(line);
        buf.push('\n');
        self.writer
            .write_all(buf.as_bytes())
            .map_err(|e| format!("control channel: sending to the peer failed: {e}"))
    }

    /// The next line; an `error ...` line from the peer becomes an error.
    fn recv(&mut self) -> Res<&str> {
        self.line.clear();
        match self.reader.read_line(&mut self.line) {
            Ok(0) => Err("control channel: the peer closed the connection".into()),
            Ok(_) => {
                let l = self.line.trim_end();
                match l.strip_prefix("error ") {
                    Some(msg) => Err(format!("the peer failed: {msg}")),
                    None => Ok(l),
                }
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                Err(format!(
                    "control channel: no word from the peer in {} s",
                    CONTROL_TIMEOUT.as_secs()
                ))
            }
            Err(e) => Err(format!("control channel: {e}")),
        }
    }

    /// The next line, which must start with `word`; returns the rest.
    fn expect(&mut self, word: &str) -> Res<String> {
        let l = self.recv()?;
        match l.split_once(' ') {
            Some((w, rest)) if w == word => Ok(rest.to_string()),
            None if l == word => Ok(String::new()),
            _ => Err(format!(
                "control channel: expected {word:?} from the peer, got {l:?}"
            )),
        }
    }
}

/// `key=value` from a space-separated line.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

fn hex(bytes: &[u8]) -> String {
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

fn unhex(s: &str) -> Res<[u8; 128]> {
    let mut out = [0u8; 128];
    if s.len() != 256 || !s.is_ascii() {
        return Err(format!("bad handle from the peer: {s:?}"));
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16)
            .map_err(|_| format!("bad handle from the peer: {s:?}"))?;
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------
// Plugin calls

/// Turns a plugin result code into a message naming the call.
trait PluginResult<T> {
    fn call(self, what: impl FnOnce() -> String) -> Res<T>;
}

impl<T> PluginResult<T> for Result<T, Code> {
    fn call(self, what: impl FnOnce() -> String) -> Res<T> {
        self.map_err(|code| {
            format!(
                "plugin call {} failed: {code:?} (ncclResult_t {})",
                what(),
                code as i32
            )
        })
    }
}

/// The loaded, initialised plugin.
struct Plugin {
    net: Net,
    props: Properties,
    /// `tcp` or `verbs`.
    transport: String,
    /// Why, when this program chose the transport.
    transport_note: Option<String>,
}

const TRANSPORT_ENV: &str = "NCCL_ERDMA_TRANSPORT";

fn set_env(key: &str, value: &str) {
    // Single-threaded here (before any thread is started), and the plugin reads its
    // environment only inside `init`, after this.
    std::env::set_var(key, value);
}

/// The plugin's last WARN line (why a call failed), or a placeholder.
fn last_warning() -> String {
    client::logged_lines()
        .iter()
        .rev()
        .find(|l| l.level <= nccl_net_erdma::ffi::NCCL_LOG_WARN)
        .map_or_else(|| "the plugin logged no warning".into(), |l| l.text.clone())
}

/// Opens the library, `init`s it (falling back to tcp when the default transport has no
/// device and the user did not choose one) and reads device 0. `want` is side A's transport,
/// which side B adopts when its own environment does not choose.
fn open_plugin(o: &Options, want: Option<&str>) -> Res<Plugin> {
    let mut net = Net::open(&o.lib, o.abi)?;
    let mut note = None;
    match (std::env::var(TRANSPORT_ENV).ok(), want) {
        (Some(_), _) => net.init().call(|| format!("init ({})", last_warning()))?,
        (None, Some(t)) => {
            set_env(TRANSPORT_ENV, t);
            net.init().call(|| {
                format!(
                    "init ({TRANSPORT_ENV}={t}, as the peer: {})",
                    last_warning()
                )
            })?;
            note = Some(format!("as the peer; {TRANSPORT_ENV} unset"));
        }
        (None, None) => {
            let quiet = std::env::var_os("NCCL_NET_CLIENT_QUIET").is_some();
            set_env("NCCL_NET_CLIENT_QUIET", "1");
            let first = net.init();
            if !quiet {
                std::env::remove_var("NCCL_NET_CLIENT_QUIET");
            }
            if first.is_err() {
                let why = last_warning();
                if !o.quiet {
                    println!("no usable RDMA device: running over tcp");
                    println!("  (init with the default transport failed: {why})");
                }
                set_env(TRANSPORT_ENV, "tcp");
                net.init()
                    .call(|| format!("init ({TRANSPORT_ENV}=tcp: {})", last_warning()))?;
                note = Some("no usable RDMA device".into());
            }
        }
    }
    let n = net.devices().call(|| "devices".into())?;
    if n < 1 {
        return Err(format!("the plugin reports {n} devices"));
    }
    let props = net.properties(0).call(|| "getProperties(0)".into())?;
    let env = std::env::var(TRANSPORT_ENV).unwrap_or_else(|_| "verbs".into());
    let transport = match env.as_str() {
        "tcp" | "verbs" => env,
        // auto: the tcp transport names its devices erdma-tcp-<ifname>.
        _ if props.name.starts_with("erdma-tcp-") => "tcp".into(),
        _ => "verbs".into(),
    };
    Ok(Plugin {
        net,
        props,
        transport,
        transport_note: note,
    })
}

// ---------------------------------------------------------------------------------------
// Buffers and patterns

/// One registered allocation, carved into slots per size.
struct Arena {
    buf: Vec<u8>,
    mh: Opaque,
}

impl Arena {
    fn new(len: usize) -> Self {
        // Non-zero fill: touches every page now, not in the first timed loop.
        Arena {
            buf: vec![0xa5; len.max(64)],
            mh: Opaque::NULL,
        }
    }

    /// Pointer to slot `i` of `layout` (derived afresh from the vector each time).
    fn slot_ptr(&mut self, layout: &Layout, i: usize) -> *mut u8 {
        self.buf.as_mut_ptr().wrapping_add(i * layout.stride)
    }

    fn slot(&mut self, layout: &Layout, i: usize) -> &mut [u8] {
        let at = i * layout.stride;
        &mut self.buf[at..at + layout.size]
    }
}

/// Where the messages of one size live. Slots 0 and 1 hold the checked first and last
/// message; send slot 2 holds every other send; receive slots 2.. are the receive pool.
#[derive(Debug, Clone, Copy)]
struct Layout {
    size: usize,
    stride: usize,
    pool: usize,
    /// Messages per connection (bandwidth phase).
    total: usize,
}

impl Layout {
    /// Slot distance for `size`: 64-byte aligned, never 0.
    fn stride(size: usize) -> usize {
        size.div_ceil(64).max(1) * 64
    }

    /// `pool` receive slots; `total` messages per connection.
    fn new(size: usize, pool: usize, total: usize) -> Self {
        Layout {
            size,
            stride: Self::stride(size),
            pool: pool.max(1),
            total,
        }
    }

    fn recv_bytes(&self) -> usize {
        (2 + self.pool) * self.stride
    }

    fn send_bytes(&self) -> usize {
        3 * self.stride
    }

    fn send_slot(&self, m: usize) -> usize {
        if m == 0 {
            0
        } else if m + 1 == self.total {
            1
        } else {
            2
        }
    }

    fn recv_slot(&self, m: usize) -> usize {
        if m == 0 {
            0
        } else if m + 1 == self.total {
            1
        } else {
            2 + m % self.pool
        }
    }
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Seed of the pattern of message `msg` of `size` on connection `conn` in `stream`.
fn seed(size: usize, stream: u64, conn: usize, msg: usize) -> u64 {
    splitmix(splitmix(splitmix(size as u64 ^ (stream << 56)) ^ conn as u64) ^ msg as u64)
}

fn fill(buf: &mut [u8], seed: u64) {
    for (i, c) in buf.chunks_mut(8).enumerate() {
        let w = splitmix(seed ^ i as u64).to_le_bytes();
        c.copy_from_slice(&w[..c.len()]);
    }
}

/// First byte that differs from the pattern: (offset, got, expected).
fn mismatch(buf: &[u8], seed: u64) -> Option<(usize, u8, u8)> {
    buf.chunks(8).enumerate().find_map(|(i, c)| {
        let w = splitmix(seed ^ i as u64).to_le_bytes();
        c.iter()
            .zip(w)
            .position(|(a, b)| *a != b)
            .map(|j| (i * 8 + j, c[j], w[j]))
    })
}

fn check_pattern(buf: &[u8], seed: u64, what: impl FnOnce() -> String) -> Res<()> {
    match mismatch(buf, seed) {
        None => Ok(()),
        Some((at, got, want)) => Err(format!(
            "data mismatch in {}: byte {at} is {got:#04x}, expected {want:#04x}",
            what()
        )),
    }
}

// ---------------------------------------------------------------------------------------
// Connections

/// One connection pair to the peer: our send comm and the receive comm from the same index
/// of the peer.
struct Conn {
    send: Opaque,
    recv: Opaque,
    tx: Arena,
    rx: Arena,
}

/// Per-connection progress of one data loop.
#[derive(Debug, Clone, Copy, Default)]
struct Progress {
    posted: usize,
    done: usize,
}

/// What an idle poll does after [`YIELD_AFTER`] idle polls in a row
/// (`NCCL_NET_BENCH_IDLE`, inherited by the local child).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IdlePolicy {
    /// `sched_yield` (the default).
    Yield,
    /// Keep polling (as perftest does).
    Spin,
    /// Sleep [`IDLE_SLEEP`] (lets the CPU go idle, e.g. for the kernel's soft RoCE work).
    Sleep,
}

/// The sleep of [`IdlePolicy::Sleep`].
const IDLE_SLEEP: Duration = Duration::from_micros(20);
const IDLE_ENV: &str = "NCCL_NET_BENCH_IDLE";

fn parse_idle(v: Option<&str>) -> Res<IdlePolicy> {
    match v {
        None | Some("" | "yield") => Ok(IdlePolicy::Yield),
        Some("spin") => Ok(IdlePolicy::Spin),
        Some("sleep") => Ok(IdlePolicy::Sleep),
        Some(v) => Err(format!("{IDLE_ENV}={v:?}: expected yield, spin or sleep")),
    }
}

/// The idle policy of this process, read once (checked in `main`).
fn idle_policy() -> IdlePolicy {
    static POLICY: std::sync::OnceLock<IdlePolicy> = std::sync::OnceLock::new();
    *POLICY.get_or_init(|| {
        parse_idle(std::env::var(IDLE_ENV).ok().as_deref()).unwrap_or(IdlePolicy::Yield)
    })
}

/// Stall detection for polling loops, cheap enough for the timed loops: the clock is read
/// only every 1024 idle polls (in a VM without a TSC clocksource a read costs about 1 us,
/// which would otherwise sit on the latency path of every call).
struct Watchdog {
    /// When progress was last seen, set at the first clock read.
    last: Option<Instant>,
    spins: u32,
}

impl Watchdog {
    fn new() -> Self {
        Watchdog {
            last: None,
            spins: 0,
        }
    }

    fn progressed(&mut self) {
        self.spins = 0;
        self.last = None;
    }

    /// Call once per idle poll; errors after [`STALL_TIMEOUT`] without progress.
    fn idle(&mut self, what: impl FnOnce() -> String) -> Res<()> {
        self.spins = self.spins.wrapping_add(1);
        if self.spins % 1024 == 0 {
            let last = *self.last.get_or_insert_with(Instant::now);
            if last.elapsed() > STALL_TIMEOUT {
                return Err(format!(
                    "no progress for {} s: {} (the plugin stalls)",
                    STALL_TIMEOUT.as_secs(),
                    what()
                ));
            }
        }
        // Idle for a while: let the peer run if it shares our CPU (NCCL's progress thread
        // yields when idle too).
        if self.spins >= YIELD_AFTER {
            match idle_policy() {
                IdlePolicy::Yield => std::thread::yield_now(),
                IdlePolicy::Spin => std::hint::spin_loop(),
                IdlePolicy::Sleep => std::thread::sleep(IDLE_SLEEP),
            }
        }
        Ok(())
    }
}

/// Which side of the run this process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    /// Listens, decides, sends the bandwidth stream, starts the ping-pong.
    A,
    /// Connects, receives the bandwidth stream, answers the ping-pong.
    B,
}

/// Sets up `params.conns` connections each way and registers their buffers.
fn connect_all(p: &Plugin, ctl: &mut Control, params: &Params) -> Res<Vec<Conn>> {
    let net = &p.net;
    let mut listens = Vec::with_capacity(params.conns);
    let mut ours = Vec::with_capacity(params.conns);
    for k in 0..params.conns {
        let mut h = [0u8; 128];
        listens.push(
            net.listen(0, &mut h)
                .call(|| format!("listen (connection {k})"))?,
        );
        ours.push(hex(&h));
    }
    ctl.send(&format!("handles {}", ours.join(",")))?;
    let theirs = ctl.expect("handles")?;
    let mut handles = theirs.split(',').map(unhex).collect::<Res<Vec<_>>>()?;
    if handles.len() != params.conns {
        return Err(format!(
            "the peer sent {} handles, expected {}",
            handles.len(),
            params.conns
        ));
    }
    // NCCL's service thread polls both stage machines round-robin; so do we.
    let mut sends = vec![Opaque::NULL; params.conns];
    let mut recvs = vec![Opaque::NULL; params.conns];
    let mut dog = Watchdog::new();
    while sends.iter().chain(&recvs).any(Opaque::is_null) {
        let mut progressed = false;
        for k in 0..params.conns {
            if sends[k].is_null() {
                sends[k] = net
                    .connect(0, &mut handles[k])
                    .call(|| format!("connect (connection {k})"))?;
                progressed |= !sends[k].is_null();
            }
            if recvs[k].is_null() {
                recvs[k] = net
                    .accept(listens[k])
                    .call(|| format!("accept (connection {k})"))?;
                progressed |= !recvs[k].is_null();
            }
        }
        if progressed {
            dog.progressed();
        } else {
            dog.idle(|| "connect/accept did not complete".into())?;
        }
    }
    for (k, l) in listens.into_iter().enumerate() {
        net.close_listen(l)
            .call(|| format!("closeListen (connection {k})"))?;
    }
    let (tx_len, rx_len) = params.arena_bytes();
    let mut conns = Vec::with_capacity(params.conns);
    for (k, (send, recv)) in sends.into_iter().zip(recvs).enumerate() {
        let mut c = Conn {
            send,
            recv,
            tx: Arena::new(tx_len),
            rx: Arena::new(rx_len),
        };
        let ptr_type = NCCL_PTR_HOST as i32;
        let (ptr, len) = (c.tx.buf.as_mut_ptr(), c.tx.buf.len());
        c.tx.mh = net
            .reg_mr(send, ptr, len, ptr_type)
            .call(|| format!("regMr of {len} bytes on send comm {k}"))?;
        let (ptr, len) = (c.rx.buf.as_mut_ptr(), c.rx.buf.len());
        c.rx.mh = net
            .reg_mr(recv, ptr, len, ptr_type)
            .call(|| format!("regMr of {len} bytes on receive comm {k}"))?;
        conns.push(c);
    }
    Ok(conns)
}

fn close_all(net: &Net, conns: Vec<Conn>) -> Res<()> {
    for (k, c) in conns.into_iter().enumerate() {
        net.dereg_mr(c.send, c.tx.mh)
            .call(|| format!("deregMr (send comm {k})"))?;
        net.dereg_mr(c.recv, c.rx.mh)
            .call(|| format!("deregMr (receive comm {k})"))?;
        net.close_send(c.send)
            .call(|| format!("closeSend (connection {k})"))?;
        net.close_recv(c.recv)
            .call(|| format!("closeRecv (connection {k})"))?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Data loops

/// Plugin calls of one side's bandwidth phase (`--stats`): the posts (`isend` or `irecv`)
/// and how many of them the plugin answered "not now" (NULL), the `test`s and how many of
/// them found the request not done yet.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Calls {
    posts: u64,
    posts_null: u64,
    tests: u64,
    tests_idle: u64,
}

impl Calls {
    fn encode(&self) -> String {
        format!(
            "{} {} {} {}",
            self.posts, self.posts_null, self.tests, self.tests_idle
        )
    }

    fn decode<'a>(mut w: impl Iterator<Item = &'a str>) -> Option<Self> {
        let mut next = || w.next()?.parse().ok();
        Some(Calls {
            posts: next()?,
            posts_null: next()?,
            tests: next()?,
            tests_idle: next()?,
        })
    }

    /// One `stats` line: calls per message of `msgs` messages.
    fn line(&self, size: usize, side: &str, post: &str, msgs: usize) -> String {
        let per = |n: u64| n as f64 / msgs.max(1) as f64;
        format!(
            "stats size={size} side={side} messages={msgs} {post}={} {post}_null={} test={} \
             test_idle={} per_message: {post} {:.3} (NULL {:.3}), test {:.3} (idle {:.3})",
            self.posts,
            self.posts_null,
            self.tests,
            self.tests_idle,
            per(self.posts),
            per(self.posts_null),
            per(self.tests),
            per(self.tests_idle)
        )
    }
}

/// Preallocated state of the data loops, reused for every size.
struct Scratch {
    /// Per connection, a ring of `window * group` requests in flight.
    rings: Vec<Vec<Opaque>>,
    progress: Vec<Progress>,
    samples: Vec<u64>,
    /// This side's calls in the last bandwidth phase.
    calls: Calls,
}

impl Scratch {
    fn new(params: &Params) -> Self {
        let cap = params.window * params.group;
        let most = params.plan.iter().map(|s| s.lat_iters).max().unwrap_or(1);
        Scratch {
            rings: vec![vec![Opaque::NULL; cap]; params.conns],
            progress: vec![Progress::default(); params.conns],
            samples: Vec::with_capacity(most),
            calls: Calls::default(),
        }
    }
}

/// Side A of the bandwidth phase: `plan.bw_iters * group` sends per connection. Never
/// inlined: `scripts/cpu-cost.sh` counts instructions inside it with callgrind's
/// `--toggle-collect`.
#[inline(never)]
fn bw_send(
    net: &Net,
    conns: &mut [Conn],
    s: &mut Scratch,
    params: &Params,
    plan: &SizePlan,
) -> Res<()> {
    let cap = params.window * params.group;
    let layout = params.layout(plan);
    let total = layout.total;
    for (k, c) in conns.iter_mut().enumerate() {
        fill(c.tx.slot(&layout, 0), seed(plan.size, STREAM_BW, k, 0));
        fill(
            c.tx.slot(&layout, 1),
            seed(plan.size, STREAM_BW, k, total - 1),
        );
    }
    // Raw pointers only after the last use of the buffers as slices.
    let ptrs: Vec<[*mut u8; 3]> = conns
        .iter_mut()
        .map(|c| std::array::from_fn(|i| c.tx.slot_ptr(&layout, i)))
        .collect();
    s.progress.fill(Progress::default());
    s.calls = Calls::default();
    let mut sizes = [0 as c_int; 64];
    let mut left = conns.len();
    let mut dog = Watchdog::new();
    while left > 0 {
        let mut progressed = false;
        for (k, c) in conns.iter().enumerate() {
            let st = &mut s.progress[k];
            let ring = &mut s.rings[k];
            if st.done == total {
                continue;
            }
            while st.posted < total && st.posted - st.done < cap {
                let m = st.posted;
                let tag = (m % params.group) as i32;
                let ptr = ptrs[k][layout.send_slot(m)];
                let r = net
                    .isend(c.send, ptr, plan.size, tag, c.tx.mh)
                    .call(|| format!("isend (size {}, connection {k}, message {m})", plan.size))?;
                s.calls.posts += 1;
                if r.is_null() {
                    s.calls.posts_null += 1;
                    break;
                }
                ring[m % cap] = r;
                st.posted += 1;
                progressed = true;
            }
            while st.done < st.posted {
                let m = st.done;
                sizes[0] = -1;
                let done = net.test(ring[m % cap], Some(&mut sizes[..1])).call(|| {
                    format!(
                        "test of isend (size {}, connection {k}, message {m})",
                        plan.size
                    )
                })?;
                s.calls.tests += 1;
                if !done {
                    s.calls.tests_idle += 1;
                    break;
                }
                if sizes[0] as usize != plan.size {
                    return Err(format!(
                        "test of isend (size {}, connection {k}, message {m}) reported size {}",
                        plan.size, sizes[0]
                    ));
                }
                st.done += 1;
                progressed = true;
                if st.done == total {
                    left -= 1;
                }
            }
        }
        if progressed {
            dog.progressed();
        } else {
            dog.idle(|| {
                format!(
                    "bandwidth sends of size {}: {}",
                    plan.size,
                    progress_text(&s.progress, total)
                )
            })?;
        }
    }
    Ok(())
}

fn progress_text(p: &[Progress], total: usize) -> String {
    p.iter()
        .enumerate()
        .map(|(k, p)| {
            format!(
                "connection {k}: {} posted, {} done of {total}",
                p.posted, p.done
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Posts one receive of `n` buffers with tags `0..n`. Every argument array lives on the
/// stack, and the client's `irecv_signed` builds its C arrays on the stack too (its
/// `irecv` would allocate a vector per call), so the timed loops allocate nothing.
fn irecv_group(
    net: &Net,
    comm: Opaque,
    bufs: &[*mut u8; MAX_GROUP],
    n: usize,
    size: usize,
    mh: Opaque,
) -> Result<Opaque, Code> {
    const TAGS: [i32; MAX_GROUP] = [0, 1, 2, 3, 4, 5, 6, 7];
    // Sizes are at most MAX_SIZE (1 GiB), so they fit an i64.
    let spans: [(*mut u8, i64); MAX_GROUP] = std::array::from_fn(|e| (bufs[e], size as i64));
    let mhs = [mh; MAX_GROUP];
    net.irecv_signed(comm, &spans[..n], &TAGS[..n], &mhs[..n], false)
}

/// Side B of the bandwidth phase: `plan.bw_iters` grouped receives per connection. Returns
/// the time from the first `irecv` to the last completion. Never inlined (as `bw_send`).
#[inline(never)]
fn bw_recv(
    net: &Net,
    conns: &mut [Conn],
    s: &mut Scratch,
    params: &Params,
    plan: &SizePlan,
) -> Res<Duration> {
    let (window, group) = (params.window, params.group);
    let layout = params.layout(plan);
    let total = plan.bw_iters;
    for c in conns.iter_mut() {
        c.rx.slot(&layout, 0).fill(0x5a);
        c.rx.slot(&layout, 1).fill(0x5a);
    }
    let bases: Vec<*mut u8> = conns
        .iter_mut()
        .map(|c| c.rx.slot_ptr(&layout, 0))
        .collect();
    s.progress.fill(Progress::default());
    s.calls = Calls::default();
    let mut sizes = [0 as c_int; 64];
    let mut bufs = [std::ptr::null_mut::<u8>(); MAX_GROUP];
    let mut left = conns.len();
    let mut dog = Watchdog::new();
    let start = Instant::now();
    while left > 0 {
        let mut progressed = false;
        for (k, c) in conns.iter().enumerate() {
            let st = &mut s.progress[k];
            let ring = &mut s.rings[k];
            if st.done == total {
                continue;
            }
            while st.posted < total && st.posted - st.done < window {
                let i = st.posted;
                for (e, b) in bufs.iter_mut().enumerate().take(group) {
                    *b = bases[k].wrapping_add(layout.recv_slot(i * group + e) * layout.stride);
                }
                let r = irecv_group(net, c.recv, &bufs, group, plan.size, c.rx.mh)
                    .call(|| format!("irecv (size {}, connection {k}, receive {i})", plan.size))?;
                s.calls.posts += 1;
                if r.is_null() {
                    s.calls.posts_null += 1;
                    break;
                }
                ring[i % window] = r;
                st.posted += 1;
                progressed = true;
            }
            while st.done < st.posted {
                let i = st.done;
                sizes[..group].fill(-1);
                let done = net.test(ring[i % window], Some(&mut sizes[..])).call(|| {
                    format!(
                        "test of irecv (size {}, connection {k}, receive {i})",
                        plan.size
                    )
                })?;
                s.calls.tests += 1;
                if !done {
                    s.calls.tests_idle += 1;
                    break;
                }
                if let Some(e) = sizes[..group].iter().position(|&z| z as usize != plan.size) {
                    return Err(format!(
                        "test of irecv (size {}, connection {k}, receive {i}) reported size {} \
                         for message {e} of {group}",
                        plan.size, sizes[e]
                    ));
                }
                st.done += 1;
                progressed = true;
                if st.done == total {
                    left -= 1;
                }
            }
        }
        if progressed {
            dog.progressed();
        } else {
            dog.idle(|| {
                format!(
                    "bandwidth receives of size {}: {}",
                    plan.size,
                    progress_text(&s.progress, total)
                )
            })?;
        }
    }
    let elapsed = start.elapsed();
    for (k, c) in conns.iter_mut().enumerate() {
        let last = layout.total - 1;
        check_pattern(
            c.rx.slot(&layout, 0),
            seed(plan.size, STREAM_BW, k, 0),
            || format!("size {} connection {k} message 0 (bandwidth)", plan.size),
        )?;
        if last > 0 {
            check_pattern(
                c.rx.slot(&layout, 1),
                seed(plan.size, STREAM_BW, k, last),
                || {
                    format!(
                        "size {} connection {k} message {last} (bandwidth)",
                        plan.size
                    )
                },
            )?;
        }
    }
    Ok(elapsed)
}

/// Waits for one request; `what` names it in errors.
fn wait(net: &Net, req: Opaque, size: usize, what: &dyn Fn() -> String) -> Res<()> {
    let mut sizes = [0 as c_int; 64];
    let mut dog = Watchdog::new();
    loop {
        sizes[0] = -1;
        if net
            .test(req, Some(&mut sizes[..]))
            .call(|| format!("test of {}", what()))?
        {
            if sizes[0] as usize != size {
                return Err(format!(
                    "test of {} reported size {}, expected {size}",
                    what(),
                    sizes[0]
                ));
            }
            return Ok(());
        }
        dog.idle(|| format!("{} does not complete", what()))?;
    }
}

/// `--idle-probe`, side A: `k` sends on connection 0 before the peer has posted a receive,
/// each of which the plugin must answer "not now" (NULL): the cost of an idle `isend`.
/// Never inlined, so callgrind can count inside it alone.
#[inline(never)]
fn probe_idle_send(net: &Net, c: &Conn, k: usize, calls: &mut Calls) -> Res<()> {
    let ptr = c.tx.buf.as_ptr().cast_mut();
    for i in 0..k {
        let r = net
            .isend(c.send, ptr, 8, 0, c.tx.mh)
            .call(|| format!("isend (idle probe, call {i})"))?;
        calls.posts += 1;
        if !r.is_null() {
            return Err(format!(
                "idle probe: isend {i} was accepted before the peer posted a receive"
            ));
        }
        calls.posts_null += 1;
    }
    Ok(())
}

/// `--idle-probe`, side B: `k` tests of a receive the peer has not sent to yet: the cost of
/// an idle `test`. Never inlined (as `probe_idle_send`).
#[inline(never)]
fn probe_idle_recv(net: &Net, req: Opaque, k: usize, calls: &mut Calls) -> Res<()> {
    let mut sizes = [0 as c_int; 64];
    for i in 0..k {
        let done = net
            .test(req, Some(&mut sizes[..]))
            .call(|| format!("test (idle probe, call {i})"))?;
        calls.tests += 1;
        if done {
            return Err(format!(
                "idle probe: test {i} completed a receive the peer never sent to"
            ));
        }
        calls.tests_idle += 1;
    }
    Ok(())
}

/// `--idle-probe K` on connection 0, before the sizes: side A makes K idle `isend`s, then
/// side B posts one 8-byte receive and makes K idle `test`s of it; then the message goes
/// through. Prints (side A) what each side did.
fn idle_probe(
    net: &Net,
    side: Side,
    ctl: &mut Control,
    c: &mut Conn,
    k: usize,
    quiet: bool,
) -> Res<()> {
    let mut calls = Calls::default();
    let what = || "the idle probe's message".to_string();
    match side {
        Side::A => {
            probe_idle_send(net, c, k, &mut calls)?;
            ctl.send("probe-sent")?;
            let peer = ctl.expect("probe-recv")?;
            let peer = Calls::decode(peer.split_whitespace())
                .ok_or_else(|| format!("bad idle probe counts from the peer: {peer:?}"))?;
            let (send, mh) = (c.send, c.tx.mh);
            let ptr = c.tx.buf.as_ptr().cast_mut();
            let q = post(|| net.isend(send, ptr, 8, 0, mh).call(what), &what)?;
            wait(net, q, 8, &what)?;
            ctl.expect("probe-done")?;
            if !quiet {
                println!(
                    "idle probe: side A {} idle isend calls, side B {} idle test calls",
                    calls.posts_null, peer.tests_idle
                );
            }
        }
        Side::B => {
            ctl.expect("probe-sent")?;
            let (recv, mh) = (c.recv, c.rx.mh);
            let mut bufs = [std::ptr::null_mut::<u8>(); MAX_GROUP];
            bufs[0] = c.rx.buf.as_mut_ptr();
            let r = post(|| irecv_group(net, recv, &bufs, 1, 8, mh).call(what), &what)?;
            probe_idle_recv(net, r, k, &mut calls)?;
            ctl.send(&format!("probe-recv {}", calls.encode()))?;
            wait(net, r, 8, &what)?;
            ctl.send("probe-done")?;
        }
    }
    Ok(())
}

/// Retries a post while the plugin answers "not now" (NULL).
fn post(mut f: impl FnMut() -> Res<Opaque>, what: &dyn Fn() -> String) -> Res<Opaque> {
    let mut dog = Watchdog::new();
    loop {
        let r = f()?;
        if !r.is_null() {
            return Ok(r);
        }
        dog.idle(|| format!("{} is never accepted (NULL request)", what()))?;
    }
}

/// Ping-pong on connection 0, run the way a latency-bound NCCL exchange runs: receives are
/// posted `depth` round trips ahead (NCCL's proxy keeps up to 8 steps posted), and each side
/// sends its next message before it re-posts the receive it last consumed. Side A returns in
/// `s.samples` the time between the starts of consecutive round trips, so everything a round
/// trip costs (re-posting included) is counted.
fn ping_pong(
    net: &Net,
    side: Side,
    c: &mut Conn,
    s: &mut Scratch,
    plan: &SizePlan,
    depth: usize,
) -> Res<()> {
    let size = plan.size;
    let warmup = lat_warmup(plan.lat_iters);
    let total = warmup + plan.lat_iters;
    let depth = depth.clamp(1, total);
    let layout = Layout::new(size, 1, total);
    let (out_stream, in_stream) = match side {
        Side::A => (STREAM_PING, STREAM_PONG),
        Side::B => (STREAM_PONG, STREAM_PING),
    };
    fill(c.tx.slot(&layout, 0), seed(size, out_stream, 0, 0));
    fill(c.tx.slot(&layout, 1), seed(size, out_stream, 0, total - 1));
    c.rx.slot(&layout, 0).fill(0x5a);
    c.rx.slot(&layout, 1).fill(0x5a);
    let tx: [*mut u8; 3] = std::array::from_fn(|i| c.tx.slot_ptr(&layout, i));
    let rx: [*mut u8; 3] = std::array::from_fn(|i| c.rx.slot_ptr(&layout, i));
    let mut bufs = [std::ptr::null_mut::<u8>(); MAX_GROUP];
    s.samples.clear();
    // The first ring holds window * group >= depth requests; taken, not reallocated.
    let mut ring = std::mem::take(&mut s.rings[0]);
    let (send, recv, tx_mh, rx_mh) = (c.send, c.recv, c.tx.mh, c.rx.mh);
    let mut irecv = |i: usize| {
        bufs[0] = rx[layout.recv_slot(i).min(2)];
        post(
            || {
                irecv_group(net, recv, &bufs, 1, size, rx_mh)
                    .call(|| format!("irecv (latency, size {size}, round trip {i})"))
            },
            &|| format!("irecv (latency, size {size}, round trip {i})"),
        )
    };
    let isend = |i: usize| {
        post(
            || {
                net.isend(send, tx[layout.send_slot(i)], size, 0, tx_mh)
                    .call(|| format!("isend (latency, size {size}, round trip {i})"))
            },
            &|| format!("isend (latency, size {size}, round trip {i})"),
        )
    };
    let waited = |r: Opaque, i: usize, what: &str| {
        wait(net, r, size, &|| {
            format!("{what} (latency, size {size}, round trip {i})")
        })
    };
    for (i, r) in ring.iter_mut().enumerate().take(depth) {
        *r = irecv(i)?;
    }
    match side {
        Side::A => {
            let mut start = Instant::now();
            for i in 0..total {
                let q = isend(i)?;
                // The receive consumed in the previous round trip is re-posted while the
                // ping is on its way.
                if i > 0 && i - 1 + depth < total {
                    ring[(i - 1) % depth] = irecv(i - 1 + depth)?;
                }
                waited(q, i, "isend")?;
                waited(ring[i % depth], i, "irecv")?;
                let now = Instant::now();
                if i >= warmup {
                    s.samples.push(now.duration_since(start).as_nanos() as u64);
                }
                start = now;
            }
        }
        Side::B => {
            for i in 0..total {
                waited(ring[i % depth], i, "irecv")?;
                let q = isend(i)?;
                if i + depth < total {
                    ring[i % depth] = irecv(i + depth)?;
                }
                waited(q, i, "isend")?;
            }
        }
    }
    s.rings[0] = ring;
    let what = |m: usize| {
        move || {
            format!(
                "size {size} round trip {m} (latency, received by side {})",
                if side == Side::A { "A" } else { "B" }
            )
        }
    };
    check_pattern(c.rx.slot(&layout, 0), seed(size, in_stream, 0, 0), what(0))?;
    if total > 1 {
        check_pattern(
            c.rx.slot(&layout, 1),
            seed(size, in_stream, 0, total - 1),
            what(total - 1),
        )?;
    }
    Ok(())
}

fn median(v: &mut [u64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_unstable();
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2] as f64
    } else {
        (v[n / 2 - 1] + v[n / 2]) as f64 / 2.0
    }
}

// ---------------------------------------------------------------------------------------
// Results

/// One line of the result table; a phase that did not run is `None`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Row {
    size: usize,
    gbps: Option<f64>,
    lat_us: Option<f64>,
}

/// What a run produced, one row per size (what the table, the CSV file and the plot are
/// made from), with what the plot says about it.
struct Report {
    rows: Vec<Row>,
    /// The plot's title: transport, device, window, group, connections.
    title: String,
    /// Lines under the title.
    notes: Vec<String>,
    /// The legend name of this run's series.
    label: String,
}

fn human(size: usize) -> String {
    match size {
        s if s >= 1 << 30 && s % (1 << 30) == 0 => format!("{} GiB", s >> 30),
        s if s >= 1 << 20 && s % (1 << 20) == 0 => format!("{} MiB", s >> 20),
        s if s >= 1 << 10 && s % (1 << 10) == 0 => format!("{} KiB", s >> 10),
        s => format!("{s} B"),
    }
}

const TABLE_HEAD: &str = "      size        GB/s      lat us";

fn table_row(r: &Row) -> String {
    let cell = |v: Option<f64>, decimals: usize| {
        v.map_or_else(|| format!("{:>11}", "-"), |v| format!("{v:>11.decimals$}"))
    };
    format!(
        "{:>10} {} {}",
        human(r.size),
        cell(r.gbps, 4),
        cell(r.lat_us, 2)
    )
}

const CSV_HEAD: &str = "size_bytes,bandwidth_gbps,latency_us";

fn write_csv(report: &Report, path: &Path) -> Res<()> {
    let mut out = format!("{CSV_HEAD}\n");
    let cell =
        |v: Option<f64>, decimals: usize| v.map_or(String::new(), |v| format!("{v:.decimals$}"));
    for r in &report.rows {
        let _ = writeln!(out, "{},{},{}", r.size, cell(r.gbps, 6), cell(r.lat_us, 3));
    }
    std::fs::write(path, out).map_err(|e| format!("writing {}: {e}", path.display()))
}

/// Reads rows in the `--csv` format (a header line, then `size,GB/s,us`; empty or `-`
/// fields are phases not run).
fn read_csv(path: &Path) -> Res<Vec<Row>> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    let mut rows = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with("size") {
            continue;
        }
        let bad = || {
            format!(
                "{}:{}: expected {CSV_HEAD}, got {line:?}",
                path.display(),
                n + 1
            )
        };
        let mut f = line.split(',').map(str::trim);
        let size = f.next().and_then(|v| v.parse().ok()).ok_or_else(bad)?;
        let mut value = || -> Res<Option<f64>> {
            match f.next() {
                None | Some("" | "-") => Ok(None),
                Some(v) => v
                    .parse::<f64>()
                    .ok()
                    .filter(|v| v.is_finite() && *v >= 0.0)
                    .map(Some)
                    .ok_or_else(bad),
            }
        };
        let (gbps, lat_us) = (value()?, value()?);
        rows.push(Row { size, gbps, lat_us });
    }
    if rows.is_empty() {
        return Err(format!("{}: no rows", path.display()));
    }
    Ok(rows)
}

// ---------------------------------------------------------------------------------------
// Plot (`--svg`): bandwidth and latency against size, a self-contained SVG

/// One named line of the plot.
struct Series<'a> {
    label: &'a str,
    rows: Vec<Row>,
}

/// Series colours (the first is this run).
const COLORS: [&str; 6] = [
    "#1f6fb4", "#e8710a", "#2ca02c", "#9467bd", "#d62728", "#8c564b",
];
const FONT: &str = "DejaVu Sans, Helvetica, Arial, sans-serif";
const SVG_W: f64 = 960.0;
const MARGIN_L: f64 = 86.0;
const MARGIN_R: f64 = 30.0;
const PANEL_H: f64 = 240.0;
/// Space between the two panels (tick labels, the second panel's title).
const PANEL_GAP: f64 = 118.0;

fn esc(s: &str) -> String {
    s.chars().fold(String::with_capacity(s.len()), |mut o, c| {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&apos;"),
            c => o.push(c),
        }
        o
    })
}

/// A round tick step of about `raw`: 1, 2, 2.5 or 5 times a power of ten.
fn nice_step(raw: f64) -> f64 {
    let raw = if raw.is_finite() && raw > 0.0 {
        raw
    } else {
        1.0
    };
    let p = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * p)
        .find(|s| *s >= raw * 0.999)
        .unwrap_or(10.0 * p)
}

/// `v` with as few decimals as needed (at most 6), no trailing zeros.
fn short_num(v: f64) -> String {
    let s = format!("{v:.6}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" {
        "0".into()
    } else {
        s.into()
    }
}

/// A latency tick in microseconds, in us, ms or s.
fn time_label(us: f64) -> String {
    if us >= 1e6 {
        format!("{} s", short_num(us / 1e6))
    } else if us >= 1e3 {
        format!("{} ms", short_num(us / 1e3))
    } else {
        format!("{} us", short_num(us))
    }
}

/// Three significant digits.
fn sig3(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return "0".into();
    }
    let decimals = (2 - v.abs().log10().floor() as i32).clamp(0, 6) as usize;
    format!("{v:.decimals$}")
}

/// Maps message sizes to x on a log2 axis.
struct XAxis {
    lo: f64,
    hi: f64,
    left: f64,
    width: f64,
}

impl XAxis {
    fn new(sizes: &[usize], left: f64, width: f64) -> Self {
        let logs = sizes.iter().filter(|s| **s > 0).map(|s| (*s as f64).log2());
        let (mut lo, mut hi) = logs.fold((f64::MAX, f64::MIN), |(a, b), l| (a.min(l), b.max(l)));
        if lo > hi {
            (lo, hi) = (3.0, 26.0);
        }
        let (mut lo, mut hi) = (lo.floor(), hi.ceil());
        if hi - lo < 2.0 {
            lo -= 1.0;
            hi += 1.0;
        }
        XAxis {
            lo,
            hi,
            left,
            width,
        }
    }

    fn x(&self, size: usize) -> f64 {
        let l = (size.max(1) as f64).log2();
        self.left + (l - self.lo + 0.3) / (self.hi - self.lo + 0.6) * self.width
    }

    fn x_pow(&self, p: f64) -> f64 {
        self.left + (p - self.lo + 0.3) / (self.hi - self.lo + 0.6) * self.width
    }
}

/// A y axis: linear from 0, or log10.
struct YAxis {
    log: bool,
    lo: f64,
    hi: f64,
    top: f64,
    height: f64,
    /// (value, label or "" for an unlabelled grid line).
    ticks: Vec<(f64, String)>,
}

impl YAxis {
    fn linear(max: f64, top: f64, height: f64) -> Self {
        let max = if max.is_finite() && max > 0.0 {
            max
        } else {
            1.0
        };
        let step = nice_step(max * 1.08 / 5.0);
        let hi = (max * 1.08 / step).ceil() * step;
        let n = (hi / step).round() as usize;
        let ticks = (0..=n)
            .map(|i| {
                let v = i as f64 * step;
                (v, short_num(v))
            })
            .collect();
        YAxis {
            log: false,
            lo: 0.0,
            hi,
            top,
            height,
            ticks,
        }
    }

    fn log10(min: f64, max: f64, top: f64, height: f64) -> Self {
        let (min, max) = if min.is_finite() && max.is_finite() && min > 0.0 && max >= min {
            (min, max)
        } else {
            (1.0, 10.0)
        };
        let lo = min.log10().floor();
        let mut hi = max.log10().ceil();
        if hi <= lo {
            hi = lo + 1.0;
        }
        let decades = (hi - lo) as i32;
        let mut ticks = Vec::new();
        for d in lo as i32..=hi as i32 {
            let p = 10f64.powi(d);
            ticks.push((p, time_label(p)));
            if d < hi as i32 {
                for m in [2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0] {
                    let label = decades <= 2 && (m == 2.0 || m == 5.0);
                    let v = m * p;
                    ticks.push((v, if label { time_label(v) } else { String::new() }));
                }
            }
        }
        YAxis {
            log: true,
            lo,
            hi,
            top,
            height,
            ticks,
        }
    }

    fn y(&self, v: f64) -> f64 {
        let f = if self.log {
            (v.max(1e-12).log10() - self.lo) / (self.hi - self.lo)
        } else {
            (v - self.lo) / (self.hi - self.lo)
        };
        self.top + self.height * (1.0 - f.clamp(-0.02, 1.02))
    }
}

/// Where the x tick labels go: the measured sizes when there are few, else every k-th
/// power of two; rotated when they would overlap.
fn x_labels(xa: &XAxis, sizes: &[usize]) -> (Vec<(f64, String)>, bool) {
    const MIN_GAP: f64 = 50.0;
    let mut labels: Vec<(f64, String)> = if !sizes.is_empty() && sizes.len() <= 16 {
        sizes.iter().map(|s| (xa.x(*s), human(*s))).collect()
    } else {
        let per_pow = xa.x_pow(1.0) - xa.x_pow(0.0);
        let step = (MIN_GAP / per_pow).ceil().max(1.0) as usize;
        (xa.lo as usize..=xa.hi as usize)
            .step_by(step)
            .map(|p| (xa.x_pow(p as f64), human(1usize << p.min(62))))
            .collect()
    };
    labels.sort_by(|a, b| a.0.total_cmp(&b.0));
    let tight = labels.windows(2).any(|w| w[1].0 - w[0].0 < MIN_GAP);
    (labels, tight)
}

/// Which value of a row a panel shows.
#[derive(Clone, Copy)]
enum Metric {
    Bandwidth,
    Latency,
}

impl Metric {
    fn of(self, r: &Row) -> Option<f64> {
        match self {
            Metric::Bandwidth => r.gbps,
            Metric::Latency => r.lat_us.filter(|v| *v > 0.0),
        }
    }
}

/// Draws one panel: frame, grid, ticks, lines, points, legend.
fn svg_panel(
    out: &mut String,
    series: &[Series],
    xa: &XAxis,
    ya: &YAxis,
    metric: Metric,
    title: &str,
    axis_title: &str,
) {
    let (left, width, top, height) = (xa.left, xa.width, ya.top, ya.height);
    let bottom = top + height;
    let _ = writeln!(
        out,
        r##"<text x="{left}" y="{:.1}" font-size="15" font-weight="600" fill="#222">{}</text>"##,
        top - 12.0,
        esc(title)
    );
    let _ = writeln!(
        out,
        r##"<rect x="{left}" y="{top}" width="{width}" height="{height}" fill="#fcfcfd" stroke="none"/>"##
    );
    // Grid: a vertical line per power of two, horizontal ones per y tick.
    let _ = writeln!(out, r##"<g stroke="#e6e6e6" stroke-width="1">"##);
    for p in xa.lo as i64..=xa.hi as i64 {
        let x = xa.x_pow(p as f64);
        let _ = writeln!(
            out,
            r#"<line x1="{x:.1}" y1="{top}" x2="{x:.1}" y2="{bottom}"/>"#
        );
    }
    for (v, label) in &ya.ticks {
        let y = ya.y(*v);
        let stroke = if label.is_empty() {
            "#f0f0f0"
        } else {
            "#dddddd"
        };
        let _ = writeln!(
            out,
            r#"<line x1="{left}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{stroke}"/>"#,
            left + width
        );
    }
    let _ = writeln!(out, "</g>");
    let _ = writeln!(
        out,
        r##"<rect x="{left}" y="{top}" width="{width}" height="{height}" fill="none" stroke="#888" stroke-width="1"/>"##
    );
    // Y tick labels and the axis title.
    let _ = writeln!(out, r##"<g font-size="12" fill="#333" text-anchor="end">"##);
    for (v, label) in ya.ticks.iter().filter(|t| !t.1.is_empty()) {
        let y = ya.y(*v);
        let _ = writeln!(
            out,
            r##"<line x1="{:.1}" y1="{y:.1}" x2="{left}" y2="{y:.1}" stroke="#888"/><text x="{:.1}" y="{:.1}">{}</text>"##,
            left - 5.0,
            left - 8.0,
            y + 4.0,
            esc(label)
        );
    }
    let _ = writeln!(out, "</g>");
    let _ = writeln!(
        out,
        r##"<text transform="translate({:.1},{:.1}) rotate(-90)" text-anchor="middle" font-size="13" fill="#333">{}</text>"##,
        left - 62.0,
        top + height / 2.0,
        esc(axis_title)
    );
    // X tick labels: the sizes.
    let sizes = all_sizes(series);
    let (labels, tight) = x_labels(xa, &sizes);
    let _ = writeln!(out, r##"<g font-size="12" fill="#333">"##);
    for (x, label) in &labels {
        let _ = write!(
            out,
            r##"<line x1="{x:.1}" y1="{bottom}" x2="{x:.1}" y2="{:.1}" stroke="#888"/>"##,
            bottom + 5.0
        );
        if tight {
            let _ = writeln!(
                out,
                r#"<text transform="translate({:.1},{:.1}) rotate(-35)" text-anchor="end">{}</text>"#,
                x + 4.0,
                bottom + 17.0,
                esc(label)
            );
        } else {
            let _ = writeln!(
                out,
                r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                bottom + 19.0,
                esc(label)
            );
        }
    }
    let _ = writeln!(out, "</g>");
    // The series: reference series first, this run on top.
    for (i, s) in series.iter().enumerate().rev() {
        let color = COLORS[i % COLORS.len()];
        let pts: Vec<(f64, f64, &Row)> = s
            .rows
            .iter()
            .filter(|r| r.size > 0)
            .filter_map(|r| metric.of(r).map(|v| (xa.x(r.size), ya.y(v), r)))
            .collect();
        if pts.len() > 1 {
            let d: Vec<String> = pts
                .iter()
                .map(|(x, y, _)| format!("{x:.1},{y:.1}"))
                .collect();
            let dash = if i == 0 {
                ""
            } else {
                r#" stroke-dasharray="7 4""#
            };
            let _ = writeln!(
                out,
                r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="{}"{dash} stroke-linejoin="round"/>"#,
                d.join(" "),
                if i == 0 { 2.6 } else { 2.0 }
            );
        }
        for (x, y, r) in &pts {
            let fill = if i == 0 { color } else { "#ffffff" };
            let value = match metric {
                Metric::Bandwidth => format!("{} GB/s", sig3(r.gbps.unwrap_or(0.0))),
                Metric::Latency => format!("{} us", sig3(r.lat_us.unwrap_or(0.0))),
            };
            let _ = writeln!(
                out,
                r#"<circle cx="{x:.1}" cy="{y:.1}" r="4" fill="{fill}" stroke="{color}" stroke-width="1.8"><title>{}: {} ({})</title></circle>"#,
                human(r.size),
                value,
                esc(s.label)
            );
        }
    }
    // Call-out for this run: the peak bandwidth, or the latency of the smallest size.
    if let Some(s) = series.first() {
        let pick = match metric {
            Metric::Bandwidth => s
                .rows
                .iter()
                .filter(|r| r.gbps.is_some())
                .max_by(|a, b| a.gbps.unwrap_or(0.0).total_cmp(&b.gbps.unwrap_or(0.0))),
            Metric::Latency => s
                .rows
                .iter()
                .filter(|r| r.size > 0 && metric.of(r).is_some())
                .min_by_key(|r| r.size),
        };
        if let Some(r) = pick {
            let text = match metric {
                Metric::Bandwidth => {
                    format!(
                        "peak {} GB/s at {}",
                        sig3(r.gbps.unwrap_or(0.0)),
                        human(r.size)
                    )
                }
                Metric::Latency => {
                    format!("{} us at {}", sig3(r.lat_us.unwrap_or(0.0)), human(r.size))
                }
            };
            // The number in words at the panel title's right end (never over a line), and a
            // ring around its point.
            let (x, y) = (xa.x(r.size), ya.y(metric.of(r).unwrap_or(0.0)));
            let _ = writeln!(
                out,
                r#"<circle cx="{x:.1}" cy="{y:.1}" r="8" fill="none" stroke="{}" stroke-width="1.4" stroke-opacity="0.7"/>"#,
                COLORS[0]
            );
            let _ = writeln!(
                out,
                r##"<text x="{:.1}" y="{:.1}" text-anchor="end" font-size="13" font-weight="600" fill="{}">{}: {}</text>"##,
                left + width,
                top - 12.0,
                COLORS[0],
                esc(s.label),
                esc(&text)
            );
        }
    }
    // Legend, top left inside the frame (small sizes: low bandwidth and low latency).
    let row_h = 18.0;
    let longest = series
        .iter()
        .map(|s| s.label.chars().count())
        .max()
        .unwrap_or(0);
    let (lx, ly) = (left + 12.0, top + 10.0);
    let lw = 44.0 + 6.8 * longest as f64;
    let _ = writeln!(
        out,
        r##"<rect x="{lx:.1}" y="{ly:.1}" width="{lw:.1}" height="{:.1}" rx="4" fill="#ffffff" fill-opacity="0.9" stroke="#cccccc"/>"##,
        8.0 + row_h * series.len() as f64
    );
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let y = ly + 4.0 + row_h * (i as f64 + 0.5);
        let dash = if i == 0 {
            ""
        } else {
            r#" stroke-dasharray="7 4""#
        };
        let fill = if i == 0 { color } else { "#ffffff" };
        let _ = writeln!(
            out,
            r##"<line x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{color}" stroke-width="2.4"{dash}/><circle cx="{:.1}" cy="{y:.1}" r="3.5" fill="{fill}" stroke="{color}" stroke-width="1.6"/><text x="{:.1}" y="{:.1}" font-size="12" fill="#222">{}</text>"##,
            lx + 8.0,
            lx + 34.0,
            lx + 21.0,
            lx + 42.0,
            y + 4.0,
            esc(s.label)
        );
    }
}

/// Every size of every series, sorted, once.
fn all_sizes(series: &[Series]) -> Vec<usize> {
    let mut v: Vec<usize> = series
        .iter()
        .flat_map(|s| s.rows.iter().map(|r| r.size))
        .filter(|s| *s > 0)
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// The whole picture: title, notes, a bandwidth panel (linear GB/s) above a latency panel
/// (log us), both against the message size on a log2 axis.
fn render_svg(title: &str, notes: &[String], series: &[Series]) -> String {
    let sizes = all_sizes(series);
    let width = SVG_W - MARGIN_L - MARGIN_R;
    let xa = XAxis::new(&sizes, MARGIN_L, width);
    let top1 = 70.0 + 17.0 * notes.len() as f64 + 24.0;
    let top2 = top1 + PANEL_H + PANEL_GAP;
    let height = top2 + PANEL_H + 76.0;
    let values = |m: Metric| -> Vec<f64> {
        series
            .iter()
            .flat_map(|s| {
                s.rows
                    .iter()
                    .filter(|r| r.size > 0)
                    .filter_map(move |r| m.of(r))
            })
            .collect()
    };
    let bw = values(Metric::Bandwidth);
    let lat = values(Metric::Latency);
    let ya_bw = YAxis::linear(bw.iter().copied().fold(0.0, f64::max), top1, PANEL_H);
    let ya_lat = YAxis::log10(
        lat.iter().copied().fold(f64::MAX, f64::min),
        lat.iter().copied().fold(0.0, f64::max),
        top2,
        PANEL_H,
    );
    let mut out = String::with_capacity(32 << 10);
    let _ = writeln!(
        out,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{SVG_W}" height="{height}" viewBox="0 0 {SVG_W} {height}" font-family="{FONT}">"##
    );
    let _ = writeln!(out, "<title>{}</title>", esc(title));
    let _ = writeln!(
        out,
        r##"<rect x="0" y="0" width="{SVG_W}" height="{height}" fill="#ffffff"/>"##
    );
    let _ = writeln!(
        out,
        r##"<text x="{MARGIN_L}" y="36" font-size="20" font-weight="700" fill="#111">{}</text>"##,
        esc(title)
    );
    for (i, n) in notes.iter().enumerate() {
        let n: String = if n.chars().count() > 140 {
            n.chars().take(137).chain("...".chars()).collect()
        } else {
            n.clone()
        };
        let _ = writeln!(
            out,
            r##"<text x="{MARGIN_L}" y="{:.1}" font-size="12.5" fill="#555">{}</text>"##,
            60.0 + 17.0 * i as f64,
            esc(&n)
        );
    }
    svg_panel(
        &mut out,
        series,
        &xa,
        &ya_bw,
        Metric::Bandwidth,
        "Bandwidth (higher is better)",
        "bandwidth (GB/s)",
    );
    svg_panel(
        &mut out,
        series,
        &xa,
        &ya_lat,
        Metric::Latency,
        "Latency (lower is better; log scale)",
        "latency (round trip / 2)",
    );
    let _ = writeln!(
        out,
        r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="13" fill="#333">message size (bytes, log2 scale)</text>"##,
        MARGIN_L + width / 2.0,
        height - 14.0
    );
    out.push_str("</svg>\n");
    out
}

/// Writes the report (and the `--compare` series) as an SVG plot.
fn write_svg(report: &Report, compare: &[(PathBuf, String)], path: &Path) -> Res<()> {
    let mut series = vec![Series {
        label: &report.label,
        rows: report.rows.clone(),
    }];
    for (file, label) in compare {
        series.push(Series {
            label,
            rows: read_csv(file)?,
        });
    }
    let svg = render_svg(&report.title, &report.notes, &series);
    std::fs::write(path, svg).map_err(|e| format!("writing {}: {e}", path.display()))
}

// ---------------------------------------------------------------------------------------
// The session both sides run

/// `Some(v)` as `v`, `None` as `-` (the `result` line).
fn opt_text(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| v.to_string())
}

fn opt_parse(s: Option<&str>) -> Option<Option<f64>> {
    match s? {
        "-" => Some(None),
        v => v.parse().ok().map(Some),
    }
}

/// The plot's title and notes for this run.
fn plot_text(p: &Plugin, params: &Params) -> (String, Vec<String>) {
    let mut title = format!(
        "{} on {}: window {}, group {}, {} conn{}",
        p.transport,
        p.props.name,
        params.window,
        params.group,
        params.conns,
        if params.conns == 1 { "" } else { "s" }
    );
    for (var, what) in [
        ("NCCL_IB_QPS_PER_CONNECTION", "QPs/conn"),
        ("NCCL_IB_SPLIT_DATA_ON_QPS", "split"),
    ] {
        if let Ok(v) = std::env::var(var) {
            let _ = write!(title, ", {what} {v}");
        }
    }
    let notes = vec![
        format!(
            "nccl-net-bench, {} (ncclNetPlugin_v{}, plugin \"{}\"), iterations {}",
            p.net.path.display(),
            p.net.version(),
            p.net.name(),
            params
                .iters
                .map_or_else(|| "scaled per size".into(), |n| format!("{n} per size"))
        ),
        "GB/s: payload of all connections / receiver time from first irecv to last completion; \
         latency: median round trip / 2 on connection 0"
            .into(),
    ];
    (title, notes)
}

/// Runs every size with the peer over `ctl` and returns the report (on both sides). Side A
/// prints both sides' call counts per size with `stats`.
fn session(
    p: &Plugin,
    side: Side,
    ctl: &mut Control,
    params: &Params,
    mut header: Vec<String>,
    quiet: bool,
    stats: bool,
) -> Res<Report> {
    let net = &p.net;
    let mut conns = connect_all(p, ctl, params)?;
    let mut scratch = Scratch::new(params);
    ctl.send("connected")?;
    ctl.expect("connected")?;
    let mut shared = params
        .plan
        .iter()
        .filter(|s| params.phases.bw && params.pool(s.size) < params.window * params.group)
        .map(|s| human(s.size))
        .peekable();
    if shared.peek().is_some() {
        header.push(format!(
            "note: receives in flight share buffers above {} MiB per process (sizes {})",
            POOL_BYTES >> 20,
            shared.collect::<Vec<_>>().join(", ")
        ));
    }
    if !quiet {
        for h in &header {
            println!("{h}");
        }
    }
    if params.probe > 0 {
        idle_probe(net, side, ctl, &mut conns[0], params.probe, quiet)?;
    }
    if !quiet {
        println!("{TABLE_HEAD}");
    }
    let mut rows = Vec::with_capacity(params.plan.len());
    let mut stats_lines = Vec::new();
    for plan in &params.plan {
        let msgs = plan.bw_iters * params.group * params.conns;
        let bytes = (msgs * plan.size) as f64;
        let row = match side {
            Side::A => {
                let mut gbps = None;
                if params.phases.bw {
                    ctl.expect("ready")?;
                    bw_send(net, &mut conns, &mut scratch, params, plan)?;
                    let bw = ctl.expect("bw")?;
                    let mut w = bw.split_whitespace();
                    let ns: u64 = w
                        .next()
                        .and_then(|v| v.parse().ok())
                        .ok_or_else(|| format!("bad bandwidth result from the peer: {bw:?}"))?;
                    let peer_calls = Calls::decode(w)
                        .ok_or_else(|| format!("bad call counts from the peer: {bw:?}"))?;
                    gbps = Some(bytes / ns.max(1) as f64);
                    if stats {
                        stats_lines.push(scratch.calls.line(plan.size, "A", "isend", msgs));
                        stats_lines.push(peer_calls.line(plan.size, "B", "irecv", msgs));
                    }
                }
                let mut lat_us = None;
                if params.phases.lat {
                    ping_pong(net, side, &mut conns[0], &mut scratch, plan, params.window)?;
                    lat_us = Some(median(&mut scratch.samples) / 2.0 / 1e3);
                    ctl.expect("lat-ok")?;
                }
                ctl.send(&format!("result {} {}", opt_text(gbps), opt_text(lat_us)))?;
                Row {
                    size: plan.size,
                    gbps,
                    lat_us,
                }
            }
            Side::B => {
                if params.phases.bw {
                    ctl.send("ready")?;
                    let t = bw_recv(net, &mut conns, &mut scratch, params, plan)?;
                    ctl.send(&format!("bw {} {}", t.as_nanos(), scratch.calls.encode()))?;
                }
                if params.phases.lat {
                    ping_pong(net, side, &mut conns[0], &mut scratch, plan, params.window)?;
                    ctl.send("lat-ok")?;
                }
                let r = ctl.expect("result")?;
                let mut w = r.split_whitespace();
                match (opt_parse(w.next()), opt_parse(w.next())) {
                    (Some(gbps), Some(lat_us)) => Row {
                        size: plan.size,
                        gbps,
                        lat_us,
                    },
                    _ => return Err(format!("bad result line from the peer: {r:?}")),
                }
            }
        };
        if !quiet {
            println!("{}", table_row(&row));
        }
        rows.push(row);
    }
    close_all(net, conns)?;
    ctl.send("done")?;
    ctl.expect("done")?;
    // After the table, so a script can read both.
    for l in &stats_lines {
        println!("{l}");
    }
    let (title, notes) = plot_text(p, params);
    Ok(Report {
        rows,
        title,
        notes,
        label: format!("{} plugin ({})", p.net.name(), p.transport),
    })
}

fn header_lines(p: &Plugin, params: &Params, peer: &str) -> Vec<String> {
    let d = &p.props;
    let iters = match params.iters {
        Some(n) => format!("{n} per size"),
        None => "scaled per size".into(),
    };
    vec![
        format!(
            "library:   {} (ncclNetPlugin_v{}, plugin \"{}\")",
            p.net.path.display(),
            p.net.version(),
            p.net.name()
        ),
        format!(
            "transport: {}{}",
            p.transport,
            p.transport_note
                .as_ref()
                .map(|n| format!(" ({n})"))
                .unwrap_or_default()
        ),
        format!(
            "device:    {} (speed {} Mbps, maxRecvs {}), peer {peer}",
            d.name, d.speed, d.max_recvs
        ),
        format!(
            "window {}, group {}, conns {}, iterations {iters}{}",
            params.window,
            params.group,
            params.conns,
            if params.phases == Phases::BOTH {
                String::new()
            } else {
                format!(", phases {}", params.phases.encode())
            }
        ),
        "GB/s: payload of all connections / receiver time from first irecv to last \
         completion; lat: median round trip / 2 on connection 0"
            .into(),
    ]
}

fn cpus_line(o: &Options) -> Option<String> {
    match o.cpus? {
        (a, Some(b)) if o.role == Role::Local => {
            Some(format!("cpus: side A on {a}, side B on {b}"))
        }
        (a, _) => Some(format!("cpus: this side on {a}")),
    }
}

fn check_group(p: &Plugin, params: &Params) -> Res<()> {
    if params.group as i32 > p.props.max_recvs {
        return Err(format!(
            "--group {} exceeds the device's maxRecvs {}",
            params.group, p.props.max_recvs
        ));
    }
    Ok(())
}

/// Side A after the control connection is up.
fn run_a(o: &Options, p: &Plugin, ctl: &mut Control) -> Res<Report> {
    let params = Params::from_options(o, &p.transport);
    check_group(p, &params)?;
    params.check_memory(if o.role == Role::Local { 2 } else { 1 })?;
    ctl.send(&format!(
        "{PROTOCOL} abi={} device={}",
        o.abi,
        p.props.name.replace(char::is_whitespace, "_")
    ))?;
    ctl.send(&params.encode())?;
    let hello = ctl.expect("hello")?;
    let peer_transport = field(&hello, "transport").unwrap_or("?");
    if peer_transport != p.transport {
        return Err(format!(
            "the peer uses transport {peer_transport}, this side {}: set the same \
             {TRANSPORT_ENV} on both",
            p.transport
        ));
    }
    let peer = format!(
        "{} (ncclNetPlugin_v{})",
        field(&hello, "device").unwrap_or("?"),
        field(&hello, "abi").unwrap_or("?")
    );
    let mut header = header_lines(p, &params, &peer);
    header.extend(cpus_line(o));
    session(p, Side::A, ctl, &params, header, o.quiet, o.stats)
}

/// Side B: receives the run, opens the plugin like side A, then runs it.
fn run_b(o: &Options, ctl: &mut Control) -> Res<Report> {
    let first = ctl.recv()?.to_string();
    if first.split_whitespace().next() != Some(PROTOCOL) {
        return Err(format!("the peer is not {PROTOCOL}: {first:?}"));
    }
    let params = Params::decode(ctl.recv()?)?;
    params.check_memory(1)?;
    if o.run_options_given && !o.quiet {
        println!("note: --sizes/--iters/--window/--group/--conns come from the listening side");
    }
    let p = open_plugin(o, Some(&params.transport))?;
    check_group(&p, &params)?;
    ctl.send(&format!(
        "hello transport={} device={} abi={}",
        p.transport,
        p.props.name.replace(char::is_whitespace, "_"),
        o.abi
    ))?;
    if p.transport != params.transport {
        return Err(format!(
            "this side uses transport {}, the peer {}: set the same {TRANSPORT_ENV} on both",
            p.transport, params.transport
        ));
    }
    let peer = format!(
        "{} (ncclNetPlugin_v{})",
        field(&first, "device").unwrap_or("?"),
        field(&first, "abi").unwrap_or("?")
    );
    let mut header = header_lines(&p, &params, &peer);
    header.extend(cpus_line(o));
    let report = session(&p, Side::B, ctl, &params, header, o.quiet, false);
    finish_plugin(p, report)
}

fn finish_plugin(mut p: Plugin, report: Res<Report>) -> Res<Report> {
    let report = report?;
    p.net.finalize().call(|| "finalize".into())?;
    Ok(report)
}

/// Sends our error to the peer (best effort) so it stops at once with the reason.
fn with_peer_notice<T>(ctl: &mut Control, r: Res<T>) -> Res<T> {
    if let Err(e) = &r {
        let _ = ctl.send(&format!("error {}", e.replace('\n', " ")));
    }
    r
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

    /// The child's exit status if it has already exited.
    fn exited(&mut self) -> Option<String> {
        let child = self.0.as_mut()?;
        match child.try_wait() {
            Ok(Some(st)) => {
                self.0 = None;
                Some(st.to_string())
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

/// Accepts the control connection, giving up after `timeout` or when `child` dies.
fn accept_control(
    l: &TcpListener,
    timeout: Duration,
    mut child: Option<&mut ChildGuard>,
) -> Res<Control> {
    l.set_nonblocking(true)
        .map_err(|e| format!("control listener: {e}"))?;
    let until = Instant::now() + timeout;
    loop {
        match l.accept() {
            Ok((s, _)) => return Control::new(s),
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) => return Err(format!("control listener: {e}")),
        }
        if let Some(st) = child.as_mut().and_then(|c| c.exited()) {
            return Err(format!("the connecting child process exited early ({st})"));
        }
        if Instant::now() > until {
            return Err(format!("no peer connected within {} s", timeout.as_secs()));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn connect_control(addr: &str) -> Res<Control> {
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| format!("--connect {addr}: {e}"))?
        .collect();
    let until = Instant::now() + CONTROL_TIMEOUT;
    loop {
        let mut last = None;
        for a in &addrs {
            match TcpStream::connect_timeout(a, Duration::from_secs(5)) {
                Ok(s) => return Control::new(s),
                Err(e) => last = Some(e),
            }
        }
        // The listening side may not be up yet: retry for a while.
        if Instant::now() > until {
            let e = last
                .map(|e| e.to_string())
                .unwrap_or_else(|| "no address".into());
            return Err(format!("cannot reach {addr}: {e}"));
        }
        std::thread::sleep(Duration::from_millis(200));
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
    let mut ctl = accept_control(&l, LISTEN_TIMEOUT, None)?;
    let r = run_a(o, &p, &mut ctl);
    let r = with_peer_notice(&mut ctl, r)?;
    p.net.finalize().call(|| "finalize".into())?;
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
    let child = cmd
        .arg("--connect")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--lib")
        .arg(&o.lib)
        .arg("--abi")
        .arg(o.abi.to_string())
        .arg("--quiet")
        .spawn()
        .map_err(|e| format!("starting {}: {e}", exe.display()))?;
    let mut guard = ChildGuard(Some(child));
    let mut ctl = accept_control(&l, CONTROL_TIMEOUT, Some(&mut guard))?;
    let r = run_a(o, &p, &mut ctl);
    let r = with_peer_notice(&mut ctl, r)?;
    p.net.finalize().call(|| "finalize".into())?;
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

/// `--plot`: the report of an earlier run, from its CSV.
fn plot_only(csv: &Path) -> Res<Report> {
    let name = csv
        .file_stem()
        .map_or_else(|| "run".into(), |n| n.to_string_lossy().into_owned());
    Ok(Report {
        rows: read_csv(csv)?,
        title: format!("nccl-net-bench: {name}"),
        notes: vec![format!("from {}", csv.display())],
        label: name,
    })
}

fn run(o: &Options) -> Res<Report> {
    if let Some(csv) = &o.plot {
        return plot_only(csv);
    }
    if let Some((a, _)) = o.cpus {
        pin_self(a)?;
    }
    match &o.role {
        Role::Local => run_local(o),
        Role::Listen(port) => run_listen(o, *port),
        Role::Connect(addr) => {
            let mut ctl = connect_control(addr)?;
            let r = run_b(o, &mut ctl);
            with_peer_notice(&mut ctl, r)
        }
    }
}

fn main() -> ExitCode {
    if let Err(e) = parse_idle(std::env::var(IDLE_ENV).ok().as_deref()) {
        eprintln!("nccl-net-bench: {e}");
        return ExitCode::from(2);
    }
    let o = match parse_args(std::env::args().skip(1)) {
        Ok(Some(o)) => o,
        Ok(None) => {
            print!("{HELP}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("nccl-net-bench: {e}");
            return ExitCode::from(2);
        }
    };
    let who = match o.role {
        Role::Connect(_) => "nccl-net-bench (connecting side)",
        _ => "nccl-net-bench",
    };
    let mut report = match run(&o) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("{who}: error: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(t) = &o.title {
        report.title.clone_from(t);
    }
    if let Some(l) = &o.label {
        report.label.clone_from(l);
    }
    if !o.notes.is_empty() {
        report.notes.clone_from(&o.notes);
    }
    if let Some(path) = &o.svg {
        if let Err(e) = write_svg(&report, &o.compare, path) {
            eprintln!("{who}: error: {e}");
            return ExitCode::FAILURE;
        }
        if !o.quiet {
            println!("svg: {}", path.display());
        }
    }
    if let Some(path) = &o.csv {
        if let Err(e) = write_csv(&report, path) {
            eprintln!("{who}: error: {e}");
            return ExitCode::FAILURE;
        }
        if !o.quiet {
            println!("csv: {}", path.display());
        }
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Res<Option<Options>> {
        parse_args(s.split_whitespace().map(String::from))
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
    }

    #[test]
    fn default_sizes_span_8_bytes_to_64_mib() {
        let s = default_sizes();
        assert_eq!(s.first(), Some(&8));
        assert_eq!(s.last(), Some(&(64 << 20)));
        assert!(s.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn options_parse() {
        let o = args("--listen 0 --sizes 8,1M --group 4 --conns 2 --window=4")
            .unwrap()
            .unwrap();
        assert_eq!(o.role, Role::Listen(0));
        assert_eq!((o.group, o.conns, o.window), (4, 2, 4));
        assert_eq!(
            args("--listen --quiet").unwrap().unwrap().role,
            Role::Listen(DEFAULT_LISTEN_PORT)
        );
        assert_eq!(
            args("--connect h:1").unwrap().unwrap().role,
            Role::Connect("h:1".into())
        );
        assert!(args("--help").unwrap().is_none());
        assert!(args("--group 9").is_err());
        assert!(args("--window 0").is_err());
        assert!(args("--abi 5").is_err());
        assert!(args("--bogus").is_err());
        assert_eq!(
            args("--cpus 0,1").unwrap().unwrap().cpus,
            Some((0, Some(1)))
        );
        assert_eq!(args("--cpus=3").unwrap().unwrap().cpus, Some((3, None)));
        assert!(args("--cpus x").is_err());
    }

    #[test]
    fn params_round_trip() {
        let o = args("--sizes 8,1M,64M --group 2 --conns 3")
            .unwrap()
            .unwrap();
        let p = Params::from_options(&o, "tcp");
        assert_eq!(Params::decode(&p.encode()).unwrap(), p);
        assert!(Params::decode("params window=0").is_err());
    }

    #[test]
    fn default_iterations_are_bounded() {
        assert_eq!(bw_iters(8, 1, 1, None, None), BW_MAX_MSGS);
        assert_eq!(bw_iters(8, 4, 2, None, None), BW_MAX_MSGS / 8);
        assert_eq!(bw_iters(8, 8, 64, None, None), BW_MAX_MSGS / 512);
        assert_eq!(bw_iters(1 << 20, 8, 64, None, None), BW_MIN_ITERS);
        assert_eq!(bw_iters(64 << 20, 1, 1, None, None), BW_MIN_ITERS);
        assert_eq!(bw_iters(1 << 20, 1, 1, None, None), 512);
        assert_eq!(bw_iters(1 << 20, 1, 1, Some(3), None), 3);
        assert_eq!(lat_iters(64 << 20, None, None), LAT_MIN_ITERS);
        // --bytes 24M: 24 MiB per size for bandwidth, 6 MiB per direction for latency.
        assert_eq!(bw_iters(1 << 20, 1, 1, None, Some(24 << 20)), 24);
        assert_eq!(bw_iters(4 << 20, 1, 1, None, Some(24 << 20)), BW_MIN_ITERS);
        assert_eq!(lat_iters(4096, None, Some(24 << 20)), 1536);
        assert_eq!(lat_iters(1 << 20, None, Some(24 << 20)), LAT_MIN_ITERS);
    }

    #[test]
    fn layout_keeps_checked_slots_private() {
        let l = Layout::new(1000, 8, 100);
        assert_eq!(l.pool, 8);
        assert_eq!(l.stride, 1024);
        assert_eq!((l.recv_slot(0), l.recv_slot(99)), (0, 1));
        assert!((1..99).all(|m| (2..2 + l.pool).contains(&l.recv_slot(m))));
        assert_eq!(
            (l.send_slot(0), l.send_slot(50), l.send_slot(99)),
            (0, 2, 1)
        );
        let o = args("--sizes 8,256M --conns 2").unwrap().unwrap();
        let p = Params::from_options(&o, "tcp");
        assert_eq!((p.pool(8), p.pool(256 << 20)), (8, 1));
        assert_eq!(p.arena_bytes(), (3 << 28, 3 << 28));
    }

    #[test]
    fn patterns_detect_changes() {
        let mut b = vec![0u8; 1003];
        fill(&mut b, seed(1003, STREAM_BW, 0, 0));
        assert_eq!(mismatch(&b, seed(1003, STREAM_BW, 0, 0)), None);
        assert!(mismatch(&b, seed(1003, STREAM_BW, 0, 1)).is_some());
        b[1001] ^= 1;
        assert_eq!(
            mismatch(&b, seed(1003, STREAM_BW, 0, 0)).map(|m| m.0),
            Some(1001)
        );
    }

    #[test]
    fn phases_parse_and_travel_to_the_peer() {
        assert_eq!(Phases::parse("bw,lat").unwrap(), Phases::BOTH);
        assert_eq!(
            Phases::parse("lat").unwrap(),
            Phases {
                bw: false,
                lat: true
            }
        );
        assert!(Phases::parse("").is_err());
        assert!(Phases::parse("bw,x").is_err());
        let o = args("--phases bw --bytes 24M --sizes 8,1M")
            .unwrap()
            .unwrap();
        let p = Params::from_options(&o, "verbs");
        assert_eq!(Params::decode(&p.encode()).unwrap(), p);
        assert_eq!(p.phases.encode(), "bw");
        assert_eq!(p.plan[1].bw_iters, 24);
        // A params line without phases (an older peer) means both.
        let old = p.encode().replace(" phases=bw", "");
        assert_eq!(Params::decode(&old).unwrap().phases, Phases::BOTH);
        assert!(args("--plot x.csv").is_err(), "--plot needs --svg");
        let o = args("--compare a/perftest.csv --compare b.csv=ib_write_bw")
            .unwrap()
            .unwrap();
        assert_eq!(
            o.compare,
            vec![
                (PathBuf::from("a/perftest.csv"), "perftest".to_string()),
                (PathBuf::from("b.csv"), "ib_write_bw".to_string())
            ]
        );
    }

    #[test]
    fn csv_round_trips_with_missing_phases() {
        let rows = vec![
            Row {
                size: 8,
                gbps: Some(0.5),
                lat_us: None,
            },
            Row {
                size: 1 << 20,
                gbps: None,
                lat_us: Some(12.25),
            },
        ];
        let report = Report {
            rows: rows.clone(),
            title: "t".into(),
            notes: vec![],
            label: "l".into(),
        };
        let path = std::env::temp_dir().join(format!("nccl-net-bench-{}.csv", std::process::id()));
        write_csv(&report, &path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            text,
            "size_bytes,bandwidth_gbps,latency_us\n8,0.500000,\n1048576,,12.250\n"
        );
        assert_eq!(read_csv(&path).unwrap(), rows);
        std::fs::write(&path, "size_bytes,bandwidth_gbps,latency_us\n8,x,1\n").unwrap();
        assert!(read_csv(&path).is_err());
        let _ = std::fs::remove_file(&path);
        assert!(table_row(&rows[0]).ends_with('-'));
    }

    #[test]
    fn plot_axes_and_labels() {
        assert_eq!(nice_step(0.43), 0.5);
        assert_eq!(nice_step(2.1), 2.5);
        assert_eq!(nice_step(7.0), 10.0);
        assert_eq!(short_num(0.30000000000000004), "0.3");
        assert_eq!(short_num(2.0), "2");
        assert_eq!(time_label(0.5), "0.5 us");
        assert_eq!(time_label(2000.0), "2 ms");
        assert_eq!(sig3(1.98163), "1.98");
        assert_eq!(sig3(110.194), "110");
        let y = YAxis::linear(1.98, 0.0, 100.0);
        assert_eq!(y.ticks.last().unwrap().1, "2.5");
        assert_eq!(y.y(0.0), 100.0);
        let y = YAxis::log10(11.9, 25463.0, 0.0, 100.0);
        assert_eq!((y.lo, y.hi), (1.0, 5.0));
        let sizes = default_sizes();
        let x = XAxis::new(&sizes, 0.0, 800.0);
        assert_eq!((x.lo, x.hi), (3.0, 26.0));
        assert!(x.x(8) > 0.0 && x.x(64 << 20) < 800.0 && x.x(8) < x.x(16));
        let (labels, rotated) = x_labels(&x, &sizes);
        assert_eq!(labels.first().unwrap().1, "8 B");
        assert_eq!(labels.last().unwrap().1, "64 MiB");
        assert!(rotated, "32 MiB and 64 MiB are one power of two apart");
        let many: Vec<usize> = (3..27).map(|p| 1usize << p).collect();
        let (labels, rotated) = x_labels(&x, &many);
        assert!(!rotated && labels.len() < many.len());
    }

    #[test]
    fn svg_is_self_contained_and_escaped() {
        let rows = vec![
            Row {
                size: 8,
                gbps: Some(0.001),
                lat_us: Some(12.0),
            },
            Row {
                size: 1 << 20,
                gbps: Some(2.5),
                lat_us: Some(400.0),
            },
        ];
        let series = [
            Series {
                label: "plugin <tcp>",
                rows: rows.clone(),
            },
            Series {
                label: "ib_write_bw & lat",
                rows,
            },
        ];
        let svg = render_svg("a \"title\"", &["note".into()], &series);
        assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("a &quot;title&quot;") && svg.contains("plugin &lt;tcp&gt;"));
        assert!(svg.contains("ib_write_bw &amp; lat"));
        assert!(svg.contains(">8 B<") && svg.contains(">1 MiB<"));
        assert!(svg.contains("peak 2.50 GB/s at 1 MiB") && svg.contains("12.0 us at 8 B"));
        assert!(!svg.contains("href"), "no external references");
        assert_eq!(svg.matches("<text").count(), svg.matches("</text>").count());
        // Without any data the axes still draw.
        let empty = [Series {
            label: "x",
            rows: vec![],
        }];
        assert!(render_svg("t", &[], &empty).contains("</svg>"));
    }

    #[test]
    fn handles_hex_round_trip() {
        let h: [u8; 128] = std::array::from_fn(|i| (i * 3) as u8);
        assert_eq!(unhex(&hex(&h)).unwrap(), h);
        assert!(unhex("00").is_err());
    }
}
