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
#      `export NCCL_NET_PLUGIN=... NCCL_NET_PLUGIN_REF_COUNT=1` line a shell can eval,
#      `--version` the package's version;
#   e. `nccl-net-erdma-info` (the console command) runs the bundled binary: exit 1 on a host
#      without RDMA with the reason in its output (0 and "can run here" where there is a
#      device), exit 0 with NCCL_ERDMA_TRANSPORT=tcp, `--json` a JSON document;
#   f. the Python API: library_path(), configure_env() sets what is unset, keeps what is set;
#   g. nccl-net-bench over tcp loads the installed library by its path and moves checked data:
#      NCCL_ERDMA_TRANSPORT=tcp NCCL_SOCKET_IFNAME=lo target/release/nccl-net-bench
#        --lib <installed path> --sizes 8,64K --iters 20;
#   h. the .deb: files, Depends (libc6 >= the glibc found), Recommends, the ldconfig trigger
#      (installing it on Debian 12 is the Soft-RoCE VM tier's step, scripts/tiers/vm-tier.sh);
#   i. both in an older userland (scripts/package/old-userland.sh: Debian 11, glibc 2.31, in a
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

echo "== package-test: python -m nccl_net_erdma [--env] [--version]"
t=$(now)
lib=$(python -m nccl_net_erdma)
envline=$(python -m nccl_net_erdma --env)
ver=$(python -m nccl_net_erdma --version)
echo "$lib"
echo "$envline"
echo "$ver"
# shellcheck disable=SC2016 # expanded by the inner shell
got=$(env -u NCCL_NET_PLUGIN -u NCCL_NET_PLUGIN_REF_COUNT bash -c 'eval "$1" && echo "$NCCL_NET_PLUGIN $NCCL_NET_PLUGIN_REF_COUNT"' sh "$envline")
if [[ $lib == "$venv"/lib/python3*/site-packages/nccl_net_erdma/lib/libnccl-net-erdma.so && -f $lib ]] &&
  [[ $got == "$lib 1" && $ver == "nccl-net-erdma $version" ]]; then
  result PASS python-m "$t" "$lib"
else
  result FAIL python-m "$t" "path '$lib', eval of --env gave '$got', version '$ver'"
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
assert os.access(m.info_path(), os.X_OK), m.info_path()
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

echo "== package-test: $deb"
t=$(now)
dpkg-deb --info "$deb"
dpkg-deb --contents "$deb"
files=$(dpkg-deb --contents "$deb" | awk '{print $NF}')
depends=$(dpkg-deb --field "$deb" Depends)
recommends=$(dpkg-deb --field "$deb" Recommends)
dpkg-deb --ctrl-tarfile "$deb" | tar -xO ./triggers >"$work/triggers" 2>/dev/null
glibc=${platform#manylinux_}
glibc=${glibc%_x86_64}
glibc=${glibc/_/.}
problems=()
grep -qx './usr/lib/x86_64-linux-gnu/libnccl-net-erdma.so' <<<"$files" || problems+=("no /usr/lib/x86_64-linux-gnu/libnccl-net-erdma.so")
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
