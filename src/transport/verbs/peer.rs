//! A connection's link to its peer: the bootstrap TCP connection, kept after setup. A move's
//! messages go both ways over it, and the peer's last word when it closes its comm (`Bye`,
//! with how many of its receives had landed); by it the peer's exit (the socket closes) or its
//! host's silence (keepalive, `NCCL_ERDMA_PEER_TIMEOUT_S`) is seen. Each end owns one and
//! nothing else reads the socket. Nothing here blocks: what cannot be written now goes out
//! at a later poll.

use crate::error::{Error, Result};
use crate::oob::{Channel, MsgKind, PEER_SILENT};

use super::fault::{Cause, Fault};
#[cfg(test)]
use super::wire::Step;
use super::wire::{decode_bye, encode_bye, MoveMsg};

/// See the module doc.
pub(crate) struct PeerLink {
    chan: Channel,
    /// The peer, for messages: its address and its devices.
    peer: String,
    /// What ended the link, once something did.
    ended: Option<Fault>,
    /// From the peer's `Bye`: its receives numbered below this had landed when it closed.
    landed: Option<u64>,
    /// This end said `Bye`.
    said_bye: bool,
    /// Tests: the thread stops right after sending a message of this step.
    #[cfg(test)]
    pause: Option<(Step, Pause)>,
}

/// Tests: a thread stopped right after its end sent a message (descheduled there) until
/// released, while the peer may answer.
#[cfg(test)]
#[derive(Clone, Default)]
pub(crate) struct Pause(std::sync::Arc<PauseState>);

#[cfg(test)]
#[derive(Default)]
pub(crate) struct PauseState {
    released: std::sync::atomic::AtomicBool,
    /// Sends that stopped so far.
    waited: std::sync::atomic::AtomicU32,
}

#[cfg(test)]
impl Pause {
    pub(crate) fn release(&self) {
        self.0
            .released
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// How many sends stopped so far.
    pub(crate) fn waited(&self) -> u32 {
        self.0.waited.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Stops the calling thread until released (30 s at most).
    fn wait(&self) {
        use std::sync::atomic::Ordering::SeqCst;
        self.0.waited.fetch_add(1, SeqCst);
        let since = std::time::Instant::now();
        while !self.0.released.load(SeqCst) && since.elapsed() < std::time::Duration::from_secs(30)
        {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

impl PeerLink {
    /// The link over `chan` (after the hello, between messages), to the peer at its other
    /// end.
    pub(crate) fn new(chan: Channel) -> Self {
        PeerLink {
            peer: chan.peer().to_string(),
            chan,
            ended: None,
            landed: None,
            said_bye: false,
            #[cfg(test)]
            pause: None,
        }
    }

    /// The peer, for messages.
    pub(crate) fn peer(&self) -> &str {
        &self.peer
    }

    /// `read`, the decoding of a message of the peer's, with the peer named where it
    /// failed (the decoder names the field).
    pub(crate) fn read<T>(&self, read: Result<T>) -> Result<T> {
        read.map_err(|e| Error::remote(format!("peer {}: {e}", self.peer)))
    }

    /// The peer's devices, once its answer named them: they follow its address in messages.
    pub(crate) fn name_devices(&mut self, devices: &str) {
        self.peer = format!("{} ({devices})", self.chan.peer());
    }

    /// Sends what is queued and reads what came: the next message of a move, if one did. The
    /// peer's `Bye` and the end of the link are kept ([`Self::landed`], [`Self::ended`]).
    pub(crate) fn poll(&mut self) -> Option<MoveMsg> {
        if self.ended.is_some() {
            return None;
        }
        if let Err(e) = self.chan.flush() {
            self.end(Cause::PeerGone, &e.to_string());
            return None;
        }
        loop {
            let m = match self.chan.recv_io() {
                Ok(Some(m)) => m,
                Ok(None) => return None,
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                    self.end(Cause::PeerSilent, &e.to_string());
                    return None;
                }
                Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                    self.end(Cause::Protocol, &e.to_string());
                    return None;
                }
                Err(e) => {
                    self.end(Cause::PeerGone, &e.to_string());
                    return None;
                }
            };
            match m.kind {
                MsgKind::Move => match MoveMsg::decode(&m.payload) {
                    Ok(msg) => return Some(msg),
                    Err(e) => {
                        self.end(Cause::Protocol, &e.to_string());
                        return None;
                    }
                },
                // The peer's bootstrap listener refused the hello (another transport).
                MsgKind::Reject => return Some(MoveMsg::refusal(0, m.payload)),
                MsgKind::Bye => match decode_bye(&m.payload) {
                    Ok(landed) => self.landed = landed,
                    Err(e) => {
                        self.end(Cause::Protocol, &e.to_string());
                        return None;
                    }
                },
                kind => {
                    self.end(
                        Cause::Protocol,
                        &format!("message type {kind:?} after the hello"),
                    );
                    return None;
                }
            }
        }
    }

    /// Sends `msg` (what the socket does not take now goes out at a later poll).
    pub(crate) fn send(&mut self, msg: &MoveMsg) {
        if self.ended.is_some() {
            return;
        }
        self.chan.queue(MsgKind::Move, &msg.encode());
        if let Err(e) = self.chan.flush() {
            self.end(Cause::PeerGone, &e.to_string());
        }
        #[cfg(test)]
        if let Some((_, pause)) = self.pause.as_ref().filter(|(step, _)| *step == msg.step) {
            pause.wait();
        }
    }

    /// Tests: from now on the thread stops right after sending a message of `step`, until
    /// the pause returned is released.
    #[cfg(test)]
    pub(crate) fn pause_after(&mut self, step: Step) -> Pause {
        let pause = Pause::default();
        self.pause = Some((step, pause.clone()));
        pause
    }

    /// Says `Bye` as this end closes, with `landed` for a receiver (its receives below it had
    /// landed): once, and only what the socket takes now.
    pub(crate) fn bye(&mut self, landed: Option<u64>) {
        if self.said_bye || self.ended.is_some() {
            return;
        }
        self.said_bye = true;
        self.chan.queue(MsgKind::Bye, &encode_bye(landed));
        let _ = self.chan.flush();
    }

    /// What ended the link: the peer gone or silent, or a message the protocol does not
    /// allow.
    pub(crate) fn ended(&self) -> Option<&Fault> {
        self.ended.as_ref()
    }

    /// The link's verdict on the comm: a peer that sent what the protocol does not allow can
    /// no longer be trusted with the connection, which fails at once (a peer gone or silent
    /// is judged by what of its work had landed).
    pub(crate) fn trusted(&self) -> Result<()> {
        match &self.ended {
            Some(f) if f.cause == Cause::Protocol => Err(f.error.clone()),
            _ => Ok(()),
        }
    }

    /// The peer said in its `Bye` that its receives below this number had landed.
    pub(crate) fn landed(&self) -> Option<u64> {
        self.landed
    }

    /// Ends the link for `cause` (`why`: what the socket said).
    #[cold]
    fn end(&mut self, cause: Cause, why: &str) {
        let peer = &self.peer;
        let e = match cause {
            Cause::PeerSilent => Error::remote(format!(
                "peer {peer} stopped answering while this end still needed it{PEER_SILENT}"
            )),
            Cause::Protocol => Error::remote(format!(
                "peer {peer} broke the connection's protocol: {why} (is the same plugin \
                 version on every node?)"
            )),
            _ => Error::remote(format!(
                "peer {peer} closed its connection (its process exited or closed the comm) \
                 while this end still needed it (a request in flight, or the setup)"
            )),
        };
        self.ended = Some(Fault::new(cause, e));
    }
}
