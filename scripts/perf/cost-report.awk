# The report of scripts/perf/cpu-cost.sh: instructions per call of each kind of plugin call, from
# the profiles of one scripted run (scripts/perf/cost-runs.sh), one profile per phase and
# each phase counting exactly one kind of call. Usage:
#
#   awk -v name='tcp (host, loopback)' -v transport=tcp -v root=/repo -v csv=FILE -v library=NAME \
#       -f cost-report.awk \
#       tag=S script.txt tag=1 part.1.tsv tag=2 part.2.tsv ...
#
# script.txt: the bench's `script` lines (the run's settings, then per phase attempt
# `script-phase n=N bin=B ... outcome_calls=C misses=M kept=yes|no`); part.N.tsv:
# scripts/perf/callgrind-sum.awk's sums of profile N. Every figure is a phase's
# instructions divided by the calls it counted: nothing is estimated or subtracted.
#
# Calls of other functions during the counted calls (allocations, lock slow paths, libc's
# syscall wrappers) are the executions of each function's first instruction (entry:*), which
# callgrind counts only while collecting, as it does instructions; its call counts (calls=)
# also count calls made while not collecting, so they are not used.

BEGIN {
  FS = "\t"
  nbins = split("isend irecv test_send test_recv isend_idle test_recv_idle", bins, " ")
  label["isend"] = "isend, accepted (sender)"
  label["irecv"] = "irecv, accepted (receiver)"
  label["test_send"] = "test completing the send (sender)"
  label["test_recv"] = "test completing the receive (receiver)"
  label["isend_idle"] = "isend, idle: NULL (sender)"
  label["test_recv_idle"] = "test, idle: not done (receiver)"
  nwork = split("isend irecv test_send test_recv", workbins, " ")
}

# The bench's `script` lines: `word key=value ...`.
tag == "S" {
  nw = split($0, w, " ")
  delete kv
  for (i = 2; i <= nw; i++) {
    eq = index(w[i], "=")
    if (eq) kv[substr(w[i], 1, eq - 1)] = substr(w[i], eq + 1)
  }
  if (w[1] == "script") {
    for (k in kv) hdr[k] = kv[k]
  } else if (w[1] == "script-phase") {
    b = kv["bin"]
    attempts[b]++
    if (kv["kept"] == "yes") {
      part[b] = kv["n"]; calls[b] = kv["outcome_calls"] + 0; misses[b] = kv["misses"] + 0
      other[b] = kv["other_misses"] + 0
    } else {
      rerun++
    }
  }
  next
}
{ v[tag, $1] = $2; keys[$1] = 1 }

# Per call of `bin`: the phase's count of `key` over the calls it counted.
function pc(bin, key) { return calls[bin] ? v[part[bin], key] / calls[bin] : 0 }
# Per message: the four calls of the work.
function work(key,    i, s) {
  s = 0
  for (i = 1; i <= nwork; i++) s += pc(workbins[i], key)
  return s
}
function short(path) {
  if (root != "" && index(path, root "/") == 1) path = substr(path, length(root) + 2)
  sub(/^\/rustc\/[0-9a-f]+\/library\//, "std:", path)
  sub(/^.*\/\.cargo\/registry\/src\/[^\/]+\//, "crate:", path)
  return path
}
function row(lbl, ncalls, nmiss, p, l, vb, d, al, sl) {
  printf "  %-40s %5s %4s %7.0f %6.0f %6.0f %6.0f %6.2f %5.2f\n", lbl, ncalls, nmiss, p, l, vb, d, al, sl
}
function csvrow(fig, ncalls, nmiss, p, l, vb, d, al, sl) {
  if (csv == "") return
  printf "%s,%s,%s,%s,%s,%.0f,%.0f,%.0f,%.0f,%.4f,%.4f,%s\n", transport, hdr["window"], fig, ncalls, nmiss, p, l, vb, d, al, sl, library >> csv
}
# Every figure of one kind of call (or, for "work", per message) into the table and the CSV.
function figure(b, lbl) {
  if (b == "work") {
    p = work("obj:plugin"); l = work("obj:libc"); vb = work("obj:verbs"); d = work("obj:bench")
    al = work("entry-alloc:all"); sl = work("entry-slowlock:all"); nc = ""; nm = ""
  } else {
    p = pc(b, "obj:plugin"); l = pc(b, "obj:libc"); vb = pc(b, "obj:verbs"); d = pc(b, "obj:bench")
    al = pc(b, "entry-alloc:all"); sl = pc(b, "entry-slowlock:all"); nc = calls[b]; nm = misses[b]
  }
  if (b != "work" && nc == 0) {
    printf "  %-40s %5s %4s %7s %6s %6s %6s %6s %5s\n", lbl, 0, "-", "-", "-", "-", "-", "-", "-"
    return
  }
  row(lbl, nc, nm, p, l, vb, d, al, sl)
  csvrow(b == "work" ? "work_per_message" : b, nc, nm, p, l, vb, d, al, sl)
}
# The `n` functions or lines (keys starting with `prefix`) of the plugin with the most
# self Ir, per call of each kind (work: per message), sorted by work + idle calls.
function top(prefix, n, what,    k, i, j, cnt, key, t, val, lbl, fn) {
  cnt = 0
  for (k in keys) {
    if (index(k, prefix) != 1) continue
    val = work(k) + pc("isend_idle", k) + pc("test_recv_idle", k)
    if (val < 0.5) continue
    cnt++; key[cnt] = k; t[cnt] = val
  }
  for (i = 2; i <= cnt; i++) {            # insertion sort, largest first
    for (j = i; j > 1 && t[j] > t[j - 1]; j--) {
      val = t[j]; t[j] = t[j - 1]; t[j - 1] = val
      val = key[j]; key[j] = key[j - 1]; key[j - 1] = val
    }
  }
  if (what == "fn") {
    printf "  %7s %7s %7s %7s %7s %7s %7s  %s\n", "work", "isend", "irecv", "test_s", "test_r", "isend0", "test0", "function"
  } else {
    printf "  %7s %7s %7s  %s\n", "work", "isend0", "test0", "file:line  (function)"
  }
  for (i = 1; i <= cnt && i <= n; i++) {
    k = key[i]
    lbl = substr(k, length(prefix) + 1)
    if (what == "fn") {
      printf "  %7.1f %7.1f %7.1f %7.1f %7.1f %7.1f %7.1f  %s\n", work(k), pc("isend", k), pc("irecv", k), pc("test_send", k), pc("test_recv", k), pc("isend_idle", k), pc("test_recv_idle", k), lbl
    } else {
      fn = ""
      for (j = 1; j <= nbins && fn == ""; j++) if (bins[j] in part) fn = v[part[bins[j]], "pline_fn:" lbl]
      printf "  %7.1f %7.1f %7.1f  %s  (%s)\n", work(k), pc("isend_idle", k), pc("test_recv_idle", k), short(lbl), fn
    }
  }
}

END {
  for (i = 1; i <= nbins; i++) {
    if (!(bins[i] in part)) {
      printf "cost-report: no kept phase for %s in the bench's output\n", bins[i] > "/dev/stderr"
      bad = 1
    }
  }
  if (bad) exit 1
  printf "\n== %s: instructions per call, scripted run\n", name
  printf "  %s-byte messages, %s per round, %s idle isend(s) and %s idle test(s) per message, %s rounds per\n", hdr["size"], hdr["window"], hdr["idle"], hdr["idle"], hdr["rounds"]
  printf "  phase, one phase per kind of call, waits for the network %s us, %d idle connection pair(s)\n", hdr["wait_us"] + 0, hdr["idle_comms"] + 0
  printf "  open beside the measured one. Each figure: the phase's Ir\n"
  printf "  (callgrind, user space) or function entries / the calls it counted, all with the outcome named.\n"
  printf "  %-40s %5s %4s %7s %6s %6s %6s %6s %5s\n", "kind of call", "calls", "miss", "plugin", "libc", "verbs", "driver", "allocs", "locks"
  for (i = 1; i <= nbins; i++) {
    b = bins[i]
    figure(b, label[b])
    if (b == "test_recv") figure("work", "WORK PER MESSAGE, both sides: the 4 above")
  }
  printf "  plugin: its own code (%s, with what is compiled into it); libc, verbs\n", (library == "" ? "libnccl_net_erdma.so" : library)
  printf "  (libibverbs + provider): called by it; driver: the bench's client code around the call;\n"
  printf "  allocs: calls of malloc & co.; locks: lock slow paths (parking_lot *_slow, park, futex).\n"
  for (i = 1; i <= nbins; i++) {
    b = bins[i]
    if (misses[b] > 0) printf "  WARNING: the %s phase kept %d miss(es): its figure includes %d call(s) that found the network not ready\n", b, misses[b], misses[b]
  }
  printf "  phases rerun after a miss: %d; misses in calls not counted: %d\n", rerun + 0, othermiss()
  printf "  functions of other libraries the plugin calls, calls per call (work: per message):\n"
  printf "  %7s %7s %7s %7s %7s %7s %7s  %s\n", "work", "isend", "irecv", "test_s", "test_r", "isend0", "test0", "library:function"
  for (k in keys) {
    if (k !~ /^out:.*:ir$/) continue
    nm = substr(k, 5, length(k) - 7)
    e = "entry:" nm
    if (work(e) + pc("isend_idle", e) + pc("test_recv_idle", e) < 0.005) continue
    printf "  %7.2f %7.2f %7.2f %7.2f %7.2f %7.2f %7.2f  %s\n", work(e), pc("isend", e), pc("irecv", e), pc("test_send", e), pc("test_recv", e), pc("isend_idle", e), pc("test_recv_idle", e), nm
  }
  printf "  hot functions of the plugin, self Ir per call (work: per message, the four calls;\n"
  printf "  isend0/test0: the idle isend and the idle test):\n"
  top("pfn:", 16, "fn")
  printf "  hot source lines of the plugin (same columns):\n"
  top("pline:", 20, "line")
}

function othermiss(    i, s) {
  s = 0
  for (i = 1; i <= nbins; i++) s += other[bins[i]]
  return s
}
