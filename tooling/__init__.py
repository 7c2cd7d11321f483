"""Build tools, run from a source checkout by nox sessions, apart from the runtime package (nothing in
``packfree_plugin`` imports them): :mod:`tooling.sweep` (``nox -s sweep``), :mod:`tooling.alone` (``nox -s alone``)."""
