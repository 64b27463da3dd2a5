#!/usr/bin/env python3
"""Where the instructions of one kind of call go, per machine instruction and per source line.

  scripts/perf/cost-annotate.py PROFILE [FUNCTION-REGEX] [--lib LIB] [--calls N] [--lines]

PROFILE is one of the callgrind profiles scripts/perf/cpu-cost.sh leaves (target/perf/cpu-cost/
<transport>/callgrind.*.out.N: 2 accepted isend, 3 irecv, 4 test completing the send, 5 test
completing the receive, 6 idle isend, 7 idle test; see its script.txt). They hold instruction
positions (--dump-instr=yes) and the library's addresses are its file's, so the library built
for that run (--lib, default target/release/libnccl-net-erdma.so) disassembles them.

Prints the plugin's instructions per call by function; then, for each function whose
demangled name matches FUNCTION-REGEX, its disassembly with the instructions per call of each
executed instruction and its source lines (objdump -l), or with --lines the instructions per
call summed by source line. Every figure is divided by --calls (default 256, the calls of one
phase of scripts/perf/cpu-cost.sh at its defaults; times CPU_COST_WINDOW when that was set).
"""

import argparse
import collections
import re
import signal
import subprocess
import sys


def read_profile(path, obj):
    """Instructions per address, and each address's function, of the object matching obj."""
    cost = collections.Counter()
    function = {}
    ob = fn = None
    skip_next = False
    with open(path) as f:
        for line in f:
            if line.startswith("ob="):
                ob = line[3:].strip()
            elif line.startswith("fn="):
                fn = line[3:].strip()
            elif line.startswith("calls="):
                # The next cost line is the call's inclusive cost, not the caller's own.
                skip_next = True
            elif line.startswith("0x"):
                if skip_next:
                    skip_next = False
                    continue
                if ob and obj in ob:
                    addr, _line, ir = line.split()[:3]
                    cost[int(addr, 16)] += int(ir)
                    function[int(addr, 16)] = fn
    return cost, function


def disassemble(lib):
    """(function, [(address, text) or (None, source line)]) for every function of lib."""
    out = subprocess.run(
        ["objdump", "-d", "-l", "-C", "--no-show-raw-insn", lib],
        capture_output=True, text=True, check=True,
    ).stdout
    current = None
    for line in out.splitlines():
        head = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if head:
            if current:
                yield current
            current = (head.group(1), [])
            continue
        if current is None:
            continue
        insn = re.match(r"^\s+([0-9a-f]+):\s+(.*)$", line)
        if insn:
            current[1].append((int(insn.group(1), 16), insn.group(2)))
        elif line.startswith("/") and ":" in line:
            current[1].append((None, line.split("/src/")[-1]))
    if current:
        yield current


def main():
    # Piped into head: stop quietly.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("profile")
    p.add_argument("function", nargs="?")
    p.add_argument("--lib", default="target/release/libnccl-net-erdma.so")
    p.add_argument("--calls", type=int, default=256)
    p.add_argument("--lines", action="store_true", help="sum by source line")
    a = p.parse_args()

    cost, function = read_profile(a.profile, "nccl-net-erdma")
    if not cost:
        sys.exit(f"cost-annotate: no instructions of the plugin in {a.profile}")
    per_fn = collections.Counter()
    for addr, ir in cost.items():
        per_fn[function[addr]] += ir
    print(f"{sum(cost.values()) / a.calls:8.1f}  the plugin's own code, per call")
    for fn, ir in per_fn.most_common(20):
        print(f"{ir / a.calls:8.1f}  {fn}")
    if not a.function:
        return
    want = re.compile(a.function)
    for name, body in disassemble(a.lib):
        if not want.search(name):
            continue
        print(f"\n== {name}")
        by_line = collections.Counter()
        source = None
        for addr, text in body:
            if addr is None:
                source = text
                if not a.lines:
                    print(f"          ## {text}")
                continue
            ir = cost.get(addr, 0) / a.calls
            by_line[source] += ir
            if not a.lines and ir > 0:
                print(f"{ir:8.1f}  {addr:x}: {text}")
        if a.lines:
            for src, ir in by_line.most_common():
                if ir >= 0.5:
                    print(f"{ir:8.1f}  {src}")
        print(f"{sum(by_line.values()):8.1f}  in all")


if __name__ == "__main__":
    main()
