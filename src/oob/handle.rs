//! The connection handle NCCL carries from `listen` to the peer's `connect`: 64 bytes, the
//! size of NCCL 2.9's handle (a stack buffer there); later NCCLs pass 128, of which only these
//! are touched.
//!
//! It is self-contained (address, port, magic, protocol version, which transport listens, a
//! random listener nonce) and holds nothing the peer would dereference. NCCL passes the same
//! buffer to every retry of `connect`, so the connector keeps its stage id in the handle; the
//! id is only a key into a registry, never a pointer, so a forged handle cannot make us touch
//! arbitrary memory.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use crate::codec::{Reader, WireError, Writer};
use crate::error::{Error, Result};

/// The bytes of NCCL's handle buffer the plugin reads and writes (bytes 0..56 are used).
pub const HANDLE_SIZE: usize = 64;
/// "ERDMANET", first 8 bytes of every handle we write.
pub const HANDLE_MAGIC: u64 = 0x4552_444d_414e_4554;
/// Version of the handle and handshake protocol; a peer with another version is refused.
/// 4: the move messages (`Refuse` among them), the `mobile` flag of the verbs setup message,
/// and `Bye`; a build of version 3 would drop them unread. 5: setup is one-way (the connector
/// waits for no answer before its comm is returned; the verbs listener answers with move 0's
/// `Answer` and the connector's last word is its `Resume`), `Accept` and `Ready` are gone.
/// 6: the receiver's `Healed`, and the move back (an offer that loses no rail).
pub const PROTOCOL_VERSION: u16 = 7;

/// Transport a listener speaks; the connector must use the same one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum TransportKind {
    /// `transport::tcp`.
    Tcp = 1,
    /// `transport::verbs`.
    Verbs = 2,
}

impl TransportKind {
    pub(crate) fn from_u8(v: u8) -> Option<Self> {
        match v {
            1 => Some(TransportKind::Tcp),
            2 => Some(TransportKind::Verbs),
            _ => None,
        }
    }
    /// Lower-case name, as in `NCCL_ERDMA_TRANSPORT`.
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Tcp => "tcp",
            TransportKind::Verbs => "verbs",
        }
    }
}

/// The decoded contents of a handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Handle {
    /// Where the listener accepts connections.
    pub addr: SocketAddr,
    /// Transport of the listener.
    pub transport: TransportKind,
    /// Random value the connector must echo in its hello, so strangers are told apart.
    pub nonce: u64,
}

// Byte layout (all integers little-endian, except the port which is in network order):
// magic u64 | version u16 | family u8 (4 or 6) | transport u8 | port u16 | 2 reserved |
// address 16 bytes | nonce u64 | connector stage id u64 (0 = not started) |
// stage check u64 (stage id ^ nonce ^ magic) | 8 unused.
const OFF_STAGE: usize = 40;
const STAGE_BYTES: usize = 16;
const _: () = assert!(OFF_STAGE + STAGE_BYTES <= HANDLE_SIZE);

impl Handle {
    /// Writes the handle; the connector's stage area is zeroed so the peer starts fresh.
    pub fn encode(&self, out: &mut [u8; HANDLE_SIZE]) {
        let (family, ip): (u8, &[u8]) = match self.addr.ip() {
            IpAddr::V4(ip) => (4, &ip.octets()),
            IpAddr::V6(ip) => (6, &ip.octets()),
        };
        let mut w = Writer::over(&mut out[..]);
        w.u64(HANDLE_MAGIC)
            .u16(PROTOCOL_VERSION)
            .u8(family)
            .u8(self.transport as u8)
            .u16_be(self.addr.port())
            .zeros(2)
            .padded(ip, 16)
            .u64(self.nonce)
            .zeros(HANDLE_SIZE - OFF_STAGE);
    }

    /// Validates and decodes a handle received from a peer.
    pub fn decode(buf: &[u8; HANDLE_SIZE]) -> Result<Self> {
        // Fixed fields of a fixed-size buffer: the reads cannot run short.
        let raw = Raw::read(&mut Reader::new("connection handle", buf))
            .map_err(|e| Error::misuse(e.to_string()))?;
        if raw.magic != HANDLE_MAGIC {
            return Err(Error::misuse(format!(
                "connection handle has magic {:#018x}, expected {HANDLE_MAGIC:#018x}: \
                 it was not made by this plugin's listen (mixed plugins or a corrupted handle)",
                raw.magic
            )));
        }
        if raw.version != PROTOCOL_VERSION {
            return Err(Error::misuse(format!(
                "connection handle has protocol version {}, this plugin speaks \
                 {PROTOCOL_VERSION}: run the same plugin build on every node",
                raw.version
            )));
        }
        let transport = TransportKind::from_u8(raw.transport).ok_or_else(|| {
            Error::misuse(format!(
                "connection handle names unknown transport {}",
                raw.transport
            ))
        })?;
        let a = raw.addr;
        let ip = match raw.family {
            4 => IpAddr::V4(Ipv4Addr::new(a[0], a[1], a[2], a[3])),
            6 => IpAddr::V6(Ipv6Addr::from(a)),
            f => {
                return Err(Error::misuse(format!(
                    "connection handle has unknown address family {f}"
                )))
            }
        };
        let port = raw.port;
        if port == 0 || ip.is_unspecified() || ip.is_multicast() {
            return Err(Error::misuse(format!(
                "connection handle has an unusable address {ip} port {port}"
            )));
        }
        Ok(Handle {
            addr: SocketAddr::new(ip, port),
            transport,
            nonce: raw.nonce,
        })
    }
}

/// A handle's fields as they lie, before they are checked.
struct Raw {
    magic: u64,
    version: u16,
    family: u8,
    transport: u8,
    port: u16,
    addr: [u8; 16],
    nonce: u64,
}

impl Raw {
    fn read(r: &mut Reader<'_>) -> std::result::Result<Self, WireError> {
        Ok(Raw {
            magic: r.u64("magic")?,
            version: r.u16("version")?,
            family: r.u8("family")?,
            transport: r.u8("transport")?,
            port: r.u16_be("port")?,
            addr: {
                r.take(2, "reserved")?;
                r.array("address")?
            },
            nonce: r.u64("nonce")?,
        })
    }
}

/// The handle's nonce and its stage area: (nonce, stage id, check).
fn stage_area(buf: &[u8; HANDLE_SIZE]) -> (u64, u64, u64) {
    // Fixed offsets inside a fixed-size buffer: the reads cannot fail.
    let word = |at: usize| {
        let mut r = Reader::new("connection handle", &buf[at..]);
        r.u64("stage").unwrap_or(0)
    };
    (word(OFF_STAGE - 8), word(OFF_STAGE), word(OFF_STAGE + 8))
}

/// The connector's stage id stored in a handle: `Ok(None)` before the first `connect`.
pub fn stage_id(buf: &[u8; HANDLE_SIZE]) -> Result<Option<u64>> {
    let (nonce, id, check) = stage_area(buf);
    match id {
        0 if check == 0 => Ok(None),
        _ if check == id ^ nonce ^ HANDLE_MAGIC => Ok(Some(id)),
        _ => Err(Error::misuse(
            "connection handle carries a corrupted connect stage".into(),
        )),
    }
}

/// Records the connector's stage id in the handle NCCL will pass to the next `connect`.
pub fn set_stage_id(buf: &mut [u8; HANDLE_SIZE], id: u64) {
    let (nonce, _, _) = stage_area(buf);
    Writer::over(&mut buf[OFF_STAGE..])
        .u64(id)
        .u64(id ^ nonce ^ HANDLE_MAGIC);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Handle {
        Handle {
            addr: "127.0.0.1:4242".parse().unwrap(),
            transport: TransportKind::Tcp,
            nonce: 0x1234_5678_9abc_def0,
        }
    }

    #[test]
    fn round_trips_v4_and_v6() {
        for h in [
            sample(),
            Handle {
                addr: "[::1]:9".parse().unwrap(),
                transport: TransportKind::Verbs,
                nonce: 7,
            },
        ] {
            let mut buf = [0xffu8; HANDLE_SIZE];
            h.encode(&mut buf);
            assert_eq!(Handle::decode(&buf).unwrap(), h);
            assert_eq!(stage_id(&buf).unwrap(), None);
        }
    }

    #[test]
    fn rejects_wrong_magic_version_and_garbage() {
        let mut buf = [0u8; HANDLE_SIZE];
        sample().encode(&mut buf);
        let mut bad = buf;
        bad[0] ^= 1;
        assert!(Handle::decode(&bad)
            .unwrap_err()
            .to_string()
            .contains("magic"));
        let mut bad = buf;
        bad[8] = 9;
        assert!(Handle::decode(&bad)
            .unwrap_err()
            .to_string()
            .contains("version"));
        let mut bad = buf;
        bad[12] = 0;
        bad[13] = 0;
        assert!(Handle::decode(&bad).is_err());
        // A deterministic pseudo-random stream: none of these decodes.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..1000 {
            let mut r = [0u8; HANDLE_SIZE];
            for b in r.iter_mut() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *b = x as u8;
            }
            assert!(Handle::decode(&r).is_err());
        }
    }

    #[test]
    fn stage_id_is_checked() {
        let mut buf = [0u8; HANDLE_SIZE];
        sample().encode(&mut buf);
        set_stage_id(&mut buf, 99);
        assert_eq!(stage_id(&buf).unwrap(), Some(99));
        buf[OFF_STAGE] ^= 4;
        assert!(stage_id(&buf).is_err());
    }
}
