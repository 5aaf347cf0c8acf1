"""transformers' own model tests as a check of moe_ep: the test modules of the five families moe_ep
supports (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3), run with moe_ep's experts wherever a
test leaves the experts implementation at its default.

    .venv/bin/python scripts/transformers_model_tests.py                 # all five families
    .venv/bin/python scripts/transformers_model_tests.py --families mixtral,qwen3_moe -k expert_parallel \\
        --ep-implementation moe_ep --fsdp-workers 4 --baseline

The test files: transformers ships none in its wheel, and its sdist has only the common mixins
(``tests/*.py``), not ``tests/models/**``. So the script takes them from git at the tag of the
installed release (``v<transformers.__version__>``): a shallow, sparse clone into ``--cache``
(default ``~/.cache/moe_ep/transformers-tests/v<version>``; needs git and github.com), made once
and reused. ``--tests DIR`` runs a tree already on the machine instead (a transformers checkout of
the same release, or any folder with its ``tests/`` package); each family runs the modules
``tests/models/<family>/test_modeling_<family>*.py`` found there.

Forcing moe_ep: a ``sitecustomize.py`` written into a temporary folder placed first on the test
run's ``PYTHONPATH`` (the test tree is never modified), so that the rank processes that
transformers' FSDP and expert-parallel mixins spawn are forced too, which a conftest would not
reach. It imports moe_ep (registering ``experts_implementation="moe_ep"`` and
``ep_implementation="moe_ep"``) and makes ``PreTrainedModel.get_correct_experts_implementation``
answer ``"moe_ep"`` for a default request; an explicit request (the tests comparing eager,
batched_mm and grouped_mm) stays what the test asked. ``--ep-implementation NAME`` also replaces
``DistributedConfig``'s default ``"auto"``; ``--fsdp-workers N`` sets the worker count of the FSDP
mixin (it uses ``os.cpu_count()`` on the CPU, so world-4 cases skip on a 2-core machine).
``--baseline`` runs every family again without forcing, and the summary names the failures that
happen with moe_ep only.

Results: JUnit XML per family and run, and a JSON summary (counts, and each failure with the first
line of its message), in ``--out`` (default ``benchmarks/results/transformers_model_tests_<version>_<date>/``).
``RUN_SLOW`` is unset (slow tests download checkpoints). Not part of the suite or CI."""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")
TRANSFORMERS_GIT = "https://github.com/huggingface/transformers"

SITECUSTOMIZE = '''\
"""Written by moe_ep's scripts/transformers_model_tests.py for one test run: moe_ep's experts
wherever transformers' tests leave the experts implementation at its default."""
import os

if os.environ.get("MOE_EP_FORCE") == "1":
    import moe_ep  # registers "moe_ep" with transformers once transformers loads its registries
    from moe_ep._on_import import after_import

    def _default_to_moe_ep(modeling_utils):
        model_class = modeling_utils.PreTrainedModel
        original = model_class.get_correct_experts_implementation

        def get_correct_experts_implementation(self, requested_experts):
            return original(self, "moe_ep" if requested_experts is None else requested_experts)

        model_class.get_correct_experts_implementation = get_correct_experts_implementation

    after_import("transformers.modeling_utils", _default_to_moe_ep)

    _ep_implementation = os.environ.get("MOE_EP_EP_IMPLEMENTATION")
    if _ep_implementation:
        def _default_ep_implementation(configuration_utils):
            config_class = configuration_utils.DistributedConfig
            original_post_init = config_class.__post_init__

            def __post_init__(self):
                if getattr(self, "ep_implementation", None) == "auto":
                    self.ep_implementation = _ep_implementation
                original_post_init(self)

            config_class.__post_init__ = __post_init__

        after_import("transformers.distributed.configuration_utils", _default_ep_implementation)

'''

# A pytest plugin (-p), for what lives in transformers' test modules: pytest imports those itself.
PYTEST_PLUGIN = '''\
"""Written by moe_ep's scripts/transformers_model_tests.py: the FSDP mixin's worker count."""
import os
import sys


def pytest_collection_finish(session):
    workers = os.environ.get("MOE_EP_FSDP_WORKERS")
    module = sys.modules.get("tests.test_fsdp_mixin")
    if workers and module is not None:
        module._get_available_fsdp_workers = lambda: int(workers)
'''
PYTEST_PLUGIN_NAME = "moe_ep_transformers_tests_plugin"


class ScriptError(Exception):
    """Said in one line, exit status 2."""


def fetch_tests(version: str, cache: Path) -> Path:
    """transformers' test tree at tag ``v<version>``, cloned into ``cache`` unless it is there."""
    if (cache / "tests" / "__init__.py").is_file():
        return cache
    if cache.exists() and any(cache.iterdir()):
        raise ScriptError(f"--cache {cache} is not empty and holds no transformers tests/ package; this script clones "
                          "only into a new or empty folder: choose another --cache")
    if shutil.which("git") is None:
        raise ScriptError("git is not installed; clone transformers' tests yourself and pass --tests DIR")
    cache.parent.mkdir(parents=True, exist_ok=True)
    clone = ["git", "clone", "--quiet", "--depth", "1", "--branch", f"v{version}", "--filter=blob:none", "--sparse",
             TRANSFORMERS_GIT, str(cache)]
    steps = [clone, ["git", "-C", str(cache), "sparse-checkout", "set", "--no-cone", "/conftest.py",
                     "/pyproject.toml", "/tests/"]]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            reason = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise ScriptError(f"cannot fetch transformers' tests at v{version} from {TRANSFORMERS_GIT} ({reason}); "
                              "on a machine without GitHub pass --tests DIR with a checkout of that release")
    return cache


def family_modules(tests_root: Path, family: str) -> list[str]:
    found = sorted((tests_root / "tests" / "models" / family).glob(f"test_modeling_{family}*.py"))
    return [str(path.relative_to(tests_root)) for path in found]


def _cause(outcome) -> str:
    """One line for a failure: the last exception line of its report (a spawned rank's own error
    rather than the mixin's 'test failed'), else the first line of its message."""
    lines = [line.strip() for line in f"{outcome.get('message') or ''}\n{outcome.text or ''}".splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"^(E\s+)?[\w.]+(Error|Exception): ", line)]
    return (raised[-1] if raised else lines[0] if lines else "")[:300]


def junit_summary(xml_path: Path) -> dict:
    """Counts and failures (test id, first line of the message) of one JUnit file."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures = []
    if not xml_path.exists():
        return {**counts, "failures": [], "note": "no report written (pytest did not start)"}
    for case in ElementTree.parse(xml_path).iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            counts["passed"] += 1
        elif outcome.tag == "skipped":
            counts["skipped"] += 1
        else:
            counts["failed" if outcome.tag == "failure" else "errors"] += 1
            failures.append({"test": test_id, "message": _cause(outcome)})
    return {**counts, "failures": failures}


def run_family(tests_root: Path, modules: list[str], env: dict, xml_path: Path, keyword: str | None) -> dict:
    cmd = [sys.executable, "-m", "pytest", *modules, "-p", "no:cacheprovider", "-p", PYTEST_PLUGIN_NAME, "-q", "-rfE",
           f"--junitxml={xml_path}", "-W", "ignore::DeprecationWarning"] + (["-k", keyword] if keyword else [])
    done = subprocess.run(cmd, cwd=tests_root, env=env)
    return {"returncode": done.returncode, **junit_summary(xml_path)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated, of " + ", ".join(FAMILIES))
    p.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    p.add_argument("--tests", default=None, help="a folder holding transformers' tests/ package (no download)")
    p.add_argument("--cache", default=None, help="where the clone goes (default ~/.cache/moe_ep/transformers-tests/v<version>)")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results/transformers_model_tests_<version>_<date>)")
    p.add_argument("--ep-implementation", default=None, help="replace DistributedConfig's default 'auto' by this")
    p.add_argument("--fsdp-workers", type=int, default=None, help="worker count of transformers' FSDP test mixin")
    p.add_argument("--baseline", action="store_true", help="also run without moe_ep, to tell its failures apart")
    p.add_argument("--label", default=None, help="a note on where the test files came from, kept in the summary")
    args = p.parse_args(argv)
    try:
        import transformers

        needed = [name for name in ("pytest", "parameterized") if importlib.util.find_spec(name) is None]
        if needed:
            raise ScriptError(f"transformers' tests need {', '.join(needed)}: pip install {' '.join(needed)}")
        families = args.families.split(",")
        unknown = sorted(set(families) - set(FAMILIES))
        if unknown:
            raise ScriptError(f"--families: unknown {unknown}; choose from {', '.join(FAMILIES)}")
        version = transformers.__version__
        if args.tests is not None:
            tests_root = Path(args.tests).resolve()
            if not (tests_root / "tests" / "__init__.py").is_file():
                raise ScriptError(f"--tests {tests_root} holds no tests/ package (tests/__init__.py)")
        else:
            cache = Path(args.cache or Path.home() / ".cache" / "moe_ep" / "transformers-tests" / f"v{version}")
            tests_root = fetch_tests(version, cache)
        modules = {family: family_modules(tests_root, family) for family in families}
        missing = [family for family, found in modules.items() if not found]
        if len(missing) == len(families):
            raise ScriptError(f"{tests_root} holds no tests/models/<family>/test_modeling_<family>*.py for {missing}")
        date = datetime.date.today().isoformat()
        out = Path(args.out or REPO / "benchmarks" / "results" / f"transformers_model_tests_{version}_{date}")
        if out.exists() and any(out.iterdir()):
            raise ScriptError(f"--out {out} is not empty; results go to a new or empty folder")
        out.mkdir(parents=True, exist_ok=True)
    except ScriptError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    summary = {"transformers": version, "tests": str(tests_root), "label": args.label, "keyword": args.keyword,
               "ep_implementation": args.ep_implementation, "fsdp_workers": args.fsdp_workers, "families": {}}
    runs = [("moe_ep", "1")] + ([("baseline", "0")] if args.baseline else [])
    with tempfile.TemporaryDirectory(prefix="moe_ep_force_") as force_dir:
        (Path(force_dir) / "sitecustomize.py").write_text(SITECUSTOMIZE)
        (Path(force_dir) / f"{PYTEST_PLUGIN_NAME}.py").write_text(PYTEST_PLUGIN)
        for family in families:
            result = {"modules": modules[family]}
            if not modules[family]:
                result["note"] = "no test module for this family in the test tree"
            for run, force in runs if modules[family] else ():
                env = dict(os.environ, MOE_EP_FORCE=force, OMP_NUM_THREADS="1",
                           PYTHONPATH=os.pathsep.join([force_dir, str(tests_root), str(REPO),
                                                       os.environ.get("PYTHONPATH", "")]))
                env.pop("RUN_SLOW", None)
                if args.ep_implementation:
                    env["MOE_EP_EP_IMPLEMENTATION"] = args.ep_implementation
                if args.fsdp_workers:
                    env["MOE_EP_FSDP_WORKERS"] = str(args.fsdp_workers)
                result[run] = run_family(tests_root, modules[family], env, out / f"{family}_{run}.xml", args.keyword)
            if args.baseline and modules[family]:
                theirs = {f["test"] for f in result["baseline"]["failures"]}
                result["failing_with_moe_ep_only"] = [f for f in result["moe_ep"]["failures"] if f["test"] not in theirs]
            summary["families"][family] = result
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for family, result in summary["families"].items():
        counts = result.get("moe_ep")
        line = (f"{family}: {counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, "
                f"{counts['skipped']} skipped" if counts else f"{family}: {result['note']}")
        if "failing_with_moe_ep_only" in result:
            line += f"; {len(result['failing_with_moe_ep_only'])} fail with moe_ep only"
        print(line)
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
