# Sums one callgrind output file (format 1, events Ir, positions `line` or `instr line`) by
# object and by function, for scripts/cpu-cost.sh. Usage:
#
#   awk -v plugin='libnccl[-_]net[-_]erdma' -f scripts/perf/callgrind-sum.awk callgrind.out.PID
#
# Prints `key<TAB>value` lines (summed over the whole file):
#   total                        every instruction collected
#   obj:CAT                      self Ir per object category: plugin (objects matching the
#                                `plugin` regex), bench, libc, verbs (libibverbs, providers),
#                                ld, other
#   pfn:FUNCTION                 self Ir of each function of the plugin object
#   pline:FILE:LINE              self Ir of each source line of the plugin object
#   pline_fn:FILE:LINE           (text) the function that line belongs to
#   ent:FUNCTION:calls|ir        calls from other objects into the plugin (its entry points)
#                                and their inclusive Ir
#   out:OBJECT:FUNCTION:calls|ir calls from the plugin into other objects (libc, verbs, ...),
#                                OBJECT being the file name of the callee's object
#   alloc:CALLERCAT:calls        calls of malloc/calloc/realloc/posix_memalign/aligned_alloc/
#                                memalign, by the caller's category
#   free:CALLERCAT:calls         calls of free/__rust_dealloc
#   slowlock:FUNCTION:calls      calls of lock slow paths (parking_lot *_slow, park, futex)
#   syscall:plugin:calls         calls of libc's syscall() from the plugin (futex waits/wakes)
# The `calls` above are callgrind's call counts, which count calls whether or not
# instructions were being collected (--toggle-collect): exact only for a profile that
# collected everything. With positions `instr line` (--dump-instr=yes) there are also
# counts of executions, which callgrind counts only while collecting:
#   entry:OBJECT:FUNCTION        executions of the first instruction (the lowest address
#                                executed) of each function outside the plugin and the
#                                bench (libc, verbs, ...) and of each lock slow path: the
#                                calls made while collecting
#   entry-alloc:all              the same summed over malloc & co. (allocations), and
#   entry-free:all, entry-slowlock:all, entry-syscall:all   over free, lock slow paths and
#                                syscall()
#
# The format: https://valgrind.org/docs/manual/cl-format.html. Names are compressed as
# "(id) name" once and "(id)" afterwards, with separate id spaces for objects (ob, cob),
# files (fl, fi, fe, cfi, cfl, jfi) and functions (fn, cfn, jfn). A position is absolute
# or relative to the previous cost line ("+n", "-n", "*"), for each position column. The
# cost line after a `calls=` line is that call's inclusive cost, not the caller's own.
# `cob=` names the object of the next call only (else the caller's object).

function uncompress(space, s,    id, rest) {
  if (s ~ /^\([0-9]+\)/) {
    id = s
    sub(/\).*/, ")", id)
    rest = substr(s, length(id) + 1)
    sub(/^ /, "", rest)
    if (rest != "") {
      names[space, id] = rest
      return rest
    }
    return names[space, id]
  }
  return s
}

function category(o) {
  if (o ~ plugin) return "plugin"
  if (o ~ /nccl-net-bench/) return "bench"
  if (o ~ /\/libc\.so|\/libc-/) return "libc"
  if (o ~ /libibverbs|rdmav|librxe|libmlx|libefa|liberdma/) return "verbs"
  if (o ~ /ld-linux|\/ld\.so/) return "ld"
  return "other"
}

function add(k, v) {
  if (v != 0) acc[k] += v
}

function hex2num(h,    i, n) {
  n = 0
  h = tolower(h)
  for (i = 3; i <= length(h); i++) n = n * 16 + index("0123456789abcdef", substr(h, i, 1)) - 1
  return n
}

# Position column value `p` relative to `prev`.
function position(p, prev) {
  if (p ~ /^\+/) return prev + substr(p, 2)
  if (p ~ /^-/) return prev - substr(p, 2)
  if (p == "*") return prev
  if (p ~ /^0x/) return hex2num(p)
  return p + 0
}

# The functions whose calls are counted by their first instruction.
function counted_fn(o, f) {
  if (category(o) !~ /^(plugin|bench)$/) return 1
  return f ~ slowlock_re && f !~ /Once/
}

BEGIN {
  if (plugin == "") plugin = "libnccl[-_]net[-_]erdma"
  slowlock_re = "(lock|lock_shared|lock_exclusive|lock_upgradable|unlock|unlock_shared|unlock_exclusive)_slow|parking_lot_core::parking_lot::park|futex_(wait|wake)"
  alloc_re = "^(malloc|calloc|realloc|posix_memalign|aligned_alloc|memalign)$"
  instr = 0; addr = 0
  obj = ""; file = ""; fn = ""; line = 0
  pending = 0; incall = 0; cobj = ""; cfn = ""
}

/^#/ || /^[ \t]*$/ { next }

# Cost lines: the position(s) (absolute, +n, -n or *), then the Ir count (absent = 0).
/^[0-9+*-]/ {
  if (instr) {
    addr = position($1, addr)
    line = position($2, line)
    ir = (NF >= 3) ? $3 + 0 : 0
  } else {
    line = position($1, line)
    ir = (NF >= 2) ? $2 + 0 : 0
  }
  if (incall) {
    callee = (cobj != "") ? cobj : obj
    cc = category(callee); oc = category(obj)
    if (oc != "plugin" && cc == "plugin") {
      add("ent:" cfn ":calls", pending); add("ent:" cfn ":ir", ir)
    } else if (oc == "plugin" && cc != "plugin") {
      base = callee; sub(/.*\//, "", base)
      add("out:" base ":" cfn ":calls", pending); add("out:" base ":" cfn ":ir", ir)
    }
    # Allocations at their entry into libc (Rust's allocator shims end there too), by the
    # caller's object: the plugin's own Rust code calls malloc from its copy of std.
    if (cfn ~ alloc_re) add("alloc:" oc ":calls", pending)
    if (cfn ~ /^(free|cfree)$/) add("free:" oc ":calls", pending)
    # Lock slow paths: parking_lot's (contended) and the futex calls under them; a Once
    # (one-time initialisation) is not a lock.
    if (cfn ~ slowlock_re && cfn !~ /Once/) add("slowlock:" cfn ":calls", pending)
    if (oc == "plugin" && cfn == "syscall") add("syscall:plugin:calls", pending)
    pending = 0; incall = 0; cobj = ""
    next
  }
  if (instr && ir > 0 && counted_fn(obj, fn)) {
    # The lowest address executed in a function is its entry; an instruction may be in
    # more than one basic block, so its lines add up.
    k = obj SUBSEP fn
    if (!(k in lowest) || addr < lowest[k]) lowest[k] = addr
    at[k, addr] += ir
  }
  total += ir
  c = category(obj)
  add("obj:" c, ir)
  if (c == "plugin") {
    add("pfn:" fn, ir)
    add("pline:" file ":" line, ir)
    where[file ":" line] = fn
  }
  next
}

/^ob=/ { obj = uncompress("ob", substr($0, 4)); next }
/^fl=/ { file = uncompress("fl", substr($0, 4)); next }
/^f[ie]=/ { file = uncompress("fl", substr($0, 4)); next }
/^fn=/ { fn = uncompress("fn", substr($0, 4)); next }
/^cob=/ { cobj = uncompress("ob", substr($0, 5)); next }
/^cf[il]=/ { uncompress("fl", substr($0, 5)); next }
/^cfn=/ { cfn = uncompress("fn", substr($0, 5)); next }
/^jfi=/ { uncompress("fl", substr($0, 5)); next }
/^jfn=/ { uncompress("fn", substr($0, 5)); next }
# A call (its cost line follows). Its count may be 0 in a dump after the first: a call
# still running when the previous dump was written.
/^calls=/ { split(substr($0, 7), a, " "); pending = a[1] + 0; incall = 1; next }
/^(jump|jcnd)=/ { next }
/^positions:/ { instr = ($0 ~ /instr/); next }
/^summary:/ { summary = $2; next }
/^totals:/ { totals = $2; next }
{ next } # headers (version, creator, pid, cmd, part, desc, positions, events, ...)

END {
  printf "total\t%d\n", total
  if (summary != "" && summary + 0 != total) {
    printf "callgrind-sum: warning: summed %d, the file says %d\n", total, summary > "/dev/stderr"
  }
  for (k in lowest) {
    split(k, p, SUBSEP)
    n = at[k, lowest[k]]
    base = p[1]; sub(/.*\//, "", base)
    acc["entry:" base ":" p[2]] += n
    if (p[2] ~ alloc_re && category(p[1]) == "libc") acc["entry-alloc:all"] += n
    if (p[2] ~ /^(free|cfree)$/ && category(p[1]) == "libc") acc["entry-free:all"] += n
    if (p[2] ~ slowlock_re && p[2] !~ /Once/) acc["entry-slowlock:all"] += n
    if (p[2] == "syscall" && category(p[1]) == "libc") acc["entry-syscall:all"] += n
  }
  for (k in acc) printf "%s\t%d\n", k, acc[k]
  for (k in where) printf "pline_fn:%s\t%s\n", k, where[k]
}
