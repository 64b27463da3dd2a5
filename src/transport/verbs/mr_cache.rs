//! Memory registration cache of one device, keyed by page range, as NCCL's IB transport
//! keeps it: a registration reuses any MR that fully covers its page-aligned range
//! (a hit), otherwise registers exactly that range (a miss). Entries are refcounted; the last
//! [`CachedMr`] of a range to drop deregisters it.

use std::sync::{
    atomic::{AtomicU64, Ordering},
    Arc,
};

use parking_lot::Mutex;

use crate::error::Result;
use crate::verbs::dma::ACCESS_RDMA;
use crate::verbs::resources::{Mr, Pd};

struct Entry {
    start: usize,
    end: usize,
    refs: usize,
    mr: Arc<Mr>,
}

/// The cache of one device (one PD).
pub struct MrCache {
    pd: Arc<Pd>,
    entries: Mutex<Vec<Entry>>,
    /// Registrations served by an existing MR.
    pub hits: AtomicU64,
    /// Registrations that created an MR.
    pub misses: AtomicU64,
}

/// A registration held by an NCCL memory handle.
pub struct CachedMr {
    cache: Arc<MrCache>,
    start: usize,
    end: usize,
    mr: Arc<Mr>,
}

impl CachedMr {
    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }
}

fn page_size() -> usize {
    4096
}

impl MrCache {
    /// An empty cache on `pd`.
    pub fn new(pd: Arc<Pd>) -> Arc<Self> {
        Arc::new(MrCache {
            pd,
            entries: Mutex::new(Vec::new()),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        })
    }

    /// Registers `addr..addr+len` (or reuses a covering registration); the flag says
    /// whether it was a hit.
    pub fn register(self: &Arc<Self>, addr: usize, len: usize) -> Result<(CachedMr, bool)> {
        let page = page_size();
        let start = addr & !(page - 1);
        let end = (addr + len.max(1)).div_ceil(page) * page;
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
        let mr = Arc::new(self.pd.reg_mr(start, end - start, ACCESS_RDMA)?);
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
    pub fn len(&self) -> usize {
        self.entries.lock().len()
    }

    /// True when no MR is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for CachedMr {
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
