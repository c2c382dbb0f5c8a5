"""Build hook for the optional C accelerator; all other metadata lives in pyproject.toml.

``optional=True`` lets an install without a C compiler succeed: the decoder then stays on its
pure-Python path.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "applier.protocol._speedups",
            ["applier/protocol/_speedups.c"],
            optional=True,
            extra_compile_args=["-O2"],
        )
    ]
)
