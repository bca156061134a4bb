"""A slow link between this machine's network namespace and a new one: two Ray nodes a WAN
apart on one machine (benchmarks/diloco_slow_link.py uses it).

`tc ... netem` is what one would use, but this machine's kernel has no netem (nor fq or etf:
`CONFIG_NET_SCH_NETEM` is unset and modules are off), so no qdisc here can delay a packet.
The link is a pair of TUN devices instead, one in each namespace, and an emulator process
(this file run with `--emulate`) that moves every packet from one to the other as netem's
`delay D rate R limit L` does, each direction on its own: a packet is serialized at R after
the packets queued before it, arrives D later, and is dropped when L packets are queued.
D is one-way: a round trip takes 2 D. The devices live as long as the emulator's process.

    sudo .venv/bin/python benchmarks/slow_link.py --probe   # build a link, measure it, remove it
"""

from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import ctypes
import fcntl
import json
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
CLONE_NEWNET = 0x40000000
# Run inside the namespace by `probe`: an echo for the round trip, then a bulk transfer each
# way (the client says how many bytes, then sends them or reads them).
PROBE_SERVER = r"""
import socket, struct, sys
s = socket.create_server((sys.argv[1], 0)); print(s.getsockname()[1], flush=True)
for _ in range(3):
    c, _ = s.accept()
    kind, n = struct.unpack("!cQ", c.recv(9, socket.MSG_WAITALL))
    if kind == b"e":
        for _ in range(n): c.sendall(c.recv(1))
    elif kind == b"u":
        while n: n -= len(c.recv(min(n, 1 << 20)))
        c.sendall(b"k")
    else:
        c.sendall(bytes(n))
    c.close()
"""


def _open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def _forward(src: int, dst: int, delay_s: float, rate_bps: float, limit: int) -> None:
    """One direction of the link, netem's model: serialization after the packets queued
    before, then the propagation delay; tail drop at `limit` queued packets."""
    queue: collections.deque[tuple[float, bytes]] = collections.deque()
    ready = threading.Condition()

    def deliver() -> None:
        while True:
            with ready:
                while not queue:
                    ready.wait()
                due, packet = queue[0]
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            with contextlib.suppress(OSError):  # the far end not up yet (EIO): lost, as on a wire
                os.write(dst, packet)
            with ready:
                queue.popleft()

    threading.Thread(target=deliver, daemon=True).start()
    last_departure = 0.0
    while True:
        packet = os.read(src, 65536)
        now = time.monotonic()
        with ready:
            if len(queue) >= limit:
                continue  # dropped, as netem drops past its limit
            last_departure = max(now, last_departure) + len(packet) * 8 / rate_bps
            queue.append((last_departure + delay_s, packet))
            ready.notify()


def emulate(args) -> None:
    """Creates the two TUN devices (the second inside the namespace: a TUN device is made in
    the namespace of the thread that opens it) and forwards between them until killed."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    outer = _open_tun(args.devices[0])
    if libc.setns(os.open(f"/var/run/netns/{args.ns}", os.O_RDONLY), CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns into the link's namespace")
    inner = _open_tun(args.devices[1])
    if libc.setns(home, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns back")
    # The link stands for hardware: it must not queue for the CPU behind the groups it links
    # (or another session's processes), or a loaded machine would make the link slower too.
    with contextlib.suppress(OSError):
        os.nice(-10)
    shape = (args.delay_ms / 1000, args.rate_mbit * 1e6, args.limit)
    threading.Thread(target=_forward, args=(inner, outer, *shape), daemon=True).start()
    print("ready", flush=True)
    _forward(outer, inner, *shape)


def _die_with_parent() -> None:
    """In a child before exec: SIGTERM when the process that started it dies, even by
    SIGKILL, so that no emulator or far node outlives a benchmark killed outright."""
    ctypes.CDLL(None).prctl(1, 15)  # PR_SET_PDEATHSIG, SIGTERM


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class SlowLink:
    """A namespace `ns` joined to this one through the emulated link: `outer_ip` here,
    `inner_ip` there. Removed by `close()` (also at exit): every process still inside the
    namespace is killed (all of them are this link's user's), then the namespace and the
    emulator go."""

    def __init__(self, delay_ms: float = 50, rate_mbit: float = 100, limit: int = 1000,
                 subnet: str = "10.213.0", mtu: int = 1500):  # fmt: skip
        tag = f"{os.getpid() % 100000}"
        self.ns, self.devices = f"rtlm-slow-{tag}", (f"rtlm{tag}a", f"rtlm{tag}b")
        self.outer_ip, self.inner_ip = f"{subnet}.1", f"{subnet}.2"
        self.shape = {"delay_ms": delay_ms, "rate_mbit": rate_mbit, "limit": limit, "mtu": mtu}
        self.emulator: subprocess.Popen | None = None
        self.closed = False
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _ip("netns", "add", self.ns)
        self.emulator = subprocess.Popen(
            [sys.executable, __file__, "--emulate", "--ns", self.ns, "--devices", *self.devices,
             "--delay-ms", str(self.shape["delay_ms"]), "--rate-mbit", str(self.shape["rate_mbit"]),
             "--limit", str(self.shape["limit"])],
            stdout=subprocess.PIPE, text=True, preexec_fn=_die_with_parent,
        )  # fmt: skip
        if self.emulator.stdout.readline().strip() != "ready":
            raise RuntimeError("the link emulator did not start")
        outer, inner, mtu = *self.devices, str(self.shape["mtu"])
        _ip("addr", "add", self.outer_ip, "peer", self.inner_ip, "dev", outer)
        _ip("link", "set", outer, "mtu", mtu, "up")
        _ip("-n", self.ns, "addr", "add", self.inner_ip, "peer", self.outer_ip, "dev", inner)
        _ip("-n", self.ns, "link", "set", inner, "mtu", mtu, "up")
        _ip("-n", self.ns, "link", "set", "lo", "up")
        # Whatever the inner side sends to this machine's other addresses crosses the link too.
        _ip("-n", self.ns, "route", "add", "default", "dev", inner)

    def popen(self, command: list[str], **kwargs) -> subprocess.Popen:
        """A process inside the namespace."""
        return subprocess.Popen(
            ["ip", "netns", "exec", self.ns, *command], preexec_fn=_die_with_parent, **kwargs
        )

    def pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def kill_inside(self, timeout_s: float = 10.0) -> None:
        """Ends every process in the namespace: SIGTERM, then SIGKILL for what stays."""
        for sig in (15, 9):
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.time() + timeout_s
            while self.pids() and time.time() < deadline:
                time.sleep(0.2)
            if not self.pids():
                return

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if os.path.exists(f"/var/run/netns/{self.ns}"):
            self.kill_inside()
        if self.emulator is not None and self.emulator.poll() is None:
            self.emulator.kill()
            self.emulator.wait(10)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)

    def __enter__(self) -> SlowLink:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def bytes_crossed(self) -> dict[str, int]:
        """Bytes that crossed the link so far, each way (IP packets, headers included)."""
        stats = Path(f"/sys/class/net/{self.devices[0]}/statistics")
        return {
            "to_inner": int((stats / "tx_bytes").read_text()),
            "from_inner": int((stats / "rx_bytes").read_text()),
        }

    def probe(self, bulk_bytes: int = 4 << 20) -> dict[str, float]:
        """The link as a TCP connection sees it: the round trip (median of 10 one-byte echoes on
        an open connection) and the rate of a `bulk_bytes` transfer each way (from the first
        byte sent to the last received, slow start included)."""
        import socket
        import statistics

        server = self.popen([sys.executable, "-c", PROBE_SERVER, self.inner_ip],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
        port = int(server.stdout.readline())
        try:

            def connect(kind: bytes, n: int) -> socket.socket:
                c = socket.create_connection((self.inner_ip, port), timeout=60)
                c.sendall(struct.pack("!cQ", kind, n))
                return c

            c, rtts = connect(b"e", 10), []
            for _ in range(10):
                t = time.perf_counter()
                c.sendall(b"x")
                c.recv(1)
                rtts.append(time.perf_counter() - t)
            c.close()
            t, c = time.perf_counter(), connect(b"u", bulk_bytes)
            c.sendall(bytes(bulk_bytes))
            c.recv(1)
            up = bulk_bytes / (time.perf_counter() - t)
            c.close()
            t, c, got = time.perf_counter(), connect(b"d", bulk_bytes), 0
            while got < bulk_bytes:
                got += len(c.recv(1 << 20))
            down = bulk_bytes / (time.perf_counter() - t)
            c.close()
        finally:
            server.wait(30)
        return {
            "rtt_ms": round(statistics.median(rtts) * 1000, 1),
            "to_inner_mbit_s": round(up * 8 / 1e6, 1),
            "from_inner_mbit_s": round(down * 8 / 1e6, 1),
            "bulk_bytes": bulk_bytes,
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--emulate", action="store_true", help="(internal) run the emulator")
    p.add_argument("--ns")
    p.add_argument("--devices", nargs=2)
    p.add_argument("--delay-ms", type=float, default=50)
    p.add_argument("--rate-mbit", type=float, default=100)
    p.add_argument("--limit", type=int, default=1000)
    p.add_argument("--probe", action="store_true", help="build a link, measure it, remove it")
    args = p.parse_args()
    if args.emulate:
        emulate(args)
    elif args.probe:
        with SlowLink(args.delay_ms, args.rate_mbit, args.limit) as link:
            print(json.dumps({**link.shape, "probes": [link.probe(n << 20) for n in (4, 16)]}))


if __name__ == "__main__":
    main()
