"""Read a GGUF file with llama.cpp's own gguf-py and hold its tensors against a safetensors export.

`python gguf_read.py LLAMA_CPP_DIR FILE.gguf EXPORT_DIR` (in llama.cpp's environment,
scripts/interop-llamacpp.sh) prints one JSON object:

- `fields`: every metadata key of the file with its value (strings, numbers, lists; the vocabulary's
  token lists are reported by length);
- `tensors`: per tensor of the export, the GGUF name llama.cpp's own tensor map gives it
  (`gguf.get_tensor_name_map(arch, n_blocks)`, on the `model.`-prefixed name the converter maps), its GGUF
  type, and whether its values equal the export's bit for bit (BF16 bytes as stored, or the BF16 values
  widened to F32 where the converter stores F32, which is exact);
- `unmatched`: GGUF tensors no export tensor maps to.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _value(field):
    from gguf import GGUFValueType

    types = field.types
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        items = [field.parts[i] for i in field.data]
        if len(types) > 1 and types[1] == GGUFValueType.STRING:
            return {"strings": len(items)} if len(items) > 32 else [bytes(x).decode() for x in items]
        return {"items": len(items)} if len(items) > 256 else [x.tolist()[0] for x in items]
    part = field.parts[field.data[0]]
    if types[0] == GGUFValueType.STRING:
        text = bytes(part).decode()
        return text if len(text) <= 200 else text[:200] + "..."
    return part.tolist()[0]


def main(llama_cpp: Path, gguf_file: Path, export: Path) -> dict:
    sys.path.insert(0, str(llama_cpp / "gguf-py"))
    import gguf
    import torch
    from safetensors.torch import load_file

    reader = gguf.GGUFReader(str(gguf_file))
    fields = {name: _value(f) for name, f in reader.fields.items()}
    arch = fields["general.architecture"]
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    n_blocks = fields[f"{arch}.block_count"]
    name_map = gguf.get_tensor_name_map(arch_enum, n_blocks)
    in_file = {t.name: t for t in reader.tensors}
    tensors, used = {}, set()
    for key, value in load_file(str(export / "model.safetensors")).items():
        mapped = name_map.get_name("model." + key, try_suffixes=(".weight", ".bias"))
        name = mapped if mapped in in_file else (mapped + ".weight" if mapped and mapped + ".weight" in in_file else None)
        if name is None:
            tensors[key] = {"gguf": mapped, "type": None, "equal": False}
            continue
        used.add(name)
        t = in_file[name]
        kind = t.tensor_type.name
        if kind == "BF16":
            want = value.contiguous().view(torch.uint8).numpy().tobytes()
        elif kind == "F32":
            want = value.float().contiguous().numpy().tobytes()
        else:
            want = None
        tensors[key] = {"gguf": name, "type": kind, "equal": want is not None and t.data.tobytes() == want}
    return {"fields": fields, "tensors": tensors, "unmatched": sorted(set(in_file) - used)}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))))
