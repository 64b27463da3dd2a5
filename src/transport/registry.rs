//! Memory registrations as NCCL holds them: opaque handles from `regMr`, checked on every
//! use, and looked up by the transports where a request is built ([`CommKeys`]).
//!
//! A handle is a generation-tagged slot index, never a pointer, so an unknown, forged or
//! already-released handle is an error code instead of a crash. `regIsGlobal` is 1: a
//! registration is not tied to the comm it was made on, only to its device.
//!
//! The data path looks a handle up on every `isend`/`irecv`, from several progress threads at
//! once, while service threads register and deregister: lookups take no lock and write no
//! shared memory. Slots live in chunks that are never freed or moved, and each slot is a
//! small seqlock: a reader checks the slot's state word before and after reading its fields.
//! A comm keeps its last lookup ([`KeyCache`]), so a repeated handle costs two compares.

use std::{
    collections::HashMap,
    sync::{
        atomic::{fence, AtomicU64, Ordering},
        Arc, OnceLock,
    },
};

use parking_lot::Mutex;

use super::bounds::MAX_RAILS;
use crate::buffer::UserBuffer;
use crate::error::{Error, Result};

/// What keeps a registration alive; dropped at deregistration.
pub(crate) type Hold = Box<dyn std::any::Any + Send + Sync>;

/// A registration as the data path uses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct MemKeys {
    /// Local key on each rail (NIC) of the device it was registered on (verbs; none for
    /// tcp).
    pub(crate) lkeys: [u32; MAX_RAILS],
    /// Remote key on each rail: as a clear-to-send entry carries them, copied whole.
    pub(crate) rkeys: [u32; MAX_RAILS],
    /// Rails with keys.
    pub(crate) rails: u8,
    /// Host memory (the CPU may read it), as opposed to GPU memory.
    pub(crate) host: bool,
}

impl MemKeys {
    /// Local key on rail `r`.
    #[inline]
    pub(crate) fn lkey(&self, r: usize) -> u32 {
        self.lkeys[r]
    }

    /// Remote key on rail `r`.
    #[inline]
    pub(crate) fn rkey(&self, r: usize) -> u32 {
        self.rkeys[r]
    }

    /// Sets rail `r`'s keys.
    pub(crate) fn set(&mut self, r: usize, (lkey, rkey): (u32, u32)) {
        self.lkeys[r] = lkey;
        self.rkeys[r] = rkey;
    }
}

/// Each rail's keys those of the NIC of its own index.
const KEYS_IN_ORDER: [u8; MAX_RAILS] = {
    let mut order = [0; MAX_RAILS];
    let mut r = 0;
    while r < MAX_RAILS {
        order[r] = r as u8;
        r += 1;
    }
    order
};

/// The last registration handle one comm looked up, and what it found. Filled by
/// [`Registry::keys`], which alone knows when a handle stops standing; the comm only keeps it
/// (under its lock, in its [`CommKeys`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct KeyCache {
    /// The handle looked up (0, which no registration has: none).
    handle: u64,
    /// The registry's release count when the handle was read (`u64::MAX`: nothing cached).
    releases: u64,
    /// (start, end, device) of the registration.
    reg: (usize, usize, usize),
    keys: MemKeys,
    /// The comm's rail `r` uses the registration's keys of NIC `order[r]` (the identity
    /// until a connection moves to another NIC, see [`CommKeys::reorder`]).
    order: [u8; MAX_RAILS],
}

impl Default for KeyCache {
    fn default() -> Self {
        KeyCache {
            handle: 0,
            releases: u64::MAX,
            reg: (0, 0, 0),
            keys: MemKeys::default(),
            order: KEYS_IN_ORDER,
        }
    }
}

/// Where one comm looks its buffers' handles up: the process's registry, on the comm's device,
/// through the comm's last lookup. Each end keeps one under its lock.
pub(crate) struct CommKeys {
    registry: Arc<Registry>,
    dev: usize,
    cache: KeyCache,
}

impl CommKeys {
    /// Lookups in `registry` for a comm on device `dev`.
    pub(crate) fn new(registry: Arc<Registry>, dev: usize) -> Self {
        CommKeys {
            registry,
            dev,
            cache: KeyCache::default(),
        }
    }

    /// Lookups on the same registry and device for another comm (a listener's next one).
    pub(crate) fn fresh(&self) -> Self {
        CommKeys::new(Arc::clone(&self.registry), self.dev)
    }

    /// The keys of `buf`, registered as `handle`; an error when the handle is unknown, does
    /// not cover it, or was registered on another device.
    #[inline(always)]
    pub(crate) fn keys(&mut self, handle: u64, buf: UserBuffer) -> Result<&MemKeys> {
        self.registry
            .keys(&mut self.cache, handle, (buf.addr(), buf.len()), self.dev)
    }

    /// [`Self::keys`] of `addr..addr+len`, a buffer named by its address (a request being
    /// sent again after its connection moved).
    pub(crate) fn keys_at(&mut self, handle: u64, addr: u64, len: usize) -> Result<MemKeys> {
        let at = (addr as usize, len);
        self.registry
            .keys(&mut self.cache, handle, at, self.dev)
            .copied()
    }

    /// From now on the comm's rail `r` uses the keys a registration holds for NIC
    /// `order[r]` (its device's NICs, then the spares it was registered on): after a
    /// connection moved. Lookups pay for it only when they read a registration afresh.
    pub(crate) fn reorder(&mut self, order: [u8; MAX_RAILS]) {
        self.cache.order = order;
        self.cache.releases = u64::MAX;
    }

    /// Checks that each handle of `handles` covers its buffer of `bufs` (a transport that
    /// needs no keys still refuses what NCCL would be wrong to pass).
    pub(crate) fn check_all(&mut self, bufs: &[UserBuffer], handles: &[u64]) -> Result<()> {
        for (buf, handle) in bufs.iter().zip(handles) {
            self.keys(*handle, *buf)?;
        }
        Ok(())
    }
}

/// What was registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Registration {
    /// First byte.
    pub(crate) addr: usize,
    /// Length in bytes.
    pub(crate) len: usize,
    /// Device index the registration belongs to.
    pub(crate) dev: usize,
    /// What the data path needs: keys, and whether it is host memory.
    pub(crate) keys: MemKeys,
}

impl Registration {
    /// A registration of `addr..addr+len` on device `dev`.
    pub(crate) fn new(addr: usize, len: usize, dev: usize, keys: MemKeys) -> Self {
        Registration {
            addr,
            len,
            dev,
            keys,
        }
    }

    /// Whether `addr..addr+len` lies inside this registration.
    #[cfg(test)]
    pub(crate) fn covers(&self, addr: usize, len: usize) -> bool {
        covers(
            (self.addr, self.addr.saturating_add(self.len), self.dev),
            addr,
            len,
        )
    }
}

/// Whether `addr..addr+len` lies inside registration `(start, end, device)` (an empty
/// buffer lies anywhere). No sum that could overflow.
#[inline(always)]
fn covers(reg: (usize, usize, usize), addr: usize, len: usize) -> bool {
    (addr >= reg.0 && addr <= reg.1 && len <= reg.1 - addr) || len == 0
}

#[cold]
fn outside_registration(addr: usize, len: usize, reg: &(usize, usize, usize)) -> Error {
    Error::misuse(format!(
        "buffer {addr:#x}+{len} lies outside its registration {:#x}+{}",
        reg.0,
        reg.1 - reg.0
    ))
}

#[cold]
fn wrong_device(registered: usize, dev: usize) -> Error {
    Error::misuse(format!(
        "buffer registered on device {registered} used on device {dev}"
    ))
}

const CHUNK: usize = 1024;
const CHUNKS: usize = 4096;
const LIVE: u64 = 1;
const WRITING: u64 = 2;

/// One slot. `state` is `generation << 2 | WRITING | LIVE`.
#[derive(Default)]
struct Slot {
    state: AtomicU64,
    addr: AtomicU64,
    len: AtomicU64,
    /// Host memory (bit 0), rails (bits 8..16) and device (high 32 bits).
    kind: AtomicU64,
    /// `lkey` (low 32 bits) and `rkey` (high 32 bits) on each rail.
    keys: [AtomicU64; MAX_RAILS],
}

impl Slot {
    /// The device registered on (the high 32 bits of `kind`).
    #[inline(always)]
    fn device(&self) -> usize {
        (self.kind.load(Ordering::Relaxed) >> 32) as usize
    }

    /// Writes the keys into `out` (fresh): rail `r` gets those of NIC `order[r]`, for as
    /// many rails as were registered.
    #[inline(always)]
    fn keys_into(&self, out: &mut MemKeys, order: &[u8; MAX_RAILS]) {
        let kind = self.kind.load(Ordering::Relaxed);
        let rails = ((kind >> 8) as u8).min(MAX_RAILS as u8);
        out.rails = rails;
        out.host = kind & 1 != 0;
        for (r, &from) in order[..usize::from(rails)].iter().enumerate() {
            let k = self.keys[usize::from(from) % MAX_RAILS].load(Ordering::Relaxed);
            out.set(r, (k as u32, (k >> 32) as u32));
        }
    }
}

#[derive(Default)]
struct Writer {
    next: usize,
    free: Vec<usize>,
    holds: HashMap<usize, Option<Hold>>,
}

/// All live registrations of the process.
pub(crate) struct Registry {
    chunks: Box<[OnceLock<Box<[Slot]>>]>,
    writer: Mutex<Writer>,
    /// Releases so far: while it stands still, every handle looked up before is as it was
    /// (see [`KeyCache`]).
    releases: AtomicU64,
}

impl Default for Registry {
    fn default() -> Self {
        Registry {
            chunks: (0..CHUNKS).map(|_| OnceLock::new()).collect(),
            writer: Mutex::new(Writer::default()),
            releases: AtomicU64::new(0),
        }
    }
}

#[inline]
fn split(handle: u64) -> Option<(usize, u64)> {
    let index = (handle & 0xffff_ffff) as usize;
    index.checked_sub(1).map(|i| (i, handle >> 32))
}

#[cold]
fn unknown(handle: u64) -> Error {
    Error::misuse(format!(
        "unknown or already released memory handle {handle:#x}"
    ))
}

impl Registry {
    #[inline]
    fn slot(&self, index: usize) -> Option<&Slot> {
        self.chunks
            .get(index / CHUNK)?
            .get()
            .map(|c| &c[index % CHUNK])
    }

    /// Records a registration and returns its handle (never 0).
    pub(crate) fn insert(&self, reg: Registration, hold: Option<Hold>) -> Result<u64> {
        let mut w = self.writer.lock();
        let index = match w.free.pop() {
            Some(i) => i,
            None if w.next < CHUNK * CHUNKS => {
                w.next += 1;
                w.next - 1
            }
            None => {
                return Err(Error::usage(format!(
                    "more than {} memory registrations at once",
                    CHUNK * CHUNKS
                )))
            }
        };
        let chunk = self.chunks[index / CHUNK]
            .get_or_init(|| (0..CHUNK).map(|_| Slot::default()).collect());
        let slot = &chunk[index % CHUNK];
        let generation = slot.state.load(Ordering::Relaxed) >> 2;
        slot.state
            .store(generation << 2 | WRITING, Ordering::Relaxed);
        fence(Ordering::Release);
        slot.addr.store(reg.addr as u64, Ordering::Relaxed);
        slot.len.store(reg.len as u64, Ordering::Relaxed);
        let k = &reg.keys;
        slot.kind.store(
            u64::from(k.host) | u64::from(k.rails) << 8 | (reg.dev as u64) << 32,
            Ordering::Relaxed,
        );
        for (r, to) in slot.keys[..usize::from(k.rails)].iter().enumerate() {
            to.store(
                u64::from(k.lkey(r)) | u64::from(k.rkey(r)) << 32,
                Ordering::Relaxed,
            );
        }
        slot.state.store(generation << 2 | LIVE, Ordering::Release);
        w.holds.insert(index, hold);
        Ok(generation << 32 | (index as u64 + 1))
    }

    /// Reads the slot of `handle` without taking a lock: `f` reads what it needs, which stands
    /// only if the slot was live under this handle's generation before and after.
    #[inline(always)]
    fn read<T>(&self, handle: u64, f: impl FnOnce(&Slot) -> T) -> Result<T> {
        let (index, generation) = split(handle).ok_or_else(|| unknown(handle))?;
        let slot = self.slot(index).ok_or_else(|| unknown(handle))?;
        let before = slot.state.load(Ordering::Acquire);
        if before != (generation << 2 | LIVE) {
            return Err(unknown(handle));
        }
        let v = f(slot);
        fence(Ordering::Acquire);
        if slot.state.load(Ordering::Relaxed) != before {
            // Released (and perhaps reused) while we read it.
            return Err(unknown(handle));
        }
        Ok(v)
    }

    /// Looks a handle up.
    pub(crate) fn get(&self, handle: u64) -> Result<Registration> {
        self.read(handle, |slot| Registration {
            addr: slot.addr.load(Ordering::Relaxed) as usize,
            len: slot.len.load(Ordering::Relaxed) as usize,
            dev: slot.device(),
            keys: {
                let mut keys = MemKeys::default();
                slot.keys_into(&mut keys, &KEYS_IN_ORDER);
                keys
            },
        })
    }

    /// The keys of `addr..addr+len` registered as `handle` on device `dev`: the data path's
    /// lookup, once per buffer (its errors out of line), through a comm's `cache` of its last
    /// handle. A handle found live stays as it was until some handle is released, so while the
    /// registry's release count stands still a repeated lookup is two compares and the slots
    /// are not read.
    #[inline(always)]
    pub(crate) fn keys<'c>(
        &self,
        cache: &'c mut KeyCache,
        handle: u64,
        (addr, len): (usize, usize),
        dev: usize,
    ) -> Result<&'c MemKeys> {
        // Read before the slot, so a release racing the read leaves a stale count behind
        // and the next lookup reads the slot again.
        let releases = self.releases.load(Ordering::Acquire);
        if cache.handle != handle || cache.releases != releases {
            self.fill(cache, handle, releases)?;
        }
        let (start, end, reg_dev) = cache.reg;
        if !covers((start, end, reg_dev), addr, len) {
            return Err(outside_registration(addr, len, &cache.reg));
        }
        if dev != reg_dev {
            return Err(wrong_device(reg_dev, dev));
        }
        Ok(&cache.keys)
    }

    /// Reads `handle` into `cache`, as of `releases`.
    #[inline(never)]
    fn fill(&self, cache: &mut KeyCache, handle: u64, releases: u64) -> Result<()> {
        cache.releases = u64::MAX;
        let mut keys = MemKeys::default();
        cache.reg = self.read(handle, |slot| {
            slot.keys_into(&mut keys, &cache.order);
            let start = slot.addr.load(Ordering::Relaxed) as usize;
            let len = slot.len.load(Ordering::Relaxed) as usize;
            (start, start.saturating_add(len), slot.device())
        })?;
        cache.keys = keys;
        cache.handle = handle;
        cache.releases = releases;
        Ok(())
    }

    /// Releases a handle (dropping what held its MR).
    pub(crate) fn remove(&self, handle: u64) -> Result<Registration> {
        let mut w = self.writer.lock();
        let reg = self.get(handle)?;
        let (index, generation) = split(handle).ok_or_else(|| unknown(handle))?;
        let slot = self.slot(index).ok_or_else(|| unknown(handle))?;
        // Counted first: a cache that still sees the old count read the slot before this.
        self.releases.fetch_add(1, Ordering::AcqRel);
        // A new generation, not live: every copy of the old handle is now unknown.
        slot.state
            .store(((generation + 1) % (1 << 30)) << 2, Ordering::Release);
        let hold = w.holds.remove(&index);
        w.free.push(index);
        drop(w);
        drop(hold);
        Ok(reg)
    }

    /// Number of live registrations.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.writer.lock().holds.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn keys(pairs: &[(u32, u32)]) -> MemKeys {
        let mut k = MemKeys {
            rails: pairs.len() as u8,
            host: true,
            ..MemKeys::default()
        };
        for (r, pair) in pairs.iter().enumerate() {
            k.set(r, *pair);
        }
        k
    }

    fn reg(addr: usize) -> Registration {
        Registration::new(addr, 100, 3, keys(&[(7, 9), (17, 19)]))
    }

    #[test]
    fn handles_are_checked_and_not_reused_after_release() {
        let t = Registry::default();
        let r = reg(4096);
        let h = t.insert(r, None).unwrap();
        assert_ne!(h, 0);
        assert_eq!(t.get(h).unwrap(), r);
        assert!(t.get(h + 1).is_err());
        assert!(t.get(0).is_err());
        assert!(t.get(u64::MAX).is_err());
        assert_eq!(t.remove(h).unwrap(), r);
        assert!(t.get(h).is_err(), "released");
        assert!(t.remove(h).is_err(), "double release");
        let h2 = t.insert(r, None).unwrap();
        assert_ne!(h, h2, "slot reused with a new generation");
        assert!(t.get(h).is_err());
        assert_eq!(t.len(), 1);
        assert!(r.covers(4096, 100) && r.covers(4100, 4) && r.covers(0, 0));
        assert!(!r.covers(4095, 2) && !r.covers(4190, 7));
    }

    #[test]
    fn a_comm_key_cache_answers_repeats_and_forgets_at_any_release() {
        let t = Registry::default();
        let mut cache = KeyCache::default();
        let lookup = |c: &mut KeyCache, h, at| t.keys(c, h, (at, 8), 3).copied();
        let h = t.insert(reg(4096), None).unwrap();
        assert_eq!(lookup(&mut cache, h, 4096).unwrap(), reg(4096).keys);
        // Answered from the cache, still checked: the range and the device.
        assert_eq!(lookup(&mut cache, h, 4100).unwrap(), reg(4096).keys);
        assert!(lookup(&mut cache, h, 4190).is_err(), "outside");
        assert!(t.keys(&mut cache, h, (4096, 8), 2).is_err(), "device");
        // Another handle released: the cache reads the table again, and the handle stands.
        let other = t.insert(reg(1 << 20), None).unwrap();
        t.remove(other).unwrap();
        assert_eq!(lookup(&mut cache, h, 4096).unwrap(), reg(4096).keys);
        // This handle released and its slot reused: the cached handle is refused.
        t.remove(h).unwrap();
        let mut moved = reg(8192);
        moved.keys.set(0, (70, 90));
        let h2 = t.insert(moved, None).unwrap();
        assert!(lookup(&mut cache, h, 4096).is_err(), "released handle");
        let found = lookup(&mut cache, h2, 8192).unwrap();
        assert_eq!((found.lkey(0), found.rkey(0)), (70, 90));
    }

    #[test]
    fn holds_are_dropped_at_release() {
        let t = Registry::default();
        let held = Arc::new(());
        let h = t.insert(reg(1), Some(Box::new(Arc::clone(&held)))).unwrap();
        assert_eq!(Arc::strong_count(&held), 2);
        t.remove(h).unwrap();
        assert_eq!(Arc::strong_count(&held), 1);
    }

    #[test]
    fn concurrent_lookups_see_whole_registrations_or_errors() {
        let t = Arc::new(Registry::default());
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (t, stop) = (Arc::clone(&t), Arc::clone(&stop));
                std::thread::spawn(move || {
                    let mut seen = 0;
                    while !stop.load(Ordering::Relaxed) {
                        for h in 1..64u64 {
                            for generation in 0..4u64 {
                                if let Ok(r) = t.get(generation << 32 | h) {
                                    // Fields written together are read together.
                                    assert_eq!(r.len, r.addr * 2);
                                    assert_eq!(r.keys.lkey(0) as usize, r.addr);
                                    seen += 1;
                                }
                            }
                        }
                    }
                    seen
                })
            })
            .collect();
        for round in 1..2000usize {
            let a = round % 1000 + 1;
            let h = t
                .insert(Registration::new(a, a * 2, 0, keys(&[(a as u32, 0)])), None)
                .unwrap();
            t.remove(h).unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        for r in readers {
            r.join().unwrap();
        }
    }
}
