"""Deterministic weights from a seed (or a safetensors file), one dict per layer."""
from __future__ import annotations

import json
import math
import os
import struct
import sys
from dataclasses import asdict

import torch

from .config import HybridConfig


def init_weights(cfg: HybridConfig) -> dict:
    """Same seed, same weights, on every machine: drawn on the CPU in float64, then cast."""
    g = torch.Generator().manual_seed(cfg.seed)
    dtype = getattr(torch, cfg.dtype)

    def w(*shape, scale=None):
        fan_in = shape[0]
        t = torch.randn(*shape, generator=g, dtype=torch.float64) * (scale or fan_in ** -0.5)
        return t.to(dtype)

    D, H, KV, hd, sd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.state_dim
    out = {"embed": w(cfg.vocab_size, D, scale=1.0), "norm_f": torch.ones(D, dtype=dtype),
           "head": w(D, cfg.vocab_size), "layers": []}
    for kind in cfg.pattern:
        lw = {"norm1": torch.ones(D, dtype=dtype), "norm2": torch.ones(D, dtype=dtype),
              "w_gate": w(D, cfg.mlp_hidden), "w_up": w(D, cfg.mlp_hidden), "w_down": w(cfg.mlp_hidden, D)}
        if not cfg.specs(kind):
            del lw["norm1"]
        if cfg.attention(kind) is not None:
            lw.update(wq=w(D, H * hd), wk=w(D, KV * hd), wv=w(D, KV * hd), wo=w(H * hd, D))
        if cfg.recurrent(kind) is not None:
            C = H * hd
            lw.update(w_u=w(D, C), w_z=w(D, C), w_k=w(D, H * sd), w_q=w(D, H * sd),
                      w_a=w(D, H), w_b=w(D, H), w_o=w(C, D),
                      conv=w(C, cfg.conv_kernel, scale=cfg.conv_kernel ** -0.5))
        out["layers"].append(lw)
    return out


# -- safetensors, written and read with the standard library and torch ------------------
#
# Layout: an 8-byte little-endian u64 N, N bytes of UTF-8 JSON (padded with trailing
# spaces), then the data buffer. The JSON maps each tensor name to {"dtype", "shape",
# "data_offsets": [begin, end]} (offsets relative to the buffer start), plus an optional
# "__metadata__" of str -> str. Tensor data is little-endian and row-major.

_DTYPES = {name: getattr(torch, attr) for name, attr in (
    ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"),
    ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
    ("I64", "int64"), ("I32", "int32"), ("I16", "int16"), ("I8", "int8"),
    ("U64", "uint64"), ("U32", "uint32"), ("U16", "uint16"), ("U8", "uint8"),
    ("BOOL", "bool")) if hasattr(torch, attr)}
_NAMES = {dt: name for name, dt in _DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024  # as the reference implementation caps it
_TOP = ("embed", "norm_f", "head")
# config fields that change what the weights compute without changing any shape
_CHECKED_FIELDS = ("pattern", "window", "rope_theta", "norm_eps")


def weight_shapes(cfg: HybridConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor's name (as stored in a file) and shape, in init_weights' order."""
    D, H, KV, hd, sd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.state_dim
    out = {"embed": (cfg.vocab_size, D), "norm_f": (D,), "head": (D, cfg.vocab_size)}
    for i, kind in enumerate(cfg.pattern):
        lw = {"norm1": (D,), "norm2": (D,), "w_gate": (D, cfg.mlp_hidden), "w_up": (D, cfg.mlp_hidden),
              "w_down": (cfg.mlp_hidden, D)}
        if not cfg.specs(kind):
            del lw["norm1"]
        if cfg.attention(kind) is not None:
            lw.update(wq=(D, H * hd), wk=(D, KV * hd), wv=(D, KV * hd), wo=(H * hd, D))
        if cfg.recurrent(kind) is not None:
            C = H * hd
            lw.update(w_u=(D, C), w_z=(D, C), w_k=(D, H * sd), w_q=(D, H * sd), w_a=(D, H), w_b=(D, H),
                      w_o=(C, D), conv=(C, cfg.conv_kernel))
        out.update((f"layers.{i}.{k}", s) for k, s in lw.items())
    return out


def _flatten(weights: dict) -> dict[str, torch.Tensor]:
    if not isinstance(weights, dict):
        raise TypeError(f"weights must be a dict as init_weights returns, got {type(weights).__name__}")
    extra = sorted(set(weights) - {*_TOP, "layers"})
    if extra:
        raise ValueError(f"unexpected top-level weight entries: {', '.join(map(str, extra))}")
    flat = {}
    for name in _TOP:
        if name in weights:
            flat[name] = weights[name]
    for i, lw in enumerate(weights.get("layers", [])):
        if not isinstance(lw, dict):
            raise TypeError(f"weights['layers'][{i}] must be a dict, got {type(lw).__name__}")
        for k, t in lw.items():
            flat[f"layers.{i}.{k}"] = t
    for name, t in flat.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weight {name!r} must be a torch.Tensor, got {type(t).__name__}")
    return flat


def _le_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous().reshape(-1)
    raw = t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
    if sys.byteorder == "big" and t.element_size() > 1:
        raw = raw.view(-1, t.element_size()).flip(-1).reshape(-1)
    return raw.numpy().tobytes()


def _check_names(shapes: dict, have, what: str) -> None:
    missing = [n for n in shapes if n not in have]
    unknown = sorted(n for n in have if n not in shapes)
    if missing or unknown:
        parts = [f"missing tensors: {', '.join(missing)}"] if missing else []
        if unknown:
            parts.append(f"unknown tensors: {', '.join(unknown)}")
        raise ValueError(f"{what}: " + "; ".join(parts))


def _config_metadata(cfg: HybridConfig) -> dict[str, str]:
    return {"uniradix.pattern": cfg.pattern, "uniradix.config": json.dumps(asdict(cfg), sort_keys=True, default=repr)}


def save_weights(weights: dict, path, cfg: HybridConfig | None = None, metadata: dict | None = None) -> None:
    """Write `weights` (init_weights' structure) to a safetensors file at `path`.
    Tensors are named "embed", "norm_f", "head" and "layers.{i}.{key}". With `cfg`, its
    pattern and fields go into "__metadata__" (load_weights checks them); `metadata`
    adds str -> str entries of your own."""
    flat = _flatten(weights)
    meta = {"format": "pt"}
    if cfg is not None:  # the metadata must not vouch for weights of another shape
        shapes = weight_shapes(cfg)
        _check_names(shapes, flat, f"weights for pattern {cfg.pattern!r}")
        for name, shape in shapes.items():
            if tuple(flat[name].shape) != shape:
                raise ValueError(f"weight {name!r} has shape {list(flat[name].shape)}, "
                                 f"the config needs {list(shape)}")
        meta.update(_config_metadata(cfg))
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"metadata must map str to str, got {k!r}: {v!r}")
        meta[k] = v
    # the reference writer's order: widest dtype first, then by name (keeps data aligned)
    order = sorted(flat, key=lambda n: (-flat[n].element_size(), n))
    header, chunks, offset = {"__metadata__": meta}, [], 0
    for name in order:
        t = flat[name]
        if t.dtype not in _NAMES:
            raise ValueError(f"weight {name!r}: dtype {t.dtype} has no safetensors name")
        data = _le_bytes(t)
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    head += b" " * (-len(head) % 8)  # pad so the buffer starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for data in chunks:
            f.write(data)


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _read(path) -> tuple[dict, dict, memoryview]:
    """(tensor entries, metadata, data buffer) of a safetensors file, its header checked."""
    where = os.fspath(path)
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ValueError(f"{where}: truncated safetensors file ({len(raw)} bytes, no header size)")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > _MAX_HEADER:
        raise ValueError(f"{where}: bad safetensors header: its size {n} is over the {_MAX_HEADER}-byte limit")
    if 8 + n > len(raw):
        raise ValueError(f"{where}: truncated safetensors file: header of {n} bytes, "
                         f"only {len(raw) - 8} after the size")
    try:
        header = json.loads(raw[8:8 + n].decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{where}: bad safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{where}: bad safetensors header: expected a JSON object, got {type(header).__name__}")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise ValueError(f"{where}: bad safetensors header: __metadata__ must map str to str")
    buf = memoryview(raw)[8 + n:]
    for name, e in header.items():
        bad = f"{where}: bad safetensors header entry for tensor {name!r}"
        if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= set(e):
            raise ValueError(f"{bad}: needs dtype, shape and data_offsets")
        if e["dtype"] not in _DTYPES:
            raise ValueError(f"{bad}: unknown dtype {e['dtype']!r}")
        shape, offs = e["shape"], e["data_offsets"]
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"{bad}: shape must be a list of non-negative ints, got {shape!r}")
        if (not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs)
                or not 0 <= offs[0] <= offs[1]):
            raise ValueError(f"{bad}: data_offsets must be [begin, end] with 0 <= begin <= end, got {offs!r}")
        want = math.prod(shape) * _DTYPES[e["dtype"]].itemsize
        if offs[1] - offs[0] != want:
            raise ValueError(f"{bad}: data_offsets {offs} span {offs[1] - offs[0]} bytes, "
                             f"but {e['dtype']} {shape} needs {want}")
        if offs[1] > len(buf):
            raise ValueError(f"{where}: truncated safetensors file: tensor {name!r} ends at byte {offs[1]} "
                             f"of the data, which has only {len(buf)}")
    return header, meta, buf


def _tensor(e: dict, buf: memoryview) -> torch.Tensor:
    dt, shape = _DTYPES[e["dtype"]], e["shape"]
    a, b = e["data_offsets"]
    if a == b:
        return torch.empty(shape, dtype=dt)
    data = bytearray(buf[a:b])  # its own, aligned copy
    if dt == torch.bool:
        return torch.frombuffer(data, dtype=torch.uint8).ne(0).reshape(shape)
    if sys.byteorder == "big" and dt.itemsize > 1:
        data = bytearray(torch.frombuffer(data, dtype=torch.uint8).view(-1, dt.itemsize).flip(-1).numpy().tobytes())
    return torch.frombuffer(data, dtype=dt).reshape(shape)


def load_weights(cfg: HybridConfig, path, device="cpu") -> dict:
    """Read a safetensors file into init_weights' structure for `cfg`: every tensor
    `cfg` needs must be there with its exact shape and nothing else; each is cast to
    cfg.dtype and moved to `device`. If the file records a config (save_weights with
    cfg=), its pattern, window, rope_theta and norm_eps must match `cfg`'s."""
    where = os.fspath(path)
    header, meta, buf = _read(path)
    if "uniradix.pattern" in meta and meta["uniradix.pattern"] != cfg.pattern:
        raise ValueError(f"{where}: the weights are for layer pattern {meta['uniradix.pattern']!r}, "
                         f"the config's pattern is {cfg.pattern!r}")
    if "uniradix.config" in meta:
        try:
            saved = json.loads(meta["uniradix.config"])
        except ValueError as e:
            raise ValueError(f"{where}: bad uniradix.config metadata: {e}") from None
        if not isinstance(saved, dict):
            raise ValueError(f"{where}: bad uniradix.config metadata: expected a JSON object")
        for field in _CHECKED_FIELDS:
            if field in saved and saved[field] != getattr(cfg, field):
                raise ValueError(f"{where}: the weights were saved with {field}={saved[field]!r}, "
                                 f"the config has {field}={getattr(cfg, field)!r}")
    shapes = weight_shapes(cfg)
    _check_names(shapes, header, f"{where}: the file does not match the config (pattern {cfg.pattern!r})")
    for name, shape in shapes.items():
        got = tuple(header[name]["shape"])
        if got != shape:
            raise ValueError(f"{where}: tensor {name!r} has shape {list(got)}, the config needs {list(shape)}")
        dt = _DTYPES[header[name]["dtype"]]
        if not dt.is_floating_point:
            raise ValueError(f"{where}: tensor {name!r} is {header[name]['dtype']}; weights must be floating point")
    dtype = getattr(torch, cfg.dtype)
    out = {"layers": [{} for _ in cfg.pattern]}
    for name in shapes:
        t = _tensor(header[name], buf).to(device=device, dtype=dtype)
        if name.startswith("layers."):
            _, i, key = name.split(".", 2)
            out["layers"][int(i)][key] = t
        else:
            out[name] = t
    return {"embed": out["embed"], "norm_f": out["norm_f"], "head": out["head"], "layers": out["layers"]}
