//! The run as both sides agree on it: what is measured per size, how many iterations, and
//! the `params` line in which side A sends all of it to side B.
//!
//! Default iteration counts scale with the size so that each size moves a bounded amount of
//! data in a bounded number of messages: small sizes are capped by message count, large ones
//! by bytes.

use crate::{args::Options, data::Layout, Res};

/// `NCCL_NET_MAX_REQUESTS`: the most receives a comm must hold in flight.
pub const MAX_WINDOW: usize = 32;
/// `maxRecvs` of NCCL IB and of this plugin: the largest grouped receive.
pub const MAX_GROUP: usize = 8;
/// The most connections one run opens.
pub const MAX_CONNS: usize = 64;
/// Largest message (the plugin's `maxP2pBytes`).
pub const MAX_SIZE: usize = 1 << 30;
/// Most idle calls per side of `--idle-probe`.
pub const MAX_PROBE: usize = 10_000_000;
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
pub const POOL_BYTES: usize = 512 << 20;

/// Which measurements run per size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Phases {
    pub bw: bool,
    pub lat: bool,
}

impl Phases {
    pub const BOTH: Phases = Phases {
        bw: true,
        lat: true,
    };

    /// `bw`, `lat`, `bw,lat` (also `bandwidth`, `latency`): from `--phases` and the params
    /// line.
    pub fn parse(s: &str) -> Res<Self> {
        let mut p = Phases {
            bw: false,
            lat: false,
        };
        for w in s.split(',').map(str::trim).filter(|w| !w.is_empty()) {
            match w {
                "bw" | "bandwidth" => p.bw = true,
                "lat" | "latency" => p.lat = true,
                _ => return Err(format!("unknown phase {w:?} (bw, lat)")),
            }
        }
        if !(p.bw || p.lat) {
            return Err("needs bw, lat or both".into());
        }
        Ok(p)
    }

    pub fn encode(&self) -> &'static str {
        match (self.bw, self.lat) {
            (true, true) => "bw,lat",
            (true, false) => "bw",
            _ => "lat",
        }
    }
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
pub fn lat_warmup(iters: usize) -> usize {
    (iters / 10).clamp(1, 50)
}

/// One size of the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SizePlan {
    pub size: usize,
    pub bw_iters: usize,
    pub lat_iters: usize,
}

/// What side A decides and sends to side B.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Params {
    pub window: usize,
    pub group: usize,
    pub conns: usize,
    /// `--iters` of side A, if given (else iterations scale with the size).
    pub iters: Option<usize>,
    /// What runs per size.
    pub phases: Phases,
    /// `--idle-probe`: idle calls per side before the sizes (0: none).
    pub probe: usize,
    pub transport: String,
    pub plan: Vec<SizePlan>,
}

impl Params {
    pub fn from_options(o: &Options, transport: &str) -> Self {
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
    pub fn pool(&self, size: usize) -> usize {
        let in_flight = self.window * self.group;
        (POOL_BYTES / self.conns / Layout::stride(size)).clamp(1, in_flight)
    }

    /// Where the bandwidth phase of `size` puts its messages.
    pub fn layout(&self, plan: &SizePlan) -> Layout {
        Layout::new(plan.size, self.pool(plan.size), plan.bw_iters * self.group)
    }

    /// Bytes of the (send, receive) buffers of one connection: enough for every size.
    pub fn arena_bytes(&self) -> (usize, usize) {
        self.plan.iter().fold((64, 64), |(tx, rx), s| {
            let l = self.layout(s);
            (tx.max(l.send_bytes()), rx.max(l.recv_bytes()))
        })
    }

    /// Errors when `processes` processes of this run would not fit in this host's memory.
    pub fn check_memory(&self, processes: usize) -> Res<()> {
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

    pub fn encode(&self) -> String {
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

    /// The params line from the peer, checked against the same limits as the command line
    /// (the peer may be another build).
    pub fn decode(line: &str) -> Res<Self> {
        let bad = || format!("bad params line from the peer: {line:?}");
        let mut p = Params {
            window: 0,
            group: 0,
            conns: 0,
            iters: None,
            // An older peer sends no phases: it ran both.
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
                // A newer peer's key: ignored, so the protocol can grow.
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

#[cfg(test)]
mod tests {
    use super::*;

    fn params(line: &str, transport: &str) -> Params {
        Params::from_options(&Options::try_parse_line(line).unwrap(), transport)
    }

    #[test]
    fn params_round_trip() {
        let p = params("--sizes 8,1M,64M --group 2 --conns 3", "tcp");
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
    fn pool_and_arena_fit_the_largest_size() {
        let p = params("--sizes 8,256M --conns 2", "tcp");
        assert_eq!((p.pool(8), p.pool(256 << 20)), (8, 1));
        assert_eq!(p.arena_bytes(), (3 << 28, 3 << 28));
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
        let p = params("--phases bw --bytes 24M --sizes 8,1M", "verbs");
        assert_eq!(Params::decode(&p.encode()).unwrap(), p);
        assert_eq!(p.phases.encode(), "bw");
        assert_eq!(p.plan[1].bw_iters, 24);
        // A params line without phases (an older peer) means both.
        let old = p.encode().replace(" phases=bw", "");
        assert_eq!(Params::decode(&old).unwrap().phases, Phases::BOTH);
    }
}
