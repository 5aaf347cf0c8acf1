import importlib.util
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_import_kernels_does_not_resolve_into_this_repository():
    # Run from the repository root, where a `kernels/` package of ours would shadow Hugging
    # Face's `kernels` if it had an __init__.py.
    code = (
        "import importlib.util, sys\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "origin = None if spec is None else (spec.origin or list(spec.submodule_search_locations or []))\n"
        "print(origin)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    origin = out.stdout.strip()
    assert str(REPO / "kernels") not in origin, origin
    assert not (REPO / "kernels" / "__init__.py").exists()


def test_kernels_ship_as_moe_ep_kernels():
    assert (REPO / "moe_ep" / "kernels").is_symlink()
    assert importlib.util.find_spec("moe_ep.kernels") is not None
