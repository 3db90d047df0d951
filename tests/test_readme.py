"""README.md stays true: its Python snippets run verbatim on CPU, every number of its results
table is in the newest results file of that row's suite, its op table lists every op, its
knob table lists exactly the knobs the package reads, and .ci/run runs its test command."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
RESULTS = ROOT / "benchmarks" / "results"


def _python_blocks():
    return re.findall(r"^```python\n(.*?)^```", README, re.S | re.M)


def _section(title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.S | re.M)
    assert m, f"README has no section '## {title}'"
    return m.group(1)


def _table_rows(text: str):
    """The body rows of the first Markdown table in text, as lists of cells."""
    rows = [line for line in text.splitlines() if line.startswith("|")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows[2:]]


def test_readme_has_python_snippets():
    assert len(_python_blocks()) >= 2


@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_python_snippet_runs_verbatim_on_cpu(index, tmp_path):
    code = _python_blocks()[index]
    env = {k: v for k, v in os.environ.items()
           if k not in ("DFLASH_OPS_BACKEND", "TRITON_INTERPRET")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"README python block {index} failed:\n{code}\n{r.stderr}"


def _newest_of_suite(suite: str) -> str:
    """File name of the newest ``<suite>[-...].md`` in benchmarks/results, by the date its
    header records."""
    dated = []
    for md in RESULTS.glob("*.md"):
        if md.stem == suite or md.stem.startswith(suite + "-"):
            m = re.search(r"^(\d{4}-\d\d-\d\dT[\d:]+)", md.read_text(encoding="utf-8"), re.M)
            if m:
                dated.append((m.group(1), md.name))
    assert dated, f"no results files for suite {suite!r}"
    return max(dated)[1]


def _numbers(text: str):
    return re.findall(r"\d+(?:\.\d+)?", text)


def test_results_table_numbers_come_from_the_newest_file_of_each_suite():
    rows = _table_rows(_section("Results (H200, bf16)"))
    assert len(rows) >= 5
    suites = set()
    for cells in rows:
        *data, source = cells
        suite = data[0].split(":", 1)[0]
        suites.add(suite)
        link = re.search(r"\]\(benchmarks/results/([^)]+\.md)\)", source)
        assert link, f"row without a results link: {cells}"
        name = link.group(1)
        assert name == _newest_of_suite(suite), (name, _newest_of_suite(suite))
        text = (RESULTS / name).read_text(encoding="utf-8")
        header = text.splitlines()[2]
        commit, date = [c.strip() for c in source.split(")", 1)[1].split(",")[1:3]]
        assert f"commit {commit} " in header + " " and header.startswith(date), (source, header)
        missing = [n for n in _numbers(" ".join(data)) if n not in text]
        assert not missing, f"{name} lacks {missing} of row {data}"
        assert re.search(r"\((cuda|triton|CUDA graphs?)\b", data[1]), f"no backend: {data[1]}"
    assert suites == {"norm", "context_kv", "attention", "drafter", "e2e"}


def test_results_plots_exist():
    plots = re.findall(r"\]\((benchmarks/results/[^)]+\.png)\)", _section("Results (H200, bf16)"))
    assert len(plots) >= 5
    for p in plots:
        assert (ROOT / p).is_file(), p


def test_op_table_lists_every_op():
    from dflash_ops import dispatch
    listed = {re.match(r"`(\w+)\(", cells[0]).group(1) for cells in _table_rows(_section("Ops"))}
    listed |= {"block_attention_out_"}  # described in block_attention's row
    assert listed == set(dispatch.ops()), (listed ^ set(dispatch.ops()))


def test_knob_table_lists_exactly_the_knobs_read():
    documented = {re.search(r"DFLASH_OPS_\w+", cells[0]).group(0)
                  for cells in _table_rows(_section("Environment knobs"))}
    read = set()
    for path in [*(ROOT / "dflash_ops").rglob("*.py"), *(ROOT / "dflash_ops_vllm").rglob("*.py"),
                 ROOT / "setup.py",
                 *(ROOT / "csrc").glob("*.c*"), *(ROOT / "csrc").glob("*.h")]:
        read |= set(re.findall(r"(?:environ\.get\(|environ\[|getenv\()\s*[\"'](DFLASH_OPS_\w+)",
                               path.read_text(encoding="utf-8")))
    read = {k for k in read if not k.startswith("DFLASH_OPS_BENCH_")}
    cmake = {"DFLASH_OPS_CUDA_ARCHITECTURES"}
    assert "DFLASH_OPS_CUDA_ARCHITECTURES" in (ROOT / "CMakeLists.txt").read_text()
    assert documented == read | cmake, (documented ^ (read | cmake))


def test_ci_runs_the_readme_test_command():
    quick = _section("Quick start (fresh CPU machine, Python 3.10+)")
    test_cmd = next(line for line in quick.splitlines() if "pytest" in line)
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    def words(cmd):  # quiet flags aside
        return [w for w in cmd.split() if w != "-q"]

    for part in test_cmd.split(" && "):
        want = words(part)[1:]  # "pip install ...", "python -m pytest ...": the program aside
        assert any(words(line)[-len(want):] == want for line in ci.splitlines()), \
            f".ci/run lacks {part!r} of the README's test command"


def test_defaults_named_in_which_kernel_runs_are_the_declared_ones():
    from dflash_ops import dispatch
    text = " ".join(_section("Which kernel runs").split())
    today = re.search(r"Today: (.*?)\. ", text).group(1)
    named = {}
    for group in today.split(";"):
        ops, backend = group.rsplit(":", 1)
        named.update({op: backend.strip() for op in re.findall(r"`(\w+)`", ops)})
    assert named == {name: op.default for name, op in dispatch.ops().items()}
    eager = re.search(r"Eager: (.*?)\. ", text).group(1)
    ops, backend = eager.rsplit(":", 1)
    assert {op: backend.strip() for op in re.findall(r"`(\w+)`", ops)} == \
        {name: op.eager for name, op in dispatch.ops().items() if op.eager}
