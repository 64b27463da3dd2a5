//! Message buffers and their contents: one registered allocation per connection and
//! direction, carved into slots per size, and the patterns that let the receiver check the
//! first and the last message of each size and phase.
//!
//! Only those two messages are checked (and so get their own slots): filling and checking
//! every message would measure memory bandwidth, not the plugin.

use nccl_net_erdma_tools::client::Opaque;

use crate::Res;

/// Pattern streams (part of the seed), so no two phases' patterns coincide.
pub const STREAM_BW: u64 = 1;
pub const STREAM_PING: u64 = 2;
pub const STREAM_PONG: u64 = 3;

/// One registered allocation, carved into slots per size.
pub struct Arena {
    pub buf: Vec<u8>,
    pub mh: Opaque,
}

impl Arena {
    pub fn new(len: usize) -> Self {
        // Non-zero fill: touches every page now, not in the first timed loop.
        Arena {
            buf: vec![0xa5; len.max(64)],
            mh: Opaque::NULL,
        }
    }

    /// Pointer to slot `i` of `layout` (derived afresh from the vector each time).
    pub fn slot_ptr(&mut self, layout: &Layout, i: usize) -> *mut u8 {
        self.buf.as_mut_ptr().wrapping_add(i * layout.stride)
    }

    pub fn slot(&mut self, layout: &Layout, i: usize) -> &mut [u8] {
        let at = i * layout.stride;
        &mut self.buf[at..at + layout.size]
    }
}

/// Where the messages of one size live. Slots 0 and 1 hold the checked first and last
/// message; send slot 2 holds every other send; receive slots 2.. are the receive pool.
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    pub size: usize,
    pub stride: usize,
    pub pool: usize,
    /// Messages per connection (bandwidth phase).
    pub total: usize,
}

impl Layout {
    /// Slot distance for `size`: 64-byte aligned, never 0.
    pub fn stride(size: usize) -> usize {
        size.div_ceil(64).max(1) * 64
    }

    /// `pool` receive slots; `total` messages per connection.
    pub fn new(size: usize, pool: usize, total: usize) -> Self {
        Layout {
            size,
            stride: Self::stride(size),
            pool: pool.max(1),
            total,
        }
    }

    pub fn recv_bytes(&self) -> usize {
        (2 + self.pool) * self.stride
    }

    pub fn send_bytes(&self) -> usize {
        3 * self.stride
    }

    pub fn send_slot(&self, m: usize) -> usize {
        if m == 0 {
            0
        } else if m + 1 == self.total {
            1
        } else {
            2
        }
    }

    pub fn recv_slot(&self, m: usize) -> usize {
        if m == 0 {
            0
        } else if m + 1 == self.total {
            1
        } else {
            2 + m % self.pool
        }
    }
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Seed of the pattern of message `msg` of `size` on connection `conn` in `stream`.
pub fn seed(size: usize, stream: u64, conn: usize, msg: usize) -> u64 {
    splitmix(splitmix(splitmix(size as u64 ^ (stream << 56)) ^ conn as u64) ^ msg as u64)
}

pub fn fill(buf: &mut [u8], seed: u64) {
    for (i, c) in buf.chunks_mut(8).enumerate() {
        let w = splitmix(seed ^ i as u64).to_le_bytes();
        c.copy_from_slice(&w[..c.len()]);
    }
}

/// First byte that differs from the pattern: (offset, got, expected).
fn mismatch(buf: &[u8], seed: u64) -> Option<(usize, u8, u8)> {
    buf.chunks(8).enumerate().find_map(|(i, c)| {
        let w = splitmix(seed ^ i as u64).to_le_bytes();
        c.iter()
            .zip(w)
            .position(|(a, b)| *a != b)
            .map(|j| (i * 8 + j, c[j], w[j]))
    })
}

pub fn check_pattern(buf: &[u8], seed: u64, what: impl FnOnce() -> String) -> Res<()> {
    match mismatch(buf, seed) {
        None => Ok(()),
        Some((at, got, want)) => Err(format!(
            "data mismatch in {}: byte {at} is {got:#04x}, expected {want:#04x}",
            what()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_keeps_checked_slots_private() {
        let l = Layout::new(1000, 8, 100);
        assert_eq!(l.pool, 8);
        assert_eq!(l.stride, 1024);
        assert_eq!((l.recv_slot(0), l.recv_slot(99)), (0, 1));
        assert!((1..99).all(|m| (2..2 + l.pool).contains(&l.recv_slot(m))));
        assert_eq!(
            (l.send_slot(0), l.send_slot(50), l.send_slot(99)),
            (0, 2, 1)
        );
        assert_eq!((l.send_bytes(), l.recv_bytes()), (3 * 1024, 10 * 1024));
    }

    #[test]
    fn patterns_detect_changes() {
        let mut b = vec![0u8; 1003];
        fill(&mut b, seed(1003, STREAM_BW, 0, 0));
        assert_eq!(mismatch(&b, seed(1003, STREAM_BW, 0, 0)), None);
        assert!(mismatch(&b, seed(1003, STREAM_BW, 0, 1)).is_some());
        b[1001] ^= 1;
        assert_eq!(
            mismatch(&b, seed(1003, STREAM_BW, 0, 0)).map(|m| m.0),
            Some(1001)
        );
        let e = check_pattern(&b, seed(1003, STREAM_BW, 0, 0), || "m".into()).unwrap_err();
        assert!(e.starts_with("data mismatch in m: byte 1001 is "), "{e}");
    }
}
