//! The latency phase of one size: ping-pong on connection 0, run the way a latency-bound
//! NCCL exchange runs. Receives are posted `depth` round trips ahead (NCCL's proxy keeps up
//! to 8 steps posted), and each side sends its next message before it re-posts the receive
//! it last consumed. The reported value is the median round trip over two, after a few
//! untimed warm-up round trips.

use std::time::Instant;

use nccl_net_erdma_tools::client::{Net, Opaque};

use crate::{
    conn::{irecv_group, Conn, Scratch},
    data::{check_pattern, fill, seed, Layout, STREAM_PING, STREAM_PONG},
    plan::{lat_warmup, SizePlan, MAX_GROUP},
    plugin::PluginResult,
    poll::{post, wait},
    session::Side,
    Res,
};

/// Runs the round trips of `plan`. Side A returns in `s.samples` the time between the
/// starts of consecutive round trips, so everything a round trip costs (re-posting
/// included) is counted.
pub fn ping_pong(
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

/// The median of `v` (sorted in place); 0 for none.
pub fn median(v: &mut [u64]) -> f64 {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_even_and_none() {
        assert_eq!(median(&mut [5, 1, 3]), 3.0);
        assert_eq!(median(&mut [4, 1, 3, 2]), 2.5);
        assert_eq!(median(&mut []), 0.0);
    }
}
