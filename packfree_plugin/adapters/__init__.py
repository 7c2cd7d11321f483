"""How boundaries reach each layer: the mixer adapters (per family), positions, pooling heads and kernel routes.

:func:`packfree_plugin.apply` installs them on a model."""
