"""`python -m jaxring.models.hf export CHECKPOINT_DIR OUT_DIR [--step N] [--dtype D]`: the command lives in
`jaxring.models.hf_export` (which reads and writes through this package: a module of its own, so the format
code never imports the command)."""

from jaxring.models.hf_export import main

raise SystemExit(main())
