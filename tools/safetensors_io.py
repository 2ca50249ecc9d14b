"""The minimal safetensors reader and writer that moh-case/1 golden cases use.

write_safetensors writes F32 and BOOL tensors with str -> str metadata; read_safetensors reads
F32, F64 and BOOL tensors back. Both raise CaseError, naming what was expected and what was
given, on anything they cannot write or read. Used by exporters.py and export_torch.py.

Only the standard library and torch are used (no safetensors, no numpy).
"""

import json
import math
import os
import struct
import sys
from array import array

import torch

__all__ = ["CaseError", "write_safetensors", "read_safetensors"]


class CaseError(ValueError):
    """A case that cannot be exported or read: names what was expected and what was given."""


# --- safetensors, the minimal subset the format uses -----------------------------------------------

_DTYPES = {"F32": (torch.float32, 4, "f"), "F64": (torch.float64, 8, "d"), "BOOL": (torch.bool, 1, None)}


def _tensor_bytes(t):
    """(dtype name, little-endian row-major bytes) of t: bool -> BOOL, anything else -> F32."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bool:
        return "BOOL", bytes(int(v) for v in t.flatten().tolist())
    if not (t.is_floating_point() or t.dtype in (torch.int32, torch.int64)):
        raise CaseError(f"tensor dtype: expected a float or bool tensor, got {t.dtype}")
    values = array("f", t.to(torch.float32).flatten().tolist())
    if sys.byteorder == "big":
        values.byteswap()
    return "F32", values.tobytes()


def write_safetensors(path, tensors, metadata):
    """Writes {name: tensor} (F32 or BOOL, sorted by name) and {str: str} metadata to path.

    The JSON header is padded with spaces to a multiple of 8 bytes; the file is written to a
    temporary name first and renamed, so a failed export never leaves a half-written case.
    """
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        dtype, data = _tensor_bytes(tensors[name])
        header[name] = {"dtype": dtype, "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise CaseError(f"metadata: expected str -> str, got {key!r} -> {value!r}")
    header["__metadata__"] = dict(metadata)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)
    os.replace(tmp, path)


def read_safetensors(path):
    """({name: tensor}, {metadata}) of a safetensors file with F32, F64 and BOOL tensors."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise CaseError(f"{path}: expected at least 8 bytes (header length), got {len(data)}")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise CaseError(f"{path}: header length {n} runs past the end of the file ({len(data)} bytes)")
    try:
        header = json.loads(data[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CaseError(f"{path}: header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise CaseError(f"{path}: header: expected a JSON object, got {type(header).__name__}")
    metadata = header.pop("__metadata__", {}) or {}
    body = data[8 + n:]
    tensors = {}
    for name, entry in header.items():
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        if dtype not in _DTYPES:
            raise CaseError(f"{path}: tensor '{name}': dtype: expected one of {sorted(_DTYPES)}, "
                            f"got {dtype!r}")
        torch_dtype, size, code = _DTYPES[dtype]
        try:
            shape = [int(s) for s in entry["shape"]]
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CaseError(f"{path}: tensor '{name}': expected integer 'shape' and two "
                            f"'data_offsets', got {entry}") from None
        count = math.prod(shape)
        if not 0 <= begin <= end <= len(body) or end - begin != count * size:
            raise CaseError(f"{path}: tensor '{name}': data_offsets [{begin}, {end}] do not hold "
                            f"{count} x {dtype} within {len(body)} data bytes")
        raw = body[begin:end]
        if code is None:
            values = torch.tensor(list(raw), dtype=torch.uint8).to(torch.bool)
        else:
            arr = array(code)
            arr.frombytes(raw)
            if sys.byteorder == "big":
                arr.byteswap()
            values = torch.tensor(arr.tolist(), dtype=torch_dtype)
        tensors[name] = values.reshape(shape)
    return tensors, {str(k): str(v) for k, v in metadata.items()}
