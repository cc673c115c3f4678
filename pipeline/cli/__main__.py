"""`python -m pipeline.cli` is `trtmc`."""
import sys

from pipeline.cli import main

sys.exit(main())
