"""nccl-net-erdma: the NCCL network plugin for Alibaba Cloud eRDMA and other RoCE/IB devices.

The wheel carries the plugin library and its diagnostics command. Point NCCL at the library
before the first communicator is created, for example at the top of a training script::

    import nccl_net_erdma
    nccl_net_erdma.configure_env()          # before torch.distributed.init_process_group
    torch.distributed.init_process_group("nccl")

or in a shell: ``eval "$(python -m nccl_net_erdma --env)"``.

The library is there twice, under the two names NCCL opens: ``lib/libnccl-net-erdma.so``
(``NCCL_NET_PLUGIN=erdma`` or its full path) and ``lib/libnccl-net.so``, a copy for NCCL 2.9
and 2.10, which ignore ``NCCL_NET_PLUGIN`` and open only ``libnccl-net.so`` from the loader
path (``LD_LIBRARY_PATH``). ``python -m nccl_net_erdma --env`` prints the lines for each NCCL.
"""

import os
from pathlib import Path

__all__ = [
    "LIBRARY",
    "DEFAULT_NAME",
    "library_path",
    "library_dir",
    "info_path",
    "plugin_env",
    "configure_env",
    "nccl_generation",
    "GENERATIONS",
    "__version__",
]

_HERE = Path(__file__).resolve().parent

#: The plugin's own name: ``NCCL_NET_PLUGIN=erdma`` makes NCCL 2.11 and newer open it.
LIBRARY = "libnccl-net-erdma.so"
#: The name every NCCL opens when ``NCCL_NET_PLUGIN`` is unset, and the only one NCCL 2.9 and
#: 2.10 open.
DEFAULT_NAME = "libnccl-net.so"

try:
    from importlib.metadata import version as _version

    __version__ = _version("nccl-net-erdma")
except Exception:  # not installed as a distribution (e.g. run from a source tree)
    __version__ = "unknown"


def library_path(name=LIBRARY):
    """Return the full path of the bundled ``libnccl-net-erdma.so`` as a string.

    ``name=DEFAULT_NAME`` (``"libnccl-net.so"``): the path of the same library under the name
    NCCL 2.9 and 2.10 open. Raises FileNotFoundError when the library is missing (a broken or
    source-only install).
    """
    if name not in (LIBRARY, DEFAULT_NAME):
        raise ValueError(f"name must be {LIBRARY!r} or {DEFAULT_NAME!r}, not {name!r}")
    path = _HERE / "lib" / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall the nccl-net-erdma wheel")
    return str(path)


def library_dir():
    """Return the directory of both libraries, for ``LD_LIBRARY_PATH`` (NCCL 2.9 - 2.20)."""
    return str(Path(library_path(DEFAULT_NAME)).parent)


def info_path():
    """Return the full path of the bundled ``nccl-net-erdma-info`` executable as a string."""
    path = _HERE / "bin" / "nccl-net-erdma-info"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall the nccl-net-erdma wheel")
    return str(path)


#: How each NCCL generation finds the plugin: (first, last or None, what it needs).
#:   "path": ``libnccl-net.so`` on the loader path (2.9 - 2.10 ignore ``NCCL_NET_PLUGIN``);
#:   "name": ``NCCL_NET_PLUGIN=erdma``, ``libnccl-net-erdma.so`` on the loader path (2.11 - 2.20
#:           open only ``libnccl-net-<NCCL_NET_PLUGIN>.so``);
#:   "full": ``NCCL_NET_PLUGIN=<full path>`` (2.21 and newer open the value as is first).
GENERATIONS = (
    ((2, 9), (2, 10), "path"),
    ((2, 11), (2, 20), "name"),
    ((2, 21), None, "full"),
)


def nccl_generation(version):
    """Return the ``GENERATIONS`` entry of an NCCL version (``"2.9.9"``, ``"2.21"``, (2, 10)).

    Raises ValueError for text that is not a version, and for NCCL older than 2.9, which this
    plugin does not support.
    """
    if isinstance(version, str):
        parts = version.strip().split("+")[0].split(".")
        try:
            version = tuple(int(p) for p in parts[:2])
        except ValueError:
            raise ValueError(f"not an NCCL version: {version!r} (e.g. 2.9.9 or 2.21)") from None
    version = tuple(version)[:2]
    if len(version) != 2:
        raise ValueError(f"not an NCCL version: {version!r} (e.g. 2.9.9 or 2.21)")
    for first, last, how in GENERATIONS:
        if first <= version and (last is None or version <= last):
            return first, last, how
    raise ValueError(
        f"NCCL {version[0]}.{version[1]} is older than 2.9, the oldest NCCL this plugin supports"
    )


def plugin_env(nccl=None, environ=None):
    """Return the variables that make NCCL load this plugin, as a dict of strings.

    By default (``nccl=None``), for NCCL 2.21 and newer: ``NCCL_NET_PLUGIN`` is the library's
    full path (they open it as is); ``NCCL_NET_PLUGIN_REF_COUNT=1`` keeps NCCL 2.28/2.29 from
    dropping the plugin when the last communicator of a process closes (NVIDIA/nccl#1978).

    ``nccl``: the NCCL version the job runs (``"2.9.9"``), for the variables of its generation
    (see :func:`nccl_generation`). Older ones find the library only on the loader path, so
    theirs include ``LD_LIBRARY_PATH``: :func:`library_dir` before ``environ``'s value
    (``os.environ`` by default). The dynamic loader reads ``LD_LIBRARY_PATH`` when a process
    starts: it takes effect in processes started afterwards (``mpirun``, ``torchrun``), not in
    the running one.
    """
    how = "full" if nccl is None else nccl_generation(nccl)[2]
    if how == "full":
        return {"NCCL_NET_PLUGIN": library_path(), "NCCL_NET_PLUGIN_REF_COUNT": "1"}
    environ = os.environ if environ is None else environ
    old = environ.get("LD_LIBRARY_PATH", "")
    ld_path = library_dir() + (":" + old if old else "")
    if how == "name":
        return {"NCCL_NET_PLUGIN": "erdma", "LD_LIBRARY_PATH": ld_path}
    return {"LD_LIBRARY_PATH": ld_path}


def configure_env(environ=None):
    """Set the variables of :func:`plugin_env` that are unset (or empty) in ``os.environ``.

    For NCCL 2.21 and newer, in the running process; older NCCL needs ``LD_LIBRARY_PATH`` set
    before the process starts (``python -m nccl_net_erdma --env`` prints the lines). Variables
    the user already set are left alone. Call it before NCCL creates its first
    communicator (``torch.distributed.init_process_group``): NCCL reads them then. Child
    processes started afterwards inherit them. ``environ`` replaces ``os.environ`` (tests).
    Returns the dict of the variables it set (empty when all were already set).
    """
    environ = os.environ if environ is None else environ
    changed = {}
    for name, value in plugin_env().items():
        if not environ.get(name):
            environ[name] = value
            changed[name] = value
    return changed
