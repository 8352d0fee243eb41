import sys

from expstream.cli import main

sys.exit(main())
