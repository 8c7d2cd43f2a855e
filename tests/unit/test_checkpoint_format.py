"""safetensors encoding and reading, and the JSON structure codec of phalanx.checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from phalanx.checkpoint.atomic import write_file
from phalanx.checkpoint.format import FormatError, encode, read_tensors
from phalanx.checkpoint.manifest import FileEntry, file_digest
from phalanx.checkpoint.structure import flatten, unflatten


def _read(path: Path) -> dict[str, torch.Tensor]:
    """``path`` read back, verified against its true size and crc32c."""
    size, digest = file_digest(path, "crc32c")
    return read_tensors(path, FileEntry(digest, size))


def _roundtrip(tensors: dict[str, torch.Tensor], tmp_path: Path) -> dict[str, torch.Tensor]:
    path = tmp_path / "t.safetensors"
    entry = write_file(path, encode(tensors))
    assert entry.tensors is not None and entry.tensors.keys() == tensors.keys()
    return read_tensors(path, entry)


def test_safetensors_roundtrip_all_kinds_of_tensors(tmp_path: Path) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(7).to(torch.bfloat16),
        "i8": torch.arange(-3, 4, dtype=torch.int8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "transposed": base.t(),
        "sliced": base[1:3, ::2],
        "u8": torch.tensor([255, 0], dtype=torch.uint8),
    }
    out = _roundtrip(tensors, tmp_path)
    assert out.keys() == tensors.keys()
    for k, t in tensors.items():
        assert out[k].dtype == t.dtype and out[k].shape == t.shape and torch.equal(out[k], t), k


def test_tensors_are_aligned_to_their_element_size(tmp_path: Path) -> None:
    tensors = {"a": torch.ones(3, dtype=torch.int8), "b": torch.ones(5, dtype=torch.float64)}
    out = _roundtrip(tensors, tmp_path)
    assert out["b"].data_ptr() % 8 == 0


def test_read_tensors_are_writable_and_the_file_never_changes(tmp_path: Path) -> None:
    tensors = {"w": torch.arange(6, dtype=torch.float32)}
    out = _roundtrip(tensors, tmp_path)
    before = (tmp_path / "t.safetensors").read_bytes()
    out["w"].add_(1)  # an optimizer's state loaded without a copy is updated in place
    assert (tmp_path / "t.safetensors").read_bytes() == before
    assert torch.equal(_read(tmp_path / "t.safetensors")["w"], tensors["w"])


def test_interoperates_with_the_safetensors_library(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    tensors = {"w": torch.randn(4, 3), "n": torch.arange(6, dtype=torch.int64)}
    ours = tmp_path / "ours.safetensors"
    write_file(ours, encode(tensors))
    theirs = st.load_file(str(ours))
    assert all(torch.equal(theirs[k], tensors[k]) for k in tensors)
    with st.safe_open(str(ours), framework="pt") as f:
        assert sorted(f.keys()) == ["n", "w"] and torch.equal(f.get_tensor("w"), tensors["w"])
    st.save_file(tensors, str(tmp_path / "theirs.safetensors"))
    back = _read(tmp_path / "theirs.safetensors")
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)


def _file(header: dict[str, object], payload: bytes, path: Path) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + payload)
    return path


@pytest.mark.parametrize(
    ("header", "payload", "message"),
    [
        ({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "not a valid"),
        ({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}, b"\0" * 16, "not a valid"),
        ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, b"\0" * 4, "data_offsets"),
        ({"x": {"dtype": "PICKLE", "shape": [1], "data_offsets": [0, 1]}}, b"\0", "no valid"),
        ({"x": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}, b"\0", "invalid shape"),
        (
            {
                "x": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                "y": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]},
            },
            b"\0" * 6,
            "not a valid",
        ),
    ],
)
def test_malformed_headers_are_rejected(
    header: dict[str, object], payload: bytes, message: str, tmp_path: Path
) -> None:
    # the library's own errors are wrapped: a FormatError naming the file
    with pytest.raises(FormatError, match=message) as err:
        _read(_file(header, payload, tmp_path / "bad.safetensors"))
    assert str(tmp_path / "bad.safetensors") in str(err.value)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\1\0", "too short"),
        ((10**9).to_bytes(8, "little") + b"{}", "header length"),
        ((4).to_bytes(8, "little") + b"{{{{", "not valid JSON"),
    ],
)
def test_truncated_and_garbage_files_are_rejected(raw: bytes, message: str, tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(raw)
    with pytest.raises(FormatError, match=message):
        _read(tmp_path / "f")


def test_unsupported_dtype_names_the_tensor() -> None:
    with pytest.raises(TypeError, match=r"'z'.*complex128"):
        encode({"z": torch.zeros(2, dtype=torch.complex128)})


def test_structure_roundtrip_keeps_int_keys_tuples_and_special_floats() -> None:
    state = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}, 1: {"m": None}},
        "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1], "x": math.inf}],
        "__tensor__": "not a tensor",
        "nested": {(1, "a"): [1, 2.5, "s", True]},
        "nan": math.nan,
    }
    tree, tensors = flatten(state, "optimizer state")
    assert set(tensors) == {"state.0.step", "state.0.exp_avg"}
    back = unflatten(json.loads(json.dumps(tree)), tensors)
    assert back["state"][0]["exp_avg"] is tensors["state.0.exp_avg"]
    assert back["param_groups"][0]["betas"] == (0.9, 0.999)
    assert back["state"][1] == {"m": None} and back["__tensor__"] == "not a tensor"
    assert back["nested"] == {(1, "a"): [1, 2.5, "s", True]} and math.isnan(back["nan"])
    assert back["param_groups"][0]["x"] == math.inf


def test_flatten_names_the_key_that_is_not_json_able() -> None:
    with pytest.raises(TypeError, match=r"scheduler state key 'lr_lambdas\.0'.*function"):
        flatten({"lr_lambdas": [lambda s: s]}, "scheduler state")
    with pytest.raises(TypeError, match="extra key 'when' holds a tensor"):
        flatten({"when": torch.ones(1)}, "extra", allow_tensors=False)
    with pytest.raises(TypeError, match="dict key of type object"):
        flatten({"d": {object(): 1}}, "state")


def test_colliding_flat_keys_are_kept_apart() -> None:
    tree, tensors = flatten({"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}, "s")
    back = unflatten(tree, tensors)
    assert torch.equal(back["a.b"], torch.ones(1)) and torch.equal(back["a"]["b"], torch.zeros(1))
