"""`python -m jaxring.models.hf export CHECKPOINT_DIR OUT_DIR [--step N] [--dtype D]`: the command is `cli.py`
(a module of its own, so the format code never imports the command)."""

from jaxring.models.hf.cli import main

raise SystemExit(main())
