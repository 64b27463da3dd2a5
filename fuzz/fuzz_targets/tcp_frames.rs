//! What a tcp peer writes after setup: clear-to-send frames as a sender reads them one after another, and data frame headers.
//! `protocol::tcp_frames` decodes as the plugin does and holds the decoder to its contract.

#![no_main]

use libfuzzer_sys::fuzz_target;
use nccl_net_erdma::protocol;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = protocol::tcp_frames(data) {
        let _ = e.to_string();
    }
});
