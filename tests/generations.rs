//! Each old table driven as the NCCL generation that loads it drives it (the facts:
//! `old-nccl-abi.md` §1.3-1.5): NCCL 2.9.9 and 2.10.3 load `libnccl-net.so` by name from the
//! loader's path and its v4 table, call `connect` and `accept` once each, run a rank's
//! connects before its accepts on one thread, and probe GPUDirect serially (listen, connect,
//! accept, regMr on both ends, close) at every init, with a 64-byte handle; 2.12 (v5) and
//! 2.13-2.18 (v6) load `libnccl-net-erdma.so` by name and poll `connect` to completion
//! before the first `accept`. All of them keep at most 8 requests in flight per comm.
//!
//! Each generation runs in a child process whose loader path holds only the copy it loads,
//! under a watchdog that fails the child instead of letting a hang stall the suite. Over tcp
//! here; over `rxe0` in the Soft-RoCE tier (`NCCL_ERDMA_TEST_DEVICE`).

mod common;

use std::{
    path::{Path, PathBuf},
    thread,
    time::Duration,
};

use common::*;

/// How an NCCL generation loads and drives the plugin.
#[derive(Debug, Clone, Copy)]
struct Generation {
    nccl: &'static str,
    table: u32,
    /// The file name it `dlopen`s from the loader's path.
    file: &'static str,
    /// `connect`/`accept` are called once each and must return their comm (v4); else NCCL
    /// polls each to completion, the connect first.
    once: bool,
}

const GENERATIONS: [Generation; 4] = [
    Generation {
        nccl: "2.9.9",
        table: 4,
        file: "libnccl-net.so",
        once: true,
    },
    Generation {
        nccl: "2.10.3",
        table: 4,
        file: "libnccl-net.so",
        once: true,
    },
    Generation {
        nccl: "2.12",
        table: 5,
        file: "libnccl-net-erdma.so",
        once: false,
    },
    Generation {
        nccl: "2.13-2.18",
        table: 6,
        file: "libnccl-net-erdma.so",
        once: false,
    },
];

/// Requests NCCL before 2.19 keeps in flight per comm.
const IN_FLIGHT: usize = 8;
/// A child's whole run may take this long before its watchdog fails it.
const WATCHDOG: Duration = Duration::from_secs(120);
/// Message sizes, each way.
const SIZES: [usize; 8] = [0, 1, 1000, 4096, 65_536, 1 << 20, 3 << 20, 4 << 20];

#[test]
fn each_old_generation_loads_the_library_by_name_and_moves_verified_data() {
    for g in GENERATIONS {
        let dir = loader_dir(g);
        let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
        let path = format!("{}:{path}", dir.display());
        let out = run_child(
            test_name!(child_generation),
            &[
                ("GENERATION", g.nccl),
                ("LD_LIBRARY_PATH", &path),
                ("NCCL_NET_PLUGIN", "erdma"),
            ],
            &[],
            false,
        );
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "NCCL {}: {text}", g.nccl);
        assert!(
            text.contains(&format!("generation {} done", g.nccl)),
            "{text}"
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// A directory holding only a copy of the plugin under the name `g` looks for.
fn loader_dir(g: Generation) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "nccl-net-erdma-gen-{}-{}",
        g.nccl,
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).expect("loader dir");
    std::fs::copy(lib(), dir.join(g.file)).expect("copy the plugin");
    dir
}

#[test]
#[ignore = "entry point of a child process"]
fn child_generation() {
    if !is_child() {
        return;
    }
    let name = std::env::var("GENERATION").expect("GENERATION");
    let g = GENERATIONS
        .into_iter()
        .find(|g| g.nccl == name)
        .expect("a known generation");
    thread::spawn(|| {
        thread::sleep(WATCHDOG);
        eprintln!("watchdog: the generation's run hung for {WATCHDOG:?}");
        std::process::exit(3);
    });
    setup();
    // By name, from the loader's path, as that NCCL's dlopen does.
    let mut net = Net::open(Path::new(g.file), g.table).unwrap_or_else(|e| panic!("{e}"));
    net.init().expect("init");
    assert!(net.devices().expect("devices") >= 1);
    let props = net.properties(0).expect("getProperties within its struct");
    assert_eq!(props.ptr_support & DMABUF, 0, "no DMA-BUF before NCCL 2.13");
    gdr_probe(&net, g);
    // Two ranks in one thread: each connects to the other, then each accepts.
    let (mut handles, listens) = ([[0u8; 128]; 2], [0, 1].map(|_| Opaque::NULL));
    let mut listens = listens;
    for (h, l) in handles.iter_mut().zip(listens.iter_mut()) {
        *l = listen(&net, h, g);
    }
    let sends = [0, 1].map(|i| connect(&net, &mut handles[i], g));
    let recvs = [0, 1].map(|i| accept(&net, listens[i], g));
    for l in listens {
        net.close_listen(l).expect("closeListen");
    }
    for (i, (&s, &r)) in sends.iter().zip(&recvs).enumerate() {
        stream(&net, s, r, i as u64 * 100);
    }
    for (s, r) in sends.into_iter().zip(recvs) {
        net.close_send(s).expect("closeSend");
        net.close_recv(r).expect("closeRecv");
    }
    println!("generation {} done", g.nccl);
}

/// `listen` into a 64-byte handle (v4: NCCL 2.9's stack buffer) with guard bytes behind it.
fn listen(net: &Net, handle: &mut [u8; 128], g: Generation) -> Opaque {
    const GUARD: u8 = 0xa7;
    if g.table == 4 {
        handle[64..].fill(GUARD);
    }
    let l = net.listen(0, handle).expect("listen");
    if g.table == 4 {
        assert!(handle[64..].iter().all(|b| *b == GUARD), "wrote past 64");
    }
    l
}

fn connect(net: &Net, handle: &mut [u8; 128], g: Generation) -> Opaque {
    if g.once {
        let s = net.connect(0, handle).expect("connect");
        assert!(
            !s.is_null(),
            "NCCL {} uses the comm of its one connect",
            g.nccl
        );
        return s;
    }
    poll_until("connect", || net.connect(0, handle).expect("connect"))
}

fn accept(net: &Net, listen: Opaque, g: Generation) -> Opaque {
    if g.once {
        let r = net.accept(listen).expect("accept");
        assert!(
            !r.is_null(),
            "NCCL {} uses the comm of its one accept",
            g.nccl
        );
        return r;
    }
    poll_until("accept", || net.accept(listen).expect("accept"))
}

/// NCCL's GPUDirect probe at every init, on the application thread, serially: listen,
/// connect, accept, a 2 MiB registration on each comm, deregistration, close (host memory
/// stands in for the GPU's).
fn gdr_probe(net: &Net, g: Generation) {
    let mut handle = [0u8; 128];
    let l = listen(net, &mut handle, g);
    let s = connect(net, &mut handle, g);
    let r = accept(net, l, g);
    for comm in [s, r] {
        let m = reg(net, comm, vec![0u8; 2 << 20]);
        dereg(net, comm, m);
    }
    net.close_send(s).expect("closeSend");
    net.close_recv(r).expect("closeRecv");
    net.close_listen(l).expect("closeListen");
}

/// Every size from `s` to `r`, `IN_FLIGHT` receives posted before their sends, each
/// completed with its size and every byte compared; each receive flushed as NCCL does
/// after data landed.
fn stream(net: &Net, s: Opaque, r: Opaque, seed: u64) {
    let max = SIZES[SIZES.len() - 1];
    for round in 0..2 {
        let sizes: Vec<usize> = (0..IN_FLIGHT)
            .map(|i| SIZES[(i + round * 3) % SIZES.len()])
            .collect();
        let mut dsts: Vec<Reg> = (0..IN_FLIGHT)
            .map(|_| reg(net, r, vec![0u8; max]))
            .collect();
        let mut srcs: Vec<Reg> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| reg(net, s, pattern(seed + i as u64, n)))
            .collect();
        let rreqs: Vec<Opaque> = dsts
            .iter_mut()
            .map(|d| {
                let (p, mh) = (d.buf.as_mut_ptr(), d.mh);
                poll_until("irecv", || {
                    net.irecv(r, &[(p, max)], &[0], &[mh], false)
                        .expect("irecv")
                })
            })
            .collect();
        let sreqs: Vec<Opaque> = srcs
            .iter_mut()
            .zip(&sizes)
            .zip(&rreqs)
            .map(|((src, &n), &rreq)| {
                let (p, mh) = (src.buf.as_mut_ptr(), src.mh);
                isend_testing(net, rreq, || net.isend(s, p, n, 0, mh).expect("isend"))
            })
            .collect();
        for (i, (&sreq, &rreq)) in sreqs.iter().zip(&rreqs).enumerate() {
            assert_eq!(wait(net, sreq, 1), vec![sizes[i] as i32], "send {i}");
            assert_eq!(wait(net, rreq, 1), vec![sizes[i] as i32], "receive {i}");
            let d = &dsts[i];
            assert!(
                d.buf[..sizes[i]] == pattern(seed + i as u64, sizes[i])[..],
                "receive {i}: {} bytes differ",
                sizes[i]
            );
            let f = net
                .iflush(r, &[(d.buf.as_ptr() as *mut u8, sizes[i])], &[d.mh])
                .expect("iflush");
            if !f.is_null() {
                wait(net, f, 0);
            }
        }
        for d in dsts {
            dereg(net, r, d);
        }
        for src in srcs {
            dereg(net, s, src);
        }
    }
}
