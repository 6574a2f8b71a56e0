"""Drop-in DCP storage classes: ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` with
``storage_writer=distckpt.dcp.FileSystemWriter(path)`` and
``storage_reader=distckpt.dcp.FileSystemReader(path)`` in place of torch's classes of the same
names (docs/integrations.md, "Plain DCP"). Same arguments, same files; plus file hashes recorded
while writing and verified while reading, the fast reader, and ``s3://`` paths.
"""

from torch.distributed.checkpoint.filesystem import SerializationFormat

from .reader import FileSystemReader
from .writer import FileSystemWriter

__all__ = ["FileSystemReader", "FileSystemWriter", "SerializationFormat"]
