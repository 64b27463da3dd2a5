"""Hatchling build hook: put the cargo-built plugin and info command into the wheel.

The files come from the release directory (``$NCCL_ERDMA_RELEASE_DIR``, else
``<repo>/target/release``); build them first (``scripts/package/package.sh`` does). The library
goes in twice, as ``lib/libnccl-net-erdma.so`` and as ``lib/libnccl-net.so``, the one name NCCL
2.9 and 2.10 open (they ignore ``NCCL_NET_PLUGIN``): a copy, as a wheel holds no symbolic links.
The wheel is tagged
``py3-none-manylinux_2_NN_x86_64``, NN the newest glibc symbol version the two files require
(read from their version references with ``objdump -p``): the oldest glibc they run on; for
2.17 also ``manylinux2014_x86_64``, its older name.
"""

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

# (file in the release directory, where it goes in the wheel)
ARTIFACTS = [
    ("libnccl_net_erdma.so", "nccl_net_erdma/lib/libnccl-net-erdma.so"),
    ("nccl-net-erdma-info", "nccl_net_erdma/bin/nccl-net-erdma-info"),
]
# The library again under the name every NCCL opens without NCCL_NET_PLUGIN.
DEFAULT_NAME = "nccl_net_erdma/lib/libnccl-net.so"


def glibc_floor(paths):
    """Return the newest GLIBC_2.N version the ELF files reference, as (2, N)."""
    found = set()
    for path in paths:
        out = subprocess.run(
            ["objdump", "-p", str(path)], check=True, capture_output=True, text=True
        ).stdout
        found.update(int(n) for n in re.findall(r"\bGLIBC_2\.(\d+)\b", out))
    if not found:
        raise RuntimeError(f"no GLIBC_2.N version references in {paths}: not glibc ELF files?")
    return (2, max(found))


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version, build_data):
        release = os.environ.get("NCCL_ERDMA_RELEASE_DIR") or Path(self.root, "../../target/release")
        release = Path(release).resolve()
        sources = [release / name for name, _ in ARTIFACTS]
        missing = [str(p) for p in sources if not p.is_file()]
        if missing:
            raise FileNotFoundError(
                f"not built: {', '.join(missing)} (run `cargo build --release --workspace` "
                "or scripts/package/package.sh first, or set NCCL_ERDMA_RELEASE_DIR)"
            )
        major, minor = glibc_floor(sources)
        build_data["pure_python"] = False
        tag = f"manylinux_{major}_{minor}_x86_64"
        if (major, minor) == (2, 17):
            # The same platform by its older name, which pip < 20.3 knows.
            tag += ".manylinux2014_x86_64"
        build_data["tag"] = f"py3-none-{tag}"
        for src, (_, dest) in zip(sources, ARTIFACTS):
            build_data["force_include"][str(src)] = dest
        # force_include maps each source file to one place: the second name is a copy's.
        self._copy_dir = tempfile.mkdtemp(prefix="nccl-net-erdma-wheel-")
        copy = Path(self._copy_dir, "libnccl-net.so")
        shutil.copy2(sources[0], copy)
        build_data["force_include"][str(copy)] = DEFAULT_NAME
        self.app.display_info(f"wheel tag {build_data['tag']} (from the glibc versions of {release})")

    def finalize(self, version, build_data, artifact_path):
        copy_dir = getattr(self, "_copy_dir", None)
        if copy_dir:
            shutil.rmtree(copy_dir, ignore_errors=True)
