"""The decoding layer (models/layers/decode_layer.py) with its PyTorch ops gives bitwise the
logits of megatron's TransformerLayer forward: for Llama, Qwen2 (q/k/v bias) and Qwen3 (q/k
norm) bases, at TP=1 and TP=2, over a ragged prefill, a chain verify and one-token steps of a
batch of two. With its C++ ops (csrc/decode_ops.cpp) it equals forward within float32
rounding at batch 1 and 2, and a batch-1 chain's logits equal one-token steps' bitwise. An MoE
layer keeps megatron's forward. The stage runner calls a layer a hook watches, and runs the
others' decode directly."""

import json

import pytest
import torch

from megatron_specdec import distributed
from megatron_specdec.models.layers.decode_attention import DecodeCache

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, tie_word_embeddings=False)


def hf_config(family):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    return {"llama": LlamaConfig(**COMMON),
            "qwen2": Qwen2Config(use_sliding_window=False, **COMMON),
            "qwen3": Qwen3Config(head_dim=32, use_sliding_window=False, **COMMON)}[family]


def base_model(hf):
    """This rank's random base; biases and norms perturbed so that they count."""
    from transformers import AutoModelForCausalLM

    from megatron_specdec.loading.hf_conversion import load_hf_into_model
    from megatron_specdec.models.provider import build_model

    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(hf, dtype=torch.float32)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    base = build_model(hf)
    load_hf_into_model(base, hf, reference.state_dict())
    return base.eval()


def set_path(base, lean: bool, fused: bool = False, whole: bool = True):
    """The decoding layer (`lean`) or megatron's forward; the decoding layer's C++ ops where
    `fused` and the layer can take them (a batch-1 chain as the one decode_layer op where
    `whole` too), else its PyTorch ops (the cached properties, decided here instead)."""
    for layer in base.decoder.layers:
        layer.__dict__["lean"] = lean
        layer.__dict__["fused"] = type(layer).fused.func(layer) if fused else (False,) * 3
        attention = layer.self_attention
        attention.__dict__["chain_op"] = fused and type(attention).chain_op.func(attention)
        layer.__dict__["layer_op"] = fused and whole and type(layer).layer_op.func(layer)


def logits(base, lean: bool, fused: bool = False, batch: int = 2, whole: bool = True):
    """Logits of a ragged prefill (one row: a prompt), a 5-token chain and three one-token
    steps, through `set_path`'s path."""
    from megatron_specdec.inference.generation import StageRunner, left_pad

    set_path(base, lean, fused, whole)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (11, 7)[:batch]]
    tokens, counts = left_pad(prompts, 0, bucket=4)
    runner = StageRunner(base, batch, 40, 512)
    out = [runner.step(tokens, counts=counts if batch > 1 else None)]
    out.append(runner.step(torch.randint(0, 512, (batch, 5), generator=g)))
    out += [runner.step(torch.randint(0, 512, (batch, 1), generator=g)) for _ in range(3)]
    return torch.cat(out, dim=1)


def compare_worker(tp, pp, family, out):
    distributed.initialize(tp, pp)
    hf = hf_config(family)
    base = base_model(hf)
    lean = [layer.lean for layer in base.decoder.layers]
    got = {"lean": lean, "decode": logits(base, True), "forward": logits(base, False)}
    if torch.distributed.get_rank() == 0:
        torch.save(got, out)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_decoding_layer_equals_megatron_forward_bitwise(family):
    distributed.initialize(1, 1)
    hf = hf_config(family)
    base = base_model(hf)
    if family == "qwen2":
        assert base.decoder.layers[0].self_attention.linear_qkv.bias is not None
    if family == "qwen3":
        assert base.decoder.layers[0].self_attention.q_layernorm is not None
    assert all(layer.lean for layer in base.decoder.layers)
    decode, forward = logits(base, True), logits(base, False)
    assert torch.equal(decode, forward), (decode - forward).abs().max()


def test_decoding_layer_equals_megatron_forward_at_tp2(tmp_path):
    out = tmp_path / "out.pt"
    distributed.spawn(compare_worker, 2, 2, 1, "qwen2", str(out))
    got = torch.load(out)
    assert all(got["lean"])
    assert torch.equal(got["decode"], got["forward"]), \
        (got["decode"] - got["forward"]).abs().max()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("batch", [1, 2])
def test_decoding_layer_with_its_cpp_ops_equals_megatron_forward(family, batch):
    distributed.initialize(1, 1)
    base = base_model(hf_config(family))
    set_path(base, True, True)
    layer = base.decoder.layers[0]
    assert all(layer.fused)
    # Qwen3's q/k norms sit between the QKV product and RoPE: its attention keeps PyTorch's.
    assert layer.self_attention.chain_op == (family != "qwen3")
    decode, forward = logits(base, True, True, batch), logits(base, False, batch=batch)
    torch.testing.assert_close(decode, forward, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_chain_through_the_cpp_ops_equals_one_token_steps_bitwise(family):
    """What makes speculative output equal plain greedy: a verify forward over k+1 tokens
    gives each token bitwise the logits a one-token step at its position gives."""
    from megatron_specdec.inference.generation import StageRunner

    distributed.initialize(1, 1)
    base = base_model(hf_config(family))
    set_path(base, True, True)
    g = torch.Generator().manual_seed(7)
    prompt, chain = torch.randint(0, 512, (1, 9), generator=g), torch.randint(0, 512, (1, 8),
                                                                               generator=g)
    runner = StageRunner(base, 1, 40, 512)
    runner.step(prompt)
    together = runner.step(chain)
    runner.rewind(8)
    apart = torch.cat([runner.step(chain[:, i: i + 1]) for i in range(8)], dim=1)
    assert torch.equal(together, apart), (together - apart).abs().max()


@pytest.mark.parametrize("family,product", [("llama", "skinny"), ("qwen2", "skinny"),
                                             ("llama", "skinny_row"), ("llama", "skinny_burst")])
def test_the_whole_layer_op_equals_its_ops_one_by_one_bitwise(family, product, monkeypatch):
    """decode_layer runs the same kernels in the same order as the per-op path, at either of
    the skinny op's schedules."""
    from megatron_specdec.models.layers import linear_kernels

    monkeypatch.setenv(linear_kernels.PIN_ENV, product)
    linear_kernels.reset()
    distributed.initialize(1, 1)
    base = base_model(hf_config(family))
    try:
        whole = logits(base, True, True, batch=1)
        assert all(layer.layer_op for layer in base.decoder.layers)
        apart = logits(base, True, True, batch=1, whole=False)
    finally:
        linear_kernels.reset()
    assert torch.equal(whole, apart), (whole - apart).abs().max()


def test_a_base_of_bf16_values_streams_its_16_bit_copies_bitwise(monkeypatch):
    """A base trained in bf16 (float32 parameters holding bf16 values) runs the decode_layers
    op over the 16-bit copies of its weights: the logits are bitwise those of its float32
    weights."""
    from megatron_specdec.models import weight_memory

    distributed.initialize(1, 1)
    base = base_model(hf_config("llama"))
    with torch.no_grad():
        for p in base.parameters():
            p.copy_(p.bfloat16().float())
    halves = logits(base, True, True, batch=1)
    assert all(layer.layer_op for layer in base.decoder.layers)

    def products():  # QKV, output, fc1, fc2 as the op takes them
        return [layer.op_weights[0][i] for layer in base.decoder.layers for i in (1, 3, 5, 6)]

    assert all(w.dtype == torch.bfloat16 for w in products())
    monkeypatch.setattr(weight_memory, "narrow_copy", lambda weight: None)
    assert all(w.dtype == torch.float32 for w in products())
    assert torch.equal(halves, logits(base, True, True, batch=1))


def test_moe_layer_keeps_megatron_forward():
    from megatron_specdec.models.provider import build_model
    from moe_models import config

    distributed.initialize(1, 1)
    base = build_model(config("qwen3_moe")).eval()
    assert not any(layer.lean for layer in base.decoder.layers)
    logits(base, False)  # and decodes through it


def test_a_prefill_wider_than_the_small_row_products_equals_megatron_forward():
    """Past MAX_ROWS rows the decoding layer's linears take the modules' own forward."""
    from megatron_specdec.inference.generation import StageRunner
    from megatron_specdec.models.layers.linear_kernels import MAX_ROWS

    distributed.initialize(1, 1)
    base = base_model(hf_config("llama"))
    tokens = torch.randint(0, 512, (1, MAX_ROWS + 20), generator=torch.Generator().manual_seed(2))
    out = {}
    for lean in (True, False):
        set_path(base, lean)
        out[lean] = StageRunner(base, 1, MAX_ROWS + 20, 512).step(tokens)
    assert torch.equal(out[True], out[False]), (out[True] - out[False]).abs().max()


def test_a_hooked_layer_is_called_and_an_unhooked_one_decoded_directly():
    """The stage runner runs a decoding layer's decode itself (skipping megatron's call path)
    unless a hook watches the layer: then the layer is called, the hook sees every step, and
    the logits are the same."""
    distributed.initialize(1, 1)
    base = base_model(hf_config("llama"))
    direct = logits(base, True, True)
    seen = []
    hook = base.decoder.layers[1].register_forward_hook(lambda *_: seen.append(1))
    try:
        with torch.no_grad():
            assert [layer.direct_decode(DecodeCache(1, 8))
                    for layer in base.decoder.layers] == [True, False]
        called = logits(base, True, True)
    finally:
        hook.remove()
    assert len(seen) == 5 and torch.equal(direct, called)


def test_the_decoding_embedding_is_the_module_output_bitwise_and_steps_aside():
    """decode_embedding is the module's output bitwise where it looks the rows up itself, and
    calls the module where the module does more: grad on, training, or a hook watching it."""
    from megatron_specdec.models.layers.decode_embedding import decode_embedding, plain_lookup

    distributed.initialize(1, 1)
    embedding = base_model(hf_config("llama")).embedding.eval()
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = embedding(input_ids=ids, position_ids=None)
        assert plain_lookup(embedding)
        got = decode_embedding(embedding, ids)
        assert got.shape == want.shape and got.is_contiguous() and torch.equal(got, want)
        seen = []
        hook = embedding.register_forward_hook(lambda *_: seen.append(1))
        try:
            assert not plain_lookup(embedding)
            assert torch.equal(decode_embedding(embedding, ids), want) and seen == [1]
        finally:
            hook.remove()
        assert not plain_lookup(embedding.train())
        embedding.eval()
    assert not plain_lookup(embedding)  # grad enabled


def test_one_row_placement_equals_the_general_placement():
    """DecodeCache.place for one row without counts (a decode step, a chain) leaves what the
    general placement leaves: slots, span, end, masks and query ends; replacing the buffers
    drops the operands derived from them (decode_chain's)."""
    from megatron_specdec.models.layers.decode_attention import DecodeCache

    fast, general = DecodeCache(1, 12), DecodeCache(1, 12)
    for s in (3, 1, 4):
        a = fast.place(s, torch.device("cpu"))
        b = general.place(s, torch.device("cpu"), torch.tensor([s]))  # counts: the general path
        general._advance, general._span = s, (int(general.lengths[0]), general._end)
        assert torch.equal(a, b) and torch.equal(fast._slots, general._slots)
        assert torch.equal(fast._rows, general._rows)
        assert (fast._end, fast._span) == (general._end, general._span)
        masks = fast.causal_mask(a), general.causal_mask(b)
        assert (masks == (None, None)) if s == 1 else torch.equal(*masks)
        assert fast.query_ends == general.query_ends == list(range(fast._span[0] + 1,
                                                                   fast._end + 1))
        fast.commit()
        general.commit()
    with pytest.raises(ValueError, match="cannot take"):
        fast.place(5, torch.device("cpu"))
    fast.buffers(1, (1, 1, 2), torch.zeros(1))
    fast.memo["operands"] = "derived from the buffers"
    fast.keep_rows(torch.tensor([0]))  # new buffers: what was derived from the old ones goes
    assert fast.memo == {}
    fast.memo["operands"] = "derived from the buffers"
    fast.swap_key_value_dict([0])
    assert fast.memo == {}


def test_a_run_of_layers_times_its_schedules_on_real_calls_once_per_bucket(monkeypatch, tmp_path):
    """A batch-1 chain's run of layers times its schedule options (the shapes' own, one for
    every product) on its real calls, once per row bucket on a machine: the logits are the
    pinned schedule's bitwise, the choice is stored, and a new process reads it untimed."""
    from megatron_specdec.models.layers import decode_layer, linear_kernels

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setenv(linear_kernels.PIN_ENV, "skinny")
    linear_kernels.reset()
    distributed.initialize(1, 1)
    base = base_model(hf_config("llama"))
    pinned = logits(base, True, True, batch=1)
    monkeypatch.delenv(linear_kernels.PIN_ENV)
    timed = []
    real_choice = decode_layer.run_choice

    def counted(key, rows, options, measure):
        def measured():
            times = measure()
            timed.append((key, rows, set(times)))
            return times
        return real_choice(key, rows, options, measured)

    monkeypatch.setattr(decode_layer, "run_choice", counted)
    try:
        linear_kernels.reset()
        assert torch.equal(logits(base, True, True, batch=1), pinned)
        run = decode_layer.run_key([w for layer in base.decoder.layers
                                    for w in layer.op_weights[0]])
        assert run.startswith("2 x ") and run.endswith(" float32")
        options = {"per_shape", "skinny", "skinny_row", "skinny_burst"}
        assert timed and all(key == run and names == options for key, _, names in timed)
        buckets = sorted(linear_kernels.bucket_of(rows) for _, rows, _ in timed)
        assert len(set(buckets)) == len(buckets)  # once per bucket
        stored = json.loads(linear_kernels.cache_path(linear_kernels.machine()).read_text())
        runs = stored["entries"][f"run {run}"]
        assert sorted(map(int, runs)) == buckets
        assert all(entry["choice"] == min(entry["ms"], key=entry["ms"].get)
                   for entry in runs.values())
        linear_kernels.reset()  # a new process
        count = len(timed)
        assert torch.equal(logits(base, True, True, batch=1), pinned) and len(timed) == count
    finally:
        linear_kernels.reset()


def test_a_stored_run_choice_outside_the_options_is_timed_again(monkeypatch, tmp_path):
    from megatron_specdec.models.layers import linear_kernels

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.delenv(linear_kernels.PIN_ENV, raising=False)
    linear_kernels.reset()
    options = ("per_shape", "skinny")
    try:
        assert linear_kernels.run_choice(
            "k", 3, options, lambda: {"per_shape": 2.0, "skinny": 1.0}) == "skinny"
        linear_kernels.reset()
        path = linear_kernels.cache_path(linear_kernels.machine())
        stored = json.loads(path.read_text())
        stored["entries"]["run k"]["4"]["choice"] = "gone"
        path.write_text(json.dumps(stored))
        assert linear_kernels.run_choice(
            "k", 4, options, lambda: {"per_shape": 1.0, "skinny": 3.0}) == "per_shape"
        monkeypatch.setenv(linear_kernels.PIN_ENV, "skinny_row")
        assert linear_kernels.run_choice(
            "k", 1, options, lambda: pytest.fail("timed while pinned")) is None
    finally:
        linear_kernels.reset()
