"""nccl-net-erdma: the NCCL network plugin for Alibaba Cloud eRDMA and other RoCE/IB devices.

The wheel carries the plugin library and its diagnostics command. Point NCCL at the library
before the first communicator is created, for example at the top of a training script::

    import nccl_net_erdma
    nccl_net_erdma.configure_env()          # before torch.distributed.init_process_group
    torch.distributed.init_process_group("nccl")

or in a shell: ``eval "$(python -m nccl_net_erdma --env)"``.
"""

import os
from pathlib import Path

__all__ = ["library_path", "info_path", "plugin_env", "configure_env", "__version__"]

_HERE = Path(__file__).resolve().parent

try:
    from importlib.metadata import version as _version

    __version__ = _version("nccl-net-erdma")
except Exception:  # not installed as a distribution (e.g. run from a source tree)
    __version__ = "unknown"


def library_path():
    """Return the full path of the bundled ``libnccl-net-erdma.so`` as a string.

    Raises FileNotFoundError when the library is missing (a broken or source-only install).
    """
    path = _HERE / "lib" / "libnccl-net-erdma.so"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall the nccl-net-erdma wheel")
    return str(path)


def info_path():
    """Return the full path of the bundled ``nccl-net-erdma-info`` executable as a string."""
    path = _HERE / "bin" / "nccl-net-erdma-info"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall the nccl-net-erdma wheel")
    return str(path)


def plugin_env():
    """Return the variables that make NCCL load this plugin, as a dict of strings.

    ``NCCL_NET_PLUGIN`` is the library's full path (NCCL 2.21 and newer open it as is);
    ``NCCL_NET_PLUGIN_REF_COUNT=1`` keeps NCCL 2.28/2.29 from dropping the plugin when the
    last communicator of a process closes (NVIDIA/nccl#1978).
    """
    return {"NCCL_NET_PLUGIN": library_path(), "NCCL_NET_PLUGIN_REF_COUNT": "1"}


def configure_env(environ=None):
    """Set the variables of :func:`plugin_env` that are unset (or empty) in ``os.environ``.

    Variables the user already set are left alone. Call it before NCCL creates its first
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
