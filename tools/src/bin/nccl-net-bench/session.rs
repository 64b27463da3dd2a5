//! The run itself, once the control channel is up: side A decides the run and sends it,
//! side B opens the plugin the same way, both connect, then they step through the sizes in
//! lock-step over the control channel and both end with the same [`Report`].
//!
//! The printed lines (header, table, `stats`, `idle probe`) are read by scripts and people:
//! their text stays as it is.

use std::fmt::Write as _;

use crate::{
    args::{Options, Role},
    bandwidth::Calls,
    conn::{close_all, connect_all, Conn, Scratch},
    control::{field, Control, PROTOCOL},
    idle::idle_probe,
    latency::{median, ping_pong},
    plan::{Params, Phases, SizePlan, POOL_BYTES},
    plugin::{check_group, open_plugin, Plugin, TRANSPORT_ENV},
    report::{human, table_row, Report, Row, TABLE_HEAD},
    Res,
};

/// Which side of the run this process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Listens, decides, sends the bandwidth stream, starts the ping-pong.
    A,
    /// Connects, receives the bandwidth stream, answers the ping-pong.
    B,
}

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
            iterations(params)
        ),
        "GB/s: payload of all connections / receiver time from first irecv to last completion; \
         latency: median round trip / 2 on connection 0"
            .into(),
    ];
    (title, notes)
}

fn iterations(params: &Params) -> String {
    params
        .iters
        .map_or_else(|| "scaled per size".into(), |n| format!("{n} per size"))
}

/// The connected run: what every size's steps use.
struct Live<'a> {
    p: &'a Plugin,
    ctl: &'a mut Control,
    params: &'a Params,
    conns: Vec<Conn>,
    scratch: Scratch,
}

impl Live<'_> {
    /// One size on side A: sends the bandwidth stream, takes B's time and counts, starts
    /// the ping-pong, and tells B the row. With `stats`, adds both sides' call counts.
    fn size_a(&mut self, plan: &SizePlan, stats: Option<&mut Vec<String>>) -> Res<Row> {
        let (net, params, s) = (&self.p.net, self.params, &mut self.scratch);
        let msgs = plan.bw_iters * params.group * params.conns;
        let mut gbps = None;
        if params.phases.bw {
            self.ctl.expect("ready")?;
            crate::bw_send(net, &mut self.conns, s, params, plan)?;
            let bw = self.ctl.expect("bw")?;
            let mut w = bw.split_whitespace();
            let ns: u64 = w
                .next()
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| format!("bad bandwidth result from the peer: {bw:?}"))?;
            let peer_calls =
                Calls::decode(w).ok_or_else(|| format!("bad call counts from the peer: {bw:?}"))?;
            gbps = Some((msgs * plan.size) as f64 / ns.max(1) as f64);
            if let Some(lines) = stats {
                lines.push(s.calls.line(plan.size, "A", "isend", msgs));
                lines.push(peer_calls.line(plan.size, "B", "irecv", msgs));
            }
        }
        let mut lat_us = None;
        if params.phases.lat {
            ping_pong(net, Side::A, &mut self.conns[0], s, plan, params.window)?;
            lat_us = Some(median(&mut s.samples) / 2.0 / 1e3);
            self.ctl.expect("lat-ok")?;
        }
        let result = format!("result {} {}", opt_text(gbps), opt_text(lat_us));
        self.ctl.send(&result)?;
        Ok(Row {
            size: plan.size,
            gbps,
            lat_us,
        })
    }

    /// One size on side B: receives and times the bandwidth stream, answers the ping-pong,
    /// and takes the row from A.
    fn size_b(&mut self, plan: &SizePlan) -> Res<Row> {
        let (net, params, s) = (&self.p.net, self.params, &mut self.scratch);
        if params.phases.bw {
            self.ctl.send("ready")?;
            let t = crate::bw_recv(net, &mut self.conns, s, params, plan)?;
            self.ctl
                .send(&format!("bw {} {}", t.as_nanos(), s.calls.encode()))?;
        }
        if params.phases.lat {
            ping_pong(net, Side::B, &mut self.conns[0], s, plan, params.window)?;
            self.ctl.send("lat-ok")?;
        }
        let r = self.ctl.expect("result")?;
        let mut w = r.split_whitespace();
        match (opt_parse(w.next()), opt_parse(w.next())) {
            (Some(gbps), Some(lat_us)) => Ok(Row {
                size: plan.size,
                gbps,
                lat_us,
            }),
            _ => Err(format!("bad result line from the peer: {r:?}")),
        }
    }
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
    let conns = connect_all(p, ctl, params)?;
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
    let mut live = Live {
        p,
        ctl,
        params,
        conns,
        scratch: Scratch::new(params),
    };
    if params.probe > 0 {
        let c = &mut live.conns[0];
        idle_probe(&p.net, side, live.ctl, c, params.probe, quiet)?;
    }
    if !quiet {
        println!("{TABLE_HEAD}");
    }
    let mut rows = Vec::with_capacity(params.plan.len());
    let mut stats_lines = Vec::new();
    for plan in &params.plan {
        let row = match side {
            Side::A => live.size_a(plan, stats.then_some(&mut stats_lines))?,
            Side::B => live.size_b(plan)?,
        };
        if !quiet {
            println!("{}", table_row(&row));
        }
        rows.push(row);
    }
    close_all(&p.net, live.conns)?;
    live.ctl.send("done")?;
    live.ctl.expect("done")?;
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
            "window {}, group {}, conns {}, iterations {}{}",
            params.window,
            params.group,
            params.conns,
            iterations(params),
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

/// Device names travel as one word of a control line.
fn device_word(p: &Plugin) -> String {
    p.props.name.replace(char::is_whitespace, "_")
}

/// `device (ncclNetPlugin_vN)` of the peer, from its first line.
fn peer_text(line: &str) -> String {
    format!(
        "{} (ncclNetPlugin_v{})",
        field(line, "device").unwrap_or("?"),
        field(line, "abi").unwrap_or("?")
    )
}

/// Side A after the control connection is up.
pub fn run_a(o: &Options, p: &Plugin, ctl: &mut Control) -> Res<Report> {
    let params = Params::from_options(o, &p.transport);
    check_group(p, &params)?;
    params.check_memory(if o.role == Role::Local { 2 } else { 1 })?;
    ctl.send(&format!(
        "{PROTOCOL} abi={} device={}",
        p.net.version(),
        device_word(p)
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
    let mut header = header_lines(p, &params, &peer_text(&hello));
    header.extend(cpus_line(o));
    session(p, Side::A, ctl, &params, header, o.quiet, o.stats)
}

/// Side B: receives the run, opens the plugin like side A, then runs it.
pub fn run_b(o: &Options, ctl: &mut Control) -> Res<Report> {
    let first = ctl.recv()?.to_string();
    if first.split_whitespace().next() != Some(PROTOCOL) {
        return Err(format!("the peer is not {PROTOCOL}: {first:?}"));
    }
    let params = Params::decode(ctl.recv()?)?;
    params.check_memory(1)?;
    if o.run_options_given && !o.quiet {
        println!("note: --sizes/--iters/--window/--group/--conns come from the listening side");
    }
    let mut p = open_plugin(o, Some(&params.transport))?;
    check_group(&p, &params)?;
    ctl.send(&format!(
        "hello transport={} device={} abi={}",
        p.transport,
        device_word(&p),
        p.net.version()
    ))?;
    if p.transport != params.transport {
        return Err(format!(
            "this side uses transport {}, the peer {}: set the same {TRANSPORT_ENV} on both",
            p.transport, params.transport
        ));
    }
    let mut header = header_lines(&p, &params, &peer_text(&first));
    header.extend(cpus_line(o));
    let report = session(&p, Side::B, ctl, &params, header, o.quiet, false)?;
    p.finalize()?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_values_travel_with_missing_phases() {
        assert_eq!(opt_text(None), "-");
        assert_eq!(opt_parse(Some(&opt_text(Some(0.25)))), Some(Some(0.25)));
        assert_eq!(opt_parse(Some("-")), Some(None));
        assert_eq!(opt_parse(Some("x")), None);
        assert_eq!(opt_parse(None), None);
        assert_eq!(
            peer_text("nccl-net-bench/1 abi=9 device=erdma-tcp-lo"),
            "erdma-tcp-lo (ncclNetPlugin_v9)"
        );
        assert_eq!(peer_text("hello"), "? (ncclNetPlugin_v?)");
    }

    #[test]
    fn cpus_line_names_the_child_only_in_the_local_run() {
        let o = Options::try_parse_line("--cpus 0,1").unwrap();
        assert_eq!(cpus_line(&o).unwrap(), "cpus: side A on 0, side B on 1");
        let o = Options::try_parse_line("--cpus 2,3 --listen").unwrap();
        assert_eq!(cpus_line(&o).unwrap(), "cpus: this side on 2");
        assert_eq!(cpus_line(&Options::try_parse_line("").unwrap()), None);
    }
}
