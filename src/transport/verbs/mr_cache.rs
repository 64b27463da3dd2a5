//! Memory registration cache of one NIC, keyed by page range, as NCCL's IB transport keeps
//! it: a registration reuses any MR that fully covers its page-aligned range (a hit),
//! otherwise registers exactly that range (a miss). Entries are refcounted; the last
//! [`CachedMr`] of a range to drop deregisters it. And a device's registration across its
//! NICs and spares ([`register_across`]).

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

/// A registration across a device's NICs: the (lkey, rkey) on each, and what holds them.
pub(crate) type Across<H> = (Vec<(u32, u32)>, Vec<H>);

/// Registers with `register` on each NIC of `nics`: a device's own (`nics[..members]`), where
/// a failure fails the registration, and its spares, where one is a WARN and the spare takes
/// no more moves (a broken or full spare must not fail the registrations of healthy devices,
/// and no connection may move where its memory has no keys). Returns the (lkey, rkey) on each
/// NIC, (0, 0) where a spare failed, and what holds the registrations.
pub(crate) fn register_across<N: Nic, H>(
    nics: &[Arc<N>],
    members: usize,
    mut register: impl FnMut(usize) -> Result<(H, u32, u32)>,
) -> Result<Across<H>> {
    let mut keys = Vec::with_capacity(nics.len());
    let mut held = Vec::with_capacity(nics.len());
    for (i, nic) in nics.iter().enumerate() {
        match register(i) {
            Ok((h, lkey, rkey)) => {
                keys.push((lkey, rkey));
                held.push(h);
            }
            Err(e) if i >= members => {
                if nic.refuse_moves() {
                    tracing::warn!(
                        "registering memory on {}, a NIC connections may move to, failed ({e}): \
                         no connection moves to it from now on",
                        nic.local().name
                    );
                }
                keys.push((0, 0));
            }
            Err(e) => return Err(e),
        }
    }
    Ok((keys, held))
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
    fn a_spare_that_cannot_register_takes_no_moves_and_fails_no_registration() {
        use crate::verbs::limits::DeviceLimits;
        let f = Fabric::new();
        let own = f.nic("own");
        let full = DeviceLimits {
            max_mr: 0,
            ..DeviceLimits::UNLIMITED
        };
        let spare = f.nic_with_limits("spare", full);
        let nics = [Arc::clone(&own), Arc::clone(&spare)];
        let buf = [0u8; 64];
        let (addr, len) = (buf.as_ptr() as usize, buf.len());
        let register = |i: usize| {
            let mr = nics[i].register(addr, len)?;
            let keys = (mr.lkey(), mr.rkey());
            Ok((mr, keys.0, keys.1))
        };
        let (keys, held) = register_across(&nics, 1, register).unwrap();
        assert_eq!(held.len(), 1);
        assert_ne!(keys[0], (0, 0));
        assert_eq!(keys[1], (0, 0));
        assert!(own.takes_moves() && !spare.takes_moves());
        // The device's own NIC failing fails the registration.
        let (_, mine) = (0, [Arc::clone(&spare)]);
        let failed = register_across(&mine, 1, |i| {
            let mr = mine[i].register(addr, len)?;
            Ok((mr, 0, 0))
        });
        assert!(failed.is_err());
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
