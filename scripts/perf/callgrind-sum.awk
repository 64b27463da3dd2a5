# Sums one callgrind output file (format 1, events Ir, positions line) by object and by
# function, for scripts/cpu-cost.sh. Usage:
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
#
# The format: https://valgrind.org/docs/manual/cl-format.html. Names are compressed as
# "(id) name" once and "(id)" afterwards, with separate id spaces for objects (ob, cob),
# files (fl, fi, fe, cfi, cfl, jfi) and functions (fn, cfn, jfn). A position is absolute
# or relative to the previous cost line ("+n", "-n", "*"). The cost line after a
# `calls=` line is that call's inclusive cost, not the caller's own. `cob=` names the
# object of the next call only (else the caller's object).

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

BEGIN {
  if (plugin == "") plugin = "libnccl[-_]net[-_]erdma"
  obj = ""; file = ""; fn = ""; line = 0
  pending = 0; cobj = ""; cfn = ""
}

/^#/ || /^[ \t]*$/ { next }

# Cost lines: a position (absolute, +n, -n or *), then the Ir count (absent = 0).
/^[0-9+*-]/ {
  pos = $1
  if (pos ~ /^\+/) line = line + substr(pos, 2)
  else if (pos ~ /^-/) line = line - substr(pos, 2)
  else if (pos != "*") line = pos + 0
  ir = (NF >= 2) ? $2 + 0 : 0
  if (pending > 0) {
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
    if (cfn ~ /^(malloc|calloc|realloc|posix_memalign|aligned_alloc|memalign)$/) add("alloc:" oc ":calls", pending)
    if (cfn ~ /^(free|cfree)$/) add("free:" oc ":calls", pending)
    # Lock slow paths: parking_lot's (contended) and the futex calls under them; a Once
    # (one-time initialisation) is not a lock.
    if (cfn ~ /(lock|lock_shared|lock_exclusive|lock_upgradable|unlock|unlock_shared|unlock_exclusive)_slow|parking_lot_core::parking_lot::park|futex_(wait|wake)/ && cfn !~ /Once/) add("slowlock:" cfn ":calls", pending)
    if (oc == "plugin" && cfn == "syscall") add("syscall:plugin:calls", pending)
    pending = 0; cobj = ""
    next
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
/^calls=/ { split(substr($0, 7), a, " "); pending = a[1] + 0; next }
/^(jump|jcnd)=/ { next }
/^summary:/ { summary = $2; next }
/^totals:/ { totals = $2; next }
{ next } # headers (version, creator, pid, cmd, part, desc, positions, events, ...)

END {
  printf "total\t%d\n", total
  if (summary != "" && summary + 0 != total) {
    printf "callgrind-sum: warning: summed %d, the file says %d\n", total, summary > "/dev/stderr"
  }
  for (k in acc) printf "%s\t%d\n", k, acc[k]
  for (k in where) printf "pline_fn:%s\t%s\n", k, where[k]
}
