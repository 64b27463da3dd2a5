//! The plugin as this program uses it: open and `init` the library through the dlopen
//! client (choosing the transport as the user or the peer asks, or falling back to tcp),
//! read device 0, and turn the plugin's result codes into messages that name the call.

use nccl_net_erdma_tools::client::{self, Code, Net, Properties};

use crate::{args::Options, plan::Params, Res};

pub const TRANSPORT_ENV: &str = "NCCL_ERDMA_TRANSPORT";

/// Our plugin's name: another's has no transport setting.
const OURS: &str = "erdma";

/// Turns a plugin result code into a message naming the call.
pub trait PluginResult<T> {
    fn call(self, what: impl FnOnce() -> String) -> Res<T>;
}

impl<T> PluginResult<T> for Result<T, Code> {
    fn call(self, what: impl FnOnce() -> String) -> Res<T> {
        self.map_err(|code| {
            format!(
                "plugin call {} failed: {code:?} (ncclResult_t {})",
                what(),
                code as i32
            )
        })
    }
}

/// The loaded, initialised plugin.
pub struct Plugin {
    pub net: Net,
    pub props: Properties,
    /// `tcp` or `verbs`.
    pub transport: String,
    /// Why, when this program chose the transport.
    pub transport_note: Option<String>,
}

impl Plugin {
    pub fn finalize(&mut self) -> Res<()> {
        self.net.finalize().call(|| "finalize".into())
    }
}

pub fn set_env(key: &str, value: &str) {
    // Single-threaded here (before any thread is started), and the plugin reads its
    // environment only inside `init`, after this.
    std::env::set_var(key, value);
}

/// The plugin's last WARN line (why a call failed), or a placeholder.
fn last_warning() -> String {
    client::logged_lines()
        .iter()
        .rev()
        .find(|l| l.level <= nccl_net_erdma::ffi::NCCL_LOG_WARN)
        .map_or_else(|| "the plugin logged no warning".into(), |l| l.text.clone())
}

/// Opens the library, `init`s it (falling back to tcp when the default transport has no
/// device and the user did not choose one) and reads device 0. `want` is side A's transport,
/// which side B adopts when its own environment does not choose.
pub fn open_plugin(o: &Options, want: Option<&str>) -> Res<Plugin> {
    let mut net = match o.abi {
        Some(v) => Net::open(&o.lib, v)?,
        None => Net::open_highest(&o.lib)?,
    };
    if net.name() != OURS {
        return open_other(net);
    }
    let mut note = None;
    match (std::env::var(TRANSPORT_ENV).ok(), want) {
        (Some(_), _) => net.init().call(|| format!("init ({})", last_warning()))?,
        (None, Some(t)) => {
            set_env(TRANSPORT_ENV, t);
            net.init().call(|| {
                format!(
                    "init ({TRANSPORT_ENV}={t}, as the peer: {})",
                    last_warning()
                )
            })?;
            note = Some(format!("as the peer; {TRANSPORT_ENV} unset"));
        }
        (None, None) => {
            // The first try's warnings would read as a failure; the fallback explains it.
            let quiet = std::env::var_os("NCCL_NET_CLIENT_QUIET").is_some();
            set_env("NCCL_NET_CLIENT_QUIET", "1");
            let first = net.init();
            if !quiet {
                std::env::remove_var("NCCL_NET_CLIENT_QUIET");
            }
            if first.is_err() {
                let why = last_warning();
                if !o.quiet {
                    println!("no usable RDMA device: running over tcp");
                    println!("  (init with the default transport failed: {why})");
                }
                set_env(TRANSPORT_ENV, "tcp");
                net.init()
                    .call(|| format!("init ({TRANSPORT_ENV}=tcp: {})", last_warning()))?;
                note = Some("no usable RDMA device".into());
            }
        }
    }
    let props = first_device(&net)?;
    let env = std::env::var(TRANSPORT_ENV).unwrap_or_else(|_| "verbs".into());
    let transport = match env.as_str() {
        "tcp" | "verbs" => env,
        // auto: the tcp transport names its devices erdma-tcp-<ifname>.
        _ if props.name.starts_with("erdma-tcp-") => "tcp".into(),
        _ => "verbs".into(),
    };
    Ok(Plugin {
        net,
        props,
        transport,
        transport_note: note,
    })
}

/// Device 0's properties, once `init` succeeded.
fn first_device(net: &Net) -> Res<Properties> {
    let n = net.devices().call(|| "devices".into())?;
    if n < 1 {
        return Err(format!("the plugin reports {n} devices"));
    }
    net.properties(0).call(|| "getProperties(0)".into())
}

/// Another plugin (not ours): `init` as NCCL would, no transport to choose; its
/// "transport" is its name, which both sides must share.
fn open_other(mut net: Net) -> Res<Plugin> {
    net.init().call(|| format!("init ({})", last_warning()))?;
    let props = first_device(&net)?;
    Ok(Plugin {
        transport: net.name().replace(char::is_whitespace, "_"),
        transport_note: Some("the plugin's own".into()),
        net,
        props,
    })
}

/// A grouped receive larger than the device takes would fail on the first `irecv`; this
/// says why before anything is connected.
pub fn check_group(p: &Plugin, params: &Params) -> Res<()> {
    if params.group as i32 > p.props.max_recvs {
        return Err(format!(
            "--group {} exceeds the device's maxRecvs {}",
            params.group, p.props.max_recvs
        ));
    }
    Ok(())
}
