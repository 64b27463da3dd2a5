//! What a verbs device changes in the settings, decided in one place ([`tuning`]): where the
//! user set nothing, eRDMA gets Alibaba Cloud's preset of 8 QPs per connection, and a
//! software device (Soft-RoCE, Soft-iWARP) batches clear-to-sends. And the parameters each
//! connection is made with ([`ConnParams`], built by [`conn_params`]).

use std::time::Duration;

use super::budget::SENDER_SEND_DEPTH;
use crate::config::{Config, Setting};
use crate::oob::Timeouts;
use crate::verbs::device::{DeviceClass, VerbsDevice};

/// What a connection is set up with (settings, resolved per device).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConnParams {
    /// `NCCL_IB_QPS_PER_CONNECTION`, per rail (the connector's is used).
    pub(crate) qps_per_connection: u32,
    /// `NCCL_IB_SPLIT_DATA_ON_QPS` (the receiver's is used).
    pub(crate) split_data: bool,
    /// `NCCL_IB_TIMEOUT`.
    pub(crate) timeout: u8,
    /// `NCCL_IB_RETRY_CNT`.
    pub(crate) retry_cnt: u8,
    /// `NCCL_IB_TC` (or the communicator's traffic class), 0 when unset.
    pub(crate) traffic_class: u8,
    /// `NCCL_IB_SL`, 0 when unset.
    pub(crate) sl: u8,
    /// Create the loopback flush QPs (GPUDirect in use, or forced).
    pub(crate) flush: bool,
    /// Bounds on reaching the peer's listener and on a silent peer.
    pub(crate) timeouts: Timeouts,
    /// `NCCL_ERDMA_CTS_BATCH`: clear-to-send entries the receiver may hold back.
    pub(crate) cts_batch: u32,
    /// `NCCL_ERDMA_WORK_TIMEOUT_S`: posted work without completion for this long fails the
    /// comm (None: never).
    pub(crate) work_timeout: Option<Duration>,
    /// `NCCL_IB_WQE_LATENCY_THRESHOLD_NS` (None: 0, off) and `NCCL_IB_WQE_LATENCY_REPORT`.
    pub(crate) wqe_latency: Option<(Duration, bool)>,
    /// The send queue depth of a sender's QPs ([`SENDER_SEND_DEPTH`]; tests make it small): a
    /// send that does not fit waits for room ("not now").
    pub(crate) send_depth: u32,
    /// `NCCL_ERDMA_FAILOVER` in effect for this connection (another NIC can carry it): how
    /// long a path's probe may go unanswered before the connection moves; None: off.
    pub(crate) failover: Option<Duration>,
    /// With failover, `NCCL_ERDMA_FAILBACK_AFTER_MS`: how long a lost NIC must stay usable to
    /// count as healed (doubled per loss); `NCCL_ERDMA_FAILBACK`: whether a connection then
    /// moves back to its own NICs.
    pub(crate) failback: (Duration, bool),
}

/// The device's retransmission timer at `NCCL_IB_TIMEOUT` = `ib_timeout`: `4.096 us *
/// 2^timeout`, how long a QP waits for an acknowledgement before it sends again.
pub(crate) fn retransmit_timer(ib_timeout: u8) -> Duration {
    Duration::from_secs_f64(4.096e-6 * 2f64.powi(i32::from(ib_timeout)))
}

/// How long a probe may go unanswered at least: eight retransmission timers, so that a probe
/// whose packets a lossy link drops a few times still comes back in time (the work timeout,
/// where longer, bounds it otherwise).
pub(crate) fn probe_floor(ib_timeout: u8) -> Duration {
    8 * retransmit_timer(ib_timeout)
}

/// QPs per connection on eRDMA when the user set none: Alibaba's published preset for NCCL
/// on eRDMA (PAI "eRDMA" guide: `NCCL_IB_QPS_PER_CONNECTION=8`).
pub(crate) const ERDMA_DEFAULT_QPS: u32 = 8;
/// `NCCL_ERDMA_CTS_BATCH` when unset, on a software RDMA device. On such a device every post
/// is a system call that runs the whole packet path before it returns, so one write
/// announcing several receives takes most clear-to-sends out of a round trip (8-byte
/// ping-pong on Soft-RoCE: ~2.1x -> ~1.2x ib_write_lat). On hardware a post is a doorbell
/// and the clear-to-send is off the critical path, while holding entries back could leave
/// the sender waiting: 1, as NCCL's IB transport does.
pub(crate) const CTS_BATCH_SOFTWARE: u32 = 8;

/// A value in effect and where it came from, for the log and the info command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Resolved<T> {
    pub(crate) value: T,
    pub(crate) source: &'static str,
}

/// The device-dependent settings of one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tuning {
    /// `NCCL_IB_QPS_PER_CONNECTION`.
    pub(crate) qps_per_connection: Resolved<u32>,
    /// `NCCL_ERDMA_CTS_BATCH`.
    pub(crate) cts_batch: Resolved<u32>,
}

/// The settings a device of `class` changes where the user set nothing.
pub(crate) fn tuning(config: &Config, class: DeviceClass) -> Tuning {
    /// `setting`'s value from the environment, else the device's `(value, why)`.
    fn pick(setting: &Setting<Option<u32>>, device: (u32, &'static str)) -> Resolved<u32> {
        match setting.value {
            Some(value) => Resolved {
                value,
                source: setting.source(),
            },
            None => Resolved {
                value: device.0,
                source: device.1,
            },
        }
    }
    let qps = match class {
        DeviceClass::Erdma => (ERDMA_DEFAULT_QPS, "eRDMA preset"),
        DeviceClass::Software | DeviceClass::Hardware => (1, "default"),
    };
    let batch = match class {
        DeviceClass::Software => (CTS_BATCH_SOFTWARE, "software device"),
        DeviceClass::Erdma | DeviceClass::Hardware => (1, "hardware device"),
    };
    Tuning {
        qps_per_connection: pick(&config.qps_per_connection, qps),
        cts_batch: pick(&config.cts_batch, batch),
    }
}

/// How long posted work may go without a completion before the comm fails:
/// `NCCL_ERDMA_WORK_TIMEOUT_S`, or by default twice the longest a device following
/// `NCCL_IB_TIMEOUT`/`NCCL_IB_RETRY_CNT` takes to report a dead path itself
/// (`(retry_cnt + 1) * 4.096 us * 2^timeout`), and at least 60 s. So the device's own error
/// comes first wherever the device bounds its retries, and a healthy job never trips it.
pub(crate) fn work_timeout(config: &Config) -> Option<Duration> {
    match config.work_timeout_s.value {
        Some(0) => None,
        Some(s) => Some(Duration::from_secs(s)),
        None => {
            let device =
                retransmit_timer(config.ib_timeout.value as u8) * (config.ib_retry_cnt.value + 1);
            Some((2 * device).max(Duration::from_secs(60)))
        }
    }
}

/// The parameters of a connection on `dev`; `traffic_class` is the communicator's (v10+),
/// used when `NCCL_IB_TC` is unset.
pub(crate) fn conn_params(
    config: &Config,
    dev: &VerbsDevice,
    traffic_class: Option<i32>,
) -> ConnParams {
    let c = config;
    let tc = if c.ib_tc.value >= 0 {
        c.ib_tc.value
    } else {
        traffic_class.filter(|t| *t >= 0).unwrap_or(0)
    };
    let sl = c.ib_sl.value.max(0);
    let peer = c.peer_timeout_s.value;
    let t = tuning(config, dev.class());
    ConnParams {
        qps_per_connection: t.qps_per_connection.value,
        split_data: c.split_data_on_qps.value,
        timeout: c.ib_timeout.value as u8,
        retry_cnt: c.ib_retry_cnt.value as u8,
        traffic_class: tc.clamp(0, 255) as u8,
        sl: sl.clamp(0, 15) as u8,
        flush: c.force_flush.value || dev.peermem || dev.dmabuf,
        timeouts: Timeouts {
            connect: Duration::from_millis(c.connect_timeout_ms.value),
            peer: (peer > 0).then(|| Duration::from_secs(peer)),
        },
        cts_batch: t.cts_batch.value,
        work_timeout: work_timeout(config),
        wqe_latency: (c.wqe_latency_threshold_ns.value > 0).then(|| {
            (
                Duration::from_nanos(c.wqe_latency_threshold_ns.value),
                c.wqe_latency_report.value,
            )
        }),
        send_depth: SENDER_SEND_DEPTH,
        // Set by the transport where another NIC can carry the connection.
        failover: None,
        failback: (
            Duration::from_millis(c.failback_after_ms.value),
            c.failback.value,
        ),
    }
}

/// How long a path's probe may go unanswered, with failover, before the connection moves:
/// `NCCL_ERDMA_FAILOVER_AFTER_MS`, and at least two of the device's retransmission timers
/// (`4.096 us * 2^NCCL_IB_TIMEOUT`), so that a probe lost once is sent again in time.
pub(crate) fn failover_after(config: &Config) -> Duration {
    Duration::from_millis(config.failover_after_ms.value)
        .max(2 * retransmit_timer(config.ib_timeout.value as u8))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(pairs: &[(&str, &str)]) -> Config {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(|k| map.get(k).cloned()).unwrap()
    }

    #[test]
    fn device_defaults_apply_only_where_the_user_set_nothing() {
        let t = tuning(&cfg(&[]), DeviceClass::Erdma);
        assert_eq!(
            (t.qps_per_connection.value, t.qps_per_connection.source),
            (8, "eRDMA preset")
        );
        assert_eq!(
            (t.cts_batch.value, t.cts_batch.source),
            (1, "hardware device")
        );
        let t = tuning(&cfg(&[]), DeviceClass::Software);
        assert_eq!(
            (t.qps_per_connection.value, t.qps_per_connection.source),
            (1, "default")
        );
        assert_eq!(
            (t.cts_batch.value, t.cts_batch.source),
            (8, "software device")
        );
        let set = cfg(&[
            ("NCCL_IB_QPS_PER_CONNECTION", "2"),
            ("NCCL_ERDMA_CTS_BATCH", "4"),
        ]);
        for class in [
            DeviceClass::Erdma,
            DeviceClass::Software,
            DeviceClass::Hardware,
        ] {
            let t = tuning(&set, class);
            assert_eq!(
                (t.qps_per_connection.value, t.qps_per_connection.source),
                (2, "env")
            );
            assert_eq!((t.cts_batch.value, t.cts_batch.source), (4, "env"));
        }
    }

    #[test]
    fn work_timeout_follows_the_ib_retry_bound_with_a_floor() {
        // 4.096 us * 2^20 = 4.29 s per try, 8 tries, twice over.
        let t20 = retransmit_timer(20);
        assert!(t20 > Duration::from_millis(4294) && t20 < Duration::from_millis(4295));
        assert_eq!(work_timeout(&cfg(&[])), Some(2 * 8 * t20));
        let short = cfg(&[("NCCL_IB_TIMEOUT", "14")]);
        assert_eq!(work_timeout(&short), Some(Duration::from_secs(60)));
        let long = cfg(&[("NCCL_IB_TIMEOUT", "22"), ("NCCL_IB_RETRY_CNT", "3")]);
        assert_eq!(work_timeout(&long), Some(2 * 4 * retransmit_timer(22)));
        assert_eq!(
            work_timeout(&cfg(&[("NCCL_ERDMA_WORK_TIMEOUT_S", "7")])),
            Some(Duration::from_secs(7))
        );
        assert_eq!(
            work_timeout(&cfg(&[("NCCL_ERDMA_WORK_TIMEOUT_S", "0")])),
            None
        );
    }
}
