//! One reader and one writer for every byte format that crosses a socket or an RDMA write:
//! the handle, the bootstrap's messages, the verbs setup and move messages, the clear-to-send
//! entries a move carries and tcp's frames. Integers are little-endian unless a field says
//! otherwise (the handle's port is in network order).
//!
//! A decoder reads its fields in order through a [`Reader`]; a read past the end, bytes left
//! after the last field or a value its field cannot hold is a [`WireError`] naming the
//! message, the field and the offset, never a panic or an index out of range. The peer's
//! bytes are the only input, so the error becomes `ncclRemoteError` (`From<WireError> for
//! Error`); the handle, which NCCL hands over, maps it to a misuse itself.

use std::fmt;

use crate::error::Error;

/// Why a message could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireError {
    /// The message being read ("move answer", "tcp clear-to-send frame", ...).
    pub message: &'static str,
    /// The field that could not be read.
    pub field: &'static str,
    /// Where in the message the field starts.
    pub at: usize,
    /// What is wrong with it.
    pub problem: Problem,
}

/// What is wrong with a field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    /// The message ends before the field does: `need` bytes, `left` there.
    Short {
        /// Bytes the field takes.
        need: usize,
        /// Bytes the message has left.
        left: usize,
    },
    /// Bytes follow the field that should have been the last.
    Trailing {
        /// How many.
        extra: usize,
    },
    /// A text field is not UTF-8 from this byte of it on.
    NotText {
        /// Its bytes before the first that is not UTF-8.
        valid: usize,
    },
    /// The field holds a value it may not.
    Invalid {
        /// The value read.
        value: u64,
        /// What it may be.
        allowed: String,
    },
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (message, field, at) = (self.message, self.field, self.at);
        match &self.problem {
            Problem::Short { need, left } => write!(
                f,
                "invalid {message}: field `{field}` needs {need} bytes at offset {at}, \
                 the message has {left}"
            ),
            Problem::Trailing { extra } => write!(
                f,
                "invalid {message}: {extra} bytes follow its last field `{field}` at offset {at}"
            ),
            Problem::NotText { valid } => write!(
                f,
                "invalid {message}: field `{field}` at offset {at} is not UTF-8 after {valid} bytes"
            ),
            Problem::Invalid { value, allowed } => write!(
                f,
                "invalid {message}: field `{field}` at offset {at} is {value}, \
                 it may be {allowed}"
            ),
        }
    }
}

impl std::error::Error for WireError {}

impl From<WireError> for Error {
    fn from(e: WireError) -> Self {
        Error::remote(e.to_string())
    }
}

/// Reads a message's fields in order, each bounds-checked.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    message: &'static str,
    /// The field read last and where it began, for [`Reader::end`]'s and
    /// [`Reader::invalid`]'s errors.
    last: &'static str,
    last_at: usize,
}

impl<'a> Reader<'a> {
    /// A reader of `bytes`, a `message` (its name in errors).
    #[inline]
    pub fn new(message: &'static str, bytes: &'a [u8]) -> Self {
        #[cfg(test)]
        tap::saw(message, bytes);
        Reader {
            bytes,
            at: 0,
            message,
            last: "",
            last_at: 0,
        }
    }

    /// The next `n` bytes.
    #[inline]
    pub fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], WireError> {
        let left = self.left();
        if n > left {
            return Err(self.error(field, Problem::Short { need: n, left }));
        }
        let b = &self.bytes[self.at..self.at + n];
        self.last = field;
        self.last_at = self.at;
        self.at += n;
        Ok(b)
    }

    /// The next `N` bytes, as an array.
    #[inline]
    pub fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], WireError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, field)?);
        Ok(a)
    }

    /// A text field of `n` bytes, zero-padded: the UTF-8 before its first zero byte.
    pub fn text(&mut self, n: usize, field: &'static str) -> Result<&'a str, WireError> {
        let b = self.take(n, field)?;
        let end = b.iter().position(|c| *c == 0).unwrap_or(n);
        std::str::from_utf8(&b[..end]).map_err(|e| WireError {
            message: self.message,
            field,
            at: self.last_at,
            problem: Problem::NotText {
                valid: e.valid_up_to(),
            },
        })
    }

    /// The next byte.
    #[inline]
    pub fn u8(&mut self, field: &'static str) -> Result<u8, WireError> {
        Ok(self.array::<1>(field)?[0])
    }

    /// The next little-endian `u16`.
    #[inline]
    pub fn u16(&mut self, field: &'static str) -> Result<u16, WireError> {
        self.array(field).map(u16::from_le_bytes)
    }

    /// The next `u16` in network order.
    #[inline]
    pub fn u16_be(&mut self, field: &'static str) -> Result<u16, WireError> {
        self.array(field).map(u16::from_be_bytes)
    }

    /// The next little-endian `u32`.
    #[inline]
    pub fn u32(&mut self, field: &'static str) -> Result<u32, WireError> {
        self.array(field).map(u32::from_le_bytes)
    }

    /// The next little-endian `i32`.
    #[inline]
    pub fn i32(&mut self, field: &'static str) -> Result<i32, WireError> {
        self.array(field).map(i32::from_le_bytes)
    }

    /// The next little-endian `u64`.
    #[inline]
    pub fn u64(&mut self, field: &'static str) -> Result<u64, WireError> {
        self.array(field).map(u64::from_le_bytes)
    }

    /// A one-byte count, at most `max`.
    #[inline]
    pub fn count_u8(&mut self, field: &'static str, max: usize) -> Result<usize, WireError> {
        let n = self.u8(field)?;
        self.at_most(n.into(), max)
    }

    /// A little-endian `u16` count, at most `max`.
    #[inline]
    pub fn count_u16(&mut self, field: &'static str, max: usize) -> Result<usize, WireError> {
        let n = self.u16(field)?;
        self.at_most(n.into(), max)
    }

    /// A little-endian `u32` count (a length), at most `max`.
    #[inline]
    pub fn count_u32(&mut self, field: &'static str, max: usize) -> Result<usize, WireError> {
        let n = self.u32(field)?;
        self.at_most(n.into(), max)
    }

    fn at_most(&self, n: u64, max: usize) -> Result<usize, WireError> {
        match usize::try_from(n) {
            Ok(n) if n <= max => Ok(n),
            _ => Err(self.invalid(n, format_args!("at most {max}"))),
        }
    }

    /// Everything left.
    #[inline]
    pub fn rest(&mut self) -> &'a [u8] {
        let b = &self.bytes[self.at..];
        self.at = self.bytes.len();
        b
    }

    /// Bytes not read yet.
    #[inline]
    pub fn left(&self) -> usize {
        self.bytes.len() - self.at
    }

    /// Bytes read so far.
    #[inline]
    pub fn position(&self) -> usize {
        self.at
    }

    /// The message must end here.
    #[inline]
    pub fn end(self) -> Result<(), WireError> {
        match self.left() {
            0 => Ok(()),
            extra => Err(self.error(self.last, Problem::Trailing { extra })),
        }
    }

    /// The error of the field just read, which holds `value` and may only be `allowed`.
    #[cold]
    pub fn invalid(&self, value: impl Into<u64>, allowed: impl fmt::Display) -> WireError {
        WireError {
            message: self.message,
            field: self.last,
            at: self.last_at,
            problem: Problem::Invalid {
                value: value.into(),
                allowed: allowed.to_string(),
            },
        }
    }

    #[cold]
    fn error(&self, field: &'static str, problem: Problem) -> WireError {
        WireError {
            message: self.message,
            field,
            at: self.at,
            problem,
        }
    }
}

/// Where a [`Writer`] puts its bytes: a growing vector, or a buffer of a fixed layout.
pub trait Sink {
    /// Writes `bytes` at offset `at`, the writer's position.
    fn put(&mut self, at: usize, bytes: &[u8]);
}

impl Sink for Vec<u8> {
    #[inline]
    fn put(&mut self, _at: usize, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

impl Sink for &mut [u8] {
    /// Fixed layouts are sized to their buffers (each checks it at compile time or in its
    /// tests); writing past the end is a bug of the layout, not of the peer.
    #[inline]
    fn put(&mut self, at: usize, bytes: &[u8]) {
        self[at..at + bytes.len()].copy_from_slice(bytes);
    }
}

/// Writes a message's fields in order.
#[derive(Debug)]
pub struct Writer<S> {
    sink: S,
    at: usize,
}

impl Writer<Vec<u8>> {
    /// A writer into a new vector with room for `capacity` bytes.
    pub fn with_capacity(capacity: usize) -> Self {
        Writer {
            sink: Vec::with_capacity(capacity),
            at: 0,
        }
    }

    /// The bytes written.
    pub fn into_vec(self) -> Vec<u8> {
        self.sink
    }
}

impl<'a> Writer<&'a mut [u8]> {
    /// A writer into `buf` from its start.
    #[inline]
    pub fn over(buf: &'a mut [u8]) -> Self {
        Writer { sink: buf, at: 0 }
    }
}

impl<S: Sink> Writer<S> {
    /// Bytes written so far.
    #[inline]
    pub fn written(&self) -> usize {
        self.at
    }

    /// `bytes` as they are.
    #[inline]
    pub fn bytes(&mut self, bytes: &[u8]) -> &mut Self {
        self.sink.put(self.at, bytes);
        self.at += bytes.len();
        self
    }

    /// `bytes` in a field of `width` bytes: cut to it, or padded with zeros.
    pub fn padded(&mut self, bytes: &[u8], width: usize) -> &mut Self {
        let n = bytes.len().min(width);
        self.bytes(&bytes[..n]).zeros(width - n)
    }

    /// `n` zero bytes (reserved fields).
    #[inline]
    pub fn zeros(&mut self, n: usize) -> &mut Self {
        const ZEROS: [u8; 16] = [0; 16];
        let mut left = n;
        while left > 0 {
            let k = left.min(ZEROS.len());
            self.bytes(&ZEROS[..k]);
            left -= k;
        }
        self
    }

    /// One byte.
    #[inline]
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.bytes(&[v])
    }

    /// A little-endian `u16`.
    #[inline]
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }

    /// A `u16` in network order.
    #[inline]
    pub fn u16_be(&mut self, v: u16) -> &mut Self {
        self.bytes(&v.to_be_bytes())
    }

    /// A little-endian `u32`.
    #[inline]
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }

    /// A little-endian `i32`.
    #[inline]
    pub fn i32(&mut self, v: i32) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }

    /// A little-endian `u64`.
    #[inline]
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }
}

/// Test builds: every message a [`Reader`] is given, kept while a test listens, so the fuzz
/// targets' seed corpora are real messages captured from a run.
#[cfg(test)]
pub(crate) mod tap {
    use std::sync::atomic::{AtomicBool, Ordering};

    use parking_lot::Mutex;

    static LISTENING: AtomicBool = AtomicBool::new(false);
    static SEEN: Mutex<Vec<(&'static str, Vec<u8>)>> = Mutex::new(Vec::new());

    /// Keeps what readers are given from now on.
    pub(crate) fn listen() {
        SEEN.lock().clear();
        LISTENING.store(true, Ordering::SeqCst);
    }

    /// Stops keeping; returns what was kept: (message, bytes), in order.
    pub(crate) fn heard() -> Vec<(&'static str, Vec<u8>)> {
        LISTENING.store(false, Ordering::SeqCst);
        std::mem::take(&mut *SEEN.lock())
    }

    pub(super) fn saw(message: &'static str, bytes: &[u8]) {
        if LISTENING.load(Ordering::Relaxed) {
            SEEN.lock().push((message, bytes.to_vec()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_read_is_bounded_and_names_its_field() {
        let bytes = [1u8, 0, 2, 0, 0, 0, 9];
        let mut r = Reader::new("sample", &bytes);
        assert_eq!(r.u16("a").unwrap(), 1);
        assert_eq!(r.u32("b").unwrap(), 2);
        let e = r.u16("c").unwrap_err();
        assert_eq!(e.field, "c");
        assert_eq!(e.at, 6);
        assert_eq!(e.problem, Problem::Short { need: 2, left: 1 });
        assert_eq!(
            e.to_string(),
            "invalid sample: field `c` needs 2 bytes at offset 6, the message has 1"
        );
        // A failed read consumes nothing.
        assert_eq!(r.u8("c").unwrap(), 9);
        r.end().unwrap();
    }

    #[test]
    fn trailing_bytes_and_counts_out_of_range_are_errors() {
        let mut r = Reader::new("sample", &[5, 0, 7]);
        let e = r.count_u16("n", 4).unwrap_err();
        assert_eq!((e.field, e.at), ("n", 0));
        assert_eq!(
            e.problem,
            Problem::Invalid {
                value: 5,
                allowed: "at most 4".into()
            }
        );
        let mut r = Reader::new("sample", &[3, 0, 7]);
        assert_eq!(r.count_u16("n", 4).unwrap(), 3);
        let e = r.end().unwrap_err();
        assert_eq!(e.problem, Problem::Trailing { extra: 1 });
        assert_eq!(e.field, "n");
        let e = Error::from(e);
        assert_eq!(e.code(), crate::error::ErrorKind::Remote.code());
    }

    #[test]
    fn a_writer_lays_out_what_the_reader_reads() {
        let mut w = Writer::with_capacity(0);
        w.u8(1)
            .u16(2)
            .u16_be(3)
            .u32(4)
            .i32(-5)
            .u64(6)
            .padded(b"abc", 5)
            .padded(b"toolong", 3)
            .zeros(20);
        let v = w.into_vec();
        assert_eq!(v.len(), 1 + 2 + 2 + 4 + 4 + 8 + 5 + 3 + 20);
        let mut r = Reader::new("sample", &v);
        assert_eq!(r.u8("a").unwrap(), 1);
        assert_eq!(r.u16("b").unwrap(), 2);
        assert_eq!(r.u16_be("c").unwrap(), 3);
        assert_eq!(r.u32("d").unwrap(), 4);
        assert_eq!(r.i32("e").unwrap(), -5);
        assert_eq!(r.u64("f").unwrap(), 6);
        assert_eq!(r.text(5, "g").unwrap(), "abc");
        assert_eq!(r.take(3, "h").unwrap(), b"too");
        assert_eq!(r.rest(), &[0u8; 20]);
        r.end().unwrap();
        let e = Reader::new("sample", b"ab\xffc")
            .text(4, "name")
            .unwrap_err();
        assert_eq!(e.problem, Problem::NotText { valid: 2 });
        let mut fixed = [0xffu8; 8];
        let mut w = Writer::over(&mut fixed[..]);
        w.u16_be(0x0102).zeros(2).u32(7);
        assert_eq!(w.written(), 8);
        assert_eq!(fixed, [1, 2, 0, 0, 7, 0, 0, 0]);
    }
}
