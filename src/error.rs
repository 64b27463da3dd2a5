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

/// A setting with a value the plugin cannot use.
#[derive(Debug, thiserror::Error)]
#[error("{var}={value} is not valid: {accepted}")]
pub struct ConfigError {
    /// Environment variable name.
    pub var: &'static str,
    /// The value found.
    pub value: String,
    /// What would have been accepted.
    pub accepted: String,
}

/// A failed system or library call.
#[derive(Debug, thiserror::Error)]
#[error("{context}: {source}")]
pub struct OsError {
    /// What the plugin was doing.
    pub context: String,
    /// The OS error.
    #[source]
    pub source: io::Error,
}

/// A plugin failure: one pointer wide, so the `Result`s of the data path come back in
/// registers; what went wrong is in its [`ErrorDetail`].
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct Error(Box<ErrorDetail>);

/// What went wrong, with enough context for one useful WARN line.
#[derive(Debug, thiserror::Error)]
pub enum ErrorDetail {
    /// A setting has a value the plugin cannot use.
    #[error(transparent)]
    Config(ConfigError),
    /// A system call or library call failed.
    #[error(transparent)]
    Os(OsError),
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

impl From<ErrorDetail> for Error {
    #[cold]
    fn from(detail: ErrorDetail) -> Self {
        Error(Box::new(detail))
    }
}

impl Error {
    /// A setting has a value the plugin cannot use.
    #[cold]
    pub fn config(var: &'static str, value: &str, accepted: impl Into<String>) -> Self {
        ErrorDetail::Config(ConfigError {
            var,
            value: value.to_string(),
            accepted: accepted.into(),
        })
        .into()
    }

    /// A failed system or library call, from the last OS error.
    #[cold]
    pub fn last_os(context: impl Into<String>) -> Self {
        Self::io(context, io::Error::last_os_error())
    }

    /// A failed system or library call, from an I/O error.
    #[cold]
    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        ErrorDetail::Os(OsError {
            context: context.into(),
            source,
        })
        .into()
    }

    /// No usable network device.
    #[cold]
    pub fn no_device(msg: String) -> Self {
        ErrorDetail::NoDevice(msg).into()
    }

    /// The caller passed something the API does not allow.
    #[cold]
    pub fn invalid_argument(msg: String) -> Self {
        ErrorDetail::InvalidArgument(msg).into()
    }

    /// The caller misused the plugin.
    #[cold]
    pub fn misuse(msg: String) -> Self {
        ErrorDetail::Misuse(msg).into()
    }

    /// The user's setup cannot work as configured.
    #[cold]
    pub fn usage(msg: String) -> Self {
        ErrorDetail::Usage(msg).into()
    }

    /// The device or a queue pair failed.
    #[cold]
    pub fn device(msg: String) -> Self {
        ErrorDetail::Device(msg).into()
    }

    /// A message was larger than the receive posted for it.
    #[cold]
    pub fn truncated(msg: String) -> Self {
        ErrorDetail::Truncated(msg).into()
    }

    /// The peer sent something invalid, or the connection to it failed.
    #[cold]
    pub fn remote(msg: String) -> Self {
        ErrorDetail::Remote(msg).into()
    }

    /// What went wrong.
    pub fn detail(&self) -> &ErrorDetail {
        &self.0
    }

    /// What went wrong, to be changed (e.g. a hint added to an OS error's context).
    pub fn detail_mut(&mut self) -> &mut ErrorDetail {
        &mut self.0
    }

    /// The class NCCL is told about.
    pub fn kind(&self) -> ErrorKind {
        use ErrorDetail as D;
        match self.detail() {
            D::Config(_) | D::Usage(_) | D::Truncated(_) => ErrorKind::InvalidUsage,
            D::Os(e) if is_peer_loss(&e.source) => ErrorKind::Remote,
            D::Os(_) | D::NoDevice(_) | D::Device(_) => ErrorKind::System,
            D::InvalidArgument(_) => ErrorKind::InvalidArgument,
            D::Misuse(_) => ErrorKind::Internal,
            D::Remote(_) => ErrorKind::Remote,
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
        let cfg = Error::config("NCCL_ERDMA_TRANSPORT", "foo", "verbs, tcp or auto");
        assert_eq!(cfg.kind(), ErrorKind::InvalidUsage);
        assert_eq!(
            cfg.to_string(),
            "NCCL_ERDMA_TRANSPORT=foo is not valid: verbs, tcp or auto"
        );
        let reset = Error::io("recv", io::Error::from(io::ErrorKind::ConnectionReset));
        assert_eq!(reset.kind(), ErrorKind::Remote);
        let perm = Error::io("bind", io::Error::from(io::ErrorKind::PermissionDenied));
        assert_eq!(perm.kind(), ErrorKind::System);
        assert_eq!(Error::misuse("x".into()).kind(), ErrorKind::Internal);
        // Results stay small on the data path: an error is one pointer, and a result of a
        // word comes back in two registers.
        assert_eq!(std::mem::size_of::<Error>(), 8);
        assert_eq!(std::mem::size_of::<Result<()>>(), 8);
        assert_eq!(std::mem::size_of::<Result<Option<usize>>>(), 16);
    }
}
