import ast
import importlib.metadata
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_import_kernels_does_not_resolve_into_this_repository():
    """From the repository root, where our top-level kernels/ folder sits first on sys.path,
    `import kernels` still gets Hugging Face's PyPI package (a test dependency; transformers
    imports it): a folder without __init__.py is only a namespace package, which any regular
    package of that name found later on the path beats."""
    assert not (REPO / "kernels" / "__init__.py").exists()
    hf_kernels = importlib.metadata.distribution("kernels")
    code = "import kernels, sys; print(sys.path[0] == ''); print(kernels.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    repo_first, origin = out.stdout.split()
    assert repo_first == "True"
    assert pathlib.Path(origin).resolve() == pathlib.Path(hf_kernels.locate_file("kernels/__init__.py")).resolve()
    assert not pathlib.Path(origin).resolve().is_relative_to(REPO / "kernels"), origin


def test_a_regular_package_later_on_the_path_beats_our_folder(tmp_path):
    """The same rule with a stand-in package, whatever is installed: the repository first on
    PYTHONPATH, the stand-in after it."""
    fake = tmp_path / "site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("WHO = 'huggingface'\n")
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{tmp_path / 'site'}")
    code = "import kernels; print(kernels.__file__); print(kernels.WHO)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    origin, who = out.stdout.split()
    assert who == "huggingface"
    assert not origin.startswith(str(REPO)), origin


@pytest.mark.slow
def test_transformers_does_not_mistake_our_folder_for_hf_kernels(tmp_path):
    """transformers' answer to "is Hugging Face's kernels package usable?" is the same from the
    repository root, where our folder is on sys.path, as from a folder where it is not."""
    code = "from transformers.utils import is_kernels_available; print(is_kernels_available())"
    answers = [
        subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=True)
        .stdout.strip().splitlines()[-1]
        for cwd in (REPO, tmp_path)
    ]
    assert answers[0] == answers[1], answers


def test_kernels_ship_as_moe_ep_kernels():
    assert (REPO / "moe_ep" / "kernels").is_symlink()
    assert importlib.util.find_spec("moe_ep.kernels") is not None


def test_kernels_import_nothing_above_them():
    """ARCHITECTURE.md's layering: the kernels know nothing of autograd, modules, distributed or Hugging
    Face, so they import only Triton, torch, the standard library and each other."""

    def allowed(name: str) -> bool:  # each other: relative imports only, never through moe_ep
        top = name.split(".")[0]
        return top in sys.stdlib_module_names or top in ("triton", "torch")

    for path in sorted((REPO / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            assert all(allowed(name) for name in names), f"{path.name} imports {names}"


def _fresh(code: str) -> dict:
    """What ``code`` prints as its last line (JSON), run in a fresh interpreter at the repository root."""
    import json

    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


LOADED = """
import json, sys
import {module}
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("moe_ep", "transformers", "torch"))))
"""


@pytest.mark.slow
def test_a_kernel_loads_no_layer_above_the_kernels():
    """Importing one kernel module in a fresh interpreter loads moe_ep's package file, its import
    hook and kernel modules: no op, distributed, Hugging Face, planner or training code, and no
    transformers."""
    loaded = _fresh(LOADED.format(module="moe_ep.kernels.grouped_gemm"))
    ours = [m for m in loaded if m.startswith("moe_ep")]
    assert "moe_ep.kernels.grouped_gemm" in ours
    assert all(m in ("moe_ep", "moe_ep._on_import", "moe_ep.kernels") or m.startswith("moe_ep.kernels.")
               for m in ours), ours
    assert not [m for m in loaded if m.startswith("transformers")]


@pytest.mark.slow
def test_import_moe_ep_is_cheap_and_registers_when_transformers_loads():
    """``import moe_ep`` alone imports neither torch nor transformers; transformers, imported
    afterwards, finds both "moe_ep" entries registered, and a public name loads on first use."""
    loaded = _fresh(LOADED.format(module="moe_ep"))
    assert loaded == ["moe_ep", "moe_ep._on_import"]
    found = _fresh("""
import importlib.util, json
import moe_ep
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
ep = importlib.util.find_spec("transformers.distributed.expert_parallel") is not None
if ep:
    from transformers.distributed.expert_parallel import EPImplementationInterface
print(json.dumps({"experts": ALL_EXPERTS_FUNCTIONS.get("moe_ep") is moe_ep.hf.moe_ep_experts_forward,
                  "ep": (not ep) or "moe_ep" in EPImplementationInterface(),
                  "public": [name for name in moe_ep.__all__ if getattr(moe_ep, name, None) is None]}))
""")
    assert found == {"experts": True, "ep": True, "public": []}


def test_training_without_stages_or_compilation_imports_neither_pipelining_nor_dynamo():
    """torch's pipelining schedules import dynamo and inductor: 0.7 s of CPU at the start-up of a
    process that imports moe_ep without building a transformers model (the planner, the kernels'
    benchmarks), when moe_ep imported them whether stages ran or not."""
    found = _fresh("""
import json, sys
import moe_ep, moe_ep.training, moe_ep.parallel, moe_ep.runs, moe_ep.hf
print(json.dumps([m for m in ("torch.distributed.pipelining", "torch._dynamo", "torch._inductor") if m in sys.modules]))
""")
    assert found == []


def test_the_example_and_the_readme_use_public_names_only():
    """The example imports only from ``moe_ep`` itself and from its run layer ``moe_ep.runs``, and
    every ``moe_ep.<name>`` that it or the README's Python code uses is in ``moe_ep.__all__``, every
    name it takes from ``moe_ep.runs`` in ``moe_ep.runs.__all__``."""
    import re

    import moe_ep
    import moe_ep.runs

    used, from_runs = {}, {}
    for path in sorted((REPO / "examples" / "mixtral").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "moe_ep":
                assert node.module in ("moe_ep", "moe_ep.runs"), f"{path.name} imports from {node.module}"
                names = {alias.name: path.name for alias in node.names}
                (used if node.module == "moe_ep" else from_runs).update(names)
            elif isinstance(node, ast.Import):
                assert not [a.name for a in node.names if a.name.startswith("moe_ep.")], path.name
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "moe_ep":
                used[node.attr] = path.name
    for block in re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S):
        used.update({name: "README.md" for name in re.findall(r"\bmoe_ep\.(\w+)", block)})
    assert used, "found no use of moe_ep"
    assert {name: where for name, where in used.items() if name not in moe_ep.__all__} == {}
    assert from_runs, "the example uses no name of moe_ep.runs"
    assert {name: where for name, where in from_runs.items() if name not in moe_ep.runs.__all__} == {}


# ARCHITECTURE.md's layers, bottom up; a layer may import only layers of a lower rank (hf and the
# planner know nothing of each other). moe_ep/__init__.py is the top.
LAYER_RANK = {"kernels": 0, "_on_import": 0, "ops": 1, "dispatch": 2, "hf": 3, "planner": 3, "parallel": 4,
              "training": 5, "runs": 6, "bench": 6, "cli": 6, "": 7}


def _moe_ep_imports() -> dict[str, set[str]]:
    """Module -> the moe_ep modules it imports (module-level, inside functions and under ``if
    TYPE_CHECKING:``: a type-only import is a dependency too, and a cycle through one means
    neither module can be read without the other), kernels/ included as moe_ep.kernels."""
    files = {}
    for path in sorted((REPO / "moe_ep").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[1:2] == ("kernels",):
            continue
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = (path, parts[-1] == "__init__")
    for path in sorted((REPO / "kernels").glob("*.py")):
        files[f"moe_ep.kernels.{path.stem}"] = (path, False)
    graph = {}
    for name, (path, is_package) in files.items():
        package = name if is_package else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                found.update(f"{target}.{a.name}" if f"{target}.{a.name}" in files else target for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        # A package's own ancestors are being imported already: not an edge.
        graph[name] = {t for t in found if t in files and t != name and not name.startswith(t + ".")}
    return graph


def test_the_import_graph_has_no_cycle_and_only_downward_edges():
    graph = _moe_ep_imports()

    def layer(module: str) -> str:
        return module.split(".")[1] if "." in module else ""

    upward = [f"{m} -> {t}" for m, targets in graph.items() for t in targets
              if layer(m) != layer(t) and LAYER_RANK[layer(t)] >= LAYER_RANK[layer(m)]]
    assert upward == []
    done, on_path = set(), []

    def visit(module: str) -> None:
        assert module not in on_path, " -> ".join(on_path[on_path.index(module):] + [module])
        if module in done:
            return
        on_path.append(module)
        for target in sorted(graph[module]):
            visit(target)
        on_path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
    assert {"moe_ep.parallel.parallelize", "moe_ep.parallel.pipeline.build", "moe_ep.kernels.grouped_gemm"} <= set(graph)
