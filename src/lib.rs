//! nccl-net-erdma: an NCCL network plugin (`ncclNet` v6 to v11) for Alibaba Cloud eRDMA and
//! any RoCE/IB verbs device, with a TCP transport for hosts without RDMA.
//!
//! Layers, top to bottom (nothing reaches up): [`abi`] (the C boundary: exported tables,
//! panic boundary, error mapping), [`plugin`] (the version-neutral core), [`transport`]
//! (tcp now, verbs next), [`oob`] (the out-of-band bootstrap), [`verbs`] (the only caller of
//! `ibv_*`), [`config`] and [`log`]. `unsafe` lives only in `abi` and `verbs`.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod abi;
pub mod config;
pub mod diag;
pub mod error;
pub mod log;
pub mod oob;
pub mod plugin;
pub mod transport;
pub mod verbs;
