"""The last steps of a replica's life: ``applier sequences``, ``applier cutover``, ``applier drop``.

A replica made by ``applier sync`` and kept current by ``applier run`` usually exists to replace
its source one day. These commands do what is left then: set the target's sequences past the
source's (:mod:`.sequences`), check that the target is a safe replacement once writes to the
source have stopped (:mod:`.cutover`), and remove everything the replica left behind on both
servers and on this machine (:mod:`.drop`). Shared reads of both servers live in :mod:`.servers`.
Must never fence the source (stopping writes is the operator's), and no command but ``drop`` may
remove anything.
"""
