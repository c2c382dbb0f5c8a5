"""applier: a PostgreSQL logical-replication replica applier.

Data path: source stream -> protocol decoder -> transaction assembler -> apply -> progress.
"""

__version__ = "0.1.0"
