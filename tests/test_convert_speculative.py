"""checkpoint_tools/convert_speculative.py on the SmolLM2 checkpoint: the speculative checkpoint
loads and trains (draft only), its d2t/t2d agree, and bad inputs fail clearly, writing nothing."""

import json

import pytest
import torch

from checkpoint_tools import convert_speculative
from megatron_specdec import distributed
from megatron_specdec.cli.common import run_cli

CONVERSATIONS = [
    {"id": str(i), "conversations": [
        {"role": "user", "content": q},
        {"role": "assistant", "content": a}]}
    for i, (q, a) in enumerate([
        ("What is 7 times 6?", "7 times 6 is 42. So the answer is 42."),
        ("Name two colors.", "Two colors are blue and red."),
        ("Spell cat backwards.", "Cat backwards is tac."),
    ])
]


def _import_base(out):
    from megatron_specdec.loading.hf_conversion import hf_to_megatron

    hf_to_megatron("default", out, tp=1, pp=1)


@pytest.fixture(scope="module")
def base_ckpt(module_tmp):
    out = module_tmp("smollm2") / "base"
    distributed.spawn(_import_base, 1, str(out))  # a child process: no groups left behind here
    return out


@pytest.fixture
def calibration(tmp_path):
    path = tmp_path / "calib.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in CONVERSATIONS))
    return path


def _cli(argv, capsys):
    code = run_cli(lambda: convert_speculative.main([str(a) for a in argv]))
    return code, capsys.readouterr().err


def _train_worker(ckpt, out_file):
    """Load at TP=1 x PP=1, take two optimizer steps, report what changed."""
    from megatron_specdec.training.schedule import forward_backward, reduce_reports
    from megatron_specdec.export import draft_source
    from megatron_specdec.methods.eagle3 import hf_export as eagle3_hf
    from megatron_specdec.loading.speculative import load_speculative

    distributed.initialize(1, 1)
    model, hf_config, meta = load_speculative(ckpt)
    draft = model.draft
    base_before = {k: v.clone() for k, v in model.base.state_dict().items() if torch.is_tensor(v)}
    draft_before = {k: v.clone() for k, v in draft.named_parameters()}
    optimizer = torch.optim.AdamW(model.trainable_parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, hf_config.vocab_size, (1, 32), generator=g),
             "loss_mask": torch.ones(1, 32)}
    losses = []
    for _ in range(2):
        optimizer.zero_grad()
        losses.append(reduce_reports(forward_backward(model, [batch]))["loss"])
        optimizer.step()
    state_ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    torch.save({
        "meta": meta, "losses": losses, "d2t": draft.d2t.clone(), "t2d": draft.t2d.clone(),
        "aux": model.aux_layer_ids,
        "base_changed": [k for k, v in model.base.state_dict().items()
                         if torch.is_tensor(v) and not torch.equal(v, base_before[k])],
        "draft_changed": [k for k, v in draft.named_parameters() if not torch.equal(v, draft_before[k])],
        "num_draft": len(draft_before),
        "optimizer_holds_base": any(id(p) in state_ids for p in model.base.parameters()),
        "base_requires_grad": any(p.requires_grad for p in model.base.parameters()),
        # what export reads (the checkpoint as saved at PP=2)
        "hf": eagle3_hf.hf_tensors(draft_source.read_draft(ckpt, "eagle3")),
    }, out_file)


@pytest.mark.slow
def test_eagle3_conversion_loads_and_trains(base_ckpt, calibration, tmp_path, capsys):
    out = tmp_path / "eagle3"
    code, err = _cli(["--model", base_ckpt, "--algo", "eagle3", "--out", out,
                      "--draft-vocab-size", 256, "--calibration-data", calibration,
                      "--ttt-steps", 2, "--pp", 2], capsys)
    assert code == 0, err
    result_file = tmp_path / "result.pt"
    distributed.spawn(_train_worker, 1, str(out), str(result_file))
    r = torch.load(result_file, weights_only=False)
    assert r["meta"]["draft"]["algo"] == "eagle3"
    assert r["aux"] == [1, 14, 26]
    d2t, t2d = r["d2t"], r["t2d"]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert d2t.numel() == 256 and t2d.numel() == 49152 and int(t2d.sum()) == 256
    assert bool(t2d[torch.arange(256) + d2t].all())  # t2d[d + d2t[d]] for every draft id
    assert all(torch.isfinite(torch.tensor(r["losses"])))
    assert r["base_changed"] == [] and not r["optimizer_holds_base"] and not r["base_requires_grad"]
    assert len(r["draft_changed"]) == r["num_draft"]
    hf, shapes = r["hf"], {k: tuple(v.shape) for k, v in r["hf"].items()}
    assert shapes["midlayer.self_attn.q_proj.weight"] == (576, 1152)  # q/k/v read 2h
    assert shapes["midlayer.self_attn.k_proj.weight"] == (192, 1152)  # 3 groups, no padding
    assert shapes["fc.weight"] == (576, 1728) and shapes["lm_head.weight"] == (256, 576)
    assert torch.equal(hf["d2t"], d2t) and torch.equal(hf["t2d"], t2d)
    assert not any(k.startswith("embed_tokens") for k in hf)


@pytest.mark.parametrize("argv,message", [
    (["--algo", "eagle4"], "valid: eagle3, medusa"),
    (["--algo", "eagle3", "--aux-layers", "1,14,30"], "aux layer id 30 is out of range"),
    (["--algo", "eagle3", "--draft-vocab-size", 50000], "draft_vocab_size=50000 is out of range"),
    (["--algo", "medusa", "--draft-vocab-size", 100], "unknown medusa config key(s) 'draft_vocab_size'"),
], ids=["unknown_algo", "aux_out_of_range", "draft_vocab_too_big", "key_for_other_algo"])
def test_bad_input_is_refused_and_writes_nothing(base_ckpt, tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    code, err = _cli(["--model", base_ckpt, "--out", out] + argv, capsys)
    assert code == 2 and message in err, err
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_calibration_without_usable_rows(base_ckpt, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "conversations": [{"role": "user", "content": "hi"}]}\nnot json\n')
    out = tmp_path / "out"
    code, err = _cli(["--model", base_ckpt, "--algo", "eagle3", "--out", out,
                      "--draft-vocab-size", 256, "--calibration-data", bad], capsys)
    assert code == 2 and "no usable conversation rows" in err, err
    assert not out.exists()


def test_help_lists_algorithms(capsys):
    with pytest.raises(SystemExit) as e:
        convert_speculative.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "--algo" in text and "eagle3, medusa" in text and "--calibration-data" in text
