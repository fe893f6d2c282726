"""Units of speculative generation in one process (small seeded random Llama): the EAGLE3
draft cache after many accepts and rollbacks equals a fresh prefill of the same sequence;
the cached draft chain reproduces the training-time-test unroll it was trained with; a draft
that is never confident is asked only on the adaptive policy's backoff schedule and reads the
skipped base states in one forward per probe; the acceptance metrics on a hand-made case; the
validation CLI writes its JSON and PNG, for chain (at batch 2) and tree drafting, and names a
bad --batch-size and a bad --typical-eps."""

import json
import re
import subprocess
import sys

import pytest
import torch

from megatron_specdec import distributed
from megatron_specdec.inference.oracle import OracleDrafter
from test_speculative_generation import HF, K, NEW, PROMPT, WRONG_AT, build, expected_accepts


@pytest.fixture(scope="module")
def eagle3():
    distributed.initialize(1, 1)
    return build("eagle3")


def _prefill(model, tokens, max_length):
    from megatron_specdec.inference.base_runner import BaseRunner

    return BaseRunner(model, 1, max_length).step(torch.tensor([tokens]))


def test_draft_cache_after_rollbacks_equals_fresh_prefill(eagle3):
    from megatron_specdec.methods.eagle3.proposer import Eagle3Drafter
    from megatron_specdec.inference.embedding import last_stage_embedding
    from megatron_specdec.inference.generator import SpeculativeGenerator
    from megatron_specdec.inference.generation import plain_generate

    greedy = plain_generate(eagle3.base, [PROMPT], NEW + K + 1, HF["vocab_size"])[0]
    embedding = last_stage_embedding(eagle3)
    oracle = OracleDrafter(Eagle3Drafter(eagle3, embedding), [greedy], [WRONG_AT],
                           HF["vocab_size"])
    result = SpeculativeGenerator(eagle3, K, drafter=oracle).generate(PROMPT, NEW)
    assert result.accepted == expected_accepts(K, NEW, WRONG_AT)
    used = oracle.inner
    seq = PROMPT + greedy
    n = int(used.real[0])
    assert n == len(PROMPT) + sum(a + 1 for a in result.accepted[:-1])
    fresh = Eagle3Drafter(eagle3, embedding)
    max_length = len(seq) + K
    with torch.no_grad():
        fresh.start(torch.tensor([seq[:n]]), torch.tensor([n]), torch.tensor([[seq[n]]]),
                    _prefill(eagle3, seq[:n], max_length), max_length)
        for (k_used, v_used), (k_fresh, v_fresh) in zip(
                used.cache.key_value_memory_dict.values(),
                fresh.cache.key_value_memory_dict.values()):
            torch.testing.assert_close(k_used[:n], k_fresh[:n], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v_used[:n], v_fresh[:n], atol=1e-4, rtol=1e-4)
        assert torch.equal(used.propose(K)[0], fresh.propose(K)[0])


@pytest.fixture(params=["decode", "forward"])
def draft_path(request, eagle3):
    """The draft's decoding path (Eagle3Layer.decode, what this model takes), or its layers'
    forward over the cache's blocks (what a layer decode cannot reproduce takes)."""
    assert eagle3.draft.lean, "the test draft should take the decoding path"
    if request.param == "forward":
        eagle3.draft.__dict__["lean"] = False
    yield request.param
    eagle3.draft.__dict__.pop("lean", None)


def test_cached_chain_equals_training_time_test(eagle3, draft_path):
    """Chain step j from the real prefix ending at t, fed the real tokens, gives the logits
    of training-time-test step j at position t + j, by either drafting path."""
    from megatron_specdec.methods.eagle3.proposer import Eagle3Drafter
    from megatron_specdec.inference.embedding import last_stage_embedding

    steps = 4
    seq = PROMPT + list(range(7, 7 + 12))
    s = len(seq)
    out = _prefill(eagle3, seq, s)
    embedding = last_stage_embedding(eagle3)
    embeds = embedding(input_ids=torch.tensor([seq]), position_ids=None)
    next_embeds = torch.cat([embeds[1:], embeds[-1:]])
    with torch.no_grad():
        ttt = eagle3.draft.training_time_test(out.aux, next_embeds, eagle3.rotary_pos_emb(s),
                                              None, steps)
    for t in (3, 10, s - steps - 1):
        drafter = Eagle3Drafter(eagle3, embedding)
        prefix = type(out)(out.logits[:, : t + 1], out.aux[: t + 1], None)
        with torch.no_grad():
            drafter.start(torch.tensor([seq[: t + 1]]), torch.tensor([t + 1]),
                          torch.tensor([[seq[t + 1]]]), prefix, s)
            hidden, logits = drafter._last
            torch.testing.assert_close(logits[0], ttt[0][t], atol=1e-4, rtol=1e-4)
            for j in range(1, steps):
                drafter._step(hidden, torch.tensor([[seq[t + j + 1]]]))
                hidden, logits = drafter._last
                torch.testing.assert_close(logits[0], ttt[j][t + j], atol=1e-4, rtol=1e-4)


def test_backoff_doubles_to_its_cap_and_resets_on_a_draft():
    from megatron_specdec.inference.draft_policy import DraftPolicy

    policy, backoff, schedule = DraftPolicy(K), 0, []
    for _ in range(8):
        backoff = policy.next_backoff(backoff, drafted=0)
        schedule.append(backoff)
    assert schedule == [1, 2, 4, 8, 16, 32, 32, 32]
    assert policy.next_backoff(32, drafted=1) == 0
    assert DraftPolicy.named("fixed", K).next_backoff(0, drafted=0) == 0


class _Recording:
    """An EAGLE3 drafter that logs how many drafts each propose kept and how many tokens each
    accept read."""

    def __init__(self, inner):
        self.inner, self.log = inner, []

    def start(self, *args):
        self.inner.start(*args)

    def propose(self, k, policy=None):
        drafts, counts = self.inner.propose(k, policy)
        self.log.append(("propose", int(counts.max())))
        return drafts, counts

    def accept(self, tokens, counts, out):
        self.log.append(("accept", int(counts.max())))
        self.inner.accept(tokens, counts, out)


def test_unconfident_draft_falls_back_to_plain_steps(eagle3, monkeypatch):
    """A random draft never reaches a 0.99 threshold: it is asked at rounds 0, 2, 5, 10, 19
    and 36 only (backoff 1, 2, 4, 8, 16), each time after reading the rounds it sat out in one
    forward, every other round is a plain step that runs no verify op, and the output is plain
    greedy's."""
    from megatron_specdec.inference import generator
    from megatron_specdec.inference.draft_policy import DraftPolicy
    from megatron_specdec.methods.eagle3.proposer import Eagle3Drafter
    from megatron_specdec.inference.embedding import last_stage_embedding
    from megatron_specdec.inference.generator import SpeculativeGenerator
    from megatron_specdec.inference.generation import plain_generate

    verifies = []
    verify = generator.greedy_chain_verify
    monkeypatch.setattr(generator, "greedy_chain_verify",
                        lambda *args: verifies.append(1) or verify(*args))
    drafter = _Recording(Eagle3Drafter(eagle3, last_stage_embedding(eagle3)))
    result = SpeculativeGenerator(eagle3, K, drafter=drafter,
                                  policy=DraftPolicy(K, 0.99)).generate(PROMPT, NEW)
    assert result.tokens == plain_generate(eagle3.base, [PROMPT], NEW, HF["vocab_size"])[0]
    assert result.drafted == [0] * (NEW - 1)
    probes = [0, 2, 5, 10, 19, 36]
    want = [("propose", 0)]
    for before, probe in zip(probes, probes[1:]):
        want += [("accept", probe - before), ("propose", 0)]
    assert drafter.log == want
    assert int(drafter.inner.real[0]) == len(PROMPT) + probes[-1]  # every state read once
    assert len(verifies) == len(probes)  # the rounds sat out verify nothing


def test_acceptance_metrics_hand_made():
    from megatron_specdec.inference.metrics import acceptance_summary, summarise_by_category

    s = acceptance_summary([0, 2, 4, 1], 4)
    assert s["verify_forwards"] == 4 and s["emitted_tokens"] == 11
    assert s["acceptance_length"] == pytest.approx(11 / 4)
    assert s["position_acceptance"] == pytest.approx([3 / 4, 2 / 3, 1 / 2, 1.0])
    assert s["accepted_histogram"] == [1, 1, 1, 0, 1]
    assert acceptance_summary([0, 0], 3)["position_acceptance"] == [0.0, None, None]
    both = summarise_by_category([{"category": "a", "accepted": [4, 4]},
                                  {"category": "b", "accepted": [0]}], 4)
    assert both["overall"]["acceptance_length"] == pytest.approx(11 / 3)  # pooled, not 3.0
    assert both["categories"]["a"]["acceptance_length"] == 5.0
    with pytest.raises(ValueError, match="accepted <= drafted <= 4"):
        acceptance_summary([5], 4)
    # Adaptive drafting: a position's rate counts only the forwards that drafted it.
    short = acceptance_summary([0, 1, 2], 3, drafted=[0, 1, 3])
    assert short["position_acceptance"] == pytest.approx([1.0, 1 / 1, 0.0])
    assert short["position_reached"] == [2, 1, 1] and short["mean_drafted"] == pytest.approx(4 / 3)
    with pytest.raises(ValueError, match="accepted <= drafted"):
        acceptance_summary([2], 3, drafted=[1])


def test_validation_cli_writes_json_and_png(tmp_path, default_hf_dir):
    """A tiny EAGLE3 checkpoint over SmolLM2's vocabulary and tokenizer, three prompts."""
    code = f"""
import torch
from megatron_specdec import distributed
distributed.initialize(1, 1)
from transformers import LlamaConfig, LlamaForCausalLM
from megatron_specdec import convert
from megatron_specdec.loading.hf_conversion import base_meta, load_hf_into_model
from megatron_specdec.models.provider import build_model
from megatron_specdec.loading.speculative import save_speculative
hf = LlamaConfig(**{dict(HF, vocab_size=49152)!r})
torch.manual_seed(0)
base = build_model(hf)
reference = LlamaForCausalLM(hf)
load_hf_into_model(base, hf, reference.state_dict())
model = convert(base, "eagle3", {{"draft_vocab_size": 256, "ttt_steps": 3,
                                 "eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}, hf_config=hf)
save_speculative(model, {str(tmp_path / 'ckpt')!r}, base_meta(hf, base, torch.float32, "local"),
                 {str(default_hf_dir)!r})
reference.save_pretrained({str(tmp_path / 'hf')!r})  # the base in HF form, for --transformers
"""
    subprocess.run([sys.executable, "-c", code], check=True)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in [
        {"category": "math", "turns": ["What is 2 + 3?", "And times 4?"]},
        {"category": "writing", "turns": ["Write a haiku about rain."]},
        {"category": "math", "turns": ["Is 91 prime?"]},
    ]))
    out = tmp_path / "report"
    run = subprocess.run(
        [sys.executable, "-m", "megatron_specdec.cli.validate", "--model",
         str(tmp_path / "ckpt"), "--data", str(prompts), "--out", str(out),
         "--max-new-tokens", "12", "--batch-size", "2"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "transformers" not in run.stdout
    report = json.loads((out / "acceptance.json").read_text())
    assert report["num_prompts"] == 3 and report["num_draft_tokens"] == 3
    assert report["batch_size"] == 2
    assert set(report["categories"]) == {"math", "writing"}
    assert report["identical_to_greedy"] == "3/3"
    overall = report["overall"]
    rounds = sum(len(r["accepted"]) for r in report["per_prompt"])
    assert overall["verify_forwards"] == rounds
    assert 1.0 <= overall["acceptance_length"] <= 4.0
    assert len(overall["position_acceptance"]) == 3
    assert report["speculative_tokens_per_s"] > 0 and report["greedy_tokens_per_s"] > 0
    png = (out / "acceptance.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000

    tree_out = tmp_path / "tree"
    run = subprocess.run(
        [sys.executable, "-m", "megatron_specdec.cli.validate", "--model",
         str(tmp_path / "ckpt"), "--data", str(prompts), "--out", str(tree_out),
         "--max-new-tokens", "12", "--tree-top-k", "2", "--tree-max-nodes", "5"],
        capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    tree = json.loads((tree_out / "acceptance.json").read_text())
    assert tree["tree"] == {"top_k": 2, "max_nodes": 5, "nodes": 5}
    assert tree["identical_to_greedy"] == "3/3"
    assert 1.0 <= tree["overall"]["acceptance_length"] <= 4.0
    assert (tree_out / "acceptance.png").is_file()

    stock_out = tmp_path / "stock"
    run = subprocess.run(
        [sys.executable, "-m", "megatron_specdec.cli.validate", "--model",
         str(tmp_path / "ckpt"), "--data", str(prompts), "--out", str(stock_out),
         "--max-new-tokens", "12", "--transformers", str(tmp_path / "hf")],
        capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    stock = json.loads((stock_out / "acceptance.json").read_text())
    assert stock["transformers"] == str(tmp_path / "hf")
    assert stock["speedup_vs_transformers"] == pytest.approx(
        stock["speculative_tokens_per_s"] / stock["transformers_tokens_per_s"])
    same, compared = map(int, stock["identical_to_transformers"].split("/"))
    assert compared == 3 and 0 <= same <= 3
    assert f"identical to it: {same}/3" in run.stdout

    sampled_out = tmp_path / "sampled"
    run = subprocess.run(
        [sys.executable, "-m", "megatron_specdec.cli.validate", "--model",
         str(tmp_path / "ckpt"), "--data", str(prompts), "--out", str(sampled_out),
         "--max-new-tokens", "12", "--drafter", "ngram", "--temperature", "0.7", "--top-k",
         "20", "--seed", "3"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    sampled = json.loads((sampled_out / "acceptance.json").read_text())
    assert sampled["algo"] == "ngram" and "identical_to_greedy" not in sampled
    assert sampled["sampling"] == {"temperature": 0.7, "top_k": 20, "top_p": 1.0, "seed": 3,
                                   "one_hot_drafts": False}

    missing = subprocess.run(
        [sys.executable, "-m", "megatron_specdec.cli.validate", "--model",
         str(tmp_path / "ckpt"), "--data", str(tmp_path / "none.jsonl"), "--out", str(out)],
        capture_output=True, text=True)
    assert missing.returncode == 2 and "none.jsonl" in missing.stderr
    # The settings are checked before any rank starts (the one-line exit is the missing file's
    # above): in this process, without another import of the stack.
    from megatron_specdec.cli import validate

    for extra, message in ((["--temperature", "-1"], "temperature must be >= 0"),
                           (["--batch-size", "0"], "--batch-size must be an integer >= 1"),
                           (["--acceptance", "typical", "--temperature", "0.7",
                             "--typical-eps", "1.5"], "typical acceptance eps must lie"),
                           (["--transformers", "--batch-size", "2"],
                            "--transformers times batch-1 greedy decoding in one process")):
        with pytest.raises(ValueError, match=re.escape(message)):
            validate.main(["--model", str(tmp_path / "ckpt"), "--data", str(prompts), "--out",
                           str(out), *extra])
    # The base's recorded HF directory is empty here (a LlamaConfig made in memory), and a
    # directory without a model is refused: both name the flag.
    for extra, message in ((["--transformers"], "pass --transformers DIR"),
                           (["--transformers", str(tmp_path)], "is not an HF model directory")):
        with pytest.raises(FileNotFoundError, match=re.escape(message)):
            validate.main(["--model", str(tmp_path / "ckpt"), "--data", str(prompts), "--out",
                           str(out), *extra])


@pytest.mark.parametrize("weights", ["float32", "bfloat16 values"])
def test_draft_layer_as_one_op_equals_its_ops_bitwise(weights):
    """The EAGLE3 draft layer run as the decode_layers op (its attention reading the
    embedding and the hidden stream) gives bitwise the hidden states and logits of its ops one
    by one, over a catch-up chunk and chained steps; with weights of bfloat16 values both read
    the 16-bit copies (weight_memory.narrow_copy)."""
    from megatron_specdec.inference.embedding import last_stage_embedding
    from megatron_specdec.methods.eagle3.proposer import Eagle3Drafter
    from megatron_specdec.models.weight_memory import narrow_copy

    distributed.initialize(1, 1)
    model = build("eagle3")
    layer = model.draft.layers[0]
    if not layer.layer_op:
        pytest.skip("the draft layer does not take the decode_layers op here (no extension)")
    if weights != "float32":
        with torch.no_grad():
            for p in model.draft.parameters():
                p.copy_(p.bfloat16().float())
    seq = PROMPT + list(range(7, 7 + 12))
    out = _prefill(model, seq, len(seq) + 8)
    embedding = last_stage_embedding(model)

    def run(op: bool):
        layer.__dict__["layer_op"] = op
        drafter = Eagle3Drafter(model, embedding)
        got = []
        with torch.no_grad():
            t = len(seq) - 4
            prefix = type(out)(None, out.aux[: t + 1], None)
            drafter.start(torch.tensor([seq[: t + 1]]), torch.tensor([t + 1]),
                          torch.tensor([[seq[t + 1]]]), prefix, len(seq) + 8)
            got.append(drafter._last)
            drafter.extend(out.aux[t + 1: t + 3], torch.tensor([seq[t + 2: t + 4]]),
                           torch.tensor([2]))
            got.append(drafter._last)
            for token in (5, 9, 11):
                drafter._step(drafter._last[0], torch.tensor([[token]]))
                got.append(drafter._last)
        return got

    try:
        one_op, by_ops = run(True), run(False)
    finally:
        layer.__dict__.pop("layer_op", None)
    for (h1, l1), (h2, l2) in zip(one_op, by_ops):
        assert torch.equal(h1, h2) and torch.equal(l1, l2)
    narrow = [narrow_copy(linear.weight) for linear in layer.linears]
    assert all((n is not None) == (weights != "float32") for n in narrow)
