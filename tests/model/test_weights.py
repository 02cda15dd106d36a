"""Weights saved to and loaded from safetensors (written with the standard library and
torch alone): bit-exact round trips, the same logits, a file checked against the
config, and a hand-written file in the standard layout read as the spec says."""
import json
import struct
from itertools import pairwise

import pytest
import torch

from uniradix.model import PRESETS, init_weights, load_weights, preset, reference_forward, save_weights
from uniradix.model.weights import weight_shapes


def tokens(n, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def flat(w):
    out = {"embed": w["embed"], "norm_f": w["norm_f"], "head": w["head"]}
    for i, lw in enumerate(w["layers"]):
        out.update((f"layers.{i}.{k}", t) for k, t in lw.items())
    return out


def write_raw(path, header: dict, data: bytes, pad: int = 0):
    """A safetensors file laid out by hand: u64 LE header size, JSON, spaces, data."""
    head = json.dumps(header).encode() + b" " * pad
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)


def read_header(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def assert_bit_equal(a: dict, b: dict):
    fa, fb = flat(a), flat(b)
    assert list(fa) == list(fb)
    for k in fa:
        assert fa[k].dtype == fb[k].dtype and fa[k].shape == fb[k].shape, k
        assert torch.equal(fa[k].view(torch.uint8) if fa[k].dim() else fa[k],
                           fb[k].view(torch.uint8) if fb[k].dim() else fb[k]), k


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["tiny-hybrid", "jamba-like"])
def test_round_trip_is_bit_exact(tmp_path, name, dtype):
    cfg = preset(name).with_(dtype=dtype)
    w = init_weights(cfg)
    path = tmp_path / "w.safetensors"
    save_weights(w, path, cfg=cfg)
    back = load_weights(cfg, path)
    assert_bit_equal(back, w)
    assert back["embed"].dtype == getattr(torch, dtype)
    # the file's header says what the spec says
    header, data = read_header(path)
    assert header["__metadata__"]["uniradix.pattern"] == cfg.pattern
    assert header["embed"] == {"dtype": "F32" if dtype == "float32" else "BF16",
                               "shape": [cfg.vocab_size, cfg.d_model],
                               "data_offsets": header["embed"]["data_offsets"]}
    assert max(e["data_offsets"][1] for k, e in header.items() if k != "__metadata__") == len(data)


def test_a_loaded_file_gives_the_same_logits(tmp_path):
    cfg = preset("tiny-hybrid")
    w = init_weights(cfg)
    save_weights(w, tmp_path / "w.safetensors", cfg=cfg)
    ids = tokens(20)
    a = reference_forward(cfg, w, ids)
    b = reference_forward(cfg, load_weights(cfg, tmp_path / "w.safetensors"), ids)
    assert torch.equal(a, b)


def test_loading_casts_to_the_config_dtype(tmp_path):
    cfg = preset("tiny-hybrid")
    w = init_weights(cfg)
    save_weights(w, tmp_path / "w.safetensors")  # no cfg: no config metadata, still loadable
    half = load_weights(cfg.with_(dtype="bfloat16"), tmp_path / "w.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in flat(half).values())
    assert torch.equal(half["head"], w["head"].to(torch.bfloat16))
    # and back up: bf16 on disk, fp32 in memory
    save_weights(half, tmp_path / "h.safetensors")
    up = load_weights(cfg, tmp_path / "h.safetensors")
    assert up["head"].dtype == torch.float32 and torch.equal(up["head"], half["head"].float())


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_expected_shapes_match_init_weights(name):
    cfg = preset(name)
    got = {k: tuple(t.shape) for k, t in flat(init_weights(cfg)).items()}
    assert got == weight_shapes(cfg)


def rewrite(path, out, edit):
    """Copy a file through a header edit, re-laying the data so offsets stay valid."""
    header, data = read_header(path)
    meta = header.pop("__metadata__", None)
    tensors = {k: (e, data[e["data_offsets"][0]:e["data_offsets"][1]]) for k, e in header.items()}
    tensors = edit(tensors)
    new, buf = ({"__metadata__": meta} if meta is not None else {}), b""
    for k, (e, raw) in tensors.items():
        new[k] = dict(e, data_offsets=[len(buf), len(buf) + len(raw)])
        buf += raw
    write_raw(out, new, buf)


@pytest.fixture
def saved(tmp_path):
    cfg = preset("tiny-hybrid")
    path = tmp_path / "w.safetensors"
    save_weights(init_weights(cfg), path, cfg=cfg)
    return cfg, path


def test_missing_tensor_is_named(saved, tmp_path):
    cfg, path = saved
    rewrite(path, tmp_path / "x", lambda t: {k: v for k, v in t.items() if k != "layers.2.w_a"})
    with pytest.raises(ValueError, match=r"missing tensors: layers\.2\.w_a"):
        load_weights(cfg, tmp_path / "x")


def test_unknown_tensors_are_listed(saved, tmp_path):
    cfg, path = saved

    def add(t):
        t = dict(t)
        t["layers.9.wq"] = t["layers.0.wq"]
        t["extra"] = t["norm_f"]
        return t
    rewrite(path, tmp_path / "x", add)
    with pytest.raises(ValueError, match=r"unknown tensors: extra, layers\.9\.wq"):
        load_weights(cfg, tmp_path / "x")


def test_wrong_shape_is_named(saved, tmp_path):
    cfg, path = saved
    # a config of another width: every shape differs, the first is named
    with pytest.raises(ValueError, match=r"'embed' has shape \[256, 64\], the config needs \[256, 32\]"):
        load_weights(cfg.with_(d_model=32), path)
    # one tensor stored transposed (same bytes, same count)
    cfg2 = cfg.with_(n_heads=2, head_dim=16)  # wq is [64, 32]
    save_weights(init_weights(cfg2), tmp_path / "y", cfg=cfg2)

    def transpose(t):
        t = dict(t)
        e, raw = t["layers.0.wq"]
        t["layers.0.wq"] = (dict(e, shape=e["shape"][::-1]), raw)
        return t
    rewrite(tmp_path / "y", tmp_path / "x", transpose)
    with pytest.raises(ValueError, match=r"'layers\.0\.wq' has shape \[32, 64\], the config needs \[64, 32\]"):
        load_weights(cfg2, tmp_path / "x")


def test_a_structurally_different_model_is_refused(tmp_path):
    cfg = preset("tiny-hybrid")
    save_weights(init_weights(cfg), tmp_path / "w")  # no metadata: the tensor names decide
    with pytest.raises(ValueError, match=r"missing tensors: layers\.2\.wq.*; unknown tensors: layers\.2\.conv"):
        load_weights(cfg.with_(pattern="FSFF"), tmp_path / "w")
    with pytest.raises(ValueError, match=r"unknown tensors: layers\.3\."):  # a layer too many
        load_weights(cfg.with_(pattern="FSM"), tmp_path / "w")
    with pytest.raises(ValueError, match=r"missing tensors: layers\.4\."):  # a layer too few
        load_weights(cfg.with_(pattern="FSMFF"), tmp_path / "w")


def test_wrong_pattern_is_refused_even_when_shapes_agree(saved):
    cfg, path = saved
    # F and S layers have the same tensors: only the recorded pattern tells them apart
    assert weight_shapes(cfg.with_(pattern="SFMS")) == weight_shapes(cfg)
    with pytest.raises(ValueError, match=r"pattern 'FSMF', the config's pattern is 'SFMS'"):
        load_weights(cfg.with_(pattern="SFMS"), path)


def test_other_computing_fields_are_checked_too(saved):
    cfg, path = saved
    with pytest.raises(ValueError, match="window=16"):
        load_weights(cfg.with_(window=8), path)
    load_weights(cfg.with_(seed=5), path)  # the seed is irrelevant to a loaded file


def test_save_refuses_weights_that_do_not_fit_the_config(tmp_path):
    cfg = preset("tiny-hybrid")
    with pytest.raises(ValueError, match="missing tensors"):
        save_weights(init_weights(cfg.with_(pattern="FSF")), tmp_path / "w", cfg=cfg)


def test_truncated_file(saved, tmp_path):
    cfg, path = saved
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    for cut, what in ((len(raw) - 1, "truncated"), (8 + n + 10, "truncated"), (8 + n // 2, "truncated"),
                      (5, "truncated"), (0, "truncated")):
        (tmp_path / "t").write_bytes(raw[:cut])
        with pytest.raises(ValueError, match=what):
            load_weights(cfg, tmp_path / "t")
    # the message names the tensor that runs off the end
    (tmp_path / "t").write_bytes(raw[:-1])
    header, _ = read_header(path)
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    with pytest.raises(ValueError, match=f"tensor '{last}'"):
        load_weights(cfg, tmp_path / "t")


@pytest.mark.parametrize("head", [
    b"not json at all!",
    b"[1, 2, 3]",
    b'{"embed": {"dtype": "F32"}}',
    b'{"embed": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 4]}}',
    b'{"embed": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}',
    b'{"embed": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}',
    b'{"embed": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}',
    b'{"__metadata__": {"k": 1}}',
    b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {}}',
    b"\xff\xfe{}",
])
def test_garbage_header(tmp_path, head):
    cfg = preset("tiny-hybrid")
    (tmp_path / "g").write_bytes(struct.pack("<Q", len(head)) + head + b"\0" * 16)
    with pytest.raises(ValueError, match="bad safetensors header"):
        load_weights(cfg, tmp_path / "g")


def test_absurd_header_size(tmp_path):
    (tmp_path / "g").write_bytes(struct.pack("<Q", 2 ** 62) + b"{}")
    with pytest.raises(ValueError, match="bad safetensors header"):
        load_weights(preset("tiny-hybrid"), tmp_path / "g")


def test_non_float_weights_are_refused(saved, tmp_path):
    cfg, path = saved

    def to_int(t):
        t = dict(t)
        e, raw = t["norm_f"]
        t["norm_f"] = (dict(e, dtype="I32"), raw)
        return t
    rewrite(path, tmp_path / "x", to_int)
    with pytest.raises(ValueError, match="'norm_f' is I32"):
        load_weights(cfg, tmp_path / "x")


def test_reads_a_hand_written_file_in_the_standard_layout(tmp_path):
    """A one-layer recurrent model of the smallest sizes, laid out by hand from the spec:
    tensors in reverse order, mixed F16 / BF16 / F64 data, a header padded with spaces
    and metadata of someone else's."""
    cfg = preset("tiny-hybrid").with_(pattern="M", vocab_size=2, d_model=2, n_heads=1, n_kv_heads=1,
                                      head_dim=2, state_dim=1, conv_kernel=1, mlp_hidden=1)
    shapes = weight_shapes(cfg)
    header, data, values = {"__metadata__": {"format": "pt", "origin": "by hand"}}, b"", {}
    for i, name in enumerate(reversed(list(shapes))):
        shape = shapes[name]
        n = 1
        for d in shape:
            n *= d
        vals = [0.5 * (i + 1) + 0.25 * j for j in range(n)]  # exact in fp16 and bf16
        if i % 3 == 0:
            raw, dt = struct.pack(f"<{n}e", *vals), "F16"
        elif i % 3 == 1:  # bf16: the high half of the fp32 bits
            raw, dt = b"".join(struct.pack("<f", v)[2:] for v in vals), "BF16"
        else:
            raw, dt = struct.pack(f"<{n}d", *vals), "F64"
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
        values[name] = torch.tensor(vals, dtype=torch.float64).reshape(shape)
    write_raw(tmp_path / "hand.safetensors", header, data, pad=13)
    w = load_weights(cfg, tmp_path / "hand.safetensors")
    got = flat(w)
    assert list(got) == list(shapes)
    for name, t in got.items():
        assert t.dtype == torch.float32
        assert torch.equal(t, values[name].float()), name
    assert torch.isfinite(reference_forward(cfg, w, [0, 1, 1])).all()


def test_our_file_follows_the_layout(saved):
    """What we write a plain reader reads: header size, padded JSON, offsets that tile
    the buffer in order, little-endian fp32 data."""
    cfg, path = saved
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0 and raw[8:9] == b"{"
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    assert header["__metadata__"]["format"] == "pt"
    spans = sorted(e["data_offsets"] for k, e in header.items() if k != "__metadata__")
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in pairwise(spans))
    assert spans[-1][1] == len(raw) - 8 - n
    a, _ = header["norm_f"]["data_offsets"]
    assert struct.unpack("<f", raw[8 + n + a:8 + n + a + 4])[0] == 1.0
    w = init_weights(cfg)
    a, _ = header["layers.0.wq"]["data_offsets"]
    assert struct.unpack("<f", raw[8 + n + a:8 + n + a + 4])[0] == w["layers"][0]["wq"][0, 0].item()
