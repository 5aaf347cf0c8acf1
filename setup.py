from setuptools import find_namespace_packages, setup

setup(
    name="moe-ep",
    version="0.1.0",
    description="Mixture-of-Experts kernels and expert parallelism for PyTorch",
    python_requires=">=3.10",
    # moe_ep/kernels is a symlink to the top-level kernels/ folder, which has no __init__.py so
    # that it never shadows Hugging Face's own `kernels` package: it ships as moe_ep.kernels.
    packages=find_namespace_packages(include=["moe_ep", "moe_ep.*"]),
    install_requires=[
        "torch>=2.9",
        "triton>=3.2",
        "transformers>=5.0",
        "accelerate>=1.0",
        "safetensors>=0.4",
    ],
    extras_require={
        "test": ["pytest>=8", "matplotlib>=3.7"],
        "bench": ["matplotlib>=3.7"],
    },
    entry_points={"console_scripts": ["moe-ep=moe_ep.cli:main"]},
)
