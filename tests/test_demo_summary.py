"""`make demo`'s closing table: one line a draft, and the stock transformers comparison only
where the step timed it."""

from megatron_specdec.cli.demo import summary_table


def _report(**extra):
    return {"num_prompts": 8, "max_new_tokens": 128,
            "overall": {"acceptance_length": 1.74, "mean_drafted": 1.45},
            "speculative_tokens_per_s": 59.4, "greedy_tokens_per_s": 52.3, "speedup": 59.4 / 52.3,
            "identical_to_greedy": "8/8", **extra}


def test_the_transformers_line_shows_only_where_it_was_timed():
    timed = _report(transformers_tokens_per_s=14.8, speedup_vs_transformers=59.4 / 14.8,
                    identical_to_transformers="7/8")
    table = summary_table([("small draft", _report()), ("shipped draft", timed)])
    lines = table.splitlines()
    assert lines[2].split()[-2:] == ["1.14x", "8/8"] and lines[3].startswith("shipped draft")
    assert "small draft against" not in table
    assert ("shipped draft against stock transformers generate (greedy, batch 1, 14.8 tokens/s"
            in table)
    assert ("speculative 4.01x, plain greedy 3.53x; transformers gave the same tokens on 7/8"
            in table)
