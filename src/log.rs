//! `tracing` -> NCCL logger bridge.
//!
//! NCCL hands `init` a C variadic `ncclDebugLogger_t`; `abi` wraps it in a [`Sink`] and
//! installs it here. Every event becomes one preformatted line, prefixed `NET/erdma`, passed
//! with the format string `"%s"` (message text is never used as a format). WARN/ERROR map to
//! `NCCL_LOG_WARN`, INFO to `NCCL_LOG_INFO` tagged `NCCL_INIT` (events with target [`INIT`]) or
//! `NCCL_NET`, DEBUG/TRACE to `NCCL_LOG_TRACE`. Before `init`, and in tests, lines go to
//! stderr, filtered by `NCCL_DEBUG` (WARN unless it says INFO or TRACE).

use std::{fmt::Write as _, sync::Arc};

use once_cell::sync::OnceCell;
use parking_lot::RwLock;
use tracing::{field::Field, Event, Level, Subscriber};
use tracing_subscriber::{layer::Context, prelude::*, Layer};

/// Target for INFO events that NCCL should file under its INIT subsystem.
pub(crate) const INIT: &str = "nccl_net_erdma::init";

/// Every line starts with this, as NCCL's own transports prefix theirs (`NET/IB`).
pub(crate) const PREFIX: &str = "NET/erdma";

/// NCCL log level of one line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LogLevel {
    /// `NCCL_LOG_WARN`.
    Warn,
    /// `NCCL_LOG_INFO`.
    Info,
    /// `NCCL_LOG_TRACE`.
    Trace,
}

/// NCCL subsystem of an INFO line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Subsys {
    /// `NCCL_INIT`.
    Init,
    /// `NCCL_NET`.
    Net,
}

/// One formatted line on its way to NCCL.
#[derive(Debug)]
pub(crate) struct LogLine<'a> {
    /// Level.
    pub(crate) level: LogLevel,
    /// Subsystem (meaningful for INFO).
    pub(crate) subsys: Subsys,
    /// Source file (NCCL prints it for WARN).
    pub(crate) file: &'a str,
    /// Module path (NCCL prints the function for TRACE).
    pub(crate) module: &'a str,
    /// Source line.
    pub(crate) line: u32,
    /// The complete message, prefix included.
    pub(crate) text: &'a str,
}

/// Where lines go once NCCL gave us a logger.
pub(crate) type Sink = Arc<dyn Fn(&LogLine<'_>) + Send + Sync>;

static SINK: RwLock<Option<Sink>> = RwLock::new(None);
static INSTALLED: OnceCell<()> = OnceCell::new();

/// Sends every later line to `sink` (NCCL's logger), replacing any earlier one.
pub(crate) fn set_sink(sink: Sink) {
    *SINK.write() = Some(sink);
}

/// Installs the bridge as this library's global `tracing` subscriber (once per process).
pub(crate) fn install() {
    INSTALLED.get_or_init(|| {
        let stderr_level = stderr_level(crate::config::nccl_debug().as_deref());
        let subscriber = tracing_subscriber::registry().with(NcclLayer { stderr_level });
        // Another subscriber can only exist if a host program linked this crate as an rlib
        // and set its own; then that one keeps receiving our events, which is fine.
        let _ = tracing::subscriber::set_global_default(subscriber);
    });
}

fn stderr_level(nccl_debug: Option<&str>) -> Level {
    match nccl_debug.map(str::to_ascii_uppercase).as_deref() {
        Some("TRACE") => Level::TRACE,
        Some("INFO") => Level::INFO,
        _ => Level::WARN,
    }
}

struct NcclLayer {
    stderr_level: Level,
}

#[derive(Default)]
struct LineVisitor {
    text: String,
}

impl tracing::field::Visit for LineVisitor {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.text.push_str(value);
        } else {
            let _ = write!(self.text, " {}={}", field.name(), value);
        }
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.text, "{value:?}");
        } else {
            let _ = write!(self.text, " {}={:?}", field.name(), value);
        }
    }
}

impl<S: Subscriber> Layer<S> for NcclLayer {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let meta = event.metadata();
        let mut visitor = LineVisitor {
            text: format!("{PREFIX} "),
        };
        event.record(&mut visitor);
        let level = match *meta.level() {
            Level::ERROR | Level::WARN => LogLevel::Warn,
            Level::INFO => LogLevel::Info,
            _ => LogLevel::Trace,
        };
        let subsys = if meta.target() == INIT {
            Subsys::Init
        } else {
            Subsys::Net
        };
        let line = LogLine {
            level,
            subsys,
            file: meta.file().unwrap_or("?"),
            module: meta.module_path().unwrap_or("?"),
            line: meta.line().unwrap_or(0),
            text: &visitor.text,
        };
        let sink = SINK.read().clone();
        match sink {
            Some(sink) => sink(&line),
            None if *meta.level() <= self.stderr_level => {
                let tag = match level {
                    LogLevel::Warn => "WARN",
                    LogLevel::Info => "INFO",
                    LogLevel::Trace => "TRACE",
                };
                eprintln!("{tag} {}", line.text);
            }
            None => {}
        }
    }
}

/// The WARN lines `f` logs on this thread (tests: the global sink sees every thread's).
#[cfg(test)]
pub(crate) fn warnings_of<R>(f: impl FnOnce() -> R) -> (R, Vec<String>) {
    struct Collect(Arc<parking_lot::Mutex<Vec<String>>>);
    impl<S: Subscriber> Layer<S> for Collect {
        fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
            if *event.metadata().level() <= Level::WARN {
                let mut visitor = LineVisitor::default();
                event.record(&mut visitor);
                self.0.lock().push(visitor.text);
            }
        }
    }
    let lines = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let subscriber = tracing_subscriber::registry().with(Collect(lines.clone()));
    let r = tracing::subscriber::with_default(subscriber, f);
    let lines = lines.lock().clone();
    (r, lines)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stderr_level_follows_nccl_debug() {
        assert_eq!(stderr_level(None), Level::WARN);
        assert_eq!(stderr_level(Some("info")), Level::INFO);
        assert_eq!(stderr_level(Some("TRACE")), Level::TRACE);
        assert_eq!(stderr_level(Some("VERSION")), Level::WARN);
    }
}
