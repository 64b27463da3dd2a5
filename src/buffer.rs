//! Caller-owned memory that crosses the boundary.
//!
//! NCCL hands `isend`/`irecv` raw pointers and promises the memory stays valid, and is not
//! written by anyone else in the receive case, until `test` reports the request done. A
//! [`UserBuffer`] captures that promise once, at the boundary (`abi` makes every one), so the
//! transports below can use the memory as slices without any `unsafe` of their own.

/// A memory range NCCL lent us for the life of one request.
#[derive(Debug, Clone, Copy)]
pub(crate) struct UserBuffer {
    addr: usize,
    len: usize,
}

impl UserBuffer {
    /// No memory: a zero-byte message.
    pub(crate) const EMPTY: UserBuffer = UserBuffer { addr: 0, len: 0 };

    /// Wraps NCCL's pointer.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes until the request that uses
    /// this buffer completes or its comm is closed, and nothing else may write the memory in
    /// that time while the plugin writes it (receives). NCCL guarantees both.
    pub(crate) unsafe fn new(ptr: *mut u8, len: usize) -> Self {
        UserBuffer {
            addr: ptr as usize,
            len,
        }
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// True for zero bytes.
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start address (for range checks against registrations).
    pub(crate) fn addr(&self) -> usize {
        self.addr
    }

    /// The bytes `from..` of the buffer.
    pub(crate) fn bytes_from(&self, from: usize) -> &[u8] {
        if from >= self.len {
            return &[];
        }
        // SAFETY: `new`'s contract makes addr..addr+len readable for the request's life, and
        // the range is inside it (from < len).
        unsafe { std::slice::from_raw_parts((self.addr + from) as *const u8, self.len - from) }
    }

    /// The bytes `from..to` of the buffer, for writing received data.
    pub(crate) fn bytes_mut(&mut self, from: usize, to: usize) -> &mut [u8] {
        let to = to.min(self.len);
        if from >= to {
            return &mut [];
        }
        // SAFETY: `new`'s contract makes addr..addr+len writable and ours alone to write for
        // the request's life; from < to <= len keeps the range inside it, and `&mut self`
        // means no other slice from this handle is live.
        unsafe { std::slice::from_raw_parts_mut((self.addr + from) as *mut u8, to - from) }
    }
}

/// Memory a unit test owns and lends to a transport as NCCL would: the buffers of the
/// transports' tests, without `unsafe` in the tests.
#[cfg(test)]
pub(crate) struct TestMem {
    mem: Box<[u8]>,
}

#[cfg(test)]
impl TestMem {
    /// `len` bytes of `seed`'s pattern (see [`TestMem::pattern`]).
    pub(crate) fn new(len: usize, seed: u64) -> Self {
        TestMem {
            mem: Self::pattern(len, seed).into_boxed_slice(),
        }
    }

    /// Deterministic bytes for message `seed`.
    pub(crate) fn pattern(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// The start address (for registration).
    pub(crate) fn addr(&self) -> usize {
        self.mem.as_ptr() as usize
    }

    /// Its size in bytes.
    pub(crate) fn len(&self) -> usize {
        self.mem.len()
    }

    /// The whole memory as a buffer.
    pub(crate) fn buffer(&mut self) -> UserBuffer {
        self.slice(0, self.mem.len())
    }

    /// `len` bytes at `off` as a buffer.
    pub(crate) fn slice(&mut self, off: usize, len: usize) -> UserBuffer {
        assert!(off + len <= self.mem.len());
        // SAFETY: the range lies inside memory this value owns; tests keep it alive while
        // the transport uses the buffer, as NCCL does.
        unsafe { UserBuffer::new(self.mem.as_mut_ptr().add(off), len) }
    }

    /// The current contents (volatile: a fake NIC wrote them behind the compiler's back).
    pub(crate) fn bytes(&self) -> Vec<u8> {
        (0..self.mem.len())
            // SAFETY: in bounds of memory this value owns.
            .map(|i| unsafe { std::ptr::read_volatile(self.mem.as_ptr().add(i)) })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_stay_inside_the_buffer() {
        let mut v = vec![1u8, 2, 3, 4];
        // SAFETY: `v` outlives `b` and nothing else touches it meanwhile.
        let mut b = unsafe { UserBuffer::new(v.as_mut_ptr(), v.len()) };
        assert_eq!(b.bytes_from(1), &[2, 3, 4]);
        assert!(b.bytes_from(9).is_empty());
        b.bytes_mut(2, 99).copy_from_slice(&[7, 8]);
        assert!(b.bytes_mut(3, 2).is_empty());
        assert_eq!(v, [1, 2, 7, 8]);
        assert!(UserBuffer::EMPTY.bytes_from(0).is_empty());
    }
}
