#!/usr/bin/env bash
# Install tests of the packages, on this host, as a user would (called by scripts/test.sh):
#
#   scripts/package/package-test.sh
#
#   a. scripts/package/package.sh builds the wheel and the .deb into target/dist/;
#   b. auditwheel (from PyPI, in a tools venv) agrees with the wheel's manylinux tag;
#   c. the wheel installs with pip into a fresh virtual environment (python3 -m venv) with
#      --no-index: it needs no other package;
#   d. `python -m nccl_net_erdma` prints an existing file in that environment, `--env` an
#      `export NCCL_NET_PLUGIN=... NCCL_NET_PLUGIN_REF_COUNT=1` line a shell can eval (NCCL
#      2.21 and newer) and, as comments, the LD_LIBRARY_PATH lines of NCCL 2.9 - 2.20;
#      `--env --nccl 2.9.9` the LD_LIBRARY_PATH line alone, `--version` the package's version;
#   e. the wheel's lib/libnccl-net.so (the name NCCL 2.9 and 2.10 open) is a copy of
#      lib/libnccl-net-erdma.so and exports ncclNetPlugin_v4 (nm -D), the table they look up;
#   f. `nccl-net-erdma-info` (the console command) runs the bundled binary: exit 1 on a host
#      without RDMA with the reason in its output (0 and "can run here" where there is a
#      device), exit 0 with NCCL_ERDMA_TRANSPORT=tcp, `--json` a JSON document; it names the
#      installed library's tables and finds libnccl-net.so beside it;
#   g. the Python API: library_path() (and of libnccl-net.so), library_dir(), plugin_env() per
#      NCCL version, configure_env() sets what is unset, keeps what is set;
#   h. nccl-net-bench over tcp loads the installed library by its path and moves checked data:
#      NCCL_ERDMA_TRANSPORT=tcp NCCL_SOCKET_IFNAME=lo target/release/nccl-net-bench
#        --lib <installed path> --sizes 8,64K --iters 20;
#      and, with the line `--env --nccl 2.9.9` prints, loads libnccl-net.so by name as NCCL
#      2.9 does (the dynamic loader finds the wheel's copy on LD_LIBRARY_PATH; the info
#      command says it is this library);
#   i. the .deb: files (libnccl-net.so only as a link in its own directory, none in the
#      loader's default path), Depends (libc6 >= the glibc found), Recommends, the ldconfig
#      trigger (installing it on Debian 12 is the Soft-RoCE VM tier's step,
#      scripts/tiers/vm-tier.sh);
#   j. both in an older userland (scripts/package/old-userland.sh: Debian 11, glibc 2.31, in a
#      chroot in its own network namespace): the wheel into a venv, its commands, the bench
#      over tcp through the installed library; the .deb with dpkg -i, its library by name.
# Each step ends with `package-test: PASS|FAIL <step> (<s> s)`; exit status non-zero if any
# step failed.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
# shellcheck source=scripts/common.sh
source scripts/common.sh
help_from_header "$@"
step_prefix package-test
start=$(now)
work=$(mktemp -d "${TMPDIR:-/tmp}/package-test.XXXXXX")
# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() { rm -rf "$work"; }
trap cleanup EXIT
done_() { # print the tally, exit non-zero when a step failed
  echo "package-test: $passed passed, $failed failed in $(since "$start") s"
  [[ $failed -eq 0 ]]
  exit
}

echo "== package-test: scripts/package/package.sh"
t=$(now)
if bash scripts/package/package.sh; then
  result PASS build "$t"
else
  result FAIL build "$t" "scripts/package/package.sh failed"
  done_
fi
version=$(cargo pkgid --quiet -p nccl-net-erdma)
version=${version##*[#@]}
dist=$(pwd)/target/dist
whl=$(ls "$dist"/nccl_net_erdma-"$version"-*.whl)
deb=$dist/nccl-net-erdma_${version}_amd64.deb
tag=${whl##*-}
tag=${tag%.whl}
# The first of the tags (manylinux_2_17_x86_64.manylinux2014_x86_64: one platform, two names).
platform=${tag%%.*}

echo "== package-test: auditwheel show $whl"
t=$(now)
python3 -m venv "$work/tools" && "$work/tools/bin/pip" install --quiet --disable-pip-version-check auditwheel &&
  "$work/tools/bin/auditwheel" show "$whl" >"$work/auditwheel.txt" 2>&1
cat "$work/auditwheel.txt"
if grep -qF "consistent with the following platform tag: \"$platform\"" <(tr '\n' ' ' <"$work/auditwheel.txt" | tr -s ' '); then
  result PASS auditwheel "$t" "$tag: $(grep -m1 -oE 'consistent with the following platform tag: "[^"]*"' <(tr '\n' ' ' <"$work/auditwheel.txt" | tr -s ' '))"
else
  result FAIL auditwheel "$t" "auditwheel does not confirm $platform"
fi

echo "== package-test: python3 -m venv; pip install --no-index $whl"
t=$(now)
venv=$work/venv
if python3 -m venv "$venv" && "$venv/bin/pip" install --no-index --disable-pip-version-check "$whl"; then
  result PASS pip-install "$t"
else
  result FAIL pip-install "$t" "pip install of the wheel failed"
  done_
fi
# The installed package, as a user meets it: from another directory, the venv on PATH. The
# benchmark is the one package.sh built with the packages (glibc 2.17).
repo=$(pwd)
rel=$(cd "${CARGO_TARGET_DIR:-target}/x86_64-unknown-linux-gnu/release" && pwd)
cd "$work" || exit 1
export PATH=$venv/bin:$PATH

echo "== package-test: python -m nccl_net_erdma [--env [--nccl 2.9.9]] [--version]"
t=$(now)
lib=$(python -m nccl_net_erdma)
libdir=${lib%/*}
envline=$(python -m nccl_net_erdma --env)
env29=$(python -m nccl_net_erdma --env --nccl 2.9.9)
ver=$(python -m nccl_net_erdma --version)
echo "$lib"
echo "$envline"
echo "$env29"
echo "$ver"
# shellcheck disable=SC2016 # expanded by the inner shell
got=$(env -u NCCL_NET_PLUGIN -u NCCL_NET_PLUGIN_REF_COUNT -u LD_LIBRARY_PATH bash -c 'eval "$1" && echo "$NCCL_NET_PLUGIN $NCCL_NET_PLUGIN_REF_COUNT ${LD_LIBRARY_PATH-unset}"' sh "$envline")
# NCCL 2.9 - 2.10: LD_LIBRARY_PATH only, the wheel's directory first, without an empty element.
# shellcheck disable=SC2016 # expanded by the inner shell
got29=$(env -u NCCL_NET_PLUGIN -u LD_LIBRARY_PATH bash -c 'eval "$1" && echo "${NCCL_NET_PLUGIN-unset} $LD_LIBRARY_PATH"' sh "$env29")
# shellcheck disable=SC2016 # expanded by the inner shell
got29b=$(LD_LIBRARY_PATH=/opt/x bash -c 'eval "$1" && echo "$LD_LIBRARY_PATH"' sh "$env29")
# The line as printed: the shell that evaluates it expands LD_LIBRARY_PATH.
ld_line="#   export LD_LIBRARY_PATH=$libdir\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
if [[ $lib == "$venv"/lib/python3*/site-packages/nccl_net_erdma/lib/libnccl-net-erdma.so && -f $lib ]] &&
  [[ $got == "$lib 1 unset" && $ver == "nccl-net-erdma $version" ]] &&
  grep -qxF "$ld_line" <<<"$envline" && grep -qx '# NCCL 2.9 - 2.10 .*' <<<"$envline" &&
  [[ $got29 == "unset $libdir" && $got29b == "$libdir:/opt/x" ]]; then
  result PASS python-m "$t" "$lib; --env has the LD_LIBRARY_PATH line for NCCL 2.9 - 2.10; --nccl 2.9.9 evaluates to LD_LIBRARY_PATH=$libdir"
else
  result FAIL python-m "$t" "path '$lib', eval of --env gave '$got', version '$ver', LD_LIBRARY_PATH line '$ld_line' in --env: $(grep -cxF "$ld_line" <<<"$envline"), eval of --nccl 2.9.9 gave '$got29' and '$got29b'"
fi

echo "== package-test: the wheel's libnccl-net.so (the name NCCL 2.9 and 2.10 open)"
t=$(now)
default_lib=$libdir/libnccl-net.so
nm -D --defined-only "$default_lib" >nm.txt 2>&1
tables=$(grep -oE '\bncclNetPlugin_v[0-9]+$' nm.txt | sort -V | tr '\n' ' ')
tables=${tables% }
tables=${tables:-none}
echo "$default_lib: tables $tables"
if [[ ! -f $default_lib ]]; then
  result FAIL wheel-default-name "$t" "no $default_lib in the wheel"
elif ! cmp -s "$default_lib" "$lib"; then
  result FAIL wheel-default-name "$t" "$default_lib is not a copy of $lib"
elif ! grep -qE '\bncclNetPlugin_v4$' nm.txt; then
  # NCCL 2.9 - 2.11 dlsym only ncclNetPlugin_v4: without it they fall back to their own IB.
  result FAIL wheel-default-name "$t" "$default_lib exports no ncclNetPlugin_v4 (it has: $tables): NCCL 2.9 - 2.11 would not load it"
else
  result PASS wheel-default-name "$t" "a copy of libnccl-net-erdma.so; exports $tables"
fi

echo "== package-test: nccl-net-erdma-info (the console command)"
t=$(now)
cmd=$(command -v nccl-net-erdma-info)
nccl-net-erdma-info >info.txt 2>&1
rc=$?
tail -n 3 info.txt
NCCL_ERDMA_TRANSPORT=tcp nccl-net-erdma-info >info-tcp.txt 2>&1
rc_tcp=$?
nccl-net-erdma-info --json >info.json 2>&1
json_ok=$(python -c 'import json,sys; d=json.load(open(sys.argv[1])); print("ok" if "devices" in d else "no devices key")' info.json 2>&1)
verdict=$(grep '^== result: ' info.txt)
why=${verdict#== result: the plugin cannot run here: }
if [[ $cmd != "$venv/bin/nccl-net-erdma-info" ]]; then
  result FAIL info "$t" "nccl-net-erdma-info is $cmd, not the venv's"
elif ! grep -qxF "  library: $lib" info.txt || ! grep -qE '^  ncclNetPlugin_v12 +NCCL 2\.30 and newer$' info.txt ||
  ! grep -qxF "  libnccl-net.so beside it (the one name NCCL 2.9 - 2.10 open): $libdir/libnccl-net.so, the same library" info.txt; then
  result FAIL info "$t" "no 'library: $lib', v12 or 'libnccl-net.so beside it' line: $(sed -n '/^== NCCL releases/,/^== /p' info.txt | tr '\n' '|')"
elif [[ $rc -eq 1 && $verdict == "== result: the plugin cannot run here: "?* ]]; then
  if [[ $rc_tcp -eq 0 && $json_ok == ok ]]; then
    result PASS info "$t" "exit 1 without RDMA, says why (${why%%. *}); exit 0 over tcp; --json ok"
  else
    result FAIL info "$t" "with NCCL_ERDMA_TRANSPORT=tcp exit $rc_tcp (want 0); --json: $json_ok"
  fi
elif [[ $rc -eq 0 && $verdict == "== result: the plugin can run here"* && $json_ok == ok ]]; then
  result PASS info "$t" "exit 0: this host has a usable RDMA device"
else
  result FAIL info "$t" "exit $rc, verdict '$verdict', --json: $json_ok"
fi

echo "== package-test: the Python API"
t=$(now)
if env -u NCCL_NET_PLUGIN -u NCCL_NET_PLUGIN_REF_COUNT python - "$lib" <<'PY'; then
import os, sys
import nccl_net_erdma as m

lib = sys.argv[1]
assert m.library_path() == lib and os.path.isfile(lib), m.library_path()
libdir = os.path.dirname(lib)
assert m.library_dir() == libdir, m.library_dir()
assert m.library_path(m.DEFAULT_NAME) == os.path.join(libdir, "libnccl-net.so")
assert os.access(m.info_path(), os.X_OK), m.info_path()
# What each NCCL generation needs (NCCL 2.9.9 is Horovod 0.28.1's, 2.10.3 torch 1.12.1's).
assert m.plugin_env("2.9.9", environ={}) == {"LD_LIBRARY_PATH": libdir}
assert m.plugin_env("2.10.3", environ={"LD_LIBRARY_PATH": "/a"}) == {"LD_LIBRARY_PATH": libdir + ":/a"}
assert m.plugin_env("2.11.4", environ={}) == {"NCCL_NET_PLUGIN": "erdma", "LD_LIBRARY_PATH": libdir}
assert m.plugin_env("2.20.5", environ={})["NCCL_NET_PLUGIN"] == "erdma"
assert m.plugin_env("2.21.5") == m.plugin_env() == {"NCCL_NET_PLUGIN": lib, "NCCL_NET_PLUGIN_REF_COUNT": "1"}
for bad in ("2.8.3", "x.y", "2"):
    try:
        m.plugin_env(bad)
    except ValueError:
        pass
    else:
        raise AssertionError(f"plugin_env({bad!r}) did not refuse it")
want = {"NCCL_NET_PLUGIN": lib, "NCCL_NET_PLUGIN_REF_COUNT": "1"}
assert m.configure_env() == want
assert all(os.environ[k] == v for k, v in want.items())
assert m.configure_env() == {}  # already set: nothing to do
env = {"NCCL_NET_PLUGIN": "erdma"}  # the user's choice is kept
assert m.configure_env(env) == {"NCCL_NET_PLUGIN_REF_COUNT": "1"} and env["NCCL_NET_PLUGIN"] == "erdma"
assert not any(x in sys.modules for x in ("torch", "numpy")), "imports more than it needs"
from importlib.metadata import requires
assert not requires("nccl-net-erdma"), requires("nccl-net-erdma")
print("library_path() =", m.library_path())
print("library_path(DEFAULT_NAME) =", m.library_path(m.DEFAULT_NAME))
print("configure_env() set", ", ".join(sorted(want)), "and keeps what the user set")
PY
  result PASS python-api "$t"
else
  result FAIL python-api "$t"
fi
echo "== package-test: nccl-net-bench over tcp with the installed library"
t=$(now)
# shellcheck disable=SC2054 # the commas are the benchmark's size list
bench=("$rel/nccl-net-bench" --lib "$lib" --sizes 8,64K --iters 20)
echo "NCCL_ERDMA_TRANSPORT=tcp NCCL_SOCKET_IFNAME=lo ${bench[*]}"
NCCL_ERDMA_TRANSPORT=tcp NCCL_SOCKET_IFNAME=lo timeout -k 5 120 "${bench[@]}" >bench.txt 2>&1
rc=$?
cat bench.txt
if [[ $rc -eq 0 ]] && grep -qF "library:   $lib " bench.txt && grep -qE '^ +64 KiB ' bench.txt; then
  result PASS bench-tcp "$t" "8 B and 64 KiB moved and checked through $lib"
else
  result FAIL bench-tcp "$t" "exit $rc"
fi

echo "== package-test: libnccl-net.so by name, as NCCL 2.9 opens it, with the --env --nccl 2.9.9 line"
t=$(now)
# shellcheck disable=SC2016 # expanded by the inner shell
env -u LD_LIBRARY_PATH bash -c 'eval "$1" && shift && NCCL_ERDMA_TRANSPORT=tcp nccl-net-erdma-info >info-29.txt 2>&1 &&
  NCCL_ERDMA_TRANSPORT=tcp NCCL_SOCKET_IFNAME=lo timeout -k 5 120 "$@" >bench-29.txt 2>&1' \
  sh "$env29" "$rel/nccl-net-bench" --lib libnccl-net.so --abi 4 --sizes 8,64K --iters 20
rc=$?
found=$(grep '^  libnccl-net.so on the loader path here: ' info-29.txt)
echo "${found#  }"
grep -E '^(library|transport): ' bench-29.txt
if [[ $rc -eq 0 && $found == "  libnccl-net.so on the loader path here: $libdir/libnccl-net.so, this library: "* ]] &&
  grep -qF "library:   libnccl-net.so (ncclNetPlugin_v4," bench-29.txt && grep -qE '^ +64 KiB ' bench-29.txt; then
  result PASS by-name-2.9 "$t" "the loader finds $libdir/libnccl-net.so; 8 B and 64 KiB moved through its v4 table"
else
  tail -n 5 bench-29.txt
  result FAIL by-name-2.9 "$t" "exit $rc; the info command says: ${found:-no libnccl-net.so line}"
fi

echo "== package-test: $deb"
t=$(now)
dpkg-deb --info "$deb"
dpkg-deb --contents "$deb"
contents=$(dpkg-deb --contents "$deb")
files=$(awk '{print $NF}' <<<"$contents")
depends=$(dpkg-deb --field "$deb" Depends)
recommends=$(dpkg-deb --field "$deb" Recommends)
dpkg-deb --ctrl-tarfile "$deb" | tar -xO ./triggers >"$work/triggers" 2>/dev/null
glibc=${platform#manylinux_}
glibc=${glibc%_x86_64}
glibc=${glibc/_/.}
problems=()
grep -qx './usr/lib/x86_64-linux-gnu/libnccl-net-erdma.so' <<<"$files" || problems+=("no /usr/lib/x86_64-linux-gnu/libnccl-net-erdma.so")
# libnccl-net.so only in the package's own directory (opted into with LD_LIBRARY_PATH), a link
# to the library; never in the loader's default path, where every NCCL would pick it up.
grep -qE '^l.* \./usr/lib/x86_64-linux-gnu/nccl-net-erdma/libnccl-net\.so -> \.\./libnccl-net-erdma\.so$' <<<"$contents" ||
  problems+=("no link usr/lib/x86_64-linux-gnu/nccl-net-erdma/libnccl-net.so -> ../libnccl-net-erdma.so")
if grep -qE ' \./(usr/)?lib/(x86_64-linux-gnu/)?libnccl-net\.so( |$)' <<<"$contents"; then
  problems+=("libnccl-net.so in the loader's default path")
fi
grep -qx './usr/bin/nccl-net-erdma-info' <<<"$files" || problems+=("no /usr/bin/nccl-net-erdma-info")
[[ $depends == *"libc6 (>= $glibc)"* ]] || problems+=("Depends '$depends' lacks libc6 (>= $glibc)")
[[ $recommends == *libibverbs1* ]] || problems+=("Recommends '$recommends' lacks libibverbs1")
grep -qx 'activate-noawait ldconfig' "$work/triggers" || problems+=("no ldconfig trigger")
if [[ ${#problems[@]} -eq 0 ]]; then
  result PASS deb-contents "$t" "Depends: $depends; Recommends: $recommends"
else
  result FAIL deb-contents "$t" "${problems[*]}"
fi

echo "== package-test: an older userland (scripts/package/old-userland.sh)"
t=$(now)
if bash "$repo/scripts/package/old-userland.sh" "$whl" "$deb" "$rel/nccl-net-bench"; then
  result PASS old-userland "$t" "Debian 11 (glibc 2.31): the wheel, its commands, the bench over tcp; the .deb"
else
  result FAIL old-userland "$t" "see the old-userland lines above"
fi

done_
