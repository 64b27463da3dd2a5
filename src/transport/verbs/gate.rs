//! What an idle call reads instead of taking the comm's lock: NCCL's proxy calls `isend` on a
//! send comm and `test` on a receive in a tight loop while nothing has come, and such a call
//! should be a load or a CQ poll, not a lock. Each end has one gate; only the holder of the
//! comm's lock writes it (one progress thread drives a comm), so a reader that finds it stale
//! only takes the lock.
//! - [`SendGate`]: the clear-to-send the next send waits for, read straight from the FIFO the
//!   receiver writes into.
//! - [`RecvGate`]: which receives still wait for their data (its one record), and the rails'
//!   CQs, polled without the lock; completions a poll finds go to the locked call in the batch
//!   they were polled into, so none is handed out twice or lost. A move replaces the CQs
//!   ([`RecvGate::follow`]), so the idle path works on the new rails as before.

use std::sync::{
    atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed},
    Arc,
};

use super::cq::IDLE_LOOK_EVERY;
use super::rail::Rail;
use super::wire::{cts_index, CtsEntry, CTS_SEQ_OFFSET, SLOTS};
use crate::verbs::dma::{DmaBuffer, WcBatch};
use crate::verbs::nic::Nic;
use crate::verbs::swap::SwapCell;

/// What the send gate's `awaited` says while nothing may be sent: a value no entry ever holds
/// (that would take 2^64 receives), so the one comparison answers "not yet".
pub(crate) const NOT_AWAITED: u64 = u64::MAX;

/// The sequence number + 1 of the receive clear-to-send entry `i` of `fifo` announces, once
/// the receiver's write has placed it (and the fields before it).
#[inline]
pub(crate) fn cts_landed<R>(fifo: &DmaBuffer<CtsEntry, R>, i: usize) -> u64 {
    fifo.get_u64(i, CTS_SEQ_OFFSET)
}

/// Whether the clear-to-send of receive `seq` (its first entry, in `seq`'s slot) has landed
/// in `fifo`.
#[inline]
pub(crate) fn cts_of_landed<R>(fifo: &DmaBuffer<CtsEntry, R>, seq: u64) -> bool {
    let slot = (seq % SLOTS as u64) as usize;
    cts_landed(fifo, cts_index(slot, 0)) == seq.wrapping_add(1)
}

/// What an `isend` reads without taking the comm's lock: the FIFO, and what the last locked
/// call left.
pub(crate) struct SendGate<R> {
    fifo: Arc<DmaBuffer<CtsEntry, R>>,
    /// The first entry the next send waits for, as the last locked call left it
    /// ([`NOT_AWAITED`] while nothing may be sent).
    awaited: AtomicU64,
    /// `isend` calls that found nothing to post.
    idle_calls: AtomicU32,
    /// Every `isend` looks around: the comm failed (each returns the error), or moves (each
    /// steps the move).
    look: AtomicBool,
}

impl<R> SendGate<R> {
    /// The gate of a sender over `fifo`, waiting for the entry `awaited`.
    pub(crate) fn new(fifo: Arc<DmaBuffer<CtsEntry, R>>, awaited: u64) -> Self {
        SendGate {
            fifo,
            awaited: AtomicU64::new(awaited),
            idle_calls: AtomicU32::new(0),
            look: AtomicBool::new(false),
        }
    }

    /// The clear-to-send the next send waits for, once it has landed: one load of the FIFO
    /// decides "not yet", as in NCCL's IB transport. (An entry's sequence number is read
    /// first and alone, the rest only once it matches.)
    #[inline]
    pub(crate) fn landed(&self) -> Option<u64> {
        let awaited = self.awaited.load(Relaxed);
        cts_of_landed(&self.fifo, awaited.wrapping_sub(1)).then_some(awaited)
    }

    /// Counts an `isend` that finds nothing to post: whether it should look around, as every
    /// [`IDLE_LOOK_EVERY`]th such call does and every call while the comm failed or moves.
    /// That keeps completions, the peer link and the watchdog moving without a CQ poll on
    /// every "not yet".
    #[inline]
    pub(crate) fn idle_call_looks(&self) -> bool {
        // Load and store, not an atomic add: one thread counts, and a lost count is harmless.
        let n = self.idle_calls.load(Relaxed).wrapping_add(1);
        self.idle_calls.store(n, Relaxed);
        n % IDLE_LOOK_EVERY == 0 || self.look.load(Relaxed)
    }

    /// Idle `isend`s counted so far (wrapping).
    #[cfg(test)]
    pub(crate) fn idle_calls(&self) -> u32 {
        self.idle_calls.load(Relaxed)
    }

    /// Records what a locked call left: the entry awaited, and whether every call looks.
    #[inline]
    pub(crate) fn publish(&self, awaited: u64, look: bool) {
        self.awaited.store(awaited, Relaxed);
        self.look.store(look, Relaxed);
    }
}

/// What [`RecvGate::poll`] found.
pub(crate) enum GatePoll {
    /// The receive waits and no CQ had anything: "not done", without the lock.
    Idle,
    /// This rail's CQ had completions, now in the caller's batch for the locked call; the
    /// rails were those of the gate's generation `.1`.
    Found(usize, u32),
    /// Anything else: the locked call decides (and polls itself).
    Lock,
}

/// A rail's NIC and CQ, as the gate polls it. The CQ handle is a clone, so the CQ outlives
/// the QPs in the comm's state.
type GateCq<N> = (Arc<N>, <N as Nic>::Cq);

/// The rails' CQs (rail 0's, which every comm has, and the others'), and which move made
/// them (0: setup).
struct GateCqs<N: Nic> {
    first: GateCq<N>,
    others: Box<[GateCq<N>]>,
    generation: u32,
}

/// One poll of rail `r`'s CQ into `wc`.
#[inline]
fn poll_rail<N: Nic>((nic, cq): &GateCq<N>, wc: &mut WcBatch, r: usize, gen: u32) -> GatePoll {
    match wc.try_poll(&**nic, cq) {
        Some(0) => GatePoll::Idle,
        Some(_) => GatePoll::Found(r, gen),
        // The locked poll meets the error again and fails the comm with it.
        None => GatePoll::Lock,
    }
}

/// What a receive's `test` reads without taking the comm's lock (see the module doc).
pub(crate) struct RecvGate<N: Nic> {
    cqs: SwapCell<GateCqs<N>>,
    /// Per slot: the receive in it waits for its data.
    waiting: [AtomicBool; SLOTS],
    /// The comm has work only a locked call does (a clear-to-send held back, a failure to
    /// report, a peer gone, a move): every test locks.
    lock: AtomicBool,
    /// Tests the gate looked at (wrapping).
    looks: AtomicU32,
}

impl<N: Nic> RecvGate<N> {
    /// The gate of a comm over `rails`: no receive waits.
    pub(crate) fn new(rails: &[Rail<N>]) -> Self {
        RecvGate {
            cqs: SwapCell::new(gate_cqs(rails, 0)),
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
        self.cqs.read(|rails| {
            match poll_rail(&rails.first, wc, 0, rails.generation) {
                GatePoll::Idle => {}
                found_or_lock => return found_or_lock,
            }
            for (r, cq) in rails.others.iter().enumerate() {
                match poll_rail(cq, wc, r + 1, rails.generation) {
                    GatePoll::Idle => {}
                    found_or_lock => return found_or_lock,
                }
            }
            GatePoll::Idle
        })
    }

    /// The lock holder moved the connection to `rails`: the gate polls their CQs from now on.
    /// Returns the old CQs where no reader can hold them any more (for the reaper).
    pub(crate) fn follow(&self, rails: &[Rail<N>]) -> Option<impl Send> {
        let generation = self.generation().wrapping_add(1);
        self.cqs.replace(gate_cqs(rails, generation))
    }

    /// Which move made the CQs the gate polls.
    pub(crate) fn generation(&self) -> u32 {
        self.cqs.read(|rails| rails.generation)
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

/// The CQs of `rails`, as the gate polls them, made by move `generation`.
fn gate_cqs<N: Nic>(rails: &[Rail<N>], generation: u32) -> GateCqs<N> {
    let cq = |r: &Rail<N>| (Arc::clone(&r.nic), r.cq.cq.clone());
    GateCqs {
        first: cq(&rails[0]),
        others: rails[1..].iter().map(cq).collect(),
        generation,
    }
}
