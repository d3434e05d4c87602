"""Where checkpoints and run locks lie: a local directory, or anywhere fsspec reaches (``s3://``, ``gs://``, ...).

:func:`to_path` turns a location into a ``Path`` or a :class:`RemotePath` (``pathlib``'s methods over an fsspec file
system); on object storage, which has no rename, a checkpoint is complete once its commit marker (:data:`COMMIT`)
is written, last (:func:`commit`)."""

from cuboid.storage.paths import (
    COMMIT,
    RemotePath,
    commit,
    committed_at,
    dcp_reader,
    dcp_writer,
    is_remote,
    readable,
    save_object,
    to_path,
)

__all__ = [
    "COMMIT",
    "RemotePath",
    "commit",
    "committed_at",
    "dcp_reader",
    "dcp_writer",
    "is_remote",
    "readable",
    "save_object",
    "to_path",
]
