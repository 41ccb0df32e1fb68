import sys

from dynaspec.cli import main

sys.exit(main())
