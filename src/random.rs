//! Random numbers without a dependency: listener nonces and initial packet sequence numbers.

use std::io::Read;

/// A random 64-bit value from the kernel, good enough to tell our own peers from strangers
/// and to spread initial PSNs (it is not a secret against an attacker on the path).
pub(crate) fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_ok()
    {
        return u64::from_le_bytes(b);
    }
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    t ^ (u64::from(std::process::id()) << 32)
}
