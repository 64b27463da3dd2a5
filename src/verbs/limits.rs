//! A device's resource limits as `ibv_query_device` reports them, and what this process holds
//! of them. Every QP, CQ and memory registration made through [`super::resources`] and
//! [`super::qp`] counts itself on its device context while it lives, so a connection can be
//! fitted to what is left before anything is created (a failed `ibv_create_qp` at scale says
//! only ENOMEM). Other processes on the same device are not seen: the device's own refusal
//! stays the last word.

use std::sync::atomic::{AtomicU32, Ordering};

/// The limits a connection is fitted to (`ibv_device_attr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceLimits {
    /// `max_qp`: queue pairs on the device.
    pub max_qp: u32,
    /// `max_cq`: completion queues.
    pub max_cq: u32,
    /// `max_mr`: memory registrations.
    pub max_mr: u32,
    /// `max_qp_wr`: work requests one queue of a QP may hold.
    pub max_qp_wr: u32,
    /// `max_cqe`: completions one CQ may hold.
    pub max_cqe: u32,
}

impl DeviceLimits {
    /// No limit worth the name (fake devices, by default).
    pub const UNLIMITED: DeviceLimits = DeviceLimits {
        max_qp: u32::MAX,
        max_cq: u32::MAX,
        max_mr: u32::MAX,
        max_qp_wr: u32::MAX,
        max_cqe: u32::MAX,
    };

    /// From the attributes' signed fields (a negative one, which no device reports, is 0).
    pub(crate) fn from_attr(attr: &rdma_sys::ibv_device_attr) -> Self {
        let u = |v: i32| v.max(0) as u32;
        DeviceLimits {
            max_qp: u(attr.max_qp),
            max_cq: u(attr.max_cq),
            max_mr: u(attr.max_mr),
            max_qp_wr: u(attr.max_qp_wr),
            max_cqe: u(attr.max_cqe),
        }
    }
}

/// What this process holds on a device at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Held {
    pub(crate) qps: u32,
    pub(crate) cqs: u32,
    pub(crate) mrs: u32,
}

/// The kinds of resource counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Resource {
    Qp,
    Cq,
    Mr,
}

/// Live counts of a device's resources held by this process.
#[derive(Debug, Default)]
pub(crate) struct Usage {
    qps: AtomicU32,
    cqs: AtomicU32,
    mrs: AtomicU32,
}

impl Usage {
    fn counter(&self, r: Resource) -> &AtomicU32 {
        match r {
            Resource::Qp => &self.qps,
            Resource::Cq => &self.cqs,
            Resource::Mr => &self.mrs,
        }
    }

    /// One more `r` was made.
    pub(crate) fn add(&self, r: Resource) {
        self.counter(r).fetch_add(1, Ordering::Relaxed);
    }

    /// One `r` was destroyed (never below zero: a miscount must not wrap into "all used").
    pub(crate) fn remove(&self, r: Resource) {
        let _ = self
            .counter(r)
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    }

    /// The counts now.
    pub(crate) fn held(&self) -> Held {
        Held {
            qps: self.qps.load(Ordering::Relaxed),
            cqs: self.cqs.load(Ordering::Relaxed),
            mrs: self.mrs.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_follow_what_is_made_and_destroyed_and_never_wrap() {
        let u = Usage::default();
        u.add(Resource::Qp);
        u.add(Resource::Qp);
        u.add(Resource::Mr);
        u.remove(Resource::Qp);
        u.remove(Resource::Cq);
        assert_eq!(
            u.held(),
            Held {
                qps: 1,
                cqs: 0,
                mrs: 1
            }
        );
    }
}
