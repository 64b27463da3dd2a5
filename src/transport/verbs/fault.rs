//! What breaks a connection's rail, or the connection, as a value: made where it is seen (a
//! failed completion with its named status, a probe unanswered, work stalled, a fatal device
//! event, a device call that failed, a QP that could not be brought up towards the peer, the
//! peer's process gone or its host silent, a peer that broke the protocol), carried up as such, and judged in one place ([`Fault::movable`]):
//! whether moving the connection to another NIC can mend it. The error NCCL is given is made
//! with the fault, once, where the facts for its message are at hand.

use crate::error::Error;
use crate::verbs::dma::WcStatus;

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cause {
    /// A work request completed with this status.
    Completion(WcStatus),
    /// A path's liveness probe went unanswered for its bound.
    Unanswered,
    /// Posted work made no progress for its bound while its paths answered.
    Stalled,
    /// A fatal asynchronous event on the device or one of the connection's QPs.
    FatalEvent,
    /// A verbs call on the device failed (a poll, a post, a QP or CQ made in a move).
    Device,
    /// A QP could not be brought up towards the peer's (setup's or a move's join): the NIC's
    /// link is down, or it has no route to the peer.
    Unreachable,
    /// The peer's process closed the bootstrap connection (it exited or closed the comm).
    PeerGone,
    /// The peer's host stopped answering (keepalive).
    PeerSilent,
    /// The peer sent what the protocol does not allow, or refused a move.
    Protocol,
}

/// A fault, on rail `rail` of the connection where it belongs to one. Boxed: the data path
/// passes `Result<_, Fault>` along, as small as a `Result<_, Error>`.
#[derive(Debug, Clone)]
pub(crate) struct Fault(Box<What>);

/// What a [`Fault`] holds.
#[derive(Debug, Clone)]
pub(crate) struct What {
    pub(crate) rail: Option<usize>,
    pub(crate) cause: Cause,
    /// What NCCL is told, should the fault end the comm.
    pub(crate) error: Error,
}

impl std::ops::Deref for Fault {
    type Target = What;

    fn deref(&self) -> &What {
        &self.0
    }
}

impl Fault {
    /// A fault of the connection as a whole.
    #[cold]
    pub(crate) fn new(cause: Cause, error: Error) -> Self {
        Fault(Box::new(What {
            rail: None,
            cause,
            error,
        }))
    }

    /// The peer's description or message cannot be joined or read (`error` says why).
    #[cold]
    pub(crate) fn protocol(error: Error) -> Self {
        Fault::new(Cause::Protocol, error)
    }

    /// The fault, as one of rail `r`.
    pub(crate) fn on_rail(mut self, r: usize) -> Self {
        self.0.rail = Some(r);
        self
    }

    /// The error NCCL is told.
    pub(crate) fn into_error(self) -> Error {
        self.0.error
    }

    /// Whether moving the connection to other NICs can mend it: the path or the NIC failed
    /// (as NCCL's IB resiliency judges a completion: its retries ran out, or the QP was
    /// flushed; Soft-RoCE reports a link gone down as a local QP operation error). A request
    /// of ours the peer or the device found wrong would be wrong on any NIC, and a peer
    /// that left is left.
    pub(crate) fn movable(&self) -> bool {
        use WcStatus::*;
        match self.cause {
            Cause::Completion(status) => matches!(
                status,
                RetryExceeded | Flushed | LocalQpOperation | Fatal | ResponseTimeout
            ),
            // Another NIC may reach the peer; each NIC is lost once per comm, so a join that
            // fails everywhere ends with no NIC left.
            Cause::Unanswered | Cause::FatalEvent | Cause::Unreachable => true,
            Cause::Stalled
            | Cause::Device
            | Cause::PeerGone
            | Cause::PeerSilent
            | Cause::Protocol => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_failed_path_or_nic_is_moved_off() {
        let f = |cause| Fault::new(cause, Error::remote("x".into()));
        for s in [
            WcStatus::RetryExceeded,
            WcStatus::Flushed,
            WcStatus::LocalQpOperation,
        ] {
            assert!(f(Cause::Completion(s)).movable(), "{s:?}");
        }
        for s in [
            WcStatus::RemoteAccess,
            WcStatus::RemoteInvalidRequest,
            WcStatus::LocalProtection,
            WcStatus::ReceiverNotReadyRetryExceeded,
            WcStatus::Other(99),
        ] {
            assert!(!f(Cause::Completion(s)).movable(), "{s:?}");
        }
        assert!(f(Cause::Unanswered).movable() && f(Cause::FatalEvent).movable());
        assert!(f(Cause::Unreachable).movable());
        assert!(!f(Cause::Stalled).movable() && !f(Cause::PeerGone).movable());
        assert_eq!(f(Cause::Device).on_rail(2).rail, Some(2));
    }
}
