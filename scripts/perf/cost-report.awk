# The report of scripts/cpu-cost.sh: instructions per message from callgrind sums
# (scripts/perf/callgrind-sum.awk) of two runs that differ only in their message count, and
# the cost of idle calls from a third (the idle probe). Usage:
#
#   awk -v n1=2000 -v n2=4000 -v probe=4000 -v name=tcp -v root=/repo -v csv=FILE \
#       -f cost-report.awk tag=A1 A1.tsv tag=A2 A2.tsv tag=B1 B1.tsv tag=B2 B2.tsv \
#       tag=PA probeA.tsv tag=PB probeB.tsv tag=S1 stats1.tsv tag=S2 stats2.tsv
#
# A is the sending side, B the receiving one; 1 and 2 the runs with n1 and n2 messages.
# Every figure is (value at n2 - value at n1) / (n2 - n1): per message, with whatever the
# runs share (setup, first-call costs, the bench's one-off work) cancelled.

BEGIN { FS = "\t" }
{ v[tag, $1] = $2; keys[$1] = 1 }

function per(side, key) { return (v[side "2", key] - v[side "1", key]) / (n2 - n1) }
function both(key) { return per("A", key) + per("B", key) }
function short(path) {
  if (root != "" && index(path, root "/") == 1) path = substr(path, length(root) + 2)
  sub(/^\/rustc\/[0-9a-f]+\/library\//, "std:", path)
  sub(/^.*\/\.cargo\/registry\/src\/[^\/]+\//, "crate:", path)
  return path
}
function row(label, a, b) {
  printf "  %-48s %9.0f %9.0f %9.0f\n", label, a, b, a + b
}
# Work only: per message, less the idle calls at the probe's cost of `key` per idle call.
function work(side, key) {
  return per(side, key) - (side == "A" ? idle_a * v["PA", key] : idle_b * v["PB", key]) / probe
}
# Prints the `n` largest per-message work-only values of keys starting with `prefix` (both
# sides), with the as-measured value and each side's cost per idle call.
function top(prefix, n, what,    k, i, j, cnt, key, val, t, lbl, fn) {
  cnt = 0
  for (k in keys) {
    if (index(k, prefix) != 1) continue
    val = work("A", k) + work("B", k)
    if (val < 0.5 && both(k) < 0.5) continue
    cnt++; key[cnt] = k; t[cnt] = val
  }
  for (i = 2; i <= cnt; i++) {            # insertion sort, largest first
    for (j = i; j > 1 && t[j] > t[j - 1]; j--) {
      val = t[j]; t[j] = t[j - 1]; t[j - 1] = val
      val = key[j]; key[j] = key[j - 1]; key[j - 1] = val
    }
  }
  printf "  %8s %8s %7s %7s  %s\n", "work", "measured", "idleA", "idleB", (what == "line" ? "file:line  (function)" : "function")
  for (i = 1; i <= cnt && i <= n; i++) {
    lbl = substr(key[i], length(prefix) + 1)
    printf "  %8.1f %8.1f %7.1f %7.1f  ", t[i], both(key[i]), v["PA", key[i]] / probe, v["PB", key[i]] / probe
    if (what == "line") {
      fn = v["A2", "pline_fn:" lbl]; if (fn == "") fn = v["B2", "pline_fn:" lbl]
      printf "%s  (%s)\n", short(lbl), fn
    } else {
      printf "%s\n", lbl
    }
  }
}

function at2(side, key) { return v[side "2", key] / n2 }

END {
  d = n2 - n1
  # Calls each side made per message (the bench's own counts): in the difference of the two
  # runs, and in the N2 run alone.
  postA = per("S", "A:post"); nullA = per("S", "A:post_null")
  testA = per("S", "A:test"); idleA = per("S", "A:test_idle")
  postB = per("S", "B:post"); nullB = per("S", "B:post_null")
  testB = per("S", "B:test"); idleB = per("S", "B:test_idle")
  # Cost of one idle call, the plugin's own code (and libc under it), from the probe.
  c_isend = v["PA", "obj:plugin"] / probe; c_isend_libc = v["PA", "obj:libc"] / probe
  c_test = v["PB", "obj:plugin"] / probe; c_test_libc = v["PB", "obj:libc"] / probe
  c_isend_verbs = v["PA", "obj:verbs"] / probe; c_test_verbs = v["PB", "obj:verbs"] / probe

  pa = per("A", "obj:plugin"); pb = per("B", "obj:plugin")
  # Idle calls: A's NULL isends and idle tests at the idle-isend cost (both are a lock, a
  # progress poll and a check); B's idle tests and NULL irecvs at the idle-test cost.
  idle_a = nullA + idleA; idle_b = idleB + nullB
  ia = (nullA + idleA) * c_isend; ib = (idleB + nullB) * c_test
  ia_l = (nullA + idleA) * c_isend_libc; ib_l = (idleB + nullB) * c_test_libc
  ia_v = (nullA + idleA) * c_isend_verbs; ib_v = (idleB + nullB) * c_test_verbs

  printf "\n== %s: instructions per 8-byte message (callgrind Ir, user space)\n", name
  printf "  per message = (Ir(%d messages) - Ir(%d messages)) / %d, unless marked 'N2 run'\n", n2, n1, d
  printf "  %-48s %9s %9s %9s\n", "", "sender", "receiver", "both"
  row("plugin's own code, as measured", pa, pb)
  row("  of which idle polls (probe cost x calls)", ia, ib)
  row("plugin's own code, WORK ONLY (no idle polls)", pa - ia, pb - ib)
  row("plugin's own code, N2 run: Ir / N2", at2("A", "obj:plugin"), at2("B", "obj:plugin"))
  row("libc under the plugin, as measured", per("A", "obj:libc"), per("B", "obj:libc"))
  row("libc under the plugin, work only", per("A", "obj:libc") - ia_l, per("B", "obj:libc") - ib_l)
  row("libibverbs + provider, as measured", per("A", "obj:verbs"), per("B", "obj:verbs"))
  row("libibverbs + provider, work only", per("A", "obj:verbs") - ia_v, per("B", "obj:verbs") - ib_v)
  row("benchmark's own loop (not the plugin)", per("A", "obj:bench"), per("B", "obj:bench"))
  printf "  %-48s %9s %9s %9s %9s\n", "calls per message (the bench's counts)", "sender", "(N2 run)", "receiver", "(N2 run)"
  printf "  %-48s %9.2f %9.2f %9.2f %9.2f\n", "  isend / irecv, accepted or NULL", postA, v["S2", "A:post"] / n2, postB, v["S2", "B:post"] / n2
  printf "  %-48s %9.2f %9.2f %9.2f %9.2f\n", "    of which NULL (not now: idle)", nullA, v["S2", "A:post_null"] / n2, nullB, v["S2", "B:post_null"] / n2
  printf "  %-48s %9.2f %9.2f %9.2f %9.2f\n", "  test", testA, v["S2", "A:test"] / n2, testB, v["S2", "B:test"] / n2
  printf "  %-48s %9.2f %9.2f %9.2f %9.2f\n", "    of which not done (idle)", idleA, v["S2", "A:test_idle"] / n2, idleB, v["S2", "B:test_idle"] / n2
  printf "  one idle call (probe, %d calls), Ir of plugin/libc/verbs: NULL isend %.0f/%.0f/%.0f, idle test %.0f/%.0f/%.0f\n", probe, c_isend, c_isend_libc, c_isend_verbs, c_test, c_test_libc, c_test_verbs
  printf "  plugin entry points (per message: calls, inclusive Ir per call incl. libc/verbs):\n"
  for (k in keys) {
    if (k !~ /^ent:.*:calls$/) continue
    base = substr(k, 1, length(k) - 6)
    nm = substr(base, 5); sub(/^nccl_net_erdma::abi::tables::/, "", nm)
    for (s = 0; s < 2; s++) {
      side = s ? "B" : "A"
      c = per(side, k)
      if (c < 0.01) continue
      printf "    %-8s %-12s %6.2f calls, %7.0f Ir/call\n", (side == "A" ? "sender" : "receiver"), nm, c, per(side, base ":ir") / c
    }
  }
  printf "  calls from the plugin into other libraries, per message (both sides):\n"
  n = 0
  for (k in keys) {
    if (k !~ /^out:.*:calls$/) continue
    c = both(k)
    if (c < 0.01) continue
    nm = substr(k, 5, length(k) - 10)
    printf "    %-60s %6.2f\n", nm, c
  }
  alloc_p = both("alloc:plugin:calls"); alloc_all = 0; free_all = 0
  for (k in keys) {
    if (k ~ /^alloc:/) alloc_all += both(k)
    if (k ~ /^free:/) free_all += both(k)
  }
  slow = 0
  for (k in keys) if (k ~ /^slowlock:/) slow += both(k)
  printf "  allocations per message: %.4f by the plugin, %.4f in all (frees %.4f)\n", alloc_p, alloc_all, free_all
  printf "  lock slow paths (parking_lot *_slow, park, futex) per message: %.4f; syscall() from the plugin: %.4f\n", slow, both("syscall:plugin:calls")
  printf "  hot functions of the plugin: self Ir per message, both sides, work only and as measured;\n"
  printf "  idleA/idleB: the function's Ir per idle call of the sender/receiver (probe)\n"
  top("pfn:", 14, "fn")
  printf "  hot source lines of the plugin (same columns):\n"
  top("pline:", 22, "line")
  if (csv != "") {
    printf "%s,sender,%.0f,%.0f,%.0f,%.0f,%.2f,%.2f,%.2f,%.2f,%.4f\n", name, pa, pa - ia, per("A", "obj:libc"), per("A", "obj:verbs"), postA, nullA, testA, idleA, per("A", "alloc:plugin:calls") >> csv
    printf "%s,receiver,%.0f,%.0f,%.0f,%.0f,%.2f,%.2f,%.2f,%.2f,%.4f\n", name, pb, pb - ib, per("B", "obj:libc"), per("B", "obj:verbs"), postB, nullB, testB, idleB, per("B", "alloc:plugin:calls") >> csv
  }
}
