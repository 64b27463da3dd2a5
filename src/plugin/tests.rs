//! The core on a fake transport (an in-memory wire between a listener and a connector): the
//! connect stages, the request tokens, the registrations the transports look up, the stats,
//! and the error codes a failed comm keeps returning. No sockets, no verbs.

use std::{
    collections::HashMap,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::{
        atomic::{AtomicU64, Ordering::Relaxed},
        Arc,
    },
};

use parking_lot::Mutex;

use super::*;
use crate::buffer::{TestMem, UserBuffer};
use crate::ffi::ncclResult_t;
use crate::oob::{Handle, TransportKind};
use crate::transport::{
    CommKeys, Endpoint, Failure, Hold, MemKeys, Receiver, Registry, Sender, SizeSink, Tested,
    Traffic, MAX_RECVS,
};

/// One posted receive on a fake wire.
struct Posted {
    bufs: Vec<UserBuffer>,
    tags: Vec<i32>,
    /// Each buffer's message size once its send came.
    sizes: Vec<Option<u32>>,
}

/// What both ends of a fake connection share: receives posted in order, sends done at once.
#[derive(Default)]
struct Wire {
    recvs: Vec<Option<Posted>>,
    /// Receive slots in the order posted (the sender fills the oldest first).
    order: Vec<usize>,
    sends: Vec<Option<usize>>,
    /// A failure both ends meet on their next call (a cut wire).
    failure: Failure,
    traffic: (Traffic, Traffic),
}

type SharedWire = Arc<Mutex<Wire>>;

/// A transport whose connections are in-memory wires, keyed by the listener's nonce.
struct FakeTransport {
    /// Device 0, then the virtual devices NCCL made.
    devices: Mutex<Vec<Arc<DeviceProps>>>,
    wires: Mutex<HashMap<u64, SharedWire>>,
    next: AtomicU64,
    registry: Arc<Registry>,
}

impl FakeTransport {
    fn new() -> Self {
        FakeTransport {
            devices: Mutex::new(vec![Arc::new(DeviceProps {
                name: c"fake0".to_owned(),
                pci_path: None,
                guid: 0,
                ptr_support: PTR_HOST,
                speed_mbps: 1000,
                port: 1,
                max_comms: 1024,
                force_flush: false,
                vdevs: vec![0],
                rail_id: -1,
            })]),
            wires: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
            registry: Arc::default(),
        }
    }
}

struct FakeListener {
    handle: Handle,
    wire: SharedWire,
    registry: Arc<Registry>,
}

/// A connector that needs two polls, so the plugin's stage table is used.
struct FakeConnector {
    wire: SharedWire,
    polls: u32,
    registry: Arc<Registry>,
}

/// Either end: the wire, and where it looks NCCL's handles up.
struct FakeEnd {
    wire: SharedWire,
    keys: Mutex<CommKeys>,
}

struct FakeSender(FakeEnd);
struct FakeReceiver(FakeEnd);

impl FakeEnd {
    fn new(wire: &SharedWire, registry: &Arc<Registry>) -> Self {
        FakeEnd {
            wire: Arc::clone(wire),
            keys: Mutex::new(CommKeys::new(Arc::clone(registry), 0)),
        }
    }
}

impl Transport for FakeTransport {
    type Listener = FakeListener;
    type Connector = FakeConnector;
    type Sender = FakeSender;
    type Receiver = FakeReceiver;

    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn facts(&self) -> TransportFacts {
        TransportFacts::default()
    }

    fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    fn device_count(&self) -> usize {
        self.devices.lock().len()
    }

    fn device(&self, dev: usize) -> Result<Arc<DeviceProps>> {
        crate::transport::device(&self.devices.lock(), dev).map(Arc::clone)
    }

    fn make_vdevice(&self, _: &[i32], _: usize) -> Result<usize> {
        let mut devices = self.devices.lock();
        let one = Arc::clone(&devices[0]);
        devices.push(one);
        Ok(devices.len() - 1)
    }

    fn drop_virtual_devices(&self) {
        self.devices.lock().truncate(1);
    }

    fn listen(&self, _dev: usize, ip: IpAddr) -> Result<FakeListener> {
        let nonce = self.next.fetch_add(1, Relaxed);
        let wire = SharedWire::default();
        self.wires.lock().insert(nonce, Arc::clone(&wire));
        let handle = Handle {
            addr: SocketAddr::new(ip, 1),
            transport: TransportKind::Tcp,
            nonce,
        };
        Ok(FakeListener {
            handle,
            wire,
            registry: Arc::clone(&self.registry),
        })
    }

    fn connect(&self, _dev: usize, handle: &Handle, _: Option<i32>) -> Result<FakeConnector> {
        let wire = self.wires.lock().get(&handle.nonce).cloned();
        let wire = wire.ok_or_else(|| Error::remote("no such listener".into()))?;
        Ok(FakeConnector {
            wire,
            polls: 0,
            registry: Arc::clone(&self.registry),
        })
    }

    fn register(
        &self,
        _: usize,
        _: usize,
        _: usize,
        host: bool,
    ) -> Result<(MemKeys, Option<Hold>)> {
        Ok((
            MemKeys {
                host,
                ..MemKeys::default()
            },
            None,
        ))
    }

    fn register_dmabuf(
        &self,
        _: usize,
        _: usize,
        _: usize,
        _: u64,
        _: i32,
    ) -> Result<(MemKeys, Hold)> {
        Err(Error::misuse("no DMA-BUF here".into()))
    }
}

impl crate::transport::Listener for FakeListener {
    type Receiver = FakeReceiver;

    fn handle(&self) -> &Handle {
        &self.handle
    }

    fn poll_accept(&mut self) -> Result<Option<FakeReceiver>> {
        Ok(Some(FakeReceiver(FakeEnd::new(&self.wire, &self.registry))))
    }
}

impl crate::transport::Connector for FakeConnector {
    type Sender = FakeSender;

    fn poll(&mut self) -> Result<Option<FakeSender>> {
        self.polls += 1;
        Ok((self.polls > 1).then(|| FakeSender(FakeEnd::new(&self.wire, &self.registry))))
    }
}

impl Endpoint for FakeSender {
    fn peer(&self) -> String {
        "fake peer".into()
    }
    fn traffic(&self) -> Traffic {
        self.0.wire.lock().traffic.0
    }
}

impl Endpoint for FakeReceiver {
    fn peer(&self) -> String {
        "fake peer".into()
    }
    fn traffic(&self) -> Traffic {
        self.0.wire.lock().traffic.1
    }
}

impl Sender for FakeSender {
    fn isend(&self, buf: UserBuffer, tag: i32, mhandle: u64) -> Result<Option<usize>> {
        let mut w = self.0.wire.lock();
        let w = &mut *w;
        w.failure.check()?;
        let Some(&slot) = w.order.first() else {
            return Ok(None);
        };
        let posted = w.recvs[slot].as_mut().expect("ordered receives are posted");
        let Some(i) =
            (0..posted.bufs.len()).find(|&i| posted.sizes[i].is_none() && posted.tags[i] == tag)
        else {
            return Ok(None);
        };
        self.0.keys.lock().keys(mhandle, buf)?;
        if buf.len() > posted.bufs[i].len() {
            return Err(w.failure.fail(Error::truncated("too large".into())));
        }
        posted.bufs[i]
            .bytes_mut(0, buf.len())
            .copy_from_slice(buf.bytes_from(0));
        posted.sizes[i] = Some(buf.len() as u32);
        if posted.sizes.iter().all(Option::is_some) {
            w.order.remove(0);
        }
        w.sends.push(Some(buf.len()));
        Ok(Some(w.sends.len() - 1))
    }

    fn test(&self, id: usize) -> Tested {
        let mut w = self.0.wire.lock();
        if let Err(e) = w.failure.check() {
            return Tested::Failed(e);
        }
        match w.sends.get_mut(id).and_then(Option::take) {
            Some(size) => {
                w.traffic.0.add(1, size as u64);
                Tested::Done(size)
            }
            None => Tested::Failed(crate::transport::not_in_flight("send", id)),
        }
    }
}

impl Receiver for FakeReceiver {
    fn irecv(&self, bufs: &[UserBuffer], tags: &[i32], mhandles: &[u64]) -> Result<Option<usize>> {
        let mut w = self.0.wire.lock();
        let w = &mut *w;
        w.failure.check()?;
        self.0.keys.lock().check_all(bufs, mhandles)?;
        let slot = w.recvs.len();
        w.recvs.push(Some(Posted {
            bufs: bufs.to_vec(),
            tags: tags.to_vec(),
            sizes: vec![None; bufs.len()],
        }));
        w.order.push(slot);
        Ok(Some(slot))
    }

    fn iflush(&self, _: &[UserBuffer], _: &[u64]) -> Result<Option<usize>> {
        Ok(None)
    }

    fn test(&self, id: usize, sizes: &mut impl SizeSink) -> Tested {
        let mut w = self.0.wire.lock();
        if let Err(e) = w.failure.check() {
            return Tested::Failed(e);
        }
        let Some(Some(posted)) = w.recvs.get(id) else {
            return Tested::Failed(crate::transport::not_in_flight("receive", id));
        };
        if posted.sizes.iter().any(Option::is_none) {
            return Tested::Pending;
        }
        let got: Vec<u32> = posted.sizes.iter().flatten().copied().collect();
        w.recvs[id] = None;
        for (i, s) in got.iter().enumerate() {
            sizes.set(i, *s);
        }
        w.traffic
            .1
            .add(got.len(), got.iter().map(|s| u64::from(*s)).sum());
        Tested::Done(got.len())
    }
}

/// A plugin over the fake transport.
fn plugin() -> Arc<Plugin<FakeTransport>> {
    plugin_with(&[])
}

/// A plugin over the fake transport, with the settings `env`.
fn plugin_with(env: &[(&str, &str)]) -> Arc<Plugin<FakeTransport>> {
    let env: HashMap<String, String> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let config = Config::from_lookup(|k| env.get(k).cloned()).unwrap();
    Arc::new(Plugin::new(
        config,
        FakeTransport::new(),
        IpAddr::V4(Ipv4Addr::LOCALHOST),
    ))
}

/// A connected pair: (send comm, receive comm), through the plugin's stages.
fn pair(
    p: &Arc<Plugin<FakeTransport>>,
) -> (Box<SendComm<FakeTransport>>, Box<RecvComm<FakeTransport>>) {
    let mut handle = [0u8; HANDLE_SIZE];
    let mut listen = p.listen(0, &mut handle).unwrap();
    // The first step stamps the stage's id into the handle; the second finishes.
    assert!(p.connect(0, &mut handle, None).unwrap().is_none());
    let send = p.connect(0, &mut handle, None).unwrap().expect("connected");
    // The finished stage is gone: a third call with the same handle is NCCL's error.
    let e = p.connect(0, &mut handle, None).err().expect("refused");
    assert_eq!(e.code(), ncclResult_t::ncclInternalError, "{e}");
    let recv = p.accept(&mut listen).unwrap().expect("accepted");
    (send, recv)
}

fn sizes() -> [u32; MAX_RECVS] {
    [0; MAX_RECVS]
}

#[test]
fn messages_flow_through_the_comms_tokens_and_registrations() {
    let p = plugin();
    let (send, recv) = pair(&p);
    let mut src = TestMem::new(100, 7);
    let mut dst = TestMem::new(100, 0);
    let smh = p.reg_mr(0, src.addr(), 100, PTR_HOST).unwrap();
    let rmh = p.reg_mr(0, dst.addr(), 100, PTR_HOST).unwrap();
    // A send before its receive: not yet.
    assert!(send.isend(src.buffer(), 3, smh).unwrap().is_none());
    let r = recv.irecv(&[dst.buffer()], &[3], &[rmh]).unwrap().unwrap();
    let s = send.isend(src.slice(0, 60), 3, smh).unwrap().unwrap();
    assert_eq!(r.owner, RequestOwner::Recv(&*recv as *const _ as usize));
    assert_eq!(s.owner, RequestOwner::Send(&*send as *const _ as usize));
    let mut got = sizes();
    assert!(send.test(s.slot, &mut got).unwrap());
    assert_eq!(got[0], 60);
    let mut got = sizes();
    assert!(recv.test(r.slot, &mut got).unwrap());
    assert_eq!(got[0], 60);
    assert_eq!(dst.bytes()[..60], TestMem::pattern(100, 7)[..60]);
    // Reported once: a second test of the same request is NCCL's error.
    let e = recv.test(r.slot, &mut sizes()).unwrap_err();
    assert_eq!(e.code(), ncclResult_t::ncclInternalError);
    drop((send, recv));
    let totals = p.totals(0);
    assert_eq!(
        (totals.tx_bytes.load(Relaxed), totals.rx_bytes.load(Relaxed)),
        (60, 60),
        "closed comms credit their device"
    );
    assert_eq!(totals.tx_msgs.load(Relaxed), 1);
}

#[test]
fn registrations_are_checked_where_the_transport_looks_them_up() {
    let p = plugin();
    let (send, recv) = pair(&p);
    let mut mem = TestMem::new(64, 1);
    let mh = p.reg_mr(0, mem.addr(), 32, PTR_HOST).unwrap();
    // A buffer beyond its registration, and a handle released: NCCL's misuse, and the call
    // fails, not the comm.
    let e = recv.irecv(&[mem.buffer()], &[0], &[mh]).unwrap_err();
    assert_eq!(e.code(), ncclResult_t::ncclInternalError, "{e}");
    assert!(e.to_string().contains("outside its registration"), "{e}");
    p.dereg_mr(mh).unwrap();
    let e = recv.irecv(&[mem.slice(0, 8)], &[0], &[mh]).unwrap_err();
    assert_eq!(e.code(), ncclResult_t::ncclInternalError, "{e}");
    assert!(p.dereg_mr(mh).is_err(), "released twice");
    let again = p.reg_mr(0, mem.addr(), 64, PTR_HOST).unwrap();
    assert!(recv
        .irecv(&[mem.buffer()], &[0], &[again])
        .unwrap()
        .is_some());
    // GPU memory on a host-only device, and an unknown device: NCCL's misuse too.
    let e = p.reg_mr(0, mem.addr(), 64, PTR_CUDA).unwrap_err();
    assert_eq!(e.code(), ncclResult_t::ncclInternalError, "{e}");
    let e = p.listen(3, &mut [0u8; HANDLE_SIZE]).err().expect("refused");
    assert_eq!(e.code(), ncclResult_t::ncclInternalError, "{e}");
    drop(send);
}

#[test]
fn a_failed_comm_returns_its_first_error_with_its_code_on_every_call() {
    for (error, code) in [
        (
            Error::truncated("too large".into()),
            ncclResult_t::ncclInvalidUsage,
        ),
        (
            Error::remote("peer gone".into()),
            ncclResult_t::ncclRemoteError,
        ),
        (
            Error::device("fatal event".into()),
            ncclResult_t::ncclSystemError,
        ),
    ] {
        let p = plugin();
        let (send, recv) = pair(&p);
        let mut mem = TestMem::new(8, 1);
        let mh = p.reg_mr(0, mem.addr(), 8, PTR_HOST).unwrap();
        let r = recv.irecv(&[mem.buffer()], &[0], &[mh]).unwrap().unwrap();
        send.end().0.wire.lock().failure.note(&error);
        for _ in 0..3 {
            let e = recv.test(r.slot, &mut sizes()).unwrap_err();
            assert_eq!((e.code(), e.to_string()), (code, error.to_string()));
            let e = send.isend(mem.buffer(), 0, mh).unwrap_err();
            assert_eq!((e.code(), e.to_string()), (code, error.to_string()));
        }
    }
}

#[test]
fn virtual_devices_are_refused_at_nccls_limit_before_one_is_added() {
    let p = plugin();
    while p.device_count() < MAX_DEVICES {
        p.make_vdevice(&[0], 4).unwrap();
    }
    let e = p.make_vdevice(&[0], 4).unwrap_err();
    assert_eq!(e.code(), ncclResult_t::ncclInvalidUsage, "{e}");
    assert_eq!(
        p.device_count(),
        MAX_DEVICES,
        "nothing added past the limit"
    );
}

#[test]
fn virtual_devices_go_at_the_last_finalize_only_where_nccl_unloads_the_plugin() {
    let p = plugin();
    assert_eq!(p.make_vdevice(&[0], 4).unwrap(), 1);
    p.last_context_finalized();
    assert_eq!(
        p.device_count(),
        1,
        "the next load sees the physical device only"
    );
    let kept = plugin_with(&[("NCCL_NET_PLUGIN_REF_COUNT", "1")]);
    kept.make_vdevice(&[0], 4).unwrap();
    kept.last_context_finalized();
    assert_eq!(
        kept.device_count(),
        2,
        "NCCL keeps the plugin loaded, and its devices"
    );
}
