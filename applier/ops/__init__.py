"""Operations: what an operator sees of applier from the outside.

``lag`` (the one definition of apply lag and of lag limits), ``logs`` (text or JSON lines, with
passwords masked and slot/LSN/xid context), ``metrics`` (Prometheus metrics, ``/healthz`` and
``/readyz`` of a running worker, read from the worker's own state at scrape time), ``status``
(``applier status``), ``healthcheck`` (the container health check) and ``reference`` (the
configuration reference in README.md, generated from the option table). Nothing here changes
what is replicated or when: these modules only observe.
"""
