"""The run specification: its typed settings (CLI flags, YAML keys, `make_plan` keywords), the checks across
them, the model families (tasks) and the command-line helpers."""
