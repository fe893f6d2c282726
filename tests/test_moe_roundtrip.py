"""MoE conversion both ways and resharding: a tiny random Qwen3-MoE and Mixtral imported at
EP=2 (each rank reading its experts) export back to HF with every tensor bitwise equal, and
the EP=2 dist checkpoint loads at EP=1 (dist_checkpointing reshards the global expert axis)
with logits identical to the model imported at EP=1. (EP=1 and EP=2 forwards sum the experts'
outputs in another order, so their logits agree to fp32 rounding, not bitwise: the parity
test bounds that against HF.) Bad layouts are refused naming the numbers."""

import pytest
import torch

import moe_models
import workers
from megatron_specdec import distributed
from megatron_specdec.models import families
from megatron_specdec.loading.hf_conversion import hf_to_megatron, megatron_to_hf, read_hf_state

PROMPT = torch.randint(0, 512, (16,), generator=torch.Generator().manual_seed(2)).tolist()


# Mixtral's round trip repeats Qwen3-MoE's at EP 2 (its names: test_moe_parity), so it is slow.
@pytest.mark.parametrize("family", ["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_moe_round_trip_at_ep2_is_bitwise_and_reshards_to_ep1(family, tmp_path):
    hf_dir, ckpt, back = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "back"
    model = moe_models.save_random(family, hf_dir)
    hf_to_megatron(hf_dir, ckpt, ep=2)
    megatron_to_hf(ckpt, back)
    src, dst = read_hf_state(hf_dir), read_hf_state(back)
    assert set(src) == set(dst)
    assert any(".experts.3." in name for name in src)  # per-expert tensors, all four experts
    for name in src:
        assert src[name].dtype == dst[name].dtype and torch.equal(src[name], dst[name]), name

    # The EP=2 checkpoint at EP=1 is the model imported at EP=1 from HF, bit for bit.
    out = tmp_path / "logits.pt"
    distributed.spawn(workers.moe_checkpoint_logits, 1, 1, 1, 1, [str(ckpt), str(hf_dir)],
                      PROMPT, str(out))
    logits = torch.load(out)
    assert torch.equal(logits[str(ckpt)], logits[str(hf_dir)])
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0]
    assert (logits[str(ckpt)] - ref).abs().max().item() <= 1e-4


def test_expert_parallel_not_dividing_experts_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"expert_parallel=3 does not divide the 4 experts"):
        families.transformer_config(moe_models.config("mixtral"), ep=3)
    moe_models.save_random("qwen3_moe", tmp_path / "hf")
    with pytest.raises(ValueError, match=r"expert_parallel=3 does not divide the 4 experts"):
        hf_to_megatron(tmp_path / "hf", tmp_path / "c", ep=3)
    assert not (tmp_path / "c").exists()


def test_hf_to_megatron_cli_takes_ep_and_names_a_bad_one(tmp_path, capsys):
    """The command-line converter passes --ep through: an EP that does not divide the experts
    is one error line naming both numbers, and nothing is written."""
    from checkpoint_tools import hf_to_megatron as tool
    from megatron_specdec.cli.common import run_cli

    moe_models.save_random("mixtral", tmp_path / "hf")
    capsys.readouterr()  # transformers' save progress bar
    code = run_cli(lambda: tool.main(["--model", str(tmp_path / "hf"), "--out", str(tmp_path / "c"),
                                      "--ep", "3"]))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "expert_parallel=3 does not divide the 4 experts" in err[0], err
    assert not (tmp_path / "c").exists()


def test_expert_parallel_on_a_dense_family_is_refused():
    from transformers import Qwen3Config

    with pytest.raises(ValueError, match=r"expert_parallel=2 given for the dense family qwen3"):
        families.transformer_config(Qwen3Config(num_hidden_layers=2), ep=2)


@pytest.mark.parametrize("fields,message", [
    (dict(mlp_only_layers=[0]), r"mlp_only_layers=\[0\].*only models whose every layer is MoE"),
    (dict(num_experts_per_tok=1), r"num_experts_per_tok=1 with renormalised top-k"),
])
def test_unsupported_moe_layouts_are_refused(fields, message):
    with pytest.raises(families.UnsupportedModelError, match=message):
        families.transformer_config(moe_models.config("qwen3_moe", **fields))


def test_unsupported_family_names_the_supported_list():
    from transformers import GptOssConfig

    with pytest.raises(families.UnsupportedModelError,
                       match=r"'GptOssForCausalLM'.*supported: .*MixtralForCausalLM.*"
                             r"Qwen3MoeForCausalLM"):
        families.family_of(GptOssConfig(architectures=["GptOssForCausalLM"]))
