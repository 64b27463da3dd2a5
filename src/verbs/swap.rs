//! A value that callers read without a lock while its owner may replace it: the completion
//! queues a receiver's gate polls on the idle path, which a failover replaces with the new
//! NICs' (`transport::verbs::gate`).
//!
//! A read is two atomic counts around a pointer load; a replacement frees the old value only
//! once no read can still hold it. The argument, in the sequentially consistent order of the
//! operations below: a reader announces itself (`readers + 1`) before it loads the pointer, and
//! the replacer swaps the pointer before it looks at `readers`. If the replacer sees no reader,
//! every reader that loaded the old pointer had already left; one that comes later loads the
//! new pointer. Otherwise the old value waits, and goes at a later replacement or at drop.
//! A comm is driven by one thread (NCCL's contract), so in practice the old value always goes
//! at once.

use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering::SeqCst};

use parking_lot::Mutex;

/// See the module doc.
pub(crate) struct SwapCell<T> {
    current: AtomicPtr<T>,
    readers: AtomicUsize,
    /// Replaced values a reader may still have held at their replacement.
    retired: Mutex<Vec<Box<T>>>,
}

// SAFETY: the cell owns its values (boxed) and hands out only shared references to them, as
// an `Arc<T>` would: it is Send and Sync where `T` is.
unsafe impl<T: Send + Sync> Send for SwapCell<T> {}
// SAFETY: as above.
unsafe impl<T: Send + Sync> Sync for SwapCell<T> {}

/// A read in progress: counted until dropped (also when the reader panics).
struct Reading<'a>(&'a AtomicUsize);

impl Drop for Reading<'_> {
    #[inline(always)]
    fn drop(&mut self) {
        self.0.fetch_sub(1, SeqCst);
    }
}

impl<T> SwapCell<T> {
    pub(crate) fn new(value: T) -> Self {
        SwapCell {
            current: AtomicPtr::new(Box::into_raw(Box::new(value))),
            readers: AtomicUsize::new(0),
            retired: Mutex::new(Vec::new()),
        }
    }

    /// What `f` makes of the current value.
    #[inline(always)]
    pub(crate) fn read<R>(&self, f: impl FnOnce(&T) -> R) -> R {
        self.readers.fetch_add(1, SeqCst);
        let _reading = Reading(&self.readers);
        let p = self.current.load(SeqCst);
        // SAFETY: `p` came from `Box::into_raw` and is freed only by `replace` or drop once
        // no reader counted before the swap remains (module doc); this reader is counted.
        f(unsafe { &*p })
    }

    /// Makes `value` the current value. Returns the old one where no reader can still hold
    /// it (always, with one thread), for the caller to drop where it likes; else it is kept
    /// and dropped by a later replacement or with the cell.
    pub(crate) fn replace(&self, value: T) -> Option<T> {
        let old = self.current.swap(Box::into_raw(Box::new(value)), SeqCst);
        // SAFETY: `old` came from `Box::into_raw` and was current until the swap: nothing else
        // owns it.
        let old = unsafe { Box::from_raw(old) };
        let mut retired = self.retired.lock();
        if self.readers.load(SeqCst) == 0 {
            // No reader counted before the swap is left: neither the old value nor any kept
            // before it is held.
            retired.clear();
            Some(*old)
        } else {
            retired.push(old);
            None
        }
    }
}

impl<T> Drop for SwapCell<T> {
    fn drop(&mut self) {
        // SAFETY: `&mut self`: no reader is left, and the pointer came from `Box::into_raw`.
        drop(unsafe { Box::from_raw(*self.current.get_mut()) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn readers_see_the_current_value_and_a_replaced_one_is_handed_back() {
        let cell = SwapCell::new(vec![1, 2]);
        assert_eq!(cell.read(|v| v.len()), 2);
        assert_eq!(cell.replace(vec![3]), Some(vec![1, 2]));
        assert_eq!(cell.read(|v| v[0]), 3);
    }

    #[test]
    fn a_value_a_reader_may_hold_is_kept_until_no_reader_is_left() {
        let dropped = Arc::new(AtomicUsize::new(0));
        struct Counted(Arc<AtomicUsize>);
        impl Drop for Counted {
            fn drop(&mut self) {
                self.0.fetch_add(1, SeqCst);
            }
        }
        let cell = SwapCell::new(Counted(Arc::clone(&dropped)));
        cell.read(|_| {
            // Replaced while read: kept.
            assert!(cell.replace(Counted(Arc::clone(&dropped))).is_none());
            assert_eq!(dropped.load(SeqCst), 0);
        });
        // The next replacement finds no reader: the kept value goes, the current comes back.
        let back = cell.replace(Counted(Arc::clone(&dropped)));
        assert_eq!(dropped.load(SeqCst), 1);
        drop(back);
        drop(cell);
        assert_eq!(dropped.load(SeqCst), 3);
    }
}
