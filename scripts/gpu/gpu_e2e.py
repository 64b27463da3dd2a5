#!/usr/bin/env python3
"""End-to-end GPU test of the nccl-net-erdma plugin through PyTorch; driven by scripts/gpu-e2e.sh.

Subcommands:

  run       the per-rank program. One process per rank, launched with RANK, WORLD_SIZE,
            MASTER_ADDR and MASTER_PORT set (by gpu-e2e.sh, or by torchrun). Every rank uses the
            same GPU (--device, default 0); each needs its own NCCL_HOSTID so that NCCL takes the
            ranks for separate hosts and sends every byte through the network plugin. When the
            launcher did not set NCCL_HOSTID, this program sets it from the rank before NCCL
            starts. Phases (--phases, comma separated):
              check  all_reduce (several dtypes and ops), all_gather, reduce_scatter, broadcast and
                     send/recv from 4 B to 256 MiB, every result compared exactly;
              ddp    a few DDP training steps of a tiny deterministic model; prints the losses;
              bw     all_reduce bus bandwidth at 1, 16 and 256 MiB.
            Rank 0 prints one machine-readable line per phase: "E2E-RESULT <json>".
  report    compares rank 0's output of the plugin run and of the Socket baseline run; prints
            "PASS ...", "FAIL ...", "INFO ..." lines that gpu-e2e.sh counts and shows.
  selftest  runs `report` on canned results (a passing and a failing set); needs no GPU or torch.

torch is imported only by `run`.
"""

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback

PREFIX = "E2E-RESULT "
MIB = 1 << 20


def emit(obj):
    print(PREFIX + json.dumps(obj, sort_keys=True), flush=True)


def human(nbytes):
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size} {unit}"
    return f"{nbytes} B"


# ---------------------------------------------------------------------------------------------
# run: the per-rank program
# ---------------------------------------------------------------------------------------------


class Rank:
    """The distributed context of this process."""

    def __init__(self, torch, dist, rank, world, dev):
        self.torch = torch
        self.dist = dist
        self.rank = rank
        self.world = world
        self.dev = dev

    def sync(self):
        self.torch.cuda.synchronize(self.dev)


def base_values(r, n, dtype, modulus):
    """Integer-valued tensor 0,1,..,modulus-1,0,1,.. of n elements (exact in every dtype used)."""
    torch = r.torch
    return (torch.arange(n, device=r.dev, dtype=torch.int32) % modulus).to(dtype)


def compare(got, want):
    """None when equal element by element, else a short description of the first difference."""
    if got.shape == want.shape and got.dtype == want.dtype and bool((got == want).all()):
        return None
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype} != {want.dtype}"
    bad = (got != want).flatten().nonzero()
    i = int(bad[0].item())
    return (
        f"{bad.numel()} of {got.numel()} elements differ; first at {i}: "
        f"got {got.flatten()[i].item()} want {want.flatten()[i].item()}"
    )


def phase_check(r, args):
    torch, dist = r.torch, r.dist
    world, rank = r.world, r.rank
    rank_sum = world * (world - 1) // 2
    failures = []
    cases = 0

    def record(op, dtype, nbytes, err):
        nonlocal cases
        cases += 1
        if err is not None:
            msg = f"rank {rank}: {op} {str(dtype).replace('torch.', '')} {human(nbytes)}: {err}"
            failures.append(msg)
            print("E2E-DETAIL " + msg, file=sys.stderr, flush=True)

    sizes = []
    s = args.min_bytes
    while s <= args.max_bytes:
        sizes.append(s)
        s *= 4
    f32 = torch.float32
    mod = 1021
    t_start = time.perf_counter()
    for idx, nbytes in enumerate(sizes):
        n = max(1, nbytes // 4)
        base = base_values(r, n, f32, mod)

        # all_reduce SUM, in place.
        x = base + rank
        dist.all_reduce(x)
        record("all_reduce(sum)", f32, nbytes, compare(x, base * world + rank_sum))
        del x

        # all_gather: rank i contributes base + 3i.
        out = torch.empty(world * n, device=r.dev, dtype=f32)
        dist.all_gather_into_tensor(out, base + 3 * rank)
        want = torch.cat([base + 3 * i for i in range(world)])
        record("all_gather", f32, nbytes, compare(out, want))
        del out, want

        # reduce_scatter SUM: every rank contributes world*n elements, keeps its n.
        big = base_values(r, world * n, f32, mod)
        out = torch.empty(n, device=r.dev, dtype=f32)
        dist.reduce_scatter_tensor(out, big + rank)
        want = big[rank * n:(rank + 1) * n] * world + rank_sum
        record("reduce_scatter(sum)", f32, nbytes, compare(out, want))
        del big, out, want

        # broadcast from a root that changes with the size.
        root = idx % world
        y = base + 5 * root if rank == root else torch.zeros(n, device=r.dev, dtype=f32)
        dist.broadcast(y, src=root)
        record(f"broadcast(root {root})", f32, nbytes, compare(y, base + 5 * root))
        del y

        # send/recv around the ring, both directions in one group.
        peer_to, peer_from = (rank + 1) % world, (rank - 1) % world
        send = base + 11 * rank
        recv = torch.empty(n, device=r.dev, dtype=f32)
        reqs = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, send, peer_to), dist.P2POp(dist.irecv, recv, peer_from)]
        )
        for q in reqs:
            q.wait()
        r.sync()
        record("sendrecv(ring)", f32, nbytes, compare(recv, base + 11 * peer_from))
        del send, recv, base

    # Plain blocking send/recv, one direction at a time (rank 0 -> others, then back).
    n = MIB // 4
    base = base_values(r, n, f32, mod)
    for src in range(world):
        if rank == src:
            for dst in range(world):
                if dst != src:
                    dist.send(base + 13 * src, dst)
        else:
            got = torch.empty(n, device=r.dev, dtype=f32)
            dist.recv(got, src)
            r.sync()
            record(f"send/recv({src}->{rank})", f32, MIB, compare(got, base + 13 * src))

    # all_reduce over other dtypes and ops at 1 MiB (moduli keep every sum exact and in range).
    moduli = {
        torch.uint8: 100, torch.int8: 50, torch.bfloat16: 100, torch.float16: 1000,
        torch.int32: mod, torch.int64: mod, torch.float64: mod,
    }
    for dtype, m in moduli.items():
        elem = torch.empty((), dtype=dtype).element_size()
        n = MIB // elem
        b = base_values(r, n, dtype, m)
        x = b + rank
        dist.all_reduce(x)
        record("all_reduce(sum)", dtype, MIB, compare(x, b * world + rank_sum))
    n = MIB // 4
    b = base_values(r, n, f32, mod)
    x = b + 7 * rank
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    record("all_reduce(max)", f32, MIB, compare(x, b + 7 * (world - 1)))
    x = b + 7 * rank
    dist.all_reduce(x, op=dist.ReduceOp.MIN)
    record("all_reduce(min)", f32, MIB, compare(x, b))
    x = b * 2 + rank  # AVG of b*2+i over i: b*2 + (world-1)/2, exact for world=2 (x.5).
    dist.all_reduce(x, op=dist.ReduceOp.AVG)
    record("all_reduce(avg)", f32, MIB, compare(x, b * 2 + (world - 1) / 2))
    r.sync()
    seconds = time.perf_counter() - t_start

    gathered = [None] * world
    dist.all_gather_object(gathered, {"cases": cases, "failures": failures})
    all_failures = [f for g in gathered for f in g["failures"]]
    total_cases = sum(g["cases"] for g in gathered)
    if rank == 0:
        emit({
            "phase": "check",
            "ok": not all_failures,
            "cases": total_cases,
            "failures": all_failures[:20],
            "n_failures": len(all_failures),
            "min_bytes": sizes[0],
            "max_bytes": sizes[-1],
            "seconds": round(seconds, 3),
        })
    return not all_failures


def phase_ddp(r, args):
    torch, dist = r.torch, r.dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(args.seed)
    model = nn.Sequential(
        nn.Linear(64, 128), nn.Tanh(),
        nn.Linear(128, 128), nn.Tanh(),
        nn.Linear(128, 1),
    ).to(r.dev)
    # Small buckets: several all_reduces per step, overlapping the backward pass.
    ddp = DDP(model, device_ids=[r.dev.index], bucket_cap_mb=0.03)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(args.seed + 1000 + r.rank)
    losses = []
    for _ in range(args.ddp_steps):
        x = torch.randn(32, 64, generator=gen).to(r.dev)
        y = torch.sin(x.sum(dim=1, keepdim=True))
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    flat = torch.cat([p.detach().flatten().double() for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(r.world)]
    dist.all_gather(everyone, flat)
    in_sync = all(bool(torch.equal(everyone[0], e)) for e in everyone[1:])
    mine = torch.tensor(losses, dtype=torch.float64, device=r.dev)
    all_losses = [torch.empty_like(mine) for _ in range(r.world)]
    dist.all_gather(all_losses, mine)
    finite = all(math.isfinite(v) for t in all_losses for v in t.tolist())
    if r.rank == 0:
        emit({
            "phase": "ddp",
            "ok": in_sync and finite,
            "steps": args.ddp_steps,
            "losses": [t.tolist() for t in all_losses],
            "param_sum": float(flat.sum().item()),
            "param_abs_sum": float(flat.abs().sum().item()),
            "in_sync": in_sync,
        })
    return in_sync and finite


def phase_bw(r, args):
    torch, dist = r.torch, r.dist
    world = r.world
    results = []
    ok_all = True
    for mib in args.bw_sizes_mib:
        nbytes = mib * MIB
        n = nbytes // 4
        t = torch.ones(n, device=r.dev, dtype=torch.float32)
        warm = 5 if mib <= 1 else 3 if mib <= 16 else 2
        r.sync()
        t0 = time.perf_counter()
        for _ in range(warm):
            dist.all_reduce(t)
        r.sync()
        est = torch.tensor([(time.perf_counter() - t0) / warm], device=r.dev, dtype=torch.float64)
        dist.all_reduce(est, op=dist.ReduceOp.MAX)
        # Same iteration count on every rank: from the reduced estimate, ~args.bw_seconds each.
        iters = int(min(args.bw_max_iters, max(3, round(args.bw_seconds / max(est.item(), 1e-6)))))
        align = torch.zeros(1, device=r.dev)
        dist.all_reduce(align)
        r.sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        r.sync()
        dt = torch.tensor([time.perf_counter() - t0], device=r.dev, dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        # In-place SUM of ones repeated k times leaves world**k in every element (exact: k < 128).
        k = warm + iters
        correct = bool((t == float(world) ** k).all().item())
        ok_all &= correct
        per_iter = dt.item() / iters
        algbw = nbytes / per_iter / 1e9
        results.append({
            "bytes": nbytes,
            "iters": iters,
            "time_us": round(per_iter * 1e6, 1),
            "algbw_GBps": round(algbw, 4),
            "busbw_GBps": round(algbw * 2 * (world - 1) / world, 4),
            "correct": correct,
        })
        del t
    if r.rank == 0:
        emit({"phase": "bw", "ok": ok_all, "world": world, "results": results})
    return ok_all


def cmd_run(args):
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # NCCL reads NCCL_HOSTID once, when it first hashes the host: set it before any NCCL call.
    if not os.environ.get("NCCL_HOSTID"):
        os.environ["NCCL_HOSTID"] = f"{args.hostid_prefix}{rank}"
    # Deterministic cuBLAS, needed by torch.use_deterministic_algorithms; before CUDA starts.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    import datetime

    import torch
    import torch.distributed as dist

    phases = [p for p in args.phases.split(",") if p]
    unknown = set(phases) - {"check", "ddp", "bw"}
    if unknown:
        print(f"unknown phases: {sorted(unknown)}", file=sys.stderr)
        return 2
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    dev = torch.device("cuda", args.device)
    torch.cuda.set_device(dev)
    dist.init_process_group(
        "nccl", rank=rank, world_size=world, device_id=dev,
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    r = Rank(torch, dist, rank, world, dev)
    if rank == 0:
        emit({
            "phase": "env",
            "torch": torch.__version__,
            "nccl": ".".join(str(v) for v in torch.cuda.nccl.version()),
            "gpu": torch.cuda.get_device_name(dev),
            "world": world,
            "hostid": os.environ.get("NCCL_HOSTID"),
            "net_plugin": os.environ.get("NCCL_NET_PLUGIN"),
            "net": os.environ.get("NCCL_NET"),
            "erdma_transport": os.environ.get("NCCL_ERDMA_TRANSPORT"),
        })
    ok = True
    for phase in phases:
        t0 = time.perf_counter()
        try:
            good = {"check": phase_check, "ddp": phase_ddp, "bw": phase_bw}[phase](r, args)
        except Exception as e:  # report and stop: a broken communicator hangs later phases
            traceback.print_exc()
            if rank == 0:
                emit({"phase": phase, "ok": False, "error": f"{type(e).__name__}: {e}"})
            print(f"rank {rank}: phase {phase} raised; exiting", file=sys.stderr, flush=True)
            os._exit(1)
        print(f"rank {rank}: phase {phase} {'ok' if good else 'FAILED'} "
              f"in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        ok &= good
    dist.destroy_process_group()
    if rank == 0:
        emit({"phase": "done", "ok": ok})
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------
# report: compare the plugin run with the Socket baseline
# ---------------------------------------------------------------------------------------------


def parse_results(path):
    """{phase: last result} from the E2E-RESULT lines of one rank's stdout; {} when unreadable."""
    out = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(PREFIX):
                    try:
                        obj = json.loads(line[len(PREFIX):])
                    except ValueError:
                        continue
                    if isinstance(obj, dict) and "phase" in obj:
                        out[obj["phase"]] = obj
    except OSError:
        pass
    return out


def report(plugin_path, baseline_path, target, loss_atol, out=print):
    """Prints PASS/FAIL/INFO lines; returns the number of FAIL lines."""
    fails = 0

    def res(ok, msg):
        nonlocal fails
        if not ok:
            fails += 1
        out(("PASS " if ok else "FAIL ") + msg)

    def info(msg):
        out("INFO " + msg)

    p = parse_results(plugin_path)
    b = parse_results(baseline_path) if baseline_path else {}
    if "env" in p:
        e = p["env"]
        info(f"plugin run: torch {e.get('torch')} NCCL {e.get('nccl')} on {e.get('gpu')}, "
             f"{e.get('world')} ranks, transport {e.get('erdma_transport')}")

    # Collective correctness (plugin run only).
    c = p.get("check")
    if c is None:
        res(False, "collectives: no result from the plugin run")
    elif "error" in c:
        res(False, f"collectives: raised {c['error']}")
    else:
        span = f"{human(c.get('min_bytes', 0))} .. {human(c.get('max_bytes', 0))}"
        if c.get("ok"):
            res(True, f"collectives: {c.get('cases')} cases exact over {span} "
                      f"({c.get('seconds')} s)")
        else:
            res(False, f"collectives: {c.get('n_failures')} of {c.get('cases')} cases wrong "
                       f"over {span}")
            for f in c.get("failures", [])[:10]:
                info(f"  {f}")

    # DDP: in sync on each run, and the same losses on both.
    pd, bd = p.get("ddp"), b.get("ddp")
    for name, d in (("plugin", pd), ("Socket", bd)):
        if d is None:
            res(False, f"DDP ({name} run): no result")
        elif "error" in d:
            res(False, f"DDP ({name} run): raised {d['error']}")
        else:
            res(bool(d.get("in_sync")) and bool(d.get("ok")),
                f"DDP ({name} run): {d.get('steps')} steps, parameters "
                f"{'identical' if d.get('in_sync') else 'DIFFER'} on every rank")
    if pd and bd and "losses" in pd and "losses" in bd:
        lp, lb = pd["losses"], bd["losses"]
        if [len(x) for x in lp] != [len(x) for x in lb] or not lp:
            res(False, f"DDP losses: shapes differ ({[len(x) for x in lp]} vs "
                       f"{[len(x) for x in lb]})")
        else:
            diffs = [abs(a - c) for ra, rb in zip(lp, lb) for a, c in zip(ra, rb)]
            worst = max(diffs) if diffs else 0.0
            good = all(math.isfinite(d) for d in diffs) and worst <= loss_atol
            res(good, f"DDP losses match the Socket run: max abs diff {worst:.3g} over "
                      f"{len(diffs)} values (tolerance {loss_atol:g}); param sum "
                      f"{pd.get('param_sum')!r} vs {bd.get('param_sum')!r}")
            info(f"  plugin rank 0 losses: {', '.join(f'{v:.6f}' for v in lp[0])}")
    else:
        res(False, "DDP losses: nothing to compare (a run gave no losses)")

    # Bandwidth: each run's all_reduce results right; the ratio table (a target, not a failure).
    pb, bb = p.get("bw"), b.get("bw")
    for name, d in (("plugin", pb), ("Socket", bb)):
        if d is None:
            res(False, f"bandwidth ({name} run): no result")
        elif "error" in d:
            res(False, f"bandwidth ({name} run): raised {d['error']}")
        else:
            res(all(x.get("correct") for x in d.get("results", [])) and bool(d.get("results")),
                f"bandwidth ({name} run): all_reduce results correct at "
                f"{', '.join(human(x['bytes']) for x in d.get('results', []))}")
    if pb and "results" in pb:
        base = {x["bytes"]: x for x in (bb or {}).get("results", [])}
        info("all_reduce bus bandwidth, 2 ranks (GB/s):")
        info(f"  {'size':>8}  {'erdma':>9}  {'Socket':>9}  {'ratio':>6}  target >= {target:g}")
        below = compared = 0
        for x in pb["results"]:
            y = base.get(x["bytes"])
            if y and y.get("busbw_GBps"):
                ratio = x["busbw_GBps"] / y["busbw_GBps"]
                verdict = "PASS" if ratio >= target else "BELOW TARGET"
                below += ratio < target
                compared += 1
                info(f"  {human(x['bytes']):>8}  {x['busbw_GBps']:9.3f}  "
                     f"{y['busbw_GBps']:9.3f}  {ratio:6.2f}  {verdict}")
            else:
                info(f"  {human(x['bytes']):>8}  {x['busbw_GBps']:9.3f}  {'-':>9}  {'-':>6}  "
                     f"no baseline")
        if not compared:
            verdict = "not compared (no baseline result)"
        elif below:
            verdict = f"below at {below} of {compared} size(s)"
        else:
            verdict = f"met at every size ({compared})"
        info(f"bandwidth target: {verdict} (reported, not a failure)")
    return fails


def cmd_report(args):
    fails = report(args.plugin, args.baseline, args.target, args.loss_atol)
    return 1 if fails else 0


# ---------------------------------------------------------------------------------------------
# selftest: the report logic on canned results
# ---------------------------------------------------------------------------------------------


def canned(losses, in_sync=True, check_ok=True, busbw=(1.0, 2.0, 3.0), correct=True):
    lines = [
        {"phase": "env", "torch": "2.11.0", "nccl": "2.28.9", "gpu": "NVIDIA H200", "world": 2,
         "erdma_transport": "tcp"},
        {"phase": "check", "ok": check_ok, "cases": 168, "n_failures": 0 if check_ok else 1,
         "failures": [] if check_ok else ["rank 1: all_gather float32 4 MiB: 1 of 2097152 "
                                          "elements differ; first at 7: got 0.0 want 7.0"],
         "min_bytes": 4, "max_bytes": 256 * MIB, "seconds": 3.2},
        {"phase": "ddp", "ok": in_sync, "steps": len(losses[0]), "losses": losses,
         "param_sum": 1.5, "param_abs_sum": 99.0, "in_sync": in_sync},
        {"phase": "bw", "ok": correct, "world": 2, "results": [
            {"bytes": m * MIB, "iters": 5, "time_us": 1.0, "algbw_GBps": v, "busbw_GBps": v,
             "correct": correct} for m, v in zip((1, 16, 256), busbw)]},
        {"phase": "done", "ok": True},
    ]
    return "noise before\n" + "".join(PREFIX + json.dumps(x) + "\n" for x in lines) + "trailing\n"


def cmd_selftest(_args):
    losses = [[0.5, 0.4, 0.3], [0.6, 0.5, 0.45]]
    off = [[0.5, 0.4, 0.3], [0.6, 0.5, 0.4501]]
    cases = [
        # name, plugin text, baseline text, expected FAIL count
        ("all good", canned(losses), canned(losses, busbw=(1.2, 2.0, 2.0)), 0),
        ("loss mismatch", canned(off), canned(losses), 1),
        ("collective wrong + ranks out of sync", canned(losses, check_ok=False, in_sync=False),
         canned(losses), 2),
        ("bw result wrong", canned(losses, correct=False), canned(losses), 1),
        ("baseline missing", canned(losses), "", 3),
        ("plugin run empty", "", canned(losses), 4),
    ]
    bad = 0
    with tempfile.TemporaryDirectory() as d:
        for i, (name, ptxt, btxt, want) in enumerate(cases):
            pp, bp = os.path.join(d, f"p{i}"), os.path.join(d, f"b{i}")
            for path, txt in ((pp, ptxt), (bp, btxt)):
                with open(path, "w", encoding="utf-8") as f:
                    f.write(txt)
            lines = []
            got = report(pp, bp, 1.0, 1e-6, out=lines.append)
            ok = got == want
            if name == "all good":
                # The ratio table must show the below-target size without failing.
                ok &= any("BELOW TARGET" in x for x in lines) and any(
                    x.startswith("INFO ") and "PASS" in x for x in lines)
            bad += not ok
            print(f"selftest {'ok ' if ok else 'BAD'}: {name}: {got} FAIL line(s), expected {want}")
            if not ok:
                for x in lines:
                    print("    " + x)
    return 1 if bad else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the per-rank program")
    r.add_argument("--phases", default="check,ddp,bw")
    r.add_argument("--device", type=int, default=0, help="CUDA device of every rank")
    r.add_argument("--timeout", type=int, default=120, help="process group timeout, seconds")
    r.add_argument("--hostid-prefix", default="gpu-e2e-host",
                   help="NCCL_HOSTID is this plus the rank when the launcher left it unset")
    r.add_argument("--min-bytes", type=int, default=4)
    r.add_argument("--max-bytes", type=int, default=256 * MIB)
    r.add_argument("--ddp-steps", type=int, default=8)
    r.add_argument("--seed", type=int, default=1234)
    r.add_argument("--bw-sizes-mib", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 16, 256])
    r.add_argument("--bw-seconds", type=float, default=1.5,
                   help="aim for this long a timed window per size")
    r.add_argument("--bw-max-iters", type=int, default=40)
    rep = sub.add_parser("report", help="compare the plugin run with the Socket baseline")
    rep.add_argument("--plugin", required=True, help="rank 0 stdout of the plugin run")
    rep.add_argument("--baseline", default="", help="rank 0 stdout of the Socket run")
    rep.add_argument("--target", type=float, default=1.0, help="bus bandwidth ratio target")
    rep.add_argument("--loss-atol", type=float, default=1e-6)
    sub.add_parser("selftest", help="the report logic on canned results (no GPU, no torch)")
    args = ap.parse_args(argv)
    if args.cmd == "run":
        if args.bw_max_iters + 5 >= 120:
            ap.error("--bw-max-iters must stay below 115 (world**k must stay exact)")
        return cmd_run(args)
    if args.cmd == "report":
        return cmd_report(args)
    return cmd_selftest(args)


if __name__ == "__main__":
    sys.exit(main())
