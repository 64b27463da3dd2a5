//! `--idle-probe K`: the cost of the calls a poll loop makes while nothing can happen, to
//! split the cost per message measured in the bandwidth loop into idle polling and work
//! (scripts/perf/cpu-cost.sh now counts each kind of call on its own: `--script`, [`crate::script`]).
//! On connection 0, before the sizes: side A makes K `isend`s before the peer has
//! posted a receive (each must return NULL), then side B posts one 8-byte receive and makes
//! K `test`s of it before anything is sent; then the message goes through.
//!
//! The loops are always inlined into `crate::probe_idle_send` / `crate::probe_idle_recv`,
//! the functions callgrind can count instructions in (see main.rs).

use std::ffi::c_int;

use nccl_net_erdma_tools::client::{Net, Opaque};

use crate::{
    bandwidth::Calls,
    conn::{irecv_group, Conn},
    control::Control,
    plan::MAX_GROUP,
    plugin::PluginResult,
    poll::{post, wait},
    session::Side,
    Res,
};

/// Side A's `k` idle `isend`s on `c`.
#[inline(always)]
pub fn idle_sends(net: &Net, c: &Conn, k: usize, calls: &mut Calls) -> Res<()> {
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

/// Side B's `k` idle `test`s of `req`, a receive the peer has not sent to yet.
#[inline(always)]
pub fn idle_tests(net: &Net, req: Opaque, k: usize, calls: &mut Calls) -> Res<()> {
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

/// Runs the probe with the peer; side A prints what each side did.
pub fn idle_probe(
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
            crate::probe_idle_send(net, c, k, &mut calls)?;
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
            crate::probe_idle_recv(net, r, k, &mut calls)?;
            ctl.send(&format!("probe-recv {}", calls.encode()))?;
            wait(net, r, 8, &what)?;
            ctl.send("probe-done")?;
        }
    }
    Ok(())
}
