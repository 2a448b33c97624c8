"""The command line of a run, generated from the run settings (`jaxring.run.schema`) and the registry.

    spec, meta = parse_command_line(sys.argv[1:])     # meta: config, print_config, debug

One flag per setting (`--NAME-WITH-DASHES`, or the setting's own flag), grouped by section, with its default
in `--help`; a registered strategy's, tensor method's or schedule's options are flags too. `--config
run.yaml` starts from a YAML file of the same settings; flags given on the command line override it.
argparse is enough here: the flags come from typed dataclass fields and registry entries, and a bad flag
must end in one line (exit 2), not a usage block.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from jaxring.run.schema import (
    SECTIONS,
    accepted_types,
    flag_name,
    registered_options,
    setting_choices,
    setting_fields,
)
from jaxring.run.spec import RunSpec
from jaxring.run.task import model_families, model_family

__all__ = ["EXIT_USER_ERROR", "META_FLAGS", "build_parser", "parse_command_line"]

EXIT_USER_ERROR = 2
META_FLAGS = ("config", "print_config", "debug", "compile_for")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line (not the usage block), exit code 2."""
        self.exit(EXIT_USER_ERROR, f"error: {message} (see {self.prog} --help)\n")


def _default_text(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, dict):
        return "none" if not value else ", ".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def _preset_help() -> str:
    return "; ".join(f"{name}: {', '.join(f.presets)}" for name, f in model_families().items())


def build_parser(prog: str = "train.py", description: str | None = None) -> argparse.ArgumentParser:
    """The parser of every setting (defaults suppressed: only given flags appear in the namespace)."""
    p = _Parser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("run specification")
    g.add_argument("--config", metavar="YAML", help="start from this run.yaml; flags given here override it")
    g.add_argument("--print-config", action="store_true", help="print the resolved run as YAML and exit")
    g.add_argument("--debug", action="store_true", help="show the traceback of an error, not only its line")
    g.add_argument(
        "--compile-for",
        metavar="TARGET",
        help="compile the run's step for a GPU machine or TPU slice without one (h100x8, h200x8, h100x1, h200x1; "
        "needs jax[cuda12]; v5e-8, v5p-8, v5p-128, v6e-8, tpu7x-8, ...; needs the tpu-compile extra) and exit: "
        "0 fits, 3 does not fit",
    )
    defaults = RunSpec()
    for section, cls in SECTIONS.items():
        g = p.add_argument_group(section, " ".join((cls.__doc__ or "").split()))
        for name, f in setting_fields(cls).items():
            if name == "options":
                continue
            meta = f.metadata
            flag = flag_name(meta.get("flag") or name)
            default = getattr(getattr(defaults, section), name)
            text = meta["help"] + (f" ({_preset_help()})" if name == "preset" else "")
            if meta.get("entries") is not None:
                text += ": " + "; ".join(f"{n}: {e.summary}" for n, e in meta["entries"]().items() if n != "none")
            if "default" not in meta["help"]:
                text += f" (default: {_default_text(default)})"
            text = text.replace("%", "%%")
            accepted, _ = accepted_types(cls, name)
            kw = {"dest": name, "default": argparse.SUPPRESS, "help": text}
            if bool in accepted:
                g.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
                continue
            if dict in accepted:
                g.add_argument(flag, action="append", metavar=meta.get("metavar") or "NAME=VALUE", **kw)
                continue
            # a typed setting (one with `parse`) is given as its text; the spec parses it
            kind = str if meta.get("parse") else next(t for t in (int, float, str) if t in accepted)
            choices = setting_choices(meta)
            if choices is not None:
                kw["choices"] = choices
            g.add_argument(flag, type=kind, metavar=meta.get("metavar"), **kw)
    _add_options(p)
    return p


def _add_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("strategy options", "options of the registry's entries (jaxring.parallel.registry)")
    for name, (option, owners) in registered_options().items():
        if option.default is not None:
            default = f" (default: {_default_text(option.default)})"
        else:
            default = f" (no default: {'/'.join(owners)} needs it)" if option.required else ""
        g.add_argument(
            flag_name(name),
            dest=name,
            type=option.type,
            choices=option.choices,
            default=argparse.SUPPRESS,
            help=f"{'/'.join(owners)}: {option.help}{default}".replace("%", "%%"),
        )


def parse_command_line(
    argv: Sequence[str] | None = None, prog: str = "train.py", description: str | None = None
) -> tuple[RunSpec, argparse.Namespace]:
    """(spec, meta): the run specification from `--config` (if given) with the flags over it (not yet
    validated), and the namespace of the meta flags (config, print_config, debug). Bad flags, a bad YAML
    file or an unknown key end the process with one line and exit code 2."""
    parser = build_parser(prog, description)
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    given = {k: v for k, v in vars(ns).items() if k not in META_FLAGS}
    meta = argparse.Namespace(**{k: getattr(ns, k, None) for k in META_FLAGS})
    meta.print_config = bool(meta.print_config)
    meta.debug = bool(meta.debug)
    try:
        base = RunSpec.load(meta.config) if meta.config else RunSpec()
        items = given.pop("overrides", None)
        spec = base.updated(**given)
        if items:
            family = model_family(spec.model.model)
            parsed = dict(family.parse_override(item) for item in items)
            spec = dataclasses.replace(
                spec, model=dataclasses.replace(spec.model, overrides={**spec.model.overrides, **parsed})
            )
    except ValueError as e:
        if meta.debug:
            raise
        parser.exit(EXIT_USER_ERROR, f"error: {' '.join(str(e).split())}\n")
    return spec, meta
