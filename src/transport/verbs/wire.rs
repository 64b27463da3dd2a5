//! What the two ends of a verbs connection agree on: the setup message each sends over `oob`
//! ([`ConnInfo`]), the messages of a move ([`MoveMsg`]), the clear-to-send entry a receiver
//! RDMA-writes into the sender's FIFO ([`CtsEntry`]), the size record of a grouped receive,
//! the work-request ids both sides post with, how QPs are dealt over rails ([`locate`]) and
//! how a message is split over several QPs. Pure data and arithmetic, no verbs.

use crate::codec::{Reader, Sink, WireError, Writer};
use crate::error::Result;
use crate::transport::{MAX_RAILS, MAX_RECVS, MAX_REQUESTS};

/// Receive slots per connection: one per request NCCL may keep in flight.
pub(crate) const SLOTS: usize = MAX_REQUESTS;
/// Marks a send that was larger than its receive, in an immediate or a size record.
pub(crate) const TRUNCATED: u32 = u32::MAX;
/// Bytes per clear-to-send entry (one cache line; the `seq` word never straddles one).
pub(crate) const CTS_BYTES: usize = 64;
/// Alignment of the pieces a message is split into over several QPs (LL/LL128 lines).
pub(crate) const SPLIT_ALIGN: usize = 128;
/// eRDMA's inline limit, and enough for three clear-to-send entries.
pub(crate) const MAX_INLINE: u32 = 96;
/// Most QPs per connection (`NCCL_IB_QPS_PER_CONNECTION`).
pub(crate) const MAX_QPS: usize = 128;

/// One clear-to-send entry, as the receiver writes it into the sender's FIFO: entry `i` of
/// slot `s` announces buffer `i` of the receive with sequence number `seq` (`seq % SLOTS ==
/// s`), with its key on each of the receiver's rails.
#[repr(C, align(64))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct CtsEntry {
    pub(crate) addr: u64,
    pub(crate) tag: i32,
    /// The buffer's size, saturated at `u32::MAX` (sends are at most 1 GiB, so a larger
    /// buffer can never be too small).
    pub(crate) size: u32,
    /// Buffers in the grouped receive.
    pub(crate) nreqs: u32,
    _reserved: u32,
    /// The buffer's remote key on each of the receiver's rails.
    pub(crate) rkeys: [u32; MAX_RAILS],
    /// The receive's sequence number + 1 (0: never written). 64 bits, so it never wraps: an
    /// entry left over from an older receive of the same slot can never pass for a new one.
    /// Last, so the NIC places it after the fields it announces.
    pub(crate) seq: u64,
}
const _: () = assert!(std::mem::size_of::<CtsEntry>() == CTS_BYTES);
/// Where `seq` lies in an entry.
pub(crate) const CTS_SEQ_OFFSET: usize = std::mem::offset_of!(CtsEntry, seq);
const _: () = assert!(CTS_SEQ_OFFSET + 8 == CTS_BYTES);

impl CtsEntry {
    /// The entry announcing `addr..addr+len` (with `rkeys` on the receiver's rails, `tag`)
    /// as one of `nreqs` buffers of the receive numbered `seq`.
    pub(crate) fn new(
        addr: u64,
        len: usize,
        rkeys: [u32; MAX_RAILS],
        tag: i32,
        nreqs: usize,
        seq: u64,
    ) -> Self {
        CtsEntry {
            addr,
            tag,
            size: u32::try_from(len).unwrap_or(u32::MAX),
            nreqs: nreqs as u32,
            _reserved: 0,
            rkeys,
            seq: seq + 1,
        }
    }
}

impl CtsEntry {
    /// Writes the entry as a move's answer carries it: its fields in order, little-endian.
    pub(crate) fn write<S: Sink>(&self, w: &mut Writer<S>) {
        w.u64(self.addr)
            .i32(self.tag)
            .u32(self.size)
            .u32(self.nreqs)
            .zeros(4);
        for k in self.rkeys {
            w.u32(k);
        }
        w.u64(self.seq);
    }

    /// [`Self::write`] back.
    pub(crate) fn read(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let mut e = CtsEntry {
            addr: r.u64("entry address")?,
            tag: r.i32("entry tag")?,
            size: r.u32("entry size")?,
            nreqs: r.u32("entry buffers")?,
            ..CtsEntry::default()
        };
        r.take(4, "entry reserved")?;
        for k in &mut e.rkeys {
            *k = r.u32("entry key")?;
        }
        e.seq = r.u64("entry sequence")?;
        Ok(e)
    }
}

/// Entry `i` of `slot` in a FIFO of `SLOTS * MAX_RECVS` entries.
#[inline]
pub(crate) fn cts_index(slot: usize, i: usize) -> usize {
    slot * MAX_RECVS + i
}

/// What a work request is, in the high 32 bits of its id; the low byte carries the slot, and
/// a send's last write on a QP also the connection QP (bits 8..16) and the work requests it
/// retires there (bits 16..32: see [`WrKind::send_id`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub(crate) enum WrKind {
    /// A receive consumed by a WRITE_WITH_IMM.
    Recv = 1,
    /// A clear-to-send write.
    Cts = 2,
    /// The data writes of a send slot.
    Send = 3,
    /// A flush read.
    Flush = 4,
    /// A liveness probe (a 1-byte read of the peer's memory).
    Probe = 5,
    /// The immediate (and size record) of a send whose data had landed when its connection
    /// moved, though the receiver had not seen it yet: no data, and no slot of the sender's
    /// to complete (see `send::moving`).
    Landed = 6,
    /// A read through a dead NIC's flush QP that orders the writes it placed before a move
    /// ahead of any later flush (see `recv::moving`).
    Order = 7,
    /// A zero-length write that tries a path before a move back takes it (see `trial`).
    Trial = 8,
}

impl WrKind {
    /// The id of a request of this kind for `slot`.
    #[inline]
    pub(crate) const fn id(self, slot: usize) -> u64 {
        (self as u64) << 32 | slot as u64
    }

    /// The kind of request `wr_id` (None for an id we never post).
    #[inline]
    pub(crate) fn of(wr_id: u64) -> Option<WrKind> {
        Some(match wr_id >> 32 {
            1 => WrKind::Recv,
            2 => WrKind::Cts,
            3 => WrKind::Send,
            4 => WrKind::Flush,
            5 => WrKind::Probe,
            6 => WrKind::Landed,
            7 => WrKind::Order,
            8 => WrKind::Trial,
            _ => return None,
        })
    }

    /// The id of the last (signaled) write of send slot `slot` on connection QP `qp`, whose
    /// completion retires the `wrs` work requests posted there for it: they go back to the
    /// QP's send queue. `Send` or `Landed`.
    #[inline]
    pub(crate) const fn send_id(self, slot: usize, qp: usize, wrs: usize) -> u64 {
        self.id(slot | qp << 8 | wrs << 16)
    }

    /// The connection QP and the work requests a send's completion `wr_id` retires.
    #[inline]
    pub(crate) fn send_retires(wr_id: u64) -> (u8, u32) {
        ((wr_id >> 8) as u8, (wr_id >> 16 & 0xffff) as u32)
    }

    /// The slot of request `wr_id`.
    #[inline]
    pub(crate) fn slot(wr_id: u64) -> usize {
        (wr_id & 0xff) as usize % SLOTS
    }

    /// What the request was, for messages.
    pub(crate) fn describe(wr_id: u64) -> &'static str {
        match WrKind::of(wr_id) {
            Some(WrKind::Recv) => "receive of RDMA write with immediate",
            Some(WrKind::Cts) => "clear-to-send RDMA write",
            Some(WrKind::Send) => "data RDMA write",
            Some(WrKind::Flush) => "flush RDMA read",
            Some(WrKind::Probe) => "liveness probe RDMA read",
            Some(WrKind::Landed) => "RDMA write with immediate of a send that had landed",
            Some(WrKind::Order) => "ordering RDMA read",
            Some(WrKind::Trial) => "zero-length RDMA write trying a path",
            None => "work request",
        }
    }
}

/// The piece `k` of `used` that a message of `size` bytes is split into over `used` QPs:
/// (offset, length). Pieces are `SPLIT_ALIGN`-aligned and cover the message exactly; the last
/// ones may be empty.
#[inline]
pub(crate) fn piece(size: usize, k: usize, used: usize) -> (usize, usize) {
    if used <= 1 {
        return (0, size);
    }
    let chunk = size.div_ceil(used).div_ceil(SPLIT_ALIGN) * SPLIT_ALIGN;
    let off = (k * chunk).min(size);
    (off, chunk.min(size - off))
}

/// Receives whose first buffer holds at least this many bytes are striped over every rail of
/// a connection that spans several; smaller ones go to one QP, taking turns. (The first
/// buffer, because its clear-to-send entry is the one the sender always has.)
pub(crate) const STRIPE_MIN: usize = 16 << 10;

/// `x % n` (n > 0) on the data path: a mask for the usual counts of QPs and rails (1, 2, 4,
/// 8), which are powers of two, and a division (tens of cycles) only for the others.
#[inline(always)]
pub(crate) fn modulo(x: usize, n: usize) -> usize {
    if n == 1 {
        // One QP, one rail: the common case, decided by one compare.
        0
    } else if n.is_power_of_two() {
        x & (n - 1)
    } else {
        x % n
    }
}

/// How a connection spreads requests over its QPs. QP `q` lives on rail `q % rails` (of the
/// connecting side; the accepting side maps it onto its own rails the same way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct QpPlan {
    /// QPs of the connection.
    pub(crate) nqps: usize,
    /// Rails (NICs) of the connecting side: the stripe width.
    pub(crate) rails: usize,
    /// `NCCL_IB_SPLIT_DATA_ON_QPS`: every request over every QP.
    pub(crate) split: bool,
}

impl QpPlan {
    /// The QPs request `seq` uses, whose first receive buffer holds `posted` bytes: (first,
    /// how many). Split: every QP. A large receive on several rails: one QP of each rail, the
    /// QP group taking turns. Otherwise one QP, taking turns (so over every rail).
    #[inline]
    pub(crate) fn qps(&self, seq: u64, posted: usize) -> (usize, usize) {
        if self.nqps == 1 {
            (0, 1)
        } else if self.split {
            (0, self.nqps)
        } else if self.rails > 1 && posted >= STRIPE_MIN {
            let groups = self.nqps / self.rails;
            (modulo(seq as usize, groups) * self.rails, self.rails)
        } else {
            (modulo(seq as usize, self.nqps), 1)
        }
    }

    /// The QP (index into the connection's QPs) that carries piece `k` of request `seq`'s
    /// `used` pieces starting at `first`. Pieces rotate with the sequence number, so the
    /// first piece (all of a small message) lands on each rail in turn.
    #[inline]
    pub(crate) fn qp_of_piece(&self, seq: u64, first: usize, used: usize, k: usize) -> usize {
        if used == 1 {
            first
        } else {
            first + modulo(k + modulo(seq as usize, used), used)
        }
    }
}

/// The rail and rail-local index of connection QP `q` over `rails` rails: QP `q` lives on
/// rail `q % rails` of each end.
#[inline(always)]
pub(crate) fn locate(q: usize, rails: usize) -> (usize, usize) {
    if rails == 1 {
        (0, q)
    } else if rails.is_power_of_two() {
        (q & (rails - 1), q >> rails.trailing_zeros())
    } else {
        (q % rails, q / rails)
    }
}

/// One rail (NIC) of a connection's end, as the other end needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RailInfo {
    pub(crate) link_layer: u8,
    pub(crate) mtu: u8,
    pub(crate) port: u8,
    pub(crate) gid_index: u8,
    pub(crate) lid: u16,
    pub(crate) gid: [u8; 16],
    /// The key of the connection's memory (`ConnInfo::addr`) on this rail.
    pub(crate) rkey: u32,
    pub(crate) device: String,
}

/// What each side tells the other about its end of the connection: the first message of
/// the connector (in its hello) and of the listener (in its accept).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ConnInfo {
    /// Sender: its clear-to-send FIFO; receiver: its size records.
    pub(crate) addr: u64,
    pub(crate) tc: u8,
    pub(crate) sl: u8,
    /// `NCCL_IB_SPLIT_DATA_ON_QPS`: the connector's setting in the hello, the setting in
    /// effect (the receiver's) in the accept.
    pub(crate) split: bool,
    /// This end can move the connection to another NIC (failover on, another NIC there): an
    /// end whose peer cannot fails a broken path as without failover.
    pub(crate) mobile: bool,
    /// The NICs of this end; QP `q` is on rail `q % rails.len()`.
    pub(crate) rails: Vec<RailInfo>,
    /// (QP number, initial PSN) of each QP.
    pub(crate) qps: Vec<(u32, u32)>,
    /// (QP number, initial PSN) of the probe QP of each path ([`paths`]): the listener's in
    /// its accept; none in the connector's hello (it sends its own once it knows the paths).
    pub(crate) probes: Vec<(u32, u32)>,
}

/// The paths of a connection of `nqps` QPs between a connector of `connector_rails` rails and
/// a listener of `listener_rails`: each distinct (connector rail, listener rail) pair its QPs
/// join (QP `q` joins rail `q % connector_rails` and rail `q % listener_rails`), in the order
/// of their first QP. Both ends number them so; each path has a probe QP of its own at each end.
pub(crate) fn paths(
    nqps: usize,
    connector_rails: usize,
    listener_rails: usize,
) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for q in 0..nqps {
        let pair = (q % connector_rails, q % listener_rails);
        if !out.contains(&pair) {
            out.push(pair);
        }
    }
    out
}

/// The probe QPs of one end, as the sender sends them in its `Resume`: a `u16` count, then
/// (QP number, PSN) pairs.
pub(crate) fn encode_qps(qps: &[(u32, u32)]) -> Vec<u8> {
    let mut w = Writer::with_capacity(2 + 8 * qps.len());
    write_qps(&mut w, qps);
    w.into_vec()
}

/// [`encode_qps`]' message back; `want` of them.
pub(crate) fn decode_qps(p: &[u8], want: usize) -> Result<Vec<(u32, u32)>> {
    let mut r = Reader::new("probe QP list", p);
    let n = r.u16("probe QPs")?;
    if usize::from(n) != want {
        return Err(r.invalid(n, format_args!("{want}, one per path")).into());
    }
    let qps = read_pairs(&mut r, want)?;
    r.end()?;
    Ok(qps)
}

/// A `u16` count of QPs, then each one's (QP number, PSN).
fn write_qps<S: Sink>(w: &mut Writer<S>, qps: &[(u32, u32)]) {
    w.u16(qps.len() as u16);
    for &(qpn, psn) in qps {
        w.u32(qpn).u32(psn);
    }
}

/// QP numbers and packet sequence numbers are 24 bits wide.
const QP_FIELD_LIMIT: u32 = 1 << 24;

/// `n` (QP number, PSN) pairs, each 24 bits.
fn read_pairs(r: &mut Reader<'_>, n: usize) -> Result<Vec<(u32, u32)>, WireError> {
    let field = |r: &mut Reader<'_>, name| {
        let v = r.u32(name)?;
        if v >= QP_FIELD_LIMIT {
            return Err(r.invalid(v, format_args!("below {QP_FIELD_LIMIT} (24 bits)")));
        }
        Ok(v)
    };
    (0..n)
        .map(|_| Ok((field(r, "QP number")?, field(r, "PSN")?)))
        .collect()
}

const CONN_FIXED: usize = 16;
const RAIL_BYTES: usize = 60;
const DEVICE_NAME: usize = 32;
const FLAG_SPLIT: u8 = 1;
const FLAG_MOBILE: u8 = 2;

impl ConnInfo {
    /// Every rail's device name, `a+b`, for messages.
    pub(crate) fn devices(&self) -> String {
        let names: Vec<&str> = self.rails.iter().map(|r| r.device.as_str()).collect();
        names.join("+")
    }

    /// The message: QPs u16 | rails u8 | flags u8 | tc u8 | sl u8 | 2 reserved | address
    /// u64, then per rail: link layer, MTU, port, GID index (u8 each) | LID u16 | 2 reserved |
    /// GID 16 bytes | key u32 | device name 32 bytes (zero-padded), then per QP its number and
    /// PSN (u32 each), then the probe QPs (a `u16` count and pairs).
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(
            CONN_FIXED
                + RAIL_BYTES * self.rails.len()
                + 8 * (self.qps.len() + self.probes.len())
                + 2,
        );
        let flags = (u8::from(self.split) * FLAG_SPLIT) | (u8::from(self.mobile) * FLAG_MOBILE);
        w.u16(self.qps.len() as u16)
            .u8(self.rails.len() as u8)
            .u8(flags)
            .u8(self.tc)
            .u8(self.sl)
            .zeros(2)
            .u64(self.addr);
        for r in &self.rails {
            w.u8(r.link_layer)
                .u8(r.mtu)
                .u8(r.port)
                .u8(r.gid_index)
                .u16(r.lid)
                .zeros(2)
                .bytes(&r.gid)
                .u32(r.rkey)
                .padded(name_within(&r.device, DEVICE_NAME).as_bytes(), DEVICE_NAME);
        }
        for &(qpn, psn) in &self.qps {
            w.u32(qpn).u32(psn);
        }
        write_qps(&mut w, &self.probes);
        w.into_vec()
    }

    pub(crate) fn decode(p: &[u8]) -> Result<Self> {
        let mut r = Reader::new("connection info", p);
        let nqps = r.count_u16("QPs", MAX_QPS)?;
        let nrails = r.count_u8("rails", MAX_RAILS)?;
        if nrails == 0 || nqps < nrails {
            return Err(r
                .invalid(
                    nrails as u64,
                    format_args!("1 to {}, at most the QPs ({nqps})", MAX_RAILS),
                )
                .into());
        }
        let flags = r.u8("flags")?;
        let (tc, sl) = (r.u8("traffic class")?, r.u8("service level")?);
        r.take(2, "reserved")?;
        let addr = r.u64("address")?;
        let rails = (0..nrails)
            .map(|_| {
                let (link_layer, mtu, port, gid_index) = (
                    r.u8("link layer")?,
                    r.u8("MTU")?,
                    r.u8("port")?,
                    r.u8("GID index")?,
                );
                let lid = r.u16("LID")?;
                r.take(2, "rail reserved")?;
                let gid = r.array("GID")?;
                let rkey = r.u32("key")?;
                let device = r.text(DEVICE_NAME, "device name")?.to_string();
                Ok(RailInfo {
                    link_layer,
                    mtu,
                    port,
                    gid_index,
                    lid,
                    gid,
                    rkey,
                    device,
                })
            })
            .collect::<Result<Vec<_>, WireError>>()?;
        let qps = read_pairs(&mut r, nqps)?;
        let nprobes = r.count_u16("probe QPs", nqps)?;
        let probes = read_pairs(&mut r, nprobes)?;
        r.end()?;
        Ok(ConnInfo {
            addr,
            tc,
            sl,
            split: flags & FLAG_SPLIT != 0,
            mobile: flags & FLAG_MOBILE != 0,
            rails,
            qps,
            probes,
        })
    }
}

/// `name`, cut to at most `width` bytes at a character boundary (device names are ASCII;
/// a longer one must still decode).
fn name_within(name: &str, width: usize) -> &str {
    let mut end = name.len().min(width);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    &name[..end]
}

/// The steps of a move (`failover`'s module doc): a receiver that lost a path says `Down`;
/// the sender `Offer`s its new rails; the receiver `Answer`s with its own and the receives it
/// still waits for; the sender `Resume`s with its probe QPs. An end that cannot make a move
/// the peer asks for, or that runs out of NICs in one, `Refuse`s it, saying why. Setup is
/// move 0, whose offer is the connector's hello: the listener `Answer`s it (or `Refuse`s the
/// connection) and the connector `Resume`s. A receiver whose own NICs can carry the
/// connection again says `Healed` (once per move); an offer that loses no rail is a move
/// back to each end's own NICs, which the sender first tries: its `Trial` (its rails on its
/// own NICs) is answered by `Tried` (the receiver's on its own, or nothing where they cannot
/// be brought up), and a write through each tells whether the path reaches the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    Down = 1,
    Offer = 2,
    Answer = 3,
    Resume = 4,
    Refuse = 5,
    Healed = 6,
    Trial = 7,
    Tried = 8,
}

/// One message of a move: its step, the move's epoch, the rails found lost (the sender's,
/// the receiver's: one bit each) and what the step carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MoveMsg {
    pub(crate) step: Step,
    pub(crate) epoch: u32,
    pub(crate) lost: [u8; 2],
    pub(crate) body: Vec<u8>,
}

impl MoveMsg {
    /// This end cannot make move `epoch` (0: take the connection), for the reason `why`.
    pub(crate) fn refusal(epoch: u32, why: Vec<u8>) -> Self {
        MoveMsg {
            step: Step::Refuse,
            epoch,
            lost: [0; 2],
            body: why,
        }
    }

    /// The message: step u8 | epoch u32 | lost rails [u8; 2] | the step's body.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(7 + self.body.len());
        w.u8(self.step as u8)
            .u32(self.epoch)
            .bytes(&self.lost)
            .bytes(&self.body);
        w.into_vec()
    }

    pub(crate) fn decode(p: &[u8]) -> Result<Self> {
        let mut r = Reader::new("move message", p);
        let step = r.u8("step")?;
        let step = Step::from_u8(step).ok_or_else(|| r.invalid(step, "1 to 8"))?;
        Ok(MoveMsg {
            step,
            epoch: r.u32("epoch")?,
            lost: r.array("lost rails")?,
            body: r.rest().to_vec(),
        })
    }
}

/// What a `Healed` says: this end can move the connection again (a NIC left to go to), and
/// its own NICs (where NCCL's device placed its rails) can carry the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Healed {
    pub(crate) mobile: bool,
    pub(crate) home: bool,
}

impl Healed {
    const MOBILE: u8 = 1;
    const HOME: u8 = 2;

    /// Its message, in move `epoch`: flags u8.
    pub(crate) fn message(self, epoch: u32) -> MoveMsg {
        let flags = (u8::from(self.mobile) * Self::MOBILE) | (u8::from(self.home) * Self::HOME);
        MoveMsg {
            step: Step::Healed,
            epoch,
            lost: [0; 2],
            body: vec![flags],
        }
    }

    /// A `Healed` message's body.
    pub(crate) fn decode(body: &[u8]) -> Result<Self> {
        let mut r = Reader::new("healed message", body);
        let flags = r.u8("flags")?;
        if flags & !(Self::MOBILE | Self::HOME) != 0 {
            return Err(r.invalid(flags, "flags 1 (mobile) and 2 (home)").into());
        }
        r.end()?;
        Ok(Healed {
            mobile: flags & Self::MOBILE != 0,
            home: flags & Self::HOME != 0,
        })
    }
}

impl Step {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Step::Down,
            2 => Step::Offer,
            3 => Step::Answer,
            4 => Step::Resume,
            5 => Step::Refuse,
            6 => Step::Healed,
            7 => Step::Trial,
            8 => Step::Tried,
            _ => return None,
        })
    }
}

/// A trial's message body (`Trial`, `Tried`): which trial of the move it is (a `Tried`
/// answers that one only), then the rails (a `Tried` without: the receiver's own NICs cannot
/// be brought up towards the sender's).
pub(crate) fn encode_trial(number: u32, rails: &[u8]) -> Vec<u8> {
    let mut w = Writer::with_capacity(4 + rails.len());
    w.u32(number).bytes(rails);
    w.into_vec()
}

/// [`encode_trial`]'s body back: the trial's number, and its rails' bytes.
pub(crate) fn decode_trial(p: &[u8]) -> Result<(u32, &[u8])> {
    let mut r = Reader::new("trial message", p);
    let number = r.u32("trial")?;
    Ok((number, r.rest()))
}

/// The receives still waiting, as an answer carries them: (slot, its clear-to-send entries).
pub(crate) type Waiting = Vec<(usize, Vec<CtsEntry>)>;

/// An answer's body: the receiver's rails (an encoded `ConnInfo`, after its length u32),
/// then the waiting receives (a `u16` count; each its slot u8, its entries' count u8 and the
/// entries).
pub(crate) fn encode_answer(info: &[u8], waiting: &Waiting) -> Vec<u8> {
    let mut w = Writer::with_capacity(8 + info.len() + waiting.len() * 8 * CTS_BYTES);
    w.u32(info.len() as u32)
        .bytes(info)
        .u16(waiting.len() as u16);
    for (slot, entries) in waiting {
        w.u8(*slot as u8).u8(entries.len() as u8);
        for e in entries {
            e.write(&mut w);
        }
    }
    w.into_vec()
}

/// [`encode_answer`] back: the `ConnInfo` bytes and the waiting receives (each a slot of the
/// connection with 1 to `MAX_RECVS` entries).
pub(crate) fn decode_answer(p: &[u8]) -> Result<(&[u8], Waiting)> {
    let mut r = Reader::new("move answer", p);
    let len = r.count_u32("connection info length", p.len())?;
    let info = r.take(len, "connection info")?;
    let n = r.count_u16("waiting receives", SLOTS)?;
    let waiting = (0..n)
        .map(|_| {
            let slot = r.u8("slot")?;
            if usize::from(slot) >= SLOTS {
                return Err(r.invalid(slot, format_args!("below {SLOTS}")));
            }
            let k = r.u8("buffers")?;
            if !(1..=MAX_RECVS).contains(&usize::from(k)) {
                return Err(r.invalid(k, format_args!("1 to {MAX_RECVS}")));
            }
            let entries = (0..k)
                .map(|_| CtsEntry::read(&mut r))
                .collect::<Result<Vec<_>, WireError>>()?;
            Ok((usize::from(slot), entries))
        })
        .collect::<Result<Waiting, WireError>>()?;
    r.end()?;
    Ok((info, waiting))
}

/// A `Bye`'s body: nothing from a sender; from a receiver, the number its landed receives
/// lie below (u64).
pub(crate) fn encode_bye(landed: Option<u64>) -> Vec<u8> {
    let mut w = Writer::with_capacity(8);
    if let Some(n) = landed {
        w.u64(n);
    }
    w.into_vec()
}

/// [`encode_bye`] back.
pub(crate) fn decode_bye(p: &[u8]) -> Result<Option<u64>> {
    if p.is_empty() {
        return Ok(None);
    }
    let mut r = Reader::new("bye", p);
    let landed = r.u64("landed receives")?;
    r.end()?;
    Ok(Some(landed))
}

#[cfg(test)]
mod tests;
