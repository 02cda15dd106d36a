"""A checkpoint directory whose files cannot be read is refused at load with the file
named, a ValueError that `uniradix run` and `uniradix serve` turn into one line and
exit 2: a shard the index names that is missing, cut short or not safetensors, an
index without its weight_map, a config.json that is not JSON or not an object, a
`text_config` that is not an object. Before, half of these were tracebacks (KeyError,
SafetensorError, AttributeError) and the JSON errors did not say which file."""
import json
import os
import shutil

import pytest
from harness import make_tiny

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The tiny Qwen3 in three shards with their index."""
    from safetensors.torch import load_file, save_file
    path = make_tiny("qwen3", str(tmp_path_factory.mktemp("sharded") / "ckpt"))
    tensors = load_file(f"{path}/model.safetensors")
    os.remove(f"{path}/model.safetensors")
    names, weight_map = sorted(tensors), {}
    for i in range(3):
        shard = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({n: tensors[n] for n in names[i::3]}, f"{path}/{shard}", metadata={"format": "pt"})
        weight_map.update({n: shard for n in names[i::3]})
    with open(f"{path}/model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return path


SHARD = "model-00002-of-00003.safetensors"


def cut_short(p):
    with open(f"{p}/{SHARD}", "rb") as f:
        data = f.read()
    with open(f"{p}/{SHARD}", "wb") as f:
        f.write(data[:len(data) // 2])


def write(name, text):
    def put(p):
        with open(f"{p}/{name}", "w") as f:
            f.write(text)
    return put


def text_config(value):
    def put(p):
        with open(f"{p}/config.json") as f:
            config = json.load(f)
        with open(f"{p}/config.json", "w") as f:
            json.dump({**config, "text_config": value}, f)
    return put


BROKEN = {
    "a missing shard": (lambda p: os.remove(f"{p}/{SHARD}"), SHARD),
    "a shard cut short": (cut_short, SHARD),
    "a shard that is not safetensors": (write(SHARD, "not safetensors"), SHARD),
    "an index without weight_map": (write("model.safetensors.index.json", "{}"), "model.safetensors.index.json"),
    "an index that is not JSON": (write("model.safetensors.index.json", "{oops"), "model.safetensors.index.json"),
    "config.json not JSON": (write("config.json", "{oops"), "config.json"),
    "config.json a list": (write("config.json", "[]"), "config.json"),
    "text_config not an object": (text_config("gemma3_text"), "text_config"),
}


@pytest.mark.parametrize("why", list(BROKEN))
def test_an_unreadable_checkpoint_is_refused_naming_the_file(sharded, tmp_path, why):
    from uniradix.model.hf import load_checkpoint
    path = str(tmp_path / "ckpt")
    shutil.copytree(sharded, path)
    breakit, named = BROKEN[why]
    breakit(path)
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        load_checkpoint(path)


def test_uniradix_run_says_it_in_one_line(sharded, tmp_path, capsys):
    from uniradix.cli import main
    path = str(tmp_path / "ckpt")
    shutil.copytree(sharded, path)
    write(SHARD, "not safetensors")(path)
    assert main(["run", "--model-path", path, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and f"{path}/{SHARD} is not a readable safetensors file" in err.splitlines()[-1], err


def test_uniradix_run_says_what_it_loads_and_what_it_took(sharded, capsys):
    import re
    from uniradix.cli import main
    assert main(["run", "--model-path", sharded, "--clients", "1", "--rounds", "1", "--tokens-per-round", "8",
                 "--output-tokens", "1", "--shared-prefix-tokens", "0", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert f"uniradix run: loading {sharded} (" in err and "iB on disk) in float32" in err, err
    m = re.search(r"loaded \S+ from .* in [0-9.]+ s: ([0-9.]+) (KiB|MiB|GiB) of weights in memory", err)
    on_disk = sum(os.path.getsize(os.path.join(sharded, f)) for f in os.listdir(sharded) if f.endswith(".safetensors"))
    scale = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    assert m and 0.5 * on_disk <= float(m.group(1)) * scale[m.group(2)] <= 2 * on_disk, err


def test_the_sharded_checkpoint_itself_loads(sharded):
    from uniradix.model.hf import load_checkpoint
    assert len(load_checkpoint(sharded).files) == 3


@pytest.mark.parametrize("head, hint", [(b"hello, not a model", ""), (b"version https://git-lfs", "Git LFS")])
def test_a_file_that_is_not_gguf_says_so(tmp_path, head, hint):
    from uniradix.model.hf.gguf import read_gguf
    path = tmp_path / "model.gguf"
    path.write_bytes(head)
    with pytest.raises(ValueError, match="is not a GGUF file") as e:
        read_gguf(str(path))
    assert str(path) in str(e.value) and hint in str(e.value)


def test_weights_nbytes_counts_every_form_once():
    """The loaded line's size: a tensor in oneDNN's opaque layout (no storage to read), a
    packed and a quantized form as held, a weight under two names once."""
    import torch
    from uniradix.model.hf.gemm import pack
    from uniradix.model.hf.quant import quantize
    from uniradix.model.hf.weights_forms import weight_nbytes, weights_nbytes
    w = torch.randn(64, 128)
    opaque = torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16).contiguous(), None)
    assert opaque.layout == torch._mkldnn and weight_nbytes(opaque) == 64 * 128 * 2
    q = quantize(w, "int8")
    assert weight_nbytes(q) == sum(t.numel() * t.element_size() for t in q.tensors().values())
    packed = pack(w)
    assert weight_nbytes(packed) == (packed.nbytes() if hasattr(packed, "nbytes") else 64 * 128 * 4)
    assert weights_nbytes({"a": w, "tied": w, "q": q}) == 64 * 128 * 4 + weight_nbytes(q)
