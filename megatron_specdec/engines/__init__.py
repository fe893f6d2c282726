"""Serving engines run from the project's env as subprocesses of their own virtual env
(`vllm_client`: the client, `vllm_runner`: the script that runs inside `.venv-vllm`), so no engine's
pinned torch or transformers enters the project's env."""
