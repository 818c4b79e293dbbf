"""Run a named scenario: one benchmark run that a document in docs/benchmarks/ cites, kept as data, so
the document names the run and the file holds its exact arguments.

    PYTHONPATH=.:protos python -m benchmarks.scenario engine-decode-prefill --out /tmp/engine.json
    python -m benchmarks.scenario --list

benchmarks/scenarios/<name>.json holds the module to run, its arguments ("OUT" where the output path
goes), the device the figures are meant for, and a line about them; engine-decode-prefill.json:

    {"module": "benchmarks.engine_bench", "args": ["--skip-peft", "--json", "OUT"],
     "device": "a GPU: H100 or H200",
     "about": "decode steps of cases (a), (b), (c) at batch 1-64 over their floor, a 4 x 2048 prefill, ..."}

The run is `sys.executable -m module args` in this directory and environment, its output streaming
through; without --out, OUT is a path under a new temporary directory, printed before the run.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

SCENARIOS = Path(__file__).resolve().parent / "scenarios"
OUT = "OUT"  # the argument that the output path replaces
FIELDS = ("module", "args", "device", "about")


class ScenarioError(Exception):
    """An unknown scenario, or a scenario file that does not hold what a scenario is."""


@dataclass(frozen=True)
class Scenario:
    name: str
    module: str             # run as `python -m module`, e.g. "benchmarks.engine_bench", "policy.simulator"
    args: tuple[str, ...]   # e.g. ("--skip-peft", "--json", "OUT")
    device: str             # what the figures were measured on, e.g. "a GPU: H100 or H200", "any CPU"
    about: str              # one line: what it measures

    @property
    def writes_output(self) -> bool:
        return OUT in self.args

    def command(self, out: Path | None) -> list[str]:
        assert out is not None or not self.writes_output, f"{self.name} needs an output path"
        return [sys.executable, "-m", self.module, *(str(out) if arg == OUT else arg for arg in self.args)]


def names() -> list[str]:
    return sorted(path.stem for path in SCENARIOS.glob("*.json"))


def load(name: str) -> Scenario:
    known = names()
    if name not in known:
        raise ScenarioError(f"no scenario {name!r}; known: {', '.join(known)}")
    path = SCENARIOS / f"{name}.json"
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ScenarioError(f"{path}: not JSON: {error}") from None
    if not isinstance(data, dict) or set(data) != set(FIELDS):
        found = ", ".join(data) if isinstance(data, dict) else type(data).__name__
        raise ScenarioError(f"{path}: needs exactly the fields {', '.join(FIELDS)} (found: {found})")
    texts = [data[key] for key in ("module", "device", "about")]
    if not all(isinstance(text, str) and text for text in texts) or not isinstance(data["args"], list) \
            or not all(isinstance(arg, str) for arg in data["args"]):
        raise ScenarioError(f"{path}: module, device and about must be non-empty strings, args a list of strings")
    return Scenario(name, data["module"], tuple(data["args"]), data["device"], data["about"])


def listing() -> str:
    scenarios = [load(name) for name in names()]
    name_width, device_width = (max(len(text) for text in column) for column in
                                ([s.name for s in scenarios], [s.device for s in scenarios]))
    return "\n".join(f"{s.name:<{name_width}}  {s.device:<{device_width}}  {s.about}" for s in scenarios)


def run(command: list[str]) -> int:
    """The suite's exit status. It shares the terminal's process group, so a Ctrl-C reaches it too: the
    runner then waits for it to stop what it started (the live suites stop their roles on the way out)."""
    with subprocess.Popen(command) as child:
        try:
            status = child.wait()
        except KeyboardInterrupt:
            status = child.wait()
    return status if status >= 0 else 128 - status  # killed by signal N: 128 + N, as a shell says


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scenario", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", nargs="?", help="the scenario to run (--list names them)")
    parser.add_argument("--out", type=Path, metavar="PATH",
                        help="the output path that replaces OUT (default: under a new temporary directory)")
    parser.add_argument("--list", action="store_true", help="list the scenarios: name, device, about")
    args = parser.parse_args(argv)
    try:
        if args.list:
            print(listing())
            return 0
        if args.name is None:
            parser.error("name a scenario, or --list")
        scenario = load(args.name)
    except ScenarioError as error:
        parser.error(str(error))
    if args.out is not None and not scenario.writes_output:
        parser.error(f"{scenario.name} writes no output file: its figures are in what it prints")
    out = args.out
    if out is None and scenario.writes_output:
        out = Path(tempfile.mkdtemp(prefix=f"{scenario.name}-")) / "out"
    command = scenario.command(out)
    print(f"scenario {scenario.name} ({scenario.device}): {scenario.about}", flush=True)
    if out is not None:
        print(f"output: {out}", flush=True)
    print("$ " + shlex.join(command), flush=True)
    return run(command)


if __name__ == "__main__":
    sys.exit(main())
