//! Memory registrations as NCCL sees them: opaque handles from `regMr`, checked on every use.
//!
//! A handle is a generation-tagged slot index, never a pointer, so an unknown, forged or
//! already-released handle is an error code instead of a crash. `regIsGlobal` is 1: a
//! registration is not tied to the comm it was made on.

use parking_lot::RwLock;

use crate::error::{Error, Result};

/// What was registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registration {
    /// First byte.
    pub addr: usize,
    /// Length in bytes.
    pub len: usize,
    /// `NCCL_PTR_HOST` or `NCCL_PTR_CUDA`.
    pub ptr_type: i32,
    /// Device index the registration belongs to.
    pub dev: usize,
    /// Local and remote keys (verbs transport).
    pub lkey: u32,
    /// Remote key (verbs transport).
    pub rkey: u32,
}

impl Registration {
    /// Whether `addr..addr+len` lies inside this registration.
    pub fn covers(&self, addr: usize, len: usize) -> bool {
        len == 0 || (addr >= self.addr && addr.saturating_add(len) <= self.addr + self.len)
    }
}

/// What keeps a registration's verbs MR alive; dropped at deregistration.
pub type Hold = Box<dyn std::any::Any + Send + Sync>;

#[derive(Default)]
struct Slot {
    generation: u32,
    reg: Option<Registration>,
    hold: Option<Hold>,
}

/// All live registrations of the process.
#[derive(Default)]
pub struct MrTable {
    slots: RwLock<(Vec<Slot>, Vec<u32>)>,
}

fn split(handle: u64) -> Option<(usize, u32)> {
    let index = (handle & 0xffff_ffff) as usize;
    let generation = (handle >> 32) as u32;
    index.checked_sub(1).map(|i| (i, generation))
}

impl MrTable {
    /// Records a registration and returns its handle (never 0).
    pub fn insert(&self, reg: Registration, hold: Option<Hold>) -> u64 {
        let mut guard = self.slots.write();
        let (slots, free) = &mut *guard;
        let index = match free.pop() {
            Some(i) => i as usize,
            None => {
                slots.push(Slot::default());
                slots.len() - 1
            }
        };
        let slot = &mut slots[index];
        slot.reg = Some(reg);
        slot.hold = hold;
        (u64::from(slot.generation) << 32) | (index as u64 + 1)
    }

    /// Looks a handle up.
    pub fn get(&self, handle: u64) -> Result<Registration> {
        let guard = self.slots.read();
        split(handle)
            .and_then(|(i, generation)| {
                guard
                    .0
                    .get(i)
                    .filter(|s| s.generation == generation)
                    .and_then(|s| s.reg)
            })
            .ok_or_else(|| unknown(handle))
    }

    /// Releases a handle.
    pub fn remove(&self, handle: u64) -> Result<Registration> {
        let mut guard = self.slots.write();
        let (slots, free) = &mut *guard;
        let (i, generation) = split(handle).ok_or_else(|| unknown(handle))?;
        let slot = slots
            .get_mut(i)
            .filter(|s| s.generation == generation && s.reg.is_some())
            .ok_or_else(|| unknown(handle))?;
        let reg = slot.reg.take().expect("checked above");
        // Dropping the hold deregisters (or releases the cache entry) outside no lock but
        // ours; the verbs cache takes its own lock, never this one.
        drop(slot.hold.take());
        slot.generation = slot.generation.wrapping_add(1);
        free.push(i as u32);
        Ok(reg)
    }

    /// Number of live registrations.
    pub fn len(&self) -> usize {
        self.slots
            .read()
            .0
            .iter()
            .filter(|s| s.reg.is_some())
            .count()
    }

    /// True when nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn unknown(handle: u64) -> Error {
    Error::Misuse(format!(
        "unknown or already released memory handle {handle:#x}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_are_checked_and_not_reused_after_release() {
        let t = MrTable::default();
        let r = Registration {
            addr: 4096,
            len: 100,
            ptr_type: 1,
            dev: 0,
            lkey: 0,
            rkey: 0,
        };
        let h = t.insert(r, None);
        assert_ne!(h, 0);
        assert_eq!(t.get(h).unwrap(), r);
        assert!(t.get(h + 1).is_err());
        assert!(t.get(0).is_err());
        assert_eq!(t.remove(h).unwrap(), r);
        assert!(t.get(h).is_err(), "released");
        assert!(t.remove(h).is_err(), "double release");
        let h2 = t.insert(r, None);
        assert_ne!(h, h2, "slot reused with a new generation");
        assert!(t.get(h).is_err());
        assert_eq!(t.len(), 1);
        assert!(r.covers(4096, 100) && r.covers(4100, 4) && r.covers(0, 0));
        assert!(!r.covers(4095, 2) && !r.covers(4190, 7));
    }
}
