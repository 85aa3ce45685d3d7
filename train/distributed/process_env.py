"""The process's environment before its process group exists, as torchtitan sets it: the NCCL
flight recorder, the socket interface that reaches MASTER_ADDR, the CUDA caching allocator, and
a rank that dies with its torchrun agent. Each variable only where the user left it unset.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import signal
import socket
import struct
import sys
from collections.abc import Mapping

from codex.core import fsio
from codex.core.progress import command_log

# NCCL's flight recorder (torchtitan's settings): the last collectives of each rank in a ring,
# written to DUMP_FILE + rank when the watchdog sees a timeout, so a hang names the rank and the
# collective that never arrived (`python -m torch.distributed.flight_recorder.fr_trace`).
# The TORCH_NCCL_* names are the ones every torch >= 2.5 reads; newer torch prefers TORCH_FR_*.
FLIGHT_RECORDER = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "20000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
FLIGHT_RECORDER_ALIASES = {
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "TORCH_FR_DUMP_TEMP_FILE",
}
DUMP_FILE = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"


def process_group_env(kind: str, run: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables make_torch_backend sets before the process group exists, each only where
    `environ` (and its newer alias) leaves it unset: on CUDA the flight recorder (its dump under
    RUN/logs/ for a local run, else torch's /tmp default); on several hosts (MASTER_ADDR not a
    loopback address) GLOO_SOCKET_IFNAME, and on CUDA NCCL_SOCKET_IFNAME, set to the interface that
    reaches MASTER_ADDR (gloo otherwise picks the one its hostname resolves to, which on many
    clusters is not the one the nodes reach each other by)."""

    def unset(name: str) -> bool:
        alias = FLIGHT_RECORDER_ALIASES.get(name)
        return name not in environ and (alias is None or alias not in environ)

    wanted = dict(FLIGHT_RECORDER) if kind == "cuda" else {}
    if kind == "cuda" and not fsio.is_remote(run):
        wanted[DUMP_FILE] = os.path.join(os.path.abspath(run), "logs", "nccl_trace_rank_")
    names = ["GLOO_SOCKET_IFNAME"] + (["NCCL_SOCKET_IFNAME"] if kind == "cuda" else [])
    master = environ.get("MASTER_ADDR", "")
    if master and any(unset(n) for n in names) and not is_loopback(master):
        interface = route_interface(master)
        if interface:
            wanted |= dict.fromkeys(names, interface)
    return {k: v for k, v in wanted.items() if unset(k)}


def is_loopback(host: str) -> bool:
    """True when `host` (a name or an address) resolves to a loopback address (one host)."""
    try:
        return all(
            ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback
            for info in socket.getaddrinfo(host, None)
        )
    except (OSError, ValueError):
        return False


def route_interface(host: str) -> str | None:
    """The network interface (e.g. "eth0", "lo") whose address this machine sends from to reach
    `host`: a UDP socket connected to it (no packet is sent) gives the source address the kernel's
    routing picks, then the interface that holds that address. None when unknown."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            local = str(s.getsockname()[0]).split("%")[0]
    except OSError:
        return None
    return interface_with_address(local)


def interface_with_address(address: str) -> str | None:
    """The interface that holds `address` (Linux: SIOCGIFADDR for IPv4, /proc/net/if_inet6 for
    IPv6; the standard library has no getifaddrs)."""
    ip = ipaddress.ip_address(address)
    if ip.version == 6:
        try:
            with open("/proc/net/if_inet6") as f:
                for line in f:  # address (32 hex digits), index, prefix, scope, flags, name
                    fields = line.split()
                    if len(fields) == 6 and ipaddress.ip_address(int(fields[0], 16)) == ip:
                        return fields[5]
        except OSError:
            return None
        return None
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not a POSIX system
        return None
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                got = socket.inet_ntoa(fcntl.ioctl(s.fileno(), siocgifaddr, req)[20:24])
            except OSError:  # no IPv4 address on this interface
                continue
            if got == address:
                return name
    return None


def die_with_launcher() -> None:
    """A rank torchrun started gets SIGTERM when its agent dies (Linux's parent-death signal): a
    SIGKILL of the agent alone would otherwise leave it training and holding the run lock. SIGTERM
    stops it as a preemption does (the step ends, every rank stops there, a checkpoint is saved)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM))
    if os.getppid() != parent:  # the agent died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


# The caching allocator's settings: expandable segments grow one mapping instead of caching
# blocks of fixed sizes, so memory freed between the forward's activations and the backward's
# gradients is reused at any size (fragmentation is what the memory plan's headroom pays for).
# Newer torch reads PYTORCH_ALLOC_CONF first (the CUDA name is its deprecated alias, read only
# when it is unset, so no warning), older torch only PYTORCH_CUDA_ALLOC_CONF: both are set.
ALLOCATOR_CONF = "expandable_segments:True"
ALLOCATOR_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def allocator_env(kind: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The allocator variables make_torch_backend sets before the first CUDA allocation (the
    allocator reads them once): ALLOCATOR_CONF under both names on CUDA, nothing where the user
    set either name (their settings stand whole) or on another kind."""
    if kind != "cuda" or any(name in environ for name in ALLOCATOR_ENV):
        return {}
    return dict.fromkeys(ALLOCATOR_ENV, ALLOCATOR_CONF)


def set_process_group_env(kind: str, run: str, rank: int) -> None:
    """process_group_env(...) into os.environ (NCCL and gloo read it when the process group is
    made), the flight recorder's folder made, and the choice logged once."""
    env = process_group_env(kind, run, os.environ)
    os.environ.update(env)
    if DUMP_FILE in env:
        with contextlib.suppress(OSError):  # no folder: NCCL's dump fails, training does not
            os.makedirs(os.path.dirname(env[DUMP_FILE]), exist_ok=True)
    if env and rank == 0:
        command_log().info(
            "process group environment: %s", " ".join(f"{k}={v}" for k, v in env.items())
        )
