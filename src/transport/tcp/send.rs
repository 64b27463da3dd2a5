//! The sending side of a tcp connection: clear-to-send frames in, data frames out, written
//! straight from the caller's buffers.

use std::{
    io::{IoSlice, Read},
    net::SocketAddr,
};

use parking_lot::Mutex;
use socket2::Socket;

use super::frame::{note_broken, send_nosignal, CtsFrame, DataHeader, CTS_MAX, DATA_HEADER};
use crate::buffer::UserBuffer;
use crate::error::{Error, Result};
use crate::oob::would_block;
use crate::transport::{
    not_in_flight, CommKeys, Endpoint, Failure, Sender, Tested, Traffic, MAX_REQUESTS,
    MAX_SEND_REQUESTS,
};

/// A receive's clear-to-send as it came, and which of its buffers sends have matched.
#[derive(Debug, Clone, Copy, Default)]
struct CtsGroup {
    frame: CtsFrame,
    matched: u8,
}

/// Where a send request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SendStage {
    Free,
    Queued,
    Written,
}

#[derive(Debug, Clone, Copy)]
struct SendRequest {
    stage: SendStage,
    header: [u8; DATA_HEADER],
    buf: UserBuffer,
    size: usize,
    written: usize,
    /// A TRUNC notice nobody will test: freed as soon as it is written.
    orphan: bool,
}

impl SendRequest {
    const FREE: SendRequest = SendRequest {
        stage: SendStage::Free,
        header: [0; DATA_HEADER],
        buf: UserBuffer::EMPTY,
        size: 0,
        written: 0,
        orphan: false,
    };
}

struct TcpSendState {
    sock: Socket,
    peer: SocketAddr,
    cts: [CtsGroup; MAX_REQUESTS],
    /// CTS groups received so far / fully matched so far.
    cts_received: u32,
    cts_matched: u32,
    rx: [u8; MAX_REQUESTS * CTS_MAX],
    rx_len: usize,
    reqs: Box<[SendRequest; MAX_SEND_REQUESTS]>,
    /// Sequence numbers of the next `isend` and of the send being written.
    next_seq: u32,
    tx_seq: u32,
    failure: Failure,
    /// The socket failed: nothing more is read or written.
    broken: bool,
    /// Where NCCL's handles are looked up.
    keys: CommKeys,
    traffic: Traffic,
}

/// A send comm over TCP.
pub(crate) struct TcpSender {
    state: Mutex<TcpSendState>,
}

impl TcpSender {
    pub(super) fn new(sock: Socket, peer: SocketAddr, keys: CommKeys) -> Self {
        TcpSender {
            state: Mutex::new(TcpSendState {
                sock,
                peer,
                cts: [CtsGroup::default(); MAX_REQUESTS],
                cts_received: 0,
                cts_matched: 0,
                rx: [0; MAX_REQUESTS * CTS_MAX],
                rx_len: 0,
                reqs: Box::new([SendRequest::FREE; MAX_SEND_REQUESTS]),
                next_seq: 0,
                tx_seq: 0,
                failure: Failure::default(),
                broken: false,
                keys,
                traffic: Traffic::default(),
            }),
        }
    }
}

impl Endpoint for TcpSender {
    fn peer(&self) -> String {
        self.state.lock().peer.to_string()
    }

    fn traffic(&self) -> Traffic {
        self.state.lock().traffic
    }
}

impl Sender for TcpSender {
    /// Posts a send; `Ok(None)` until the receiver has posted a matching receive.
    fn isend(&self, buf: UserBuffer, tag: i32, mhandle: u64) -> Result<Option<usize>> {
        let mut s = self.state.lock();
        s.progress();
        s.failure.check()?;
        let slot = s.next_seq as usize % MAX_SEND_REQUESTS;
        if s.reqs[slot].stage != SendStage::Free || s.cts_matched == s.cts_received {
            return Ok(None);
        }
        let g = s.cts_matched as usize % MAX_REQUESTS;
        let group = &mut s.cts[g];
        let Some(entry) = (0..group.frame.n)
            .find(|&e| group.matched & (1 << e) == 0 && group.frame.tags[e] == tag)
        else {
            return Ok(None);
        };
        s.keys.keys(mhandle, buf)?;
        let group = &mut s.cts[g];
        group.matched |= 1 << entry;
        let (group_seq, posted) = (group.frame.seq, group.frame.sizes[entry]);
        if group.matched.count_ones() as usize == group.frame.n {
            s.cts_matched = s.cts_matched.wrapping_add(1);
        }
        let truncated = buf.len() as u64 > posted;
        let header = DataHeader {
            entry: entry as u8,
            truncated,
            seq: group_seq,
            size: buf.len() as u64,
        }
        .encode();
        s.reqs[slot] = SendRequest {
            stage: SendStage::Queued,
            header,
            buf: if truncated { UserBuffer::EMPTY } else { buf },
            size: buf.len(),
            written: 0,
            orphan: truncated,
        };
        s.next_seq = s.next_seq.wrapping_add(1);
        s.progress();
        if truncated {
            // The comm fails from here on, as over verbs: every later call returns this.
            let e = Error::truncated(format!(
                "send of {} bytes (tag {tag}) to {} is larger than the {posted}-byte receive \
                 posted for it",
                buf.len(),
                s.peer
            ));
            return Err(s.failure.fail(e));
        }
        Ok(Some(slot))
    }

    /// Tests a send: done once all of its bytes are in the socket.
    fn test(&self, slot: usize) -> Tested {
        self.test_send(slot).into()
    }
}

impl TcpSender {
    #[inline(never)] // the locked part, as the verbs transport's
    fn test_send(&self, slot: usize) -> Result<Option<usize>> {
        let mut s = self.state.lock();
        s.progress();
        let req = s
            .reqs
            .get_mut(slot)
            .ok_or_else(|| Error::misuse(format!("unknown send request {slot}")))?;
        match req.stage {
            SendStage::Written => {
                req.stage = SendStage::Free;
                let size = req.size;
                s.traffic.add(1, size as u64);
                Ok(Some(size))
            }
            SendStage::Queued => {
                s.failure.check()?;
                Ok(None)
            }
            SendStage::Free => Err(not_in_flight("send", slot)),
        }
    }
}

impl TcpSendState {
    /// Reads clear-to-send frames and writes what is queued, until the socket breaks: a comm
    /// failed by a truncation still writes the TRUNC notice and the sends queued before it.
    fn progress(&mut self) {
        if !self.broken {
            let r = self.read_cts().and_then(|()| self.write_data());
            self.broken = r.is_err();
            note_broken(&mut self.failure, r, "to", self.peer);
        }
    }

    fn read_cts(&mut self) -> Result<()> {
        loop {
            let asked = self.rx.len() - self.rx_len;
            let n = match (&self.sock).read(&mut self.rx[self.rx_len..]) {
                Ok(0) => {
                    let busy = self.tx_seq != self.next_seq
                        || self.reqs.iter().any(|r| r.stage == SendStage::Queued);
                    if busy {
                        return Err(Error::remote("the peer closed the connection".into()));
                    }
                    self.failure
                        .note_quietly(Error::remote("the peer closed the connection".into()));
                    return Ok(());
                }
                Ok(n) => n,
                Err(e) if would_block(&e) => return Ok(()),
                Err(e) => return Err(Error::io("receiving clear-to-send", e)),
            };
            self.rx_len += n;
            let mut at = 0;
            while let Some((frame, len)) = CtsFrame::decode(&self.rx[at..self.rx_len])? {
                let seq = frame.seq;
                if seq != self.cts_received
                    || self.cts_received.wrapping_sub(self.cts_matched) as usize >= MAX_REQUESTS
                {
                    return Err(Error::remote(format!(
                        "protocol error: clear-to-send for receive {seq}, expected {} \
                         ({} unmatched)",
                        self.cts_received,
                        self.cts_received.wrapping_sub(self.cts_matched)
                    )));
                }
                self.cts[seq as usize % MAX_REQUESTS] = CtsGroup { frame, matched: 0 };
                self.cts_received = self.cts_received.wrapping_add(1);
                at += len;
            }
            self.rx.copy_within(at..self.rx_len, 0);
            self.rx_len -= at;
            if n < asked {
                // The socket is drained: another read would only return EAGAIN.
                return Ok(());
            }
        }
    }

    fn write_data(&mut self) -> Result<()> {
        while self.tx_seq != self.next_seq {
            let slot = self.tx_seq as usize % MAX_SEND_REQUESTS;
            let req = &mut self.reqs[slot];
            let total = DATA_HEADER + req.buf.len();
            while req.written < total {
                let (h, p) = if req.written < DATA_HEADER {
                    (&req.header[req.written..], req.buf.bytes_from(0))
                } else {
                    (&[][..], req.buf.bytes_from(req.written - DATA_HEADER))
                };
                match send_nosignal(&self.sock, &[IoSlice::new(h), IoSlice::new(p)]) {
                    Ok(n) => req.written += n,
                    Err(e) if would_block(&e) => return Ok(()),
                    Err(e) => return Err(Error::io("sending data", e)),
                }
            }
            req.stage = if req.orphan {
                SendStage::Free
            } else {
                SendStage::Written
            };
            self.tx_seq = self.tx_seq.wrapping_add(1);
        }
        Ok(())
    }
}
