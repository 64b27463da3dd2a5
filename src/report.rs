//! What `nccl-net-erdma-info` reports, as data: the plugin's `init` run once with this
//! process's environment, and what it found and decided (devices, ports, GID choice, MTUs,
//! speed, GPUDirect readiness, fusion), every setting and where it came from, what NCCL would
//! get, and warnings that each carry their fix. The tools render it (text or JSON); nothing
//! here discovers anything the plugin's `init` does not.

use crate::config::{Config, SETTINGS};
use crate::plugin::Plugin;

pub use crate::transport::facts::{
    Device, Fusion, GpuDirect, Port, Sourced, TransportFacts, Warning,
};

/// One setting: variable, value in effect, where it came from, what it does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettingEntry {
    /// The environment variable.
    pub name: String,
    /// Its value as the user would write it.
    pub value: String,
    /// `env` or `default`.
    pub source: String,
    /// What it does.
    pub doc: String,
}

/// The whole report.
#[derive(Debug, Default)]
pub struct Report {
    /// The plugin's version.
    pub version: String,
    /// The ABI versions the library exports.
    pub abi: String,
    /// The bootstrap interface and address, when one was found.
    pub bootstrap: Option<String>,
    /// What the transport found and decided (for a transport that does not open: what it
    /// saw of the host).
    pub facts: TransportFacts,
    /// Every setting.
    pub settings: Vec<SettingEntry>,
    /// Problems found besides the transport's (a setting the plugin cannot use).
    pub warnings: Vec<Warning>,
    /// Whether the plugin's `init` succeeds with this environment.
    pub plugin_runs: bool,
    /// Why it does not, when it does not.
    pub failure: Option<String>,
}

impl Report {
    /// Every problem found, each with its fix.
    pub fn all_warnings(&self) -> impl Iterator<Item = &Warning> {
        self.warnings.iter().chain(&self.facts.warnings)
    }
}

/// The ABI versions the library exports.
pub const ABI: &str = "ncclNetPlugin_v4 .. v12 (NCCL 2.8 - 2.32)";

/// Builds the report from this process's environment: the plugin's `init`, once.
pub fn collect() -> Report {
    let mut r = Report {
        version: env!("CARGO_PKG_VERSION").to_string(),
        abi: ABI.to_string(),
        ..Report::default()
    };
    let config = match Config::from_env() {
        Ok(c) => c,
        Err(e) => {
            r.warnings
                .push(Warning::new(e.to_string(), "fix the variable named above"));
            r.failure = Some(e.to_string());
            return r;
        }
    };
    r.settings = config
        .entries()
        .into_iter()
        .map(|(name, value, source)| SettingEntry {
            name: name.to_string(),
            value,
            source: source.to_string(),
            doc: SETTINGS
                .iter()
                .find(|(n, _)| *n == name)
                .map_or("", |(_, doc)| *doc)
                .trim()
                .to_string(),
        })
        .collect();
    let (opened, bootstrap) = Plugin::open_for_report(config);
    r.bootstrap = bootstrap;
    match opened {
        Ok(p) => {
            r.facts = p.facts();
            r.plugin_runs = true;
        }
        Err((e, facts)) => {
            let why = e.to_string();
            r.facts = facts;
            r.warnings.push(Warning::new(
                format!("the plugin's init fails here: {why}"),
                "NCCL falls back to its own transports; fix the cause above or set \
                 NCCL_ERDMA_TRANSPORT=auto to use TCP",
            ));
            r.failure = Some(why);
        }
    }
    r
}
