"""One writer per run: a lease in the run directory, taken before anything of the run is
written and held, renewed in the background, for the run's whole life. It uses only what a
local folder and a bucket both give: whole-object writes (a PUT; on a disk, a temp file
renamed over the file), deletes and listings; no rename of a shared object, no append, no
conditional write.

The protocol. Each candidate writes a claim object of its own, `lease/<unique id>.json`
(holder: host, pid, user, start, command; `expires_at` = its clock + TTL), then lists the
claims. It holds the lease if no OTHER live claim is listed; otherwise it deletes its claim
and is refused, naming the live holder. Before writing it looks once, so that a refusal in
the usual case writes nothing at all. The holder overwrites its own claim (a renewal, every
TTL/6) and deletes it when the run ends, on errors and Ctrl-C too (and at the interpreter's
exit: Tune ends a stopped trial's actor without unwinding its threads).

A claim is dead, and ignored (and removed by the next holder), when its holder is known to be
gone: past `expires_at` + MAX_CLOCK_SKEW_S by the reader's clock, or, on the same machine
(same kernel boot and pid namespace), when its process no longer exists (so the same command
run again after a SIGKILL or a crash goes on at once, not a TTL later; Ray ends the run's
actors with their driver).

Why two holders cannot overlap, given (1) the store's strong read-after-write and list
consistency (S3, GCS, a local disk; not NFS with attribute caching) and (2) clocks that
differ by at most MAX_CLOCK_SKEW_S (NTP or chrony keep machines within milliseconds; the
allowance is generous):

- Two candidates A and B, each writing (W) then listing (L). If A's list missed B's claim,
  L_A < W_B, so W_A < L_A < W_B < L_B: B's list shows A's claim, which nobody deletes while
  it is live, so B refuses. Both may see each other and both refuse: safe (run it again).
- B may judge A's claim expired only when B's clock is past `expires_at` + skew, so A's
  clock is past `expires_at`. Hence the holder's rule: a claim counts as held only up to its
  own `expires_at` by the holder's clock. A candidacy whose listing ends after that (a
  stalled process) starts again, and a renewal that lands after it (a suspended machine, a
  bucket away for longer than the TTL) is a new candidacy: the holder lists the claims, and
  if another live claim is there the lease is lost (the run is asked to stop; it publishes
  nothing). Without that rule, which the plain write-then-list design lacks, a holder that
  stalled past its TTL would renew its claim back to life beside the one that replaced it.
- Only dead claims are deleted by others; a dead claim's holder is gone, or is stalled and
  meets the rule above at its next renewal.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import getpass
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raytrain_lm.errors import UserError
from raytrain_lm.rundir import LEASE_DIR, RunDir
from raytrain_lm.storage import filesystem, retrying

TTL_S = 60.0
RENEWALS_PER_TTL = 6
# Readers add this to a claim's expiry: the most two machines' clocks may differ.
MAX_CLOCK_SKEW_S = 15.0
# How long a claim write, listing or delete waits out a bucket that does not answer.
STORE_PATIENCE_S = 30.0
# A sweep trial started again (a new process, perhaps on another node) waits this long for
# its old process's claim to go: a dead one's expires within it (see sweeps/trial.py).
TRIAL_PATIENCE_S = TTL_S + MAX_CLOCK_SKEW_S + 2 * TTL_S / RENEWALS_PER_TTL


class LeaseHeld(UserError):
    """Another live process holds the run's lease."""


class LeaseLost(UserError):
    """The holder could not renew in time and another process holds the lease now."""


@functools.cache
def _machine() -> str:
    """This kernel and pid namespace: where a claim's pid means the same process."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        import psutil

        boot = f"{socket.gethostname()}@{psutil.boot_time():.0f}"
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{boot}/{namespace}"


def this_process() -> dict[str, Any]:
    import psutil

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a container's uid without a passwd entry
        user = str(os.getuid())
    command = " ".join([os.path.basename(sys.argv[0]) if sys.argv else "python", *sys.argv[1:]])
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "user": user,
        "command": command if len(command) <= 120 else command[:117] + "...",
        "machine": _machine(),
        "process_started": psutil.Process().create_time(),
    }


def _process_gone(claim: dict[str, Any]) -> bool:
    """Whether the claim's process is known to have ended (only on this machine)."""
    import psutil

    if claim.get("machine") != _machine():
        return False
    try:
        process = psutil.Process(int(claim["pid"]))
        if abs(process.create_time() - float(claim["process_started"])) > 1.0:
            return True  # the pid was reused
        return process.status() == psutil.STATUS_ZOMBIE  # ended, not yet reaped
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return True
    except (psutil.AccessDenied, KeyError, ValueError):
        return False


def describe(claim: dict[str, Any]) -> str:
    started = time.strftime("%Y-%m-%d %H:%M", time.localtime(claim.get("started_at", 0)))
    return (
        f"pid {claim.get('pid')} on {claim.get('host')} (user {claim.get('user')}, since "
        f"{started}: {claim.get('command')})"
    )


@dataclass(eq=False)  # one lease is one holder: hashed by identity
class RunLease:
    """The lease on `run_dir` for the run `name`; a context manager (acquire, release).
    `patience_s`: how long to wait for another live claim to go (0: refuse at once); `clock`,
    `ttl_s`, `max_skew_s`, `renew_every_s`: the protocol's terms (tests shorten them);
    `on_lost`: called once if the lease is lost (module docstring)."""

    run_dir: RunDir
    name: str
    ttl_s: float = TTL_S
    max_skew_s: float = MAX_CLOCK_SKEW_S
    renew_every_s: float | None = None
    patience_s: float = 0.0
    clock: Callable[[], float] = time.time
    on_lost: Callable[[], None] | None = None
    lost: str | None = None
    claim: dict[str, Any] | None = None
    _stop_renewing: threading.Event = field(default_factory=threading.Event)
    _renewer: threading.Thread | None = None
    _created: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.renew_every_s is None:
            self.renew_every_s = self.ttl_s / RENEWALS_PER_TTL
        self.run_dir = RunDir.coerce(self.run_dir)

    def __enter__(self) -> RunLease:
        return self.acquire()

    def __exit__(self, *exc_info: Any) -> None:
        self.release()

    def acquire(self, renew_in_background: bool = True) -> RunLease:
        """Takes the lease or raises LeaseHeld naming the live holder (nothing left behind)."""
        waited_from, told = time.monotonic(), False
        try:
            while True:
                live = self.live_claims()  # a refusal in the usual case writes nothing
                if not live:
                    self.write_claim()
                    live = self.settle()
                    if not live:
                        break
                if time.monotonic() - waited_from >= self.patience_s:
                    raise LeaseHeld(self._refusal(live[0]))
                if not told:
                    told = True
                    print(f"[raytrain-lm] run '{self.name}': waiting up to {self.patience_s:g}"
                          f" s for {describe(live[0])} to let go of it", flush=True)  # fmt: skip
                time.sleep(min(1.0, self.renew_every_s))
        except BaseException:
            self._delete_own_claim()
            self._remove_created_folders()
            raise
        self._remove_dead_claims()
        _HELD.add(self)
        if renew_in_background:
            self._renewer = threading.Thread(
                target=self._renew_until_released, name=f"lease-{self.name}", daemon=True
            )
            self._renewer.start()
        return self

    def settle(self) -> list[dict[str, Any]]:
        """A candidacy's second step, after `write_claim`: the other live claims, after which
        this candidate's own claim is deleted; none: this candidate holds the lease."""
        while True:
            live = self.live_claims()
            if live:
                self._delete_own_claim()
                return live
            if self.clock() < self.claim["expires_at"]:
                return []
            self.write_claim()  # the candidacy outlasted its own claim (a stall): again

    def write_claim(self) -> None:
        """Writes this candidate's claim (its first step), or overwrites it (a renewal)."""
        now = self.clock()
        if self.claim is None:
            self._created = self._missing_folders()
            self.claim = {
                "id": f"{int(now * 1e6):017d}-{uuid.uuid4().hex[:12]}",
                "run": self.name,
                **this_process(),
                "started_at": now,
            }
        self.claim |= {"renewed_at": now, "expires_at": now + self.ttl_s, "ttl_s": self.ttl_s}
        data = json.dumps(self.claim, indent=1).encode()
        self._store(lambda: self._put(f"{self.claim['id']}.json", data), "writing")

    def live_claims(self) -> list[dict[str, Any]]:
        """The other candidates' claims that are live, oldest first."""
        return [c for c in self._other_claims() if not self._dead(c)]

    def renew(self) -> bool:
        """One renewal; False once the lease is lost (then `on_lost` has been called)."""
        if self.lost is not None or self.claim is None:
            return self.lost is None
        held_until = self.claim["expires_at"]
        self.write_claim()
        if self.clock() < held_until:
            return True
        live = self.live_claims()  # it lapsed: a new candidacy
        if not live:
            return True
        self.lost = describe(live[0])
        self._stop_renewing.set()
        self._delete_own_claim()
        print(f"[raytrain-lm] run '{self.name}' lost its lease to {self.lost}: it was not "
              f"renewed within {self.ttl_s:g} s; stopping", file=sys.__stderr__, flush=True)  # fmt: skip
        if self.on_lost is not None:
            self.on_lost()
        return False

    def check(self) -> None:
        """Raises LeaseLost if the lease was lost while the run went on."""
        if self.lost is not None:
            raise LeaseLost(
                f"run '{self.name}' lost its lease to {self.lost} (not renewed within "
                f"{self.ttl_s:g} s, a stalled or cut-off process) and stopped without "
                "publishing; run it again once that process has ended"
            )

    def release(self) -> None:
        """Stops renewing and deletes the claim; the lease folder goes if it is empty."""
        self._stop_renewing.set()
        if self._renewer is not None and self._renewer is not threading.current_thread():
            self._renewer.join(timeout=STORE_PATIENCE_S)
        _HELD.discard(self)
        if self.claim is not None and self.lost is None:
            self._delete_own_claim()
        self._remove_created_folders()

    def _renew_until_released(self) -> None:
        while not self._stop_renewing.wait(self.renew_every_s):
            try:
                if not self.renew():
                    return
            except OSError as exc:  # the store is away: the next renewal tries again
                reason = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
                print(
                    f"[raytrain-lm] lease of run '{self.name}' not renewed ({reason}); "
                    f"trying again in {self.renew_every_s:g} s",
                    file=sys.__stderr__,
                    flush=True,
                )

    def _dead(self, claim: dict[str, Any]) -> bool:
        try:
            expires_at = float(claim["expires_at"])
        except (KeyError, TypeError, ValueError):
            return True  # not a claim this protocol wrote
        return self.clock() > expires_at + self.max_skew_s or _process_gone(claim)

    def _refusal(self, holder: dict[str, Any]) -> str:
        text = (
            f"run '{self.name}' is already running: {describe(holder)}; one writer per run: "
            "wait for it to end, stop it, or choose another name=..."
        )
        if holder.get("machine") == _machine():
            return text  # its process was looked up: it is alive
        expires = float(holder["expires_at"]) + self.max_skew_s
        at = time.strftime("%H:%M:%S", time.localtime(expires))
        return (
            f"{text} (if that process is gone, its lease in {self.run_dir.at(LEASE_DIR)} "
            f"expires at {at}, in {max(0, expires - self.clock()):.0f} s)"
        )

    def _other_claims(self) -> list[dict[str, Any]]:
        own = f"{self.claim['id']}.json" if self.claim is not None else None
        names = self._store(lambda: self.run_dir.list_files(LEASE_DIR), "listing")
        claims = []
        for name in names:
            if name == own or name.startswith(".") or not name.endswith(".json"):
                continue
            data = self._store(lambda n=name: self._get(n), "reading")
            if data is None:
                continue  # released meanwhile
            try:
                claims.append(json.loads(data) | {"file": name})
            except ValueError:
                claims.append({"file": name})  # not ours to judge: dead (see _dead)
        return claims

    def _remove_dead_claims(self) -> None:
        for claim in self._other_claims():
            if self._dead(claim) and "expires_at" in claim:
                with contextlib.suppress(OSError):
                    self._store(lambda c=claim: self._delete(c["file"]), "removing")

    def _delete_own_claim(self) -> None:
        if self.claim is None:
            return
        try:
            self._store(lambda: self._delete(f"{self.claim['id']}.json"), "deleting")
        except OSError as exc:  # it expires by itself
            print(f"[raytrain-lm] lease of run '{self.name}' not deleted: {exc}", flush=True)

    def _store(self, action: Callable[[], Any], what: str) -> Any:
        if not self.run_dir.remote:
            return action()
        give_up_at = time.time() + STORE_PATIENCE_S
        return retrying(action, f"{what} the lease of run '{self.name}'", give_up_at)

    def _put(self, name: str, data: bytes) -> None:
        if not self.run_dir.remote:
            for attempt in range(3):  # another holder's release may remove the empty folder
                try:
                    return self.run_dir.write_bytes(data, LEASE_DIR, name)
                except FileNotFoundError:
                    if attempt == 2:
                        raise
        fs, inner = filesystem(self.run_dir.at(LEASE_DIR, name))
        with fs.open_output_stream(inner) as f:
            f.write(data)

    def _get(self, name: str) -> bytes | None:
        fs, inner = filesystem(self.run_dir.at(LEASE_DIR, name))
        with contextlib.suppress(FileNotFoundError), fs.open_input_stream(inner) as f:
            return f.read()
        return None  # deleted since the listing

    def _delete(self, name: str) -> None:
        fs, inner = filesystem(self.run_dir.at(LEASE_DIR, name))
        with contextlib.suppress(FileNotFoundError):
            fs.delete_file(inner)

    def _missing_folders(self) -> list[str]:
        """The local folders the claim's write will create, deepest first (a bucket has none)."""
        if self.run_dir.remote:
            return []
        missing, folder = [], Path(self.run_dir.at(LEASE_DIR))
        while not folder.exists():
            missing.append(str(folder))
            folder = folder.parent
        return missing

    def _remove_created_folders(self) -> None:
        """A run that ends or is refused leaves no empty lease folder, nor one it made."""
        lease_folder = [] if self.run_dir.remote else [self.run_dir.at(LEASE_DIR)]
        for folder in dict.fromkeys([*lease_folder, *self._created]):
            try:
                os.rmdir(folder)
            except FileNotFoundError:
                continue
            except OSError:
                break  # not empty: the run's own files, or another candidate's claim
        self._created = []


_HELD: set[RunLease] = set()


@atexit.register
def _release_at_exit() -> None:
    for lease in list(_HELD):
        with contextlib.suppress(Exception):
            lease.release()
