//! The one place that names both transports: [`open`] picks the one `NCCL_ERDMA_TRANSPORT`
//! asks for, and the `Any*` types are either transport's listener, connector and ends behind
//! the contract, dispatched by a `match` (the transports are a closed set, so the plugin's
//! calls need no vtable). [`wire`] gathers both transports' wire formats for the crate's
//! `protocol` surface (fuzzing, hostile-peer tests).

use std::{net::IpAddr, sync::Arc};

use super::tcp::{TcpConnector, TcpListener, TcpReceiver, TcpSender, TcpTransport};
use super::verbs::{VerbsConnector, VerbsListener, VerbsReceiver, VerbsSender, VerbsTransport};
use super::{
    Connector, DeviceProps, Endpoint, Hold, Listener, MemKeys, Receiver, Registry, Sender,
    SizeSink, Tested, Traffic, Transport, TransportFacts,
};
use crate::buffer::UserBuffer;
use crate::config::{Config, TransportChoice};
use crate::error::{Error, Result};
use crate::log::INIT;
use crate::oob::{iface::LocalAddr, Handle, TransportKind};

/// Both transports' wire formats: what `protocol` checks.
pub(crate) mod wire {
    pub(crate) use super::super::tcp::frame::{CtsFrame, DataHeader, CTS_MAX, DATA_HEADER};
    pub use super::super::tcp::frame::{TCP_RECEIVER_READS, TCP_SENDER_READS};
    pub(crate) use super::super::verbs::wire::{
        decode_answer, decode_bye, decode_qps, decode_trial, encode_answer, encode_bye, encode_qps,
        ConnInfo, Healed, MoveMsg, Step,
    };
    /// What `protocol`'s round-trip tests generate.
    #[cfg(test)]
    pub(crate) use super::super::verbs::wire::{CtsEntry, RailInfo, Waiting, MAX_QPS, SLOTS};
    #[cfg(test)]
    pub(crate) use super::super::{MAX_RAILS, MAX_RECVS};
}

/// Runs `$body` with `$x` bound to whichever transport's value `$value` holds, and wraps what
/// it returns in the same variant of `$wrap` (or returns it as is, without `=>`).
macro_rules! each {
    ($value:expr, $x:ident => $body:expr) => {
        match $value {
            Self::Verbs($x) => $body,
            Self::Tcp($x) => $body,
        }
    };
    ($value:expr, $x:ident => $body:expr, wrap $wrap:ident) => {
        match $value {
            Self::Verbs($x) => $body.map(|v| v.map($wrap::Verbs)),
            Self::Tcp($x) => $body.map(|v| v.map($wrap::Tcp)),
        }
    };
}

/// Opens the transport `NCCL_ERDMA_TRANSPORT` asks for: verbs, tcp, or verbs where a device
/// is usable and tcp otherwise. `bootstrap` is the interface the tcp transport reports;
/// `registry` holds the registrations its ends look up.
pub(crate) fn open(
    config: &Config,
    bootstrap: &LocalAddr,
    registry: Arc<Registry>,
) -> Result<AnyTransport> {
    let tcp = |registry| TcpTransport::new(config, bootstrap, registry);
    match config.transport.value {
        TransportChoice::Tcp => Ok(AnyTransport::Tcp(tcp(registry))),
        TransportChoice::Verbs => VerbsTransport::open(config, registry)
            .map(AnyTransport::Verbs)
            .map_err(|e| {
                Error::no_device(format!(
                    "verbs transport unavailable: {e}. NCCL falls back to its own \
                     transports; set NCCL_ERDMA_TRANSPORT=tcp (or auto) to use this plugin \
                     over TCP"
                ))
            }),
        TransportChoice::Auto => match VerbsTransport::open(config, Arc::clone(&registry)) {
            Ok(t) => Ok(AnyTransport::Verbs(t)),
            Err(e) => {
                tracing::info!(target: INIT, "verbs transport unavailable ({e}); using tcp");
                Ok(AnyTransport::Tcp(tcp(registry)))
            }
        },
    }
}

/// What the transport `NCCL_ERDMA_TRANSPORT` asks for would see of this host, for a report
/// of why it did not open.
pub(crate) fn survey(config: &Config) -> TransportFacts {
    match config.transport.value {
        TransportChoice::Tcp => TransportFacts {
            transport: TransportKind::Tcp.name().to_string(),
            ..TransportFacts::default()
        },
        TransportChoice::Verbs | TransportChoice::Auto => super::verbs::survey_facts(config),
    }
}

/// Either transport (one per process).
#[allow(clippy::large_enum_variant)]
pub(crate) enum AnyTransport {
    Verbs(VerbsTransport),
    Tcp(TcpTransport),
}

/// Either transport's listener (held in its boxed listen comm).
#[allow(clippy::large_enum_variant)]
pub(crate) enum AnyListener {
    Verbs(VerbsListener),
    Tcp(TcpListener),
}

/// Either transport's connect in progress (the verbs one, of many kilobytes, boxed: the
/// plugin's stage table holds it while NCCL polls).
#[allow(clippy::large_enum_variant)]
pub(crate) enum AnyConnector {
    Verbs(Box<VerbsConnector>),
    Tcp(TcpConnector),
}

/// Either transport's sending end. Held inside the boxed comm and never moved once
/// connected, so the variants' sizes may differ.
#[allow(clippy::large_enum_variant)]
pub(crate) enum AnySender {
    Verbs(VerbsSender),
    Tcp(TcpSender),
}

/// Either transport's receiving end (see [`AnySender`]).
#[allow(clippy::large_enum_variant)]
pub(crate) enum AnyReceiver {
    Verbs(VerbsReceiver),
    Tcp(TcpReceiver),
}

impl Transport for AnyTransport {
    type Listener = AnyListener;
    type Connector = AnyConnector;
    type Sender = AnySender;
    type Receiver = AnyReceiver;

    fn kind(&self) -> TransportKind {
        each!(self, t => t.kind())
    }

    fn facts(&self) -> TransportFacts {
        each!(self, t => t.facts())
    }

    fn registry(&self) -> &Arc<Registry> {
        each!(self, t => t.registry())
    }

    fn device_count(&self) -> usize {
        each!(self, t => t.device_count())
    }

    fn device(&self, dev: usize) -> Result<Arc<DeviceProps>> {
        each!(self, t => t.device(dev))
    }

    fn make_vdevice(&self, devs: &[i32], max: usize) -> Result<usize> {
        each!(self, t => t.make_vdevice(devs, max))
    }

    fn drop_virtual_devices(&self) {
        each!(self, t => t.drop_virtual_devices())
    }

    fn listen(&self, dev: usize, ip: IpAddr) -> Result<AnyListener> {
        match self {
            Self::Verbs(t) => t.listen(dev, ip).map(AnyListener::Verbs),
            Self::Tcp(t) => t.listen(dev, ip).map(AnyListener::Tcp),
        }
    }

    fn connect(
        &self,
        dev: usize,
        handle: &Handle,
        traffic_class: Option<i32>,
    ) -> Result<AnyConnector> {
        match self {
            Self::Verbs(t) => t
                .connect(dev, handle, traffic_class)
                .map(|c| AnyConnector::Verbs(Box::new(c))),
            Self::Tcp(t) => t.connect(dev, handle, traffic_class).map(AnyConnector::Tcp),
        }
    }

    fn register(
        &self,
        dev: usize,
        addr: usize,
        len: usize,
        host: bool,
    ) -> Result<(MemKeys, Option<Hold>)> {
        each!(self, t => t.register(dev, addr, len, host))
    }

    fn register_dmabuf(
        &self,
        dev: usize,
        addr: usize,
        len: usize,
        offset: u64,
        fd: i32,
    ) -> Result<(MemKeys, Hold)> {
        each!(self, t => t.register_dmabuf(dev, addr, len, offset, fd))
    }
}

impl Listener for AnyListener {
    type Receiver = AnyReceiver;

    fn handle(&self) -> &Handle {
        each!(self, l => l.handle())
    }

    fn poll_accept(&mut self) -> Result<Option<AnyReceiver>> {
        each!(self, l => l.poll_accept(), wrap AnyReceiver)
    }
}

impl Connector for AnyConnector {
    type Sender = AnySender;

    fn poll(&mut self) -> Result<Option<AnySender>> {
        each!(self, c => c.poll(), wrap AnySender)
    }
}

/// `Endpoint` of either transport's end: what that transport's end tells.
macro_rules! endpoint_of_either {
    ($end:ident) => {
        impl Endpoint for $end {
            fn peer(&self) -> String {
                each!(self, e => e.peer())
            }

            fn traffic(&self) -> Traffic {
                each!(self, e => e.traffic())
            }

            fn summary(&self) -> String {
                each!(self, e => e.summary())
            }
        }
    };
}

endpoint_of_either!(AnySender);
endpoint_of_either!(AnyReceiver);

impl Sender for AnySender {
    #[inline]
    fn isend(&self, buf: UserBuffer, tag: i32, mhandle: u64) -> Result<Option<usize>> {
        each!(self, s => s.isend(buf, tag, mhandle))
    }

    #[inline]
    fn test(&self, id: usize) -> Tested {
        each!(self, s => s.test(id))
    }
}

impl Receiver for AnyReceiver {
    #[inline]
    fn irecv(&self, bufs: &[UserBuffer], tags: &[i32], mhandles: &[u64]) -> Result<Option<usize>> {
        each!(self, r => r.irecv(bufs, tags, mhandles))
    }

    fn iflush(&self, bufs: &[UserBuffer], mhandles: &[u64]) -> Result<Option<usize>> {
        each!(self, r => r.iflush(bufs, mhandles))
    }

    #[inline]
    fn test(&self, id: usize, sizes: &mut impl SizeSink) -> Tested {
        each!(self, r => r.test(id, sizes))
    }
}
