"""Generation backend for an OpenAI-compatible server (vLLM, SGLang), using only the stdlib.

`endpoint="completions"` sends the chat-templated prompt token ids (one batched request), so
the prompt is exactly what training tokenizes; `endpoint="chat"` sends the messages and lets
the server apply its own chat template (one request per prompt, sent concurrently).
Returned text is tokenized back to ids; a `finish_reason` of "stop" appends the eos id.
"""

import json
import logging
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

log = logging.getLogger(__name__)

ENDPOINTS = ("completions", "chat")
# Overload and transient server errors are worth retrying; other HTTP errors are the request's fault.
RETRY_STATUS = {408, 429, 500, 502, 503, 504}


class BackendError(RuntimeError):
    """The generation server failed or answered something unusable."""


class OpenAIBackend:
    def __init__(
        self,
        url: str,
        model: str,
        tokenizer,
        endpoint: str = "completions",
        timeout: float = 600.0,
        max_retries: int = 5,
        retry_delay: float = 2.0,
        api_key: Optional[str] = None,
    ):
        if endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {endpoint!r}")
        base = url.rstrip("/").removesuffix("/v1")  # accept the server root or its /v1 base
        self.url = base + (
            "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
        )
        self.model = model
        self.tokenizer = tokenizer
        self.endpoint = endpoint
        self.timeout = timeout
        self.max_retries = max_retries
        self.retry_delay = retry_delay
        self.api_key = api_key

    def generate(self, prompts: list, max_new_tokens: int, messages: Optional[list] = None) -> list:
        common = {"model": self.model, "max_tokens": max_new_tokens, "temperature": 0.0}
        if self.endpoint == "completions":
            return self._complete({**common, "prompt": prompts}, len(prompts))
        if messages is None:
            raise BackendError("the chat endpoint needs the prompts as messages")
        with ThreadPoolExecutor(max_workers=max(1, len(messages))) as pool:
            replies = list(
                pool.map(lambda m: self._post({**common, "messages": m})["choices"][0], messages)
            )
        return [self._ids((c.get("message") or {}).get("content"), c) for c in replies]

    def sample(self, prompts: list, max_new_tokens: int, temperature: float, top_p: float,
               seed: int) -> list:
        """Sampled continuations of raw token-id prompts (completions endpoint only)."""
        if self.endpoint != "completions":
            raise BackendError("sampling from raw token-id prefixes needs --endpoint completions")
        body = {"model": self.model, "max_tokens": max_new_tokens, "temperature": temperature,
                "top_p": top_p, "seed": seed, "prompt": prompts}
        return self._complete(body, len(prompts))

    def _complete(self, body: dict, n: int) -> list:
        choices = self._post(body)["choices"]
        if len(choices) != n:
            raise BackendError(f"{self.url}: {len(choices)} choices for {n} prompts")
        choices = sorted(choices, key=lambda c: c.get("index", 0))
        return [self._ids(c.get("text"), c) for c in choices]

    def _ids(self, text, choice) -> list:
        if not isinstance(text, str):
            raise BackendError(f"{self.url}: reply without text: {json.dumps(choice)[:300]}")
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if choice.get("finish_reason") == "stop":
            ids.append(self.tokenizer.eos_token_id)
        return ids

    def _post(self, body: dict) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode("utf-8")
        for attempt in range(1, self.max_retries + 2):
            request = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as e:
                detail = e.read().decode("utf-8", "replace")[:500]
                if e.code not in RETRY_STATUS:
                    raise BackendError(f"{self.url} answered HTTP {e.code}: {detail}") from None
                error = f"HTTP {e.code}: {detail}"
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                error = str(getattr(e, "reason", e))
            except json.JSONDecodeError as e:
                raise BackendError(f"{self.url} answered invalid JSON: {e}") from None
            if attempt <= self.max_retries:
                delay = self.retry_delay * 2 ** (attempt - 1)
                log.warning(
                    "%s failed (%s); retry %d/%d in %.1f s",
                    self.url,
                    error,
                    attempt,
                    self.max_retries,
                    delay,
                )
                time.sleep(delay)
        raise BackendError(f"{self.url} failed after {self.max_retries + 1} attempts: {error}")
