//! TCP transport: NCCL's p2p contract over one socket per connection, without RDMA.
//!
//! Receiver-driven like the verbs data path: `irecv` sends the sender a clear-to-send (CTS)
//! frame naming the sizes and tags of its `n` buffers; `isend` returns a NULL request until a
//! CTS entry with its tag has arrived, then streams a data frame (16-byte header + payload,
//! written straight from the user's buffer). So a send larger than its receive is caught by
//! the sender, which fails and tells the receiver (a TRUNC frame), and neither side ever
//! buffers unexpected data. Everything is non-blocking, preallocated at connection time and
//! progressed by whichever of `isend`/`irecv`/`test` runs next; nothing waits for the peer,
//! and `close` just closes the socket.

use std::{
    collections::VecDeque,
    ffi::CString,
    io::{self, IoSlice, Read},
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use parking_lot::Mutex;
use socket2::Socket;

use crate::buffer::UserBuffer;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::oob::{
    self, iface::LocalAddr, would_block, Channel, Handle, Hello, Listener, MsgKind, Timeouts,
    TransportKind,
};
use crate::sysfs;
use crate::transport::{
    device, not_in_flight, Completion, Connecting, DeviceProps, Failure, Hold, Listening, MemKeys,
    RecvEndpoint, SendEndpoint, Transport, MAX_RECVS, MAX_REQUESTS, MAX_SEND_REQUESTS, PTR_HOST,
};

const FRAME_CTS: u8 = 1;
const FRAME_DATA: u8 = 2;
const FLAG_TRUNC: u8 = 1;
const CTS_HEADER: usize = 8;
const CTS_ENTRY: usize = 16;
const CTS_MAX: usize = CTS_HEADER + MAX_RECVS * CTS_ENTRY;
const DATA_HEADER: usize = 16;

fn send_nosignal(sock: &Socket, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
    // MSG_NOSIGNAL: a peer that closed must be an error code, not a SIGPIPE that kills the
    // training process.
    sock.send_vectored_with_flags(bufs, libc::MSG_NOSIGNAL)
}

fn into_data_socket(stream: std::net::TcpStream) -> Result<Socket> {
    let sock = Socket::from(stream);
    sock.set_nonblocking(true)
        .map_err(|e| Error::io("making the data socket non-blocking", e))?;
    Ok(sock)
}

// ---------------------------------------------------------------------------------------
// The backend

/// The tcp backend: one device, the bootstrap interface.
pub(crate) struct TcpTransport {
    props: [DeviceProps; 1],
    timeouts: Timeouts,
}

impl TcpTransport {
    /// The transport over `bootstrap`'s interface.
    pub(crate) fn new(config: &Config, bootstrap: &LocalAddr) -> Self {
        let ifname = &bootstrap.ifname;
        let sys = format!("/sys/class/net/{ifname}");
        let speed = config
            .speed_mbps
            .value
            .map(|s| s as i32)
            .or_else(|| {
                sysfs::read(&format!("{sys}/speed"))
                    .and_then(|s| s.parse::<i32>().ok())
                    .filter(|s| *s > 0)
            })
            .unwrap_or(10_000);
        let pci_path = std::fs::canonicalize(format!("{sys}/device"))
            .ok()
            .and_then(|p| CString::new(p.to_string_lossy().into_owned()).ok());
        let peer = config.peer_timeout_s.value;
        TcpTransport {
            props: [DeviceProps {
                name: CString::new(format!("erdma-tcp-{ifname}")).unwrap_or_default(),
                pci_path,
                guid: 0,
                ptr_support: PTR_HOST,
                speed_mbps: speed,
                port: 1,
                max_comms: 65536,
                force_flush: false,
            }],
            timeouts: Timeouts {
                connect: Duration::from_millis(config.connect_timeout_ms.value),
                peer: (peer > 0).then(|| Duration::from_secs(peer)),
            },
        }
    }
}

impl Transport for TcpTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn devices(&self) -> &[DeviceProps] {
        &self.props
    }

    fn listen(&self, dev: usize, ip: IpAddr) -> Result<Box<dyn Listening>> {
        device(&self.props, dev)?;
        Ok(Box::new(TcpListen::bind(ip, self.timeouts)?))
    }

    fn connect(
        &self,
        dev: usize,
        handle: &Handle,
        _traffic_class: Option<i32>,
    ) -> Result<Box<dyn Connecting>> {
        device(&self.props, dev)?;
        Ok(Box::new(TcpConnecting::start(handle, self.timeouts)?))
    }

    fn register(
        &self,
        dev: usize,
        _addr: usize,
        _len: usize,
        host: bool,
    ) -> Result<(MemKeys, Option<Hold>)> {
        device(&self.props, dev)?;
        let keys = MemKeys {
            host,
            ..MemKeys::default()
        };
        Ok((keys, None))
    }

    fn register_dmabuf(
        &self,
        _dev: usize,
        _addr: usize,
        _len: usize,
        _offset: u64,
        _fd: i32,
    ) -> Result<(MemKeys, Hold)> {
        Err(Error::Usage(
            "DMA-BUF registration is not supported here (transport tcp); NCCL should not have \
             asked"
                .into(),
        ))
    }
}

/// Records a failed step of a comm's progress as its failure, naming the peer (and the
/// keepalive timeout when that was the cause); `dir` is "to" or "from".
fn note_broken(failure: &mut Failure, r: Result<()>, dir: &str, peer: SocketAddr) {
    if let Err(e) = r {
        let hint = oob::peer_timeout_hint(&e);
        failure.set(format!("connection {dir} {peer} failed: {e}{hint}"));
    }
}

// ---------------------------------------------------------------------------------------
// Connection setup

/// The listening side of one connection.
pub(crate) struct TcpListen {
    listener: Listener,
    accepted: Option<Channel>,
}

impl TcpListen {
    /// Binds the bootstrap listener; its handle goes to the peer.
    fn bind(ip: std::net::IpAddr, timeouts: Timeouts) -> Result<Self> {
        Ok(TcpListen {
            listener: Listener::bind(ip, TransportKind::Tcp, timeouts)?,
            accepted: None,
        })
    }

    /// One non-blocking step of `accept`.
    fn step(&mut self) -> Result<Option<TcpRecvComm>> {
        if self.accepted.is_none() {
            match self.listener.poll_hello()? {
                Some((mut chan, _hello)) => {
                    chan.queue(MsgKind::Accept, &[]);
                    self.accepted = Some(chan);
                }
                None => return Ok(None),
            }
        }
        let chan = self.accepted.as_mut().expect("set above");
        if !chan.flush()? {
            return Ok(None);
        }
        let chan = self.accepted.take().expect("set above");
        let peer = chan.peer();
        Ok(Some(TcpRecvComm::new(
            into_data_socket(chan.into_stream())?,
            peer,
        )))
    }
}

impl Listening for TcpListen {
    fn handle(&self) -> &Handle {
        self.listener.handle()
    }

    fn poll_accept(&mut self) -> Result<Option<Box<dyn RecvEndpoint>>> {
        Ok(self.step()?.map(|c| Box::new(c) as Box<dyn RecvEndpoint>))
    }
}

/// The connecting side, between NCCL's repeated `connect` calls.
pub(crate) struct TcpConnecting {
    /// Until the listener accepted; then the data socket.
    chan: Option<Channel>,
}

impl TcpConnecting {
    /// Starts connecting to the listener described by `handle`.
    fn start(handle: &Handle, timeouts: Timeouts) -> Result<Self> {
        let mut chan = Channel::connect(handle.addr, timeouts)?;
        let hello = Hello {
            nonce: handle.nonce,
            transport: TransportKind::Tcp,
            payload: Vec::new(),
        };
        chan.queue(MsgKind::Hello, &hello.encode());
        Ok(TcpConnecting { chan: Some(chan) })
    }
}

impl Connecting for TcpConnecting {
    fn poll(&mut self) -> Result<Option<Box<dyn SendEndpoint>>> {
        let chan = self
            .chan
            .as_mut()
            .ok_or_else(|| Error::Misuse("connect polled again after it finished".into()))?;
        if !chan.flush()? {
            return Ok(None);
        }
        match chan.poll_recv()? {
            None => Ok(None),
            Some(m) if m.kind == MsgKind::Accept => {
                let peer = chan.peer();
                let Some(chan) = self.chan.take() else {
                    return Ok(None);
                };
                let sock = into_data_socket(chan.into_stream())?;
                Ok(Some(Box::new(TcpSendComm::new(sock, peer))))
            }
            Some(m) if m.kind == MsgKind::Reject => Err(Error::Remote(format!(
                "{} refused the connection: {}",
                chan.peer(),
                String::from_utf8_lossy(&m.payload)
            ))),
            Some(m) => Err(Error::Remote(format!(
                "{} answered the hello with message type {:?}",
                chan.peer(),
                m.kind
            ))),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Receive side

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RecvState {
    Free,
    Active,
    Done,
}

#[derive(Debug)]
struct RecvRequest {
    state: RecvState,
    seq: u32,
    n: usize,
    bufs: [UserBuffer; MAX_RECVS],
    sizes: [usize; MAX_RECVS],
    arrived: u8,
    truncated: Option<(usize, usize)>,
}

impl RecvRequest {
    const FREE: RecvRequest = RecvRequest {
        state: RecvState::Free,
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

struct RecvInner {
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
}

/// A receive comm over TCP.
pub(crate) struct TcpRecvComm {
    inner: Mutex<RecvInner>,
}

impl TcpRecvComm {
    fn new(sock: Socket, peer: SocketAddr) -> Self {
        TcpRecvComm {
            inner: Mutex::new(RecvInner {
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
            }),
        }
    }
}

impl RecvEndpoint for TcpRecvComm {
    fn peer(&self) -> String {
        self.inner.lock().peer.to_string()
    }

    fn iflush(&self, _bufs: &[UserBuffer], _mem: &[MemKeys]) -> Result<Option<usize>> {
        // Data is copied by the CPU: nothing to flush.
        Ok(None)
    }

    /// Posts a grouped receive; `Ok(None)` when 32 are already in flight.
    fn irecv(&self, bufs: &[UserBuffer], tags: &[i32], _mem: &[MemKeys]) -> Result<Option<usize>> {
        let mut s = self.inner.lock();
        s.failure.check()?;
        let slot = s.next_seq as usize % MAX_REQUESTS;
        if s.reqs[slot].state != RecvState::Free {
            return Ok(None);
        }
        let seq = s.next_seq;
        let n = bufs.len();
        let req = &mut s.reqs[slot];
        req.state = RecvState::Active;
        req.seq = seq;
        req.n = n;
        req.bufs[..n].copy_from_slice(bufs);
        req.sizes = [0; MAX_RECVS];
        req.arrived = 0;
        req.truncated = None;
        let mut frame = [0u8; CTS_MAX];
        frame[0] = FRAME_CTS;
        frame[1] = n as u8;
        frame[4..8].copy_from_slice(&seq.to_le_bytes());
        for (i, (b, tag)) in bufs.iter().zip(tags).enumerate() {
            let e = &mut frame[CTS_HEADER + i * CTS_ENTRY..CTS_HEADER + (i + 1) * CTS_ENTRY];
            e[0..8].copy_from_slice(&(b.len() as u64).to_le_bytes());
            e[8..12].copy_from_slice(&tag.to_le_bytes());
        }
        let len = CTS_HEADER + n * CTS_ENTRY;
        s.cts_out.extend(&frame[..len]);
        s.next_seq = seq.wrapping_add(1);
        s.progress();
        Ok(Some(slot))
    }

    /// Tests a receive; `Ok(Some)` once every message of the group has arrived.
    fn test(&self, slot: usize) -> Result<Option<Completion>> {
        let mut s = self.inner.lock();
        s.progress();
        let req = s
            .reqs
            .get_mut(slot)
            .ok_or_else(|| Error::Misuse(format!("unknown receive request {slot}")))?;
        match req.state {
            RecvState::Done => {
                req.state = RecvState::Free;
                if let Some((sent, posted)) = req.truncated {
                    return Err(Error::Truncated(format!(
                        "the peer sent {sent} bytes to a receive of {posted} bytes"
                    )));
                }
                let mut c = Completion {
                    n: req.n,
                    ..Completion::EMPTY
                };
                for (out, size) in c.sizes.iter_mut().zip(&req.sizes[..req.n]) {
                    *out = *size as u32;
                }
                Ok(Some(c))
            }
            RecvState::Active => {
                s.failure.check()?;
                Ok(None)
            }
            RecvState::Free => Err(not_in_flight("receive", slot)),
        }
    }
}

impl RecvInner {
    /// Sends pending CTS frames and reads whatever data has arrived. Failures are recorded,
    /// not returned, so requests that already completed can still be collected.
    fn progress(&mut self) {
        if self.failure.0.is_none() {
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
                    let busy = self.reqs.iter().any(|r| r.state == RecvState::Active);
                    return if busy {
                        Err(Error::Remote("the peer closed the connection".into()))
                    } else {
                        // A peer that finished and closed is not an error until we need it.
                        self.failure
                            .0
                            .get_or_insert_with(|| "the peer closed the connection".into());
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
        let entry = h[1] as usize;
        let flags = h[2];
        let seq = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
        let mut size_b = [0u8; 8];
        size_b.copy_from_slice(&h[8..16]);
        let size = u64::from_le_bytes(size_b) as usize;
        let slot = seq as usize % MAX_REQUESTS;
        let req = &mut self.reqs[slot];
        let valid = h[0] == FRAME_DATA
            && seq == self.fill_seq
            && req.state == RecvState::Active
            && req.seq == seq
            && entry < req.n
            && req.arrived & (1 << entry) == 0;
        if !valid {
            return Err(Error::Remote(format!(
                "protocol error: unexpected data frame (type {}, receive {seq}, entry {entry}; \
                 expected receive {})",
                h[0], self.fill_seq
            )));
        }
        let capacity = req.bufs[entry].len();
        if flags & FLAG_TRUNC != 0 {
            req.truncated = Some((size, capacity));
            self.finish_message(slot, entry, 0);
            return Ok(());
        }
        if size > capacity {
            return Err(Error::Remote(format!(
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
            req.state = RecvState::Done;
            self.fill_seq = self.fill_seq.wrapping_add(1);
        }
        self.rx = RecvRx::Header {
            buf: [0; DATA_HEADER],
            have: 0,
        };
    }
}

// ---------------------------------------------------------------------------------------
// Send side

#[derive(Debug, Clone, Copy)]
struct CtsGroup {
    n: usize,
    seq: u32,
    sizes: [usize; MAX_RECVS],
    tags: [i32; MAX_RECVS],
    matched: u8,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SendState {
    Free,
    Queued,
    Written,
}

#[derive(Debug, Clone, Copy)]
struct SendRequest {
    state: SendState,
    header: [u8; DATA_HEADER],
    buf: UserBuffer,
    size: usize,
    written: usize,
    /// A TRUNC notice nobody will test: freed as soon as it is written.
    orphan: bool,
}

impl SendRequest {
    const FREE: SendRequest = SendRequest {
        state: SendState::Free,
        header: [0; DATA_HEADER],
        buf: UserBuffer::EMPTY,
        size: 0,
        written: 0,
        orphan: false,
    };
}

struct SendInner {
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
}

/// A send comm over TCP.
pub(crate) struct TcpSendComm {
    inner: Mutex<SendInner>,
}

impl TcpSendComm {
    fn new(sock: Socket, peer: SocketAddr) -> Self {
        TcpSendComm {
            inner: Mutex::new(SendInner {
                sock,
                peer,
                cts: [CtsGroup {
                    n: 0,
                    seq: 0,
                    sizes: [0; MAX_RECVS],
                    tags: [0; MAX_RECVS],
                    matched: 0,
                }; MAX_REQUESTS],
                cts_received: 0,
                cts_matched: 0,
                rx: [0; MAX_REQUESTS * CTS_MAX],
                rx_len: 0,
                reqs: Box::new([SendRequest::FREE; MAX_SEND_REQUESTS]),
                next_seq: 0,
                tx_seq: 0,
                failure: Failure::default(),
            }),
        }
    }
}

impl SendEndpoint for TcpSendComm {
    fn peer(&self) -> String {
        self.inner.lock().peer.to_string()
    }

    /// Posts a send; `Ok(None)` until the receiver has posted a matching receive.
    fn isend(&self, buf: UserBuffer, tag: i32, _mem: MemKeys) -> Result<Option<usize>> {
        let mut s = self.inner.lock();
        s.progress();
        s.failure.check()?;
        let slot = s.next_seq as usize % MAX_SEND_REQUESTS;
        if s.reqs[slot].state != SendState::Free || s.cts_matched == s.cts_received {
            return Ok(None);
        }
        let g = s.cts_matched as usize % MAX_REQUESTS;
        let group = &mut s.cts[g];
        let Some(entry) =
            (0..group.n).find(|&e| group.matched & (1 << e) == 0 && group.tags[e] == tag)
        else {
            return Ok(None);
        };
        group.matched |= 1 << entry;
        let (group_seq, posted) = (group.seq, group.sizes[entry]);
        if group.matched.count_ones() as usize == group.n {
            s.cts_matched = s.cts_matched.wrapping_add(1);
        }
        let truncated = buf.len() > posted;
        let mut header = [0u8; DATA_HEADER];
        header[0] = FRAME_DATA;
        header[1] = entry as u8;
        header[2] = if truncated { FLAG_TRUNC } else { 0 };
        header[4..8].copy_from_slice(&group_seq.to_le_bytes());
        header[8..16].copy_from_slice(&(buf.len() as u64).to_le_bytes());
        s.reqs[slot] = SendRequest {
            state: SendState::Queued,
            header,
            buf: if truncated { UserBuffer::EMPTY } else { buf },
            size: buf.len(),
            written: 0,
            orphan: truncated,
        };
        s.next_seq = s.next_seq.wrapping_add(1);
        s.progress();
        if truncated {
            return Err(Error::Truncated(format!(
                "send of {} bytes (tag {tag}) to {} is larger than the {posted}-byte receive \
                 posted for it",
                buf.len(),
                s.peer
            )));
        }
        Ok(Some(slot))
    }

    /// Tests a send; done once all of its bytes are in the socket.
    fn test(&self, slot: usize) -> Result<Option<Completion>> {
        let mut s = self.inner.lock();
        s.progress();
        let req = s
            .reqs
            .get_mut(slot)
            .ok_or_else(|| Error::Misuse(format!("unknown send request {slot}")))?;
        match req.state {
            SendState::Written => {
                req.state = SendState::Free;
                Ok(Some(Completion::single(req.size)))
            }
            SendState::Queued => {
                s.failure.check()?;
                Ok(None)
            }
            SendState::Free => Err(not_in_flight("send", slot)),
        }
    }
}

impl SendInner {
    fn progress(&mut self) {
        if self.failure.0.is_none() {
            let r = self.read_cts().and_then(|()| self.write_data());
            note_broken(&mut self.failure, r, "to", self.peer);
        }
    }

    fn read_cts(&mut self) -> Result<()> {
        loop {
            let asked = self.rx.len() - self.rx_len;
            let n = match (&self.sock).read(&mut self.rx[self.rx_len..]) {
                Ok(0) => {
                    let busy = self.tx_seq != self.next_seq
                        || self.reqs.iter().any(|r| r.state == SendState::Queued);
                    if busy {
                        return Err(Error::Remote("the peer closed the connection".into()));
                    }
                    self.failure
                        .0
                        .get_or_insert_with(|| "the peer closed the connection".into());
                    return Ok(());
                }
                Ok(n) => n,
                Err(e) if would_block(&e) => return Ok(()),
                Err(e) => return Err(Error::io("receiving clear-to-send", e)),
            };
            self.rx_len += n;
            let mut at = 0;
            while self.rx_len - at >= CTS_HEADER {
                let f = &self.rx[at..self.rx_len];
                let count = f[1] as usize;
                let seq = u32::from_le_bytes([f[4], f[5], f[6], f[7]]);
                if f[0] != FRAME_CTS
                    || count == 0
                    || count > MAX_RECVS
                    || seq != self.cts_received
                    || self.cts_received.wrapping_sub(self.cts_matched) as usize >= MAX_REQUESTS
                {
                    return Err(Error::Remote(format!(
                        "protocol error: bad clear-to-send frame (type {}, n {count}, \
                         receive {seq}, expected {})",
                        f[0], self.cts_received
                    )));
                }
                let len = CTS_HEADER + count * CTS_ENTRY;
                if f.len() < len {
                    break;
                }
                let mut group = CtsGroup {
                    n: count,
                    seq,
                    sizes: [0; MAX_RECVS],
                    tags: [0; MAX_RECVS],
                    matched: 0,
                };
                for i in 0..count {
                    let e = &f[CTS_HEADER + i * CTS_ENTRY..];
                    let mut size = [0u8; 8];
                    size.copy_from_slice(&e[0..8]);
                    group.sizes[i] = u64::from_le_bytes(size) as usize;
                    group.tags[i] = i32::from_le_bytes([e[8], e[9], e[10], e[11]]);
                }
                self.cts[seq as usize % MAX_REQUESTS] = group;
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
            req.state = if req.orphan {
                SendState::Free
            } else {
                SendState::Written
            };
            self.tx_seq = self.tx_seq.wrapping_add(1);
        }
        Ok(())
    }
}
