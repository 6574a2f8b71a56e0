"""distckpt: save and resume the whole training state of a torchrun job through DCP.

Public API: :class:`CheckpointConfig` and its sections (:class:`ScheduleConfig`, ...),
:class:`CheckpointManager`, :class:`TrainState`, the reshardable data sampler, and the typed errors.
"""

from ._version import __version__
from .config import (
    AsyncSaveConfig,
    CheckpointConfig,
    CoordinationConfig,
    ElasticConfig,
    KeepBest,
    LoadConfig,
    MemoryConfig,
    PreemptionConfig,
    RetentionConfig,
    SaveConfig,
    ScheduleConfig,
    StorageConfig,
)
from .data import ReshardableSampler
from .errors import (
    CheckpointCorruptError,
    CheckpointLockedError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CollectiveMismatchError,
    ConfigError,
    DistCkptError,
    IncompatibleCheckpointError,
    ReaderInvariantError,
    StorageError,
)
from .manager import CheckpointManager
from .state.training_state import TrainState

__all__ = [
    "__version__",
    "CheckpointConfig",
    "ScheduleConfig",
    "RetentionConfig",
    "KeepBest",
    "SaveConfig",
    "AsyncSaveConfig",
    "LoadConfig",
    "ElasticConfig",
    "PreemptionConfig",
    "CoordinationConfig",
    "StorageConfig",
    "MemoryConfig",
    "CheckpointManager",
    "TrainState",
    "ReshardableSampler",
    "DistCkptError",
    "StorageError",
    "ConfigError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "IncompatibleCheckpointError",
    "CheckpointLockedError",
    "CheckpointSaveError",
    "CollectiveMismatchError",
    "ReaderInvariantError",
]
