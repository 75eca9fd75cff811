"""MoE dispatch and combine end to end on the simulator: W ranks' engines in one process
(threads), chunks landing shuffled, completions reordered.

Every test checks the dispatch and the combine bit for bit against the single-process
reference, the exact number of imms each rank counted (from the routing alone), that no
count is left over, and the bytes each rank wrote (each token once per destination rank).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from moeworld import (
    Inputs,
    MoeWorld,
    T,
    assert_same_dispatch,
    assert_same_output,
    expected_bytes,
    expected_imms,
    expert_fn,
    layer_imms,
    parallel,
    random_inputs,
    step,
    unwrap,
)

from fabric_apps.moe import (
    MoeAllToAll,
    MoeConfig,
    MoeStateError,
    Phase,
    StepAborted,
    apply_experts,
    moe_imm,
    reference_dispatch,
    reference_moe,
)
from fabric_core import ConfigError, PeerUnreachable, Rendezvous, TransferTimeout


def _config(w: int, **kw: Any) -> MoeConfig:
    base: dict[str, Any] = dict(world_size=w, rank=0, num_experts=2 * w, hidden=24, top_k=min(4, 2 * w))
    base.update(max_tokens=8)
    base.update(kw)
    return MoeConfig(**base)


def _run_and_check(world: MoeWorld, moes: list[MoeAllToAll], config: MoeConfig, inputs: Inputs) -> None:
    """One step on every rank, checked bitwise, with exact counts and bytes."""
    w = config.world_size
    imms_before, bytes_before = world.received(), world.written()
    results = unwrap(parallel(lambda r: step(moes[r], inputs, r), w))
    assert world.fabric.quiesce(T)
    want_dispatch = reference_dispatch(config, inputs.xs, inputs.idxs)
    want_out = reference_moe(config, inputs.xs, inputs.idxs, inputs.ws, expert_fn)
    for r, (res, out) in enumerate(results):
        assert_same_dispatch(res, want_dispatch[r], r)
        assert_same_output(out, want_out[r], r)
    got = [a - b for a, b in zip(world.received(), imms_before, strict=True)]
    assert got == expected_imms(config, inputs, world.max_msg_size, world.nics)
    wrote = [a - b for a, b in zip(world.written(), bytes_before, strict=True)]
    assert wrote == expected_bytes(config, inputs, want_dispatch)
    for e in world.engines:  # waits consumed exactly what arrived: nothing left on any counter
        for layer in {m.layer for m in moes}:
            assert all(e.counter(imm).value == 0 for imm in layer_imms(config, layer))


# --- (a) random routings over world sizes, NIC counts and seeds, two consecutive steps ----------
@pytest.mark.fabric_seeds(5)
@pytest.mark.parametrize("nics", [1, 2])
@pytest.mark.parametrize("w", [1, 2, 4, 8])
def test_dispatch_and_combine_match_reference(fabric_seed: int, w: int, nics: int) -> None:
    # bf16 hidden states; odd seeds in float32, where any other summation order shows in the bits
    config = _config(w, dtype=torch.float32 if fabric_seed % 2 else torch.bfloat16)
    world = MoeWorld(fabric_seed, w, nics=nics)
    try:
        moes = world.layer(config)
        for s in range(2):
            _run_and_check(world, moes, config, random_inputs(config, 100 * fabric_seed + s))
        assert [m.step for m in moes] == [2] * w
    finally:
        world.close()


# --- (b) routing shapes ------------------------------------------------------------------------
SHAPES: dict[str, tuple[dict[str, Any], list[int] | None, str]] = {
    # every token of every rank to the same single expert
    "all-to-one-expert": (dict(top_k=1), None, "skewed"),
    # every token to experts 0..K-1: all on rank 0, the other ranks receive nothing
    "skewed-top-k": (dict(num_experts=16), None, "skewed"),
    "empty-ranks": ({}, [0, 5, 0, 8], "uniform"),
    "no-tokens-anywhere": ({}, [0, 0, 0, 0], "uniform"),
    "one-token-each": ({}, [1, 1, 1, 1], "uniform"),
    "full-ranks": ({}, [8, 8, 8, 8], "uniform"),
    "masked-slots": ({}, [6, 3, 8, 1], "masked"),
    "one-expert-per-rank": (dict(num_experts=4, top_k=3), None, "uniform"),
    "round-robin-placement": (dict(placement=tuple(e % 4 for e in range(8))), None, "uniform"),
    "fp32": (dict(dtype=torch.float32), None, "uniform"),
}


@pytest.mark.fabric_seeds(2)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_routing_shapes_match_reference(fabric_seed: int, shape: str) -> None:
    overrides, tokens, kind = SHAPES[shape]
    config = _config(4, **overrides)
    world = MoeWorld(fabric_seed, 4)
    try:
        moes = world.layer(config)
        inputs = random_inputs(config, fabric_seed, tokens, kind=kind)
        _run_and_check(world, moes, config, inputs)
        if kind == "skewed":  # the reference agrees that only the owners of experts 0..K-1 receive
            got = [int(reference_dispatch(config, inputs.xs, inputs.idxs)[q].num_rows) for q in range(4)]
            assert got[0] == sum(int(x.shape[0]) for x in inputs.xs) * config.top_k and not any(got[1:])
    finally:
        world.close()


def test_writes_split_at_max_msg_size_are_counted_exactly() -> None:
    """Records and output rows larger than the largest message become several work requests
    each; every wait still expects exactly what the contract's rule gives."""
    config = _config(4, hidden=40)  # 80-byte rows, 96-byte records; max_msg_size 64
    world = MoeWorld(7, 4, max_msg_size=64)
    try:
        assert world.max_msg_size == 64 and config.record_bytes > 64 and config.token_bytes > 64
        moes = world.layer(config)
        for s in range(2):
            _run_and_check(world, moes, config, random_inputs(config, s, [8, 3, 0, 5]))
    finally:
        world.close()


def test_large_chunks_and_bigger_shapes() -> None:
    """A larger layer (H=256, K=8, E=32, T_max=32) with the simulator's default chunking."""
    config = MoeConfig(world_size=4, rank=0, num_experts=32, hidden=256, top_k=8, max_tokens=32)
    world = MoeWorld(3, 4, chunk_bytes=1 << 16)
    try:
        _run_and_check(world, world.layer(config), config, random_inputs(config, 3, [32, 17, 1, 32]))
    finally:
        world.close()


# --- (c) steps and layers never share imms ------------------------------------------------------
def test_two_layers_interleaved_over_steps_do_not_collide() -> None:
    """Two layers (two instances, ids 0 and 1) in flight together on the same engines, their
    halves interleaved, over three steps with new routings each step."""
    config = _config(4)
    world = MoeWorld(11, 4)
    try:
        a, b = world.layer(config, 0), world.layer(config, 1)
        for s in range(3):
            ins = [random_inputs(config, 10 * s + j) for j in range(2)]
            imms_before = world.received()

            def run(r: int, ins: list[Inputs] = ins) -> list[tuple[Any, torch.Tensor]]:
                la, lb = a[r], b[r]
                la.dispatch_send(ins[0].xs[r], ins[0].idxs[r], ins[0].ws[r])
                lb.dispatch_send(ins[1].xs[r], ins[1].idxs[r], ins[1].ws[r])
                rb = lb.dispatch_recv(T)
                ra = la.dispatch_recv(T)
                la.combine_send(apply_experts(ra, expert_fn))
                lb.combine_send(apply_experts(rb, expert_fn))
                ob = lb.combine_recv(T)
                oa = la.combine_recv(T)
                return [(ra, oa), (rb, ob)]

            results = unwrap(parallel(run, 4))
            assert world.fabric.quiesce(T)
            for j in range(2):
                want_d = reference_dispatch(config, ins[j].xs, ins[j].idxs)
                want_o = reference_moe(config, ins[j].xs, ins[j].idxs, ins[j].ws, expert_fn)
                for r in range(4):
                    assert_same_dispatch(results[r][j][0], want_d[r], r)
                    assert_same_output(results[r][j][1], want_o[r], r)
            want = [
                x + y
                for x, y in zip(
                    *(expected_imms(config, i, world.max_msg_size, world.nics) for i in ins), strict=True
                )
            ]
            assert [x - y for x, y in zip(world.received(), imms_before, strict=True)] == want
            for e in world.engines:
                assert all(e.counter(imm).value == 0 for imm in layer_imms(config, 0) + layer_imms(config, 1))
    finally:
        world.close()


def test_next_step_arriving_before_this_step_ends_is_kept_apart() -> None:
    """Rank 0 holds back its combine_recv until every other rank has posted the next step's
    dispatch and the fabric has delivered it: step 1's counts and tokens are already counted
    at rank 0 (on the other parity's imms) while it finishes step 0, and both steps come out
    exact."""
    config = _config(4)
    world = MoeWorld(5, 4)
    try:
        moes = world.layer(config)
        ins = [random_inputs(config, 40 + s, [6, 8, 5, 7]) for s in range(2)]
        posted = threading.Barrier(4, timeout=T)

        def run(r: int) -> list[tuple[Any, torch.Tensor]]:
            m, out = moes[r], []
            m.dispatch_send(ins[0].xs[r], ins[0].idxs[r], ins[0].ws[r])
            res = m.dispatch_recv(T)
            m.combine_send(apply_experts(res, expert_fn))
            if r == 0:
                posted.wait()  # ranks 1..3 are done with step 0 and posted step 1
                assert world.fabric.quiesce(T)
                counts = world.engines[0].counter
                assert [counts(moe_imm(0, 1, Phase.COUNTS, q)).value for q in (1, 2, 3)] == [1, 1, 1]
                out.append((res, m.combine_recv(T)))
                m.dispatch_send(ins[1].xs[r], ins[1].idxs[r], ins[1].ws[r])
            else:
                out.append((res, m.combine_recv(T)))
                m.dispatch_send(ins[1].xs[r], ins[1].idxs[r], ins[1].ws[r])
                posted.wait()
            res = m.dispatch_recv(T)
            m.combine_send(apply_experts(res, expert_fn))
            out.append((res, m.combine_recv(T)))
            return out

        results = unwrap(parallel(run, 4))
        for s in range(2):
            want_d = reference_dispatch(config, ins[s].xs, ins[s].idxs)
            want_o = reference_moe(config, ins[s].xs, ins[s].idxs, ins[s].ws, expert_fn)
            for r in range(4):
                assert_same_dispatch(results[r][s][0], want_d[r], r)
                assert_same_output(results[r][s][1], want_o[r], r)
    finally:
        world.close()


# --- (d) failures: typed errors, no hang --------------------------------------------------------
def _step_until_error(moe: MoeAllToAll, inputs: Inputs, r: int) -> BaseException | None:
    try:
        step(moe, inputs, r)
    except (PeerUnreachable, TransferTimeout) as exc:
        return exc
    return None


def test_rank_dead_before_dispatch_fails_every_other_rank() -> None:
    """Rank 3 is dead before the step: a rank whose write to it already failed reports that
    write; a rank that gets to its waits first fails them at once (rank 3 is known lost)."""
    config = _config(4)
    world = MoeWorld(2, 4)
    try:
        moes = world.layer(config)
        inputs = random_inputs(config, 2, [8, 8, 8, 8])
        world.fabric.fail_peer(world.engines[3])
        moes[0].dispatch_send(inputs.xs[0], inputs.idxs[0], inputs.ws[0])
        assert world.fabric.quiesce(T)  # its writes to rank 3 have failed
        with pytest.raises(PeerUnreachable, match="a write to rank 3 failed"):
            moes[0].dispatch_recv(T)
        with world.fabric.paused():  # nothing moves: rank 1's writes are not failed yet
            moes[1].dispatch_send(inputs.xs[1], inputs.idxs[1], inputs.ws[1])
            with pytest.raises(PeerUnreachable, match="rank 3 is gone"):
                moes[1].dispatch_recv(T)
        # the failed step poisons the instance: later calls refuse with StepAborted
        for m in moes[:2]:
            with pytest.raises(StepAborted) as info:
                m.combine_recv()
            assert isinstance(info.value.__cause__, PeerUnreachable)
        # and a full step on a rank that has not started yet fails the same way, in time
        (exc,) = parallel(lambda r: _step_until_error(moes[2], inputs, 2), 1)
        assert isinstance(exc, PeerUnreachable) and "rank 3" in str(exc)
    finally:
        world.close()


@pytest.mark.parametrize("after_events", [1, 8, 30, 120, 300])
def test_rank_dying_mid_dispatch_gives_typed_errors_and_no_hang(after_events: int) -> None:
    """Rank 3 posts its dispatch and dies after ``after_events`` more fabric events (part of
    its writes may have landed): every other rank's step fails with a typed error."""
    config = _config(4)
    world = MoeWorld(9, 4)
    try:
        moes = world.layer(config)
        inputs = random_inputs(config, 9, [8, 8, 8, 8])
        dead = world.engines[3]
        with world.fabric.paused():
            moes[3].dispatch_send(inputs.xs[3], inputs.idxs[3], inputs.ws[3])
            world.fabric.after(after_events, lambda: world.fabric.fail_peer(dead))
        errors = parallel(lambda r: _step_until_error(moes[r], inputs, r), 3)
        assert dead.closed
        for r, exc in enumerate(errors):
            assert isinstance(exc, (PeerUnreachable, TransferTimeout)), f"rank {r}: {exc!r}"
    finally:
        world.close()


def test_silent_rank_times_out_with_counts() -> None:
    """Rank 2 is alive but never dispatches: the others time out at their deadline with the
    counts each missing imm expected and received."""
    config = _config(3)
    world = MoeWorld(4, 3)
    try:
        moes = world.layer(config, timeout=0.3)
        inputs = random_inputs(config, 4, [4, 4, 4])

        def run(r: int) -> BaseException | None:
            moes[r].dispatch_send(inputs.xs[r], inputs.idxs[r], inputs.ws[r])
            try:
                moes[r].dispatch_recv()
            except TransferTimeout as exc:
                return exc
            return None

        for exc in parallel(run, 2):
            assert isinstance(exc, TransferTimeout)
            imm = moe_imm(0, 0, Phase.COUNTS, 2)
            assert exc.expected == {imm: 1} and exc.received == {imm: 0}
            assert "rank(s) 2" in str(exc)
    finally:
        world.close()


# --- (e) API: order, setup, inputs -------------------------------------------------------------
def test_calls_out_of_order_are_refused_and_change_nothing() -> None:
    config = _config(2)
    world = MoeWorld(0, 2)
    try:
        moes = world.layer(config)
        m = moes[0]
        for call in (
            lambda: m.dispatch_recv(0.1),
            lambda: m.combine_send(torch.empty(0, 24)),
            m.combine_recv,
        ):
            with pytest.raises(MoeStateError):
                call()
        inputs = random_inputs(config, 1, [3, 2])
        m.dispatch_send(inputs.xs[0], inputs.idxs[0], inputs.ws[0])
        with pytest.raises(MoeStateError):
            m.dispatch_send(inputs.xs[0], inputs.idxs[0], inputs.ws[0])
        # the refused calls did not break the instance: the step completes exactly
        moes[1].dispatch_send(inputs.xs[1], inputs.idxs[1], inputs.ws[1])
        res = unwrap(parallel(lambda r: moes[r].dispatch_recv(T), 2))
        with pytest.raises(MoeStateError):
            m.combine_send(torch.zeros(res[0].num_rows + 1, 24, dtype=torch.bfloat16))

        def combine(r: int) -> torch.Tensor:
            moes[r].combine_send(apply_experts(res[r], expert_fn))
            return moes[r].combine_recv(T)

        outs = unwrap(parallel(combine, 2))
        want = reference_moe(config, inputs.xs, inputs.idxs, inputs.ws, expert_fn)
        for r in range(2):
            assert_same_output(outs[r], want[r], r)
    finally:
        world.close()


BadInput = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
]
BAD_INPUTS: dict[str, BadInput] = {
    "duplicate-expert": lambda x, i, w: (x, torch.tensor([[1, 1, 2, 3]] * x.shape[0]), w),
    "expert-out-of-range": lambda x, i, w: (x, i.fill_(4), w),
    "expert-below-minus-one": lambda x, i, w: (x, i.fill_(-2), w),
    "wrong-dtype": lambda x, i, w: (x.float(), i, w),
    "too-many-tokens": lambda x, i, w: (torch.zeros(9, 24, dtype=torch.bfloat16), torch.zeros(9, 4), w),
    "wrong-hidden": lambda x, i, w: (x[:, :8], i, w),
    "float-indices": lambda x, i, w: (x, i.float(), w),
    "int-weights": lambda x, i, w: (x, i, w.long()),
    "weights-shape": lambda x, i, w: (x, i, w[:, :2]),
}


@pytest.mark.parametrize("bad", list(BAD_INPUTS))
def test_bad_inputs_raise_config_error_and_post_nothing(bad: str) -> None:
    config = _config(2)
    world = MoeWorld(0, 2)
    try:
        moes = world.layer(config)
        inputs = random_inputs(config, 0, [4, 4])
        submitted = world.engines[0].stats().submitted
        with pytest.raises(ConfigError):
            moes[0].dispatch_send(*BAD_INPUTS[bad](inputs.xs[0], inputs.idxs[0].clone(), inputs.ws[0]))
        assert world.engines[0].stats().submitted == submitted
        _run_and_check(world, moes, config, inputs)  # still usable
    finally:
        world.close()


def test_connect_checks_every_endpoint() -> None:
    config = _config(2)
    world = MoeWorld(0, 2)
    try:
        a = MoeAllToAll(world.engines[0], config.for_rank(0))
        b = MoeAllToAll(world.engines[1], config.for_rank(1))
        other = MoeAllToAll(world.engines[1], _config(2, hidden=32).for_rank(1), layer=5)
        world.apps += [a, b, other]
        with pytest.raises(MoeStateError):
            a.dispatch_send(torch.empty(0, 24, dtype=torch.bfloat16), torch.empty(0, 4), torch.empty(0, 4))
        for eps in (
            [b.endpoint, a.endpoint],
            [a.endpoint],
            [a.endpoint, other.endpoint],
            [b.endpoint, b.endpoint],
        ):
            with pytest.raises(ConfigError):
                a.connect(eps)
        with pytest.raises(ConfigError):  # one layer id per engine while the instance lives
            MoeAllToAll(world.engines[0], config.for_rank(0))
        a.connect([a.endpoint, b.endpoint.to_bytes()])
        with pytest.raises(MoeStateError):
            a.connect([a.endpoint, b.endpoint])
    finally:
        world.close()


def test_nic_count_mismatch_is_refused() -> None:
    config = _config(2)
    fabric_world = MoeWorld(0, 1, nics=2)
    try:
        odd = fabric_world.fabric.open_engine(1)
        fabric_world.engines.append(odd)
        a = MoeAllToAll(fabric_world.engines[0], config.for_rank(0))
        b = MoeAllToAll(odd, config.for_rank(1))
        fabric_world.apps += [a, b]
        with pytest.raises(ConfigError, match="NICs"):
            a.connect([a.endpoint, b.endpoint])
    finally:
        fabric_world.close()


def test_close_frees_the_layer_id_and_the_registrations() -> None:
    config = _config(2)
    world = MoeWorld(0, 2)
    try:
        regs = world.engines[0].stats().registrations
        with MoeAllToAll(world.engines[0], config.for_rank(0)) as m:
            assert world.engines[0].stats().registrations == regs + 6
        assert world.engines[0].stats().registrations == regs
        with pytest.raises(MoeStateError):
            m.connect([])
        MoeAllToAll(world.engines[0], config.for_rank(0)).close()  # the id is free again
    finally:
        world.close()


def test_expert_output_buffer_is_sent_without_a_copy() -> None:
    config = _config(2)
    world = MoeWorld(1, 2)
    try:
        moes = world.layer(config)
        inputs = random_inputs(config, 1, [5, 7])

        def run(r: int) -> torch.Tensor:
            m = moes[r]
            m.dispatch_send(inputs.xs[r], inputs.idxs[r], inputs.ws[r])
            res = m.dispatch_recv(T)
            buf = m.expert_output_buffer(res.num_rows)
            buf.copy_(apply_experts(res, expert_fn))
            m.combine_send(buf)
            return m.combine_recv(T)

        outs = unwrap(parallel(run, 2))
        want = reference_moe(config, inputs.xs, inputs.idxs, inputs.ws, expert_fn)
        for r in range(2):
            assert_same_output(outs[r], want[r], r)
        with pytest.raises(ConfigError):
            moes[0].expert_output_buffer(config.max_pairs + 1)
    finally:
        world.close()


def test_connect_through_a_torch_store() -> None:
    """Endpoints exchanged once through a torch.distributed store (``fabric_core.Rendezvous``)."""
    from torch.distributed import HashStore  # type: ignore[attr-defined]

    config = _config(3)
    world = MoeWorld(6, 3)
    try:
        moes = [MoeAllToAll(e, config.for_rank(r), timeout=T) for r, e in enumerate(world.engines)]
        world.apps += moes
        store: Any = HashStore()
        unwrap(
            parallel(
                lambda r: moes[r].connect_rendezvous(Rendezvous(store, rank=r, world_size=3, timeout=T)), 3
            )
        )
        with pytest.raises(ConfigError):
            moes[0].connect_rendezvous(Rendezvous(store, rank=1, world_size=3))
        _run_and_check(world, moes, config, random_inputs(config, 6))
    finally:
        world.close()
