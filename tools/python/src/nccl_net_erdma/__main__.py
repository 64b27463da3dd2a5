"""Command line of the nccl-net-erdma wheel.

``python -m nccl_net_erdma``          prints the full path of libnccl-net-erdma.so
``python -m nccl_net_erdma --env``    prints ``export NCCL_NET_PLUGIN=<path> NCCL_NET_PLUGIN_REF_COUNT=1``
``nccl-net-erdma-info [--json]``      runs the bundled diagnostics command (see :func:`info`)
"""

import argparse
import os
import shlex
import sys

from . import __version__, info_path, library_path, plugin_env


def main(argv=None):
    """``python -m nccl_net_erdma [--env]``: print the library's path, or the shell line."""
    parser = argparse.ArgumentParser(
        prog="python -m nccl_net_erdma",
        description="Print the full path of the bundled NCCL net plugin libnccl-net-erdma.so.",
        epilog='in a shell: eval "$(python -m nccl_net_erdma --env)"\n'
        "diagnostics: nccl-net-erdma-info [--json]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--env",
        action="store_true",
        help="print an `export NCCL_NET_PLUGIN=... NCCL_NET_PLUGIN_REF_COUNT=1` line instead",
    )
    parser.add_argument("--version", action="version", version=f"nccl-net-erdma {__version__}")
    args = parser.parse_args(argv)
    try:
        if args.env:
            pairs = (f"{k}={shlex.quote(v)}" for k, v in plugin_env().items())
            print("export " + " ".join(pairs))
        else:
            print(library_path())
    except FileNotFoundError as e:
        print(f"nccl_net_erdma: {e}", file=sys.stderr)
        return 1
    return 0


def info():
    """``nccl-net-erdma-info``: replace this process with the bundled binary.

    Arguments, output and exit status are the binary's own (0: the plugin can run here,
    1: it cannot, and the output says why).
    """
    try:
        path = info_path()
        os.execv(path, [path] + sys.argv[1:])
    except OSError as e:  # missing, not executable, ...
        print(f"nccl-net-erdma-info: cannot run the bundled binary: {e}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
