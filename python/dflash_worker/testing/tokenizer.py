"""A tiny real tokenizer with a Qwen3-style chat template, for tests, benchmarks and the demo.

The tokenizer is a byte-level BPE trained with `tokenizers` on a few hundred
generated lines of text (deterministic for a given seed), wrapped as a
`transformers.PreTrainedTokenizerFast` with the control tokens a Qwen3 chat
model uses: ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos),
``<think>`` and ``</think>``.

`QWEN3_STYLE_CHAT_TEMPLATE` behaves like Qwen3's own template where it matters
for training: turns are ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; an
assistant turn after the last user message renders a think block
``<think>\\n{reasoning}\\n</think>\\n\\n{content}`` (empty when there is no
reasoning); earlier assistant turns drop their reasoning; the generation prompt
is ``<|im_start|>assistant\\n`` followed, when ``enable_thinking=False``, by an
empty think block.

Byte-level BPE means any Unicode text tokenizes, so hostile input can be tested.
Later stages (demo, benchmarks) call `save_tiny_target_with_tokenizer` to get a
target checkpoint directory that `AutoTokenizer.from_pretrained` and the
streaming loader both accept.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_START = "<think>"
THINK_END = "</think>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END, THINK_START, THINK_END)
# Qwen tokenizers also hold the tool markers as single (non-special) added tokens; opt-in here
# (`build_tiny_tokenizer(tool_tokens=True)`) so every existing vocab and id stays as it was.
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

QWEN3_STYLE_CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set reasoning = m.reasoning_content if (m.reasoning_content is defined and m.reasoning_content is not none) else '' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + m.content.lstrip('\\n') }}"
    "{%- else %}"
    "{{- m.content }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

# Qwen3.5's template differs where generation starts: with thinking on, the generation
# prompt opens the think block (``<|im_start|>assistant\n<think>\n``); off, it is the
# empty think block as in Qwen3. Completed turns render the same.
QWEN3_5_STYLE_CHAT_TEMPLATE = QWEN3_STYLE_CHAT_TEMPLATE.replace(
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}",
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}",
)
assert QWEN3_5_STYLE_CHAT_TEMPLATE != QWEN3_STYLE_CHAT_TEMPLATE


def chat_template_for(family: str) -> str:
    """The tiny tokenizer's chat template for a target family (Qwen3.5 families: the Qwen3.5 style)."""
    return QWEN3_5_STYLE_CHAT_TEMPLATE if family.startswith("qwen3_5") else QWEN3_STYLE_CHAT_TEMPLATE


_WORDS = (
    "the a an draft target model token block anchor verify accept reject cache feature layer hidden "
    "state train data prompt response reason think answer question because therefore first second "
    "then next finally small large fast slow river mountain city garden window paper number seven "
    "three eleven twenty compute memory shard write read check error value true false open close "
    "speculative decoding learns predicts matches teacher student sample greedy temperature seed"
).split()


def corpus_lines(n: int = 400, *, seed: int = 0) -> list[str]:
    """`n` deterministic pseudo-sentences (plus punctuation, digits and some non-ASCII) for BPE training."""
    rng = random.Random(seed)
    extras = ["é", "ß", "中文", "🙂", "…", "—", "(", ")", ",", ".", "?", ":", "'", '"', "\t", "  "]
    lines = []
    for _ in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), rng.choice(extras))
        if rng.random() < 0.2:
            words.append(str(rng.randint(0, 999)))
        line = " ".join(words)
        lines.append(line[0].upper() + line[1:] + rng.choice([".", "?", "!", ""]))
    return lines


def build_tiny_tokenizer(*, vocab_size: int = 384, seed: int = 0, lines: int = 400, tool_tokens: bool = False):
    """Train a byte-level BPE on `corpus_lines` and wrap it with the Qwen3-style template.

    The returned tokenizer has `len(tokenizer) == vocab_size` at most (BPE may stop early when
    the corpus runs out of merges); size a model's embedding with `len(tokenizer)`.
    `tool_tokens` appends `TOOL_TOKENS` as added tokens after the trained vocab (ids above it).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(lines, seed=seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        extra_special_tokens=[IM_START, THINK_START, THINK_END],
        model_max_length=1 << 20,
    )
    fast.chat_template = QWEN3_STYLE_CHAT_TEMPLATE
    if tool_tokens:
        fast.add_tokens(list(TOOL_TOKENS))
    return fast


def save_tiny_tokenizer(target_dir: str | Path, tokenizer: Any = None):
    """Save the tiny tokenizer (built if not given) into a target checkpoint dir; returns it."""
    tokenizer = tokenizer if tokenizer is not None else build_tiny_tokenizer()
    Path(target_dir).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(target_dir))
    return tokenizer


def save_tiny_target_with_tokenizer(
    path: str | Path, *, family: str = "qwen3", tokenizer: Any = None, **kwargs: Any
):
    """A tiny target whose vocab covers the tiny tokenizer, saved with that tokenizer.

    Returns `(model, tokenizer)`. Extra keyword arguments go to `save_tiny_target`.
    """
    from .tiny import save_tiny_target

    if tokenizer is None:
        tokenizer = build_tiny_tokenizer()
        tokenizer.chat_template = chat_template_for(family)
    kw: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        bos_token_id=None,
    )
    kw.update(kwargs)
    model = save_tiny_target(path, family=family, **kw)
    save_tiny_tokenizer(path, tokenizer)
    return model, tokenizer
