"""``python -m expansion_dag.sim``: the same as the ``expansion-sim`` command."""

import sys

from expansion_dag.sim.cli import main

sys.exit(main())
