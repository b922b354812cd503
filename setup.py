"""specjax: lossless speculative decoding in JAX/Flax."""
import setuptools

RUNTIME = [
    "jax>=0.10",
    "flax>=0.12",
    "optax>=0.2.8",
    "orbax-checkpoint>=0.12",
    "chex>=0.1.90",
    "absl-py>=2.0",
    "ml_collections>=1.0",
    "numpy>=2.0",
    "gguf>=0.19",
    "tokenizers>=0.22",
    "safetensors>=0.6",
    "jinja2>=3.1",
    "tqdm>=4.66",
]

# The reference implementation the tests compare against. torch is pinned: pip takes that CPU
# build from a wheel already on the CI machine; an unpinned torch pulls a multi-GB CUDA build.
REFERENCE = [
    "torch==2.13.0",
    "transformers==5.24.0",
    "accelerate==1.15.0",
]

setuptools.setup(
    name="specjax",
    version="0.1.0",
    description="Lossless speculative decoding and draft distillation in JAX/Flax.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=setuptools.find_packages(include=["specjax", "specjax.*"]),
    package_data={"specjax": ["data/*.jsonl", "data/*.md", "artifacts/*/*"]},
    python_requires=">=3.10",
    install_requires=RUNTIME,
    extras_require={
        "test": ["pytest>=8", "hypothesis>=6.100", "scipy>=1.11", *REFERENCE],
        "bench": [*REFERENCE, "matplotlib>=3.8"],
        "gpu": ["jax[cuda12]>=0.10"],
        "tpu": ["jax[tpu]>=0.10"],
    },
    entry_points={"console_scripts": ["specjax=specjax.cli:run"]},
)
