//! The verbs setup message a peer sends in its hello, offer and answer (`ConnInfo`): any bytes are refused with an error or decode to what re-encodes alike.
//! `protocol::conn_info` decodes as the plugin does and holds the decoder to its contract.

#![no_main]

use libfuzzer_sys::fuzz_target;
use nccl_net_erdma::protocol;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = protocol::conn_info(data) {
        let _ = e.to_string();
    }
});
