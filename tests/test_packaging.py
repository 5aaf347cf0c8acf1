import importlib.metadata
import importlib.util
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_import_kernels_does_not_resolve_into_this_repository(tmp_path):
    """Hugging Face's PyPI package `kernels` (imported by transformers) must win over our top-level
    kernels/ folder, even from the repository root where that folder sits first on sys.path.
    A stand-in regular package placed *after* the repository on the path plays its part."""
    fake = tmp_path / "site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("WHO = 'huggingface'\n")
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{tmp_path / 'site'}")
    code = "import kernels, sys; print(kernels.__file__); print(kernels.WHO)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    origin, who = out.stdout.split()
    assert who == "huggingface"
    assert not origin.startswith(str(REPO)), origin
    assert not (REPO / "kernels" / "__init__.py").exists()


def test_transformers_does_not_mistake_our_folder_for_hf_kernels():
    try:
        importlib.metadata.distribution("kernels")
        hf_kernels_installed = True
    except importlib.metadata.PackageNotFoundError:
        hf_kernels_installed = False
    code = "from transformers.utils import is_kernels_available; print(is_kernels_available())"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == str(hf_kernels_installed)


def test_kernels_ship_as_moe_ep_kernels():
    assert (REPO / "moe_ep" / "kernels").is_symlink()
    assert importlib.util.find_spec("moe_ep.kernels") is not None
