//! The framed handshake messages a listener reads from whoever connects to its port: the
//! input is read as a stream of messages (header, payload, header, ...), as `Channel` does.
//! Nothing may crash or over-allocate; what decodes is self-consistent.

#![no_main]

use libfuzzer_sys::fuzz_target;
use nccl_net_erdma::protocol::{decode_header, encode_header, Hello, MsgKind, MAX_PAYLOAD, MSG_HEADER};

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    while rest.len() >= MSG_HEADER {
        let mut h = [0u8; MSG_HEADER];
        h.copy_from_slice(&rest[..MSG_HEADER]);
        rest = &rest[MSG_HEADER..];
        let (kind, len) = match decode_header(&h) {
            Ok(v) => v,
            Err(e) => {
                // The connection is dropped here.
                let _ = e.to_string();
                return;
            }
        };
        // The length is checked before anything is allocated for the payload.
        assert!(len <= MAX_PAYLOAD);
        assert_eq!(
            decode_header(&encode_header(kind, len)).expect("re-encoded"),
            (kind, len)
        );
        if rest.len() < len {
            return; // truncated: the reader waits for more, or the peer closed
        }
        let (payload, tail) = rest.split_at(len);
        rest = tail;
        if kind == MsgKind::Hello {
            match Hello::decode(payload) {
                Ok(hello) => {
                    assert_eq!(hello.encode(), payload);
                    assert_eq!(Hello::decode(&hello.encode()).expect("re-encoded"), hello);
                }
                Err(e) => {
                    let _ = e.to_string();
                }
            }
        }
    }
});
