"""A real GGUF model cut to its first layers: a reduced pair in the file's own quant types.

CI has no room to compile the Qwen 1.5B pair, but the real-model path (GGUF quant types,
the qwen2 architecture with its attention biases, the real tokenizer and prompts) is what the
formats and calibration phases must be exercised on; the first layers of the real 0.5B model,
with its embeddings, final norm and head, make a Qwen-shaped model of any depth that still
speaks (poorly) and that shares the draft's tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import gguf

_SKIP = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}  # the writer sets these


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blk" else None


def _copy_fields(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, layers: int, suffix: str) -> None:
    arch = reader.fields["general.architecture"].contents()
    for key, field in reader.fields.items():
        if key in _SKIP or key == "general.architecture":  # the writer's constructor wrote it
            continue
        value = field.contents()
        if key == f"{arch}.block_count":
            value = layers
        elif key == "general.name":
            value = f"{value} {suffix}"
        kind = field.types[0]
        sub = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, kind, sub_type=sub)


def cut_gguf(source: Path, destination: Path, layers: int) -> Path:
    """destination: source's metadata and tensors but only blocks 0..layers-1 (raw bytes
    copied, so each tensor keeps its quant type)."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    total = reader.fields[f"{arch}.block_count"].contents()
    if not 1 <= layers <= total:
        raise ValueError(f"{source} has {total} layers; cannot keep {layers}")
    writer = gguf.GGUFWriter(destination, arch)
    _copy_fields(reader, writer, layers, f"(first {layers} of {total} layers)")
    for tensor in reader.tensors:
        layer = _layer_of(tensor.name)
        if layer is not None and layer >= layers:
            continue
        # tensor.data is the stored bytes ([rows, bytes per row] when quantized), which the
        # writer turns back into the logical shape from the quant type
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return destination
