import sys

from threefold.cli.main import main

sys.exit(main())
