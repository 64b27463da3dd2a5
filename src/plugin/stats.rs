//! Traffic statistics per comm and per device, without a background thread.
//!
//! The transport counts the messages and bytes a comm's `test` reports done (under the
//! lock that `test` holds anyway); the plugin counts waits and errors in relaxed atomics of
//! the comm (one writer, so no contention). With `NCCL_ERDMA_STATS_INTERVAL=<s>` a comm
//! logs a rate line through NCCL's logger, like `eadm stat`, from its own `test` calls that
//! finish or fail a request once the interval has passed (the clock is read every 64 such
//! calls only; the proxy's idle polls never read it); every comm logs a summary when it
//! closes, and adds its counts to its device's totals.

use std::{
    sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed},
    time::{Duration, Instant},
};

use parking_lot::Mutex;

use crate::transport::{Endpoint, Tested, Traffic};

/// Totals of one device over all its closed comms (and reported intervals).
#[derive(Debug, Default)]
pub(crate) struct DeviceTotals {
    /// Bytes sent.
    pub(crate) tx_bytes: AtomicU64,
    /// Messages sent.
    pub(crate) tx_msgs: AtomicU64,
    /// Bytes received.
    pub(crate) rx_bytes: AtomicU64,
    /// Messages received.
    pub(crate) rx_msgs: AtomicU64,
    /// Errors returned.
    pub(crate) errors: AtomicU64,
}

/// Direction of a comm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    /// A send comm.
    Tx,
    /// A receive comm.
    Rx,
}

/// Counters of one comm.
#[derive(Debug)]
pub(crate) struct CommStats {
    dir: Direction,
    label: String,
    interval: Option<Duration>,
    waits: AtomicU64,
    errors: AtomicU64,
    calls: AtomicU32,
    /// Time and counts of the last rate line, and what was already added to the device.
    last: Mutex<(Instant, u64, u64)>,
    credited: Mutex<(u64, u64, u64)>,
}

impl CommStats {
    /// Counters for a comm called `label` (device and peer).
    pub(crate) fn new(dir: Direction, label: String, interval_s: u64) -> Self {
        CommStats {
            dir,
            label,
            interval: (interval_s > 0).then(|| Duration::from_secs(interval_s)),
            waits: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            calls: AtomicU32::new(0),
            last: Mutex::new((Instant::now(), 0, 0)),
            credited: Mutex::new((0, 0, 0)),
        }
    }

    /// After a `test` of the comm over `end` found `r`: counts a failure, and logs a rate
    /// line when one is due, with what `end` tells; the proxy's idle polls (a request not
    /// done) count nothing and never log.
    #[inline(always)]
    pub(crate) fn tested<'d>(
        &self,
        r: &Tested,
        device: impl FnOnce() -> &'d DeviceTotals,
        end: &impl Endpoint,
    ) {
        match r {
            Tested::Pending => return,
            Tested::Done(_) => {}
            Tested::Failed(_) => self.failed(),
        }
        if let Some(interval) = self.interval {
            self.tick_every(interval, device(), end);
        }
    }

    /// A send had to wait for the receiver's clear-to-send.
    pub(crate) fn waited(&self) {
        self.waits.fetch_add(1, Relaxed);
    }

    /// A call returned an error.
    pub(crate) fn failed(&self) {
        self.errors.fetch_add(1, Relaxed);
    }

    fn name(&self) -> &'static str {
        match self.dir {
            Direction::Tx => "tx",
            Direction::Rx => "rx",
        }
    }

    /// Logs a rate line when the interval has passed (checked every 64 calls that count).
    #[inline(never)]
    fn tick_every(&self, interval: Duration, device: &DeviceTotals, end: &impl Endpoint) {
        if self.calls.fetch_add(1, Relaxed) % 64 != 0 {
            return;
        }
        let Some(mut last) = self.last.try_lock() else {
            return;
        };
        let elapsed = last.0.elapsed();
        if elapsed < interval {
            return;
        }
        let now = end.traffic();
        let (msgs, bytes) = (now.messages, now.bytes);
        let secs = elapsed.as_secs_f64();
        tracing::info!(
            "stats {} {}: {:.3} MB/s {:.0} msg/s (total {} bytes in {} messages, {} clear-to-send \
             waits{}, {} errors)",
            self.name(),
            self.label,
            (bytes - last.2) as f64 / secs / 1e6,
            (msgs - last.1) as f64 / secs,
            bytes,
            msgs,
            self.waits.load(Relaxed),
            end.summary(),
            self.errors.load(Relaxed)
        );
        *last = (Instant::now(), msgs, bytes);
        drop(last);
        self.credit(device, now);
    }

    /// Adds what is new in `traffic` (the comm's so far) and the errors since the last credit
    /// to the device's totals.
    fn credit(&self, device: &DeviceTotals, traffic: Traffic) {
        let mut c = self.credited.lock();
        let now = (traffic.messages, traffic.bytes, self.errors.load(Relaxed));
        let (msgs, bytes) = match self.dir {
            Direction::Tx => (&device.tx_msgs, &device.tx_bytes),
            Direction::Rx => (&device.rx_msgs, &device.rx_bytes),
        };
        msgs.fetch_add(now.0 - c.0, Relaxed);
        bytes.fetch_add(now.1 - c.1, Relaxed);
        device.errors.fetch_add(now.2 - c.2, Relaxed);
        *c = now;
    }

    /// Logs the comm's summary (with what its end `end` tells) and credits its device;
    /// called when the comm closes.
    pub(crate) fn close(&self, device: &DeviceTotals, end: &impl Endpoint) {
        let traffic = end.traffic();
        self.credit(device, traffic);
        let (msgs, errors) = (traffic.messages, self.errors.load(Relaxed));
        if msgs == 0 && errors == 0 {
            return;
        }
        let detail = end.summary();
        tracing::info!(
            "closed {} comm {}: {} bytes in {} messages, {} clear-to-send waits{detail}, {} \
             errors; device totals: tx {} bytes / {} messages, rx {} bytes / {} messages",
            self.name(),
            self.label,
            traffic.bytes,
            msgs,
            self.waits.load(Relaxed),
            errors,
            device.tx_bytes.load(Relaxed),
            device.tx_msgs.load(Relaxed),
            device.rx_bytes.load(Relaxed),
            device.rx_msgs.load(Relaxed)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An end that has moved what it holds.
    struct Moved(Traffic);

    impl Endpoint for Moved {
        fn peer(&self) -> String {
            "peer".into()
        }

        fn traffic(&self) -> Traffic {
            self.0
        }
    }

    #[test]
    fn device_totals_get_each_byte_once() {
        let dev = DeviceTotals::default();
        let s = CommStats::new(Direction::Tx, "x".into(), 0);
        s.credit(
            &dev,
            Traffic {
                messages: 2,
                bytes: 300,
            },
        );
        s.failed();
        s.close(
            &dev,
            &Moved(Traffic {
                messages: 3,
                bytes: 305,
            }),
        );
        assert_eq!(dev.tx_msgs.load(Relaxed), 3);
        assert_eq!(dev.tx_bytes.load(Relaxed), 305);
        assert_eq!(dev.errors.load(Relaxed), 1);
        assert_eq!(dev.rx_bytes.load(Relaxed), 0);
    }
}
