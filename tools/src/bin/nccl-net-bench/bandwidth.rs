//! The bandwidth phase of one size: side A sends, side B receives, on every connection at
//! once from one thread (as NCCL's progress thread does), requests tested oldest first.
//! Side B keeps `window` grouped receives (of `group` messages) in flight per connection and
//! times from its first `irecv` to its last completion; side A keeps `window * group` sends
//! in flight. Both count their plugin calls for `--stats`.
//!
//! The loops are always inlined into `crate::bw_send` / `crate::bw_recv`, the functions
//! callgrind can count instructions in (see main.rs).

use std::{ffi::c_int, time::Duration, time::Instant};

use nccl_net_erdma_tools::client::{Net, Opaque};

use crate::{
    conn::{irecv_group, Conn, Scratch},
    data::{check_pattern, fill, seed, STREAM_BW},
    plan::{Params, SizePlan, MAX_GROUP},
    plugin::PluginResult,
    poll::Watchdog,
    Res,
};

/// Plugin calls of one side's bandwidth phase (`--stats`): the posts (`isend` or `irecv`)
/// and how many of them the plugin answered "not now" (NULL), the `test`s and how many of
/// them found the request not done yet.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Calls {
    pub posts: u64,
    pub posts_null: u64,
    pub tests: u64,
    pub tests_idle: u64,
}

impl Calls {
    /// The counts as side B sends them on its `bw` and `probe-recv` lines.
    pub fn encode(&self) -> String {
        format!(
            "{} {} {} {}",
            self.posts, self.posts_null, self.tests, self.tests_idle
        )
    }

    pub fn decode<'a>(mut w: impl Iterator<Item = &'a str>) -> Option<Self> {
        let mut next = || w.next()?.parse().ok();
        Some(Calls {
            posts: next()?,
            posts_null: next()?,
            tests: next()?,
            tests_idle: next()?,
        })
    }

    /// One `stats` line: calls per message of `msgs` messages; scripts may read its
    /// `key=value` words up to `per_message:`.
    pub fn line(&self, size: usize, side: &str, post: &str, msgs: usize) -> String {
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

/// Per-connection progress of one data loop.
#[derive(Debug, Clone, Copy, Default)]
pub struct Progress {
    posted: usize,
    done: usize,
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

/// The loop both sides run, on every connection in turn from one thread as NCCL's
/// progress thread does, until each has `total` requests done: post while fewer than
/// `in_flight` are outstanding and the plugin accepts (`post(k, i)` makes request `i` of
/// connection `k`; NULL is "not now"), then `test` the oldest ones until one is not done
/// (`test(k, i, request)` also checks what completed). Counts the calls in `s.calls`; a
/// stall is reported with `what` and every connection's progress.
#[inline(always)]
fn poll_all(
    s: &mut Scratch,
    total: usize,
    in_flight: usize,
    what: &dyn Fn() -> String,
    mut post: impl FnMut(usize, usize) -> Res<Opaque>,
    mut test: impl FnMut(usize, usize, Opaque) -> Res<bool>,
) -> Res<()> {
    s.progress.fill(Progress::default());
    s.calls = Calls::default();
    let calls = &mut s.calls;
    let mut left = s.progress.len();
    let mut dog = Watchdog::new();
    while left > 0 {
        let mut progressed = false;
        for (k, (st, ring)) in s.progress.iter_mut().zip(&mut s.rings).enumerate() {
            if st.done == total {
                continue;
            }
            while st.posted < total && st.posted - st.done < in_flight {
                let r = post(k, st.posted)?;
                calls.posts += 1;
                if r.is_null() {
                    calls.posts_null += 1;
                    break;
                }
                ring[st.posted % in_flight] = r;
                st.posted += 1;
                progressed = true;
            }
            while st.done < st.posted {
                let done = test(k, st.done, ring[st.done % in_flight])?;
                calls.tests += 1;
                if !done {
                    calls.tests_idle += 1;
                    break;
                }
                st.done += 1;
                progressed = true;
            }
            if st.done == total {
                left -= 1;
            }
        }
        if progressed {
            dog.progressed();
        } else {
            dog.idle(|| format!("{}: {}", what(), progress_text(&s.progress, total)))?;
        }
    }
    Ok(())
}

/// Side A: `plan.bw_iters * group` sends per connection, `window * group` in flight.
#[inline(always)]
pub fn send(
    net: &Net,
    conns: &mut [Conn],
    s: &mut Scratch,
    params: &Params,
    plan: &SizePlan,
) -> Res<()> {
    let size = plan.size;
    let layout = params.layout(plan);
    let total = layout.total;
    for (k, c) in conns.iter_mut().enumerate() {
        fill(c.tx.slot(&layout, 0), seed(size, STREAM_BW, k, 0));
        fill(c.tx.slot(&layout, 1), seed(size, STREAM_BW, k, total - 1));
    }
    // Raw pointers only after the last use of the buffers as slices.
    let ptrs: Vec<[*mut u8; 3]> = conns
        .iter_mut()
        .map(|c| std::array::from_fn(|i| c.tx.slot_ptr(&layout, i)))
        .collect();
    let conns = &*conns;
    let mut sizes = [0 as c_int; 64];
    let post = |k: usize, m: usize| {
        let (c, tag) = (&conns[k], (m % params.group) as i32);
        net.isend(c.send, ptrs[k][layout.send_slot(m)], size, tag, c.tx.mh)
            .call(|| format!("isend (size {size}, connection {k}, message {m})"))
    };
    let test = |k: usize, m: usize, req: Opaque| {
        let what = || format!("test of isend (size {size}, connection {k}, message {m})");
        sizes[0] = -1;
        let done = net.test(req, Some(&mut sizes[..1])).call(what)?;
        if done && sizes[0] as usize != size {
            return Err(format!("{} reported size {}", what(), sizes[0]));
        }
        Ok(done)
    };
    let what = || format!("bandwidth sends of size {size}");
    poll_all(s, total, params.window * params.group, &what, post, test)
}

/// Side B: `plan.bw_iters` grouped receives per connection, `window` in flight. Returns
/// the time from the first `irecv` to the last completion.
#[inline(always)]
pub fn recv(
    net: &Net,
    conns: &mut [Conn],
    s: &mut Scratch,
    params: &Params,
    plan: &SizePlan,
) -> Res<Duration> {
    let (size, group) = (plan.size, params.group);
    let layout = params.layout(plan);
    for c in conns.iter_mut() {
        c.rx.slot(&layout, 0).fill(0x5a);
        c.rx.slot(&layout, 1).fill(0x5a);
    }
    let bases: Vec<*mut u8> = conns
        .iter_mut()
        .map(|c| c.rx.slot_ptr(&layout, 0))
        .collect();
    let receivers = &*conns;
    let mut bufs = [std::ptr::null_mut::<u8>(); MAX_GROUP];
    let post = |k: usize, i: usize| {
        for (e, b) in bufs.iter_mut().enumerate().take(group) {
            *b = bases[k].wrapping_add(layout.recv_slot(i * group + e) * layout.stride);
        }
        let c = &receivers[k];
        irecv_group(net, c.recv, &bufs, group, size, c.rx.mh)
            .call(|| format!("irecv (size {size}, connection {k}, receive {i})"))
    };
    let mut sizes = [0 as c_int; 64];
    let test = |k: usize, i: usize, req: Opaque| {
        let what = || format!("test of irecv (size {size}, connection {k}, receive {i})");
        sizes[..group].fill(-1);
        let done = net.test(req, Some(&mut sizes[..])).call(what)?;
        if done {
            if let Some(e) = sizes[..group].iter().position(|&z| z as usize != size) {
                return Err(format!(
                    "{} reported size {} for message {e} of {group}",
                    what(),
                    sizes[e]
                ));
            }
        }
        Ok(done)
    };
    let what = || format!("bandwidth receives of size {size}");
    let start = Instant::now();
    poll_all(s, plan.bw_iters, params.window, &what, post, test)?;
    let elapsed = start.elapsed();
    for (k, c) in conns.iter_mut().enumerate() {
        let last = layout.total - 1;
        let what = |m: usize| move || format!("size {size} connection {k} message {m} (bandwidth)");
        check_pattern(c.rx.slot(&layout, 0), seed(size, STREAM_BW, k, 0), what(0))?;
        if last > 0 {
            let seed = seed(size, STREAM_BW, k, last);
            check_pattern(c.rx.slot(&layout, 1), seed, what(last))?;
        }
    }
    Ok(elapsed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_travel_and_print_per_message() {
        let c = Calls {
            posts: 30,
            posts_null: 10,
            tests: 40,
            tests_idle: 20,
        };
        assert_eq!(Calls::decode(c.encode().split_whitespace()), Some(c));
        assert_eq!(Calls::decode("1 2 3".split_whitespace()), None);
        assert_eq!(
            c.line(8, "A", "isend", 20),
            "stats size=8 side=A messages=20 isend=30 isend_null=10 test=40 test_idle=20 \
             per_message: isend 1.500 (NULL 0.500), test 2.000 (idle 1.000)"
        );
    }
}
