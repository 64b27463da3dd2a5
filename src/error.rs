//! The plugin's one error type, and the one place that decides what NCCL is told of it.
//!
//! Every failure inside the plugin is an [`Error`]. Its [`ErrorKind`] follows NCCL's plugin
//! README ("Error codes"), and [`Error::code`] is the only mapping to `ncclResult_t`:
//!
//! | our error | kind | NCCL code | raised for |
//! |---|---|---|---|
//! | `Misuse` | `Internal` | `ncclInternalError` | NCCL broke the contract: a NULL pointer, a count or size out of range, an unknown device, memory handle, comm or request, a foreign or corrupted handle, a buffer outside its registration, a call before `init` |
//! | `Config` | `InvalidUsage` | `ncclInvalidUsage` | a setting with a value the plugin cannot use (`init` fails) |
//! | `Usage` | `InvalidUsage` | `ncclInvalidUsage` | a setup that cannot work as configured: transports or link layers that differ between peers, a fusion NCCL or the user asks for that cannot be made |
//! | `Truncated` | `InvalidUsage` | `ncclInvalidUsage` | a message larger than the receive posted for it (both sides) |
//! | `NoDevice` | `System` | `ncclSystemError` | no usable RDMA device or libibverbs (`init` fails and NCCL falls back to its own transports) |
//! | `Device` | `System` | `ncclSystemError` | a fatal asynchronous event on the device |
//! | `Os` | `System`, or `Remote` when the errno means the peer is gone (reset, refused, timed out, unreachable) | `ncclSystemError` / `ncclRemoteError` | a failed system or verbs call |
//! | `Remote` | `Remote` | `ncclRemoteError` | the peer failed: a failed completion, a closed or silent peer, work that never completes, a protocol error |
//!
//! `ncclInvalidArgument` is never returned: the README says plugins should usually not use
//! it, and every bad argument NCCL can pass is its misuse of the plugin. An error is shared
//! (`Clone` is a reference count), so a comm that failed returns its first error, with its
//! kind and message, on every later call.

use std::{io, sync::Arc};

use crate::ffi::ncclResult_t;

/// What NCCL is told (see the module's table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// Kernel, library or hardware failure (`ncclSystemError`).
    System,
    /// NCCL broke the plugin's contract (`ncclInternalError`).
    Internal,
    /// A user or configuration error (`ncclInvalidUsage`).
    InvalidUsage,
    /// The peer, or the path to it, failed (`ncclRemoteError`).
    Remote,
}

impl ErrorKind {
    /// NCCL's result code of this kind.
    pub fn code(self) -> ncclResult_t {
        match self {
            ErrorKind::System => ncclResult_t::ncclSystemError,
            ErrorKind::Internal => ncclResult_t::ncclInternalError,
            ErrorKind::InvalidUsage => ncclResult_t::ncclInvalidUsage,
            ErrorKind::Remote => ncclResult_t::ncclRemoteError,
        }
    }
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

/// A plugin failure: one pointer wide, and shared by every call that reports it.
#[derive(Debug, Clone, thiserror::Error)]
#[error(transparent)]
pub struct Error(Arc<ErrorDetail>);

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
    /// NCCL misused the plugin: a bad argument, a call out of order, an unknown object.
    #[error("{0}")]
    Misuse(String),
    /// The user's setup cannot work as configured.
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
        Error(Arc::new(detail))
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

    /// NCCL misused the plugin.
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

    /// The OS error's context, to add a hint to, while this error is not shared yet.
    pub fn os_context_mut(&mut self) -> Option<(&mut String, &io::Error)> {
        match Arc::get_mut(&mut self.0)? {
            ErrorDetail::Os(os) => Some((&mut os.context, &os.source)),
            _ => None,
        }
    }

    /// The class NCCL is told about.
    pub fn kind(&self) -> ErrorKind {
        use ErrorDetail as D;
        match self.detail() {
            D::Misuse(_) => ErrorKind::Internal,
            D::Config(_) | D::Usage(_) | D::Truncated(_) => ErrorKind::InvalidUsage,
            D::Os(e) if is_peer_loss(&e.source) => ErrorKind::Remote,
            D::Os(_) | D::NoDevice(_) | D::Device(_) => ErrorKind::System,
            D::Remote(_) => ErrorKind::Remote,
        }
    }

    /// NCCL's result code for this error.
    pub fn code(&self) -> ncclResult_t {
        self.kind().code()
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
    use ncclResult_t::*;

    #[test]
    fn every_error_maps_to_the_code_its_table_row_names() {
        let os = |k| Error::io("x", io::Error::from(k));
        for (e, want) in [
            (Error::misuse("x".into()), ncclInternalError),
            (
                Error::config("NCCL_IB_TIMEOUT", "99", "1 to 31"),
                ncclInvalidUsage,
            ),
            (Error::usage("x".into()), ncclInvalidUsage),
            (Error::truncated("x".into()), ncclInvalidUsage),
            (Error::no_device("x".into()), ncclSystemError),
            (Error::device("x".into()), ncclSystemError),
            (os(io::ErrorKind::PermissionDenied), ncclSystemError),
            (os(io::ErrorKind::ConnectionReset), ncclRemoteError),
            (os(io::ErrorKind::TimedOut), ncclRemoteError),
            (Error::remote("x".into()), ncclRemoteError),
        ] {
            assert_eq!(e.code(), want, "{e:?}");
            // Only the codes NCCL's plugin README gives plugins.
            assert!(matches!(
                e.code(),
                ncclSystemError | ncclInvalidUsage | ncclRemoteError | ncclInternalError
            ));
        }
    }

    #[test]
    fn an_error_keeps_its_message_and_code_when_shared() {
        let cfg = Error::config("NCCL_ERDMA_TRANSPORT", "foo", "verbs, tcp or auto");
        assert_eq!(
            cfg.to_string(),
            "NCCL_ERDMA_TRANSPORT=foo is not valid: verbs, tcp or auto"
        );
        let again = cfg.clone();
        assert_eq!(
            (again.code(), again.to_string()),
            (cfg.code(), cfg.to_string())
        );
        // One pointer: the data path's results stay small.
        assert_eq!(std::mem::size_of::<Error>(), 8);
        assert_eq!(std::mem::size_of::<Result<()>>(), 8);
    }

    #[test]
    fn a_hint_is_added_to_an_os_error_only_while_it_is_not_shared() {
        let mut e = Error::io("RTR", io::Error::from_raw_os_error(libc::EINVAL));
        let (context, source) = e.os_context_mut().unwrap();
        assert_eq!(source.raw_os_error(), Some(libc::EINVAL));
        context.push_str(" (hint)");
        assert!(e.to_string().starts_with("RTR (hint): "));
        let _shared = e.clone();
        assert!(e.os_context_mut().is_none());
        assert!(Error::remote("x".into()).os_context_mut().is_none());
    }
}
