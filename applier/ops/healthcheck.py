"""The container health check: ``python -m applier.ops.healthcheck``.

Owns one question: is this container's worker alive? With a metrics port configured
(``APPLIER_METRICS_PORT``) it asks the worker's ``/healthz``; without one it can only check that
applier imports and its decoder loads. Exit 0 healthy, 1 not. Must never connect to a database.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    port = os.environ.get("APPLIER_METRICS_PORT")
    if not port:
        import applier.protocol
        import applier.worker  # noqa: F401
        return 0
    url = f"http://127.0.0.1:{int(port)}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=4) as response:
            return 0 if response.status == 200 else 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"applier health check: {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
