import sys

from cachedaemon.cli import main

sys.exit(main())
