import sys

from mla.cli import main

sys.exit(main())
