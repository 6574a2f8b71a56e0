"""Drop-in DCP storage classes (docs/integrations.md, "Plain DCP"): ``dcp.save`` / ``dcp.load``
with ``storage_writer=distckpt.dcp.FileSystemWriter(path)`` and
``storage_reader=distckpt.dcp.FileSystemReader(path)`` in place of torch's classes of the same
names. Same arguments, same files; plus file hashes recorded while writing and verified while
reading, the fast reader, and ``s3://`` paths."""

from ._dcp import FileSystemReader, FileSystemWriter

__all__ = ["FileSystemReader", "FileSystemWriter"]
