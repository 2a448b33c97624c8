"""The tables of figures in docs/*.md are what benchmarks/tables.py renders from benchmarks/results/*.json: a
figure cannot drift from its record, and a region names a table the script knows."""

import importlib.util
import sys

import pytest
from helpers import ROOT

spec = importlib.util.spec_from_file_location("tables", ROOT / "benchmarks" / "tables.py")
tables = importlib.util.module_from_spec(spec)
sys.modules["tables"] = tables
spec.loader.exec_module(tables)

PAGES = sorted((ROOT / "docs").glob("*.md"))


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_committed_tables_equal_what_the_results_render(page):
    stale = tables.stale_regions(page.read_text(), page.name)
    assert not stale, f"{page.name}: {stale} differ from the results; run python benchmarks/tables.py"


def test_every_table_is_in_the_docs():
    """Each renderer fills a region of some page (the longest-sequence tables at least), once."""
    found = [m.group(2) for page in PAGES for m in tables.REGION.finditer(page.read_text())]
    assert sorted(found) == sorted(tables.TABLES), found
    assert "longest-sequence-gpu" in found


def test_a_region_is_rendered_from_its_record_and_the_rest_kept():
    text = "before\n<!-- generated: llama3-8b-8m -->\nold figures\n<!-- end generated -->\nafter\n"
    out = tables.rendered(text)
    assert out.startswith("before\n<!-- generated: llama3-8b-8m -->\n\n| plan at 8,388,608 tokens")
    assert out.endswith("|\n\n<!-- end generated -->\nafter\n") and "old figures" not in out
    assert "| the same, UPipe head chunks 4 | 58.3 (58.7) | 270.5 |" in out  # a recorded figure
    assert tables.stale_regions(text) == ["llama3-8b-8m"] and tables.stale_regions(out) == []


def test_an_unknown_region_is_one_line():
    with pytest.raises(ValueError, match=r"^page.md: generated region 'nope' is not one of \[") as e:
        tables.rendered("<!-- generated: nope -->\n<!-- end generated -->\n", "page.md")
    assert "\n" not in str(e.value)
