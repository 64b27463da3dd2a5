//! Tools around the nccl-net-erdma plugin, kept out of the library NCCL loads: the dlopen
//! [`client`] that drives a built plugin through its C ABI exactly as NCCL's proxy threads do
//! (used by the benchmark and by the plugin's conformance and reliability suites), the
//! benchmark `nccl-net-bench` and the info command `nccl-net-erdma-info`; and the [`loader`]
//! facts: which NCCL release loads which table, and what a library file exports.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod client;
pub mod loader;
