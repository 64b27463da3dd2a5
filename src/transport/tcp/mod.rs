//! TCP transport: NCCL's p2p contract over one socket per connection, without RDMA.
//!
//! Receiver-driven like the verbs data path: `irecv` sends the sender a clear-to-send (CTS)
//! frame naming the sizes and tags of its `n` buffers; `isend` returns a NULL request until a
//! CTS entry with its tag has arrived, then streams a data frame (16-byte header + payload,
//! written straight from the user's buffer). So a send larger than its receive is caught by
//! the sender, which fails and tells the receiver (a TRUNC frame), and neither side ever
//! buffers unexpected data. Everything is non-blocking, preallocated at connection time and
//! progressed by whichever of `isend`/`irecv`/`test` runs next; nothing waits for the peer,
//! and `close` just closes the socket.

mod frame;
mod recv;
mod send;

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

/// The listening side of one connection.
pub(crate) struct TcpListener {
    listener: oob::Listener,
    accepted: Option<Channel>,
    /// For the receiving end, once accepted.
    keys: Option<CommKeys>,
}

impl TcpListener {
    /// Binds the bootstrap listener; its handle goes to the peer.
    fn bind(ip: std::net::IpAddr, timeouts: Timeouts, keys: CommKeys) -> Result<Self> {
        Ok(TcpListener {
            listener: oob::Listener::bind(ip, TransportKind::Tcp, timeouts)?,
            accepted: None,
            keys: Some(keys),
        })
    }

    /// One non-blocking step of `accept`.
    fn step(&mut self) -> Result<Option<TcpReceiver>> {
        if self.accepted.is_none() {
            match self.listener.poll_hello()? {
                Some((mut chan, _hello)) => {
                    chan.queue(MsgKind::Accept, &[]);
                    self.accepted = Some(chan);
                }
                None => return Ok(None),
            }
        }
        let chan = self.accepted.as_mut().expect("set above");
        if !chan.flush()? {
            return Ok(None);
        }
        let chan = self.accepted.take().expect("set above");
        let peer = chan.peer();
        let keys = self.keys.take().ok_or_else(accepted_twice)?;
        Ok(Some(TcpReceiver::new(
            into_data_socket(chan.into_stream())?,
            peer,
            keys,
        )))
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

/// The connecting side, between NCCL's repeated `connect` calls.
pub(crate) struct TcpConnector {
    /// Until the listener accepted; then the data socket.
    chan: Option<Channel>,
    /// For the sending end, once connected.
    keys: Option<CommKeys>,
}

/// A listener or connector asked for a second connection.
fn accepted_twice() -> Error {
    Error::misuse("a listen or connect polled again after it made its connection".into())
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

    fn poll(&mut self) -> Result<Option<TcpSender>> {
        let chan = self
            .chan
            .as_mut()
            .ok_or_else(|| Error::misuse("connect polled again after it finished".into()))?;
        if !chan.flush()? {
            return Ok(None);
        }
        match chan.poll_recv()? {
            None => Ok(None),
            Some(m) if m.kind == MsgKind::Accept => {
                let peer = chan.peer();
                let Some(chan) = self.chan.take() else {
                    return Ok(None);
                };
                let sock = into_data_socket(chan.into_stream())?;
                let keys = self.keys.take().ok_or_else(accepted_twice)?;
                Ok(Some(TcpSender::new(sock, peer, keys)))
            }
            Some(m) if m.kind == MsgKind::Reject => Err(Error::remote(format!(
                "{} refused the connection: {}",
                chan.peer(),
                String::from_utf8_lossy(&m.payload)
            ))),
            Some(m) => Err(Error::remote(format!(
                "{} answered the hello with message type {:?}",
                chan.peer(),
                m.kind
            ))),
        }
    }
}
