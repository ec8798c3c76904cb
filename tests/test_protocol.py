"""The wire protocol: exact round trips, zero-copy frames, and a typed error for every malformed
message. `decode` is the server's first line of defence: whatever bytes arrive, it either returns
a message or raises `ProtocolError`, never anything else."""

import dataclasses
import random
import re
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from common.errors import ProtocolError
from common.wire.protocol import (
    MAX_HEADER_BYTES,
    PROTOCOL_VERSION,
    WIRE_DTYPES,
    Commit,
    Error,
    Heartbeat,
    HeartbeatAck,
    Leave,
    MessageType,
    Pull,
    Push,
    PushAck,
    PushReady,
    Register,
    Roster,
    Status,
    StatusReply,
    Stop,
    Weights,
    Welcome,
    decode,
    encode,
)


def _tensor(dtype: torch.dtype, numel: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.int64:
        return torch.randint(-(2**62), 2**62, (numel,), generator=generator, dtype=torch.int64)
    return torch.randn(numel, generator=generator).to(dtype)


def _push(grads: torch.Tensor | None = None, buffers: torch.Tensor | None = None) -> Push:
    return Push(
        worker_id=3,
        token="0123abcd",
        version=17,
        epoch=2,
        batch=41,
        samples=64,
        loss_sum=123.456,
        correct=51,
        grads=_tensor(torch.float32, 37, seed=1) if grads is None else grads,
        grad_indices=torch.arange(37, dtype=torch.int32),
        buffers=_tensor(torch.float32, 5, seed=2) if buffers is None else buffers,
    )


def _weights(params: torch.Tensor, buffers: torch.Tensor) -> Weights:
    return Weights(
        version=9,
        epoch=1,
        batch=4,
        rank=1,
        world_size=3,
        push_granted=True,
        params=params,
        buffers=buffers,
    )


SCALAR_MESSAGES = [
    Register(shard=2, num_shards=3, endpoint="tcp://ps-2:5557", fingerprints={"lenet": "ab"}),
    Register(shard=1, num_shards=2, endpoint="tcp://ps-1:5557", fingerprints={}, proof="ab12"),
    Commit(
        leader_token="f00d",
        version=41,
        entries=[[3, "t", 41, 0, 7, 64], [5, "u", 41, 0, 7, 12]],
        expected=76,
        lr_scale=0.5,
    ),
    Commit(
        leader_token="f00d",
        version=42,
        entries=[],
        expected=76,
        lr_scale=1.0,
        epoch=1,
        batch=8,
        plan=[[3, "t", 38], [5, "u", 38]],
    ),
    Pull(worker_id=3, token="t", have_version=41, shard=2, min_version=41),
    Roster(leader_token="f00d", workers=[1, 4], next_id=6),
    PushAck(version=3, staleness=0, applied=True, shard=2),
    PushReady(worker_id=3, token="t"),
    PushAck(version=7, staleness=0, applied=False, go=True),
    Pull(worker_id=0, token="f00d", shard=1, min_version=-1, with_momentum=True),
    Register(
        worker_name="host:gpu0",
        hostname="host",
        device="cuda:0",
        pid=4242,
        process="9f86d081884c7d65",
        fingerprints={"resnet18": "0123456789abcdef", "lenet": "fedcba9876543210"},
    ),
    Welcome(
        worker_id=7,
        token="f00d",
        heartbeat_interval=0.5,
        job={"mode": "sync", "world_size": 4, "train_limit": None, "nested": {"a": [1, 2]}},
    ),
    Pull(worker_id=0, token="t"),
    Pull(worker_id=0, token="t", have_version=12),
    PushAck(version=100, staleness=3, applied=False),
    Leave(worker_id=4, token="t", reason="shutting down"),
    Heartbeat(worker_id=4, token="t"),
    HeartbeatAck(version=12),
    Stop(reason="training is over"),
    Error(code="bad-message", message="header must be a map; upgrade the worker"),
    Status(),
    StatusReply(status={"phase": "training", "step": 3, "staleness": None, "workers": [{}]}),
]


def _assert_same(decoded: Any, original: Any) -> None:
    assert type(decoded) is type(original)
    for field in dataclasses.fields(original):
        got, want = getattr(decoded, field.name), getattr(original, field.name)
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype, field.name
            assert got.shape == (want.numel(),), field.name
            # Bytes, not values: NaN payloads and -0.0 must survive too.
            assert got.view(torch.uint8).tolist() == want.reshape(-1).view(torch.uint8).tolist()
        else:
            assert type(got) is type(want), field.name
            assert got == want, field.name


def _header(frames: list[Any]) -> dict[str, Any]:
    return msgpack.unpackb(frames[0], raw=False)


def _with_header(frames: list[Any], header: dict[str, Any]) -> list[Any]:
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


# ---- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("message", SCALAR_MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip_scalar_messages(message: Any) -> None:
    frames = encode(message)
    assert len(frames) == 1
    _assert_same(decode(frames), message)


@pytest.mark.parametrize("dtype_name", sorted(WIRE_DTYPES))
@pytest.mark.parametrize("numel", [0, 1, 1000])
def test_round_trip_weights_every_wire_dtype(dtype_name: str, numel: int) -> None:
    dtype = WIRE_DTYPES[dtype_name]
    message = _weights(_tensor(dtype, numel, seed=3), _tensor(dtype, numel // 3, seed=4))
    frames = encode(message)
    assert len(frames) == 4  # every tensor field has its frame, an empty one too
    header = _header(frames)
    assert header["v"] == PROTOCOL_VERSION
    assert header["type"] == MessageType.WEIGHTS
    assert header["tensors"] == [
        ["params", dtype_name, numel],
        ["buffers", dtype_name, numel // 3],
        ["momentum", "float32", 0],
    ]
    _assert_same(decode(frames), message)


def test_round_trip_streamed_weights() -> None:
    part = dataclasses.replace(
        _weights(_tensor(torch.float32, 11, seed=5), torch.empty(0)), shard=2, bucket=3
    )
    frames = encode(part)
    assert [spec[2] for spec in _header(frames)["tensors"]] == [11, 0, 0]
    _assert_same(decode(frames), part)
    # A WEIGHTS for a worker that has every bucket: the parameters stay out.
    weights = dataclasses.replace(
        _weights(torch.empty(0), _tensor(torch.float32, 4)), streamed=True
    )
    _assert_same(decode(encode(weights)), weights)


def test_round_trip_push_with_special_floats() -> None:
    grads = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, 3.4e38])
    message = _push(grads=grads, buffers=torch.empty(0))
    decoded = decode(encode(message))
    _assert_same(decoded, message)
    assert isinstance(decoded, Push)
    assert decoded.buffers.numel() == 0
    assert decoded.loss_sum == 123.456


def test_round_trip_from_memoryview_frames() -> None:
    # The server hands `decode` zmq.Frame buffers (memoryviews), not bytes.
    message = _push()
    frames = [memoryview(bytes(frame)) for frame in encode(message)]
    _assert_same(decode(frames), message)


def test_encode_flattens_multidimensional_and_non_contiguous_tensors() -> None:
    params = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # non-contiguous
    decoded = decode(encode(_weights(params, torch.ones(2, 2))))
    assert isinstance(decoded, Weights)
    assert decoded.params.tolist() == params.reshape(-1).tolist()
    assert decoded.buffers.tolist() == [1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("dtype_name", sorted(WIRE_DTYPES))
def test_encode_is_zero_copy(dtype_name: str) -> None:
    params = _tensor(WIRE_DTYPES[dtype_name], 257, seed=5)
    frames = encode(_weights(params, torch.zeros(0, dtype=params.dtype)))
    frame = frames[1]
    assert isinstance(frame, memoryview)
    array = np.asarray(frame)
    assert np.shares_memory(array, params.view(torch.uint8).numpy())
    assert array.ctypes.data == params.data_ptr()
    assert frame.nbytes == params.numel() * params.element_size()
    # Proof by mutation: the frame sees a later write to the tensor.
    params.view(torch.uint8)[0] ^= 0xFF
    assert array[0] == params.view(torch.uint8)[0].item()


def test_decode_is_zero_copy() -> None:
    frames = encode(_push())
    received = [bytes(frame) for frame in frames]
    decoded = decode(received)
    assert isinstance(decoded, Push)
    assert decoded.grads.data_ptr() == np.frombuffer(received[1], np.uint8).ctypes.data
    assert decoded.grad_indices.data_ptr() == np.frombuffer(received[2], np.uint8).ctypes.data
    assert decoded.buffers.data_ptr() == np.frombuffer(received[3], np.uint8).ctypes.data


def test_encode_refuses_non_wire_dtype() -> None:
    with pytest.raises(ValueError, match="not a wire dtype"):
        encode(_weights(torch.zeros(3, dtype=torch.float64), torch.zeros(0)))


# ---- malformed input -------------------------------------------------------------------------


def _valid_push_frames() -> list[Any]:
    return [bytes(frame) for frame in encode(_push())]


def test_empty_frame_list() -> None:
    with pytest.raises(ProtocolError, match="empty message"):
        decode([])


@pytest.mark.parametrize("garbage", [b"", b"\xc1", b"\x92\x01", b"\xff\xfe\xfd not msgpack"])
def test_header_not_msgpack(garbage: bytes) -> None:
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        decode([garbage])


def test_header_with_trailing_bytes() -> None:
    frames = _valid_push_frames()
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        decode([frames[0] + b"\x00", *frames[1:]])


@pytest.mark.parametrize(
    "header",
    [
        [1, 5, {}, []],
        "a string",
        42,
        None,
        {"v": 1, "type": 5, "body": {}},
        {"v": 1, "type": 5, "body": {}, "tensors": [], "extra": 0},
        {"version": 1, "type": 5, "body": {}, "tensors": []},
    ],
    ids=["list", "str", "int", "nil", "missing-key", "extra-key", "wrong-key"],
)
def test_header_not_a_map_with_the_right_keys(header: Any) -> None:
    with pytest.raises(ProtocolError, match="exactly the keys v, type, body, tensors"):
        decode([msgpack.packb(header)])


def test_header_with_non_string_key() -> None:
    raw = msgpack.packb({1: 1, "type": 5, "body": {}, "tensors": []})
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        decode([raw])


def test_the_kinds_are_numbered_without_gaps() -> None:
    """Codes 1..N, each documented (below): a gap is a kind that was dropped without the
    renumbering a new protocol version allows."""
    assert [kind.value for kind in MessageType] == list(range(1, len(MessageType) + 1))


def test_the_protocol_page_shows_the_version_and_kinds_spoken() -> None:
    """The protocol page showed "v": 6 after the protocol had moved on to 7: someone writing
    a client from it would have been refused by every server. Its table of kinds must name
    every kind with its code, and no other."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "protocol.md").read_text()
    shown = re.findall(r'msgpack map \{"v": (\d+),', page)
    assert shown == [str(PROTOCOL_VERSION)], shown
    listed = re.findall(r"^\| (\d+) ([A-Z_]+) \|", page, flags=re.MULTILINE)
    assert listed == [(str(kind.value), kind.name) for kind in MessageType], listed


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION + 1, "1", None])
def test_wrong_protocol_version(version: Any) -> None:
    frames = _valid_push_frames()
    header = _header(frames)
    header["v"] = version
    with pytest.raises(ProtocolError, match=f"version {version!r} is not supported") as info:
        decode(_with_header(frames, header))
    assert f"speaks version {PROTOCOL_VERSION}" in str(info.value)


@pytest.mark.parametrize(
    "message_type", [0, len(MessageType) + 1, 99, -1, 2**40, "PUSH", None, [5], 5.0, True]
)
def test_unknown_message_type(message_type: Any) -> None:
    frames = _valid_push_frames()
    header = _header(frames)
    header["type"] = message_type
    with pytest.raises(ProtocolError, match="unknown message type"):
        decode(_with_header(frames, header))


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("body", [], "body must be a map"),
        ("tensors", {}, "tensors a list"),
    ],
)
def test_body_and_tensors_containers(key: str, value: Any, expected: str) -> None:
    frames = _valid_push_frames()
    header = _header(frames)
    header[key] = value
    with pytest.raises(ProtocolError, match=expected):
        decode(_with_header(frames, header))


def test_missing_body_field() -> None:
    frames = _valid_push_frames()
    header = _header(frames)
    del header["body"]["samples"]
    with pytest.raises(ProtocolError, match="Push body must have fields") as info:
        decode(_with_header(frames, header))
    assert "'samples'" in str(info.value)


def test_extra_body_field() -> None:
    frames = _valid_push_frames()
    header = _header(frames)
    header["body"]["admin"] = True
    with pytest.raises(ProtocolError, match="Push body must have fields") as info:
        decode(_with_header(frames, header))
    assert "'admin'" in str(info.value)


def test_body_keys_mixing_str_and_bytes() -> None:
    # Regression: the error message sorted the keys, and str < bytes raised TypeError.
    frames = _valid_push_frames()
    header = _header(frames)
    header["body"][b"samples"] = 1
    with pytest.raises(ProtocolError, match="Push body must have fields") as info:
        decode(_with_header(frames, header))
    assert "b'samples'" in str(info.value)


def test_tensor_field_in_body_is_refused() -> None:
    frames = _valid_push_frames()
    header = _header(frames)
    header["body"]["grads"] = b"\x00" * 4
    with pytest.raises(ProtocolError, match="Push body must have fields"):
        decode(_with_header(frames, header))


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("worker_id", "3", "Push.worker_id must be int, got str"),
        ("version", True, "Push.version must be int, got bool"),
        ("samples", 64.0, "Push.samples must be int, got float"),
        ("correct", None, "Push.correct must be int, got NoneType"),
        ("loss_sum", "1.5", "Push.loss_sum must be float, got str"),
        ("loss_sum", False, "Push.loss_sum must be float, got bool"),
    ],
)
def test_wrong_field_type(field: str, value: Any, expected: str) -> None:
    frames = _valid_push_frames()
    header = _header(frames)
    header["body"][field] = value
    with pytest.raises(ProtocolError, match=expected):
        decode(_with_header(frames, header))


def test_wrong_field_type_in_scalar_messages() -> None:
    with pytest.raises(ProtocolError, match=r"Stop\.reason must be str, got int"):
        decode(
            [
                msgpack.packb(
                    {"v": PROTOCOL_VERSION, "type": 7, "body": {"reason": 3}, "tensors": []}
                )
            ]
        )
    body = {"worker_id": 1, "token": "t", "heartbeat_interval": 1.0, "job": [1, 2]}
    with pytest.raises(ProtocolError, match=r"Welcome\.job must be dict, got list"):
        decode([msgpack.packb({"v": PROTOCOL_VERSION, "type": 2, "body": body, "tensors": []})])


def test_float_field_accepts_int() -> None:
    frames = _valid_push_frames()
    header = _header(frames)
    header["body"]["loss_sum"] = 7
    decoded = decode(_with_header(frames, header))
    assert isinstance(decoded, Push)
    assert type(decoded.loss_sum) is float
    assert decoded.loss_sum == 7.0


def test_too_few_frames() -> None:
    frames = _valid_push_frames()
    with pytest.raises(ProtocolError, match="Push needs 4 frames, got 3"):
        decode(frames[:3])
    with pytest.raises(ProtocolError, match="Push needs 4 frames, got 1"):
        decode(frames[:1])


def test_too_many_frames() -> None:
    frames = _valid_push_frames()
    with pytest.raises(ProtocolError, match="Push needs 4 frames, got 5"):
        decode([*frames, b""])
    stop = encode(Stop(reason="done"))
    with pytest.raises(ProtocolError, match="Stop needs 1 frame, got 2"):
        decode([*stop, b"\x00"])


def test_tensor_spec_count_mismatch() -> None:
    frames = _valid_push_frames()
    header = _header(frames)
    header["tensors"] = header["tensors"][:1]
    with pytest.raises(ProtocolError, match="Push carries tensors"):
        decode(_with_header(frames, header))


@pytest.mark.parametrize("spec", [["grads", "float32"], "grads", ["grads", "float32", 37, 0]])
def test_malformed_tensor_spec(spec: Any) -> None:
    frames = _valid_push_frames()
    header = _header(frames)
    header["tensors"][0] = spec
    with pytest.raises(ProtocolError, match=r"tensor spec must be \[name, dtype, numel\]"):
        decode(_with_header(frames, header))


def test_tensor_name_mismatch() -> None:
    frames = _valid_push_frames()
    header = _header(frames)
    header["tensors"][0][0] = "params"
    with pytest.raises(ProtocolError, match="expected tensor 'grads', got 'params'"):
        decode(_with_header(frames, header))


def test_tensors_in_wrong_order() -> None:
    frames = _valid_push_frames()
    header = _header(frames)
    header["tensors"].reverse()
    with pytest.raises(ProtocolError, match="expected tensor 'grads', got 'buffers'"):
        decode(_with_header(frames, header))


@pytest.mark.parametrize(
    "dtype_name",
    # Unhashable values are a regression: `dtype in WIRE_DTYPES` raised TypeError for them.
    ["float64", "object", "uint8", "", "torch.float32", 7, None, ["float32"], {"a": 1}],
)
def test_dtype_not_in_allow_list(dtype_name: Any) -> None:
    frames = _valid_push_frames()
    header = _header(frames)
    header["tensors"][0][1] = dtype_name
    with pytest.raises(ProtocolError, match="allowed: ") as info:
        decode(_with_header(frames, header))
    assert repr(dtype_name) in str(info.value)


@pytest.mark.parametrize("numel", [-1, -(2**40), 37.0, "37", True, None])
def test_invalid_numel(numel: Any) -> None:
    frames = _valid_push_frames()
    header = _header(frames)
    header["tensors"][0][2] = numel
    with pytest.raises(ProtocolError, match="invalid element count"):
        decode(_with_header(frames, header))


def test_truncated_tensor_frame() -> None:
    frames = _valid_push_frames()
    with pytest.raises(ProtocolError, match="needs 148 bytes, the frame has 147"):
        decode([frames[0], frames[1][:-1], frames[2], frames[3]])


def test_tensor_frame_with_one_extra_byte() -> None:
    frames = _valid_push_frames()
    with pytest.raises(ProtocolError, match="needs 20 bytes, the frame has 21"):
        decode([frames[0], frames[1], frames[2], frames[3] + b"\x00"])


def test_numel_disagrees_with_frame() -> None:
    frames = _valid_push_frames()
    header = _header(frames)
    header["tensors"][0][2] = 2**62  # would overflow a naive size computation
    with pytest.raises(ProtocolError, match="the frame has 148"):
        decode(_with_header(frames, header))
    header["tensors"][0][2] = 0
    with pytest.raises(ProtocolError, match="needs 0 bytes, the frame has 148"):
        decode(_with_header(frames, header))


def test_dtype_disagrees_with_frame() -> None:
    frames = _valid_push_frames()
    header = _header(frames)
    header["tensors"][0][1] = "int64"  # 37 x 8 bytes, but the frame holds 37 x 4
    with pytest.raises(ProtocolError, match="37 x int64 needs 296 bytes, the frame has 148"):
        decode(_with_header(frames, header))


def test_header_over_size_limit() -> None:
    message = Stop(reason="x" * MAX_HEADER_BYTES)
    frames = encode(message)
    assert len(frames[0]) > MAX_HEADER_BYTES
    with pytest.raises(ProtocolError, match=f"the limit is {MAX_HEADER_BYTES}"):
        decode(frames)


def test_header_just_under_size_limit_is_accepted() -> None:
    overhead = len(encode(Stop(reason=""))[0]) + 4  # a str of this size has a 5-byte prefix
    message = Stop(reason="y" * (MAX_HEADER_BYTES - overhead))
    frames = encode(message)
    assert len(frames[0]) == MAX_HEADER_BYTES
    _assert_same(decode(frames), message)


# ---- property: garbage in, ProtocolError out -------------------------------------------------


def _mutate(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    frames = list(frames)
    kind = rng.randrange(6)
    index = 0 if rng.random() < 0.7 else rng.randrange(len(frames))
    data = bytearray(frames[index])
    if kind == 0 and data:  # flip some bytes
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif kind == 1:  # truncate
        del data[rng.randint(0, len(data)) :]
    elif kind == 2:  # insert bytes
        at = rng.randint(0, len(data))
        data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
    elif kind == 3 and data:  # delete a byte
        del data[rng.randrange(len(data))]
    elif kind == 4:  # drop or duplicate a frame
        if rng.random() < 0.5:
            del frames[rng.randrange(len(frames))]
        else:
            frames.insert(rng.randrange(len(frames) + 1), frames[rng.randrange(len(frames))])
        return frames
    else:  # replace by random bytes of the same length
        data = bytearray(rng.randbytes(len(data)))
    if index < len(frames):
        frames[index] = bytes(data)
    return frames


_ODD_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    2**63,
    1.5,
    float("nan"),
    "",
    "float32",
    "grads",
    b"\x00",
    [],
    [1],
    {},
    {"a": 1},
    {b"k": 1},
    ["grads", "float32", 37],
    msgpack.ExtType(1, b"x"),
]


def _mutate_header(rng: random.Random, header: Any) -> Any:
    """Replace one value somewhere in the decoded header tree with an odd value."""
    if isinstance(header, dict) and header and rng.random() < 0.8:
        key = rng.choice(list(header))
        if rng.random() < 0.1:
            del header[key]
        else:
            header[key] = _mutate_header(rng, header[key])
        return header
    if isinstance(header, list) and header and rng.random() < 0.8:
        index = rng.randrange(len(header))
        header[index] = _mutate_header(rng, header[index])
        return header
    return rng.choice(_ODD_VALUES)


def test_random_header_values_raise_only_protocol_error() -> None:
    rng = random.Random(7)
    original = _valid_push_frames()
    refused = 0
    for trial in range(2000):
        header = _mutate_header(rng, _header(original))
        frames = _with_header(original, header)
        try:
            decode(frames)
        except ProtocolError:
            refused += 1
        except Exception as exc:
            pytest.fail(f"trial {trial}: {type(exc).__name__}: {exc} for header {header!r}")
    assert refused > 1500, refused


def test_random_mutations_raise_only_protocol_error() -> None:
    rng = random.Random(20240521)
    original = _valid_push_frames()
    outcomes = {"decoded": 0, "refused": 0}
    for trial in range(2000):
        frames = _mutate(rng, original)
        try:
            message = decode(frames)
        except ProtocolError:
            outcomes["refused"] += 1
        except Exception as exc:
            pytest.fail(f"trial {trial}: {type(exc).__name__}: {exc} for frames {frames!r}")
        else:
            outcomes["decoded"] += 1
            # Whatever got through is a well-formed message of a known type.
            assert type(message) in (Register, Welcome, Pull, Weights, Push, PushAck, Stop, Error)
    # The mutations must be able to hit both outcomes, or the test is testing nothing.
    assert outcomes["refused"] > 500, outcomes
    assert outcomes["decoded"] > 50, outcomes


def test_a_fingerprint_map_holds_strings_only() -> None:
    """A REGISTER's fingerprints nested 1000 deep used to reach the server's error message,
    whose repr of them blew the stack ("internal"); a fingerprint is a string."""
    deep: Any = []
    for _ in range(1000):
        deep = [deep]
    frames = encode(Register("w", "h", "cpu", 1, "p", {"lenet": "ab12"}))
    header = msgpack.unpackb(frames[0])
    header["body"]["fingerprints"] = {"lenet": deep}
    with pytest.raises(ProtocolError, match="must map strings to strings"):
        decode([msgpack.packb(header, use_bin_type=True)])


@pytest.mark.parametrize("process", [1, None, b"9f86", ["9f86"], {"a": "b"}])
def test_a_register_process_identity_is_a_string(process: Any) -> None:
    frames = encode(Register("w", "h", "cpu", 1, "9f86d081884c7d65", {"lenet": "ab12"}))
    header = msgpack.unpackb(frames[0])
    header["body"]["process"] = process
    with pytest.raises(ProtocolError, match=r"Register\.process must be str, got"):
        decode([msgpack.packb(header, use_bin_type=True)])


def test_a_register_from_before_process_identities_is_refused_by_its_version() -> None:
    """A worker of the release before (protocol 7) sends no process identity: it hears that
    its version is not spoken, not which field it left out."""
    frames = encode(Register("w", "h", "cpu", 1, "9f86d081884c7d65", {"lenet": "ab12"}))
    header = msgpack.unpackb(frames[0])
    header["v"] = 7
    del header["body"]["process"]
    with pytest.raises(ProtocolError, match="protocol version 7 is not supported"):
        decode([msgpack.packb(header, use_bin_type=True)])


@pytest.mark.parametrize("workers", [[1, "2"], [1, True], [[3]], [1.0]])
def test_a_roster_lists_integer_ids_only(workers: list[Any]) -> None:
    frames = encode(Roster("f00d", [1, 2], 3))
    header = msgpack.unpackb(frames[0])
    header["body"]["workers"] = workers
    with pytest.raises(ProtocolError, match=r"Roster\.workers must be a list of integers"):
        decode([msgpack.packb(header, use_bin_type=True)])


# ---- REGISTER and WELCOME: a worker's form and a follower shard's -----------------------------


def _shard_register() -> Register:
    return Register(
        shard=1, num_shards=2, endpoint="tcp://ps-1:5556", fingerprints={"lenet": "ab"}, proof="0f"
    )


def _shard_welcome() -> Welcome:
    return Welcome(
        shard=1,
        job={"mode": "sync", "shard_bounds": [0, 10, 20]},
        optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.0},
        leader_token="f00d",
        version=12,
        slice_wait=30.0,
        max_staged=4,
        params=_tensor(torch.float32, 10, seed=3),
        momentum=_tensor(torch.float32, 10, seed=4),
        stream_weights=True,
        worker_key="beef",
    )


def test_a_follower_shards_welcome_round_trips_with_its_slice() -> None:
    message = _shard_welcome()
    frames = encode(message)
    assert len(frames) == 3  # the header, params, momentum
    assert sorted(_header(frames)["body"]) == [
        "job", "leader_token", "max_staged", "optimizer", "shard", "slice_wait",
        "stream_weights", "version", "worker_key",
    ]  # fmt: skip
    decoded = decode(frames)
    _assert_same(decoded, message)
    assert isinstance(decoded, Welcome) and decoded.form == "shard"


def test_each_form_sends_its_own_fields_only() -> None:
    """A worker's REGISTER and WELCOME are what they were before followers used them."""
    worker = encode(Register("w", "h", "cpu", 1, "p", {"lenet": "ab"}))
    assert sorted(_header(worker)["body"]) == [
        "device", "fingerprints", "hostname", "pid", "process", "worker_name",
    ]  # fmt: skip
    assert sorted(_header(encode(_shard_register()))["body"]) == [
        "endpoint", "fingerprints", "num_shards", "proof", "shard",
    ]  # fmt: skip
    assert sorted(_header(encode(Welcome(1, "t", 1.0, {})))["body"]) == [
        "heartbeat_interval", "job", "token", "worker_id",
    ]  # fmt: skip


def _body_changed(message: Any, **changes: Any) -> list[Any]:
    frames = encode(message)
    header = _header(frames)
    for name, value in changes.items():
        if value is None:
            del header["body"][name]
        else:
            header["body"][name] = value
    return _with_header(frames, header)


@pytest.mark.parametrize(
    ("frames", "expected"),
    [
        (  # a worker's REGISTER with a follower's fields
            _body_changed(Register("w", "h", "cpu", 1, "p", {}), shard=1, proof=""),
            "Register body must have the fields of one sender",
        ),
        (  # a follower's REGISTER without its proof
            _body_changed(_shard_register(), proof=None),
            "Register body must have the fields of one sender",
        ),
        (  # a follower's REGISTER with a worker's process identity
            _body_changed(_shard_register(), process="9f86"),
            "Register body must have the fields of one sender",
        ),
        (  # a follower's REGISTER as shard 0, the leader
            _body_changed(_shard_register(), shard=0),
            "a follower shard's Register has shard 1 or more, got 0",
        ),
        (
            _body_changed(_shard_register(), shard=-3),
            "a follower shard's Register has shard 1 or more, got -3",
        ),
        (  # a worker's WELCOME with a follower's leader token
            _body_changed(Welcome(1, "t", 1.0, {}), leader_token="f00d"),
            "Welcome body must have the fields of one sender",
        ),
        (  # a follower's WELCOME without its worker key
            _body_changed(_shard_welcome(), worker_key=None),
            "Welcome body must have the fields of one sender",
        ),
        (  # a follower's WELCOME without its slice's frames
            [encode(_shard_welcome())[0]],
            "Welcome needs 3 frames, got 1",
        ),
        (  # a worker's WELCOME with a follower's frames
            [encode(Welcome(1, "t", 1.0, {}))[0], b"", b""],
            "Welcome needs 1 frame, got 3",
        ),
    ],
)
def test_a_register_or_welcome_whose_fields_fit_no_sender_is_refused(
    frames: list[Any], expected: str
) -> None:
    with pytest.raises(ProtocolError, match=re.escape(expected)) as info:
        decode(frames)
    if "one sender" in expected:  # it says what each sender's form holds
        assert "a worker's [" in str(info.value) and "a follower shard's [" in str(info.value)


def test_encode_refuses_a_field_of_the_other_form() -> None:
    with pytest.raises(ValueError, match=r"Register\.process is not a field of a follower"):
        encode(Register(process="9f86", shard=1, num_shards=2, endpoint="tcp://h:1"))
    with pytest.raises(ValueError, match=r"Welcome\.params is not a field of a worker's WELCOME"):
        encode(Welcome(1, "t", 1.0, {}, params=torch.ones(3)))
