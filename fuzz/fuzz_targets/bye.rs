//! A `Bye`'s body, the peer's last word.
//! `protocol::bye` decodes as the plugin does and holds the decoder to its contract.

#![no_main]

use libfuzzer_sys::fuzz_target;
use nccl_net_erdma::protocol;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = protocol::bye(data) {
        let _ = e.to_string();
    }
});
