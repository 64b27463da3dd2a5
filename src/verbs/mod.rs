//! libibverbs, loaded with `dlopen` so the plugin loads on any host, and the only place that
//! calls `ibv_*`.
//!
//! [`VerbsLib`] (`library`) resolves the exported functions by symbol version (`IBVERBS_1.1`, optional
//! ones by their own versions, turned into capability flags), exactly as NCCL does; rdma-sys
//! supplies the types and the inline data-path helpers, which go through the provider's ops
//! table (each slot checked before the call). [`resources`] wraps contexts, PDs, CQs and MRs
//! in RAII types, [`qp`] the QPs, [`device`] finds and describes devices.

pub(crate) mod device;
pub(crate) mod dma;
#[cfg(test)]
pub(crate) mod fake;
mod library;
pub(crate) mod limits;
pub(crate) mod nic;
pub(crate) mod qp;
pub(crate) mod resources;
pub(crate) mod swap;

pub(crate) use library::VerbsLib;
