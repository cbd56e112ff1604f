import sys

from harness.docker.inside import main

sys.exit(main())
