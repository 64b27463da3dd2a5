//! What the two ends of a tcp connection put on the socket after setup: clear-to-send frames
//! (a header and one entry per buffer of a receive) and data frames (a header, then the
//! payload), and how a socket is written and a failed step of it reported.

use std::{
    io::{self, IoSlice},
    net::SocketAddr,
};

use socket2::Socket;

use crate::codec::{Reader, WireError, Writer};
use crate::error::{Error, Result};
use crate::oob;
use crate::transport::{Failure, MAX_RECVS};

/// Frame types: a receive's clear-to-send, a send's data.
const FRAME_CTS: u8 = 1;
const FRAME_DATA: u8 = 2;
/// A data frame's flag: the send was larger than its receive (no payload follows).
const FLAG_TRUNC: u8 = 1;
/// Bytes of a clear-to-send frame's header and of each of its entries, and the most it takes.
const CTS_HEADER: usize = 8;
const CTS_ENTRY: usize = 16;
pub(crate) const CTS_MAX: usize = CTS_HEADER + MAX_RECVS * CTS_ENTRY;
/// Bytes of a data frame's header.
pub(crate) const DATA_HEADER: usize = 16;

/// Which tcp stream the `tcp_frames` fuzz target reads: the first byte of its input, even
/// for what a sender reads (clear-to-send frames), odd for what a receiver reads (data frame
/// headers).
pub const TCP_SENDER_READS: u8 = 0;
/// See [`TCP_SENDER_READS`].
pub const TCP_RECEIVER_READS: u8 = 1;

/// A receive's clear-to-send: type u8 (1) | buffers u8 | 2 reserved | the receive's sequence
/// number u32, then per buffer its size u64 | tag i32 | 4 reserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct CtsFrame {
    /// The receive's sequence number.
    pub(crate) seq: u32,
    /// Buffers of the receive (1 to `MAX_RECVS`): each one's size and tag.
    pub(crate) n: usize,
    pub(crate) sizes: [u64; MAX_RECVS],
    pub(crate) tags: [i32; MAX_RECVS],
}

impl CtsFrame {
    /// Writes the frame into `out`; returns its length.
    pub(crate) fn encode(&self, out: &mut [u8; CTS_MAX]) -> usize {
        let mut w = Writer::over(&mut out[..]);
        w.u8(FRAME_CTS).u8(self.n as u8).zeros(2).u32(self.seq);
        for i in 0..self.n {
            w.u64(self.sizes[i]).i32(self.tags[i]).zeros(4);
        }
        w.written()
    }

    /// The frame at the start of `bytes` and its length; `None` while it has not all arrived.
    pub(crate) fn decode(bytes: &[u8]) -> Result<Option<(Self, usize)>, WireError> {
        let mut r = Reader::new("tcp clear-to-send frame", bytes);
        if r.left() < CTS_HEADER {
            return Ok(None);
        }
        let kind = r.u8("type")?;
        if kind != FRAME_CTS {
            return Err(r.invalid(kind, FRAME_CTS));
        }
        let n = r.u8("buffers")?;
        if !(1..=MAX_RECVS).contains(&usize::from(n)) {
            return Err(r.invalid(n, format_args!("1 to {MAX_RECVS}")));
        }
        let n = usize::from(n);
        r.take(2, "reserved")?;
        let seq = r.u32("receive")?;
        if r.left() < n * CTS_ENTRY {
            return Ok(None);
        }
        let mut frame = CtsFrame {
            seq,
            n,
            sizes: [0; MAX_RECVS],
            tags: [0; MAX_RECVS],
        };
        for i in 0..n {
            frame.sizes[i] = r.u64("size")?;
            frame.tags[i] = r.i32("tag")?;
            r.take(4, "entry reserved")?;
        }
        Ok(Some((frame, r.position())))
    }
}

/// The header of a send's data: type u8 (2) | the receive's buffer u8 | flags u8 | reserved u8
/// | the receive's sequence number u32 | the send's size u64; the payload follows unless the
/// send was truncated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DataHeader {
    /// The buffer of the receive the data is for.
    pub(crate) entry: u8,
    /// The send was larger than the buffer: no payload follows.
    pub(crate) truncated: bool,
    /// The receive's sequence number.
    pub(crate) seq: u32,
    /// The send's size.
    pub(crate) size: u64,
}

impl DataHeader {
    pub(crate) fn encode(&self) -> [u8; DATA_HEADER] {
        let mut h = [0u8; DATA_HEADER];
        Writer::over(&mut h[..])
            .u8(FRAME_DATA)
            .u8(self.entry)
            .u8(if self.truncated { FLAG_TRUNC } else { 0 })
            .zeros(1)
            .u32(self.seq)
            .u64(self.size);
        h
    }

    pub(crate) fn decode(h: &[u8; DATA_HEADER]) -> Result<Self, WireError> {
        let mut r = Reader::new("tcp data frame header", h);
        let kind = r.u8("type")?;
        if kind != FRAME_DATA {
            return Err(r.invalid(kind, FRAME_DATA));
        }
        let entry = r.u8("buffer")?;
        let flags = r.u8("flags")?;
        if flags & !FLAG_TRUNC != 0 {
            return Err(r.invalid(flags, format_args!("0 or {FLAG_TRUNC}")));
        }
        r.take(1, "reserved")?;
        Ok(DataHeader {
            entry,
            truncated: flags & FLAG_TRUNC != 0,
            seq: r.u32("receive")?,
            size: r.u64("size")?,
        })
    }
}

pub(super) fn send_nosignal(sock: &Socket, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
    // MSG_NOSIGNAL: a peer that closed must be an error code, not a SIGPIPE that kills the
    // training process.
    sock.send_vectored_with_flags(bufs, libc::MSG_NOSIGNAL)
}

/// Records a failed step of a comm's progress as its failure, naming the peer (and the
/// keepalive timeout when that was the cause); `dir` is "to" or "from". The failure keeps
/// the step's kind (a peer gone, or this host's system call).
pub(super) fn note_broken(failure: &mut Failure, r: Result<()>, dir: &str, peer: SocketAddr) {
    if let Err(e) = r {
        let hint = oob::peer_timeout_hint(&e);
        let msg = format!("connection {dir} {peer} failed: {e}{hint}");
        let e = match e.kind() {
            crate::error::ErrorKind::Remote => Error::remote(msg),
            _ => Error::io(msg, std::io::Error::other(e.to_string())),
        };
        failure.note(&e);
    }
}
