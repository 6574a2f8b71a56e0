"""distckpt: save and resume the whole training state of a torchrun job through DCP.

Public API: :class:`CheckpointConfig` and its sections (:class:`ScheduleConfig`, ...),
:class:`CheckpointManager`, :class:`TrainState`, the reshardable data sampler, and the typed errors.
"""

from ._config import (
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
from ._data import ReshardableSampler
from ._errors import (
    CheckpointCorruptError,
    CheckpointLockedError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CollectiveMismatchError,
    ConfigError,
    DistCkptError,
    IncompatibleCheckpointError,
    ManagerClosedError,
    RankLostError,
    ReaderInvariantError,
    StorageError,
)
from ._manager import CheckpointManager
from ._state.train_state import TrainState
from ._version import __version__

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
    "ManagerClosedError",
    "CheckpointSaveError",
    "CollectiveMismatchError",
    "RankLostError",
    "ReaderInvariantError",
]
