"""Hostile and careless model checkpoints: ``attnlab.models.load`` refuses them with a
:class:`CheckpointError` naming the file and the field or tensor, and a config that asks
for more than the checkpoint holds is refused before anything is allocated.

The tiny checkpoints are written here by transformers' own ``save_pretrained`` (GPT-2,
Llama, BERT; vocab 50, width 16), then edited into hostile ones.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
safetensors = pytest.importorskip("safetensors.torch")
transformers = pytest.importorskip("transformers")

import attnlab  # noqa: E402
from attnlab.models import CheckpointError, load  # noqa: E402

VOCAB, WIDTH = 50, 16
DELETE = object()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """``{name: folder}`` of tiny random checkpoints as transformers saves them."""
    T = transformers
    made = {
        "gpt2": T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=WIDTH, n_positions=32)),
        "llama": T.LlamaForCausalLM(
            T.LlamaConfig(
                vocab_size=VOCAB,
                hidden_size=WIDTH,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=2,
                max_position_embeddings=32,
            )
        ),
        "bert": T.BertModel(
            T.BertConfig(
                vocab_size=VOCAB,
                hidden_size=WIDTH,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=32,
                max_position_embeddings=32,
            )
        ),
    }
    root = tmp_path_factory.mktemp("faults-models")
    out = {}
    for name, model in made.items():
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


def make(base, name, dst: Path, *, to_bin=False, **config) -> Path:
    """A copy of checkpoint ``name`` at ``dst`` with ``config`` fields changed
    (``DELETE`` removes one); ``to_bin`` rewrites the weights as ``pytorch_model.bin``."""
    shutil.copytree(base[name], dst)
    p = dst / "config.json"
    d = json.loads(p.read_text())
    for k, v in config.items():
        if v is DELETE:
            d.pop(k, None)
        else:
            d[k] = v
    p.write_text(json.dumps(d))
    if to_bin:
        st = dst / "model.safetensors"
        torch.save(safetensors.load_file(str(st)), dst / "pytorch_model.bin")
        st.unlink()
    return dst


def rewrite_weights(folder: Path, fn) -> None:
    p = folder / "model.safetensors"
    t = safetensors.load_file(str(p))
    fn(t)
    safetensors.save_file(t, str(p), metadata={"format": "pt"})


def shard(folder: Path) -> dict:
    """Split ``model.safetensors`` into two shards plus ``model.safetensors.index.json``;
    returns the index dict (rewrite it to make it hostile)."""
    t = safetensors.load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(t)
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    parts = [names[: len(names) // 2], names[len(names) // 2 :]]
    wm = {}
    for f, part in zip(files, parts, strict=True):
        safetensors.save_file({n: t[n] for n in part}, str(folder / f), metadata={"format": "pt"})
        wm.update({n: f for n in part})
    index = {"metadata": {}, "weight_map": wm}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return index


def write_index(folder: Path, index) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


# ---------------------------------------------------------------------------------------------
# 1. Configs that ask for more than the checkpoint holds: refused before allocating.
#
# One child process loads each hostile folder under an address-space cap (RLIMIT_AS) of
# CAP_MB above its size after a warm-up load, and reports the growth of its peak resident
# memory during each load (VmHWM, reset before each case; ru_maxrss where it cannot be).
# Today's loader allocates the model the config describes first (6.4 GB for
# vocab_size=1e8 at width 16) and so dies on the cap.

CAP_MB = 256  # room far beyond a tiny load, far below what the hostile configs ask for
GROWTH_LIMIT_MB = 64  # a refused load may touch a few MB (headers, the meta model's Python objects)
HUGE = 10**8

HOSTILE = {
    "gpt2-vocab-1e8": ("gpt2", dict(vocab_size=HUGE)),
    "gpt2-n_layer-20000": ("gpt2", dict(n_layer=20000)),
    "gpt2-n_layer-1e12": ("gpt2", dict(n_layer=10**12)),
    "gpt2-n_inner-1e8": ("gpt2", dict(n_inner=HUGE)),
    "gpt2-n_positions-1e8": ("gpt2", dict(n_positions=HUGE)),
    "gpt2-bin-vocab-1e8": ("gpt2", dict(vocab_size=HUGE, to_bin=True)),
    "llama-vocab-1e8": ("llama", dict(vocab_size=HUGE)),
    "llama-intermediate-1e8": ("llama", dict(intermediate_size=HUGE)),
    "bert-vocab-1e8": ("bert", dict(vocab_size=HUGE)),
    "bert-max_positions-1e8": ("bert", dict(max_position_embeddings=HUGE)),
}
SPARSE = {"config-1GiB": "config.json", "index-1GiB": "model.safetensors.index.json"}

CHILD = r"""
import json, resource, sys, time
import torch
torch.set_num_threads(1)
from attnlab.models import CheckpointError, load


def status_kb(key):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key + ":"))


def reset_peak():  # Linux: writing 5 to clear_refs resets VmHWM (the peak RSS) to the current RSS
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


cases, good, cap_mb = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
load(good)  # warm-up: every lazy import and first-call path of a normal load
limit = (status_kb("VmSize") + cap_mb * 1024) * 1024
resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
out = {}
for name, folder in cases.items():
    per_case = reset_peak()
    before = status_kb("VmHWM") if per_case else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    try:
        load(folder)
        result = "loaded"
    except CheckpointError as e:
        result = "CheckpointError: " + str(e)[:400]
    except BaseException as e:
        result = type(e).__name__ + ": " + str(e)[:200]
    after = status_kb("VmHWM") if per_case else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out[name] = {"result": result, "growth_mb": (after - before) / 1024, "seconds": time.perf_counter() - t,
                 "peak": "VmHWM" if per_case else "ru_maxrss"}
# control: the measurement sees an allocation of 32 MiB that is written to
per_case = reset_peak()
before = status_kb("VmHWM") if per_case else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
x = torch.ones(8 << 20)
after = status_kb("VmHWM") if per_case else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out["control-32MiB"] = {"result": "allocated", "growth_mb": (after - before) / 1024}
print("RESULTS" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def hostile_results(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    cases = {}
    for case, (name, kw) in HOSTILE.items():
        kw = dict(kw)
        cases[case] = str(make(base, name, root / case, to_bin=kw.pop("to_bin", False), **kw))
    for case, fname in SPARSE.items():
        folder = make(base, "gpt2", root / case)
        if fname.endswith("index.json"):
            shard(folder)
        with open(folder / fname, "r+b") as f:  # a sparse file: 1 GiB of zeros, no disk used
            f.truncate(1 << 30)
        cases[case] = str(folder)
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(Path(attnlab.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(cases), str(base["gpt2"]), str(CAP_MB)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULTS")), None)
    assert line is not None, f"child failed (rc {proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(line[len("RESULTS") :])


@pytest.mark.parametrize("case", sorted(HOSTILE) + sorted(SPARSE))
def test_hostile_config_refused_before_allocating(hostile_results, case):
    r = hostile_results[case]
    assert r["result"].startswith("CheckpointError"), r
    assert r["growth_mb"] < GROWTH_LIMIT_MB, r
    # the control that makes the bound mean something: 32 MiB written in the same child is seen
    assert hostile_results["control-32MiB"]["growth_mb"] > 24, hostile_results["control-32MiB"]


def test_hostile_config_error_names_field_and_shapes(hostile_results):
    assert "'wte.weight' has shape (50, 16), expected (100000000, 16)" in hostile_results["gpt2-vocab-1e8"]["result"]
    assert "field 'n_layer': the config asks for 20000 layers" in hostile_results["gpt2-n_layer-20000"]["result"]
    assert "config.json: 1073741824 bytes" in hostile_results["config-1GiB"]["result"]


@pytest.mark.parametrize("field,cfg_field", [("vocab_size", "vocab_size"), ("n_positions", "max_positions")])
def test_config_beyond_int64_names_the_field(base, tmp_path, field, cfg_field):
    # today: the model is built first and torch fails on a size it cannot even represent.
    # Now the config check refuses it by name (DecoderConfig bounds sizes to int64-safe
    # 2**62) before any header is compared or anything allocated.
    folder = make(base, "gpt2", tmp_path / "ckpt", **{field: 10**30})
    with pytest.raises(
        CheckpointError, match=rf"config\.json: .*DecoderConfig\.{cfg_field}: expected an int <= 2\*\*62"
    ):
        load(folder)


def test_headers_that_declare_more_bytes_than_the_files_hold(tmp_path):
    # the last guard of the header phase, for a file whose header lies about its data
    from attnlab.models.checkpoint import Entry, Header, check_plan

    f = tmp_path / "w.bin"
    f.write_bytes(b"\0" * 16)
    headers = {"w": Header((2, 3), "F32", f), "b": Header((2,), "F32", f)}  # 32 bytes declared, 16 held
    plan = {"weight": Entry([("w", (2, 3))]), "bias": Entry([("b", (2,))])}
    with pytest.raises(CheckpointError, match=r"declare 32 bytes but the files hold only 16"):
        check_plan(lambda: torch.nn.Linear(3, 2), headers, plan)


# ---------------------------------------------------------------------------------------------
# 2. Every config field the loader reads is checked: type, range, known names.

BAD_FIELDS = [
    ("gpt2", "vocab_size", "50"),
    ("gpt2", "n_embd", 16.0),
    ("gpt2", "n_head", 0),
    ("gpt2", "n_head", 3),  # does not divide n_embd=16
    ("gpt2", "n_layer", -1),
    ("gpt2", "n_layer", True),
    ("gpt2", "n_inner", 0),  # today: silently 4 * n_embd
    ("gpt2", "n_positions", 0),
    ("gpt2", "layer_norm_epsilon", float("nan")),
    ("gpt2", "layer_norm_epsilon", -1e-5),
    ("gpt2", "tie_word_embeddings", "yes"),
    ("gpt2", "scale_attn_weights", "false"),  # today: a non-empty string reads as True
    ("gpt2", "activation_function", ["gelu"]),
    ("gpt2", "model_type", ["gpt2"]),
    ("llama", "rms_norm_eps", float("inf")),
    ("llama", "rope_theta", float("nan")),
    ("llama", "rope_theta", -1.0),
    ("llama", "num_key_value_heads", 0),  # today: silently num_attention_heads
    ("llama", "num_key_value_heads", 3),  # does not divide num_attention_heads=2
    ("llama", "head_dim", 0),  # today: silently hidden_size // heads
    ("llama", "partial_rotary_factor", 2.0),
    ("llama", "rope_scaling", "linear"),
    ("llama", "attention_bias", "no"),
    ("llama", "num_hidden_layers", None),
    ("bert", "pad_token_id", 10**6),  # beyond vocab_size
    ("bert", "type_vocab_size", -1),
    ("bert", "layer_norm_eps", 0.0),
    ("bert", "hidden_act", ["gelu"]),
    ("bert", "is_decoder", 0),
]


@pytest.mark.parametrize("arch,field,value", BAD_FIELDS, ids=[f"{a}-{f}-{v!r}" for a, f, v in BAD_FIELDS])
def test_bad_config_field_names_file_and_field(base, tmp_path, arch, field, value):
    folder = make(base, arch, tmp_path / "ckpt", **{field: value})
    if arch == "llama" and field in ("rope_theta", "partial_rotary_factor", "rope_scaling"):
        d = json.loads((folder / "config.json").read_text())  # transformers 5 writes rope_parameters
        d.pop("rope_parameters", None)
        (folder / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match=rf"config\.json.*{field}"):
        load(folder)


def test_rope_scaling_with_nan_factor(base, tmp_path):
    folder = make(
        base,
        "llama",
        tmp_path / "ckpt",
        rope_parameters=DELETE,
        rope_scaling={"rope_type": "linear", "factor": float("nan")},
    )
    with pytest.raises(CheckpointError, match=r"config\.json.*rope_scaling.*factor"):
        load(folder)


# ---------------------------------------------------------------------------------------------
# 3. Malformed JSON files: CheckpointError naming the file, never AttributeError & co.


@pytest.mark.parametrize("text", ["[1, 2]", '"gpt2"', "null", "NaN", "3"])
def test_config_that_is_not_an_object(base, tmp_path, text):
    folder = make(base, "gpt2", tmp_path / "ckpt")
    (folder / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=r"config\.json: expected a JSON object"):
        load(folder)


def test_config_nested_too_deeply(base, tmp_path):
    folder = make(base, "gpt2", tmp_path / "ckpt")
    (folder / "config.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(CheckpointError, match=r"config\.json"):
        load(folder)


def test_config_with_an_int_of_5000_digits(base, tmp_path):
    folder = make(base, "gpt2", tmp_path / "ckpt")
    text = (folder / "config.json").read_text()
    (folder / "config.json").write_text(text.replace('"n_layer": 2', '"n_layer": 1' + "0" * 5000))
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        load(folder)


def test_config_with_a_duplicated_key(base, tmp_path):
    folder = make(base, "gpt2", tmp_path / "ckpt")
    text = (folder / "config.json").read_text()
    (folder / "config.json").write_text(text.replace('"n_layer": 2', '"n_layer": 2, "n_layer": 1'))
    with pytest.raises(CheckpointError, match=r"config\.json: key 'n_layer' appears twice"):
        load(folder)


# ---------------------------------------------------------------------------------------------
# 4. Shard indexes: every name a string that stays inside the folder.


def _sharded(base, tmp_path):
    folder = make(base, "gpt2", tmp_path / "ckpt")
    return folder, shard(folder)


def test_weight_map_not_an_object(base, tmp_path):
    folder, index = _sharded(base, tmp_path)
    write_index(folder, {"weight_map": sorted(index["weight_map"].values())})
    with pytest.raises(CheckpointError, match=r"index\.json: field 'weight_map': expected a non-empty JSON object"):
        load(folder)


@pytest.mark.parametrize("bad", [1, None, ["model-00001-of-00002.safetensors"], "", "model\0.safetensors"])
def test_shard_name_not_a_string(base, tmp_path, bad):
    folder, index = _sharded(base, tmp_path)
    first = sorted(index["weight_map"])[0]
    if bad == 1:  # every shard name an int: today `folder / 1` raises TypeError
        index["weight_map"] = {k: 1 for k in index["weight_map"]}
    else:
        index["weight_map"][first] = bad
    write_index(folder, index)
    with pytest.raises(CheckpointError, match=r"index\.json: weight_map\['.*'\]: expected a shard file name"):
        load(folder)


def _escape(base, tmp_path, how):
    """A sharded checkpoint whose second shard lies outside the folder, named by ``how``."""
    folder, index = _sharded(base, tmp_path)
    second = "model-00002-of-00002.safetensors"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(folder / second, outside / second)
    name = {
        "dotdot": f"../elsewhere/{second}",
        "absolute": str(outside / second),
        "symlink": second,
        "dot-inside-dotdot": f"./sub/../../elsewhere/{second}",
    }[how]
    if how == "symlink":
        (folder / second).symlink_to(outside / second)
    index["weight_map"] = {k: (name if v == second else v) for k, v in index["weight_map"].items()}
    write_index(folder, index)
    return folder


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink", "dot-inside-dotdot"])
def test_shard_outside_the_folder_is_refused(base, tmp_path, how):
    folder = _escape(base, tmp_path, how)
    with pytest.raises(CheckpointError, match=r"index\.json: weight_map\[.*(inside|outside)"):
        load(folder)


def test_shard_that_is_not_safetensors_is_refused(base, tmp_path):
    folder, index = _sharded(base, tmp_path)
    second = "model-00002-of-00002.safetensors"
    torch.save(safetensors.load_file(str(folder / second)), folder / "shard2.bin")
    index["weight_map"] = {k: ("shard2.bin" if v == second else v) for k, v in index["weight_map"].items()}
    write_index(folder, index)
    with pytest.raises(CheckpointError, match=r"shard 'shard2.bin' is not a .safetensors file"):
        load(folder)


@pytest.mark.parametrize("how", ["wrong-shard", "unlisted", "ghost"])
def test_index_that_disagrees_with_its_shards_is_refused(base, tmp_path, how):
    folder, index = _sharded(base, tmp_path)
    wm = index["weight_map"]
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    name = next(k for k, v in sorted(wm.items()) if v == first)
    if how == "wrong-shard":
        wm[name] = second
    elif how == "unlisted":
        del wm[name]
    else:
        wm["transformer.h.9.ghost.weight"] = first
    write_index(folder, index)
    with pytest.raises(CheckpointError, match=r"index\.json: field 'weight_map' disagrees with the shards"):
        load(folder)


# ---------------------------------------------------------------------------------------------
# 5. Two names for one tensor after the prefix is dropped: refused, both named.


@pytest.mark.parametrize(
    "arch,long,short",
    [
        ("gpt2", "transformer.wte.weight", "wte.weight"),
        ("gpt2", "transformer.h.0.ln_1.bias", "h.0.ln_1.bias"),
        ("llama", "model.norm.weight", "norm.weight"),
        ("bert", "bert.pooler.dense.bias", "pooler.dense.bias"),
    ],
)
def test_prefix_collision_is_refused(base, tmp_path, arch, long, short):
    folder = make(base, arch, tmp_path / "ckpt")

    def add(t):
        have = long if long in t else short
        t[short if have == long else long] = t[have].clone() + 1  # a second, different value

    rewrite_weights(folder, add)
    with pytest.raises(CheckpointError, match=rf"'{long}' and '{short}'|'{short}' and '{long}'"):
        load(folder)


def test_bin_with_non_string_names(base, tmp_path):
    folder = make(base, "gpt2", tmp_path / "ckpt", to_bin=True)
    t = torch.load(folder / "pytorch_model.bin", weights_only=True)
    t[7] = torch.zeros(3)
    torch.save(t, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin: expected a dict of tensors with string names"):
        load(folder)
