"""``python -m packfree_plugin`` runs the ``packfree`` command line."""

import sys

from .cli import main

sys.exit(main())
