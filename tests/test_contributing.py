"""CONTRIBUTING.md stays true: its layout table has a row for every op family of ``FAMILIES``,
naming each family's ops, and every file a row names exists."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")


def _rows() -> dict:
    table = TEXT.split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("|")][2:]
    return {cells[0]: cells for cells in
            ([c.strip() for c in row.split("|")[1:-1]] for row in rows)}


def test_layout_table_lists_every_family_and_its_ops():
    from dflash_ops import dispatch
    from dflash_ops.ops import FAMILIES, modules
    rows = _rows()
    assert list(rows) == list(FAMILIES)
    listed = set()
    for family, cells in rows.items():
        ops = set(re.findall(r"`(\w+)`", cells[1]))
        src = Path(modules[family].__file__).read_text(encoding="utf-8")
        assert set(re.findall(r"define_op\(\s*\"(\w+)\(", src)) <= ops, family
        listed |= ops
    assert listed == set(dispatch.ops())


def test_layout_table_files_exist():
    prefixes = {2: "dflash_ops/", 3: "dflash_ops/", 4: "csrc/", 5: "tests/"}  # short forms
    for family, cells in _rows().items():
        for col, prefix in prefixes.items():
            for name in re.findall(r"`([\w/.]+\.(?:py|cu|cuh))`", cells[col]):
                path = name if (ROOT / name).is_file() else prefix + name.removeprefix(prefix)
                assert (ROOT / path).is_file(), (family, name)
