"""What async saves run on: DCP's ``async_save`` writer and a gloo group that only their background
work uses, so it never interleaves with the training loop's collectives."""

from __future__ import annotations

from typing import Any

from .._config import CheckpointConfig
from .._coord.collective import Collective
from .._engine import AsyncWriter

__all__ = ["open_async_writer"]


def open_async_writer(config: CheckpointConfig, process_group: Any) -> tuple[Collective | None, AsyncWriter | None]:
    """``(background group, writer)`` of ``config``'s async saves over ``process_group``
    (``None``: the default group); ``(None, None)`` when ``async_save.mode`` is ``off`` or
    ``save.enabled`` is false. Collective (creates a group).

    Raises:
        ConfigError: ``async_save.mode: process`` without an initialised ``torch.distributed``.
    """
    if config.async_save.mode == "off" or not config.save.enabled:
        return None, None
    coord = config.coordination
    background = Collective(process_group, timeout_s=coord.timeout_s)
    writer = AsyncWriter(
        config.async_save.mode,
        background_staging=config.async_save.background_staging,
        process_group=background.group,
        thread_count=config.save.thread_count,
        write_timeout_s=coord.effective_write_timeout_s,
    )
    return background, writer
