//! What the two ends of a tcp connection put on the socket after setup: clear-to-send frames
//! (a header and one entry per buffer of a receive) and data frames (a header, then the
//! payload), and how a socket is written and a failed step of it reported.

use std::{
    io::{self, IoSlice},
    net::SocketAddr,
};

use socket2::Socket;

use crate::error::{Error, Result};
use crate::oob;
use crate::transport::{Failure, MAX_RECVS};

/// Frame types: a receive's clear-to-send, a send's data.
pub(super) const FRAME_CTS: u8 = 1;
pub(super) const FRAME_DATA: u8 = 2;
/// A data frame's flag: the send was larger than its receive (no payload follows).
pub(super) const FLAG_TRUNC: u8 = 1;
/// Bytes of a clear-to-send frame's header and of each of its entries, and the most it takes.
pub(super) const CTS_HEADER: usize = 8;
pub(super) const CTS_ENTRY: usize = 16;
pub(super) const CTS_MAX: usize = CTS_HEADER + MAX_RECVS * CTS_ENTRY;
/// Bytes of a data frame's header.
pub(super) const DATA_HEADER: usize = 16;

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
