"""`python -m flare_paper ARGS`: `flare paper ARGS`."""
import sys

from flare_paper.cli import main

sys.exit(main())
