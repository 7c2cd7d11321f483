"""``python -m packfree_plugin`` runs the ``packfree`` command line."""

import sys

from .tools.cli import main

sys.exit(main())
