//! What a receive's `test` reads without taking the comm's lock (see [`RecvGate`]): the proxy
//! tests a receive in a tight loop while its data is on the way, and such a test is one CQ
//! poll per rail that finds nothing. Completions a poll finds go to the locked call in the
//! batch they were polled into, so none is handed out twice or lost.

use std::sync::{
    atomic::{AtomicU32, AtomicU64, Ordering::Relaxed},
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

/// In [`RecvGate`]'s word: the comm has work only a locked call does (a clear-to-send held
/// back, a failure to report, a peer gone).
const LOCK: u64 = 1 << 63;
const _: () = assert!(SLOTS < 63);

/// What an idle `test` reads without taking the comm's lock, and the one record of which
/// receives wait for their data. Only the holder of the comm's lock writes it (one progress
/// thread drives a comm), so its writes are plain loads and stores; a reader that found it
/// stale would only take the lock.
pub(crate) struct RecvGate<N: Nic> {
    /// Every rail's CQ, rail 0 first.
    cqs: Box<[GateCq<N>]>,
    /// Bit `s`: the receive in slot `s` waits for its data. [`LOCK`]: every test locks.
    word: AtomicU64,
    /// Tests the gate looked at (wrapping).
    looks: AtomicU32,
}

impl<N: Nic> RecvGate<N> {
    /// The gate of a comm over `rails`: no receive waits.
    pub(crate) fn new(rails: &[Rail<N>]) -> Self {
        RecvGate {
            cqs: rails
                .iter()
                .map(|r| (Arc::clone(&r.nic), r.cq.cq.clone()))
                .collect(),
            word: AtomicU64::new(0),
            looks: AtomicU32::new(0),
        }
    }

    /// The test of request `id` without the lock: where receive `id` waits and the comm has
    /// nothing else to do, a poll of every rail's CQ into `wc`. Every [`IDLE_LOOK_EVERY`]th
    /// such test locks instead, to run what the locked poll does besides (the slow checks).
    #[inline]
    pub(crate) fn poll(&self, id: usize, wc: &mut WcBatch) -> GatePoll {
        let waits = id < SLOTS && self.word.load(Relaxed) & (LOCK | 1 << id) == 1 << id;
        if !waits || self.lock_this_time() {
            return GatePoll::Lock;
        }
        for (r, (nic, cq)) in self.cqs.iter().enumerate() {
            match wc.try_poll(&**nic, cq) {
                Some(0) => {}
                Some(_) => return GatePoll::Found(r),
                // The locked poll meets the error again and fails the comm with it.
                None => return GatePoll::Lock,
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
        self.word.load(Relaxed) & (1 << slot) != 0
    }

    /// The lock holder posted a receive in `slot`: it waits for its data.
    #[inline]
    pub(crate) fn posted(&self, slot: usize) {
        self.word
            .store(self.word.load(Relaxed) | 1 << slot, Relaxed);
    }

    /// The lock holder saw the last of `slot`'s data arrive.
    #[inline]
    pub(crate) fn arrived(&self, slot: usize) {
        self.word
            .store(self.word.load(Relaxed) & !(1 << slot), Relaxed);
    }

    /// The lock holder's verdict at the end of a locked call: whether the comm has work only
    /// a locked call does.
    #[inline]
    pub(crate) fn lock_wanted(&self, yes: bool) {
        let word = self.word.load(Relaxed);
        let want = if yes { word | LOCK } else { word & !LOCK };
        if want != word {
            self.word.store(want, Relaxed);
        }
    }
}
