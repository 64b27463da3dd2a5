//! Memory registration cache of one device, keyed by page range, as NCCL's IB transport
//! keeps it: a registration reuses any MR that fully covers its page-aligned range (a hit),
//! otherwise registers exactly that range (a miss). Entries are refcounted; the last
//! [`CachedMr`] of a range to drop deregisters it.

use std::sync::{
    atomic::{AtomicU64, Ordering},
    Arc,
};

use parking_lot::Mutex;

use crate::error::Result;
use crate::verbs::dma::page_size;
use crate::verbs::nic::{MemoryRegion, Nic};

struct Entry<M> {
    start: usize,
    end: usize,
    refs: usize,
    mr: Arc<M>,
}

/// The cache of one device.
pub(crate) struct MrCache<N: Nic> {
    nic: Arc<N>,
    entries: Mutex<Vec<Entry<N::Mr>>>,
    /// Registrations served by an existing MR.
    pub(crate) hits: AtomicU64,
    /// Registrations that created an MR.
    pub(crate) misses: AtomicU64,
}

/// A registration held by an NCCL memory handle.
pub(crate) struct CachedMr<N: Nic> {
    cache: Arc<MrCache<N>>,
    start: usize,
    end: usize,
    mr: Arc<N::Mr>,
}

impl<N: Nic> CachedMr<N> {
    /// Local key.
    pub(crate) fn lkey(&self) -> u32 {
        self.mr.lkey()
    }
    /// Remote key.
    pub(crate) fn rkey(&self) -> u32 {
        self.mr.rkey()
    }
}

/// The page-aligned range `addr..addr+len` lies in (a zero-length range is one byte's page).
fn page_range(addr: usize, len: usize, page: usize) -> (usize, usize) {
    let start = addr & !(page - 1);
    let end = (addr + len.max(1)).div_ceil(page) * page;
    (start, end)
}

impl<N: Nic> MrCache<N> {
    /// An empty cache on `nic`.
    pub(crate) fn new(nic: Arc<N>) -> Arc<Self> {
        Arc::new(MrCache {
            nic,
            entries: Mutex::new(Vec::new()),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        })
    }

    /// Registers `addr..addr+len` (or reuses a covering registration); the flag says
    /// whether it was a hit.
    pub(crate) fn register(
        self: &Arc<Self>,
        addr: usize,
        len: usize,
    ) -> Result<(CachedMr<N>, bool)> {
        let (start, end) = page_range(addr, len, page_size());
        let mut entries = self.entries.lock();
        if let Some(e) = entries
            .iter_mut()
            .find(|e| e.start <= start && end <= e.end)
        {
            e.refs += 1;
            self.hits.fetch_add(1, Ordering::Relaxed);
            let held = CachedMr {
                cache: Arc::clone(self),
                start: e.start,
                end: e.end,
                mr: Arc::clone(&e.mr),
            };
            return Ok((held, true));
        }
        let mr = Arc::new(self.nic.register(start, end - start)?);
        self.misses.fetch_add(1, Ordering::Relaxed);
        entries.push(Entry {
            start,
            end,
            refs: 1,
            mr: Arc::clone(&mr),
        });
        let held = CachedMr {
            cache: Arc::clone(self),
            start,
            end,
            mr,
        };
        Ok((held, false))
    }

    /// Number of distinct MRs held.
    pub(crate) fn len(&self) -> usize {
        self.entries.lock().len()
    }
}

impl<N: Nic> Drop for CachedMr<N> {
    fn drop(&mut self) {
        let mut entries = self.cache.entries.lock();
        if let Some(i) = entries.iter().position(|e| {
            e.start == self.start && e.end == self.end && Arc::ptr_eq(&e.mr, &self.mr)
        }) {
            entries[i].refs -= 1;
            if entries[i].refs == 0 {
                // Deregisters once the last Arc (this entry's) goes.
                entries.swap_remove(i);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::fake::Fabric;

    #[test]
    fn page_ranges_cover_the_buffer_in_whole_pages() {
        assert_eq!(page_range(0x1000, 0x1000, 0x1000), (0x1000, 0x2000));
        assert_eq!(page_range(0x1001, 0x1000, 0x1000), (0x1000, 0x3000));
        assert_eq!(page_range(0x1fff, 1, 0x1000), (0x1000, 0x2000));
        assert_eq!(page_range(0x1fff, 2, 0x1000), (0x1000, 0x3000));
        assert_eq!(page_range(0x5000, 0, 0x1000), (0x5000, 0x6000));
    }

    #[test]
    fn covering_registrations_are_hits_and_the_last_release_deregisters() {
        let nic = Fabric::new().nic("fake0");
        let cache = MrCache::new(nic);
        let page = page_size();
        let buf = vec![0u8; 4 * page];
        let base = (buf.as_ptr() as usize).next_multiple_of(page);
        let (whole, hit) = cache.register(base, 2 * page).unwrap();
        assert!(!hit);
        // Inside the first registration: the same MR.
        let (inner, hit) = cache.register(base + 10, page).unwrap();
        assert!(hit);
        assert_eq!((inner.lkey(), inner.rkey()), (whole.lkey(), whole.rkey()));
        // Reaching past it: a new one.
        let (past, hit) = cache.register(base + page, 2 * page).unwrap();
        assert!(!hit);
        assert_ne!(past.lkey(), whole.lkey());
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.hits.load(Ordering::Relaxed), 1);
        assert_eq!(cache.misses.load(Ordering::Relaxed), 2);
        drop(whole);
        assert_eq!(cache.len(), 2, "still held by `inner`");
        drop(inner);
        assert_eq!(cache.len(), 1);
        drop(past);
        assert_eq!(cache.len(), 0);
    }
}
