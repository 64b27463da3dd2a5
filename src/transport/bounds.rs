//! The numbers of NCCL's contract that every transport keeps: requests in flight, buffers per
//! receive, bytes per message, NICs per device, and the kinds of memory a device takes.

/// Largest `n` of a grouped receive (`maxRecvs`).
pub(crate) const MAX_RECVS: usize = 8;
/// Requests in flight per comm NCCL may rely on (`NCCL_NET_MAX_REQUESTS`).
pub(crate) const MAX_REQUESTS: usize = 32;
/// Sends in flight per send comm: one per entry of every in-flight grouped receive.
pub(crate) const MAX_SEND_REQUESTS: usize = MAX_REQUESTS * MAX_RECVS;
/// Largest message per request we advertise (`maxP2pBytes`): what `test` can report in an
/// `int`, rounded to 1 GiB as NCCL's shims do for older plugins.
pub(crate) const MAX_P2P_BYTES: usize = 1 << 30;
/// Most NICs (rails) one device spans: a virtual device of NCCL's v12 ABI.
pub(crate) const MAX_RAILS: usize = 8;

/// `NCCL_PTR_HOST`.
pub(crate) const PTR_HOST: i32 = 1;
/// `NCCL_PTR_CUDA`.
pub(crate) const PTR_CUDA: i32 = 2;
/// `NCCL_PTR_DMABUF`.
pub(crate) const PTR_DMABUF: i32 = 4;
