"""The sweep: prove every model type of the installed transformers and record what is exact.

``python -m tooling.sweep`` (``nox -s sweep``) proves every target (:mod:`.run`) and writes what it found
(:mod:`.render`): ``packfree_plugin/gate/verified.json``, keyed by transformers version (the exact classes and every
result), which the load-time gate reads; the support matrix in ``docs/support-matrix.md``; and the gate on users'
configs, ``docs/gate-checks.md``.
"""
