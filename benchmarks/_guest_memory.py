"""Hold a virtual machine's free page reporting while a benchmark runs.

Why: on a VM whose kernel reports free pages to the host (virtio-balloon free page reporting,
``/sys/module/page_reporting``), memory freed a few seconds ago is handed back to the host, and
the next use of it faults it in again on the host side. Evicting a checkpoint from the page
cache frees exactly such memory, so a "cold" read a few seconds later lands in pages the host
must supply again. Measured on this project's 2-core Firecracker VM (1 GiB file, one
sequential 16 MiB-``readv`` reader, page cache evicted with ``posix_fadvise``): read at once
after eviction 0.31 s; after a 6 s wait 1.13-1.30 s, its second half at ~0.55 GB/s; with
reporting held, 0.33 s after the same wait. The slow mode is the hypervisor refaulting guest
memory, not the disk nor the reader, and does not exist on bare-metal training nodes, so the
load and save benchmarks hold reporting (when they may) and record that they did.

Holding = raising ``page_reporting_order`` above the largest buddy order (only free blocks of
at least that order are reported, so none are); the old value is restored on exit, also on
SIGTERM/SIGHUP, and a hold left by a killed run is repaired by the next run. Root only; where
the file is missing or read-only nothing changes and the result says so.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator

__all__ = ["describe_hold", "hold_page_reporting"]

_PARAMS = Path("/sys/module/page_reporting/parameters")
_HELD_ORDER = "11"  # above MAX_PAGE_ORDER (10 on x86-64): no free block qualifies


def _raise_system_exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _reported_kib(params: Path) -> int | None:
    try:
        return int((params / "reported_kib").read_text())
    except (OSError, ValueError):
        return None


def _owner_alive(record: Path) -> bool | None:
    """Whether the run that wrote ``record`` still runs (``None``: no readable record)."""
    try:
        pid = json.loads(record.read_text())["pid"]
        os.kill(int(pid), 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return None


@contextlib.contextmanager
def hold_page_reporting(
    enabled: bool = True, params: Path = _PARAMS, record: Path | None = None
) -> Iterator[dict[str, object]]:
    """Hold free page reporting for the ``with`` block; yields a dict recorded in the results.

    The dict holds ``state`` (``"held"``, ``"held (already, by another run)"``, ``"not held:
    <why>"``), ``order_before`` and, after the block, ``reported_kib_during`` (KiB the guest
    handed back while the block ran, from the module's counter; 0 when the hold worked).

    The old value and this process's pid go to ``record`` (default: beside the system's temp
    files) for the hold's duration; SIGTERM and SIGHUP become ``SystemExit`` so the restore
    runs. A hold left by a run that died without restoring (SIGKILL) is found by the next one
    (the pid is gone) and its recorded value restored at that run's end. Never raises for a
    missing or read-only knob.
    """
    order_file = params / "page_reporting_order"
    record = record or Path(tempfile.gettempdir()) / "distckpt-page-reporting-hold.json"
    info: dict[str, object] = {}
    old: str | None = None
    if not enabled:
        info["state"] = "not held: --leave-page-reporting"
    elif not order_file.exists():
        info["state"] = "not held: no free page reporting on this machine"
    else:
        try:
            old = order_file.read_text().strip()
            if old == _HELD_ORDER:
                alive = _owner_alive(record)
                if alive is False:  # left by a run that died: take over its record
                    old = str(json.loads(record.read_text())["order"])
                    info["recovered_from_dead_run"] = True
                else:
                    old = None
                    info["state"] = (
                        "held (already, by another run)" if alive else "held (already; no record of the value before)"
                    )
            if old is not None:
                record.write_text(json.dumps({"pid": os.getpid(), "order": old}))
                order_file.write_text(_HELD_ORDER + "\n")
                info.update(state="held", order_before=int(old))
        except (OSError, ValueError, KeyError) as e:
            old = None
            info["state"] = f"not held: {order_file}: {getattr(e, 'strerror', None) or e}"
    before = _reported_kib(params)
    previous: dict[signal.Signals, Any] = {}
    if old is not None and threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, _raise_system_exit)
    try:
        yield info
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if old is not None:
            order_file.write_text(old + "\n")
            with contextlib.suppress(OSError):
                record.unlink()
        after = _reported_kib(params)
        if before is not None and after is not None:
            info["reported_kib_during"] = after - before


def describe_hold(info: dict[str, Any] | None) -> str:
    """One line for a report from the dict :func:`hold_page_reporting` yielded."""
    if not info:
        return "not recorded"
    line = str(info.get("state"))
    if "order_before" in info:
        line += f" (page_reporting_order {info['order_before']} -> {_HELD_ORDER}, restored at the end)"
    if info.get("recovered_from_dead_run"):
        line += "; repaired the hold a killed run had left"
    if "reported_kib_during" in info:
        line += f"; {int(info['reported_kib_during']) / 1024:.0f} MiB handed to the host during the run"
    return line + " -- see benchmarks/_guest_memory.py"
