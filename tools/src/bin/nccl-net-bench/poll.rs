//! Polling, as NCCL's proxy drives a net plugin: no call ever blocks, so every loop polls,
//! detects a stall by the clock, and once idle for a while gives the CPU away
//! (`NCCL_NET_BENCH_IDLE`), so two sides sharing one CPU both make progress.

use std::{
    ffi::c_int,
    time::{Duration, Instant},
};

use nccl_net_erdma_tools::client::{Net, Opaque};

use crate::{plugin::PluginResult, Res};

/// How long a data loop (or connection setup) may go without progress.
const STALL_TIMEOUT: Duration = Duration::from_secs(60);
/// Idle polls in a row after which every further idle poll yields the CPU.
const YIELD_AFTER: u32 = 256;
/// The sleep of [`IdlePolicy::Sleep`].
const IDLE_SLEEP: Duration = Duration::from_micros(20);
pub const IDLE_ENV: &str = "NCCL_NET_BENCH_IDLE";

/// What an idle poll does after [`YIELD_AFTER`] idle polls in a row
/// (`NCCL_NET_BENCH_IDLE`, inherited by the local child).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdlePolicy {
    /// `sched_yield` (the default).
    Yield,
    /// Keep polling (as perftest does).
    Spin,
    /// Sleep [`IDLE_SLEEP`] (lets the CPU go idle, e.g. for the kernel's soft RoCE work).
    Sleep,
}

pub fn parse_idle(v: Option<&str>) -> Res<IdlePolicy> {
    match v {
        None | Some("" | "yield") => Ok(IdlePolicy::Yield),
        Some("spin") => Ok(IdlePolicy::Spin),
        Some("sleep") => Ok(IdlePolicy::Sleep),
        Some(v) => Err(format!("{IDLE_ENV}={v:?}: expected yield, spin or sleep")),
    }
}

/// The idle policy of this process, read once (checked in `main`).
fn idle_policy() -> IdlePolicy {
    static POLICY: std::sync::OnceLock<IdlePolicy> = std::sync::OnceLock::new();
    *POLICY.get_or_init(|| {
        parse_idle(std::env::var(IDLE_ENV).ok().as_deref()).unwrap_or(IdlePolicy::Yield)
    })
}

/// Stall detection for polling loops, cheap enough for the timed loops: the clock is read
/// only every 1024 idle polls (in a VM without a TSC clocksource a read costs about 1 us,
/// which would otherwise sit on the latency path of every call).
pub struct Watchdog {
    /// When progress was last seen, set at the first clock read.
    last: Option<Instant>,
    spins: u32,
}

impl Watchdog {
    pub fn new() -> Self {
        Watchdog {
            last: None,
            spins: 0,
        }
    }

    pub fn progressed(&mut self) {
        self.spins = 0;
        self.last = None;
    }

    /// Call once per idle poll; errors after [`STALL_TIMEOUT`] without progress.
    pub fn idle(&mut self, what: impl FnOnce() -> String) -> Res<()> {
        self.spins = self.spins.wrapping_add(1);
        if self.spins % 1024 == 0 {
            let last = *self.last.get_or_insert_with(Instant::now);
            if last.elapsed() > STALL_TIMEOUT {
                return Err(format!(
                    "no progress for {} s: {} (the plugin stalls)",
                    STALL_TIMEOUT.as_secs(),
                    what()
                ));
            }
        }
        // Idle for a while: let the peer run if it shares our CPU (NCCL's progress thread
        // yields when idle too).
        if self.spins >= YIELD_AFTER {
            match idle_policy() {
                IdlePolicy::Yield => std::thread::yield_now(),
                IdlePolicy::Spin => std::hint::spin_loop(),
                IdlePolicy::Sleep => std::thread::sleep(IDLE_SLEEP),
            }
        }
        Ok(())
    }
}

/// Retries a post while the plugin answers "not now" (NULL).
pub fn post(mut f: impl FnMut() -> Res<Opaque>, what: &dyn Fn() -> String) -> Res<Opaque> {
    let mut dog = Watchdog::new();
    loop {
        let r = f()?;
        if !r.is_null() {
            return Ok(r);
        }
        dog.idle(|| format!("{} is never accepted (NULL request)", what()))?;
    }
}

/// Waits for one request of one `size`-byte message; `what` names it in errors.
pub fn wait(net: &Net, req: Opaque, size: usize, what: &dyn Fn() -> String) -> Res<()> {
    let mut sizes = [0 as c_int; 64];
    let mut dog = Watchdog::new();
    loop {
        sizes[0] = -1;
        if net
            .test(req, Some(&mut sizes[..]))
            .call(|| format!("test of {}", what()))?
        {
            if sizes[0] as usize != size {
                return Err(format!(
                    "test of {} reported size {}, expected {size}",
                    what(),
                    sizes[0]
                ));
            }
            return Ok(());
        }
        dog.idle(|| format!("{} does not complete", what()))?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_policy_parses() {
        assert_eq!(parse_idle(None).unwrap(), IdlePolicy::Yield);
        assert_eq!(parse_idle(Some("")).unwrap(), IdlePolicy::Yield);
        assert_eq!(parse_idle(Some("spin")).unwrap(), IdlePolicy::Spin);
        assert_eq!(parse_idle(Some("sleep")).unwrap(), IdlePolicy::Sleep);
        assert!(parse_idle(Some("nap"))
            .unwrap_err()
            .contains("NCCL_NET_BENCH_IDLE=\"nap\""));
    }
}
