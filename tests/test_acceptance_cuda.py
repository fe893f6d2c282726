"""CUDA acceptance ops: every .cu file compiles with nvcc (even with a CPU torch), and on
a GPU the CUDA ops return exactly what the reference returns."""
import glob
import os
import re
import shutil
import subprocess

import pytest
import torch

from megatron_specdec.acceptance import reference, validation

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron_specdec", "csrc")
CU_FILES = sorted(glob.glob(os.path.join(CSRC, "*.cu")))


def test_there_are_cuda_kernels():
    names = {os.path.basename(f) for f in CU_FILES}
    assert {"chain_verify_cuda.cu", "tree_verify_cuda.cu", "typical_verify_cuda.cu"} <= names


def test_sources_have_distinct_object_names():
    """setuptools/ninja names objects by stem: x.cpp and x.cu would both build x.o."""
    stems = [os.path.splitext(f)[0] for f in glob.glob(os.path.join(CSRC, "*.c*"))]
    assert len(stems) == len(set(stems)), sorted(stems)


def test_python_limits_match_the_kernels():
    limits = open(os.path.join(CSRC, "limits.h")).read()
    assert int(re.search(r"kMaxDraftLen = (\d+);", limits).group(1)) == validation.MAX_DRAFT_LEN
    assert int(re.search(r"kMaxTreeNodes = (\d+);", limits).group(1)) == validation.MAX_TREE_NODES


needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="nvcc not on PATH: cannot compile-check the .cu files")


@pytest.fixture(scope="module")
def objects(tmp_path_factory):
    """Each .cu file compiled once, with the flags a CUDA build of the extension uses (and
    position-independent, for the link below): source -> (the finished process, object)."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    out = tmp_path_factory.mktemp("cu_objects")
    done = {}
    for source in CU_FILES:
        obj = out / (os.path.basename(source) + ".o")
        cmd = ["nvcc", "-std=c++17", *COMMON_NVCC_FLAGS, "-Xcompiler", "-Wall,-fPIC", "-I", CSRC,
               "-c", source, "-o", str(obj)]
        done[source] = (subprocess.run(cmd, capture_output=True, text=True, timeout=600), obj)
    return done


@needs_nvcc
@pytest.mark.parametrize("source", CU_FILES, ids=os.path.basename)
def test_cu_file_compiles(source, objects):
    proc, obj = objects[source]
    assert proc.returncode == 0, proc.stderr
    assert obj.stat().st_size > 0
    assert "warning" not in proc.stderr.lower(), proc.stderr


@needs_nvcc
def test_cu_files_link_together(objects, tmp_path):
    """Header functions defined in several .cu files must not collide at link time."""
    assert all(proc.returncode == 0 for proc, _ in objects.values()), "a .cu file did not compile"
    lib = tmp_path / "kernels.so"
    cmd = ["nvcc", "-shared", *(str(obj) for _, obj in objects.values()), "-o", str(lib)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert "multiple definition" not in proc.stderr, proc.stderr


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)")


@pytest.fixture
def cuda_ops():
    from megatron_specdec.acceptance import extension_available

    if not extension_available("cuda"):
        pytest.fail("a CUDA device is present but the extension was built without CUDA kernels")
    return torch.ops.megatron_specdec


def _same(fused, ref):
    for a, b in zip(fused, ref):
        assert torch.equal(a.cpu(), b.cpu()), f"cuda\n{a}\nreference\n{b}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("vocab", [1, 300, 49152, 128256])
@pytest.mark.parametrize("batch", [1, 24])
def test_cuda_chain_ops_match_reference(cuda_ops, dtype, vocab, batch):
    """Batch 1 splits each row over many blocks of the statistics pass; batch 24 over few."""
    from tests.test_acceptance_equivalence import chain_case

    gen = torch.Generator().manual_seed(21)
    draft, logits, lens, q, u = chain_case(gen, batch, 6, vocab, dtype, accept_bias=3.0 + (vocab > 1000) * 9)
    dev = [t.cuda() for t in (draft, logits, lens, q, u)]
    _same(cuda_ops.greedy_chain_verify(*dev[:3]), reference.greedy_chain_verify(draft, logits, lens))
    ids = logits.argmax(-1)
    _same(cuda_ops.greedy_chain_verify_ids(dev[0], ids.cuda(), dev[2]),
          reference.greedy_chain_verify_ids(draft, ids, lens))
    for with_q in (False, True):
        for params in [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.2, 0, 0.8), (0.9, 20, 0.9)]:
            args = (draft, logits, lens, q if with_q else None, u, *params)
            dargs = (dev[0], dev[1], dev[2], dev[3] if with_q else None, dev[4], *params)
            _same(cuda_ops.stochastic_chain_verify(*dargs), reference.stochastic_chain_verify(*args))
    _same(cuda_ops.typical_verify(*dev[:3], 0.8, 0.09, 0.3), reference.typical_verify(draft, logits, lens, 0.8,
                                                                                     0.09, 0.3))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("vocab", [1, 9, 49152])
def test_cuda_tree_ops_match_reference(cuda_ops, vocab):
    from tests.test_acceptance_equivalence import tree_case

    gen = torch.Generator().manual_seed(22)
    ids, parents, logits, nodes, q, u, depth = tree_case(gen, 16, 14, vocab)
    dev = [t.cuda() for t in (ids, parents, logits, nodes, q, u)]
    _same(cuda_ops.tree_verify_greedy(dev[0], dev[1], dev[2], dev[3], depth),
          reference.tree_verify_greedy(ids, parents, logits, nodes, depth))
    for with_q in (False, True):
        for params in [(1.0, 0, 1.0), (0.7, 3, 0.9)]:
            args = (ids, parents, logits, nodes, q if with_q else None, u, depth, *params)
            dargs = (dev[0], dev[1], dev[2], dev[3], dev[4] if with_q else None, dev[5], depth, *params)
            _same(cuda_ops.tree_verify_stochastic(*dargs), reference.tree_verify_stochastic(*args))


@pytest.mark.gpu
@needs_gpu
def test_cuda_value_errors(cuda_ops):
    draft = torch.zeros(2, 3, dtype=torch.long, device="cuda")
    lens = torch.full((2,), 3, device="cuda")
    logits = torch.zeros(2, 4, 5, device="cuda")
    logits[0, 0, 1] = float("nan")
    u = torch.rand(2, 4, device="cuda")
    with pytest.raises(RuntimeError, match="NaN"):
        cuda_ops.stochastic_chain_verify(draft, logits, lens, None, u, 1.0, 0, 1.0)
    with pytest.raises(RuntimeError, match="NaN"):
        cuda_ops.greedy_chain_verify(draft, logits, lens)
    probs = torch.full((2, 3, 5), -1.0, device="cuda")
    with pytest.raises(RuntimeError, match="draft_probs must be finite and >= 0"):
        cuda_ops.stochastic_chain_verify(draft, torch.zeros(2, 4, 5, device="cuda"), lens, probs, u, 1.0, 0, 1.0)
    with pytest.raises(RuntimeError, match=r"draft_lens\[0\] must be in \[0, 3\]"):
        cuda_ops.greedy_chain_verify(draft, logits, torch.tensor([4, 0], device="cuda"))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH: no CUDA headers to check ops_cuda.cpp against")
def test_cuda_op_wrappers_compile(tmp_path):
    """ops_cuda.cpp (the torch ops around the kernels) is compiled only by CUDA builds: check its
    syntax here against torch's CUDA headers. A CPU wheel lacks one generated header, stubbed."""
    import sysconfig

    from torch.utils.cpp_extension import CUDA_HOME, include_paths

    stub = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    stub.parent.mkdir(parents=True)
    stub.write_text("#pragma once\n")
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), CUDA_HOME, "/usr/local/cuda"]
    includes = [os.path.join(h, "include") for h in homes if h]
    cuda_include = next((i for i in includes if os.path.exists(os.path.join(i, "cuda_runtime.h"))), None)
    if cuda_include is None:
        pytest.skip(f"no cuda_runtime.h under {includes}: set CUDA_HOME")
    cmd = ["g++", "-std=c++17", "-fsyntax-only", "-DSPECDEC_WITH_CUDA", "-I", str(tmp_path),
           "-I", cuda_include, "-I", sysconfig.get_paths()["include"]]
    cmd += [arg for path in include_paths() for arg in ("-I", path)]
    proc = subprocess.run(cmd + [os.path.join(CSRC, "ops_cuda.cpp")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
