"""The apps with their buffers in GPU memory, on fabric-efa over shm (CUDA IPC), checked bit for
bit against their references. Two engines in one process, one thread per rank; skipped
without a GPU (tests/gpu/conftest.py) or without fabric-efa."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from fabric_core import open_engine
from fabric_core.testing.ranks import run_ranks, unwrap_ranks

torch: Any = pytest.importorskip("torch")
pytest.importorskip("fabric_efa")

from fabric_apps.moe import MoeAllToAll, MoeConfig, apply_experts, reference_moe  # noqa: E402


@pytest.fixture
def engines() -> Iterator[list[Any]]:
    es = [open_engine("efa", efa_provider="shm") for _ in range(2)]
    if not all(e.capabilities.cuda_memory for e in es):
        for e in es:
            e.close()
        pytest.skip("efa shm carries no CUDA memory here")
    yield es
    for e in es:
        e.close()


def _expert(expert: int, rows: Any) -> Any:
    return (rows.to(torch.float32) * (1.0 + expert / 8.0) + expert / 16.0 - 0.5).to(rows.dtype)


@pytest.mark.parametrize("tokens", [128, 1024])
def test_moe_ep2_with_gpu_buffers_matches_the_reference_bit_for_bit(engines: list[Any], tokens: int) -> None:
    config = MoeConfig(
        world_size=2, rank=0, num_experts=16, hidden=1024, top_k=4, max_tokens=tokens, device="cuda"
    )
    moes = [MoeAllToAll(e, config.for_rank(r)) for r, e in enumerate(engines)]
    endpoints = [m.endpoint.to_bytes() for m in moes]
    for m in moes:
        m.connect(endpoints)
    g = torch.Generator().manual_seed(tokens)
    xs = [torch.randn(tokens, config.hidden, generator=g).to(config.dtype) for _ in range(2)]
    idxs = [torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(tokens)]) for _ in range(2)]
    ws = [torch.randn(tokens, 4, generator=g) for _ in range(2)]
    want = reference_moe(config, xs, idxs, ws, _expert)

    def step(r: int) -> Any:
        m = moes[r]
        outs = []
        for _ in range(3):  # three steps on the same buffers: both step parities, and a reuse
            m.dispatch_send(xs[r].cuda(), idxs[r].cuda(), ws[r].cuda())
            m.combine_send(apply_experts(m.dispatch_recv(), _expert))
            outs.append(m.combine_recv().cpu())
        return outs

    got = unwrap_ranks(run_ranks(step, 2, 60.0))
    for r in range(2):
        for out in got[r]:
            assert out.dtype == want[r].dtype and out.shape == want[r].shape
            assert torch.equal(out.view(torch.uint8), want[r].view(torch.uint8)), f"rank {r}: bytes differ"
    for m in moes:
        m.close()


def test_kvcache_pages_land_exactly_between_gpu_caches(engines: list[Any]) -> None:
    from fabric_apps.kvcache import KvDecoder, KvLayout, KvPrefiller

    layout = KvLayout(4, 64, 16, 8, 128, "bfloat16", "stacked")  # Llama-70B pages, 4 layers
    shape = layout.accepted_shapes()[0]
    g = torch.Generator(device="cuda").manual_seed(3)
    pcaches = [
        torch.randint(0, 1 << 16, shape, dtype=torch.int32, device="cuda", generator=g)
        .to(torch.int16)
        .view(torch.bfloat16)
        for _ in range(layout.num_layers)
    ]
    dcaches = [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in range(layout.num_layers)]
    torch.cuda.synchronize()
    dec = KvDecoder(engines[0], layout, dcaches, timeout=30)
    pf = KvPrefiller(engines[1], layout, pcaches, timeout=30)
    dec.connect(pf.address, timeout=30)
    src = torch.randperm(64, generator=torch.Generator().manual_seed(4))[:23].numpy()
    h = dec.receive(pf.address, "seq0", 23)
    job = pf.begin(pf.next_request(30), src, timeout=30)
    for layer in range(layout.num_layers):
        job.write_layer(layer)
    h.wait(30)
    job.wait(30)
    pages = torch.as_tensor(h.pages, dtype=torch.int64, device="cuda")
    srcs = torch.as_tensor(src, dtype=torch.int64, device="cuda")
    for layer in range(layout.num_layers):
        got, want = dcaches[layer][:, pages], pcaches[layer][:, srcs]
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"layer {layer}"
        rest = dcaches[layer].clone()
        rest[:, pages] = 0
        assert int(rest.view(torch.int16).count_nonzero()) == 0, f"layer {layer}: bytes outside the pages"
    h.release()
    dec.allocator.check_no_leaks()
    pf.close(timeout=5)
    dec.close(timeout=5)
