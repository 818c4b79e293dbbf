"""benchmarks/scenarios/*.json and their runner, benchmarks/scenario.py: every scenario names a suite that
exists and whose parser takes its arguments (parsed only: no benchmark runs here); every scenario an area
document cites exists, and every scenario is cited; the runner refuses an unknown name or a malformed file,
and runs a scenario with its output path in place of OUT."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from benchmarks import scenario

REPO = Path(__file__).resolve().parents[3]
DOCS = REPO / "docs" / "benchmarks"
AREAS = ("adapters", "engine", "gateway", "kernels", "merge", "routing", "vision")
CITED = re.compile(r"benchmarks\.scenario\s+([A-Za-z0-9][\w.-]*\w)")  # a name, not a trailing full stop


def cited(document: Path) -> set[str]:
    return set(CITED.findall(document.read_text()))


def parse_args_of(module: str) -> Callable[[list[str]], argparse.Namespace]:
    """A suite's parse_args: in its module, or, for a package run by its __main__ (policy.simulator),
    in the package's cli."""
    suite = importlib.import_module(module)
    if hasattr(suite, "__path__"):
        suite = importlib.import_module(f"{module}.cli")
    return suite.parse_args


@pytest.mark.parametrize("name", scenario.names())
def test_scenario_names_a_suite_whose_parser_takes_its_arguments(name: str, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    found = scenario.load(name)
    runnable = f"{found.module}.__main__" if hasattr(importlib.import_module(found.module), "__path__") \
        else found.module
    assert importlib.util.find_spec(runnable) is not None, f"{name}: python -m {found.module} runs nothing"
    for arg in found.args:  # a file the run reads (a perf model) is part of the figure
        if "/" in arg:
            assert (REPO / arg).exists(), f"{name}: {arg} is not in the tree"
    # Parsed on this CPU as on the GPU it is meant for: the tiny-run suites refuse a missing CUDA device at parse.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    command = found.command(tmp_path / "out")
    assert command[:3] == [sys.executable, "-m", found.module]
    assert found.writes_output == (str(tmp_path / "out") in command)
    parse_args_of(found.module)(command[3:])


@pytest.mark.parametrize("area", AREAS)
def test_every_scenario_an_area_document_names_exists(area: str) -> None:
    names = cited(DOCS / f"{area}.md")
    assert names, f"{area}.md names no scenario"
    assert names <= set(scenario.names()), f"{area}.md names no such scenario: {sorted(names - set(scenario.names()))}"


def test_every_scenario_is_cited_by_a_document() -> None:
    citations = set().union(*(cited(document) for document in DOCS.glob("*.md")))
    assert set(scenario.names()) <= citations, f"cited nowhere: {sorted(set(scenario.names()) - citations)}"


def test_an_unknown_name_is_refused_with_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        scenario.main(["engine-no-such-run"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert "no scenario 'engine-no-such-run'; known:" in error and "engine-decode-prefill" in error


@pytest.mark.parametrize("text,complaint", [
    ("{not json", "not JSON"),
    ('["benchmarks.engine_bench"]', "needs exactly the fields module, args, device, about"),
    ('{"module": "benchmarks.engine_bench", "args": [], "device": "any CPU"}', "needs exactly the fields"),
    ('{"module": "benchmarks.engine_bench", "args": "--quick", "device": "any CPU", "about": "a"}',
     "args a list of strings"),
    ('{"module": "", "args": [], "device": "any CPU", "about": "a"}', "non-empty strings"),
])
def test_a_malformed_file_is_refused_naming_it(text: str, complaint: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scenario, "SCENARIOS", tmp_path)
    (tmp_path / "broken.json").write_text(text)
    with pytest.raises(scenario.ScenarioError, match=re.escape(complaint)) as error:
        scenario.load("broken")
    assert str(tmp_path / "broken.json") in str(error.value)


def test_a_run_puts_the_output_path_in_place_of_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(scenario, "SCENARIOS", tmp_path / "scenarios")
    (tmp_path / "scenarios").mkdir()
    (tmp_path / "in.json").write_text('{"rows": [1, 2]}')
    (tmp_path / "scenarios" / "copy.json").write_text(json.dumps(  # a stand-in suite: json.tool IN OUT
        {"module": "json.tool", "args": ["--compact", str(tmp_path / "in.json"), "OUT"], "device": "any CPU",
         "about": "copies a JSON file"}))
    assert scenario.main(["copy", "--out", str(tmp_path / "given.json")]) == 0
    assert json.loads((tmp_path / "given.json").read_text()) == {"rows": [1, 2]}

    assert scenario.main(["copy"]) == 0  # no --out: a fresh path, printed
    printed = capsys.readouterr().out
    out = Path(re.search(r"^output: (.+)$", printed, re.MULTILINE).group(1))
    assert json.loads(out.read_text()) == {"rows": [1, 2]}
    assert "copy  any CPU  copies a JSON file" in scenario.listing()
