//! The connects in progress, keyed by the id `connect` stamps into NCCL's handle.
//!
//! NCCL polls a connect until it finishes or fails. One it stops polling (a communicator
//! aborted while it was connecting: NCCL calls neither `connect` nor a close for it again) is
//! dropped once it has gone unpolled for [`ABANDONED_AFTER`], so that aborts and re-inits in
//! one process do not pile up sockets, QPs and pinned memory.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

/// How long a connect may go unpolled before it counts as abandoned. NCCL polls every
/// connect in a loop until it is done, so this much silence means nobody will come back.
pub(crate) const ABANDONED_AFTER: Duration = Duration::from_secs(600);

/// Connect stages by id, each with the time it was last polled.
pub(crate) struct Stages<T> {
    map: HashMap<u64, (T, Instant)>,
    next: u64,
}

impl<T> Default for Stages<T> {
    fn default() -> Self {
        Stages {
            // Id 0 means "no stage" in a handle.
            map: HashMap::new(),
            next: 1,
        }
    }
}

impl<T> Stages<T> {
    /// Adds `stage`, polled at `now`; first drops the abandoned ones. Returns the new id and
    /// how many were dropped.
    pub(crate) fn insert(&mut self, stage: T, now: Instant) -> (u64, usize) {
        let before = self.map.len();
        self.map
            .retain(|_, (_, polled)| now.saturating_duration_since(*polled) < ABANDONED_AFTER);
        let dropped = before - self.map.len();
        let id = self.next;
        self.next += 1;
        self.map.insert(id, (stage, now));
        (id, dropped)
    }

    /// Stage `id`, marked polled at `now`.
    pub(crate) fn poll(&mut self, id: u64, now: Instant) -> Option<&mut T> {
        self.map.get_mut(&id).map(|(stage, polled)| {
            *polled = now;
            stage
        })
    }

    /// Takes stage `id` out (finished or failed).
    pub(crate) fn remove(&mut self, id: u64) -> Option<T> {
        self.map.remove(&id).map(|(stage, _)| stage)
    }

    /// Stages held.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.map.len()
    }

    /// True when none is held.
    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_nccl_stopped_polling_are_dropped_and_polled_ones_kept() {
        let t0 = Instant::now();
        let mut stages = Stages::default();
        let (a, _) = stages.insert("aborted", t0);
        let (b, _) = stages.insert("slow peer", t0);
        assert_ne!((a, b), (0, 0));
        // NCCL keeps polling b (its peer accepts late); a's communicator was aborted.
        let later = t0 + ABANDONED_AFTER - Duration::from_secs(1);
        assert_eq!(stages.poll(b, later).copied(), Some("slow peer"));
        let (c, dropped) = stages.insert("new", t0 + ABANDONED_AFTER);
        assert_eq!(dropped, 1);
        assert_eq!(stages.len(), 2);
        assert!(
            stages.poll(a, t0 + ABANDONED_AFTER).is_none(),
            "abandoned one dropped"
        );
        assert_eq!(stages.remove(b), Some("slow peer"));
        assert_eq!(stages.remove(c), Some("new"));
        assert!(stages.is_empty());
    }
}
