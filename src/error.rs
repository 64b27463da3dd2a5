//! The plugin's one error type. Every failure inside the plugin is an [`Error`]; the C
//! boundary (`abi`) turns it into an `ncclResult_t` with [`Error::kind`] and logs it once.

use std::io;

/// What NCCL is told. Mirrors the guidance of NCCL's plugin README: system failures,
/// misuse by the caller, user configuration errors, and peer failures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// Kernel, library or hardware failure (`ncclSystemError`).
    System,
    /// The caller broke the API contract (`ncclInternalError`).
    Internal,
    /// A bad argument value such as a NULL pointer or an out-of-range count
    /// (`ncclInvalidArgument`).
    InvalidArgument,
    /// A user or configuration error (`ncclInvalidUsage`).
    InvalidUsage,
    /// The peer failed or went away (`ncclRemoteError`).
    Remote,
}

/// A plugin failure, with enough context for one useful WARN line.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A setting has a value the plugin cannot use.
    #[error("{var}={value} is not valid: {accepted}")]
    Config {
        /// Environment variable name.
        var: &'static str,
        /// The value found.
        value: String,
        /// What would have been accepted.
        accepted: String,
    },
    /// A system call or library call failed.
    #[error("{context}: {source}")]
    Os {
        /// What the plugin was doing.
        context: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// No usable network device for the selected transport.
    #[error("{0}")]
    NoDevice(String),
    /// The caller passed something the API does not allow.
    #[error("{0}")]
    InvalidArgument(String),
    /// The caller misused the plugin (a call out of order, an unknown object).
    #[error("{0}")]
    Misuse(String),
    /// The user's setup cannot work as configured (mismatched settings between peers, an
    /// unsupported memory type for the transport).
    #[error("{0}")]
    Usage(String),
    /// The device or a queue pair failed (a fatal asynchronous event).
    #[error("{0}")]
    Device(String),
    /// A message was larger than the receive posted for it.
    #[error("{0}")]
    Truncated(String),
    /// The peer sent something invalid, or the connection to it failed.
    #[error("{0}")]
    Remote(String),
}

impl Error {
    /// Builds an [`Error::Os`] from the last OS error.
    pub fn last_os(context: impl Into<String>) -> Self {
        Error::Os {
            context: context.into(),
            source: io::Error::last_os_error(),
        }
    }

    /// Builds an [`Error::Os`] from an I/O error.
    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        Error::Os {
            context: context.into(),
            source,
        }
    }

    /// The class NCCL is told about.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Config { .. } | Error::Usage(_) | Error::Truncated(_) => ErrorKind::InvalidUsage,
            Error::Os { source, .. } if is_peer_loss(source) => ErrorKind::Remote,
            Error::Os { .. } | Error::NoDevice(_) | Error::Device(_) => ErrorKind::System,
            Error::InvalidArgument(_) => ErrorKind::InvalidArgument,
            Error::Misuse(_) => ErrorKind::Internal,
            Error::Remote(_) => ErrorKind::Remote,
        }
    }
}

/// Errors that mean the other end is gone, not that this host is broken.
fn is_peer_loss(e: &io::Error) -> bool {
    use io::ErrorKind as K;
    matches!(
        e.kind(),
        K::ConnectionRefused
            | K::ConnectionReset
            | K::ConnectionAborted
            | K::BrokenPipe
            | K::UnexpectedEof
            | K::TimedOut
            | K::HostUnreachable
            | K::NetworkUnreachable
    )
}

/// The plugin's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_follow_nccl_guidance() {
        let cfg = Error::Config {
            var: "NCCL_ERDMA_TRANSPORT",
            value: "foo".into(),
            accepted: "verbs, tcp or auto".into(),
        };
        assert_eq!(cfg.kind(), ErrorKind::InvalidUsage);
        assert_eq!(
            cfg.to_string(),
            "NCCL_ERDMA_TRANSPORT=foo is not valid: verbs, tcp or auto"
        );
        let reset = Error::io("recv", io::Error::from(io::ErrorKind::ConnectionReset));
        assert_eq!(reset.kind(), ErrorKind::Remote);
        let perm = Error::io("bind", io::Error::from(io::ErrorKind::PermissionDenied));
        assert_eq!(perm.kind(), ErrorKind::System);
        assert_eq!(Error::Misuse("x".into()).kind(), ErrorKind::Internal);
    }
}
