//! nccl-net-erdma: an NCCL network plugin (`ncclNet` v6 to v12) for Alibaba Cloud eRDMA and
//! any RoCE/IB verbs device, with a TCP transport for hosts without RDMA.
//!
//! Layers, top to bottom; imports only point down (`tests/layers.rs` checks it):
//! `abi` (the C boundary: exported tables, panic boundary) and `report` (what the info command
//! shows), `plugin` (the version-neutral core, generic over the transport contract),
//! `transport` (the contract; `either` names `tcp` and `verbs` behind it), `oob` (the
//! out-of-band bootstrap), `verbs` (the only caller of `ibv_*`), `log`, `config`, and the small
//! shared pieces at the bottom (`error`, with the one mapping to NCCL's codes, `buffer`,
//! `random`, `sysfs`, `ffi`). `unsafe` lives only in `abi`, `verbs` and the buffer type `abi`
//! hands down.
//!
//! The crate's public surface is what the tools and tests need besides the exported tables:
//! [`ffi`] (the ABI types), [`protocol`] (every wire format a peer sends, for fuzzing and
//! hostile-peer tests) and [`report`] (the host report behind `nccl-net-erdma-info`).

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]
#![warn(clippy::undocumented_unsafe_blocks)]

mod abi;
mod buffer;
mod codec;
mod config;
mod error;
pub mod ffi;
mod log;
mod oob;
mod plugin;
pub mod protocol;
mod random;
pub mod report;
mod sysfs;
mod transport;
mod verbs;
