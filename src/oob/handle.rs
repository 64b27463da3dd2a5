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
pub const PROTOCOL_VERSION: u16 = 5;

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
    fn from_u8(v: u8) -> Option<Self> {
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
const OFF_MAGIC: usize = 0; // u64
const OFF_VERSION: usize = 8; // u16
const OFF_FAMILY: usize = 10; // u8: 4 or 6
const OFF_TRANSPORT: usize = 11; // u8
const OFF_PORT: usize = 12; // u16 big-endian
const OFF_ADDR: usize = 16; // 16 bytes
const OFF_NONCE: usize = 32; // u64
const OFF_STAGE: usize = 40; // u64: connector stage id, 0 = not started
const OFF_STAGE_CHECK: usize = 48; // u64: stage id ^ nonce ^ magic
const _: () = assert!(OFF_STAGE_CHECK + 8 <= HANDLE_SIZE);

impl Handle {
    /// Writes the handle; the connector's stage area is zeroed so the peer starts fresh.
    pub fn encode(&self, out: &mut [u8; HANDLE_SIZE]) {
        out.fill(0);
        out[OFF_MAGIC..OFF_MAGIC + 8].copy_from_slice(&HANDLE_MAGIC.to_le_bytes());
        out[OFF_VERSION..OFF_VERSION + 2].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        out[OFF_TRANSPORT] = self.transport as u8;
        out[OFF_PORT..OFF_PORT + 2].copy_from_slice(&self.addr.port().to_be_bytes());
        match self.addr.ip() {
            IpAddr::V4(ip) => {
                out[OFF_FAMILY] = 4;
                out[OFF_ADDR..OFF_ADDR + 4].copy_from_slice(&ip.octets());
            }
            IpAddr::V6(ip) => {
                out[OFF_FAMILY] = 6;
                out[OFF_ADDR..OFF_ADDR + 16].copy_from_slice(&ip.octets());
            }
        }
        out[OFF_NONCE..OFF_NONCE + 8].copy_from_slice(&self.nonce.to_le_bytes());
    }

    /// Validates and decodes a handle received from a peer.
    pub fn decode(buf: &[u8; HANDLE_SIZE]) -> Result<Self> {
        let magic = u64_at(buf, OFF_MAGIC);
        if magic != HANDLE_MAGIC {
            return Err(Error::misuse(format!(
                "connection handle has magic {magic:#018x}, expected {HANDLE_MAGIC:#018x}: \
                 it was not made by this plugin's listen (mixed plugins or a corrupted handle)"
            )));
        }
        let version = u16::from_le_bytes([buf[OFF_VERSION], buf[OFF_VERSION + 1]]);
        if version != PROTOCOL_VERSION {
            return Err(Error::misuse(format!(
                "connection handle has protocol version {version}, this plugin speaks \
                 {PROTOCOL_VERSION}: run the same plugin build on every node"
            )));
        }
        let transport = TransportKind::from_u8(buf[OFF_TRANSPORT]).ok_or_else(|| {
            Error::misuse(format!(
                "connection handle names unknown transport {}",
                buf[OFF_TRANSPORT]
            ))
        })?;
        let port = u16::from_be_bytes([buf[OFF_PORT], buf[OFF_PORT + 1]]);
        let ip = match buf[OFF_FAMILY] {
            4 => {
                let mut o = [0u8; 4];
                o.copy_from_slice(&buf[OFF_ADDR..OFF_ADDR + 4]);
                IpAddr::V4(Ipv4Addr::from(o))
            }
            6 => {
                let mut o = [0u8; 16];
                o.copy_from_slice(&buf[OFF_ADDR..OFF_ADDR + 16]);
                IpAddr::V6(Ipv6Addr::from(o))
            }
            f => {
                return Err(Error::misuse(format!(
                    "connection handle has unknown address family {f}"
                )))
            }
        };
        if port == 0 || ip.is_unspecified() || ip.is_multicast() {
            return Err(Error::misuse(format!(
                "connection handle has an unusable address {ip} port {port}"
            )));
        }
        Ok(Handle {
            addr: SocketAddr::new(ip, port),
            transport,
            nonce: u64_at(buf, OFF_NONCE),
        })
    }
}

/// The connector's stage id stored in a handle: `Ok(None)` before the first `connect`.
pub fn stage_id(buf: &[u8; HANDLE_SIZE]) -> Result<Option<u64>> {
    let id = u64_at(buf, OFF_STAGE);
    let check = u64_at(buf, OFF_STAGE_CHECK);
    match id {
        0 if check == 0 => Ok(None),
        _ if check == id ^ u64_at(buf, OFF_NONCE) ^ HANDLE_MAGIC => Ok(Some(id)),
        _ => Err(Error::misuse(
            "connection handle carries a corrupted connect stage".into(),
        )),
    }
}

/// Records the connector's stage id in the handle NCCL will pass to the next `connect`.
pub fn set_stage_id(buf: &mut [u8; HANDLE_SIZE], id: u64) {
    let check = id ^ u64_at(buf, OFF_NONCE) ^ HANDLE_MAGIC;
    buf[OFF_STAGE..OFF_STAGE + 8].copy_from_slice(&id.to_le_bytes());
    buf[OFF_STAGE_CHECK..OFF_STAGE_CHECK + 8].copy_from_slice(&check.to_le_bytes());
}

fn u64_at(buf: &[u8], off: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&buf[off..off + 8]);
    u64::from_le_bytes(b)
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
        bad[OFF_VERSION] = 9;
        assert!(Handle::decode(&bad)
            .unwrap_err()
            .to_string()
            .contains("version"));
        let mut bad = buf;
        bad[OFF_PORT] = 0;
        bad[OFF_PORT + 1] = 0;
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
