//! A resume's probe QP list.
//! `protocol::probe_qps` decodes as the plugin does and holds the decoder to its contract.

#![no_main]

use libfuzzer_sys::fuzz_target;
use nccl_net_erdma::protocol;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = protocol::probe_qps(data) {
        let _ = e.to_string();
    }
});
