"""Copying a snapshot's tensors into its file's data region, and summing the blocks they fill.

:mod:`.format` decides where each tensor's bytes go (:class:`~.format.Encoded`) and what the
block sums are; this module moves the bytes: :func:`copy_tensors` (the copy), :func:`copy_and_sum`
(the copy and the sums, pipelined on a helper thread for a large region) and
:class:`BackgroundCopy` (a periodic snapshot's large tensors copied while training goes on).
Every helper thread here has finished before the caller may close the map it reads or writes,
also when a signal handler raises meanwhile.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch

from lightning_ft.checkpoint.memory.format import BLOCK_SIZE, Encoded, block_sums

#: data regions at least this large are summed on a helper thread that follows the copy (when
#: torch runs single-threaded; otherwise its own threads already use every core for both passes)
PIPELINE_MIN_BYTES = 64 << 20
#: a large contiguous tensor is copied in pieces of this many bytes, so the sums can follow it
_PIECE_BYTES = 16 << 20


def copy_tensors(enc: Encoded, data: torch.Tensor, progress: Callable[[int], None] | None = None,
                 tensors: list[tuple[torch.Tensor, int]] | None = None) -> None:
    """Copy every tensor's bytes into ``data`` (a uint8 view of the file's data region).

    ``progress(end)``: called whenever every byte of ``data`` below ``end`` is final (after each
    tensor, and after each ``_PIECE_BYTES`` piece of a large contiguous one). ``tensors``: only
    these ``(tensor, offset)`` pairs of ``enc.tensors`` (default: all)."""
    for tensor, offset in enc.tensors if tensors is None else tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if not nbytes:
            continue
        src = tensor.detach()
        if progress is None or nbytes <= _PIECE_BYTES or not src.is_contiguous():
            # copy_ reads any strides / device, so non-contiguous and CUDA tensors need no temp copy
            data[offset: offset + nbytes].view(src.dtype).view(src.shape).copy_(src)
        else:
            flat_src, flat_dst = src.reshape(-1), data[offset: offset + nbytes].view(src.dtype)
            step = _PIECE_BYTES // src.element_size()
            for start in range(0, flat_src.numel(), step):
                flat_dst[start: start + step].copy_(flat_src[start: start + step])
                progress(offset + min(nbytes, (start + step) * src.element_size()))
        if progress is not None:
            progress(offset + nbytes)


def copy_and_sum(enc: Encoded, data: torch.Tensor, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """:func:`copy_tensors` into ``data``, then the :func:`block_sums` of ``data``.

    For a large data region, when torch runs on one thread, a helper thread sums the blocks the
    copy has passed (told every ``_PIECE_BYTES`` or so), so a save costs about the copy rather
    than the copy plus a second pass over the memory (the training thread waits for both; a
    second core is idle meanwhile). With more torch threads both passes are parallel already
    and a helper only competes with them (measured slower). Tensors are laid out at ascending
    offsets, so a block below the copy's progress is final (alignment gaps are never written).
    Both passes release the GIL. The helper has always finished before this returns or raises,
    also when a signal handler raises meanwhile: it reads ``data``, whose map the caller may
    close right after.
    """
    if enc.data_len < PIPELINE_MIN_BYTES or torch.get_num_threads() != 1:
        copy_tensors(enc, data)
        return block_sums(data, block_size)
    nblocks = -(-enc.data_len // block_size)
    sums = torch.empty(nblocks, dtype=torch.int64)
    progress: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    failure: list[BaseException] = []
    finished = threading.Event()

    def follow() -> None:
        done = 0  # blocks summed
        try:
            while (upto := progress.get()) is not None:
                whole = nblocks if upto >= enc.data_len else upto // block_size  # the last may be partial
                if whole > done:
                    sums[done:whole] = block_sums(data[done * block_size: whole * block_size], block_size)
                    done = whole
        except BaseException as exc:  # noqa: BLE001 - re-raised on the saving thread
            failure.append(exc)
        finally:
            finished.set()

    helper = threading.Thread(target=follow, name="lightning_ft-block-sums", daemon=True)
    posted = 0

    def passed(end: int) -> None:
        nonlocal posted
        if end - posted >= _PIECE_BYTES:  # one wake-up per piece, not per small tensor
            posted = end
            progress.put(end)

    try:
        helper.start()  # inside the try: start() itself can be interrupted after the thread runs
        copy_tensors(enc, data, passed)
        progress.put(enc.data_len)
    finally:
        progress.put(None)
        _wait_uninterrupted(finished, helper)
    if failure:
        raise failure[0]
    return sums


#: a background snapshot copies its deferred tensors on a helper thread only when they hold at
#: least this many bytes: below it the copy takes a few milliseconds at most (~0.2 s per GiB
#: here), which a helper thread and the commit's wait would not win back
BACKGROUND_MIN_BYTES = 16 << 20


class BackgroundCopy:
    """Copies some of a snapshot's tensors into ``data`` on a helper thread, then sums every
    block of ``data`` (the tensors copied before it started included).

    For tensors the caller promises not to change until :meth:`wait` (parameters and optimizer
    state between a batch's end and the next optimizer step), so the copy overlaps the next
    forward and backward instead of blocking training. The promise is checked: each tensor's
    version counter (bumped by every in-place torch operation on it or a view of it) is
    recorded at the start, and :meth:`modified` names the tensors whose counter moved. Writes
    that bypass autograd's counter (through ``.data`` or numpy) are not seen.
    """

    def __init__(self, enc: Encoded, data: torch.Tensor, tensors: list[tuple[torch.Tensor, int]]) -> None:
        self._enc, self._data, self._tensors = enc, data, tensors
        self._versions = [tensor._version for tensor, _ in tensors]
        self._sums: torch.Tensor | None = None
        self._failure: BaseException | None = None
        self._finished = threading.Event()
        #: seconds the helper thread took (copy and sums); None until it finished
        self.seconds: float | None = None
        self._thread = threading.Thread(target=self._run, name="lightning_ft-snapshot-copy", daemon=True)
        try:
            self._thread.start()
        except BaseException:
            # start() interrupted (a signal handler raised) after the thread began: it writes
            # into ``data``, whose map the caller closes next
            _wait_uninterrupted(self._finished, self._thread)
            raise

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            copy_tensors(self._enc, self._data, tensors=self._tensors)
            self._sums = block_sums(self._data)
        except BaseException as exc:  # noqa: BLE001 - re-raised by wait() on the caller's thread
            self._failure = exc
        finally:
            self.seconds = time.perf_counter() - start
            self._finished.set()

    def done(self) -> bool:
        """Whether the helper has finished (wait() will not block)."""
        return self._finished.is_set()

    def wait(self) -> torch.Tensor:
        """The block sums of ``data`` once the helper finished; re-raises its error. Waits
        through a signal handler's exception (raised afterwards): the caller closes ``data``'s
        map next."""
        _wait_uninterrupted(self._finished, self._thread)
        if self._failure is not None:
            raise self._failure
        assert self._sums is not None
        return self._sums

    def modified(self) -> list[torch.Tensor]:
        """The tensors changed in place since the copy started (their copy may be torn)."""
        return [tensor for (tensor, _), version in zip(self._tensors, self._versions, strict=True)
                if tensor._version != version]


def has_version_counter(tensor: torch.Tensor) -> bool:
    """Whether in-place changes of ``tensor`` are counted (not an inference tensor)."""
    try:
        _ = tensor._version  # raises for an inference tensor
    except RuntimeError:
        return False
    return True


def _wait_uninterrupted(finished: threading.Event, helper: threading.Thread) -> None:
    """Wait until the helper has finished even if a signal handler raises meanwhile (a second
    Ctrl-C): it reads a map the caller closes next. Such an exception is raised afterwards (the
    helper ends after its current sum). A helper whose start() never ran has nothing to wait for."""
    interrupted: BaseException | None = None
    while helper.ident is not None and not finished.is_set():
        try:
            finished.wait()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            interrupted = exc
    if interrupted is not None:
        raise interrupted


