//! Transports behind the version-neutral core: `tcp` (sockets, for hosts without RDMA and
//! for tests) and `verbs`. Both honour the same request contract, defined here.

pub mod tcp;
pub mod verbs;

use crate::error::{Error, Result};

/// Largest `n` of a grouped receive (`maxRecvs`).
pub const MAX_RECVS: usize = 8;
/// Requests in flight per comm NCCL may rely on (`NCCL_NET_MAX_REQUESTS`).
pub const MAX_REQUESTS: usize = 32;
/// Sends in flight per send comm: one per entry of every in-flight grouped receive.
pub const MAX_SEND_REQUESTS: usize = MAX_REQUESTS * MAX_RECVS;

/// The error for `test` on request `id` (a `what`: send, receive, flush) that is not in
/// flight: never posted, or already reported done.
#[cold]
pub(crate) fn not_in_flight(what: &str, id: usize) -> Error {
    Error::Misuse(format!(
        "test on {what} request {id}, which is not in flight"
    ))
}

/// What `test` reports for a finished request: the size of each of its `n` messages. Sizes
/// fit in 32 bits (`maxP2pBytes` is 1 GiB), which keeps the data path's results small.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// Number of messages (1 for a send, `n` for a grouped receive, 0 for a flush).
    pub n: usize,
    /// Received (or sent) size of each message.
    pub sizes: [u32; MAX_RECVS],
}

impl Completion {
    /// A completion of one message of `size` bytes.
    pub fn single(size: usize) -> Self {
        let mut sizes = [0; MAX_RECVS];
        sizes[0] = size as u32;
        Completion { n: 1, sizes }
    }

    /// A completion with no message (a flush).
    pub const EMPTY: Completion = Completion {
        n: 0,
        sizes: [0; MAX_RECVS],
    };

    /// Total bytes of the messages.
    pub fn bytes(&self) -> u64 {
        self.sizes[..self.n].iter().map(|s| u64::from(*s)).sum()
    }
}

/// A sticky connection failure: once set, every call that needs the peer returns it.
#[derive(Debug, Default)]
pub(crate) struct Failure(pub(crate) Option<String>);

impl Failure {
    pub(crate) fn set(&mut self, msg: String) {
        if self.0.is_none() {
            tracing::warn!("{msg}");
            self.0 = Some(msg);
        }
    }
    /// Passes `r` through, remembering its error as the comm's failure.
    #[inline]
    pub(crate) fn record<T>(&mut self, r: Result<T>) -> Result<T> {
        if let Err(e) = &r {
            self.note(e);
        }
        r
    }

    /// Remembers `e` as the comm's failure.
    #[cold]
    pub(crate) fn note(&mut self, e: &Error) {
        self.set(e.to_string());
    }
    #[inline]
    pub(crate) fn check(&self) -> Result<()> {
        match &self.0 {
            Some(m) => Err(Self::error(m)),
            None => Ok(()),
        }
    }

    #[cold]
    fn error(m: &str) -> Error {
        Error::Remote(m.to_string())
    }
}
