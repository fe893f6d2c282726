"""vLLM (the CPU build in .venv-vllm, run through megatron_specdec/engines) serves the drafts
export_draft writes, as users deploy them.

SmolLM2 (fp32) with a live EAGLE3 draft (tests/live_draft.py: a fitted linear draft that vLLM
accepts tokens from) over a 2048-id draft vocabulary, imported into a speculative checkpoint
saved at TP=2 and exported by export_draft in fp32 and bf16, plus a two-layer draft:

- vLLM's speculative output equals vLLM's greedy output, which equals the project's
  plain_generate on the same fp32 weights, token for token;
- vLLM accepts the draft's tokens, and serves an export without d2t silently dead, which is
  why `export_draft --verify-with vllm` checks the files and the acceptance length;
- `--verify-with vllm` passes the good export and names the fault of broken ones;
- the same draft imported as a parallel-drafting (P-EAGLE) one, exported and served with
  vLLM's parallel_drafting: its output is greedy's and vLLM's acceptance length is the
  project decoder's.

The default suite serves the fp32 one-layer export; the bf16 and two-layer exports, n-gram
drafting, the export without d2t and the Medusa / draft-model serving are marked slow.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_specdec import distributed
from megatron_specdec.engines import verify_export
from megatron_specdec.engines import vllm_client as vllm

pytestmark = pytest.mark.engines

NEW_TOKENS = 32
K = 3
DRAFT_VOCAB = 2048
FIT_DATA = Path(__file__).resolve().parents[1] / "data" / "smollm2_regen.jsonl.gz"


@pytest.fixture(scope="module")
def vllm_env():
    """Skip (with the install's reason) only where vLLM could not be installed; an env that
    was never created is an error that says how to create it."""
    failed = vllm.REPO / ".venv-vllm" / ".install-failed"
    if failed.is_file():
        pytest.skip(f"vLLM could not be installed (make vllm-env): {failed.read_text().strip()}")
    return vllm.vllm_python()


def _project_greedy(prompts, out_file):
    """The project's greedy continuations of SmolLM2 (fp32), K tokens past NEW_TOKENS (what a
    last round verifies beyond the end)."""
    from megatron_specdec.inference.generation import plain_generate
    from megatron_specdec.loading.hf_conversion import model_from_hf

    distributed.initialize(1, 1)
    model, config = model_from_hf("default")
    torch.save(plain_generate(model.eval(), prompts, NEW_TOKENS + K, config.vocab_size),
               out_file)


@pytest.fixture(scope="module")
def prompts(default_hf_dir):
    return verify_export.chat_prompts(default_hf_dir)


@pytest.fixture(scope="module")
def project_greedy(vllm_env, prompts, module_tmp):
    out = module_tmp("greedy") / "greedy.pt"
    distributed.spawn(_project_greedy, 1, prompts, str(out))
    return torch.load(out)


@pytest.fixture(scope="module")
def base_tp2(vllm_env, module_tmp):
    """SmolLM2 (fp32) saved at TP=2 (its 3 query groups padded to 4)."""
    from megatron_specdec.loading.hf_conversion import hf_to_megatron

    out = module_tmp("base") / "base"
    hf_to_megatron("default", out, tp=2)
    return out


@pytest.fixture(scope="module")
def live(vllm_env, default_hf_dir):
    """The fitted linear draft (tests/live_draft.py), fitted once for every depth written."""
    import live_draft

    return live_draft.fit(default_hf_dir, FIT_DATA, DRAFT_VOCAB)


def speculative_tp2(live, base_dir, base_tp2, root, layers):
    """The live draft with `layers` layers imported onto the TP=2 base (once per depth)."""
    from megatron_specdec.methods.eagle3.hf_import import import_eagle3

    import live_draft

    ckpt = root / f"spec{layers}_tp2"
    if not ckpt.exists():
        hf = live_draft.write(live, base_dir, root / f"live{layers}", layers)
        import_eagle3(hf, base_tp2, ckpt, tp=2)
    return ckpt


def export(ckpt, root, layers, dtype):
    """export_draft of a TP=2 speculative checkpoint: name -> export directory."""
    from checkpoint_tools import export_draft

    out = root / f"export{layers}_{dtype}"
    export_draft.main(["--model", str(ckpt), "--out", str(out), "--dtype", dtype])
    return {f"eagle3_{layers}layer_{dtype}": out}


@pytest.fixture(scope="module")
def served(default_hf_dir, prompts, project_greedy, base_tp2, live, module_tmp):
    """The one-layer EAGLE3 export (TP=2 checkpoint -> export_draft, fp32) and one vLLM
    process serving greedy and the draft on the same prompts."""
    from checkpoint_tools import export_draft
    from megatron_specdec.methods.eagle3.hf_import import import_eagle3

    root = module_tmp("engines")
    exports = export(speculative_tp2(live, default_hf_dir, base_tp2, root, 1), root, 1,
                     "float32")
    from megatron_specdec.methods.eagle3.mask_init import conversation_ids

    import_eagle3(root / "live1", base_tp2, root / "peagle1_tp2", tp=2,
                  parallel_drafting=conversation_ids([FIT_DATA], base_tp2 / "tokenizer"))
    export_draft.main(["--model", str(root / "peagle1_tp2"), "--out", str(root / "peagle1")])
    exports["peagle_1layer_float32"] = root / "peagle1"
    runs = {"greedy": None, **{n: vllm.eagle3_config(d, K) for n, d in exports.items()}}
    results = vllm.generate(default_hf_dir, prompts, NEW_TOKENS, runs)
    (root / "vllm_results.json").write_text(json.dumps(
        {n: {k: v for k, v in vars(r).items() if k != "outputs"} for n, r in results.items()}))
    return {"root": root, "prompts": prompts, "exports": exports, "results": results,
            "project_greedy": [g[:NEW_TOKENS] for g in project_greedy]}


@pytest.fixture(scope="module")
def served_more(default_hf_dir, prompts, served, base_tp2, live):
    """What the slow tests serve besides: the bf16 export of the same checkpoint, a two-layer
    draft, the fp32 export without d2t and vLLM's n-gram drafting, in one more vLLM process
    (with its own greedy run)."""
    root = served["root"]
    exports = {**export(root / "spec1_tp2", root, 1, "bfloat16"),
               **export(speculative_tp2(live, default_hf_dir, base_tp2, root, 2), root, 2,
                        "float32")}
    exports["no_d2t"] = broken(served["exports"]["eagle3_1layer_float32"], root / "no_d2t",
                               drop="d2t")
    # n-gram listed first: vLLM 0.32 builds no EAGLE3 engine after an n-gram one in a process,
    # so the runner must order them (its results keep this order).
    runs = {"greedy": None, "ngram": vllm.ngram_config(K),
            **{n: vllm.eagle3_config(d, K) for n, d in exports.items()}}
    results = vllm.generate(default_hf_dir, prompts, NEW_TOKENS, runs)
    return {"exports": exports, "results": results}


def broken(src, dst, drop=None, rename=None, config=None):
    """A copy of an export with a tensor dropped or renamed, or config keys replaced (a dict
    value updates the key's dict)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    if drop:
        del tensors[drop]
    if rename:
        tensors[rename[1]] = tensors.pop(rename[0])
    save_file(tensors, str(dst / "model.safetensors"))
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        for key, value in config.items():
            cfg[key] = dict(cfg[key], **value) if isinstance(value, dict) else value
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_vllm_speculative_output_is_its_greedy_and_the_projects(served):
    results = served["results"]
    for name, result in results.items():
        assert result.error is None, (name, result.error, result.where)
    assert list(results) == ["greedy", *served["exports"]]
    greedy = results["greedy"].outputs
    assert greedy == served["project_greedy"], "vLLM greedy != the project's plain_generate"
    for name in served["exports"]:
        assert results[name].outputs == greedy, name
        assert results[name].tokens == NEW_TOKENS * len(served["prompts"]), name


def _project_accepted(ckpt, prompts, out_file):
    """The project's decoder on a speculative checkpoint: tokens and accepted drafts per round
    of each prompt (fixed K drafts a round)."""
    from megatron_specdec.inference.generator import SpeculativeGenerator
    from megatron_specdec.loading.speculative import load_speculative

    distributed.initialize(1, 1)
    generator = SpeculativeGenerator(load_speculative(ckpt)[0].eval(), K, policy="fixed")
    results = [generator.generate(ids, NEW_TOKENS) for ids in prompts]
    torch.save([(r.tokens, r.accepted) for r in results], out_file)


def test_vllm_drafts_a_parallel_drafting_export_as_the_project_does(served, tmp_path):
    """P-EAGLE: vLLM runs the export as parallel_drafting (its config.json says so), drafts
    K tokens every verify step, and accepts what the project's decoder accepts from the same
    draft (acceptance length within 5%; a chain-drafting reading of the same weights accepts
    more, its later positions being the live draft's own)."""
    r = served["results"]["peagle_1layer_float32"]
    config = json.loads((served["exports"]["peagle_1layer_float32"] / "config.json").read_text())
    assert vllm.eagle3_config(served["exports"]["peagle_1layer_float32"], K)["parallel_drafting"]
    assert config["parallel_drafting"] is True and config["mask_token_id"] == 49151
    assert r.drafts > 0 and r.draft_tokens == K * r.drafts, r
    out = tmp_path / "project.pt"
    distributed.spawn(_project_accepted, 1, str(served["root"] / "peagle1_tp2"),
                      served["prompts"], str(out))
    project = torch.load(out)
    assert [tokens for tokens, _ in project] == served["project_greedy"]
    accepted = [a for _, rounds in project for a in rounds]
    project_al = (sum(accepted) + len(accepted)) / len(accepted)
    assert sum(accepted) > 0
    assert abs(r.acceptance_length / project_al - 1) <= 0.05, (r.acceptance_length, project_al)


# The bf16 and two-layer exports, and n-gram drafting, repeat the fp32 export's checks on
# another dtype or depth, in a second vLLM process: slow.
@pytest.mark.slow
def test_vllm_serves_every_export_and_ngram_as_its_greedy(served, served_more):
    results = served_more["results"]
    for name, result in results.items():
        assert result.error is None, (name, result.error, result.where)
    assert list(results) == ["greedy", "ngram", *served_more["exports"]]
    greedy = results["greedy"].outputs
    assert greedy == served["project_greedy"], "vLLM greedy != the project's plain_generate"
    for name in ("ngram", *served_more["exports"]):
        assert results[name].outputs == greedy, name
        assert results[name].tokens == NEW_TOKENS * len(served["prompts"]), name


@pytest.mark.parametrize("name", ["eagle3_1layer_float32",
                                  pytest.param("eagle3_1layer_bfloat16", marks=pytest.mark.slow),
                                  pytest.param("eagle3_2layer_float32", marks=pytest.mark.slow)])
def test_vllm_accepts_the_exported_draft(served, request, name):
    results = (served if name in served["exports"] else request.getfixturevalue("served_more")
               )["results"]
    r = results[name]
    assert r.drafts > 0 and r.draft_tokens == K * r.drafts, name
    assert r.acceptance_length >= verify_export.MIN_ACCEPTANCE_LENGTH, (name, r)
    assert r.accepted_per_position[0] > 0, (name, r.accepted_per_position)


@pytest.mark.slow  # a fact about vLLM that test_verify_names_a_broken_export_before_serving acts on
def test_vllm_serves_an_export_without_d2t_without_complaint(served, served_more):
    """vLLM loads it without an error (draft id d is served as target id d) and stays
    lossless: nothing in vLLM says the mapping is gone, so only a check of the files (below)
    catches it."""
    r = served_more["results"]["no_d2t"]
    assert r.error is None and r.drafts > 0
    assert r.outputs == served_more["results"]["greedy"].outputs


@pytest.mark.slow  # a second vLLM serving run: verify_eagle3 serves in vLLM in the test below
def test_export_draft_verify_with_vllm(served, capsys, caplog):
    """The flag on the TP=2 checkpoint: the base is written to a temporary HF directory."""
    from checkpoint_tools import export_draft

    out = served["root"] / "verified"
    caplog.set_level("INFO", logger="megatron_specdec.engines.verify_export")
    export_draft.main(["--model", str(served["root"] / "spec1_tp2"), "--out", str(out),
                       "--verify-with", "vllm"])
    assert "greedy-identical on 3 prompts" in caplog.text
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".verify_base_")]


@pytest.mark.parametrize("fault,edit,message", [
    ("renamed tensor", {"rename": ("midlayer.hidden_norm.weight", "midlayer.hiddennorm.weight")},
     "midlayer.hiddennorm.weight"),
    ("missing d2t", {"drop": "d2t"}, "'d2t'"),
    ("aux ids of the two numberings disagree", {"config": {"eagle_aux_hidden_state_layer_ids":
                                                           [1, 14, 26]}},
     "name different layers"),
])
def test_verify_names_a_broken_export_before_serving(served, default_hf_dir, fault, edit,
                                                     message):
    bad = broken(served["exports"]["eagle3_1layer_float32"],
                 served["root"] / fault.replace(" ", "_"), **edit)
    with pytest.raises(verify_export.VerificationError, match=message):
        verify_export.verify_eagle3(bad, default_hf_dir)


def test_verify_catches_wrong_aux_layers_only_vllm_can_see(served, default_hf_dir):
    """Both numberings agree but name other layers: the files are consistent, vLLM serves the
    draft without complaint, and the acceptance floor (here half-way between a dead draft and
    what vLLM measured on the good export) reports it with the layers vLLM read. (Listing
    the right layers in another order is no fault to vLLM: it collects them in layer order.)"""
    wrong = {"eagle_aux_hidden_state_layer_ids": [5, 10, 20],
             "eagle_config": {"eagle_aux_hidden_state_layer_ids": [4, 9, 19]}}
    bad = broken(served["exports"]["eagle3_1layer_float32"], served["root"] / "aux_wrong",
                 config=wrong)
    good = served["results"]["eagle3_1layer_float32"].acceptance_length
    with pytest.raises(verify_export.VerificationError,
                       match=r"draft is dead as served.*entering base layers \[5, 10, 20\]"):
        verify_export.verify_eagle3(bad, default_hf_dir, min_acceptance_length=(1 + good) / 2)


# Medusa heads and a separate draft model: vLLM 0.32's CPU runner builds both proposers (its
# CPUModelRunner is the GPU runner's subclass), so both are served here.
MEDUSA_HEADS = K  # vLLM drafts exactly one token per Medusa head
DRAFT_LAYERS = 8
BIAS_SCALE = 1e4
HIDDEN_BOUND = 80.0  # |final normed state| <= max|norm weight| * sqrt(hidden) = 3.35 * 24


def constant_medusa(src, dst, token_pool, fc_bias=True):
    """A copy of an (untrained) Medusa export whose every head drafts one token whatever the
    hidden state: a block is `x + SiLU(W x + b)` with W = 0 as exported, and b = BIAS_SCALE
    along that token's lm_head row outweighs x (the logit margin is checked against the
    largest logit x can move). Returns the token, the first of `token_pool` with that margin.
    With medusa_fc_bias false vLLM builds bias-free blocks and drops the biases; each head is
    then the base's lm_head on the base's state, so it drafts the token just emitted."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "medusa_lm_head.safetensors"))
    lm_head = tensors["0.1.weight"].float()
    reach = 2 * lm_head.norm(dim=1).max() * HIDDEN_BOUND
    for token in token_pool:
        bias = BIAS_SCALE * lm_head[token] / lm_head[token].norm()
        logits = lm_head @ torch.nn.functional.silu(bias)
        top2 = logits.topk(2)
        if top2.indices[0] == token and top2.values[0] - top2.values[1] > reach:
            break
    else:
        raise AssertionError("no token of the pool reaches a safe logit margin")
    for i in range(MEDUSA_HEADS):
        tensors[f"{i}.0.linear.bias"] = bias.to(tensors[f"{i}.0.linear.bias"].dtype).clone()
    save_file(tensors, str(dst / "medusa_lm_head.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(dict(config, medusa_fc_bias=fc_bias)))
    return token


def chain_accepted(continuations, drafts_after, k=K, length=NEW_TOKENS):
    """(verify rounds, accepted drafts) of a chain drafter generating `length` tokens greedily:
    `continuations` are the greedy outputs (k tokens past `length`: a last round verifies
    beyond the end, and vLLM counts what it accepts there), drafts_after(out, p) the k drafts
    proposed once out[p] is emitted. The prefill emits out[0] and verifies nothing."""
    rounds = accepted = 0
    for out in continuations:
        p = 0
        while p + 1 < length:
            drafts = drafts_after(out, p)
            a = 0
            while a < k and drafts[a] == out[p + 1 + a]:
                a += 1
            rounds, accepted, p = rounds + 1, accepted + a, p + a + 1
    return rounds, accepted


@pytest.fixture(scope="module")
def served_heads(default_hf_dir, prompts, project_greedy, base_tp2, module_tmp):
    """Medusa heads converted at TP=2 and exported (with their biases set so every head drafts
    one frequent token, and a copy without medusa_fc_bias), and a depth-pruned SmolLM2
    exported as an HF Llama, served by vLLM beside its greedy in one process."""
    from collections import Counter

    from checkpoint_tools import export_draft, megatron_to_hf
    from megatron_specdec.loading.conversion import convert_checkpoint

    root = module_tmp("heads")
    convert_checkpoint(base_tp2, root / "medusa_tp2", "medusa",
                       {"medusa_num_heads": MEDUSA_HEADS, "medusa_num_layers": 1}, tp=2)
    export_draft.main(["--model", str(root / "medusa_tp2"), "--out", str(root / "medusa")])
    pool = [t for t, _ in Counter(t for g in project_greedy for t in g[:NEW_TOKENS])
            .most_common(20)]
    token = constant_medusa(root / "medusa", root / "medusa_bias", pool)
    constant_medusa(root / "medusa", root / "medusa_no_flag", [token], fc_bias=False)
    subprocess.run([sys.executable, str(vllm.REPO / "checkpoint_tools" / "prune_depth.py"),
                    "--model", "default", "--num-layers", str(DRAFT_LAYERS), "--data",
                    str(FIT_DATA), "--out", str(root / "pruned")], check=True, cwd=vllm.REPO)
    megatron_to_hf.main(["--model", str(root / "pruned"), "--out", str(root / "pruned_hf")])
    runs = {"greedy": None,
            "medusa": vllm.medusa_config(root / "medusa_bias", MEDUSA_HEADS),
            "medusa_no_flag": vllm.medusa_config(root / "medusa_no_flag", MEDUSA_HEADS),
            "draft_model": vllm.draft_model_config(root / "pruned_hf", K)}
    results = vllm.generate(default_hf_dir, prompts, NEW_TOKENS, runs)
    return {"results": results, "token": token, "project_greedy": project_greedy}


# Medusa and the draft model are the second vLLM serving fixture (a conversion, a depth
# pruning, four engines): slow; the EAGLE3 tests above serve an export in the default suite.
@pytest.mark.slow
def test_vllm_serves_medusa_and_a_draft_model_greedy_identical(served_heads):
    results, greedy = served_heads["results"], served_heads["project_greedy"]
    for name, result in results.items():
        assert result.error is None, (name, result.error, result.where)
        assert result.outputs == [g[:NEW_TOKENS] for g in greedy], name
    for name in ("medusa", "draft_model"):
        r = results[name]
        assert r.drafts > 0 and r.draft_tokens == K * r.drafts, (name, r)
    assert results["draft_model"].accepted > 0, results["draft_model"]


@pytest.mark.slow
def test_vllm_keeps_the_medusa_biases_only_with_medusa_fc_bias(served_heads):
    """vLLM's counters equal, round for round, what the heads draft with their biases (every
    head: the chosen token) and, when config.json lacks medusa_fc_bias, without them (the
    token just emitted): the two differ on these prompts, so the flag is what keeps them."""
    results, greedy, token = (served_heads[k] for k in ("results", "project_greedy", "token"))
    with_bias = chain_accepted(greedy, lambda out, p: [token] * K)
    without = chain_accepted(greedy, lambda out, p: [out[p]] * K)
    assert with_bias != without
    assert (results["medusa"].drafts, results["medusa"].accepted) == with_bias
    assert (results["medusa_no_flag"].drafts, results["medusa_no_flag"].accepted) == without
