"""`python -m agentrl.cli`: the same as the `agentrl` console script."""

import sys

from agentrl.cli import main

sys.exit(main())
