//! Teardown off the data path. Destroying the QPs of a NIC whose link just died can take a
//! long time: Soft-RoCE waits up to 50 s for every packet a QP still owns (`__rxe_cleanup`),
//! and hardware may wait on its firmware. A connection that moved, or a comm closed after its
//! rails failed, hands what it held on the dead NIC (QPs, CQs, registrations) to one thread of
//! the process that drops it, so that no `isend`, `test` or `close` waits on it. The thread
//! starts at the first such hand-over and then waits for more; the library stays mapped until
//! the process exits (`-z nodelete`), so NCCL's `dlclose` never unmaps its code.

use std::sync::mpsc::{channel, Sender};

use once_cell::sync::Lazy;
use parking_lot::Mutex;

/// Something to drop on the reaper's thread.
type Remains = Box<dyn Send>;

/// The reaper's inbox (None once it could not be started).
static INBOX: Lazy<Mutex<Option<Sender<Remains>>>> = Lazy::new(|| Mutex::new(start()));

/// Starts the reaper's thread: it drops whatever it is handed, in order.
fn start() -> Option<Sender<Remains>> {
    let (tx, rx) = channel::<Remains>();
    let spawned = std::thread::Builder::new()
        .name("nccl-erdma-reaper".into())
        .spawn(move || {
            for remains in rx {
                drop(remains);
                #[cfg(test)]
                BURIED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        });
    match spawned {
        Ok(_) => Some(tx),
        Err(e) => {
            tracing::warn!(
                "could not start the thread that frees a dead NIC's resources ({e}): they are \
                 freed where they are given up, which may hold that call"
            );
            None
        }
    }
}

/// Drops `remains` on the reaper's thread (where it cannot be started, here).
pub(crate) fn bury(remains: impl Send + 'static) {
    let boxed: Remains = Box::new(remains);
    #[cfg(test)]
    HANDED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let inbox = INBOX.lock();
    let Some(tx) = inbox.as_ref() else {
        drop(inbox);
        drop(boxed);
        #[cfg(test)]
        BURIED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        return;
    };
    if let Err(returned) = tx.send(boxed) {
        drop(inbox);
        drop(returned.0);
        #[cfg(test)]
        BURIED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

#[cfg(test)]
static HANDED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
#[cfg(test)]
static BURIED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Waits until everything handed over so far is dropped (tests that count resources).
#[cfg(test)]
pub(crate) fn settle() {
    use std::sync::atomic::Ordering::SeqCst;
    let want = HANDED.load(SeqCst);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while BURIED.load(SeqCst) < want {
        assert!(std::time::Instant::now() < deadline, "the reaper is stuck");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}
