"""safetensors encoding and the JSON structure codec of phalanx.checkpoint (no files, no ranks)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from phalanx.checkpoint.format import FormatError, decode, encode
from phalanx.checkpoint.structure import flatten, unflatten


def _roundtrip(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    data = bytearray(b"".join(bytes(b) for b in encode(tensors)))
    out, _ = decode(data, "mem")
    return out


def test_safetensors_roundtrip_all_kinds_of_tensors() -> None:
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
    out = _roundtrip(tensors)
    assert out.keys() == tensors.keys()
    for k, t in tensors.items():
        assert out[k].dtype == t.dtype and out[k].shape == t.shape and torch.equal(out[k], t), k


def test_tensors_are_aligned_to_their_element_size() -> None:
    tensors = {"a": torch.ones(3, dtype=torch.int8), "b": torch.ones(5, dtype=torch.float64)}
    out = _roundtrip(tensors)
    assert out["b"].data_ptr() % 8 == 0


def test_interoperates_with_the_safetensors_library(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    tensors = {"w": torch.randn(4, 3), "n": torch.arange(6, dtype=torch.int64)}
    ours = tmp_path / "ours.safetensors"
    ours.write_bytes(b"".join(bytes(b) for b in encode(tensors)))
    theirs = st.load_file(str(ours))
    assert all(torch.equal(theirs[k], tensors[k]) for k in tensors)
    st.save_file(tensors, str(tmp_path / "theirs.safetensors"))
    back, _ = decode(bytearray((tmp_path / "theirs.safetensors").read_bytes()), "theirs")
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)


def _file(header: dict[str, object], payload: bytes) -> bytearray:
    raw = json.dumps(header).encode()
    return bytearray(len(raw).to_bytes(8, "little") + raw + payload)


@pytest.mark.parametrize(
    ("header", "payload", "message"),
    [
        ({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "outside"),
        ({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}, b"\0" * 16, "needs 12"),
        ({"x": {"dtype": "PICKLE", "shape": [1], "data_offsets": [0, 1]}}, b"\0", "no valid"),
        ({"x": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}, b"\0", "invalid shape"),
        (
            {
                "x": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                "y": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]},
            },
            b"\0" * 6,
            "overlap",
        ),
    ],
)
def test_malformed_headers_are_rejected(
    header: dict[str, object], payload: bytes, message: str
) -> None:
    with pytest.raises(FormatError, match=message) as err:
        decode(_file(header, payload), "bad.safetensors")
    assert "bad.safetensors" in str(err.value)


def test_truncated_and_garbage_files_are_rejected() -> None:
    with pytest.raises(FormatError, match="too short"):
        decode(bytearray(b"\1\0"), "f")
    with pytest.raises(FormatError, match="header length"):
        decode(bytearray((10**9).to_bytes(8, "little") + b"{}"), "f")
    with pytest.raises(FormatError, match="not valid JSON"):
        decode(bytearray((4).to_bytes(8, "little") + b"{{{{"), "f")


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
