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

/// What [`RecvGate::poll`] or [`RecvGate::look`] concluded.
pub(crate) enum Look {
    /// The poll found nothing: "not done", without the lock.
    Idle,
    /// The poll found completions, now in the caller's batch for the locked call.
    Found,
    /// The receive still waits, on a comm of several rails: see [`RecvGate::look_further`].
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
    /// Tests the gate looked at for the lock.
    looks: AtomicU32,
}

impl<N: Nic> RecvGate<N> {
    /// The gate of a comm over `rails`; it answers nothing until [`Self::publish`]ed.
    pub(crate) fn new(rails: &[Rail<N>]) -> Self {
        let cq = |r: &Rail<N>| (Arc::clone(&r.nic), r.cq.cq.clone());
        RecvGate {
            first: cq(&rails[0]),
            others: rails[1..].iter().map(cq).collect(),
            waiting: AtomicU32::new(0),
            looks: AtomicU32::new(0),
        }
    }

    /// Whether `test` of request `id` may be answered by [`Self::poll`], without the lock:
    /// the receive waits, on a comm of one rail, so a poll of its CQ that finds nothing
    /// answers "not done". Every [`IDLE_LOOK_EVERY`]th such test takes the lock instead, to
    /// run what the locked poll does besides (the slow checks). Decided before the poll, so
    /// that the caller keeps nothing but its own arguments across it.
    #[inline(always)]
    pub(crate) fn may_poll(&self, id: usize) -> bool {
        self.waits(id) && self.others.is_empty() && !self.lock_this_time()
    }

    /// The poll [`Self::may_poll`] allows: rail 0's CQ, into `wc`.
    #[inline(always)]
    pub(crate) fn poll(&self, wc: &mut WcBatch) -> Look {
        let (nic, cq) = &self.first;
        match wc.try_poll(&**nic, cq) {
            Some(0) => Look::Idle,
            Some(_) => Look::Found,
            // The locked poll meets the error again and fails the comm with it.
            None => Look::Lock,
        }
    }

    /// What a test that [`Self::may_poll`] did not let poll does: a receive waiting on a
    /// comm of several rails looks at every rail's CQ ([`Look::Further`]); all else locks.
    pub(crate) fn look(&self, id: usize) -> Look {
        if self.waits(id) && !self.others.is_empty() {
            Look::Further
        } else {
            Look::Lock
        }
    }

    /// Whether receive `id` waits for data, as the last locked call left it.
    #[inline(always)]
    fn waits(&self, id: usize) -> bool {
        id < SLOTS && self.waiting.load(Relaxed) & (1 << id) != 0
    }

    /// [`Look::Further`]: the CQs of every rail, into `wc` (as [`Self::may_poll`], every
    /// [`IDLE_LOOK_EVERY`]th such test takes the lock instead).
    pub(crate) fn look_further(&self, wc: &mut WcBatch) -> LookFurther {
        if self.lock_this_time() {
            return LookFurther::Lock;
        }
        let first = std::iter::once(&self.first);
        for (r, (nic, cq)) in first.chain(self.others.iter()).enumerate() {
            match wc.try_poll(&**nic, cq) {
                Some(0) => {}
                Some(_) => return LookFurther::Found(r),
                // As in `poll`: the locked poll meets the error again.
                None => return LookFurther::Lock,
            }
        }
        LookFurther::Idle
    }

    /// Counts a test the gate looks at for the lock: whether it takes the lock after all,
    /// as every [`IDLE_LOOK_EVERY`]th does.
    #[inline(always)]
    fn lock_this_time(&self) -> bool {
        // Load and store, not an atomic add: one thread counts, and a lost count is harmless.
        let n = self.looks.load(Relaxed).wrapping_add(1);
        self.looks.store(n, Relaxed);
        n % IDLE_LOOK_EVERY == 0
    }

    /// Records what a locked call left: one bit per slot whose receive waits for data, that
    /// the gate may answer for (none while the comm is not quiet).
    #[inline(always)]
    pub(crate) fn publish(&self, waiting: u32) {
        self.waiting.store(waiting, Relaxed);
    }

    /// Tests looked at so far (wrapping): when it moves, the caller is testing.
    #[inline(always)]
    pub(crate) fn looks(&self) -> u32 {
        self.looks.load(Relaxed)
    }
}
