"""The vLLM client's handling of its runner process, without vLLM: a stand-in interpreter."""

import pytest

from megatron_specdec.engines import vllm_client


def stand_in(tmp_path, monkeypatch, body: str):
    """SPECDEC_VLLM_PYTHON pointed at a shell script that runs `body` instead of the runner."""
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    monkeypatch.setenv(vllm_client.PYTHON_ENV, str(script))


def test_a_runner_past_its_time_limit_is_killed_with_its_log(tmp_path, monkeypatch):
    stand_in(tmp_path, monkeypatch, "echo engine warming up; exec sleep 60")
    with pytest.raises(vllm_client.EngineRunError,
                       match=r"did not finish in 1 s and was killed(.|\n)*engine warming up"):
        vllm_client.generate(tmp_path, [[1, 2]], 4, {"greedy": None}, timeout=1)


def test_a_failed_runner_raises_with_its_log(tmp_path, monkeypatch):
    stand_in(tmp_path, monkeypatch, "echo no such model >&2; exit 3")
    with pytest.raises(vllm_client.EngineRunError, match=r"exited with 3(.|\n)*no such model"):
        vllm_client.generate(tmp_path, [[1, 2]], 4, {"greedy": None})


def test_the_default_time_limit_grows_with_the_work():
    # Three runs over all 80 MT-bench prompts x 128 tokens took over 30 min on 2 cores.
    assert vllm_client.time_limit(80, 128, 3) > 3 * 80 * 128 / 11
    assert vllm_client.time_limit(160, 128, 3) > vllm_client.time_limit(80, 128, 3)
    assert vllm_client.time_limit(2, 8, 1) <= 600


def test_a_missing_env_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv(vllm_client.PYTHON_ENV, str(tmp_path / "nowhere" / "python"))
    with pytest.raises(vllm_client.EngineUnavailableError, match="nowhere/python does not exist"):
        vllm_client.generate(tmp_path, [[1]], 4, {"greedy": None})
