//! Connections to the peer: swapping the plugin's handles over the control channel,
//! connecting and accepting until every connection is up, registering each connection's
//! buffers once for the whole run, and the state the data loops reuse for every size.

use nccl_net_erdma::ffi::NCCL_PTR_HOST;
use nccl_net_erdma_tools::client::{self, Code, Net, Opaque};

use crate::{
    bandwidth::{Calls, Progress},
    control::Control,
    data::Arena,
    plan::{Params, MAX_GROUP},
    plugin::{Plugin, PluginResult},
    poll::Watchdog,
    Res,
};

/// One connection pair to the peer: our send comm and the receive comm from the same index
/// of the peer.
pub struct Conn {
    pub send: Opaque,
    pub recv: Opaque,
    pub tx: Arena,
    pub rx: Arena,
}

/// Preallocated state of the data loops, reused for every size, so the timed loops
/// allocate nothing of their own.
pub struct Scratch {
    /// Per connection, a ring of `window * group` requests in flight.
    pub rings: Vec<Vec<Opaque>>,
    pub progress: Vec<Progress>,
    pub samples: Vec<u64>,
    /// This side's calls in the last bandwidth phase.
    pub calls: Calls,
}

impl Scratch {
    pub fn new(params: &Params) -> Self {
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

/// Sets up `params.conns` connections each way and registers their buffers.
pub fn connect_all(p: &Plugin, ctl: &mut Control, params: &Params) -> Res<Vec<Conn>> {
    let net = &p.net;
    let mut listens = Vec::with_capacity(params.conns);
    let mut ours = Vec::with_capacity(params.conns);
    for k in 0..params.conns {
        let mut h = [0u8; 128];
        listens.push(
            net.listen(0, &mut h)
                .call(|| format!("listen (connection {k})"))?,
        );
        ours.push(client::handle_to_hex(&h));
    }
    ctl.send(&format!("handles {}", ours.join(",")))?;
    let theirs = ctl.expect("handles")?;
    let mut handles = theirs
        .split(',')
        .map(|h| client::handle_from_hex(h).map_err(|e| format!("bad handle from the peer: {e}")))
        .collect::<Res<Vec<_>>>()?;
    if handles.len() != params.conns {
        return Err(format!(
            "the peer sent {} handles, expected {}",
            handles.len(),
            params.conns
        ));
    }
    // NCCL's service thread polls both stage machines round-robin; so do we (blocking in
    // one would deadlock when the peer waits in the other).
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

pub fn close_all(net: &Net, conns: Vec<Conn>) -> Res<()> {
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

/// Posts one receive of `n` buffers with tags `0..n`. Every argument array lives on the
/// stack, and the client's `irecv_signed` builds its C arrays on the stack too (its
/// `irecv` would allocate a vector per call), so the timed loops allocate nothing.
pub fn irecv_group(
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
