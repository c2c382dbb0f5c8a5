"""A quiet local (or cluster) SparkSession with the PostgreSQL JDBC driver on its class path.

Owns: finding the pgjdbc jar without network access, and the Spark settings every applier Spark
command uses (quiet logs, no UI, loopback binding, UTC session time zone). Must never download
anything (Maven Central is not assumed reachable) nor change a session someone else created.

Driver jar search order: the ``jar`` argument, ``$APPLIER_JDBC_JAR``, Debian's
``libpostgresql-jdbc-java`` (``/usr/share/java/postgresql.jar``), then the newest
``org/postgresql/postgresql/*/postgresql-*.jar`` in the local Maven repository
(``$MAVEN_REPO`` or ``~/.m2/repository``).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["JDBC_DRIVER", "SparkUnavailable", "find_jdbc_jar", "spark_session"]

JDBC_DRIVER = "org.postgresql.Driver"
JAR_ENV = "APPLIER_JDBC_JAR"
DEBIAN_JARS = (Path("/usr/share/java/postgresql.jar"), Path("/usr/share/java/postgresql-jdbc4.jar"))
LOG4J2_FILE = Path(__file__).resolve().parent / "log4j2.properties"

INSTALL_HINT = ("install the PostgreSQL JDBC driver: `apt-get install libpostgresql-jdbc-java` "
                "(Debian/Ubuntu), or download postgresql-<version>.jar from "
                "https://jdbc.postgresql.org and pass --jdbc-jar PATH or set "
                f"{JAR_ENV}=PATH")


class SparkUnavailable(RuntimeError):
    """PySpark or the JDBC driver is missing; the message says how to install it."""


def _version_key(path: Path) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", path.parent.name))


def find_jdbc_jar(jar: str | os.PathLike[str] | None = None) -> Path:
    """The pgjdbc jar to put on Spark's class path; raises SparkUnavailable with a hint."""
    explicit = jar or os.environ.get(JAR_ENV)
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            source = "the jar argument" if jar else f"${JAR_ENV}"
            raise SparkUnavailable(f"{source} names {path}, which is not a file; {INSTALL_HINT}")
        return path
    for path in DEBIAN_JARS:
        if path.is_file():
            return path
    repo = Path(os.environ.get("MAVEN_REPO") or Path.home() / ".m2" / "repository")
    candidates = sorted((repo / "org" / "postgresql" / "postgresql").glob("*/postgresql-*.jar"),
                        key=_version_key)
    # Skip -sources/-javadoc jars, which Maven puts in the same folder.
    candidates = [c for c in candidates if re.fullmatch(r"postgresql-[\d.]+(-\w+)?\.jar", c.name)
                  and not c.name.endswith(("-sources.jar", "-javadoc.jar"))]
    if candidates:
        return candidates[-1]
    raise SparkUnavailable(f"no PostgreSQL JDBC driver found (looked at ${JAR_ENV}, "
                           f"{', '.join(map(str, DEBIAN_JARS))} and {repo}); {INSTALL_HINT}")


def spark_session(master: str | None = None, *, app_name: str = "applier",
                  jar: str | os.PathLike[str] | None = None, driver_memory: str | None = None,
                  config: Mapping[str, str] | None = None) -> SparkSession:
    """A SparkSession for reading replicas: ``local[*]`` unless ``master`` names a cluster.

    Returns the active session unchanged if one exists in this process (Spark allows one per
    JVM, and settings such as the class path cannot change after it started).
    """
    try:
        from pyspark.sql import SparkSession
    except ImportError as exc:
        raise SparkUnavailable("PySpark is not installed: pip install 'applier[spark]' "
                               "(or pip install pyspark)") from exc
    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    master = master or "local[*]"
    if master.startswith("local"):
        # Without this Spark binds to the external interface and warns that the host name
        # resolves to a loopback address; a local session needs nothing but loopback.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    # Python workers must run the interpreter (and virtualenv) the driver runs.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    jar_path = find_jdbc_jar(jar)
    log_option = f"-Dlog4j2.configurationFile={LOG4J2_FILE.as_uri()}"
    builder = (SparkSession.builder.master(master).appName(app_name)
               .config("spark.jars", str(jar_path))
               .config("spark.driver.extraJavaOptions", log_option)
               .config("spark.executor.extraJavaOptions", log_option)
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               # One time zone for every reader: timestamptz values are instants either way,
               # and UTC makes their text and Parquet forms independent of the host.
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.sql.shuffle.partitions", "8" if master.startswith("local") else "200"))
    if driver_memory:
        builder = builder.config("spark.driver.memory", driver_memory)
    for key, value in (config or {}).items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("WARN")
    return session
