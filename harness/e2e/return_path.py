"""The return path of hidden states alone: from the result processor, through the
scheduler -> detokenizer -> tokenizer-manager pipes, to what the caller gets.

What a forward's hidden-state rows cost on their way out, without the forward, for
each variant (one process, the same rows, side by side):

- ``pristine-lists``: SGLang 0.5.23's own result processor (its
  ``batch_result_processor.py``, read from the release's verified wheel and loaded under
  a name of its own): a ``.cpu()`` and a ``.tolist()`` per request; the lists of floats
  cross both pipes; the tokenizer manager hands them on;
- ``series-lists``: the series' result processor (``ReturnedHiddenStates``: one gather,
  host tensors); tensors cross the pipes; the tokenizer manager makes the lists of
  before (``_hidden_states_for_caller``), once;
- ``series-arrays``: the same, and the caller gets one tensor per request
  (``return_raw_hidden_states``).

Each pipe is a real pair of ZMQ sockets (``inproc``, PAIR), pickle being SGLang 0.5.23's
default IPC (``SGLANG_USE_PICKLE_IPC``), as its scheduler, detokenizer and tokenizer
manager talk: the series' variants through the installed SGLang's ``sock_send`` /
``sock_recv`` (with the series a CPU tensor crosses as its bytes), the pristine one
through ``send_pyobj`` / ``recv_pyobj``, which is what the release's ``sock_send`` does.
A run is ``batch`` requests, each a prefill of ``prompt`` rows and ``decode_steps`` decode
steps of one row, every row ``width`` values in bfloat16 (what a GPU target captures); the
result processor runs at every forward, the output streamer, the pipes and the tokenizer
manager once, when the requests finish (as for requests that do not stream). Rows per
second = the run's rows / the median wall time over ``repeats``.

Stdlib-only at import time.
"""

from __future__ import annotations

import pickle
import statistics
import time
from typing import Any, Callable, Sequence

VARIANTS = ("pristine-lists", "series-lists", "series-arrays")
PRISTINE_MODULE = "sglang.srt.managers.scheduler_components._auxcap_pristine_batch_result_processor"


def pristine_processor_module():
    """SGLang's own ``batch_result_processor.py`` of the base's release (its verified
    wheel), as a module of its own."""
    import sys

    from harness.memory.models import _load, _pristine_source

    if PRISTINE_MODULE in sys.modules:
        return sys.modules[PRISTINE_MODULE]
    found = _pristine_source("srt/managers/scheduler_components/batch_result_processor.py")
    if found is None:
        raise RuntimeError("the base's release has no scheduler_components/batch_result_processor.py")
    return _load(PRISTINE_MODULE, "sglang.srt.managers.scheduler_components", *found)


def _requests(batch: int, rows: int):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return [Req(f"r{i}", "", list(range(max(rows, 1))), SamplingParams(), return_hidden_states=True)
            for i in range(batch)]


class _Pipe:
    """A ZMQ PAIR over ``inproc``: ``through(obj, series)`` sends it and receives it back."""

    def __init__(self, context, name: str) -> None:
        import zmq

        self.tx = context.socket(zmq.PAIR)
        self.rx = context.socket(zmq.PAIR)
        self.rx.bind(f"inproc://{name}")
        self.tx.connect(f"inproc://{name}")

    def through(self, obj: Any, series: bool) -> Any:
        if series:
            from sglang.srt.managers.io_struct import sock_recv, sock_send

            sock_send(self.tx, obj)
            return sock_recv(self.rx)
        self.tx.send_pyobj(obj, protocol=pickle.HIGHEST_PROTOCOL)
        return self.rx.recv_pyobj()

    def close(self) -> None:
        self.tx.close(0)
        self.rx.close(0)


def one_request_batch(variant: str, prefill, decodes: Sequence[Any], batch: int, prompt: int,
                      pipes: Sequence[_Pipe]) -> list:
    """``batch`` requests through ``variant``'s return path: the prefill forward's rows
    (``prefill``: ``[batch * prompt, width]``), then each decode step's (``decodes``: one
    ``[batch, width]`` each), then, once the requests finish, what the output streamer
    sends, through both pipes, and what the tokenizer manager hands the callers."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers import io_struct, tokenizer_manager
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    reqs = _requests(batch, prompt)
    series = variant != "pristine-lists"
    if series:
        from sglang.srt.managers.scheduler_components.batch_result_processor import (
            ReturnedHiddenStates,
            SchedulerBatchResultProcessor as proc_cls,
        )
    else:
        proc_cls = pristine_processor_module().SchedulerBatchResultProcessor
    proc = proc_cls.__new__(proc_cls)
    returned = ReturnedHiddenStates() if series else None
    kwargs = {"returned": returned} if series else {}
    output = LogitsProcessorOutput(next_token_logits=None, hidden_states=prefill)
    offset = 0
    for req in reqs:
        offset = proc._append_prefill_hidden_states(
            req=req, logits_output=output, hidden_state_offset=offset,
            capture_hidden_mode=CaptureHiddenMode.FULL, extend_input_len=prompt, store=True, **kwargs)
    if series:
        returned.copy_to_host(prefill)
    for step in decodes:
        for i, req in enumerate(reqs):
            req.output_ids.append(1)
            proc_cls._append_decode_hidden_states(req=req, hidden_states=step, start=i, accept_len=1, **kwargs)
        if series:
            returned.copy_to_host(step)
    # The output streamer's fields for the finished requests (the series packs each
    # request's entries into one array and a layout), through both pipes.
    if series:
        packed = [io_struct.pack_hidden_states(req.hidden_states) for req in reqs]
        sent = ([rows for rows, _ in packed], [layout for _, layout in packed])
    else:
        sent = ([req.hidden_states for req in reqs], None)
    for pipe in pipes:
        sent = pipe.through(sent, series)
    rows, layouts = sent
    if not series:
        return rows
    return [tokenizer_manager._hidden_states_for_caller(r, lay, variant == "series-arrays")
            for r, lay in zip(rows, layouts)]


def measure(widths: Sequence[int], batches: Sequence[int], prompt: int, decode_steps: int, repeats: int,
            log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Rows/s of each variant at each width and batch size: ``batch`` requests of a
    ``prompt``-token prefill and ``decode_steps`` decode steps (every row returned), the
    variants interleaved in a rotated order each repeat after a warm-up. Every
    variant's callers must get the same values."""
    import torch
    import zmq

    context = zmq.Context()
    pipes = [_Pipe(context, "auxcap-scheduler-to-detokenizer"), _Pipe(context, "auxcap-detokenizer-to-tokenizer")]
    out: list[dict[str, Any]] = []
    try:
        for width in widths:
            for batch in batches:
                gen = torch.Generator().manual_seed(width + batch)
                prefill = torch.randn(batch * prompt, width, generator=gen).to(torch.bfloat16)
                decodes = [torch.randn(batch, width, generator=gen).to(torch.bfloat16) for _ in range(decode_steps)]
                rows = batch * (prompt + decode_steps)
                reference = None
                times: dict[str, list[float]] = {v: [] for v in VARIANTS}
                for r in range(repeats + 1):
                    order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
                    for v in order:
                        t0 = time.perf_counter()
                        got = one_request_batch(v, prefill, decodes, batch, prompt, pipes)
                        seconds = time.perf_counter() - t0
                        if r == 0:
                            values = [torch.cat([torch.as_tensor(e, dtype=torch.float32).reshape(-1)
                                                 for e in (g if isinstance(g, list) else [g])]) for g in got]
                            if reference is None:
                                reference = values
                            elif not all(torch.equal(a, b) for a, b in zip(reference, values)):
                                raise RuntimeError(f"return path: {v} gave other values at width {width}")
                            continue  # warm-up
                        times[v].append(seconds)
                        del got
                for v in VARIANTS:
                    med = statistics.median(times[v])
                    out.append({"width": width, "batch": batch, "prompt": prompt, "decode_steps": decode_steps,
                                "variant": v, "rows": rows, "median_s": med, "min_s": min(times[v]),
                                "max_s": max(times[v]), "rows_per_s": rows / med})
                base = out[-3]["rows_per_s"]
                log(f"[return path] width {width}, batch {batch}: "
                    + ", ".join(f"{o['variant']} {o['rows_per_s']:,.0f} rows/s ({o['rows_per_s'] / base:.1f}x)"
                                for o in out[-3:]))
    finally:
        for pipe in pipes:
            pipe.close()
        context.term()
    return out
