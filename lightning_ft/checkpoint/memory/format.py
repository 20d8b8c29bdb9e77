"""On-disk (in-shm) layout of one snapshot file, and its encode / verify / decode steps (the
copy of the tensor bytes into a file is :mod:`.copying`'s).

Layout (little endian), format version 2::

    [0, 128)            header: magic, version, step, sizes, crc32 of the body, crc32 of itself
    [128, +ident_len)   identity: UTF-8 JSON {"model", "rank", "run_id"} (see identity.py)
    [sums_off, meta_off) per-block sums of the data region (int64, one per BLOCK_SIZE bytes);
                        sums_off is 8-byte aligned
    [meta_off, +len)    pickled metadata; tensors are replaced by placeholders (persistent ids)
    [data_off, end)     flat data region (data_off is page aligned); each tensor's bytes at its
                        64-byte aligned offset

Integrity: crc32 covers the identity, the block-sum table and the metadata; the data region is
covered by wrap-around int64 sums over 1 MiB blocks. The sums are a single bandwidth-bound torch
reduction (~30 GB/s here) where zlib.crc32 runs at ~2.4 GB/s and would cost 3x the copy
itself. The sums detect truncation (also caught by the size check), any single flipped
bit or byte, zeroed or stale pages and data shifted between blocks; they do not detect
8-byte words swapped within one block (not a failure mode of a torn or partial write).

Decoding runs no code from the file: the metadata is read by a restricted unpickler
(:mod:`lightning_ft.checkpoint.restricted_pickle`) and tensor placeholders are checked against
the data region. What the loader would refuse is refused at save time already (tensors without
a flat layout, globals outside the allow-list), so a save never produces a snapshot that cannot
be resumed.
"""

from __future__ import annotations

import functools
import io
import json
import math
import pickle
import struct
import warnings
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_ft.checkpoint.identity import SnapshotIdentity, model_fingerprint
from lightning_ft.checkpoint.restricted_pickle import (
    DisallowedGlobal,
    RefusedEffect,
    RestrictedUnpickler,
    check_effects,
)

MAGIC = b"LFTSNAP\x01"
VERSION = 2
HEADER_SIZE = 128
BLOCK_SIZE = 1 << 20
TENSOR_ALIGN = 64
PAGE = 4096
MAX_IDENTITY_BYTES = 4096

# Every version starts with magic, version, header_size, so an old file is named as such.
_PREFIX = struct.Struct("<8sII")
# magic, version, header_size, step, created, file_size, ident_len, meta_off, meta_len, data_off,
# data_len, block_size, nblocks, body_crc
_HEADER = struct.Struct("<8sIIqdQQQQQQQQI")
_HEADER_CRC = struct.Struct("<I")
#: bytes of the header's fields, followed by their CRC-32 (then zero padding up to HEADER_SIZE)
HEADER_FIELDS_SIZE = _HEADER.size


class SnapshotError(Exception):
    """A snapshot file is torn, corrupt, not a snapshot, or cannot be loaded safely; the message says why."""


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Header:
    step: int
    created: float
    file_size: int
    ident_len: int
    meta_off: int
    meta_len: int
    data_off: int
    data_len: int
    block_size: int
    nblocks: int
    body_crc: int

    @property
    def sums_off(self) -> int:
        return self.meta_off - 8 * self.nblocks

    def crc(self) -> int:
        """CRC-32 of the header's fields: the value stored right after them (it names one exact
        snapshot: its step, creation time, sizes and, through the body CRC, its content)."""
        return zlib.crc32(self.pack()[: _HEADER.size])

    def pack(self) -> bytes:
        raw = _HEADER.pack(MAGIC, VERSION, HEADER_SIZE, self.step, self.created, self.file_size, self.ident_len,
                           self.meta_off, self.meta_len, self.data_off, self.data_len, self.block_size, self.nblocks,
                           self.body_crc)
        raw += _HEADER_CRC.pack(zlib.crc32(raw))
        return raw.ljust(HEADER_SIZE, b"\0")

    @classmethod
    def unpack(cls, buf: Any) -> Header:
        mv = memoryview(buf)
        if len(mv) < HEADER_SIZE:
            raise SnapshotError(f"file too short for a header ({len(mv)} < {HEADER_SIZE} bytes)")
        magic, version, header_size = _PREFIX.unpack(bytes(mv[: _PREFIX.size]))
        if magic != MAGIC:
            raise SnapshotError("bad magic (not a snapshot file)")
        if version != VERSION or header_size != HEADER_SIZE:
            raise SnapshotError(f"snapshot format version {version}, this lightning_ft reads version {VERSION} "
                                f"only (written by another lightning_ft version; not loaded)")
        raw = bytes(mv[: _HEADER.size])
        (crc,) = _HEADER_CRC.unpack(bytes(mv[_HEADER.size: _HEADER.size + _HEADER_CRC.size]))
        if crc != zlib.crc32(raw):
            raise SnapshotError("header checksum mismatch")
        (_, _, _, step, created, file_size, ident_len, meta_off, meta_len, data_off, data_len, block_size, nblocks,
         body_crc) = _HEADER.unpack(raw)
        if not (0 < ident_len <= MAX_IDENTITY_BYTES and block_size > 0 and block_size % 8 == 0
                and _align(HEADER_SIZE + ident_len, 8) + 8 * nblocks == meta_off
                and meta_off + meta_len <= data_off and data_off + data_len == file_size and data_len % 8 == 0
                and nblocks == -(-data_len // block_size) and step >= 0):
            raise SnapshotError("inconsistent header fields")
        return cls(step, created, file_size, ident_len, meta_off, meta_len, data_off, data_len, block_size, nblocks,
                   body_crc)


# ---------------------------------------------------------------------------------------
# Identity record
# ---------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=16)  # the same few values at every save of a job
def encode_identity(run_id: str, rank: int, model: str) -> bytes:
    raw = json.dumps({"model": model, "rank": rank, "run_id": run_id}, sort_keys=True,
                     separators=(",", ":")).encode()
    if len(raw) > MAX_IDENTITY_BYTES:
        raise SnapshotError(f"run id too long for a snapshot ({len(run_id)} characters)")
    return raw


def decode_identity(raw: bytes, step: int) -> SnapshotIdentity:
    try:
        record = json.loads(raw)
        run_id, rank, model = record["run_id"], record["rank"], record["model"]
    except (ValueError, TypeError, KeyError) as exc:
        raise SnapshotError(f"bad identity record: {exc}") from None
    if not (isinstance(run_id, str) and type(rank) is int and isinstance(model, str)):
        raise SnapshotError("bad identity record: wrong field types")
    return SnapshotIdentity(run_id=run_id, rank=rank, step=step, model=model)


# ---------------------------------------------------------------------------------------
# Metadata pickling: tensors become placeholders, everything else is pickled as usual.
# Using pickle's persistent-id hook (as torch.save does) handles every container type —
# OrderedDict, namedtuple, dataclasses, hparams objects — without our own tree walker.
# ---------------------------------------------------------------------------------------

_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def unsupported_tensor(tensor: torch.Tensor) -> str | None:
    """What a tensor is when our format cannot store it as flat bytes (None: it can).

    Pickled the torch way instead, such tensors would need globals (and for some, an
    unrestricted ``torch.load``) that the restricted loader refuses.
    """
    if type(tensor) not in _PLAIN_TENSOR_TYPES:
        return f"a {type(tensor).__module__}.{type(tensor).__qualname__} (a tensor subclass)"
    if tensor.layout != torch.strided:
        return f"a {str(tensor.layout).removeprefix('torch.')} tensor"
    if tensor.is_quantized:
        return "a quantized tensor"
    if tensor.is_nested:
        return "a nested tensor"
    if tensor.is_meta:
        return "a meta tensor (it has no data)"
    return None


def _shape_text(tensor: torch.Tensor) -> str:
    try:
        return str(tuple(tensor.shape))
    except RuntimeError:  # nested tensors have no single shape
        return "irregular"


class _UnsupportedTensor(Exception):
    def __init__(self, tensor: torch.Tensor, what: str) -> None:
        super().__init__(what)
        self.tensor = tensor
        self.what = what


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=5)
        self.tensors: list[tuple[torch.Tensor, int]] = []
        self.data_len = 0
        self._memo: dict[int, tuple] = {}

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return None
        pid = self._memo.get(id(obj))
        if pid is None:
            # the common case inline (this runs for every tensor of every save)
            if not (type(obj) in _PLAIN_TENSOR_TYPES and obj.layout is torch.strided and not obj.is_quantized
                    and not obj.is_nested and not obj.is_meta):
                raise _UnsupportedTensor(obj, unsupported_tensor(obj) or "an unsupported tensor")
            nbytes = obj.numel() * obj.element_size()
            offset = self.data_len
            self.data_len = _align(offset + nbytes, TENSOR_ALIGN)
            is_param = isinstance(obj, torch.nn.Parameter)
            pid = ("t", len(self.tensors), str(obj.dtype).removeprefix("torch."), tuple(obj.shape), offset,
                   nbytes, is_param, bool(obj.requires_grad) if is_param else False)
            # self.tensors keeps obj alive, so its id cannot be reused by another object
            self._memo[id(obj)] = pid
            self.tensors.append((obj, offset))
        return pid


def parse_placeholder(pid: Any, data_len: int) -> tuple[Any, torch.dtype, tuple, int, int, Any, Any]:
    """Check a tensor placeholder read from a file against the data region (SnapshotError if bad):
    (index, dtype, shape, offset, nbytes, is_param, requires_grad).

    What matters is checked here, once per tensor at every load: a known dtype, and a byte range
    inside the data region that is exactly the shape's size, so nothing larger than the file is
    ever allocated. Malformed dimensions or flags (negative, not ints) are refused by
    ``torch.empty`` and ``Parameter`` themselves, and reported as a decoding failure.
    """
    try:
        kind, index, dtype_name, shape, offset, nbytes, is_param, requires_grad = pid
        dtype = _DTYPES[dtype_name]
        fits = (kind == "t" and type(shape) is tuple and nbytes == math.prod(shape) * dtype.itemsize
                and 0 <= offset <= data_len - nbytes)
    except (TypeError, ValueError, KeyError):
        fits = False
    if not fits:
        raise SnapshotError(f"bad tensor placeholder {pid!r}: not a tensor of the data region")
    return index, dtype, shape, offset, nbytes, is_param, requires_grad


class _Unpickler(RestrictedUnpickler):
    """Restricted unpickler whose tensor placeholders are resolved by ``resolve(pid)``."""

    def __init__(self, file: io.BytesIO, resolve: Callable[[Any], torch.Tensor]) -> None:
        # set before the base __init__, which is where the C unpickler looks the hook up: it then
        # calls ``resolve`` directly, one Python frame per tensor instead of three
        self.persistent_load = resolve  # type: ignore[method-assign,assignment]  # pickle takes an attribute too
        super().__init__(file)


class _DataRegion:
    """Resolves placeholders to fresh tensors copied out of a file's data region (uint8 view)."""

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data
        self._len = data.numel()
        self._loaded: dict[int, torch.Tensor] = {}

    def __call__(self, pid: Any) -> torch.Tensor:
        index, dtype, shape, offset, nbytes, is_param, requires_grad = parse_placeholder(pid, self._len)
        tensor = self._loaded.get(index)
        if tensor is None:
            tensor = torch.empty(shape, dtype=dtype)
            if nbytes:
                flat = tensor.reshape(-1).view(torch.uint8)
                flat.copy_(self._data[offset: offset + nbytes])
            if is_param:
                tensor = torch.nn.Parameter(tensor, requires_grad=requires_grad)
            self._loaded[index] = tensor
        return tensor


class _ShapesOnly:
    """Resolves placeholders to data-less tensors (the ``meta`` device) of the recorded dtype
    and shape: the metadata is checked without reading or copying the data region."""

    def __init__(self, data_len: int) -> None:
        self._len = data_len

    def __call__(self, pid: Any) -> torch.Tensor:
        _, dtype, shape, _, _, is_param, requires_grad = parse_placeholder(pid, self._len)
        tensor = torch.empty(shape, dtype=dtype, device="meta")
        return torch.nn.Parameter(tensor, requires_grad=requires_grad) if is_param else tensor


def _unpickle(meta: bytes, resolve: Callable[[Any], torch.Tensor]) -> Any:
    try:
        check_effects(meta)
        return _Unpickler(io.BytesIO(meta), resolve).load()
    except RefusedEffect as exc:
        raise SnapshotError(f"snapshot metadata refused: {exc}") from None
    except DisallowedGlobal as exc:
        raise SnapshotError(f"snapshot metadata refused: {exc}") from None
    except SnapshotError:
        raise
    except Exception as exc:  # noqa: BLE001 - any other decoding failure is a bad file, said as such
        raise SnapshotError(f"snapshot metadata cannot be decoded: {type(exc).__name__}: {exc}") from None


def _path_to(root: Any, target: Any, depth: int = 12) -> str | None:
    """Where ``target`` sits inside nested dicts/lists/tuples of ``root``, e.g. ``['state_dict']['w']``."""
    if root is target:
        return ""
    if depth == 0:
        return None
    items: Iterable[tuple[Any, Any]]
    if isinstance(root, dict):
        items = root.items()
    elif isinstance(root, (list, tuple)):
        items = enumerate(root)
    else:
        return None
    for key, value in items:
        sub = _path_to(value, target, depth - 1)
        if sub is not None:
            return f"[{key!r}]{sub}"
    return None


@dataclass
class Encoded:
    """A snapshot whose metadata is serialized; the tensor bytes are still to be copied."""

    identity: bytes
    meta: bytes
    tensors: list[tuple[torch.Tensor, int]]
    meta_off: int
    data_off: int
    data_len: int
    nblocks: int

    @property
    def file_size(self) -> int:
        return self.data_off + self.data_len


def encode(obj: Any, run_id: str = "", rank: int = 0, check_loadable: bool = True) -> Encoded:
    """Pickle ``obj`` with tensor placeholders and compute the file layout.

    ``run_id`` (``""``: none configured) and ``rank`` go into the identity record with the
    fingerprint of ``obj["state_dict"]``. Raises SnapshotError, naming where, for a tensor the
    format cannot hold and (``check_loadable``: decoding the metadata once as a load would, ~10 %
    of the pickling time) for a global the restricted loader would refuse.
    """
    buf = io.BytesIO()
    pickler = _Pickler(buf)
    try:
        pickler.dump(obj)
    except _UnsupportedTensor as exc:
        where = _path_to(obj, exc.tensor)
        raise SnapshotError(
            f"cannot snapshot {exc.what}{f' at {where}' if where else ''} (shape {_shape_text(exc.tensor)}): "
            "snapshots hold plain dense tensors only. Convert it in state_dict()/on_save_checkpoint "
            "(e.g. .to_dense(), .dequantize(), or the plain tensor a subclass wraps)") from None
    meta = buf.getvalue()
    if check_loadable:
        # Decode as a load would (placeholders resolve to the live tensors, nothing is copied):
        # what the restricted loader refuses fails here, at the save, not at the resume.
        _unpickle(meta, lambda pid: pickler.tensors[pid[1]][0])
    identity = encode_identity(run_id, rank, model_fingerprint(obj))
    data_len = _align(pickler.data_len, 8)
    nblocks = -(-data_len // BLOCK_SIZE)
    meta_off = _align(HEADER_SIZE + len(identity), 8) + 8 * nblocks
    data_off = _align(meta_off + len(meta), PAGE)
    return Encoded(identity, meta, pickler.tensors, meta_off, data_off, data_len, nblocks)


def block_sums(data: torch.Tensor, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Wrap-around int64 sums of ``data`` (uint8, length a multiple of 8) per block."""
    words = data.view(torch.int64)
    per_block = block_size // 8
    nfull = words.numel() // per_block
    parts = []
    if nfull:
        parts.append(words[: nfull * per_block].view(nfull, per_block).sum(dim=1))
    if words.numel() > nfull * per_block:
        parts.append(words[nfull * per_block:].sum().reshape(1))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def finish(enc: Encoded, step: int, created: float, sums: torch.Tensor) -> bytes:
    """Bytes of ``[0, meta_off + len(meta))``: header, identity, block sums and metadata."""
    sums_bytes = sums.numpy().tobytes()
    gap = b"\0" * (enc.meta_off - 8 * enc.nblocks - HEADER_SIZE - len(enc.identity))
    body_crc = zlib.crc32(enc.meta, zlib.crc32(sums_bytes, zlib.crc32(enc.identity)))
    header = Header(step, created, enc.file_size, len(enc.identity), enc.meta_off, len(enc.meta), enc.data_off,
                    enc.data_len, BLOCK_SIZE, enc.nblocks, body_crc)
    return header.pack() + enc.identity + gap + sums_bytes + enc.meta


def frombuffer_u8(buf: Any, offset: int, length: int) -> torch.Tensor:
    """uint8 tensor over ``buf[offset:offset+length]`` without copying."""
    if length == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        # read-only buffers (loads) warn that writes would be undefined; we only read them
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8, count=length, offset=offset)


def check_body(buf: Any, actual_size: int) -> Header:
    """Check the header, the file size and the crc of identity + block sums + metadata (cheap:
    the data region is not read). Raise SnapshotError with the reason."""
    header = Header.unpack(buf)
    # A recycled file may be longer than its snapshot (files are never shrunk); shorter is torn.
    if actual_size < header.file_size:
        raise SnapshotError(f"size {actual_size} < {header.file_size} recorded in the header (torn/truncated)")
    mv = memoryview(buf)
    identity = mv[HEADER_SIZE: HEADER_SIZE + header.ident_len]
    sums_raw = mv[header.sums_off: header.meta_off]
    meta = mv[header.meta_off: header.meta_off + header.meta_len]
    if zlib.crc32(meta, zlib.crc32(sums_raw, zlib.crc32(identity))) != header.body_crc:
        raise SnapshotError("metadata checksum mismatch")
    return header


def _stored_sums(body: Any, header: Header) -> torch.Tensor:
    """The block-sum table of a snapshot whose body passed ``check_body`` (a copy: ``body`` may
    be a map that goes away)."""
    if not header.nblocks:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(bytearray(memoryview(body)[header.sums_off: header.meta_off]), dtype=torch.int64)


def _check_blocks(header: Header, stored: torch.Tensor, computed: torch.Tensor, first: int = 0) -> None:
    """Compare the sums of blocks ``first``.. with their stored values; raise SnapshotError
    naming the first block that differs."""
    if not torch.equal(stored, computed):
        bad = first + int((stored != computed).nonzero()[0, 0])
        start = header.data_off + bad * header.block_size
        raise SnapshotError(f"data checksum mismatch in block {bad} (bytes {start}..{start + header.block_size})")


def check_data(buf: Any, header: Header) -> None:
    """Check the data region against the block sums (call ``check_body`` first)."""
    computed = block_sums(frombuffer_u8(buf, header.data_off, header.data_len), header.block_size)
    _check_blocks(header, _stored_sums(buf, header), computed)


def verify(buf: Any, actual_size: int) -> Header:
    """Check a whole snapshot held in ``buf`` (mmap or bytes); raise SnapshotError with the reason."""
    header = check_body(buf, actual_size)
    check_data(buf, header)
    return header


def verify_chunks(chunks: Iterable[Any], expected_size: int) -> Header:
    """Check a whole snapshot that arrives in pieces of any size (a read back from an object
    store) against ``expected_size`` and its own checksums, holding its body and less than one
    chunk plus one block of its data at a time; raise SnapshotError with the reason. Stricter
    than :func:`verify` on length: the pieces must be exactly ``expected_size`` bytes and end
    where the header says the snapshot ends (no slack of a recycled file)."""
    body = bytearray()
    header: Header | None = None
    stored = torch.empty(0, dtype=torch.int64)
    pending = bytearray()
    checked_blocks = total = 0
    for chunk in chunks:
        total += memoryview(chunk).nbytes
        if total > expected_size:
            raise SnapshotError(f"longer than the expected {expected_size} bytes")
        if header is None:
            body += chunk
            if len(body) < HEADER_SIZE or len(body) < Header.unpack(body).data_off:
                continue
            header = check_body(body, expected_size)
            pending = body[header.data_off:]
            del body[header.data_off:]
            stored = _stored_sums(body, header)
        else:
            pending += chunk
        whole = len(pending) // header.block_size
        last = total == header.file_size and len(pending) > whole * header.block_size
        n = whole + last
        if n:
            if checked_blocks + n > header.nblocks:
                raise SnapshotError("more data than the header's block table covers")
            done = min(len(pending), n * header.block_size)
            computed = block_sums(frombuffer_u8(pending, 0, done), header.block_size)
            _check_blocks(header, stored[checked_blocks: checked_blocks + n], computed, checked_blocks)
            checked_blocks += n
            del computed
            pending = pending[done:]  # a new buffer: the old one may still be exported to torch
    if header is None:
        raise SnapshotError(f"ends after {total} bytes, inside its header or metadata (torn/truncated)")
    if total != header.file_size or total != expected_size or checked_blocks != header.nblocks:
        raise SnapshotError(f"ends after {total} bytes; {expected_size} expected, {header.file_size} recorded in "
                            f"the header (torn/truncated)")
    return header


def read_identity(buf: Any, header: Header) -> SnapshotIdentity:
    """The identity record of a snapshot whose body passed ``check_body``."""
    return decode_identity(bytes(memoryview(buf)[HEADER_SIZE: HEADER_SIZE + header.ident_len]), header.step)


def check_metadata(buf: Any, header: Header) -> None:
    """Unpickle the metadata with the restricted loader, tensors as shapes only; raise
    SnapshotError if loading this snapshot would be refused (a snapshot received from elsewhere
    is checked before it is kept, not first when it is needed)."""
    mv = memoryview(buf)
    _unpickle(bytes(mv[header.meta_off: header.meta_off + header.meta_len]), _ShapesOnly(header.data_len))


def decode(buf: Any, header: Header) -> Any:
    """Unpickle the metadata (restricted) and materialize every tensor as a fresh copy (call verify first)."""
    mv = memoryview(buf)
    meta = bytes(mv[header.meta_off: header.meta_off + header.meta_len])
    data = frombuffer_u8(buf, header.data_off, header.data_len)
    return _unpickle(meta, _DataRegion(data))
