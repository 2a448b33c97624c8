"""Writes notebooks/NN_name.ipynb from notebooks/src/NN_name.py, without outputs.

    python notebooks/build.py              # rebuild every notebook
    python notebooks/build.py --check      # exit 1 if a stored notebook differs from its source

The sources are in the "percent" format that Jupytext, VS Code and PyCharm read: `# %%` starts a code cell,
`# %% [markdown]` a Markdown cell whose lines are written as comments (`# text`, `#` for an empty line). In
code cells a commented `# %pip ...` line is the `%pip` magic (so the source stays valid Python). Edit the
source, run this script, and commit both; `tests/integration/test_notebooks.py` checks that they agree.

Each notebook gets an "Open in Colab" badge under its title, made from the repository URL in pyproject.toml
(`[project.urls] Repository`); a source's `git+` install line must name that same repository.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import tomllib

import nbformat

HERE = pathlib.Path(__file__).resolve().parent
SOURCES = HERE / "src"
PYPROJECT = HERE.parent / "pyproject.toml"
COLAB_BADGE = "https://colab.research.google.com/assets/colab-badge.svg"
_GITHUB = re.compile(r"^https://github\.com/(?P<path>[^/\s]+/[^/\s]+?)/?$")
_INSTALL_URL = re.compile(r"git\+(https://[^\s\"'@]+)")
_CELL = re.compile(r"^# %%( \[markdown\])?[ \t]*$", re.M)
_MAGIC = re.compile(r"^(\s*)# (%pip\b.*)$", re.M)


def _markdown(text: str) -> str:
    lines = []
    for line in text.split("\n"):
        if line != "#" and not line.startswith("# "):
            raise ValueError(f"markdown line {line!r} does not start with '# '")
        lines.append(line[2:])
    return "\n".join(lines)


def repository() -> str:
    """The project's repository URL (pyproject.toml's `[project.urls] Repository`), a GitHub address."""
    urls = tomllib.loads(PYPROJECT.read_text())["project"].get("urls", {})
    url = urls.get("Repository")
    if not url or not _GITHUB.match(url):
        raise ValueError(
            f"{PYPROJECT.name}: [project.urls] Repository = {url!r} must be a https://github.com/OWNER/NAME address "
            f"(the notebooks' Colab badges open the notebooks from it)"
        )
    return url.rstrip("/")


def colab_badge(notebook_name: str, repo: str) -> str:
    """The "Open in Colab" badge (HTML) of notebooks/NOTEBOOK_NAME on the repository's main branch."""
    path = _GITHUB.match(repo).group("path")
    href = f"https://colab.research.google.com/github/{path}/blob/main/notebooks/{notebook_name}"
    return f'<a href="{href}" target="_parent"><img src="{COLAB_BADGE}" alt="Open In Colab"/></a>'


def cells(source: str) -> list[tuple[str, str]]:
    """[(cell_type, text)] of a percent-format source."""
    marks = list(_CELL.finditer(source))
    if not marks or source[: marks[0].start()].strip():
        raise ValueError("a notebook source must start with a '# %%' cell marker")
    out = []
    for mark, after in zip(marks, marks[1:] + [None]):
        body = source[mark.end() : after.start() if after else len(source)].strip("\n")
        if mark.group(1):
            out.append(("markdown", _markdown(body)))
        else:
            out.append(("code", _MAGIC.sub(r"\1\2", body)))
    return out


def notebook(source_path: pathlib.Path) -> nbformat.NotebookNode:
    """The notebook of one source: cells without outputs, stable ids, Colab and kernel metadata, and the Colab
    badge under the title (the first line of the first cell, a Markdown one)."""
    name = source_path.stem + ".ipynb"
    repo = repository()
    source = source_path.read_text()
    for url in _INSTALL_URL.findall(source):
        if url.rstrip("/") != repo:
            raise ValueError(f"{source_path.name}: installs from {url}, but pyproject.toml's repository is {repo}")
    parts = cells(source)
    kind, text = parts[0]
    if kind != "markdown" or not text.startswith("# "):
        raise ValueError(f"{source_path.name}: the first cell must be Markdown starting with the '# Title' line")
    title, _, rest = text.partition("\n")
    parts[0] = ("markdown", f"{title}\n\n{colab_badge(name, repo)}\n{rest}")
    nb = nbformat.v4.new_notebook()
    nb.metadata = {
        "colab": {"name": name, "provenance": []},
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    for i, (kind, text) in enumerate(parts):
        new = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        nb.cells.append(new(text, id=f"cell-{i:02d}"))
    nbformat.validate(nb)
    return nb


def render(source_path: pathlib.Path) -> str:
    return nbformat.writes(notebook(source_path)) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when a notebook is stale")
    args = parser.parse_args(argv)
    stale = []
    for source_path in sorted(SOURCES.glob("*.py")):
        target = HERE / (source_path.stem + ".ipynb")
        text = render(source_path)
        if target.exists() and target.read_text() == text:
            continue
        stale.append(target.name)
        if not args.check:
            target.write_text(text)
    verb = "stale" if args.check else "written"
    print(f"{verb}: {', '.join(stale)}" if stale else "all notebooks match their sources")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
