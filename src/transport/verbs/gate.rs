//! What a receive's `test` reads without taking the comm's lock (see [`RecvGate`]): the proxy
//! tests a receive in a tight loop while its data is on the way, and such a test is one CQ
//! poll per rail that finds nothing. Completions a poll finds go to the locked call in the
//! batch they were polled into, so none is handed out twice or lost.

use std::sync::{
    atomic::{AtomicBool, AtomicU32, Ordering::Relaxed},
    Arc,
};

use super::cq::IDLE_LOOK_EVERY;
use super::rail::Rail;
use super::wire::SLOTS;
use crate::verbs::dma::WcBatch;
use crate::verbs::nic::Nic;

/// What [`RecvGate::poll`] found.
pub(crate) enum GatePoll {
    /// The receive waits and no CQ had anything: "not done", without the lock.
    Idle,
    /// This rail's CQ had completions, now in the caller's batch for the locked call.
    Found(usize),
    /// Anything else: the locked call decides (and polls itself).
    Lock,
}

/// A rail's NIC and CQ, as the gate polls it. The CQ handle is a clone, so the CQ outlives
/// the QPs in the comm's state.
type GateCq<N> = (Arc<N>, <N as Nic>::Cq);

/// One poll of rail `r`'s CQ into `wc`.
#[inline]
fn poll_rail<N: Nic>((nic, cq): &GateCq<N>, wc: &mut WcBatch, r: usize) -> GatePoll {
    match wc.try_poll(&**nic, cq) {
        Some(0) => GatePoll::Idle,
        Some(_) => GatePoll::Found(r),
        // The locked poll meets the error again and fails the comm with it.
        None => GatePoll::Lock,
    }
}

/// What an idle `test` reads without taking the comm's lock, and the one record of which
/// receives wait for their data. Only the holder of the comm's lock writes it (one progress
/// thread drives a comm), so its writes are plain loads and stores; a reader that found it
/// stale would only take the lock.
pub(crate) struct RecvGate<N: Nic> {
    /// Rail 0's CQ, which every comm has, and the other rails'.
    first: GateCq<N>,
    others: Box<[GateCq<N>]>,
    /// Per slot: the receive in it waits for its data.
    waiting: [AtomicBool; SLOTS],
    /// The comm has work only a locked call does (a clear-to-send held back, a failure to
    /// report, a peer gone): every test locks.
    lock: AtomicBool,
    /// Tests the gate looked at (wrapping).
    looks: AtomicU32,
}

impl<N: Nic> RecvGate<N> {
    /// The gate of a comm over `rails`: no receive waits.
    pub(crate) fn new(rails: &[Rail<N>]) -> Self {
        let cq = |r: &Rail<N>| (Arc::clone(&r.nic), r.cq.cq.clone());
        RecvGate {
            first: cq(&rails[0]),
            others: rails[1..].iter().map(cq).collect(),
            waiting: [const { AtomicBool::new(false) }; SLOTS],
            lock: AtomicBool::new(false),
            looks: AtomicU32::new(0),
        }
    }

    /// The test of request `id` without the lock: where receive `id` waits and the comm has
    /// nothing else to do, a poll of every rail's CQ into `wc`. Every [`IDLE_LOOK_EVERY`]th
    /// such test locks instead, to run what the locked poll does besides (the slow checks).
    #[inline]
    pub(crate) fn poll(&self, id: usize, wc: &mut WcBatch) -> GatePoll {
        let waits = self.waiting.get(id).is_some_and(|w| w.load(Relaxed));
        if !waits || self.lock.load(Relaxed) || self.lock_this_time() {
            return GatePoll::Lock;
        }
        match poll_rail(&self.first, wc, 0) {
            GatePoll::Idle => {}
            found_or_lock => return found_or_lock,
        }
        for (r, cq) in self.others.iter().enumerate() {
            match poll_rail(cq, wc, r + 1) {
                GatePoll::Idle => {}
                found_or_lock => return found_or_lock,
            }
        }
        GatePoll::Idle
    }

    /// Counts a test the gate looked at: whether it locks after all, as every
    /// [`IDLE_LOOK_EVERY`]th does.
    #[inline]
    fn lock_this_time(&self) -> bool {
        // Load and store, not an atomic add: one thread counts, and a lost count is harmless.
        let n = self.looks.load(Relaxed).wrapping_add(1);
        self.looks.store(n, Relaxed);
        n % IDLE_LOOK_EVERY == 0
    }

    /// Tests looked at so far (wrapping): when it moves, the caller is testing.
    pub(crate) fn looks(&self) -> u32 {
        self.looks.load(Relaxed)
    }

    /// Whether the receive in `slot` waits for its data.
    #[inline]
    pub(crate) fn waits(&self, slot: usize) -> bool {
        self.waiting[slot].load(Relaxed)
    }

    /// The lock holder posted a receive in `slot`: it waits for its data.
    #[inline]
    pub(crate) fn posted(&self, slot: usize) {
        self.waiting[slot].store(true, Relaxed);
    }

    /// The lock holder saw the last of `slot`'s data arrive.
    #[inline]
    pub(crate) fn arrived(&self, slot: usize) {
        self.waiting[slot].store(false, Relaxed);
    }

    /// The lock holder's verdict of the last locked call.
    #[inline]
    pub(crate) fn lock_is_wanted(&self) -> bool {
        self.lock.load(Relaxed)
    }

    /// The lock holder's verdict at the end of a locked call: whether the comm has work only
    /// a locked call does.
    #[inline]
    pub(crate) fn lock_wanted(&self, yes: bool) {
        self.lock.store(yes, Relaxed);
    }
}
