"""Build rlperf: the Python package, its top-level subpackages and the rlperf._C extension.

`kernels/`, `gates/`, `profiles/` and `bench/` live at the top of the repository but import as
`rlperf.kernels`, `rlperf.gates`, `rlperf.profiles` and `rlperf.bench` (package_dir below), for
both `pip install -e .` and a wheel.

The C++/CUDA extension (csrc/) needs torch at build time, so install with
`pip install --no-build-isolation -e .` after torch. When torch is not importable the package
still installs, without `rlperf._C`, and the Python fallbacks warn at run time.

An editable install builds in a fresh temporary directory every time, so adding an extra later
(`pip install -e ".[plot]"`) compiled the extension again (most of the install's time). The build keeps a key of
what it compiled from (the sources, torch, Python, the flags) beside the in-tree copy of the
extension (`rlperf/_C*.so.key`); a build whose key matches copies that extension instead of compiling
(`RLPERF_REBUILD_EXTENSION=1` compiles anyway).
"""
import hashlib
import os
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
TOP_LEVEL_SUBPACKAGES = ("kernels", "gates", "profiles", "bench")


def _packages():
    packages = ["rlperf"] + ["rlperf." + p for p in find_packages(where="rlperf")]
    package_dir = {"rlperf": "rlperf"}
    for top in TOP_LEVEL_SUBPACKAGES:
        if not (ROOT / top / "__init__.py").exists():
            continue
        packages.append(f"rlperf.{top}")
        package_dir[f"rlperf.{top}"] = top
        for sub in find_packages(where=top):
            packages.append(f"rlperf.{top}.{sub}")
            package_dir[f"rlperf.{top}.{sub}"] = os.path.join(top, *sub.split("."))
    return packages, package_dir


def _extensions():
    """rlperf._C from csrc/: CPU sources always, CUDA sources when nvcc and a CUDA torch exist."""
    sources_cpp = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.cpp"))
    if not sources_cpp or os.environ.get("RLPERF_NO_EXTENSION") == "1":
        return [], {}
    try:
        import torch  # noqa: F401
        from torch.utils import cpp_extension
    except ImportError:
        print("rlperf: torch is not importable at build time; building without rlperf._C", file=sys.stderr)
        return [], {}
    sources_cu = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.cu"))
    use_cuda = bool(sources_cu) and cpp_extension.CUDA_HOME is not None and torch.version.cuda is not None
    # No -std flag of our own: BuildExtension passes the standard torch itself was built with
    # (C++20 for current releases). Compiling torch's headers under another standard changes the
    # layout of inline types such as c10::Error, and a raised TORCH_CHECK then crashes the process.
    cxx_flags = ["-O3", "-fopenmp"]
    if use_cuda:
        ext = cpp_extension.CUDAExtension(
            "rlperf._C",
            sources_cpp + sources_cu,
            define_macros=[("RLPERF_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "--use_fast_math"]},
            extra_link_args=["-fopenmp"],
        )
    else:
        ext = cpp_extension.CppExtension(
            "rlperf._C", sources_cpp, extra_compile_args={"cxx": cxx_flags}, extra_link_args=["-fopenmp"]
        )
    key = _build_key(f"{torch.__version__} cuda={torch.version.cuda} nvcc={use_cuda} {cxx_flags}")

    class BuildExtension(cpp_extension.BuildExtension):
        """torch's BuildExtension, reusing the in-tree extension built from the same key (module docstring)."""

        def build_extension(self, ext):
            target = Path(self.get_ext_fullpath(ext.name))
            in_tree = ROOT / self.get_ext_filename(ext.name)
            stamp = in_tree.with_name(in_tree.name + ".key")
            fresh = os.environ.get("RLPERF_REBUILD_EXTENSION") == "1"
            # the stamp names the build's key and the hash of the file it produced: an in-tree file that is
            # not that build's output (an older one, a wheel build's leftover) is never reused
            if not fresh and in_tree.is_file() and stamp.is_file() and stamp.read_text().split() == [key, _sha256(in_tree)]:
                if target.resolve() != in_tree.resolve():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(in_tree, target)
                print(f"rlperf: {in_tree.relative_to(ROOT)} was built from these sources, torch and flags; "
                      f"reused (RLPERF_REBUILD_EXTENSION=1 compiles anyway)", file=sys.stderr)
                return
            super().build_extension(ext)
            stamp.write_text(f"{key} {_sha256(target)}\n")

    # with ninja installed the sources compile in parallel (41 -> 25 s on 2 cores); without it torch's
    # BuildExtension says so and compiles them one at a time
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _build_key(settings: str) -> str:
    """What an extension build depends on: every csrc file (sources and headers), the Python, torch and flags."""
    h = hashlib.sha256(f"{sys.version} {settings}".encode())
    for path in sorted((ROOT / "csrc").rglob("*")):
        if path.is_file():
            h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


packages, package_dir = _packages()
ext_modules, cmdclass = _extensions()

# megatron-core 0.19 needs Python >= 3.12; the 0.16 line is the last that installs on 3.11. The
# megatron trainer backend (rlperf/train/megatron/) uses its local (no Transformer Engine) spec,
# which is pure Python in both lines.
MEGATRON_CORE = ['megatron-core~=0.16.1; python_version < "3.12"',
                 'megatron-core~=0.19.0; python_version >= "3.12"']

setup(
    name="rlperf",
    version="0.1.0",
    description="Performance lab for RL post-training of LLMs: batch-invariant kernels, first-step gates, profiling",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=packages,
    package_dir=package_dir,
    package_data={"rlperf": ["data/*", "data/**/*"], "rlperf.kernels": ["manifests/*.jsonl"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    install_requires=["torch>=2.6", "triton>=3.3", "numpy", "safetensors>=0.4", "aiohttp>=3.9", "tqdm", "perfetto>=0.59"],
    extras_require={
        "test": ["pytest>=8", "pyflakes>=3", "pytest-xdist>=3.5", "pytest-benchmark>=4", "sglang-router>=0.3.2", "transformers>=4.51",
                 "perfetto>=0.59", "ray[default]>=2.40", "tensorboard>=2.14", "wandb>=0.17", "matplotlib>=3.7", *MEGATRON_CORE],
        "serve": ["sglang-router>=0.3.2"],
        "hf": ["transformers>=4.51"],
        "profile": ["sglang-router>=0.3.2", "perfetto>=0.59"],
        "ray": ["ray[default]>=2.40", "sglang-router>=0.3.2"],  # --placement ray (its engines sit behind the router)
        "tensorboard": ["tensorboard>=2.14"],  # rlperf train --use-tensorboard
        "wandb": ["wandb>=0.17"],  # rlperf train --use-wandb
        "plot": ["matplotlib>=3.7"],  # rlperf plot, rlperf train --plot, the gate's and the profile's pictures
        "megatron": MEGATRON_CORE,  # the megatron trainer backend (rlperf.train.megatron)
    },
    entry_points={
        "console_scripts": ["rlperf=rlperf.cli:main"],
        # SGLang (0.5.17) runs every plugin of this group in each of its processes: --attention-backend rlperf
        # then computes with rlperf's kernels (rlperf/sglang_plugin/__init__.py)
        "sglang.srt.plugins": ["rlperf=rlperf.sglang_plugin:register"],
    },
)
