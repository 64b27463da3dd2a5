//! A move message as the peer's bootstrap socket delivers it at any time of a connection's life, with its body read as the step it names carries it.
//! `protocol::move_message` decodes as the plugin does and holds the decoder to its contract.

#![no_main]

use libfuzzer_sys::fuzz_target;
use nccl_net_erdma::protocol;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = protocol::move_message(data) {
        let _ = e.to_string();
    }
});
