import sys

from jaxring.eval.cli import main

sys.exit(main())
