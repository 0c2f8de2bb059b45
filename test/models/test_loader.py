"""The safetensors checkpoint loader on tiny random checkpoints: shards, dtypes, hub ids, errors."""

import json
import re
import shutil
from pathlib import Path

import huggingface_hub.constants
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from sgl_jax.layers.rotary import RopeConfig
from sgl_jax.models.loader import CheckpointError, LoadedModel, load_model
from sgl_jax.testing import write_tiny_checkpoint

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
UP_PROJ = "model.layers.1.mlp.up_proj.weight"


# --------------------------------------------------------------------------- fixtures, helpers


def _write(factory, name: str, preset: str, **kwargs) -> Path:
    # numpy backend: no torch import, and the same seed always gives the same tensors.
    return write_tiny_checkpoint(
        factory.mktemp(name), preset, backend="numpy", with_tokenizer=False, **kwargs
    )


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return _write(tmp_path_factory, "llama", "llama", seed=3)


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory) -> Path:
    return _write(tmp_path_factory, "sharded", "llama", seed=3, max_shard_size="100KB")


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory) -> Path:
    return _write(tmp_path_factory, "bf16", "llama", dtype="bfloat16", seed=5)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    return _write(tmp_path_factory, "qwen3", "qwen3", seed=7)  # tie_word_embeddings=True


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory) -> Path:
    return _write(tmp_path_factory, "llama3", "llama3", seed=9)


@pytest.fixture(autouse=True)
def offline_hub(tmp_path, monkeypatch) -> Path:
    """An empty, private hub cache with HF_HUB_OFFLINE=1, so no test can reach the network.

    huggingface_hub reads HF_HOME / HF_HUB_CACHE / HF_HUB_OFFLINE into `huggingface_hub.constants`
    once, when it is imported (constants.py evaluates os.environ at module level; transformers
    has imported it long before any test runs), and `snapshot_download` looks up
    `constants.HF_HUB_CACHE` when called. Setting the env vars alone would therefore leave it
    searching the real cache, so the module attributes are patched as well. The loader itself
    reads HF_HUB_OFFLINE from os.environ at call time (it passes local_files_only), so the env
    var is what it sees.
    """
    home = tmp_path / "hf_home"
    cache = home / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HOME", str(home))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def load(path: Path | str, **kwargs) -> LoadedModel:
    return load_model(str(path), progress=False, **kwargs)


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(model_dir: Path, drop: tuple[str, ...] = (), **changes) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    for key in drop:
        config.pop(key, None)
    config.update(changes)
    path.write_text(json.dumps(config, indent=2))


def edit_tensors(shard: Path, edit) -> None:
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})


def file_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint, read independently of the loader."""
    tensors = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def leaf(params, path: tuple):
    for key in path:
        params = params[key]
    return params


def bits(array) -> np.ndarray:
    array = np.ascontiguousarray(np.asarray(array))
    return array.view(f"u{array.dtype.itemsize}")


def assert_same_params(a, b) -> None:
    """Same pytree structure, and every leaf bitwise equal with the same dtype and shape."""
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for (path, x), y in zip(
        jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b), strict=True
    ):
        assert (x.dtype, x.shape) == (y.dtype, y.shape), jax.tree_util.keystr(path)
        np.testing.assert_array_equal(bits(x), bits(y), err_msg=jax.tree_util.keystr(path))


def assert_params_match_file(model: LoadedModel, expected_dtype) -> None:
    """Each parameter (or its part of a fused parameter) is its file tensor cast to
    `expected_dtype`; fused parameters are fully covered."""
    tensors = file_tensors(model.model_dir)
    specs = model.impl.hf_weight_specs(model.config)
    assert len(jax.tree_util.tree_leaves(model.params)) == len({s.path for s in specs.values()})
    covered: dict[tuple, int] = {}
    for name, spec in specs.items():
        value = leaf(model.params, spec.path)
        assert value.dtype == expected_dtype, name
        want = tensors[name].astype(expected_dtype)
        if spec.part is not None:
            covered[spec.path] = covered.get(spec.path, 0) + want.size
            value = np.asarray(value)[spec.part.index].reshape(want.shape)
        assert value.shape == want.shape, name
        np.testing.assert_array_equal(bits(value), bits(want), err_msg=name)
    for path, size in covered.items():
        assert leaf(model.params, path).size == size, path


# --------------------------------------------------------------------------- sharding, dtypes


def test_sharded_checkpoint_matches_unsharded(llama_dir, sharded_dir):
    index = json.loads((sharded_dir / INDEX).read_text())
    shards = sorted(p.name for p in sharded_dir.glob("*.safetensors"))
    assert len(shards) > 1
    assert sorted(set(index["weight_map"].values())) == shards
    assert not (llama_dir / INDEX).exists()
    assert [p.name for p in llama_dir.glob("*.safetensors")] == [SINGLE]

    single = load(llama_dir, dtype="float32")
    sharded = load(sharded_dir, dtype="float32")
    assert sharded.config == single.config
    assert_same_params(sharded.params, single.params)
    assert_params_match_file(single, jnp.float32)
    assert len(single.params["layers"]) == single.config.num_layers == 4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "auto"])
def test_bfloat16_checkpoint_dtypes(bf16_dir, dtype):
    assert {t.dtype.name for t in file_tensors(bf16_dir).values()} == {"bfloat16"}
    model = load(bf16_dir, dtype=dtype)
    assert model.config.checkpoint_dtype == "bfloat16"
    if dtype == "auto":
        # CPUs compute in float32; an accelerator keeps the checkpoint's 16-bit dtype.
        expected = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    else:
        expected = jnp.dtype(dtype)
    assert model.dtype == expected
    # bf16 -> f32 is exact, so the loaded values are bitwise the file's values widened.
    assert_params_match_file(model, expected)


# --------------------------------------------------------------------------- hub ids


def place_in_hub_cache(cache: Path, repo_id: str, src: Path, commit: str = COMMIT) -> Path:
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    shutil.copytree(src, snapshot)
    (repo / "refs").mkdir()
    # No trailing newline: huggingface_hub uses the file's content verbatim as the commit.
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_offline_hub_id_not_in_cache():
    with pytest.raises(
        FileNotFoundError,
        match=r"'someorg/not-cached' .*not found in the local cache \(HF_HUB_OFFLINE is set\)",
    ):
        load("someorg/not-cached")


@pytest.mark.parametrize("revision", [None, "main", COMMIT])
def test_hub_id_loads_from_offline_cache(offline_hub, llama_dir, revision):
    snapshot = place_in_hub_cache(offline_hub, "someorg/tiny", llama_dir)
    model = load("someorg/tiny", dtype="float32", revision=revision)
    assert model.model_dir.resolve() == snapshot.resolve()
    assert_same_params(model.params, load(llama_dir, dtype="float32").params)


@pytest.mark.parametrize("revision", ["v9.9", "f" * 40])
def test_hub_revision_not_in_cache(offline_hub, llama_dir, revision):
    place_in_hub_cache(offline_hub, "someorg/tiny", llama_dir)
    with pytest.raises(
        FileNotFoundError,
        match=rf"'someorg/tiny' .*local cache \(HF_HUB_OFFLINE is set\) at revision '{revision}'",
    ):
        load("someorg/tiny", revision=revision)


# --------------------------------------------------------------------------- missing files


def test_missing_directory():
    with pytest.raises(
        FileNotFoundError, match=re.escape("model directory './no/such/dir/here' does not exist")
    ):
        load("./no/such/dir/here")


def test_path_is_a_file(tmp_path):
    path = tmp_path / SINGLE
    path.write_bytes(b"not a directory")
    with pytest.raises(NotADirectoryError, match=rf"{re.escape(str(path))}.* is a file, not a dir"):
        load(path)


def test_missing_config_json(llama_dir, tmp_path):
    model_dir = copy_checkpoint(llama_dir, tmp_path / "ckpt")
    (model_dir / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"no config\.json in model directory .*ckpt"):
        load(model_dir)


def test_no_safetensors_files(llama_dir, tmp_path):
    model_dir = tmp_path / "ckpt"
    model_dir.mkdir()
    shutil.copy(llama_dir / "config.json", model_dir)
    (model_dir / "pytorch_model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(
        FileNotFoundError,
        match=r"no \*\.safetensors files in .*\(found pytorch_model\.bin\).*only safetensors",
    ):
        load(model_dir)


def test_index_names_missing_shard(sharded_dir, tmp_path):
    model_dir = copy_checkpoint(sharded_dir, tmp_path / "ckpt")
    shard = json.loads((model_dir / INDEX).read_text())["weight_map"][UP_PROJ]
    (model_dir / shard).unlink()
    with pytest.raises(
        FileNotFoundError, match=rf"shard '{re.escape(shard)}' listed in .*{INDEX} is missing"
    ):
        load(model_dir)


# --------------------------------------------------------------------------- tensor names


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_missing_tensor(llama_dir, sharded_dir, tmp_path, layout):
    src = llama_dir if layout == "single" else sharded_dir
    model_dir = copy_checkpoint(src, tmp_path / "ckpt")
    if layout == "single":
        shard = SINGLE
    else:  # drop it from its shard and from the index, as a consistent exporter would
        index = json.loads((model_dir / INDEX).read_text())
        shard = index["weight_map"].pop(UP_PROJ)
        (model_dir / INDEX).write_text(json.dumps(index))
    edit_tensors(model_dir / shard, lambda t: t.pop(UP_PROJ))
    with pytest.raises(
        CheckpointError, match=rf"missing 1 tensor\(s\) the config requires: {re.escape(UP_PROJ)}$"
    ):
        load(model_dir)


def test_index_lists_tensor_its_shard_lacks(sharded_dir, tmp_path):
    model_dir = copy_checkpoint(sharded_dir, tmp_path / "ckpt")
    shard = json.loads((model_dir / INDEX).read_text())["weight_map"][UP_PROJ]
    edit_tensors(model_dir / shard, lambda t: t.pop(UP_PROJ))  # the index still lists it
    with pytest.raises(CheckpointError, match=re.escape(UP_PROJ)) as info:
        load(model_dir)
    assert shard in str(info.value)


def test_unexpected_tensor(llama_dir, tmp_path):
    model_dir = copy_checkpoint(llama_dir, tmp_path / "ckpt")
    extra = "model.layers.0.extra.weight"
    edit_tensors(model_dir / SINGLE, lambda t: t.update({extra: np.zeros(64, np.float32)}))
    with pytest.raises(CheckpointError, match=rf"1 unexpected tensor\(s\): {re.escape(extra)}$"):
        load(model_dir)


def test_rotary_inv_freq_buffers_are_ignored(llama_dir, tmp_path):
    model_dir = copy_checkpoint(llama_dir, tmp_path / "ckpt")
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, 16, 2, dtype=np.float32) / 16)

    def add_buffers(tensors):
        for i in range(4):
            tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = inv_freq

    edit_tensors(model_dir / SINGLE, add_buffers)
    assert_same_params(load(model_dir).params, load(llama_dir).params)


def test_tied_checkpoint_with_lm_head_copy_loads(qwen3_dir, tmp_path):
    model_dir = copy_checkpoint(qwen3_dir, tmp_path / "ckpt")
    assert "lm_head.weight" not in file_tensors(qwen3_dir)
    edit_tensors(
        model_dir / SINGLE,
        lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].copy()}),
    )
    model = load(model_dir)
    assert model.config.tie_word_embeddings
    assert "lm_head" not in model.params
    assert_same_params(model.params, load(qwen3_dir).params)


def test_untied_config_without_lm_head(qwen3_dir, tmp_path):
    model_dir = copy_checkpoint(qwen3_dir, tmp_path / "ckpt")
    edit_config(model_dir, tie_word_embeddings=False)
    with pytest.raises(
        CheckpointError, match=r"missing 1 tensor\(s\) the config requires: lm_head\.weight$"
    ):
        load(model_dir)


# --------------------------------------------------------------------------- shapes, dtypes


def test_shape_mismatch(llama_dir, tmp_path):
    model_dir = copy_checkpoint(llama_dir, tmp_path / "ckpt")
    edit_config(model_dir, intermediate_size=96)  # the file's MLP matrices use 128
    message = (
        r"tensor '(model\.layers\.\d+\.mlp\.(?:gate|up|down)_proj\.weight)' in model\.safetensors "
        r"has shape (\[[\d, ]+\]), but the config implies (\[[\d, ]+\])"
    )
    with pytest.raises(CheckpointError, match=message) as info:
        load(model_dir)
    name, found, implied = re.search(message, str(info.value)).groups()
    file_shape = list(file_tensors(llama_dir)[name].shape)
    assert json.loads(found) == file_shape
    assert json.loads(implied) == [96 if d == 128 else d for d in file_shape]


def test_unsupported_dtype_argument(llama_dir):
    with pytest.raises(
        ValueError, match=r"dtype 'int8' is not supported; choose from auto, float32, bfloat16, "
    ) as info:
        load(llama_dir, dtype="int8")
    assert "float16" in str(info.value).split("choose from", 1)[1]


def test_integer_tensor_in_checkpoint(llama_dir, tmp_path):
    model_dir = copy_checkpoint(llama_dir, tmp_path / "ckpt")
    edit_tensors(
        model_dir / SINGLE, lambda t: t.update({"model.norm.weight": np.ones(64, np.int8)})
    )
    with pytest.raises(
        CheckpointError,
        match=r"tensor 'model\.norm\.weight' in model\.safetensors has dtype I8; "
        r"only floating-point",
    ):
        load(model_dir)


# --------------------------------------------------------------------------- config.json


def test_unsupported_architecture(llama_dir, tmp_path):
    model_dir = copy_checkpoint(llama_dir, tmp_path / "ckpt")
    edit_config(model_dir, architectures=["GPT2LMHeadModel"])
    with pytest.raises(
        ValueError,
        match=r"GPT2LMHeadModel.*not supported; supported architectures: "
        r".*LlamaForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM",
    ):
        load(model_dir)


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_unsupported_rope_type(llama_dir, tmp_path, key):
    model_dir = copy_checkpoint(llama_dir, tmp_path / "ckpt")
    edit_config(model_dir, drop=("rope_parameters",), **{key: {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(
        ValueError,
        match=r"rope scaling type 'yarn' is not supported; supported: .*default.*linear.*llama3",
    ):
        load(model_dir)


LLAMA3_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


@pytest.mark.parametrize(
    "v4, v5, expected",
    [
        (
            {"rope_theta": 1e6, "rope_scaling": None},
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
            RopeConfig(theta=1e6),
        ),
        (
            {"rope_theta": 5e4, "rope_scaling": {"type": "linear", "factor": 2.0}},
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 5e4, "factor": 2.0}},
            RopeConfig(theta=5e4, rope_type="linear", factor=2.0),
        ),
        (
            {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **LLAMA3_SCALING}},
            {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3_SCALING}},
            RopeConfig(theta=5e5, rope_type="llama3", **LLAMA3_SCALING),
        ),
    ],
    ids=["default", "linear", "llama3"],
)
def test_rope_config_both_spellings(v4, v5, expected):
    assert RopeConfig.from_hf(v4) == expected
    assert RopeConfig.from_hf(v5) == expected


def test_rope_spellings_load_the_same(llama3_dir, tmp_path):
    """The checkpoint's config.json (transformers 5 layout) rewritten in the transformers 4 one."""
    v5 = json.loads((llama3_dir / "config.json").read_text())
    params = dict(v5["rope_parameters"])
    assert params["rope_type"] == "llama3"
    model_dir = copy_checkpoint(llama3_dir, tmp_path / "ckpt")
    edit_config(
        model_dir,
        drop=("rope_parameters",),
        rope_theta=params.pop("rope_theta"),
        rope_scaling=params,
    )
    from_v5, from_v4 = load(llama3_dir), load(model_dir)
    assert from_v4.config == from_v5.config
    assert from_v5.config.rope == RopeConfig(theta=5e5, rope_type="llama3", **LLAMA3_SCALING)
