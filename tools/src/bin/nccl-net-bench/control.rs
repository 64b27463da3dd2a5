//! The control channel between the two sides: std TCP, one text line per message, every
//! read and write under a timeout, so a side whose peer died stops with a reason instead of
//! hanging. It carries the run's parameters, the plugin's handles (hex) and the steps through
//! the sizes; the data itself goes through the plugin.

use std::{
    io::{BufRead, BufReader, ErrorKind, Write},
    net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs},
    time::{Duration, Instant},
};

use crate::Res;

/// Control-channel protocol version (first line from A).
pub const PROTOCOL: &str = "nccl-net-bench/1";
/// How long a control-channel read or write may take.
pub const CONTROL_TIMEOUT: Duration = Duration::from_secs(60);
/// How long `--listen` waits for its peer to connect.
pub const LISTEN_TIMEOUT: Duration = Duration::from_secs(300);

/// The line-based control connection to the peer.
pub struct Control {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    line: String,
}

impl Control {
    fn new(stream: TcpStream) -> Res<Self> {
        let setup = |s: &TcpStream| -> std::io::Result<()> {
            s.set_nonblocking(false)?;
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(CONTROL_TIMEOUT))?;
            s.set_write_timeout(Some(CONTROL_TIMEOUT))
        };
        setup(&stream).map_err(|e| format!("control connection: {e}"))?;
        let writer = stream
            .try_clone()
            .map_err(|e| format!("control connection: {e}"))?;
        Ok(Control {
            reader: BufReader::new(stream),
            writer,
            line: String::new(),
        })
    }

    pub fn send(&mut self, line: &str) -> Res<()> {
        // One write per line: with TCP_NODELAY, two would be two segments.
        let mut buf = String::with_capacity(line.len() + 1);
        buf.push_str(line);
        buf.push('\n');
        self.writer
            .write_all(buf.as_bytes())
            .map_err(|e| format!("control channel: sending to the peer failed: {e}"))
    }

    /// The next line; an `error ...` line from the peer becomes an error.
    pub fn recv(&mut self) -> Res<&str> {
        self.line.clear();
        match self.reader.read_line(&mut self.line) {
            Ok(0) => Err("control channel: the peer closed the connection".into()),
            Ok(_) => {
                let l = self.line.trim_end();
                match l.strip_prefix("error ") {
                    Some(msg) => Err(format!("the peer failed: {msg}")),
                    None => Ok(l),
                }
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                Err(format!(
                    "control channel: no word from the peer in {} s",
                    CONTROL_TIMEOUT.as_secs()
                ))
            }
            Err(e) => Err(format!("control channel: {e}")),
        }
    }

    /// The next line, which must start with `word`; returns the rest.
    pub fn expect(&mut self, word: &str) -> Res<String> {
        let l = self.recv()?;
        match l.split_once(' ') {
            Some((w, rest)) if w == word => Ok(rest.to_string()),
            None if l == word => Ok(String::new()),
            _ => Err(format!(
                "control channel: expected {word:?} from the peer, got {l:?}"
            )),
        }
    }

    /// Sends `r`'s error to the peer (best effort), so it stops at once with the reason
    /// instead of at its next timeout; returns `r`.
    pub fn notify<T>(&mut self, r: Res<T>) -> Res<T> {
        if let Err(e) = &r {
            let _ = self.send(&format!("error {}", e.replace('\n', " ")));
        }
        r
    }
}

/// `key=value` from a space-separated line.
pub fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

/// Accepts the control connection, giving up after `timeout` or when `peer_gone` says why
/// the peer (the local child) can no longer connect.
pub fn accept_control(
    l: &TcpListener,
    timeout: Duration,
    mut peer_gone: impl FnMut() -> Option<String>,
) -> Res<Control> {
    // Non-blocking, so the wait can watch the clock and the child.
    l.set_nonblocking(true)
        .map_err(|e| format!("control listener: {e}"))?;
    let until = Instant::now() + timeout;
    loop {
        match l.accept() {
            Ok((s, _)) => return Control::new(s),
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) => return Err(format!("control listener: {e}")),
        }
        if let Some(why) = peer_gone() {
            return Err(why);
        }
        if Instant::now() > until {
            return Err(format!("no peer connected within {} s", timeout.as_secs()));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

pub fn connect_control(addr: &str) -> Res<Control> {
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| format!("--connect {addr}: {e}"))?
        .collect();
    let until = Instant::now() + CONTROL_TIMEOUT;
    loop {
        let mut last = None;
        for a in &addrs {
            match TcpStream::connect_timeout(a, Duration::from_secs(5)) {
                Ok(s) => return Control::new(s),
                Err(e) => last = Some(e),
            }
        }
        // The listening side may not be up yet: retry for a while.
        if Instant::now() > until {
            let e = last
                .map(|e| e.to_string())
                .unwrap_or_else(|| "no address".into());
            return Err(format!("cannot reach {addr}: {e}"));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_travel_and_peer_errors_become_errors() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let peer = std::thread::spawn(move || {
            let mut c = connect_control(&addr).unwrap();
            c.send("hello transport=tcp device=lo abi=11").unwrap();
            let got = c.expect("params").unwrap();
            let _ = c.notify::<()>(Err("it broke\nbadly".into()));
            got
        });
        let mut c = accept_control(&l, Duration::from_secs(10), || None).unwrap();
        let hello = c.expect("hello").unwrap();
        assert_eq!(field(&hello, "device"), Some("lo"));
        assert_eq!(field(&hello, "abi"), Some("11"));
        assert_eq!(field(&hello, "speed"), None);
        c.send("params window=8").unwrap();
        assert_eq!(c.recv().unwrap_err(), "the peer failed: it broke badly");
        assert_eq!(peer.join().unwrap(), "window=8");
        assert!(c.recv().unwrap_err().contains("closed"));
    }

    #[test]
    fn accept_gives_up_when_the_peer_is_gone() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let e = accept_control(&l, Duration::from_secs(10), || Some("child died".into()));
        assert_eq!(e.err().unwrap(), "child died");
    }
}
