"""Run llama.cpp's own converter, `convert_hf_to_gguf.py`, in llama.cpp's environment (scripts/interop-llamacpp.sh).

`python convert.py LLAMA_CPP_DIR ARGS...` runs `LLAMA_CPP_DIR/convert_hf_to_gguf.py ARGS...` unchanged, with
its own gguf-py unless `NO_LOCAL_GGUF` is set (the converter's own rule), and with one addition: the converter
names a BPE tokenizer's pre-tokenizer only by the hash of how a known model tokenizes a fixed text, and
refuses any other tokenizer ("BPE pre-tokenizer was not recognized"); upstream's fix is to add the
tokenizer's hash to the converter. The project's tiny test tokenizer is a byte-level BPE with the GPT-2
split (`ByteLevel`, regex on, no prefix space), which llama.cpp calls `gpt-2`; so where the converter
refuses a tokenizer whose `tokenizer.json` pre-tokenizer is exactly that, this answers `gpt-2`, and
lets every other refusal stand. Nothing else in the converter is touched.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

GPT2_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def _is_plain_byte_level(model_dir: Path) -> bool:
    try:
        pre = json.loads((Path(model_dir) / "tokenizer.json").read_text()).get("pre_tokenizer")
    except (OSError, ValueError):
        return False
    return pre == GPT2_BYTE_LEVEL


def main(llama_cpp: Path, argv: list[str]) -> None:
    converter = llama_cpp / "convert_hf_to_gguf.py"
    sys.path.insert(0, str(llama_cpp))
    if "NO_LOCAL_GGUF" not in os.environ:  # the converter's own rule for its gguf-py
        sys.path.insert(1, str(llama_cpp / "gguf-py"))
    import conversion.base as base

    unrecognized = base.TextModel.get_vocab_base_pre

    def pre_tokenizer(self, tokenizer) -> str:
        try:
            return unrecognized(self, tokenizer)
        except NotImplementedError:
            if _is_plain_byte_level(self.dir_model):
                print(f"convert.py: `{self.dir_model}`: byte-level BPE with the GPT-2 split, named `gpt-2`", file=sys.stderr)
                return "gpt-2"
            raise

    base.TextModel.get_vocab_base_pre = pre_tokenizer
    sys.argv = [str(converter), *argv]
    runpy.run_path(str(converter), run_name="__main__")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
