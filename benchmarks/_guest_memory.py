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
at least that order are reported, so none are); the old value is restored on exit. Root only;
where the file is missing or read-only nothing changes and the result says so.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path
from typing import Iterator

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


@contextlib.contextmanager
def hold_page_reporting(enabled: bool = True, params: Path = _PARAMS) -> Iterator[dict[str, object]]:
    """Hold free page reporting for the ``with`` block; yields a dict recorded in the results.

    The dict holds ``state`` (``"held"``, ``"not held: <why>"``), ``order_before`` and, after
    the block, ``reported_kib_during`` (KiB the guest handed back while the block ran, from the
    module's counter; 0 when the hold worked). Never raises for a missing or read-only knob.
    """
    order_file = params / "page_reporting_order"
    info: dict[str, object] = {}
    old: str | None = None
    if not enabled:
        info["state"] = "not held: --leave-page-reporting"
    elif not order_file.exists():
        info["state"] = "not held: no free page reporting on this machine"
    else:
        try:
            old = order_file.read_text().strip()
            if old == _HELD_ORDER:  # another run holds it and will restore it
                old = None
                info["state"] = "held (already, by another run)"
            else:
                order_file.write_text(_HELD_ORDER + "\n")
                info.update(state="held", order_before=int(old))
        except OSError as e:
            old = None
            info["state"] = f"not held: {order_file}: {e.strerror or e}"
    before = _reported_kib(params)
    # SIGTERM (a timeout, a job scheduler) would skip the restore below: make it an exception.
    previous = None
    if old is not None and threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _raise_system_exit)
    try:
        yield info
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if old is not None:
            order_file.write_text(old + "\n")
        after = _reported_kib(params)
        if before is not None and after is not None:
            info["reported_kib_during"] = after - before


def describe_hold(info: dict[str, object] | None) -> str:
    """One line for a report from the dict :func:`hold_page_reporting` yielded."""
    if not info:
        return "not recorded"
    line = str(info.get("state"))
    if "order_before" in info:
        line += f" (page_reporting_order {info['order_before']} -> {_HELD_ORDER}, restored at the end)"
    if "reported_kib_during" in info:
        line += f"; {int(info['reported_kib_during']) / 1024:.0f} MiB handed to the host during the run"
    return line + " -- see benchmarks/_guest_memory.py"
