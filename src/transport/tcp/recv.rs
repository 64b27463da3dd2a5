//! The receiving side of a tcp connection: clear-to-send frames out, data frames in, read
//! straight into the posted buffers.

use std::{
    collections::VecDeque,
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
    not_in_flight, CommKeys, Endpoint, Failure, Receiver, SizeSink, Tested, Traffic, MAX_RECVS,
    MAX_REQUESTS,
};

/// Where a receive request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RecvStage {
    Free,
    Active,
    Done,
}

#[derive(Debug)]
struct RecvRequest {
    stage: RecvStage,
    seq: u32,
    n: usize,
    bufs: [UserBuffer; MAX_RECVS],
    sizes: [usize; MAX_RECVS],
    arrived: u8,
    truncated: Option<(usize, usize)>,
}

impl RecvRequest {
    const FREE: RecvRequest = RecvRequest {
        stage: RecvStage::Free,
        seq: 0,
        n: 0,
        bufs: [UserBuffer::EMPTY; MAX_RECVS],
        sizes: [0; MAX_RECVS],
        arrived: 0,
        truncated: None,
    };
}

enum RecvRx {
    Header {
        buf: [u8; DATA_HEADER],
        have: usize,
    },
    Payload {
        slot: usize,
        entry: usize,
        have: usize,
        size: usize,
    },
}

struct TcpRecvState {
    sock: Socket,
    peer: SocketAddr,
    reqs: [RecvRequest; MAX_REQUESTS],
    /// Sequence number of the next `irecv`.
    next_seq: u32,
    /// Sequence number of the receive whose data arrives now.
    fill_seq: u32,
    cts_out: VecDeque<u8>,
    rx: RecvRx,
    failure: Failure,
    /// Where NCCL's handles are looked up.
    keys: CommKeys,
    traffic: Traffic,
}

/// A receive comm over TCP.
pub(crate) struct TcpReceiver {
    state: Mutex<TcpRecvState>,
}

impl TcpReceiver {
    pub(super) fn new(sock: Socket, peer: SocketAddr, keys: CommKeys) -> Self {
        TcpReceiver {
            state: Mutex::new(TcpRecvState {
                sock,
                peer,
                reqs: [RecvRequest::FREE; MAX_REQUESTS],
                next_seq: 0,
                fill_seq: 0,
                cts_out: VecDeque::with_capacity(MAX_REQUESTS * CTS_MAX),
                rx: RecvRx::Header {
                    buf: [0; DATA_HEADER],
                    have: 0,
                },
                failure: Failure::default(),
                keys,
                traffic: Traffic::default(),
            }),
        }
    }
}

impl Endpoint for TcpReceiver {
    fn peer(&self) -> String {
        self.state.lock().peer.to_string()
    }

    fn traffic(&self) -> Traffic {
        self.state.lock().traffic
    }
}

impl Receiver for TcpReceiver {
    fn iflush(&self, bufs: &[UserBuffer], mhandles: &[u64]) -> Result<Option<usize>> {
        // Data is copied by the CPU: nothing to flush.
        self.state.lock().keys.check_all(bufs, mhandles)?;
        Ok(None)
    }

    /// Posts a grouped receive; `Ok(None)` when 32 are already in flight.
    fn irecv(&self, bufs: &[UserBuffer], tags: &[i32], mhandles: &[u64]) -> Result<Option<usize>> {
        let mut s = self.state.lock();
        s.failure.check()?;
        let slot = s.next_seq as usize % MAX_REQUESTS;
        if s.reqs[slot].stage != RecvStage::Free {
            return Ok(None);
        }
        s.keys.check_all(bufs, mhandles)?;
        let seq = s.next_seq;
        let n = bufs.len();
        let req = &mut s.reqs[slot];
        req.stage = RecvStage::Active;
        req.seq = seq;
        req.n = n;
        req.bufs[..n].copy_from_slice(bufs);
        req.sizes = [0; MAX_RECVS];
        req.arrived = 0;
        req.truncated = None;
        let mut cts = CtsFrame {
            seq,
            n,
            sizes: [0; MAX_RECVS],
            tags: [0; MAX_RECVS],
        };
        for (i, (b, tag)) in bufs.iter().zip(tags).enumerate() {
            cts.sizes[i] = b.len() as u64;
            cts.tags[i] = *tag;
        }
        let mut frame = [0u8; CTS_MAX];
        let len = cts.encode(&mut frame);
        s.cts_out.extend(&frame[..len]);
        s.next_seq = seq.wrapping_add(1);
        s.progress();
        Ok(Some(slot))
    }

    /// Tests a receive: done once every message of the group has arrived.
    fn test(&self, slot: usize, sizes: &mut impl SizeSink) -> Tested {
        self.test_receive(slot, sizes).into()
    }
}

impl TcpReceiver {
    #[inline(never)] // the locked part, as the verbs transport's
    fn test_receive(&self, slot: usize, sizes: &mut impl SizeSink) -> Result<Option<usize>> {
        let mut s = self.state.lock();
        s.progress();
        let req = s
            .reqs
            .get_mut(slot)
            .ok_or_else(|| Error::misuse(format!("unknown receive request {slot}")))?;
        match req.stage {
            RecvStage::Done => {
                req.stage = RecvStage::Free;
                if let Some((sent, posted)) = req.truncated {
                    // The sender's comm failed, so nothing more comes: this one fails too.
                    let e = Error::truncated(format!(
                        "the peer sent {sent} bytes to a receive of {posted} bytes"
                    ));
                    return Err(s.failure.fail(e));
                }
                let mut bytes = 0;
                for (i, size) in req.sizes[..req.n].iter().enumerate() {
                    sizes.set(i, *size as u32);
                    bytes += *size as u64;
                }
                let n = req.n;
                s.traffic.add(n, bytes);
                Ok(Some(n))
            }
            RecvStage::Active => {
                s.failure.check()?;
                Ok(None)
            }
            RecvStage::Free => Err(not_in_flight("receive", slot)),
        }
    }
}

impl TcpRecvState {
    /// Sends pending CTS frames and reads whatever data has arrived. Failures are recorded,
    /// not returned, so requests that already completed can still be collected.
    fn progress(&mut self) {
        if !self.failure.is_set() {
            let r = self.flush_cts().and_then(|()| self.read_data());
            note_broken(&mut self.failure, r, "from", self.peer);
        }
    }

    fn flush_cts(&mut self) -> Result<()> {
        while !self.cts_out.is_empty() {
            let (a, b) = self.cts_out.as_slices();
            match send_nosignal(&self.sock, &[IoSlice::new(a), IoSlice::new(b)]) {
                Ok(n) => {
                    self.cts_out.drain(..n);
                }
                Err(e) if would_block(&e) => return Ok(()),
                Err(e) => return Err(Error::io("sending clear-to-send", e)),
            }
        }
        Ok(())
    }

    fn read_data(&mut self) -> Result<()> {
        loop {
            let (n, asked) = match &mut self.rx {
                RecvRx::Header { buf, have } => {
                    let dst = &mut buf[*have..];
                    let asked = dst.len();
                    ((&self.sock).read(dst), asked)
                }
                RecvRx::Payload {
                    slot,
                    entry,
                    have,
                    size,
                } => {
                    let dst = self.reqs[*slot].bufs[*entry].bytes_mut(*have, *size);
                    let asked = dst.len();
                    ((&self.sock).read(dst), asked)
                }
            };
            let n = match n {
                Ok(0) => {
                    let busy = self.reqs.iter().any(|r| r.stage == RecvStage::Active);
                    return if busy {
                        Err(Error::remote("the peer closed the connection".into()))
                    } else {
                        // A peer that finished and closed is not an error until we need it.
                        self.failure
                            .note_quietly(Error::remote("the peer closed the connection".into()));
                        Ok(())
                    };
                }
                Ok(n) => n,
                Err(e) if would_block(&e) => return Ok(()),
                Err(e) => return Err(Error::io("receiving data", e)),
            };
            match &mut self.rx {
                RecvRx::Header { buf, have } => {
                    *have += n;
                    if *have == DATA_HEADER {
                        let hdr = *buf;
                        self.start_message(&hdr)?;
                    }
                }
                RecvRx::Payload {
                    slot,
                    entry,
                    have,
                    size,
                } => {
                    *have += n;
                    if *have == *size {
                        let (slot, entry, size) = (*slot, *entry, *size);
                        self.finish_message(slot, entry, size);
                    }
                }
            }
            if n < asked {
                // The socket is drained: another read would only return EAGAIN.
                return Ok(());
            }
        }
    }

    fn start_message(&mut self, h: &[u8; DATA_HEADER]) -> Result<()> {
        let h = DataHeader::decode(h)?;
        let (entry, seq) = (usize::from(h.entry), h.seq);
        let size = h.size as usize;
        let slot = seq as usize % MAX_REQUESTS;
        let req = &mut self.reqs[slot];
        let valid = seq == self.fill_seq
            && req.stage == RecvStage::Active
            && req.seq == seq
            && entry < req.n
            && req.arrived & (1 << entry) == 0;
        if !valid {
            return Err(Error::remote(format!(
                "protocol error: unexpected data frame (receive {seq}, buffer {entry}; \
                 expected receive {})",
                self.fill_seq
            )));
        }
        let capacity = req.bufs[entry].len();
        if h.truncated {
            req.truncated = Some((size, capacity));
            self.finish_message(slot, entry, 0);
            return Ok(());
        }
        if size > capacity {
            return Err(Error::remote(format!(
                "protocol error: {size} bytes sent to a {capacity}-byte receive"
            )));
        }
        if size == 0 {
            self.finish_message(slot, entry, 0);
        } else {
            self.rx = RecvRx::Payload {
                slot,
                entry,
                have: 0,
                size,
            };
        }
        Ok(())
    }

    fn finish_message(&mut self, slot: usize, entry: usize, size: usize) {
        let req = &mut self.reqs[slot];
        req.sizes[entry] = size;
        req.arrived |= 1 << entry;
        if req.arrived.count_ones() as usize == req.n {
            req.stage = RecvStage::Done;
            self.fill_seq = self.fill_seq.wrapping_add(1);
        }
        self.rx = RecvRx::Header {
            buf: [0; DATA_HEADER],
            have: 0,
        };
    }
}
