"""Build hook: the optional C accelerators and the package layout; other metadata is in pyproject.toml.

``optional=True`` lets an install without a C compiler succeed: the decoder, the apply stage's
insert lane, the replication stream's frame reader and the initial copy's relay then stay on
their pure-Python paths. The top-level ``migrations/`` folder ships inside the package as
``applier._migrations`` so an installed applier (a wheel, the Docker image) can upgrade its
bookkeeping schema; a source checkout uses the folder in place.
"""

from setuptools import Extension, find_packages, setup

setup(
    packages=find_packages(include=["applier", "applier.*"])
    + ["applier._migrations", "applier._migrations.versions"],
    package_dir={"applier._migrations": "migrations"},
    package_data={"applier": ["py.typed"], "applier._migrations": ["script.py.mako"],
                  "applier.spark": ["*.properties"]},
    ext_modules=[
        Extension(
            "applier.protocol._speedups",
            ["applier/protocol/_speedups.c"],
            depends=["applier/protocol/_wire.h"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
        Extension(
            "applier.apply._lane",
            ["applier/apply/_lane.c"],
            depends=["applier/protocol/_wire.h"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
        Extension(
            "applier.source._frames",
            ["applier/source/_frames.c"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
        Extension(
            "applier.sync._relay",
            ["applier/sync/_relay.c"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
    ]
)
