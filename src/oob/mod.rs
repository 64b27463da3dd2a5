//! Out-of-band TCP bootstrap shared by both transports.
//!
//! `listen` binds a [`Listener`] on the bootstrap interface and writes a [`Handle`]; the
//! peer's `connect` opens a [`Channel`] to it and sends a versioned, length-checked
//! [`MsgKind::Hello`] carrying the listener's nonce. Nothing here blocks: NCCL polls `connect`
//! and `accept` from one service thread, so every step returns "not yet" instead of waiting.
//! A connection that sends garbage, a wrong magic, version or nonce, an oversized or truncated
//! message, or nothing before its deadline is dropped with a WARN; the real peer still gets in.

pub mod handle;
pub mod iface;

use std::{
    io::{self, Read, Write},
    net::{IpAddr, SocketAddr, TcpListener, TcpStream},
    time::{Duration, Instant},
};

use socket2::{Domain, Protocol, SockAddr, SockRef, Socket, TcpKeepalive, Type};

pub use handle::{Handle, TransportKind, HANDLE_SIZE};

use crate::codec::{Reader, Writer};
use crate::error::{Error, ErrorDetail, Result};

/// How long the bootstrap waits on a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// For a connection to be set up (`NCCL_ERDMA_CONNECT_TIMEOUT_MS`).
    pub connect: Duration,
    /// For a peer whose host stopped answering (`NCCL_ERDMA_PEER_TIMEOUT_S`; None: never).
    pub peer: Option<Duration>,
}

/// Makes a peer whose host died or became unreachable (no FIN or RST ever comes) a read
/// error (`ETIMEDOUT`) after about `after`, where it would otherwise be silence forever for
/// a receiver with nothing in flight to it:
/// - idle: the kernel probes the connection (keepalive), quiet for half of `after`, then up
///   to 5 unanswered probes over the rest;
/// - with bytes written and not acknowledged (keepalive does not probe then):
///   `TCP_USER_TIMEOUT` gives up after `after` without an acknowledgement.
pub fn keep_alive(sock: &impl std::os::fd::AsFd, after: Duration) -> Result<()> {
    let secs = after.as_secs().max(2);
    let idle = secs / 2;
    let interval = ((secs - idle) / 5).max(1);
    let probes = ((secs - idle) / interval).clamp(1, 5) as u32;
    let params = TcpKeepalive::new()
        .with_time(Duration::from_secs(idle))
        .with_interval(Duration::from_secs(interval))
        .with_retries(probes);
    let sock = SockRef::from(sock);
    sock.set_tcp_keepalive(&params)
        .and_then(|()| sock.set_tcp_user_timeout(Some(Duration::from_secs(secs))))
        .map_err(|e| Error::io("setting TCP keepalive", e))
}

/// Why a connection ended with `ETIMEDOUT` once [`keep_alive`] was on it, for the WARN.
pub const PEER_SILENT: &str = " (no answer to keepalive probes within \
    NCCL_ERDMA_PEER_TIMEOUT_S: the peer's host is down or unreachable)";

/// The error of a `connect` that did not reach the peer's listener (TCP connection made
/// and hello sent) within `timeout`. Only that part of `connect` has a deadline: once the
/// listener is reached, the peer's owner may call `accept` much later (NCCL >= 2.22 sets
/// connections up when they are first used, so a busy peer can take minutes) and NCCL's IB
/// transport waits for it as long as it takes. A peer whose process exits closes the
/// connection, and one whose host falls silent trips `NCCL_ERDMA_PEER_TIMEOUT_S`.
fn unreachable_listener(peer: SocketAddr, timeout: Duration) -> Error {
    Error::remote(format!(
        "could not reach the listener at {peer} within {} ms (NCCL_ERDMA_CONNECT_TIMEOUT_MS)",
        timeout.as_millis()
    ))
}

/// What to add to a connection error that `keep_alive` caused, so the WARN says why.
pub fn peer_timeout_hint(e: &Error) -> &'static str {
    match e.detail() {
        ErrorDetail::Os(os) if os.source.kind() == io::ErrorKind::TimedOut => PEER_SILENT,
        _ => "",
    }
}

/// Bytes in a message header.
pub const MSG_HEADER: usize = 16;
/// Largest payload a handshake message may carry.
pub const MAX_PAYLOAD: usize = 64 * 1024;
const MSG_MAGIC: u32 = 0x4552_4d41; // "ERMA"
/// At most this many not-yet-identified connections wait on one listener.
const MAX_PENDING: usize = 16;

/// Handshake message types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum MsgKind {
    /// Connector -> listener: nonce, transport, transport payload.
    Hello = 1,
    /// Either way: refused, with a UTF-8 reason.
    Reject = 3,
    /// Either way, after the hello (verbs): a step of a move of the connection's rails; move
    /// 0 is its setup, the others move it off failed NICs.
    Move = 5,
    /// Either way, as an end closes its comm: its last word (verbs: a receiver says how many
    /// of its receives had landed).
    Bye = 6,
}

impl MsgKind {
    fn from_u16(v: u16) -> Option<Self> {
        // 2 and 4 were the two-way setup's `Accept` and `Ready` (protocol 4).
        Some(match v {
            1 => MsgKind::Hello,
            3 => MsgKind::Reject,
            5 => MsgKind::Move,
            6 => MsgKind::Bye,
            _ => return None,
        })
    }
}

/// Encodes a message header: magic u32 | version u16 | kind u16 | payload length u32 |
/// 4 reserved.
pub fn encode_header(kind: MsgKind, len: usize) -> [u8; MSG_HEADER] {
    let mut h = [0u8; MSG_HEADER];
    Writer::over(&mut h[..])
        .u32(MSG_MAGIC)
        .u16(handle::PROTOCOL_VERSION)
        .u16(kind as u16)
        .u32(len as u32)
        .zeros(4);
    h
}

/// Decodes and validates a message header: returns the kind and payload length.
pub fn decode_header(h: &[u8; MSG_HEADER]) -> Result<(MsgKind, usize)> {
    let mut r = Reader::new("handshake message header", h);
    let magic = r.u32("magic")?;
    if magic != MSG_MAGIC {
        return Err(Error::remote(format!(
            "handshake message has magic {magic:#010x}, expected {MSG_MAGIC:#010x}"
        )));
    }
    let version = r.u16("version")?;
    if version != handle::PROTOCOL_VERSION {
        return Err(Error::remote(format!(
            "handshake protocol version {version}, this plugin speaks {}",
            handle::PROTOCOL_VERSION
        )));
    }
    let kind = r.u16("kind")?;
    let kind = MsgKind::from_u16(kind)
        .ok_or_else(|| Error::remote(format!("unknown handshake message type {kind}")))?;
    let len = r.u32("length")? as usize;
    if len > MAX_PAYLOAD {
        return Err(Error::remote(format!(
            "handshake message of {len} bytes exceeds the {MAX_PAYLOAD}-byte limit"
        )));
    }
    Ok((kind, len))
}

/// A non-blocking, framed message stream used during connection setup. Reads never go past
/// the end of the current message, so the stream can carry data afterwards.
#[derive(Debug)]
pub struct Channel {
    stream: TcpStream,
    peer: SocketAddr,
    connected: bool,
    /// [`keep_alive`] to apply once connected (a connecting socket: while the kernel still
    /// retries the SYN, `NCCL_ERDMA_CONNECT_TIMEOUT_MS` alone bounds the attempt).
    keep_alive: Option<Duration>,
    /// A connector's deadline to reach the listener (connection made, everything queued
    /// sent, i.e. the hello), with the timeout it came from; none once reached.
    reach_by: Option<(Instant, Duration)>,
    out: Vec<u8>,
    out_pos: usize,
    hdr: [u8; MSG_HEADER],
    hdr_len: usize,
    payload: Vec<u8>,
    want: Option<(MsgKind, usize)>,
}

/// A received message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Its type.
    pub kind: MsgKind,
    /// Its payload.
    pub payload: Vec<u8>,
}

/// Whether a non-blocking socket call failed only because it would have to wait.
pub(crate) fn would_block(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted | io::ErrorKind::NotConnected
    )
}

impl Channel {
    fn new(stream: TcpStream, peer: SocketAddr, connected: bool) -> Self {
        Channel {
            stream,
            peer,
            connected,
            keep_alive: None,
            reach_by: None,
            out: Vec::new(),
            out_pos: 0,
            hdr: [0; MSG_HEADER],
            hdr_len: 0,
            payload: Vec::new(),
            want: None,
        }
    }

    /// Starts a non-blocking TCP connection to `addr` that must reach its listener within
    /// `timeouts.connect` ([`unreachable_listener`]) and is then probed for a silent peer
    /// after `timeouts.peer` ([`keep_alive`]).
    pub fn connect(addr: SocketAddr, timeouts: Timeouts) -> Result<Self> {
        let sock = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))
            .map_err(|e| Error::io("creating bootstrap socket", e))?;
        sock.set_nonblocking(true)
            .map_err(|e| Error::io("making bootstrap socket non-blocking", e))?;
        sock.set_tcp_nodelay(true)
            .map_err(|e| Error::io("setting TCP_NODELAY", e))?;
        match sock.connect(&SockAddr::from(addr)) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) || would_block(&e) => {}
            Err(e) => return Err(Error::io(format!("connecting to {addr}"), e)),
        }
        let mut chan = Channel::new(sock.into(), addr, false);
        chan.keep_alive = timeouts.peer;
        chan.reach_by = Some((Instant::now() + timeouts.connect, timeouts.connect));
        Ok(chan)
    }

    /// The peer's address.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// True once the TCP connection is established; an error if it failed.
    pub fn poll_connected(&mut self) -> Result<bool> {
        if self.connected {
            return Ok(true);
        }
        if let Some(e) = self
            .stream
            .take_error()
            .map_err(|e| Error::io("reading socket state", e))?
        {
            return Err(Error::io(format!("connecting to {}", self.peer), e));
        }
        match self.stream.peer_addr() {
            Ok(_) => {
                if let Some(after) = self.keep_alive {
                    keep_alive(&self.stream, after)?;
                }
                self.connected = true;
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::NotConnected => Ok(false),
            Err(e) => Err(Error::io(format!("connecting to {}", self.peer), e)),
        }
    }

    /// Queues a message; [`Channel::flush`] sends it.
    pub fn queue(&mut self, kind: MsgKind, payload: &[u8]) {
        debug_assert!(payload.len() <= MAX_PAYLOAD);
        self.out
            .extend_from_slice(&encode_header(kind, payload.len()));
        self.out.extend_from_slice(payload);
    }

    /// Writes queued bytes; true when nothing is left to send. A connector's first complete
    /// flush (its hello) reaches the listener: before it, the connect deadline applies.
    pub fn flush(&mut self) -> Result<bool> {
        if let Some((by, timeout)) = self.reach_by {
            if Instant::now() > by {
                return Err(unreachable_listener(self.peer, timeout));
            }
        }
        if !self.poll_connected()? {
            return Ok(false);
        }
        while self.out_pos < self.out.len() {
            match self.stream.write(&self.out[self.out_pos..]) {
                Ok(0) => return Err(self.closed()),
                Ok(n) => self.out_pos += n,
                Err(e) if would_block(&e) => return Ok(false),
                Err(e) => return Err(Error::io(format!("sending to {}", self.peer), e)),
            }
        }
        self.out.clear();
        self.out_pos = 0;
        // Reached: the peer's owner may call accept much later; from here only the peer
        // closing the connection, or its host falling silent, ends the wait.
        self.reach_by = None;
        Ok(true)
    }

    fn closed(&self) -> Error {
        Error::remote(format!(
            "{} closed the connection during the handshake",
            self.peer
        ))
    }

    /// Reads towards the next message; returns it once complete.
    pub fn poll_recv(&mut self) -> Result<Option<Message>> {
        if !self.poll_connected()? {
            return Ok(None);
        }
        self.recv_io().map_err(|e| match e.kind() {
            io::ErrorKind::UnexpectedEof => self.closed(),
            io::ErrorKind::InvalidData => Error::remote(format!("{}: {e}", self.peer)),
            _ => Error::io(format!("receiving from {}", self.peer), e),
        })
    }

    /// [`Self::poll_recv`] on a connected stream, with the socket's own error: the peer
    /// closing is `UnexpectedEof`, a bad header `InvalidData` (for the watch of a connected
    /// peer, which tells a closed socket from a silent host).
    pub fn recv_io(&mut self) -> io::Result<Option<Message>> {
        let eof = || io::Error::from(io::ErrorKind::UnexpectedEof);
        loop {
            let (buf, filled) = match self.want {
                None => (&mut self.hdr[self.hdr_len..], &mut self.hdr_len),
                Some((_, len)) => {
                    let have = self.payload.len();
                    if have == len {
                        let (kind, _) = self.want.take().expect("checked above");
                        let payload = std::mem::take(&mut self.payload);
                        return Ok(Some(Message { kind, payload }));
                    }
                    self.payload.resize(len, 0);
                    let n = match self.stream.read(&mut self.payload[have..]) {
                        Ok(0) => return Err(eof()),
                        Ok(n) => n,
                        Err(e) if would_block(&e) => {
                            self.payload.truncate(have);
                            return Ok(None);
                        }
                        Err(e) => return Err(e),
                    };
                    self.payload.truncate(have + n);
                    continue;
                }
            };
            match self.stream.read(buf) {
                Ok(0) => return Err(eof()),
                Ok(n) => {
                    *filled += n;
                    if self.hdr_len == MSG_HEADER {
                        self.hdr_len = 0;
                        let (kind, len) = decode_header(&self.hdr).map_err(|e| {
                            io::Error::new(io::ErrorKind::InvalidData, e.to_string())
                        })?;
                        self.want = Some((kind, len));
                        self.payload.clear();
                    }
                }
                Err(e) if would_block(&e) => return Ok(None),
                Err(e) => return Err(e),
            }
        }
    }

    /// Whether any byte of a message has arrived.
    pub fn received_any(&self) -> bool {
        self.hdr_len > 0 || self.want.is_some()
    }

    /// Gives up the framing and returns the stream for the data path.
    pub fn into_stream(self) -> TcpStream {
        self.stream
    }
}

/// What a connector says in its hello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The listener's nonce, copied from the handle.
    pub nonce: u64,
    /// The connector's transport.
    pub transport: TransportKind,
    /// Transport-specific setup data.
    pub payload: Vec<u8>,
}

impl Hello {
    /// Serialises the hello payload: nonce u64 | transport u8 | the transport's payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(9 + self.payload.len());
        w.u64(self.nonce)
            .u8(self.transport as u8)
            .bytes(&self.payload);
        w.into_vec()
    }

    /// Parses a hello payload.
    pub fn decode(p: &[u8]) -> Result<Self> {
        let mut r = Reader::new("hello", p);
        let nonce = r.u64("nonce")?;
        let transport = r.u8("transport")?;
        let transport = TransportKind::from_u8(transport)
            .ok_or_else(|| Error::remote(format!("hello names unknown transport {transport}")))?;
        Ok(Hello {
            nonce,
            transport,
            payload: r.rest().to_vec(),
        })
    }
}

struct Pending {
    chan: Channel,
    since: Instant,
}

/// A bound bootstrap listener: one per NCCL `listen`, i.e. one per connection.
pub struct Listener {
    sock: TcpListener,
    handle: Handle,
    pending: Vec<Pending>,
    timeouts: Timeouts,
}

impl Listener {
    /// Binds an ephemeral port on `ip` and describes it in a handle.
    pub fn bind(ip: IpAddr, transport: TransportKind, timeouts: Timeouts) -> Result<Self> {
        let sock = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| Error::io(format!("binding a bootstrap listener on {ip}"), e))?;
        sock.set_nonblocking(true)
            .map_err(|e| Error::io("making the listener non-blocking", e))?;
        let addr = sock
            .local_addr()
            .map_err(|e| Error::io("reading the listener address", e))?;
        let handle = Handle {
            addr,
            transport,
            nonce: crate::random::random_u64(),
        };
        Ok(Listener {
            sock,
            handle,
            pending: Vec::new(),
            timeouts,
        })
    }

    /// The handle the peer's `connect` needs.
    pub fn handle(&self) -> &Handle {
        &self.handle
    }

    /// Accepts and screens incoming connections; returns the first one whose hello carries
    /// this listener's nonce. A matching peer speaking another transport is refused with a
    /// reason it can report, and the error is returned here too.
    pub fn poll_hello(&mut self) -> Result<Option<(Channel, Hello)>> {
        loop {
            // Read what the waiting connections sent before admitting more, so a flood of
            // new connections can never push out a peer whose hello has already arrived.
            if let Some(found) = self.screen_pending()? {
                return Ok(Some(found));
            }
            let (stream, peer) = match self.sock.accept() {
                Ok(c) => c,
                Err(e) if would_block(&e) => return Ok(None),
                Err(e) => return Err(Error::io("accepting a bootstrap connection", e)),
            };
            stream
                .set_nonblocking(true)
                .map_err(|e| Error::io("making an accepted socket non-blocking", e))?;
            // Best effort: latency only.
            let _ = stream.set_nodelay(true);
            if let Some(after) = self.timeouts.peer {
                keep_alive(&stream, after)?;
            }
            if self.pending.len() == MAX_PENDING {
                // Make room by dropping the connection that has been silent the longest.
                let victim = self
                    .pending
                    .iter()
                    .position(|p| !p.chan.received_any())
                    .unwrap_or(0);
                let old = self.pending.remove(victim);
                tracing::warn!(
                    "dropping unidentified bootstrap connection from {} ({} connections waiting)",
                    old.chan.peer(),
                    MAX_PENDING
                );
            }
            self.pending.push(Pending {
                chan: Channel::new(stream, peer, true),
                since: Instant::now(),
            });
        }
    }

    /// Reads from every waiting connection; returns the first hello for this listener and
    /// drops (with a WARN) every connection that sent something else or timed out.
    fn screen_pending(&mut self) -> Result<Option<(Channel, Hello)>> {
        let mut i = 0;
        while i < self.pending.len() {
            let p = &mut self.pending[i];
            let outcome = match p.chan.poll_recv() {
                Ok(None) if p.since.elapsed() > self.timeouts.connect => Err(Error::remote(
                    format!("no hello within {} ms", self.timeouts.connect.as_millis()),
                )),
                Ok(None) => {
                    i += 1;
                    continue;
                }
                Ok(Some(m)) if m.kind == MsgKind::Hello => Hello::decode(&m.payload),
                Ok(Some(m)) => Err(Error::remote(format!(
                    "expected a hello, got message type {:?}",
                    m.kind
                ))),
                Err(e) => Err(e),
            };
            let mut p = self.pending.remove(i);
            match outcome {
                Ok(hello) if hello.nonce != self.handle.nonce => tracing::warn!(
                    "rejected bootstrap connection from {}: its hello is for another listener",
                    p.chan.peer()
                ),
                Ok(hello) if hello.transport != self.handle.transport => {
                    let reason = format!(
                        "the listener uses transport {}, the connector {}: set the same \
                         NCCL_ERDMA_TRANSPORT on every node",
                        self.handle.transport.name(),
                        hello.transport.name()
                    );
                    p.chan.queue(MsgKind::Reject, reason.as_bytes());
                    let _ = p.chan.flush();
                    return Err(Error::remote(format!(
                        "peer {} refused: {reason}",
                        p.chan.peer()
                    )));
                }
                Ok(hello) => return Ok(Some((p.chan, hello))),
                Err(e) => {
                    tracing::warn!("rejected bootstrap connection from {}: {e}", p.chan.peer())
                }
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip_and_limits() {
        let h = encode_header(MsgKind::Move, 77);
        assert_eq!(decode_header(&h).unwrap(), (MsgKind::Move, 77));
        let big = encode_header(MsgKind::Hello, MAX_PAYLOAD + 1);
        assert!(decode_header(&big)
            .unwrap_err()
            .to_string()
            .contains("limit"));
        let mut bad = h;
        bad[0] ^= 0xff;
        assert!(decode_header(&bad).is_err());
        let mut bad = h;
        bad[6] = 99;
        assert!(decode_header(&bad).is_err());
    }

    #[test]
    fn hello_round_trip() {
        let h = Hello {
            nonce: 5,
            transport: TransportKind::Tcp,
            payload: vec![1, 2, 3],
        };
        assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        assert!(Hello::decode(&[0; 4]).is_err());
    }

    #[test]
    fn keep_alive_spreads_the_peer_timeout_over_idle_time_and_probes() {
        for (after, want) in [
            (60, (30, 6, 5)),
            (61, (30, 6, 5)),
            (2, (1, 1, 1)),
            (0, (1, 1, 1)),
        ] {
            let sock = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
            keep_alive(&sock, Duration::from_secs(after)).unwrap();
            assert!(sock.keepalive().unwrap());
            let got = (
                sock.tcp_keepalive_time().unwrap().as_secs(),
                sock.tcp_keepalive_interval().unwrap().as_secs(),
                sock.tcp_keepalive_retries().unwrap(),
            );
            assert_eq!(got, want, "NCCL_ERDMA_PEER_TIMEOUT_S={after}");
            let unacked = sock.tcp_user_timeout().unwrap().map(|d| d.as_secs());
            assert_eq!(unacked, Some(after.max(2)), "TCP_USER_TIMEOUT");
        }
    }

    #[test]
    fn stranger_is_dropped_and_peer_gets_in() {
        let timeouts = Timeouts {
            connect: Duration::from_secs(5),
            peer: Some(Duration::from_secs(60)),
        };
        let mut l =
            Listener::bind("127.0.0.1".parse().unwrap(), TransportKind::Tcp, timeouts).unwrap();
        let addr = l.handle().addr;
        let mut stranger = TcpStream::connect(addr).unwrap();
        stranger.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        let mut peer = Channel::connect(addr, timeouts).unwrap();
        let hello = Hello {
            nonce: l.handle().nonce,
            transport: TransportKind::Tcp,
            payload: vec![],
        };
        peer.queue(MsgKind::Hello, &hello.encode());
        let deadline = Instant::now() + Duration::from_secs(5);
        let got = loop {
            let _ = peer.flush().unwrap();
            if let Some((chan, h)) = l.poll_hello().unwrap() {
                break (chan, h);
            }
            assert!(Instant::now() < deadline, "peer never accepted");
        };
        assert_eq!(got.1, hello);
        // The stranger was dropped: its socket reads EOF (or a reset, since it had sent
        // bytes nobody read).
        stranger
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut b = [0u8; 1];
        match stranger.read(&mut b) {
            Ok(n) => assert_eq!(n, 0),
            Err(e) => assert_eq!(e.kind(), io::ErrorKind::ConnectionReset),
        }
    }
}
