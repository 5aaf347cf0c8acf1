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
        # The oldest releases the code is written against: triton.knobs and the AOT compile API of
        # Triton 3.6, the router and experts interfaces of transformers 5.17 (moe_ep.hf.version).
        "triton>=3.6",
        "transformers>=5.17",
        "accelerate>=1.0",
        "safetensors>=0.4",
    ],
    extras_require={
        # kernels: Hugging Face's package of that name, so the tests can show that ours never shadows it;
        # tensorboard: the example's --tensorboard logging is tested.
        "test": ["pytest>=8", "pytest-xdist>=3.5", "matplotlib>=3.7", "kernels>=0.10", "tensorboard>=2.14"],
        "tensorboard": ["tensorboard>=2.14"],
        "bench": ["matplotlib>=3.7"],
    },
    entry_points={"console_scripts": ["moe-ep=moe_ep.cli:main"]},
)
