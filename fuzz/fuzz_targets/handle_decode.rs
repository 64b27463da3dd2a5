//! The 64-byte connection handle NCCL carries from `listen` to the peer's `connect`: any
//! bytes must be refused or decoded, never crash, and what decodes is self-consistent.

#![no_main]

use libfuzzer_sys::fuzz_target;
use nccl_net_erdma::protocol::{handle, Handle, HANDLE_SIZE};

fuzz_target!(|data: &[u8]| {
    // The plugin reads HANDLE_SIZE bytes of NCCL's handle buffer; shorter inputs are
    // zero-padded.
    let mut buf = [0u8; HANDLE_SIZE];
    let n = data.len().min(HANDLE_SIZE);
    buf[..n].copy_from_slice(&data[..n]);

    match Handle::decode(&buf) {
        Ok(h) => {
            // Only a usable address gets through, so connect never dials garbage.
            let ip = h.addr.ip();
            assert!(h.addr.port() != 0 && !ip.is_unspecified() && !ip.is_multicast());
            // What decodes re-encodes to a handle that decodes the same.
            let mut again = [0u8; HANDLE_SIZE];
            h.encode(&mut again);
            assert_eq!(Handle::decode(&again).expect("re-encoded handle"), h);
            assert_eq!(handle::stage_id(&again).expect("fresh stage"), None);
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }

    match handle::stage_id(&buf) {
        Ok(Some(id)) => {
            // A valid stage area is exactly what set_stage_id writes for it.
            let mut b = buf;
            handle::set_stage_id(&mut b, id);
            assert_eq!(b, buf);
        }
        Ok(None) => {}
        Err(e) => {
            let _ = e.to_string();
        }
    }
});
