//! What an idle receive `test` reads without taking the comm's lock (see [`RecvGate`]): the
//! proxy tests a receive in a tight loop while its data is on the way, and such a test is one
//! CQ poll per rail that finds nothing. Completions a poll finds go to the locked call in the
//! batch they were polled into, so none is handed out twice or lost.

use std::sync::{
    atomic::{AtomicU32, Ordering::Relaxed},
    Arc,
};

use super::cq::IDLE_LOOK_EVERY;
use super::rail::Rail;
use super::wire::SLOTS;
use crate::verbs::dma::WcBatch;
use crate::verbs::nic::Nic;

/// What [`RecvGate::look`] concluded.
pub(crate) enum Look {
    /// The receive still waits and rail 0's CQ had nothing, on a comm of one rail: "not
    /// done", without the lock.
    Idle,
    /// Rail 0's CQ had completions, now in the caller's batch for the locked call.
    Found,
    /// Rail 0's CQ had nothing, and the comm has more rails: see [`RecvGate::look_further`].
    Further,
    /// Anything else: the locked call decides (and polls itself).
    Lock,
}

/// What [`RecvGate::look_further`] concluded.
pub(crate) enum LookFurther {
    Idle,
    /// This rail's CQ had completions, now in the caller's batch for the locked call.
    Found(usize),
    Lock,
}

/// A rail's NIC and CQ, as the gate polls it. The CQ handle is a clone, so the CQ outlives
/// the QPs in the comm's state.
type GateCq<N> = (Arc<N>, <N as Nic>::Cq);

/// What an idle `test` reads without taking the comm's lock: which receives still wait for
/// their data, as the last locked call left them, and the CQs the data's completions come
/// to. One progress thread drives a comm, so these are its own writes; were they stale, the
/// lock decides.
pub(crate) struct RecvGate<N: Nic> {
    /// Rail 0's CQ, and the other rails'.
    first: GateCq<N>,
    others: Box<[GateCq<N>]>,
    /// One bit per slot whose receive waits for data, while the comm is quiet; else 0, and
    /// every test takes the lock.
    waiting: AtomicU32,
    /// Tests answered [`Look::Idle`].
    idle_calls: AtomicU32,
}

impl<N: Nic> RecvGate<N> {
    /// The gate of a comm over `rails`; it answers nothing until [`Self::publish`]ed.
    pub(crate) fn new(rails: &[Rail<N>]) -> Self {
        let cq = |r: &Rail<N>| (Arc::clone(&r.nic), r.cq.cq.clone());
        RecvGate {
            first: cq(&rails[0]),
            others: rails[1..].iter().map(cq).collect(),
            waiting: AtomicU32::new(0),
            idle_calls: AtomicU32::new(0),
        }
    }

    /// Whether `test` of request `id` can be answered without the lock: the receive waits,
    /// and a poll of rail 0's CQ into `wc` finds nothing (with more rails, see
    /// [`Self::look_further`]). Every [`IDLE_LOOK_EVERY`]th such test takes the lock anyway,
    /// to run what the locked poll does besides (the slow checks).
    #[inline(always)]
    pub(crate) fn look(&self, id: usize, wc: &mut WcBatch) -> Look {
        if id >= SLOTS || self.waiting.load(Relaxed) & (1 << id) == 0 {
            return Look::Lock;
        }
        let (nic, cq) = &self.first;
        match wc.poll(&**nic, cq) {
            Ok(0) if self.others.is_empty() => {}
            Ok(0) => return Look::Further,
            Ok(_) => return Look::Found,
            // The locked poll meets the error again and fails the comm with it.
            Err(_) => return Look::Lock,
        }
        if self.idle_call() {
            Look::Lock
        } else {
            Look::Idle
        }
    }

    /// [`Self::look`] of a comm over several rails, rail 0 found empty: the CQs of the rest.
    pub(crate) fn look_further(&self, wc: &mut WcBatch) -> LookFurther {
        for (r, (nic, cq)) in self.others.iter().enumerate() {
            match wc.poll(&**nic, cq) {
                Ok(0) => {}
                Ok(_) => return LookFurther::Found(r + 1),
                Err(_) => return LookFurther::Lock,
            }
        }
        if self.idle_call() {
            LookFurther::Lock
        } else {
            LookFurther::Idle
        }
    }

    /// Counts a test answered "not done" here: whether it takes the lock after all, as every
    /// [`IDLE_LOOK_EVERY`]th does.
    #[inline(always)]
    fn idle_call(&self) -> bool {
        // Load and store, not an atomic add: one thread counts, and a lost count is harmless.
        let n = self.idle_calls.load(Relaxed).wrapping_add(1);
        self.idle_calls.store(n, Relaxed);
        n % IDLE_LOOK_EVERY == 0
    }

    /// Records what a locked call left: one bit per slot whose receive waits for data, that
    /// the gate may answer for (none while the comm is not quiet).
    #[inline(always)]
    pub(crate) fn publish(&self, waiting: u32) {
        self.waiting.store(waiting, Relaxed);
    }

    /// Tests answered "not done" so far (wrapping): when it moves, the caller is testing.
    #[inline(always)]
    pub(crate) fn idle_calls(&self) -> u32 {
        self.idle_calls.load(Relaxed)
    }
}
