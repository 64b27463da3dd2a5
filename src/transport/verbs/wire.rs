//! What the two ends of a verbs connection agree on: the setup message each sends over `oob`
//! ([`ConnInfo`]), the clear-to-send entry a receiver RDMA-writes into the sender's FIFO
//! ([`CtsEntry`]), the size record of a grouped receive, the work-request ids both sides post
//! with, and how a message is split over several QPs. Pure data and arithmetic, no verbs.

use crate::error::{Error, Result};
use crate::transport::{MAX_RECVS, MAX_REQUESTS};

/// Receive slots per connection: one per request NCCL may keep in flight.
pub(crate) const SLOTS: usize = MAX_REQUESTS;
/// Marks a send that was larger than its receive, in an immediate or a size record.
pub(crate) const TRUNCATED: u32 = u32::MAX;
/// Bytes per clear-to-send entry; entries never straddle 32-byte boundaries.
pub(crate) const CTS_BYTES: usize = 32;
/// Alignment of the pieces a message is split into over several QPs (LL/LL128 lines).
pub(crate) const SPLIT_ALIGN: usize = 128;
/// eRDMA's inline limit, and enough for three clear-to-send entries.
pub(crate) const MAX_INLINE: u32 = 96;
/// Most QPs per connection (`NCCL_IB_QPS_PER_CONNECTION`).
pub(crate) const MAX_QPS: usize = 128;

/// One clear-to-send entry, as the receiver writes it into the sender's FIFO: entry `i` of
/// slot `s` announces buffer `i` of the receive with sequence number `seq` (`seq % SLOTS ==
/// s`).
#[repr(C, align(8))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct CtsEntry {
    pub(crate) addr: u64,
    pub(crate) rkey: u32,
    pub(crate) tag: i32,
    /// The buffer's size, saturated at `u32::MAX` (sends are at most 1 GiB, so a larger
    /// buffer can never be too small).
    pub(crate) size: u32,
    /// Buffers in the grouped receive.
    pub(crate) nreqs: u32,
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
    /// The entry announcing `addr..addr+len` (`rkey`, `tag`) as one of `nreqs` buffers of
    /// the receive numbered `seq`.
    pub(crate) fn new(addr: u64, len: usize, rkey: u32, tag: i32, nreqs: usize, seq: u64) -> Self {
        CtsEntry {
            addr,
            rkey,
            tag,
            size: u32::try_from(len).unwrap_or(u32::MAX),
            nreqs: nreqs as u32,
            seq: seq + 1,
        }
    }
}

/// Entry `i` of `slot` in a FIFO of `SLOTS * MAX_RECVS` entries.
#[inline(always)]
pub(crate) fn cts_index(slot: usize, i: usize) -> usize {
    slot * MAX_RECVS + i
}

/// What a work request is, in the high 32 bits of its id (the low bits carry the slot).
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
}

impl WrKind {
    /// The id of a request of this kind for `slot`.
    #[inline(always)]
    pub(crate) const fn id(self, slot: usize) -> u64 {
        (self as u64) << 32 | slot as u64
    }

    /// The kind of request `wr_id` (None for an id we never post).
    #[inline(always)]
    pub(crate) fn of(wr_id: u64) -> Option<WrKind> {
        Some(match wr_id >> 32 {
            1 => WrKind::Recv,
            2 => WrKind::Cts,
            3 => WrKind::Send,
            4 => WrKind::Flush,
            5 => WrKind::Probe,
            _ => return None,
        })
    }

    /// The slot of request `wr_id`.
    #[inline(always)]
    pub(crate) fn slot(wr_id: u64) -> usize {
        (wr_id & 0xffff_ffff) as usize % SLOTS
    }

    /// What the request was, for messages.
    pub(crate) fn describe(wr_id: u64) -> &'static str {
        match WrKind::of(wr_id) {
            Some(WrKind::Recv) => "receive of RDMA write with immediate",
            Some(WrKind::Cts) => "clear-to-send RDMA write",
            Some(WrKind::Send) => "data RDMA write",
            Some(WrKind::Flush) => "flush RDMA read",
            Some(WrKind::Probe) => "liveness probe RDMA read",
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

/// The QPs a request uses: (first, how many). Split: every QP, each with a piece of every
/// message; else requests take turns, one QP each.
#[inline(always)]
pub(crate) fn qps_for(seq: u64, nqps: usize, split: bool) -> (usize, usize) {
    if split {
        (0, nqps)
    } else {
        ((seq % nqps as u64) as usize, 1)
    }
}

/// What each side tells the other about its end of the connection: the first message of
/// the connector (in its hello) and of the listener (in its accept).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ConnInfo {
    pub(crate) link_layer: u8,
    pub(crate) mtu: u8,
    pub(crate) port: u8,
    pub(crate) gid_index: u8,
    pub(crate) lid: u16,
    pub(crate) gid: [u8; 16],
    /// Sender: its clear-to-send FIFO; receiver: its size records.
    pub(crate) addr: u64,
    pub(crate) rkey: u32,
    pub(crate) device: String,
    pub(crate) tc: u8,
    pub(crate) sl: u8,
    /// `NCCL_IB_SPLIT_DATA_ON_QPS`: the connector's setting in the hello, the setting in
    /// effect (the receiver's) in the accept.
    pub(crate) split: bool,
    /// (QP number, initial PSN) of each QP.
    pub(crate) qps: Vec<(u32, u32)>,
}

const CONN_FIXED: usize = 72;
const FLAG_SPLIT: u8 = 1;

impl ConnInfo {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(CONN_FIXED + 8 * self.qps.len());
        v.extend_from_slice(&(self.qps.len() as u16).to_le_bytes());
        v.extend_from_slice(&[self.link_layer, self.mtu, self.port, self.gid_index]);
        v.extend_from_slice(&self.lid.to_le_bytes());
        v.extend_from_slice(&self.gid);
        v.extend_from_slice(&self.addr.to_le_bytes());
        v.extend_from_slice(&self.rkey.to_le_bytes());
        let mut name = [0u8; 32];
        let n = self.device.len().min(32);
        name[..n].copy_from_slice(&self.device.as_bytes()[..n]);
        v.extend_from_slice(&name);
        let flags = if self.split { FLAG_SPLIT } else { 0 };
        v.extend_from_slice(&[self.tc, self.sl, flags, 0]);
        for (qpn, psn) in &self.qps {
            v.extend_from_slice(&qpn.to_le_bytes());
            v.extend_from_slice(&psn.to_le_bytes());
        }
        v
    }

    pub(crate) fn decode(p: &[u8]) -> Result<Self> {
        let bad = |why: &str| Error::Remote(format!("invalid connection info: {why}"));
        if p.len() < CONN_FIXED {
            return Err(bad("too short"));
        }
        let nqps = u16::from_le_bytes([p[0], p[1]]) as usize;
        if nqps == 0 || nqps > MAX_QPS || p.len() != CONN_FIXED + 8 * nqps {
            return Err(bad(&format!("{nqps} QPs in {} bytes", p.len())));
        }
        let u32_at = |o: usize| u32::from_le_bytes([p[o], p[o + 1], p[o + 2], p[o + 3]]);
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&p[8..24]);
        let mut addr = [0u8; 8];
        addr.copy_from_slice(&p[24..32]);
        let name_end = p[36..68].iter().position(|b| *b == 0).unwrap_or(32);
        Ok(ConnInfo {
            link_layer: p[2],
            mtu: p[3],
            port: p[4],
            gid_index: p[5],
            lid: u16::from_le_bytes([p[6], p[7]]),
            gid,
            addr: u64::from_le_bytes(addr),
            rkey: u32_at(32),
            device: String::from_utf8_lossy(&p[36..36 + name_end]).into_owned(),
            tc: p[68],
            sl: p[69],
            split: p[70] & FLAG_SPLIT != 0,
            qps: (0..nqps)
                .map(|i| (u32_at(CONN_FIXED + 8 * i), u32_at(CONN_FIXED + 8 * i + 4)))
                .collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_every_byte_once_aligned() {
        for size in [
            0,
            1,
            127,
            128,
            129,
            1000,
            4096,
            65_537,
            1 << 20,
            (1 << 20) + 3,
        ] {
            for used in [1, 2, 3, 4, 8, 128] {
                let mut next = 0;
                for k in 0..used {
                    let (off, len) = piece(size, k, used);
                    if len > 0 {
                        assert_eq!(off, next, "size {size} used {used} piece {k}");
                        assert!(used == 1 || off % SPLIT_ALIGN == 0);
                    }
                    next = off + len;
                }
                assert_eq!(next, size, "size {size} over {used}");
            }
        }
        // Small messages land in the first piece; the rest are empty.
        assert_eq!(piece(100, 0, 4), (0, 100));
        assert_eq!(piece(100, 1, 4), (100, 0));
    }

    #[test]
    fn requests_take_turns_over_qps_unless_split() {
        assert_eq!(qps_for(0, 4, false), (0, 1));
        assert_eq!(qps_for(5, 4, false), (1, 1));
        assert_eq!(qps_for(u64::from(u32::MAX) + 1, 4, false), (0, 1));
        assert_eq!(qps_for(7, 4, true), (0, 4));
    }

    #[test]
    fn wr_ids_carry_kind_and_slot() {
        for kind in [
            WrKind::Recv,
            WrKind::Cts,
            WrKind::Send,
            WrKind::Flush,
            WrKind::Probe,
        ] {
            for slot in [0, 1, SLOTS - 1] {
                let id = kind.id(slot);
                assert_eq!(WrKind::of(id), Some(kind));
                assert_eq!(WrKind::slot(id), slot);
            }
        }
        assert_eq!(WrKind::of(0), None);
        assert_eq!(WrKind::describe(9 << 32), "work request");
    }

    #[test]
    fn cts_entries_saturate_sizes_and_number_receives_from_one() {
        let e = CtsEntry::new(0x1000, 5 << 30, 7, -3, 2, u64::from(u32::MAX));
        assert_eq!(e.size, u32::MAX);
        assert_eq!(e.seq, 1 << 32, "no wrap at 2^32");
        assert_eq!((e.addr, e.rkey, e.tag, e.nreqs), (0x1000, 7, -3, 2));
        assert_eq!(cts_index(3, 2), 26);
    }

    #[test]
    fn conn_info_round_trips_and_rejects_bad_lengths() {
        let info = ConnInfo {
            link_layer: 2,
            mtu: 3,
            port: 1,
            gid_index: 1,
            lid: 9,
            gid: [7; 16],
            addr: 0xdead_beef_0000,
            rkey: 42,
            device: "rxe0".into(),
            tc: 106,
            sl: 3,
            split: true,
            qps: vec![(17, 100), (18, 200)],
        };
        let bytes = info.encode();
        assert_eq!(ConnInfo::decode(&bytes).unwrap(), info);
        let off = ConnInfo {
            split: false,
            ..info.clone()
        };
        assert!(!ConnInfo::decode(&off.encode()).unwrap().split);
        assert!(ConnInfo::decode(&bytes[..CONN_FIXED]).is_err());
        assert!(ConnInfo::decode(&bytes[..bytes.len() - 1]).is_err());
        let mut zero = bytes.clone();
        zero[0] = 0;
        zero[1] = 0;
        assert!(ConnInfo::decode(&zero).is_err());
    }
}
