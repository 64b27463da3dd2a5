"""Command line of the nccl-net-erdma wheel.

``python -m nccl_net_erdma``          prints the full path of libnccl-net-erdma.so
``python -m nccl_net_erdma --env``    prints ``export NCCL_NET_PLUGIN=<path> NCCL_NET_PLUGIN_REF_COUNT=1``
                                      (NCCL 2.21 and newer), then the lines for older NCCL as
                                      comments
``python -m nccl_net_erdma --env --nccl 2.9.9``  prints the one line for that NCCL
``nccl-net-erdma-info [--json]``      runs the bundled diagnostics command (see :func:`info`)
"""

import argparse
import os
import shlex
import sys

from . import (
    DEFAULT_NAME,
    GENERATIONS,
    __version__,
    info_path,
    library_dir,
    library_path,
    nccl_generation,
    plugin_env,
)

# LD_LIBRARY_PATH's old value, joined by the shell that evaluates the line (no empty element,
# which would make the loader search the current directory).
_OLD_LD_PATH = "${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"


def _releases(first, last):
    if last is None:
        return f"NCCL {first[0]}.{first[1]} and newer"
    return f"NCCL {first[0]}.{first[1]} - {last[0]}.{last[1]}"


def env_line(how):
    """The shell line (``export ...``) for a generation's way of finding the plugin."""
    if how == "full":
        pairs = [f"{k}={shlex.quote(v)}" for k, v in plugin_env().items()]
        return "export " + " ".join(pairs)
    ld_path = f"LD_LIBRARY_PATH={shlex.quote(library_dir())}{_OLD_LD_PATH}"
    if how == "name":
        return f"export NCCL_NET_PLUGIN=erdma {ld_path}"
    return f"export {ld_path}"


_WHY = {
    "full": "open NCCL_NET_PLUGIN as given: the library's full path",
    "name": "open libnccl-net-<NCCL_NET_PLUGIN>.so, found on the loader path",
    "path": f"ignore NCCL_NET_PLUGIN and open only {DEFAULT_NAME}, found on the loader path",
}


def env_text(nccl=None):
    """What ``--env`` prints: one generation's line (``nccl``), or every generation's."""
    if nccl is not None:
        return env_line(nccl_generation(nccl)[2])
    newest_first = sorted(GENERATIONS, key=lambda g: g[0], reverse=True)
    out = []
    for i, (first, last, how) in enumerate(newest_first):
        line = env_line(how)
        out.append(f"# {_releases(first, last)} {_WHY[how]}:")
        # The newest generation's line is the one `eval` runs; the others are for copying.
        out.append(line if i == 0 else "#   " + line)
    out.append("# one NCCL's line alone: python -m nccl_net_erdma --env --nccl 2.9.9")
    out.append("# with mpirun, pass each variable on: -x NCCL_NET_PLUGIN -x LD_LIBRARY_PATH ...")
    return "\n".join(out)


def main(argv=None):
    """``python -m nccl_net_erdma [--env]``: print the library's path, or the shell line."""
    parser = argparse.ArgumentParser(
        prog="python -m nccl_net_erdma",
        description="Print the full path of the bundled NCCL net plugin libnccl-net-erdma.so.",
        epilog='in a shell: eval "$(python -m nccl_net_erdma --env)"\n'
        'NCCL 2.9 - 2.20 (e.g. Horovod 0.28.1\'s NCCL 2.9.9): '
        'eval "$(python -m nccl_net_erdma --env --nccl 2.9.9)"\n'
        "diagnostics: nccl-net-erdma-info [--json]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--env",
        action="store_true",
        help="print the shell lines that make NCCL load the plugin instead: `export "
        "NCCL_NET_PLUGIN=... NCCL_NET_PLUGIN_REF_COUNT=1` (NCCL 2.21 and newer), then those "
        "of older NCCL (LD_LIBRARY_PATH) as comments",
    )
    parser.add_argument(
        "--nccl",
        metavar="VERSION",
        help="with --env: print only the line for this NCCL version (e.g. 2.9.9: "
        "LD_LIBRARY_PATH, as NCCL 2.9 and 2.10 ignore NCCL_NET_PLUGIN)",
    )
    parser.add_argument("--version", action="version", version=f"nccl-net-erdma {__version__}")
    args = parser.parse_args(argv)
    if args.nccl is not None and not args.env:
        parser.error("--nccl goes with --env")
    try:
        if args.env:
            print(env_text(args.nccl))
        else:
            print(library_path())
    except ValueError as e:
        parser.error(str(e))
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
