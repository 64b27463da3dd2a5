//! A move's answer (the receiver's rails and the receives it waits for), read by a sender whose peer may say anything.
//! `protocol::answer` decodes as the plugin does and holds the decoder to its contract.

#![no_main]

use libfuzzer_sys::fuzz_target;
use nccl_net_erdma::protocol;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = protocol::answer(data) {
        let _ = e.to_string();
    }
});
