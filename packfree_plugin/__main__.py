"""``python -m packfree_plugin`` runs the ``packfree`` command line."""

import sys

from .cli.main import main

sys.exit(main())
