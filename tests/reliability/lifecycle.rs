//! The plugin's lifetime in a process. Case 6: fifty dlclose/dlopen cycles with traffic
//! leave no fds, threads or memory behind. Case 7 (verbs): fork() after registration keeps
//! the parent's transfers correct. Case 8: service threads set up and tear down comms while
//! progress threads move verified data on 64 others, with no deadlock and nothing leaked.

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread,
    time::{Duration, Instant},
};

use crate::common::*;
use crate::support::*;

// ---------------------------------------------------------------------------------------
// Case 6. dlclose / dlopen cycles

#[test]
fn fifty_dlclose_dlopen_cycles_leave_nothing_behind() {
    report_child(&run_child(
        test_name!(child_dlclose_cycles),
        &[],
        &[],
        false,
    ));
}

fn library_mapped() -> bool {
    let name = lib()
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .any(|l| l.ends_with(&name))
}

#[test]
#[ignore = "entry point of a child process"]
fn child_dlclose_cycles() {
    if !is_child() {
        return;
    }
    const CYCLES: usize = 50;
    let mut samples = Vec::with_capacity(CYCLES);
    let mut unloaded = 0;
    for cycle in 0..CYCLES {
        let v = VERSIONS[cycle % VERSIONS.len()];
        let mut net = open(v);
        let (s, r) = connect_pair(&net);
        for (i, &size) in [0usize, 1, 4097, 1 << 20].iter().enumerate() {
            transfer(&net, s, r, size, size, (cycle * 8 + i) as u64);
        }
        close_pair(&mut net, s, r);
        net.close();
        unloaded += usize::from(!library_mapped());
        samples.push((fd_count(), thread_count(), rss_kib()));
    }
    let (fds, threads, _) = samples[0];
    for (cycle, &(f, t, _)) in samples.iter().enumerate() {
        assert_eq!(f, fds, "fds after cycle {cycle}: {samples:?}");
        assert_eq!(t, threads, "threads after cycle {cycle}: {samples:?}");
    }
    // RSS: after a few cycles to settle, 40 more cycles may not grow it by more than 8 MiB
    // (a leak of the 1 MiB transfer buffers, or of a per-load table, would).
    let settled = samples[9].2;
    let last = samples[CYCLES - 1].2;
    println!(
        "reliability: dlclose cycles: {CYCLES} cycles, fds {fds}, threads {threads}, \
         RSS {settled} KiB -> {last} KiB, library unmapped after {unloaded} of {CYCLES} dlcloses"
    );
    if under_valgrind() {
        // Under memcheck the resident set is mostly valgrind's own: freed blocks wait in its
        // 20 MB quarantine and every reload is translated again (6-9 MiB over 40 cycles, with
        // no leak). The same test outside valgrind (`cargo test`) holds the bound; here
        // memcheck's leak check, which scripts/tiers/reliability.sh makes fatal, stands in for it.
        println!("reliability: dlclose cycles: RSS bound skipped under valgrind");
        return;
    }
    assert!(
        last <= settled + 8 * 1024,
        "RSS grew from {settled} KiB to {last} KiB over {} cycles",
        CYCLES - 10
    );
}

/// True when this process runs under valgrind, whose preload objects are mapped into it.
fn under_valgrind() -> bool {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .any(|l| l.contains("/vgpreload_"))
}

// ---------------------------------------------------------------------------------------
// Case 7. fork() after registration (verbs; the PyTorch DataLoader pattern)

#[test]
#[ignore = "needs an RDMA device: NCCL_ERDMA_TEST_DEVICE (run by the Soft-RoCE tier)"]
fn verbs_fork_after_registration_keeps_parent_transfers_correct() {
    require_verbs();
    run_child(test_name!(child_fork_after_registration), &[], &[], false);
}

/// Fills `src` with message `seed`, receives it into `dst` (both registered on their comms)
/// and compares every byte.
fn transfer_regs(net: &Net, s: Opaque, r: Opaque, src: &mut Reg, dst: &mut Reg, seed: u64) {
    let len = src.buf.len();
    assert!(dst.buf.len() >= len);
    src.buf.copy_from_slice(&pattern(seed, len));
    dst.buf.fill(0);
    let dlen = dst.buf.len();
    let rreq = poll_until("irecv", || {
        net.irecv(r, &[(dst.buf.as_mut_ptr(), dlen)], &[3], &[dst.mh], false)
            .expect("irecv")
    });
    let sreq = isend_testing(net, rreq, || {
        net.isend(s, src.buf.as_mut_ptr(), len, 3, src.mh)
            .expect("isend")
    });
    assert_eq!(wait(net, rreq, 1), vec![len as i32], "received size");
    assert_eq!(wait(net, sreq, 1), vec![len as i32], "sent size");
    assert!(dst.buf[..len] == src.buf[..], "payload of message {seed}");
}

/// Forks; the child sleeps `child_ms` (0: none) and exits at once without running any
/// Rust code. Returns the child's pid.
fn fork_child(child_ms: u32) -> libc::pid_t {
    // SAFETY: the child calls only async-signal-safe functions (usleep, _exit) and touches
    // no memory of the parent's, so forking a multi-threaded process is sound here.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: as above.
        unsafe {
            if child_ms > 0 {
                libc::usleep(child_ms * 1000);
            }
            libc::_exit(0)
        }
    }
    assert!(pid > 0, "fork failed: {}", std::io::Error::last_os_error());
    pid
}

fn reap(pid: libc::pid_t) {
    let mut status = 0;
    // SAFETY: pid is our child; status is a valid out pointer.
    let got = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(got, pid, "waitpid: {}", std::io::Error::last_os_error());
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the forked child failed: status {status:#x}"
    );
}

#[test]
#[ignore = "entry point of a child process"]
fn child_fork_after_registration() {
    if !is_child() {
        return;
    }
    let mut net = open(11);
    let (s, r) = connect_pair(&net);
    // Page-sized and small, unaligned heap buffers (sharing pages with other allocations),
    // registered before the fork and reused after it.
    let mut bufs: Vec<(Reg, Reg)> = [1usize << 20, 4096, 100, 3]
        .iter()
        .map(|&n| (reg(&net, s, vec![0u8; n]), reg(&net, r, vec![0u8; n])))
        .collect();
    let mut seed = 0;
    let mut round = |net: &Net, bufs: &mut Vec<(Reg, Reg)>| {
        for (src, dst) in bufs.iter_mut() {
            seed += 1;
            transfer_regs(net, s, r, src, dst, seed);
        }
    };
    round(&net, &mut bufs);
    // A child that exits at once; the parent writes its registered buffers right away.
    let pid = fork_child(0);
    round(&net, &mut bufs);
    reap(pid);
    round(&net, &mut bufs);
    // A child that lives on while the parent moves data, then exits.
    let pid = fork_child(200);
    for _ in 0..5 {
        round(&net, &mut bufs);
    }
    reap(pid);
    round(&net, &mut bufs);
    // Registrations made after the fork work too.
    transfer(&net, s, r, 70_000, 70_000, 1234);
    for (src, dst) in bufs {
        dereg(&net, s, src);
        dereg(&net, r, dst);
    }
    close_pair(&mut net, s, r);
}

// ---------------------------------------------------------------------------------------
// Case 8. Stress: service threads set up and tear down while progress threads move data

#[test]
fn stress_service_and_progress_threads_on_64_comms() {
    report_child(&run_child(test_name!(child_stress), &[], &[], false));
}

const STRESS_PAIRS: usize = 64;
const PROGRESS_THREADS: usize = 4;
const SERVICE_THREADS: usize = 2;
const STRESS_BUF: usize = 3 * 65536;

/// One progress thread: verified transfers round-robin over its pairs, single and grouped
/// receives, until told to stop (and at least `min_rounds` rounds). Returns messages moved.
fn progress_loop(
    net: &Net,
    pairs: &[(usize, Opaque, Opaque)],
    stop: &AtomicBool,
    min_rounds: u64,
) -> u64 {
    let mut regs: Vec<(Reg, Reg)> = pairs
        .iter()
        .map(|&(_, s, r)| {
            (
                reg(net, s, vec![0u8; STRESS_BUF]),
                reg(net, r, vec![0u8; STRESS_BUF]),
            )
        })
        .collect();
    let sizes = [0usize, 1, 100, 4096, 65536 + 7, STRESS_BUF];
    let mut moved = 0;
    let mut round = 0u64;
    while round < min_rounds || !stop.load(Ordering::Relaxed) {
        for (k, &(id, s, r)) in pairs.iter().enumerate() {
            let (src, dst) = &mut regs[k];
            let seed = ((id as u64) << 32) | round;
            dst.buf.fill(0);
            if round % 3 == 2 {
                // A grouped receive of three 64 KiB parts, sent in reverse order.
                let part = STRESS_BUF / 3;
                let lens = [part, 1 + (seed as usize % part), 17];
                let msgs: Vec<Vec<u8>> = (0..3)
                    .map(|i| pattern(seed + i, lens[i as usize]))
                    .collect();
                for i in 0..3 {
                    src.buf[i * part..i * part + lens[i]].copy_from_slice(&msgs[i]);
                }
                let d = dst.buf.as_mut_ptr();
                let bufs: Vec<(*mut u8, usize)> =
                    (0..3).map(|i| (d.wrapping_add(i * part), part)).collect();
                let tags = [10, 11, 12];
                let rreq = poll_until("irecv", || {
                    net.irecv(r, &bufs, &tags, &[dst.mh; 3], false).unwrap()
                });
                let mut sreqs = Vec::new();
                for i in (0..3).rev() {
                    let p = src.buf.as_mut_ptr().wrapping_add(i * part);
                    sreqs.push(isend_testing(net, rreq, || {
                        net.isend(s, p, lens[i], tags[i], src.mh).unwrap()
                    }));
                }
                assert_eq!(
                    wait(net, rreq, 3),
                    lens.iter().map(|&l| l as i32).collect::<Vec<_>>(),
                    "pair {id} round {round}"
                );
                for q in sreqs {
                    wait(net, q, 1);
                }
                for i in 0..3 {
                    assert!(
                        dst.buf[i * part..i * part + lens[i]] == msgs[i][..],
                        "pair {id} round {round} part {i} corrupted"
                    );
                }
                moved += 3;
            } else {
                let len = sizes[(seed as usize + k) % sizes.len()];
                src.buf[..len].copy_from_slice(&pattern(seed, len));
                let d = dst.buf.as_mut_ptr();
                let rreq = poll_until("irecv", || {
                    net.irecv(r, &[(d, STRESS_BUF)], &[5], &[dst.mh], false)
                        .unwrap()
                });
                let sreq = isend_testing(net, rreq, || {
                    net.isend(s, src.buf.as_mut_ptr(), len, 5, src.mh).unwrap()
                });
                assert_eq!(
                    wait(net, rreq, 1),
                    vec![len as i32],
                    "pair {id} round {round}"
                );
                wait(net, sreq, 1);
                assert!(
                    dst.buf[..len] == src.buf[..len],
                    "pair {id} round {round}: {len} bytes corrupted"
                );
                assert!(
                    dst.buf[len..].iter().all(|b| *b == 0),
                    "pair {id} round {round}: bytes past the message"
                );
                moved += 1;
            }
        }
        round += 1;
    }
    for ((_, s, r), (src, dst)) in pairs.iter().zip(regs) {
        dereg(net, *s, src);
        dereg(net, *r, dst);
    }
    moved
}

/// One service thread: connect/accept new pairs, move a message over each, register and
/// deregister on the comms the progress threads are using, close. Returns setups done.
fn service_loop(
    net: &Net,
    shared: &[(usize, Opaque, Opaque)],
    stop: &AtomicBool,
    min: usize,
    who: usize,
) -> usize {
    let mut setups = 0;
    while setups < min || !stop.load(Ordering::Relaxed) {
        let (s2, r2) = connect_pair(net);
        transfer(
            net,
            s2,
            r2,
            1000 + setups % 3000,
            4096,
            (1 << 40) + (who * 1000 + setups) as u64,
        );
        let (_, s, r) = shared[(who * 7 + setups) % shared.len()];
        let mut a = vec![0u8; 8192];
        let mut b = vec![0u8; 100];
        let ma = net.reg_mr(s, a.as_mut_ptr(), a.len(), HOST).unwrap();
        let mb = net.reg_mr(r, b.as_mut_ptr(), b.len(), HOST).unwrap();
        // regIsGlobal: deregistered through the other comm.
        net.dereg_mr(r, ma).unwrap();
        net.dereg_mr(s, mb).unwrap();
        net.close_send(s2).unwrap();
        net.close_recv(r2).unwrap();
        setups += 1;
    }
    setups
}

#[test]
#[ignore = "entry point of a child process"]
fn child_stress() {
    if !is_child() {
        return;
    }
    let (net, base_fds) = open_warm(11);
    let base_threads = thread_count();
    let net = Arc::new(net);
    let pairs: Vec<(usize, Opaque, Opaque)> = (0..STRESS_PAIRS)
        .map(|i| {
            let (s, r) = connect_pair(&net);
            (i, s, r)
        })
        .collect();
    let pairs = Arc::new(pairs);
    let stop = Arc::new(AtomicBool::new(false));
    let run_for = Duration::from_millis(
        std::env::var("RELIABILITY_STRESS_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(2000),
    );
    let start = Instant::now();
    let mut progress = Vec::new();
    for t in 0..PROGRESS_THREADS {
        let (net, pairs, stop) = (Arc::clone(&net), Arc::clone(&pairs), Arc::clone(&stop));
        progress.push(thread::spawn(move || {
            let per = STRESS_PAIRS / PROGRESS_THREADS;
            progress_loop(&net, &pairs[t * per..(t + 1) * per], &stop, 3)
        }));
    }
    let mut service = Vec::new();
    for who in 0..SERVICE_THREADS {
        let (net, pairs, stop) = (Arc::clone(&net), Arc::clone(&pairs), Arc::clone(&stop));
        service.push(thread::spawn(move || {
            service_loop(&net, &pairs, &stop, 3, who)
        }));
    }
    // A watchdog instead of a bare join: a deadlock fails the test instead of hanging it.
    let limit = run_for + Duration::from_secs(60);
    loop {
        let running = progress.iter().filter(|h| !h.is_finished()).count()
            + service.iter().filter(|h| !h.is_finished()).count();
        if running == 0 {
            break;
        }
        if start.elapsed() >= run_for {
            stop.store(true, Ordering::Relaxed);
        }
        assert!(
            start.elapsed() < limit,
            "deadlock: {running} threads still running {limit:?} after the start"
        );
        thread::sleep(Duration::from_millis(10));
    }
    let moved: u64 = progress
        .into_iter()
        .map(|h| h.join().expect("a progress thread failed (see above)"))
        .sum();
    let setups: usize = service
        .into_iter()
        .map(|h| h.join().expect("a service thread failed (see above)"))
        .sum();
    println!(
        "reliability: stress: {moved} verified messages on {STRESS_PAIRS} comm pairs, \
         {setups} connection setups in {} ms",
        start.elapsed().as_millis()
    );
    for &(_, s, r) in pairs.iter() {
        net.close_send(s).unwrap();
        net.close_recv(r).unwrap();
    }
    assert_eq!(fd_count(), base_fds, "fds after the stress");
    assert_eq!(
        settles(base_threads, thread_count),
        base_threads,
        "threads after the stress"
    );
}
