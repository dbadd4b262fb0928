"""Bad checkpoints fail loudly, name the tensor and shapes, and never half-load."""

from __future__ import annotations

import json
import pickle
import shutil

import pytest
import torch

safetensors = pytest.importorskip("safetensors.torch")

from attnlab.models import CheckpointError, load  # noqa: E402
from attnlab.models.checkpoint import Entry, assign  # noqa: E402


@pytest.fixture
def gpt2_dir(hf_checkpoint, tmp_path):
    src, _ = hf_checkpoint("gpt2")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _rewrite(folder, fn):
    p = folder / "model.safetensors"
    t = safetensors.load_file(str(p))
    fn(t)
    safetensors.save_file(t, str(p), metadata={"format": "pt"})


def test_truncated_file(gpt2_dir):
    p = gpt2_dir / "model.safetensors"
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors .*corrupt or truncated"):
        load(gpt2_dir)


def test_garbage_file(gpt2_dir):
    (gpt2_dir / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load(gpt2_dir)


def test_wrong_shape_names_tensor_and_shapes(gpt2_dir):
    _rewrite(gpt2_dir, lambda t: t.__setitem__("transformer.h.1.mlp.c_fc.weight", torch.zeros(64, 100)))
    with pytest.raises(CheckpointError, match=r"'h.1.mlp.c_fc.weight' has shape \(64, 100\), expected \(64, 256\)"):
        load(gpt2_dir)


def test_missing_tensor(gpt2_dir):
    _rewrite(gpt2_dir, lambda t: t.pop("transformer.h.0.ln_2.bias"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'h.0.ln_2.bias' \(expected shape \(64,\)\)"):
        load(gpt2_dir)


def test_unexpected_tensor(gpt2_dir):
    _rewrite(gpt2_dir, lambda t: t.__setitem__("transformer.h.0.attn.extra", torch.zeros(3)))
    with pytest.raises(CheckpointError, match=r"unexpected tensors \['h.0.attn.extra'\]"):
        load(gpt2_dir)


def test_nan_weights(gpt2_dir):
    _rewrite(gpt2_dir, lambda t: t["transformer.ln_f.weight"].__setitem__(0, float("nan")))
    with pytest.raises(CheckpointError, match=r"'ln_f.weight' holds NaN"):
        load(gpt2_dir)


def test_config_that_does_not_match_weights(gpt2_dir):
    cfg = json.loads((gpt2_dir / "config.json").read_text())
    cfg["n_layer"] = 3
    (gpt2_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"missing tensor 'h.2.ln_1.weight'"):
        load(gpt2_dir)


def test_unsupported_model_type_and_unknown_name(gpt2_dir, tmp_path):
    cfg = json.loads((gpt2_dir / "config.json").read_text())
    cfg["model_type"] = "t5"
    (gpt2_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        CheckpointError, match=r"model_type 't5' is not supported; supported: \['bert', 'gpt2', 'llama'\]"
    ):
        load(gpt2_dir)
    with pytest.raises(ValueError, match=r"neither a known name .*'minilm'"):
        load("gpt-17")
    with pytest.raises(CheckpointError, match=r"no config.json"):
        load(tmp_path)


def test_pytorch_bin_uses_weights_only(gpt2_dir, tmp_path):
    t = {
        k.removeprefix("transformer."): v for k, v in safetensors.load_file(str(gpt2_dir / "model.safetensors")).items()
    }
    (gpt2_dir / "model.safetensors").unlink()
    torch.save(t, gpt2_dir / "pytorch_model.bin")
    model, _ = load(gpt2_dir)  # plain tensors load
    assert torch.equal(model.embed.weight, t["wte.weight"])

    class Evil:
        def __reduce__(self):
            return (print, ("code ran",))

    with open(gpt2_dir / "pytorch_model.bin", "wb") as f:
        pickle.dump({"x": Evil()}, f)
    with pytest.raises(CheckpointError, match=r"weights_only=True"):
        load(gpt2_dir)


def test_failed_assign_leaves_model_untouched():
    lin = torch.nn.Linear(3, 2)
    before = {k: v.clone() for k, v in lin.state_dict().items()}
    plan = {"weight": Entry([("w", (2, 3))]), "bias": Entry([("b", (2,))])}
    with pytest.raises(CheckpointError, match=r"'b' has shape \(3,\), expected \(2,\)"):
        assign(lin, {"w": torch.ones(2, 3), "b": torch.ones(3)}, plan)
    for k, v in lin.state_dict().items():
        assert torch.equal(v, before[k])
    assign(lin, {"w": torch.ones(2, 3), "b": torch.ones(2)}, plan)
    assert torch.equal(lin.weight, torch.ones(2, 3))


def test_tied_checkpoint_with_different_head_is_refused(gpt2_dir):
    _rewrite(gpt2_dir, lambda t: t.__setitem__("lm_head.weight", torch.randn_like(t["transformer.wte.weight"])))
    with pytest.raises(CheckpointError, match=r"tie_word_embeddings is set but lm_head.weight differs"):
        load(gpt2_dir)


def _shard_into(folder, files):
    """Split model.safetensors over ``files`` (paths relative to ``folder``) plus an index."""
    t = safetensors.load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names, wm = sorted(t), {}
    for i, f in enumerate(files):
        part = names[i :: len(files)]
        (folder / f).parent.mkdir(parents=True, exist_ok=True)
        safetensors.save_file({n: t[n] for n in part}, str(folder / f), metadata={"format": "pt"})
        wm.update({n: f for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return t


def test_sharded_checkpoint_loads(gpt2_dir):
    ref, _ = load(gpt2_dir)
    _shard_into(gpt2_dir, ["model-00001-of-00002.safetensors", "sub/./model-00002-of-00002.safetensors"])
    model, _ = load(gpt2_dir)
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_hub_cache_layout_with_symlinked_shards_loads(gpt2_dir, tmp_path):
    # huggingface_hub: models--x--y/snapshots/<rev>/<file> -> ../../blobs/<sha>
    ref, _ = load(gpt2_dir)
    repo = tmp_path / "models--x--y"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    shutil.copytree(gpt2_dir, snap)
    _shard_into(snap, ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])
    blobs.mkdir()
    for i, f in enumerate(sorted(snap.iterdir())):
        (f.rename(blobs / f"sha{i}"))
        f.symlink_to(f"../../blobs/sha{i}")
    model, _ = load(snap)
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_legacy_bin_format_loads(gpt2_dir):
    # torch's pre-zip format cannot be memory-mapped; the loader reads it whole
    t = safetensors.load_file(str(gpt2_dir / "model.safetensors"))
    (gpt2_dir / "model.safetensors").unlink()
    torch.save(t, gpt2_dir / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    model, _ = load(gpt2_dir)
    assert torch.equal(model.embed.weight, t["transformer.wte.weight"])
