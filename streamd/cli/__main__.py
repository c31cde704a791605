"""`python -m streamd.cli`: the `streamd` command."""

import sys

from streamd.cli.main import main

sys.exit(main())
