"""The collectives baseline (``all_to_all_single`` over gloo, in spawned processes) gives the
single-process reference's dispatch and combine bit for bit."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch
from moeworld import (
    _RESULT_FIELDS,
    assert_same_dispatch,
    assert_same_output,
    baseline_worker,
    expert_fn,
    random_inputs,
)

from fabric_apps.moe import DispatchResult, MoeConfig, reference_dispatch, reference_moe

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

JOIN_S = 120.0


@pytest.mark.parametrize("w", [2, 3])
def test_collectives_baseline_matches_reference(tmp_path: Path, w: int) -> None:
    config_kw: dict[str, Any] = dict(world_size=w, num_experts=4 * w, hidden=24, top_k=4, max_tokens=8)
    seeds = [11, 12, 13]
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(
            target=baseline_worker,
            args=(r, w, str(tmp_path / "store"), str(tmp_path / f"rank{r}.pt"), config_kw, seeds),
            daemon=True,
        )
        for r in range(w)
    ]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(JOIN_S)
        assert not any(p.is_alive() for p in procs), f"baseline workers still running after {JOIN_S} s"
        assert [p.exitcode for p in procs] == [0] * w
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    config = MoeConfig(**config_kw, rank=0)
    saved = [torch.load(tmp_path / f"rank{r}.pt") for r in range(w)]
    for s, seed in enumerate(seeds):
        inputs = random_inputs(config, seed)
        want_d = reference_dispatch(config, inputs.xs, inputs.idxs)
        want_o = reference_moe(config, inputs.xs, inputs.idxs, inputs.ws, expert_fn)
        for r in range(w):
            got = saved[r][s]
            res = DispatchResult(experts=config.local_experts(r), **{k: got[k] for k in _RESULT_FIELDS})
            assert_same_dispatch(res, want_d[r], r)
            assert_same_output(got["out"], want_o[r], r)
