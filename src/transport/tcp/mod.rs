//! TCP transport: NCCL's p2p contract over one socket per connection, without RDMA.
//!
//! Receiver-driven like the verbs data path: `irecv` sends the sender a clear-to-send (CTS)
//! frame naming the sizes and tags of its `n` buffers; `isend` returns a NULL request until a
//! CTS entry with its tag has arrived, then streams a data frame (16-byte header + payload,
//! written straight from the user's buffer). So a send larger than its receive is caught by
//! the sender, which fails and tells the receiver (a TRUNC frame), and neither side ever
//! buffers unexpected data. Everything is non-blocking, preallocated at connection time and
//! progressed by whichever of `isend`/`irecv`/`test` runs next; nothing waits for the peer,
//! and `close` just closes the socket. Setup is one-way: the connector's comm is returned once
//! its hello is out, the listener's once a hello came; the frames follow on the same socket.

pub(crate) mod frame;
mod recv;
mod send;
#[cfg(test)]
mod tests;

use std::{ffi::CString, net::IpAddr, sync::Arc, time::Duration};

use parking_lot::RwLock;
use socket2::Socket;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::oob::{
    self, iface::LocalAddr, Channel, Handle, Hello, MsgKind, Timeouts, TransportKind,
};
use crate::sysfs;
use crate::transport::facts::TransportFacts;
use crate::transport::{
    device, CommKeys, Connector, DeviceProps, Hold, Listener, MemKeys, Registry, Transport,
    PTR_HOST,
};
pub(crate) use recv::TcpReceiver;
pub(crate) use send::TcpSender;

fn into_data_socket(stream: std::net::TcpStream) -> Result<Socket> {
    let sock = Socket::from(stream);
    sock.set_nonblocking(true)
        .map_err(|e| Error::io("making the data socket non-blocking", e))?;
    Ok(sock)
}

// ---------------------------------------------------------------------------------------
// The backend

/// The tcp backend: one device, the bootstrap interface (and the virtual devices NCCL makes
/// of it, which are that interface too).
pub(crate) struct TcpTransport {
    props: RwLock<Vec<Arc<DeviceProps>>>,
    timeouts: Timeouts,
    registry: Arc<Registry>,
}

impl TcpTransport {
    /// The transport over `bootstrap`'s interface, its ends looking handles up in `registry`.
    pub(crate) fn new(config: &Config, bootstrap: &LocalAddr, registry: Arc<Registry>) -> Self {
        let ifname = &bootstrap.ifname;
        let sys = format!("/sys/class/net/{ifname}");
        let speed = config
            .speed_mbps
            .value
            .map(|s| s as i32)
            .or_else(|| {
                sysfs::read(&format!("{sys}/speed"))
                    .and_then(|s| s.parse::<i32>().ok())
                    .filter(|s| *s > 0)
            })
            .unwrap_or(10_000);
        let pci_path = std::fs::canonicalize(format!("{sys}/device"))
            .ok()
            .and_then(|p| CString::new(p.to_string_lossy().into_owned()).ok());
        let peer = config.peer_timeout_s.value;
        TcpTransport {
            props: RwLock::new(vec![Arc::new(DeviceProps {
                name: CString::new(format!("erdma-tcp-{ifname}")).unwrap_or_default(),
                pci_path,
                guid: 0,
                ptr_support: PTR_HOST,
                speed_mbps: speed,
                port: 1,
                max_comms: 65536,
                force_flush: false,
                vdevs: vec![0],
                rail_id: -1,
            })]),
            timeouts: Timeouts {
                connect: Duration::from_millis(config.connect_timeout_ms.value),
                peer: (peer > 0).then(|| Duration::from_secs(peer)),
            },
            registry,
        }
    }

    /// Lookups of NCCL's handles for a comm on device `dev`.
    fn keys(&self, dev: usize) -> CommKeys {
        CommKeys::new(Arc::clone(&self.registry), dev)
    }
}

impl Transport for TcpTransport {
    type Listener = TcpListener;
    type Connector = TcpConnector;
    type Sender = TcpSender;
    type Receiver = TcpReceiver;

    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn facts(&self) -> TransportFacts {
        let props = self.props.read();
        let name = props[0].name().to_string();
        TransportFacts {
            transport: TransportKind::Tcp.name().to_string(),
            devices: props
                .iter()
                .enumerate()
                .map(|(i, d)| {
                    let why = if i == 0 {
                        "the bootstrap interface"
                    } else {
                        "made by NCCL (makeVDevice) of device 0"
                    };
                    d.facts(i, vec![name.clone()], why)
                })
                .collect(),
            ..TransportFacts::default()
        }
    }

    fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    fn device_count(&self) -> usize {
        self.props.read().len()
    }

    fn device(&self, dev: usize) -> Result<Arc<DeviceProps>> {
        device(&self.props.read(), dev).map(Arc::clone)
    }

    /// A virtual device of the one device (NCCL may ask for one of a single NIC); it is the
    /// same interface.
    fn make_vdevice(&self, devs: &[i32], max: usize) -> Result<usize> {
        if devs != [0] || max == 0 {
            return Err(Error::usage(format!(
                "makeVDevice of devices {devs:?}: this transport has one device, 0, and cannot \
                 fuse several"
            )));
        }
        let mut props = self.props.write();
        let one = &props[0];
        let virtual_one = DeviceProps {
            name: one.name.clone(),
            pci_path: one.pci_path.clone(),
            vdevs: vec![0],
            ..**one
        };
        props.push(Arc::new(virtual_one));
        Ok(props.len() - 1)
    }

    fn drop_virtual_devices(&self) {
        self.props.write().truncate(1);
    }

    fn listen(&self, dev: usize, ip: IpAddr) -> Result<TcpListener> {
        device(&self.props.read(), dev)?;
        TcpListener::bind(ip, self.timeouts, self.keys(dev))
    }

    fn connect(
        &self,
        dev: usize,
        handle: &Handle,
        _traffic_class: Option<i32>,
    ) -> Result<TcpConnector> {
        device(&self.props.read(), dev)?;
        TcpConnector::start(handle, self.timeouts, self.keys(dev))
    }

    fn register(
        &self,
        dev: usize,
        _addr: usize,
        _len: usize,
        host: bool,
    ) -> Result<(MemKeys, Option<Hold>)> {
        device(&self.props.read(), dev)?;
        let keys = MemKeys {
            host,
            ..MemKeys::default()
        };
        Ok((keys, None))
    }

    fn register_dmabuf(
        &self,
        _dev: usize,
        _addr: usize,
        _len: usize,
        _offset: u64,
        _fd: i32,
    ) -> Result<(MemKeys, Hold)> {
        Err(Error::misuse(
            "DMA-BUF registration is not supported here (transport tcp); NCCL should not have \
             asked"
                .into(),
        ))
    }
}

// ---------------------------------------------------------------------------------------
// Connection setup

/// The listening side: every connection made to its handle.
pub(crate) struct TcpListener {
    listener: oob::Listener,
    /// Where its connections' receiving ends look handles up (each its own copy).
    keys: CommKeys,
}

impl TcpListener {
    /// Binds the bootstrap listener; its handle goes to the peer.
    fn bind(ip: std::net::IpAddr, timeouts: Timeouts, keys: CommKeys) -> Result<Self> {
        Ok(TcpListener {
            listener: oob::Listener::bind(ip, TransportKind::Tcp, timeouts)?,
            keys,
        })
    }

    /// One non-blocking step of `accept`: the receiving end of the next connector whose hello
    /// came. Nothing is answered: the socket carries the data frames from here on.
    fn step(&mut self) -> Result<Option<TcpReceiver>> {
        let Some((chan, _hello)) = self.listener.poll_hello()? else {
            return Ok(None);
        };
        let peer = chan.peer();
        let sock = into_data_socket(chan.into_stream())?;
        Ok(Some(TcpReceiver::new(sock, peer, self.keys.fresh())))
    }
}

impl Listener for TcpListener {
    type Receiver = TcpReceiver;

    fn handle(&self) -> &Handle {
        self.listener.handle()
    }

    fn poll_accept(&mut self) -> Result<Option<TcpReceiver>> {
        self.step()
    }
}

/// The connecting side, between NCCL's repeated `connect` calls: until its hello is out.
pub(crate) struct TcpConnector {
    chan: Option<Channel>,
    keys: Option<CommKeys>,
}

impl TcpConnector {
    /// Starts connecting to the listener described by `handle`.
    fn start(handle: &Handle, timeouts: Timeouts, keys: CommKeys) -> Result<Self> {
        let mut chan = Channel::connect(handle.addr, timeouts)?;
        let hello = Hello {
            nonce: handle.nonce,
            transport: TransportKind::Tcp,
            payload: Vec::new(),
        };
        chan.queue(MsgKind::Hello, &hello.encode());
        Ok(TcpConnector {
            chan: Some(chan),
            keys: Some(keys),
        })
    }
}

impl Connector for TcpConnector {
    type Sender = TcpSender;

    /// The sending end once the hello is out: the socket carries data frames from there, and
    /// the sender waits for the receiver's clear-to-send as it does for every send.
    fn poll(&mut self) -> Result<Option<TcpSender>> {
        let chan = self
            .chan
            .as_mut()
            .ok_or_else(|| Error::misuse("connect polled again after it finished".into()))?;
        if !chan.flush()? {
            return Ok(None);
        }
        let (Some(chan), Some(keys)) = (self.chan.take(), self.keys.take()) else {
            return Ok(None);
        };
        let peer = chan.peer();
        Ok(Some(TcpSender::new(
            into_data_socket(chan.into_stream())?,
            peer,
            keys,
        )))
    }
}
